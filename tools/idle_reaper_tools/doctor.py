"""`idle-reaper doctor`: gather facts from a deployed account (read-only) and print the core's findings.

Thin gatherers only: SSM through PolicyStore, EC2 through Fleet, Slack through slack-sdk's WebClient. Every
call here reads; nothing is written, cached or posted (unless --send-test asks for one test message).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from idle_reaper import aws
from idle_reaper.aws.policies import policy_for
from idle_reaper.core.doctor import (
    MANIFEST_BOT_SCOPES,
    SIGNAL_WINDOW_MINUTES,
    UNREACHABLE,
    ChannelState,
    Finding,
    LastSweep,
    MachineSignals,
    OwnedMachine,
    PolicyFacts,
    SlackFacts,
    TeamContacts,
    check_groups,
    check_last_sweep,
    check_people,
    check_policy,
    check_signals,
    check_slack,
    failed,
    listed,
    outcomes,
    unknown,
)
from idle_reaper.core.signals import Machine, Signals, has_no_gpu, is_gpu_type
from idle_reaper.policy import PolicyError, Settings, TeamPolicyRef
from idle_reaper.slack.owners import EMAIL, MAX_EMAIL_CHARS, SLACK_USER_ID
from idle_reaper.sweep.fanout import LAST_SWEEP_KEY

GROUP_FILTER_VALUES = 1000  # DescribeTags: at most 1000 values per filter type; 100 tags a page
SLACK_BUDGET_SECONDS = 20.0  # rate-limit retries past this make a fact unknown, not the doctor slow

_SLACK_DOWN = (SlackClientError, OSError)


def gather_policy(store: aws.PolicyStore) -> tuple[Settings, PolicyFacts, dict[str, TeamPolicyRef]]:
    try:
        settings, _ = store.load_settings()
        problems: tuple[str, ...] = ()
    except PolicyError as exc:
        settings, problems = Settings(), tuple(exc.problems)
    refs = store.load_teams(settings)
    facts = PolicyFacts(
        settings_parameter=store.settings_name, settings_problems=problems, teams=refs, machine_teams=None
    )
    return settings, facts, refs


def _slack_error(exc: Exception) -> str | None:
    """A Slack error code when Slack answered; None when it did not (down, rate limited past the budget)."""
    if isinstance(exc, SlackApiError) and exc.response.status_code == 200:
        return str(exc.response.get("error") or "error")
    return None


class SlackReader:
    """Read-only Slack calls; each answer is a fact, or None when Slack could not be asked."""

    def __init__(self, client: WebClient) -> None:
        self.client = client
        self.calls = 0

    def auth(self) -> tuple[str | None, frozenset[str] | None]:
        self.calls += 1
        try:
            response = self.client.auth_test()
        except SlackApiError as exc:
            code = _slack_error(exc)
            return (code if code else f"{UNREACHABLE}: HTTP {exc.response.status_code}"), None
        except _SLACK_DOWN as exc:
            return f"{UNREACHABLE}: {type(exc).__name__}", None
        header = {k.lower(): v for k, v in response.headers.items()}.get("x-oauth-scopes")
        scopes = header[0] if isinstance(header, list) else header
        return None, (frozenset(s.strip() for s in str(scopes).split(",") if s.strip()) if scopes else None)

    def channel(self, channel: str) -> ChannelState | None:
        self.calls += 1
        try:
            info = self.client.conversations_info(channel=channel)
        except SlackApiError as exc:
            code = _slack_error(exc)
            return "not_found" if code == "channel_not_found" else None
        except _SLACK_DOWN:
            return None
        return "member" if (info.get("channel") or {}).get("is_member") else "not_member"

    def user_exists(self, user: str) -> bool | None:
        self.calls += 1
        try:
            info = self.client.users_info(user=user)
        except SlackApiError as exc:
            return False if _slack_error(exc) in ("user_not_found", "users_not_found") else None
        except _SLACK_DOWN:
            return None
        return not (info.get("user") or {}).get("deleted")

    def email_exists(self, email: str) -> bool | None:
        self.calls += 1
        try:
            self.client.users_lookupByEmail(email=email)
        except SlackApiError as exc:
            return False if _slack_error(exc) == "users_not_found" else None
        except _SLACK_DOWN:
            return None
        return True

    def owner_resolves(self, owner: str | None) -> bool | None:
        owner = (owner or "").strip()
        if SLACK_USER_ID.match(owner):
            return self.user_exists(owner)
        if not owner or len(owner) > MAX_EMAIL_CHARS or not EMAIL.match(owner):
            return False
        return self.email_exists(owner)


def gather_slack(
    reader: SlackReader | None, signing_secret: bool, settings: Settings, refs: dict[str, TeamPolicyRef]
) -> SlackFacts:
    if reader is None:
        return SlackFacts("not configured", None, MANIFEST_BOT_SCOPES, signing_secret)
    auth_error, scopes = reader.auth()
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
    if auth_error is not None:
        return SlackFacts(auth_error, scopes, MANIFEST_BOT_SCOPES, signing_secret)
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
    machines: list[Machine] | None,
    refs: dict[str, TeamPolicyRef],
    cached: Callable[[str], str | None] = lambda key: None,
) -> tuple[list[OwnedMachine] | None, list[TeamContacts]]:
    """Each distinct Owner asked once: an email the sweep already resolved (its 7-day cache in the state table,
    read, never written) costs no Slack call; the rest go to users.info or users.lookupByEmail."""
    teams = [
        TeamContacts(team, ref.policy.slack_channel, len(ref.policy.members))
        for team, ref in refs.items()
        if ref.policy is not None
    ]
    if machines is None:
        return None, teams
    resolved: dict[str, bool | None] = {}
    for owner in {(m.owner or "").strip() for m in machines}:
        if EMAIL.match(owner) and cached(f"owner#{owner.lower()}"):
            resolved[owner] = True
        else:
            resolved[owner] = reader.owner_resolves(owner) if reader else (None if owner else False)
    return [OwnedMachine(m.instance_id, m.team, m.owner, resolved[(m.owner or "").strip()]) for m in machines], teams


def gather_signals(
    metrics: aws.MetricsReader,
    machines: list[Machine],
    settings: Settings,
    refs: dict[str, TeamPolicyRef],
    now: datetime,
) -> list[MachineSignals]:
    """The last hour of every opted-in machine's CPU, GPU (types that can have one) and collector metrics, in
    the sweep's own GetMetricData batches (500 queries a call)."""
    start = now - timedelta(minutes=SIGNAL_WINDOW_MINUTES)
    gpu_ids = [m.instance_id for m in machines if not has_no_gpu(m.instance_type, settings.gpu_instance_families)]
    other_ids = [m.instance_id for m in machines if has_no_gpu(m.instance_type, settings.gpu_instance_families)]
    read: dict[str, Signals] = {}
    for ids, gpu in ((gpu_ids, True), (other_ids, False)):
        if ids:
            read.update(metrics.fetch(ids, settings.metrics, start=start, end=now, human=True, gpu=gpu))
    out: list[MachineSignals] = []
    for m in machines:
        policy = policy_for(m.team, refs, settings).policy or settings.default_policy
        signals = read[m.instance_id]
        out.append(
            MachineSignals(
                instance_id=m.instance_id,
                team=m.team,
                gpu_expected=m.instance_id in set(gpu_ids)
                and is_gpu_type(m.instance_type, settings.gpu_instance_families),
                collector_expected=policy.human_active_minutes is not None,
                max_gap_minutes=policy.max_gap_minutes,
                complete=signals.complete,
                cpu=[t for t, _ in signals.cpu],
                gpu=len(signals.gpu),
                user=len(signals.user),
            )
        )
    return out


