"""The decision core: is a machine busy, idle or unknown, and what happens to it now.

Pure functions over plain data: no boto3, no Slack, no clock. The same code runs in Lambda, the CLI,
the demo and trace replay. The invariant above all: never reap a busy machine; missing data is
"unknown", never "idle".
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import lru_cache
from typing import Literal
from zoneinfo import ZoneInfo

from idle_reaper.policy import TeamPolicy, TeamPolicyRef
from idle_reaper.time_of_day import epoch_day, epoch_hours, observe_text, parse_profile, time_of_day_wait

Signal = Literal["busy", "idle", "unknown"]


class State(StrEnum):
    """Where a machine is in its lifecycle, as kept in the state table."""

    ACTIVE = "active"  # busy, or quiet for less than the warning point
    IDLE = "idle"  # quiet, not yet at the warning point
    WARNED = "warned"  # the owner was (or is being) warned; the stop follows unless answered
    SNOOZED = "snoozed"  # someone asked to keep it
    REAPED = "reaped"  # stopped, hibernated, terminated or released to its group
    UNKNOWN = "unknown"  # not enough data to say; nothing happens
    EXEMPT = "exempt"  # tagged exempt; reported, never touched
    SAFE_MODE = "safe_mode"  # the team's policy is invalid; nothing happens


class Action(StrEnum):
    NONE = "none"
    WARN = "warn"
    STOP = "stop"
    HIBERNATE = "hibernate"
    PROTECT = "protect"  # ASG member: set scale-in protection
    UNPROTECT = "unprotect"  # ASG member: drop scale-in protection so the group may shrink
    TERMINATE = "terminate"  # ASG member: terminate and decrement desired capacity


# Actions that change a machine (as opposed to a warning, which only talks to people).
MACHINE_ACTIONS = frozenset({Action.STOP, Action.HIBERNATE, Action.PROTECT, Action.UNPROTECT, Action.TERMINATE})
REAP_ACTIONS = frozenset({Action.STOP, Action.HIBERNATE, Action.UNPROTECT, Action.TERMINATE})


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Machine:
    instance_id: str
    instance_type: str
    team: str
    launch_time: datetime
    name: str | None = None
    owner: str | None = None
    exempt_tag: str | None = None  # raw value of the exemption tag, if present
    asg_name: str | None = None
    asg_protected: bool = False
    hibernation_configured: bool = False

    @property
    def family(self) -> str:
        return self.instance_type.split(".", 1)[0]


Point = tuple[datetime, float]  # (period start, value)


@dataclass(frozen=True)
class Signals:
    """Datapoints fetched for one machine, sorted by time. `complete` is False when CloudWatch
    answered PartialData we could not finish, or a query errored: such a machine is unknown."""

    cpu: Sequence[Point] = ()
    gpu: Sequence[Point] = ()
    network_in: Sequence[Point] = ()
    network_out: Sequence[Point] = ()
    complete: bool = True
    # CWAgent idle_reaper_minutes_since_input (Minimum): minutes since a person's last input, 0-10080
    # (HUMAN_NONE = none seen). No points: the collector is not running, no information either way.
    user: Sequence[Point] = ()


@dataclass(frozen=True)
class Assessment:
    signal: Signal
    reason: str
    quiet_since: datetime | None = None  # start of the covered, below-threshold run that ends now
    max_cpu: float | None = None
    max_gpu: float | None = None
    max_network: float | None = None  # bytes per second
    uses_gpu: bool = False
    # End of the newest activity or data hole in the fetched data (None: none seen). A warning given
    # before this belongs to an earlier quiet stretch and no longer counts.
    interrupted_at: datetime | None = None
    observed_until: datetime | None = None  # end of the newest datapoint every track has
    quiet_summary: str = ""  # what the quiet stretch looked like, for warnings ("why it counts as idle")
    # The human-activity signal: a person active within human_active_minutes, none, no usable data,
    # or "off" (the policy ignores it).
    human_signal: Literal["active", "quiet", "missing", "off"] = "off"
    # For the machine's usage profile (time_of_day.py): the UTC hours (since the epoch) of the busy
    # datapoints fetched, and the UTC day of the newest datapoint (None: no data).
    busy_hours: tuple[int, ...] = ()
    seen_day: int | None = None

    @property
    def why_quiet(self) -> str:
        return self.quiet_summary or self.reason

    def quiet_minutes(self, now: datetime) -> float:
        """Observed quiet only: up to the end of the newest datapoint, never the unreported tail."""
        if self.quiet_since is None:
            return 0.0
        until = min(now, self.observed_until or now)
        return max(0.0, (until - self.quiet_since).total_seconds() / 60)


# ---------------------------------------------------------------------------------------------
# Signal assessment


@dataclass(frozen=True)
class _Track:
    label: str
    threshold: float
    points: Sequence[Point]
    unit: str = "%"


def _coverage(
    points: Sequence[Point], period: timedelta, max_gap: timedelta, now: datetime
) -> tuple[datetime, bool] | None:
    """Earliest time from which `points` cover [t, now] with no hole longer than max_gap, and whether
    that coverage starts after a real hole (True) or only where the fetched data begins (False).
    None when there are no points or the newest one is already too old (the data stopped)."""
    if not points:
        return None
    last_start = points[-1][0]
    if now - (last_start + period) > max_gap:
        return None
    since = last_start
    for (earlier, _), (later, _) in zip(reversed(points[:-1]), reversed(points[1:]), strict=True):
        if later - (earlier + period) > max_gap:
            return since, True
        since = earlier
    # Before the first point we know nothing; allow a leading hole of max_gap like any other.
    return since - max_gap, False


def _fmt(value: float, unit: str) -> str:
    if unit == "B/s":
        return f"{value:,.0f} B/s"
    return f"{value:.1f}%"


def _below(label: str, value: float, threshold: float, unit: str) -> str:
    """'max CPU 4.96% < 5.0%': enough digits that a value just under the threshold never reads as equal."""
    shown = _fmt(value, unit)
    if unit == "%" and shown == _fmt(threshold, unit):
        shown = f"{value:.3f}".rstrip("0") + "%"
    return f"max {label} {shown} < {_fmt(threshold, unit)}"


def _combine_network(inbound: Sequence[Point], outbound: Sequence[Point], period: timedelta) -> list[Point]:
    """NetworkIn + NetworkOut (Sum per period, bytes) as bytes per second; only periods with both."""
    out_by_time = dict(outbound)
    seconds = period.total_seconds()
    return [(t, (v + out_by_time[t]) / seconds) for t, v in inbound if t in out_by_time]


# Every EC2 family starting p<digit>, g<digit> or gr<digit> carries GPUs (p6-b200, g4ad, ...): a family
# AWS adds next year must count as a GPU machine before anyone updates a list.
_GPU_FAMILY = re.compile(r"^(p|g|gr)\d")


def is_gpu_type(instance_type: str, gpu_families: Iterable[str]) -> bool:
    family = instance_type.split(".", 1)[0]
    return family in set(gpu_families) or bool(_GPU_FAMILY.match(family))


HUMAN_NONE = 10080.0  # the collector's "no human input seen" (a week, in minutes)


def last_human_input(points: Sequence[Point], now: datetime) -> tuple[datetime | None, int]:
    """The latest human input the user track shows (datapoint time - minutes since input), and how many
    datapoints were garbage and ignored: negative, over HUMAN_NONE, NaN, or an input time in the future
    (a skewed clock). HUMAN_NONE means no input seen: a valid point that names no input."""
    latest: datetime | None = None
    bad = 0
    for t, minutes in points:
        if not 0.0 <= minutes <= HUMAN_NONE:  # also NaN
            bad += 1
            continue
        if minutes == HUMAN_NONE:
            continue
        at = t - timedelta(minutes=minutes)
        if at > now or t > now:
            bad += 1
            continue
        latest = at if latest is None or at > latest else latest
    return latest, bad


def assess(
    machine: Machine,
    signals: Signals,
    policy: TeamPolicy,
    *,
    now: datetime,
    period: timedelta,
    gpu_families: Iterable[str],
) -> Assessment:
    """Busy if any datapoint in the window is at or above a threshold; idle if the whole window is
    covered and every datapoint is below every threshold; unknown otherwise."""
    window = timedelta(minutes=policy.idle_minutes)
    window_start = now - window
    # A hole may be at most half the window: a window must hold real datapoints to be called idle.
    max_gap = timedelta(minutes=min(policy.max_gap_minutes, policy.idle_minutes // 2))

    if not signals.complete:
        return Assessment("unknown", "CloudWatch did not return complete metrics for this machine")

    tracks = [_Track("CPU", policy.cpu_threshold_percent, sorted(signals.cpu))]
    notes: list[str] = []
    gpu_type = is_gpu_type(machine.instance_type, gpu_families)
    uses_gpu = bool(signals.gpu) or gpu_type
    if signals.gpu:
        tracks.append(_Track("GPU", policy.gpu_threshold_percent, sorted(signals.gpu)))
    elif gpu_type:
        if policy.missing_gpu_metrics == "busy":
            return Assessment(
                "unknown",
                f"GPU instance {machine.instance_type} reports no GPU metrics; "
                "policy missing_gpu_metrics=busy never treats it as idle",
                uses_gpu=True,
            )
        notes.append("no GPU metrics, judged on CPU alone (missing_gpu_metrics=cpu_only)")
    if policy.network_threshold_bytes_per_second is not None:
        network = sorted(_combine_network(signals.network_in, signals.network_out, period))
        tracks.append(_Track("network", policy.network_threshold_bytes_per_second, network, "B/s"))

    def in_window(points: Sequence[Point]) -> list[Point]:
        return [(t, v) for t, v in points if t + period > window_start and t <= now]

    maxima: dict[str, float | None] = {}
    busy_times: list[datetime] = []  # for the usage profile: every busy datapoint fetched
    latest_high: tuple[datetime, _Track, float] | None = None
    interrupted_at: datetime | None = None  # end of the newest activity or data hole seen
    # A person at the keyboard: active from their last input for human_active_minutes, like a busy bucket.
    human: Literal["active", "quiet", "missing", "off"] = "off"
    human_until: datetime | None = None  # the end of the newest human activity
    last_input: datetime | None = None
    if policy.human_active_minutes:
        last_input, bad = last_human_input(signals.user, now)
        if bad:
            notes.append(f"ignored {bad} unusable human-activity value{'s' if bad > 1 else ''}")
        if len(signals.user) == bad:  # said on the Assessment (status shows it), not in every reason
            human = "missing"
        elif last_input is None:
            human = "quiet"
        else:
            human_until = min(now, last_input + timedelta(minutes=policy.human_active_minutes))
            interrupted_at = human_until
            human = "active" if human_until > window_start else "quiet"
        # A person's input within the datapoint's own period makes its hour a busy one (as the replay's truth).
        busy_times.extend(t for t, v in signals.user if 0 <= v < period.total_seconds() / 60 and t <= now)
    for track in tracks:
        windowed = in_window(track.points)
        maxima[track.label] = max((v for _, v in windowed), default=None)
        highs = [(t, v) for t, v in track.points if v >= track.threshold and t <= now]
        busy_times.extend(t for t, _ in highs)
        if highs:
            t_high, v_high = highs[-1]
            interrupted_at = max(interrupted_at or t_high, t_high + period)
            if t_high + period > window_start and (latest_high is None or t_high > latest_high[0]):
                latest_high = (t_high, track, v_high)

    def result(signal: Signal, reason: str, since: datetime | None) -> Assessment:
        if notes:
            reason = f"{reason} ({'; '.join(notes)})"
        summary = ""
        if since is not None:
            parts = []
            for track in tracks:
                peak = max((v for t, v in track.points if t >= since), default=0.0)
                parts.append(_below(track.label, peak, track.threshold, track.unit))
            summary = f"quiet since {since:%H:%M} UTC: {', '.join(parts)}"
            if notes:
                summary += f" ({'; '.join(notes)})"
        return Assessment(
            signal,
            reason,
            since,
            max_cpu=maxima.get("CPU"),
            max_gpu=maxima.get("GPU"),
            max_network=maxima.get("network"),
            uses_gpu=uses_gpu,
            interrupted_at=interrupted_at,
            observed_until=observed_until,
            quiet_summary=summary,
            human_signal=human,
            busy_hours=epoch_hours(busy_times),
            seen_day=epoch_day(newest_point) if newest_point else None,
        )

    observed_until = (
        min(track.points[-1][0] for track in tracks) + period if all(track.points for track in tracks) else None
    )
    newest_point = max((track.points[-1][0] for track in tracks if track.points), default=None)
    coverage = [_coverage(track.points, period, max_gap, now) for track in tracks]
    covered = [c[0] if c else None for c in coverage]
    for c in coverage:
        if c and c[1]:
            interrupted_at = max(interrupted_at or c[0], c[0])
    quiet: datetime | None = None
    if all(c is not None for c in covered):
        quiet_since = max([machine.launch_time, *(c for c in covered if c is not None)])
        if interrupted_at is not None:
            quiet_since = max(quiet_since, interrupted_at)
        # Quiet must be observed: every track has a point at or after the start of the quiet run.
        newest = min(track.points[-1][0] for track in tracks)
        quiet = quiet_since if quiet_since <= newest else None

    if human == "active" and last_input and human_until and (latest_high is None or human_until >= latest_high[0]):
        return result(
            "busy",
            f"a person was active at {last_input:%H:%M} UTC, within human_active_minutes "
            f"({policy.human_active_minutes}) of the {policy.idle_minutes}-min window",
            quiet,
        )
    if latest_high is not None:
        t_high, track, value = latest_high
        return result(
            "busy",
            f"{track.label} {_fmt(value, track.unit)} at {t_high:%H:%M} UTC is at or above "
            f"{_fmt(track.threshold, track.unit)} within the {policy.idle_minutes}-min window",
            quiet,
        )
    if machine.launch_time > window_start:
        age = (now - machine.launch_time).total_seconds() / 60
        return result(
            "unknown", f"started {age:.0f} min ago, less than one idle window ({policy.idle_minutes} min)", None
        )
    for track, since in zip(tracks, covered, strict=True):
        if since is None:
            if not track.points:
                return result("unknown", f"no {track.label} datapoints", None)
            last = track.points[-1][0] + period
            return result(
                "unknown", f"no {track.label} data since {last:%H:%M} UTC (gap over {policy.max_gap_minutes} min)", None
            )
        if since > window_start:
            return result(
                "unknown",
                f"{track.label} data has a gap over {policy.max_gap_minutes} min "
                f"before {since + max_gap:%H:%M} UTC; the window is not covered",
                quiet,
            )
    for track in tracks:
        if maxima[track.label] is None:
            return result("unknown", f"no {track.label} datapoints inside the {policy.idle_minutes}-min window", quiet)
    below = ", ".join(_below(track.label, maxima[track.label] or 0.0, track.threshold, track.unit) for track in tracks)
    return result("idle", f"quiet for the whole {policy.idle_minutes}-min window: {below}", quiet)


# ---------------------------------------------------------------------------------------------
# Exemption


def parse_exemption(value: str | None, now: datetime) -> tuple[bool, str]:
    """`true`, or an ISO-8601 time until which the machine is exempt. A value we cannot read is
    treated as exempt: a typo must make the reaper do less, never more."""
    if value is None:
        return False, ""
    text = value.strip()
    if text.lower() == "true":
        return True, "tagged exempt"
    if text.lower() == "false":
        return False, ""
    try:
        until = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return True, f"exemption tag value {value!r} is not 'true' or an ISO time; treated as exempt"
    if until.tzinfo is None:
        until = until.replace(tzinfo=now.tzinfo)
    if until > now:
        return True, f"exempt until {until.isoformat()}"
    return False, f"exemption expired at {until.isoformat()}"


# ---------------------------------------------------------------------------------------------
# Lifecycle


@dataclass(frozen=True)
class MachineRecord:
    """One machine's lifecycle as kept in the state table. `version` guards conditional writes."""

    instance_id: str
    team: str
    state: State = State.ACTIVE
    version: int = 0
    idle_since: datetime | None = None
    warned_at: datetime | None = None
    warning_delivered_at: datetime | None = None
    snoozed_until: datetime | None = None
    snoozed_by: str | None = None
    last_action: str | None = None
    last_action_at: datetime | None = None
    policy_version: str | None = None
    reason: str = ""
    updated_at: datetime | None = None
    # Facts about the machine, kept so Slack answers and `status` need no EC2 call.
    name: str | None = None
    instance_type: str | None = None
    owner: str | None = None  # the Owner tag: a Slack user id or an email
    asg_name: str | None = None
    owner_slack_id: str | None = None  # the owner resolved to a Slack user id
    # The current Slack message: its buttons carry `warning_ref`, an opaque single-use reference.
    warning_ref: str | None = None
    messages: tuple[str, ...] = ()  # "channel|ts" of every copy, for chat.update
    snooze_day: str | None = None  # the team-local date snoozes_today counts for
    snoozes_today: int = 0
    observed_at: datetime | None = None  # the last sweep that could tell busy from idle
    stop_not_before: datetime | None = None  # the stop time the current warning announced
    # Delivery of the current warning, kept by the sweep (decide() carries them along untouched):
    warning_post_started_at: datetime | None = None  # a sweep began posting it and has not recorded the outcome
    delivery_error: str | None = None  # why it cannot be delivered, or that delivery is unknown: not posted again
    # How the machine's last quiet stretches ended: their lengths in minutes, oldest first, comma-separated
    # (format_history); the learned wait reads it. Bounded: HISTORY_SIZE stretches, each at most a week.
    quiet_history: str = ""
    # When the machine was busy over its last two weeks, by UTC hour (time_of_day.py, at most
    # PROFILE_MAX_CHARS characters); the time-of-day wait reads it. Kept from the datapoints each sweep reads.
    usage_profile: str = ""
    # The human-activity signal the last sweep saw, for `status` (human_signal_note): "" when the policy
    # ignores it, "missing", or "active"/"quiet" with the newest input seen ("active 2026-11-23T12:03Z").
    human_signal: str = ""
    # The "Keep all" reference of the one message that lists this machine with its owner's other machines
    # (owner_message_groups); later updates of this machine edit that shared message. None: its own message.
    group_ref: str | None = None
    # When the sweep stopped it during its team's quiet hours, until its owner is told (quiet_hours_reports).
    quiet_stop_at: datetime | None = None


