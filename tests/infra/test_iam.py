"""IAM checks on the synthesized policies, so what AWS would refuse is caught before a deploy.

1. parliament lints every identity policy against AWS's own action, resource and condition definitions
   (it catches an ARN pattern no real resource has, an unknown action, a condition key an action ignores).
2. Every AWS call the runtime makes is evaluated, with a real example ARN and the context keys the call
   carries, against the role that makes it; so are the calls a role must not be able to make."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from iam_policy import ACCOUNT, Environment, Request, Statement, condition_holds, decide, role_statements
from synthesis import REGIONS, Synth

pytestmark = pytest.mark.infra

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME, OTHER = REGIONS  # the stack under test lives in HOME; its Slack endpoint also acts in OTHER
MANAGED_TAG = "aws:ResourceTag/idle-reaper:managed"


# -- real example ARNs of the calls the code makes ---------------------------------------------------


def instance(region: str) -> str:
    return f"arn:aws:ec2:{region}:{ACCOUNT}:instance/i-0abc123def4567890"


def group(region: str) -> str:
    return (
        f"arn:aws:autoscaling:{region}:{ACCOUNT}:autoScalingGroup:"
        "1c0e5b1f-7d2a-4f3e-9a6b-2c8d4e6f8a0b:autoScalingGroupName/ml-workers"
    )


def notebook(region: str) -> str:
    return f"arn:aws:sagemaker:{region}:{ACCOUNT}:notebook-instance/team-ml-gpu-nb"


def sagemaker(region: str, kind: str, name: str = "demo-llm") -> str:
    """An endpoint, endpoint-config or model ARN (the issue 46 endpoints)."""
    return f"arn:aws:sagemaker:{region}:{ACCOUNT}:{kind}/{name}"


OPTING_IN = {"aws:RequestTag/idle-reaper:managed": "true", "aws:TagKeys": ("Team", "Owner", "idle-reaper:managed")}


def studio_app(region: str, app_type: str = "jupyterlab") -> str:
    """A Studio app's ARN (app/<domain>/<space>/<type>/<name>)."""
    return f"arn:aws:sagemaker:{region}:{ACCOUNT}:app/d-abc123/alice-space/{app_type}/default"


def parameter(region: str, name: str) -> str:
    return f"arn:aws:ssm:{region}:{ACCOUNT}:parameter/idle-reaper/{name}"


def table(region: str, index: str | None = None) -> str:
    return f"arn:aws:dynamodb:{region}:{ACCOUNT}:table/idle-reaper-state" + (f"/index/{index}" if index else "")


def secret(region: str) -> str:
    return f"arn:aws:secretsmanager:{region}:{ACCOUNT}:secret:idle-reaper/slack-Ab12Cd"


def function(region: str, name: str) -> str:
    return f"arn:aws:lambda:{region}:{ACCOUNT}:function:{name}"


def state_machine(region: str, name: str) -> str:
    return f"arn:aws:states:{region}:{ACCOUNT}:stateMachine:{name}"


FANOUT = "idle-reaper-sweep"  # the sharded sweep's state machine


def call(action: str, resource: str, region: str = HOME, **context: str | tuple[str, ...]) -> Request:
    return Request(action, resource, {"aws:RequestedRegion": region, **context})


def on_managed(action: str, resource: str, region: str = HOME) -> Request:
    """A write on a machine or group that opted in (and, like production machines, has a Team tag)."""
    return call(action, resource, region, **{MANAGED_TAG: "true", "aws:ResourceTag/Team": "ml"})


def fleet_reads(region: str) -> list[Request]:
    return [
        call("ec2:DescribeInstances", "*", region),
        call("ec2:DescribeAvailabilityZones", "*", region),
        call("ec2:DescribeSpotInstanceRequests", "*", region),
        call("ec2:DescribeCapacityReservations", "*", region),
        call("autoscaling:DescribeAutoScalingGroups", "*", region),
        call("cloudwatch:GetMetricData", "*", region),
        call("sagemaker:ListNotebookInstances", "*", region),
        call("sagemaker:ListTags", notebook(region), region),
        call("sagemaker:DescribeNotebookInstance", notebook(region), region),
        call("sagemaker:ListApps", "*", region),
        call("sagemaker:DescribeSpace", f"arn:aws:sagemaker:{region}:{ACCOUNT}:space/d-abc123/alice-space", region),
        call("sagemaker:ListTags", f"arn:aws:sagemaker:{region}:{ACCOUNT}:space/d-abc123/alice-space", region),
        call("sagemaker:DescribeDomain", f"arn:aws:sagemaker:{region}:{ACCOUNT}:domain/d-abc123", region),
        call("sagemaker:ListEndpoints", "*", region),
        call("sagemaker:ListTags", sagemaker(region, "endpoint"), region),
        call("sagemaker:DescribeEndpoint", sagemaker(region, "endpoint"), region),
        call("sagemaker:DescribeEndpointConfig", sagemaker(region, "endpoint-config"), region),
        call("sagemaker:DescribeModel", sagemaker(region, "model"), region),
        call("application-autoscaling:DescribeScalableTargets", "*", region),
    ]


