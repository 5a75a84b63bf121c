"""Where a sweep's time goes at fleet scale: the real `run_sweep` over the counting fakes, every AWS call
charged its in-region latency (testkit/aws/ LATENCY, as issue 13 states them).

The projection models what the code really overlaps: the sweep's thread pools (aws.run_concurrently) are
replaced by a scheduler that puts each task on the virtual lane that frees first, so a pool of N threads
overlaps at most N calls, and calls made one after another add up. Modelled wall = modelled latency + the
code's own CPU time (measured, serial as under the GIL) + botocore's CPU for each request (serialise, sign,
parse: measured at start with real botocore against stubbed answers, benchmarks/botocore_cpu.py; serial
too, printed apart). `--check SIZE` runs the same sweeps with every latency really slept (and each
request's botocore CPU really burnt) on real thread pools and compares the measured wall with the model
(within 20 %). `--doctor-day` makes every sweep the day's first: the daily doctor runs as the handlers run it (in
place after the sweep; fanned out, the planner's part after it starts the execution, beside the Map, and the
GPU check in the shards and the gather step), its Slack calls not modelled (no token: the same in every place).

For each fleet size and for the first-look, steady and reaping sweeps (benchmarks/sweep_cost.py's fleet;
sweeps at +0, +5 and +30 min) it prints calls by operation (DynamoDB included), the latency each operation charged,
total wall, the longest single invocation and its share of the sweep Lambda's timeout, and the invocations
used; and the EC2 Describe* requests the account-region's bucket sees (planner and shards on one timeline, the
shards side by side as the Map runs them): the most in any second against EC2's 20 a second and 100 of burst, and
how low the bucket falls. The product's pacers (aws/limits.py) wait on the model's virtual clock. Then the
reaper's own monthly AWS bill at 10,000 machines and 5-minute sweeps.

    python benchmarks/sweep_latency.py [--sizes 1000,10000,50000,200000] [--check 2000]
"""

from __future__ import annotations

import argparse
import heapq
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "INFO")

from botocore_cpu import BotocoreCpu, describe, items_of, measure  # noqa: E402
from sweep_cost import PREFIX, T0, build_fleet  # noqa: E402

from idle_reaper import sweep as sweep_module  # noqa: E402
from idle_reaper.aws.fleet import LISTING_PROCESSES  # noqa: E402
from idle_reaper.aws.limits import GET_METRIC_DATA_DPS, GET_METRIC_DATA_TPS  # noqa: E402
from idle_reaper.aws.metrics import requested_points  # noqa: E402
from idle_reaper.notify import LoggingNotifier  # noqa: E402
from idle_reaper.sweep import (  # noqa: E402
    PLANNER_MEMORY_MB,
    PLANNER_VCPUS,
    SHARD_SIZE,
    SHARDS_AT_ONCE,
    GatherTask,
    ShardTask,
    gather_sweep,
    plan_sweep,
    run_shard,
    run_sweep,
)
from idle_reaper.sweep.doctor_daily import claim_daily_doctor, daily_claim_key, run_daily_doctor  # noqa: E402
from testkit.aws import CountingStateStore, FakeAws, LatencyModel, RequestCpu  # noqa: E402
from testkit.aws.fleet import ZONES, zone_of  # noqa: E402
from testkit.aws_rules import TokenBucket  # noqa: E402

# First look; the steady sweep 5 minutes later (the stack's default schedule: what most sweeps are);
# reaping when the first look's warnings fall due.
SWEEPS = (T0, T0 + timedelta(minutes=5), T0 + timedelta(minutes=30))
SWEEP_TIMEOUT_S = 240.0  # the stack's sweep and shard worker Lambdas at the default 5-minute schedule
# Step Functions' own time between states (Map start, iteration hand-offs, the gather state): a few
# transitions of a few tens of ms each; charged once per sharded sweep.
STATE_OVERHEAD_S = 0.1
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
    shards: int = 1
    lambda_s: float = 0.0  # the invocations' walls summed: what Lambda bills
    botocore_s: float = 0.0  # botocore's CPU (serialise, sign, parse), charged per request (in wall_s)
    botocore_by_op: Counter[str] = field(default_factory=Counter)  # seconds by operation
    planner_s: float = 0.0  # the sweep function's invocation (the planner; the whole sweep when in place)
    doctor_s: float = 0.0  # of it, the daily doctor's part (the day's first sweep, `--doctor-day`)
    # When each EC2 Describe* and GetMetricData request was sent, s from the start: (time, operation, datapoints asked)
    stamps: list[Stamp] = field(default_factory=list)


# EC2's bucket for Describe* requests, per account and region (aws/limits.py EC2_DESCRIBE, as the rules keep it).
# https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-throttling.html
DESCRIBE_BUCKET, DESCRIBE_REFILL = 100.0, 20.0


