"""Carrying out a sweep's decisions: claim each machine, act, post, and record what happened."""

from __future__ import annotations

import contextlib
import secrets
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper.aws.clients import CALL_WIDE_ERRORS, DDB_WORKERS, AwsError, error_code, run_concurrently
from idle_reaper.aws.fleet import ACTION_WORKERS, ActionOutcome, Fleet
from idle_reaper.aws.limits import RATE_HELD
from idle_reaper.aws.state import AuditEntry, StateStore
from idle_reaper.core.digest import running_again_entry
from idle_reaper.core.dollars import of_record
from idle_reaper.core.kinds import notice_sentence
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.reading import plan_next_read
from idle_reaper.core.records import MACHINE_ACTIONS, Action, MachineRecord, State
from idle_reaper.core.reports import owner_key
from idle_reaper.notify import (
    Delivery,
    DeliveryFinder,
    DeliveryUnknown,
    OwnerResolver,
    PermanentDeliveryFailure,
    PostOutcome,
)
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.policy import Settings
from idle_reaper.sweep.adapters import DEFERRED, Adapters, alert_once
from idle_reaper.sweep.copies import owed_at_stop, owed_intent, owes_copy, post_owed_copies, with_copies
from idle_reaper.sweep.notices import StopNoticeSender, queue_notices
from idle_reaper.sweep.owner_messages import SLACK_WORKERS, owner_post, post_owner_messages


def apply_decisions(
    adapters: Adapters,
    decisions: list[Decision],
    previous: Mapping[str, MachineRecord],
    settings: Settings,
    sweep_id: str,
    now: datetime,
    time_left: Callable[[], float] | None = None,
    message_scope: str | None = None,
) -> tuple[list[Decision], set[str]]:
    """Claim, act, tell, record; returns the decisions and the machines whose record this sweep wrote.
    `message_scope` (organization mode): the id the units of one sweep share, so that an owner gets one
    message across them (sweep/owner_messages.py).

    Before a machine is posted about or acted on, its record (the intent: warning, stopping, ...) is
    written together with this sweep's claim, conditionally on the version this sweep read and on no other
    sweep holding a live claim. So of two overlapping sweeps only one gets past this write, and the other
    does nothing to the machine until the outcome is recorded and the claim released. Machines nothing
    happens to are written under the same conditions, unclaimed, when their record changed (record_changed).
    Per-machine failures are recorded on the decision, never raised."""
    store = adapters.store

    def out_of_time() -> bool:
        return time_left is not None and time_left() < FINISH_RESERVE

    def claim(d: Decision) -> tuple[Decision, bool, bool]:
        """The decision, whether its record was written, whether this sweep now holds the machine."""
        if not d.read:
            return d, False, False  # not read this sweep: nothing happened to it, its record stays
        if out_of_time():
            return replace(d, error=DEFERRED), False, False
        before = previous.get(d.machine.instance_id)
        d = _delivery_intent(d, before, now, adapters.notifier)
        hold = _posts_or_acts(d)
        if not hold and before is not None and not record_changed(before, d, now):
            return d, False, False  # nothing new to say: the stored record stays (see record_changed)
        try:
            saved = store.save(owed_intent(d), sweep_id, hold=hold)
        except AwsError as exc:
            saved = False
            d = replace(d, error=f"state table write failed ({error_code(exc)}); nothing done")
        if not saved and d.error is None:
            d = replace(d, error="another sweep is handling it, or changed it first; nothing done")
        return d, saved, saved and hold

    _warm_owner_cache(adapters.notifier, [d for d in decisions if d.read and d.deliver_warning], out_of_time)
    by_id: dict[str, Decision] = {d.machine.instance_id: d for d in decisions}  # keeps the listing's order
    written: set[str] = set()
    claimed: set[str] = set()
    # What posts or acts first, so a sweep short of time spends it on what matters.
    ordered = sorted(decisions, key=lambda d: not _posts_or_acts(d))
    for d, saved, held in run_concurrently(claim, ordered, DDB_WORKERS):
        by_id[d.machine.instance_id] = d
        if saved:
            written.add(d.machine.instance_id)
        if held:
            claimed.add(d.machine.instance_id)

    acting = [d for d in by_id.values() if d.machine.instance_id in claimed and d.action in MACHINE_ACTIONS]
    acting = [d for d in acting if d.applied]
    if acting:
        # Another sweep may have acted between our listing and our loading the records (its record then
        # looks current to us): look again, now that we hold the claims, and act only on what is unchanged.
        try:
            unchanged = adapters.fleet.still_as_listed([d.machine for d in acting], settings.tags)
        except AwsError:
            unchanged = set()  # cannot tell: act on none of them
        changed = [d for d in acting if d.machine.instance_id not in unchanged]
        for d in run_concurrently(lambda d: _stand_down(store, d, previous, sweep_id), changed, DDB_WORKERS):
            by_id[d.machine.instance_id] = d
            claimed.discard(d.machine.instance_id)
        acting = [d for d in acting if d.machine.instance_id in unchanged]
    outcomes = _act(adapters.fleet, acting)
    for d in _held_back(store, acting, outcomes, claimed, previous, sweep_id):  # EC2's rate: the next sweep's
        by_id[d.machine.instance_id] = d

    failed = [d for d in by_id.values() if outcomes.get(d.machine.instance_id)]
    for d in run_concurrently(
        lambda d: _record_failure(store, d, outcomes[d.machine.instance_id] or "", sweep_id, now), failed, DDB_WORKERS
    ):
        by_id[d.machine.instance_id] = d
    to_post = [d for i, d in by_id.items() if i in claimed and not outcomes.get(i)]
    told, untold = _post_claimed(adapters, to_post, outcomes, settings, now, out_of_time, message_scope)
    for d in run_concurrently(lambda d: _record_outcome(store, d, sweep_id), told, DDB_WORKERS):
        by_id[d.machine.instance_id] = d
    _queue_notices(adapters, [d for d in told if d.record.notice and d.error is None], settings, now)
    for d in run_concurrently(lambda d: _stand_down(store, d, previous, sweep_id, DEFERRED), untold, DDB_WORKERS):
        by_id[d.machine.instance_id] = d

    _alert_and_audit(adapters, list(by_id.values()), previous, written, outcomes, settings, now)
    return list(by_id.values()), written


