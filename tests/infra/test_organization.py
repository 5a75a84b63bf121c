"""Organization mode at deploy time (issue 30): the `organization` context, the hub's StackSet of the member
stack, the member role's and the digest's read role's trust and permissions, and single-account mode left
exactly as it was."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from iam_policy import ACCOUNT, Environment, decide, role_statements
from synthesis import ALARM_EMAIL, REGIONS, Synth, shared_synth, synthesize
from test_iam import (
    NEVER,
    OPTING_IN,
    ORGANIZATION_MODE,
    OTHER,
    _identity_policies,
    call,
    fleet_reads,
    group,
    instance,
    lint,
    notebook,
    on_managed,
    parameter,
    sagemaker,
    secret,
    studio_app,
    table,
)
from test_names import physical_names

from idle_reaper.aws.accounts import ORGANIZATION_ENV, OrganizationConfig
from idle_reaper.organization import ContextError, member_read_role_name, member_role_name
from infra.organization import TEMPLATE_BODY_LIMIT, any_of
from infra.stack import IdleReaperProps

pytestmark = pytest.mark.infra

ORG_ID = "o-a1b2c3d4e5"
TARGETS = ["ou-ab12-cd34ef56", "r-ab12"]
MEMBER_REGIONS = ["eu-west-1", "us-east-2", "ap-south-1"]
ORGANIZATION = {"organizationId": ORG_ID, "targets": TARGETS, "regions": MEMBER_REGIONS}
HUB, SECOND = REGIONS
HUB_ROLES = {"HubSweepRoleArn": "Sweep", "HubShardWorkerRoleArn": "ShardWorker", "HubAnswerRoleArn": "Slack"}
HUB_DIGEST = {"HubDigestRoleArn": "Digest"}  # the one role the read role trusts


@pytest.fixture(scope="module")
def org(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The hub in two regions, as the session's `synth`, plus organization mode."""
    return shared_synth(
        tmp_path_factory, "organization", regions=list(REGIONS), alarmEmail=ALARM_EMAIL, organization=ORGANIZATION
    )


@pytest.fixture(scope="module")
def hub(org: Synth) -> dict[str, Any]:
    return org.template(f"IdleReaper-{HUB}")


def of_type(template: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


@pytest.fixture(scope="module")
def stack_set(hub: dict[str, Any]) -> dict[str, Any]:
    [found] = of_type(hub, "AWS::CloudFormation::StackSet").values()
    properties: dict[str, Any] = found["Properties"]
    return properties


@pytest.fixture(scope="module")
def member(stack_set: dict[str, Any]) -> dict[str, Any]:
    template: dict[str, Any] = json.loads(stack_set["TemplateBody"])
    return template


def role_logical_id(template: dict[str, Any], construct: str) -> str:
    [found] = [k for k in of_type(template, "AWS::IAM::Role") if k.startswith(f"{construct}Role")]
    return found


def member_stack_role(member: dict[str, Any], construct: str = "HubRole") -> tuple[str, dict[str, Any]]:
    """The member stack's role (HubRole) or the digest's read role (DigestReadRole): logical id and resource."""
    [found] = [(k, v) for k, v in of_type(member, "AWS::IAM::Role").items() if k.startswith(construct)]
    return found


# -- the context -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "key", "kind"),
    [
        ({"organizationId": "o-short"}, "organization.organizationId", "an organization id"),
        ({"targets": ["ou-ab12-cd34ef56", "ou-ab12"]}, "organization.targets[1]", "an organizational unit id"),
        ({"targets": ["r-AB12"]}, "organization.targets[0]", "root id"),
        ({"targets": ["123456789012"]}, "organization.targets[0]", "an organizational unit id"),
        ({"targets": []}, "organization.targets", "at least 1"),
        ({"regions": ["eu-west-1", "europe"]}, "organization.regions[1]", "an AWS region name"),
        ({"regions": ["eu-west-1", "eu-west-1"]}, "organization.regions", "listed more than once: eu-west-1"),
        ({"delegatedAdmin": "perhaps"}, "organization.delegatedAdmin", "boolean"),
        ({"accounts": ["1234"]}, "organization.accounts", "unknown field"),
    ],
)
def test_a_bad_organization_context_fails_synth_naming_the_key(change: dict[str, Any], key: str, kind: str) -> None:
    context = {"organization": {**ORGANIZATION, **change}}
    with pytest.raises(ContextError) as raised:
        IdleReaperProps.from_context(cdk.App(context=context).node)
    message = str(raised.value)
    assert f"{key}:" in message and kind in message, message


