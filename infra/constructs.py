"""The building blocks of the idle-reaper stack. No business logic: the reaper's decisions live in
lambdas/idle_reaper; these only provision what it runs on and watch it."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aws_cdk import ArnFormat, Duration, Stack
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_ssm as ssm
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from aws_cdk import custom_resources as cr
from cdk_nag import NagPackSuppression, NagSuppressions, RegexAppliesTo
from constructs import Construct

# Must match what the sweep handler emits (Powertools Metrics, EMF).
METRICS_NAMESPACE = "IdleReaper"
SERVICE_NAME = "idle-reaper"
# Slack gives up on a request after 3 s.
SLACK_DURATION_ALARM_MS = 2500
SLACK_INIT_ALARM_MS = 2000  # a cold start's init alone; the handler's own work comes on top


def suppress(construct: Construct, *suppressions: NagPackSuppression) -> None:
    """cdk-nag suppressions for a construct and its children; each carries its written reason."""
    NagSuppressions.add_resource_suppressions(construct, list(suppressions), apply_to_children=True)


class ReaperFunction(Construct):
    """A Python 3.12 arm64 Lambda with its own role and log group.

    The role starts empty (no AWSLambdaBasicExecutionRole): it may write to its own log group and
    X-Ray, and the stack grants the rest statement by statement."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        handler: str,
        description: str,
        code: lambda_.Code,
        layer: lambda_.ILayerVersion,
        environment: Mapping[str, str],
        timeout: Duration,
        memory_size: int,
        reserved_concurrent_executions: int | None = None,
        function_name: str | None = None,
        logging_format: lambda_.LoggingFormat | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.log_group = logs.LogGroup(self, "Logs", retention=logs.RetentionDays.THREE_MONTHS)
        self.role = iam.Role(
            self, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"), description=description
        )
        self.function = lambda_.Function(
            self,
            "Function",
            description=description,
            function_name=function_name,
            runtime=lambda_.Runtime.PYTHON_3_12,
            architecture=lambda_.Architecture.ARM_64,
            handler=handler,
            code=code,
            layers=[layer],
            environment=dict(environment),
            timeout=timeout,
            memory_size=memory_size,
            reserved_concurrent_executions=reserved_concurrent_executions,
            tracing=lambda_.Tracing.ACTIVE,
            role=self.role,
            log_group=self.log_group,
            logging_format=logging_format,
        )
        self.log_group.grant_write(self.role)
        suppress(
            self,
            NagPackSuppression(
                id="AwsSolutions-L1",
                reason="Pinned to Python 3.12: the dependency layer is built for cp312 and the package is "
                "tested on it. Moving runtimes is a deliberate change, not a default.",
            ),
            NagPackSuppression(
                id="AwsSolutions-IAM5",
                reason="X-Ray trace segments: xray:PutTraceSegments and PutTelemetryRecords have no "
                "resource-level permissions.",
                applies_to=["Resource::*"],
            ),
        )


class SeededParameter(Construct):
    """An SSM String parameter the stack writes once, when it is first created, and never again.

    Why not an AWS::SSM::Parameter: CloudFormation would own the value, so the next deploy after
    an admin tuned the policy would silently revert it (or delete it with the stack). Instead a
    custom resource calls PutParameter with Overwrite=false on create only: it seeds a fresh
    account, leaves an existing parameter (an admin's edit, or an earlier deployment's) alone
    by ignoring ParameterAlreadyExists, does nothing on update, and keeps the parameter on delete
    (policies are the admins' data, not the stack's)."""

    def __init__(self, scope: Construct, id: str, *, name: str, value: str, description: str) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        arn = stack.format_arn(service="ssm", resource="parameter", resource_name=name.lstrip("/"))
        cr.AwsCustomResource(
            self,
            "Put",
            resource_type="Custom::IdleReaperSeededParameter",
            on_create=cr.AwsSdkCall(
                service="SSM",
                action="putParameter",
                parameters={
                    "Name": name,
                    "Value": value,
                    "Type": "String",
                    "Overwrite": False,
                    "Description": description,
                },
                physical_resource_id=cr.PhysicalResourceId.of(name),
                ignore_error_codes_matching="ParameterAlreadyExists",
            ),
            policy=cr.AwsCustomResourcePolicy.from_sdk_calls(resources=[arn]),
            install_latest_aws_sdk=False,  # no npm download at deploy time; the runtime's SDK suffices
        )
        # The provider function CDK shares between all AwsCustomResources of the stack.
        provider = stack.node.find_child("AWS" + cr.AwsCustomResource.PROVIDER_FUNCTION_UUID.replace("-", ""))
        suppress(
            provider,
            NagPackSuppression(
                id="AwsSolutions-IAM4",
                reason="CDK's AwsCustomResource provider (SSM seeding at stack creation, the notebook collector's "
                "upload) uses the AWS managed "
                "AWSLambdaBasicExecutionRole, for its own logs only.",
                applies_to=["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"],
            ),
            NagPackSuppression(
                id="AwsSolutions-L1",
                reason="The runtime of CDK's AwsCustomResource provider is chosen by aws-cdk-lib, not here.",
            ),
        )


