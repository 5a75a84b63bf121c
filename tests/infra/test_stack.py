"""What the stack deploys, checked on the synthesized templates.

The app is synthesized once for the session (jsii start-up and synthesis take seconds), with
bundling skipped (test_layer_bundling.py bundles the layer for real). Tests read the cloud assembly
from disk: the templates, and the metadata and report where cdk-nag leaves its findings."""

from __future__ import annotations

import ast
import csv
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Match, Template
from synthesis import ALARM_EMAIL, REGIONS, Synth, synthesize

from idle_reaper.sweep import PLANNER_VCPUS
from infra.constructs import GpuAgentRollout
from infra.stack import DOCTOR_READS, SWEEP_HANDLER, IdleReaperProps

pytestmark = pytest.mark.infra

REPO_ROOT = Path(__file__).resolve().parents[2]
WRITE_ACTIONS = {
    "ec2:StopInstances",
    "ec2:StartInstances",
    "autoscaling:SetInstanceProtection",
    "autoscaling:TerminateInstanceInAutoScalingGroup",
    "sagemaker:StopNotebookInstance",
    "sagemaker:StartNotebookInstance",
}


@pytest.fixture(scope="session")
def template(synth: Synth) -> dict[str, Any]:
    return synth.template()


@pytest.fixture(scope="module")
def assertions(template: dict[str, Any]) -> Template:
    return Template.from_json(template)


def resources(template: dict[str, Any], type_: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == type_}


def function(template: dict[str, Any], handler: str) -> tuple[str, dict[str, Any]]:
    [(logical_id, fn)] = [
        (k, v["Properties"])
        for k, v in resources(template, "AWS::Lambda::Function").items()
        if v["Properties"].get("Handler") == handler
    ]
    return logical_id, fn


def statements(template: dict[str, Any], role_logical_id: str | None = None) -> Iterator[dict[str, Any]]:
    for policy in resources(template, "AWS::IAM::Policy").values():
        roles = policy["Properties"].get("Roles", [])
        if role_logical_id is None or {"Ref": role_logical_id} in roles:
            yield from policy["Properties"]["PolicyDocument"]["Statement"]


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def role_of(fn: dict[str, Any]) -> str:
    logical_id: str = fn["Role"]["Fn::GetAtt"][0]
    return logical_id


# -- state ---------------------------------------------------------------------------------------


def test_state_table_is_on_demand_recoverable_and_retained(assertions: Template) -> None:
    assertions.has_resource(
        "AWS::DynamoDB::Table",
        {
            "Properties": {
                "TableName": "idle-reaper-state",
                "KeySchema": [
                    {"AttributeName": "pk", "KeyType": "HASH"},
                    {"AttributeName": "sk", "KeyType": "RANGE"},
                ],
                "BillingMode": "PAY_PER_REQUEST",
                "PointInTimeRecoverySpecification": {"PointInTimeRecoveryEnabled": True},
                "TimeToLiveSpecification": {"AttributeName": "expires_at", "Enabled": True},
                "DeletionProtectionEnabled": True,
                "GlobalSecondaryIndexes": [
                    {
                        "IndexName": "owner-index",
                        "KeySchema": [{"AttributeName": "owner_slack_id", "KeyType": "HASH"}],
                        "Projection": {"ProjectionType": "ALL"},
                    }
                ],
            },
            "DeletionPolicy": "Retain",
            "UpdateReplacePolicy": "Retain",
        },
    )


def test_slack_secret_is_created_empty_retained_and_never_put_in_environment(template: dict[str, Any]) -> None:
    [secret] = resources(template, "AWS::SecretsManager::Secret").values()
    assert secret["Properties"]["Name"] == "idle-reaper/slack"
    assert secret["DeletionPolicy"] == secret["UpdateReplacePolicy"] == "Retain"
    assert json.loads(secret["Properties"]["SecretString"]) == {"bot_token": "", "signing_secret": ""}
    [secret_id] = resources(template, "AWS::SecretsManager::Secret")
    for fn in resources(template, "AWS::Lambda::Function").values():
        env = fn["Properties"].get("Environment", {}).get("Variables", {})
        assert not {"SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET"} & env.keys()
        if "IDLE_REAPER_SLACK_SECRET" in env:
            assert env["IDLE_REAPER_SLACK_SECRET"] == {"Ref": secret_id}


def test_settings_and_example_team_are_seeded_once_and_never_overwritten(template: dict[str, Any]) -> None:
    from idle_reaper.policy import Settings, TeamPolicy

    seeded = {}
    for resource in resources(template, "Custom::IdleReaperSeededParameter").values():
        props = resource["Properties"]
        assert "Update" not in props and "Delete" not in props  # create only; kept on stack delete
        call = json.loads(props["Create"])
        assert call["action"] == "putParameter"
        assert call["parameters"]["Overwrite"] is False
        assert call["ignoreErrorCodesMatching"] == "ParameterAlreadyExists"
        seeded[call["parameters"]["Name"]] = call["parameters"]["Value"]
    assert seeded == {
        "/idle-reaper/settings": Settings.model_validate(
            {"tags": {"managed": "idle-reaper:managed"}}
        ).model_dump_json(),
        "/idle-reaper/teams/example": TeamPolicy().model_dump_json(),
    }
    # The runtime's opt-in filter is the tag IAM requires.
    assert Settings.model_validate_json(seeded["/idle-reaper/settings"]).tags.managed == "idle-reaper:managed"


