"""Trace replay: the real decision core over a utilization trace, with a simulated clock and in-memory state.

`idle-reaper replay TRACE.csv` answers "what would idle-reaper have done to this fleet, and what would it
have saved?" Samples are bucketed to the sweep period (Maximum per bucket: what the sweep reads), and
every period `core.assess` + `core.decide` run for every running machine on the points a real sweep
would have fetched. Warnings are assumed delivered at once (as after a successful Slack post).

The counterfactual model: the trace is the demand, what each machine would have done had it kept
running. After a stop the machine reports nothing and stays stopped until the trace shows activity
again (a bucket at or above a threshold): its owner wanted it back, so it restarts there, with a new
launch time. Quiet samples while stopped are what the stop saved; they are never shown to the core.

Scoring, per machine, from the trace alone (see docs/replay.md):
- a bucket is *busy* when any value is at or above its threshold, *quiet* when it is below every
  threshold and covered the way the core requires (holes up to max_gap count as covered), else unknown;
- idle hours: all quiet time; ideal: a clairvoyant reaper with the same window stops every quiet
  stretch exactly one window in and, like the replay, keeps it stopped until activity;
- recovered hours: quiet time during which the replayed machine was stopped;
- a false stop: a stop with a busy bucket in the window before it.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import os
import random
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from itertools import repeat
from pathlib import Path
from typing import Any, Literal, TextIO

from idle_reaper.core import (
    REAP_ACTIONS,
    Action,
    Machine,
    MachineRecord,
    Signals,
    State,
    assess,
    decide,
    is_gpu_type,
    keep_until,
    snooze,
    started_by_person,
)
from idle_reaper.policy import (
    DEFAULT_GPU_FAMILIES,
    PolicyError,
    TeamPolicy,
    TeamPolicyRef,
    parse_team_policy,
)
from idle_reaper.pricing import DEFAULT_PRICES, load_price_table

NAN = math.nan
REQUIRED_COLUMNS = ("timestamp", "instance_id", "cpu")
OPTIONAL_COLUMNS = ("gpu", "team", "instance_type", "network")
DEFAULT_TEAM = "default"
SNOOZE_CHOICE = "keep_2h"  # the answer assumed for --snooze-rate
SNOOZER = "replay-user"  # who answers and restarts machines in the replay
BASELINES = ("cloudwatch-cpu",)

# Fleet state per bucket, for the timeline plot.
BUSY, IDLE, WARNED, STOPPED, UNKNOWN = range(5)
STATE_NAMES = ("busy", "idle", "warned", "stopped", "unknown")
_STATE_CODE = {
    State.ACTIVE: BUSY,
    State.IDLE: IDLE,
    State.WARNED: WARNED,
    State.SNOOZED: WARNED,
    State.REAPED: STOPPED,
}


# ---------------------------------------------------------------------------------------------
# Reading a trace


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, the line and the column."""

    def __init__(self, source: str, line: int | None, message: str, column: str | None = None) -> None:
        self.source = source
        self.line = line
        self.column = column
        where = f"{source}:{line}" if line is not None else source
        what = f" column {column!r}:" if column else ""
        super().__init__(f"{where}:{what} {message}")


@dataclass
class Series:
    """One machine's samples on the bucket grid: bucket i starts at (first_bucket + i) * period."""

    instance_id: str
    team: str
    instance_type: str
    first_bucket: int
    cpu: array[float]  # Maximum per bucket; NaN where the trace has no sample
    gpu: array[float]
    network: array[float]  # bytes per second, in + out

    def __len__(self) -> int:
        return len(self.cpu)

    @property
    def has_gpu(self) -> bool:
        return any(v == v for v in self.gpu)


@dataclass
class Trace:
    source: str
    period_seconds: int
    series: list[Series]
    has_network: bool = False
    clamped: int = 0  # values above 100 read as 100 (clamp_utilization)
    skipped_duplicates: int = 0  # rows repeating the previous one of their instance (skip_duplicates)

    @property
    def notes(self) -> list[str]:
        notes = []
        if self.clamped:
            notes.append(f"{self.clamped:,} values above 100 read as 100")
        if self.skipped_duplicates:
            notes.append(f"{self.skipped_duplicates:,} repeated rows skipped")
        return notes


class _Builder:
    """Accumulates one instance's rows while the file streams past (rows are sorted per instance)."""

    __slots__ = (
        "cpu",
        "first",
        "gpu",
        "instance_type",
        "last_bucket",
        "last_line",
        "last_row",
        "last_ts",
        "net",
        "team",
    )

    def __init__(self, bucket: int) -> None:
        self.first = bucket
        self.last_bucket = bucket - 1
        self.last_ts = -math.inf
        self.last_line = 0
        self.last_row: list[str] = []
        self.team: tuple[str, int] | None = None
        self.instance_type: tuple[str, int] | None = None
        self.cpu: array[float] = array("d")
        self.gpu: array[float] = array("d")
        self.net: array[float] = array("d")


def _timestamp(text: str, source: str, line: int) -> float:
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise TraceError(source, line, f"not an ISO-8601 time: {text!r}", "timestamp") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)  # a trace without offsets is read as UTC, like CloudWatch exports
    return value.timestamp()


class _Clamp:
    """Counts values read as 100 under clamp_utilization; None where clamping is off."""

    def __init__(self) -> None:
        self.count = 0


def _value(text: str, column: str, high: float, source: str, line: int, clamp: _Clamp | None = None) -> float:
    """A metric cell; empty means no datapoint for this metric in this sample."""
    if not text or text.isspace():
        return NAN
    try:
        v = float(text)
    except ValueError:
        raise TraceError(source, line, f"not a number: {text!r}", column) from None
    if not 0.0 <= v <= high:  # also rejects nan
        if clamp is not None and v > high and v != math.inf:
            clamp.count += 1
            return high
        if high == 100.0:
            hint = "" if v < 0 or v != v else " (--clamp-utilization reads values above 100 as 100)"
            raise TraceError(source, line, f"{text.strip()!r} is outside 0-100{hint}", column)
        raise TraceError(source, line, f"{text.strip()!r} is not a rate of 0 or more bytes per second", column)
    return v


