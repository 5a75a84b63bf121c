"""Where a sweep's time goes at fleet scale: the real `run_sweep` over the counting fakes, every AWS call
charged its in-region latency (testkit/fake_aws.py LATENCY, as issue 13 states them).

The projection models what the code really overlaps: the sweep's thread pools (aws.run_concurrently) are
replaced by a scheduler that puts each task on the virtual lane that frees first, so a pool of N threads
overlaps at most N calls, and calls made one after another add up. Modelled wall = modelled latency + the
code's own CPU time (measured, serial as under the GIL). `--check SIZE` runs the same sweeps with every
latency really slept on real thread pools and compares the measured wall with the model (within 20 %).

For each fleet size and for the first-look, steady and reaping sweeps (benchmarks/sweep_cost.py's fleet;
sweeps at +0, +5 and +30 min) it prints calls by operation (DynamoDB included), the latency each operation charged,
total wall, the longest single invocation and its share of the sweep Lambda's timeout, and the invocations
used. Then the reaper's own monthly AWS bill at 10,000 machines and 5-minute sweeps.

    python benchmarks/sweep_latency.py [--sizes 1000,10000,50000] [--check 2000]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "INFO")

from sweep_cost import PREFIX, T0, build_fleet  # noqa: E402

from idle_reaper import sweep as sweep_module  # noqa: E402
from idle_reaper.aws import Fleet, MetricsReader, PolicyStore  # noqa: E402
from idle_reaper.notify import LoggingNotifier  # noqa: E402
from idle_reaper.sweep import Adapters, run_sweep  # noqa: E402
from testkit.fake_aws import CountingStateStore, LatencyModel  # noqa: E402

# First look; the steady sweep 5 minutes later (the stack's default schedule: what most sweeps are);
# reaping when the first look's warnings fall due.
SWEEPS = (T0, T0 + timedelta(minutes=5), T0 + timedelta(minutes=30))
SWEEP_TIMEOUT_S = 240.0  # the stack's sweep Lambda at the default 5-minute schedule (schedule - 1 min)
LABELS = ("#1 first", "#2 steady", "#3 reaping")
TARGETS = {50_000: 60.0, 200_000: 120.0}
DDB_OPS = ("PutItem", "BatchGetItem", "BatchWriteItem", "GetItem", "DeleteItem", "Query")


class CountingStream:
    """Where the sweep's log lines go: counted (what CloudWatch Logs would ingest), not kept."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, text: str) -> int:
        self.bytes += len(text.encode())
        return len(text)

    def flush(self) -> None:
        pass


LOG = CountingStream()


@dataclass
class Measured:
    calls: Counter[str]
    charged_s: dict[str, float]  # latency each operation charged, summed over its calls (serial cost)
    wall_s: float  # modelled (or, when slept, measured) wall of the sweep
    cpu_s: float  # the code's own time (wall minus latency and minus the fakes' time)
    invocations: int
    longest_s: float
    machines: int
    state_writes: int
    metrics_requested: int = 0
    records_read: int = 0
    log_bytes: int = 0


def run_size(size: int, seed: int, *, sleep: bool) -> list[Measured]:
    bench = build_fleet(size, seed)
    aws = bench.aws
    model = LatencyModel(sleep=sleep)
    aws.set_latency(model)
    store = CountingStateStore(model)
    notifier = LoggingNotifier(sweep_module.logger, delivers=True)
    model.install()
    results = []
    try:
        for now in SWEEPS:
            charged_before, virtual_before, fake_before = Counter(model.charged), model.virtual, aws.seconds()
            requested_before, log_before = aws.cloudwatch.metrics_requested, LOG.bytes
            adapters = Adapters(
                policies=PolicyStore(aws.ssm, PREFIX),
                fleet=Fleet(aws.ec2, aws.autoscaling),
                metrics=MetricsReader(aws.cloudwatch),
                store=store,
                notifier=notifier,
            )
            started, cpu_started = time.perf_counter(), time.process_time()
            run_sweep(adapters, now=now)
            real, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            fake = aws.seconds() - fake_before
            charged = model.charged - charged_before
            latency = model.virtual - virtual_before
            # Modelled: one thread does all the work, so its CPU time (minus the fakes') is the code's own.
            own = cpu - fake
            wall = real - fake if sleep else latency + own
            calls = Counter({op: n for op, n in charged.items()})
            results.append(
                Measured(
                    calls=calls,
                    charged_s={op: n * model.latency.get(op, 0.0) for op, n in charged.items()},
                    wall_s=wall,
                    cpu_s=own,
                    invocations=1,
                    longest_s=wall,
                    machines=size,
                    state_writes=charged["dynamodb:PutItem"],
                    metrics_requested=aws.cloudwatch.metrics_requested - requested_before,
                    records_read=len(store.records),
                    log_bytes=LOG.bytes - log_before,
                )
            )
    finally:
        model.uninstall()
    return results


