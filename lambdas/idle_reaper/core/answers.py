"""What a person's answer does to a machine's record: keep it, stop it now, start it again; and who may answer."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from idle_reaper.core.endpoints import Restore, words_for
from idle_reaper.core.lifecycle import TRANSITIONS, Event, allowed
from idle_reaper.core.records import Action, MachineRecord, with_stretch
from idle_reaper.core.studio import AppRestore
from idle_reaper.policy import TeamPolicy

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
    words = words_for(record.instance_id)  # an endpoint or a Studio app is deleted, not stopped
    if not allowed(record.state, Event.KEEP):
        return f"the {words.noun} is already {words.stopped}"
    day = now.astimezone(ZoneInfo(policy.timezone)).date().isoformat()
    used = record.snoozes_today if record.snooze_day == day else 0
    if used >= policy.max_snoozes_per_day:
        return f"this {words.noun} was already kept {used} times today (the team allows {policy.max_snoozes_per_day})"
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
        warning_owed=(),  # a copy still owed is moot: someone answered
        snooze_day=day,
        snoozes_today=used + 1,
        reason=keep.explain({"user": user, "until": until.isoformat()}),
        updated_at=now,
        next_read_at="",  # an answer makes the machine due at once (core/reading.py)
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
        warning_owed=(),
        reason=stop_now.explain({"action": action.value, "user": user}),
        updated_at=now,
        next_read_at="",
    )


def terminated_by_person(record: MachineRecord, user: str, now: datetime) -> MachineRecord:
    """Terminated at its owner's confirmed request (a machine EC2 cannot stop): nothing to start again."""
    terminate_now = TRANSITIONS[Event.TERMINATE_NOW]
    return replace(
        record,
        version=record.version + 1,
        state=terminate_now.target,
        last_action=Action.TERMINATE_INSTANCE.value,
        last_action_at=now,
        warning_ref=None,
        reason=terminate_now.explain({"user": user}),
        updated_at=now,
    )


def started_by_person(record: MachineRecord, user: str, now: datetime) -> MachineRecord:
    """Started again: a fresh grace window (the launch time resets the idle clock too). The quiet stretch
    the stop ended goes into the machine's history: it lasted until now."""
    start_again = TRANSITIONS[Event.START_AGAIN]
    if record.idle_since is not None:
        record = with_stretch(record, record.idle_since, (now - record.idle_since).total_seconds() / 60, 0)
    return replace(
        record,
        version=record.version + 1,
        state=start_again.target,
        idle_since=None,
        warned_at=None,
        warning_delivered_at=None,
        warning_ref=None,
        warning_owed=(),
        snoozed_until=None,
        last_action="start",
        last_action_at=now,
        reason=start_again.explain({"user": user}),
        updated_at=now,
        next_read_at="",
    )


def bring_back_failed(
    record: MachineRecord, restore: Restore | AppRestore, why: str, now: datetime, ref: str | None
) -> MachineRecord:
    """An endpoint brought back (a Studio app started again) that SageMaker could not create (the sweep found it
    Failed: `why`, its FailureReason): deleted again, as it was before the click, told (no longer pending), and its
    message's "Try again" button carrying `ref`."""
    by, kept = restore.pending_by or "someone", restore.failed_with(why)
    again = stopped_by_person(record, by, Action.STOP, now, ref)  # as a deletion: REAPED by a stop, Try again
    if isinstance(restore, AppRestore):
        why_said = f"started again by {by}, but SageMaker could not start it (Failed: {kept.failed}); deleted again"
    else:
        why_said = f"brought back by {by}, but SageMaker could not create it (Failed: {kept.failed}); deleted again"
    return replace(again, endpoint=kept.to_json(), reason=why_said)
