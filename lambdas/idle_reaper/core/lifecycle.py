"""The decision: what happens to one machine now, as one transition of the lifecycle table (TRANSITIONS).

Pure: no boto3, no Slack, no clock. Read `decide` top to bottom: the first rule that applies decides."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from idle_reaper.core.endpoints import endpoint_policy, words_for
from idle_reaper.core.kinds import (
    ON_DEMAND,
    Handling,
    Kind,
    MachineKind,
    Saving,
    caveats,
    describe,
    handling,
)
from idle_reaper.core.records import Action, MachineRecord, State, owes_owner, parse_history, with_stretch
from idle_reaper.core.signals import Assessment, Machine, Signal, parse_exemption
from idle_reaper.core.studio import kept_restore
from idle_reaper.core.time_of_day import observe_text
from idle_reaper.core.waiting import DEFAULT_RULE, LearnedWait, WaitingRule, earliest_warn_minutes, wait_for, warn_point
from idle_reaper.policy import TeamPolicy, TeamPolicyRef


@dataclass(frozen=True)
class Decision:
    machine: Machine
    state: State
    action: Action
    reason: str
    signal: Signal | None
    record: MachineRecord  # the record to write (version already bumped)
    applied: bool = True  # False: dry run or notify_only; the action is reported as "would ..."
    notify: Literal["warning", "resolved", "reaped"] | None = None
    deliver_warning: bool = False  # a warning is due and not delivered yet
    assessment: Assessment | None = None
    policy: TeamPolicyRef | None = None
    hourly_cost: float | None = None  # what the machine costs an hour (its on-demand price), for messages
    error: str | None = None
    kind: MachineKind = ON_DEMAND
    handling: Handling | None = None  # what the end of the window brings for it (None: no policy, or a group member)
    saving: Saving | None = None  # what stopping it saves an hour: the figure every savings total adds up
    waited: str = ""  # a warning held past the team's usual point: why (the warning's text says it too)

    @property
    def why_warned(self) -> str:
        """Why the machine counts as idle, and why its warning came when it did: for the warning's text."""
        why = self.assessment.why_quiet if self.assessment else self.reason
        return f"{why}; {self.waited}" if self.waited else why

    read: bool = True  # False: not read this sweep (core/reading.py); nothing happens, the record stays

    @property
    def action_label(self) -> str:
        if self.action is Action.NONE:
            return "none"
        return self.action.value if self.applied else f"would_{self.action.value}"


# The lifecycle as a state machine. A sweep re-judges every machine from what it sees now, so a sweep's
# events may come from any state; what a machine remembers (idle_since, warned_at, snoozed_until,
# stop_not_before) lives in its record, not in the name of its state. `decide` tries the sweep's events
# in the order below and the first that applies decides; people's answers come through answers.py.
#
#   event                from            to         action                             notice to people
#   exempted             any             exempt     none                               resolved, if it was warned
#   policy_invalid       any             safe_mode  none                               -
#   signals_unknown      any             unknown    none                               -
#   busy                 any             active     protect an unprotected ASG member  resolved, if it was warned
#   quiet_after_busy     any             idle       protect an unprotected ASG member  resolved, if it was warned
#   kept                 any             snoozed    none                               resolved, if it was warned
#   quiet                any             idle       none                               resolved, if it was warned
#   warning_due          any             warned     warn                               the warning
#   notice_due           any             warned     warn (a notice: nothing will be        the notice (and the admins,
#                                                   stopped; kinds.Handling)       for a fleet or a reservation)
#   notice_given         any             warned     none: the owner was told               the notice, if undelivered
#   kind_unknown         any             unknown    none: a kind look-up failed            -
#   waits_for_people     any             idle       none: a notice or a termination        -
#                                                   warning waits for quiet hours to end
#   would_warn           any             warned     warn, not applied (dry run)        -
#   warning_undelivered  any             warned     none: no stop until delivered      the warning, retried
#   owner_copy_owed      any             warned     none: the channel has it, the owner's  the owner's copy, retried
#                                                   DM not yet: no stop until it has
#                                                   (undelivered_warning_max_minutes)
#   answer_time          any             warned     none: the owner has warn_minutes   the warning, if undelivered
#   stop_due             any             reaped     stop, hibernate, unprotect or      reaped
#                                                   terminate (none: ASG member free;
#                                                   terminate_instance: opted in, a
#                                                   machine EC2 cannot stop)
#   stop_reported        any             warned     the same, not applied (dry run     -
#                                                   or a notify_only policy)
#   keep                 all but reaped  snoozed    none (snooze)                      the message is updated
#   stop_now             any             reaped     stop, or unprotect an ASG member   the message is updated
#   start_again          reaped          active     start: a fresh grace window        the message is updated
#   terminate_now        all but reaped  reaped     terminate_instance (the owner,     the message is updated
#                                                   confirmed; a machine EC2 cannot
#                                                   stop)
#
# busy and quiet_after_busy apply while the last activity is less than the warning point ago (quiet for
# under idle_minutes - warn_minutes); every later event needs the machine quiet (covered, every track
# below its threshold) since quiet_since, and stop_due an idle signal over the whole window. Two
# conditions change how a transition reads, never where it goes:
#   cap reached  up max_runtime_hours or longer: a keep no longer holds (kept is skipped), nor does a learned
#                or time-of-day wait, and the reason starts with why; a busy machine is still never stopped,
#                an exempt one never touched
#   quiet hours  policy.quiet_hours: nothing is posted to owners; a new warning counts as delivered at once
# What kind of machine it is (kinds.py: one-time Spot, instance-store root, fleet member, reserved
# capacity, scarce family, or a kind look-up that failed) decides what the end of the window brings: a stop,
# a notice (nothing is stopped), or, opted in, termination after a longer window. A machine whose kind changed
# since its warning is warned afresh: the old warning promised something else.
# A policy change shows at the next sweep: an invalid policy means safe mode, and a schedule that shortens
# the window never brings a stop before the time its warning announced (stop_not_before). The sweep
# records what happens after a decision: a delivered warning (warning_delivered_at; the owner's
# warn_minutes run from then) and a failed action (the machine stays warned; the next sweep retries).


