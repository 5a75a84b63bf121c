"""Organization mode (issue 30): the member stack every enrolled account gets, and the service-managed StackSet
that puts it there. The hub stack is the single-account stack plus these (infra/stack.py).

The member stack holds only what must live in each account and region: the role the hub's sweep and Slack
endpoint assume (the machine permissions of infra/machine_access.py, nothing else), the read-only role the
hub's weekly digest assumes (cloudwatch:GetMetricData, nothing else: the digest never gets stop power) and the
GPU agent and activity collector associations (infra/constructs.py's GpuAgentRollout). It has no Lambda and no
file asset: a service-managed StackSet cannot read the hub's CDK bootstrap bucket from a member account, so the
template travels inline (TemplateBody) and the collector's files ride inside the SSM document, as in the hub
stack."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aws_cdk import (
    App,
    Aspects,
    Aws,
    BootstraplessSynthesizer,
    CfnCondition,
    CfnParameter,
    CfnResource,
    Fn,
    ICfnConditionExpression,
    Stack,
)
from aws_cdk import aws_cloudformation as cfn
from aws_cdk import aws_iam as iam
from cdk_nag import AwsSolutionsChecks, NagPackSuppression, RegexAppliesTo
from constructs import Construct

from idle_reaper.organization import (
    MEMBER_ROLE_SUFFIX,
    READ_ROLE_SUFFIX,
    OrganizationContext,
    member_read_role_name,
    member_role_name,
)
from infra.bundling import REPO_ROOT
from infra.constructs import GpuAgentRollout, suppress
from infra.machine_access import MachineAccess, in_regions

# CloudFormation's limit on an inline template (TemplateBody); above it a StackSet needs an S3 URL.
TEMPLATE_BODY_LIMIT = 51_200
# The hub's roles that act in member accounts: the sweep, its shard workers, and the Slack endpoint.
HUB_ROLE_PARAMETERS = ("HubSweepRoleArn", "HubShardWorkerRoleArn", "HubAnswerRoleArn")
# The hub's weekly digest: the one role the read role trusts.
HUB_DIGEST_PARAMETER = "HubDigestRoleArn"
HUB_ACCOUNT_PARAMETER = "HubAccountId"
# What CloudFormation accepts for a hub role's ARN (the parameters' AllowedPattern): an IAM role of one account.
ROLE_ARN_PATTERN = r"^arn:aws[a-z-]*:iam::\d{12}:role/.+$"


def member_agent_parameter_name(prefix: str) -> str:
    """The member stack's CloudWatch agent config: not the hub stack's name (AmazonCloudWatch-<prefix>-gpu), so
    a hub inside a target OU gets both. The managed CloudWatchAgentServerPolicy reads AmazonCloudWatch-*."""
    return f"AmazonCloudWatch-{prefix}-{MEMBER_ROLE_SUFFIX}-gpu"


@dataclass(frozen=True)
class MemberSettings:
    """What the member stack takes from the hub's props (infra/stack.py IdleReaperProps)."""

    prefix: str
    ssm_prefix: str
    organization_id: str
    managed_tag_key: str
    gpu_agent_tag_key: str
    gpu_agent_tag_value: str
    # The first organization region: its member role also lists instances in every region, once a day, for
    # the count of the account's regions outside the organization's (sweep/regions.py report_member_unwatched).
    count_region: str = ""
    # The hub's own regions (its stacks'): in the hub's account a member stack rolls the agent out only elsewhere.
    hub_regions: tuple[str, ...] = ()


# What the member role of the first organization region may do beyond a unit's sweep, and the single-account
# sweep role of the first region does too (infra/stack.py): list the enabled regions and their instances.
COUNT_UNWATCHED = ("ec2:DescribeRegions", "ec2:DescribeInstances")


