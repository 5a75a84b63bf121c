"""Property tests of the lifecycle. Random signal histories, policies, answers and clocks drive the real
`assess` + `decide` sweep after sweep, the way the sweep and the Slack answers do, and the product's
invariants are checked at every step:

* never stop (or release, or terminate) with a busy point in the window, nor a machine started less than a
  window ago;
* unknown data, and a team in safe mode, are never acted on;
* no stop before a delivered warning plus warn_minutes, unless the policy says so (an undelivered warning
  after undelivered_warning_max_minutes; quiet hours, where a recorded warning counts as delivered);
* a keep holds until its time, unless the machine is over max_runtime_hours; over it, a keep never holds;
* an exempt machine is untouched;
* the learned wait never warns before the team's minimum (earliest_warn_minutes), whatever the machine's
  quiet history (random, corrupted or oversized to start with); the history stays bounded;
* the same sweep twice at the same clock changes nothing the second time (per decision, and once through
  run_sweep over the in-memory AWS fakes), except under warn_minutes 0, where the policy puts the stop at
  the warning's delivery itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from idle_reaper.aws import Concurrency, InMemoryStateStore
from idle_reaper.core import (
    HISTORY_SIZE,
    REAP_ACTIONS,
    TRANSITIONS,
    Action,
    Assessment,
    Decision,
    Event,
    Machine,
    MachineRecord,
    Point,
    Signals,
    State,
    allowed,
    assess,
    decide,
    earliest_warn_minutes,
    format_history,
    parse_history,
    snooze,
    started_by_person,
    stopped_by_person,
)
from idle_reaper.notify import LoggingNotifier
from idle_reaper.policy import DEFAULT_GPU_FAMILIES, Settings, TeamPolicy, TeamPolicyRef
from idle_reaper.sweep import logger, run_sweep
from testkit.aws import FakeAws

PERIOD = timedelta(minutes=5)
START = datetime(2026, 11, 20, 6, 0, tzinfo=UTC)  # the machine starts, and its metrics begin
USER = "U0OWNER"
# Datapoint levels. Thresholds are drawn from (5, 20) for CPU and (5, 50) for the GPU, so EDGE is exactly
# at a 5 % threshold (busy: "at or above") and below a 20 % one.
LEVELS = {"low": 1.0, "edge": 5.0, "high": 60.0}
Level = str  # a key of LEVELS, or "gap": no datapoint


# ---------------------------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True)
class Answer:
    after_sweep: int
    kind: str  # "keep", "stop_now" or "start_again"
    hours: int  # how long a keep asks for
    quarter: int  # when, between this sweep and the next: 0 = at once, 3 = three quarters of the way


@dataclass(frozen=True)
class Scenario:
    policy: TeamPolicy
    later_policy: TeamPolicy | None  # None: invalid (safe mode) from `policy_changes_at` on
    policy_changes_at: int  # sweep index; past the last sweep: the policy never changes
    instance_type: str
    gpu_metrics: bool
    asg: bool
    protected: bool
    hibernation: bool
    exempt_tag: str | None
    cpu: tuple[Level, ...]  # one level per 5-minute period from START; past the end: low
    gpu: tuple[Level, ...]
    first_sweep: timedelta
    gaps: tuple[int, ...]  # minutes between sweeps
    lags: tuple[int, ...]  # minutes CloudWatch lags behind at each sweep (cycled)
    deliveries: tuple[bool, ...]  # whether each warning Slack is asked to deliver gets through
    dry_runs: frozenset[int]
    answers: tuple[Answer, ...]
    history: str = ""  # the quiet history the machine's record starts with

    def clocks(self) -> list[datetime]:
        t = START + self.first_sweep
        out = [t]
        for gap in self.gaps:
            t += timedelta(minutes=gap)
            out.append(t)
        return out

    def ref(self, index: int) -> TeamPolicyRef:
        if index < self.policy_changes_at:
            return TeamPolicyRef(team="ml", policy=self.policy, source="/idle-reaper/teams/ml", version=1)
        return TeamPolicyRef(
            team="ml",
            policy=self.later_policy,
            source="/idle-reaper/teams/ml",
            version=2,
            error=None if self.later_policy else "idle_minutes: Input should be greater than or equal to 15",
        )


@st.composite
def policies(draw: st.DrawFn) -> TeamPolicy:
    idle = draw(st.sampled_from([15, 30, 60, 90]))
    return TeamPolicy(
        idle_minutes=idle,
        warn_minutes=draw(st.integers(0, idle - 1)),
        cpu_threshold_percent=draw(st.sampled_from([5.0, 20.0])),
        gpu_threshold_percent=draw(st.sampled_from([5.0, 50.0])),
        action=draw(st.sampled_from(["stop", "hibernate", "notify_only"])),
        asg_action=draw(st.sampled_from(["unprotect", "terminate"])),
        missing_gpu_metrics=draw(st.sampled_from(["busy", "cpu_only"])),
        max_gap_minutes=draw(st.sampled_from([5, 15])),
        undelivered_warning_max_minutes=draw(st.sampled_from([0, 30, 240])),
        quiet_hours=draw(st.booleans()),
        max_runtime_hours=draw(st.sampled_from([None, None, 1, 3, 6])),
        max_snooze_hours=draw(st.sampled_from([1, 2, 8])),
        max_snoozes_per_day=draw(st.sampled_from([0, 1, 3])),
        adaptive_wait_max_minutes=draw(st.sampled_from([None, 0, 30, 120])),
        adaptive_earliest_warn_minutes=draw(st.sampled_from([None, 0, 10, 45])),
    )


# A machine's quiet history to start from: well formed (often stretches that ended soon, so the wait moves),
# corrupted, or oversized.
histories = st.one_of(
    st.just(""),
    st.lists(st.tuples(st.integers(0, 23), st.integers(0, 600)), max_size=HISTORY_SIZE).map(format_history),
    st.sampled_from(["garbage", "25:10", "1:1," * 40, "6:70,6:75,6:80,7:85,7:95"]),
)


# Mostly quiet, so that warnings and stops happen; bursts of activity, the threshold exactly, and holes.
levels = st.sampled_from(["low", "low", "low", "low", "high", "edge", "gap"])


@st.composite
def tracks(draw: st.DrawFn) -> tuple[Level, ...]:
    """Runs of one level, 5 minutes to 3 hours each."""
    runs = draw(st.lists(st.tuples(levels, st.integers(1, 36)), min_size=1, max_size=6))
    return tuple(level for level, length in runs for _ in range(length))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    sweeps = draw(st.integers(3, 30))
    exempt_tag = draw(
        st.sampled_from([None, None, None, None, None, "true", "not-a-time", "until"]),
    )
    if exempt_tag == "until":
        exempt_tag = (START + timedelta(minutes=draw(st.integers(0, 600)))).isoformat()
    return Scenario(
        policy=draw(policies()),
        later_policy=draw(st.none() | policies()),
        policy_changes_at=draw(st.integers(1, 2 * sweeps)),
        instance_type=draw(st.sampled_from(["m5.large", "m5.large", "g5.xlarge"])),
        gpu_metrics=draw(st.booleans()),
        asg=draw(st.booleans()),
        protected=draw(st.booleans()),
        hibernation=draw(st.booleans()),
        exempt_tag=exempt_tag,
        cpu=draw(tracks()),
        gpu=draw(tracks()),
        first_sweep=timedelta(minutes=draw(st.integers(0, 150))),
        gaps=tuple(draw(st.lists(st.sampled_from([5, 10, 15, 15, 30, 60, 180]), min_size=sweeps, max_size=sweeps))),
        lags=tuple(draw(st.lists(st.sampled_from([0, 0, 5, 10, 20]), min_size=1, max_size=4))),
        deliveries=tuple(draw(st.lists(st.sampled_from([True, True, False]), min_size=sweeps, max_size=sweeps))),
        dry_runs=frozenset(draw(st.sets(st.integers(0, sweeps), max_size=2))),
        answers=tuple(
            draw(
                st.lists(
                    st.builds(
                        Answer,
                        after_sweep=st.integers(0, sweeps),
                        kind=st.sampled_from(["keep", "keep", "stop_now", "start_again"]),
                        hours=st.sampled_from([1, 2, 4, 8]),
                        quarter=st.integers(0, 3),
                    ),
                    max_size=5,
                )
            )
        ),
        history=draw(histories),
    )


@pytest.fixture(autouse=True, scope="module")
def one_task_at_a_time() -> Iterator[None]:
    """run_sweep's thread pools run their tasks one after another: over at most four machines and the
    in-memory fakes, the same calls and answers, without the threads each sweep would start (most of
    test_run_sweep_twice_at_the_same_clock_changes_nothing_the_second_time's time)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Concurrency, "runner", staticmethod(lambda fn, items, workers: [fn(item) for item in items]))
        yield


# ---------------------------------------------------------------------------------------------
# The world: one machine, its metrics, the state table, Slack and the people who answer


@dataclass
class World:
    scenario: Scenario
    machine: Machine
    running: bool = True
    record: MachineRecord | None = None
    kept_until: datetime | None = None  # the latest keep someone got, as the world remembers it
    stopped: list[tuple[datetime, datetime | None]] = field(default_factory=list)  # no datapoints while stopped
    deliveries: Iterator[bool] = field(default_factory=lambda: iter(()))

    def signals(self, now: datetime, lag: int, policy: TeamPolicy) -> Signals:
        """What CloudWatch answers at `now`: the window plus its slack, up to the lag, none while stopped."""
        since = now - timedelta(minutes=policy.idle_minutes + policy.max_gap_minutes) - PERIOD
        until = now - timedelta(minutes=lag)

        def points(track: tuple[Level, ...]) -> list[Point]:
            out: list[Point] = []
            # From the first period at or after `since` (none before it is answered): the same points as from
            # START, without walking every period of a scenario that runs for days.
            t = START + max(0, -((START - since) // PERIOD)) * PERIOD
            while t + PERIOD <= until:
                index = int((t - START) / PERIOD)
                level = track[index] if index < len(track) else "low"
                off = any(stop <= t < (start or until) for stop, start in self.stopped)
                if t >= since and level != "gap" and not off:
                    out.append((t, LEVELS[level]))
                t += PERIOD
            return out

        gpu = points(self.scenario.gpu) if self.scenario.gpu_metrics else []
        return Signals(cpu=points(self.scenario.cpu), gpu=gpu)

    def after_sweep(self, d: Decision, now: datetime) -> None:
        """What the sweep does with a decision: write the record, act, deliver the warning (or not)."""
        record = d.record
        if d.applied and d.action in (Action.STOP, Action.HIBERNATE, Action.TERMINATE):
            self.running = False
            self.stopped.append((now, None))
        elif d.applied and d.action in (Action.PROTECT, Action.UNPROTECT):
            self.machine = replace(self.machine, asg_protected=d.action is Action.PROTECT)
        policy = d.policy.policy if d.policy else None
        if d.deliver_warning and next(self.deliveries, True):
            # As sweep._notify records it: delivered late, the owner still gets warn_minutes from now.
            stop_not_before = record.stop_not_before
            if policy is not None:
                stop_not_before = max(stop_not_before or now, now + timedelta(minutes=policy.warn_minutes))
            record = replace(
                record, version=record.version + 1, warning_delivered_at=now, stop_not_before=stop_not_before
            )
        self.record = record

    def answer(self, answer: Answer, ref: TeamPolicyRef, at: datetime) -> None:
        """A person's answer, as answers.py applies it."""
        record = self.record
        if record is None:
            return
        if answer.kind == "keep" and ref.policy is not None:
            kept = snooze(record, ref.policy, USER, at + timedelta(hours=answer.hours), at)
            if isinstance(kept, MachineRecord):
                self.record, self.kept_until = kept, kept.snoozed_until
        elif answer.kind == "stop_now" and self.running:
            action = Action.UNPROTECT if self.machine.asg_name else Action.STOP
            self.record = stopped_by_person(record, USER, action, at)
            if action is Action.STOP:
                self.running = False
                self.stopped.append((at, None))
            else:
                self.machine = replace(self.machine, asg_protected=False)
        elif answer.kind == "start_again" and not self.running and record.last_action in ("stop", "hibernate"):
            self.running = True
            self.stopped[-1] = (self.stopped[-1][0], at)
            self.machine = replace(self.machine, launch_time=at)
            self.record = started_by_person(record, USER, at)
            self.kept_until = None


@dataclass(frozen=True)
class Step:
    """One decision and everything it was made from."""

    now: datetime
    machine: Machine
    ref: TeamPolicyRef
    signals: Signals
    assessment: Assessment | None
    previous: MachineRecord | None
    decision: Decision
    dry_run: bool
    kept_until: datetime | None

    @property
    def previous_history(self) -> str:
        return self.previous.quiet_history if self.previous else ""


def simulate(s: Scenario) -> Iterator[tuple[Step, World]]:
    machine = Machine(
        instance_id="i-0abc",
        instance_type=s.instance_type,
        team="ml",
        launch_time=START,
        owner=USER,
        exempt_tag=s.exempt_tag,
        asg_name="ml-workers" if s.asg else None,
        asg_protected=s.asg and s.protected,
        hibernation_configured=s.hibernation,
    )
    world = World(s, machine, deliveries=iter(s.deliveries))
    if s.history:
        world.record = MachineRecord(instance_id=machine.instance_id, team="ml", quiet_history=s.history)
    clocks = s.clocks()
    for index, now in enumerate(clocks):
        ref = s.ref(index)
        if world.running:
            lag = s.lags[index % len(s.lags)]
            signals = Signals()
            assessment = None
            if ref.policy is not None:
                signals = world.signals(now, lag, ref.policy)
                assessment = assess(
                    world.machine, signals, ref.policy, now=now, period=PERIOD, gpu_families=DEFAULT_GPU_FAMILIES
                )
            dry_run = index in s.dry_runs
            previous = world.record
            d = decide(world.machine, ref, assessment, previous, now=now, dry_run=dry_run)
            step = Step(now, world.machine, ref, signals, assessment, previous, d, dry_run, world.kept_until)
            world.after_sweep(d, now)
            yield step, world
        if index + 1 < len(clocks):
            span = clocks[index + 1] - now
            for answer in (a for a in s.answers if a.after_sweep == index):
                world.answer(answer, ref, now + span * answer.quarter / 4)


# ---------------------------------------------------------------------------------------------
# The invariants


def busy_points(step: Step, after: datetime | None = None) -> list[Point]:
    """Datapoints at or above their threshold inside the window (or ending after `after`)."""
    policy = step.ref.policy
    assert policy is not None
    start = after if after is not None else step.now - timedelta(minutes=policy.idle_minutes)
    tracks = [(step.signals.cpu, policy.cpu_threshold_percent), (step.signals.gpu, policy.gpu_threshold_percent)]
    return [(t, v) for points, threshold in tracks for t, v in points if v >= threshold and start < t + PERIOD]


def exempt(step: Step) -> bool:
    """The exemption tag as users write it: `true`, an ISO time it holds until, anything else unreadable
    (which must make the reaper do less, so it counts as exempt)."""
    tag = step.machine.exempt_tag
    if tag is None or tag == "false":
        return False
    try:
        return step.now < datetime.fromisoformat(tag)
    except ValueError:
        return True


def reaps(d: Decision) -> bool:
    return d.applied and d.action in REAP_ACTIONS


def never_stops_a_busy_machine(step: Step) -> None:
    if not reaps(step.decision):
        return
    assert step.assessment is not None and step.assessment.signal == "idle", step.decision.reason
    assert not busy_points(step), f"reaped with busy points in the window: {busy_points(step)}"
    policy = step.ref.policy
    assert policy is not None
    assert step.machine.launch_time <= step.now - timedelta(minutes=policy.idle_minutes), "started too recently"


def unknown_is_never_acted_on(step: Step) -> None:
    d = step.decision
    if step.ref.policy is None or step.assessment is None or step.assessment.signal == "unknown":
        assert d.action is Action.NONE, d.reason
        assert not d.deliver_warning and d.notify in (None, "resolved"), d.reason
        if not exempt(step):
            assert d.state is (State.SAFE_MODE if step.ref.policy is None else State.UNKNOWN)


def stops_only_after_an_answerable_warning(step: Step) -> None:
    if not reaps(step.decision):
        return
    policy, previous, now = step.ref.policy, step.previous, step.now
    assert policy is not None and not step.dry_run, "a dry run never acts"
    assert policy.action != "notify_only" or step.machine.asg_name, "notify_only never stops a machine"
    assert previous is not None and previous.warned_at is not None, "reaped without a warning"
    assert not busy_points(step, after=previous.warned_at), "activity since the warning"
    warn = timedelta(minutes=policy.warn_minutes)
    delivered = previous.warning_delivered_at
    given_up = max(warn, timedelta(minutes=policy.undelivered_warning_max_minutes))
    assert (delivered is not None and now - delivered >= warn) or now - previous.warned_at >= given_up, (
        f"warned {previous.warned_at}, delivered {delivered}, reaped {now}"
    )
    assert previous.stop_not_before is None or now >= previous.stop_not_before, "before the announced time"


def over_cap(step: Step) -> bool:
    policy = step.ref.policy
    cap = policy.max_runtime_hours if policy else None
    return cap is not None and step.now - step.machine.launch_time >= timedelta(hours=cap)


def a_keep_holds_until_its_time(step: Step) -> None:
    d = step.decision
    if step.kept_until is None or step.now >= step.kept_until or over_cap(step):
        return
    assert not reaps(d), d.reason
    assert not (d.action is Action.WARN and d.applied) and not d.deliver_warning and d.notify != "warning", d.reason


def the_runtime_cap_overrides_a_keep(step: Step) -> None:
    if not over_cap(step):
        return
    d, a, policy = step.decision, step.assessment, step.ref.policy
    assert d.state is not State.SNOOZED, d.reason
    kept = step.kept_until is not None and step.now < step.kept_until
    idle = (
        policy is not None and a is not None and a.signal == "idle" and a.quiet_minutes(step.now) >= policy.idle_minutes
    )
    if kept and idle and not exempt(step):
        assert d.state in (State.WARNED, State.REAPED), d.reason


def exempt_is_untouched(step: Step) -> None:
    if not exempt(step):
        return
    d = step.decision
    assert d.state is State.EXEMPT and d.action is Action.NONE, d.reason
    assert not d.deliver_warning and d.notify in (None, "resolved")


LIFECYCLE_FIELDS = ("state", "idle_since", "warned_at", "warning_delivered_at", "snoozed_until", "stop_not_before")


def the_same_sweep_twice_changes_nothing(step: Step, world: World) -> None:
    if not world.running:  # stopped or terminated: the next sweep does not see it
        return
    assert world.record is not None
    policy = step.ref.policy
    if policy and policy.warn_minutes == 0 and step.now in (world.record.warned_at, world.record.warning_delivered_at):
        # warn_minutes 0 puts the stop at the warning's delivery itself: any later sweep may stop, even
        # one at the same clock. A known exception, kept as it is.
        return
    again = decide(world.machine, step.ref, step.assessment, world.record, now=step.now, dry_run=step.dry_run)
    assert again.state is step.decision.state, (step.decision.reason, again.reason)
    assert again.action is Action.NONE or not again.applied, again.reason
    assert again.notify is None, again.reason
    assert not again.deliver_warning or world.record.warning_delivered_at is None
    for name in (*LIFECYCLE_FIELDS, "last_action", "last_action_at"):
        assert getattr(again.record, name) == getattr(world.record, name), name


def never_warns_before_the_team_minimum(step: Step) -> None:
    d, policy = step.decision, step.ref.policy
    if d.action is not Action.WARN or not d.applied or policy is None or step.assessment is None:
        return
    assert step.assessment.quiet_minutes(step.now) >= earliest_warn_minutes(policy), d.reason


def the_history_stays_bounded(step: Step) -> None:
    history, note = parse_history(step.decision.record.quiet_history)
    assert note == "" or step.decision.record.quiet_history == step.previous_history, note
    assert len(history) <= HISTORY_SIZE


INVARIANTS = (
    never_warns_before_the_team_minimum,
    the_history_stays_bounded,
    never_stops_a_busy_machine,
    unknown_is_never_acted_on,
    stops_only_after_an_answerable_warning,
    a_keep_holds_until_its_time,
    the_runtime_cap_overrides_a_keep,
    exempt_is_untouched,
)


# ---------------------------------------------------------------------------------------------
# Known cases: every kind of decision, drawn every run


def known(policy: TeamPolicy | None = None, sweeps: int = 8, **fields: Any) -> Scenario:
    """An on-demand machine started at START, quiet (1 % CPU) ever since, under a 30-minute window with the
    warning 10 minutes before the stop, swept every 5 minutes from 45 minutes on, every warning delivered,
    the policy never changing: a warning, then the stop 10 minutes later. `fields` change what the case is
    about."""
    base: dict[str, Any] = {
        "policy": policy or TeamPolicy(idle_minutes=30, warn_minutes=10),
        "later_policy": None,
        "policy_changes_at": 99,
        "instance_type": "m5.large",
        "gpu_metrics": False,
        "asg": False,
        "protected": False,
        "hibernation": False,
        "exempt_tag": None,
        "cpu": ("low",),
        "gpu": (),
        "first_sweep": timedelta(minutes=45),
        "gaps": (5,) * sweeps,
        "lags": (0,),
        "deliveries": (True,) * (sweeps + 1),
        "dry_runs": frozenset(),
        "answers": (),
    }
    return Scenario(**{**base, **fields})


def short(**fields: Any) -> TeamPolicy:
    return TeamPolicy(idle_minutes=30, warn_minutes=10, **fields)


ALWAYS = frozenset(range(99))  # every sweep a dry run
MIN = timedelta(minutes=1)
# Each is a kind of decision (a state and an action, "a keep holds", "the cap overrides a keep") or a rule of
# the invariants that random scenarios reach only now and then: the rarest kinds in under 1 % of them ("active
# would_protect", "idle would_protect"), "warned would_warn" and a sweep exactly at the runtime cap in none of
# the 250 of the run whose events were counted. Listed, each is checked every run, all of them in about 0.1 s.
KNOWN_CASES = {
    # every reap action, and a group member already left to its group
    "stop": known(),
    "hibernate": known(short(action="hibernate"), hibernation=True),
    "hibernate, not configured: stop": known(short(action="hibernate")),
    "unprotect": known(asg=True, protected=True),
    "terminate": known(short(asg_action="terminate"), asg=True, protected=True),
    "a member already unprotected": known(asg=True),
    "protect a busy member": known(asg=True, cpu=("high",) * 12),
    # reported, never applied: dry runs (before and after a real warning) and notify_only
    "dry run": known(dry_runs=ALWAYS),
    "dry run, unprotect": known(asg=True, protected=True, dry_runs=ALWAYS),
    "dry run, terminate": known(short(asg_action="terminate"), asg=True, protected=True, dry_runs=ALWAYS),
    "dry run, protect": known(asg=True, cpu=("high",) * 8, first_sweep=35 * MIN, dry_runs=ALWAYS),
    "dry runs after a warning": known(dry_runs=frozenset({2, 3})),
    "notify_only": known(short(action="notify_only")),
    # busy exactly at the threshold, a busy GPU under an idle CPU, a GPU that reports no metrics
    "at the threshold": known(cpu=("edge",) * 40),
    "busy GPU": known(instance_type="g5.xlarge", gpu_metrics=True, gpu=("high",) * 40),
    "no GPU metrics: busy": known(instance_type="g5.xlarge"),
    "no GPU metrics: CPU only": known(short(missing_gpu_metrics="cpu_only"), instance_type="g5.xlarge"),
    # unknown: a hole longer than max_gap_minutes after the warning, CloudWatch lagging; safe mode when warned
    "a hole after the warning": known(cpu=("low",) * 9 + ("gap",) * 6, gaps=(20,) + (5,) * 9),
    "lag": known(lags=(20, 0)),
    "safe mode after the warning": known(later_policy=None, policy_changes_at=2),
    # exemptions: on, unreadable, until a time the sweeps pass
    "exempt": known(exempt_tag="true"),
    "exempt, unreadable": known(exempt_tag="not-a-time"),
    "exempt until": known(exempt_tag=(START + 60 * MIN).isoformat(), sweeps=10),
    # a warning undelivered until undelivered_warning_max_minutes, or delivered late; quiet hours; warn_minutes 0
    "never delivered": known(short(undelivered_warning_max_minutes=30), deliveries=(False,) * 9),
    "delivered late": known(deliveries=(False, False, True) + (True,) * 6),
    "quiet hours": known(short(quiet_hours=True)),
    "warn_minutes 0": known(TeamPolicy(idle_minutes=30, warn_minutes=0)),
    # people: a keep, a keep past the runtime cap (with a sweep exactly at it), stop now and start again
    "a keep": known(answers=(Answer(1, "keep", 2, 0),), sweeps=12),
    "a keep past the runtime cap": known(
        short(max_runtime_hours=1), answers=(Answer(0, "keep", 8, 2),), first_sweep=40 * MIN
    ),
    "stop now, start again": known(answers=(Answer(0, "stop_now", 1, 1), Answer(2, "start_again", 1, 0)), sweeps=12),
    # the quiet history: stretches that ended soon (wait longer), that went on for hours (warn at the team's
    # earliest), a full history a new stretch is added to, an unreadable and an oversized one
    "waits longer": known(
        short(adaptive_wait_max_minutes=30), history=format_history([(6, 25)] * 6), first_sweep=30 * MIN
    ),
    "warns sooner": known(
        short(adaptive_earliest_warn_minutes=10),
        history=format_history([(6, 600)] * 6),
        cpu=("high",) * 8 + ("low",),
        first_sweep=40 * MIN,
        sweeps=10,
    ),
    "a full history": known(
        history=format_history([(6, 30)] * HISTORY_SIZE),
        cpu=("low",) * 6 + ("high",) * 2 + ("low",),
        first_sweep=30 * MIN,
        sweeps=12,
    ),
    "an unreadable history": known(history="garbage"),
    "an oversized history": known(history="1:1," * 40),
}


def known_cases(test: Callable[..., None]) -> Callable[..., None]:
    for case in reversed(KNOWN_CASES.values()):
        test = example(case)(test)
    return test


# 250 random scenarios -> 100, the known cases above drawn first every run. Seeded bugs, 5 runs each, caught by
# 250 random / 100 random / the known cases: an unknown signal acted on 5/5/5, a delivered warning asked for
# again 5/5/5, an unreadable exemption tag read as none 5/4/5, a keep ending early 5/2/5, a datapoint at the
# threshold counted quiet 4/3/5, notify_only stopping 3/2/5, and an undelivered warning stopped at once, the
# runtime cap a sweep late, the learned wait under the team's minimum, one stretch too many kept 0-1/5 and 5/5
# by the known cases (the announced time: by its @example below). What the 250 caught only on some runs, a known
# case now catches on every run; the random scenarios are left to combine the kinds, and 100 alone still catch
# the bugs common scenarios show every run. About 1.1 s instead of 3.5 s.
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
@known_cases
@example(  # warned under a long window, then a schedule or an admin shortens it: the announced time holds
    Scenario(
        policy=TeamPolicy(idle_minutes=90, warn_minutes=60),
        later_policy=TeamPolicy(idle_minutes=15, warn_minutes=0),
        policy_changes_at=2,
        instance_type="m5.large",
        gpu_metrics=False,
        asg=False,
        protected=False,
        hibernation=False,
        exempt_tag=None,
        cpu=("low",),
        gpu=(),
        first_sweep=timedelta(minutes=95),
        gaps=(5, 5, 5),
        lags=(0,),
        deliveries=(True,) * 4,
        dry_runs=frozenset(),
        answers=(),
    )
)
def test_lifecycle_invariants_hold_sweep_after_sweep(s: Scenario) -> None:
    for step, world in simulate(s):
        d = step.decision
        event(f"{d.state.value} {d.action_label}")
        if step.kept_until and step.now < step.kept_until:
            event("a keep holds" if not over_cap(step) else "the cap overrides a keep")
        for invariant in INVARIANTS:
            invariant(step)
        the_same_sweep_twice_changes_nothing(step, world)


def test_answers_follow_the_transition_table() -> None:
    stopped = MachineRecord("i-1", "ml", State.REAPED)
    assert not allowed(State.REAPED, Event.KEEP)
    assert snooze(stopped, TeamPolicy(), USER, START + timedelta(hours=1), START) == "the machine is already stopped"
    warned = MachineRecord("i-1", "ml", State.WARNED, warned_at=START)
    kept = snooze(warned, TeamPolicy(), USER, START + timedelta(hours=1), START)
    assert isinstance(kept, MachineRecord) and kept.state is TRANSITIONS[Event.KEEP].target
    assert stopped_by_person(warned, USER, Action.STOP, START).state is TRANSITIONS[Event.STOP_NOW].target
    assert started_by_person(stopped, USER, START).state is TRANSITIONS[Event.START_AGAIN].target


# ---------------------------------------------------------------------------------------------
# The same sweep twice, through run_sweep over the in-memory AWS fakes


def profile(levels_by_period: tuple[Level, ...]) -> Any:
    def values(t: datetime) -> tuple[float | None, ...]:
        index = int((t - START) / PERIOD)
        level = levels_by_period[index] if 0 <= index < len(levels_by_period) else "low"
        return (None,) if level == "gap" else (LEVELS[level],)

    return values


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=policies(),
    fleet=st.lists(st.tuples(tracks(), st.booleans()), min_size=1, max_size=4),
    clocks=st.lists(st.integers(15, 600), min_size=1, max_size=4, unique=True),
)
@example(  # every run: a warning delivered (then not posted again), a stop and a release, each swept twice
    policy=TeamPolicy(idle_minutes=30, warn_minutes=10), fleet=[(("low",), False), (("low",), True)], clocks=[60, 75]
)
def test_run_sweep_twice_at_the_same_clock_changes_nothing_the_second_time(
    policy: TeamPolicy, fleet: list[tuple[tuple[Level, ...], bool]], clocks: list[int]
) -> None:
    policy = policy.model_copy(update={"warn_minutes": max(1, policy.warn_minutes)})  # see the check above
    aws = FakeAws()
    aws.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    aws.ssm.store("/idle-reaper/teams/ml", policy.model_dump_json(exclude={"schedules"}))
    aws.autoscaling.add_group("ml-workers")
    for cpu, member in fleet:
        group = {"group": "ml-workers", "protected": True} if member else {}
        aws.launch("m5.large", team="ml", owner=USER, profile=profile(cpu), launch_time=START, **group)
    store = InMemoryStateStore()
    notifier = LoggingNotifier(logger, delivers=True)
    for minutes in sorted(clocks):
        now = START + timedelta(minutes=minutes)
        first = run_sweep(aws.adapters(store=store, notifier=notifier), now=now)
        writes, sent = aws.write_calls(), len(notifier.sent)
        records = store.load([d.machine.instance_id for d in first.decisions])
        second = run_sweep(aws.adapters(store=store, notifier=notifier), now=now)
        assert aws.write_calls() == writes, "the second sweep stopped, released or protected something"
        assert notifier.sent[sent:] == [], "the second sweep told people something again"
        running = {d.machine.instance_id for d in second.decisions}
        assert running == {i for i in records if aws.ec2.state_of(i) == "running"}
        for d in second.decisions:
            before = records[d.machine.instance_id]
            assert d.action is Action.NONE or not d.applied, d.reason
            assert [getattr(d.record, f) for f in LIFECYCLE_FIELDS] == [getattr(before, f) for f in LIFECYCLE_FIELDS]
