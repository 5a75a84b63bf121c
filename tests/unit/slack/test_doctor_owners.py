"""The doctor's "every Owner resolves to a Slack user" at fleet scale: owners the sweep has not cached are found
by pages of users.list (the sweep's own bulk path, slack/owners.py), not one users.lookupByEmail each, so 50,000
machines' owners take a handful of Tier 2 calls; what Slack could not answer is unknown, never resolved."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from slack_sdk.errors import SlackApiError
from slack_sdk.web import SlackResponse

from idle_reaper.core.signals import Machine
from idle_reaper.slack.doctor import SlackReader, gather_people
from idle_reaper.slack.owners import BULK_RESOLVE_FROM, USERS_LIST_PAGE

LAUNCHED = datetime(2026, 11, 20, 8, 0, tzinfo=UTC)
# Slack's documented tiers, calls a minute: users.list Tier 2, users.lookupByEmail Tier 3, users.info Tier 4.
TIER_PER_MINUTE = {"users.list": 20, "users.lookupByEmail": 50, "users.info": 100}


def error(code: str, status: int = 200) -> SlackApiError:
    data = {"ok": False, "error": code}
    response = SlackResponse(
        client=None, http_verb="POST", api_url="x", req_args={}, data=data, headers={}, status_code=status
    )
    return SlackApiError(code, response)


@dataclass
class Workspace:
    """users.list (cursors), users.lookupByEmail and users.info over the same users; every call counted."""

    users: dict[str, str]  # email -> id
    deleted: set[str] = field(default_factory=set)
    list_fails_after: int | None = None  # pages answered before users.list is rate limited past the budget
    calls: Counter[str] = field(default_factory=Counter)

    def users_list(self, limit: int, cursor: str | None = None) -> dict[str, Any]:
        self.calls["users.list"] += 1
        if self.list_fails_after is not None and self.calls["users.list"] > self.list_fails_after:
            raise error("ratelimited", 429)
        start = int(cursor or 0)
        everyone = sorted(self.users.items(), key=lambda item: item[1])
        page = [
            {"id": uid, "deleted": uid in self.deleted, "profile": {"email": email}}
            for email, uid in everyone[start : start + limit]
        ]
        more = start + limit < len(everyone)
        return {"members": page, "response_metadata": {"next_cursor": str(start + limit) if more else ""}}

    def users_lookupByEmail(self, email: str) -> dict[str, Any]:
        self.calls["users.lookupByEmail"] += 1
        if email.lower() not in self.users:
            raise error("users_not_found")
        return {"user": {"id": self.users[email.lower()]}}

    def users_info(self, user: str) -> dict[str, Any]:
        self.calls["users.info"] += 1
        if user not in self.users.values():
            raise error("user_not_found")
        return {"user": {"id": user, "deleted": user in self.deleted}}


def fleet(machines: int, owners: list[str]) -> list[Machine]:
    return [
        Machine(f"i-{i:017x}", "m5.large", f"team{i % 20}", LAUNCHED, owner=owners[i % len(owners)])
        for i in range(machines)
    ]


def minutes_of_tier_allowance(calls: Counter[str]) -> float:
    """How long Slack's documented tiers take to allow these calls, method by method (they are separate)."""
    return max((n / TIER_PER_MINUTE[method] for method, n in calls.items()), default=0.0)


def resolved(owned: list[Any] | None) -> dict[str, bool | None]:
    assert owned is not None
    return {m.owner: m.resolved for m in owned}


def test_50000_machines_uncached_owners_take_one_users_list_page_per_200_users() -> None:
    people = {f"user{i}@example.com": f"U{i:08d}" for i in range(2000)}
    workspace = Workspace(people)
    owners = [*people, "nobody@example.com", "U00000007"]
    written: dict[str, str] = {}

    owned, _ = gather_people(SlackReader(workspace), fleet(50_000, owners), {}, resolved_to=written.update)  # type: ignore[arg-type]

    answer = resolved(owned)
    assert answer["user1999@example.com"] is True and answer["U00000007"] is True
    assert answer["nobody@example.com"] is False, "the whole workspace was listed: nobody has that email"
    assert workspace.calls == {"users.list": math.ceil(2000 / USERS_LIST_PAGE)}, "no lookup per owner"
    assert minutes_of_tier_allowance(workspace.calls) < 1.0
    # One users.lookupByEmail per owner would take 40 minutes of Tier 3's allowance.
    assert len(people) / TIER_PER_MINUTE["users.lookupByEmail"] == 40
    assert written == people, "what was resolved goes to the sweep's owner cache"