class MemberStack(Stack):
    """One member account and region: the hub's role, the digest's read role, and the GPU agent and collector
    rollout.

    Parameters (set by the StackSet from the hub stack): the ARNs of the hub roles the member role trusts, the
    ARN of the hub's digest role (the read role trusts it alone), and the hub's account id (in the hub's own
    account, in a hub region, the hub stack already rolls the agent out, so the member stack there holds only the
    roles; in the hub's account's other organization regions the hub sweeps it as a member and the rollout is
    the member stack's)."""

    def __init__(self, scope: Construct, id: str, *, settings: MemberSettings) -> None:
        super().__init__(
            scope,
            id,
            description="idle-reaper member: the roles the hub assumes, and the GPU agent and activity collector",
            synthesizer=BootstraplessSynthesizer(),  # members have no CDK bootstrap; it also refuses any asset
            analytics_reporting=False,
        )
        hub_roles = [
            CfnParameter(self, name, type="String", allowed_pattern=ROLE_ARN_PATTERN) for name in HUB_ROLE_PARAMETERS
        ]
        hub_digest = CfnParameter(self, HUB_DIGEST_PARAMETER, type="String", allowed_pattern=ROLE_ARN_PATTERN)
        hub_account = CfnParameter(self, HUB_ACCOUNT_PARAMETER, type="String", allowed_pattern=r"^\d{12}$")
        machines = MachineAccess(self, settings.managed_tag_key)
        # Only the hub's roles, and only while they belong to this organization.
        in_organization = {"StringEquals": {"aws:PrincipalOrgID": settings.organization_id}}
        first, *others = (iam.ArnPrincipal(p.value_as_string) for p in hub_roles)
        self.role = iam.Role(
            self,
            "HubRole",
            role_name=member_role_name(settings.prefix, Aws.REGION),
            description="idle-reaper: assumed by the hub's sweep and Slack endpoint to act on opted-in machines here",
            assumed_by=first.with_conditions(in_organization),
            inline_policies={
                "Machines": iam.PolicyDocument(
                    statements=[*machines.sweep_statements(Aws.REGION), *machines.answer_statements([Aws.REGION])]
                )
            },
        )
        assert self.role.assume_role_policy is not None
        self.role.assume_role_policy.add_statements(
            iam.PolicyStatement(actions=["sts:AssumeRole"], principals=others, conditions=in_organization)
        )
        machines.suppress_wildcards(self.role, settings.ssm_prefix)
        if settings.count_region:
            # Only in the first organization region's stack (a condition, so one template serves every region).
            counts_here = CfnCondition(
                self, "CountsOtherRegions", expression=Fn.condition_equals(Aws.REGION, settings.count_region)
            )
            count = iam.Policy(
                self,
                "CountOtherRegions",
                roles=[self.role],
                statements=[
                    iam.PolicyStatement(sid="CountUnwatchedRegions", actions=list(COUNT_UNWATCHED), resources=["*"])
                ],
            )
            assert isinstance(count.node.default_child, CfnResource)
            count.node.default_child.cfn_options.condition = counts_here
            suppress(
                count,
                NagPackSuppression(
                    id="AwsSolutions-IAM5",
                    reason="The daily count of running instances in this account's regions outside the organization's "
                    "(read only): DescribeRegions and DescribeInstances have no resource-level permissions and must "
                    "reach every region; the same two calls the first region's single-account sweep role has.",
                    applies_to=["Resource::*"],
                ),
            )
        # The weekly digest reads how idle this account's exempt machines were: their metrics, nothing else.
        self.read_role = iam.Role(
            self,
            "DigestReadRole",
            role_name=member_read_role_name(settings.prefix, Aws.REGION),
            description="idle-reaper: assumed by the hub's weekly digest to read machine metrics here (read-only)",
            assumed_by=iam.ArnPrincipal(hub_digest.value_as_string).with_conditions(in_organization),
            inline_policies={
                "Metrics": iam.PolicyDocument(
                    statements=[
                        iam.PolicyStatement(
                            sid="ReadMetrics",
                            actions=["cloudwatch:GetMetricData"],
                            resources=["*"],
                            conditions=in_regions([Aws.REGION]),
                        )
                    ]
                )
            },
        )
        suppress(
            self.read_role,
            NagPackSuppression(
                id="AwsSolutions-IAM5",
                reason="cloudwatch:GetMetricData has no resource-level permissions (Resource must be *); it is the "
                "role's only action, in this region only.",
                applies_to=["Resource::*"],
            ),
        )
        if settings.gpu_agent_tag_key:
            rollout = GpuAgentRollout(
                self,
                "GpuAgent",
                config_file=REPO_ROOT / "infra" / "cloudwatch-agent-gpu.json",
                parameter_name=member_agent_parameter_name(settings.prefix),
                tag_key=settings.gpu_agent_tag_key,
                tag_value=settings.gpu_agent_tag_value,
            )
            not_hub = Fn.condition_not(Fn.condition_equals(Aws.ACCOUNT_ID, hub_account))
            if settings.hub_regions:
                in_hub_region = any_of([Fn.condition_equals(Aws.REGION, r) for r in settings.hub_regions])
                rolls_out = CfnCondition(
                    self, "NoHubStackHere", expression=Fn.condition_or(not_hub, Fn.condition_not(in_hub_region))
                )
            else:
                rolls_out = CfnCondition(self, "NotTheHubAccount", expression=not_hub)
            for child in rollout.node.find_all():
                if isinstance(child, CfnResource):
                    child.cfn_options.condition = rolls_out


