"""The idle-reaper stack: one per region. See docs/deploying.md for the walkthrough."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aws_cdk import (
    App,
    ArnFormat,
    Aspects,
    CfnOutput,
    Duration,
    Environment,
    RemovalPolicy,
    SecretValue,
    Stack,
    Tags,
    Token,
)
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_lambda_destinations as destinations
from aws_cdk import aws_secretsmanager as secretsmanager
from aws_cdk import aws_sqs as sqs
from cdk_nag import AwsSolutionsChecks, NagPackSuppression, RegexAppliesTo
from constructs import Construct, Node

from idle_reaper import __version__
from idle_reaper.aws.accounts import ORGANIZATION_ENV
from idle_reaper.aws.deploy import RELAY_ALARM_ENV, STACK_ENV
from idle_reaper.organization import ContextError, OrganizationContext, organization_from_context, role_names_too_long
from idle_reaper.policy import Settings, TeamPolicy
from idle_reaper.sweep import PLANNER_MEMORY_MB, SHARDS_AT_ONCE
from infra.bundling import CHART_PACKAGES, REPO_ROOT, dependency_layer_code
from infra.constructs import (
    METRICS_NAMESPACE,
    SERVICE_NAME,
    GpuAgentRollout,
    ReaperFunction,
    ReaperMonitoring,
    SeededParameter,
    SweepFanout,
    suppress,
)
from infra.machine_access import SWEEP_READS, MachineAccess, in_regions
from infra.notebooks import NotebookAgent
from infra.organization import (
    MemberSettings,
    MemberStackSet,
    grant_member_access,
    grant_member_reads,
    member_template,
)
from infra.studio import StudioAgent

SWEEP_HANDLER = "idle_reaper.handlers.sweep.handler"
SLACK_HANDLER = "idle_reaper.handlers.slack.handler"
ALARMS_HANDLER = "idle_reaper.handlers.alarms.handler"
SHARD_HANDLER = "idle_reaper.handlers.fanout.shard_handler"
GATHER_HANDLER = "idle_reaper.handlers.fanout.gather_handler"
DIGEST_HANDLER = "idle_reaper.handlers.digest.handler"  # the weekly digest, checked hourly
FANOUT_ENV = "IDLE_REAPER_FANOUT_ARN"  # handlers/sweep.py: hand a fleet larger than one shard to the state machine
# 1,769 MB is one full vCPU: the sweep's own CPU time (benchmarks/sweep_latency.py) is measured on one core,
# and the Slack endpoint's cold start (benchmarks/cold_import.py) must leave room in Slack's 3 s.
ONE_VCPU_MB = 1769

# `/idle-reaper doctor` (sweep/doctor.py run_checks): the Slack endpoint lists its own region's fleet, its
# groups' opt-in tags and the last hour of metrics, for admins only; none has resource-level permissions.
DOCTOR_READS = (
    "ec2:DescribeInstances",
    "ec2:DescribeAvailabilityZones",
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeTags",
    "cloudwatch:GetMetricData",
    "lambda:GetAccountSettings",  # deploy.concurrency: the account's quota
)
# ... and its own stack's deploy checks (idle_reaper.aws.deploy), each on that stack's own resource alone.
DOCTOR_STACK_READS = (
    "cloudformation:DescribeStacks",
    "cloudformation:GetTemplate",
    "cloudformation:ListStackResources",
)
DOCTOR_TOPIC_READS = ("sns:GetTopicAttributes", "sns:ListSubscriptionsByTopic")
SWEEP_MINUTES_ENV = "IDLE_REAPER_SWEEP_MINUTES"  # slack/routing.py: deploy.last_sweep judges by the schedule
POLICY_READS = ("ssm:GetParameter", "ssm:GetParametersByPath")
# Exactly the item calls each function makes (aws.DynamoStateStore); DeleteItem is granted to the sweep
# separately, for its own claims and the quiet-hours stops it told only. Query: a partition of entries (the
# quiet-hours stops of an account and region, StateStore.entries), on the table alone (no index).
SWEEP_TABLE_ACTIONS = ("dynamodb:BatchGetItem", "dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:Query")
# The items the sweep may delete besides its claims: the quiet-hours stops it told (sweep/quiet_hours.py).
QUIET_STOPS_KEYS = "entries#quiet-stops#*"
SLACK_TABLE_ACTIONS = (
    "dynamodb:BatchGetItem",
    "dynamodb:GetItem",
    "dynamodb:PutItem",
    "dynamodb:Query",
)
# BatchGetItem: the stop-notice pass loads the records whose notices the shards queued (sweep/notices.py).
GATHER_TABLE_ACTIONS = ("dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:BatchGetItem")
# The weekly digest: one Scan (records and the audit of its weeks) when a digest is due, its once-a-week claims.
DIGEST_TABLE_ACTIONS = ("dynamodb:Scan", "dynamodb:PutItem")
OWNER_INDEX = "owner-index"
DEFAULT_PREFIX = "idle-reaper"  # the names the CLI assumes (IDLE_REAPER_TABLE, IDLE_REAPER_SSM_PREFIX unset)
PREFIX_PATTERN = re.compile(r"[a-z][a-z0-9-]{0,30}[a-z0-9]")


@dataclass(frozen=True)
class IdleReaperProps:
    """What an admin may choose at deploy time (CDK context keys in brackets)."""

    # [prefix] every physical name derives from it (table, secret, functions, state machine, dashboard,
    # agent parameter, SSM path): a second stack with another prefix (staging) fits beside the first.
    prefix: str = DEFAULT_PREFIX
    schedule_minutes: int = 5  # [scheduleMinutes] how often a sweep runs
    alarm_email: str | None = None  # [alarmEmail] who gets the alarms
    regions: tuple[str, ...] = ()  # [regions] one stack per region; empty: the CLI's default region
    ssm_prefix: str = ""  # [ssmPrefix] where settings and team policies live; empty: /<prefix>
    # [managedTagKey] machines (and Auto Scaling groups) opt in with this tag set to `true`; IAM lets the
    # reaper stop, start or release nothing else. Seeded into the settings as tags.managed.
    managed_tag_key: str = "idle-reaper:managed"
    # [gpuAgentTagKey, gpuAgentTagValue] instances with this tag get the CloudWatch agent for GPU
    # metrics; an empty key turns the rollout off.
    gpu_agent_tag_key: str = "idle-reaper:gpu-agent"
    gpu_agent_tag_value: str = "install"
    # [sweepReservedConcurrency, slackReservedConcurrency] executions reserved for the sweep (1: two sweeps
    # never plan at once) and the Slack endpoint (a flood of unsigned requests cannot take the account's
    # concurrency). AWS keeps 100 unreserved, so the account's quota must be 100 + their sum; 0 reserves none.
    sweep_reserved_concurrency: int = 1
    slack_reserved_concurrency: int = 10
    # [organization] organization mode (docs/deploying.md, Organizations): this deploy is the hub, and a
    # StackSet puts the member stack into the target OUs' accounts. None: single-account mode.
    organization: OrganizationContext | None = None

    def __post_init__(self) -> None:
        if not PREFIX_PATTERN.fullmatch(self.prefix):
            raise ValueError(
                "prefix must be 2-32 lowercase letters, digits or '-', starting with a letter and not ending "
                f"with '-', e.g. idle-reaper-staging (got {self.prefix!r})"
            )
        if self.organization is not None and (too_long := role_names_too_long(self.prefix, self.organization.regions)):
            raise ContextError("CDK context: " + "; ".join(too_long))
        if not self.ssm_prefix:
            object.__setattr__(self, "ssm_prefix", f"/{self.prefix}")
        for key, value in (
            ("sweepReservedConcurrency", self.sweep_reserved_concurrency),
            ("slackReservedConcurrency", self.slack_reserved_concurrency),
        ):
            if not 0 <= value <= 1000:
                raise ValueError(f"{key} must be between 0 (reserve none) and 1000 (got {value})")
        if not 1 <= self.schedule_minutes <= 60:
            raise ValueError("scheduleMinutes must be between 1 and 60")
        if not self.ssm_prefix.startswith("/") or self.ssm_prefix.endswith("/"):
            raise ValueError("ssmPrefix must start with '/' and not end with '/', e.g. /idle-reaper")
        if not 1 <= len(self.managed_tag_key) <= 128 or self.managed_tag_key.startswith("aws:"):
            raise ValueError("managedTagKey must be a tag key of 1-128 characters, not starting with 'aws:'")

    @classmethod
    def from_context(cls, node: Node) -> IdleReaperProps:
        """Read the props from CDK context (cdk.json, or `-c key=value` on the command line)."""

        def get(key: str) -> Any:
            return node.try_get_context(key)

        defaults = cls()
        regions = get("regions") or ()
        if isinstance(regions, str):  # `-c regions=us-east-1,eu-west-1`
            regions = [r.strip() for r in regions.split(",")]
        return cls(
            prefix=str(get("prefix") or defaults.prefix),
            schedule_minutes=int(get("scheduleMinutes") or defaults.schedule_minutes),
            alarm_email=get("alarmEmail") or None,
            regions=tuple(r for r in regions if r),
            ssm_prefix=get("ssmPrefix") or "",  # empty: /<prefix>
            managed_tag_key=_or_default(get("managedTagKey"), defaults.managed_tag_key),
            gpu_agent_tag_key=_or_default(get("gpuAgentTagKey"), defaults.gpu_agent_tag_key),
            gpu_agent_tag_value=get("gpuAgentTagValue") or defaults.gpu_agent_tag_value,
            sweep_reserved_concurrency=_count(get("sweepReservedConcurrency"), defaults.sweep_reserved_concurrency),
            slack_reserved_concurrency=_count(get("slackReservedConcurrency"), defaults.slack_reserved_concurrency),
            organization=organization_from_context(get("organization")),
        )

    # Physical names: per region (DynamoDB, Secrets Manager, Lambda, Step Functions and SSM are regional;
    # a dashboard is account-wide, so its name carries the region).
    @property
    def table_name(self) -> str:
        return f"{self.prefix}-state"

    @property
    def secret_name(self) -> str:
        return f"{self.prefix}/slack"

    @property
    def slack_function_name(self) -> str:
        return f"{self.prefix}-slack"

    @property
    def state_machine_name(self) -> str:
        return f"{self.prefix}-sweep"

    @property
    def agent_parameter_name(self) -> str:
        # The managed CloudWatchAgentServerPolicy lets instances read parameters named AmazonCloudWatch-*.
        return f"AmazonCloudWatch-{self.prefix}-gpu"

    @property
    def member_stack_set_name(self) -> str:
        return f"{self.prefix}-members"

    def dashboard_name(self, region: str) -> str:
        return f"{self.prefix}-{region}"

    @property
    def relay_alarm_name(self) -> str:
        """The alarm on the Slack alarm relay's own errors (the sweep reads it: alarm names are per region)."""
        return f"{self.prefix}-alarm-relay-errors"

    @property
    def stack_name(self) -> str:
        """The CloudFormation stack's name, the same in every region (names are per region), so adding
        regions later updates the stack a default deploy made instead of creating a second one beside it."""
        return "IdleReaper" if self.prefix == DEFAULT_PREFIX else self.prefix