def _post_claimed(
    adapters: Adapters,
    to_post: list[Decision],
    outcomes: Mapping[str, str | None],
    settings: Settings,
    now: datetime,
    out_of_time: Callable[[], bool],
    message_scope: str | None,
) -> tuple[list[Decision], list[Decision]]:
    """Post what the claimed machines call for: (told, untold), each decision's record carrying its outcome.

    Posts go to several conversations at once (SLACK_WORKERS), each conversation's one after another (Slack: about
    one message a second in a conversation, a few hundred a minute in the workspace: the notifier paces both; a
    429's Retry-After is honoured by the client); the outcomes are then recorded concurrently. Out of time, nothing
    more is posted: a machine acted on still has its outcome recorded (unposted), one only to be warned or told
    goes back to its record from before this sweep, claim released. One message per owner, and the copies delivered
    warnings still owe (sweep/copies.py): posted once there is time for the first post, then recorded per machine."""
    owner_posts: dict[str, PostOutcome] | None = None
    owed_posts: dict[str, Delivery] = {}
    # The budget is asked once per machine posted about; its first answer also decides the owner messages.
    first_answer = [not out_of_time()] if to_post else []
    if first_answer and first_answer[0]:
        warnings = [w for w in to_post if w.deliver_warning]
        owner_posts = post_owner_messages(adapters, warnings, out_of_time, message_scope)
        owed_posts = post_owed_copies(adapters, [d for d in to_post if owes_copy(d)], now, out_of_time)
    answers = threading.Lock()

    def in_time() -> bool:
        with answers:
            if first_answer:
                return first_answer.pop()
        return not out_of_time()

    def post_conversation(lane: list[Decision]) -> list[tuple[bool, Decision]]:
        """(told, decision) for each of one conversation's machines, in order."""
        done: list[tuple[bool, Decision]] = []
        for d in lane:
            instance_id = d.machine.instance_id
            if owes_copy(d):  # posted above (or not reached in time: its record stays as it was)
                copies = owed_posts.get(instance_id)
                done.append(
                    (False, d) if copies is None else (True, _record_copies(adapters, d, copies, settings, now))
                )
            elif in_time() or (owner_posts and instance_id in owner_posts):  # out of time: already posted
                done.append((True, _post(adapters, d, settings, now, owner_posts)))
            elif instance_id in outcomes:  # acted, and out of time to post: its notice is drafted, sent later
                record = d.record
                if d.notify == "reaped":
                    record = _copies_given_up(adapters, d, _with_notice(adapters, d), settings, now)
                done.append((True, replace(d, record=replace(record, version=record.version + 1))))
            else:
                done.append((False, d))
        return done

    told: list[Decision] = []
    untold: list[Decision] = []
    for lane in run_concurrently(post_conversation, conversation_lanes(to_post), SLACK_WORKERS):
        for was_told, d in lane:
            (told if was_told else untold).append(d)
    return told, untold


def _record_copies(adapters: Adapters, d: Decision, copies: Delivery, settings: Settings, now: datetime) -> Decision:
    """`d` with what became of the copies its warning still owed; the ones given up are told to the admins."""
    record = with_copies(d, copies, now)
    if copies.undelivered:
        _alert_partly_delivered(adapters, d, copies.undelivered, settings, now)
    return replace(d, record=replace(record, version=record.version + 1))