def any_of(conditions: Sequence[ICfnConditionExpression]) -> ICfnConditionExpression:
    """One condition true when any is: CloudFormation's Fn::Or takes 2 to 10, so one stands alone and more are
    nested by tens."""
    if not conditions:
        raise ValueError("any_of needs at least one condition")
    level = list(conditions)
    while len(level) > 1:
        chunks = [level[i : i + 10] for i in range(0, len(level), 10)]
        level = [c[0] if len(c) == 1 else Fn.condition_or(*c) for c in chunks]
    return level[0]


def member_template(settings: MemberSettings) -> dict[str, Any]:
    """The member stack's template, synthesized in an app of its own (cdk-nag included) so the hub's app holds
    the hub's stacks only. Fails, naming the findings, when cdk-nag or CDK report an error."""
    outdir = tempfile.mkdtemp(prefix="idle-reaper-member-")
    try:
        app = App(outdir=outdir)
        stack = MemberStack(app, "Member", settings=settings)
        Aspects.of(app).add(AwsSolutionsChecks(verbose=True))
        artifact = app.synth().get_stack_artifact(stack.artifact_id)
        errors = [f"{m.id}: {m.entry.data}" for m in artifact.messages if m.level.value in ("error", "warning")]
        if errors:
            raise ValueError("the member stack has findings:\n" + "\n".join(errors))
        template: dict[str, Any] = artifact.template
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    body = json.dumps(template, separators=(",", ":"))
    if len(body) > TEMPLATE_BODY_LIMIT:
        raise ValueError(
            f"the member template is {len(body)} bytes, over CloudFormation's {TEMPLATE_BODY_LIMIT} for an inline "
            "template: a StackSet would need it in S3 (see docs/deploying.md, Organizations)"
        )
    return template