def test_a_bad_context_stops_the_synth_itself(tmp_path: Path) -> None:
    with pytest.raises(ContextError, match=r"organization\.targets\[0\]: not an organizational unit id"):
        synthesize(tmp_path, organization={**ORGANIZATION, "targets": ["ou-xx"]})
    assert not list(tmp_path.glob("*.template.json"))  # nothing was written


def test_the_context_is_read_from_cdk_json_or_the_command_line() -> None:
    # `-c organization='{...}'` arrives as text; cdk.json holds an object.
    from_text = IdleReaperProps.from_context(cdk.App(context={"organization": json.dumps(ORGANIZATION)}).node)
    from_object = IdleReaperProps.from_context(cdk.App(context={"organization": ORGANIZATION}).node)
    assert from_text == from_object and from_text.organization is not None
    assert from_text.organization.targets == TARGETS and not from_text.organization.delegated_admin
    with pytest.raises(ContextError, match="organization: not valid JSON"):
        IdleReaperProps.from_context(cdk.App(context={"organization": "{targets:"}).node)
    # Absent, empty or switched off: single-account mode.
    for off in (None, "", {**ORGANIZATION, "enabled": False}):
        assert IdleReaperProps.from_context(cdk.App(context={"organization": off}).node).organization is None


def test_single_account_mode_synthesizes_exactly_as_without_the_block(synth: Synth, tmp_path: Path) -> None:
    disabled = synthesize(
        tmp_path, regions=list(REGIONS), alarmEmail=ALARM_EMAIL, organization={**ORGANIZATION, "enabled": False}
    )
    assert disabled.stack_names == synth.stack_names
    for name in synth.stack_names:
        assert disabled.template(name) == synth.template(name)
    everything = json.dumps([synth.template(n) for n in synth.stack_names])
    assert "AWS::CloudFormation::StackSet" not in everything and "-member-" not in everything
    assert "digest-read" not in everything and "HubDigestRoleArn" not in everything


# What turning a single-account stack into the hub may change in place: the functions' environment (the
# organization's description), the roles' policies (assuming member roles, reading the organization) and
# cdk-nag's notes. Nothing else, so no resource is replaced or removed, and the state stays where it is.
CHANGED_IN_PLACE = {
    "AWS::Lambda::Function": ("Properties", "Environment"),
    "AWS::IAM::Policy": ("Properties", "PolicyDocument"),
}


def as_kept(resource: dict[str, Any]) -> dict[str, Any]:
    """A resource without what may change in place when its stack becomes the hub."""
    kept = {k: v for k, v in resource.items() if k != "Metadata"}
    where = CHANGED_IN_PLACE.get(resource["Type"])
    if where is not None:
        section, key = where
        kept[section] = {k: v for k, v in kept[section].items() if k != key}
    return kept


def test_the_hub_accounts_single_account_stack_becomes_the_hub_keeping_every_resource(synth: Synth, org: Synth) -> None:
    """Moving into organization mode is a `make deploy` of the same stacks: every single-account resource is in
    the hub under the same logical id and type (the state table above all: its snoozes, warnings in flight and
    history stay), unchanged but for what CHANGED_IN_PLACE names; the hub only adds (the StackSet)."""
    assert org.stack_names == synth.stack_names  # the same CloudFormation stacks, updated
    for name in synth.stack_names:
        single, hub_template = synth.template(name)["Resources"], org.template(name)["Resources"]
        assert set(single) <= set(hub_template), f"{name} would lose {sorted(set(single) - set(hub_template))}"
        changed = sorted(k for k, r in single.items() if as_kept(r) != as_kept(hub_template[k]))
        assert changed == [], f"{name}: turning it into the hub would replace or alter {changed}"
        [table] = [k for k, r in single.items() if r["Type"] == "AWS::DynamoDB::Table"]
        assert hub_template[table] == single[table] and single[table]["DeletionPolicy"] == "Retain"
        added = {r["Type"] for k, r in hub_template.items() if k not in single}
        assert added <= {"AWS::CloudFormation::StackSet"}, added