def gather_last_sweep(store: aws.DynamoStateStore, now: datetime) -> LastSweep | Literal["unreadable"] | None:
    try:
        stored = store.get_lookup(LAST_SWEEP_KEY, now)
    except aws.AwsError:
        return "unreadable"
    if not stored:
        return None
    value = json.loads(stored)
    return LastSweep(datetime.fromisoformat(value["at"]), int(value["failed_shards"]), int(value["errors"]))


def gather_group_tags(autoscaling: Any, groups: set[str], tag: str) -> set[str] | None:
    """The groups (of `groups`) whose opt-in tag is `true`; None when they could not be read."""
    tagged: set[str] = set()
    names = sorted(groups)
    try:
        for i in range(0, len(names), GROUP_FILTER_VALUES):
            filters = [
                {"Name": "auto-scaling-group", "Values": names[i : i + GROUP_FILTER_VALUES]},
                {"Name": "key", "Values": [tag]},
            ]
            for page in autoscaling.get_paginator("describe_tags").paginate(
                Filters=filters, PaginationConfig={"PageSize": 100}
            ):
                tagged |= {t["ResourceId"] for t in page["Tags"] if str(t.get("Value", "")).lower() == "true"}
    except aws.AwsError:
        return None
    return tagged


def _slack_reader() -> tuple[SlackReader | None, bool]:
    from idle_reaper.slack import SlackNotConfigured, load_secrets, make_client

    try:
        secrets = load_secrets()
    except SlackNotConfigured:
        return None, False
    return SlackReader(make_client(secrets.bot_token, SLACK_BUDGET_SECONDS)), bool(secrets.signing_secret)


TEST_MESSAGE = "idle-reaper doctor: a test message. Warnings about idle machines will reach you here."