class Event(StrEnum):
    """What moves a machine from one state to another: something a sweep saw, or a person's answer."""

    EXEMPTED = "exempted"
    POLICY_INVALID = "policy_invalid"
    SIGNALS_UNKNOWN = "signals_unknown"
    BUSY = "busy"
    QUIET_AFTER_BUSY = "quiet_after_busy"
    KEPT = "kept"
    QUIET = "quiet"
    WARNING_DUE = "warning_due"
    WOULD_WARN = "would_warn"
    WARNING_UNDELIVERED = "warning_undelivered"
    OWNER_COPY_OWED = "owner_copy_owed"
    ANSWER_TIME = "answer_time"
    STOP_DUE = "stop_due"
    STOP_REPORTED = "stop_reported"
    KEEP = "keep"
    STOP_NOW = "stop_now"
    START_AGAIN = "start_again"
    NOTICE_DUE = "notice_due"
    NOTICE_GIVEN = "notice_given"
    KIND_UNKNOWN = "kind_unknown"
    WAITS_FOR_PEOPLE = "waits_for_people"
    TERMINATE_NOW = "terminate_now"


@dataclass(frozen=True)
class Transition:
    sources: frozenset[State]  # the states the event may come from
    target: State
    reason: str  # a str.format template; the rule that saw the event supplies the fields

    def explain(self, fields: Mapping[str, object]) -> str:
        return self.reason.format_map(fields)


ANY_STATE = frozenset(State)
_QUIET_FOR = "quiet for {quiet:.0f} min"