# -- functions -----------------------------------------------------------------------------------


def test_sweep_runs_on_the_schedule_one_at_a_time(template: dict[str, Any], assertions: Template) -> None:
    logical_id, sweep = function(template, "idle_reaper.handlers.sweep.handler")
    assert sweep["Runtime"] == "python3.12"
    assert sweep["Architectures"] == ["arm64"]
    assert sweep["ReservedConcurrentExecutions"] == 1
    assert sweep["TracingConfig"] == {"Mode": "Active"}
    assert sweep["Timeout"] < 5 * 60  # ends before the next sweep is due
    assert len(sweep["Layers"]) == 1
    env = sweep["Environment"]["Variables"]
    assert env["IDLE_REAPER_SSM_PREFIX"] == "/idle-reaper"
    assert env["IDLE_REAPER_TABLE"] == {"Ref": next(iter(resources(template, "AWS::DynamoDB::Table")))}
    assert env["POWERTOOLS_SERVICE_NAME"] == "idle-reaper"
    assert env["POWERTOOLS_METRICS_NAMESPACE"] == "IdleReaper"

    [queue] = resources(template, "AWS::SQS::Queue")
    assertions.has_resource_properties(
        "AWS::Events::Rule",
        {
            "ScheduleExpression": "rate(5 minutes)",
            "State": "ENABLED",
            "Targets": [
                Match.object_like(
                    {
                        "Arn": {"Fn::GetAtt": [logical_id, "Arn"]},
                        "DeadLetterConfig": {"Arn": {"Fn::GetAtt": [queue, "Arn"]}},
                    }
                )
            ],
        },
    )
    # A failed sweep is not retried (the next one is the retry); it goes to the dead-letter queue.
    assertions.has_resource_properties(
        "AWS::Lambda::EventInvokeConfig",
        {
            "FunctionName": {"Ref": logical_id},
            "MaximumRetryAttempts": 0,
            "DestinationConfig": {"OnFailure": {"Destination": {"Fn::GetAtt": [queue, "Arn"]}}},
        },
    )


def test_slack_handler_is_behind_an_unauthenticated_function_url(
    template: dict[str, Any], assertions: Template
) -> None:
    logical_id, slack = function(template, "idle_reaper.handlers.slack.handler")
    assert slack["Runtime"] == "python3.12"
    assert slack["Architectures"] == ["arm64"]
    assert slack["Environment"]["Variables"]["IDLE_REAPER_REGIONS"] == ",".join(REGIONS)
    # A flood of unsigned requests cannot take the account's shared concurrency.
    assert slack["ReservedConcurrentExecutions"] == 10
    # Slack's request signature is the authentication, checked in the handler.
    assertions.has_resource_properties(
        "AWS::Lambda::Url", {"AuthType": "NONE", "TargetFunctionArn": {"Fn::GetAtt": [logical_id, "Arn"]}}
    )


def test_function_code_is_the_lambdas_directory_and_dependencies_a_layer(synth: Synth) -> None:
    assets = json.loads((synth.outdir / f"{synth.stack_names[0]}.assets.json").read_text())
    paths = {Path(a["source"]["path"]).name for a in assets["files"].values()}
    code_dirs = [synth.outdir / p for p in paths if (synth.outdir / p / "idle_reaper" / "__init__.py").exists()]
    assert len(code_dirs) == 1
    assert not list(code_dirs[0].rglob("__pycache__"))


# What Lambda may import besides the standard library: the layer's packages and the runtime itself.
RUNTIME_IMPORTS = {
    "idle_reaper",
    "boto3",
    "botocore",
    "aws_lambda_powertools",
    "pydantic",
    "pydantic_core",
    "slack_sdk",
    "PIL",  # Pillow: the weekly digest's chart (slack/chart.py), imported only when it draws one
}


def test_function_asset_ships_only_the_runtime_package(synth: Synth) -> None:
    """Every file in the functions' code asset is a tracked module of lambdas/idle_reaper, and none of
    them imports a local tool, a test double or a test-only package."""
    assets = json.loads((synth.outdir / f"{synth.stack_names[0]}.assets.json").read_text())
    [code_dir] = {
        synth.outdir / a["source"]["path"]
        for a in assets["files"].values()
        if (synth.outdir / a["source"]["path"] / "idle_reaper" / "__init__.py").exists()
    }
    shipped = {p.relative_to(code_dir).as_posix() for p in code_dir.rglob("*") if p.is_file()}
    source = REPO_ROOT / "lambdas"
    runtime = {p.relative_to(source).as_posix() for p in (source / "idle_reaper").rglob("*.py")}
    assert shipped == runtime, f"unexpected files in the asset: {sorted(shipped ^ runtime)}"
    for name in ("demo", "local", "fake_slack", "replay", "cli", "admin"):
        assert not any(Path(f).stem == name for f in shipped), f"tool module {name} is in the Lambda asset"
    for path in shipped:
        tree = ast.parse((code_dir / path).read_text())
        imported = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        }
        foreign = imported - RUNTIME_IMPORTS - set(sys.stdlib_module_names)
        assert not foreign, f"{path} imports {sorted(foreign)}, which Lambda does not ship"


