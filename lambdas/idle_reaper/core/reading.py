"""When a machine must next be read: a machine whose decision cannot change before some time need not be
read before it. One read returns the whole window, so nothing the machine did meanwhile is lost; and a
machine that is not read is not acted on, so skipping can only delay what would happen, never bring it
forward or act on old data.

Three cases are certain (the replay shows the same warnings and stops with and without them):
- busy at its newest datapoint: a quiet stretch can only begin after that activity ended, and no warning
  comes before `earliest_warn_minutes` of quiet (learned and time-of-day waits only ever add to it);
- started less than a warning point ago and not yet judged: quiet cannot begin before the launch;
- a series it is judged on has no datapoint at all (a GPU machine without the agent): its quiet cannot be
  observed before it reports (a late backfill of older datapoints only delays its warning, never a stop).
One more is safe because nothing can follow it but words: a machine the reaper only reports (a notify_only
policy, or a kind it does not stop), whose notice is delivered. Nothing will be stopped, so there is no
warning window to watch; what can still change is the "resolved" notice when it is busy again, which
comes up to NOTICE_REFRESH later (always within its idle window, so the notice is never given afresh).
Everything else (a quiet stretch under way, a warning that leads to an action, a keep, a released group
member, unknown data, a failed read or action) is read at every sweep, as are machines whose policy,
facts or protection changed. A bounded refresh keeps what `status` shows at most READ_REFRESH old.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import Action, MachineRecord, State
from idle_reaper.core.signals import Machine, parse_exemption
from idle_reaper.core.waiting import earliest_warn_minutes
from idle_reaper.policy import TeamPolicy, TeamPolicyRef

READ_REFRESH = timedelta(hours=1)  # a skipped machine is read at least this often (what `status` shows)
NOTICE_REFRESH = timedelta(minutes=30)  # a machine only reported on: its "resolved" notice is at most this late
NOTICE_ONLY = "only reported on, told at"  # how the plan of such a machine starts (not_due trusts it)


def plan_next_read(d: Decision, now: datetime) -> MachineRecord:
    """`d.record` with when its machine must next be read and why ("" : at the next sweep)."""
    at, why = _next_read(d, now)
    return replace(d.record, next_read_at=at.isoformat() if at else "", next_read_why=why)


def _next_read(d: Decision, now: datetime) -> tuple[datetime | None, str]:
    policy, assessment, record, machine = d.policy.policy if d.policy else None, d.assessment, d.record, d.machine
    if policy is None or assessment is None or d.error:
        return None, ""
    if _only_reported(d, policy):
        assert record.warned_at is not None
        refresh = min(NOTICE_REFRESH, timedelta(minutes=policy.idle_minutes) / 2)
        due = now + refresh
        return due, f"{NOTICE_ONLY} {record.warned_at:%H:%M} UTC; nothing is stopped; next read {due:%H:%M} UTC"
    if d.action not in (Action.NONE, Action.PROTECT):
        return None, ""
    if record.idle_since is not None or record.warned_at is not None:
        return None, ""
    if machine.asg_name and not machine.asg_protected and d.action is not Action.PROTECT:
        return None, ""
    earliest = timedelta(minutes=earliest_warn_minutes(policy))
    if d.state is State.ACTIVE and assessment.signal == "busy" and assessment.interrupted_at is not None:
        ended = assessment.interrupted_at
        why = f"busy until {ended:%H:%M} UTC; no warning before {earliest_warn_minutes(policy)} min of quiet"
    elif d.state is State.UNKNOWN and assessment.signal == "unknown" and machine.launch_time + earliest > now:
        ended = machine.launch_time
        why = f"started {ended:%H:%M} UTC; no warning before {earliest_warn_minutes(policy)} min of quiet"
    elif d.state is State.UNKNOWN and assessment.missing_series:
        # Its data starts after this read; metrics an agent publishes late with older timestamps can only
        # make its warning later than reading every sweep would, never a stop sooner.
        ended = now
        why = f"{assessment.reason}; no warning before {earliest_warn_minutes(policy)} min of quiet once it reports"
    else:
        return None, ""
    horizon = min(ended + earliest, now + READ_REFRESH)
    if horizon <= now:
        return None, ""
    due = _own_point(machine.instance_id, now, horizon)
    return due, f"{why}; next read {due:%H:%M} UTC"


def _only_reported(d: Decision, policy: TeamPolicy) -> bool:
    """Warned, told, and nothing will be done: a notify_only policy's report or a kind's notice, delivered
    (its record says so: before the post it is not, so a notice not yet delivered is read every sweep)."""
    record = d.record
    if d.state is not State.WARNED or record.warned_at is None or record.warning_delivered_at is None:
        return False
    if record.warning_owed:  # a copy still owed is posted again at every sweep
        return False
    # The notice itself (Action.WARN) or a stop only reported: nothing is done to the machine.
    if d.machine.asg_name or (d.action not in (Action.NONE, Action.WARN) and d.applied):
        return False
    return policy.action == "notify_only" or (d.handling is not None and d.handling.mode == "notify")


_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def _own_point(instance_id: str, now: datetime, horizon: datetime) -> datetime:
    """The latest of the machine's own hourly points (a hash of its id) up to `horizon`, or `horizon` when
    none falls after `now`: a fleet seen busy in one sweep is read again spread over the hour, not at once."""
    period = int(READ_REFRESH.total_seconds())
    phase = zlib.crc32(instance_id.encode()) % period
    since = int((horizon - _EPOCH).total_seconds()) - phase
    point = _EPOCH + timedelta(seconds=since // period * period + phase)
    return point if point > now else horizon


def parse_next_read(text: str) -> datetime | None:
    """The stored next-read time; None when missing or unreadable (then the machine is read now)."""
    if not text:
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return None
    return at.astimezone(UTC) if at.tzinfo else None


def not_due(machine: Machine, ref: TeamPolicyRef, record: MachineRecord | None, now: datetime) -> str:
    """Why `machine` need not be read this sweep ("" : it must be). Anything that could change its decision
    (its policy or schedule, its facts, an exemption, lost scale-in protection, a start, an answer that
    moved its state) makes it due at once, and so does a missing, corrupt or far-off next-read time."""
    if record is None or ref.policy is None:
        return ""
    due = parse_next_read(record.next_read_at)
    if due is None or due <= now or due > now + READ_REFRESH:
        return ""
    reported = record.state is State.WARNED and record.next_read_why.startswith(NOTICE_ONLY)
    if not reported and (record.state not in (State.ACTIVE, State.UNKNOWN) or record.idle_since or record.warned_at):
        return ""
    # Started since the plan was made: due. A machine never judged (no GPU metrics yet) has no observed_at;
    # its plan is as old as the record's last write.
    planned = record.observed_at or record.updated_at
    if record.policy_version != ref.label or planned is None or machine.launch_time > planned:
        return ""
    facts = (machine.team, machine.instance_type, machine.owner, machine.asg_name, machine.name)
    if facts != (record.team, record.instance_type, record.owner, record.asg_name, record.name):
        return ""
    if (machine.asg_name and not machine.asg_protected) or parse_exemption(machine.exempt_tag, now)[0]:
        return ""
    return f"not read: {record.next_read_why} (last read {planned:%H:%M} UTC)"


def unread(machine: Machine, ref: TeamPolicyRef, record: MachineRecord, why: str) -> Decision:
    """The decision for a machine this sweep does not read: nothing happens, the record stays as stored."""
    return Decision(machine, record.state, Action.NONE, why, None, record, policy=ref, read=False)
