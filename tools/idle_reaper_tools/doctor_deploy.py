"""`idle-reaper doctor`'s deploy checks: find the stack in every enabled region (or the one asked for), read
its schedule, alarm topic, reserved concurrency and agent association, and ping its Slack endpoint.

Thin gatherers, read-only (Describe/Get/List calls and one signed ping that the handler answers without doing
anything); the decisions are idle_reaper.core.deploy_checks'. Calls per region with a stack: DescribeStacks,
DescribeRule, GetTopicAttributes, ListSubscriptionsByTopic, GetAccountSettings, GetTemplate,
ListStackResources, one GetFunctionConcurrency per function the template reserves for, DescribeAssociation.
Without --region: DescribeRegions, one DescribeStacks per enabled region (8 at once), and the sweep's own count of the
regions without a stack (DescribeRegions, one paginated DescribeInstances each).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
from slack_sdk.signature import SignatureVerifier

import idle_reaper
from idle_reaper import aws
from idle_reaper.aws.clients import DEFAULT_DEPLOY_PREFIX
from idle_reaper.aws.regions import count_unwatched
from idle_reaper.core.deploy_checks import (
    ASSOCIATION_OUTPUT,
    SCHEDULE_OUTPUT,
    TOPIC_OUTPUT,
    UNREADABLE,
    AssociationFacts,
    ConcurrencyFacts,
    EndpointAnswer,
    RegionScan,
    StackFacts,
    Subscription,
    Unreadable,
    check_alarm_topic,
    check_concurrency,
    check_endpoint,
    check_regions,
    check_schedule,
    check_stack,
    in_region,
    with_association,
)
from idle_reaper.core.doctor import Finding
from idle_reaper.policy import PolicyError, TagKeys

PING_TIMEOUT_SECONDS = 10.0
REGIONS_AT_ONCE = 8
PING_PAYLOAD = json.dumps(
    {"type": "idle_reaper_doctor_ping"}
)  # an interaction that is no button: answered, nothing done

# Run one region's other checks (policy, Slack, people, signals, last sweep, groups); the flag is True for the
# first region only, so --send-test posts once.
RegionalChecks = Callable[[str, bool], list[Finding]]


class CannotRun(Exception):
    """Nothing can be checked (no credentials, no region): one line, exit 2."""


def stack_name_for(prefix: str) -> str:
    """The CloudFormation name infra/stack.py gives the stack of a prefix."""
    return "IdleReaper" if prefix == DEFAULT_DEPLOY_PREFIX else prefix


def default_stack_name() -> str:
    """The stack of the state table this command reads (IDLE_REAPER_TABLE is `<prefix>-state`)."""
    return stack_name_for(aws.deploy_prefix())


# What AWS answers credentials it does not accept (unknown, expired, or signed wrong): nothing can be checked.
REFUSED_CREDENTIALS = frozenset(
    {
        "AuthFailure",
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "ExpiredToken",
        "ExpiredTokenException",
        "SignatureDoesNotMatch",
    }
)


def _refused(exc: Exception) -> CannotRun | None:
    if isinstance(exc, aws.AwsError) and aws.error_code(exc) in REFUSED_CREDENTIALS:
        return CannotRun(
            f"AWS refused the credentials ({aws.error_code(exc)}): renew them (aws sso login, aws configure)"
        )
    return None


def _missing(exc: Exception, *codes: str) -> bool:
    return isinstance(exc, aws.AwsError) and aws.error_code(exc) in codes


def describe_stack(cloudformation: Any, name: str) -> StackFacts | Unreadable | None:
    try:
        stack = cloudformation.describe_stacks(StackName=name)["Stacks"][0]
    except aws.AwsError as exc:
        # CloudFormation answers a missing stack with a ValidationError "Stack with id X does not exist".
        if _missing(exc, "ValidationError") and "does not exist" in str(exc):
            return None
        if refused := _refused(exc):
            raise refused from None
        return UNREADABLE
    outputs = {o["OutputKey"]: str(o.get("OutputValue", "")) for o in stack.get("Outputs", [])}
    return StackFacts(name, stack["StackStatus"], stack.get("StackStatusReason"), outputs)


def rule_state(events: Any, rule: str | None) -> str | Unreadable | None:
    if rule is None:
        return None
    try:
        return str(events.describe_rule(Name=rule)["State"])
    except aws.AwsError as exc:
        return None if _missing(exc, "ResourceNotFoundException") else UNREADABLE


def topic_facts(sns: Any, topic: str | None) -> tuple[str | Unreadable | None, list[Subscription] | Unreadable]:
    if topic is None:
        return None, []
    try:
        policy: str | Unreadable | None = sns.get_topic_attributes(TopicArn=topic)["Attributes"].get("Policy")
    except aws.AwsError:
        policy = UNREADABLE
    try:
        subscriptions = [
            Subscription(s["Protocol"], s["Endpoint"], s["SubscriptionArn"].startswith("arn:"))
            for page in sns.get_paginator("list_subscriptions_by_topic").paginate(TopicArn=topic)
            for s in page["Subscriptions"]
        ]
    except aws.AwsError:
        return policy, UNREADABLE
    return policy, subscriptions


def _template(cloudformation: Any, name: str) -> dict[str, Any]:
    body = cloudformation.get_template(StackName=name, TemplateStage="Original")["TemplateBody"]
    parsed = json.loads(body) if isinstance(body, str) else body  # boto3 parses a JSON template itself
    if not isinstance(parsed, dict):
        raise ValueError("the template is not a JSON object")
    return parsed


def concurrency_facts(cloudformation: Any, lambda_: Any, name: str) -> ConcurrencyFacts | None:
    """The account's quota, what the stack's template reserves per function, and what those functions hold."""
    try:
        limit = lambda_.get_account_settings()["AccountLimit"]
        wanted_by_id = {
            logical: int(resource["Properties"]["ReservedConcurrentExecutions"])
            for logical, resource in _template(cloudformation, name).get("Resources", {}).items()
            if resource.get("Type") == "AWS::Lambda::Function"
            and "ReservedConcurrentExecutions" in resource.get("Properties", {})
        }
        physical = {
            r["LogicalResourceId"]: r.get("PhysicalResourceId") or r["LogicalResourceId"]
            for page in cloudformation.get_paginator("list_stack_resources").paginate(StackName=name)
            for r in page["StackResourceSummaries"]
            if r["LogicalResourceId"] in wanted_by_id
        }
        wanted: dict[str, int] = {}
        held: dict[str, int] = {}
        for logical, n in wanted_by_id.items():
            function = physical.get(logical, logical)
            wanted[function] = n
            held[function] = _reserved(lambda_, function) if n else 0
    except (*aws.AwsError, ValueError, TypeError, KeyError):
        return None
    return ConcurrencyFacts(
        int(limit["ConcurrentExecutions"]), int(limit["UnreservedConcurrentExecutions"]), wanted, held
    )


def _reserved(lambda_: Any, function: str) -> int:
    try:
        return int(lambda_.get_function_concurrency(FunctionName=function).get("ReservedConcurrentExecutions") or 0)
    except aws.AwsError as exc:
        if _missing(exc, "ResourceNotFoundException"):
            return 0  # the function is gone (a rolled-back create): it holds nothing
        raise


def association_facts(ssm: Any, association: str | None) -> AssociationFacts | Unreadable | None:
    if association is None:
        return None
    try:
        overview = ssm.describe_association(AssociationId=association)["AssociationDescription"].get("Overview", {})
    except aws.AwsError:
        return UNREADABLE
    counts = {str(k): int(v) for k, v in overview.get("AssociationStatusAggregatedCount", {}).items()}
    return AssociationFacts(association, overview.get("Status"), counts)


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


def deploy_findings(region: str, name: str, stack: StackFacts | Unreadable | None) -> list[Finding]:
    """The stack's own checks in one region (the schedule, alarm topic and concurrency only where it exists)."""
    findings = check_stack(region, name, stack, idle_reaper.__version__)
    if not isinstance(stack, StackFacts):
        return findings
    outputs = stack.outputs
    cloudformation = aws.client("cloudformation", region)
    schedule = outputs.get(SCHEDULE_OUTPUT)
    findings.append(check_schedule(region, schedule, rule_state(aws.client("events", region), schedule)))
    topic = outputs.get(TOPIC_OUTPUT)
    findings += check_alarm_topic(region, topic, *topic_facts(aws.client("sns", region), topic))
    findings.append(check_concurrency(region, concurrency_facts(cloudformation, aws.client("lambda", region), name)))
    return findings


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
        if refused := _refused(exc):
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
        stack = stacks.get(here)
        association = (
            association_facts(aws.client("ssm", here), stack.outputs.get(ASSOCIATION_OUTPUT))
            if isinstance(stack, StackFacts)
            else None
        )
        ours = deploy_findings(here, name, stack)
        findings += in_region(here, [*ours, *with_association(regional(here, i == 0), association)])
    if not region:
        findings.append(check_regions(scan))
    if endpoint:
        findings.append(check_endpoint(endpoint, ping_endpoint(endpoint, _signing_secret())))
    return findings