def _copies_given_up(
    adapters: Adapters, d: Decision, record: MachineRecord, settings: Settings, now: datetime
) -> MachineRecord:
    """A machine stopped while its warning still owed copies: they are given up, and the admins told."""
    if not record.warning_owed:
        return record
    _alert_partly_delivered(adapters, d, owed_at_stop(d), settings, now)
    return replace(record, warning_owed=())


def _held_back(
    store: StateStore,
    acting: list[Decision],
    outcomes: dict[str, str | None],
    claimed: set[str],
    previous: Mapping[str, MachineRecord],
    sweep_id: str,
) -> list[Decision]:
    """The machines whose action was not sent because EC2's rate for it was used (aws/limits.py RateHeld):
    untouched, as machines this sweep had no time for (DEFERRED), their records put back and claims released (taken
    out of `outcomes` and `claimed`); the next sweep acts on them."""
    held = [d for d in acting if (outcomes.get(d.machine.instance_id) or "").startswith(RATE_HELD)]
    for d in held:
        outcomes.pop(d.machine.instance_id)
        claimed.discard(d.machine.instance_id)
    return run_concurrently(lambda d: _stand_down(store, d, previous, sweep_id, DEFERRED), held, DDB_WORKERS)


def _alert_and_audit(
    adapters: Adapters,
    decisions: list[Decision],
    previous: Mapping[str, MachineRecord],
    written: set[str],
    outcomes: Mapping[str, str | None],
    settings: Settings,
    now: datetime,
) -> None:
    """The admins' alerts this sweep's outcomes call for, and the audit trail of what happened."""
    audits: list[AuditEntry] = []
    for d in decisions:
        instance_id = d.machine.instance_id
        if instance_id in written and d.record.delivery_error and d.record.warned_at:
            _alert_undeliverable(adapters, d, settings, now)
        if instance_id in written and d.record.delivery_unresolved and d.record.warned_at:
            _alert_unresolved(adapters, d, settings, now)
        if instance_id in written and d.action is Action.WARN and d.applied and d.handling and d.handling.tell_admins:
            _alert_kind_notice(adapters, d, settings, now)
        if (d.action is not Action.NONE and d.error is None) or instance_id in outcomes:
            audits.append(AuditEntry(d.machine.key, now, explain(d)))
        audits += _running_again(d, previous.get(instance_id), now)
    _audit(adapters.store, audits)


def _running_again(d: Decision, before: MachineRecord | None, now: datetime) -> list[AuditEntry]:
    """A machine the reaper stopped, seen running again: what its stop saved ends at its launch (the digest)."""
    if before is None or before.state is not State.REAPED or not d.read or d.state is State.REAPED:
        return []
    m = d.machine
    # A released group member never stopped: it is running again (protected, busy) from now.
    since = m.launch_time if before.last_action_at is None or m.launch_time >= before.last_action_at else now
    return [AuditEntry(m.key, now, running_again_entry(m.instance_id, m.team, m.owner, m.instance_type, since))]


def conversation_lanes(decisions: list[Decision]) -> list[list[Decision]]:
    """The posts grouped by where they go: an owner's machines in one lane (their DM), a machine without an
    owner in its team's lane (the team channel), in the order given; lanes run concurrently, a lane's posts
    one after another."""
    lanes: dict[str, list[Decision]] = defaultdict(list)
    for d in decisions:
        lanes[owner_key(d.machine.owner) or f"team:{d.machine.team}"].append(d)
    return list(lanes.values())


def _act(fleet: Fleet, acting: list[Decision]) -> dict[str, str | None]:
    """Carry out the machine actions: instance id -> error. Stops, hibernations, protection changes and
    terminations are different APIs with their own rate limits, so they run at once, each in batches
    (and groups) on its own bounded pool."""
    groups: dict[tuple[str, bool], list[str]] = defaultdict(list)
    for d in acting:
        if d.action in (Action.PROTECT, Action.UNPROTECT):
            groups[(d.machine.asg_name or "", d.action is Action.PROTECT)].append(d.machine.instance_id)

    def ids(action: Action) -> list[str]:
        return [d.machine.instance_id for d in acting if d.action is action]

    def protect(group: tuple[str, bool]) -> list[ActionOutcome]:
        return fleet.set_protection(group[0], groups[group], protected=group[1])

    def protect_all() -> list[ActionOutcome]:
        return [o for done in run_concurrently(protect, list(groups), ACTION_WORKERS) for o in done]

    kinds: list[Callable[[], list[ActionOutcome]]] = [
        lambda: fleet.stop(ids(Action.STOP), hibernate=False),
        lambda: fleet.stop(ids(Action.HIBERNATE), hibernate=True),
        protect_all,
        lambda: fleet.terminate_in_groups(ids(Action.TERMINATE)),
        lambda: fleet.terminate(ids(Action.TERMINATE_INSTANCE)),
    ]
    outcomes: dict[str, str | None] = {}
    for done in run_concurrently(lambda kind: kind(), kinds, len(kinds)):
        outcomes.update((o.instance_id, o.error) for o in done)
    return outcomes


