"""What one sweep costs: API calls per operation, GetMetricData packing, the core's CPU time, wall time.

Runs the REAL `run_sweep` with the REAL adapters (PolicyStore, Fleet, MetricsReader) over counting
in-memory fakes of the boto3 clients (testkit/aws/; moto is far too slow at this scale),
for a realistic ML fleet, three sweeps 15 minutes apart:

    #1 first look   warnings for long-idle machines, scale-in protection for busy ASG members
    #2 steady state nothing is due: the sweep most runs are
    #3 reaping      warned machines are stopped, hibernated, released to or terminated in their group

Exits non-zero when a sweep's GetMetricData call count differs from ceil(metrics x machines / 500).

    python benchmarks/sweep_cost.py [--sizes 1000,10000,50000]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "INFO")  # what the Lambda logs; the stream goes to /dev/null

from idle_reaper import sweep as sweep_module  # noqa: E402
from idle_reaper.aws import Fleet, MetricsReader, PolicyStore  # noqa: E402
from idle_reaper.core import Action, Machine, MachineRecord, Signals, assess, decide  # noqa: E402
from idle_reaper.notify import LoggingNotifier  # noqa: E402
from idle_reaper.policy import MetricSettings, Settings, TagKeys  # noqa: E402
from idle_reaper.sweep import Adapters, SweepReport, run_sweep  # noqa: E402
from testkit.aws import CountingStateStore, FakeAws, quiet_after, steady  # noqa: E402

T0 = datetime(2026, 11, 20, 14, 0, tzinfo=UTC)
SWEEPS = (T0, T0 + timedelta(minutes=15), T0 + timedelta(minutes=30))
LONG_AGO = T0 - timedelta(days=2)
QUERIES_PER_CALL = 500
GROUP_SIZE = 25
PREFIX = "/idle-reaper"

TEAM_POLICIES = {
    "ml": {"idle_minutes": 90, "warn_minutes": 30},
    "cv": {"idle_minutes": 120, "warn_minutes": 30, "action": "hibernate"},
    "nlp": {"idle_minutes": 60, "warn_minutes": 20, "action": "notify_only"},
    "platform": {"asg_action": "terminate"},
    "research": {"idle_minutes": 5},  # invalid (15-1440): the team is in safe mode
    # "data" has no parameter: the default policy from settings
}

# (kind, share of the fleet, what it is)
MIX = (
    ("gpu-training", 0.25, "GPU training, 2.5% CPU / 92% GPU"),
    ("idle-notebook", 0.20, "notebook idle since 100 min before sweep #1"),
    ("asg-worker", 0.20, f"ASG workers in groups of {GROUP_SIZE}, half busy, half idle"),
    ("cpu-busy", 0.10, "busy CPU job, no GPU"),
    ("spiky", 0.07, "10 busy minutes every hour"),
    ("gpu-no-agent", 0.05, "GPU box without GPU metrics (unknown)"),
    ("exempt", 0.05, "idle, tagged exempt"),
    ("invalid-team", 0.05, "idle, team policy invalid"),
    ("young", 0.03, "idle, started 10 min before sweep #1"),
)

GPU_TYPES = ("g5.xlarge", "g5.12xlarge", "g6.xlarge", "p3.2xlarge", "p4d.24xlarge", "g4dn.12xlarge")
NOTEBOOK_TYPES = ("g4dn.xlarge", "g5.xlarge", "m5.xlarge", "r5.xlarge", "t3.large")
CPU_TYPES = ("m5.2xlarge", "c5.4xlarge", "c6i.4xlarge", "r6i.2xlarge")


def spiky(t: datetime) -> tuple[float, None]:
    return (60.0 if t.minute < 10 else 2.0), None


@dataclass
class BenchFleet:
    aws: FakeAws
    size: int
    kinds: Counter[str] = field(default_factory=Counter)


def build_fleet(size: int, seed: int) -> BenchFleet:
    rng = random.Random(seed)
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())
    for team, policy in TEAM_POLICIES.items():
        aws.ssm.store(f"{PREFIX}/teams/{team}", json.dumps(policy))
    counts = {kind: int(share * size) for kind, share, _ in MIX}
    counts["gpu-training"] += size - sum(counts.values())
    plan = [kind for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(plan)  # machines of every kind are spread over pages and metric batches
    fleet = BenchFleet(aws, size, Counter(plan))
    quiet_from = T0 - timedelta(minutes=100)
    group_index, group_fill, group, group_team = 0, GROUP_SIZE, "", ""
    for n, kind in enumerate(plan):
        owner = f"user{n % 500}@example.com"
        if kind == "gpu-training":
            aws.launch(
                rng.choice(GPU_TYPES),
                team=rng.choice(("ml", "cv", "data")),
                profile=steady(2.5, 92.0),
                launch_time=LONG_AGO,
                owner=owner,
            )
        elif kind == "idle-notebook":
            itype = rng.choice(NOTEBOOK_TYPES)
            gpu = itype.startswith(("g", "p"))
            team = rng.choice(("ml", "cv", "nlp"))
            aws.launch(
                itype,
                team=team,
                profile=quiet_after(quiet_from, (35.0, 60.0 if gpu else None), (0.8, 0.0 if gpu else None)),
                launch_time=LONG_AGO,
                owner=owner,
                hibernation=team == "cv" and rng.random() < 0.8,
            )
        elif kind == "asg-worker":
            if group_fill == GROUP_SIZE:
                group_index, group_fill = group_index + 1, 0
                group_team = "platform" if group_index % 2 else "data"
                group = f"workers-{group_index:04d}"
                aws.autoscaling.add_group(group, min_size=GROUP_SIZE - 5, max_size=GROUP_SIZE * 2)
            busy = group_fill % 2 == 0
            aws.launch(
                "c5.2xlarge",
                team=group_team,
                profile=steady(70.0 if busy else 1.0),
                launch_time=LONG_AGO,
                group=group,
                protected=not busy,  # busy members get protection at #1, idle ones lose it at #3
            )
            group_fill += 1
        elif kind == "cpu-busy":
            aws.launch(rng.choice(CPU_TYPES), team="data", profile=steady(55.0), launch_time=LONG_AGO, owner=owner)
        elif kind == "spiky":
            aws.launch("m5.xlarge", team=rng.choice(("ml", "data")), profile=spiky, launch_time=LONG_AGO, owner=owner)
        elif kind == "gpu-no-agent":
            aws.launch("g5.xlarge", team="ml", profile=steady(1.0), launch_time=LONG_AGO, owner=owner)
        elif kind == "exempt":
            until = "true" if n % 2 else (T0 + timedelta(days=3)).isoformat()
            aws.launch(
                "m5.large",
                team="ml",
                profile=steady(1.0),
                launch_time=LONG_AGO,
                owner=owner,
                tags={"idle-reaper:exempt": until},
            )
        elif kind == "invalid-team":
            aws.launch("m5.large", team="research", profile=steady(1.0), launch_time=LONG_AGO, owner=owner)
        elif kind == "young":
            aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=T0 - timedelta(minutes=10), owner=owner)
    # One in 50 hibernation-configured machines cannot hibernate right now: the adapter must fall back.
    configured = [i for i, inst in aws.ec2.instances.items() if inst.hibernation_configured]
    aws.ec2.unhibernatable.update(configured[::50])
    return fleet


# ---------------------------------------------------------------------------------------------
# Adapters that remember their inputs, so the core can be re-run (and timed) on exactly those.


class CapturingFleet(Fleet):
    machines: list[Machine]
    seconds = 0.0

    def discover(
        self, tags: TagKeys, *, notebooks: bool = True, endpoints: bool = True, studio: bool = False
    ) -> list[Machine]:
        started = time.perf_counter()
        self.machines = super().discover(tags, notebooks=notebooks, endpoints=endpoints, studio=studio)
        self.seconds = time.perf_counter() - started
        return self.machines


class CapturingMetrics(MetricsReader):
    signals: dict[str, Signals]
    instance_ids: list[str]
    metrics_per_machine = 0
    seconds = 0.0

    def fetch(
        self,
        instance_ids: Sequence[str],
        metrics: MetricSettings,
        *,
        start: datetime,
        end: datetime,
        network: bool = False,
    ) -> dict[str, Signals]:
        # A sweep may fetch in several groups (long windows, network teams): accumulate over them.
        started = time.perf_counter()
        per_machine = 5 if network else 3  # CPU, GPU, human activity (+ network in and out)
        self.instance_ids = [*getattr(self, "instance_ids", []), *instance_ids]
        self.metrics_requested = getattr(self, "metrics_requested", 0) + per_machine * len(instance_ids)
        self.expected_calls = getattr(self, "expected_calls", 0) + math.ceil(per_machine * len(instance_ids) / 500)
        self.metrics_per_machine = self.metrics_requested / max(1, len(self.instance_ids))
        fetched = super().fetch(instance_ids, metrics, start=start, end=end, network=network)
        self.signals = {**getattr(self, "signals", {}), **fetched}
        self.seconds = getattr(self, "seconds", 0.0) + time.perf_counter() - started
        return fetched


class CapturingStore(CountingStateStore):
    loaded: dict[str, MachineRecord]

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        self.loaded = super().load(instance_ids)
        return self.loaded


def core_cpu_seconds(
    report: SweepReport, fleet: CapturingFleet, metrics: CapturingMetrics, store: CapturingStore
) -> float:
    """assess + decide for every machine, on the inputs the sweep just used, timed alone."""
    settings = Settings()
    period = timedelta(seconds=settings.metrics.period_seconds)
    refs = {d.machine.instance_id: d.policy for d in report.decisions}
    signals = getattr(metrics, "signals", {})
    records = store.loaded
    started = time.process_time()
    for m in fleet.machines:
        ref = refs[m.instance_id]
        assert ref is not None
        assessment = None
        if ref.policy is not None and m.instance_id in signals:
            assessment = assess(
                m,
                signals[m.instance_id],
                ref.policy,
                now=report.now,
                period=period,
                gpu_families=settings.gpu_instance_families,
            )
        decide(m, ref, assessment, records.get(m.instance_id), now=report.now, dry_run=report.dry_run)
    return time.process_time() - started


# ---------------------------------------------------------------------------------------------


@dataclass
class SweepResult:
    calls: Counter[str]
    store: Counter[str]
    actions: Counter[str]
    errors: int
    queried: int
    metrics_per_machine: int
    metrics_requested: int
    expected_gmd: int
    core_cpu: float
    discover_s: float
    metrics_s: float
    wall: float
    fake_s: float
    savings_per_hour: float
    hibernated: int


def run_size(size: int, seed: int) -> tuple[list[SweepResult], BenchFleet, Counter[str]]:
    fleet = build_fleet(size, seed)
    aws = fleet.aws
    store = CapturingStore()
    notifier = LoggingNotifier(sweep_module.logger, delivers=True)  # as if Slack delivered every warning
    results = []
    for now in SWEEPS:
        calls_before, store_before = aws.calls(), Counter(store.counts)
        requested_before = aws.cloudwatch.metrics_requested
        hibernated_before = len(aws.ec2.hibernated)
        adapters = Adapters(
            policies=PolicyStore(aws.ssm, PREFIX),
            fleet=CapturingFleet(aws.ec2, aws.autoscaling),
            metrics=CapturingMetrics(aws.cloudwatch),
            store=store,
            notifier=notifier,
        )
        fake_before = aws.seconds()
        started = time.perf_counter()
        report = run_sweep(adapters, now=now)
        wall = time.perf_counter() - started
        fake_s = aws.seconds() - fake_before
        assert isinstance(adapters.fleet, CapturingFleet) and isinstance(adapters.metrics, CapturingMetrics)
        cpu = core_cpu_seconds(report, adapters.fleet, adapters.metrics, store)
        calls = aws.calls() - calls_before
        queried = len(getattr(adapters.metrics, "instance_ids", []))
        per_machine = adapters.metrics.metrics_per_machine or 2
        results.append(
            SweepResult(
                calls=calls,
                store=store.counts - store_before,
                actions=Counter(d.action_label for d in report.decisions if d.action is not Action.NONE),
                errors=len(report.errors),
                queried=queried,
                metrics_per_machine=per_machine,
                metrics_requested=aws.cloudwatch.metrics_requested - requested_before,
                expected_gmd=getattr(adapters.metrics, "expected_calls", 0),
                core_cpu=cpu,
                discover_s=adapters.fleet.seconds,
                metrics_s=adapters.metrics.seconds,
                wall=wall,
                fake_s=fake_s,
                savings_per_hour=sum(t.hourly_savings for t in report.summary.teams.values()),
                hibernated=len(aws.ec2.hibernated) - hibernated_before,
            )
        )
    return results, fleet, aws.errors()


def fmt(n: float) -> str:
    return f"{n:,.0f}" if n == int(n) else f"{n:,.2f}"


WIDTH = 60


def row(label: str, values: Sequence[float], spec: str = ",.0f", suffix: str = "") -> None:
    width = 12 - len(suffix)
    print(f"  {label:<{WIDTH}}" + "".join(f"{v:>{width}{spec}}{suffix}" for v in values))


def print_size(size: int, results: list[SweepResult], fleet: BenchFleet, api_errors: Counter[str]) -> bool:
    ok = True
    gmd = [r.calls["cloudwatch:GetMetricData"] for r in results]
    print(f"\n== {size:,} machines ==")
    print("  fleet: " + ", ".join(f"{fleet.kinds[kind]:,} {kind}" for kind, _, _ in MIX))
    print(f"  {'API calls per sweep':<{WIDTH}}" + "".join(f"{h:>12}" for h in ("#1 first", "#2 steady", "#3 reaping")))
    for op in sorted(set().union(*(r.calls for r in results))):
        row(op, [r.calls[op] for r in results])
    row("total AWS API calls", [sum(r.calls.values()) for r in results])
    print("  state table (in-memory twin), as DynamoDB requests:")
    for key in ("BatchGetItem", "PutItem", "ConditionalCheckFailed"):
        row(f"  {key}", [r.store[key] for r in results])
    print("  decisions with an action:")
    for action in sorted(set().union(*(r.actions for r in results))):
        row(f"  {action}", [r.actions[action] for r in results])
    row("  of the hibernations, really hibernated by EC2", [r.hibernated for r in results])
    row("  per-machine errors (reported, not raised)", [r.errors for r in results])
    row("machines queried for metrics", [r.queried for r in results])
    row("GetMetricData calls, measured", gmd)
    row("GetMetricData calls, ceil(metrics x machines / 500)", [r.expected_gmd for r in results])
    statistics = [r.metrics_per_machine * r.queried for r in results]
    row("per-machine GetMetricStatistics design, calls", statistics)
    row(
        "  ratio: GetMetricStatistics / GetMetricData calls",
        [s / g if g else 0 for s, g in zip(statistics, gmd, strict=True)],
        suffix="x",
    )
    row("metrics requested (what GetMetricData bills)", [r.metrics_requested for r in results])
    row("core CPU, assess+decide (second pass), ms", [r.core_cpu * 1000 for r in results])
    row("  per machine, microseconds", [r.core_cpu / fleet.size * 1e6 for r in results])
    row("sweep wall time, ms", [r.wall * 1000 for r in results])
    row("  of which inside the fakes (not our code), ms", [r.fake_s * 1000 for r in results])
    row("  discovery: DescribeInstances + ASG join, ms", [r.discover_s * 1000 for r in results])
    row("  signals: GetMetricData + parsing, ms", [r.metrics_s * 1000 for r in results])
    row("sweep wall time without the fakes, ms", [(r.wall - r.fake_s) * 1000 for r in results])
    row("estimated savings of the reaps, $/hour", [r.savings_per_hour for r in results], ",.2f")
    for i, r in enumerate(results, 1):
        measured = r.calls["cloudwatch:GetMetricData"]
        if measured != r.expected_gmd:
            ok = False
            print(f"  FAIL sweep #{i}: {measured} GetMetricData calls, expected {r.expected_gmd}")
    if api_errors:
        print("  API errors the fakes raised over the three sweeps (some are injected on purpose):")
        for key, n in sorted(api_errors.items()):
            note = "  <- the adapter broke an API limit" if "ValidationError" in key else ""
            print(f"    {key}: {n:,}{note}")
    return ok


def print_cost(all_results: dict[int, list[SweepResult]]) -> None:
    # Billing: $0.01 per 1,000 metrics requested (each query of each call, NextToken pages included).
    per_machine = max(
        (r.metrics_requested / r.queried for rs in all_results.values() for r in rs if r.queried), default=2.0
    )
    month_minutes = 30 * 24 * 60
    print("\nThe reaper's own CloudWatch GetMetricData cost per 1,000 machines queried")
    print(f"({per_machine:g} metrics requested per machine per sweep, $0.01 per 1,000 metrics, 30-day month):")
    for every in (5, 15):
        sweeps = month_minutes // every
        metrics = sweeps * per_machine * 1000
        dollars = metrics / 1000 * 0.01
        print(
            f"  sweep every {every:>2} min: {sweeps:,} sweeps x {per_machine * 1000:,.0f} metrics"
            f" = {metrics:,.0f} metrics -> ${dollars:,.2f} / month"
        )
    print(
        "  (GetMetricStatistics is billed per request at the same $0.01 per 1,000, so one call per machine per\n"
        "  metric costs the same dollars; batching wins on calls, latency and throttling, not on the bill.)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000", help="comma-separated fleet sizes (default 1000,10000)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    sizes = [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]

    # The sweep logs one JSON line per machine (as in Lambda); format them all, write them nowhere.
    handler = sweep_module.logger.registered_handler
    if isinstance(handler, logging.StreamHandler):
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115

    print("idle-reaper sweep cost: the real run_sweep and AWS adapters over counting in-memory fakes")
    print("(EC2, Auto Scaling, CloudWatch, SSM; the state table is the in-memory twin, its DynamoDB requests counted).")
    print("Three sweeps 15 min apart: #1 first look, #2 steady state, #3 reaping.")
    ok = True
    all_results = {}
    for size in sizes:
        started = time.perf_counter()
        results, fleet, api_errors = run_size(size, args.seed)
        all_results[size] = results
        ok = print_size(size, results, fleet, api_errors) and ok
        print(f"  (built and swept in {time.perf_counter() - started:.1f} s)")
    print_cost(all_results)
    if not ok:
        print("\nFAIL: GetMetricData calls differ from ceil(metrics x machines / 500)")
        return 1
    print("\nOK: every sweep made exactly ceil(metrics x machines / 500) GetMetricData calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