def policy_reads(region: str) -> list[Request]:
    return [
        call("ssm:GetParameter", parameter(region, "settings"), region),
        call("ssm:GetParametersByPath", parameter(region, "teams"), region),
        call("ssm:GetParameter", parameter(region, "teams/ml"), region),
    ]


# What each function calls (grep lambdas/idle_reaper for `self.ec2.`, `.dynamodb.`, `get_paginator(`).
SWEEP_CALLS = [
    *fleet_reads(HOME),
    on_managed("ec2:StopInstances", instance(HOME)),
    on_managed("ec2:TerminateInstances", instance(HOME)),  # machines EC2 cannot stop, on the team's opt-in
    on_managed("sagemaker:StopNotebookInstance", notebook(HOME)),
    on_managed("sagemaker:DeleteEndpoint", sagemaker(HOME, "endpoint")),
    on_managed("sagemaker:DeleteApp", studio_app(HOME)),  # a team that asked for it (studio_apps: delete)
    on_managed("sagemaker:DeleteApp", studio_app(HOME, "codeeditor")),
    on_managed("autoscaling:SetInstanceProtection", group(HOME)),
    on_managed("autoscaling:TerminateInstanceInAutoScalingGroup", group(HOME)),
    *policy_reads(HOME),
    call("dynamodb:BatchGetItem", table(HOME)),  # load
    call("dynamodb:PutItem", table(HOME)),  # save, audit, claim_once, put_lookup
    call("dynamodb:GetItem", table(HOME)),  # get_lookup (a shard worker: its manifest)
    call("dynamodb:Query", table(HOME)),  # entries: the quiet-hours stops of an account and region
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("once#policy:/idle-reaper/teams/ml",)}),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("entries#quiet-stops#hub",)}),
    call("secretsmanager:GetSecretValue", secret(HOME)),
]
# The daily count of running instances in regions without a stack (HOME is the first listed region).
COUNT_UNWATCHED = [call("ec2:DescribeRegions", "*"), call("ec2:DescribeInstances", "*", "ap-south-1")]
# The scheduled sweep is also the planner: a fleet larger than one shard goes to the state machine.
PLANNER_CALLS = [
    *SWEEP_CALLS,
    *COUNT_UNWATCHED,
    call("states:StartExecution", state_machine(HOME, FANOUT)),
    # The alarm relay's own errors alarm, which the sweep tells the admins of (sweep/doctor.py).
    call("cloudwatch:DescribeAlarms", f"arn:aws:cloudwatch:{HOME}:{ACCOUNT}:alarm:idle-reaper-alarm-relay-errors"),
]
GATHER_CALLS = [
    call("dynamodb:GetItem", table(HOME)),  # the shards' results, the failed-shard count, the notices' index
    # ... and, on the day's doctor, the shards' GPU facts, the GPU check's claims and memory
    call("dynamodb:PutItem", table(HOME)),  # the failed-shard count, a told notice off its record
    call("dynamodb:BatchGetItem", table(HOME)),  # the records of the queued stop notices (sweep/notices.py)
    # A cleared GPU failure's claim (sweep/doctor_daily.py tell_new_failures).
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("once#doctor#signals.gpu#0a1b2c",)}),
    call("ssm:GetParameter", parameter(HOME, "settings")),  # who the admins are
    call("secretsmanager:GetSecretValue", secret(HOME)),  # to tell them
]
# `/idle-reaper doctor` (sweep/doctor.py run_checks) from the Slack endpoint, in its own region.
DOCTOR_CALLS = [
    call("ec2:DescribeInstances", "*"),
    call("ec2:DescribeAvailabilityZones", "*"),
    call("autoscaling:DescribeAutoScalingGroups", "*"),
    call("autoscaling:DescribeTags", "*"),  # the groups' opt-in tags (deploy.groups)
    call("cloudwatch:GetMetricData", "*"),
    call("lambda:GetAccountSettings", "*"),  # deploy.concurrency: the account's quota (no resource-level permission)
]
# ... and its own stack's deploy checks (idle_reaper.aws.deploy), on the resources the stack's outputs name:
# test_the_slack_doctor_reads_its_own_stacks_deploy_and_no_other checks them on the template's real ARNs.
DOCTOR_DEPLOY_READS = {
    "cloudformation:DescribeStacks",
    "cloudformation:GetTemplate",
    "cloudformation:ListStackResources",
    "events:DescribeRule",
    "sns:GetTopicAttributes",
    "sns:ListSubscriptionsByTopic",
    "lambda:GetFunctionConcurrency",
    "ssm:DescribeAssociation",
}
SLACK_CALLS = [
    *(
        request
        for region in REGIONS
        for request in (
            on_managed("ec2:StartInstances", instance(region), region),
            on_managed("ec2:StopInstances", instance(region), region),
            on_managed("ec2:TerminateInstances", instance(region), region),  # "Terminate now"
            on_managed("sagemaker:StartNotebookInstance", notebook(region), region),
            on_managed("sagemaker:StopNotebookInstance", notebook(region), region),
            on_managed("sagemaker:DeleteEndpoint", sagemaker(region, "endpoint"), region),  # "Delete now"
            # "Bring it back": the configuration and models read first, then created with its own tags.
            call("sagemaker:DescribeEndpointConfig", sagemaker(region, "endpoint-config"), region),
            call("sagemaker:DescribeModel", sagemaker(region, "model"), region),
            call("sagemaker:CreateEndpoint", sagemaker(region, "endpoint"), region, **OPTING_IN),
            call("sagemaker:CreateEndpoint", sagemaker(region, "endpoint-config"), region, **OPTING_IN),
            call("sagemaker:AddTags", sagemaker(region, "endpoint"), region, **OPTING_IN),
            on_managed("sagemaker:DeleteApp", studio_app(region), region),  # a Studio app's "Delete now"
            call("sagemaker:CreateApp", studio_app(region), region, **OPTING_IN),  # "Start it again"
            call("sagemaker:CreateApp", studio_app(region, "codeeditor"), region, **OPTING_IN),
            call("sagemaker:AddTags", studio_app(region), region, **OPTING_IN),
            on_managed("autoscaling:SetInstanceProtection", group(region), region),
            *policy_reads(region),
            call("dynamodb:BatchGetItem", table(region), region),
            call("dynamodb:GetItem", table(region), region),
            call("dynamodb:PutItem", table(region), region),
            call("dynamodb:Query", table(region), region),
            call("dynamodb:Query", table(region, "owner-index"), region),
        )
    ),
    call("secretsmanager:GetSecretValue", secret(HOME)),
    call("lambda:InvokeFunction", function(HOME, "idle-reaper-slack")),  # finish the work asynchronously
    *DOCTOR_CALLS,  # `/idle-reaper doctor`, for admins: this region's fleet and metrics, read only
]
DIGEST_CALLS = [
    *policy_reads(HOME),
    call("dynamodb:Scan", table(HOME)),  # records and the audit of the digest's weeks, when one is due
    call("dynamodb:PutItem", table(HOME)),  # claim_once: once per destination per week
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("once#digest#ml#2026-W47",)}),
    call("secretsmanager:GetSecretValue", secret(HOME)),
    call("cloudwatch:GetMetricData", "*", HOME),  # the week of the machines exempt now (never read by sweeps)
]
ALARM_RELAY_CALLS = [
    call("ssm:GetParameter", parameter(HOME, "settings")),
    call("secretsmanager:GetSecretValue", secret(HOME)),
]