# -- the StackSet ----------------------------------------------------------------------------------


def test_the_hub_deploys_a_service_managed_stack_set_with_automatic_deployment(
    org: Synth, hub: dict[str, Any], stack_set: dict[str, Any]
) -> None:
    assert stack_set["PermissionModel"] == "SERVICE_MANAGED"
    assert stack_set["AutoDeployment"] == {"Enabled": True, "RetainStacksOnAccountRemoval": False}
    assert stack_set["CallAs"] == "SELF"
    assert stack_set["StackSetName"] == "idle-reaper-members"
    assert stack_set["Capabilities"] == ["CAPABILITY_NAMED_IAM"]  # the member role has a name
    [group_] = stack_set["StackInstancesGroup"]
    assert group_ == {"DeploymentTargets": {"OrganizationalUnitIds": TARGETS}, "Regions": MEMBER_REGIONS}
    # One account that cannot take the stack does not hold up the others.
    assert stack_set["OperationPreferences"]["FailureTolerancePercentage"] == 100
    # The trust parameters are the hub's own roles, by ARN.
    parameters = {p["ParameterKey"]: p["ParameterValue"] for p in stack_set["Parameters"]}
    assert parameters.pop("HubAccountId") == {"Ref": "AWS::AccountId"}
    assert {k: v["Fn::GetAtt"][0] for k, v in parameters.items()} == {
        k: role_logical_id(hub, construct) for k, construct in {**HUB_ROLES, **HUB_DIGEST}.items()
    }
    # Only the hub (the first listed region's stack) holds it.
    assert not of_type(org.template(f"IdleReaper-{SECOND}"), "AWS::CloudFormation::StackSet")


def test_a_delegated_administrator_calls_as_one_and_cdk_nag_is_clean(tmp_path: Path) -> None:
    variant = synthesize(tmp_path, organization={**ORGANIZATION, "delegatedAdmin": True}, gpuAgentTagKey="")
    # One stack, so cdk-nag's report (named after the CloudFormation stack) is the hub's own.
    rows = list(csv.reader(variant.nag_report(variant.stack_names[0]).splitlines()[1:]))
    assert rows and all(row[2] in ("Compliant", "Suppressed") for row in rows)
    [found] = of_type(variant.template(), "AWS::CloudFormation::StackSet").values()
    assert found["Properties"]["CallAs"] == "DELEGATED_ADMIN"
    # Without the GPU agent rollout the member stack is the two roles alone (and the first region's count policy).
    types = [r["Type"] for r in json.loads(found["Properties"]["TemplateBody"])["Resources"].values()]
    assert sorted(types) == ["AWS::IAM::Policy", "AWS::IAM::Role", "AWS::IAM::Role"]


# -- the member stack ------------------------------------------------------------------------------


def test_the_member_template_holds_only_the_role_and_the_associations(
    stack_set: dict[str, Any], member: dict[str, Any]
) -> None:
    types = sorted(r["Type"] for r in member["Resources"].values())
    assert types == [
        "AWS::IAM::Policy",  # the first organization region's daily count of the account's other regions
        "AWS::IAM::Role",
        "AWS::IAM::Role",
        "AWS::SSM::Association",
        "AWS::SSM::Document",
        "AWS::SSM::Parameter",
    ]
    # No asset, no bootstrap: only the trust parameters, no rule asking for a CDK bootstrap version.
    assert sorted(member["Parameters"]) == sorted([*HUB_ROLES, *HUB_DIGEST, "HubAccountId"])
    assert "Rules" not in member and "Lambda" not in json.dumps(member)
    assert len(stack_set["TemplateBody"]) <= TEMPLATE_BODY_LIMIT  # inline: no S3 URL to share with members
    # The collector rides inside the document, as in the hub stack.
    [document] = of_type(member, "AWS::SSM::Document").values()
    assert "installActivityCollector" in json.dumps(document)
    # In the hub's own account, in a hub region, the hub stack already rolls the agent out: the member stack there
    # is the roles. In the hub's account's other organization regions the hub sweeps it as a member: rolled out.
    rolls_out = member["Conditions"]["NoHubStackHere"]
    hub_account = "999999999999"
    for account, region, expected in [
        (ACCOUNT, HUB, True),  # a member account, in a hub region
        (ACCOUNT, "ap-south-1", True),
        (hub_account, HUB, False),
        (hub_account, SECOND, False),
        (hub_account, "ap-south-1", True),  # an organization region without a hub stack
    ]:
        refs = {"AWS::AccountId": account, "AWS::Region": region, "HubAccountId": hub_account}
        assert evaluate(rolls_out, refs) is expected, (account, region)
    assert all(r.get("Condition") == "NoHubStackHere" for r in member["Resources"].values() if "SSM" in r["Type"])
    assert all("Condition" not in role for role in of_type(member, "AWS::IAM::Role").values())
    assert member["Conditions"]["CountsOtherRegions"] == {"Fn::Equals": [{"Ref": "AWS::Region"}, MEMBER_REGIONS[0]]}
    assert [p.get("Condition") for p in of_type(member, "AWS::IAM::Policy").values()] == ["CountsOtherRegions"]


