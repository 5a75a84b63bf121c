"""A fake CloudWatch (GetMetricData over generated utilisation profiles) and the profiles themselves."""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from testkit.aws.clients import FakeClient, api

# A utilization profile: period start -> (cpu %, gpu % or None, network in bytes, network out bytes,
# minutes since a person's last input).
# Shorter tuples are fine: a missing or None entry means that metric has no datapoints.
Profile = Callable[[datetime], Sequence[float | None]]


def steady(cpu: float, gpu: float | None = None) -> Profile:
    values = (cpu, gpu)
    return lambda t: values


def quiet_after(change: datetime, before: Sequence[float | None], after: Sequence[float | None]) -> Profile:
    """Busy (`before`) until `change`, then `after` (typically quiet)."""
    before, after = tuple(before), tuple(after)
    return lambda t: before if t < change else after


# ---------------------------------------------------------------------------------------------
# CloudWatch


_QUERY_ID = re.compile(r"^[a-z][a-zA-Z0-9_]*$")
_STATS = {"Average", "Maximum", "Minimum", "Sum", "SampleCount"}

DEFAULT_METRICS = {
    ("AWS/EC2", "CPUUtilization"): 0,
    ("CWAgent", "nvidia_smi_utilization_gpu"): 1,
    ("AWS/EC2", "NetworkIn"): 2,
    ("AWS/EC2", "NetworkOut"): 3,
    ("CWAgent", "idle_reaper_minutes_since_input"): 4,  # the activity collector's minutes since input
}