# -- permissions ---------------------------------------------------------------------------------


def test_writes_are_limited_to_machines_that_opted_in(template: dict[str, Any]) -> None:
    seen: set[str] = set()
    for statement in statements(template):
        actions = set(as_list(statement["Action"]))
        assert "*" not in actions and not any(a.endswith(":*") for a in actions)
        writes = actions & WRITE_ACTIONS
        if not writes:
            continue
        seen |= writes
        assert "*" not in as_list(statement["Resource"])
        # The reaper's own opt-in tag, not the Team cost-allocation tag production machines carry too.
        assert statement["Condition"] == {"StringEquals": {"aws:ResourceTag/idle-reaper:managed": "true"}}
    assert seen == WRITE_ACTIONS


def test_only_the_slack_handler_starts_machines_and_only_the_sweep_terminates(template: dict[str, Any]) -> None:
    def actions_of(handler: str) -> set[str]:
        _, fn = function(template, handler)
        return {a for s in statements(template, role_of(fn)) for a in as_list(s["Action"])}

    sweep, slack = actions_of("idle_reaper.handlers.sweep.handler"), actions_of("idle_reaper.handlers.slack.handler")
    assert "ec2:StartInstances" in slack and "ec2:StartInstances" not in sweep
    assert "autoscaling:TerminateInstanceInAutoScalingGroup" in sweep
    assert "autoscaling:TerminateInstanceInAutoScalingGroup" not in slack
    assert "cloudwatch:GetMetricData" in sweep
    # Answers act on known machines; only `/idle-reaper doctor` lists, read-only, in the stack's own region.
    _, fn = function(template, "idle_reaper.handlers.slack.handler")
    listing = [s for s in statements(template, role_of(fn)) if "ec2:DescribeInstances" in as_list(s["Action"])]
    assert [s["Sid"] for s in listing] == ["DoctorReads"]
    assert set(as_list(listing[0]["Action"])) == set(DOCTOR_READS)
    assert set(listing[0]["Condition"]["StringEquals"]) == {"aws:RequestedRegion"}
    assert not {a for a in sweep | slack if a.startswith("ssm:Put")}  # admins edit policies, not Lambdas


STATE_MACHINE_LOG_DELIVERY = {
    "logs:CreateLogDelivery",
    "logs:GetLogDelivery",
    "logs:UpdateLogDelivery",
    "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries",
    "logs:PutResourcePolicy",
    "logs:DescribeResourcePolicies",
    "logs:DescribeLogGroups",
}


def test_reads_are_scoped_to_the_prefix_the_table_and_the_secret(template: dict[str, Any]) -> None:
    [table] = resources(template, "AWS::DynamoDB::Table")
    [secret] = resources(template, "AWS::SecretsManager::Secret")
    for statement in statements(template):
        actions = as_list(statement["Action"])
        text = json.dumps(statement["Resource"])
        if any(a.startswith("ssm:Get") for a in actions):
            assert text.count(":parameter/idle-reaper") == len(as_list(statement["Resource"]))
        if any(a.startswith("secretsmanager:") for a in actions):
            assert statement["Resource"] == {"Ref": secret}
        if any(a.startswith("dynamodb:") for a in actions):
            assert table in text or "table/idle-reaper-state" in text
        if statement["Resource"] == "*":
            # Only calls without resource-level permissions: fleet reads, X-Ray, and the state machine's
            # log delivery (Step Functions' vended logs; AWS documents Resource "*" for these).
            assert set(actions) <= {
                "ec2:DescribeInstances",
                "ec2:DescribeAvailabilityZones",
                "ec2:DescribeRegions",
                "ec2:DescribeSpotInstanceRequests",
                "ec2:DescribeCapacityReservations",
                "autoscaling:DescribeAutoScalingGroups",
                "autoscaling:DescribeTags",  # `/idle-reaper doctor`: the groups' opt-in tags
                "cloudwatch:GetMetricData",
                "lambda:GetAccountSettings",  # `/idle-reaper doctor`: deploy.concurrency's quota
                "sagemaker:ListNotebookInstances",  # no resource-level permission either
                "sagemaker:ListApps",
                "sagemaker:ListEndpoints",  # issue 46: endpoints, and their variants' minimum capacity
                "application-autoscaling:DescribeScalableTargets",
                "xray:PutTraceSegments",
                "xray:PutTelemetryRecords",
                "xray:GetSamplingRules",
                "xray:GetSamplingTargets",
                *STATE_MACHINE_LOG_DELIVERY,
            }


# -- monitoring ----------------------------------------------------------------------------------