class MemberStackSet(Construct):
    """The service-managed StackSet of the member stack: every account of the target OUs (and every account
    that joins them later: automatic deployment), in every member region. An account that leaves the OUs has
    its member stack removed (RetainStacksOnAccountRemoval false), and with it the hub's access."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        organization: OrganizationContext,
        stack_set_name: str,
        template: dict[str, Any],
        hub_roles: Sequence[iam.IRole],
        digest_role: iam.IRole,
    ) -> None:
        super().__init__(scope, id)
        if len(hub_roles) != len(HUB_ROLE_PARAMETERS):
            raise ValueError(f"the member stack trusts exactly {len(HUB_ROLE_PARAMETERS)} hub roles")
        self.stack_set = cfn.CfnStackSet(
            self,
            "StackSet",
            stack_set_name=stack_set_name,
            description="idle-reaper member stacks: the roles the hub assumes, the GPU agent and activity collector",
            permission_model="SERVICE_MANAGED",
            # The management account (SELF) or a delegated administrator for StackSets.
            call_as="DELEGATED_ADMIN" if organization.delegated_admin else "SELF",
            auto_deployment=cfn.CfnStackSet.AutoDeploymentProperty(
                enabled=True, retain_stacks_on_account_removal=False
            ),
            capabilities=["CAPABILITY_NAMED_IAM"],
            managed_execution={"Active": True},  # operations queue instead of failing on a running one
            # One account that cannot take the stack (a region it has disabled, an SCP) must not hold up the
            # others: the hub reports that account when it cannot assume its role.
            operation_preferences=cfn.CfnStackSet.OperationPreferencesProperty(
                failure_tolerance_percentage=100, max_concurrent_percentage=100, region_concurrency_type="PARALLEL"
            ),
            parameters=[
                *(
                    cfn.CfnStackSet.ParameterProperty(parameter_key=key, parameter_value=role.role_arn)
                    for key, role in zip(HUB_ROLE_PARAMETERS, hub_roles, strict=True)
                ),
                cfn.CfnStackSet.ParameterProperty(
                    parameter_key=HUB_DIGEST_PARAMETER, parameter_value=digest_role.role_arn
                ),
                cfn.CfnStackSet.ParameterProperty(parameter_key=HUB_ACCOUNT_PARAMETER, parameter_value=Aws.ACCOUNT_ID),
            ],
            stack_instances_group=[
                cfn.CfnStackSet.StackInstancesProperty(
                    deployment_targets=cfn.CfnStackSet.DeploymentTargetsProperty(
                        organizational_unit_ids=list(organization.targets)
                    ),
                    regions=list(organization.regions),
                )
            ],
            template_body=json.dumps(template, separators=(",", ":")),
        )


# Read-only calls on the organization, none with a region (Organizations is global): the planner lists the
# accounts (aws/accounts.py AccountDirectory); every role that assumes member roles asks, after a refusal,
# whether the account was suspended or left (AccountDirectory.status_of).
ORGANIZATION_LISTING = (
    "organizations:DescribeOrganization",
    "organizations:ListAccountsForParent",
    "organizations:ListChildren",
)
ACCOUNT_STATUS = ("organizations:DescribeAccount",)


def grant_member_access(
    roles: Sequence[iam.IRole], *, lists_accounts: Sequence[iam.IRole], prefix: str, organization_id: str
) -> None:
    """The hub roles may assume the member role in any account of the organization, and nothing else across
    accounts: the role name is the member stack's, and the role must belong to this organization. Those of
    `lists_accounts` also list the accounts: the sweep's planner, and the Slack endpoint's `/idle-reaper
    doctor`, which checks every member account (a role of `lists_accounts` not in `roles`, the weekly digest's,
    lists them only to name them)."""
    pattern = f"arn:{Aws.PARTITION}:iam::*:role/{member_role_name(prefix, '*')}"
    for role in roles:
        role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="AssumeMemberRoles",
                actions=["sts:AssumeRole"],
                resources=[pattern],
                conditions={"StringEquals": {"aws:ResourceOrgID": organization_id}},
            )
        )
        reads = [*ORGANIZATION_LISTING, *ACCOUNT_STATUS] if role in lists_accounts else list(ACCOUNT_STATUS)
        role.add_to_principal_policy(iam.PolicyStatement(sid="ReadOrganization", actions=reads, resources=["*"]))
        suppress(
            role,
            NagPackSuppression(
                id="AwsSolutions-IAM5",
                reason="Member accounts join and leave the organization's OUs without a deploy (the StackSet's "
                "automatic deployment): the member role is named in every account of the organization, and the "
                "aws:ResourceOrgID condition keeps it inside this organization. The organization's accounts and "
                "OUs are read (never changed) wherever they are.",
                applies_to=[RegexAppliesTo(regex=r"/^Resource::arn:.+:iam::\*:role\/.+-member-\*$/"), "Resource::*"],
            ),
        )
    for role in (r for r in lists_accounts if r not in roles):
        role.add_to_principal_policy(
            iam.PolicyStatement(sid="ListOrganization", actions=list(ORGANIZATION_LISTING), resources=["*"])
        )
        suppress(
            role,
            NagPackSuppression(
                id="AwsSolutions-IAM5",
                reason="The organization's accounts and OUs are listed (never changed) to name member accounts; "
                "Organizations' listing calls have no resource-level permissions.",
                applies_to=["Resource::*"],
            ),
        )


def grant_member_reads(digest_role: iam.IRole, *, prefix: str, organization_id: str) -> None:
    """The weekly digest may assume the member stacks' read role (cloudwatch:GetMetricData) in any account of the
    organization, and no other role: not the member role, which acts on machines."""
    digest_role.add_to_principal_policy(
        iam.PolicyStatement(
            sid="AssumeMemberReadRoles",
            actions=["sts:AssumeRole"],
            resources=[f"arn:{Aws.PARTITION}:iam::*:role/{member_read_role_name(prefix, '*')}"],
            conditions={"StringEquals": {"aws:ResourceOrgID": organization_id}},
        )
    )
    digest_role.add_to_principal_policy(
        iam.PolicyStatement(sid="ReadAccountStatus", actions=list(ACCOUNT_STATUS), resources=["*"])
    )
    suppress(
        digest_role,
        NagPackSuppression(
            id="AwsSolutions-IAM5",
            reason="Member accounts join and leave the organization's OUs without a deploy: the read role is named "
            "in every account of the organization, and the aws:ResourceOrgID condition keeps it inside this "
            "organization. An account's status is read (never changed) after a refused AssumeRole.",
            applies_to=[
                RegexAppliesTo(regex=rf"/^Resource::arn:.+:iam::\*:role\/.+-{READ_ROLE_SUFFIX}-\*$/"),
                "Resource::*",
            ],
        ),
    )
