"""Stop notices, each a delivery of its own: a machine stopped (hibernated, terminated, released to its group) is
told to its owner where its warning went, and the notice stays pending until Slack took it.

When the sweep acts, the notice is drafted onto the machine's record (`notice`, written with the outcome) and its
key goes into the pending index, before anything is posted: a sweep that runs out of time, or a Slack that
refuses, loses nothing. A notice pass (`send_pending_notices`, once per sweep: the sweep itself, or the gather step
of a fanned-out one) reads the index back, coalesces the notices by message (a shared owner message is edited
once for all its machines), sends them paced under Slack's Tier 3 for chat.update, and clears each notice Slack
took. The rest wait for the next sweep; a notice whose message is gone is told in a message of its own; one that
cannot be told anywhere, or is still pending after NOTICE_GIVE_UP, is given up and the admins are told.

The index is NOTICE_BUCKETS lookup items of at most BUCKET_KEYS machine keys each (a stopped machine is no longer
listed, so its record is not read unless something names it): it never grows with the fleet inside one item, and
a key that does not fit is reported, never dropped in silence."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from idle_reaper.aws.clients import DDB_WORKERS, AwsError, error_code, run_concurrently
from idle_reaper.aws.state import StateStore
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MachineRecord
from idle_reaper.notify import logger
from idle_reaper.policy import Settings
from idle_reaper.slack.notices import NOTICE_EDITS_PER_MINUTE, EditPace, StopNotice, Told
from idle_reaper.sweep.adapters import Adapters, alert_once

NOTICE_BUCKETS = 16
BUCKET_KEYS = 2000  # about 100 KB of keys a bucket: far inside DynamoDB's 400 KB item
NOTICE_INDEX_TTL = timedelta(days=7)
NOTICE_GIVE_UP = timedelta(hours=24)
NOTICE_RESERVE_SECONDS = 10.0  # kept for recording what was sent
PASS_LEASE = timedelta(minutes=15)  # one notice pass at a time: two would tell a notice twice
INDEX_ATTEMPTS = 8


@runtime_checkable
class StopNoticeSender(Protocol):
    """A notifier that drafts stop notices and sends them later, coalesced and paced (slack.SlackNotifier)."""

    def stop_notice(self, decision: Decision) -> StopNotice | None: ...

    def send_notices(self, records: Sequence[MachineRecord], pace: EditPace) -> dict[str, Told]: ...


def _bucket_name(n: int) -> str:
    return f"notices#{n}"


def _bucket(key: str) -> str:
    return _bucket_name(zlib.crc32(key.encode()) % NOTICE_BUCKETS)


def _keys(raw: str | None) -> list[str]:
    try:
        value = json.loads(raw) if raw else []
    except ValueError:
        return []
    return [k for k in value if isinstance(k, str)] if isinstance(value, list) else []


def _change(store: StateStore, bucket: str, now: datetime, change: Callable[[list[str]], list[str]]) -> bool:
    """Read-modify-write of one bucket, conditional on what was read (shards and sweeps write it at once)."""
    for _ in range(INDEX_ATTEMPTS):
        raw = store.get_lookup(bucket, now)
        if store.replace_lookup(bucket, json.dumps(change(_keys(raw))), now + NOTICE_INDEX_TTL, expected=raw, now=now):
            return True
    return False


def queue_notices(store: StateStore, keys: Iterable[str], now: datetime) -> list[str]:
    """Put `keys` (machines whose notice is drafted on their record) into the pending index. The keys that did not
    fit (a full bucket) or could not be written: the caller reports them."""
    by_bucket: dict[str, list[str]] = {}
    for key in keys:
        by_bucket.setdefault(_bucket(key), []).append(key)
    left_out: list[str] = []

    def add(bucket: str) -> list[str]:
        wanted = by_bucket[bucket]
        refused: list[str] = []

        def with_them(keys: list[str]) -> list[str]:
            refused.clear()
            room = BUCKET_KEYS - len(keys)
            new = [k for k in wanted if k not in keys]
            refused.extend(new[max(0, room) :])
            return keys + new[: max(0, room)]

        try:
            if not _change(store, bucket, now, with_them):
                return list(wanted)
        except AwsError as exc:
            logger.warning("stop notices not queued", extra={"bucket": bucket, "error": error_code(exc)})
            return list(wanted)
        return list(refused)

    for missed in run_concurrently(add, list(by_bucket), DDB_WORKERS):
        left_out += missed
    return left_out


def pending_notices(store: StateStore, now: datetime) -> list[str]:
    def read(n: int) -> list[str]:
        return _keys(store.get_lookup(_bucket_name(n), now))

    return [k for keys in run_concurrently(read, list(range(NOTICE_BUCKETS)), DDB_WORKERS) for k in keys]


def _unqueue(store: StateStore, keys: Sequence[str], now: datetime) -> None:
    by_bucket: dict[str, set[str]] = {}
    for key in keys:
        by_bucket.setdefault(_bucket(key), set()).add(key)

    def remove(bucket: str) -> None:
        try:
            _change(store, bucket, now, lambda keys: [k for k in keys if k not in by_bucket[bucket]])
        except AwsError as exc:  # sent, and still listed: the next pass finds no notice on their records
            logger.warning("stop notices not taken off the index", extra={"bucket": bucket, "error": error_code(exc)})

    run_concurrently(remove, list(by_bucket), DDB_WORKERS)


@dataclass(frozen=True)
class NoticePass:
    sent: int = 0  # notices Slack took (the only ones counted as told)
    pending: int = 0  # left for the next sweep
    given_up: int = 0
    edits: int = 0


def send_pending_notices(
    adapters: Adapters,
    settings: Settings,
    now: datetime,
    time_left: Callable[[], float] | None = None,
    *,
    edits_per_minute: float = NOTICE_EDITS_PER_MINUTE,
) -> NoticePass:
    """Send the pending stop notices within Slack's limits and the time left; what Slack took is cleared from each
    record and from the index. Never raises: a failure leaves the notices pending."""
    notifier, store = adapters.notifier, adapters.store
    if not isinstance(notifier, StopNoticeSender):
        return NoticePass()
    token = secrets.token_hex(8)
    try:
        keys = pending_notices(store, now)
        if not keys:
            return NoticePass()
        if not store.replace_lookup("notices-pass", token, now + PASS_LEASE, expected=None, now=now):
            return NoticePass(pending=len(keys))  # another sweep is telling them
        records = [r for r in store.load(keys).values() if r.notice]
    except AwsError as exc:
        logger.warning("stop notices not read", extra={"error": error_code(exc)})
        return NoticePass()
    try:
        return _send(adapters, settings, now, time_left, keys, records, edits_per_minute)
    finally:
        with contextlib.suppress(*AwsError):  # else it lapses after PASS_LEASE
            store.replace_lookup("notices-pass", "", now - timedelta(seconds=1), expected=token, now=now)


def _send(
    adapters: Adapters,
    settings: Settings,
    now: datetime,
    time_left: Callable[[], float] | None,
    keys: Sequence[str],
    records: Sequence[MachineRecord],
    edits_per_minute: float,
) -> NoticePass:
    notifier, store = adapters.notifier, adapters.store
    assert isinstance(notifier, StopNoticeSender)
    seconds = (time_left() if time_left is not None else 120.0) - NOTICE_RESERVE_SECONDS
    pace = EditPace(edits_per_minute, time.monotonic() + max(0.0, seconds))
    # The oldest notices first: a sweep short of time tells the ones waiting longest.
    ordered = sorted(records, key=lambda r: r.last_action_at or now)
    try:
        told = notifier.send_notices(ordered, pace) if ordered else {}
    except Exception as exc:  # a notifier must never break the sweep: every notice stays pending
        logger.warning("stop notices not sent", extra={"error": str(exc)})
        told = {}
    outcomes = {key: status for key, (status, _) in told.items()}
    stale = {r.key for r in ordered if r.last_action_at and now - r.last_action_at > NOTICE_GIVE_UP}
    given_up = [
        r for r in ordered if outcomes.get(r.key) == "gone" or (r.key in stale and outcomes.get(r.key) != "sent")
    ]
    done = [r for r in ordered if outcomes.get(r.key) == "sent"] + given_up

    def clear(r: MachineRecord) -> bool:
        """The notice off the record; a message of its own it went out in is where later answers edit."""
        posted = told.get(r.key, ("retry", ()))[1]
        try:
            return store.save(replace(r, notice=None, messages=posted or r.messages, version=r.version + 1))
        except AwsError:
            return False

    cleared = {r.key for r, ok in zip(done, run_concurrently(clear, done, DDB_WORKERS), strict=True) if ok}
    # Keys listed whose record has no notice (told by an earlier pass, or gone) are taken off too.
    orphans = set(keys) - {r.key for r in records}
    _unqueue(store, sorted(cleared | orphans), now)
    for r in given_up:
        text = (
            f"the stop of {r.name or r.instance_id} ({r.instance_id}, team {r.team}, owner {r.owner or 'none'}) at "
            f"{r.last_action_at or now:%Y-%m-%d %H:%M} UTC could not be told to its owner (its message is gone or "
            "Slack refused it for a day); `idle-reaper status` shows it."
        )
        alert_once(adapters, f"notice-given-up#{r.key}@{(r.last_action_at or now).isoformat()}", text, settings, now)
    sent = sum(1 for r in ordered if outcomes.get(r.key) == "sent" and r.key in cleared)
    logger.info(
        "stop notices",
        extra={"sent": sent, "pending": len(ordered) - len(done), "given_up": len(given_up)},
    )
    return NoticePass(sent=sent, pending=len(ordered) - len(done), given_up=len(given_up))


def send_sweep_notices(adapters: Adapters, now: datetime, time_left: Callable[[], float] | None) -> NoticePass:
    """The sweep's one notice pass where it has no settings at hand (the gather step, the in-place member units)."""
    try:
        settings, _ = adapters.policies.load_settings()
    except Exception as exc:  # they wait for the next sweep
        logger.warning("stop notices wait: the settings could not be read", extra={"error": str(exc)})
        return NoticePass()
    return send_pending_notices(adapters, settings, now, time_left)
