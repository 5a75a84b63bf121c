"""The simulation: every machine of a trace swept by the real decision core, with a simulated clock.

Every period `core.assess` + `core.decide` run for every running machine on the points a real sweep
would have fetched. Warnings are assumed delivered at once (as after a successful Slack post).

The counterfactual model: the trace is the demand, what each machine would have done had it kept
running. After a stop the machine reports nothing and stays stopped until the trace shows activity
again (a bucket at or above a threshold): its owner wanted it back, so it restarts there, with a new
launch time. Quiet samples while stopped are what the stop saved; they are never shown to the core.

Machines are independent: a large fleet is spread over worker processes (see simulate_fleet).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from itertools import repeat
from typing import Any, Literal

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
from idle_reaper.core.digest import running_again_entry
from idle_reaper.core.dollars import of_kind
from idle_reaper.core.kinds import NOTEBOOK, ON_DEMAND, InstanceFacts
from idle_reaper.core.reading import not_due, plan_next_read
from idle_reaper.core.time_of_day import observe_text
from idle_reaper.core.waiting import DEFAULT_RULE, WaitingRule
from idle_reaper.policy import TeamPolicy
from idle_reaper.sweep.delivery import explain
from idle_reaper_tools.replay.policies import PolicySet
from idle_reaper_tools.replay.trace import Series, Trace
from idle_reaper_tools.replay.truth import Truth, classify, ideal_buckets

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


@dataclass(frozen=True)
class StopEvent:
    instance_id: str
    at: datetime
    reason: str
    false_stop: bool  # a busy bucket in the window before the stop
    resumed_after_minutes: float | None  # activity after the stop (the owner wanted it back); None: never
    person_active: bool = False  # the trace's `user` column shows a person's input shortly before the stop


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
    # Warnings (sent or silent) whose quiet stretch ended without a stop: the machine came back during
    # the warning, so the nudge was for nothing. Kept warnings (snoozes) are not counted here.
    warnings_without_stop: int = 0
    warning_buckets: list[int] = field(default_factory=list)  # absolute buckets of delivered warnings
    owner: str = ""
    core_calls: int = 0  # sweeps that ran assess + decide (the rest took the fast path or were stopped)
    skipped_reads: int = 0  # sweeps that did not read the machine: not due (read_when_due)
    stops: list[StopEvent] = field(default_factory=list)
    timeline: bytearray | None = None  # a state code per bucket
    # The audit trail a sweep would have written (ReplayOptions.audit_prices): (instance id, time, entry).
    audit: list[tuple[str, datetime, dict[str, Any]]] = field(default_factory=list)


@dataclass(frozen=True)
class ReplayOptions:
    policies: PolicySet = field(default_factory=PolicySet)
    still_wanted_minutes: int = 60
    snooze_rate: float = 0.0
    seed: int = 0
    default_instance_type: str | None = None  # for machines whose trace has no instance_type
    timeline: bool = False
    # A stop with a person's input within this many minutes before it is counted (person_active_stops).
    person_minutes: int = 30
    # Skip calling the core when its answer is already determined (see _replay_reaper). Off: call it
    # every period, the reference the fast path is tested against.
    fast_path: bool = True
    # Score only what happens in these absolute buckets [first, end) (--split time): every machine is still
    # swept over the whole trace (its profile and history learn from the days before), but stops, warnings,
    # idle, ideal and recovered time outside the span are not counted.
    judged: tuple[int, int] | None = None
    # Call the core only when the machine is due (core/reading.py), as the sweep reads only then. The same
    # warnings and stops as calling it every period: benchmarks/read_when_due.py shows it on every trace.
    read_when_due: bool = False
    # Record the audit trail the sweep would write (sweep.delivery.explain for every action, running_again when
    # a stopped machine starts), priced with this table: what the weekly digest reads (core/digest.py).
    audit_prices: Mapping[str, float] | None = None
    # The constants of waiting the core decides with (the sweep's defaults unless set: benchmarks/carries.py
    # tunes them on one part of a trace and judges them on another; `idle-reaper replay --waiting`).
    waiting: WaitingRule = DEFAULT_RULE


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


def _person_active(series: Series | None, at: int, at_time: datetime, minutes: int, period_seconds: int) -> bool:
    """Whether the `user` column shows a person's input within `minutes` before the start of bucket `at`
    (a datapoint at t saying v minutes since input: input at t - v)."""
    if series is None or not series.user:
        return False
    lookback = math.ceil(minutes * 60 / period_seconds) + 1
    since = at_time.timestamp() - minutes * 60
    for j in range(max(0, at - lookback), at):
        v = series.user[j]
        if v == v and (series.first_bucket + j) * period_seconds - v * 60 >= since:
            return True
    return False


def _judged_span(run: MachineRun, judged: tuple[int, int] | None) -> tuple[int, int]:
    """The machine's own buckets that are scored: all of them, or those inside `judged`."""
    if judged is None:
        return 0, run.buckets
    lo = min(max(judged[0] - run.first_bucket, 0), run.buckets)
    return lo, max(lo, min(judged[1] - run.first_bucket, run.buckets))


