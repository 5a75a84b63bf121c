"""What idle-reaper may do to machines, in one place: the statements the sweep's and the Slack endpoint's roles
carry in a single-account stack, and that the member role carries in every member account (infra/organization.py).

Every write names only machines and groups that opted in (the `aws:ResourceTag/<managedTagKey> = true`
condition); reads that have no resource-level permissions are limited to the regions the role works in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from cdk_nag import NagPackSuppression, RegexAppliesTo

from infra.constructs import suppress

# The sweep's read-only calls; none has resource-level permissions in IAM. The Spot requests and capacity
# reservations say what kind of machine each is (core/kinds.py).
SWEEP_READS = (
    "ec2:DescribeInstances",
    "ec2:DescribeAvailabilityZones",  # the fleet is listed by zone, side by side (aws/fleet.py)
    "ec2:DescribeSpotInstanceRequests",
    "ec2:DescribeCapacityReservations",
    "autoscaling:DescribeAutoScalingGroups",
    "cloudwatch:GetMetricData",
    "sagemaker:ListNotebookInstances",  # SageMaker notebook instances (aws/notebooks.py)
    "sagemaker:ListApps",  # Studio apps, reported once a day and swept for teams that ask (aws/studio.py)
    "sagemaker:ListEndpoints",  # SageMaker real-time endpoints (aws/endpoints.py)
    "application-autoscaling:DescribeScalableTargets",  # ... and their variants' minimum capacity
)
# On any notebook instance, tagged or not (listing has to read every one's tags to find the team's).
NOTEBOOK_READS = ("sagemaker:ListTags", "sagemaker:DescribeNotebookInstance")
STUDIO_READS = ("sagemaker:DescribeSpace", "sagemaker:DescribeDomain", "sagemaker:ListTags")
# On any endpoint, its configuration and models (an endpoint whose configuration or model is gone is never deleted).
ENDPOINT_READS = (
    "sagemaker:ListTags",
    "sagemaker:DescribeEndpoint",
    "sagemaker:DescribeEndpointConfig",
    "sagemaker:DescribeModel",
)


def in_regions(regions: Sequence[str]) -> dict[str, Any]:
    return {"StringEquals": {"aws:RequestedRegion": list(regions)}}


@dataclass(frozen=True)
class MachineAccess:
    """The machine statements of one stack (its account: the hub's, or each member's)."""

    stack: Stack
    managed_tag_key: str

    def managed(self) -> dict[str, Any]:
        """Writes only on resources that opted in. For EC2 calls that is the instance's tag; for Auto
        Scaling calls it is the group's own tag (aws:ResourceTag on the autoScalingGroup resource)."""
        return {"StringEquals": {f"aws:ResourceTag/{self.managed_tag_key}": "true"}}

    def instances(self, region: str) -> str:
        return self.stack.format_arn(service="ec2", resource="instance", resource_name="*", region=region)

    def notebooks(self, region: str) -> str:
        return self.stack.format_arn(
            service="sagemaker", resource="notebook-instance", resource_name="*", region=region
        )

    def studio(self, region: str) -> list[str]:
        return [
            self.stack.format_arn(service="sagemaker", resource=kind, resource_name="*", region=region)
            for kind in ("space", "domain")
        ]

    def apps(self, region: str) -> list[str]:
        """The Studio apps idle-reaper may delete and start again: JupyterLab and Code Editor apps of any space
        (app/<domain>/<space>/<type>/<name>; SageMaker writes the type lowercase in an app's ARN)."""
        return [
            self.stack.format_arn(service="sagemaker", resource="app", resource_name=f"*/*/{kind}/*", region=region)
            for kind in ("jupyterlab", "codeeditor")
        ]

    def endpoints(self, region: str) -> list[str]:
        """Endpoints, then what bringing one back reads or names: endpoint configurations and models."""
        return [
            self.stack.format_arn(service="sagemaker", resource=kind, resource_name="*", region=region)
            for kind in ("endpoint", "endpoint-config", "model")
        ]

    def opting_in(self) -> dict[str, Any]:
        """A create that tags what it creates with the opt-in tag (CreateEndpoint with the endpoint's own tags)."""
        return {"StringEquals": {f"aws:RequestTag/{self.managed_tag_key}": "true"}}

    def groups(self, region: str) -> str:
        # arn:aws:autoscaling:<region>:<account>:autoScalingGroup:<uuid>:autoScalingGroupName/<name>
        return self.stack.format_arn(
            service="autoscaling",
            resource="autoScalingGroup",
            resource_name="*:autoScalingGroupName/*",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
            region=region,
        )

    def sweep_statements(self, region: str) -> list[iam.PolicyStatement]:
        """List the fleet and read its metrics in `region`; stop, release or (on a team's opt-in) terminate
        machines that opted in."""
        return [
            iam.PolicyStatement(
                sid="FleetReads", actions=list(SWEEP_READS), resources=["*"], conditions=in_regions([region])
            ),
            # TerminateInstances only for machines EC2 cannot stop, on a team's opt-in
            # (terminate_unstoppable_after_minutes); like every write, only on opted-in machines.
            iam.PolicyStatement(
                sid="StopManagedInstances",
                actions=["ec2:StopInstances", "ec2:TerminateInstances"],
                resources=[self.instances(region)],
                conditions=self.managed(),
            ),
            iam.PolicyStatement(
                sid="ReadNotebookInstances", actions=list(NOTEBOOK_READS), resources=[self.notebooks(region)]
            ),
            iam.PolicyStatement(sid="ReadStudio", actions=list(STUDIO_READS), resources=self.studio(region)),
            iam.PolicyStatement(
                sid="StopManagedNotebookInstances",
                actions=["sagemaker:StopNotebookInstance"],
                resources=[self.notebooks(region)],
                conditions=self.managed(),
            ),
            iam.PolicyStatement(sid="ReadEndpoints", actions=list(ENDPOINT_READS), resources=self.endpoints(region)),
            iam.PolicyStatement(
                sid="DeleteManagedEndpoints",
                actions=["sagemaker:DeleteEndpoint"],
                resources=self.endpoints(region)[:1],
                conditions=self.managed(),
            ),
            # DeleteApp's condition keys are the app's own tags (none names its space's): an app started from Studio
            # carries its space's tags where the domain propagates them (TagPropagation ENABLED), and one idle-reaper
            # started again carries them because it passed them to CreateApp (docs/policy.md).
            iam.PolicyStatement(
                sid="DeleteManagedStudioApps",
                actions=["sagemaker:DeleteApp"],
                resources=self.apps(region),
                conditions=self.managed(),
            ),
            iam.PolicyStatement(
                sid="ReleaseManagedGroupMembers",
                actions=["autoscaling:SetInstanceProtection", "autoscaling:TerminateInstanceInAutoScalingGroup"],
                resources=[self.groups(region)],
                conditions=self.managed(),
            ),
        ]

    def answer_statements(self, regions: Sequence[str]) -> list[iam.PolicyStatement]:
        """A person's answer acts on one known machine (no discovery), in any of `regions`."""
        return [
            iam.PolicyStatement(
                sid="StartStopManagedInstances",
                # TerminateInstances: an owner's confirmed "Terminate now" on a machine EC2 cannot stop.
                actions=["ec2:StartInstances", "ec2:StopInstances", "ec2:TerminateInstances"],
                resources=[self.instances(r) for r in regions],
                conditions=self.managed(),
            ),
            iam.PolicyStatement(
                sid="StartStopManagedNotebookInstances",
                actions=["sagemaker:StartNotebookInstance", "sagemaker:StopNotebookInstance"],
                resources=[self.notebooks(r) for r in regions],
                conditions=self.managed(),
            ),
            # "Delete now", and "Bring it back": CreateEndpoint from the kept configuration, with the endpoint's own
            # tags (the opt-in tag among them), after reading that its configuration and models still exist.
            iam.PolicyStatement(
                sid="DeleteManagedEndpoints",
                actions=["sagemaker:DeleteEndpoint"],
                resources=[self.endpoints(r)[0] for r in regions],
                conditions=self.managed(),
            ),
            iam.PolicyStatement(
                sid="BringBackManagedEndpoints",
                actions=["sagemaker:CreateEndpoint", "sagemaker:AddTags"],
                resources=[arn for r in regions for arn in self.endpoints(r)[:2]],
                conditions=self.opting_in(),
            ),
            iam.PolicyStatement(
                sid="ReadEndpointConfigurations",
                actions=["sagemaker:DescribeEndpointConfig", "sagemaker:DescribeModel"],
                resources=[arn for r in regions for arn in self.endpoints(r)[1:]],
            ),
            # "Delete now" and "Start it again": CreateApp in its space with the space's tags (the opt-in tag among
            # them), which needs AddTags on the app too.
            iam.PolicyStatement(
                sid="DeleteManagedStudioApps",
                actions=["sagemaker:DeleteApp"],
                resources=[arn for r in regions for arn in self.apps(r)],
                conditions=self.managed(),
            ),
            iam.PolicyStatement(
                sid="StartManagedStudioApps",
                actions=["sagemaker:CreateApp", "sagemaker:AddTags"],
                resources=[arn for r in regions for arn in self.apps(r)],
                conditions=self.opting_in(),
            ),
            iam.PolicyStatement(
                sid="ProtectManagedGroupMembers",
                actions=["autoscaling:SetInstanceProtection"],
                resources=[self.groups(r) for r in regions],
                conditions=self.managed(),
            ),
        ]

    def suppress_wildcards(self, role: iam.IRole, ssm_prefix: str, *, reads: Sequence[str] = ()) -> None:
        reads_reason = f"{', '.join(reads)} have no resource-level permissions (Resource must be *). " if reads else ""
        suppress(
            role,
            NagPackSuppression(
                id="AwsSolutions-IAM5",
                reason=reads_reason + "Stop, start and scale-in name every instance or Auto Scaling group "
                f"because machines come and go; the aws:ResourceTag/{self.managed_tag_key} = true condition "
                "limits them to machines and groups that opted in (an endpoint brought back, a Studio app started "
                f"again: the same tag in aws:RequestTag). Parameter reads stay under {ssm_prefix}/.",
                applies_to=[
                    "Resource::*",
                    # Partition, region and account are tokens or literals depending on the environment.
                    RegexAppliesTo(regex=r"/^Resource::arn:.+:ec2:.*:instance\/\*$/"),
                    RegexAppliesTo(
                        regex=r"/^Resource::arn:.+:sagemaker:.*:(notebook-instance|space|domain|endpoint|endpoint-config|model)\/\*$/"
                    ),
                    RegexAppliesTo(regex=r"/^Resource::arn:.+:sagemaker:.*:app\/\*\/\*\/(jupyterlab|codeeditor)\/\*$/"),
                    RegexAppliesTo(
                        regex=r"/^Resource::arn:.+:autoscaling:.+:autoScalingGroup:\*:autoScalingGroupName\/\*$/"
                    ),
                    RegexAppliesTo(regex=r"/^Resource::arn:.+:ssm:.*:parameter\/.+\/\*$/"),
                ],
            ),
        )
