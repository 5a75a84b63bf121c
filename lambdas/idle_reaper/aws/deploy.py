"""The deploy's facts, read-only, for the doctor's deploy checks (core/deploy_checks.py decides): the stack
and its outputs, the sweep's schedule rule, the alarm topic's policy and subscriptions, the Lambda concurrency
the stack reserves against the account's quota, and the agent association's last status. Shared by
`idle-reaper doctor` (tools/idle_reaper_tools/doctor_deploy.py, every region with a stack) and
`/idle-reaper doctor` (slack/routing.py, the endpoint's own stack, under its time budget).

Calls for a stack: DescribeStacks, DescribeRule, GetTopicAttributes, ListSubscriptionsByTopic,
GetAccountSettings, GetTemplate, ListStackResources, one GetFunctionConcurrency per function the template
reserves for, DescribeAssociation. The Slack function's role may make exactly these on its own stack's
resources (infra/stack.py DOCTOR_DEPLOY_READS)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import idle_reaper
from idle_reaper.aws.clients import DEFAULT_DEPLOY_PREFIX, AwsError, deploy_prefix, error_code
from idle_reaper.core.deploy_checks import (
    ASSOCIATION_OUTPUT,
    SCHEDULE_OUTPUT,
    TOPIC_OUTPUT,
    UNREADABLE,
    AssociationFacts,
    ConcurrencyFacts,
    StackFacts,
    Subscription,
    Unreadable,
    check_alarm_topic,
    check_concurrency,
    check_schedule,
    check_stack,
)
from idle_reaper.core.doctor import Finding, unknown

STACK_ENV = "IDLE_REAPER_STACK"  # the stack's CloudFormation name, given to the Slack function (infra/stack.py)
RELAY_ALARM_ENV = "IDLE_REAPER_RELAY_ALARM"  # the alarm on the Slack alarm relay's own errors (the sweep reads it)
# The deploy's checks, in the order they are made: what is not reached in time is said to be unknown.
DEPLOY_CHECKS = (
    "deploy.stack",
    "deploy.version",
    "deploy.schedule",
    "deploy.alarm_topic",
    "deploy.alarm_subscribers",
    "deploy.concurrency",
)
OUT_OF_TIME = "out of time"


class CannotRun(Exception):
    """Nothing can be checked (no credentials, no region): one line, exit 2."""


def stack_name_for(prefix: str) -> str:
    """The CloudFormation name infra/stack.py gives the stack of a prefix."""
    return "IdleReaper" if prefix == DEFAULT_DEPLOY_PREFIX else prefix


def default_stack_name() -> str:
    """The stack of the state table this command reads (IDLE_REAPER_TABLE is `<prefix>-state`)."""
    return stack_name_for(deploy_prefix())


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


def refused_credentials(exc: Exception) -> CannotRun | None:
    if isinstance(exc, AwsError) and error_code(exc) in REFUSED_CREDENTIALS:
        return CannotRun(f"AWS refused the credentials ({error_code(exc)}): renew them (aws sso login, aws configure)")
    return None


def _missing(exc: Exception, *codes: str) -> bool:
    return isinstance(exc, AwsError) and error_code(exc) in codes


def describe_stack(cloudformation: Any, name: str) -> StackFacts | Unreadable | None:
    try:
        stack = cloudformation.describe_stacks(StackName=name)["Stacks"][0]
    except AwsError as exc:
        # CloudFormation answers a missing stack with a ValidationError "Stack with id X does not exist".
        if _missing(exc, "ValidationError") and "does not exist" in str(exc):
            return None
        if refused := refused_credentials(exc):
            raise refused from None
        return UNREADABLE
    outputs = {o["OutputKey"]: str(o.get("OutputValue", "")) for o in stack.get("Outputs", [])}
    return StackFacts(name, stack["StackStatus"], stack.get("StackStatusReason"), outputs)


def rule_state(events: Any, rule: str | None) -> str | Unreadable | None:
    if rule is None:
        return None
    try:
        return str(events.describe_rule(Name=rule)["State"])
    except AwsError as exc:
        return None if _missing(exc, "ResourceNotFoundException") else UNREADABLE


def topic_facts(sns: Any, topic: str | None) -> tuple[str | Unreadable | None, list[Subscription] | Unreadable]:
    if topic is None:
        return None, []
    try:
        policy: str | Unreadable | None = sns.get_topic_attributes(TopicArn=topic)["Attributes"].get("Policy")
    except AwsError:
        policy = UNREADABLE
    try:
        subscriptions = [
            Subscription(s["Protocol"], s["Endpoint"], s["SubscriptionArn"].startswith("arn:"))
            for page in sns.get_paginator("list_subscriptions_by_topic").paginate(TopicArn=topic)
            for s in page["Subscriptions"]
        ]
    except AwsError:
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
    except (*AwsError, ValueError, TypeError, KeyError):
        return None
    return ConcurrencyFacts(
        int(limit["ConcurrentExecutions"]), int(limit["UnreservedConcurrentExecutions"]), wanted, held
    )


def _reserved(lambda_: Any, function: str) -> int:
    try:
        return int(lambda_.get_function_concurrency(FunctionName=function).get("ReservedConcurrentExecutions") or 0)
    except AwsError as exc:
        if _missing(exc, "ResourceNotFoundException"):
            return 0  # the function is gone (a rolled-back create): it holds nothing
        raise


def association_facts(ssm: Any, association: str | None) -> AssociationFacts | Unreadable | None:
    if association is None:
        return None
    try:
        overview = ssm.describe_association(AssociationId=association)["AssociationDescription"].get("Overview", {})
    except AwsError:
        return UNREADABLE
    counts = {str(k): int(v) for k, v in overview.get("AssociationStatusAggregatedCount", {}).items()}
    return AssociationFacts(association, overview.get("Status"), counts)


Connect = Callable[[str], Any]  # a service's client in the region checked


def deploy_findings(
    connect: Connect, region: str, name: str, stack: StackFacts | Unreadable | None, deadline: float | None = None
) -> tuple[list[Finding], AssociationFacts | Unreadable | None]:
    """The stack's own checks in one region (the schedule, alarm topic and concurrency only where it exists),
    and its agent association's facts (shown in the signals findings: deploy_checks.with_association).
    `deadline` (time.monotonic()): nothing is asked past it; the checks not reached are unknown."""
    findings = check_stack(region, name, stack, idle_reaper.__version__)
    if not isinstance(stack, StackFacts):
        return findings, None
    outputs = stack.outputs

    def in_time() -> bool:
        return deadline is None or time.monotonic() < deadline

    def not_reached(*checks: str) -> list[Finding]:
        return [unknown(c, OUT_OF_TIME) for c in checks]

    schedule = outputs.get(SCHEDULE_OUTPUT)
    if in_time():
        findings.append(check_schedule(region, schedule, rule_state(connect("events"), schedule)))
    else:
        findings += not_reached("deploy.schedule")
    topic = outputs.get(TOPIC_OUTPUT)
    if in_time():
        findings += check_alarm_topic(region, topic, *topic_facts(connect("sns"), topic))
    else:
        findings += not_reached("deploy.alarm_topic", "deploy.alarm_subscribers")
    if in_time():
        findings.append(
            check_concurrency(region, concurrency_facts(connect("cloudformation"), connect("lambda"), name))
        )
    else:
        findings += not_reached("deploy.concurrency")
    association_id = outputs.get(ASSOCIATION_OUTPUT)
    association = (
        association_facts(connect("ssm"), association_id) if in_time() else (UNREADABLE if association_id else None)
    )
    return findings, association