# And what each must not be able to do.
UNMANAGED = {"aws:ResourceTag/Team": "ml"}  # a production machine: cost-allocation tag, no opt-in
NEVER = [
    call("ec2:StopInstances", instance(HOME), **UNMANAGED),
    call("ec2:StartInstances", instance(HOME), **UNMANAGED),
    call("ec2:StopInstances", instance(HOME), **{MANAGED_TAG: "false"}),
    call("autoscaling:SetInstanceProtection", group(HOME), **UNMANAGED),
    call("autoscaling:TerminateInstanceInAutoScalingGroup", group(HOME), **UNMANAGED),
    # TerminateInstances (machines EC2 cannot stop) only ever on opted-in machines.
    call("ec2:TerminateInstances", instance(HOME), **UNMANAGED),
    call("ec2:TerminateInstances", instance(HOME), **{MANAGED_TAG: "false"}),
    # Notebook instances likewise: stop and start only with the opt-in tag; never deleted or changed.
    call("sagemaker:StopNotebookInstance", notebook(HOME), **UNMANAGED),
    call("sagemaker:StartNotebookInstance", notebook(HOME), **UNMANAGED),
    call("sagemaker:StopNotebookInstance", notebook(HOME), **{MANAGED_TAG: "false"}),
    on_managed("sagemaker:DeleteNotebookInstance", notebook(HOME)),
    on_managed("sagemaker:UpdateNotebookInstance", notebook(HOME)),
    # Endpoints: deleted only with the opt-in tag, created only carrying it; configurations and models never
    # deleted or changed.
    call("sagemaker:DeleteEndpoint", sagemaker(HOME, "endpoint"), **UNMANAGED),
    call("sagemaker:DeleteEndpoint", sagemaker(HOME, "endpoint"), **{MANAGED_TAG: "false"}),
    call("sagemaker:CreateEndpoint", sagemaker(HOME, "endpoint")),
    call("sagemaker:CreateEndpoint", sagemaker(HOME, "endpoint"), **{"aws:RequestTag/idle-reaper:managed": "no"}),
    on_managed("sagemaker:DeleteEndpointConfig", sagemaker(HOME, "endpoint-config")),
    on_managed("sagemaker:DeleteModel", sagemaker(HOME, "model")),
    on_managed("sagemaker:UpdateEndpoint", sagemaker(HOME, "endpoint")),
    # Studio apps: deleted only with the opt-in tag, created only carrying it, and only JupyterLab and Code Editor
    # apps; spaces (and their storage) never changed or deleted.
    call("sagemaker:DeleteApp", studio_app(HOME), **UNMANAGED),
    call("sagemaker:DeleteApp", studio_app(HOME), **{MANAGED_TAG: "false"}),
    call("sagemaker:CreateApp", studio_app(HOME)),
    call("sagemaker:CreateApp", studio_app(HOME), **{"aws:RequestTag/idle-reaper:managed": "no"}),
    on_managed("sagemaker:DeleteApp", studio_app(HOME, "kernelgateway")),
    call("sagemaker:CreateApp", studio_app(HOME, "canvas"), **OPTING_IN),
    on_managed("sagemaker:UpdateSpace", f"arn:aws:sagemaker:{HOME}:{ACCOUNT}:space/d-abc123/alice-space"),
    on_managed("sagemaker:DeleteSpace", f"arn:aws:sagemaker:{HOME}:{ACCOUNT}:space/d-abc123/alice-space"),
    on_managed("autoscaling:UpdateAutoScalingGroup", group(HOME)),
    call("ssm:PutParameter", parameter(HOME, "settings")),
    call("ssm:GetParameter", f"arn:aws:ssm:{HOME}:{ACCOUNT}:parameter/prod/db-password"),
    call("dynamodb:BatchWriteItem", table(HOME)),
    call("dynamodb:UpdateItem", table(HOME)),
    call("dynamodb:DeleteTable", table(HOME)),
    call("dynamodb:GetItem", f"arn:aws:dynamodb:{HOME}:{ACCOUNT}:table/billing"),
    call("secretsmanager:GetSecretValue", f"arn:aws:secretsmanager:{HOME}:{ACCOUNT}:secret:prod/db-Zz99Yy"),
    call("lambda:InvokeFunction", function(HOME, "payments")),
]
SWEEP_NEVER = [
    *NEVER,
    on_managed("ec2:StartInstances", instance(HOME)),  # only a person's "start" click starts a machine
    on_managed("sagemaker:StartNotebookInstance", notebook(HOME)),
    on_managed("sagemaker:StopNotebookInstance", notebook(OTHER), OTHER),
    call("sagemaker:CreateEndpoint", sagemaker(HOME, "endpoint"), **OPTING_IN),  # only a person brings one back
    call("sagemaker:CreateApp", studio_app(HOME), **OPTING_IN),  # ... or starts an app again
    on_managed("sagemaker:DeleteApp", studio_app(OTHER), OTHER),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("machine#i-0abc123def4567890",)}),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("entries#other#x",)}),
    call("dynamodb:Query", table(HOME, "owner-index")),  # the owner-index is the Slack endpoint's
    call("dynamodb:Scan", table(HOME)),
    # A sweep reads its own region only (listing instances aside: the daily count of unwatched regions).
    *(r for r in fleet_reads(OTHER) if r.action != "ec2:DescribeInstances"),
    call("cloudwatch:GetMetricData", "*", "ap-south-1"),
    call("cloudwatch:DescribeAlarms", f"arn:aws:cloudwatch:{HOME}:{ACCOUNT}:alarm:billing-alarm"),
    on_managed("ec2:StopInstances", instance(OTHER), OTHER),
    on_managed("ec2:TerminateInstances", instance(OTHER), OTHER),
    call("lambda:InvokeFunction", function(HOME, "idle-reaper-slack")),
]
# "Bring it back" reads that an endpoint's configuration and models still exist before it creates anything.
BRING_BACK_READS = {"sagemaker:DescribeEndpointConfig", "sagemaker:DescribeModel"}
SLACK_NEVER = [
    *NEVER,
    call("dynamodb:Scan", table(HOME)),  # an owner's machines come from the owner-index, never a scan
    call("dynamodb:DeleteItem", table(HOME)),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("once#x",)}),
    on_managed("autoscaling:TerminateInstanceInAutoScalingGroup", group(HOME)),
    # Answers act on one known machine; only the doctor lists, and only its own region's fleet and metrics.
    *(r for r in fleet_reads(HOME) if r.action not in {c.action for c in DOCTOR_CALLS} | BRING_BACK_READS),
    *(call(r.action, r.resource, OTHER) for r in DOCTOR_CALLS),
    call("dynamodb:GetItem", table("ap-south-1"), "ap-south-1"),  # a region the stack does not list
    call("lambda:InvokeFunction", function(HOME, "idle-reaper-sweep")),
]
SHARD_WORKER_NEVER = [
    *SWEEP_NEVER,
    call("states:StartExecution", state_machine(HOME, FANOUT)),  # a worker never starts another sweep
    *COUNT_UNWATCHED,  # the planner counts, once a day; a worker sweeps its shard in its region only
]
GATHER_NEVER = [
    *NEVER,
    *fleet_reads(HOME),
    on_managed("ec2:StopInstances", instance(HOME)),
    on_managed("ec2:TerminateInstances", instance(HOME)),
    on_managed("autoscaling:TerminateInstanceInAutoScalingGroup", group(HOME)),
    call("ssm:GetParameter", parameter(HOME, "teams/ml")),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("machine#i-0abc123def4567890",)}),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("once#policy-alert#x",)}),
    call("states:StartExecution", state_machine(HOME, FANOUT)),
]
DIGEST_NEVER = [
    *NEVER,
    *(c for c in fleet_reads(HOME) if c.action != "cloudwatch:GetMetricData"),
    call("cloudwatch:GetMetricData", "*", OTHER),
    on_managed("ec2:StopInstances", instance(HOME)),
    on_managed("ec2:StartInstances", instance(HOME)),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("machine#i-0abc123def4567890",)}),
    call("dynamodb:DeleteItem", table(HOME), **{"dynamodb:LeadingKeys": ("once#policy-alert#x",)}),
    call("dynamodb:Scan", table(OTHER), OTHER),
    call("lambda:InvokeFunction", function(HOME, "idle-reaper-slack")),
]
ALARM_RELAY_NEVER = [
    *NEVER,
    call("ssm:GetParameter", parameter(HOME, "teams/ml")),
    call("dynamodb:GetItem", table(HOME)),
    on_managed("ec2:StopInstances", instance(HOME)),
    on_managed("ec2:TerminateInstances", instance(HOME)),
]


