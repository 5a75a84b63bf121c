"""Quiet hours: stops made while a team sleeps are noted, and each owner gets one summary when they end.

The index of stops not told yet is one small item per stop (StateStore.put_entries: about 150 bytes), in a
partition per account and region: group `quiet-stops#hub` for the hub's own machines, `quiet-stops#<account>/<region>`
for a member account's. So nothing grows with the fleet inside one item, and noting a stop is one PutItem: shards
and sweeps noting at once never lose each other's (nothing is read, changed and written back). A partition takes
no more writes than EC2 lets its account and region stop machines (StopInstances: 1,000 instances, then 20 a
second, limits.EC2_STOP_INSTANCES) and, in the morning, a removal per stop as each owner's summary is sent (as fast
as Slack takes them): inside DynamoDB's 1,000 writes a second for one partition.

Each partition is read once a sweep, by the invocation that sweeps its account and region with the policies its
machines were stopped under: the hub's sweep (in place, or shard 0 of a fanned-out one) reads the hub's; a member
unit (part 0 of one swept in parts) reads its own. No shard or unit reads another's stops, nor one hot item."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from idle_reaper.aws.clients import AwsError, error_code
from idle_reaper.aws.limits import Pacing
from idle_reaper.aws.policies import policy_for
from idle_reaper.aws.state import StateStore
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MachineRecord, State, parse_machine_key
from idle_reaper.core.reports import QUIET_REPORT_GIVE_UP, owner_key, quiet_hours_reports
from idle_reaper.notify import OwnerNotifier, PermanentDeliveryFailure
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.policy import Settings, TeamPolicyRef
from idle_reaper.sweep.adapters import Adapters, alert_once
from idle_reaper.sweep.delivery import FINISH_RESERVE, OUTCOME_NOT_RECORDED

QUIET_STOPS = "quiet-stops"  # the entries' group, one a scope: quiet-stops#hub, quiet-stops#<account>/<region>
HUB_SCOPE = "hub"
# The index before it was split (one lookup item, JSON {team: [machine keys]}): a deploy that upgrades during the
# night finds it; the hub's summary pass moves what it holds into the entries and empties it (migrate_old_index).
QUIET_INDEX = "quiet-stops"
QUIET_INDEX_TTL = timedelta(days=7)  # an entry lives this long after its stop (quiet hours longer are not told)
QUIET_INDEX_ATTEMPTS = 6
QUIET_WAIT_WARNING = timedelta(days=6)  # a stop still waiting this long is told to the admins (it expires at 7)


@dataclass(frozen=True)
class QuietStop:
    """One stop made during quiet hours, not told yet: the entry `key` (the machine's) -> JSON {team, stopped_at}."""

    key: str
    team: str
    stopped_at: str | None  # ISO-8601; None for a stop moved from the old index (it did not keep the time)

    @property
    def value(self) -> str:
        return json.dumps({"team": self.team, "stopped_at": self.stopped_at}, sort_keys=True)


def scope_of(key: str) -> str:
    """The partition a machine's stops go to: where it runs (ValueError for text that is no machine key)."""
    found = parse_machine_key(key)
    return HUB_SCOPE if found.account is None else f"{found.account}/{found.region}"


def _group(scope: str) -> str:
    return f"{QUIET_STOPS}#{scope}"


def parse_stop(key: str, value: str, scope: str) -> QuietStop:
    """An entry of `scope`'s partition as stored; ValueError saying what is wrong with it."""
    try:
        where = scope_of(key)
    except ValueError:
        raise ValueError(f"{key!r} is not a machine key") from None
    if where != scope:
        raise ValueError(f"{key!r} runs in {where}, not in {scope}")
    try:
        data = json.loads(value)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("team"), str) or not data["team"]:
        raise ValueError(f"its value is not a JSON object with a team: {value[:100]!r}")
    at = data.get("stopped_at")
    if at is not None:
        try:
            when = datetime.fromisoformat(at)
        except (TypeError, ValueError):
            raise ValueError(f"stopped_at is not an ISO-8601 time: {at!r}") from None
        if when.tzinfo is None:
            raise ValueError(f"stopped_at has no time zone: {at!r}")
    return QuietStop(key, data["team"], at)