def test_cached_owners_cost_nothing_and_few_uncached_are_looked_up_one_by_one() -> None:
    people = {f"user{i}@example.com": f"U{i:08d}" for i in range(100)}
    workspace = Workspace(people)
    owners = list(people)
    uncached = owners[: BULK_RESOLVE_FROM - 1]

    owned, _ = gather_people(
        SlackReader(workspace),  # type: ignore[arg-type]
        fleet(1000, owners),
        {},
        cached=lambda key: None if key.removeprefix("owner#") in uncached else "U-cached",
    )

    assert set(resolved(owned).values()) == {True}
    assert workspace.calls == {"users.lookupByEmail": BULK_RESOLVE_FROM - 1}


def test_a_listing_cut_short_leaves_the_rest_to_single_lookups_and_what_slack_refuses_is_unknown() -> None:
    people = {f"user{i}@example.com": f"U{i:08d}" for i in range(450)}
    workspace = Workspace(people, list_fails_after=1)
    owners = [*people, "nobody@example.com"]

    owned, _ = gather_people(SlackReader(workspace), fleet(900, owners), {})  # type: ignore[arg-type]

    answer = resolved(owned)
    assert all(answer[email] is True for email in people)
    assert answer["nobody@example.com"] is False
    assert workspace.calls["users.list"] == 2
    assert workspace.calls["users.lookupByEmail"] == len(owners) - USERS_LIST_PAGE


def test_past_the_deadline_nothing_is_asked_and_every_uncached_owner_is_unknown() -> None:
    people = {f"user{i}@example.com": f"U{i:08d}" for i in range(300)}
    workspace = Workspace(people)
    owners = [*people, "U00000001", "not an email"]

    owned, _ = gather_people(SlackReader(workspace, deadline=0.0), fleet(600, owners), {})  # type: ignore[arg-type]

    answer = resolved(owned)
    assert not workspace.calls
    assert answer["not an email"] is False, "no Slack user can be found for it: known without asking"
    assert {answer[o] for o in owners if o != "not an email"} == {None}, "could not check, never resolved"


def test_a_deleted_user_does_not_resolve() -> None:
    people = {f"user{i}@example.com": f"U{i:08d}" for i in range(30)}
    workspace = Workspace(people, deleted={"U00000003"})
    owned, _ = gather_people(SlackReader(workspace), fleet(60, [*people, "U00000004"]), {})  # type: ignore[arg-type]
    answer = resolved(owned)
    assert answer["user3@example.com"] is False and answer["user4@example.com"] is True
    assert answer["U00000004"] is True
    assert workspace.calls == {"users.list": 1}


class Down(Workspace):
    """Slack answers nothing (503 past the client's retries) to any of the owner calls."""

    def users_list(self, limit: int, cursor: str | None = None) -> dict[str, Any]:
        self.calls["users.list"] += 1
        raise error("service_unavailable", 503)

    def users_lookupByEmail(self, email: str) -> dict[str, Any]:
        self.calls["users.lookupByEmail"] += 1
        raise error("service_unavailable", 503)

    def users_info(self, user: str) -> dict[str, Any]:
        self.calls["users.info"] += 1
        raise error("service_unavailable", 503)


def test_slack_down_leaves_every_uncached_owner_unknown_and_writes_nothing() -> None:
    people = {f"user{i}@example.com": f"U{i:08d}" for i in range(40)}
    owners = [*people, "U00000001"]
    written: dict[str, str] = {}
    owned, _ = gather_people(
        SlackReader(Down(people)),  # type: ignore[arg-type]
        fleet(80, owners),
        {},
        cached=lambda key: "U00000000" if key == "owner#user0@example.com" else None,
        resolved_to=written.update,
    )
    answer = resolved(owned)
    assert answer["user0@example.com"] is True, "the sweep's cache still counts"
    assert {answer[o] for o in owners[1:]} == {None}, "could not check, never resolved nor refused"
    assert not written
