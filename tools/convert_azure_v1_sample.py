"""Convert a public sample of the Azure Public Dataset V1 (2017 VM CPU readings) into the replay format.

The source: `data/microsoft_avg_100.rda` of the R package DataCenterSim (github.com/carlonlv/DataCenterSim,
commit fa2cc2592969c40d3e8494c2be46a94641b235f1), a data frame of 8,004 rows x 100 columns: one column per
Azure VM (its renumbered id), one row per 5-minute reading, the VM's *average* CPU utilization (percent) in
those 5 minutes, about 27.8 days. The readings are Microsoft's, from the Azure Public Dataset V1
(github.com/Azure/AzurePublicDataset, AzurePublicDatasetV1.md), published under the Creative Commons
Attribution 4.0 International licence, which allows redistribution with attribution (tests/data/README.md).

What the conversion does, and nothing else:
- one row per (reading, VM): `timestamp, instance_id, cpu`; instance_id `az-<column name>`; cpu rounded to
  0.1 (the replay's thresholds are whole percents);
- the average per 5 minutes is kept, not the maximum: it is what CloudWatch's CPUUtilization datapoint of a
  machine on basic monitoring is (a 5-minute average), which is what the sweep reads;
- timestamps: the sample holds no clock, only row numbers (the dataset's own timestamps are seconds from the
  start of its 30 days, and the sample's rows may not start at 0). Row 1 is put at ANCHOR, a Monday 00:00
  UTC, and each row 5 minutes after the one before. So **hours of day and weekdays are relative**: a VM's
  own daily rhythm is kept (24 h apart stays 24 h apart), but "10:00 UTC" or "Saturday" mean nothing real,
  and the VMs' clocks may not even be aligned with each other (their cross-correlation does not peak at lag
  0). Waiting that learns from a machine's own past is judged fairly; a fleet-wide clock is not.

    uv run --with rdata python tools/convert_azure_v1_sample.py microsoft_avg_100.rda \\
        tests/data/azure-v1-100vms.csv.gz
"""

from __future__ import annotations

import argparse
import gzip
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

ANCHOR = datetime(2017, 1, 2, tzinfo=UTC)  # a Monday; arbitrary (see the docstring)
PERIOD = timedelta(minutes=5)


def convert(source: Path, out: Path, name: str = "microsoft_avg_100") -> tuple[int, int]:
    import rdata  # type: ignore[import-not-found]  # only for this one-off conversion: `uv run --with rdata`

    frame = rdata.read_rda(str(source))[name]
    values = frame.values
    ids = [f"az-{c}" for c in frame.coords[frame.dims[1]].values]
    rows = 0
    with gzip.open(out, "wt", newline="", compresslevel=9) as f:
        f.write("timestamp,instance_id,cpu\n")
        for i in range(values.shape[0]):
            stamp = (ANCHOR + i * PERIOD).strftime("%Y-%m-%dT%H:%M:%SZ")
            for j, vm in enumerate(ids):
                cpu = float(values[i, j])
                if cpu != cpu:  # NaN: no reading; the replay sees a hole
                    continue
                f.write(f"{stamp},{vm},{min(100.0, max(0.0, round(cpu, 1))):g}\n")
                rows += 1
    return rows, len(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="microsoft_avg_100.rda")
    parser.add_argument("out", type=Path, help="the replay trace to write (.csv.gz)")
    args = parser.parse_args(argv)
    rows, machines = convert(args.source, args.out)
    print(f"{rows} rows, {machines} machines -> {args.out} ({args.out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