def alarm_topics(template: dict[str, Any]) -> tuple[str, str]:
    """(the topic every alarm goes to, the one the relay's own errors alarm goes to)."""
    by_name = {r["Properties"]["DisplayName"]: i for i, r in resources(template, "AWS::SNS::Topic").items()}
    return by_name["idle-reaper alarms"], by_name["idle-reaper alarms the Slack relay failed"]


def test_the_sweep_reads_the_alarm_relays_own_alarm(template: dict[str, Any]) -> None:
    """Issue 43 (11): the relay's errors alarm goes to a topic without the relay, where nobody is without an alarm
    e-mail. The sweep is told its name, and may read that alarm alone (test_iam.py checks the ARN)."""
    [relay_alarm] = [a for n, a in resources(template, "AWS::CloudWatch::Alarm").items() if "AlarmRelayErrors" in n]
    assert relay_alarm["Properties"]["AlarmName"] == "idle-reaper-alarm-relay-errors"
    _, sweep = function(template, "idle_reaper.handlers.sweep.handler")
    assert sweep["Environment"]["Variables"]["IDLE_REAPER_RELAY_ALARM"] == "idle-reaper-alarm-relay-errors"


def test_alarms_notify_the_topic_and_its_email_subscription(template: dict[str, Any], assertions: Template) -> None:
    topic, relay_topic = alarm_topics(template)
    alarms = resources(template, "AWS::CloudWatch::Alarm")
    assert len(alarms) == 14
    for name, alarm in alarms.items():
        # The relay's own errors alarm never goes through the relay (it would wake it to fail again).
        expected = relay_topic if name.startswith("MonitoringAlarmRelayErrorsAlarm") else topic
        assert alarm["Properties"]["AlarmActions"] == [{"Ref": expected}], name
        assert alarm["Properties"]["OKActions"] == [{"Ref": expected}], name
    for each in (topic, relay_topic):
        assertions.has_resource_properties(
            "AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": ALARM_EMAIL, "TopicArn": {"Ref": each}}
        )
    subscribed = [s["Properties"]["TopicArn"] for s in resources(template, "AWS::SNS::Subscription").values()]
    assert subscribed.count({"Ref": relay_topic}) == 1  # e-mail only: the relay does not listen there
    # By default alarms go to the admins in Slack: the relay function is subscribed, e-mail or not.
    relay, _ = function(template, "idle_reaper.handlers.alarms.handler")
    assertions.has_resource_properties(
        "AWS::SNS::Subscription",
        {"Protocol": "lambda", "Endpoint": {"Fn::GetAtt": [relay, "Arn"]}, "TopicArn": {"Ref": topic}},
    )
    # "No sweep in 3 intervals": no datapoint at all is the failure.
    assertions.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "EvaluationPeriods": 3,
            "DatapointsToAlarm": 3,
            "TreatMissingData": "breaching",
            "ComparisonOperator": "LessThanThreshold",
            "Metrics": [
                Match.object_like(
                    {
                        "MetricStat": {
                            "Metric": {
                                "Namespace": "IdleReaper",
                                "MetricName": "SweepDurationMs",
                                "Dimensions": [{"Name": "service", "Value": "idle-reaper"}],
                            },
                            "Period": 300,
                            "Stat": "SampleCount",
                        }
                    }
                )
            ],
        },
    )
    # Sweep errors: reported by the sweep, or the invocation itself failed.
    assertions.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {"Metrics": Match.array_with([Match.object_like({"Expression": "FILL(reported, 0) + FILL(crashed, 0)"})])},
    )


def test_dashboard_shows_every_metric_the_sweep_emits(template: dict[str, Any]) -> None:
    [dashboard] = resources(template, "AWS::CloudWatch::Dashboard").values()
    name = dashboard["Properties"]["DashboardName"]
    assert name == f"idle-reaper-{REGIONS[0]}"
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    for metric in (
        "MachinesScanned",
        "MachinesIdle",
        "MachinesUnknown",
        "MachinesProtected",
        "WarningsSent",
        "MachinesReaped",
        "Snoozes",
        "EstimatedHourlySavings",
        "SweepDurationMs",
        "SweepErrors",
        "TeamsInSafeMode",
        "ShardsFailed",
        "MachinesDeferred",
        "SlackRequestFailures",
        "Throttles",
    ):
        assert metric in body, metric


def test_outputs_name_the_slack_url_the_secret_and_the_dashboard(template: dict[str, Any]) -> None:
    outputs = template["Outputs"]
    [url] = resources(template, "AWS::Lambda::Url")
    assert outputs["SlackFunctionUrl"]["Value"] == {"Fn::GetAtt": [url, "FunctionUrl"]}
    assert outputs["SlackSecretName"]["Value"] == "idle-reaper/slack"
    dashboard_url = json.dumps(outputs["DashboardUrl"]["Value"])
    assert "console.aws.amazon.com/cloudwatch" in dashboard_url and "#dashboards:name=" in dashboard_url
    # The function to invoke for a sweep now: the one whose handler is the sweep's.
    (sweep,) = [
        logical
        for logical, r in template["Resources"].items()
        if r["Type"] == "AWS::Lambda::Function" and r["Properties"].get("Handler") == SWEEP_HANDLER
    ]
    assert outputs["SweepFunctionName"]["Value"] == {"Ref": sweep}


