"""`idle-reaper doctor`'s deploy checks: the stack, its schedule, its alarm topic, the Lambda concurrency it
reserves, the regions it covers, its agent association and its Slack endpoint, decided from gathered facts.

Pure, as core/doctor.py: a fact that could not be gathered is None (or UNREADABLE) and makes its finding
"unknown", never "ok". Every finding of a region is labelled with it (`in_region`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from idle_reaper.core.doctor import Finding, listed, unknown

UNREADABLE: Literal["unreadable"] = "unreadable"
Unreadable = Literal["unreadable"]

# The stack's outputs the doctor reads (infra/stack.py writes them; tests/infra keeps the two equal).
VERSION_OUTPUT = "Version"
SCHEDULE_OUTPUT = "SweepScheduleName"
TOPIC_OUTPUT = "AlarmTopicArn"
ASSOCIATION_OUTPUT = "GpuAgentAssociationId"

UNRESERVED_MINIMUM = 100  # Lambda keeps at least this many executions unreserved in every account and region
CLOUDWATCH = "cloudwatch.amazonaws.com"


def in_region(region: str, findings: Sequence[Finding]) -> list[Finding]:
    """Each finding labelled with the region it is about (the message starts with it)."""
    return [f.model_copy(update={"message": f"{region}: {f.message}"}) for f in findings]


# ---------------------------------------------------------------------------------------------
# The stack


@dataclass(frozen=True)
class StackFacts:
    name: str
    status: str  # CloudFormation's StackStatus
    reason: str | None  # StackStatusReason
    outputs: Mapping[str, str]


FAILED_STATES = frozenset(
    {
        "CREATE_FAILED",
        "ROLLBACK_IN_PROGRESS",
        "ROLLBACK_FAILED",
        "ROLLBACK_COMPLETE",
        "DELETE_FAILED",
        "UPDATE_FAILED",
        "UPDATE_ROLLBACK_FAILED",
        "IMPORT_ROLLBACK_FAILED",
        "DELETE_IN_PROGRESS",
        "DELETE_COMPLETE",
    }
)
# The last update failed and was rolled back: the stack runs, but as the version before the update.
ROLLED_BACK_STATES = frozenset({"UPDATE_ROLLBACK_COMPLETE", "IMPORT_ROLLBACK_COMPLETE"})


def check_stack(region: str, name: str, stack: StackFacts | Unreadable | None, installed: str) -> list[Finding]:
    """deploy.stack (exists and is healthy) and deploy.version (it is the version of this command)."""
    events = f"aws cloudformation describe-stack-events --stack-name {name} --region {region}"
    if stack == UNREADABLE:
        return [unknown("deploy.stack", f"the stack {name} could not be described")]
    if stack is None:
        return [
            Finding(
                check="deploy.stack",
                status="fail",
                subjects=(name, region),
                message=f"no stack {name} in {region}: nothing here is swept",
                fix=f"deploy it: cdk deploy -c regions={region} (add the region to the regions you deploy), or "
                "run the doctor with --region where the stack is (--stack NAME for another prefix)",
            )
        ]
    why = f" ({stack.reason})" if stack.reason else ""
    out: list[Finding]
    if stack.status in FAILED_STATES:
        out = [
            Finding(
                check="deploy.stack",
                status="fail",
                subjects=(name, region),
                message=f"the stack {name} is {stack.status}{why}: its sweep and Slack endpoint may not exist",
                fix=f"{events} (the first FAILED event names the cause); fix it, then cdk deploy"
                + (
                    f" (a {stack.status} stack must be deleted first: aws cloudformation delete-stack "
                    f"--stack-name {name} --region {region})"
                    if stack.status == "ROLLBACK_COMPLETE"
                    else ""
                ),
            )
        ]
    elif stack.status in ROLLED_BACK_STATES:
        out = [
            Finding(
                check="deploy.stack",
                status="warn",
                subjects=(name, region),
                message=f"the stack {name}'s last update failed and was rolled back ({stack.status}{why}): "
                "it runs the version deployed before",
                fix=f"{events} (the first FAILED event names the cause); fix it, then cdk deploy",
            )
        ]
    elif stack.status.endswith("_IN_PROGRESS"):
        out = [unknown("deploy.stack", f"the stack {name} is {stack.status}", "run the doctor again when it ends")]
    else:
        out = [Finding(check="deploy.stack", status="ok", message=f"the stack {name} is {stack.status}")]
    deployed = stack.outputs.get(VERSION_OUTPUT)
    if deployed == installed:
        out.append(Finding(check="deploy.version", status="ok", message=f"the stack is version {installed}"))
    else:
        out.append(
            Finding(
                check="deploy.version",
                status="warn",
                subjects=(name,),
                message=f"the stack {name} is "
                + (f"version {deployed}" if deployed else "of a version before 0.1.0 (no Version output)")
                + f", this command {installed}: some checks may not match what it runs",
                fix=f"deploy this version (cdk deploy), or run the doctor of the stack's version "
                f"(pip install idle-reaper=={deployed})"
                if deployed
                else "deploy this version: cdk deploy",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# The schedule


def check_schedule(region: str, rule: str | None, state: str | Unreadable | None) -> Finding:
    """The EventBridge rule that starts every sweep is enabled. `state` None: the rule is gone."""
    check = "deploy.schedule"
    if rule is None:
        return unknown(check, f"the stack has no {SCHEDULE_OUTPUT} output (deployed before 0.1.0)", "cdk deploy")
    if state == UNREADABLE:
        return unknown(check, f"the rule {rule} could not be described")
    if state is None:
        return Finding(
            check=check,
            status="fail",
            subjects=(rule,),
            message=f"the sweep's schedule rule {rule} no longer exists: no sweep runs",
            fix="cdk deploy (it recreates the rule)",
        )
    if state != "ENABLED":
        return Finding(
            check=check,
            status="fail",
            subjects=(rule,),
            message=f"the sweep's schedule rule {rule} is {state}: no sweep runs",
            fix=f"aws events enable-rule --name {rule} --region {region}",
        )
    return Finding(check=check, status="ok", message=f"the sweep's schedule rule {rule} is enabled")


# ---------------------------------------------------------------------------------------------
# The alarm topic


def _listed_values(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _names_cloudwatch(principal: Any) -> bool:
    if principal == "*":
        return True
    if not isinstance(principal, dict):
        return False
    return any(p == CLOUDWATCH for p in _listed_values(principal.get("Service", []))) or "*" in _listed_values(
        principal.get("AWS", [])
    )


def _covers_publish(actions: Any) -> bool:
    return any(str(a).lower() in ("sns:publish", "sns:*", "*") for a in _listed_values(actions))


def lets_cloudwatch_publish(policy: Mapping[str, Any]) -> bool:
    """Whether a topic policy lets CloudWatch alarms publish: an Allow of sns:Publish to the CloudWatch service
    (or to everyone in the account, as SNS's default policy does), and no unconditional Deny of it. Conditions
    on an Allow (source account, alarm ARNs: the stack's own) are taken as the alarms' to meet; a conditional
    Deny (enforce_ssl's aws:SecureTransport) does not apply to CloudWatch, which publishes over TLS."""
    statements = [s for s in _listed_values(policy.get("Statement", [])) if isinstance(s, dict)]

    def matching(effect: str) -> list[dict[str, Any]]:
        return [
            s
            for s in statements
            if s.get("Effect") == effect and _names_cloudwatch(s.get("Principal")) and _covers_publish(s.get("Action"))
        ]

    return bool(matching("Allow")) and not any("Condition" not in s for s in matching("Deny"))


@dataclass(frozen=True)
class Subscription:
    protocol: str
    endpoint: str
    confirmed: bool  # SNS lists an unconfirmed one with SubscriptionArn "PendingConfirmation"


def check_alarm_topic(
    region: str,
    topic: str | None,
    policy: str | Unreadable | None,
    subscriptions: Sequence[Subscription] | Unreadable,
) -> list[Finding]:
    """deploy.alarm_topic (CloudWatch may publish) and deploy.alarm_subscribers (someone receives them)."""
    if topic is None:
        why = f"the stack has no {TOPIC_OUTPUT} output"
        return [unknown("deploy.alarm_topic", why), unknown("deploy.alarm_subscribers", why)]
    out: list[Finding] = []
    document: Any = None
    if isinstance(policy, str) and policy != UNREADABLE:
        try:
            document = json.loads(policy)
        except ValueError:
            document = None
    if policy == UNREADABLE:
        out.append(unknown("deploy.alarm_topic", f"the topic {topic} could not be read"))
    elif isinstance(document, dict) and lets_cloudwatch_publish(document):
        out.append(Finding(check="deploy.alarm_topic", status="ok", message=f"CloudWatch may publish to {topic}"))
    else:
        out.append(
            Finding(
                check="deploy.alarm_topic",
                status="fail",
                subjects=(topic,),
                message=f"the topic policy of {topic} does not let CloudWatch ({CLOUDWATCH}) publish: every "
                'alarm action fails ("not authorized to perform: SNS:Publish") and no alarm reaches anyone',
                fix="cdk deploy (the stack's policy allows it), or add to the topic policy a statement allowing "
                f'{{"Service": "{CLOUDWATCH}"}} the action sns:Publish on {topic}: aws sns set-topic-attributes '
                f"--topic-arn {topic} --attribute-name Policy --attribute-value file://policy.json --region {region}",
            )
        )
    if subscriptions == UNREADABLE:
        out.append(unknown("deploy.alarm_subscribers", f"the subscriptions of {topic} could not be listed"))
        return out
    confirmed = [s for s in subscriptions if s.confirmed]
    pending = [f"{s.protocol} {s.endpoint}" for s in subscriptions if not s.confirmed]
    confirm = "open the 'AWS Notification - Subscription Confirmation' e-mail and click Confirm subscription"
    if not confirmed:
        out.append(
            Finding(
                check="deploy.alarm_subscribers",
                status="fail",
                subjects=(topic, *pending),
                message=f"the alarm topic {topic} has no confirmed subscription: alarms reach nobody"
                + (f" ({len(pending)} pending: {listed(pending)})" if pending else ""),
                fix=confirm
                if pending
                else f"cdk deploy (it subscribes the Slack alarm relay; -c alarmEmail=ADDRESS adds an e-mail), or "
                f"aws sns subscribe --topic-arn {topic} --protocol email --notification-endpoint ADDRESS "
                f"--region {region}",
            )
        )
    elif pending:
        out.append(
            Finding(
                check="deploy.alarm_subscribers",
                status="warn",
                subjects=tuple(pending),
                message=f"{len(pending)} subscription(s) of {topic} not confirmed, so they get no alarm: "
                + listed(pending),
                fix=confirm,
            )
        )
    else:
        out.append(
            Finding(
                check="deploy.alarm_subscribers",
                status="ok",
                message=f"{len(confirmed)} confirmed subscription(s) receive the alarms",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Lambda concurrency


@dataclass(frozen=True)
class ConcurrencyFacts:
    limit: int  # AccountLimit.ConcurrentExecutions
    unreserved: int  # AccountLimit.UnreservedConcurrentExecutions
    wanted: Mapping[str, int]  # the stack's functions -> the reservation its template asks for
    held: Mapping[str, int]  # the stack's functions -> what they reserve now (0: none, or the function is gone)


def check_concurrency(region: str, facts: ConcurrencyFacts | None) -> Finding:
    """The account's concurrency quota leaves room for what the stack reserves, with the 100 executions Lambda
    keeps unreserved: a new account's quota (often 10) makes the deploy fail ("decreases account's
    UnreservedConcurrentExecution below its minimum value of [100]")."""
    check = "deploy.concurrency"
    if facts is None:
        return unknown(check, "the account's Lambda settings or the stack's functions could not be read")
    wanted = sum(facts.wanted.values())
    missing = sum(max(n - facts.held.get(f, 0), 0) for f, n in facts.wanted.items())
    room = facts.unreserved - missing
    reserving = ", ".join(f"{f} {n}" for f, n in sorted(facts.wanted.items()) if n) or "nothing"
    if room < UNRESERVED_MINIMUM:
        needed = facts.limit - room + UNRESERVED_MINIMUM
        return Finding(
            check=check,
            status="fail",
            subjects=(region, *sorted(f for f, n in facts.wanted.items() if n > facts.held.get(f, 0))),
            message=f"the Lambda concurrency quota {facts.limit} ({facts.unreserved} unreserved) has no room for "
            f"the {missing} execution(s) the stack still has to reserve ({reserving}) while keeping the "
            f"{UNRESERVED_MINIMUM} Lambda requires unreserved: the deploy fails",
            fix=f"aws service-quotas request-service-quota-increase --service-code lambda --quota-code L-B99A9384 "
            f"--desired-value {max(needed, 1000)} --region {region}; or deploy with fewer reserved "
            "(-c slackReservedConcurrency=0 -c sweepReservedConcurrency=0)",
        )
    return Finding(
        check=check,
        status="ok",
        message=f"the Lambda concurrency quota {facts.limit} holds the stack's reservation of {wanted} "
        f"({reserving}) with {facts.unreserved - missing} unreserved",
    )


# ---------------------------------------------------------------------------------------------
# Regions


@dataclass(frozen=True)
class RegionScan:
    enabled: int  # regions enabled for the account
    with_stack: Sequence[str]
    opted_in_without_stack: Mapping[str, int]  # region -> running opted-in machines, where there is no stack
    unreadable: Sequence[str]  # regions that could not be asked (denied, or an error)


def check_regions(scan: RegionScan | None) -> Finding:
    check = "deploy.regions"
    if scan is None:
        return unknown(check, "the account's regions could not be listed")
    lonely = sorted((r, n) for r, n in scan.opted_in_without_stack.items() if n)
    if lonely:
        return Finding(
            check=check,
            status="warn",
            subjects=tuple(r for r, _ in lonely),
            message=f"{len(lonely)} region(s) with opted-in machines but no stack (never swept): "
            + listed([f"{r} ({n} machine(s))" for r, n in lonely]),
            fix="add them to the regions you deploy: cdk deploy -c regions="
            + ",".join([*scan.with_stack, *(r for r, _ in lonely)]),
        )
    if scan.unreadable:
        return unknown(check, f"{len(scan.unreadable)} region(s) could not be read: {listed(list(scan.unreadable))}")
    return Finding(
        check=check,
        status="ok",
        message=f"of {scan.enabled} enabled regions, {len(scan.with_stack)} with a stack "
        f"({', '.join(scan.with_stack) or 'none'}); no opted-in machines elsewhere",
    )


# ---------------------------------------------------------------------------------------------
# The agent association (shown in the signals findings)


@dataclass(frozen=True)
class AssociationFacts:
    association_id: str
    status: str | None  # Overview.Status: Success, Failed, Pending
    counts: Mapping[str, int]  # Overview.AssociationStatusAggregatedCount: status -> instances


AGENT_CHECKS = ("signals.gpu", "signals.collector")


def with_association(findings: Sequence[Finding], association: AssociationFacts | Unreadable | None) -> list[Finding]:
    """The GPU agent and collector findings, with the State Manager association's last status (the one
    association that installs both) where the stack has one."""
    if association is None:
        return list(findings)
    if association == UNREADABLE:
        note = "the State Manager association's status could not be read"
    else:
        counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(association.counts.items())) or "no instances"
        note = (
            f"State Manager association {association.association_id}: last status "
            f"{association.status or 'none yet'} ({counts})"
        )
        if association.counts.get("Failed"):
            note += (
                f"; aws ssm list-association-executions --association-id {association.association_id} "
                "names the failures"
            )
    return [
        f.model_copy(update={"message": f"{f.message}; {note}"}) if f.check in AGENT_CHECKS else f for f in findings
    ]


# ---------------------------------------------------------------------------------------------
# The Slack endpoint


@dataclass(frozen=True)
class EndpointAnswer:
    status: int | None  # None: no HTTP answer at all
    body: str
    error: str | None = None  # why there was no answer


PING_ANSWER = "idle-reaper only understands its own buttons."  # the handler's answer to a signed non-button


def check_endpoint(url: str, answer: EndpointAnswer | None) -> Finding:
    """A signed interaction that is no button (the harmless ping) is answered 200 with the handler's ephemeral
    reply; anything else names what came back."""
    check = "slack.endpoint"
    if answer is None:
        return unknown(check, "there is no signing secret to sign the ping with")
    if answer.status is None:
        return Finding(
            check=check,
            status="fail",
            subjects=(url,),
            message=f"{url} did not answer ({answer.error}): Slack cannot reach it either",
            fix="set the Slack app's request URLs to the stack's SlackFunctionUrl output (slack/manifest.yml)",
        )
    try:
        body = json.loads(answer.body)
    except ValueError:
        body = None
    if answer.status == 200 and isinstance(body, dict) and body.get("text") == PING_ANSWER:
        return Finding(check=check, status="ok", message=f"{url} answers a signed ping as the handler does")
    fix = {
        401: "the endpoint's signing secret differs from the one read here: put the Slack app's Signing Secret "
        "into the stack's Slack secret (SlackSecretName output) as signing_secret",
        503: "the endpoint has no Slack secret: put bot_token and signing_secret into the stack's Slack secret",
    }.get(
        answer.status,
        "set the Slack app's request URLs to the stack's SlackFunctionUrl output and read the Slack function's logs",
    )
    return Finding(
        check=check,
        status="fail",
        subjects=(url,),
        message=f"{url} answered a signed ping with HTTP {answer.status}: {answer.body[:200]!r}",
        fix=fix,
    )