def evaluate(condition: Any, refs: dict[str, str]) -> Any:
    """A CloudFormation condition (Fn::Or, Fn::And, Fn::Not, Fn::Equals, Ref) evaluated as CloudFormation would."""
    if isinstance(condition, str):
        return condition
    [(function, value)] = condition.items()
    if function == "Ref":
        return refs[value]
    args = [evaluate(v, refs) for v in value]
    if function == "Fn::Equals":
        return args[0] == args[1]
    if function == "Fn::Not":
        return not args[0]
    assert 2 <= len(args) <= 10, f"{function} takes 2 to 10 conditions, not {len(args)}"
    return any(args) if function == "Fn::Or" else all(args)


@pytest.mark.parametrize("count", [1, 2, 10, 11, 23])
def test_any_of_is_true_when_one_condition_is_and_never_passes_cloudformations_ten(count: int) -> None:
    regions = [f"xx-region-{i}" for i in range(count)]
    stack = cdk.Stack(cdk.App())
    built = stack.resolve(any_of([cdk.Fn.condition_equals(cdk.Aws.REGION, r) for r in regions]))
    for region in regions:
        assert evaluate(built, {"AWS::Region": region}) is True
    assert evaluate(built, {"AWS::Region": "elsewhere"}) is False


def trusted_principals(role: dict[str, Any]) -> list[Any]:
    """Who may assume a member stack's role: each statement an Allow of sts:AssumeRole by role ARNs only, under
    the organization's condition."""
    principals = []
    for statement in role["Properties"]["AssumeRolePolicyDocument"]["Statement"]:
        assert statement["Effect"] == "Allow" and statement["Action"] == "sts:AssumeRole"
        assert statement["Condition"] == {"StringEquals": {"aws:PrincipalOrgID": ORG_ID}}
        assert set(statement["Principal"]) == {"AWS"}  # no service, no account root, no federated principal
        aws = statement["Principal"]["AWS"]
        principals += aws if isinstance(aws, list) else [aws]
    return sorted(principals, key=json.dumps)


def test_the_member_role_trusts_only_the_hub_roles_inside_the_organization(member: dict[str, Any]) -> None:
    _, role = member_stack_role(member)
    # The sweep, its shard workers and the Slack endpoint: not the digest, which would get stop power.
    assert trusted_principals(role) == sorted(({"Ref": p} for p in HUB_ROLES), key=json.dumps)
    name = role["Properties"]["RoleName"]
    assert name == {"Fn::Join": ["", ["idle-reaper-member-", {"Ref": "AWS::Region"}]]}


def test_the_read_role_trusts_only_the_digest_and_may_only_read_metrics_in_its_region(member: dict[str, Any]) -> None:
    logical_id, role = member_stack_role(member, "DigestReadRole")
    assert trusted_principals(role) == [{"Ref": "HubDigestRoleArn"}]
    assert role["Properties"]["RoleName"] == {"Fn::Join": ["", ["idle-reaper-digest-read-", {"Ref": "AWS::Region"}]]}
    assert "ManagedPolicyArns" not in role["Properties"]
    env = Environment(HUB, member)
    statements = role_statements(member, env, logical_id)
    assert sorted(a for s in statements for a in s.actions) == ["cloudwatch:GetMetricData"]
    assert decide(statements, call("cloudwatch:GetMetricData", "*", HUB)) == "Allow"
    refused = [
        call("cloudwatch:GetMetricData", "*", OTHER),  # each region's read role reads its own region only
        *(r for r in MEMBER_CALLS if r.action != "cloudwatch:GetMetricData"),  # no listing, no stop, no start
        *MEMBER_NEVER,
        call("cloudwatch:PutMetricData", "*", HUB),
        call("cloudwatch:GetMetricStatistics", "*", HUB),
    ]
    allowed = [r for r in refused if decide(statements, r) == "Allow"]
    assert not allowed, allowed
    # What parliament finds in it: nothing (GetMetricData's Resource "*" is what the API requires).
    for policy in role["Properties"]["Policies"]:
        assert lint(env.resolve(policy["PolicyDocument"])) == []