WIDTH = 52


def row(label: str, values: Sequence[float], spec: str = ",.0f", suffix: str = "") -> None:
    width = 12 - len(suffix)
    print(f"  {label:<{WIDTH}}" + "".join(f"{v:>{width}{spec}}{suffix}" for v in values))


def print_size(size: int, results: list[Measured]) -> bool:
    ok = True
    print(f"\n== {size:,} machines ==")
    print(f"  {'calls per sweep':<{WIDTH}}" + "".join(f"{h:>12}" for h in LABELS))
    for op in sorted(set().union(*(r.calls for r in results))):
        row(op, [r.calls[op] for r in results])
    row("total calls", [sum(r.calls.values()) for r in results])
    print(f"  {'latency charged, seconds if made one by one':<{WIDTH}}")
    for op in sorted(set().union(*(r.charged_s for r in results)), key=lambda o: -results[0].charged_s.get(o, 0)):
        if max(r.charged_s.get(op, 0.0) for r in results) >= 0.05:
            row(f"  {op}", [r.charged_s.get(op, 0.0) for r in results], ",.1f")
    row("  sum: the sweep with no overlap, s", [sum(r.charged_s.values()) for r in results], ",.1f")
    row("code's own CPU (this machine), s", [r.cpu_s for r in results], ",.1f")
    row("modelled wall, s", [r.wall_s for r in results], ",.1f")
    row("invocations", [r.invocations for r in results])
    row("longest invocation, s", [r.longest_s for r in results], ",.1f")
    row("  share of its timeout", [100 * r.longest_s / SWEEP_TIMEOUT_S for r in results], ",.0f", "%")
    row(
        "DynamoDB writes (state + audit), % of machines",
        [100 * r.state_writes / r.machines for r in results],
        ",.1f",
        "%",
    )
    gmd = [r.calls["cloudwatch:GetMetricData"] for r in results]
    row("GetMetricData calls", gmd)
    target = TARGETS.get(size)
    for label, r in zip(LABELS, results, strict=True):
        if target is not None and r.wall_s > target:
            ok = False
            print(f"  MISSED sweep {label}: {r.wall_s:.1f} s > {target:.0f} s")
        if r.longest_s > SWEEP_TIMEOUT_S / 2:
            ok = False
            print(f"  MISSED sweep {label}: an invocation uses {r.longest_s / SWEEP_TIMEOUT_S:.0%} of its timeout")
    if results[1].state_writes > 0.10 * size:
        ok = False
        print(f"  MISSED steady state: {results[1].state_writes:,} writes > 10 % of {size:,} machines")
    return ok


# us-east-1 list prices, November 2026.
GMD_PER_1000_METRICS = 0.01
DDB_PER_MILLION_WRITES = 0.625  # on-demand write request units (an item up to 1 KB; records are ~1-2 KB: 2 each)
DDB_PER_MILLION_READS = 0.125  # on-demand read request units (BatchGetItem reads eventually consistent: 1/2)
LAMBDA_PER_GB_SECOND = 0.0000133334  # arm64
LAMBDA_PER_MILLION_REQUESTS = 0.20
LOGS_PER_GB = 0.50
LAMBDA_GB = 0.5  # the stack's sweep function
BILL_FLEET = 10_000
SWEEPS_PER_MONTH = 30 * 24 * 60 // 5