TRANSITIONS: dict[Event, Transition] = {
    Event.EXEMPTED: Transition(ANY_STATE, State.EXEMPT, "{why}"),
    Event.POLICY_INVALID: Transition(ANY_STATE, State.SAFE_MODE, "team policy invalid, nothing is changed: {error}"),
    Event.SIGNALS_UNKNOWN: Transition(ANY_STATE, State.UNKNOWN, "unknown: {why}"),
    Event.BUSY: Transition(ANY_STATE, State.ACTIVE, "busy: {activity}{notes}"),
    Event.QUIET_AFTER_BUSY: Transition(
        ANY_STATE, State.IDLE, _QUIET_FOR + "; last activity: {activity}; warning at {warn_at} min{learned}{notes}"
    ),
    Event.KEPT: Transition(ANY_STATE, State.SNOOZED, _QUIET_FOR + ", kept by {by} until {until}"),
    Event.QUIET: Transition(
        ANY_STATE,
        State.IDLE,
        _QUIET_FOR + "; warning at {warn_at} min, stop at {stop_minutes} min{learned}: {why_quiet}",
    ),
    Event.WARNING_DUE: Transition(
        ANY_STATE,
        State.WARNED,
        _QUIET_FOR + "; will {verb} at {stop_at:%H:%M} UTC unless kept{notes}{learned}: {why_quiet}",
    ),
    Event.WOULD_WARN: Transition(ANY_STATE, State.WARNED, _QUIET_FOR + ": {why_quiet}"),
    Event.WARNING_UNDELIVERED: Transition(
        ANY_STATE, State.WARNED, "warned at {warned_at:%H:%M} UTC, not delivered yet; no stop until it is: {why_quiet}"
    ),
    Event.OWNER_COPY_OWED: Transition(
        ANY_STATE,
        State.WARNED,
        "warned at {warned_at:%H:%M} UTC in the team channel; the owner's own copy is not delivered yet: no stop until "
        "it is, or until {until:%H:%M} UTC: {why_quiet}",
    ),
    Event.ANSWER_TIME: Transition(
        ANY_STATE, State.WARNED, "warned; will {verb} at {stop_at:%H:%M} UTC if still idle: {why_quiet}"
    ),
    Event.STOP_DUE: Transition(ANY_STATE, State.REAPED, "{why}: {why_quiet}"),
    Event.STOP_REPORTED: Transition(ANY_STATE, State.WARNED, "{why}: {why_quiet}"),
    Event.KEEP: Transition(ANY_STATE - {State.REAPED}, State.SNOOZED, "kept by {user} until {until}"),
    Event.STOP_NOW: Transition(ANY_STATE, State.REAPED, "{action} now, asked by {user}"),
    Event.START_AGAIN: Transition(frozenset({State.REAPED}), State.ACTIVE, "started again by {user}"),
    Event.NOTICE_DUE: Transition(
        ANY_STATE, State.WARNED, _QUIET_FOR + "; {what}; the owner is told{notes}{learned}: {why_quiet}"
    ),
    Event.NOTICE_GIVEN: Transition(ANY_STATE, State.WARNED, "told at {warned_at:%H:%M} UTC; {what}: {why_quiet}"),
    Event.KIND_UNKNOWN: Transition(ANY_STATE, State.UNKNOWN, _QUIET_FOR + "; not stopped this sweep: {why}"),
    Event.WAITS_FOR_PEOPLE: Transition(
        ANY_STATE, State.IDLE, _QUIET_FOR + "; {what} waits until quiet hours end (nobody would read it)"
    ),
    Event.TERMINATE_NOW: Transition(ANY_STATE - {State.REAPED}, State.REAPED, "terminated now, asked by {user}"),
}
# Prefixed to the reason of whatever follows when the runtime cap overrides a keep.
CAP_OVERRIDES_KEEP = "{cap}: the keep by {by} no longer holds; "


def allowed(state: State, event: Event) -> bool:
    """Whether `event` may move a machine out of `state` (TRANSITIONS)."""
    return state in TRANSITIONS[event].sources


Notice = Literal["warning", "resolved", "reaped"]


@dataclass(frozen=True)
class _Outcome:
    """What one rule saw: the event, the action it asks for and the record to write (state not yet set)."""

    event: Event
    action: Action
    record: MachineRecord
    fields: Mapping[str, object]  # fills the transition's reason template
    applied: bool = True
    notify: Notice | None = None
    deliver_warning: bool = False
    waited: str = ""  # why the warning came later than the team's usual point


@dataclass(frozen=True)
class _Sweep:
    """One machine as one sweep sees it: the inputs of `decide`, and the record carried over."""

    machine: Machine
    ref: TeamPolicyRef
    assessment: Assessment | None
    record: MachineRecord  # as the last sweep or answer left it
    base: MachineRecord  # the record to write, before this sweep's rule changes it
    now: datetime
    dry_run: bool
    kind: MachineKind = ON_DEMAND
    how: Handling | None = None  # None: no policy, or an Auto Scaling group member (the group decides)

    @property
    def mode(self) -> str:
        return self.how.mode if self.how else "stop"

    @property
    def was_warned(self) -> bool:
        return self.record.state is State.WARNED and self.record.warned_at is not None

    def decision(self, outcome: _Outcome, *, quiet_hours: bool = False, prefix: str = "", note: str = "") -> Decision:
        """The transition `outcome.event` makes; under quiet hours nothing is posted to owners (the
        record and the audit still say what happened); `prefix` says why a keep no longer holds; `note`
        is something the log must show (a quiet history reset)."""
        transition = TRANSITIONS[outcome.event]
        reason = prefix + transition.explain(outcome.fields) + (f" ({note})" if note else "")
        record = replace(outcome.record, state=transition.target, reason=reason)
        if outcome.action is not Action.NONE and outcome.applied:
            record = replace(record, last_action=outcome.action.value, last_action_at=self.now)
        return Decision(
            self.machine,
            transition.target,
            outcome.action,
            reason,
            self.assessment.signal if self.assessment else None,
            record,
            applied=outcome.applied,
            notify=None if quiet_hours else outcome.notify,
            deliver_warning=outcome.deliver_warning and not quiet_hours,
            assessment=self.assessment,
            policy=self.ref,
            kind=self.kind,
            handling=self.how,
            waited=outcome.waited,
        )