def send_test(reader: SlackReader | None, settings: Settings, user: str | None) -> Finding:
    """The one thing the doctor may post, when asked: a test message to the admins (and a named user)."""
    check = "slack.send_test"
    targets = [
        *settings.admins,
        *([settings.admin_channel] if settings.admin_channel else []),
        *([user] if user else []),
    ]
    if reader is None:
        return unknown(check, "Slack is not configured")
    if not targets:
        return Finding(
            check=check,
            status="warn",
            message="no admins, admin channel or user to send to",
            fix="set admins or admin_channel in the settings, or name a user: --send-test U0123ABCD",
        )
    refused: list[str] = []
    for target in dict.fromkeys(targets):
        try:
            reader.client.chat_postMessage(channel=target, text=TEST_MESSAGE)
        except (SlackApiError, *_SLACK_DOWN) as exc:
            refused.append(f"{target} ({_slack_error(exc) or type(exc).__name__})")
    return outcomes(
        check,
        f"a test message went to {listed(list(dict.fromkeys(targets)))}",
        None,
        (
            [r.split(" ", 1)[0] for r in refused],
            f"the test message was refused for {listed(refused)}",
            "see slack.channels and slack.users above; /invite @idle-reaper where it is a channel",
        ),
    )[0]


def run_checks(region: str | None = None, sweep_minutes: int = 5, send_test_to: str | None = None) -> list[Finding]:
    store = aws.PolicyStore(aws.client("ssm", region), aws.ssm_prefix())
    settings, policy_facts, refs = gather_policy(store)
    machines: list[Machine] | None
    try:
        machines = aws.Fleet(aws.client("ec2", region), aws.client("autoscaling", region)).discover(settings.tags)
    except aws.AwsError:
        machines = None
    policy_facts = PolicyFacts(
        policy_facts.settings_parameter,
        policy_facts.settings_problems,
        refs,
        None if machines is None else [m.team for m in machines],
    )
    reader, signing = _slack_reader()
    findings = check_policy(policy_facts)
    now = datetime.now(UTC)
    store_table = aws.DynamoStateStore(aws.client("dynamodb", region), aws.table_name())
    findings.append(
        check_last_sweep(
            gather_last_sweep(store_table, now),
            now,
            sweep_minutes,
        )
    )
    opt_in = settings.tags.managed
    members: dict[str, int] | None = None
    tagged: set[str] | None = set()
    if machines is not None:
        members = {}
        for m in machines:
            if m.asg_name:
                members[m.asg_name] = members.get(m.asg_name, 0) + 1
        if opt_in and members:
            tagged = gather_group_tags(aws.client("autoscaling", region), set(members), opt_in)
    findings.append(check_groups(None if tagged is None else members, tagged or set(), opt_in))
    period = settings.metrics.period_seconds // 60
    if machines is None:
        findings += check_signals(None, now, now, period)
    else:
        metrics = aws.MetricsReader(aws.client("cloudwatch", region))
        signals = gather_signals(metrics, machines, settings, refs, now)
        findings += check_signals(signals, now - timedelta(minutes=SIGNAL_WINDOW_MINUTES), now, period)
    slack = gather_slack(reader, signing, settings, refs)
    findings += check_slack(slack)
    if reader is None or not slack.reachable:
        findings.append(unknown("people.owners", "Slack is not reachable with the bot token"))
    else:

        def cached(key: str) -> str | None:
            try:
                return store_table.get_lookup(key, now)
            except aws.AwsError:
                return None

        owned, contacts = gather_people(reader, machines, refs, cached)
        findings += check_people(owned, contacts)
    if send_test_to is not None:
        findings.append(send_test(reader, settings, send_test_to or None))
    return findings


def print_findings(findings: Iterable[Finding], as_json: bool) -> None:
    findings = list(findings)
    if as_json:
        print(json.dumps([f.model_dump(mode="json") for f in findings], indent=2))
        return
    for finding in findings:
        print(finding.line())
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.status] = counts.get(f.status, 0) + 1
    print(", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "warn", "fail", "unknown")))


def cmd_doctor(args: argparse.Namespace) -> int:
    from idle_reaper_tools.doctor_deploy import CannotRun, check_deploy, default_stack_name

    try:
        findings = check_deploy(
            args.region,
            args.stack or default_stack_name(),
            args.endpoint,
            lambda region, first: run_checks(region, args.sweep_minutes, args.send_test if first else None),
        )
    except CannotRun as exc:
        print(f"idle-reaper: doctor cannot run: {exc}", file=sys.stderr)
        return 2
    except aws.AwsError as exc:
        print(f"idle-reaper: doctor could not read the account ({aws.error_code(exc)}): {exc}", file=sys.stderr)
        return 2
    print_findings(findings, args.json)
    return 1 if failed(findings) else 0