@dataclass(frozen=True)
class Role:
    handler: str
    allowed: list[Request]
    denied: list[Request]


ROLES = {
    "sweep": Role("idle_reaper.handlers.sweep.handler", PLANNER_CALLS, SWEEP_NEVER),
    "shard_worker": Role("idle_reaper.handlers.fanout.shard_handler", SWEEP_CALLS, SHARD_WORKER_NEVER),
    "gather": Role("idle_reaper.handlers.fanout.gather_handler", GATHER_CALLS, GATHER_NEVER),
    "slack": Role("idle_reaper.handlers.slack.handler", SLACK_CALLS, SLACK_NEVER),
    "alarms": Role("idle_reaper.handlers.alarms.handler", ALARM_RELAY_CALLS, ALARM_RELAY_NEVER),
    "digest": Role("idle_reaper.handlers.digest.handler", DIGEST_CALLS, DIGEST_NEVER),
}
# Made only by the CLI with the operator's credentials (`init`, `policy put`, `status` lists every record).
CLI_ONLY = {"ssm:PutParameter", "dynamodb:CreateTable", "dynamodb:DescribeTable", "dynamodb:Scan"}
# Made only by an organization-mode hub (aws/accounts.py); its roles are checked in test_organization.py.
ORGANIZATION_MODE = {
    "organizations:DescribeOrganization",
    "organizations:ListAccountsForParent",
    "organizations:ListChildren",
    "organizations:DescribeAccount",
    "sts:AssumeRole",
}