class FakeCloudWatch(FakeClient):
    """GetMetricData over per-instance profiles. A datapoint for the period starting at t exists once
    t + period + `delay` has passed (EndTime is the clock) and t is not before the launch."""

    service = "cloudwatch"
    MAX_QUERIES = 500
    MAX_DATAPOINTS = 100_800

    def __init__(
        self,
        metrics: dict[tuple[str, str], int] | None = None,
        *,
        points_per_call: int = MAX_DATAPOINTS,
        delay: timedelta = timedelta(minutes=2),
    ) -> None:
        super().__init__()
        self.metric_index = dict(metrics or DEFAULT_METRICS)
        self.points_per_call = points_per_call
        self.delay = delay
        self.profiles: dict[str, Profile] = {}
        self.data_from: dict[str, datetime] = {}
        self.partial_data: set[str] = set()  # queries for these instances end PartialData after the last page
        self.throttled: set[str] = set()  # any call querying these instances raises Throttling
        self.metrics_requested = 0  # what GetMetricData bills: one per query per call
        self._grids: dict[tuple[datetime, datetime, int], tuple[list[int], list[datetime]]] = {}
        self.datapoints_returned = 0

    def add(self, instance_id: str, profile: Profile, data_from: datetime) -> None:
        self.profiles[instance_id] = profile
        self.data_from[instance_id] = data_from

    @api
    def get_metric_data(
        self,
        MetricDataQueries: Sequence[dict[str, Any]],
        StartTime: datetime,
        EndTime: datetime,
        NextToken: str | None = None,
        ScanBy: str = "TimestampDescending",
        **_: Any,
    ) -> dict[str, Any]:
        op = "GetMetricData"
        self._call(
            op,
            {
                "MetricDataQueries": MetricDataQueries,
                "StartTime": StartTime,
                "EndTime": EndTime,
                "NextToken": NextToken,
            },
        )
        self.metrics_requested += len(MetricDataQueries)
        self._validate(MetricDataQueries, StartTime, EndTime)
        if self.throttled and any(self._instance(q) in self.throttled for q in MetricDataQueries):
            raise self._error(op, "Throttling", "Rate exceeded")
        if NextToken:
            if NextToken not in self._cursors:
                raise self._error(op, "InvalidNextToken", "The service cannot decode the token")
            series, qi, pi = self._cursors.pop(NextToken)
            if len(series) != len(MetricDataQueries):
                raise self._error(op, "InvalidNextToken", "NextToken does not match the queries")
        else:
            series, qi, pi = self._series(MetricDataQueries, StartTime, EndTime, ScanBy == "TimestampAscending"), 0, 0
        budget = self.points_per_call
        results = []
        while qi < len(series) and budget > 0:
            query_id, label, timestamps, values, partial = series[qi]
            take = min(budget, len(timestamps) - pi)
            done = pi + take >= len(timestamps)
            results.append(
                {
                    "Id": query_id,
                    "Label": label,
                    "Timestamps": timestamps[pi : pi + take],
                    "Values": values[pi : pi + take],
                    "StatusCode": "PartialData" if partial or not done else "Complete",
                }
            )
            budget -= take
            self.datapoints_returned += take
            qi, pi = (qi + 1, 0) if done else (qi, pi + take)
        out: dict[str, Any] = {"MetricDataResults": results, "Messages": []}
        if qi < len(series):
            token = f"gmd-{next(self._tokens)}"
            self._cursors[token] = (series, qi, pi)
            out["NextToken"] = token
        return out

    def _validate(self, queries: Sequence[dict[str, Any]], start: datetime, end: datetime) -> None:
        op = "GetMetricData"
        if not queries:
            raise self._error(op, "ValidationError", "The parameter MetricDataQueries is required.")
        if len(queries) > self.MAX_QUERIES:
            raise self._error(
                op, "ValidationError", "The collection MetricDataQueries must not have a size greater than 500."
            )
        if start >= end:
            raise self._error(op, "ValidationError", "The parameter StartTime must be less than the parameter EndTime.")
        ids = [q["Id"] for q in queries]
        if len(set(ids)) != len(ids):
            raise self._error(op, "ValidationError", "The values for parameter Id in MetricDataQueries are not unique.")
        for q in queries:
            if not _QUERY_ID.match(q["Id"]):
                raise self._error(op, "ValidationError", f"Invalid metric data query Id {q['Id']!r}")
            stat = q["MetricStat"]
            if stat["Period"] % 60 or stat["Stat"] not in _STATS:
                raise self._error(op, "ValidationError", f"Invalid Period or Stat in query {q['Id']}")

    @staticmethod
    def _instance(query: dict[str, Any]) -> str | None:
        dims = query["MetricStat"]["Metric"].get("Dimensions", [])
        if len(dims) == 1 and dims[0]["Name"] == "InstanceId":
            return str(dims[0]["Value"])
        return None  # any other dimension set is a different metric: no data here

    def _series(
        self, queries: Sequence[dict[str, Any]], start: datetime, end: datetime, ascending: bool
    ) -> list[tuple[str, str, list[datetime], list[float], bool]]:
        series = []
        rows: dict[tuple[str, int], list[tuple[datetime, Sequence[float | None]]]] = {}
        for q in queries:
            stat = q["MetricStat"]
            metric, period = stat["Metric"], int(stat["Period"])
            index = self.metric_index.get((metric["Namespace"], metric["MetricName"]))
            instance = self._instance(q)
            timestamps: list[datetime] = []
            values: list[float] = []
            if index is not None and instance in self.profiles:
                key = (instance, period)
                if key not in rows:  # the profile is evaluated once per instance per call
                    profile = self.profiles[instance]
                    rows[key] = [(t, profile(t)) for t in self._grid(start, end, period, self.data_from[instance])]
                for t, sample in rows[key]:
                    if index < len(sample) and sample[index] is not None:
                        timestamps.append(t)
                        values.append(float(sample[index]))  # type: ignore[arg-type]
            if not ascending:
                timestamps.reverse()
                values.reverse()
            label = f"{metric['MetricName']} {instance}"
            series.append((q["Id"], label, timestamps, values, instance in self.partial_data))
        return series

    def _grid(self, start: datetime, end: datetime, period: int, data_from: datetime) -> list[datetime]:
        key = (start, end, period)
        if key not in self._grids:  # the same for every instance of a sweep: built once
            first = math.ceil(start.timestamp() / period) * period
            last_end = (end - self.delay).timestamp()  # the newest published period ends before this
            epochs = list(range(first, int(last_end) - period + 1, period))
            self._grids = {key: (epochs, [datetime.fromtimestamp(e, tz=UTC) for e in epochs])}
        epochs, times = self._grids[key]
        return times[bisect.bisect_left(epochs, data_from.timestamp()) :]