def _record_stop(
    run: MachineRun,
    truth: Truth,
    at: int,
    reason: str,
    at_time: datetime,
    window: int,
    clock: _Clock,
    person: tuple[Series, int] | None = None,
    judged: tuple[int, int] | None = None,
) -> int | None:
    """Book a stop issued at the start of bucket `at`; return the bucket where the machine restarts.
    person: the machine's series and the minutes of input before the stop that count as a person active.
    judged: only the stop and stopped time inside these absolute buckets count."""
    n = run.buckets
    restart = next((j for j in range(at, n) if truth.busy[j]), None)
    end = n if restart is None else restart
    lo, hi = _judged_span(run, judged)
    run.stopped += max(0, min(end, hi) - max(at, lo))
    run.recovered += sum(truth.quiet[max(at, lo) : min(end, hi)])
    if not lo <= at < hi:
        return restart
    false_stop = truth.busy_between(at - window, at)
    person_active = person is not None and _person_active(person[0], at, at_time, person[1], clock.period_seconds)
    resumed = None if restart is None else (restart - at) * clock.period_seconds / 60
    run.stops.append(StopEvent(run.instance_id, at_time, reason, false_stop, resumed, person_active))
    if run.timeline is not None:
        run.timeline[at:end] = bytes([STOPPED]) * (end - at)
        if restart is not None:
            run.timeline[restart] = BUSY
    return restart


