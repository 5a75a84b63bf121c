"""CloudWatch: every machine's CPU, GPU, network and human-activity datapoints in few GetMetricData calls."""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper.aws.clients import AwsError, chunks, run_concurrently
from idle_reaper.aws.limits import GET_METRIC_DATA_DPS, GET_METRIC_DATA_TPS, Pace, Quota
from idle_reaper.core.endpoints import ENDPOINT_DIMENSION, VARIANT_DIMENSION
from idle_reaper.core.signals import Point, Signals
from idle_reaper.policy import (
    MetricSettings,
)

METRIC_QUERIES_PER_CALL = 500  # GetMetricData's limit
DATAPOINTS_PER_CALL = 100_800  # GetMetricData returns at most this many before paging
# The on-machine activity collector's metric (agent/README.md), by InstanceId alone. Minimum: a hostile
# local user's high values cannot hide a real low one (see the threat model there).
HUMAN_METRIC_NAMESPACE = "CWAgent"
HUMAN_METRIC_NAME = "idle_reaper_minutes_since_input"
# Read at the sweep's period like the other metrics (the agent publishes one value a minute): a Minimum of
# five one-minute values asks CloudWatch for a fifth of the datapoints, which at 200,000 machines is the
# difference between a first look inside GetMetricData's 180,000 datapoints a second and one past its
# timeout. Its datapoint is moved to the end of its period (`_human_point`), so the input it places
# (core/signals.py, last_human_input) is never earlier than the truth, at most a period later.
# The collector's second gauge: which of its sources it could not read (agent/README.md). Read by `status`
# only, on demand, never by the sweep (each query is billed).
UNREADABLE_METRIC_NAME = "idle_reaper_unreadable_sources"
UNREADABLE_SOURCES = {1: "terminals", 2: "jupyter"}


def unreadable_source_names(bits: int) -> list[str]:
    """The sources a collector's bitmask names ("source 8" for a bit this version does not know)."""
    return [UNREADABLE_SOURCES.get(1 << i, f"source {1 << i}") for i in range(16) if bits & (1 << i)]


# Threads per kind of call. GetMetricData allows 50 transactions/s per account and region: 20 threads at
# ~0.6 s a call stay near 33/s. DynamoDB on-demand absorbs 32 threads of small writes (a new table starts
# at 4,000 writes/s). EC2 and Auto Scaling calls run on 8 threads per kind of action (at 0.2-0.3 s a call,
# 25-40 calls/s); the adaptive retry mode slows a client down when a bucket runs dry (docs/deploying.md).
METRIC_WORKERS = 20
# What one GetMetricData call takes in-region: with its quota of calls a second (aws/limits.py), how many calls the
# shards of one sweep may have in flight together.
GET_METRIC_DATA_SECONDS = 0.6
CALLS_QUOTA = Quota(GET_METRIC_DATA_TPS, GET_METRIC_DATA_TPS)
DATAPOINTS_QUOTA = Quota(GET_METRIC_DATA_DPS, GET_METRIC_DATA_DPS)


