"""One message per owner: which of a sweep's warnings share a message, and (organization mode) how the units of
one sweep (each member account and region, the hub's own shards) share an owner's message across them."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from idle_reaper.aws.clients import AwsError, run_concurrently
from idle_reaper.aws.state import StateStore
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.reports import owner_message_groups, owner_message_key
from idle_reaper.notify import (
    Delivery,
    DeliveryFinder,
    DeliveryUnknown,
    OwnerNotifier,
    OwnerResolver,
    PermanentDeliveryFailure,
    PostOutcome,
    SharedOwnerNotifier,
    logger,
)
from idle_reaper.slack.shared import REF_TTL
from idle_reaper.sweep.adapters import Adapters

# Conversations posted to at once. Slack allows about one message a second in a conversation and several
# hundred a minute across a workspace (chat.postMessage): 8 conversations at ~0.25 s a post would ask far more
# than the workspace allows, so the notifier paces every post under both (slack.posting: POSTS_PER_MINUTE across
# the workspace, shared between the shards posting at once), and a 429 is answered by waiting its Retry-After
# (slack.client.make_client).
SLACK_WORKERS = 8


# A unit finding an owner's message being posted by another unit waits this long (polling) for it to be posted,
# then posts its own: a post takes well under a second unless Slack makes it wait. Two messages can happen; none
# cannot.
POSTING_WAIT_SECONDS = 5.0
POSTING_POLL_SECONDS = 0.1
LEAD_ATTEMPTS = 3  # takes of the lead after another unit's post failed, before posting alone


def post_owner_messages(
    adapters: Adapters,
    warnings: list[Decision],
    out_of_time: Callable[[], bool],
    scope: str | None = None,
) -> dict[str, PostOutcome]:
    """One message per owner: the warnings of this sweep whose owners are one person (each machine's own
    Owner tag, resolved to a Slack user) and go to the same places share a message
    (core.owner_message_groups), posted before each machine's outcome is recorded by _post as for a warning
    of its own. A lone warning, a machine whose owner does not resolve, or a notifier that cannot group,
    posts alone. Each message honours the sweep's time budget: one not posted leaves its machines pending.
    A message that fails leaves each machine it lists undelivered (pending, or its permanent fault).

    `scope` (organization mode: the id every unit and shard of one sweep shares): an owner's warnings, a lone
    one included, share the message of every unit of the sweep that warns the same person in the same places
    (post_across)."""
    notifier = adapters.notifier
    if not isinstance(notifier, OwnerNotifier):
        return {}
    across = scope is not None and isinstance(notifier, SharedOwnerNotifier)
    owners: dict[str, str | None] | None = None
    if (len(warnings) > 1 or across) and isinstance(notifier, DeliveryFinder):  # one warning shares no message
        owners = _resolve_owners(notifier, warnings)
    if across and owners is None:
        across = False  # nobody can tell who the owners are: each unit's own messages, as in one account
    groups = owner_message_groups(warnings, owners)
    if across:
        groups = [g for g in groups if owner_message_key(g[0], owners) is not None]
    else:
        groups = [g for g in groups if len(g) > 1]

    def post(group: list[Decision]) -> dict[str, PostOutcome]:
        if out_of_time():
            return {}  # stays pending: posted alone if time allows, else by the next sweep
        ids = [d.machine.instance_id for d in group]
        owner_id = owners.get(ids[0]) if owners else None
        try:
            if across and isinstance(notifier, SharedOwnerNotifier) and scope is not None:
                item = owner_item_key(scope, owner_message_key(group[0], owners))
                outcomes = post_across(adapters.store, notifier, item, group, owner_id, out_of_time)
                if outcomes is None:
                    return {}  # a lone warning posted alone, by _post
            else:
                outcomes = notifier.warn_owner(group, owner_id)
        except Exception as exc:  # a notifier must never break the sweep; the warnings stay pending
            logger.warning("owner message failed", extra={"instance_ids": ids, "error": str(exc)})
            outcomes = [None] * len(group)
        return dict(zip(ids, outcomes, strict=True))

    # Each group is one owner's DM (or its channels): the groups are posted concurrently.
    posts: dict[str, PostOutcome] = {}
    for done in run_concurrently(post, groups, SLACK_WORKERS):
        posts.update(done)
    return posts


def _resolve_owners(notifier: DeliveryFinder, warnings: list[Decision]) -> dict[str, str | None]:
    """Each warned machine's owner as a Slack user (None: does not resolve), by instance id."""
    tags = sorted({(d.machine.owner or "").strip() for d in warnings})
    resolved: dict[str, str | None] = {}
    if isinstance(notifier, OwnerResolver):
        try:
            resolved = notifier.resolve_owners(tags)
        except Exception as exc:  # resolved one by one below
            logger.warning("owners could not be resolved at once", extra={"error": str(exc)})

    def resolve(owner: str) -> str | None:
        try:
            return notifier.resolve_owner(owner)
        except Exception:  # Slack or the table down: this owner's machines are warned alone (pending if that fails)
            return None

    rest = [tag for tag in tags if tag not in resolved]
    resolved.update(zip(rest, run_concurrently(resolve, rest, SLACK_WORKERS), strict=True))
    return {d.machine.instance_id: resolved[(d.machine.owner or "").strip()] for d in warnings}