@pytest.mark.parametrize(
    "value",
    [
        "",
        "*",
        "arn:aws:iam::12345:role/x",  # not an account id
        "arn:aws:iam::123456789012:user/ada",  # a user, not a role
        "arn:aws:sts::123456789012:assumed-role/IdleReaper-DigestRole/s",  # a session, not the role
        "arn:aws:iam::123456789012:role/",  # no name
        "123456789012",
    ],
)
def test_a_malformed_hub_role_arn_is_refused_by_the_member_template(member: dict[str, Any], value: str) -> None:
    """CloudFormation checks each parameter against its AllowedPattern (the whole value) before it creates
    anything: a StackSet operation given such an ARN fails in every account, nothing changed."""
    for name in [*HUB_ROLES, *HUB_DIGEST]:
        pattern = member["Parameters"][name]["AllowedPattern"]
        assert not re.fullmatch(pattern, value), (name, value)
        # and the ARN the hub passes is accepted
        assert re.fullmatch(pattern, f"arn:aws:iam::{ACCOUNT}:role/IdleReaper-DigestRole414B3B09-Ab12Cd34Ef56")


def test_a_role_name_over_iams_limit_fails_synth_naming_the_region() -> None:
    context = {"prefix": "p" * 32, "organization": {**ORGANIZATION, "regions": ["eu-west-1", "us-gov-northwestern-12"]}}
    with pytest.raises(ContextError, match=r"organization\.regions\[1\]: the role name 'p{32}-digest-read-us-gov"):
        IdleReaperProps.from_context(cdk.App(context=context).node)


# What aws/accounts.py calls in organization mode, and what no role may do to the organization.
ORGANIZATION_CALLS = tuple(sorted(ORGANIZATION_MODE - {"sts:AssumeRole"}))
ORGANIZATION_CHANGES = ("organizations:MoveAccount", "organizations:CloseAccount", "organizations:CreateAccount")
MEMBER_CALLS = [
    *fleet_reads(HUB),
    *(
        on_managed(action, arn)
        for action, arn in (
            ("ec2:StopInstances", instance(HUB)),
            ("ec2:StartInstances", instance(HUB)),
            ("ec2:TerminateInstances", instance(HUB)),
            ("sagemaker:StopNotebookInstance", notebook(HUB)),
            ("sagemaker:StartNotebookInstance", notebook(HUB)),
            ("autoscaling:SetInstanceProtection", group(HUB)),
            ("autoscaling:TerminateInstanceInAutoScalingGroup", group(HUB)),
            ("sagemaker:DeleteEndpoint", sagemaker(HUB, "endpoint")),
            ("sagemaker:DeleteApp", studio_app(HUB)),
        )
    ),
    # "Bring it back" on a member account's endpoint: the same rights as the hub's own (issue 46).
    call("sagemaker:CreateEndpoint", sagemaker(HUB, "endpoint"), HUB, **OPTING_IN),
    call("sagemaker:CreateEndpoint", sagemaker(HUB, "endpoint-config"), HUB, **OPTING_IN),
    call("sagemaker:AddTags", sagemaker(HUB, "endpoint"), HUB, **OPTING_IN),
    # ... and "Start it again" on a member account's Studio app.
    call("sagemaker:CreateApp", studio_app(HUB), HUB, **OPTING_IN),
    call("sagemaker:AddTags", studio_app(HUB), HUB, **OPTING_IN),
]
MEMBER_NEVER = [
    *NEVER,
    # Machines only: no policies, state, secrets or functions live in a member account.
    call("ssm:GetParameter", parameter(HUB, "settings")),
    call("dynamodb:GetItem", table(HUB)),
    call("secretsmanager:GetSecretValue", secret(HUB)),
    call("sts:AssumeRole", "arn:aws:iam::210987654321:role/idle-reaper-member-eu-west-1"),
    # Each region's member role acts in its own region only.
    *(r for r in fleet_reads(OTHER) if r.action != "sagemaker:ListTags"),
    on_managed("ec2:StopInstances", instance(OTHER), OTHER),
]


