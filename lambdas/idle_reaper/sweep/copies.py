"""The copies a delivered warning still owes (MachineRecord.warning_owed), posted by the sweep.

A warning goes to each of its conversations on its own (the owner's DM, the team channel). When one took it and
another refused for a reason that may pass (a 429 past the client's retries, Slack down), the warning counts as
delivered (a person can read and answer it) and the other conversation is owed its copy: every sweep posts the same
warning there, once, until Slack takes it. A copy whose post may have gone out (its answer lost, or a sweep died
after posting it: the claim writes every copy it is about to post as MAYBE_POSTED) is looked for first, never
posted twice. A copy still owed after undelivered_warning_max_minutes, refused for good, or still owed when the
machine is stopped, is given up, and the admins are told, as of a target that refused the warning for good. While
the owner's own copy is owed the stop waits for it (core.lifecycle, Event.OWNER_COPY_OWED)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

from idle_reaper.aws.clients import run_concurrently
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MAYBE_POSTED, MachineRecord, State, owed_target
from idle_reaper.notify import CopyNotifier, Delivery, logger
from idle_reaper.sweep.adapters import Adapters
from idle_reaper.sweep.owner_messages import SLACK_WORKERS


def owes_copy(d: Decision) -> bool:
    """Whether this sweep posts the copies `d`'s warning still owes: read, warned, delivered, and not stopped now."""
    r = d.record
    return (
        d.read
        and bool(r.warning_owed)
        and d.state is State.WARNED
        and r.warned_at is not None
        and r.warning_delivered_at is not None
        and not d.deliver_warning
        and d.notify is None
    )


def owed_intent(d: Decision) -> MachineRecord:
    """The record the claim writes: every copy about to be posted marked as maybe posted, so that a sweep that dies
    after posting one leaves it to be looked for, not posted twice."""
    if not owes_copy(d):
        return d.record
    marked = tuple(e if e.endswith(MAYBE_POSTED) else e + MAYBE_POSTED for e in d.record.warning_owed)
    return replace(d.record, warning_owed=marked)


def _given_up(d: Decision, entry: str, why: str) -> str:
    target, _ = owed_target(entry)
    where = "the owner's DM" if target == d.record.owner_slack_id else f"channel {target}"
    return f"warning for {d.machine.instance_id} (team {d.machine.team}): its copy to {where} {why}"


def post_owed_copies(
    adapters: Adapters, decisions: list[Decision], now: datetime, out_of_time: Callable[[], bool]
) -> dict[str, Delivery]:
    """Post the copies `decisions` (owes_copy) still owe: one post per message and conversation (the machines of a
    shared message together), several conversations at once. By instance id, what became of each machine's copies
    (notify.CopyNotifier.post_owed, merged); a machine absent was not reached in time (its record stays as it was).
    A copy owed for undelivered_warning_max_minutes is given up without a post."""
    out: dict[str, Delivery] = {}
    due: list[Decision] = []
    for d in decisions:
        policy = d.policy.policy if d.policy else None
        held = timedelta(minutes=policy.undelivered_warning_max_minutes if policy else 0)
        assert d.record.warned_at is not None
        if now - d.record.warned_at >= held:
            why = f"could not be posted for {held.total_seconds() / 60:.0f} min (undelivered_warning_max_minutes)"
            out[d.machine.instance_id] = Delivery(
                undelivered=tuple(_given_up(d, e, why) for e in d.record.warning_owed)
            )
        else:
            due.append(d)
    notifier = adapters.notifier
    if not isinstance(notifier, CopyNotifier):
        return out
    groups: dict[tuple[str, str], list[tuple[Decision, str]]] = {}
    for d in due:
        for entry in d.record.warning_owed:
            target, _ = owed_target(entry)
            groups.setdefault((d.record.group_ref or d.machine.key, target), []).append((d, entry))

    def post(group: tuple[tuple[str, str], list[tuple[Decision, str]]]) -> list[tuple[Decision, str, Delivery]]:
        (_, target), members = group
        if out_of_time():
            return []
        listed = [d for d, _ in members]
        try:
            posted = notifier.post_owed(listed, target, any(owed_target(e)[1] for _, e in members))
        except Exception as exc:  # a notifier must never break the sweep: the copies stay owed
            logger.warning("owed warning copies not posted", extra={"target": target, "error": str(exc)})
            posted = [Delivery(owed=(e,)) for _, e in members]
        return [(d, e, o) for (d, e), o in zip(members, posted, strict=True)]

    results: dict[str, dict[str, Delivery]] = {}
    for done in run_concurrently(post, list(groups.items()), SLACK_WORKERS):
        for d, entry, outcome in done:
            results.setdefault(d.machine.instance_id, {})[entry] = outcome
    for d in due:
        mine = results.get(d.machine.instance_id)
        if mine is None:
            continue  # none of its copies reached in time: its record stays as it was
        each = [mine.get(e) or Delivery(owed=(e,)) for e in d.record.warning_owed]
        out[d.machine.instance_id] = Delivery(
            messages=tuple(m for o in each for m in o.messages),
            owed=tuple(e for o in each for e in o.owed),
            undelivered=tuple(u for o in each for u in o.undelivered),
        )
    return out


def with_copies(d: Decision, copies: Delivery, now: datetime) -> MachineRecord:
    """`d`'s record with what became of its owed copies: the copies posted are kept (later answers and the stop
    edit them too), and a copy posted now announces the stop as it now stands, warn_minutes from now at the
    soonest: the stop never comes before a copy of its warning said it would."""
    record = d.record
    stop_not_before = record.stop_not_before
    policy = d.policy.policy if d.policy else None
    if copies.messages and policy is not None:
        stop_not_before = max(stop_not_before or now, now + timedelta(minutes=policy.warn_minutes))
    messages = tuple(dict.fromkeys(record.messages + copies.messages))
    return replace(record, messages=messages, warning_owed=copies.owed, stop_not_before=stop_not_before)


def owed_at_stop(d: Decision) -> tuple[str, ...]:
    """The copies `d`'s warning still owed when the machine was stopped: given up (the admins are told)."""
    why = "was not posted before the stop (Slack refused it for now at every try)"
    return tuple(_given_up(d, e, why) for e in d.record.warning_owed)