# -- GPU agent -----------------------------------------------------------------------------------


def test_gpu_agent_config_is_the_repo_file_rolled_out_by_tag(template: dict[str, Any], assertions: Template) -> None:
    shipped = json.loads((REPO_ROOT / "infra" / "cloudwatch-agent-gpu.json").read_text())
    metrics = shipped["metrics"]
    # Custom metrics are billed per series: only the one the reaper reads, rolled up per instance.
    gpu = metrics["metrics_collected"]["nvidia_gpu"]
    assert gpu["measurement"] == ["utilization_gpu"]
    # No per-GPU series: the agent's translator takes measurement names under nvidia_gpu (its own test
    # TestDropMultipleOriginal maps them to the nvidia_smi plugin).
    assert gpu["drop_original_metrics"] == ["utilization_gpu"]
    assert metrics["append_dimensions"] == {"InstanceId": "${aws:InstanceId}"}
    assert metrics["aggregation_dimensions"] == [["InstanceId"]]
    assert metrics.get("namespace", "CWAgent") == "CWAgent"

    [parameter] = resources(template, "AWS::SSM::Parameter").values()
    assert parameter["Properties"]["Name"] == "AmazonCloudWatch-idle-reaper-gpu"
    assert parameter["Properties"]["Name"].startswith("AmazonCloudWatch-")  # readable under the managed policy
    assert json.loads(parameter["Properties"]["Value"]) == shipped

    [document_id] = resources(template, "AWS::SSM::Document")
    steps = template["Resources"][document_id]["Properties"]["Content"]["mainSteps"]
    # Install, configure (fetch-config replaces appended configs), then the activity collector (append-config).
    assert [s.get("inputs", {}).get("documentPath") for s in steps] == [
        "AWS-ConfigureAWSPackage",
        "AmazonCloudWatch-ManageAgent",
        None,
    ]
    assert (steps[2]["action"], steps[2]["name"]) == ("aws:runShellScript", GpuAgentRollout.COLLECTOR_STEP)
    assert steps[0]["inputs"]["documentParameters"] == {"action": "Install", "name": "AmazonCloudWatchAgent"}
    configure = steps[1]["inputs"]["documentParameters"]
    assert configure["optionalConfigurationLocation"] == "AmazonCloudWatch-idle-reaper-gpu"
    assertions.has_resource_properties(
        "AWS::SSM::Association",
        {"Name": {"Ref": document_id}, "Targets": [{"Key": "tag:idle-reaper:gpu-agent", "Values": ["install"]}]},
    )


# -- cdk-nag -------------------------------------------------------------------------------------


def test_cdk_nag_aws_solutions_has_no_unsuppressed_findings(synth: Synth) -> None:
    for stack_name in synth.stack_names:
        errors = [
            (path, entry["data"])
            for path, entries in synth.metadata(stack_name).items()
            for entry in entries
            if entry["type"] in ("aws:cdk:error", "aws:cdk:warning")
        ]
        assert errors == []
        report = synth.nag_report(stack_name)
        rows = report.splitlines()[1:]
        assert rows, "cdk-nag did not run"
        for row in csv.reader(rows):
            compliance, reason = row[2], row[3]
            assert compliance in ("Compliant", "Suppressed"), row  # not Non-Compliant, not UNKNOWN
            if compliance == "Suppressed":
                assert len(reason) > 20, row  # a written reason, not a placeholder


# -- regions and props ---------------------------------------------------------------------------


def test_one_stack_per_region_and_a_shared_slack_endpoint_may_act_in_all(synth: Synth) -> None:
    assert synth.stack_names == tuple(f"IdleReaper-{r}" for r in REGIONS)
    second = synth.template(synth.stack_names[1])
    [dashboard] = resources(second, "AWS::CloudWatch::Dashboard").values()
    assert dashboard["Properties"]["DashboardName"] == f"idle-reaper-{REGIONS[1]}"
    _, slack = function(second, "idle_reaper.handlers.slack.handler")
    starts = [s for s in statements(second, role_of(slack)) if "ec2:StartInstances" in as_list(s["Action"])]
    resources_text = json.dumps([s["Resource"] for s in starts])
    assert all(f":ec2:{r}:" in resources_text for r in REGIONS)


def test_props_from_context() -> None:
    node = cdk.App(
        context={
            "regions": "us-east-1, eu-west-1",
            "scheduleMinutes": "10",
            "gpuAgentTagKey": "",
            "managedTagKey": "reaper:opt-in",
        }
    ).node
    props = IdleReaperProps.from_context(node)
    assert props.managed_tag_key == "reaper:opt-in"
    assert props.regions == ("us-east-1", "eu-west-1")
    assert props.schedule_minutes == 10
    assert props.gpu_agent_tag_key == ""  # an empty key turns the GPU agent rollout off
    assert IdleReaperProps.from_context(cdk.App().node) == IdleReaperProps()
    with pytest.raises(ValueError, match="scheduleMinutes"):
        IdleReaperProps(schedule_minutes=0)
    with pytest.raises(ValueError, match="ssmPrefix"):
        IdleReaperProps(ssm_prefix="idle-reaper/")
    for bad in ("", "aws:managed", "x" * 129):  # IAM's opt-in condition needs a real, settable tag key
        with pytest.raises(ValueError, match="managedTagKey"):
            IdleReaperProps(managed_tag_key=bad)