def _count(value: Any, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"a reserved concurrency must be a whole number (got {value!r})") from None


def _or_default(value: Any, default: str) -> str:
    """Context value if set at all (an empty string is a choice: it turns a feature off)."""
    return default if value is None else str(value)


class IdleReaperStack(Stack):
    """Everything idle-reaper needs in one region: state, functions, schedule, permissions,
    seeded policies, GPU agent rollout, alarms and dashboard."""

    def __init__(self, scope: Construct, id: str, *, props: IdleReaperProps, **kwargs: Any) -> None:
        super().__init__(scope, id, description="idle-reaper: stops idle ML machines after warning in Slack", **kwargs)
        interval = Duration.minutes(props.schedule_minutes)
        Tags.of(self).add("application", "idle-reaper")

        table = dynamodb.Table(
            self,
            "StateTable",
            table_name=props.table_name,
            partition_key=dynamodb.Attribute(name="pk", type=dynamodb.AttributeType.STRING),
            sort_key=dynamodb.Attribute(name="sk", type=dynamodb.AttributeType.STRING),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            time_to_live_attribute="expires_at",
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            deletion_protection=True,
            # Snoozes and the audit trail outlive the stack.
            removal_policy=RemovalPolicy.RETAIN,
        )
        # The Slack handler lists one owner's machines without a scan.
        table.add_global_secondary_index(
            index_name=OWNER_INDEX,
            partition_key=dynamodb.Attribute(name="owner_slack_id", type=dynamodb.AttributeType.STRING),
            projection_type=dynamodb.ProjectionType.ALL,
        )

        # Filled by the admin (docs/deploying.md). The placeholder has the right shape and empty values,
        # and CloudFormation only rewrites it if this template value changes, which it does not.
        secret = secretsmanager.Secret(
            self,
            "SlackSecret",
            secret_name=props.secret_name,
            description="idle-reaper Slack app credentials: JSON with bot_token and signing_secret",
            secret_string_value=SecretValue.unsafe_plain_text('{"bot_token": "", "signing_secret": ""}'),
            # The admin's credentials outlive the stack, as the table and the logs do.
            removal_policy=RemovalPolicy.RETAIN,
        )
        suppress(
            secret,
            NagPackSuppression(
                id="AwsSolutions-SMG4",
                reason="The Slack bot token and signing secret are issued and rotated in Slack, not by a "
                "rotation Lambda; rotate them there and put the new values into this secret.",
            ),
        )

        layer = lambda_.LayerVersion(
            self,
            "Dependencies",
            code=dependency_layer_code(REPO_ROOT),
            compatible_runtimes=[lambda_.Runtime.PYTHON_3_12],
            compatible_architectures=[lambda_.Architecture.ARM_64],
            description="idle-reaper runtime dependencies from uv.lock (boto3 comes with the runtime; Pillow is the "
            "digest's own layer)",
        )
        code = lambda_.Code.from_asset(str(REPO_ROOT / "lambdas"), exclude=["**/__pycache__", "**/*.pyc", "*.egg-info"])
        all_regions = list(props.regions) or [self.region]
        environment = {
            "IDLE_REAPER_TABLE": table.table_name,
            "IDLE_REAPER_SSM_PREFIX": props.ssm_prefix,
            "IDLE_REAPER_SLACK_SECRET": secret.secret_arn,
            "POWERTOOLS_SERVICE_NAME": SERVICE_NAME,
            "POWERTOOLS_METRICS_NAMESPACE": METRICS_NAMESPACE,
        }

        sweep_timeout = Duration.minutes(min(max(props.schedule_minutes - 1, 1), 15))
        # A shard worker has the same budget; it stops starting new work FINISH_RESERVE before its end.
        shard_timeout = sweep_timeout
        sweep = ReaperFunction(
            self,
            "Sweep",
            handler=SWEEP_HANDLER,
            description="idle-reaper sweep: assess machines, warn owners, stop idle machines",
            code=code,
            layer=layer,
            # The first listed region also counts running instances in regions without a stack, daily.
            environment={**environment, "IDLE_REAPER_REGIONS": ",".join(all_regions)},
            # A sweep should end before the next one is due; reserved concurrency 1 makes sure it does.
            timeout=sweep_timeout,
            # The planner lists the zones in child processes, one vCPU each (sweep.fanout.PLANNER_VCPUS).
            memory_size=PLANNER_MEMORY_MB,
            reserved_concurrent_executions=props.sweep_reserved_concurrency or None,
        )
        # A fleet larger than one shard: the sweep above plans it, and this state machine sweeps the shards.
        shard_worker = ReaperFunction(
            self,
            "ShardWorker",
            handler=SHARD_HANDLER,
            description="idle-reaper shard worker: sweeps one shard of a sharded sweep",
            code=code,
            layer=layer,
            environment=environment,
            timeout=shard_timeout,
            memory_size=ONE_VCPU_MB,
        )
        gather = ReaperFunction(
            self,
            "Gather",
            handler=GATHER_HANDLER,
            description="idle-reaper gather: one summary and set of metrics of a sharded sweep",
            code=code,
            layer=layer,
            environment=environment,
            timeout=Duration.seconds(60),
            memory_size=256,
        )
        fanout = SweepFanout(
            self,
            "Fanout",
            worker=shard_worker.function,
            gather=gather.function,
            # A sweep that runs long overlaps the next one safely (claims), but never runs on for hours.
            timeout=Duration.minutes(30),
            shards_at_once=SHARDS_AT_ONCE,
            name=props.state_machine_name,
        )
        sweep.function.add_environment(FANOUT_ENV, fanout.state_machine.state_machine_arn)
        # An explicit name, so the role can name the function's ARN without a dependency cycle.
        slack_function_name = props.slack_function_name
        slack = ReaperFunction(
            self,
            "Slack",
            function_name=slack_function_name,
            handler=SLACK_HANDLER,
            description="idle-reaper Slack endpoint: buttons and commands (Slack signature checked in code)",
            code=code,
            layer=layer,
            # With several regions, one Slack app can point at one region's endpoint; this tells the
            # handler where the other deployments are (same table name and prefix in each).
            environment={
                **environment,
                "IDLE_REAPER_REGIONS": ",".join(all_regions),
                SWEEP_MINUTES_ENV: str(props.schedule_minutes),
                STACK_ENV: self.stack_name,  # `/idle-reaper doctor` checks its own stack
            },
            timeout=Duration.seconds(30),
            # A cold start imports pydantic, slack-sdk and Powertools from source (Lambda's code is read-only:
            # no bytecode is written): at 512 MB that alone is about 2 s of Slack's 3 s. Clicks are rare,
            # so a full vCPU costs little.
            memory_size=ONE_VCPU_MB,
            # JSON logs carry each cold start's init time (platform.report), which the monitoring alarms on.
            logging_format=lambda_.LoggingFormat.JSON,
            # Unsigned requests are refused in code, but still run: cap what a flood of them can use.
            reserved_concurrent_executions=props.slack_reserved_concurrency or None,
        )
        alarm_relay = ReaperFunction(
            self,
            "AlarmRelay",
            handler=ALARMS_HANDLER,
            description="idle-reaper alarms: posts every alarm state change to the admins in Slack",
            code=code,
            layer=layer,
            environment=environment,
            timeout=Duration.seconds(30),
            memory_size=256,
        )

        # The weekly digest: its own function, so the chart's Pillow never loads in a sweep or a click, with
        # Pillow in a layer of its own that no other function carries.
        chart_layer = lambda_.LayerVersion(
            self,
            "ChartDependencies",
            code=dependency_layer_code(REPO_ROOT, only=CHART_PACKAGES),
            compatible_runtimes=[lambda_.Runtime.PYTHON_3_12],
            compatible_architectures=[lambda_.Architecture.ARM_64],
            description="idle-reaper weekly digest's chart: Pillow from uv.lock",
        )
        digest = ReaperFunction(
            self,
            "Digest",
            handler=DIGEST_HANDLER,
            description="idle-reaper weekly digest: what was saved and what is still wasted, per team, in Slack",
            code=code,
            layer=layer,
            environment=environment,
            timeout=Duration.minutes(5),
            memory_size=ONE_VCPU_MB,
            reserved_concurrent_executions=None,
        )
        digest.function.add_layers(chart_layer)
        events.Rule(
            self,
            "DigestSchedule",
            description="Send each team's and the admins' weekly digest when due (claimed once per week)",
            schedule=events.Schedule.rate(Duration.hours(1)),
            targets=[targets.LambdaFunction(digest.function, retry_attempts=0)],
        )

        # Failed sweeps (after no retry: the next scheduled sweep is the retry) and events EventBridge
        # could not deliver both land here, and are alarmed.
        failures = sqs.Queue(
            self,
            "SweepFailures",
            retention_period=Duration.days(14),
            enforce_ssl=True,
            encryption=sqs.QueueEncryption.SQS_MANAGED,
        )
        suppress(
            failures,
            NagPackSuppression(
                id="AwsSolutions-SQS3",
                reason="This queue is itself the dead-letter destination of the sweep; it is alarmed.",
            ),
        )
        sweep.function.configure_async_invoke(
            retry_attempts=0,
            max_event_age=Duration.seconds(max(60, int(interval.to_seconds()))),
            on_failure=destinations.SqsDestination(failures),
        )
        schedule = events.Rule(
            self,
            "Schedule",
            description=f"Run an idle-reaper sweep every {props.schedule_minutes} minute(s)",
            schedule=events.Schedule.rate(interval),
            targets=[
                targets.LambdaFunction(
                    sweep.function, dead_letter_queue=failures, retry_attempts=2, max_event_age=interval
                )
            ],
        )

        url = slack.function.add_function_url(
            # Slack cannot sign AWS requests; the handler verifies Slack's request signature instead.
            auth_type=lambda_.FunctionUrlAuthType.NONE,
        )

        self._grant_sweep(sweep.role, props, table, secret, counts_unwatched=self.region == all_regions[0])
        sweep.role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="StartShardedSweep",
                actions=["states:StartExecution"],
                resources=[fanout.state_machine.state_machine_arn],
            )
        )
        self._grant_sweep(shard_worker.role, props, table, secret, counts_unwatched=False)
        self._grant_gather(gather.role, props, table, secret)
        self._grant_slack(
            slack.role,
            props,
            secret,
            all_regions,
            self._slack_function_arn(slack_function_name),
        )
        self._grant_alarms(alarm_relay.role, props, secret)
        self._grant_digest(digest.role, props, table, secret)

        # Defaults come from the pydantic models, the single source of truth for policies.
        SeededParameter(
            self,
            "SettingsParameter",
            name=f"{props.ssm_prefix}/settings",
            # The opt-in tag the runtime filters on is the one IAM requires.
            value=Settings.model_validate({"tags": {"managed": props.managed_tag_key}}).model_dump_json(),
            description="idle-reaper settings (seeded with defaults once; yours to edit)",
        )
        SeededParameter(
            self,
            "ExampleTeamParameter",
            name=f"{props.ssm_prefix}/teams/example",
            value=TeamPolicy().model_dump_json(),
            description="idle-reaper policy of team 'example' (seeded once; copy it per team)",
        )
        gpu = None
        if props.gpu_agent_tag_key:
            gpu = GpuAgentRollout(
                self,
                "GpuAgent",
                config_file=REPO_ROOT / "infra" / "cloudwatch-agent-gpu.json",
                parameter_name=props.agent_parameter_name,
                tag_key=props.gpu_agent_tag_key,
                tag_value=props.gpu_agent_tag_value,
            )

        # What notebook instances need to publish CPU, GPU, network and activity; an admin attaches the
        # lifecycle configuration (docs/policy.md).
        notebook_agent = NotebookAgent(self, "NotebookAgent", prefix=props.prefix)
        # The same collector for Studio apps, from lifecycle configurations an admin attaches to a domain.
        StudioAgent(self, "StudioAgent", prefix=props.prefix, collector=notebook_agent.collector)

        monitoring = ReaperMonitoring(
            self,
            "Monitoring",
            sweep=sweep.function,
            sweep_timeout=sweep_timeout,
            slack=slack.function,
            slack_logs=slack.log_group,
            alarm_relay=alarm_relay.function,
            failures=failures,
            interval=interval,
            alarm_email=props.alarm_email,
            dashboard_name=props.dashboard_name(self.region),
            relay_alarm_name=props.relay_alarm_name,
            ssm_prefix=props.ssm_prefix,
            fanout=fanout,
            shard_worker=shard_worker.function,
            shard_timeout=shard_timeout,
        )

        # The alarm on the relay's own errors reaches nobody without an alarm e-mail: each sweep reads it.
        sweep.function.add_environment(RELAY_ALARM_ENV, props.relay_alarm_name)
        sweep.role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="ReadTheAlarmRelaysAlarm",
                actions=["cloudwatch:DescribeAlarms"],
                resources=[monitoring.relay_errors.alarm_arn],
            )
        )
        CfnOutput(
            self, "SlackFunctionUrl", value=url.url, description="Request URL for the Slack app (slack/manifest.yml)"
        )
        CfnOutput(self, "SlackSecretName", value=props.secret_name, description="Put the Slack credentials here")
        CfnOutput(
            self,
            "DashboardUrl",
            value=f"https://console.aws.amazon.com/cloudwatch/home?region={self.region}"
            f"#dashboards:name={monitoring.dashboard.dashboard_name}",
        )
        CfnOutput(self, "StateTableName", value=table.table_name)
        # What `idle-reaper doctor` reads: the version deployed, and the rule it checks is enabled.
        CfnOutput(self, "Version", value=__version__, description="The idle-reaper version deployed")
        CfnOutput(self, "SweepScheduleName", value=schedule.rule_name, description="The rule that starts every sweep")
        CfnOutput(
            self,
            "SweepFunctionName",
            value=sweep.function.function_name,
            description="Invoke it to sweep now (in organization mode: every member account too)",
        )
        CfnOutput(self, "AlarmTopicArn", value=monitoring.topic.topic_arn)
        if gpu is not None:
            gpu.report_failures_to(monitoring.topic)
            CfnOutput(self, "GpuAgentAssociationId", value=gpu.association.attr_association_id)
        self._grant_slack_doctor(
            slack.role,
            schedule,
            monitoring.topic.topic_arn,
            [sweep.function.function_arn, self._slack_function_arn(slack_function_name)],
            gpu.association.attr_association_id if gpu is not None else None,
        )
        if props.organization is not None and self.region == all_regions[0]:
            # The hub: the first listed region's stack holds the member StackSet.
            self._add_members(
                props, props.organization, [sweep, shard_worker, slack], listers=[sweep, slack, digest], digest=digest
            )

    def _add_members(
        self,
        props: IdleReaperProps,
        organization: OrganizationContext,
        functions: list[ReaperFunction],
        *,
        listers: list[ReaperFunction],
        digest: ReaperFunction,
    ) -> None:
        """The hub: the member StackSet, and the hub functions that act in member accounts may assume the member
        role and are told where the members are (aws/accounts.py, OrganizationConfig). `listers` list the
        accounts: the sweep's planner, the Slack endpoint's `/idle-reaper doctor` (every member account), and the
        weekly digest, which names them. The digest assumes the member stacks' read role only (GetMetricData:
        its exempt machines' week), never the member role (which trusts the sweep and the Slack endpoint only)."""
        roles: list[iam.IRole] = [f.role for f in functions]
        # The hub's own regions, where its stacks sweep its account (not known at synth when the region is a token:
        # then the hub's account is left out of the member units, as before).
        hub_regions = [r for r in (list(props.regions) or [self.region]) if not Token.is_unresolved(r)]
        template = member_template(
            MemberSettings(
                prefix=props.prefix,
                ssm_prefix=props.ssm_prefix,
                organization_id=organization.organization_id,
                managed_tag_key=props.managed_tag_key,
                gpu_agent_tag_key=props.gpu_agent_tag_key,
                gpu_agent_tag_value=props.gpu_agent_tag_value,
                count_region=organization.regions[0],
                hub_regions=tuple(hub_regions),
            )
        )
        members = MemberStackSet(
            self,
            "Members",
            organization=organization,
            stack_set_name=props.member_stack_set_name,
            template=template,
            hub_roles=roles,
            digest_role=digest.role,
        )
        grant_member_access(
            roles,
            lists_accounts=[f.role for f in listers],
            prefix=props.prefix,
            organization_id=organization.organization_id,
        )
        grant_member_reads(digest.role, prefix=props.prefix, organization_id=organization.organization_id)
        members_env = self.to_json_string(
            {
                "prefix": props.prefix,
                "targets": organization.targets,
                "regions": organization.regions,
                "hubAccount": self.account,
                "partition": self.partition,
                "hubRegions": hub_regions,
            }
        )
        for function in dict.fromkeys([*functions, *listers]):
            function.function.add_environment(ORGANIZATION_ENV, members_env)
        CfnOutput(self, "MemberStackSetId", value=members.stack_set.attr_stack_set_id)

    # -- permissions ---------------------------------------------------------------------------
    # What each role may do is listed call by call in tests/infra/test_iam.py and docs/deploying.md.

    _in_regions = staticmethod(in_regions)

    def _parameters(self, props: IdleReaperProps, region: str) -> list[str]:
        path = props.ssm_prefix.lstrip("/")
        # GetParametersByPath is authorized on the path itself, GetParameter on each parameter.
        return [
            self.format_arn(service="ssm", resource="parameter", resource_name=name, region=region)
            for name in (path, f"{path}/*")
        ]

    def _table(self, props: IdleReaperProps, region: str) -> str:
        return self.format_arn(service="dynamodb", resource="table", resource_name=props.table_name, region=region)

    def _grant_sweep(
        self,
        role: iam.IRole,
        props: IdleReaperProps,
        table: dynamodb.ITable,
        secret: secretsmanager.ISecret,
        *,
        counts_unwatched: bool,
    ) -> None:
        statements = [
            *MachineAccess(self, props.managed_tag_key).sweep_statements(self.region),
            # The sweep deletes only its own once-only claims (release after a failed alert).
            *self._policies_table_and_secret(props, table, secret, ("StateTable", SWEEP_TABLE_ACTIONS), "once#*"),
            # ... and the index entries of the quiet-hours stops it told.
            iam.PolicyStatement(
                sid="RemoveToldQuietStops",
                actions=["dynamodb:DeleteItem"],
                resources=[table.table_arn],
                conditions={"ForAllValues:StringLike": {"dynamodb:LeadingKeys": [QUIET_STOPS_KEYS]}},
            ),
        ]
        if counts_unwatched:
            # The daily count of running instances in regions without a stack: listing only, in any region.
            statements.append(
                iam.PolicyStatement(
                    sid="CountUnwatchedRegions",
                    actions=["ec2:DescribeRegions", "ec2:DescribeInstances"],
                    resources=["*"],
                )
            )
        for statement in statements:
            role.add_to_principal_policy(statement)
        MachineAccess(self, props.managed_tag_key).suppress_wildcards(role, props.ssm_prefix, reads=SWEEP_READS)

    def _grant_slack(
        self,
        role: iam.IRole,
        props: IdleReaperProps,
        secret: secretsmanager.ISecret,
        regions: Sequence[str],
        function_arn: str,
    ) -> None:
        # Answers act on one known machine (no discovery), in every configured region: a shared
        # Slack endpoint may act on machines wherever they run.
        everywhere = self._in_regions(regions)
        statements = [
            *MachineAccess(self, props.managed_tag_key).answer_statements(regions),
            iam.PolicyStatement(
                sid="ReadPolicies",
                actions=list(POLICY_READS),
                resources=[arn for r in regions for arn in self._parameters(props, r)],
                conditions=everywhere,
            ),
            # Reads and (conditional) puts; no deletes, no batch writes.
            iam.PolicyStatement(
                sid="StateTables",
                actions=list(SLACK_TABLE_ACTIONS),
                resources=[
                    arn
                    for r in regions
                    for arn in (self._table(props, r), f"{self._table(props, r)}/index/{OWNER_INDEX}")
                ],
                conditions=everywhere,
            ),
            iam.PolicyStatement(
                sid="ReadSlackSecret",
                actions=["secretsmanager:GetSecretValue"],
                resources=[secret.secret_arn],
                conditions=self._in_regions([self.region]),
            ),
            # Acknowledge Slack at once, finish the work in an asynchronous invocation of itself.
            iam.PolicyStatement(sid="InvokeItself", actions=["lambda:InvokeFunction"], resources=[function_arn]),
            # `/idle-reaper doctor`: read-only, this region's fleet and metrics (the state table read is above).
            iam.PolicyStatement(
                sid="DoctorReads",
                actions=list(DOCTOR_READS),
                resources=["*"],
                conditions=self._in_regions([self.region]),
            ),
        ]
        for statement in statements:
            role.add_to_principal_policy(statement)
        MachineAccess(self, props.managed_tag_key).suppress_wildcards(role, props.ssm_prefix, reads=DOCTOR_READS)

    def _slack_function_arn(self, name: str) -> str:
        """The Slack function's ARN by its explicit name: its own role names it without a dependency cycle."""
        return self.format_arn(
            service="lambda", resource="function", resource_name=name, arn_format=ArnFormat.COLON_RESOURCE_NAME
        )

    def _grant_slack_doctor(
        self,
        role: iam.IRole,
        schedule: events.Rule,
        topic_arn: str,
        reserving_functions: Sequence[str],
        association_id: str | None,
    ) -> None:
        """`/idle-reaper doctor`'s deploy checks (idle_reaper.aws.deploy): read-only, each on this stack's own
        resource (the stack, its schedule rule, alarm topic, the functions it reserves concurrency for, its agent
        association); the account's concurrency quota is in DOCTOR_READS (no resource-level permission)."""
        statements = [
            iam.PolicyStatement(sid="DoctorReadsItsStack", actions=list(DOCTOR_STACK_READS), resources=[self.stack_id]),
            iam.PolicyStatement(
                sid="DoctorReadsItsSchedule", actions=["events:DescribeRule"], resources=[schedule.rule_arn]
            ),
            iam.PolicyStatement(
                sid="DoctorReadsItsAlarmTopic", actions=list(DOCTOR_TOPIC_READS), resources=[topic_arn]
            ),
            iam.PolicyStatement(
                sid="DoctorReadsItsReservations",
                actions=["lambda:GetFunctionConcurrency"],
                resources=list(reserving_functions),
            ),
        ]
        if association_id is not None:
            statements.append(
                iam.PolicyStatement(
                    sid="DoctorReadsItsAgentAssociation",
                    actions=["ssm:DescribeAssociation"],
                    resources=[self.format_arn(service="ssm", resource="association", resource_name=association_id)],
                )
            )
        for statement in statements:
            role.add_to_principal_policy(statement)

    def _grant_alarms(self, role: iam.IRole, props: IdleReaperProps, secret: secretsmanager.ISecret) -> None:
        for statement in self._settings_and_secret(props, secret):
            role.add_to_principal_policy(statement)

    def _grant_gather(
        self, role: iam.IRole, props: IdleReaperProps, table: dynamodb.ITable, secret: secretsmanager.ISecret
    ) -> None:
        """The gather step reads the shards' results and keeps the failed-shard count in the table; it reads
        the settings and the Slack secret to tell the admins about repeated failures, sends the stop notices the
        shards queued (it loads and saves their records), and, on the day's doctor, tells a GPU check's new failure
        (claimed once, as the sweep claims; a cleared one's claim deleted)."""
        shard_results = iam.PolicyStatement(
            sid="ShardResults",
            actions=list(GATHER_TABLE_ACTIONS),
            resources=[table.table_arn],
            conditions=self._in_regions([self.region]),
        )
        doctor_claims = iam.PolicyStatement(
            sid="ReleaseDoctorClaims",
            actions=["dynamodb:DeleteItem"],
            resources=[table.table_arn],
            conditions={"ForAllValues:StringLike": {"dynamodb:LeadingKeys": ["once#doctor#*"]}},
        )
        for statement in (shard_results, doctor_claims, *self._settings_and_secret(props, secret)):
            role.add_to_principal_policy(statement)

    def _grant_digest(
        self, role: iam.IRole, props: IdleReaperProps, table: dynamodb.ITable, secret: secretsmanager.ISecret
    ) -> None:
        """The weekly digest reads the policies (who gets it, when), scans the table when a digest is due, and
        claims each digest once (PutItem; DeleteItem of its own claims only, to try again after a failed post)."""
        table_access = ("DigestTable", DIGEST_TABLE_ACTIONS)
        for statement in self._policies_table_and_secret(props, table, secret, table_access, "once#digest#*"):
            role.add_to_principal_policy(statement)
        # Exempt machines are never read by a sweep: the digest reads their week to say whether they sat idle.
        role.add_to_principal_policy(
            iam.PolicyStatement(
                sid="ReadExemptMetrics",
                actions=["cloudwatch:GetMetricData"],
                resources=["*"],  # GetMetricData has no resource-level permissions
                conditions=self._in_regions([self.region]),
            )
        )
        suppress(
            role,
            NagPackSuppression(
                id="AwsSolutions-IAM5",
                reason=f"The digest reads every team's policy: parameter reads stay under {props.ssm_prefix}/.",
                applies_to=[RegexAppliesTo(regex=r"/^Resource::arn:.+:ssm:.*:parameter\/.+\/\*$/")],
            ),
        )

    def _policies_table_and_secret(
        self,
        props: IdleReaperProps,
        table: dynamodb.ITable,
        secret: secretsmanager.ISecret,
        table_access: tuple[str, Sequence[str]],
        claims: str,
    ) -> list[iam.PolicyStatement]:
        """Read the policies, use the state table (`table_access`: its sid and actions), delete only the
        once-only claims whose key is like `claims` (released after a failed alert or post), read the secret."""
        here = self._in_regions([self.region])
        sid, actions = table_access
        return [
            iam.PolicyStatement(
                sid="ReadPolicies",
                actions=list(POLICY_READS),
                resources=self._parameters(props, self.region),
                conditions=here,
            ),
            iam.PolicyStatement(sid=sid, actions=list(actions), resources=[table.table_arn], conditions=here),
            iam.PolicyStatement(
                sid="ReleaseClaims",
                actions=["dynamodb:DeleteItem"],
                resources=[table.table_arn],
                conditions={"ForAllValues:StringLike": {"dynamodb:LeadingKeys": [claims]}},
            ),
            iam.PolicyStatement(
                sid="ReadSlackSecret",
                actions=["secretsmanager:GetSecretValue"],
                resources=[secret.secret_arn],
                conditions=here,
            ),
        ]

    def _settings_and_secret(self, props: IdleReaperProps, secret: secretsmanager.ISecret) -> list[iam.PolicyStatement]:
        """Read the settings parameter (who the admins are) and the Slack secret (to tell them)."""
        here = self._in_regions([self.region])
        settings = self.format_arn(
            service="ssm", resource="parameter", resource_name=f"{props.ssm_prefix.lstrip('/')}/settings"
        )
        return [
            iam.PolicyStatement(
                sid="ReadSettings", actions=["ssm:GetParameter"], resources=[settings], conditions=here
            ),
            iam.PolicyStatement(
                sid="ReadSlackSecret",
                actions=["secretsmanager:GetSecretValue"],
                resources=[secret.secret_arn],
                conditions=here,
            ),
        ]


def stack_id(props: IdleReaperProps, region: str | None) -> str:
    """The stack's id in the app (what `cdk deploy ID` names); its CloudFormation name is props.stack_name."""
    return f"{props.stack_name}-{region}" if region else props.stack_name


def build(app: App) -> list[IdleReaperStack]:
    """All stacks of the app: one per configured region, or one for the CLI's default region.

    cdk-nag's AwsSolutions pack runs on every synth, so a violation fails `make synth` too."""
    props = IdleReaperProps.from_context(app.node)
    stacks = []
    for region in props.regions or (None,):
        # Account-agnostic: the stack deploys into whichever account the credentials belong to.
        env = Environment(region=region or os.environ.get("CDK_DEFAULT_REGION"))
        stacks.append(IdleReaperStack(app, stack_id(props, region), props=props, env=env, stack_name=props.stack_name))
    Aspects.of(app).add(AwsSolutionsChecks(verbose=True))
    return stacks