@dataclass(frozen=True)
class _Stretch:
    """The quiet stretch a sweep sees, and whether the record's warning belongs to it."""

    quiet: float  # observed quiet minutes
    warn_at: int  # the quiet minutes at which the owner is warned
    warned: bool  # the record's warning was given in this quiet stretch, and sweeps kept watching since
    resolved: Notice | None  # "resolved": a warning was out and no longer applies
    record: MachineRecord  # the record to write, with idle_since, observed_at and the warning brought up to date
    # What the machine's history moved the warning point by (in warn_at). Frozen: one default serves all.
    learned: LearnedWait = LearnedWait()  # noqa: RUF009
    note: str = ""  # a quiet history that had to be reset, for the reason (and so the log)

    @property
    def learned_text(self) -> str:
        return f"; {self.learned.why}" if self.learned.why else ""


def decide(
    machine: Machine,
    ref: TeamPolicyRef,
    assessment: Assessment | None,
    previous: MachineRecord | None,
    *,
    now: datetime,
    dry_run: bool = False,
    kind: MachineKind = ON_DEMAND,
    waiting: WaitingRule = DEFAULT_RULE,
) -> Decision:
    """The per-machine lifecycle: the event this sweep sees and the transition it makes (TRANSITIONS).
    Read it top to bottom: the first rule that applies decides. `kind`: what kind of machine it is
    (kinds.classify); `ref` is already the machine's own (kind_policy); `waiting`: the replay may set it."""
    record = previous or MachineRecord(
        instance_id=machine.instance_id, team=machine.team, account=machine.account, region=machine.region
    )
    how = handling(kind, machine.instance_type, ref.policy) if ref.policy is not None and not machine.asg_name else None
    base = _carried_over(record, machine, ref, assessment, now, kind, waiting.restart_after_days)
    seen = _Sweep(machine, ref, assessment, record, base, now, dry_run, kind, how)
    # An exemption is read before the policy: it holds in safe mode too. Its "resolved" notice (a warned
    # machine exempted since) keeps quiet hours like any other message to owners.
    exempt, why = parse_exemption(machine.exempt_tag, now)
    if exempt:
        return seen.decision(_exempted(seen, why), quiet_hours=bool(ref.policy and ref.policy.quiet_hours))
    policy = ref.policy
    if policy is None:
        return seen.decision(_Outcome(Event.POLICY_INVALID, Action.NONE, seen.base, {"error": ref.error}))
    quiet_hours = policy.quiet_hours
    if assessment is None or assessment.signal == "unknown":
        why = assessment.reason if assessment else "no signals"
        return seen.decision(
            _Outcome(Event.SIGNALS_UNKNOWN, Action.NONE, seen.base, {"why": why}), quiet_hours=quiet_hours
        )

    cap = _over_runtime_cap(machine, policy, now)
    stretch = _stretch(seen, policy, assessment, waiting if not cap else None)
    # Busy with no quiet stretch at all is busy whatever the warning point (a learned one may be 0).
    if assessment.signal == "busy" and (stretch.quiet < stretch.warn_at or assessment.quiet_since is None):
        return seen.decision(_busy(seen, assessment, stretch, cap), quiet_hours=quiet_hours, note=stretch.note)
    # Quiet from here on: covered, and every track below its threshold since quiet_since, at least the
    # warning point ago when the window still holds activity.
    assert assessment.quiet_since is not None
    kept = record.snoozed_until is not None and now < record.snoozed_until
    if kept and not cap:
        return seen.decision(_kept(record, stretch), quiet_hours=quiet_hours, note=stretch.note)
    prefix = CAP_OVERRIDES_KEEP.format(cap=cap, by=record.snoozed_by or "someone") if kept else ""
    if stretch.quiet < stretch.warn_at:
        outcome = _quiet(policy, assessment, stretch)
    elif seen.mode == "hold":
        why = seen.how.why_not_stop if seen.how else ""
        outcome = _Outcome(Event.KIND_UNKNOWN, Action.NONE, stretch.record, {"quiet": stretch.quiet, "why": why})
    elif seen.mode in ("notify", "terminate") and quiet_hours and not stretch.warned and not dry_run:
        # A notice recorded unsent would never be sent, and a termination cannot be undone: both wait for a
        # person who can read them.
        what = "the notice" if seen.mode == "notify" else "the termination warning"
        outcome = _Outcome(Event.WAITS_FOR_PEOPLE, Action.NONE, stretch.record, {"quiet": stretch.quiet, "what": what})
    elif seen.mode == "notify":
        outcome = _notice(seen, assessment, stretch)
    elif not stretch.warned and not dry_run:
        outcome = _warning_due(seen, policy, assessment, stretch)
    else:
        outcome = _after_warning(seen, policy, assessment, stretch)
    return seen.decision(outcome, quiet_hours=quiet_hours, prefix=prefix, note=stretch.note)


