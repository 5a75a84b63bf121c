"""The doctor's Slack facts (core/doctor.py decides on them): read-only Web API calls, each answer a fact or
None when Slack could not be asked. A reader with a deadline asks nothing past it: what it did not reach is
"could not check", so a sweep's daily check or a Slack command stays within its time."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from idle_reaper.core.doctor import (
    MANIFEST_BOT_SCOPES,
    UNREACHABLE,
    ChannelState,
    OwnedMachine,
    SlackFacts,
    TeamContacts,
)
from idle_reaper.core.signals import Machine
from idle_reaper.policy import Settings, TeamPolicyRef
from idle_reaper.slack.notifier import SlackNotConfigured, load_secrets, make_client
from idle_reaper.slack.owners import BULK_RESOLVE_FROM, EMAIL, MAX_EMAIL_CHARS, SLACK_USER_ID, UsersListing

SLACK_DOWN = (SlackClientError, OSError)


def slack_error(exc: Exception) -> str | None:
    """A Slack error code when Slack answered; None when it did not (down, rate limited past the budget)."""
    if isinstance(exc, SlackApiError) and exc.response.status_code == 200:
        return str(exc.response.get("error") or "error")
    return None


class SlackReader:
    """Read-only Slack calls; each answer is a fact, or None when Slack could not be asked. `deadline`
    (time.monotonic()): past it nothing more is asked, and the answer is None."""

    def __init__(self, client: WebClient, deadline: float | None = None) -> None:
        self.client = client
        self.deadline = deadline
        self.calls = 0

    @property
    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _may_ask(self) -> bool:
        if self.out_of_time:
            return False
        self.calls += 1
        return True

    def auth(self) -> tuple[str | None, frozenset[str] | None]:
        if not self._may_ask():
            return f"{UNREACHABLE}: out of time", None
        try:
            response = self.client.auth_test()
        except SlackApiError as exc:
            code = slack_error(exc)
            return (code if code else f"{UNREACHABLE}: HTTP {exc.response.status_code}"), None
        except SLACK_DOWN as exc:
            return f"{UNREACHABLE}: {type(exc).__name__}", None
        header = {k.lower(): v for k, v in response.headers.items()}.get("x-oauth-scopes")
        scopes = header[0] if isinstance(header, list) else header
        return None, (frozenset(s.strip() for s in str(scopes).split(",") if s.strip()) if scopes else None)

    def channel(self, channel: str) -> ChannelState | None:
        if not self._may_ask():
            return None
        try:
            info = self.client.conversations_info(channel=channel)
        except SlackApiError as exc:
            return "not_found" if slack_error(exc) == "channel_not_found" else None
        except SLACK_DOWN:
            return None
        found = info.get("channel") or {}
        if found.get("is_member"):
            return "member"
        return "not_member" if found.get("is_private") else "joins"  # a public channel: joined when first posted to

    def user_exists(self, user: str) -> bool | None:
        if not self._may_ask():
            return None
        try:
            info = self.client.users_info(user=user)
        except SlackApiError as exc:
            return False if slack_error(exc) in ("user_not_found", "users_not_found") else None
        except SLACK_DOWN:
            return None
        return not (info.get("user") or {}).get("deleted")

    def email_user(self, email: str) -> str | Literal[False] | None:
        """The user id an email belongs to, False when it is nobody's, None when Slack could not be asked."""
        if not self._may_ask():
            return None
        try:
            response = self.client.users_lookupByEmail(email=email)
        except SlackApiError as exc:
            return False if slack_error(exc) == "users_not_found" else None
        except SLACK_DOWN:
            return None
        return str((response.get("user") or {}).get("id") or "") or False

    def users_listing(self, emails: set[str], ids: frozenset[str]) -> UsersListing:
        """users.list pages (the sweep's bulk owner lookup) until every email and id is found, the listing ends,
        or the deadline; a Slack fault ends it early (what was listed before stays)."""
        listing = UsersListing()
        with contextlib.suppress(*SLACK_DOWN):
            listing.read(self.client, emails, ids, self._may_ask)
        return listing


def slack_reader(budget_seconds: float, deadline: float | None = None) -> tuple[SlackReader | None, bool]:
    """A reader with the configured bot token (None when Slack is not configured), and whether the signing
    secret is present."""
    try:
        secrets = load_secrets()
    except SlackNotConfigured:
        return None, False
    return SlackReader(make_client(secrets.bot_token, budget_seconds), deadline), bool(secrets.signing_secret)


