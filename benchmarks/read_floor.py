"""Where the steady-state GetMetricData bill comes from: the metrics the sweep still reads in the steady hour
(after the first look and the reaping), by what the machine is, the state it is in and the metric, each with
its share of the bill per machine-month. The real run_sweep over benchmarks/sweep_cost.py's fleet.

    python benchmarks/read_floor.py [--size 2000]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import sweep_cost  # noqa: E402

from idle_reaper.notify import LoggingNotifier  # noqa: E402
from idle_reaper.policy import DEFAULT_GPU_FAMILIES  # noqa: E402
from idle_reaper.sweep import logger, run_sweep  # noqa: E402
from testkit.aws import CountingStateStore  # noqa: E402

GMD_PER_METRIC = 0.01 / 1000
SWEEPS_PER_MONTH = 30 * 24 * 60 // 5


def kinds_of(size: int, seed: int, ids: list[str]) -> dict[str, str]:
    """Each machine's kind in sweep_cost.MIX, as build_fleet drew them (the same generator, in launch order)."""
    rng = random.Random(seed)
    counts = {kind: int(share * size) for kind, share, _ in sweep_cost.MIX}
    counts["gpu-training"] += size - sum(counts.values())
    plan = [kind for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(plan)
    return dict(zip(sorted(ids), plan, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    handler = logger.registered_handler
    if isinstance(handler, logging.StreamHandler):
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115
    bench = sweep_cost.build_fleet(args.size, args.seed)
    aws = bench.aws
    kind = kinds_of(args.size, args.seed, list(aws.ec2.instances))
    itype = {i: inst.instance_type for i, inst in aws.ec2.instances.items()}
    adapters = aws.adapters(
        store=CountingStateStore(), notifier=LoggingNotifier(logger, delivers=True), prefix="/idle-reaper"
    )
    for minutes in (0, 5, 30):
        run_sweep(adapters, now=sweep_cost.T0 + timedelta(minutes=minutes))
    first = len(aws.cloudwatch.requests)
    state: dict[str, str] = {}
    hour = range(35, 95, 5)
    for minutes in hour:
        for d in run_sweep(adapters, now=sweep_cost.T0 + timedelta(minutes=minutes)).decisions:
            if d.read:
                state[d.machine.instance_id] = d.state.value
    reads: Counter[tuple[str, str]] = Counter()
    metrics: Counter[str] = Counter()
    no_gpu = 0
    for operation, request in aws.cloudwatch.requests[first:]:
        if operation != "GetMetricData":
            continue
        for query in request["MetricDataQueries"]:
            stat = query["MetricStat"]
            instance_id = stat["Metric"]["Dimensions"][0]["Value"]
            reads[(kind[instance_id], state.get(instance_id, "?"))] += 1
            metrics[stat["Metric"]["MetricName"]] += 1
            family = itype[instance_id].split(".")[0]
            if stat["Metric"]["MetricName"] == "nvidia_smi_utilization_gpu" and family not in DEFAULT_GPU_FAMILIES:
                no_gpu += 1
    sweeps, size = len(hour), args.size
    total = sum(reads.values())

    def dollars(n: int) -> float:
        return n / sweeps * SWEEPS_PER_MONTH * GMD_PER_METRIC / size

    per_machine = total / sweeps / size
    print(f"Metrics read a sweep in the steady hour at {size:,} machines: {total / sweeps:,.0f}")
    print(f"  {per_machine:.2f} per machine = ${dollars(total):.3f} per machine-month of GetMetricData")
    print(f"  {'machine (sweep_cost.MIX) and its state':<44}{'a sweep':>10}{'share':>8}{'$/machine-month':>17}")
    for (what, st), n in reads.most_common():
        print(f"  {what + ' / ' + st:<44}{n / sweeps:>10,.0f}{n / total:>8.0%}{dollars(n):>17.4f}")
    print("  by metric: " + ", ".join(f"{m} {n / total:.0%}" for m, n in metrics.most_common()))
    print(
        f"  GPU queries for instance types outside the GPU families: {no_gpu / total:.0%} of reads"
        f" (${dollars(no_gpu):.4f} per machine-month)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