def test_schedule_prefix_and_optional_parts_follow_the_props(tmp_path: Path) -> None:
    variant = synthesize(
        tmp_path,
        scheduleMinutes=15,
        ssmPrefix="/ml/reaper",
        gpuAgentTagKey="",
        alarmEmail="",
        managedTagKey="reaper:opt-in",
    )
    template = variant.template()
    assert variant.stack_names == ("IdleReaper",)
    Template.from_json(template).has_resource_properties(
        "AWS::Events::Rule", {"ScheduleExpression": "rate(15 minutes)"}
    )
    _, sweep = function(template, "idle_reaper.handlers.sweep.handler")
    assert sweep["Timeout"] == 14 * 60
    assert sweep["Environment"]["Variables"]["IDLE_REAPER_SSM_PREFIX"] == "/ml/reaper"
    assert not resources(template, "AWS::SSM::Association")
    # No e-mail: the Slack relay is the only subscriber.
    assert [s["Properties"]["Protocol"] for s in resources(template, "AWS::SNS::Subscription").values()] == ["lambda"]
    # The opt-in tag key follows the context, in IAM and in the seeded settings alike.
    conditions = json.dumps([s.get("Condition") for s in statements(template)])
    assert "aws:ResourceTag/reaper:opt-in" in conditions and "idle-reaper:managed" not in conditions
    seeded = [
        json.loads(r["Properties"]["Create"]) for r in resources(template, "Custom::IdleReaperSeededParameter").values()
    ]
    [settings] = [c["parameters"]["Value"] for c in seeded if c["parameters"]["Name"].endswith("/settings")]
    assert json.loads(settings)["tags"]["managed"] == "reaper:opt-in"
    names = {
        json.loads(r["Properties"]["Create"])["parameters"]["Name"]
        for r in resources(template, "Custom::IdleReaperSeededParameter").values()
    }
    assert names == {"/ml/reaper/settings", "/ml/reaper/teams/example"}
    assert "GpuAgentAssociationId" not in template["Outputs"]


def alarm_on(template: dict[str, Any], metric_name: str, namespace: str, dimension: Any) -> dict[str, Any]:
    [alarm] = [
        a["Properties"]
        for a in resources(template, "AWS::CloudWatch::Alarm").values()
        if a["Properties"].get("MetricName") == metric_name
        and a["Properties"].get("Namespace") == namespace
        and dimension in a["Properties"].get("Dimensions", [])
    ]
    return alarm


def test_failures_the_handlers_survive_and_slowness_are_alarmed(template: dict[str, Any]) -> None:
    service = {"Name": "service", "Value": "idle-reaper"}
    slack_id, _ = function(template, "idle_reaper.handlers.slack.handler")
    sweep_id, sweep = function(template, "idle_reaper.handlers.sweep.handler")
    relay_id, _ = function(template, "idle_reaper.handlers.alarms.handler")

    def of(logical_id: str) -> dict[str, Any]:
        return {"Name": "FunctionName", "Value": {"Ref": logical_id}}

    failures = alarm_on(template, "SlackRequestFailures", "IdleReaper", service)
    assert (failures["Statistic"], failures["Threshold"], failures["ComparisonOperator"]) == (
        "Sum",
        1,
        "GreaterThanOrEqualToThreshold",
    )
    safe_mode = alarm_on(template, "TeamsInSafeMode", "IdleReaper", service)
    assert safe_mode["Threshold"] == 1 and safe_mode["Period"] == 300  # one sweep interval
    assert safe_mode["EvaluationPeriods"] == safe_mode["DatapointsToAlarm"] == 3
    slack_p99 = alarm_on(template, "Duration", "AWS/Lambda", of(slack_id))
    assert slack_p99["ExtendedStatistic"] == "p99" and slack_p99["Threshold"] < 3000
    sweep_p99 = alarm_on(template, "Duration", "AWS/Lambda", of(sweep_id))
    assert sweep_p99["ExtendedStatistic"] == "p99"
    assert 0.5 * sweep["Timeout"] * 1000 <= sweep_p99["Threshold"] < sweep["Timeout"] * 1000
    throttles = alarm_on(template, "Throttles", "AWS/Lambda", of(slack_id))
    assert throttles["Threshold"] == 1 and throttles["TreatMissingData"] == "notBreaching"
    relay_errors = alarm_on(template, "Errors", "AWS/Lambda", of(relay_id))
    assert relay_errors["Threshold"] == 1


# A report event of a cold start as Lambda writes it with the JSON log format (trimmed of the trace fields).
PLATFORM_REPORT = {
    "time": "2026-11-24T10:00:01.203Z",
    "type": "platform.report",
    "record": {
        "requestId": "6d68ca91-49c9-448d-89b8-7ca3e6dc66aa",
        "metrics": {
            "durationMs": 182.4,
            "billedDurationMs": 1036,
            "memorySizeMB": 1769,
            "maxMemoryUsedMB": 121,
            "initDurationMs": 853.2,
        },
        "status": "success",
    },
}