def in_region(member: dict[str, Any], region: str) -> dict[str, Any]:
    """The member template as CloudFormation makes it in `region`: resources whose condition is false left out
    (the conditions a template of one region can decide: AWS::Region against a literal)."""
    decided = {
        name: condition["Fn::Equals"][1] == region
        for name, condition in member["Conditions"].items()
        if "Fn::Equals" in condition and condition["Fn::Equals"][0] == {"Ref": "AWS::Region"}
    }
    resources = {k: v for k, v in member["Resources"].items() if decided.get(v.get("Condition", ""), True)}
    return {**member, "Resources": resources}


COUNT_CALLS = [call("ec2:DescribeRegions", "*", OTHER), call("ec2:DescribeInstances", "*", OTHER)]


def test_the_member_role_may_do_what_the_single_account_roles_do_to_machines_and_nothing_else(
    hub: dict[str, Any], member: dict[str, Any]
) -> None:
    env = Environment(HUB, member)
    role, _ = member_stack_role(member)
    # A member role in any organization region but the first: its own region only.
    statements = role_statements(in_region(member, MEMBER_REGIONS[1]), env, role)
    refused = [r for r in MEMBER_CALLS if decide(statements, r) != "Allow"]
    assert not refused, refused
    allowed = [r for r in [*MEMBER_NEVER, *COUNT_CALLS] if decide(statements, r) == "Allow"]
    assert not allowed, allowed
    # The first organization region's: also DescribeRegions and DescribeInstances everywhere (the daily count of
    # the account's other regions), as the first region's single-account sweep role; nothing else widened.
    first = role_statements(in_region(member, MEMBER_REGIONS[0]), env, role)
    assert [r for r in [*MEMBER_CALLS, *COUNT_CALLS] if decide(first, r) != "Allow"] == []
    widened = [r for r in MEMBER_NEVER if decide(first, r) == "Allow"]
    assert widened == [r for r in MEMBER_NEVER if r.action == "ec2:DescribeInstances"], widened
    statements = first
    # The same statements as the hub's sweep and Slack roles, from the same source (infra/machine_access.py).
    hub_env = Environment(HUB, hub)
    single = {
        s.sid: s
        for construct in ("Sweep", "Slack")
        for s in role_statements(hub, hub_env, role_logical_id(hub, construct))
    }
    for statement in statements:
        twin = single[statement.sid]
        assert set(statement.actions) == set(twin.actions), statement.sid
        assert statement.conditions == twin.conditions, statement.sid
        # The Slack endpoint of a two-region hub acts in both; a member role in its own region.
        assert set(statement.resources) <= set(twin.resources), statement.sid