def metric_workers(concurrent: int) -> int:
    """GetMetricData threads of one worker, so that the workers sweeping one account and region at once (the
    hub's shards; a large member account-region's parts) together stay under its GetMetricData quota (about
    GET_METRIC_DATA_TPS x GET_METRIC_DATA_SECONDS calls in flight)."""
    in_flight = int(GET_METRIC_DATA_TPS * GET_METRIC_DATA_SECONDS)
    return max(1, min(METRIC_WORKERS, in_flight // concurrent))


def requested_points(query: Mapping[str, Any], start: datetime, end: datetime) -> int:
    """The datapoints one query asks for, as CloudWatch counts them against its datapoints a second: the range
    over the query's period."""
    period = int(query["MetricStat"]["Period"])
    return -(-int((end - start).total_seconds()) // period)


# ---------------------------------------------------------------------------------------------
# Signals (CloudWatch GetMetricData)


# Maximum of utilization (the busiest moment), Sum of bytes, Minimum of minutes since a person's input.
_STATISTIC = {"network_in": "Sum", "network_out": "Sum", "user": "Minimum"}


@dataclass(frozen=True)
class MetricFetchStats:
    calls: int = 0
    queries: int = 0
    failed_calls: int = 0


class MetricsReader:
    """Packs every machine's CPU, GPU, human-activity (and network) queries into as few GetMetricData calls
    as possible. Every query names one dimension, the machine's own InstanceId: datapoints published for
    any other dimension set (another InstanceId, extra StatsD tags) are never read for this machine."""

    def __init__(self, cloudwatch: Any, workers: int = METRIC_WORKERS, *, sharing: int = 1) -> None:
        self.cloudwatch = cloudwatch
        self.workers = workers  # GetMetricData calls at once (fewer when shards of one sweep share the quota)
        self.stats = MetricFetchStats()
        self._stats_lock = threading.Lock()  # batches run on several threads
        # GetMetricData's quotas of calls and of datapoints a second, this reader's share of them when `sharing`
        # workers read the same account and region at once: each call waits its turn, none is throttled.
        self.sharing = max(1, sharing)
        self.calls_pace = Pace(CALLS_QUOTA.share(self.sharing))
        self.points_pace = Pace(DATAPOINTS_QUOTA.share(self.sharing))

    def shared_by(self, workers: int) -> MetricsReader:
        """A reader over the same client for one of `workers` reading this account and region at once: its share
        of the threads (metric_workers) and of the quotas."""
        return MetricsReader(self.cloudwatch, metric_workers(workers), sharing=workers)

    def _count(self, calls: int = 0, queries: int = 0, failed_calls: int = 0) -> None:
        with self._stats_lock:
            s = self.stats
            self.stats = MetricFetchStats(s.calls + calls, s.queries + queries, s.failed_calls + failed_calls)

    def fetch(
        self,
        instance_ids: Sequence[str],
        metrics: MetricSettings,
        *,
        start: datetime,
        end: datetime,
        network: bool = False,
        human: bool = True,
        gpu: bool = True,
        notebooks: Collection[str] = (),
        later_starts: Mapping[str, datetime] | None = None,
    ) -> dict[str, Signals]:
        """`gpu`: read the GPU metric (False only for types that cannot have one: core.signals.has_no_gpu).
        `later_starts`: machines whose own window begins after `start` (read from there, in calls of their own
        range where they fill one).
        `notebooks`: those of the ids that are SageMaker notebook instances, whose CPU and network are the
        agent's (`metrics.notebook_cpu`, `notebook_network_in`, `notebook_network_out`): SageMaker publishes
        neither."""
        period = metrics.period_seconds
        kinds: list[tuple[str, str, str]] = [("cpu", metrics.cpu.namespace, metrics.cpu.name)]
        if gpu:
            kinds.append(("gpu", metrics.gpu.namespace, metrics.gpu.name))
        if human:  # only for policies that read it (human_active_minutes): each query is billed
            kinds.append(("user", HUMAN_METRIC_NAMESPACE, HUMAN_METRIC_NAME))
        if network:
            kinds += [
                ("network_in", metrics.network_in.namespace, metrics.network_in.name),
                ("network_out", metrics.network_out.namespace, metrics.network_out.name),
            ]
        on_notebook = {
            "cpu": metrics.notebook_cpu,
            "network_in": metrics.notebook_network_in,
            "network_out": metrics.notebook_network_out,
        }
        queries: list[dict[str, Any]] = []
        owner: dict[str, tuple[str, str]] = {}
        for index, instance_id in enumerate(instance_ids):
            for kind, namespace, name in kinds:
                if instance_id in notebooks and (source := on_notebook.get(kind)):
                    namespace, name = source.namespace, source.name
                query_id = f"{kind[0]}{kind[-1]}{index}"  # e.g. "cu12": unique, starts with a letter
                owner[query_id] = (instance_id, kind)
                stat = _STATISTIC.get(kind, "Maximum")
                queries.append(
                    {
                        "Id": query_id,
                        "MetricStat": {
                            "Metric": {
                                "Namespace": namespace,
                                "MetricName": name,
                                "Dimensions": [{"Name": "InstanceId", "Value": instance_id}],
                            },
                            "Period": period,
                            "Stat": stat,
                        },
                        "ReturnData": True,
                    }
                )
        points, incomplete = self._read(queries, owner, start, end, period, later_starts=later_starts)
        step = timedelta(seconds=period)
        result: dict[str, Signals] = {}
        for instance_id in instance_ids:
            series = {kind: sorted(points.get((instance_id, kind), [])) for kind, _, _ in kinds}
            result[instance_id] = Signals(
                cpu=series["cpu"],
                gpu=series.get("gpu", []),
                network_in=series.get("network_in", []),
                network_out=series.get("network_out", []),
                complete=instance_id not in incomplete,
                user=[_human_point(p, step, end) for p in series.get("user", [])],
            )
        return result

    def fetch_invocations(
        self,
        endpoints: Mapping[str, tuple[str, Sequence[str]]],
        metrics: MetricSettings,
        *,
        start: datetime,
        end: datetime,
    ) -> dict[str, Signals]:
        """SageMaker endpoints' requests: for each machine id, (its endpoint's name, its variants' names) ->
        two queries per variant by EndpointName and VariantName, `metrics.endpoint_invocations` (AWS/SageMaker
        Invocations) Sum and `metrics.endpoint_heartbeat` (the instances' CPUUtilization) SampleCount per period,
        packed into as few GetMetricData calls as the queries fill."""
        period = metrics.period_seconds
        series = (("c", "Sum", metrics.endpoint_invocations), ("r", "SampleCount", metrics.endpoint_heartbeat))
        queries: list[dict[str, Any]] = []
        owner: dict[str, tuple[str, str]] = {}
        for index, (machine_id, (name, variants)) in enumerate(endpoints.items()):
            for number, variant in enumerate(variants):
                dimensions = [
                    {"Name": ENDPOINT_DIMENSION, "Value": name},
                    {"Name": VARIANT_DIMENSION, "Value": variant},
                ]
                for letter, stat, source in series:
                    query_id = f"{letter}{index}v{number}"  # unique, starts with a letter
                    owner[query_id] = (machine_id, f"{letter}:{variant}")
                    metric = {"Namespace": source.namespace, "MetricName": source.name, "Dimensions": dimensions}
                    stat_of = {"Metric": metric, "Period": period, "Stat": stat}
                    queries.append({"Id": query_id, "MetricStat": stat_of, "ReturnData": True})
        points, incomplete = self._read(queries, owner, start, end, period)

        def of(machine_id: str, letter: str, variants: Sequence[str]) -> tuple[tuple[str, tuple[Point, ...]], ...]:
            return tuple((v, tuple(sorted(points.get((machine_id, f"{letter}:{v}"), [])))) for v in variants)

        return {
            machine_id: Signals(
                invocations=of(machine_id, "c", variants),
                reported=of(machine_id, "r", variants),
                complete=machine_id not in incomplete,
            )
            for machine_id, (_, variants) in endpoints.items()
        }

    def _read(
        self,
        queries: Sequence[dict[str, Any]],
        owner: Mapping[str, tuple[str, str]],
        start: datetime,
        end: datetime,
        period: int,
        *,
        later_starts: Mapping[str, datetime] | None = None,
    ) -> tuple[dict[tuple[str, str], list[Point]], set[str]]:
        """Every query's datapoints by its owner (machine id, series), and the machines whose data is incomplete,
        from `start` (or the owner's own later start) rounded down to the `period` every query has. A call has one
        range, the earliest of its queries': queries are packed shortest range first, so a machine with a short
        window is not read over a longer one's range unless it shares a call with it (at most one call a range).
        A long window returns many points per query; one call stays under GetMetricData's datapoint limit so no
        batch needs a second (re-billed) NextToken page, and under this reader's share of the datapoints a
        second, so that one call never asks for more than its bucket holds (calls are billed by the metric, not
        by the call: smaller calls cost nothing more)."""
        points: dict[tuple[str, str], list[Point]] = {}
        incomplete: set[str] = set()
        if not queries:
            return points, incomplete

        def rounded(at: datetime) -> datetime:
            return datetime.fromtimestamp(int(at.timestamp()) // period * period, tz=UTC)

        own = later_starts or {}
        start_of = {q["Id"]: rounded(max(start, own.get(owner[q["Id"]][0], start))) for q in queries}
        most = min(DATAPOINTS_PER_CALL, int(self.points_pace.quota.burst))
        batches: list[list[dict[str, Any]]] = []
        ranges: list[datetime] = []  # each batch's start: the earliest of its queries'
        for query in sorted(queries, key=lambda q: start_of[q["Id"]], reverse=True):  # stable: one range keeps order
            begins = start_of[query["Id"]]  # the earliest so far: the batch's range if the query joins it
            per_call = max(1, min(METRIC_QUERIES_PER_CALL, most // max(1, requested_points(query, begins, end))))
            if batches and len(batches[-1]) < per_call:
                batches[-1].append(query)
                ranges[-1] = begins
            else:
                batches.append([query])
                ranges.append(begins)

        def read(batch: tuple[datetime, list[dict[str, Any]]]) -> None:
            # Each batch fills its own keys of `points`; the set and dict updates are atomic under the GIL.
            begins, batch_queries = batch
            try:
                self._fetch_batch(batch_queries, begins, end, owner, points, incomplete)
            except AwsError:
                # A batch we could not read: those machines are unknown, the rest go on.
                incomplete.update(owner[q["Id"]][0] for q in batch_queries)
                self._count(failed_calls=1)

        run_concurrently(read, list(zip(ranges, batches, strict=True)), self.workers)
        return points, incomplete

    def _fetch_batch(
        self,
        batch: Sequence[dict[str, Any]],
        start: datetime,
        end: datetime,
        owner: Mapping[str, tuple[str, str]],
        points: dict[tuple[str, str], list[Point]],
        incomplete: set[str],
    ) -> None:
        status: dict[str, str] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "MetricDataQueries": list(batch),
                "StartTime": start,
                "EndTime": end,
                "ScanBy": "TimestampAscending",
            }
            if token:
                kwargs["NextToken"] = token
            self.calls_pace.take()
            self.points_pace.take(sum(requested_points(q, start, end) for q in batch))
            response = self.cloudwatch.get_metric_data(**kwargs)
            self._count(calls=1, queries=len(batch))
            for res in response["MetricDataResults"]:
                key = owner[res["Id"]]
                points.setdefault(key, []).extend(
                    (ts.astimezone(UTC), float(v)) for ts, v in zip(res["Timestamps"], res["Values"], strict=True)
                )
                status[res["Id"]] = res.get("StatusCode", "Complete")
            token = response.get("NextToken")
            if not token:
                break
        for query_id, code in status.items():
            if code != "Complete":  # PartialData left after the last page, InternalError, Forbidden
                incomplete.add(owner[query_id][0])
        for q in batch:
            if q["Id"] not in status:
                incomplete.add(owner[q["Id"]][0])


def _human_point(point: Point, period: timedelta, end: datetime) -> Point:
    """A Minimum of minutes since input over one period, at the period's end (or `end`, for the period still
    under way): each value it took was sampled by then, so the input it places (time - minutes) is never earlier
    than any of them placed it; timed at the period's start, a value sampled late in it placed the input up to
    a period early, and the machine looked idle that much sooner."""
    at, minutes = point
    return min(at + period, end), minutes


def unreadable_sources(cloudwatch: Any, instance_ids: Sequence[str], end: datetime) -> dict[str, list[str]]:
    """Per machine whose collector reported in the last 15 minutes, the sources it could not read (an
    empty list: it read them all). One GetMetricData call per 500 machines; for `idle-reaper status`."""
    found: dict[str, list[str]] = {}
    for batch in chunks(list(instance_ids), METRIC_QUERIES_PER_CALL):
        queries = [
            {
                "Id": f"u{i}",
                "MetricStat": {
                    "Metric": {
                        "Namespace": HUMAN_METRIC_NAMESPACE,
                        "MetricName": UNREADABLE_METRIC_NAME,
                        "Dimensions": [{"Name": "InstanceId", "Value": instance_id}],
                    },
                    "Period": 900,
                    "Stat": "Maximum",
                },
                "ReturnData": True,
            }
            for i, instance_id in enumerate(batch)
        ]
        response = cloudwatch.get_metric_data(
            MetricDataQueries=queries, StartTime=end - timedelta(minutes=15), EndTime=end
        )
        for result in response["MetricDataResults"]:
            if result["Values"]:
                found[batch[int(result["Id"][1:])]] = unreadable_source_names(int(max(result["Values"])))
    return found
