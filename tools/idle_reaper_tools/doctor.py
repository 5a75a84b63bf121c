"""`idle-reaper doctor`: the read-only checks of a deployed account, printed. Wiring only: the gatherers and
the checks live in the runtime (sweep/doctor.py runs them; aws/doctor.py and slack/doctor.py fetch;
core/doctor.py decides), where the sweep's daily check and `/idle-reaper doctor` run them too. Nothing is
written, cached or posted (unless --send-test asks for one test message)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from datetime import UTC, datetime

from idle_reaper import aws
from idle_reaper.core.doctor import Finding, failed, listed, outcomes, tally, unknown
from idle_reaper.policy import PolicyError, Settings
from idle_reaper.slack.doctor import SLACK_DOWN, SlackReader, slack_error, slack_reader
from idle_reaper.sweep.doctor import Account
from idle_reaper.sweep.doctor import run_checks as run_region_checks

SLACK_BUDGET_SECONDS = 20.0  # rate-limit retries past this make a fact unknown, not the doctor slow
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
        except SLACK_DOWN as exc:
            refused.append(f"{target} ({slack_error(exc) or type(exc).__name__})")
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
    account = Account(
        policies=aws.PolicyStore(aws.client("ssm", region), aws.ssm_prefix()),
        fleet=aws.Fleet(aws.client("ec2", region), aws.client("autoscaling", region)),
        metrics=aws.MetricsReader(aws.client("cloudwatch", region)),
        store=aws.DynamoStateStore(aws.client("dynamodb", region), aws.table_name()),
    )
    reader, signing = slack_reader(SLACK_BUDGET_SECONDS)
    now = datetime.now(UTC)
    findings = run_region_checks(account, reader, signing_secret=signing, now=now, sweep_minutes=sweep_minutes)
    if send_test_to is not None:
        try:
            settings, _ = account.policies.load_settings()
        except PolicyError:
            settings = Settings()  # policy.settings says why; nobody to send to but the named user
        findings.append(send_test(reader, settings, send_test_to or None))
    return findings


def print_findings(findings: Iterable[Finding], as_json: bool) -> None:
    findings = list(findings)
    if as_json:
        print(json.dumps([f.model_dump(mode="json") for f in findings], indent=2))
        return
    for finding in findings:
        print(finding.line())
    print(tally(findings))


def cmd_doctor(args: argparse.Namespace) -> int:
    try:
        findings = run_checks(args.region, args.sweep_minutes, args.send_test)
    except aws.AwsError as exc:
        print(f"idle-reaper: doctor could not read the account ({aws.error_code(exc)}): {exc}", file=sys.stderr)
        return 2
    print_findings(findings, args.json)
    return 1 if failed(findings) else 0