def _carried_over(
    record: MachineRecord,
    machine: Machine,
    ref: TeamPolicyRef,
    assessment: Assessment | None,
    now: datetime,
    kind: MachineKind,
    restart_after: int,
) -> MachineRecord:
    """The previous record with this sweep's facts about the machine and its policy, version bumped, and
    its usage profile updated from the datapoints this sweep read (it starts again on another team or after
    `restart_after` days without data). A failed kind look-up keeps the kind the last sweep saw."""
    known = kind.kind is not Kind.UNKNOWN
    profile = record.usage_profile if record.team == machine.team else ""
    if assessment is not None:
        profile, _ = observe_text(profile, assessment.usage.seen_day, assessment.usage.busy_hours, restart_after)
    return replace(
        record,
        machine_kind=kind.kind.value if known else record.machine_kind,
        kind_note=describe(kind) if known else record.kind_note,
        spot_max_price=(f"{kind.spot_max_price:g}" if kind.spot_max_price is not None else "")
        if known
        else record.spot_max_price,
        team=machine.team,
        version=record.version + 1,
        policy_version=ref.label,
        updated_at=now,
        name=machine.name,
        instance_type=machine.instance_type,
        owner=machine.owner,
        asg_name=machine.asg_name,
        owner_slack_id=record.owner_slack_id if record.owner == machine.owner else None,
        usage_profile=profile,
        endpoint=kept_restore(record.endpoint, machine.facts.endpoint, machine.facts.studio),
    )


def _stretch(seen: _Sweep, policy: TeamPolicy, assessment: Assessment, learn: WaitingRule | None) -> _Stretch:
    """The quiet stretch as this sweep sees it, what of the record (idle-since, the warning) still belongs
    to it, and the warning point: the team's, moved by what the machine's past stretches teach (`learn`;
    None over the runtime cap, a hard limit that history must not stretch, as it overrides a keep)."""
    record, now = seen.record, seen.now
    interrupted = assessment.interrupted_at
    # A warning (and an idle-since) counts only for this quiet stretch: activity or a data hole
    # seen after it means the machine may have been used, so it starts over.
    # ...and only if sweeps kept watching: after a stretch of unknown data, safe mode or no sweeps at all,
    # use in between may have fallen out of the fetched data, so the machine must be warned afresh.
    watched = record.observed_at is not None and now - record.observed_at <= timedelta(minutes=policy.idle_minutes)
    # A warning given while the machine was another kind promised something else: it is warned afresh.
    watched = watched and (record.machine_kind or Kind.ON_DEMAND) == (seen.base.machine_kind or Kind.ON_DEMAND)
    warned = watched and record.warned_at is not None and (interrupted is None or interrupted <= record.warned_at)
    continuous = watched and record.idle_since is not None and (interrupted is None or interrupted <= record.idle_since)
    idle_since = record.idle_since if continuous else assessment.quiet_since
    base = replace(seen.base, idle_since=idle_since if assessment.quiet_since else None, observed_at=now)
    history, note = parse_history(base.quiet_history)
    if note:
        base = replace(base, quiet_history="")
    if watched and not continuous and interrupted is not None and record.idle_since and record.observed_at:
        # The last stretch ended in activity seen by watching sweeps: it lasted until the last sweep that
        # saw it quiet.
        ended = (record.observed_at - record.idle_since).total_seconds() / 60
        base = with_stretch(base, record.idle_since, ended, earliest_warn_minutes(policy))
        history, _ = parse_history(base.quiet_history)
    if not warned and (
        base.warned_at
        or base.warning_delivered_at
        or base.warning_ref
        or base.stop_not_before
        or base.action_refused_at
        or base.warning_owed
    ):
        base = replace(
            base,
            warned_at=None,
            warning_delivered_at=None,
            warning_ref=None,
            stop_not_before=None,
            action_refused_at=None,
            warning_held=False,
            warning_owed=(),
        )
    quiet = _quiet_minutes(assessment, idle_since if continuous else None, now)
    learned = LearnedWait()
    if idle_since and learn is not None:
        learned = wait_for(history, base.usage_profile, policy, idle_since, quiet, learn)
    return _Stretch(
        quiet=quiet,
        warn_at=warn_point(policy) + learned.extra_minutes,
        warned=warned,
        resolved="resolved" if seen.was_warned and not warned else None,
        record=base,
        learned=learned,
        note=note,
    )


def _quiet_minutes(assessment: Assessment, recorded_since: datetime | None, now: datetime) -> float:
    """Observed quiet, measured from the start of the stretch the record keeps when sweeps watched it
    all along, not only from what this sweep fetched: a warning point later than idle_minutes +
    max_gap_minutes is still reached, and so is the stop (the wait never leaves a machine unstopped)."""
    quiet = assessment.quiet_minutes(now)
    if recorded_since is None or assessment.quiet_since is None:
        return quiet
    observed = min(now, assessment.observed_until or now)
    return max(quiet, (observed - recorded_since).total_seconds() / 60)