def print_bill(steady: Measured) -> bool:
    """The reaper's own monthly bill at 10,000 machines, 5-minute sweeps (every sweep priced as the steady
    one, which most sweeps are), next to what the replay of the shipped sample trace saves at that size."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import savings  # the replay benchmark: the real core over the sample trace

    n = SWEEPS_PER_MONTH
    bill = {
        "CloudWatch GetMetricData": steady.metrics_requested * n / 1000 * GMD_PER_1000_METRICS,
        "DynamoDB writes": steady.state_writes * 2 * n / 1e6 * DDB_PER_MILLION_WRITES,
        "DynamoDB reads": steady.records_read * 0.5 * n / 1e6 * DDB_PER_MILLION_READS,
        "Lambda": steady.wall_s * LAMBDA_GB * n * LAMBDA_PER_GB_SECOND + n / 1e6 * LAMBDA_PER_MILLION_REQUESTS,
        "Step Functions / SQS (one invocation suffices)": 0.0,
        "CloudWatch Logs": steady.log_bytes * n / 1e9 * LOGS_PER_GB,
    }
    replay = savings.compare(savings.SAMPLE)
    per_machine_day = replay["dollars_saved"] / replay["machine_days"]
    saved = per_machine_day * BILL_FLEET * 30
    total = sum(bill.values())
    print(f"\n== the reaper's own bill at {BILL_FLEET:,} machines, a sweep every 5 min ({n:,} sweeps a month) ==")
    for item, dollars in bill.items():
        print(f"  {item:<{WIDTH}}{dollars:>12,.2f} $/month")
    print(f"  {'total':<{WIDTH}}{total:>12,.2f} $/month")
    print(
        f"  savings the replay reports: ${replay['dollars_saved']:,.0f} over {replay['machine_days']:,.0f} machine-days"
        f" of the sample trace = ${per_machine_day:,.2f} a machine-day -> ${saved:,.0f} a month at {BILL_FLEET:,}"
    )
    share = total / saved
    print(f"  the reaper costs {share:.3%} of what it saves (target: under 1 %)")
    return share < 0.01


def check(size: int, seed: int) -> bool:
    """The model against a run that really sleeps every latency on real thread pools."""
    modelled = run_size(size, seed, sleep=False)
    slept = run_size(size, seed, sleep=True)
    print(f"\n== check at {size:,} machines: modelled wall against a run that really sleeps each latency ==")
    print(f"  {'':<{WIDTH}}" + "".join(f"{h:>12}" for h in LABELS))
    row("modelled, s", [r.wall_s for r in modelled], ",.2f")
    row("slept on real threads, s", [r.wall_s for r in slept], ",.2f")
    ratios = [m.wall_s / s.wall_s for m, s in zip(modelled, slept, strict=True)]
    row("modelled / slept", [100 * x for x in ratios], ",.0f", "%")
    ok = all(0.8 <= x <= 1.2 for x in ratios)
    print("  OK: within 20 %" if ok else "  FAIL: the model is more than 20 % off")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,50000", help="comma-separated fleet sizes")
    parser.add_argument("--check", type=int, default=2000, help="fleet size of the slept check (0: skip)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    handler = sweep_module.logger.registered_handler
    if isinstance(handler, logging.StreamHandler):
        handler.setStream(LOG)  # type: ignore[arg-type]

    print("idle-reaper sweep latency model: the real run_sweep over counting fakes, every call charged its latency")
    ok = True
    measured = {}
    for size in [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]:
        measured[size] = run_size(size, args.seed, sleep=False)
        ok = print_size(size, measured[size]) and ok
    if BILL_FLEET in measured:
        ok = print_bill(measured[BILL_FLEET][1]) and ok
    if args.check:
        ok = check(args.check, args.seed) and ok
    print("\nOK: every target met" if ok else "\nMISSED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