# A record whose lifecycle did not change is not rewritten, except to keep what readers see fresh:
# `status` and explanations show data at most REFRESH_EVERY (plus one sweep) old. Each machine is refreshed
# by the first sweep after its own point in the hour (a hash of its id), so refreshes spread evenly over
# sweeps: at 5-minute sweeps, 1/12 of the fleet a sweep. A machine whose lifecycle depends on being watched
# (idle_since or a warning: core.decide counts them only if a sweep observed the machine within one idle
# window) is refreshed the same way every half idle window instead, when that is shorter.
REFRESH_EVERY = timedelta(hours=1)
WATCHED_REFRESH_SHARE = 2
# human_signal is for `status` only ("person active 12:03"): it changes every sweep a person types, so it
# is refreshed with the rest, not written on every change. So is usage_profile (a new busy hour each hour
# of use): each written sweep marks every busy hour it fetched (idle_minutes + max_gap_minutes back), so
# an hourly refresh loses no hour of a window of 45 minutes or more; a lost one only warns sooner.
_BOOKKEEPING = frozenset(
    {"version", "updated_at", "observed_at", "reason", "human_signal", "usage_profile", "week_peaks"}
)
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def record_changed(stored: MachineRecord, d: Decision, now: datetime) -> bool:
    """Whether `d.record` must be written over `stored`: its lifecycle changed (state, idle-since, warning,
    delivery, snooze, action, policy version, facts about the machine), or a refresh is due.

    The stored observed_at then lags the last observation by up to idle_minutes / 2 plus one sweep
    interval. A lag only ever makes core.decide see the machine as unwatched (a fresh warning, a later
    stop), never as watched when it was not: a stop never comes early. With sweeps at most half the
    shortest idle window apart (the default 5-minute schedule and 15-minute policies) it never happens."""
    new = d.record
    lifecycle = (f.name for f in fields(MachineRecord) if f.name not in _BOOKKEEPING)
    if any(getattr(stored, name) != getattr(new, name) for name in lifecycle):
        return True
    period, last_written = REFRESH_EVERY, stored.updated_at
    policy = d.policy.policy if d.policy else None
    watched = policy is not None and (new.idle_since is not None or new.warned_at is not None)
    if watched and policy is not None and new.observed_at is not None and new.observed_at != stored.observed_at:
        # Its lifecycle depends on being watched: keep the stored observation at most half a window old.
        period = min(period, timedelta(minutes=policy.idle_minutes) / WATCHED_REFRESH_SHARE)
        last_written = min(last_written, stored.observed_at) if last_written and stored.observed_at else None
    return last_written is None or last_written <= _last_refresh_point(new.instance_id, now, period)