def _over_runtime_cap(machine: Machine, policy: TeamPolicy, now: datetime) -> str:
    """Why the hard cap applies ('' when it does not): up max_runtime_hours or longer since its last start.
    It overrides a keep, never a busy signal (and an exemption is handled before it)."""
    runtime = now - machine.launch_time
    cap = policy.max_runtime_hours
    if cap is None or runtime < timedelta(hours=cap):
        return ""
    return f"up {runtime.total_seconds() / 3600:.0f} h, over max_runtime_hours ({cap})"


def _exempted(seen: _Sweep, why: str) -> _Outcome:
    """Exempt: reported, never touched; an outstanding warning is resolved."""
    cleared = replace(
        seen.base, idle_since=None, warned_at=None, warning_delivered_at=None, warning_ref=None, warning_owed=()
    )
    return _Outcome(Event.EXEMPTED, Action.NONE, cleared, {"why": why}, notify="resolved" if seen.was_warned else None)


def _busy(seen: _Sweep, assessment: Assessment, stretch: _Stretch, cap: str) -> _Outcome:
    """Activity less than the warning point ago: keep a group member protected from scale-in."""
    machine = seen.machine
    action = Action.PROTECT if machine.asg_name and not machine.asg_protected else Action.NONE
    notes = f"; scale-in protection set in {machine.asg_name}" if action is Action.PROTECT else ""
    if cap:
        notes += f"; {cap} but busy, so not stopped"
    return _Outcome(
        Event.QUIET_AFTER_BUSY if stretch.quiet > 0 else Event.BUSY,
        action,
        stretch.record,
        {
            "quiet": stretch.quiet,
            "activity": assessment.reason,
            "warn_at": stretch.warn_at,
            "learned": stretch.learned_text,
            "notes": notes,
        },
        applied=not seen.dry_run,
        notify=stretch.resolved,
    )


def _kept(record: MachineRecord, stretch: _Stretch) -> _Outcome:
    """Quiet, but someone asked to keep it and the keep has not ended."""
    assert record.snoozed_until is not None
    fields = {"quiet": stretch.quiet, "by": record.snoozed_by or "someone", "until": record.snoozed_until.isoformat()}
    return _Outcome(Event.KEPT, Action.NONE, stretch.record, fields, notify=stretch.resolved)


def _quiet(policy: TeamPolicy, assessment: Assessment, stretch: _Stretch) -> _Outcome:
    """Quiet, not yet for as long as the warning point."""
    fields = {
        "quiet": stretch.quiet,
        "warn_at": stretch.warn_at,
        "stop_minutes": policy.idle_minutes + max(0, stretch.learned.extra_minutes),
        "learned": stretch.learned_text,
        "why_quiet": assessment.why_quiet,
    }
    return _Outcome(Event.QUIET, Action.NONE, stretch.record, fields, notify=stretch.resolved)


def _warned_afresh(record: MachineRecord, now: datetime, stop_not_before: datetime | None) -> MachineRecord:
    """A new warning (or notice): nothing of an earlier one's delivery carries over."""
    return replace(
        record,
        warned_at=now,
        warning_delivered_at=None,
        warning_ref=None,
        stop_not_before=stop_not_before,
        warning_held=False,
        warning_owed=(),
    )


def _warning_due(seen: _Sweep, policy: TeamPolicy, assessment: Assessment, stretch: _Stretch) -> _Outcome:
    """Past the warning point with no warning for this quiet stretch: warn, announcing the stop time."""
    assert assessment.quiet_since is not None
    now = seen.now
    stop_at = max(
        now + timedelta(minutes=policy.warn_minutes), assessment.quiet_since + timedelta(minutes=policy.idle_minutes)
    )
    record = _warned_afresh(stretch.record, now, stop_at)
    notes = _kind_notes(seen)
    if policy.quiet_hours:
        # Recorded, not sent; counted as delivered while quiet hours last, so the stop follows warn_minutes
        # later as usual (and is summarised when they end). Still ahead when they end: sent then.
        record = replace(record, warning_delivered_at=now, warning_held=True)
        notes += " (quiet hours: warning recorded, not sent)"
    fields = {
        "quiet": stretch.quiet,
        "verb": _verb(seen.machine, policy, seen.how),
        "stop_at": stop_at,
        "notes": notes,
        "learned": stretch.learned_text,
        "why_quiet": assessment.why_quiet,
    }
    waited = stretch.learned.why if stretch.learned.extra_minutes > 0 else ""
    return _Outcome(
        Event.WARNING_DUE, Action.WARN, record, fields, notify="warning", deliver_warning=True, waited=waited
    )