# ---------------------------------------------------------------------------------------------
# Learned waiting: each machine's quiet stretches, and what they say about the current one

HISTORY_SIZE = 24  # stretches kept per machine
HISTORY_CAP_MINUTES = 10080  # a stretch longer than a week is kept as a week
_HISTORY_MAX_CHARS = HISTORY_SIZE * len(f"23:{HISTORY_CAP_MINUTES},")
UNWANTED_WITHIN_MINUTES = 60  # activity this soon after a stop means the stop was unwanted
LEARN_MIN_STRETCHES = 3  # fewer stretches of a length than this teach nothing about it
LEARN_SOON_SHARE = 0.4  # wait longer while more than this share of such stretches ended soon
LEARN_STEP_MINUTES = 15
LEARN_HOURS_AROUND = 1  # stretches that began within this many hours of the time of day count as alike

Stretch = tuple[int, int]  # (UTC hour the quiet stretch began, its length in minutes)


@lru_cache(maxsize=4096)  # pure, and read on every sweep of every machine (the replay: millions of times)
def parse_history(text: str) -> tuple[tuple[Stretch, ...], str]:
    """The stretches a record's quiet_history holds ("hour:minutes,..." oldest first), and a note for the
    log when it had to be reset (unreadable, out of range or oversized: a corrupted item must never fail
    a sweep)."""
    if not text:
        return (), ""
    parts = text.split(",")
    if len(text) > _HISTORY_MAX_CHARS or len(parts) > HISTORY_SIZE:
        return (), f"quiet history of {len(parts)} entries ({len(text)} characters) is oversized; reset to empty"
    stretches: list[Stretch] = []
    for part in parts:
        hour, _, minutes = part.partition(":")
        if not (hour.isascii() and hour.isdigit() and minutes.isascii() and minutes.isdigit()):
            break
        if int(hour) > 23 or int(minutes) > HISTORY_CAP_MINUTES:
            break
        stretches.append((int(hour), int(minutes)))
    else:
        return tuple(stretches), ""
    shown = text if len(text) <= 40 else text[:39] + "…"
    return (), f"quiet history {shown!r} is unreadable; reset to empty"


