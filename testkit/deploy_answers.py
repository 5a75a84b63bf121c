"""A deployed idle-reaper stack in moto, as `idle-reaper doctor` sees it, and AWS's real answers where moto has
none or answers otherwise.

moto has no Lambda GetAccountSettings and no SSM associations, lists every region as enabled, and lists an
e-mail subscription as confirmed the moment it is made. Real AWS answers GetAccountSettings with the account's
quota and what is left unreserved (the quota less every function's reservation in the region),
DescribeAssociation with the association's Overview (its last status and the instances per status),
DescribeRegions with the regions the account has enabled (one unless a test enables more, which also spares
each test waking moto's EC2 in thirty regions), and lists an unconfirmed subscription with the SubscriptionArn
"PendingConfirmation". `DeployAnswers` registers on boto3's default session (as testkit/ec2_answers.py does),
so every client created inside `real_deploy_answers()` meets these answers first; it also counts every call
by region and operation.

`deploy_stack` creates, through moto's CloudFormation, what infra/stack.py creates that the doctor reads: the
stack with its outputs (Version, SweepScheduleName, AlarmTopicArn, GpuAgentAssociationId), the sweep's schedule
rule, the alarm topic with the stack's topic policy and the alarm relay's subscription, and the functions with
the stack's reservations (sweep 1, Slack 10).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import boto3

import idle_reaper
from testkit.ec2_answers import Answer, Ec2Answers, _Http

ACCOUNT = "123456789012"
STACK = "IdleReaper"
ASSOCIATION_ID = "5b1e0a7c-3d2f-4e8a-9c61-0f2b7d4e8a13"


# CDK's statement (infra/constructs.py, ReaperMonitoring._alarm_topic) beside enforce_ssl's deny.
def topic_policy(topic: str, region: str) -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "AllowPublishThroughSSLOnly",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "sns:Publish",
                    "Resource": topic,
                    "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                },
                {
                    "Sid": "CloudWatchAlarmsOfThisAccount",
                    "Effect": "Allow",
                    "Principal": {"Service": "cloudwatch.amazonaws.com"},
                    "Action": "sns:Publish",
                    "Resource": topic,
                    "Condition": {
                        "StringEquals": {"aws:SourceAccount": ACCOUNT},
                        "ArnLike": {"aws:SourceArn": f"arn:aws:cloudwatch:{region}:{ACCOUNT}:alarm:*"},
                    },
                },
            ],
        }
    )


def association(status: str = "Success", counts: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A DescribeAssociation AssociationDescription as SSM answers it."""
    return {
        "Name": "IdleReaper-GpuAgentInstallAndConfigure-AbCdEf012345",
        "AssociationId": ASSOCIATION_ID,
        "AssociationVersion": "1",
        "Targets": [{"Key": "tag:idle-reaper:gpu-agent", "Values": ["install"]}],
        "ScheduleExpression": "rate(1 day)",
        "Overview": {
            "Status": status,
            "DetailedStatus": status,
            "AssociationStatusAggregatedCount": dict(counts if counts is not None else {status: 3}),
        },
        "MaxErrors": "100%",
        "MaxConcurrency": "25%",
    }


def association_missing(association_id: str) -> Answer:
    return Answer("AssociationDoesNotExist", f"Association {association_id} does not exist.")


def access_denied(service: str, action: str) -> Answer:
    return Answer(
        "AccessDeniedException",
        f"User: arn:aws:sts::{ACCOUNT}:assumed-role/admin/doctor is not authorized to perform: {service}:{action}",
        403,
    )


@dataclass
class DeployAnswers:
    """`concurrency_limit`: the account's Lambda quota per region. `enabled_regions`: what DescribeRegions
    lists. `associations`: id -> DescribeAssociation's
    answer. `pending`: subscription endpoints SNS lists unconfirmed. `fail`: operation -> an error answer."""

    concurrency_limit: int = 1000
    # The regions this account has enabled: DescribeRegions lists only those (moto lists every region there is).
    enabled_regions: list[str] = field(default_factory=lambda: ["us-east-1"])
    associations: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)
    fail: dict[str, Answer] = field(default_factory=dict)
    calls: Counter[tuple[str, str]] = field(default_factory=Counter)  # (region, operation) -> calls
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, operation: str, region: str | None = None) -> int:
        return sum(n for (r, op), n in self.calls.items() if op == operation and region in (None, r))

    def before_call(self, model: Any, params: Mapping[str, Any], request_signer: Any = None, **_: Any) -> Any:
        operation = model.name
        region = request_signer.region_name if request_signer is not None else ""
        with self._lock:
            self.calls[(region, operation)] += 1
        if operation in self.fail:
            return Ec2Answers._error(self.fail[operation])
        service = model.service_model.service_name
        if service == "ec2" and operation == "DescribeRegions":
            regions = [
                {"RegionName": r, "Endpoint": f"ec2.{r}.amazonaws.com", "OptInStatus": "opt-in-not-required"}
                for r in self.enabled_regions
            ]
            return _Http(200), {"Regions": regions}
        if service == "lambda" and operation == "GetAccountSettings":
            return _Http(200), self._account_settings(region)
        if service == "ssm" and operation == "DescribeAssociation":
            wanted = json.loads(params.get("body") or b"{}").get("AssociationId", "")
            if wanted not in self.associations:
                return Ec2Answers._error(association_missing(wanted))
            return _Http(200), {"AssociationDescription": self.associations[wanted]}
        return None

    def after_call(self, parsed: dict[str, Any], **_: Any) -> None:
        for subscription in parsed.get("Subscriptions", []):
            if subscription.get("Endpoint") in self.pending:
                subscription["SubscriptionArn"] = "PendingConfirmation"

    def _account_settings(self, region: str) -> dict[str, Any]:
        from moto.awslambda.models import lambda_backends

        reserved = sum(int(f.reserved_concurrency or 0) for f in lambda_backends[ACCOUNT][region].list_functions())
        return {
            "AccountLimit": {
                "TotalCodeSize": 80530636800,
                "CodeSizeUnzipped": 262144000,
                "CodeSizeZipped": 52428800,
                "ConcurrentExecutions": self.concurrency_limit,
                "UnreservedConcurrentExecutions": self.concurrency_limit - reserved,
            },
            "AccountUsage": {"TotalCodeSize": 0, "FunctionCount": 0},
        }


