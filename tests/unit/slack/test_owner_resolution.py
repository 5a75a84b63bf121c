"""Resolving many owners at once: users.list pages instead of one users.lookupByEmail per owner (Tier 3,
about 50 a minute), cached like single lookups; a failed listing leaves the rest to single lookups."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from slack_sdk.errors import SlackApiError
from slack_sdk.web import SlackResponse

from idle_reaper.aws import InMemoryStateStore
from idle_reaper.slack import SlackNotifier
from idle_reaper.slack.owners import BULK_RESOLVE_FROM

NOW = datetime(2026, 11, 20, 14, 0, tzinfo=UTC)


def error(code: str) -> SlackApiError:
    response = SlackResponse(
        client=None,
        http_verb="POST",
        api_url="x",
        req_args={},
        data={"ok": False, "error": code},
        headers={},
        status_code=200,
    )
    return SlackApiError(code, response)


@dataclass
class Directory:
    """users.list (200 a page, cursors) and users.lookupByEmail over the same users; calls recorded."""

    users: dict[str, str]  # email -> id
    fail_list_after: int | None = None  # pages answered before users.list fails
    calls: list[str] = field(default_factory=list)

    def users_list(self, limit: int, cursor: str | None = None) -> dict[str, Any]:
        self.calls.append("users.list")
        pages = self.calls.count("users.list")
        if self.fail_list_after is not None and pages > self.fail_list_after:
            raise error("ratelimited")
        start = int(cursor or 0)
        everyone = sorted(self.users.items())
        members = [{"id": uid, "profile": {"email": email.upper()}} for email, uid in everyone[start : start + limit]]
        members.append({"id": "UBOT", "is_bot": True, "profile": {"email": "bot@example.com"}})
        more = start + limit < len(everyone)
        return {"members": members, "response_metadata": {"next_cursor": str(start + limit) if more else ""}}

    def users_lookupByEmail(self, email: str) -> dict[str, Any]:
        self.calls.append("users.lookupByEmail")
        if email.lower() not in self.users:
            raise error("users_not_found")
        return {"user": {"id": self.users[email.lower()]}}


def owners(n: int) -> dict[str, str]:
    return {f"user{i}@example.com": f"U{i:05d}" for i in range(n)}


def test_many_uncached_owners_are_found_by_listing_users_and_cached():
    directory = Directory(owners(450))
    store = InMemoryStateStore()
    slack = SlackNotifier(directory, store, clock=lambda: NOW)  # type: ignore[arg-type]
    tags = [
        *(f"user{i}@example.com" for i in range(400)),
        " USER7@example.com ",
        "U0DIRECT",
        "nobody@example.com",
        None,
    ]

    resolved = slack.resolve_owners(tags)

    assert resolved["user0@example.com"] == "U00000" and resolved["user399@example.com"] == "U00399"
    assert resolved[" USER7@example.com "] == "U00007", "the same person, spelled another way"
    assert resolved["U0DIRECT"] == "U0DIRECT" and resolved[""] is None
    assert resolved["nobody@example.com"] is None, "the whole directory was listed: nobody by that email"
    assert directory.calls == ["users.list"] * 3, "450 users: three pages, no lookup per owner"
    # Cached as single lookups are: a later sweep asks Slack nothing.
    directory.calls.clear()
    assert slack.resolve_owner("user123@example.com") == "U00123" and directory.calls == []


def test_a_listing_that_fails_part_way_leaves_the_rest_to_single_lookups():
    directory = Directory(owners(450), fail_list_after=1)
    slack = SlackNotifier(directory, InMemoryStateStore(), clock=lambda: NOW)  # type: ignore[arg-type]
    tags = [f"user{i}@example.com" for i in range(0, 450, 10)] + ["nobody@example.com"]

    resolved = slack.resolve_owners(tags)

    assert all(resolved[f"user{i}@example.com"] == f"U{i:05d}" for i in range(0, 450, 10))
    assert resolved["nobody@example.com"] is None
    first_page = set(sorted(directory.users)[:200])
    listed_first_page = sum(1 for t in tags if t in first_page)
    assert directory.calls.count("users.list") == 2
    assert directory.calls.count("users.lookupByEmail") == len(tags) - listed_first_page


def test_few_owners_are_looked_up_one_by_one():
    directory = Directory(owners(450))
    slack = SlackNotifier(directory, InMemoryStateStore(), clock=lambda: NOW)  # type: ignore[arg-type]
    tags = [f"user{i}@example.com" for i in range(BULK_RESOLVE_FROM - 1)]
    assert slack.resolve_owners(tags) == {t: f"U{i:05d}" for i, t in enumerate(tags)}
    assert directory.calls == ["users.lookupByEmail"] * len(tags)