def _new_run(series: Series, truth: Truth, window: int, judged: tuple[int, int] | None = None) -> MachineRun:
    run = MachineRun(
        series.instance_id,
        series.team,
        series.instance_type,
        series.first_bucket,
        len(series),
        sum(truth.quiet),
        ideal_buckets(truth, window),
        owner=series.owner or series.instance_id,
    )
    if judged is not None:
        lo, hi = _judged_span(run, judged)
        run.quiet = sum(truth.quiet[lo:hi])
        run.ideal = ideal_buckets(truth, window, lo, hi)
    return run


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
    busy = truth.track_busy or truth.busy  # the fast path below holds for a busy metric, not a person
    user = series.user
    use_user = bool(user) and bool(policy.human_active_minutes)
    # seen[i]: buckets before i with any datapoint the core reads; an empty window costs O(1) to spot.
    seen = [0] * (n + 1)
    for i in range(n):
        seen[i + 1] = seen[i] + (
            cpu[i] == cpu[i] or gpu[i] == gpu[i] or (use_net and net[i] == net[i]) or (use_user and user[i] == user[i])
        )
    run = _new_run(series, truth, window, opts.judged)
    judged_lo, judged_hi = _judged_span(run, opts.judged)
    if opts.timeline:
        run.timeline = bytearray([UNKNOWN]) * n
    timeline = run.timeline
    rng = random.Random(f"{opts.seed}/{series.instance_id}") if opts.snooze_rate > 0 else None

    notebook = series.kind == "notebook"
    facts = InstanceFacts(notebook_status="InService") if notebook else InstanceFacts()
    machine = Machine(series.instance_id, series.instance_type, series.team, launch_time=times[0], facts=facts)
    record: MachineRecord | None = None
    launch = 0
    # What the core's last answer settled into, while its inputs keep it there (see the fast paths).
    settled: Literal["active", "unknown"] | None = None
    warning_open = False  # a warning was given in the current quiet stretch and has not ended in a stop
    warned_judged = True  # that warning was given inside the judged span
    k = 1  # the sweep at the start of bucket k sees buckets < k
    while k <= n:
        now = times[k]
        newest = k - 1
        # Fast paths: skip the call when the core's answer is already determined, and keep the record
        # it wrote last (only its version and timestamps would differ). Tests compare every trace they
        # replay with fast_path=False, which calls the core every period. Not with schedules: their
        # thresholds and windows may differ from the ones `busy` and `lookback` were computed with.
        if (
            opts.read_when_due
            and record is not None
            and not_due(machine, base_ref.at(now) if scheduled else base_ref, record, now)
        ):
            run.skipped_reads += 1
            if timeline is not None and k < n:
                timeline[k] = _STATE_CODE.get(record.state, UNKNOWN)
            k += 1
            continue
        if settled is not None and opts.fast_path and not scheduled:
            # The newest bucket is busy on a track the core judges: assess() can only say "busy, quiet
            # for 0 min" (its one earlier exit, a GPU type without GPU points, is excluded), and decide()
            # keeps an active, settled record as it is.
            if settled == "active" and busy[newest] and (not gpu_blind_unknown or gpu[newest] == gpu[newest]):
                # ...except for the usage profile, which marks the newest bucket (marking is idempotent, so
                # each bucket marked once, as the newest of some sweep, is what every sweep marking it gives).
                if record is not None:
                    stamp = (series.first_bucket + newest) * period_seconds
                    forget = opts.waiting.restart_after_days
                    text, _ = observe_text(record.usage_profile, stamp // 86400, (stamp // 3600,), forget)
                    if text != record.usage_profile:
                        record = replace(record, usage_profile=text)
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
            # As the sweep reads it (aws/metrics.py, _human_point): a period's Minimum timed at its end.
            user=[(times[i + 1], v) for i in range(lo, k) if (v := user[i]) == v] if use_user else (),
        )
        assessment = assess(machine, signals, in_force, now=now, period=period, gpu_families=families)
        kind = NOTEBOOK if notebook else ON_DEMAND
        decision = decide(machine, ref, assessment, record, now=now, kind=kind, waiting=opts.waiting)
        if opts.read_when_due:
            decision = replace(decision, record=plan_next_read(decision, now))
        record = decision.record
        run.core_calls += 1
        if opts.audit_prices is not None and decision.action is not Action.NONE:
            price = opts.audit_prices.get(series.instance_type)
            priced = replace(
                decision,
                hourly_cost=price,
                saving=of_kind(NOTEBOOK if notebook else ON_DEMAND, price).saved_by(decision.action.value),
            )
            run.audit.append((series.instance_id, now, explain(priced)))

        if warning_open and record.warned_at is None:
            run.warnings_without_stop += warned_judged  # the stretch ended (activity, a hole) before the stop
            warning_open = False
        if decision.action in REAP_ACTIONS and decision.applied:
            warning_open = False
            person = (series, opts.person_minutes)
            restart = _record_stop(run, truth, k, decision.reason, now, window, clock, person, opts.judged)
            if restart is None:
                break
            # A stopped machine reports nothing; its owner starts it again where the trace shows activity.
            if opts.audit_prices is not None:
                entry = running_again_entry(
                    series.instance_id, series.team, series.owner, series.instance_type, times[restart]
                )
                run.audit.append((series.instance_id, times[restart + 1], entry))
            launch = restart
            machine = replace(machine, launch_time=times[restart])
            record = started_by_person(record, SNOOZER, times[restart])
            settled = None
            k = restart + 1
            continue
        if decision.action is Action.WARN:
            warning_open = decision.applied
            warned_judged = judged_lo <= k < judged_hi
            if decision.deliver_warning:
                if warned_judged:
                    run.warnings += 1
                    run.warning_buckets.append(series.first_bucket + k)
                # Delivered at once, as the sweep records after a successful notifier.warn().
                record = replace(record, version=record.version + 1, warning_delivered_at=now)
                if rng is not None and rng.random() < opts.snooze_rate:
                    until = keep_until(SNOOZE_CHOICE, in_force, now)
                    kept = snooze(record, in_force, SNOOZER, until, now) if until else "no such choice"
                    if isinstance(kept, MachineRecord):  # else refused, e.g. the daily limit of keeps
                        record = kept
                        run.snoozes += warned_judged
                        warning_open = False
            else:
                run.silent_warnings += warned_judged
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
    run = _new_run(series, truth, window, opts.judged)
    cpu = series.cpu
    breaching = 0
    i = 0
    while i < n:
        v = cpu[i]
        breaching = breaching + 1 if v < threshold else 0  # NaN: missing, not breaching
        if breaching >= window:
            reason = f"CPUUtilization < {threshold:g}% for {window} consecutive datapoints"
            person = (series, opts.person_minutes)
            restart = _record_stop(run, truth, i + 1, reason, times[i + 1], window, clock, person, opts.judged)
            if restart is None:
                break
            breaching = 0
            i = restart
            continue
        i += 1
    return run


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


def simulate_fleet(
    trace: Trace, options: ReplayOptions, baseline: str | None = None, workers: int | None = None
) -> list[tuple[MachineRun, MachineRun | None]]:
    """Every machine of the trace under idle-reaper (and the baseline), in the trace's order.
    workers: processes to use (default: one per CPU for a large fleet, else this process only)."""
    if baseline is not None and baseline not in BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; known: {', '.join(BASELINES)}")
    series = [
        replace(s, instance_type=options.default_instance_type)
        if not s.instance_type and options.default_instance_type
        else s
        for s in trace.series
    ]
    return _run_all(series, options, trace.period_seconds, baseline, workers or _workers(trace))


def fleet_timeline(runs: Sequence[MachineRun], period_seconds: int) -> tuple[datetime, dict[str, list[int]]]:
    """The time of the first bucket, and per state name the machines in that state in each bucket."""
    start = min(r.first_bucket for r in runs)
    end = max(r.first_bucket + r.buckets for r in runs)
    counts = [[0] * (end - start) for _ in STATE_NAMES]
    for r in runs:
        offset = r.first_bucket - start
        for i, code in enumerate(r.timeline or b""):
            counts[code][offset + i] += 1
    return _Clock(period_seconds).times(start, 1)[0], dict(zip(STATE_NAMES, counts, strict=True))