def format_history(stretches: Iterable[Stretch]) -> str:
    """The newest HISTORY_SIZE stretches, each capped at a week: what parse_history reads back."""
    kept = [(hour % 24, min(HISTORY_CAP_MINUTES, max(0, int(m)))) for hour, m in stretches][-HISTORY_SIZE:]
    return ",".join(f"{hour}:{m}" for hour, m in kept)


def _with_stretch(record: MachineRecord, began: datetime, minutes: float, shortest: int) -> MachineRecord:
    """The record with one more ended quiet stretch; ones too short to ever be warned teach nothing."""
    if minutes < shortest:
        return record
    history, _ = parse_history(record.quiet_history)
    hour = began.astimezone(UTC).hour
    return replace(record, quiet_history=format_history([*history, (hour, round(minutes))]))


@dataclass(frozen=True)
class LearnedWait:
    """What a machine's history changes about its warning: minutes added to the usual warning point
    (negative: sooner), and why in words ("" when nothing was learned)."""

    extra_minutes: int = 0
    why: str = ""


def _warn_point(policy: TeamPolicy) -> int:
    return policy.idle_minutes - policy.warn_minutes


def earliest_warn_minutes(policy: TeamPolicy) -> int:
    """The team's minimum: the learned wait never warns before this much quiet."""
    usual = _warn_point(policy)
    earliest = policy.adaptive_earliest_warn_minutes
    return usual if earliest is None else min(usual, earliest)