def statements_of(template: dict[str, Any], handler: str, region: str = HOME) -> list[Statement]:
    [fn] = [
        r["Properties"]
        for r in template["Resources"].values()
        if r["Type"] == "AWS::Lambda::Function" and r["Properties"].get("Handler") == handler
    ]
    return role_statements(template, Environment(region, template), fn["Role"]["Fn::GetAtt"][0])


@pytest.fixture(scope="module")
def home(synth: Synth) -> dict[str, Any]:
    return synth.template(f"IdleReaper-{HOME}")


@pytest.mark.parametrize("role", ROLES)
def test_every_call_a_function_makes_is_allowed_on_a_real_arn(home: dict[str, Any], role: str) -> None:
    statements = statements_of(home, ROLES[role].handler)
    refused = [r for r in ROLES[role].allowed if decide(statements, r) != "Allow"]
    assert not refused, f"{role} would get AccessDenied for: {refused}"


@pytest.mark.parametrize("role", ROLES)
def test_what_a_function_must_not_do_is_denied(home: dict[str, Any], role: str) -> None:
    statements = statements_of(home, ROLES[role].handler)
    allowed = [r for r in ROLES[role].denied if decide(statements, r) == "Allow"]
    assert not allowed, f"{role} may do what it must not: {allowed}"