# The human-activity collector's files (agent/), as install.sh installs them.
COLLECTOR_DIR = Path(__file__).resolve().parents[1] / "agent"
COLLECTOR_FILES = (
    "install.sh",
    "idle_reaper_activity.py",
    "cloudwatch-agent-activity.json",
    "idle-reaper-activity.service",
    "idle-reaper-activity.timer",
    "README.md",
)
_BUNDLE_END = "IDLE_REAPER_COLLECTOR_FILES"


def collector_bundle(agent_dir: Path = COLLECTOR_DIR) -> bytes:
    """The collector's files as a gzip'd tar that is the same bytes for the same files: no times, owners
    or modes of the machine that synthesizes, so the SSM document gets a new version only when a file
    changes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in COLLECTOR_FILES:
            data = (agent_dir / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith((".sh", ".py")) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buffer.getvalue(), compresslevel=9, mtime=0)


def collector_install_commands(bundle: bytes) -> list[str]:
    """A shell script (one line per element, as aws:runShellScript takes it) that unpacks the embedded
    files, checks them against their SHA-256 and runs install.sh. The files ride inside the document, so
    the instance needs no S3 read and no network beyond the SSM agent's own."""
    encoded = textwrap.wrap(base64.b64encode(bundle).decode(), 76)
    return [
        "set -eu",
        "work=$(mktemp -d)",
        "trap 'rm -rf \"$work\"' EXIT",
        f"base64 -d > \"$work/collector.tar.gz\" <<'{_BUNDLE_END}'",
        *encoded,
        _BUNDLE_END,
        f'echo "{hashlib.sha256(bundle).hexdigest()}  $work/collector.tar.gz" | sha256sum -c --quiet -',
        'tar -xzf "$work/collector.tar.gz" -C "$work"',
        'sh "$work/install.sh"',
    ]