def _alike(hour: int, began: int) -> bool:
    apart = abs(hour - began) % 24
    return min(apart, 24 - apart) <= LEARN_HOURS_AROUND


def learned_wait(history: Sequence[Stretch], policy: TeamPolicy, began: datetime) -> LearnedWait:
    """Deterministic and explainable. The evidence: the past stretches that began at about the same time
    of day as this one (within LEARN_HOURS_AROUND hours, UTC: a lunch break is not a night), or, when
    fewer than LEARN_MIN_STRETCHES of those reached the warning point, all of the machine's stretches.
    Warned at W minutes of quiet, a stretch that then ends before the stop plus UNWANTED_WITHIN_MINUTES
    was a nudge (or a stop) for nothing. While more than LEARN_SOON_SHARE of the stretches that reached W
    ended that soon, try W + LEARN_STEP_MINUTES, up to the policy's adaptive_wait_max_minutes; with fewer
    than LEARN_MIN_STRETCHES reaching W nothing is known and the search stops there. When none ended soon
    and every one went on for hours, warn at the team's earliest."""
    most = policy.adaptive_wait_max_minutes or 0
    if not most or not history:
        return LearnedWait()
    hour = began.astimezone(UTC).hour
    return _learned(tuple(history), hour, _warn_point(policy), policy.warn_minutes, most, earliest_warn_minutes(policy))


