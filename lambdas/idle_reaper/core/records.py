"""A machine's record in the state table: its lifecycle state, and the compact history of its quiet stretches."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple


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
    # A machine EC2 cannot stop (one-time Spot, instance-store root): TerminateInstances, only on a team's opt-in
    # (terminate_unstoppable_after_minutes) or its owner's confirmed click.
    TERMINATE_INSTANCE = "terminate_instance"


# Actions that change a machine (as opposed to a warning, which only talks to people).
MACHINE_ACTIONS = frozenset(
    {Action.STOP, Action.HIBERNATE, Action.PROTECT, Action.UNPROTECT, Action.TERMINATE, Action.TERMINATE_INSTANCE}
)
REAP_ACTIONS = frozenset({Action.STOP, Action.HIBERNATE, Action.UNPROTECT, Action.TERMINATE, Action.TERMINATE_INSTANCE})


# ---------------------------------------------------------------------------------------------
# Identity: a machine is (account, region, instance)

_ACCOUNT = re.compile(r"^\d{12}$")
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d{1,2}$")
_INSTANCE = re.compile(r"^[^/\s]{1,128}$")  # an EC2 id, a notebook's name, endpoint:<name> or studio:<...>


class MachineId(NamedTuple):
    """Which machine: `account` and `region` are None for a machine in the hub's own account (single-account
    mode, and the hub's machines in organization mode), both set for a machine in a member account."""

    instance_id: str
    account: str | None = None
    region: str | None = None


def machine_key(instance_id: str, account: str | None = None, region: str | None = None) -> str:
    """The one text that names a machine in the state table, its audit trail and Slack references: the
    instance id alone for the hub's machines (as every record was before organization mode: no migration),
    `<account>/<region>/<instance-id>` for a member account's. The same instance id in two accounts gives two
    keys. parse_machine_key reads it back; nothing else formats or splits a machine key."""
    if not _INSTANCE.match(instance_id):
        raise ValueError(f"not an instance id: {instance_id!r}")
    if account is None and region is None:
        return instance_id
    if account is None or region is None or not _ACCOUNT.match(account) or not _REGION.match(region):
        raise ValueError(f"a member machine needs a 12-digit account and a region, got {account!r} and {region!r}")
    return f"{account}/{region}/{instance_id}"


def parse_machine_key(key: str) -> MachineId:
    """The machine a key names (machine_key's inverse); ValueError for text no machine_key made."""
    parts = key.split("/")
    if len(parts) == 1:
        found = MachineId(parts[0])
    elif len(parts) == 3:
        found = MachineId(parts[2], parts[0], parts[1])
    else:
        raise ValueError(f"not a machine key: {key!r}")
    if machine_key(*found) != key:  # raises for a bad part; a round trip catches anything else
        raise ValueError(f"not a machine key: {key!r}")
    return found


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
    # A stop notice Slack has not taken yet (slack.notifier.StopNotice as JSON): sweep/notices.py sends it, within
    # Slack's limits, until it is told; then None.
    notice: str | None = None
    # Why a post's outcome cannot be told although Slack answers (the bot may not read where it went): the
    # warning is not posted again, and the stop waits until the outcome is known (never the Slack-down exception).
    delivery_unresolved: str | None = None
    # The conversations the current warning still owes a copy (core.records.owed_target): it reached another one,
    # and this one's post failed for a reason that may pass (a 429, Slack down): each sweep posts the same warning
    # there until it is taken, given up (undelivered_warning_max_minutes, or a permanent failure) or the machine
    # is stopped; the admins are told of a copy given up. At most one entry a target (two: the owner, the channel).
    warning_owed: tuple[str, ...] = ()
    # How the machine's last quiet stretches ended: their lengths in minutes, oldest first, comma-separated
    # (format_history); the learned wait reads it. Bounded: HISTORY_SIZE stretches, each at most a week.
    quiet_history: str = ""
    # When the machine was busy over its last two weeks, by UTC hour (core/time_of_day.py, at most
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
    # The current warning was recorded silently under quiet hours (counted as delivered while they last);
    # if its stop is still ahead when they end, it is sent then and the stop waits warn_minutes from that.
    warning_held: bool = False
    # What kind of machine the last sweep that could tell saw (kinds.Kind; "" before kinds were kept),
    # and the kind in words with what a stop saves, for `status` and answers.
    machine_kind: str = ""
    kind_note: str = ""
    # A Spot machine's request's maximum price an hour, as the last sweep that could tell saw it ("" : none, or not
    # Spot), so every surface bounds what it bills as the sweep does (core/dollars.py). Text: DynamoDB takes no float.
    spot_max_price: str = ""
    # When EC2 refused this quiet stretch's action for a reason a retry does not change (UnsupportedOperation,
    # ...): the action is not tried again until the machine is busy again (one refused call per stretch).
    action_refused_at: datetime | None = None
    # When the sweep must next read this machine (ISO-8601 UTC; "": at the next sweep) and why not before
    # (core/reading.py). Text, not a date: a corrupt value means "read now", never an unreadable record.
    next_read_at: str = ""
    next_read_why: str = ""
    # The busiest GPU (CPU for CPU-only types) the sweep recorded while the machine was busy, per ISO week
    # (UTC), and how many such reads: "2026-W47:23.5:61,2026-W48:12.0:9", the last two weeks. The weekly
    # digest's under-used machines read it (core/under_used.py: with_peak, under_used).
    week_peaks: str = ""
    # A SageMaker endpoint's: what CreateEndpoint needs to bring it back after its deletion (core/endpoints.Restore
    # as JSON: its configuration's name and tags, at most 50; and who asked to bring it back, until it is InService
    # again). A Studio app's: what CreateApp needs (core/studio.AppRestore: its domain, space, type, name, resource
    # spec and its space's tags; and who asked to start it again). None for every other machine.
    endpoint: str | None = None
    # Organization mode: the member account and region the machine runs in (None: the hub's own account).
    # Written only when set, so a hub machine's item is what it always was.
    account: str | None = None
    region: str | None = None

    @property
    def key(self) -> str:
        """Its key in the state table (machine_key)."""
        return machine_key(self.instance_id, self.account, self.region)