def test_the_hub_roles_may_assume_member_roles_of_the_organization_only(hub: dict[str, Any]) -> None:
    env = Environment(HUB, hub)
    member_role = f"arn:aws:iam::210987654321:role/{member_role_name('idle-reaper', 'ap-south-1')}"
    read_role = f"arn:aws:iam::210987654321:role/{member_read_role_name('idle-reaper', 'ap-south-1')}"
    in_org = {"aws:ResourceOrgID": ORG_ID}
    for construct in ("Sweep", "ShardWorker", "Slack", "Gather", "Digest", "AlarmRelay"):
        statements = role_statements(hub, env, role_logical_id(hub, construct))
        acts_in_members = construct in ("Sweep", "ShardWorker", "Slack")
        expected = "Allow" if acts_in_members else "ImplicitDeny"
        assert decide(statements, call("sts:AssumeRole", member_role, **in_org)) == expected, construct
        # The digest assumes the read role, and only it; the roles that act on machines never the read role.
        reads = "Allow" if construct == "Digest" else "ImplicitDeny"
        assert decide(statements, call("sts:AssumeRole", read_role, **in_org)) == reads, construct
        for other in (
            call("sts:AssumeRole", member_role, **{"aws:ResourceOrgID": "o-zzzzzzzzzz"}),  # another organization
            call("sts:AssumeRole", read_role, **{"aws:ResourceOrgID": "o-zzzzzzzzzz"}),
            call("sts:AssumeRole", "arn:aws:iam::210987654321:role/idle-reaper-digest-write-ap-south-1", **in_org),
            call("sts:AssumeRole", "arn:aws:iam::210987654321:role/other-digest-read-ap-south-1", **in_org),
            call("sts:AssumeRole", "arn:aws:iam::210987654321:role/OrganizationAccountAccessRole", **in_org),
            *(call(action, "*", "us-east-1") for action in ORGANIZATION_CHANGES),
        ):
            assert decide(statements, other) == "ImplicitDeny", (construct, other)
        # The planner, `/idle-reaper doctor` (the Slack endpoint) and the digest (to name them) list the accounts;
        # each role that assumes member roles (the digest: the read role) may ask about one account.
        lists = {a: decide(statements, call(a, "*", "us-east-1")) == "Allow" for a in ORGANIZATION_CALLS}
        assert lists == {
            a: (a == "organizations:DescribeAccount" and (acts_in_members or construct == "Digest"))
            or (a != "organizations:DescribeAccount" and construct in ("Sweep", "Slack", "Digest"))
            for a in ORGANIZATION_CALLS
        }, construct


def test_a_hub_inside_a_target_ou_shares_no_name_with_its_member_stack(
    hub: dict[str, Any], member: dict[str, Any]
) -> None:
    ours, theirs = physical_names(hub), physical_names(member)
    assert theirs == {
        "AWS::IAM::Role idle-reaper-member-REGION",
        "AWS::IAM::Role idle-reaper-digest-read-REGION",
        "AWS::SSM::Parameter AmazonCloudWatch-idle-reaper-member-gpu",
    }
    assert ours.isdisjoint(theirs), ours & theirs
    # The hub creates no role named like a member role (its roles' names are CloudFormation's own).
    assert not any(r["Properties"].get("RoleName") for r in of_type(hub, "AWS::IAM::Role").values())


def test_the_hub_functions_that_act_in_members_are_told_where_they_are(
    hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = Environment(HUB, hub)
    told = {}
    for logical_id, function in of_type(hub, "AWS::Lambda::Function").items():
        variables = function["Properties"].get("Environment", {}).get("Variables", {})
        if ORGANIZATION_ENV in variables:
            told[logical_id.split("Function")[0]] = env.resolve(variables[ORGANIZATION_ENV])
    assert sorted(told) == ["Digest", "ShardWorker", "Slack", "Sweep"]
    monkeypatch.setenv(ORGANIZATION_ENV, told["Sweep"])
    assert OrganizationConfig.from_environment() == OrganizationConfig(
        prefix="idle-reaper",
        targets=tuple(TARGETS),
        regions=tuple(MEMBER_REGIONS),
        hub_account=ACCOUNT,
        hub_regions=REGIONS,
    )
    # The hub's account is a member unit only where the hub has no stack of its own.
    assert OrganizationConfig.from_environment().hub_member_regions == ("ap-south-1",)


def test_cdk_nag_is_clean_on_the_hub(org: Synth) -> None:
    for stack_name in org.stack_names:
        findings = [
            entry["data"]
            for entries in org.metadata(stack_name).values()
            for entry in entries
            if entry["type"] in ("aws:cdk:error", "aws:cdk:warning")
        ]
        assert findings == []


def test_parliament_finds_nothing_in_the_hubs_and_the_member_stacks_policies(
    org: Synth, member: dict[str, Any]
) -> None:
    policies = [document for _, _, document in _identity_policies(org)]
    env = Environment(HUB, member)
    for role in of_type(member, "AWS::IAM::Role").values():
        policies += [env.resolve(p["PolicyDocument"]) for p in role["Properties"]["Policies"]]
    assert any("AssumeMemberReadRoles" in json.dumps(d) for d in policies)  # the digest's is among them
    # Accepted: DescribeAccount on any account. Its ARN names the management account, which a hub that is a
    # delegated administrator does not know at synth time; the call only reads.
    accepted = {("RESOURCE_STAR", json.dumps(["organizations:DescribeAccount"]))}
    findings = [f for document in policies for f in lint(document) if f[:2] not in accepted]
    assert findings == []