@contextmanager
def real_deploy_answers() -> Iterator[DeployAnswers]:
    answers = DeployAnswers()
    session: Any = boto3._get_default_session()._session
    session.register("before-call", answers.before_call, unique_id="idle-reaper-real-deploy-answers")
    session.register(
        "after-call.sns.ListSubscriptionsByTopic", answers.after_call, unique_id="idle-reaper-real-sns-subscriptions"
    )
    try:
        yield answers
    finally:
        session.unregister("before-call", unique_id="idle-reaper-real-deploy-answers")
        session.unregister("after-call.sns.ListSubscriptionsByTopic", unique_id="idle-reaper-real-sns-subscriptions")


def _function(role: str, handler: str, reserved: int | None = None) -> dict[str, Any]:
    props: dict[str, Any] = {
        "Runtime": "python3.12",
        "Handler": handler,
        "Role": {"Fn::GetAtt": [role, "Arn"]},
        "Code": {"ZipFile": "def handler(event, context):\n    return None\n"},
    }
    if reserved:
        props["ReservedConcurrentExecutions"] = reserved
    return {"Type": "AWS::Lambda::Function", "Properties": props}


def template(version: str | None, *, sweep_reserved: int = 1, slack_reserved: int = 10) -> dict[str, Any]:
    trust = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}
        ],
    }
    outputs: dict[str, Any] = {
        "SweepScheduleName": {"Value": {"Ref": "Schedule83A77FD1"}},
        "AlarmTopicArn": {"Value": {"Ref": "MonitoringAlarms2E8D3F52"}},
        "GpuAgentAssociationId": {"Value": ASSOCIATION_ID},
    }
    if version is not None:
        outputs["Version"] = {"Value": version}
    return {
        "Resources": {
            "SweepRole": {"Type": "AWS::IAM::Role", "Properties": {"AssumeRolePolicyDocument": trust}},
            "SweepFunction": _function("SweepRole", "idle_reaper.handlers.sweep.handler", sweep_reserved),
            "SlackFunction": _function("SweepRole", "idle_reaper.handlers.slack.handler", slack_reserved),
            "AlarmRelayFunction": _function("SweepRole", "idle_reaper.handlers.alarms.handler"),
            "Schedule83A77FD1": {
                "Type": "AWS::Events::Rule",
                "Properties": {"ScheduleExpression": "rate(5 minutes)", "State": "ENABLED"},
            },
            "MonitoringAlarms2E8D3F52": {
                "Type": "AWS::SNS::Topic",
                "Properties": {"DisplayName": "idle-reaper alarms"},
            },
        },
        "Outputs": outputs,
    }


def deploy_stack(
    answers: DeployAnswers,
    region: str = "us-east-1",
    *,
    version: str | None = idle_reaper.__version__,
    name: str = STACK,
    **reservations: int,
) -> dict[str, str]:
    """The stack in moto as a healthy deploy leaves it; its outputs."""
    cloudformation: Any = boto3.client("cloudformation", region_name=region)
    cloudformation.create_stack(StackName=name, TemplateBody=json.dumps(template(version, **reservations)))
    stack = cloudformation.describe_stacks(StackName=name)["Stacks"][0]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    topic = outputs["AlarmTopicArn"]
    sns: Any = boto3.client("sns", region_name=region)
    sns.set_topic_attributes(TopicArn=topic, AttributeName="Policy", AttributeValue=topic_policy(topic, region))
    relay = next(
        r["PhysicalResourceId"]
        for r in cloudformation.list_stack_resources(StackName=name)["StackResourceSummaries"]
        if r["LogicalResourceId"] == "AlarmRelayFunction"
    )
    relay_arn = boto3.client("lambda", region_name=region).get_function(FunctionName=relay)["Configuration"][
        "FunctionArn"
    ]
    sns.subscribe(TopicArn=topic, Protocol="lambda", Endpoint=relay_arn)
    answers.associations[ASSOCIATION_ID] = association()
    return outputs


def _moto_stack(region: str, name: str) -> Any:
    from moto.cloudformation.models import cloudformation_backends

    return next(s for s in cloudformation_backends[ACCOUNT][region].stacks.values() if s.name == name)


def set_stack_status(status: str, region: str = "us-east-1", name: str = STACK) -> None:
    """What CloudFormation reports of a stack moto always creates cleanly (its backend runs in this process)."""
    _moto_stack(region, name).status = status


def set_stack_version(version: str, region: str = "us-east-1", name: str = STACK) -> None:
    """The Version output of a stack deployed from another release."""
    _moto_stack(region, name).output_map["Version"].value = version