def _after_warning(seen: _Sweep, policy: TeamPolicy, assessment: Assessment, stretch: _Stretch) -> _Outcome:
    """Warned (or, in a dry run without a real warning, assumed warned on time and unanswered): the stop
    is due once idle for the whole window, warn_minutes after the warning was delivered, and not before
    the time it announced. An undelivered warning holds the stop for undelivered_warning_max_minutes."""
    assert assessment.quiet_since is not None
    record, now = seen.record, seen.now
    if stretch.warned and record.warning_held and not policy.quiet_hours:
        # Quiet hours are over and the stop is still ahead: the warning recorded silently is sent now, as a
        # warning of its own, and the stop waits warn_minutes from its delivery.
        def sent_now(r: MachineRecord) -> MachineRecord:
            return replace(r, warned_at=now, warning_delivered_at=None, warning_held=False, warning_owed=())

        record = sent_now(record)
        stretch = replace(stretch, record=sent_now(stretch.record))
    undelivered_ok = False
    owner_until: datetime | None = None  # set while the stop waits for the owner's own copy
    if stretch.warned:
        assert record.warned_at is not None
        pending = now - record.warned_at
        # A termination cannot be undone: it never follows a warning nobody received. Nor does any stop follow a
        # warning whose outcome Slack answered but would not show: only Slack being unreachable lets it proceed.
        undelivered_ok = (
            seen.mode != "terminate"
            and record.warning_delivered_at is None
            and not record.delivery_unresolved
            and pending >= timedelta(minutes=policy.undelivered_warning_max_minutes)
        )
        # The owner's time to answer runs from delivery; an undelivered warning holds the stop.
        clock_from = record.warning_delivered_at or (record.warned_at if undelivered_ok else None)
        # Delivered to the team channel while the owner's own copy (their DM) is still owed: the owner is told
        # personally before the stop, so it waits for that copy (posted again every sweep, and warn_minutes from
        # when it lands: its stop time) for undelivered_warning_max_minutes at most; then the channel's copy, which
        # a person could answer, stands, and the admins are told the owner's never went out.
        held = timedelta(minutes=policy.undelivered_warning_max_minutes)
        if clock_from is not None and owes_owner(record) and pending < held:
            owner_until, clock_from = record.warned_at + held, None
    else:
        clock_from = assessment.quiet_since + timedelta(minutes=stretch.warn_at)
    due = (
        assessment.signal == "idle"
        and stretch.quiet >= policy.idle_minutes
        and clock_from is not None
        and now - clock_from >= timedelta(minutes=policy.warn_minutes)
        # Never before the time the warning announced, even if a schedule has shortened the window since.
        and (not stretch.warned or record.stop_not_before is None or now >= record.stop_not_before)
    )
    fields: dict[str, object] = {
        "quiet": stretch.quiet,
        "verb": _verb(seen.machine, policy, seen.how),
        "why_quiet": assessment.why_quiet,
    }
    if due and stretch.warned and record.action_refused_at is not None:
        # EC2 refused it once this stretch for a reason a retry does not change: say so, do not ask again.
        fields["why"] = (
            f"EC2 refused it at {record.action_refused_at:%H:%M} UTC ({record.last_action}); not tried again "
            "until the machine is busy again"
        )
        return _Outcome(Event.STOP_REPORTED, Action.NONE, stretch.record, fields, applied=False)
    if due:
        return _stop_due(seen, policy, stretch, undelivered_ok, fields)
    if not stretch.warned:
        return _Outcome(Event.WOULD_WARN, Action.WARN, stretch.record, fields, applied=False)
    deliver = record.warning_delivered_at is None and not seen.dry_run
    if owner_until is not None:
        fields.update(warned_at=record.warned_at, until=owner_until)
        return _Outcome(Event.OWNER_COPY_OWED, Action.NONE, stretch.record, fields)
    if clock_from is None:
        fields["warned_at"] = record.warned_at
        return _Outcome(Event.WARNING_UNDELIVERED, Action.NONE, stretch.record, fields, deliver_warning=deliver)
    fields["stop_at"] = max(
        clock_from + timedelta(minutes=policy.warn_minutes),
        assessment.quiet_since + timedelta(minutes=policy.idle_minutes),
        record.stop_not_before or now,
    )
    return _Outcome(Event.ANSWER_TIME, Action.NONE, stretch.record, fields, deliver_warning=deliver)