# ---------------------------------------------------------------------------------------------
# Across the units of one sweep (organization mode)


def owner_item_key(scope: str, key: tuple[str, str, str | None] | None) -> str:
    """The state table lookup that one sweep's units share for one owner's message to some targets
    (core.owner_message_key: the owner's Slack id, notify, the team channel)."""
    assert key is not None
    owner, notify, channel = key
    targets = hashlib.sha256(f"{notify}|{channel or ''}".encode()).hexdigest()[:16]
    return f"ownermsg#{scope}#{owner}#{targets}"


@dataclass(frozen=True)
class OwnerItem:
    """What the shared item says: "posting" (a unit is posting the message), "posted" (its "Keep all" reference
    and copies), or "failed" (that post failed: another unit may take the lead)."""

    state: str
    group_ref: str = ""
    messages: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: str | None) -> OwnerItem | None:
        """None: absent or unreadable (then a unit posts alone)."""
        try:
            data: Any = json.loads(raw) if raw else None
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("state") not in ("posting", "posted", "failed"):
            return None
        if data["state"] != "posted":
            return cls(data["state"])
        group_ref, messages = data.get("group_ref"), data.get("messages")
        if not (isinstance(group_ref, str) and group_ref and isinstance(messages, list) and messages):
            return None
        if not all(isinstance(m, str) and "|" in m for m in messages):
            return None
        return cls("posted", group_ref, tuple(messages))


def post_across(
    store: StateStore,
    notifier: SharedOwnerNotifier,
    key: str,
    group: list[Decision],
    owner_id: str | None,
    out_of_time: Callable[[], bool],
) -> list[PostOutcome] | None:
    """One owner's warnings of this unit (one owner, the same targets), in the message this sweep's units
    share. The first unit to get here creates the item `key` (a conditional write) and posts (a message of one
    machine as a warning of its own, until others join it), then records the message there. A unit finding it
    posted joins that message (join_owner_message); finding it being posted, it waits up to
    POSTING_WAIT_SECONDS; finding its post failed, it takes the lead. Whatever cannot be shared (the item
    unreadable, the wait over, the message full or gone) is posted alone, as in one account: two messages may
    happen, a warning lost may not. None: a lone warning to be posted alone (by the caller, as `warn`)."""
    now = group[0].record.updated_at or datetime.now(UTC)
    mine = json.dumps({"state": "posting", "by": secrets.token_hex(8)})

    def alone() -> list[PostOutcome] | None:
        return notifier.warn_owner(group, owner_id) if len(group) > 1 else None

    def lead() -> list[PostOutcome]:
        try:
            outcomes = notifier.warn_owner(group, owner_id, lone_layout=True)
        except Exception as exc:
            logger.warning("owner message failed", extra={"error": str(exc)})
            outcomes = [None] * len(group)
        # A message split in parts: the last has room for others.
        posted = next((o for o in reversed(outcomes) if isinstance(o, Delivery) and o.group_ref and o.messages), None)
        state: dict[str, Any] = {"state": "failed"}
        if posted is not None:
            state = {"state": "posted", "group_ref": posted.group_ref, "messages": list(posted.messages)}
        try:
            if not store.replace_lookup(key, json.dumps(state), now + REF_TTL, expected=mine, now=now):
                logger.info("another unit took over this owner's message; ours stands alone", extra={"item": key})
        except AwsError as exc:  # the others wait, then post alone
            logger.warning("owner message not shared", extra={"item": key, "error": str(exc)})
        return outcomes

    try:
        if store.replace_lookup(key, mine, now + REF_TTL, expected=None, now=now):
            return lead()
        deadline = time.monotonic() + POSTING_WAIT_SECONDS
        for _ in range(LEAD_ATTEMPTS):
            raw = store.get_lookup(key, now)
            item = OwnerItem.parse(raw)
            while item is not None and item.state == "posting":
                if out_of_time() or time.monotonic() >= deadline:
                    return alone()  # the unit posting it is slow or gone
                time.sleep(POSTING_POLL_SECONDS)
                raw = store.get_lookup(key, now)
                item = OwnerItem.parse(raw)
            if item is None:
                return alone()
            if item.state == "posted":
                joined = notifier.join_owner_message(group, owner_id, item.group_ref, item.messages)
                if joined is not None:
                    return joined
            # Its post failed, or its message is full or gone: ours is the one the units after us join.
            if store.replace_lookup(key, mine, now + REF_TTL, expected=raw, now=now):
                return lead()
    except AwsError as exc:
        logger.warning("owner message not shared: the state table failed", extra={"item": key, "error": str(exc)})
    return alone()


def owner_post(outcome: PostOutcome) -> Delivery | None:
    if isinstance(outcome, PermanentDeliveryFailure | DeliveryUnknown):
        raise outcome
    return outcome