@lru_cache(maxsize=4096)  # pure in plain values: a machine's sweeps within one stretch share the answer
def _learned(
    history: tuple[Stretch, ...], hour: int, usual: int, warn_minutes: int, most: int, earliest: int
) -> LearnedWait:
    """learned_wait in plain values."""
    alike = [m for h, m in history if _alike(h, hour)]
    scope = " begun about this time of day"
    if sum(m >= usual for m in alike) < LEARN_MIN_STRETCHES:
        alike, scope = [m for _, m in history], ""
    soon_span = warn_minutes + UNWANTED_WITHIN_MINUTES

    def tally(point: int) -> tuple[int, int]:
        reached = [m for m in alike if m >= point]
        return sum(m < point + soon_span for m in reached), len(reached)

    soon, reached = tally(usual)
    extra = 0
    while extra < most:
        soon_here, reached_here = tally(usual + extra)
        if reached_here < LEARN_MIN_STRETCHES or soon_here <= LEARN_SOON_SHARE * reached_here:
            break
        extra = min(most, extra + LEARN_STEP_MINUTES)
    if extra:
        return LearnedWait(
            extra,
            f"waits {extra} more min: {soon} of its last {reached} quiet stretches of {usual} min or more"
            f"{scope} ended within {soon_span} min",
        )
    hours = usual + 2 * soon_span
    long_ones = [m for m in alike if m >= earliest]
    if earliest < usual and len(long_ones) >= LEARN_MIN_STRETCHES and min(long_ones) >= hours:
        return LearnedWait(
            earliest - usual,
            f"warned {usual - earliest} min sooner: its last {len(long_ones)} quiet stretches of {earliest} min "
            f"or more{scope} all went on for {hours} min or more",
        )
    return LearnedWait()


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
    hourly_cost: float | None = None
    error: str | None = None
    waited: str = ""  # a warning held past the usual point: why (the warning's text says it too)

    @property
    def why_warned(self) -> str:
        """Why the machine counts as idle, and why its warning came when it did: for the warning's text."""
        why = self.assessment.why_quiet if self.assessment else self.reason
        return f"{why}; {self.waited}" if self.waited else why

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
#   would_warn           any             warned     warn, not applied (dry run)        -
#   warning_undelivered  any             warned     none: no stop until delivered      the warning, retried
#   answer_time          any             warned     none: the owner has warn_minutes   the warning, if undelivered
#   stop_due             any             reaped     stop, hibernate, unprotect or      reaped
#                                                   terminate (none: ASG member free)
#   stop_reported        any             warned     the same, not applied (dry run     -
#                                                   or a notify_only policy)
#   keep                 all but reaped  snoozed    none (snooze)                      the message is updated
#   stop_now             any             reaped     stop, or unprotect an ASG member   the message is updated
#   start_again          reaped          active     start: a fresh grace window        the message is updated
#
# busy and quiet_after_busy apply while the last activity is less than the warning point ago (quiet for
# under idle_minutes - warn_minutes); every later event needs the machine quiet (covered, every track
# below its threshold) since quiet_since, and stop_due an idle signal over the whole window. Two
# conditions change how a transition reads, never where it goes:
#   cap reached  up max_runtime_hours or longer: a keep no longer holds (kept is skipped) and the reason
#                starts with why; a busy machine is still never stopped, an exempt one never touched
#   quiet hours  policy.quiet_hours: nothing is posted to owners; a new warning counts as delivered at once
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
    ANSWER_TIME = "answer_time"
    STOP_DUE = "stop_due"
    STOP_REPORTED = "stop_reported"
    KEEP = "keep"
    STOP_NOW = "stop_now"
    START_AGAIN = "start_again"


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
    Event.ANSWER_TIME: Transition(
        ANY_STATE, State.WARNED, "warned; will {verb} at {stop_at:%H:%M} UTC if still idle: {why_quiet}"
    ),
    Event.STOP_DUE: Transition(ANY_STATE, State.REAPED, "{why}: {why_quiet}"),
    Event.STOP_REPORTED: Transition(ANY_STATE, State.WARNED, "{why}: {why_quiet}"),
    Event.KEEP: Transition(ANY_STATE - {State.REAPED}, State.SNOOZED, "kept by {user} until {until}"),
    Event.STOP_NOW: Transition(ANY_STATE, State.REAPED, "{action} now, asked by {user}"),
    Event.START_AGAIN: Transition(frozenset({State.REAPED}), State.ACTIVE, "started again by {user}"),
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
    learned: LearnedWait = LearnedWait()  # what the machine's history moved the warning point by (in warn_at)
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
) -> Decision:
    """The per-machine lifecycle: the event this sweep sees and the transition it makes (TRANSITIONS).
    Read it top to bottom: the first rule that applies decides."""
    record = previous or MachineRecord(instance_id=machine.instance_id, team=machine.team)
    seen = _Sweep(machine, ref, assessment, record, _carried_over(record, machine, ref, assessment, now), now, dry_run)
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

    stretch = _stretch(seen, policy, assessment)
    cap = _over_runtime_cap(machine, policy, now)
    if assessment.signal == "busy" and stretch.quiet < stretch.warn_at:
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
    elif not stretch.warned and not dry_run:
        outcome = _warning_due(seen, policy, assessment, stretch)
    else:
        outcome = _after_warning(seen, policy, assessment, stretch)
    return seen.decision(outcome, quiet_hours=quiet_hours, prefix=prefix, note=stretch.note)


