"""`idle-reaper doctor`: the read-only checks of a deployed account, printed. Wiring only: the gatherers and
the checks live in the runtime (sweep/doctor.py runs them; aws/doctor.py and slack/doctor.py fetch;
core/doctor.py decides), where the sweep's daily check and `/idle-reaper doctor` run them too. Nothing is
written, cached or posted (unless --send-test asks for one test message)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper import aws
from idle_reaper.aws.accounts import Directory, MemberCheck, OrganizationConfig, last_member_check
from idle_reaper.aws.studio import StudioApps
from idle_reaper.core.doctor import Finding, check_members, failed, listed, outcomes, tally, unknown
from idle_reaper.policy import PolicyError, Settings
from idle_reaper.slack.doctor import SLACK_DOWN, SlackReader, slack_error, slack_reader
from idle_reaper.sweep.doctor import CLI_GPU_UNREAD, Account, digest_reads, members_as_last_checked
from idle_reaper.sweep.doctor import run_checks as run_region_checks
from idle_reaper.sweep.doctor_daily import within

MEMBERS_OUTPUT = "MemberStackSetId"  # the hub stack's output in organization mode (infra/stack.py)
# The member checks (the Organizations listing, the StackSet's instances) end by then, as in Slack: late is unknown.
MEMBERS_SECONDS = 20.0
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


def organization_of(region: str | None, stack: str, outputs: Mapping[str, str]) -> OrganizationConfig | None:
    """The organization the stack in `region` sweeps: its sweep function's IDLE_REAPER_ORGANIZATION. Only the
    hub's stack (the first region of an organization-mode deploy) has the `MemberStackSetId` output: elsewhere,
    and in single-account mode, nothing more is read."""
    if MEMBERS_OUTPUT not in outputs:
        return None
    try:
        pages = aws.client("cloudformation", region).get_paginator("list_stack_resources").paginate(StackName=stack)
        sweep = next(
            (
                r["PhysicalResourceId"]
                for page in pages
                for r in page["StackResourceSummaries"]
                if r["ResourceType"] == "AWS::Lambda::Function" and r["LogicalResourceId"].startswith("SweepFunction")
            ),
            None,
        )
        if sweep is None:
            return None
        found = aws.client("lambda", region).get_function_configuration(FunctionName=sweep)
    except aws.AwsError:
        return None  # the deploy checks say what cannot be read
    return OrganizationConfig.of_function(found)


def member_stack_instances(cloudformation: Any, stack_set_name: str) -> dict[tuple[str, str], str] | None:
    """The member StackSet's stack instances: (account, region) -> "" when current, else its status and reason
    ("OUTDATED/FAILED: ..."). Called as the management account, then as a delegated administrator. None: the
    StackSet could not be read (not this account's, or not allowed): not checked."""
    for call_as in ("SELF", "DELEGATED_ADMIN"):
        found: dict[tuple[str, str], str] = {}
        try:
            pages = cloudformation.get_paginator("list_stack_instances").paginate(
                StackSetName=stack_set_name, CallAs=call_as
            )
            for page in pages:
                for instance in page["Summaries"]:
                    status = str(instance.get("Status") or "")
                    detailed = str((instance.get("StackInstanceStatus") or {}).get("DetailedStatus") or "")
                    if status == "CURRENT" and detailed in ("", "SUCCEEDED"):
                        found[(instance["Account"], instance["Region"])] = ""
                        continue
                    reason = str(instance.get("StatusReason") or "")
                    text = f"{status}/{detailed}" if detailed else status
                    found[(instance["Account"], instance["Region"])] = f"{text}: {reason}" if reason else text
        except aws.AwsError as exc:
            if call_as == "SELF" and aws.error_code(exc) in ("StackSetNotFoundException", "ValidationError"):
                continue
            return None
        return found
    return None


def member_checks(
    region: str | None, stack: str, sweep_minutes: int, now: datetime, first: bool, outputs: Mapping[str, str]
) -> list[Finding]:
    """Organization mode, from the hub's region: every member account and region as the sweep's last check saw
    its member role, with its member stack instance's status; their GPU metrics are the hub's roles' to read
    (`/idle-reaper doctor`), said once as unknown. The listing and the stack instances are bounded by
    MEMBERS_SECONDS, as in Slack: what is late, or unreadable, is unknown. Nothing in single-account mode.
    IDLE_REAPER_ORGANIZATION set here stands for the stack's (checked from the first region)."""
    config = (OrganizationConfig.from_environment() if first else None) or organization_of(region, stack, outputs)
    if config is None:
        return []
    deadline = time.monotonic() + MEMBERS_SECONDS
    late = f"not done in {MEMBERS_SECONDS:.0f} s"
    listing = within(
        deadline,
        config.directory(aws.client("organizations")).current,
        Directory((), error=f"AWS Organizations did not answer in time ({late})"),
    )
    store = aws.DynamoStateStore(aws.client("dynamodb", region), aws.table_name())
    check: MemberCheck | str | None
    try:
        check = last_member_check(store, now)
    except aws.AwsError as exc:
        check = f"{aws.error_code(exc)}: {exc}"[:300]
    except ValueError as exc:  # what is stored is not a check: unknown, with why
        check = str(exc)
    fresh = timedelta(minutes=max(15, 3 * sweep_minutes))
    cloudformation = aws.client("cloudformation", region)
    stack_set = f"{config.prefix}-members"
    not_read: dict[tuple[str, str], str] | None = None
    stacks, stacks_late = within(
        deadline, lambda: (member_stack_instances(cloudformation, stack_set), ""), (not_read, late)
    )
    read = members_as_last_checked(check, listing, config.regions_of, now, fresh, stacks, digest_reads(store, now))
    findings = check_members(
        read.units, listing_error=read.listing_error, skipped=read.skipped, gpu_unread=CLI_GPU_UNREAD
    )
    if stacks is None:
        why = stacks_late or "not this account's StackSet, or not allowed"
        findings.append(
            unknown(
                "members.stacks",
                f"the member StackSet's stack instances could not be listed ({why})",
                "run the doctor as the management account or the StackSets delegated administrator",
            )
        )
    return findings


def run_checks(
    region: str | None = None,
    sweep_minutes: int = 5,
    send_test_to: str | None = None,
    stack: str | None = None,
    first: bool = True,
    outputs: Mapping[str, str] | None = None,
) -> list[Finding]:
    account = Account(
        policies=aws.PolicyStore(aws.client("ssm", region), aws.ssm_prefix()),
        fleet=aws.Fleet(
            aws.client("ec2", region),
            aws.client("autoscaling", region),
            studio=StudioApps(aws.client("sagemaker", region)),
        ),
        metrics=aws.MetricsReader(aws.client("cloudwatch", region)),
        store=aws.DynamoStateStore(aws.client("dynamodb", region), aws.table_name()),
    )
    reader, signing = slack_reader(SLACK_BUDGET_SECONDS)
    now = datetime.now(UTC)
    findings = run_region_checks(account, reader, signing_secret=signing, now=now, sweep_minutes=sweep_minutes)
    if stack is not None:
        findings += member_checks(region, stack, sweep_minutes, now, first, outputs or {})
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
    from idle_reaper_tools.doctor_deploy import CannotRun, check_deploy, default_stack_name

    try:
        findings = check_deploy(
            args.region,
            args.stack or default_stack_name(),
            args.endpoint,
            lambda region, first, outputs: run_checks(
                region,
                args.sweep_minutes,
                args.send_test if first else None,
                args.stack or default_stack_name(),
                first,
                outputs,
            ),
        )
    except CannotRun as exc:
        print(f"idle-reaper: doctor cannot run: {exc}", file=sys.stderr)
        return 2
    except aws.AwsError as exc:
        print(f"idle-reaper: doctor could not read the account ({aws.error_code(exc)}): {exc}", file=sys.stderr)
        return 2
    print_findings(findings, args.json)
    return 1 if failed(findings) else 0