def _last_refresh_point(instance_id: str, now: datetime, every: timedelta) -> datetime:
    """The machine's latest refresh point at or before `now`: one each `every`, at the machine's own phase,
    so a fleet's refreshes spread evenly over the sweeps in between."""
    period = int(every.total_seconds())
    phase = zlib.crc32(instance_id.encode()) % period
    since = int((now - _EPOCH).total_seconds()) - phase
    return _EPOCH + timedelta(seconds=since // period * period + phase)


CHANGED_SINCE_LISTED = (
    "the machine changed since this sweep listed it (another sweep or a person acted first); nothing done"
)
# Seconds a time-aware sweep keeps for finishing what it began (acting on claimed machines, recording).
FINISH_RESERVE = 30.0


def _stand_down(
    store: StateStore,
    d: Decision,
    previous: Mapping[str, MachineRecord],
    sweep_id: str,
    error: str = CHANGED_SINCE_LISTED,
) -> Decision:
    """Put back the record as it was before this sweep claimed the machine, and release the claim."""
    before = previous.get(d.machine.instance_id) or MachineRecord(
        d.machine.instance_id, d.machine.team, account=d.machine.account, region=d.machine.region
    )
    record = replace(before, version=d.record.version + 1)
    with contextlib.suppress(*AwsError):
        store.save(record, sweep_id)  # if this fails, the claim lapses after SWEEP_LEASE
    return replace(d, record=record, error=error)


def _posts_or_acts(d: Decision) -> bool:
    """Whether applying `d` talks to people or changes the machine: then it must hold the claim."""
    acts = d.applied and d.action in MACHINE_ACTIONS
    return acts or d.deliver_warning or d.notify in ("resolved", "reaped") or owes_copy(d)


def _delivery_intent(d: Decision, previous: MachineRecord | None, now: datetime, notifier: object) -> Decision:
    """Carry the warning's delivery from sweep to sweep, and write the intent to post before posting.

    A warning's delivery is explicit: pending (not posted: this sweep posts it), delivered (channel and ts
    known), unknown (a post was attempted and its outcome lost), or undeliverable. Unknown is resolved, not
    assumed: every warning carries Slack message metadata naming its machine and reference, so the post is
    looked for where it would be (`find_warning`): found, it is delivered as of when it was posted; not
    found, it is pending and posted now with the same buttons; when Slack cannot be asked it stays unknown
    and the stop waits (up to undelivered_warning_max_minutes, the documented Slack-unreachable exception).
    The intent carries the warning's button reference, so its buttons work from the moment the message
    exists, whatever happens to this sweep afterwards. A warning that cannot be delivered is not retried."""
    record = d.record
    same_warning = previous is not None and record.warned_at is not None and record.warned_at == previous.warned_at
    if not same_warning:
        if record.warning_post_started_at or record.delivery_error or record.delivery_unresolved or record.warning_owed:
            record = replace(
                record, warning_post_started_at=None, delivery_error=None, delivery_unresolved=None, warning_owed=()
            )
    elif d.deliver_warning and record.delivery_error is None and record.warning_post_started_at is not None:
        d = _resolve_unknown(replace(d, record=record), notifier, now)
        record = d.record
    if d.deliver_warning and record.delivery_error:
        reason = f"{d.reason}; not sent again: {record.delivery_error}"
        return replace(d, deliver_warning=False, reason=reason, record=replace(record, reason=reason))
    if d.deliver_warning:
        record = replace(
            record,
            warning_post_started_at=now,
            warning_ref=record.warning_ref or secrets.token_urlsafe(18),
            owner_slack_id=record.owner_slack_id or _owner_of(notifier, d),
        )
    return replace(d, record=record)


def _warm_owner_cache(notifier: object, warnings: list[Decision], out_of_time: Callable[[], bool]) -> None:
    """Resolve the owners of this sweep's warnings at once (OwnerResolver: a few users.list pages rather than
    a users.lookupByEmail each, Tier 3), so that the claims (_owner_of) and the owner messages find them
    cached. A failure only leaves them to be resolved one by one."""
    tags = sorted({(d.machine.owner or "").strip() for d in warnings if not d.record.owner_slack_id} - {""})
    if len(tags) < 2 or not isinstance(notifier, OwnerResolver) or out_of_time():
        return
    try:
        notifier.resolve_owners(tags)
    except Exception as exc:
        logger.warning("owners could not be resolved at once", extra={"error": str(exc)})


def _owner_of(notifier: object, d: Decision) -> str | None:
    """The owner as a Slack user, on the record from the claim on, so the owner's click is recognised
    before the sweep has recorded the outcome (None: unknown yet, recorded with the outcome)."""
    if not isinstance(notifier, DeliveryFinder):
        return None
    try:
        return notifier.resolve_owner(d.machine.owner)
    except Exception:  # Slack or the table down: the post itself will say
        return None


def _resolve_unknown(d: Decision, notifier: object, now: datetime) -> Decision:
    """A warning whose post was attempted and never recorded: delivered, pending, or still unknown."""
    record = d.record
    assert record.warning_post_started_at is not None
    started = record.warning_post_started_at
    try:
        found = notifier.find_warning(d) if isinstance(notifier, DeliveryFinder) else None
    except PermanentDeliveryFailure as exc:
        return replace(d, record=replace(record, warning_post_started_at=None, delivery_error=exc.reason))
    except Exception as exc:  # DeliveryUnknown, or any notifier fault: not posted twice, the stop waits
        answered = isinstance(exc, DeliveryUnknown) and exc.answered
        reason = (
            f"{d.reason}; delivery unknown: a post began at {started:%H:%M} UTC and whether it reached the owner "
            f"cannot be told now ({exc}); no stop until it is known"
        )
        # Slack answered and would not show it: the stop waits for the outcome, however long (the admins are told).
        unresolved = str(exc) if answered else record.delivery_unresolved
        record = replace(record, reason=reason, delivery_unresolved=unresolved)
        return replace(d, deliver_warning=False, reason=reason, record=record)
    record = replace(record, delivery_unresolved=None)
    if found is None:
        logger.info(
            "a warning whose outcome was lost was never posted: posting it now",
            extra={"instance_id": d.machine.instance_id},
        )
        return d  # pending: posted now, with the same reference
    delivered_at = started  # the post began then: a person could read it from about then on
    policy = d.policy.policy if d.policy else None
    stop_not_before = record.stop_not_before
    if policy is not None:
        stop_not_before = max(stop_not_before or delivered_at, delivered_at + timedelta(minutes=policy.warn_minutes))
    reason = f"{d.reason}; the warning was found delivered at {delivered_at:%H:%M} UTC"
    record = replace(
        record,
        warning_post_started_at=None,
        warning_delivered_at=delivered_at,
        stop_not_before=stop_not_before,
        messages=found.messages,
        owner_slack_id=found.owner_slack_id or record.owner_slack_id,
        group_ref=found.group_ref or record.group_ref,
        warning_owed=found.owed,  # the conversations it was not found in: posted there, once
        reason=reason,
    )
    return replace(d, deliver_warning=False, reason=reason, record=record)


def _alert_undeliverable(adapters: Adapters, d: Decision, settings: Settings, now: datetime) -> None:
    """Once per machine per warning: the admins learn that its owner cannot be (or may not have been) told."""
    record, m = d.record, d.machine
    assert record.warned_at is not None
    policy = d.policy.policy if d.policy else None
    held = ""
    if policy is not None:
        until = record.warned_at + timedelta(minutes=policy.undelivered_warning_max_minutes)
        held = f" It is not stopped before {until:%Y-%m-%d %H:%M} UTC (undelivered_warning_max_minutes) unless kept."
    text = (
        f"the idle warning for {m.name or m.instance_id} ({m.instance_id}{m.where}, team {m.team}, owner "
        f"{m.owner or 'none'}) was not delivered and is not retried: {record.delivery_error}.{held} "
        "Fix the cause (the Owner tag, the team's slack_channel, the bot's membership); `idle-reaper status` shows it."
    )
    alert_once(adapters, f"undeliverable#{m.key}@{record.warned_at.isoformat()}", text, settings, now)


def _alert_unresolved(adapters: Adapters, d: Decision, settings: Settings, now: datetime) -> None:
    """Once per machine per warning: Slack answers but will not show whether the warning went out, so the machine
    is not stopped until it can tell; the admins learn what to fix."""
    record, m = d.record, d.machine
    assert record.warned_at is not None
    text = (
        f"whether the idle warning for {m.name or m.instance_id} ({m.instance_id}{m.where}, team {m.team}, owner "
        f"{m.owner or 'none'}) reached anyone cannot be told: a post began and its answer was lost, and Slack will "
        f"not show where it went ({record.delivery_unresolved}). The machine is not stopped until it can be told. "
        "Fix the cause (invite the bot to the channel, reinstall the app with slack/manifest.yml's scopes)."
    )
    alert_once(adapters, f"unresolved#{m.key}@{record.warned_at.isoformat()}", text, settings, now)


def _alert_kind_notice(adapters: Adapters, d: Decision, settings: Settings, now: datetime) -> None:
    """Once per machine per quiet stretch: the admins learn of an idle machine the reaper does not stop because
    its fleet would replace it or a reservation bills it either way (their decision: shrink or release)."""
    m, how = d.machine, d.handling
    assert how is not None and d.record.warned_at is not None
    cost = f"; it costs about ${d.hourly_cost:,.2f} an hour at the on-demand rate" if d.hourly_cost is not None else ""
    text = (
        f"idle: {m.name or m.instance_id} ({m.instance_id}{m.where}, {m.instance_type}, team {m.team}, owner "
        f"{m.owner or 'none'}). {notice_sentence(d.kind, how, m.instance_type).rstrip('.')}{cost}. Its owner was told "
        "too."
    )
    alert_once(adapters, f"kind-notice#{m.key}@{d.record.warned_at.isoformat()}", text, settings, now)


def _alert_partly_delivered(
    adapters: Adapters, d: Decision, undelivered: tuple[str, ...], settings: Settings, now: datetime
) -> None:
    """The warning reached someone (so it counts), but not every target: e.g. the owner's DM went out and
    the team channel refused it. Said once per machine per warning, so the channel gets fixed."""
    m, record = d.machine, d.record
    assert record.warned_at is not None
    text = (
        f"the idle warning for {m.name or m.instance_id} ({m.instance_id}{m.where}, team {m.team}) was delivered, "
        f"but not to every target: {'; '.join(undelivered)}"
    )
    alert_once(adapters, f"partly-undelivered#{m.key}@{record.warned_at.isoformat()}", text, settings, now)


# Errors a later call may not meet (throttling, an outage, the network); every other refusal is EC2's answer
# about this machine, and asking again would get the same one.
TRANSIENT_ERRORS = CALL_WIDE_ERRORS | {
    "InternalServerError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
}


def _record_failure(store: StateStore, d: Decision, error: str, sweep_id: str, now: datetime) -> Decision:
    # A machine already stopped or gone is recorded, not retried. One EC2 refuses for a reason a retry does not
    # change (UnsupportedOperation: a one-time Spot or instance-store machine it could not be told from) stays
    # warned and is not asked again this quiet stretch. Anything else (throttling, an outage) stays warned so
    # the next sweep tries again.
    code = error.split(":", 1)[0]
    gone = code in ("InvalidInstanceID.NotFound", "IncorrectInstanceState")
    refused = not gone and code not in TRANSIENT_ERRORS
    if (d.machine.is_notebook or d.machine.deleted_by_stop) and code in ("ValidationException", "ResourceInUse"):
        # SageMaker's answer while a notebook instance, an endpoint or a Studio app is not InService (it began
        # changing after the listing): it passes, so the next sweep that finds it InService and still idle tries again.
        refused = False
    state = State.REAPED if gone and d.action in (Action.STOP, Action.HIBERNATE) else d.record.state
    if not gone and d.action in (
        Action.STOP,
        Action.HIBERNATE,
        Action.UNPROTECT,
        Action.TERMINATE,
        Action.TERMINATE_INSTANCE,
    ):
        state = State.WARNED
    reason = f"{d.action.value} failed: {error}"
    if refused and state is State.WARNED:
        reason += "; not tried again until the machine is busy again"
    record = replace(
        d.record,
        version=d.record.version + 1,
        state=state,
        reason=reason,
        last_action=f"{d.action.value}_failed",
        last_action_at=now,
        action_refused_at=now if refused and state is State.WARNED else d.record.action_refused_at,
    )
    # If this write fails too, the decision still carries the error; the claim lapses after SWEEP_LEASE
    # and a later sweep re-reads the truth.
    with contextlib.suppress(*AwsError):
        store.save(record, sweep_id)
    return replace(d, error=reason, record=record, state=state)


def _post(
    adapters: Adapters,
    d: Decision,
    settings: Settings,
    now: datetime,
    owner_posts: Mapping[str, PostOutcome] | None = None,
) -> Decision:
    """Post what the decision calls for; the decision's record then carries the outcome (not yet written).
    A warning already posted in its owner's shared message (`owner_posts`) is recorded as that post went."""
    record, reason = d.record, d.reason
    delivery: Delivery | None = None
    try:
        if d.deliver_warning and owner_posts and d.machine.instance_id in owner_posts:
            delivery = owner_post(owner_posts[d.machine.instance_id])
        elif d.deliver_warning:
            delivery = adapters.notifier.warn(d)
        elif d.notify == "resolved":
            adapters.notifier.resolved(d)
        elif d.notify == "reaped" and isinstance(adapters.notifier, StopNoticeSender):
            record = _with_notice(adapters, d)  # sent by the notice pass, paced, until Slack takes it
        elif d.notify == "reaped":
            delivery = adapters.notifier.reaped(d)
        if d.notify == "reaped":
            record = _copies_given_up(adapters, d, record, settings, now)
    except PermanentDeliveryFailure as exc:
        logger.warning("message cannot be delivered", extra={"instance_id": d.machine.instance_id, "why": exc.reason})
        if d.deliver_warning:
            reason = f"{reason}; the warning cannot be delivered: {exc.reason}"
            record = replace(record, delivery_error=exc.reason, reason=reason)
    except DeliveryUnknown as exc:  # the post's answer was lost: it may be there, looked for before posting again
        logger.warning("warning post outcome lost", extra={"instance_id": d.machine.instance_id, "why": exc.reason})
        if d.deliver_warning:
            reason = f"{reason}; the warning's post may have gone out (its answer was lost): looked for next sweep"
            return replace(d, record=replace(record, reason=reason, version=record.version + 1), reason=reason)
    except Exception as exc:  # a notifier must never break the sweep; the warning stays pending
        logger.warning("notification failed", extra={"instance_id": d.machine.instance_id, "error": str(exc)})
    if d.deliver_warning:
        record = replace(record, warning_post_started_at=None)  # the outcome is known: delivered or not
    if delivery is not None:
        stop_not_before = record.stop_not_before
        policy = d.policy.policy if d.policy else None
        if d.deliver_warning and policy is not None:
            # Delivered late: the owner still gets warn_minutes from now, and the message says so.
            stop_not_before = max(stop_not_before or now, now + timedelta(minutes=policy.warn_minutes))
        record = replace(
            record,
            stop_not_before=stop_not_before,
            warning_delivered_at=now if d.deliver_warning else record.warning_delivered_at,
            messages=delivery.messages or record.messages,
            warning_ref=delivery.ref,
            owner_slack_id=delivery.owner_slack_id or record.owner_slack_id,
            group_ref=delivery.group_ref if d.deliver_warning else record.group_ref,
            warning_owed=delivery.owed if d.deliver_warning else record.warning_owed,
        )
        if d.deliver_warning:  # told now: a machine only reported on is planned in this same write
            record = plan_next_read(replace(d, record=record), now)
    if delivery is not None and delivery.undelivered and d.deliver_warning and record.warned_at:
        _alert_partly_delivered(adapters, d, delivery.undelivered, settings, now)
    return replace(d, record=replace(record, version=record.version + 1), reason=reason)


def _with_notice(adapters: Adapters, d: Decision) -> MachineRecord:
    """The record with its stop notice drafted (sweep/notices.py), and the "Start it again" reference it carries."""
    if not isinstance(adapters.notifier, StopNoticeSender):
        return d.record
    try:
        notice = adapters.notifier.stop_notice(d)
    except Exception as exc:  # a notifier must never break the sweep: the stop happened; it is told in `status`
        logger.warning("stop notice not drafted", extra={"instance_id": d.machine.instance_id, "error": str(exc)})
        return d.record
    if notice is None:
        return d.record
    return replace(d.record, notice=notice.to_json(), warning_ref=notice.ref or d.record.warning_ref)


def _queue_notices(adapters: Adapters, told: list[Decision], settings: Settings, now: datetime) -> None:
    left_out = queue_notices(adapters.store, [d.machine.key for d in told], now)
    if left_out:
        text = (
            f"{len(left_out)} stop notices could not be queued (the state table refused, or the pending notices are "
            f"full): their owners are told only by `idle-reaper status`: {', '.join(sorted(left_out)[:20])}"
        )
        alert_once(adapters, f"notices-not-queued#{now.isoformat()}", text, settings, now)


# The error of a decision carried out whose outcome could not be written: what it did still happened.
OUTCOME_NOT_RECORDED = "outcome not recorded"


def _record_outcome(store: StateStore, d: Decision, sweep_id: str) -> Decision:
    """Record what was posted and release the claim. The write is conditional: an answer a person gave
    meanwhile wins, and a late sweep never overwrites newer truth."""
    record = d.record
    try:
        if not store.save(record, sweep_id):
            logger.warning("the machine changed while claimed (a person answered); outcome not recorded")
    except AwsError as exc:
        # The claim lapses after SWEEP_LEASE; a warning whose outcome is lost is not posted again.
        return replace(d, error=f"{OUTCOME_NOT_RECORDED}: state table write failed ({error_code(exc)})")
    return d


def explain(d: Decision) -> dict[str, Any]:
    a = d.assessment
    saving = d.saving or of_record(d.record, d.hourly_cost).saved_by(d.action.value)
    # A member account's machine says which account and region it runs in; a hub machine's row is unchanged.
    where = {"account": d.machine.account, "region": d.machine.region} if d.machine.account else {}
    return {
        "instance_id": d.machine.instance_id,
        **where,
        "team": d.machine.team,
        "owner": d.machine.owner,
        "instance_type": d.machine.instance_type,
        "asg": d.machine.asg_name,
        "state": d.state.value,
        "signal": d.signal,
        "action": d.action_label,
        "reason": d.reason,
        "error": d.error,
        "policy": d.policy.label if d.policy else None,
        "window_minutes": d.policy.policy.idle_minutes if d.policy and d.policy.policy else None,
        "max_cpu": a.max_cpu if a else None,
        "max_gpu": a.max_gpu if a else None,
        "quiet_since": a.quiet_since.isoformat() if a and a.quiet_since else None,
        "idle_since": d.record.idle_since.isoformat() if d.record.idle_since else None,
        "warned_at": d.record.warned_at.isoformat() if d.record.warned_at else None,
        "snoozed_until": d.record.snoozed_until.isoformat() if d.record.snoozed_until else None,
        "snoozed_by": d.record.snoozed_by,
        "hourly_cost": d.hourly_cost,
        # What its action saves an hour, by the one rule (core/dollars.py: 0 for reserved capacity and for kinds
        # never stopped, for Spot the most it can be), and the kind why.
        "hourly_savings": saving.hourly,
        "savings_upper_bound": saving.upper_bound,
        "kind": d.kind.kind.value if d.read else (d.record.machine_kind or None),
        "kind_note": d.record.kind_note or None,
    }


def _audit(store: StateStore, entries: list[AuditEntry]) -> None:
    try:
        failed = store.audit_many(entries)
    except AwsError as exc:
        failed = [a.instance_id for a in entries]
        logger.warning("audit write failed", extra={"error": error_code(exc)})
    for instance_id in failed:
        logger.warning("audit write failed", extra={"instance_id": instance_id})