def _carried_over(
    record: MachineRecord, machine: Machine, ref: TeamPolicyRef, assessment: Assessment | None, now: datetime
) -> MachineRecord:
    """The previous record with this sweep's facts about the machine and its policy, version bumped, and
    its usage profile updated from the datapoints this sweep read (a machine moved to another team
    starts its profile again)."""
    profile = record.usage_profile if record.team == machine.team else ""
    if assessment is not None:
        profile, _ = observe_text(profile, assessment.seen_day, assessment.busy_hours)
    return replace(
        record,
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
    )


def _stretch(seen: _Sweep, policy: TeamPolicy, assessment: Assessment) -> _Stretch:
    """The quiet stretch as this sweep sees it, what of the record (idle-since, the warning) still belongs
    to it, and the warning point: the team's, moved by what the machine's past stretches teach."""
    record, now = seen.record, seen.now
    interrupted = assessment.interrupted_at
    # A warning (and an idle-since) counts only for this quiet stretch: activity or a data hole
    # seen after it means the machine may have been used, so it starts over.
    # ...and only if sweeps kept watching: after a stretch of unknown data, safe mode or no sweeps at all,
    # use in between may have fallen out of the fetched data, so the machine must be warned afresh.
    watched = record.observed_at is not None and now - record.observed_at <= timedelta(minutes=policy.idle_minutes)
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
        base = _with_stretch(base, record.idle_since, ended, earliest_warn_minutes(policy))
        history, _ = parse_history(base.quiet_history)
    if not warned and (base.warned_at or base.warning_delivered_at or base.warning_ref or base.stop_not_before):
        base = replace(base, warned_at=None, warning_delivered_at=None, warning_ref=None, stop_not_before=None)
    learned = _wait(history, base.usage_profile, policy, idle_since) if idle_since else LearnedWait()
    quiet = assessment.quiet_minutes(now)
    if continuous and idle_since is not None and assessment.quiet_since is not None:
        # Measured from the start of the stretch the record keeps, not only what this sweep fetched: a
        # warning point later than idle_minutes + max_gap_minutes is still reached (and so the stop).
        observed = min(now, assessment.observed_until or now)
        quiet = max(quiet, (observed - idle_since).total_seconds() / 60)
    return _Stretch(
        quiet=quiet,
        warn_at=_warn_point(policy) + learned.extra_minutes,
        warned=warned,
        resolved="resolved" if seen.was_warned and not warned else None,
        record=base,
        learned=learned,
        note=note,
    )


def _wait(history: Sequence[Stretch], profile_text: str, policy: TeamPolicy, began: datetime) -> LearnedWait:
    """The time-of-day wait when the policy turns it on and the machine has a usage profile; else (a new
    machine, a profile started again, an unreadable one) what its past quiet stretches teach."""
    if policy.time_of_day_wait_percent:
        profile, _ = parse_profile(profile_text)
        wait = time_of_day_wait(
            profile,
            began,
            _warn_point(policy),
            policy.adaptive_wait_max_minutes or 0,
            policy.time_of_day_wait_percent,
            policy.time_of_day_horizon_minutes,
        )
        if wait is not None:
            return LearnedWait(wait.extra_minutes, wait.why)
    return learned_wait(history, policy, began)


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
    cleared = replace(seen.base, idle_since=None, warned_at=None, warning_delivered_at=None, warning_ref=None)
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


def _warning_due(seen: _Sweep, policy: TeamPolicy, assessment: Assessment, stretch: _Stretch) -> _Outcome:
    """Past the warning point with no warning for this quiet stretch: warn, announcing the stop time."""
    assert assessment.quiet_since is not None
    now = seen.now
    stop_at = max(
        now + timedelta(minutes=policy.warn_minutes), assessment.quiet_since + timedelta(minutes=policy.idle_minutes)
    )
    record = replace(
        stretch.record, warned_at=now, warning_delivered_at=None, warning_ref=None, stop_not_before=stop_at
    )
    notes = ""
    if policy.quiet_hours:
        # Recorded, not sent; counted as delivered so the stop follows warn_minutes later as usual.
        record = replace(record, warning_delivered_at=now)
        notes = " (quiet hours: warning recorded, not sent)"
    fields = {
        "quiet": stretch.quiet,
        "verb": _verb(seen.machine, policy),
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
    undelivered_ok = False
    if stretch.warned:
        assert record.warned_at is not None
        pending = now - record.warned_at
        undelivered_ok = record.warning_delivered_at is None and pending >= timedelta(
            minutes=policy.undelivered_warning_max_minutes
        )
        # The owner's time to answer runs from delivery; an undelivered warning holds the stop.
        clock_from = record.warning_delivered_at or (record.warned_at if undelivered_ok else None)
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
        "verb": _verb(seen.machine, policy),
        "why_quiet": assessment.why_quiet,
    }
    if due:
        return _stop_due(seen, policy, stretch, undelivered_ok, fields)
    if not stretch.warned:
        return _Outcome(Event.WOULD_WARN, Action.WARN, stretch.record, fields, applied=False)
    deliver = record.warning_delivered_at is None and not seen.dry_run
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
    action, why = _reap_action(machine, policy)
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


def _reap_action(machine: Machine, policy: TeamPolicy) -> tuple[Action, str]:
    if machine.asg_name:
        if policy.asg_action == "terminate":
            return Action.TERMINATE, f"idle member of {machine.asg_name}: terminate and shrink the group"
        if machine.asg_protected:
            return Action.UNPROTECT, f"idle member of {machine.asg_name}: scale-in protection released"
        return Action.NONE, f"idle member of {machine.asg_name}: already unprotected, the group may scale it in"
    if policy.action == "hibernate":
        if machine.hibernation_configured:
            return Action.HIBERNATE, "idle past its window: hibernate"
        return Action.STOP, "idle past its window: stop (hibernation is not configured on this machine)"
    return Action.STOP, "idle past its window: stop"


