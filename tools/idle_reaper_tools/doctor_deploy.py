"""`idle-reaper doctor`'s deploy checks: find the stack in every enabled region (or the one asked for), read
its schedule, alarm topic, reserved concurrency and agent association, and ping its Slack endpoint.

Thin gatherers, read-only (Describe/Get/List calls and one signed ping that the handler answers without doing
anything); the decisions are idle_reaper.core.deploy_checks'. A stack's own facts are read by
idle_reaper.aws.deploy, which `/idle-reaper doctor` runs too (its calls are listed there).
Without --region: DescribeRegions, one DescribeStacks per enabled region (8 at once), and the sweep's own count of the
regions without a stack (DescribeRegions, one paginated DescribeInstances each).
"""

from __future__ import annotations

import functools
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import boto3
from slack_sdk.signature import SignatureVerifier

from idle_reaper import aws
from idle_reaper.aws.deploy import (
    CannotRun,
    default_stack_name,
    deploy_findings,
    describe_stack,
    refused_credentials,
    stack_name_for,
)
from idle_reaper.aws.regions import count_unwatched
from idle_reaper.core.deploy_checks import (
    UNREADABLE,
    EndpointAnswer,
    RegionScan,
    StackFacts,
    Unreadable,
    check_endpoint,
    check_regions,
    in_region,
    with_association,
)
from idle_reaper.core.doctor import Finding
from idle_reaper.policy import PolicyError, TagKeys

__all__ = ["CannotRun", "check_deploy", "default_stack_name", "stack_name_for"]

PING_TIMEOUT_SECONDS = 10.0
REGIONS_AT_ONCE = 8
PING_PAYLOAD = json.dumps(
    {"type": "idle_reaper_doctor_ping"}
)  # an interaction that is no button: answered, nothing done

# Run one region's other checks (policy, Slack, people, signals, last sweep, groups); the flag is True for the
# first region only, so --send-test posts once; the mapping is the stack's outputs there ({}: none read).
RegionalChecks = Callable[[str, bool, Mapping[str, str]], list[Finding]]


def ping_endpoint(url: str, signing_secret: str | None) -> EndpointAnswer | None:
    """POST a signed interaction that is no button to the Slack endpoint, as Slack sends one."""
    if not signing_secret:
        return None
    base = url.rstrip("/").removesuffix("/slack/interactions").removesuffix("/slack/commands")
    target = base + "/slack/interactions"  # the buttons' request URL: a non-button is answered, nothing done
    body = urllib.parse.urlencode({"payload": PING_PAYLOAD})
    timestamp = str(int(time.time()))
    request = urllib.request.Request(
        target,
        data=body.encode(),
        method="POST",
        headers={
            "Content-Type": "application/x-www-form-urlencoded",
            "User-Agent": "Slackbot 1.0 (+https://api.slack.com/robots)",
            "X-Slack-Request-Timestamp": timestamp,
            "X-Slack-Signature": SignatureVerifier(signing_secret).generate_signature(timestamp=timestamp, body=body)
            or "",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=PING_TIMEOUT_SECONDS) as response:
            return EndpointAnswer(response.status, response.read(4096).decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        return EndpointAnswer(exc.code, exc.read(4096).decode(errors="replace"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return EndpointAnswer(None, "", str(getattr(exc, "reason", exc)))


def _signing_secret() -> str | None:
    from idle_reaper.slack import SlackNotConfigured, load_secrets

    try:
        return load_secrets().signing_secret
    except SlackNotConfigured:
        return None


def _tags(home: str) -> TagKeys:
    """The opt-in and team tag keys of the settings where the doctor runs (the defaults if unreadable)."""
    try:
        return aws.PolicyStore(aws.client("ssm", home), aws.ssm_prefix()).load_settings()[0].tags
    except (*aws.AwsError, PolicyError):
        return TagKeys()


def scan_regions(home: str, name: str) -> tuple[dict[str, StackFacts | Unreadable | None], RegionScan | None]:
    """The stack in every enabled region, and the opted-in machines of the regions without one."""
    try:
        enabled = sorted(r["RegionName"] for r in aws.client("ec2", home).describe_regions()["Regions"])
    except aws.AwsError as exc:
        if refused := refused_credentials(exc):
            raise refused from None
        return {home: describe_stack(aws.client("cloudformation", home), name)}, None
    # One DescribeStacks per region, REGIONS_AT_ONCE at a time (clients made here: sessions are not thread-safe).
    clients = {r: aws.client("cloudformation", r) for r in enabled}
    with ThreadPoolExecutor(REGIONS_AT_ONCE) as pool:
        stacks = dict(zip(enabled, pool.map(lambda r: describe_stack(clients[r], name), enabled), strict=True))
    with_stack = [r for r, s in stacks.items() if isinstance(s, StackFacts)]
    unreadable = [r for r, s in stacks.items() if s == UNREADABLE]
    try:
        counts, denied = count_unwatched(lambda r: aws.client("ec2", r), with_stack or [home], _tags(home))
    except aws.AwsError:
        return stacks, None
    without = {c.region: c.opted_in for c in counts}
    if not with_stack and stacks.get(home) is None:
        without.pop(home, None)  # said by deploy.stack already
    return stacks, RegionScan(len(enabled), with_stack, without, sorted({*unreadable, *denied}))


def check_deploy(region: str | None, name: str, endpoint: str | None, regional: RegionalChecks) -> list[Finding]:
    """Every region with a stack (or the one asked for; with no stack anywhere, the configured one), each
    region's findings labelled with it, then the regions without a stack and the Slack endpoint."""
    if boto3.session.Session().get_credentials() is None:
        raise CannotRun(
            "no AWS credentials: set AWS_PROFILE, run `aws configure` or `aws sso login`, or run where a role is"
        )
    home = region or boto3.session.Session().region_name or os.environ.get("AWS_REGION")
    if not home:
        raise CannotRun("no AWS region: pass --region REGION or set AWS_REGION / AWS_DEFAULT_REGION")
    scan: RegionScan | None = None
    if region:
        stacks = {region: describe_stack(aws.client("cloudformation", region), name)}
        checked = [region]
    else:
        stacks, scan = scan_regions(home, name)
        # The configured region first: --send-test posts once, from there (its settings name the admins).
        checked = sorted((r for r, s in stacks.items() if isinstance(s, StackFacts)), key=lambda r: r != home)
        checked = checked or [home]
    findings: list[Finding] = []
    for i, here in enumerate(checked):
        connect = functools.partial(aws.client, region=here)
        ours, association = deploy_findings(connect, here, name, stacks.get(here))
        facts = stacks.get(here)
        outputs = facts.outputs if isinstance(facts, StackFacts) else {}
        findings += in_region(here, [*ours, *with_association(regional(here, i == 0, outputs), association)])
    if not region:
        findings.append(check_regions(scan))
    if endpoint:
        findings.append(check_endpoint(endpoint, ping_endpoint(endpoint, _signing_secret())))
    return findings