def doctor_deploy_calls(template: dict[str, Any], region: str = HOME) -> list[Request]:
    """The deploy checks' calls, on the real ARNs of what the stack's outputs name (what aws/deploy.py reads)."""
    env = Environment(region, template)
    wanted = ("SweepScheduleName", "AlarmTopicArn", "GpuAgentAssociationId")
    outputs = {k: env.resolve(template["Outputs"][k]["Value"]) for k in wanted}
    rule = next(
        env.resolve({"Fn::GetAtt": [logical, "Arn"]})
        for logical, r in template["Resources"].items()
        if r["Type"] == "AWS::Events::Rule" and env.resolve({"Ref": logical}) == outputs["SweepScheduleName"]
    )
    reserving = [
        env.resolve({"Fn::GetAtt": [logical, "Arn"]})
        for logical, r in template["Resources"].items()
        if r["Type"] == "AWS::Lambda::Function" and r["Properties"].get("ReservedConcurrentExecutions")
    ]
    assert len(reserving) == 2, "the sweep's and the Slack endpoint's reservations"
    stack = env.resolve({"Ref": "AWS::StackId"})
    association = f"arn:aws:ssm:{region}:{ACCOUNT}:association/{outputs['GpuAgentAssociationId']}"
    return [
        *(call(a, stack, region) for a in ("cloudformation:DescribeStacks", "cloudformation:GetTemplate")),
        call("cloudformation:ListStackResources", stack, region),
        call("events:DescribeRule", rule, region),
        call("sns:GetTopicAttributes", outputs["AlarmTopicArn"], region),
        call("sns:ListSubscriptionsByTopic", outputs["AlarmTopicArn"], region),
        *(call("lambda:GetFunctionConcurrency", f, region) for f in reserving),
        call("ssm:DescribeAssociation", association, region),
    ]


def test_the_slack_doctor_reads_its_own_stacks_deploy_and_no_other(home: dict[str, Any]) -> None:
    calls = doctor_deploy_calls(home)
    assert {c.action for c in calls} == DOCTOR_DEPLOY_READS
    slack = statements_of(home, ROLES["slack"].handler)
    refused = [r for r in calls if decide(slack, r) != "Allow"]
    assert not refused, f"`/idle-reaper doctor` would get AccessDenied for: {refused}"
    elsewhere = {
        "cloudformation": f"arn:aws:cloudformation:{HOME}:{ACCOUNT}:stack/payments/0f1e2d3c-aaaa-bbbb-cccc-0123",
        "events": f"arn:aws:events:{HOME}:{ACCOUNT}:rule/payments-nightly",
        "sns": f"arn:aws:sns:{HOME}:{ACCOUNT}:payments-alerts",
        "lambda": function(HOME, "payments"),
        "ssm": f"arn:aws:ssm:{HOME}:{ACCOUNT}:association/00000000-1111-2222-3333-444444444444",
    }
    others = [call(c.action, elsewhere[c.action.split(":")[0]]) for c in calls]
    allowed = [r for r in others if decide(slack, r) == "Allow"]
    assert not allowed, f"the Slack function may read another stack's deploy: {allowed}"
    for role in ("sweep", "shard_worker", "gather", "alarms", "digest"):  # only the Slack endpoint runs them
        statements = statements_of(home, ROLES[role].handler)
        assert not [r for r in calls if decide(statements, r) == "Allow"], role


def test_only_the_first_listed_region_counts_the_regions_without_a_stack(synth: Synth) -> None:
    """The count is made once for the account: the other stacks' sweeps list nothing outside their region."""
    statements = statements_of(synth.template(f"IdleReaper-{OTHER}"), ROLES["sweep"].handler, OTHER)
    assert decide(statements, call("ec2:DescribeInstances", "*", OTHER)) == "Allow"
    for request in (call("ec2:DescribeRegions", "*", OTHER), call("ec2:DescribeInstances", "*", "ap-south-1")):
        assert decide(statements, request) == "ImplicitDeny", request


# Where the IAM action is not the boto3 method's name in CamelCase.
ACTION_OF_METHOD = {"lambda:Invoke": "lambda:InvokeFunction", "stepfunctions:StartExecution": "states:StartExecution"}


CLIENT_ATTRIBUTES = {"ec2": "ec2", "autoscaling": "autoscaling", "cloudwatch": "cloudwatch", "ssm": "ssm"}
CLIENT_ATTRIBUTES |= {"dynamodb": "dynamodb", "lambda_client": "lambda", "organizations": "organizations", "sts": "sts"}
CLIENT_ATTRIBUTES |= {"sagemaker": "sagemaker", "app_autoscaling": "application-autoscaling"}
CALL_SITE = re.compile(
    r"\b(?P<client>ec2|autoscaling|cloudwatch|ssm|dynamodb|lambda_client|organizations|sts|sagemaker|app_autoscaling)\."
    r"(?:get_paginator\(\"(?P<paginated>[a-z_]+)\"\)|(?P<method>[a-z_]+)\()"
)
# ... and calls on a client made in place: client("lambda").invoke(...), boto3.client("lambda", ...).invoke(...)
INLINE_CALL = re.compile(r"client\(\s*\"(?P<service>[a-z-]+)\"[^)]*\)\.(?P<method>[a-z_]+)\(")


