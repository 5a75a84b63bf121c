"""Who an owner is in Slack: the Owner tag holds a Slack user id or an email, resolved once and cached."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from idle_reaper.aws.state import StateStore

OWNER_CACHE_TTL = timedelta(days=7)
BULK_RESOLVE_FROM = 20  # uncached owner emails from which users.list pages beat users.lookupByEmail calls
USERS_LIST_PAGE = 200  # users a users.list page (Slack recommends no more than 200)
USERS_LIST_MAX_PAGES = 250  # 50,000 users at 200 a page
SLACK_USER_ID = re.compile(r"^[UW][A-Z0-9]{2,31}$")
EMAIL = re.compile(r"^[^@\s]{1,64}@[^@\s]+\.[^@\s]+$")
MAX_EMAIL_CHARS = 254  # RFC 5321's longest address; a longer Owner tag is no email


class OwnerDirectory:
    """Who an owner is: the Owner tag holds a Slack user id or an email (resolved once, cached in the table)."""

    client: WebClient
    store: StateStore
    clock: Any

    def _failed(self, what: str, subject: str, exc: Exception, target: str) -> object:
        raise NotImplementedError  # SlackDelivery's: logs and classifies the failure

    def resolve_owner(self, owner: str | None) -> str | None:
        owner = (owner or "").strip()  # a tag's stray space must not make the same person someone else
        if not owner:
            return None
        if SLACK_USER_ID.match(owner):
            return owner
        if len(owner) > MAX_EMAIL_CHARS or not EMAIL.match(owner):
            return None
        now = self.clock()
        cached = self.store.get_lookup(f"owner#{owner.lower()}", now)
        if cached:
            return cached
        try:
            user_id = str(self.client.users_lookupByEmail(email=owner)["user"]["id"])
        except SlackApiError as exc:
            if exc.response.get("error") == "users_not_found":
                return None
            raise
        self.store.put_lookup(f"owner#{owner.lower()}", user_id, now + OWNER_CACHE_TTL)
        return user_id

    def resolve_owners(self, owners: Sequence[str | None]) -> dict[str, str | None]:
        """`resolve_owner` for many tags at once (keyed by the tag as given). Emails not yet cached are looked
        up one by one (users.lookupByEmail, Tier 3: about 50 a minute) when few, else found by listing the
        workspace's users (users.list, 200 a page, Tier 2: 20 pages a minute), so a first look at a large
        fleet resolves its owners in seconds, not many minutes. A listing that fails part-way leaves the rest
        to the one-by-one lookup; an email the whole listing does not hold names no Slack user."""
        result: dict[str, str | None] = {}
        unresolved: dict[str, list[str]] = {}  # email (lower case) -> the tags that spell it
        now = self.clock()
        for tag in dict.fromkeys(owners):
            owner = (tag or "").strip()
            if not owner or SLACK_USER_ID.match(owner) or len(owner) > MAX_EMAIL_CHARS or not EMAIL.match(owner):
                result[tag or ""] = self.resolve_owner(owner)
                continue
            cached = self.store.get_lookup(f"owner#{owner.lower()}", now)
            if cached:
                result[tag or ""] = cached
            else:
                unresolved.setdefault(owner.lower(), []).append(tag or "")
        if len(unresolved) >= BULK_RESOLVE_FROM:
            found, complete = self._listed_users(set(unresolved))
            for email, user_id in found.items():
                self.store.put_lookup(f"owner#{email}", user_id, now + OWNER_CACHE_TTL)
                for tag in unresolved.pop(email):
                    result[tag] = user_id
            if complete:  # every user listed: the rest are nobody Slack knows
                for tags in unresolved.values():
                    result.update(dict.fromkeys(tags))
                unresolved = {}
        for tags in unresolved.values():
            for tag in tags:
                result[tag] = self.resolve_owner(tag)
        return result

    def _listed_users(self, emails: set[str]) -> tuple[dict[str, str], bool]:
        """The users.list pages until every email is found: (email -> user id, whether the listing ended)."""
        listing = UsersListing()
        try:
            listing.read(self.client, emails)
        except (SlackApiError, SlackClientError, OSError) as exc:
            self._failed("owner lookup", f"{len(emails)} owners", exc, "users.list")
        return listing.emails, listing.complete


class UsersListing:
    """What pages of users.list (USERS_LIST_PAGE a page, Tier 2) say about some emails and user ids: the
    active users found by email, the ids found, and whether the whole workspace was listed (then an email or id
    not found names nobody). A Slack error propagates; what was read before it stays."""

    def __init__(self) -> None:
        self.emails: dict[str, str] = {}  # email (lower case) -> user id
        self.ids: set[str] = set()  # of the ids asked for, those listed as active users
        self.complete = False
        self.pages = 0

    def read(
        self,
        client: WebClient,
        emails: set[str],
        ids: frozenset[str] = frozenset(),
        may_ask: Callable[[], bool] = lambda: True,
    ) -> None:
        """Pages until every email and id is found, the listing ends, or `may_ask` says no more."""
        cursor: str | None = None
        for _ in range(USERS_LIST_MAX_PAGES):
            if not may_ask():
                return
            page = client.users_list(limit=USERS_LIST_PAGE, cursor=cursor)
            self.pages += 1
            for user in page.get("members") or []:
                if user.get("deleted") or user.get("is_bot"):
                    continue
                email = str((user.get("profile") or {}).get("email") or "").lower()
                if email in emails:
                    self.emails[email] = str(user["id"])
                if user.get("id") in ids:
                    self.ids.add(str(user["id"]))
            cursor = (page.get("response_metadata") or {}).get("next_cursor")
            if not cursor:
                self.complete = True
                return
            if len(self.emails) == len(emails) and len(self.ids) == len(ids):
                return