def _who_to_check(settings: Settings, refs: Mapping[str, TeamPolicyRef]) -> tuple[dict[str, list[str]], ...]:
    """Every channel (with the teams it serves) and every admin or member id (with their roles)."""
    channel_teams: dict[str, list[str]] = {}
    user_roles: dict[str, list[str]] = {}
    if settings.admin_channel:
        channel_teams.setdefault(settings.admin_channel, []).append("admin channel")
    for user in settings.admins:
        user_roles.setdefault(user, []).append("admin")
    for team, ref in sorted(refs.items()):
        if ref.policy is None:
            continue
        if ref.policy.slack_channel:
            channel_teams.setdefault(ref.policy.slack_channel, []).append(f"team {team}")
        for member in ref.policy.members:
            if member[0] in "UW":
                user_roles.setdefault(member, []).append(f"team {team} member")
    return channel_teams, user_roles


def gather_slack(
    reader: SlackReader | None,
    signing_secret: bool,
    settings: Settings,
    refs: Mapping[str, TeamPolicyRef],
    *,
    users: bool = True,
) -> SlackFacts:
    """The token, its scopes, the bot's channels and (`users`) whether every admin and member exists."""
    if reader is None:
        return SlackFacts("not configured", None, MANIFEST_BOT_SCOPES, signing_secret)
    auth_error, scopes = reader.auth()
    if auth_error is not None:
        return SlackFacts(auth_error, scopes, MANIFEST_BOT_SCOPES, signing_secret)
    channel_teams, user_roles = _who_to_check(settings, refs)
    if not users:
        user_roles = {}
    return SlackFacts(
        None,
        scopes,
        MANIFEST_BOT_SCOPES,
        signing_secret,
        channels={c: reader.channel(c) for c in channel_teams},
        channel_teams=channel_teams,
        users={u: reader.user_exists(u) for u in user_roles},
        user_roles=user_roles,
    )


def gather_people(
    reader: SlackReader | None,
    machines: Sequence[Machine] | None,
    refs: Mapping[str, TeamPolicyRef],
    cached: Callable[[str], str | None] = lambda key: None,
    resolved_to: Callable[[Mapping[str, str]], None] | None = None,
) -> tuple[list[OwnedMachine] | None, list[TeamContacts]]:
    """Each distinct Owner asked once, as the sweep resolves owners (slack/owners.py): an email the sweep
    already resolved (its 7-day cache in the state table) costs no Slack call; from BULK_RESOLVE_FROM uncached
    owners on, pages of users.list (200 users a call) find them all, and only what a listing cut short did not
    reach is asked one by one (users.lookupByEmail, users.info). Past the reader's deadline nothing more is
    asked: could not check. `resolved_to` receives the emails resolved (lower case -> user id), for the
    sweep's cache; the command line passes none (it writes nothing)."""
    teams = [
        TeamContacts(team, ref.policy.slack_channel, len(ref.policy.members))
        for team, ref in refs.items()
        if ref.policy is not None
    ]
    if machines is None:
        return None, teams
    resolved: dict[str, bool | None] = {}
    emails: dict[str, list[str]] = {}  # uncached email (lower case) -> the owners that spell it
    ids: set[str] = set()
    for owner in sorted({(m.owner or "").strip() for m in machines}):
        if SLACK_USER_ID.match(owner):
            ids.add(owner)
        elif not owner or len(owner) > MAX_EMAIL_CHARS or not EMAIL.match(owner):
            resolved[owner] = False
        elif cached(f"owner#{owner.lower()}"):
            resolved[owner] = True
        else:
            emails.setdefault(owner.lower(), []).append(owner)
    found: dict[str, str] = {}
    if reader is not None and len(emails) + len(ids) >= BULK_RESOLVE_FROM:
        listing = reader.users_listing(set(emails), frozenset(ids))
        found.update(listing.emails)
        for email in list(emails):
            if email in listing.emails or listing.complete:
                resolved.update(dict.fromkeys(emails.pop(email), email in listing.emails))
        resolved.update(dict.fromkeys(listing.ids, True))
        ids -= listing.ids  # an id the listing did not show is asked for (users.info says whether it exists)
    for email, spellings in emails.items():
        user = reader.email_user(email) if reader is not None else None
        if user:
            found[email] = user
        resolved.update(dict.fromkeys(spellings, None if user is None else bool(user)))
    for user in ids:
        resolved[user] = reader.user_exists(user) if reader is not None else None
    if found and resolved_to is not None:
        resolved_to(found)
    return [OwnedMachine(m.instance_id, m.team, m.owner, resolved[(m.owner or "").strip()]) for m in machines], teams