class GpuAgentRollout(Construct):
    """Installs and configures the CloudWatch agent for GPU metrics on instances carrying a tag, then the
    human-activity collector (agent/) beside it.

    The agent config (a file in this repo) goes into an SSM parameter whose name starts with
    `AmazonCloudWatch-`, the prefix the managed CloudWatchAgentServerPolicy lets instances read.
    One composite Command document runs in order: install the agent, configure it (fetch-config, which
    replaces every appended configuration), then install the collector, whose install.sh appends its
    StatsD listener with `append-config` and so must come after. A fresh instance never configures an
    agent that is not there yet; a State Manager association applies it to tagged instances as they
    appear, and daily to catch drift. The collector's files are embedded in the document
    (collector_install_commands): nothing new for the instance role to read."""

    COLLECTOR_STEP = "installActivityCollector"

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config_file: Path,
        tag_key: str,
        tag_value: str,
        parameter_name: str,
        collector_dir: Path = COLLECTOR_DIR,
    ) -> None:
        super().__init__(scope, id)
        self.parameter_name = parameter_name
        config = json.loads(config_file.read_text())
        self.config_parameter = ssm.StringParameter(
            self,
            "AgentConfig",
            parameter_name=parameter_name,
            description="CloudWatch agent config for GPU metrics read by idle-reaper (from infra/"
            + config_file.name
            + ")",
            string_value=json.dumps(config, separators=(",", ":")),
        )
        document = ssm.CfnDocument(
            self,
            "InstallAndConfigure",
            document_type="Command",
            document_format="JSON",
            update_method="NewVersion",
            content={
                "schemaVersion": "2.2",
                "description": "Install the CloudWatch agent, apply idle-reaper's GPU metrics config, then "
                "install idle-reaper's human-activity collector (it appends its StatsD listener to that config).",
                "mainSteps": [
                    {
                        "action": "aws:runDocument",
                        "name": "installAgent",
                        "inputs": {
                            "documentType": "SSMDocument",
                            "documentPath": "AWS-ConfigureAWSPackage",
                            "documentParameters": {"action": "Install", "name": "AmazonCloudWatchAgent"},
                        },
                    },
                    {
                        "action": "aws:runDocument",
                        "name": "configureAgent",
                        "inputs": {
                            "documentType": "SSMDocument",
                            "documentPath": "AmazonCloudWatch-ManageAgent",
                            "documentParameters": {
                                "action": "configure",
                                "mode": "ec2",
                                "optionalConfigurationSource": "ssm",
                                "optionalConfigurationLocation": parameter_name,
                                "optionalRestart": "yes",
                            },
                        },
                    },
                    {
                        "action": "aws:runShellScript",
                        "name": self.COLLECTOR_STEP,
                        "precondition": {"StringEquals": ["platformType", "Linux"]},
                        "inputs": {
                            "timeoutSeconds": "300",
                            "runCommand": collector_install_commands(collector_bundle(collector_dir)),
                        },
                    },
                ],
            },
        )
        self.association = ssm.CfnAssociation(
            self,
            "Association",
            name=document.ref,
            targets=[ssm.CfnAssociation.TargetProperty(key=f"tag:{tag_key}", values=[tag_value])],
            schedule_expression="rate(1 day)",
            # A machine without an NVIDIA driver fails the configure step; that must not stop the rollout
            # to the others. Every failure is reported instead (report_failures_to).
            max_errors="100%",
            max_concurrency="25%",
        )
        self.association.node.add_dependency(self.config_parameter)

    def report_failures_to(self, topic: sns.ITopic) -> events.Rule:
        """Every instance the association fails on is reported to the alarm topic (and so to the admins):
        without the agent the machine has no GPU metric, so the reaper never judges it idle."""
        detail = events.EventField.from_path
        return events.Rule(
            self,
            "Failures",
            description="idle-reaper: the GPU agent rollout failed on an instance",
            event_pattern=events.EventPattern(
                source=["aws.ssm"],
                detail_type=["EC2 State Manager Instance Association State Change"],
                detail={"association-id": [self.association.attr_association_id], "status": ["Failed"]},
            ),
            targets=[
                targets.SnsTopic(
                    topic,
                    message=events.RuleTargetInput.from_text(
                        f"GPU agent rollout failed on {detail('$.detail.instance-id')} in "
                        f"{events.EventField.region} ({detail('$.detail.detailed-status')}: "
                        f"{detail('$.detail.execution-summary')}). Without the agent this machine has no GPU "
                        "metric and is never judged idle; without the activity collector (python3 3.9+) "
                        "it is judged on CPU/GPU alone. Check its NVIDIA driver, python3 and SSM agent."
                    ),
                )
            ],
        )


