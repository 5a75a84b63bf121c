"""The doctor's Slack facts (core/doctor.py decides on them): read-only Web API calls, each answer a fact or
None when Slack could not be asked. A reader with a deadline asks nothing past it: what it did not reach is
"could not check", so a sweep's daily check or a Slack command stays within its time."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

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
from idle_reaper.slack.owners import EMAIL, MAX_EMAIL_CHARS, SLACK_USER_ID

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
        return "member" if (info.get("channel") or {}).get("is_member") else "not_member"

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

    def email_exists(self, email: str) -> bool | None:
        if not self._may_ask():
            return None
        try:
            self.client.users_lookupByEmail(email=email)
        except SlackApiError as exc:
            return False if slack_error(exc) == "users_not_found" else None
        except SLACK_DOWN:
            return None
        return True

    def owner_resolves(self, owner: str | None) -> bool | None:
        owner = (owner or "").strip()
        if SLACK_USER_ID.match(owner):
            return self.user_exists(owner)
        if not owner or len(owner) > MAX_EMAIL_CHARS or not EMAIL.match(owner):
            return False
        return self.email_exists(owner)


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
) -> tuple[list[OwnedMachine] | None, list[TeamContacts]]:
    """Each distinct Owner asked once: an email the sweep already resolved (its 7-day cache in the state table,
    read, never written) costs no Slack call; the rest go to users.info or users.lookupByEmail. Past the
    reader's deadline the rest are not looked at (could not check)."""
    teams = [
        TeamContacts(team, ref.policy.slack_channel, len(ref.policy.members))
        for team, ref in refs.items()
        if ref.policy is not None
    ]
    if machines is None:
        return None, teams
    resolved: dict[str, bool | None] = {}
    for owner in sorted({(m.owner or "").strip() for m in machines}):
        if reader is not None and reader.out_of_time:
            resolved[owner] = None  # not reached in time: could not check
        elif EMAIL.match(owner) and cached(f"owner#{owner.lower()}"):
            resolved[owner] = True
        else:
            resolved[owner] = reader.owner_resolves(owner) if reader else (None if owner else False)
    return [OwnedMachine(m.instance_id, m.team, m.owner, resolved[(m.owner or "").strip()]) for m in machines], teams