# GetMetricData's quotas per account and region (aws/limits.py, as the rules keep them): calls and datapoints a second.
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/cloudwatch_limits.html
METRIC_CALLS_PER_S, METRIC_POINTS_PER_S = GET_METRIC_DATA_TPS, GET_METRIC_DATA_DPS

Stamp = tuple[float, str, int]  # (when it was sent, s; "describe" or "metrics"; datapoints it asked for)


def shifted(stamps: Sequence[Stamp], by: float) -> list[Stamp]:
    return [(t + by, kind, points) for t, kind, points in stamps]


class StampedModel(LatencyModel):
    """The latency model, noting on its virtual clock when each EC2 Describe* and GetMetricData request is sent
    (before its latency): on the lane that sends it, so a pacer's wait (on that lane) moves it later."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stamps: list[Stamp] = []

    def charge(self, operation: str, times: int = 1) -> None:
        if operation.startswith("ec2:Describe"):
            self.stamps.extend([(self.virtual, "describe", 0)] * times)
        elif operation == "cloudwatch:GetMetricData":
            self.stamps.append((self.virtual, "metrics", 0))  # its datapoints: charge_cpu, right after
        super().charge(operation, times)

    def charge_cpu(self, operation: str, request: Mapping[str, Any], response: Mapping[str, Any]) -> None:
        if operation == "cloudwatch:GetMetricData" and self.stamps and self.stamps[-1][1] == "metrics":
            start, end = request["StartTime"], request["EndTime"]
            points = sum(requested_points(q, start, end) for q in request["MetricDataQueries"])
            self.stamps[-1] = (self.stamps[-1][0], "metrics", points)
        super().charge_cpu(operation, request, response)


@dataclass(frozen=True)
class DescribeRate:
    """EC2 Describe* requests as the account-region's bucket sees them in one sweep."""

    calls: int
    peak_per_s: int  # the most sent in any one second (a sliding window)
    lowest: float  # the bucket's fewest tokens (100 burst, 20 a second); below a request's 1: throttled
    throttled: int  # requests that found the bucket empty

    @classmethod
    def of(cls, stamps: Sequence[Stamp]) -> DescribeRate:
        ordered = sorted(t for t, kind, _ in stamps if kind == "describe")
        peak = most_in_a_second([(t, 1) for t in ordered])
        bucket = TokenBucket(DESCRIBE_BUCKET, DESCRIBE_REFILL)
        throttled, lowest = 0, DESCRIBE_BUCKET
        for t in ordered:
            throttled += not bucket.take(t)
            lowest = min(lowest, bucket.tokens)
        return cls(len(ordered), peak, lowest, throttled)


def most_in_a_second(weighted: Sequence[tuple[float, int]]) -> int:
    """The largest sum of weights sent within any one second (a sliding window)."""
    ordered = sorted(weighted)
    peak = start = in_window = 0
    for t, weight in ordered:
        in_window += weight
        while ordered[start][0] <= t - 1.0:
            in_window -= ordered[start][1]
            start += 1
        peak = max(peak, in_window)
    return peak


@dataclass(frozen=True)
class MetricRate:
    """GetMetricData requests as the account-region's quotas see them in one sweep: its calls and its datapoints a
    second, each a bucket of one second's worth (as the rules in front of moto keep them, aws_rules.py)."""

    calls: int
    points: int  # the datapoints they asked for
    peak_calls_per_s: int  # the most sent in any one second (a sliding window)
    lowest_calls: float  # the calls bucket's fewest tokens (50, refilled 50 a second)
    lowest_points: float  # the datapoints bucket's fewest (180,000, refilled 180,000 a second)
    throttled: int  # requests that found either bucket short

    @classmethod
    def of(cls, stamps: Sequence[Stamp]) -> MetricRate:
        sent = sorted((t, points) for t, kind, points in stamps if kind == "metrics")
        calls = TokenBucket(METRIC_CALLS_PER_S, METRIC_CALLS_PER_S)
        points = TokenBucket(METRIC_POINTS_PER_S, METRIC_POINTS_PER_S)
        throttled, lowest_calls, lowest_points = 0, calls.capacity, points.capacity
        for t, asked in sent:
            throttled += not (calls.take(t) and points.take(t, asked))
            lowest_calls, lowest_points = min(lowest_calls, calls.tokens), min(lowest_points, points.tokens)
        peak = most_in_a_second([(t, 1) for t, _ in sent])
        return cls(len(sent), sum(asked for _, asked in sent), peak, lowest_calls, lowest_points, throttled)


def map_starts(durations: Sequence[float], lanes: int) -> list[float]:
    """When each iteration of a Map starts (map_wall's schedule): on the lane that frees first."""
    free = [0.0] * max(1, min(lanes, len(durations)))
    starts = []
    for d in durations:
        start = heapq.heappop(free)
        starts.append(start)
        heapq.heappush(free, start + d)
    return starts