def _verb(machine: Machine, policy: TeamPolicy) -> str:
    if machine.asg_name:
        return "terminate it" if policy.asg_action == "terminate" else "release it to its group"
    return {"stop": "stop it", "hibernate": "hibernate it", "notify_only": "report it (notify only)"}[policy.action]


# ---------------------------------------------------------------------------------------------
# Answers from people (Slack buttons and the slash command)

KEEP_HOURS = {"keep_1h": 1, "keep_2h": 2, "keep_4h": 4, "keep_8h": 8, "keep_24h": 24}


def next_morning(policy: TeamPolicy, now: datetime) -> datetime:
    """The next `policy.morning` in the team's time zone (zoneinfo: daylight saving included)."""
    zone = ZoneInfo(policy.timezone)
    local_now = now.astimezone(zone)
    hour, minute = (int(part) for part in policy.morning.split(":"))
    candidate = local_now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if candidate <= local_now:
        candidate = (local_now + timedelta(days=1)).replace(hour=hour, minute=minute, second=0, microsecond=0)
    return candidate.astimezone(now.tzinfo)


def keep_until(choice: str, policy: TeamPolicy, now: datetime) -> datetime | None:
    """When a 'keep' answer ends, capped by the team's max_snooze_hours. None: not a keep choice."""
    cap = now + timedelta(hours=policy.max_snooze_hours)
    if choice == "keep_morning":
        return min(next_morning(policy, now), cap)
    if choice in KEEP_HOURS:
        return min(now + timedelta(hours=KEEP_HOURS[choice]), cap)
    return None


def keep_choices(policy: TeamPolicy) -> list[str]:
    """The durations offered in a warning: only those within the team's cap."""
    return [choice for choice, hours in KEEP_HOURS.items() if hours <= policy.max_snooze_hours]


def parse_duration(text: str) -> timedelta | None:
    """'2h', '90m', '1h30m', '1.5h' -> a duration; None when unreadable or not positive."""
    match = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+)\s*m)?\s*", text.lower())
    if not match or not any(match.groups()):
        return None
    hours, minutes = match.groups()
    duration = timedelta(hours=float(hours or 0), minutes=int(minutes or 0))
    return duration if duration > timedelta(0) else None


def may_answer(
    user: str,
    record: MachineRecord,
    policy: TeamPolicy | None,
    admins: Iterable[str],
    group_members: Iterable[str] = (),
) -> bool:
    """The owner, the team's listed members (directly or through a listed user group), or an admin."""
    if user in set(admins):
        return True
    if record.owner_slack_id and user == record.owner_slack_id:
        return True
    if policy is None:
        return False
    return user in policy.members or user in set(group_members)


def snooze(record: MachineRecord, policy: TeamPolicy, user: str, until: datetime, now: datetime) -> MachineRecord | str:
    """Keep a machine until `until` (capped). Returns the new record, or why it is refused."""
    until = min(until, now + timedelta(hours=policy.max_snooze_hours))
    if until <= now:
        return "that time has already passed"
    if not allowed(record.state, Event.KEEP):
        return "the machine is already stopped"
    day = now.astimezone(ZoneInfo(policy.timezone)).date().isoformat()
    used = record.snoozes_today if record.snooze_day == day else 0
    if used >= policy.max_snoozes_per_day:
        return f"this machine was already kept {used} times today (the team allows {policy.max_snoozes_per_day})"
    keep = TRANSITIONS[Event.KEEP]
    return replace(
        record,
        version=record.version + 1,
        state=keep.target,
        snoozed_until=until,
        snoozed_by=user,
        # The next warning starts afresh when the snooze ends.
        warned_at=None,
        warning_delivered_at=None,
        warning_ref=None,
        snooze_day=day,
        snoozes_today=used + 1,
        reason=keep.explain({"user": user, "until": until.isoformat()}),
        updated_at=now,
    )


def stopped_by_person(
    record: MachineRecord, user: str, action: Action, now: datetime, start_ref: str | None = None
) -> MachineRecord:
    """Stopped (or released) at a person's request; `start_ref` is what a "Start it again" button carries."""
    stop_now = TRANSITIONS[Event.STOP_NOW]
    return replace(
        record,
        version=record.version + 1,
        state=stop_now.target,
        last_action=action.value,
        last_action_at=now,
        warning_ref=start_ref,
        reason=stop_now.explain({"action": action.value, "user": user}),
        updated_at=now,
    )


def started_by_person(record: MachineRecord, user: str, now: datetime) -> MachineRecord:
    """Started again: a fresh grace window (the launch time resets the idle clock too). The quiet stretch
    the stop ended goes into the machine's history: it lasted until now."""
    start_again = TRANSITIONS[Event.START_AGAIN]
    if record.idle_since is not None:
        record = _with_stretch(record, record.idle_since, (now - record.idle_since).total_seconds() / 60, 0)
    return replace(
        record,
        version=record.version + 1,
        state=start_again.target,
        idle_since=None,
        warned_at=None,
        warning_delivered_at=None,
        warning_ref=None,
        snoozed_until=None,
        last_action="start",
        last_action_at=now,
        reason=start_again.explain({"user": user}),
        updated_at=now,
    )


# ---------------------------------------------------------------------------------------------
# Fleet-level planning


@dataclass(frozen=True)
class GroupCapacity:
    name: str
    min_size: int
    desired: int