def note_quiet_stops(store: StateStore, stops: Sequence[QuietStop], now: datetime) -> dict[str, str]:
    """Add `stops` to the index, each an entry of its own in its scope's partition; the ones that could not be
    written after QUIET_INDEX_ATTEMPTS tries (throttled, refused), each with why. Idempotent: a stop noted again
    is the same entry."""
    left = {s.key: s for s in stops}
    failed: dict[str, str] = {}
    for attempt in range(QUIET_INDEX_ATTEMPTS):
        if not left:
            break
        if attempt:  # throttled: back off, jittered, before writing what is left
            Pacing.sleep(random.uniform(0, 0.02 * 2**attempt))  # the benchmark's virtual clock moves too
        by_scope: dict[str, dict[str, str]] = {}
        for s in left.values():
            by_scope.setdefault(scope_of(s.key), {})[s.key] = s.value
        failed = {}
        for scope, entries in by_scope.items():
            try:
                failed.update(store.put_entries(_group(scope), entries, now + QUIET_INDEX_TTL))
            except AwsError as exc:
                failed.update(dict.fromkeys(entries, f"{error_code(exc)}: {exc}"))
        left = {k: s for k, s in left.items() if k in failed}
    return failed


def quiet_stops(store: StateStore, scope: str, now: datetime) -> tuple[list[QuietStop], dict[str, str]]:
    """The stops not told yet of one scope, and its entries that are unreadable (key -> what is wrong).

    Read eventually consistent, as enough: an entry written a moment ago and not seen is read by the next sweep
    (a stop noted this sweep is under quiet hours, so it is not due now anyway); an entry seen after its removal
    is told at most once, since each stop's summary is claimed with a conditional (strongly consistent) write
    that outlives the entry (claim_once, CLAIM_TTL_DAYS), and the record it is told from must still say so."""
    stops, bad = [], {}
    for key, value in sorted(store.entries(_group(scope), now).items()):
        try:
            stops.append(parse_stop(key, value, scope))
        except ValueError as exc:
            bad[key] = str(exc)
    return stops, bad


def migrate_old_index(store: StateStore, now: datetime) -> int:
    """Move the stops of the index as it was before it was split (one lookup item) into the entries, then empty
    it (conditionally: what an old sweep wrote meanwhile is moved by the next sweep). A single GetItem when there
    is none. An unreadable old index is left as it is (its TTL ends it) and said. Returns the stops moved."""
    raw = store.get_lookup(QUIET_INDEX, now)
    if raw is None:
        return 0
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        logger.warning(
            "the quiet-hours index of the previous version is unreadable: left as it is (its TTL ends it within "
            "7 days); the stops it held are not in a morning summary",
            extra={"value": raw[:200]},
        )
        return 0
    stops: dict[str, QuietStop] = {}
    for team, keys in data.items():
        for key in keys:
            try:
                scope_of(key)
            except (ValueError, AttributeError):
                logger.warning("not a machine key in the old quiet-hours index: skipped", extra={"key": str(key)})
                continue
            stops[key] = QuietStop(key, str(team), None)
    failed = note_quiet_stops(store, list(stops.values()), now)
    if failed:  # the old index stays, and the next sweep moves it again (noting a stop twice is the same entry)
        logger.warning("the old quiet-hours index not moved yet", extra={"failed": dict(list(failed.items())[:5])})
        return 0
    store.replace_lookup(QUIET_INDEX, "{}", now, expected=raw, now=now)  # expires at once
    return len(stops)


