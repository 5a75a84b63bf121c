"""Reading only when due changes no warning and no stop: every trace replayed twice through the real core,
reading every machine at every sweep and reading only when due (core/reading.py), with the reads each made.

Exits 1 when any trace's stops, warnings or outcome figures differ between the two.

    python benchmarks/read_when_due.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from idle_reaper_tools.replay import PolicySet, ReplayOptions, read_trace, replay

ROOT = Path(__file__).resolve().parents[1]
TRACES = [
    *(sorted((ROOT / "tests" / "data").glob("*.csv"))),
    ROOT / "testkit" / "sample-trace.csv.gz",
    ROOT / "testkit" / "sample-trace-people.csv.gz",
    ROOT.parent / "shared" / "traces" / "nab-ec2-cpu.csv",
    ROOT.parent / "shared" / "traces" / "bitbrains-rnd-2013-07-100vms.csv.gz",
]


def compare(path: Path) -> dict[str, Any]:
    bitbrains = "bitbrains" in path.name
    trace = read_trace(path, clamp_utilization=bitbrains, skip_duplicates=bitbrains)
    runs = {}
    for when in (False, True):
        started = time.perf_counter()
        result = replay(trace, ReplayOptions(policies=PolicySet(), fast_path=False, read_when_due=when))
        runs[when] = (result, time.perf_counter() - started)
    (every, every_s), (due, due_s) = runs[False], runs[True]
    strip = lambda s: {k: v for k, v in s.items() if k != "core_calls"}  # noqa: E731
    same = every.reaper.stops == due.reaper.stops and strip(every.reaper.summary()) == strip(due.reaper.summary())
    return {
        "trace": path.name,
        "machines": len(trace.series),
        "same_stops_and_warnings": same,
        "stops": every.reaper.summary()["stops"],
        "warnings": every.reaper.summary()["warnings"],
        "reads_every_sweep": every.reaper.fleet.core_calls,
        "reads_when_due": due.reaper.fleet.core_calls,
        "read_share": due.reaper.fleet.core_calls / max(1, every.reaper.fleet.core_calls),
        "seconds": [round(every_s, 1), round(due_s, 1)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [compare(p) for p in TRACES if p.exists()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'trace':40} {'machines':>8} {'stops':>6} {'warnings':>8} {'reads/sweep':>12} {'same':>5}")
        for r in rows:
            print(
                f"{r['trace']:40} {r['machines']:>8,} {r['stops']:>6,} {r['warnings']:>8,} "
                f"{r['read_share']:>11.1%} {'yes' if r['same_stops_and_warnings'] else 'NO':>5}"
            )
    return 0 if all(r["same_stops_and_warnings"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