def _label(
    builder: _Builder, slot: Literal["team", "instance_type"], value: str, iid: str, source: str, line: int
) -> None:
    """Team and instance type may be given on any row, but must not change within an instance."""
    known: tuple[str, int] | None = getattr(builder, slot)
    if known is None:
        setattr(builder, slot, (value, line))
    elif known[0] != value:
        raise TraceError(source, line, f"{iid} was {known[0]!r} at line {known[1]}, now {value!r}", slot)


def parse_trace(
    lines: Iterable[str],
    source: str,
    period_seconds: int = 300,
    *,
    clamp_utilization: bool = False,
    skip_duplicates: bool = False,
) -> Trace:
    """Stream a CSV trace into per-machine bucket series. Raises TraceError naming the line.

    Two opt-in allowances for real exports, both off by default (then such rows are errors):
    clamp_utilization reads CPU and GPU values above 100 as 100 (Bitbrains measures against provisioned
    capacity and overshoots a little); skip_duplicates drops a row identical to the previous row of its
    instance (a repeated export line). A duplicate timestamp with different values is always an error."""
    reader = csv.reader(lines)
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(source, 1, "empty file: expected a header with timestamp, instance_id, cpu") from None
    except csv.Error as exc:
        raise TraceError(source, 1, f"not CSV: {exc}") from None
    names = [h.strip().lower() for h in header]
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise TraceError(
            source,
            1,
            f"missing column(s) {', '.join(missing)}; the header has: {', '.join(names) or '(nothing)'} "
            f"(required: {', '.join(REQUIRED_COLUMNS)}; optional: {', '.join(OPTIONAL_COLUMNS)})",
        )
    repeated = sorted({n for n in names if n and names.count(n) > 1})
    if repeated:
        raise TraceError(source, 1, f"repeated column(s) {', '.join(repeated)}")
    col = {n: i for i, n in enumerate(names)}
    i_ts, i_id, i_cpu = col["timestamp"], col["instance_id"], col["cpu"]
    i_gpu, i_net = col.get("gpu"), col.get("network")
    i_team, i_type = col.get("team"), col.get("instance_type")
    width = len(names)

    ts_cache: dict[str, float] = {}  # a fleet's rows share their timestamps: parse each once
    builders: dict[str, _Builder] = {}
    clamp = _Clamp() if clamp_utilization else None
    skipped = 0
    line = 1
    try:
        for row in reader:
            line = reader.line_num
            if len(row) != width:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue  # a blank line
                raise TraceError(source, line, f"expected {width} fields like the header, got {len(row)}")
            ts_text = row[i_ts]
            ts = ts_cache.get(ts_text)
            if ts is None:
                if len(ts_cache) > 100_000:
                    ts_cache.clear()
                ts = ts_cache[ts_text] = _timestamp(ts_text, source, line)
            iid = row[i_id].strip()
            if not iid:
                raise TraceError(source, line, "empty", "instance_id")
            bucket = int(ts // period_seconds)
            b = builders.get(iid)
            if b is None:
                b = builders[iid] = _Builder(bucket)
            elif ts <= b.last_ts:
                if ts == b.last_ts:
                    if skip_duplicates and row == b.last_row:
                        skipped += 1
                        continue
                    hint = "" if row != b.last_row else " (--skip-duplicates drops identical repeats)"
                    raise TraceError(
                        source, line, f"duplicate sample for {iid} at {ts_text} (also at line {b.last_line}){hint}"
                    )
                raise TraceError(
                    source,
                    line,
                    f"rows are not sorted by time for {iid}: {ts_text} comes after line {b.last_line}, which is later",
                )
            b.last_ts, b.last_line, b.last_row = ts, line, row
            cpu = _value(row[i_cpu], "cpu", 100.0, source, line, clamp)
            gpu = NAN if i_gpu is None else _value(row[i_gpu], "gpu", 100.0, source, line, clamp)
            net = NAN if i_net is None else _value(row[i_net], "network", math.inf, source, line)
            if i_team is not None and (team := row[i_team].strip()):
                _label(b, "team", team, iid, source, line)
            if i_type is not None and (itype := row[i_type].strip()):
                _label(b, "instance_type", itype, iid, source, line)

            if bucket == b.last_bucket:  # several samples in one period: keep the Maximum
                if cpu > b.cpu[-1] or b.cpu[-1] != b.cpu[-1]:
                    b.cpu[-1] = cpu
                if gpu > b.gpu[-1] or b.gpu[-1] != b.gpu[-1]:
                    b.gpu[-1] = gpu
                if net > b.net[-1] or b.net[-1] != b.net[-1]:
                    b.net[-1] = net
                continue
            hole = bucket - b.last_bucket - 1
            if hole:  # a gap stays a gap: NaN, never a value
                padding = [NAN] * hole
                b.cpu.extend(padding)
                b.gpu.extend(padding)
                b.net.extend(padding)
            b.cpu.append(cpu)
            b.gpu.append(gpu)
            b.net.append(net)
            b.last_bucket = bucket
    except csv.Error as exc:
        raise TraceError(source, line, f"not valid CSV: {exc}") from None
    if not builders:
        raise TraceError(source, None, "no samples after the header")
    series = [
        Series(
            instance_id=iid,
            team=b.team[0] if b.team else DEFAULT_TEAM,
            instance_type=b.instance_type[0] if b.instance_type else "",
            first_bucket=b.first,
            cpu=b.cpu,
            gpu=b.gpu,
            network=b.net,
        )
        for iid, b in builders.items()
    ]
    return Trace(
        source=source,
        period_seconds=period_seconds,
        series=series,
        has_network=i_net is not None,
        clamped=clamp.count if clamp else 0,
        skipped_duplicates=skipped,
    )


def read_trace(
    path: str | Path, period_minutes: int = 5, *, clamp_utilization: bool = False, skip_duplicates: bool = False
) -> Trace:
    """A .csv or gzip-compressed .csv(.gz) trace file (detected by content, not by name)."""
    source = str(path)
    try:
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        stream: TextIO = (
            gzip.open(path, "rt", encoding="utf-8-sig", newline="")  # noqa: SIM115 (closed by the with below)
            if gzipped
            else open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115
        )
    except OSError as exc:
        raise TraceError(source, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        with stream:
            return parse_trace(
                stream,
                source,
                period_minutes * 60,
                clamp_utilization=clamp_utilization,
                skip_duplicates=skip_duplicates,
            )
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(source, None, f"cannot read: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True)
class PolicySet:
    """The policy of every team in the replay: a default plus per-team overrides."""

    default: TeamPolicy = field(default_factory=TeamPolicy)
    teams: Mapping[str, TeamPolicy] = field(default_factory=dict)
    source: str = "default policy"
    gpu_families: tuple[str, ...] = DEFAULT_GPU_FAMILIES

    def for_team(self, team: str) -> TeamPolicy:
        return self.teams.get(team, self.default)

    def ref(self, team: str) -> TeamPolicyRef:
        return TeamPolicyRef(team=team, policy=self.for_team(team), source=self.source, version=None)

    def describe(self, team: str | None = None) -> str:
        p = self.default if team is None else self.for_team(team)
        net = (
            f", network < {p.network_threshold_bytes_per_second:,.0f} B/s"
            if p.network_threshold_bytes_per_second
            else ""
        )
        return (
            f"idle {p.idle_minutes} min, warn {p.warn_minutes} min before, CPU < {p.cpu_threshold_percent:g}%, "
            f"GPU < {p.gpu_threshold_percent:g}%{net}, max gap {p.max_gap_minutes} min"
        )


def load_policies(path: str | Path | None) -> PolicySet:
    """Either one team policy (JSON, a partial override of the defaults, as in SSM), applied to every
    team, or {"default_policy": {...}, "teams": {"name": {...}}, "gpu_instance_families": [...]}.
    Raises PolicyError naming the file and every bad field."""
    if path is None:
        return PolicySet()
    name = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PolicyError(name, [f"cannot read: {exc.strerror or exc}"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # parse_team_policy reports the JSON error with its position
    structured = isinstance(data, dict) and bool({"default_policy", "teams", "gpu_instance_families"} & data.keys())
    if not structured or not isinstance(data, dict):
        return PolicySet(default=parse_team_policy(name, text, TeamPolicy()), source=name)
    unknown = sorted(set(data) - {"default_policy", "teams", "gpu_instance_families"})
    if unknown:
        raise PolicyError(name, [f"{key}: unknown key" for key in unknown])
    default = parse_team_policy(f"{name} default_policy", json.dumps(data.get("default_policy", {})), TeamPolicy())
    teams_data = data.get("teams", {})
    if not isinstance(teams_data, dict):
        raise PolicyError(name, ["teams: expected an object of team name to policy"])
    teams = {
        str(team): parse_team_policy(f"{name} teams.{team}", json.dumps(value), default)
        for team, value in teams_data.items()
    }
    families = data.get("gpu_instance_families", list(DEFAULT_GPU_FAMILIES))
    if not isinstance(families, list) or not all(isinstance(f, str) for f in families):
        raise PolicyError(name, ["gpu_instance_families: expected a list of instance families"])
    return PolicySet(default=default, teams=teams, source=name, gpu_families=tuple(families))


# ---------------------------------------------------------------------------------------------
# What the trace itself says: busy, quiet or unknown per bucket


def _covered(values: Sequence[float], gap: int) -> bytearray:
    """Buckets the core counts as covered: a sample, or a hole's first `gap` buckets (the lag the core
    accepts at the end of the data), or the last `gap` buckets before a track's first sample (the core
    allows a leading hole of max_gap, bounded by the launch time)."""
    n = len(values)
    covered = bytearray(n)
    first = next((i for i, v in enumerate(values) if v == v), None)
    if first is None:
        return covered
    for i in range(max(0, first - gap), first):
        covered[i] = 1
    hole = 0
    for i in range(first, n):
        v = values[i]
        if v == v:
            covered[i] = 1
            hole = 0
        else:
            covered[i] = hole < gap
            hole += 1
    return covered


@dataclass
class Truth:
    busy: bytearray  # any value at or above its threshold: activity, what restarts a stopped machine
    quiet: bytearray  # below every threshold and covered: idle time
    prefix_busy: list[int]  # prefix_busy[i] = busy buckets before i, for "busy within the window" in O(1)

    def busy_between(self, lo: int, hi: int) -> bool:
        lo = max(lo, 0)
        return hi > lo and self.prefix_busy[hi] - self.prefix_busy[lo] > 0


def classify(series: Series, policy: TeamPolicy, period_seconds: int, gpu_families: Iterable[str]) -> Truth:
    n = len(series)
    gap = policy.max_gap_minutes * 60 // period_seconds
    has_gpu = series.has_gpu
    tracks: list[tuple[Sequence[float], float]] = [(series.cpu, policy.cpu_threshold_percent)]
    if has_gpu:
        tracks.append((series.gpu, policy.gpu_threshold_percent))
    if policy.network_threshold_bytes_per_second is not None:
        tracks.append((series.network, policy.network_threshold_bytes_per_second))
    busy = bytearray(n)
    covered = bytearray(b"\x01") * n
    for values, threshold in tracks:
        track_covered = _covered(values, gap)
        for i, v in enumerate(values):
            if v >= threshold:  # NaN compares False: a hole is never busy
                busy[i] = 1
            if not track_covered[i]:
                covered[i] = 0
    # A GPU machine that never reports GPU metrics is never idle under missing_gpu_metrics=busy.
    blind = not has_gpu and policy.missing_gpu_metrics == "busy" and is_gpu_type(series.instance_type, gpu_families)
    quiet = bytearray(n) if blind else bytearray(c and not b for c, b in zip(covered, busy, strict=True))
    prefix = [0] * (n + 1)
    total = 0
    for i, b in enumerate(busy):
        total += b
        prefix[i + 1] = total
    return Truth(busy=busy, quiet=quiet, prefix_busy=prefix)


def ideal_buckets(truth: Truth, window: int) -> int:
    """A clairvoyant reaper with the same window: each quiet stretch stopped exactly `window` buckets
    in, kept stopped (like the replay) until the trace shows activity. Quiet buckets it saves."""
    saved = 0
    run = 0
    stopped = False
    for busy, quiet in zip(truth.busy, truth.quiet, strict=True):
        if stopped:
            if busy:
                stopped, run = False, 0
            else:
                saved += quiet
            continue
        run = run + 1 if quiet else 0
        stopped = run >= window
    return saved


# ---------------------------------------------------------------------------------------------
# The replay of one machine


@dataclass(frozen=True)
class StopEvent:
    instance_id: str
    at: datetime
    reason: str
    false_stop: bool  # a busy bucket in the window before the stop
    resumed_after_minutes: float | None  # activity after the stop (the owner wanted it back); None: never


@dataclass
class MachineRun:
    """What happened to one machine under one reaper (idle-reaper or a baseline). Small and picklable:
    worker processes send these back."""

    instance_id: str
    team: str
    instance_type: str
    first_bucket: int
    buckets: int
    quiet: int  # buckets
    ideal: int
    recovered: int = 0
    stopped: int = 0
    warnings: int = 0  # delivered to a person
    silent_warnings: int = 0  # recorded but not sent (the policy's quiet hours)
    snoozes: int = 0
    core_calls: int = 0  # sweeps that ran assess + decide (the rest took the fast path or were stopped)
    stops: list[StopEvent] = field(default_factory=list)
    timeline: bytearray | None = None  # a state code per bucket


@dataclass(frozen=True)
class ReplayOptions:
    policies: PolicySet = PolicySet()
    still_wanted_minutes: int = 60
    snooze_rate: float = 0.0
    seed: int = 0
    default_instance_type: str | None = None  # for machines whose trace has no instance_type
    timeline: bool = False
    # Skip calling the core when its answer is already determined (see _replay_reaper). Off: call it
    # every period, the reference the fast path is tested against.
    fast_path: bool = True


class _Clock:
    """Bucket numbers to aware datetimes, each made once and shared by every machine."""

    def __init__(self, period_seconds: int) -> None:
        self.period_seconds = period_seconds
        self.period = timedelta(seconds=period_seconds)
        self._cache: dict[int, datetime] = {}

    def times(self, first_bucket: int, count: int) -> list[datetime]:
        cache, p = self._cache, self.period_seconds
        out = []
        for b in range(first_bucket, first_bucket + count):
            t = cache.get(b)
            if t is None:
                t = cache[b] = datetime.fromtimestamp(b * p, UTC)
            out.append(t)
        return out


def _record_stop(
    run: MachineRun, truth: Truth, at: int, reason: str, at_time: datetime, window: int, clock: _Clock
) -> int | None:
    """Book a stop issued at the start of bucket `at`; return the bucket where the machine restarts."""
    n = run.buckets
    false_stop = truth.busy_between(at - window, at)
    restart = next((j for j in range(at, n) if truth.busy[j]), None)
    end = n if restart is None else restart
    run.stopped += end - at
    run.recovered += sum(truth.quiet[at:end])
    resumed = None if restart is None else (restart - at) * clock.period_seconds / 60
    run.stops.append(StopEvent(run.instance_id, at_time, reason, false_stop, resumed))
    if run.timeline is not None:
        run.timeline[at:end] = bytes([STOPPED]) * (end - at)
        if restart is not None:
            run.timeline[restart] = BUSY
    return restart


def _new_run(series: Series, truth: Truth, window: int) -> MachineRun:
    return MachineRun(
        series.instance_id,
        series.team,
        series.instance_type,
        series.first_bucket,
        len(series),
        sum(truth.quiet),
        ideal_buckets(truth, window),
    )


def _window_buckets(policy: TeamPolicy, period_seconds: int) -> int:
    return math.ceil(policy.idle_minutes * 60 / period_seconds)


def _lookback(policy: TeamPolicy, period_seconds: int) -> int:
    """Buckets a sweep fetches: the idle window + max gap + one period (sweep._fetch_signals)."""
    return math.ceil((policy.idle_minutes + policy.max_gap_minutes) * 60 / period_seconds) + 1


def _replay_reaper(series: Series, truth: Truth, opts: ReplayOptions, clock: _Clock) -> MachineRun:
    """Sweep one machine every period with the real core, as sweep.run_sweep does: the policy in force
    at `now` (schedules), assess on the points a sweep would fetch, decide, then act on the decision."""
    policies = opts.policies
    policy = policies.for_team(series.team)
    base_ref = policies.ref(series.team)
    scheduled = bool(policy.schedules)  # then the policy in force changes with the time of day
    families = policies.gpu_families
    n = len(series)
    period_seconds = clock.period_seconds
    window = _window_buckets(policy, period_seconds)
    lookback = _lookback(policy, period_seconds)
    times = clock.times(series.first_bucket, n + 1)
    period = clock.period
    cpu, gpu, net = series.cpu, series.gpu, series.network
    use_net = policy.network_threshold_bytes_per_second is not None
    seconds = float(period_seconds)
    gpu_blind_unknown = is_gpu_type(series.instance_type, families) and policy.missing_gpu_metrics == "busy"
    busy = truth.busy
    # seen[i]: buckets before i with any datapoint the core reads; an empty window costs O(1) to spot.
    seen = [0] * (n + 1)
    for i in range(n):
        seen[i + 1] = seen[i] + (cpu[i] == cpu[i] or gpu[i] == gpu[i] or (use_net and net[i] == net[i]))
    run = _new_run(series, truth, window)
    if opts.timeline:
        run.timeline = bytearray([UNKNOWN]) * n
    timeline = run.timeline
    rng = random.Random(f"{opts.seed}/{series.instance_id}") if opts.snooze_rate > 0 else None

    machine = Machine(series.instance_id, series.instance_type, series.team, launch_time=times[0])
    record: MachineRecord | None = None
    launch = 0
    # What the core's last answer settled into, while its inputs keep it there (see the fast paths).
    settled: Literal["active", "unknown"] | None = None
    k = 1  # the sweep at the start of bucket k sees buckets < k
    while k <= n:
        now = times[k]
        newest = k - 1
        # Fast paths: skip the call when the core's answer is already determined, and keep the record
        # it wrote last (only its version and timestamps would differ). Tests compare every trace they
        # replay with fast_path=False, which calls the core every period. Not with schedules: their
        # thresholds and windows may differ from the ones `busy` and `lookback` were computed with.
        if settled is not None and opts.fast_path and not scheduled:
            # The newest bucket is busy on a track the core judges: assess() can only say "busy, quiet
            # for 0 min" (its one earlier exit, a GPU type without GPU points, is excluded), and decide()
            # keeps an active, settled record as it is.
            if settled == "active" and busy[newest] and (not gpu_blind_unknown or gpu[newest] == gpu[newest]):
                if timeline is not None and k < n:
                    timeline[k] = BUSY
                k += 1
                continue
            # No datapoint at all in the window (a machine its owner stopped has no rows): assess() can
            # only say "unknown", and decide() changes nothing for an unknown machine.
            if settled == "unknown" and seen[k] == seen[max(k - lookback, launch)]:
                if timeline is not None and k < n:
                    timeline[k] = UNKNOWN
                k += 1
                continue

        ref = base_ref.at(now) if scheduled else base_ref
        in_force = ref.policy or policy
        lo = max(k - _lookback(in_force, period_seconds), launch)
        signals = Signals(
            cpu=[(times[i], v) for i in range(lo, k) if (v := cpu[i]) == v],
            gpu=[(times[i], v) for i in range(lo, k) if (v := gpu[i]) == v],
            network_in=[(times[i], v * seconds) for i in range(lo, k) if (v := net[i]) == v] if use_net else (),
            network_out=[(times[i], 0.0) for i in range(lo, k) if net[i] == net[i]] if use_net else (),
        )
        assessment = assess(machine, signals, in_force, now=now, period=period, gpu_families=families)
        decision = decide(machine, ref, assessment, record, now=now)
        record = decision.record
        run.core_calls += 1

        if decision.action in REAP_ACTIONS and decision.applied:
            restart = _record_stop(run, truth, k, decision.reason, now, window, clock)
            if restart is None:
                break
            # A stopped machine reports nothing; its owner starts it again where the trace shows activity.
            launch = restart
            machine = replace(machine, launch_time=times[restart])
            record = started_by_person(record, SNOOZER, times[restart])
            settled = None
            k = restart + 1
            continue
        if decision.action is Action.WARN:
            if decision.deliver_warning:
                run.warnings += 1
                # Delivered at once, as the sweep records after a successful notifier.warn().
                record = replace(record, version=record.version + 1, warning_delivered_at=now)
                if rng is not None and rng.random() < opts.snooze_rate:
                    until = keep_until(SNOOZE_CHOICE, in_force, now)
                    kept = snooze(record, in_force, SNOOZER, until, now) if until else "no such choice"
                    if isinstance(kept, MachineRecord):  # else refused, e.g. the daily limit of keeps
                        record = kept
                        run.snoozes += 1
            else:
                run.silent_warnings += 1
        if decision.state is State.UNKNOWN:
            settled = "unknown"
        elif (
            decision.state is State.ACTIVE
            and decision.action is Action.NONE
            and record.idle_since is None
            and record.warned_at is None
        ):
            settled = "active"
        else:
            settled = None
        if timeline is not None and k < n:
            timeline[k] = _STATE_CODE.get(decision.state, UNKNOWN)
        k += 1
    return run


def _replay_cpu_alarm(series: Series, truth: Truth, opts: ReplayOptions, clock: _Clock) -> MachineRun:
    """The AWS-native alternative: a CloudWatch alarm on CPUUtilization < threshold for every datapoint
    of the window (missing data: not breaching) whose action stops the instance. No GPU, no warning.
    It fires when the window's last datapoint arrives, and re-arms when the machine starts again."""
    policy = opts.policies.for_team(series.team)
    threshold = policy.cpu_threshold_percent
    window = _window_buckets(policy, clock.period_seconds)
    n = len(series)
    times = clock.times(series.first_bucket, n + 1)
    run = _new_run(series, truth, window)
    cpu = series.cpu
    breaching = 0
    i = 0
    while i < n:
        v = cpu[i]
        breaching = breaching + 1 if v < threshold else 0  # NaN: missing, not breaching
        if breaching >= window:
            reason = f"CPUUtilization < {threshold:g}% for {window} consecutive datapoints"
            restart = _record_stop(run, truth, i + 1, reason, times[i + 1], window, clock)
            if restart is None:
                break
            breaching = 0
            i = restart
            continue
        i += 1
    return run


# ---------------------------------------------------------------------------------------------
# Totals and the report


@dataclass
class Totals:
    """One reaper's results over the fleet (or one team)."""

    machines: int = 0
    buckets: int = 0
    quiet: int = 0
    ideal: int = 0
    recovered: int = 0
    stopped: int = 0
    stops: int = 0
    false_stops: int = 0
    wanted: int = 0
    warnings: int = 0
    silent_warnings: int = 0
    snoozes: int = 0
    core_calls: int = 0
    dollars: float | None = 0.0
    ideal_dollars: float | None = 0.0
    unpriced_hours: float | None = 0.0

    def add(self, run: MachineRun, hours: float, price: float | None, priced: bool, wanted_minutes: float) -> None:
        self.machines += 1
        self.buckets += run.buckets
        self.quiet += run.quiet
        self.ideal += run.ideal
        self.recovered += run.recovered
        self.stopped += run.stopped
        self.stops += len(run.stops)
        self.false_stops += sum(s.false_stop for s in run.stops)
        self.wanted += sum(
            s.resumed_after_minutes is not None and s.resumed_after_minutes <= wanted_minutes for s in run.stops
        )
        self.warnings += run.warnings
        self.silent_warnings += run.silent_warnings
        self.snoozes += run.snoozes
        self.core_calls += run.core_calls
        if not priced:
            self.dollars = self.ideal_dollars = self.unpriced_hours = None
        elif self.dollars is not None and self.ideal_dollars is not None and self.unpriced_hours is not None:
            if price is None:
                self.unpriced_hours += run.recovered * hours
            else:
                self.dollars += run.recovered * hours * price
                self.ideal_dollars += run.ideal * hours * price


@dataclass
class Result:
    """One reaper's outcome: fleet totals, per-team totals, every stop."""

    name: str
    hours_per_bucket: float
    fleet: Totals = field(default_factory=Totals)
    teams: dict[str, Totals] = field(default_factory=dict)
    stops: list[StopEvent] = field(default_factory=list)

    def hours(self, buckets: int) -> float:
        return buckets * self.hours_per_bucket

    def summary(self, t: Totals | None = None) -> dict[str, Any]:
        t = self.fleet if t is None else t
        machine_days = self.hours(t.buckets) / 24
        ideal = self.hours(t.ideal)
        recovered = self.hours(t.recovered)
        return {
            "machines": t.machines,
            "machine_days": round(machine_days, 3),
            "idle_hours": round(self.hours(t.quiet), 3),
            "ideal_hours": round(ideal, 3),
            "recovered_hours": round(recovered, 3),
            "recovery_ratio": round(recovered / ideal, 4) if ideal else None,
            "stopped_hours": round(self.hours(t.stopped), 3),
            "stops": t.stops,
            "false_stops": t.false_stops,
            "stops_followed_by_activity": t.wanted,
            "warnings": t.warnings,
            "warnings_per_machine_day": round(t.warnings / machine_days, 4) if machine_days else 0.0,
            "silent_warnings": t.silent_warnings,
            "snoozes": t.snoozes,
            "dollars_saved": None if t.dollars is None else round(t.dollars, 2),
            "ideal_dollars": None if t.ideal_dollars is None else round(t.ideal_dollars, 2),
            "unpriced_hours": None if t.unpriced_hours is None else round(t.unpriced_hours, 3),
            "core_calls": t.core_calls,
        }


@dataclass
class Replay:
    trace: Trace
    options: ReplayOptions
    price_source: str | None  # None: no usable price table, savings unknown
    reaper: Result
    baseline: Result | None
    seconds: float
    timeline: dict[str, list[int]] | None = None  # state name -> machines in that state per bucket
    timeline_start: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        p = self.options.policies
        out: dict[str, Any] = {
            "trace": self.trace.source,
            "period_minutes": self.trace.period_seconds // 60,
            "policy": {"source": p.source, "default": p.default.model_dump(mode="json")}
            | ({"teams": {t: v.model_dump(mode="json") for t, v in p.teams.items()}} if p.teams else {}),
            "price_table": self.price_source,
            "still_wanted_minutes": self.options.still_wanted_minutes,
            "snooze_rate": self.options.snooze_rate,
            **self.reaper.summary(),
            "teams": {team: self.reaper.summary(t) for team, t in sorted(self.reaper.teams.items())},
            "replay_seconds": round(self.seconds, 3),
        }
        if self.baseline is not None:
            out["baseline"] = {
                "name": self.baseline.name,
                **self.baseline.summary(),
                "teams": {team: self.baseline.summary(t) for team, t in sorted(self.baseline.teams.items())},
            }
        return out


def _replay_chunk(
    chunk: Sequence[Series], options: ReplayOptions, period_seconds: int, baseline: str | None
) -> list[tuple[MachineRun, MachineRun | None]]:
    """Replay some machines (in a worker process, or in this one)."""
    clock = _Clock(period_seconds)
    policies = options.policies
    out: list[tuple[MachineRun, MachineRun | None]] = []
    for series in chunk:
        truth = classify(series, policies.for_team(series.team), period_seconds, policies.gpu_families)
        reaper = _replay_reaper(series, truth, options, clock)
        alarm = _replay_cpu_alarm(series, truth, options, clock) if baseline else None
        out.append((reaper, alarm))
    return out


def _workers(trace: Trace) -> int:
    """Machines are independent: spread a large fleet over the CPUs we may use."""
    if sum(len(s) for s in trace.series) < 200_000 or len(trace.series) < 8:
        return 1  # a process pool costs more than it saves
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def _run_all(
    series: Sequence[Series], options: ReplayOptions, period_seconds: int, baseline: str | None, workers: int
) -> list[tuple[MachineRun, MachineRun | None]]:
    if workers > 1:
        count = workers * 4  # interleaved chunks balance long and short machines
        chunks = [series[i::count] for i in range(count)]
        try:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                parts = list(pool.map(_replay_chunk, chunks, repeat(options), repeat(period_seconds), repeat(baseline)))
        except (OSError, NotImplementedError, BrokenProcessPool):
            pass  # no processes here (a sandbox, a tiny container): do it all in this one
        else:
            ordered: list[tuple[MachineRun, MachineRun | None]] = [parts[0][0]] * len(series)
            for i, part in enumerate(parts):
                ordered[i::count] = part
            return ordered
    return _replay_chunk(series, options, period_seconds, baseline)


def replay(
    trace: Trace,
    options: ReplayOptions = ReplayOptions(),
    *,
    prices: Mapping[str, float] | None = DEFAULT_PRICES,
    price_source: str | None = "built-in",
    baseline: str | None = None,
    workers: int | None = None,
) -> Replay:
    """Replay every machine of the trace under idle-reaper (and a baseline). prices=None: savings unknown.
    workers: processes to use (default: one per CPU for a large fleet, else this process only)."""
    if baseline is not None and baseline not in BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; known: {', '.join(BASELINES)}")
    started = time.perf_counter()
    hours = trace.period_seconds / 3600
    wanted = options.still_wanted_minutes
    reaper = Result("idle-reaper", hours)
    alarm = Result(baseline, hours) if baseline else None
    series = [
        replace(s, instance_type=options.default_instance_type)
        if not s.instance_type and options.default_instance_type
        else s
        for s in trace.series
    ]
    pairs = _run_all(series, options, trace.period_seconds, baseline, workers or _workers(trace))
    for reaper_run, alarm_run in pairs:
        price = prices.get(reaper_run.instance_type) if prices is not None else None
        for result, run in ((reaper, reaper_run), (alarm, alarm_run)):
            if result is None or run is None:
                continue
            for totals in (result.fleet, result.teams.setdefault(run.team, Totals())):
                totals.add(run, hours, price, prices is not None, wanted)
            result.stops.extend(run.stops)
    out = Replay(trace, options, price_source if prices is not None else None, reaper, alarm, 0.0)
    if options.timeline and pairs:
        out.timeline_start, out.timeline = _fleet_timeline([r for r, _ in pairs], _Clock(trace.period_seconds))
    out.seconds = time.perf_counter() - started
    return out


def _fleet_timeline(runs: Sequence[MachineRun], clock: _Clock) -> tuple[datetime, dict[str, list[int]]]:
    start = min(r.first_bucket for r in runs)
    end = max(r.first_bucket + r.buckets for r in runs)
    counts = [[0] * (end - start) for _ in STATE_NAMES]
    for r in runs:
        offset = r.first_bucket - start
        for i, code in enumerate(r.timeline or b""):
            counts[code][offset + i] += 1
    return clock.times(start, 1)[0], dict(zip(STATE_NAMES, counts, strict=True))


# ---------------------------------------------------------------------------------------------
# Text report


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:,.2f}"


def _num(value: Any, fmt: str = "{:,.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def format_report(r: Replay, max_events: int = 8) -> str:
    trace = r.trace
    reaper = r.reaper.summary()
    columns = [("idle-reaper", reaper)]
    if r.baseline is not None:
        columns.append((f"{r.baseline.name} alarm", r.baseline.summary()))
    wanted = r.options.still_wanted_minutes
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("idle machine-hours in the trace", lambda s: _num(s["idle_hours"])),
        ("ideal recoverable hours", lambda s: _num(s["ideal_hours"])),
        ("recovered hours", lambda s: _num(s["recovered_hours"])),
        ("recovery ratio", lambda s: _num(s["recovery_ratio"], "{:.1%}")),
        ("stops", lambda s: f"{s['stops']:,}"),
        ("false stops (busy within the window)", lambda s: f"{s['false_stops']:,}"),
        (f"stops followed by activity <= {wanted} min", lambda s: f"{s['stops_followed_by_activity']:,}"),
        ("warnings per machine-day", lambda s: _num(s["warnings_per_machine_day"], "{:.2f}")),
        (f"snoozes (assumed rate {r.options.snooze_rate:.0%})", lambda s: f"{s['snoozes']:,}"),
        ("dollars saved", lambda s: _money(s["dollars_saved"])),
        ("unpriced recovered hours", lambda s: _num(s["unpriced_hours"])),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [max(len(name), 12) for name, _ in columns]
    lines = [
        f"replay of {trace.source}: {reaper['machines']} machines, {reaper['machine_days']:,.1f} machine-days, "
        f"a sweep every {trace.period_seconds // 60} min ({r.seconds:.1f} s)",
        f"policy ({r.options.policies.source}): {r.options.policies.describe()}",
    ]
    if trace.notes:
        lines.append(f"input: {'; '.join(trace.notes)}")
    for team in sorted(r.options.policies.teams):
        lines.append(f"  team {team}: {r.options.policies.describe(team)}")
    lines.append(f"prices: {r.price_source or 'unknown (no usable price table)'}")
    lines.append("")
    lines.append(" " * label_w + "  " + "  ".join(n.rjust(w) for (n, _), w in zip(columns, col_w, strict=True)))
    for label, fmt in rows:
        cells = "  ".join(fmt(s).rjust(w) for (_, s), w in zip(columns, col_w, strict=True))
        lines.append(f"{label.ljust(label_w)}  {cells}")

    lines.append("")
    team_header = ("TEAM", "MACHINES", "IDLE H", "RECOVERED H", "DOLLARS", "WARNINGS", "STOPS", "FALSE")
    team_rows = []
    for name, totals in sorted(r.reaper.teams.items()):
        s = r.reaper.summary(totals)
        team_rows.append(
            (
                name,
                str(s["machines"]),
                _num(s["idle_hours"]),
                _num(s["recovered_hours"]),
                _money(s["dollars_saved"]),
                str(s["warnings"]),
                str(s["stops"]),
                str(s["false_stops"]),
            )
        )
    widths = [max(len(row[i]) for row in [team_header, *team_rows]) for i in range(len(team_header))]
    lines.append("idle-reaper per team:")
    for row in [team_header, *team_rows]:
        lines.append(
            "  "
            + "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        )

    for result in [r.reaper, *([r.baseline] if r.baseline else [])]:
        notable = [e for e in result.stops if e.false_stop] + [
            e
            for e in result.stops
            if not e.false_stop and e.resumed_after_minutes is not None and e.resumed_after_minutes <= wanted
        ]
        if notable:
            lines.append("")
            lines.append(f"{result.name}: false stops and stops followed by activity (first {max_events}):")
            for e in notable[:max_events]:
                tag = "FALSE STOP" if e.false_stop else "wanted back"
                back = "" if e.resumed_after_minutes is None else f", activity {e.resumed_after_minutes:.0f} min later"
                lines.append(f"  {e.at:%Y-%m-%d %H:%M} {e.instance_id} {tag}{back}: {e.reason[:110]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plot


def plot(r: Replay, path: str | Path) -> None:
    """A PNG: the fleet's state over time (stacked) and recovered hours and dollars per team."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 2])
    ax = fig.add_subplot(grid[0, :])
    colors = {
        "busy": "#2b8a3e",
        "idle": "#f2c94c",
        "warned": "#f2994a",
        "stopped": "#4c6ef5",
        "unknown": "#adb5bd",
    }
    if r.timeline is not None and r.timeline_start is not None:
        start = r.timeline_start
        count = len(r.timeline["busy"])
        xs = [i * r.trace.period_seconds / 86400 for i in range(count)]  # days since the start
        ax.stackplot(
            xs,
            *(r.timeline[name] for name in STATE_NAMES),
            labels=[name if name != "unknown" else "unknown / no data" for name in STATE_NAMES],
            colors=[colors[name] for name in STATE_NAMES],
            step="post",
            linewidth=0,
        )
        ax.set_xlim(xs[0], xs[-1])
        # A tick at each UTC midnight (each Monday on long traces), labelled with the weekday and date.
        midnight = start.replace(hour=0, minute=0, second=0, microsecond=0)
        days = [midnight + timedelta(days=d) for d in range(int(xs[-1]) + 2)]
        days = [d for d in days if start <= d <= start + timedelta(days=xs[-1])]
        if len(days) > 21:
            days = [d for d in days if d.weekday() == 0]
        ax.set_xticks(
            [(d - start).total_seconds() / 86400 for d in days], [f"{d:%a}\n{d:%b %d}" for d in days], fontsize=8
        )
        ax.set_xlabel("UTC")
    ax.set_ylabel("machines")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(
        f"Fleet state under idle-reaper, every {r.trace.period_seconds // 60} min: {Path(r.trace.source).name}"
    )
    ax.legend(loc="upper left", ncols=5, fontsize=9, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)

    teams = sorted(r.reaper.teams)
    results = [r.reaper, *([r.baseline] if r.baseline else [])]
    bar_colors = ["#4c6ef5", "#adb5bd"]
    width = 0.8 / len(results)
    for position, (metric, title) in enumerate(
        [("recovered_hours", "Recovered machine-hours per team"), ("dollars_saved", "Dollars saved per team")]
    ):
        bar_ax = fig.add_subplot(grid[1, position])
        for j, result in enumerate(results):
            values = [result.summary(result.teams[t]).get(metric) or 0.0 for t in teams]
            xs_bar = [i + (j - (len(results) - 1) / 2) * width for i in range(len(teams))]
            name = result.name if j == 0 else f"{result.name} alarm"
            bar_ax.bar(xs_bar, values, width=width, label=name, color=bar_colors[j % len(bar_colors)])
        bar_ax.set_xticks(range(len(teams)), teams, rotation=20 if len(teams) > 4 else 0)
        unknown = metric == "dollars_saved" and r.price_source is None
        bar_ax.set_title(title + (" (unknown: no price table)" if unknown else ""))
        unpriced = r.reaper.fleet.unpriced_hours
        if metric == "dollars_saved" and not r.reaper.fleet.dollars and unpriced:
            bar_ax.text(
                0.5,
                0.5,
                f"{unpriced:,.0f} recovered hours unpriced:\nno instance_type in the trace (see --instance-type)",
                ha="center",
                va="center",
                transform=bar_ax.transAxes,
            )
        bar_ax.grid(axis="y", alpha=0.3)
        if len(results) > 1:
            bar_ax.legend(fontsize=9)
    fig.savefig(str(path), dpi=110)


# ---------------------------------------------------------------------------------------------
# Command line (`idle-reaper replay`, wired in cli.py)


def snooze_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction from 0 to 1, got {text}")
    return value


def positive_minutes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of minutes: {text!r}") from None
    if not 1 <= value <= 60:
        raise argparse.ArgumentTypeError(f"from 1 to 60 minutes, got {value}")
    return value


def non_negative_minutes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of minutes: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"0 or more minutes, got {value}")
    return value


def cmd_replay(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"idle-reaper replay: {message}", file=sys.stderr)
        return 2

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail("--plot needs matplotlib: pip install 'idle-reaper[plot]'")
    try:
        policies = load_policies(args.policy)
    except PolicyError as exc:
        return fail(f"invalid policy: {exc}")
    prices: dict[str, float] | None = DEFAULT_PRICES
    price_source: str | None = "built-in on-demand prices (us-east-1, Linux)"
    if args.price_table:
        try:
            prices = load_price_table(args.price_table)
            price_source = str(args.price_table)
        except ValueError as exc:
            prices = None
            print(f"idle-reaper replay: {exc}; savings are reported as unknown", file=sys.stderr)
    try:
        trace = read_trace(
            args.trace,
            args.period_minutes,
            clamp_utilization=args.clamp_utilization,
            skip_duplicates=args.skip_duplicates,
        )
    except TraceError as exc:
        return fail(str(exc))
    if policies.default.network_threshold_bytes_per_second is not None and not trace.has_network:
        print(
            "idle-reaper replay: the policy judges network but the trace has no network column; "
            "every machine will be unknown",
            file=sys.stderr,
        )
    options = ReplayOptions(
        policies=policies,
        still_wanted_minutes=args.still_wanted_minutes,
        snooze_rate=args.snooze_rate,
        seed=args.seed,
        default_instance_type=args.instance_type,
        timeline=bool(args.plot),
    )
    result = replay(trace, options, prices=prices, price_source=price_source, baseline=args.baseline)
    try:
        print(json.dumps(result.to_json(), indent=2) if args.json else format_report(result), flush=True)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.plot:
        plot(result, args.plot)
        print(f"idle-reaper replay: plot written to {args.plot}", file=sys.stderr)
    return 0