def test_slack_cold_starts_are_timed_and_alarmed(template: dict[str, Any]) -> None:
    """Init time is not in the Duration metric: the Slack function logs JSON, whose platform.report event
    carries initDurationMs, and a metric filter turns it into a metric with an alarm below Slack's 3 s."""
    _, slack = function(template, "idle_reaper.handlers.slack.handler")
    assert slack["LoggingConfig"]["LogFormat"] == "JSON"
    assert slack["MemorySize"] == 1769  # a full vCPU: the cold import from source is CPU-bound
    [log_group] = [ref["Ref"] for ref in [slack["LoggingConfig"]["LogGroup"]]]
    [metric_filter] = [
        r["Properties"]
        for r in resources(template, "AWS::Logs::MetricFilter").values()
        if r["Properties"]["LogGroupName"] == {"Ref": log_group}
    ]
    [transformation] = metric_filter["MetricTransformations"]
    assert (transformation["MetricNamespace"], transformation["MetricName"]) == ("IdleReaper", "SlackInitDurationMs")
    # The pattern's two terms and the value's path, read against a real report event.
    pattern = metric_filter["FilterPattern"]
    assert '$.type = "platform.report"' in pattern and "$.record.metrics.initDurationMs > 0" in pattern
    value: Any = PLATFORM_REPORT
    for key in transformation["MetricValue"].removeprefix("$.").split("."):
        value = value[key]
    assert value == 853.2
    [alarm] = [
        a["Properties"]
        for a in resources(template, "AWS::CloudWatch::Alarm").values()
        if "SlackInitDurationMs" in json.dumps(a["Properties"].get("Metrics", []))
    ]
    [stat] = [m["MetricStat"] for m in alarm["Metrics"]]
    assert stat["Stat"] == "Maximum" and stat["Metric"]["Namespace"] == "IdleReaper"
    assert alarm["Threshold"] < 3000 and alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"


def test_slack_function_may_invoke_itself_and_nothing_else_without_a_cycle(template: dict[str, Any]) -> None:
    logical_id, slack = function(template, "idle_reaper.handlers.slack.handler")
    assert slack["FunctionName"] == "idle-reaper-slack"
    # Among the functions' roles (the sharded sweep's state machine invokes its own two, see below).
    function_roles = {role_of(fn["Properties"]) for fn in resources(template, "AWS::Lambda::Function").values()}
    invokes = [
        s
        for role in function_roles
        for s in statements(template, role)
        if "lambda:InvokeFunction" in as_list(s["Action"])
    ]
    assert len(invokes) == 1 and {"Ref": role_of(slack)} in next(
        p["Properties"]["Roles"]
        for p in resources(template, "AWS::IAM::Policy").values()
        if invokes[0] in p["Properties"]["PolicyDocument"]["Statement"]
    )
    # Built from the name, not from the function (which depends on the role's policy): no cycle.
    text = json.dumps(invokes[0]["Resource"])
    assert logical_id not in text and ":function:idle-reaper-slack" in text


def test_this_accounts_alarms_may_publish_to_both_alarm_topics(template: dict[str, Any]) -> None:
    """A topic policy replaces SNS's default one, under which the account's own alarms could publish: the
    policy must allow CloudWatch itself, for this account's alarms only, or every alarm action fails."""
    policies = {
        topic["Ref"]: r["Properties"]["PolicyDocument"]["Statement"]
        for r in resources(template, "AWS::SNS::TopicPolicy").values()
        for topic in r["Properties"]["Topics"]
    }
    for topic in alarm_topics(template):
        statements = policies[topic]
        [allow] = [s for s in statements if s.get("Principal") == {"Service": "cloudwatch.amazonaws.com"}]
        assert allow["Effect"] == "Allow" and allow["Action"] == "sns:Publish"
        assert allow["Resource"] == {"Ref": topic}
        assert allow["Condition"]["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}
        source = json.dumps(allow["Condition"]["ArnLike"]["aws:SourceArn"])
        assert ":cloudwatch:" in source and ":alarm:*" in source and "AWS::AccountId" in source
        # The TLS-only statement stays, and denies nothing CloudWatch does (it publishes over TLS).
        [deny] = [s for s in statements if s["Effect"] == "Deny"]
        assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_gpu_agent_failures_reach_the_alarm_topic(template: dict[str, Any], assertions: Template) -> None:
    topic, _ = alarm_topics(template)
    [association] = resources(template, "AWS::SSM::Association")
    [rule] = [
        r["Properties"]
        for r in resources(template, "AWS::Events::Rule").values()
        if r["Properties"].get("EventPattern", {}).get("source") == ["aws.ssm"]
    ]
    assert rule["EventPattern"]["detail-type"] == ["EC2 State Manager Instance Association State Change"]
    assert rule["EventPattern"]["detail"] == {
        "association-id": [{"Fn::GetAtt": [association, "AssociationId"]}],
        "status": ["Failed"],
    }
    [target] = rule["Targets"]
    assert target["Arn"] == {"Ref": topic}
    assert "<detail-instance-id>" in json.dumps(target["InputTransformer"])
    # EventBridge may publish to the topic.
    assertions.has_resource_properties(
        "AWS::SNS::TopicPolicy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [Match.object_like({"Principal": {"Service": "events.amazonaws.com"}, "Action": "sns:Publish"})]
                )
            }
        },
    )


