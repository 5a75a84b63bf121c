"""Across machines: how many a group may lose at once, the sweep's totals, which warnings share a
message, and what quiet hours report."""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from idle_reaper.core.kinds import Saving
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import REAP_ACTIONS, Action, MachineRecord, State
from idle_reaper.core.signals import Machine

# ---------------------------------------------------------------------------------------------
# Fleet-level planning


@dataclass(frozen=True)
class GroupCapacity:
    name: str
    min_size: int
    desired: int


@dataclass(frozen=True)
class GroupPart:
    """Which of an Auto Scaling group's `parts` one shard holds (`held`, each 0 .. parts-1): a group too large
    for one shard is cut into parts swept by different shards at once, and its termination headroom (DesiredCapacity
    less MinSize) is shared out between them, so that together they never terminate it below its MinSize."""

    parts: int
    held: tuple[int, ...]

    def headroom(self, whole: int) -> int:
        """This shard's share of the group's `whole` headroom: each part whole // parts, the parts labelled below
        whole % parts one more (the shares of all parts sum to `whole`; the planner labels the parts afresh each
        sweep, so the one more goes round)."""
        return sum(whole // self.parts + (1 if j < whole % self.parts else 0) for j in set(self.held))


def limit_terminations(
    decisions: list[Decision], groups: dict[str, GroupCapacity], parts: Mapping[str, GroupPart] | None = None
) -> list[Decision]:
    """Never terminate a group below its MinSize: terminations beyond the headroom become unprotect. `parts`: the
    groups this sweep holds a part of (a shard of a group cut across shards), each its share of the headroom."""
    parts = parts or {}
    headroom = {
        name: parts[name].headroom(max(0, g.desired - g.min_size)) if name in parts else max(0, g.desired - g.min_size)
        for name, g in groups.items()
    }
    limited: list[Decision] = []
    for d in decisions:
        if d.action is Action.TERMINATE and d.applied:
            group = d.machine.asg_name or ""
            if headroom.get(group, 0) > 0:
                headroom[group] -= 1
            else:
                known = group in groups
                why = f"{group} is at its MinSize" if known else f"the capacity of {group} could not be read"
                if known and group in parts:
                    why = f"{group}'s share of its headroom above MinSize in this shard is used"
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
    hourly_savings: float = 0.0  # what the machines reaped save an hour: their stop's saving, never more
    savings_upper_bound: bool = False  # a Spot machine's saving counted at the most it can be


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
                saving = d.saving or Saving(d.hourly_cost)
                totals.hourly_savings += saving.hourly or 0.0
                totals.savings_upper_bound |= saving.upper_bound
        return summary


OWNER_PART = "owner:"  # how part_key begins for an owner's machines (the hub's shards chunk those)


def part_key(instance_id: str, asg_name: str | None, owner: str | None) -> str:
    """What keeps machines together when a fleet is cut into shards or parts: an Auto Scaling group's members
    (its termination limit is counted in one place; the hub's shards cut a group larger than a shard into parts
    that share it out, GroupPart), else an owner's machines (one message), else the machine."""
    if asg_name:
        return f"asg:{asg_name}"
    if owner := owner_key(owner):
        return f"{OWNER_PART}{owner}"
    return instance_id


def part_of(key: str, parts: int) -> int:
    """The part (0 .. parts-1) a part_key falls in: a stable hash (crc32), the same in every process and sweep
    (Python's hash() is salted per process)."""
    return zlib.crc32(key.encode()) % parts


def machine_part(m: Machine, parts: int) -> int:
    """The part (0 .. parts-1) a machine falls in, by its part_key as listed."""
    return part_of(part_key(m.instance_id, m.asg_name, m.owner), parts)


# ---------------------------------------------------------------------------------------------
# One message per owner


def owner_key(owner: str | None) -> str:
    """The Owner tag as one person: case and surrounding spaces do not make another owner; "" when none."""
    return (owner or "").strip().lower()


def owner_message_key(
    d: Decision, owners: Mapping[str, str | None] | None = None
) -> tuple[str, str, str | None] | None:
    """Which owner message a warning may share: (owner, notify, team channel or None); None when it is posted
    alone (no warning, no owner or policy, or a warning of another kind). `owners`: as owner_message_groups."""
    policy = d.policy.policy if d.policy else None
    owner = owner_key(d.machine.owner) if owners is None else (owners.get(d.machine.instance_id) or "")
    # A notice or a termination warning says other things and carries other buttons: a message of its own.
    other_kind = d.handling is not None and d.handling.mode != "stop"
    if not d.deliver_warning or not owner or policy is None or other_kind:
        return None
    return owner, policy.notify, policy.slack_channel if policy.notify != "owner" else None


def owner_message_groups(
    decisions: Sequence[Decision], owners: Mapping[str, str | None] | None = None
) -> list[list[Decision]]:
    """The warnings due in one sweep, one list per message. An owner's machines whose warnings go to the
    same places (the owner's DM, and the same team channel when the policy posts there) share a message,
    across teams; a channel so only ever lists its own team's machines. `owners`: each machine's owner as
    resolved from its own tag (the person, whatever the tag's spelling); a machine whose owner does not
    resolve is alone, never listed in another's message. Without it the tag, normalised, is the owner. A
    machine without an owner or a policy is alone, and so is every decision that posts no warning. Order:
    first appearance."""
    groups: dict[tuple[str, str, str | None], list[Decision]] = {}
    alone: list[list[Decision]] = []
    for d in decisions:
        key = owner_message_key(d, owners)
        if key is None:
            alone.append([d])
        else:
            groups.setdefault(key, []).append(d)
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