# A copy still owed (MachineRecord.warning_owed): the target as posted to (the owner's Slack user id for their DM, a
# channel id), MAYBE_POSTED after it when a post there may have gone out (its answer was lost, or a sweep died after
# posting it): looked for before it is posted again.
MAYBE_POSTED = "?"


def owed_target(entry: str) -> tuple[str, bool]:
    """(the conversation a copy is owed to, whether it may be there already)."""
    return entry.removesuffix(MAYBE_POSTED), entry.endswith(MAYBE_POSTED)


def owes_owner(record: MachineRecord) -> bool:
    """Whether the owner's own copy (their DM) of the current warning is still owed."""
    owner = record.owner_slack_id
    return owner is not None and any(owed_target(e)[0] == owner for e in record.warning_owed)


# ---------------------------------------------------------------------------------------------
# Learned waiting: each machine's quiet stretches, and what they say about the current one

HISTORY_SIZE = 32  # stretches kept per machine
HISTORY_CAP_MINUTES = 10080  # a stretch longer than a week is kept as a week
NO_WEEKDAY = 7  # a stretch kept before weekdays were (written "hour:minutes"): its weekday is unknown
_HISTORY_MAX_CHARS = HISTORY_SIZE * len(f"23:{HISTORY_CAP_MINUTES}:6,")  # 352: the learned state's bound
UNWANTED_WITHIN_MINUTES = 60  # activity this soon after a stop means the stop was unwanted

# (UTC hour the quiet stretch began, its length in minutes, UTC weekday it began: 0 Monday .. 6 Sunday, or
# NO_WEEKDAY)
Stretch = tuple[int, int, int]


@lru_cache(maxsize=4096)  # pure, and read on every sweep of every machine (the replay: millions of times)
def parse_history(text: str) -> tuple[tuple[Stretch, ...], str]:
    """The stretches a record's quiet_history holds ("hour:minutes:weekday,..." oldest first; an entry kept
    before weekdays were is "hour:minutes" and reads with NO_WEEKDAY), and a note for the log when it had to
    be reset (unreadable, out of range or oversized: a corrupted item must never fail a sweep)."""
    if not text:
        return (), ""
    parts = text.split(",")
    if len(text) > _HISTORY_MAX_CHARS or len(parts) > HISTORY_SIZE:
        return (), f"quiet history of {len(parts)} entries ({len(text)} characters) is oversized; reset to empty"
    stretches: list[Stretch] = []
    for part in parts:
        fields = part.split(":")
        if not 2 <= len(fields) <= 3 or not all(f.isascii() and f.isdigit() for f in fields):
            break
        hour, minutes = int(fields[0]), int(fields[1])
        weekday = int(fields[2]) if len(fields) == 3 else NO_WEEKDAY
        if hour > 23 or minutes > HISTORY_CAP_MINUTES or weekday > NO_WEEKDAY:
            break
        stretches.append((hour, minutes, weekday))
    else:
        return tuple(stretches), ""
    shown = text if len(text) <= 40 else text[:39] + "…"
    return (), f"quiet history {shown!r} is unreadable; reset to empty"


def format_history(stretches: Iterable[tuple[int, ...]]) -> str:
    """The newest HISTORY_SIZE stretches, each capped at a week: what parse_history reads back. A stretch
    given as (hour, minutes) has no weekday."""
    kept = [
        (s[0] % 24, min(HISTORY_CAP_MINUTES, max(0, int(s[1]))), s[2] if len(s) > 2 and 0 <= s[2] < 7 else NO_WEEKDAY)
        for s in stretches
    ][-HISTORY_SIZE:]
    return ",".join(f"{hour}:{m}" if day == NO_WEEKDAY else f"{hour}:{m}:{day}" for hour, m, day in kept)


def with_stretch(record: MachineRecord, began: datetime, minutes: float, shortest: int) -> MachineRecord:
    """The record with one more ended quiet stretch; ones too short to ever be warned teach nothing."""
    if minutes < shortest:
        return record
    history, _ = parse_history(record.quiet_history)
    at = began.astimezone(UTC)
    return replace(record, quiet_history=format_history([*history, (at.hour, round(minutes), at.weekday())]))