# -- the sharded sweep ---------------------------------------------------------------------------


def test_a_large_fleet_is_swept_by_a_state_machine_over_shard_indices(template: dict[str, Any]) -> None:
    [(machine_id, machine)] = resources(template, "AWS::StepFunctions::StateMachine").items()
    props = machine["Properties"]
    assert props["StateMachineName"] == "idle-reaper-sweep" and props["TracingConfiguration"] == {"Enabled": True}
    assert props["LoggingConfiguration"]["Level"] == "ALL"
    worker_id, worker = function(template, "idle_reaper.handlers.fanout.shard_handler")
    gather_id, _ = function(template, "idle_reaper.handlers.fanout.gather_handler")
    definition = json.loads(
        "".join(p if isinstance(p, str) else p["Fn::GetAtt"][0] for p in props["DefinitionString"]["Fn::Join"][1])
    )
    assert definition["TimeoutSeconds"] <= 30 * 60
    shards = definition["States"][definition["StartAt"]]
    assert shards["Type"] == "Map" and shards["ItemsPath"] == "$.shards" and shards["MaxConcurrency"] == 30
    # Only indices travel (the 256 KB limit): the worker reads its manifest from the state table.
    assert set(shards["ItemSelector"]) == {
        "sweep_id.$",
        "now.$",
        "dry_run.$",
        "shard.$",
        "concurrent_shards.$",
        "doctor.$",  # the day's doctor: a machine shard keeps its GPU machines' facts
    }
    processor = shards["ItemProcessor"]["States"]
    task = processor[shards["ItemProcessor"]["StartAt"]]
    assert task["Type"] == "Task" and [c["ErrorEquals"] for c in task["Catch"]] == [["States.ALL"]]
    # A worker throttled by the account's Lambda concurrency waits and tries again before its shard fails.
    throttled = [r for r in task["Retry"] if r["ErrorEquals"] == ["Lambda.TooManyRequestsException"]]
    assert len(throttled) == 1 and throttled[0]["MaxAttempts"] >= 3 and throttled[0]["BackoffRate"] > 1
    caught = processor[task["Catch"][0]["Next"]]
    assert caught["Type"] == "Pass" and caught["Parameters"] == {"shard.$": "$.shard", "error.$": "$.error.Error"}
    assert task["Resource"] == worker_id and definition["States"][shards["Next"]]["Resource"] == gather_id
    # The state machine may invoke the worker and the gather step, and nothing else.
    role = props["RoleArn"]["Fn::GetAtt"][0]
    invoked = {
        json.dumps(resource)
        for s in statements(template, role)
        if "lambda:InvokeFunction" in as_list(s["Action"])
        for resource in as_list(s["Resource"])
    }
    assert invoked and all(worker_id in r or gather_id in r for r in invoked)
    # The scheduled sweep plans, and hands a large fleet to it.
    _, sweep = function(template, "idle_reaper.handlers.sweep.handler")
    assert sweep["Environment"]["Variables"]["IDLE_REAPER_FANOUT_ARN"] == {"Ref": machine_id}
    assert worker["Timeout"] == sweep["Timeout"] and worker["MemorySize"] == 1769  # one vCPU
    # The planner lists the zones in child processes: a vCPU each, as many as the benchmark models (Lambda's
    # largest function, 10,240 MB, has 6).
    assert sweep["MemorySize"] == 10_240 and PLANNER_VCPUS == 6
    assert "ReservedConcurrentExecutions" not in worker


def test_failed_shards_and_failed_executions_are_alarmed(template: dict[str, Any]) -> None:
    service = {"Name": "service", "Value": "idle-reaper"}
    shards_failed = alarm_on(template, "ShardsFailed", "IdleReaper", service)
    assert (shards_failed["Statistic"], shards_failed["Threshold"], shards_failed["EvaluationPeriods"]) == ("Sum", 1, 1)
    worker_id, worker = function(template, "idle_reaper.handlers.fanout.shard_handler")
    worker_p99 = alarm_on(template, "Duration", "AWS/Lambda", {"Name": "FunctionName", "Value": {"Ref": worker_id}})
    assert 0.5 * worker["Timeout"] * 1000 <= worker_p99["Threshold"] < worker["Timeout"] * 1000
    [executions] = [
        a["Properties"]
        for a in resources(template, "AWS::CloudWatch::Alarm").values()
        if "FILL(timed_out, 0)" in json.dumps(a["Properties"].get("Metrics", []))
    ]
    names = {m["MetricStat"]["Metric"]["MetricName"] for m in executions["Metrics"] if "MetricStat" in m}
    assert names == {"ExecutionsFailed", "ExecutionsTimedOut", "ExecutionsAborted"}