class Segments:
    """Times one invocation at a time: its modelled wall (latency on the virtual clock plus the code's own
    CPU) or, when slept, its measured wall (minus the fakes' own time)."""

    def __init__(self, model: LatencyModel, aws: FakeAws, *, sleep: bool) -> None:
        self.model, self.aws, self.sleep = model, aws, sleep
        self.botocore_s = 0.0
        self.stamps: list[Stamp] = []

    def time(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """fn's result, its wall and its own CPU time (botocore's, charged per request, counted apart:
        `self.botocore_s`). `self.stamps`: when its EC2 Describe* and GetMetricData requests were sent,
        from its start."""
        virtual, fake, botocore = self.model.virtual, self.aws.seconds(), self.model.cpu_s
        stamped = len(self.model.stamps) if isinstance(self.model, StampedModel) else 0
        in_lanes = self.model.lanes_cpu_s
        started, cpu_started = time.perf_counter(), time.process_time()
        result = fn()
        real, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        fake = self.aws.seconds() - fake
        botocore = self.model.cpu_s - botocore
        self.botocore_s += botocore
        # CPU of the code under test: the process's, minus the fakes' (and minus botocore's, burnt when slept).
        own = cpu - fake - (botocore if self.sleep else 0.0)
        # CPU spent in modelled child processes is on their lanes, in the virtual clock already: not serial.
        serial = own + botocore - (self.model.lanes_cpu_s - in_lanes)
        stamps = self.model.stamps[stamped:] if isinstance(self.model, StampedModel) else []
        self.stamps = shifted(stamps, -virtual)
        return result, (real - fake if self.sleep else self.model.virtual - virtual + serial), own


def whole_timeout() -> float:
    """The time left an invocation's daily doctor sees: a whole timeout (each is timed, not cut short)."""
    return SWEEP_TIMEOUT_S


def request_cpu(cpu: BotocoreCpu) -> RequestCpu:
    """Each fake call's botocore CPU, from what it was asked and answered."""
    return lambda operation, request, response: cpu.cost(operation, items_of(operation, request, response))


def map_wall(durations: Sequence[float], lanes: int) -> float:
    """Wall of a Map state running these iterations, at most `lanes` at once, each on the lane that frees first."""
    free = [0.0] * max(1, min(lanes, len(durations)))
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def sampled(shards: int, sample: int) -> list[int]:
    """`sample` shard indices spread evenly over 0 .. shards-1 (the first and the last among them); all when
    `sample` is 0 or not fewer than the shards."""
    if sample <= 0 or sample >= shards:
        return list(range(shards))
    if sample == 1:
        return [0]
    return sorted({round(i * (shards - 1) / (sample - 1)) for i in range(sample)})


@dataclass
class Tally:
    """What a stretch of a sweep charged: calls by operation, botocore's CPU, metrics billed, log bytes."""

    calls: Counter[str] = field(default_factory=Counter)
    botocore_by_op: Counter[str] = field(default_factory=Counter)
    botocore_s: float = 0.0
    metrics_requested: float = 0.0
    log_bytes: float = 0.0

    @classmethod
    def of(cls, model: LatencyModel, aws: FakeAws, segments: Segments) -> Tally:
        return cls(
            Counter(dict(model.charged)),
            Counter(dict(model.cpu_charged)),
            segments.botocore_s,
            aws.cloudwatch.metrics_requested,
            LOG.bytes,
        )

    def minus(self, other: Tally) -> Tally:
        return Tally(
            Counter({k: self.calls[k] - other.calls[k] for k in self.calls}),
            Counter({k: self.botocore_by_op[k] - other.botocore_by_op[k] for k in self.botocore_by_op}),
            self.botocore_s - other.botocore_s,
            self.metrics_requested - other.metrics_requested,
            self.log_bytes - other.log_bytes,
        )

    def times(self, factor: float) -> Tally:
        return Tally(
            Counter({k: round(v * factor) for k, v in self.calls.items()}),
            Counter({k: v * factor for k, v in self.botocore_by_op.items()}),
            self.botocore_s * factor,
            self.metrics_requested * factor,
            self.log_bytes * factor,
        )


def run_size(
    size: int,
    seed: int,
    *,
    sleep: bool,
    shard_size: int = SHARD_SIZE,
    sweeps: Sequence[datetime] = SWEEPS,
    cpu: BotocoreCpu | None = None,
    zones: int = len(ZONES),
    sample: int = 0,
    doctor: bool = False,
) -> list[Measured]:
    """Each sweep as the stack runs it: the scheduled sweep plans; a fleet that fits one shard is swept in
    that invocation, a larger one goes to the state machine, whose Map runs a worker invocation per shard
    (SHARDS_AT_ONCE at a time) and then the gather step. Invocations are timed one by one (each is its own
    Lambda, with its own CPU), and composed as Step Functions runs them. `zones`: the machines spread over
    that many of the region's Availability Zones (1: all in one zone, the planner's worst case).

    `sample` > 0 runs only that many of a sweep's shards, evenly spread over its indices (the same shards every
    sweep: a plan of the same fleet splits it the same way), and projects the others from them: their calls,
    CPU and writes scaled by shards / sample, each unrun shard's wall the sampled ones' in turn. The shards are
    drawn from one shuffled fleet, so they are alike; a full run at 200,000 takes hours of CPU here. It holds
    while the fleet is the same from sweep to sweep, as in SWEEPS (the stops come in the last of them); the
    bill's steady hour, after the stops, always runs every shard (steady_hour). `doctor`: every sweep is the day's
    first, and runs the daily doctor (its claim released before each)."""
    bench = build_fleet(size, seed)
    aws = bench.aws
    for instance in aws.ec2.instances.values():
        instance.api["Placement"]["AvailabilityZone"] = ZONES[ZONES.index(zone_of(instance.instance_id)) % zones]
    model = StampedModel(sleep=sleep, cpu=request_cpu(cpu) if cpu is not None else None, vcpus=PLANNER_VCPUS)
    aws.set_latency(model)
    store = CountingStateStore(model)
    notifier = LoggingNotifier(sweep_module.logger, delivers=True)
    adapters = aws.adapters(store=store, notifier=notifier, prefix=PREFIX, listing_processes=LISTING_PROCESSES)
    segments = Segments(model, aws, sleep=sleep)
    model.install()
    results = []
    try:
        for now in sweeps:
            # The schedule's minutes pass between sweeps: EC2's stop buckets and GetMetricData's, which the product
            # paces itself to, refill meanwhile (each invocation's Fleet starts with full ones, as AWS's are by
            # then). Without it, the stops one sweep held back for EC2's rate were held back at every later one.
            model.idle_until((now - sweeps[0]).total_seconds())
            botocore_before, botocore_ops_before = segments.botocore_s, Counter(model.cpu_charged)
            charged_before, requested_before, log_before = (
                Counter(model.charged),
                aws.cloudwatch.metrics_requested,
                LOG.bytes,
            )
            writes_before = model.charged["dynamodb:PutItem"]
            extra, records_scale, doctor_s = Tally(), 1.0, 0.0
            if doctor:
                store.release_claim(daily_claim_key(now))
            plan, planner_s, cpu_s = segments.time(
                lambda now=now: plan_sweep(adapters, now=now, in_place=True, shard_size=shard_size)
            )
            stamps = list(segments.stamps)  # the account-region's paced requests, on the sweep's timeline
            if plan.shards == 1:
                report, swept_s, swept_cpu = segments.time(
                    lambda now=now, plan=plan: run_sweep(adapters, now=now, sweep_id=plan.sweep_id, listed=plan.listed)
                )
                stamps += shifted(segments.stamps, planner_s)
                if doctor:  # after the sweep, in its invocation, on what it read
                    _, doctor_s, doctor_cpu = segments.time(
                        lambda now=now, r=report: run_daily_doctor(adapters, now, r.read, whole_timeout)
                    )
                    swept_s, swept_cpu = swept_s + doctor_s, swept_cpu + doctor_cpu
                walls, wall, cpu_s = [planner_s + swept_s], planner_s + swept_s, cpu_s + swept_cpu
            else:
                model.charge("states:StartExecution")
                if doctor and claim_daily_doctor(adapters, now, whole_timeout):
                    # The planner's part, after it starts the execution: beside the Map, not before it.
                    _, doctor_s, doctor_cpu = segments.time(
                        lambda now=now, p=plan: run_daily_doctor(
                            adapters, now, None, whole_timeout, p.listed, claimed=True, gpu=False
                        )
                    )
                    cpu_s += doctor_cpu
                indices = sampled(plan.shards, sample)
                before_shards = Tally.of(model, aws, segments)
                shard_walls, shards_cpu, shard_stamps = [], 0.0, []
                for index in indices:
                    model.charge("states:InvokeLambda")
                    concurrent = min(plan.shards, SHARDS_AT_ONCE)  # as the execution input says
                    task = ShardTask(
                        sweep_id=plan.sweep_id, now=plan.now, shard=index, concurrent_shards=concurrent, doctor=doctor
                    )
                    _, shard_s, shard_cpu = segments.time(lambda task=task: run_shard(adapters, task))
                    shard_walls.append(shard_s + model.latency["states:InvokeLambda"])
                    shard_stamps.append(segments.stamps)
                    shards_cpu += shard_cpu
                # The shards not run: each as the sampled ones, in turn (their calls and CPU scaled up below).
                extra = Tally.of(model, aws, segments).minus(before_shards).times(plan.shards / len(indices) - 1)
                shard_walls = [shard_walls[i % len(shard_walls)] for i in range(plan.shards)]
                # The Map starts after the planner and StartExecution; each shard on its lane, as they run.
                map_start = planner_s + model.latency["states:StartExecution"]
                for i, start in enumerate(map_starts(shard_walls, SHARDS_AT_ONCE)):
                    at = map_start + start + model.latency["states:InvokeLambda"]
                    stamps += shifted(shard_stamps[i % len(shard_stamps)], at)
                records_scale = plan.shards / len(indices)  # only the sampled shards' machines have records
                cpu_s += shards_cpu * plan.shards / len(indices)
                model.charge("states:InvokeLambda")
                gather_task = GatherTask(
                    sweep_id=plan.sweep_id, now=plan.now, shards=indices, doctor=doctor, machine_shards=plan.shards
                )
                gathered, gather_s, gather_cpu = segments.time(lambda t=gather_task: gather_sweep(adapters, t))
                assert not gathered.failed, gathered.failed
                cpu_s += gather_cpu
                start_s = model.latency["states:StartExecution"]
                walls = [planner_s + start_s + doctor_s, *shard_walls, gather_s]
                # The sweep ends with the gather step, or with the planner's invocation if that ends later.
                executed = planner_s + start_s + map_wall(shard_walls, SHARDS_AT_ONCE) + gather_s + STATE_OVERHEAD_S
                wall = max(walls[0], executed)
            charged = Counter(dict(model.charged - charged_before)) + extra.calls
            results.append(
                Measured(
                    calls=charged,
                    charged_s={op: n * model.latency.get(op, 0.0) for op, n in charged.items()},
                    wall_s=wall,
                    cpu_s=cpu_s,
                    invocations=len(walls),
                    longest_s=max(walls),
                    machines=size,
                    state_writes=model.charged["dynamodb:PutItem"] - writes_before + extra.calls["dynamodb:PutItem"],
                    metrics_requested=aws.cloudwatch.metrics_requested - requested_before + extra.metrics_requested,
                    records_read=round(len(store.records) * records_scale),
                    log_bytes=LOG.bytes - log_before + extra.log_bytes,
                    shards=plan.shards,
                    lambda_s=sum(walls),
                    botocore_s=segments.botocore_s - botocore_before + extra.botocore_s,
                    botocore_by_op=model.cpu_charged - botocore_ops_before + extra.botocore_by_op,
                    planner_s=walls[0],
                    doctor_s=doctor_s,
                    stamps=stamps,
                )
            )
    finally:
        model.uninstall()
    return results


WIDTH = 52


def row(label: str, values: Sequence[float], spec: str = ",.0f", suffix: str = "") -> None:
    width = 12 - len(suffix)
    print(f"  {label:<{WIDTH}}" + "".join(f"{v:>{width}{spec}}{suffix}" for v in values))


def print_size(size: int, results: list[Measured], zones: int = len(ZONES)) -> bool:
    ok = True
    print(f"\n== {size:,} machines, in {zones} Availability Zone(s) ==")
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
    row("botocore's CPU (serialise, sign, parse), s", [r.botocore_s for r in results], ",.1f")
    for op in sorted(set().union(*(r.botocore_by_op for r in results)), key=lambda o: -results[0].botocore_by_op[o]):
        if max(r.botocore_by_op[op] for r in results) >= 0.05:
            row(f"  {op}", [r.botocore_by_op[op] for r in results], ",.1f")
    row("modelled wall, s", [r.wall_s for r in results], ",.1f")
    row(f"  planner (listed in processes, {PLANNER_VCPUS} vCPUs), s", [r.planner_s for r in results], ",.1f")
    if any(r.doctor_s for r in results):
        row("    of it the daily doctor's part, s", [r.doctor_s for r in results], ",.1f")
    row("shards", [r.shards for r in results])
    row("invocations (planner + shard workers + gather)", [r.invocations for r in results])
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
    rates = [DescribeRate.of(r.stamps) for r in results]
    print(
        f"  EC2 Describe* in the account-region (planner + shards side by side; bucket {DESCRIBE_BUCKET:.0f}, "
        f"{DESCRIBE_REFILL:.0f}/s)"
    )
    row("  requests", [d.calls for d in rates])
    row("  most in any one second", [d.peak_per_s for d in rates])
    row("  the bucket at its lowest, tokens", [d.lowest for d in rates], ",.1f")
    row("  requests that found it empty (throttled)", [d.throttled for d in rates])
    metric_rates = [MetricRate.of(r.stamps) for r in results]
    print(
        f"  GetMetricData in the account-region (planner + shards side by side; {METRIC_CALLS_PER_S:.0f} calls and "
        f"{METRIC_POINTS_PER_S:,.0f} datapoints a second)"
    )
    row("  datapoints asked for", [m.points for m in metric_rates])
    row("  most calls in any one second", [m.peak_calls_per_s for m in metric_rates])
    row("  the calls bucket at its lowest, tokens", [m.lowest_calls for m in metric_rates], ",.1f")
    row("  the datapoints bucket at its lowest", [m.lowest_points for m in metric_rates])
    row("  requests that found either short (throttled)", [m.throttled for m in metric_rates])
    target = TARGETS.get(size)
    for label, r in zip(LABELS, results, strict=True):
        if target is not None and r.wall_s > target:
            ok = False
            print(f"  MISSED sweep {label}: {r.wall_s:.1f} s > {target:.0f} s")
        if r.longest_s > SWEEP_TIMEOUT_S / 2:
            ok = False
            print(f"  MISSED sweep {label}: an invocation uses {r.longest_s / SWEEP_TIMEOUT_S:.0%} of its timeout")
    for label, d in zip(LABELS, rates, strict=True):
        if d.throttled:
            ok = False
            print(f"  MISSED sweep {label}: {d.throttled:,} EC2 Describe* requests past the account-region's bucket")
    for label, m in zip(LABELS, metric_rates, strict=True):
        if m.throttled:
            ok = False
            print(f"  MISSED sweep {label}: {m.throttled:,} GetMetricData requests past the account-region's quotas")
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
LAMBDA_GB = 1.769  # the stack's shard worker function (one full vCPU); the gather step is smaller
# The sweep function (PLANNER_MEMORY_MB, 6 vCPUs: its zone listers run in child processes side by side): the
# planner, and the sweep of a fleet of one shard.
PLANNER_GB = PLANNER_MEMORY_MB / 1000
STEP_FUNCTIONS_PER_1000_TRANSITIONS = 0.025  # standard workflows
BILL_FLEET = 10_000


def state_transitions(shards: int) -> int:
    """Step Functions state transitions of one sweep: none when it is swept in place; else the Map, a task
    per shard (and its exit), the gather step and the end."""
    return 0 if shards == 1 else 3 + 2 * shards


# The bill's steady state: an hour of 5-minute sweeps after the first look's warnings fell due. A machine is
# read only when its decision can change (busy ones about hourly, each at its own point in the hour), so
# one sweep is not every sweep: the bill averages the hour.
def steady_hour_sweeps(every: int) -> tuple[datetime, ...]:
    """An hour of sweeps `every` minutes apart, after the first look, the next sweep and the reaping."""
    return tuple(T0 + timedelta(minutes=m) for m in range(35, 95, every))


def steady_hour(size: int, seed: int, cpu: BotocoreCpu | None, every: int = 5) -> Measured:
    """One sweep as the average of the steady hour's sweeps (after the first look and the reaping). Every
    shard runs: the reaping stops machines, so later plans split the fleet differently, and a sample of shards
    would then hold machines no sampled shard has seen (a first look each, not a steady sweep)."""
    sweeps = (*SWEEPS, *steady_hour_sweeps(every))
    runs = run_size(size, seed, sleep=False, sweeps=sweeps, cpu=cpu)[len(SWEEPS) :]
    n = len(runs)
    return Measured(
        calls=sum((r.calls for r in runs), Counter()),
        charged_s={},
        wall_s=sum(r.wall_s for r in runs) / n,
        cpu_s=sum(r.cpu_s for r in runs) / n,
        invocations=round(sum(r.invocations for r in runs) / n),
        longest_s=max(r.longest_s for r in runs),
        machines=size,
        state_writes=round(sum(r.state_writes for r in runs) / n),
        metrics_requested=round(sum(r.metrics_requested for r in runs) / n),
        records_read=round(sum(r.records_read for r in runs) / n),
        log_bytes=round(sum(r.log_bytes for r in runs) / n),
        shards=max(r.shards for r in runs),
        lambda_s=sum(r.lambda_s for r in runs) / n,
        botocore_s=sum(r.botocore_s for r in runs) / n,
        planner_s=sum(r.planner_s for r in runs) / n,
    )


def print_bill(steady: Measured, every: int = 5) -> bool:
    """The reaper's own monthly bill at the steady hour's fleet size, 5-minute sweeps (every sweep priced as
    the steady hour's average, which most sweeps are), next to what the replay of the sample trace saves."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import savings  # the replay benchmark: the real core over the sample trace

    n = 30 * 24 * 60 // every
    bill = {
        "CloudWatch GetMetricData": steady.metrics_requested * n / 1000 * GMD_PER_1000_METRICS,
        "DynamoDB writes": steady.state_writes * 2 * n / 1e6 * DDB_PER_MILLION_WRITES,
        "DynamoDB reads": steady.records_read * 0.5 * n / 1e6 * DDB_PER_MILLION_READS,
        "Lambda": (steady.planner_s * PLANNER_GB + (steady.lambda_s - steady.planner_s) * LAMBDA_GB)
        * n
        * LAMBDA_PER_GB_SECOND
        + steady.invocations * n / 1e6 * LAMBDA_PER_MILLION_REQUESTS,
        f"Step Functions ({steady.shards} shard(s) a sweep)": state_transitions(steady.shards)
        * n
        / 1000
        * STEP_FUNCTIONS_PER_1000_TRANSITIONS,
        "CloudWatch Logs": steady.log_bytes * n / 1e9 * LOGS_PER_GB,
    }
    replay = savings.compare(savings.SAMPLE)
    per_machine_day = replay["dollars_saved"] / replay["machine_days"]
    fleet = steady.machines
    saved = per_machine_day * fleet * 30
    total = sum(bill.values())
    print(f"\n== the reaper's own bill at {fleet:,} machines, a sweep every {every} min ({n:,} sweeps a month) ==")
    for item, dollars in bill.items():
        print(f"  {item:<{WIDTH}}{dollars:>12,.2f} $/month")
    print(f"  {'total':<{WIDTH}}{total:>12,.2f} $/month")
    print(
        f"  savings the replay reports: ${replay['dollars_saved']:,.0f} over {replay['machine_days']:,.0f} machine-days"
        f" of the sample trace = ${per_machine_day:,.2f} a machine-day -> ${saved:,.0f} a month at {fleet:,}"
    )
    share = total / saved
    per_machine = total / fleet
    print(f"  the reaper costs {share:.3%} of what it saves (target: under 1 %)")
    print(f"  ${per_machine:.3f} per machine-month (target: at most $0.05 at 10,000 machines)")
    print(f"  metrics read a sweep: {steady.metrics_requested:,} ({steady.metrics_requested / fleet:.2f} per machine)")
    # The hour holds the young machines' warnings and stops too: more than the steady sweep (#2) writes.
    print(f"  DynamoDB writes a sweep: {steady.state_writes:,} ({steady.state_writes / fleet:.1%} of machines)")
    return share < 0.01 and (fleet != BILL_FLEET or every != 5 or per_machine <= 0.05)


def check(size: int, seed: int, cpu: BotocoreCpu | None) -> bool:
    """The model against a run that really sleeps every latency on real thread pools, and really burns each
    request's botocore CPU on the thread that makes it (so the GIL serialises it as it would botocore's):
    swept in one invocation, and in four shards (each shard's invocation timed alone, as its own Lambda runs it)."""
    ok = True
    for shard_size, how in ((SHARD_SIZE, "in one invocation"), (-(-size // 4), "in 4 shards")):
        modelled = run_size(size, seed, sleep=False, shard_size=shard_size, cpu=cpu)
        slept = run_size(size, seed, sleep=True, shard_size=shard_size, cpu=cpu)
        print(f"\n== check at {size:,} machines {how}: modelled wall against a run that really sleeps each latency ==")
        print(f"  {'':<{WIDTH}}" + "".join(f"{h:>12}" for h in LABELS))
        row("modelled, s", [r.wall_s for r in modelled], ",.2f")
        row("slept on real threads, s", [r.wall_s for r in slept], ",.2f")
        row("  of which botocore's CPU (modelled | burnt), s", [r.botocore_s for r in modelled], ",.2f")
        ratios = [m.wall_s / s.wall_s for m, s in zip(modelled, slept, strict=True)]
        row("modelled / slept", [100 * x for x in ratios], ",.0f", "%")
        within = all(0.8 <= x <= 1.2 for x in ratios)
        print("  OK: within 20 %" if within else "  FAIL: the model is more than 20 % off")
        ok = ok and within
    return ok


def time_planner(
    size: int, seed: int, cpu: BotocoreCpu | None, *, sleep: bool, processes: int, zones: int, vcpus: int
) -> float:
    """The planner's wall (listing, groups, shards and their manifests) over a fleet spread evenly over `zones`
    of the region's zones, listed in up to `processes` child processes (1: on threads, in one process) on
    `vcpus`, modelled or really slept and burnt."""
    aws = build_fleet(size, seed).aws
    for instance in aws.ec2.instances.values():
        instance.api["Placement"]["AvailabilityZone"] = ZONES[ZONES.index(zone_of(instance.instance_id)) % zones]
    model = LatencyModel(sleep=sleep, cpu=request_cpu(cpu) if cpu is not None else None, vcpus=vcpus)
    aws.set_latency(model)
    adapters = aws.adapters(store=CountingStateStore(model), prefix=PREFIX, listing_processes=processes)
    segments = Segments(model, aws, sleep=sleep)
    model.install()
    try:
        plan, wall, _ = segments.time(lambda: plan_sweep(adapters, now=T0, in_place=True))
    finally:
        model.uninstall()
    assert plan.machines == size, plan.machines
    return wall


def print_planner(size: int, seed: int, cpu: BotocoreCpu | None) -> None:
    """The planner alone at `size`: the fleet evenly over the region's zones, and all in one (a full zone is listed
    again in parts by instance id, so the children share it), against the listing on threads of one process."""
    print(f"\n== the planner alone at {size:,} machines ({PLANNER_VCPUS} vCPUs, zones and parts in child processes) ==")
    runs = ((len(ZONES), 1, "on threads of one process (before)"), (len(ZONES), LISTING_PROCESSES, "in processes"))
    for zones, processes, how in (*runs, (1, LISTING_PROCESSES, "in processes")):
        wall = time_planner(size, seed, cpu, sleep=False, processes=processes, zones=zones, vcpus=PLANNER_VCPUS)
        row(f"machines in {zones} zone(s), listed {how}, s", [wall], ",.1f")


def check_planner(size: int, seed: int, cpu: BotocoreCpu | None) -> bool:
    """The model's CPU lanes against real child processes: the planner listing `size` machines in as many
    processes as this machine has cores (up to the planner's vCPUs), modelled and really slept and burnt;
    the listing on threads alongside, slept, to show what the processes gain."""
    k = max(1, min(PLANNER_VCPUS, os.cpu_count() or 1))
    modelled = time_planner(size, seed, cpu, sleep=False, processes=k, zones=k, vcpus=k)
    slept = time_planner(size, seed, cpu, sleep=True, processes=k, zones=k, vcpus=k)
    on_threads = time_planner(size, seed, cpu, sleep=True, processes=1, zones=k, vcpus=k)
    print(f"\n== check of the planner at {size:,} machines in {k} zones, listed in {k} processes ==")
    row("modelled (CPU lanes), s", [modelled], ",.2f")
    row("slept and burnt in real child processes, s", [slept], ",.2f")
    row("  modelled / slept", [100 * modelled / slept], ",.0f", "%")
    row("slept and burnt on threads of one process (before), s", [on_threads], ",.2f")
    within = 0.8 <= modelled / slept <= 1.2
    print("  OK: within 20 %" if within else "  FAIL: the model is more than 20 % off")
    return within


def measured_botocore(*, skip: bool) -> BotocoreCpu | None:
    """botocore's CPU per request, measured now and printed (None: `skip`, latency only); then the sweep's log
    goes to LOG (counted, not kept)."""
    cpu = None
    if not skip:
        cpu = measure()
        print("and its botocore CPU, measured now with real botocore against stubbed answers (botocore_cpu.py):")
        for line in describe(cpu):
            print(f"  {line}")
    handler = sweep_module.logger.registered_handler
    if isinstance(handler, logging.StreamHandler):  # after measure(), which sends the log to /dev/null
        handler.setStream(LOG)  # type: ignore[arg-type]
    return cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,50000,200000", help="comma-separated fleet sizes")
    parser.add_argument("--check", type=int, default=2000, help="fleet size of the slept check (0: skip)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--bills", default="", help="sizes (of --sizes) to price the steady hour at (default 10000)")
    parser.add_argument("--every", default="5", help="sweep schedules (minutes, comma-separated) to price")
    parser.add_argument("--no-botocore", action="store_true", help="charge latency only, not botocore's CPU")
    parser.add_argument("--planner", type=int, default=0, help="fleet size to time the planner alone at (0: skip)")
    parser.add_argument("--doctor-day", action="store_true", help="every sweep the day's first: the daily doctor runs")
    parser.add_argument(
        "--sample-shards",
        type=int,
        default=0,
        help="run only this many of a sharded sweep's shards and project the rest (0: all; the bills run all)",
    )
    parser.add_argument(
        "--zones",
        type=int,
        default=len(ZONES),
        choices=range(1, len(ZONES) + 1),
        help=f"Availability Zones the machines spread over, evenly (default {len(ZONES)}; 1: the planner's worst case)",
    )
    args = parser.parse_args(argv)
    print("idle-reaper sweep latency model: the real run_sweep over counting fakes, every call charged its latency")
    cpu = measured_botocore(skip=args.no_botocore)
    ok = True
    measured = {}
    for size in [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]:
        measured[size] = run_size(
            size,
            args.seed,
            sleep=False,
            cpu=cpu,
            zones=args.zones,
            sample=args.sample_shards,
            doctor=args.doctor_day,
        )
        if args.sample_shards and measured[size][0].shards > args.sample_shards:
            shards = measured[size][0].shards
            print(f"\n({args.sample_shards} of the {shards} shards of each sweep run; the others projected from them)")
        ok = print_size(size, measured[size], args.zones) and ok
    if args.planner:
        print_planner(args.planner, args.seed, cpu)
    bills = {int(s.replace("_", "")) for s in args.bills.split(",") if s.strip()} if args.bills else {BILL_FLEET}
    for size in sorted(bills & set(measured)):
        for every in sorted({int(e) for e in args.every.split(",")}):
            ok = print_bill(steady_hour(size, args.seed, cpu, every), every) and ok
    if args.check:
        ok = check(args.check, args.seed, cpu) and ok
        ok = check_planner(10_000, args.seed, cpu) and ok
    print("\nOK: every target met" if ok else "\nMISSED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