def report_quiet_hours(
    adapters: Adapters,
    decisions: list[Decision],
    refs: Mapping[str, TeamPolicyRef],
    settings: Settings,
    now: datetime,
    member: tuple[str, str] | None = None,
    tell: bool = True,
    time_left: Callable[[], float] | None = None,
) -> None:
    """Quiet hours are not lost: the machines this sweep stopped during their team's quiet hours are noted in
    the index (above); and with `tell`, at the first sweep after a team's quiet hours end, each owner of a stop
    of this sweep's scope (`member`'s account and region, None: the hub's) gets ONE summary of what was stopped
    (core.quiet_hours_reports), with "Start it again" per machine. Each stop is claimed once (claim_once per
    machine and stop), so no stop is told twice, and each owner once a sweep (claim_once per owner and sweep): an
    owner with stops in several accounts or regions hears of the others at the next sweeps. A post that fails
    releases its claims and the next sweep tries again, for at most core.QUIET_REPORT_GIVE_UP. Stops that cannot
    be noted are reported to the admins. Never fails the sweep."""
    notifier, store = adapters.notifier, adapters.store
    if not isinstance(notifier, OwnerNotifier):
        return
    stopped = []
    for d in decisions:
        # Noted from what the stop did: a stop whose outcome write failed still happened (its intent, with
        # quiet_stop_at, was written with the claim); one refused or never attempted did not.
        did_stop = d.error is None or d.error.startswith(OUTCOME_NOT_RECORDED)
        if d.record.quiet_stop_at == now and did_stop and d.record.state is State.REAPED:
            stopped.append(QuietStop(d.machine.key, d.machine.team, now.isoformat()))
    failed = note_quiet_stops(store, stopped, now) if stopped else {}
    if failed:
        lost = sorted(failed)
        why = next(iter(failed.values()))
        logger.warning("quiet hours index not updated", extra={"error": why, "instance_ids": lost})
        text = (
            f"{len(lost)} machines stopped during quiet hours will not be in their owners' morning summary "
            f"(the state table refused the update: {why}): {', '.join(lost[:20])}"
        )
        alert_once(adapters, f"quiet-index#{scope_of(lost[0])}@{now.isoformat()}", text, settings, now)
    if tell:
        _tell_scope(
            adapters,
            notifier,
            HUB_SCOPE if member is None else f"{member[0]}/{member[1]}",
            refs,
            settings,
            now,
            time_left,
        )


def _tell_scope(
    adapters: Adapters,
    notifier: OwnerNotifier,
    scope: str,
    refs: Mapping[str, TeamPolicyRef],
    settings: Settings,
    now: datetime,
    time_left: Callable[[], float] | None,
) -> None:
    """The summaries due of one scope's stops (its partition read once); never raises."""
    store = adapters.store
    if scope == HUB_SCOPE:
        try:
            migrate_old_index(store, now)
        except AwsError as exc:  # the next sweep moves it; the entries are told meanwhile
            logger.warning("the old quiet-hours index not moved yet", extra={"error": error_code(exc)})
    try:
        pending, bad = quiet_stops(store, scope, now)
        for key, why in bad.items():
            logger.warning(
                "unreadable entry of the quiet-hours index: left as it is (its TTL ends it), not told",
                extra={"partition": _group(scope), "key": key, "why": why},
            )
        awake = {t for t in {s.team for s in pending} if _awake(t, refs, settings, now)}
        _waiting_long(adapters, scope, [s for s in pending if s.team not in awake], settings, now)
        values = {s.key: s.value for s in pending if s.team in awake}

        def settled(keys: Sequence[str]) -> None:
            """Told, given up, or nothing to tell: off the index, as each owner's summary is done (so the
            removals go as fast as Slack takes the summaries). An entry written again meanwhile (a new stop)
            stays: the removal is conditional on the value read."""
            if keys:
                store.remove_entries(_group(scope), {k: values[k] for k in keys})

        if values:
            _send_quiet_summaries(adapters, notifier, list(values), now, time_left, settled)
    except Exception as exc:  # the summary must never fail the sweep; the index stays for the next one
        logger.warning("quiet hours summary failed", extra={"error": str(exc)})


def _waiting_long(
    adapters: Adapters, scope: str, waiting: Sequence[QuietStop], settings: Settings, now: datetime
) -> None:
    """Stops whose team's quiet hours (or valid policy) have not come back within QUIET_WAIT_WARNING of the stop
    leave the index untold QUIET_INDEX_TTL after it: the admins are told, once a day per scope."""
    old = [s for s in waiting if s.stopped_at and now - datetime.fromisoformat(s.stopped_at) > QUIET_WAIT_WARNING]
    if not old:
        return
    teams = ", ".join(sorted({s.team for s in old}))
    text = (
        f"{len(old)} machines stopped during quiet hours more than {QUIET_WAIT_WARNING.days} days ago (teams: "
        f"{teams}) still wait for their team's quiet hours to end, or for a valid policy: their owners are not "
        f"told if that takes {QUIET_INDEX_TTL.days} days from the stop. {', '.join(s.key for s in old[:20])}"
    )
    alert_once(adapters, f"quiet-waiting#{scope}#{now:%Y-%m-%d}", text, settings, now)