def limit_terminations(decisions: list[Decision], groups: dict[str, GroupCapacity]) -> list[Decision]:
    """Never terminate a group below its MinSize: terminations beyond the headroom become unprotect."""
    headroom = {name: max(0, g.desired - g.min_size) for name, g in groups.items()}
    limited: list[Decision] = []
    for d in decisions:
        if d.action is Action.TERMINATE and d.applied:
            group = d.machine.asg_name or ""
            if headroom.get(group, 0) > 0:
                headroom[group] -= 1
            else:
                known = group in groups
                why = f"{group} is at its MinSize" if known else f"the capacity of {group} could not be read"
                if d.machine.asg_protected:
                    reason = f"{why}; not terminated, protection released instead. {d.reason}"
                    d = replace(
                        d,
                        action=Action.UNPROTECT,
                        reason=reason,
                        record=replace(d.record, reason=reason, last_action=Action.UNPROTECT.value),
                    )
                else:
                    # Nothing changes: say so, keep the warning's state, and send no "reaped" notice.
                    reason = f"{why}; not terminated, nothing changed. {d.reason}"
                    d = replace(
                        d,
                        action=Action.NONE,
                        state=State.WARNED,
                        reason=reason,
                        notify=None,
                        record=replace(
                            d.record,
                            state=State.WARNED,
                            reason=reason,
                            last_action=d.record.last_action if d.record.last_action != "terminate" else None,
                        ),
                    )
        limited.append(d)
    return limited


# ---------------------------------------------------------------------------------------------
# Summaries


@dataclass
class TeamTotals:
    scanned: int = 0
    idle: int = 0
    warned: int = 0
    reaped: int = 0
    protected: int = 0
    unknown: int = 0
    snoozed: int = 0
    hourly_savings: float = 0.0


@dataclass
class SweepSummary:
    teams: dict[str, TeamTotals] = field(default_factory=lambda: defaultdict(TeamTotals))

    @classmethod
    def of(cls, decisions: Iterable[Decision]) -> SweepSummary:
        summary = cls()
        for d in decisions:
            totals = summary.teams[d.machine.team]
            totals.scanned += 1
            totals.idle += d.state in (State.IDLE, State.WARNED, State.SNOOZED, State.REAPED)
            totals.warned += d.action is Action.WARN
            totals.unknown += d.state is State.UNKNOWN
            totals.snoozed += d.state is State.SNOOZED
            totals.protected += d.action is Action.PROTECT and d.applied and d.error is None
            if d.action in REAP_ACTIONS and d.applied and d.error is None:
                totals.reaped += 1
                totals.hourly_savings += d.hourly_cost or 0.0
        return summary


# ---------------------------------------------------------------------------------------------
# The human-activity signal as `status` shows it


def human_signal_note(assessment: Assessment | None, signals: Signals | None, now: datetime) -> str:
    """What a record keeps of the human-activity signal (MachineRecord.human_signal): "" when the policy
    ignores it or the machine was not judged, "missing" when the collector sent nothing usable, else
    "active" or "quiet" and the newest human input seen, to the minute."""
    if assessment is None or assessment.human_signal == "off":
        return ""
    if assessment.human_signal == "missing":
        return "missing"
    last, _ = last_human_input(signals.user if signals else (), now)
    return assessment.human_signal + (f" {last:%Y-%m-%dT%H:%MZ}" if last else "")


def describe_human_signal(note: str) -> str:
    """A record's human_signal in words ("person active 12:03 UTC", "no activity collector data"); "" when
    there is nothing to say. A value it cannot read (a corrupted item) says nothing rather than fail."""
    kind, _, at = note.partition(" ")
    when = ""
    with contextlib.suppress(ValueError):
        when = f"{datetime.fromisoformat(at.replace('Z', '+00:00')):%H:%M} UTC" if at else ""
    if kind == "missing":
        return "no activity collector data (judged on CPU/GPU alone)"
    if kind == "active":
        return f"person active {when}".rstrip()
    if kind == "quiet":
        return f"no person active (last input {when})" if when else "no person active"
    return ""


# ---------------------------------------------------------------------------------------------
# One message per owner


def owner_key(owner: str | None) -> str:
    """The Owner tag as one person: case and surrounding spaces do not make another owner; "" when none."""
    return (owner or "").strip().lower()


def owner_message_groups(decisions: Sequence[Decision]) -> list[list[Decision]]:
    """The warnings due in one sweep, one list per message. An owner's machines whose warnings go to the
    same places (the owner's DM, and the same team channel when the policy posts there) share a message,
    across teams; a channel so only ever lists its own team's machines. A machine without an Owner tag or
    a policy is alone, and so is every decision that posts no warning. Order: first appearance."""
    groups: dict[tuple[str, str, str | None], list[Decision]] = {}
    alone: list[list[Decision]] = []
    for d in decisions:
        policy = d.policy.policy if d.policy else None
        owner = owner_key(d.machine.owner)
        if not d.deliver_warning or not owner or policy is None:
            alone.append([d])
            continue
        channel = policy.slack_channel if policy.notify != "owner" else None
        groups.setdefault((owner, policy.notify, channel), []).append(d)
    return [*groups.values(), *alone]


# ---------------------------------------------------------------------------------------------
# Quiet hours: what was stopped while nobody was told, said once they end

QUIET_REPORT_GIVE_UP = timedelta(hours=24)  # a summary that could not be posted for this long is dropped


def quiet_hours_reports(records: Iterable[MachineRecord]) -> list[list[MachineRecord]]:
    """The machines stopped during quiet hours that are still stopped, one list per owner (the owner's Slack
    id, else the Owner tag, else the machine alone), oldest stop first. A machine started again meanwhile has
    nothing left to report."""
    owners: dict[str, list[MachineRecord]] = {}
    for r in records:
        if r.quiet_stop_at is None or r.state is not State.REAPED or r.last_action not in ("stop", "hibernate"):
            continue
        owner = r.owner_slack_id or owner_key(r.owner) or r.instance_id
        owners.setdefault(owner, []).append(r)
    return [sorted(group, key=lambda r: (r.quiet_stop_at or datetime.min, r.instance_id)) for group in owners.values()]