def calls_in(source: str) -> set[str]:
    """IAM actions of the boto3 calls in one module's source."""
    calls = [(CLIENT_ATTRIBUTES[m["client"]], m["paginated"] or m["method"]) for m in CALL_SITE.finditer(source)]
    calls += [(m["service"], m["method"]) for m in INLINE_CALL.finditer(source)]
    found = set()
    for prefix, method in calls:
        if method in ("get_waiter", "get_paginator"):
            continue
        action = f"{prefix}:{''.join(part.capitalize() for part in method.split('_'))}"
        found.add(ACTION_OF_METHOD.get(action, action))
    if "parameters.get_secret(" in source:  # Powertools: GetSecretValue
        found.add("secretsmanager:GetSecretValue")
    return found


def test_calls_are_found_in_source() -> None:
    source = """
        self.ec2.stop_instances(InstanceIds=ids)
        for page in self.autoscaling.get_paginator("describe_auto_scaling_groups").paginate():
        client("lambda").invoke(FunctionName=name, InvocationType="Event", Payload=body)
        region = client("dynamodb").meta.region_name
        value = parameters.get_secret(secret_id, transform="json")
    """
    assert calls_in(source) == {
        "ec2:StopInstances",
        "autoscaling:DescribeAutoScalingGroups",
        "lambda:InvokeFunction",
        "secretsmanager:GetSecretValue",
    }


def test_every_call_in_the_runtime_is_in_a_roles_list() -> None:
    """A new boto3 call in lambdas/idle_reaper fails here until it is added to the lists above (and granted)."""
    found = set().union(*(calls_in(p.read_text()) for p in (REPO_ROOT / "lambdas" / "idle_reaper").rglob("*.py")))
    assert {"ec2:StopInstances", "autoscaling:TerminateInstanceInAutoScalingGroup", "dynamodb:DeleteItem"} <= found
    listed = {r.action for role in ROLES.values() for r in role.allowed} | CLI_ONLY | ORGANIZATION_MODE
    listed |= DOCTOR_DEPLOY_READS
    assert found - listed == set(), "calls no role is checked for"


# -- the evaluator itself ----------------------------------------------------------------------------

REAL_GROUP = group("eu-west-1")


@pytest.mark.parametrize(
    ("pattern", "matches"),
    [
        (f"arn:aws:autoscaling:eu-west-1:{ACCOUNT}:autoScalingGroup:*:autoScalingGroupName/*", True),
        (f"arn:aws:autoscaling:eu-west-1:{ACCOUNT}:autoScalingGroup:*:autoScalingGroupName/ml-*", True),
        # The shape the stack used to grant: no real group ARN has it, so AWS refused every call.
        (f"arn:aws:autoscaling:eu-west-1:{ACCOUNT}:autoScalingGroup/*:autoScalingGroupName/*", False),
        (f"arn:aws:autoscaling:us-east-2:{ACCOUNT}:autoScalingGroup:*:autoScalingGroupName/*", False),
    ],
)
def test_resource_patterns_match_like_iam(pattern: str, matches: bool) -> None:
    statement = Statement("Allow", ("autoscaling:SetInstanceProtection",), (pattern,), {})
    assert (decide([statement], call("autoscaling:SetInstanceProtection", REAL_GROUP)) == "Allow") is matches


def test_the_old_group_arn_bug_is_caught_on_the_template(home: dict[str, Any]) -> None:
    """Put the old pattern back into the template: the call matrix must refuse it."""
    broken = json.loads(json.dumps(home).replace(":autoScalingGroup:*:", ":autoScalingGroup/*:"))
    statements = statements_of(broken, ROLES["sweep"].handler)
    release = on_managed("autoscaling:SetInstanceProtection", group(HOME))
    assert decide(statements, release) == "ImplicitDeny"