def _stop_due(
    seen: _Sweep, policy: TeamPolicy, stretch: _Stretch, undelivered_ok: bool, fields: dict[str, object]
) -> _Outcome:
    """Reap: stop, hibernate, release or terminate; reported only under dry_run or a notify_only policy."""
    machine = seen.machine
    action, why = _reap_action(machine, policy, seen.how)
    notify_only = policy.action == "notify_only" and not machine.asg_name
    if undelivered_ok:
        why += f" (the warning was never delivered; stopping after {policy.undelivered_warning_max_minutes} min)"
    if not stretch.warned:
        why += " (dry run: assuming an unanswered warning)"
    if notify_only:
        why = f"notify_only policy, nothing is stopped: {why}"
    fields = {**fields, "why": why}
    if action is Action.NONE:  # a group member already unprotected: nothing to do, nothing to report
        return _Outcome(Event.STOP_DUE, action, stretch.record, fields)
    if seen.dry_run or notify_only:
        return _Outcome(Event.STOP_REPORTED, action, stretch.record, fields, applied=False)
    # The warning's buttons no longer apply.
    return _Outcome(Event.STOP_DUE, action, replace(stretch.record, warning_ref=None), fields, notify="reaped")


def _reap_action(machine: Machine, policy: TeamPolicy, how: Handling | None = None) -> tuple[Action, str]:
    if machine.asg_name:
        if policy.asg_action == "terminate":
            return Action.TERMINATE, f"idle member of {machine.asg_name}: terminate and shrink the group"
        if machine.asg_protected:
            return Action.UNPROTECT, f"idle member of {machine.asg_name}: scale-in protection released"
        return Action.NONE, f"idle member of {machine.asg_name}: already unprotected, the group may scale it in"
    if how is not None and how.mode == "terminate":
        why = f"idle past its {how.idle_minutes}-min window and EC2 cannot stop it: terminate"
        return Action.TERMINATE_INSTANCE, why
    if machine.deleted_by_stop:
        return Action.STOP, f"idle past its window: delete it ({words_for(machine.instance_id).keeps} kept)"
    if policy.action == "hibernate":
        if machine.hibernation_configured:
            return Action.HIBERNATE, "idle past its window: hibernate"
        return Action.STOP, "idle past its window: stop (hibernation is not configured on this machine)"
    return Action.STOP, "idle past its window: stop"


def _verb(machine: Machine, policy: TeamPolicy, how: Handling | None = None) -> str:
    if machine.asg_name:
        return "terminate it" if policy.asg_action == "terminate" else "release it to its group"
    if how is not None and how.mode == "terminate":
        return "terminate it" if policy.action != "notify_only" else "report it (notify only)"
    if machine.deleted_by_stop and policy.action != "notify_only":
        return "delete it"
    return {"stop": "stop it", "hibernate": "hibernate it", "notify_only": "report it (notify only)"}[policy.action]


def _kind_notes(seen: _Sweep) -> str:
    """What the kind adds to a warning's reason: why termination, an unsaved reservation, scarce capacity."""
    if seen.how is None:
        return ""
    return "".join(f"; {note}" for note in caveats(seen.kind, seen.how, seen.machine.instance_type))


def _notice(seen: _Sweep, assessment: Assessment, stretch: _Stretch) -> _Outcome:
    """Past the warning point of a machine the reaper does not stop (kinds.Handling "notify"): its
    owner (and, for a fleet or a reservation, the admins) is told once per quiet stretch; nothing more."""
    record, now = seen.record, seen.now
    how = seen.how
    assert how is not None
    what = f"not stopped: {how.why_not_stop}" if how.why_not_stop else "not stopped"
    fields: dict[str, object] = {
        "quiet": stretch.quiet,
        "what": what,
        "why_quiet": assessment.why_quiet,
        "learned": stretch.learned_text,
        "notes": "; the admins are told too" if how.tell_admins else "",
    }
    if not stretch.warned:
        if seen.dry_run:
            return _Outcome(Event.NOTICE_DUE, Action.WARN, stretch.record, fields, applied=False)
        # (Never under quiet hours: decide holds a notice until they end.)
        told = _warned_afresh(stretch.record, now, None)
        return _Outcome(Event.NOTICE_DUE, Action.WARN, told, fields, notify="warning", deliver_warning=True)
    fields["warned_at"] = record.warned_at
    deliver = record.warning_delivered_at is None and not seen.dry_run
    return _Outcome(Event.NOTICE_GIVEN, Action.NONE, stretch.record, fields, deliver_warning=deliver)


def kind_policy(ref: TeamPolicyRef, kind: MachineKind, machine: Machine) -> TeamPolicyRef:
    """The machine's own policy: its team's, with the idle window its kind gets (a scarce family's own window,
    the longer one termination waits for, an endpoint's endpoint_idle_minutes). The sweep fetches signals and
    decides with it."""
    policy = ref.policy
    if policy is None or machine.asg_name:
        return ref
    if machine.is_endpoint:  # its own window, and nothing of a machine's insides (core/endpoints.py)
        return ref.model_copy(update={"policy": endpoint_policy(policy)})
    window = handling(kind, machine.instance_type, policy).idle_minutes
    if window == policy.idle_minutes:
        return ref
    return ref.model_copy(update={"policy": policy.model_copy(update={"idle_minutes": window})})