def _awake(team: str, refs: Mapping[str, TeamPolicyRef], settings: Settings, now: datetime) -> bool:
    """Whether the team's quiet hours are over (a team in safe mode waits: its policy cannot say)."""
    policy = policy_for(team, refs, settings).at(now).policy
    return policy is not None and not policy.quiet_hours


def _send_quiet_summaries(
    adapters: Adapters,
    notifier: OwnerNotifier,
    ids: list[str],
    now: datetime,
    time_left: Callable[[], float] | None,
    settled: Callable[[Sequence[str]], None],
) -> list[str]:
    """One summary per owner of the stopped machines `ids`, each owner's `settled` (the keys not to try again)
    once done; returns the ids to try again next sweep."""
    store = adapters.store
    reports = quiet_hours_reports(store.load(ids).values())
    listed = {r.key for stopped in reports for r in stopped}
    settled([i for i in ids if i not in listed])  # started again meanwhile, or no record: nothing to tell
    retry: list[str] = []
    for stopped in reports:
        before = len(retry)
        _tell_owner(adapters, notifier, stopped, now, time_left, retry)
        again = set(retry[before:])
        settled([r.key for r in stopped if r.key not in again])
    return retry


def _tell_owner(
    adapters: Adapters,
    notifier: OwnerNotifier,
    stopped: list[MachineRecord],
    now: datetime,
    time_left: Callable[[], float] | None,
    retry: list[str],
) -> None:
    """One owner's summary of `stopped`; adds to `retry` the keys to try again next sweep."""
    store = adapters.store
    if time_left is not None and time_left() < FINISH_RESERVE:  # the next sweep tells them
        retry += [r.key for r in stopped]
        return
    oldest = min(r.quiet_stop_at or now for r in stopped)
    # One summary per owner per sweep: whichever invocation of the sweep claims the owner first tells its
    # stops; the others leave theirs to the next sweep.
    owner = stopped[0].owner_slack_id or owner_key(stopped[0].owner) or stopped[0].key
    owner_claim = f"quiet-summary-owner#{owner}@{now.isoformat()}"
    if not store.claim_once(owner_claim, now):
        retry += [r.key for r in stopped] if now - oldest < QUIET_REPORT_GIVE_UP else []
        return
    keys = {r.key: f"quiet-summary#{r.key}@{(r.quiet_stop_at or now).isoformat()}" for r in stopped}
    group = [r for r in stopped if store.claim_once(keys[r.key], now)]
    # A stop claimed elsewhere is being told by another sweep (or was): kept in the index until its record
    # says it was told, in case that post fails.
    claimed = {r.key for r in group}
    held = [r.key for r in stopped if r.key not in claimed]
    if held and now - oldest < QUIET_REPORT_GIVE_UP:
        retry += held
    if not group:
        return
    try:
        deliveries = notifier.quiet_summary(group)
    except PermanentDeliveryFailure as exc:
        logger.warning("quiet hours summary cannot be delivered", extra={"why": exc.reason})
        return
    except Exception as exc:
        logger.warning("quiet hours summary failed", extra={"error": str(exc)})
        deliveries = None
    if deliveries is None:
        store.release_claim(owner_claim)
        for r in group:
            store.release_claim(keys[r.key])
        if now - oldest < QUIET_REPORT_GIVE_UP:
            retry += [r.key for r in group]
        else:
            logger.warning("quiet hours summary given up", extra={"instance_ids": [r.instance_id for r in group]})
        return
    for r, delivery in zip(group, deliveries, strict=True):
        told = replace(
            r,
            version=r.version + 1,
            quiet_stop_at=None,
            warning_ref=delivery.ref or r.warning_ref,
            group_ref=delivery.group_ref,
            messages=delivery.messages or r.messages,
            owner_slack_id=delivery.owner_slack_id or r.owner_slack_id,
        )
        with contextlib.suppress(*AwsError):
            if not store.save(told):
                logger.warning("machine changed while its quiet hours summary was sent", extra={"id": r.instance_id})