class SweepFanout(Construct):
    """The Step Functions state machine that sweeps a fleet too large for one invocation: a Map over the
    shard indices the planner wrote runs one worker per shard (at most `shards_at_once` at a time), a
    worker's failure is caught and becomes that shard's error (the other shards go on), and the gather step
    makes one summary of the shards. Only indices travel between states (256 KB limit); the instance ids
    are in the shard manifests in the state table."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        worker: lambda_.IFunction,
        gather: lambda_.IFunction,
        timeout: Duration,
        shards_at_once: int,
        name: str,
    ) -> None:
        super().__init__(scope, id)
        sweep_shard = tasks.LambdaInvoke(
            self, "SweepShard", lambda_function=worker, payload_response_only=True, comment="Sweep one shard"
        )
        # A Map wider than the account's free Lambda concurrency (a young account's quota of 10 or 50) is
        # throttled, not failed: the shard waits for a worker (2, 4, 8, 16, 32 s), then fails as its own error.
        sweep_shard.add_retry(
            errors=["Lambda.TooManyRequestsException"],
            interval=Duration.seconds(2),
            backoff_rate=2,
            max_attempts=5,
        )
        # Only the error's name goes on: a cause (a stack trace) per shard could exceed the 256 KB state limit.
        sweep_shard.add_catch(
            sfn.Pass(self, "ShardFailed", parameters={"shard.$": "$.shard", "error.$": "$.error.Error"}),
            result_path="$.error",
        )
        shards = sfn.Map(
            self,
            "Shards",
            items_path="$.shards",
            max_concurrency=shards_at_once,
            item_selector={
                "sweep_id.$": "$.sweep_id",
                "now.$": "$.now",
                "dry_run.$": "$.dry_run",
                "shard.$": "$$.Map.Item.Value",
                "concurrent_shards.$": "$.concurrent_shards",
                # The planner claimed the day's doctor: each machine shard keeps its GPU machines' facts.
                "doctor.$": "$.doctor",
            },
            result_path="$.results",
        )
        shards.item_processor(sweep_shard)
        gather_step = tasks.LambdaInvoke(
            self, "Gather", lambda_function=gather, payload_response_only=True, comment="One summary of the shards"
        )
        self.log_group = logs.LogGroup(self, "Logs", retention=logs.RetentionDays.THREE_MONTHS)
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=name,
            definition_body=sfn.DefinitionBody.from_chainable(shards.next(gather_step)),
            state_machine_type=sfn.StateMachineType.STANDARD,
            timeout=timeout,
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=False),
        )
        suppress(
            self.state_machine,
            NagPackSuppression(
                id="AwsSolutions-IAM5",
                reason="Step Functions grants itself the worker and gather functions with their versions "
                "(function ARN and ARN:*), and log delivery and X-Ray calls have no resource-level permissions.",
                applies_to=[
                    "Resource::*",
                    RegexAppliesTo(regex=r"/^Resource::<.+Function[A-F0-9]+\.Arn>:\*$/"),
                ],
            ),
        )


class ReaperMonitoring(Construct):
    """Alarms and the dashboard. Every alarm state change goes to an SNS topic; the alarm relay function
    (subscribed to it) posts it to the admins in Slack, and an e-mail address may subscribe too."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        sweep: lambda_.IFunction,
        sweep_timeout: Duration,
        slack: lambda_.IFunction,
        slack_logs: logs.ILogGroup,
        alarm_relay: lambda_.IFunction,
        failures: sqs.IQueue,
        interval: Duration,
        alarm_email: str | None,
        dashboard_name: str,
        ssm_prefix: str,
        relay_alarm_name: str | None = None,
        fanout: SweepFanout | None = None,
        shard_worker: lambda_.IFunction | None = None,
        shard_timeout: Duration | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.topic = self._alarm_topic("Alarms", "idle-reaper alarms", alarm_email)
        self.topic.add_subscription(subscriptions.LambdaSubscription(alarm_relay))
        # The relay's own failures go elsewhere: on the topic it listens to, a relay that cannot post would
        # be woken by its own errors alarm, fail again, and flap ALARM/OK for as long as Slack is unreachable.
        self.relay_topic = self._alarm_topic("RelayAlarms", "idle-reaper alarms the Slack relay failed", alarm_email)
        hour = Duration.hours(1)
        sweep_errors = cw.MathExpression(
            label="Sweep errors",
            expression="FILL(reported, 0) + FILL(crashed, 0)",
            using_metrics={
                "reported": self._service_metric("SweepErrors", "Sum", interval),
                "crashed": sweep.metric_errors(period=interval, statistic="Sum"),
            },
            period=interval,
        )
        completed_sweeps = self._service_metric("SweepDurationMs", "SampleCount", interval)
        five_minutes = Duration.minutes(5)

        def at_least(
            metric: cw.IMetric,
            id: str,
            description: str,
            *,
            threshold: float = 1,
            periods: int = 1,
            name: str | None = None,
        ) -> cw.Alarm:
            """Alarm when the metric reaches the threshold in `periods` consecutive periods; no data is fine."""
            return metric.create_alarm(
                self,
                id,
                alarm_name=name,
                alarm_description=description,
                threshold=threshold,
                evaluation_periods=periods,
                datapoints_to_alarm=periods,
                comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
            )

        self.alarms = [
            sweep_errors.create_alarm(
                self,
                "SweepErrorsAlarm",
                alarm_description="A sweep failed or reported errors (see the sweep function's logs).",
                threshold=1,
                evaluation_periods=1,
                comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
            ),
            completed_sweeps.with_(label="Completed sweeps").create_alarm(
                self,
                "NoSweepAlarm",
                alarm_description="No sweep completed in 3 schedule intervals: idle machines are not being handled.",
                threshold=1,
                evaluation_periods=3,
                datapoints_to_alarm=3,
                comparison_operator=cw.ComparisonOperator.LESS_THAN_THRESHOLD,
                # No datapoint is exactly the failure this alarm exists for.
                treat_missing_data=cw.TreatMissingData.BREACHING,
            ),
            at_least(
                failures.metric_approximate_number_of_messages_visible(period=five_minutes, statistic="Maximum").with_(
                    label="Undelivered or failed sweeps"
                ),
                "SweepDeadLettersAlarm",
                "Sweep invocations were dropped or failed and landed in the dead-letter "
                "queue (often: a sweep ran longer than the schedule interval).",
            ),
            at_least(
                slack.metric_errors(period=five_minutes, statistic="Sum").with_(label="Slack handler errors"),
                "SlackErrorsAlarm",
                "The Slack handler failed: someone's answer to a warning may have been lost.",
            ),
            # The Slack handler answers every handled failure with a message, not a 5xx: it counts them.
            at_least(
                self._service_metric("SlackRequestFailures", "Sum", five_minutes),
                "SlackRequestFailuresAlarm",
                "The Slack handler could not carry out a request (an internal error it answered politely).",
            ),
            at_least(
                slack.metric_throttles(period=five_minutes, statistic="Sum"),
                "SlackThrottlesAlarm",
                "Slack requests were throttled at the function's reserved concurrency: a flood of requests, "
                "or answers being lost.",
            ),
            at_least(
                slack.metric_duration(period=five_minutes, statistic="p99"),
                "SlackDurationAlarm",
                "The Slack handler's p99 duration is near Slack's 3 s limit; Slack shows users an error past it.",
                threshold=SLACK_DURATION_ALARM_MS,
                periods=2,
            ),
            # Init time is not in Duration: a cold start that nears Slack's 3 s shows only in the report
            # event of the function's JSON logs.
            at_least(
                logs.MetricFilter(
                    self,
                    "SlackInitDuration",
                    log_group=slack_logs,
                    filter_pattern=logs.FilterPattern.all(
                        logs.FilterPattern.string_value("$.type", "=", "platform.report"),
                        logs.FilterPattern.number_value("$.record.metrics.initDurationMs", ">", 0),
                    ),
                    metric_namespace=METRICS_NAMESPACE,
                    metric_name="SlackInitDurationMs",
                    metric_value="$.record.metrics.initDurationMs",
                ).metric(period=five_minutes, statistic="Maximum", label="Slack cold start (init) ms"),
                "SlackInitDurationAlarm",
                "A cold start of the Slack handler took 2 s or more: with the request's own work it nears "
                "Slack's 3 s, past which Slack shows the person an error.",
                threshold=SLACK_INIT_ALARM_MS,
            ),
            at_least(
                sweep.metric_duration(period=interval, statistic="p99"),
                "SweepDurationAlarm",
                "A sweep ran close to its timeout; the next ones may time out.",
                threshold=int(sweep_timeout.to_milliseconds() * 0.8),
            ),
            at_least(
                self._service_metric("TeamsInSafeMode", "Maximum", interval),
                "TeamsInSafeModeAlarm",
                "A team has been in safe mode (warn only, no stops) for 3 sweeps: its policy or data needs an admin.",
                periods=3,
            ),
        ]
        shards_failed = self._service_metric("ShardsFailed", "Sum", interval)
        if fanout is not None and shard_worker is not None and shard_timeout is not None:
            executions_failed = cw.MathExpression(
                label="Sweep executions failed",
                expression="FILL(failed, 0) + FILL(timed_out, 0) + FILL(aborted, 0)",
                using_metrics={
                    "failed": fanout.state_machine.metric_failed(period=interval, statistic="Sum"),
                    "timed_out": fanout.state_machine.metric_timed_out(period=interval, statistic="Sum"),
                    "aborted": fanout.state_machine.metric_aborted(period=interval, statistic="Sum"),
                },
                period=interval,
            )
            self.alarms += [
                at_least(
                    shards_failed,
                    "ShardsFailedAlarm",
                    "A shard of a sweep failed (throttling, timeout, crash): its machines were left untouched and "
                    "are retried by the next sweep (see the shard worker's logs).",
                ),
                at_least(
                    executions_failed,
                    "FanoutFailedAlarm",
                    "A sharded sweep's state machine execution failed (the planner's hand-off or the gather step).",
                ),
                at_least(
                    shard_worker.metric_duration(period=interval, statistic="p99"),
                    "ShardDurationAlarm",
                    "A shard worker ran close to its timeout: lower the shard size or raise the timeout.",
                    threshold=int(shard_timeout.to_milliseconds() * 0.8),
                ),
            ]
        relay_errors = at_least(
            alarm_relay.metric_errors(period=five_minutes, statistic="Sum"),
            "AlarmRelayErrorsAlarm",
            "Alarms could not be posted to Slack (bad credentials, or Slack down): only e-mail subscribers see "
            "alarms now. This alarm goes to its own topic, never through the relay; the sweep tells the admins.",
            name=relay_alarm_name,  # the name the sweep is given to read (infra/stack.py)
        )
        for alarm in self.alarms:
            alarm.add_alarm_action(cw_actions.SnsAction(self.topic))
            alarm.add_ok_action(cw_actions.SnsAction(self.topic))
        relay_errors.add_alarm_action(cw_actions.SnsAction(self.relay_topic))
        relay_errors.add_ok_action(cw_actions.SnsAction(self.relay_topic))
        self.alarms.append(relay_errors)
        # Without an alarm e-mail nobody is on that topic: each sweep reads this alarm and, while it is in ALARM,
        # tells the admins itself (sweep/doctor.py report_failing_relay).
        self.relay_errors = relay_errors

        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=dashboard_name)
        self.dashboard.add_widgets(
            cw.TextWidget(
                width=24,
                height=2,
                markdown=f"## idle-reaper\nA sweep every {interval.to_minutes()} min. Team policies live in SSM "
                f"under `{ssm_prefix}/teams/`. A team appears here after the first sweep that finds its machines.",
            )
        )
        # Gauges (the state of the fleet at each sweep) ...
        self.dashboard.add_widgets(
            self._team_graph("Machines watched", "MachinesScanned", "Maximum", interval, width=8),
            self._team_graph("Idle (incl. warned, snoozed, reaped)", "MachinesIdle", "Maximum", interval, width=8),
            self._team_graph("Unknown (not enough data)", "MachinesUnknown", "Maximum", interval, width=8),
        )
        # ... and events (what the reaper and people did), per hour.
        self.dashboard.add_widgets(
            self._team_graph("Warnings sent", "WarningsSent", "Sum", hour, width=6),
            self._team_graph("Stopped or released to their ASG", "MachinesReaped", "Sum", hour, width=6),
            self._team_graph("Scale-in protection set", "MachinesProtected", "Sum", hour, width=6),
            self._team_graph("Snoozes", "Snoozes", "Sum", hour, width=6),
        )
        self.dashboard.add_widgets(
            self._team_graph(
                "Hourly cost of machines reaped (USD/h, estimate)", "EstimatedHourlySavings", "Sum", hour, width=16
            ),
            cw.SingleValueWidget(
                title="Hourly cost reaped in the time range (USD/h)",
                width=8,
                height=6,
                set_period_to_time_range=True,
                metrics=[
                    cw.MathExpression(
                        label="All teams",
                        expression=f"SUM({self._search('EstimatedHourlySavings', 'Sum', hour)})",
                        using_metrics={},
                        period=hour,
                    )
                ],
            ),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(
                title="Sweep duration (ms)",
                width=8,
                left=[
                    self._service_metric("SweepDurationMs", "Average", interval).with_(label="average"),
                    self._service_metric("SweepDurationMs", "Maximum", interval).with_(label="maximum"),
                ],
                left_annotations=[
                    cw.HorizontalAnnotation(value=interval.to_milliseconds(), label="schedule interval"),
                ],
            ),
            cw.GraphWidget(
                title="Sweep errors, throttles, teams in safe mode, failed shards",
                width=8,
                left=[
                    sweep_errors,
                    sweep.metric_throttles(period=interval, statistic="Sum"),
                    self._service_metric("TeamsInSafeMode", "Maximum", interval).with_(label="Teams in safe mode"),
                    shards_failed.with_(label="Shards failed"),
                    self._service_metric("MachinesDeferred", "Sum", interval).with_(label="Machines deferred"),
                ],
            ),
            cw.AlarmStatusWidget(title="Alarms", width=8, alarms=self.alarms),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(
                title="Slack handler: failures and throttles",
                width=12,
                left=[
                    slack.metric_errors(period=five_minutes, statistic="Sum").with_(label="Crashes and timeouts"),
                    self._service_metric("SlackRequestFailures", "Sum", five_minutes).with_(
                        label="Requests answered with an internal error"
                    ),
                    slack.metric_throttles(period=five_minutes, statistic="Sum").with_(label="Throttled"),
                ],
            ),
            cw.GraphWidget(
                title="Slack handler duration (ms; Slack gives up at 3,000)",
                width=12,
                left=[
                    slack.metric_duration(period=five_minutes, statistic="p50").with_(label="p50"),
                    slack.metric_duration(period=five_minutes, statistic="p99").with_(label="p99"),
                ],
                left_annotations=[cw.HorizontalAnnotation(value=SLACK_DURATION_ALARM_MS, label="alarm")],
            ),
        )

    def _alarm_topic(self, id: str, display_name: str, alarm_email: str | None) -> sns.Topic:
        """A topic this account's CloudWatch alarms may publish to. enforce_ssl gives the topic a policy,
        and a topic policy replaces SNS's default one (under which the account's alarms could publish):
        without the statement below every alarm action fails with "not authorized to perform: SNS:Publish"."""
        stack = Stack.of(self)
        topic = sns.Topic(self, id, display_name=display_name, enforce_ssl=True)
        topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarmsOfThisAccount",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["sns:Publish"],
                resources=[topic.topic_arn],
                conditions={
                    "StringEquals": {"aws:SourceAccount": stack.account},
                    "ArnLike": {
                        "aws:SourceArn": stack.format_arn(
                            service="cloudwatch",
                            resource="alarm",
                            resource_name="*",
                            arn_format=ArnFormat.COLON_RESOURCE_NAME,
                        )
                    },
                },
            )
        )
        if alarm_email:
            topic.add_subscription(subscriptions.EmailSubscription(alarm_email))
        suppress(
            topic,
            NagPackSuppression(
                id="AwsSolutions-SNS2",
                reason="Alarm notifications carry no secrets. CloudWatch cannot publish to a topic encrypted "
                "with the AWS-managed SNS key, and a customer-managed key per region costs more than the rest "
                "of the stack; add one if your policy requires it.",
            ),
        )
        return topic

    @staticmethod
    def _service_metric(name: str, statistic: str, period: Duration) -> cw.Metric:
        return cw.Metric(
            namespace=METRICS_NAMESPACE,
            metric_name=name,
            dimensions_map={"service": SERVICE_NAME},
            statistic=statistic,
            period=period,
        )

    @staticmethod
    def _search(metric: str, statistic: str, period: Duration) -> str:
        # No metric schema ({Namespace,dims}) on purpose: a schema matches one exact dimension set,
        # and per-team metrics may carry `service` besides `team`. The bare `team` term keeps only
        # series that have a team dimension.
        return (
            f'SEARCH(\'Namespace="{METRICS_NAMESPACE}" MetricName="{metric}" team\', '
            f"'{statistic}', {int(period.to_seconds())})"
        )

    def _team_graph(self, title: str, metric: str, statistic: str, period: Duration, *, width: int) -> cw.GraphWidget:
        per_team: Any = cw.MathExpression(
            label="${PROP('Dim.team')}",
            expression=self._search(metric, statistic, period),
            using_metrics={},
            period=period,
        )
        return cw.GraphWidget(title=title, width=width, height=6, left=[per_team], stacked=True)