def test_conditions_and_deny() -> None:
    allow = Statement(
        "Allow",
        ("EC2:Stop*",),  # actions match case-insensitively
        ("arn:aws:ec2:*:*:instance/*",),
        {"StringEquals": {MANAGED_TAG: "true"}, "StringLike": {"aws:RequestedRegion": ["eu-*"]}},
    )
    stop = on_managed("ec2:StopInstances", instance("eu-west-1"), "eu-west-1")
    assert decide([allow], stop) == "Allow"
    assert decide([allow], call("ec2:StopInstances", instance("eu-west-1"), "eu-west-1")) == "ImplicitDeny"
    assert decide([allow], on_managed("ec2:StopInstances", instance("us-east-2"), "us-east-2")) == "ImplicitDeny"
    deny = Statement("Deny", ("ec2:*",), ("*",), {})
    assert decide([allow, deny], stop) == "ExplicitDeny"
    # ForAllValues: every requested key must match; no key at all matches vacuously, as in IAM.
    assert condition_holds("ForAllValues:StringLike", "dynamodb:LeadingKeys", ["once#*"], {})
    assert not condition_holds(
        "ForAllValues:StringLike", "dynamodb:LeadingKeys", ["once#*"], {"dynamodb:LeadingKeys": ("once#a", "x#b")}
    )
    assert condition_holds("StringNotEquals", "aws:ResourceTag/x", ["y"], {})
    with pytest.raises(NotImplementedError):
        condition_holds("NumericLessThan", "k", ["1"], {"k": "0"})
    with pytest.raises(NotImplementedError):
        Statement.of({"Effect": "Allow", "NotAction": "s3:*", "Resource": "*"})


def test_intrinsics_resolve_to_realistic_strings() -> None:
    template = {
        "Resources": {
            "Table": {"Type": "AWS::DynamoDB::Table", "Properties": {"TableName": "idle-reaper-state"}},
            "Secret": {"Type": "AWS::SecretsManager::Secret", "Properties": {"Name": "idle-reaper/slack"}},
        }
    }
    env = Environment("eu-west-1", template)
    resolved = env.resolve(
        {
            "a": {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":ec2:", {"Ref": "AWS::Region"}, ":x"]]},
            "b": {"Fn::GetAtt": ["Table", "Arn"]},
            "c": {
                "Fn::Sub": [
                    "arn:${AWS::Partition}:ssm:${AWS::Region}:${AWS::AccountId}:parameter/${Name}",
                    {"Name": "idle-reaper/settings"},
                ]
            },
            "d": {"Ref": "Secret"},
            "e": {"Fn::Select": [1, {"Fn::Split": ["/", "a/b/c"]}]},
        }
    )
    assert resolved == {
        "a": "arn:aws:ec2:eu-west-1:x",
        "b": table("eu-west-1"),
        "c": parameter("eu-west-1", "settings"),
        "d": secret("eu-west-1"),
        "e": "b",
    }
    with pytest.raises(KeyError):
        env.resolve({"Ref": "Missing"})


# -- parliament ------------------------------------------------------------------------------------

# Findings accepted, each with its reason. (issue, action) pairs; anything else fails the test.
ACCEPTED_FINDINGS: dict[tuple[str, str], str] = {}


def _identity_policies(synth: Synth) -> list[tuple[str, str, dict[str, Any]]]:
    found = []
    for stack_name in synth.stack_names:
        template = synth.template(stack_name)
        region = stack_name.removeprefix("IdleReaper-")
        env = Environment(region, template)
        for logical_id, resource in template["Resources"].items():
            props = resource.get("Properties", {})
            if resource["Type"] == "AWS::IAM::Policy":
                found.append((stack_name, logical_id, env.resolve(props["PolicyDocument"])))
            elif resource["Type"] == "AWS::IAM::Role":
                found += [(stack_name, logical_id, env.resolve(p["PolicyDocument"])) for p in props.get("Policies", [])]
    return found


def lint(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """parliament's findings on one policy document: (issue, detail, location)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # parliament imports the deprecated pkg_resources
        import parliament

    policy = parliament.analyze_policy_string(json.dumps(document), include_community_auditors=False)
    return [(f.issue, json.dumps(f.detail, default=str), json.dumps(f.location, default=str)) for f in policy.findings]


def test_parliament_finds_nothing_in_the_synthesized_policies(synth: Synth) -> None:
    policies = _identity_policies(synth)
    assert len(policies) >= 3 * len(synth.stack_names)  # sweep, slack, alarm relay: nothing skipped
    findings = [
        (stack, logical_id, finding)
        for stack, logical_id, document in policies
        for finding in lint(document)
        if (finding[0], finding[2]) not in ACCEPTED_FINDINGS
    ]
    assert findings == []


def test_parliament_reports_the_old_group_arn_shape() -> None:
    """The lint would have caught the bug: parliament knows the real Auto Scaling group ARN format."""
    document = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": "autoscaling:SetInstanceProtection",
                "Resource": f"arn:aws:autoscaling:eu-west-1:{ACCOUNT}:autoScalingGroup/*:autoScalingGroupName/*",
            }
        ],
    }
    assert "RESOURCE_MISMATCH" in {issue for issue, _, _ in lint(document)}
    fixed = json.loads(json.dumps(document).replace("autoScalingGroup/*:", "autoScalingGroup:*:"))
    assert lint(fixed) == []
