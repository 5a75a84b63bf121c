"""SageMaker notebook instances end to end: moto's SageMaker (with SageMaker's real refusals in front of it),
CloudWatch as the lifecycle configuration's agent publishes, the real slack-sdk against the local Slack fake."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from idle_reaper import aws
from idle_reaper.core import State
from idle_reaper.handlers import slack as slack_handler
from idle_reaper.policy import Settings
from idle_reaper.sweep import run_sweep
from idle_reaper_tools import local
from idle_reaper_tools.demo import adapters_at, at
from idle_reaper_tools.fake_slack import LambdaContextStub, button_click

pytestmark = pytest.mark.integration

T0 = at(14)
_clicks = itertools.count()


def idle(_t):
    return (1.0, 0.0)


def gpu_busy(_t):
    return (2.0, 95.0)


@pytest.fixture
def sagemaker_as_aws() -> Iterator[list[str]]:
    """SageMaker's answers where moto is lax: StopNotebookInstance only InService, StartNotebookInstance only
    Stopped or Failed (ValidationException otherwise). Yields the names each refused call named."""
    refused: list[str] = []
    allowed = {"StopNotebookInstance": ("InService",), "StartNotebookInstance": ("Stopped", "Failed")}

    def check(params: dict[str, Any], model: Any, **_: Any) -> None:
        name = params["NotebookInstanceName"]
        status = local.notebook_statuses([name])[name]
        if status not in allowed[model.name]:
            refused.append(name)
            message = f"Status ({status}) not in ({allowed[model.name]}). Unable to {model.name} ({name})"
            raise ClientError({"Error": {"Code": "ValidationException", "Message": message}}, model.name)

    events = boto3._get_default_session().events
    for operation in allowed:
        events.register(f"before-parameter-build.sagemaker.{operation}", check, unique_id=f"real-{operation}")
    yield refused
    for operation in allowed:
        events.unregister(f"before-parameter-build.sagemaker.{operation}", unique_id=f"real-{operation}")


@pytest.fixture
def aws_server(aws):  # the `aws` fixture: a clean emulated account (the name `aws` is the adapters here)
    return aws


@pytest.fixture
def team(aws_server, slack, sagemaker_as_aws):
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    ssm = aws.client("ssm")
    settings = json.loads(ssm.get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"])
    settings["admins"] = ["U0ADMIN"]
    ssm.put_parameter(Name="/idle-reaper/settings", Value=json.dumps(settings), Type="String", Overwrite=True)
    return sagemaker_as_aws


def notebook(name: str, profile=idle, instance_type: str = "ml.p3.2xlarge", **kw: Any) -> str:
    local.launch_notebook(name, instance_type, team="ml", launch_time=at(8), owner="U0BOB", **kw)
    if profile is not None:
        local.write_metrics(name, profile, at(11), at(23), notebook=True)
    return name


def sweep(now):
    return {d.machine.instance_id: d for d in run_sweep(adapters_at(now), now=now).decisions}


def record(name):
    return aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).load([name])[name]


def click(slack, action_id: str, value: str) -> dict:
    name = f"click-{next(_clicks)}"
    event = button_click("U0BOB", action_id, value, slack.response_url(name))
    response = slack_handler.handler(event, LambdaContextStub())
    assert response["statusCode"] == 200 and response["body"] == "", response
    return response


def warning_ref(slack) -> str:
    post = [c for c in slack.calls_to("chat.postMessage") if "blocks" in c.params][-1]
    return next(b for b in post.params["blocks"] if b["type"] == "actions")["elements"][0]["value"]


def admin_notes(slack) -> list[str]:
    return [c.params["text"] for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0ADMIN"]


def test_idle_notebook_warned_kept_stopped_and_started_again_from_slack(team, slack, clock):
    idle_one = notebook("idle-nb")
    gpu = notebook("gpu-training", gpu_busy)
    dark = notebook("no-agent", None)
    broken = notebook("attached-silent", None, lifecycle_config="idle-reaper-notebook-agent")
    foreign = notebook("other-config", None, lifecycle_config="team-autostop")
    notebook("other-team-nb", managed=False)  # no opt-in tag: never listed

    decisions = sweep(T0)
    assert set(decisions) == {idle_one, gpu, dark, broken, foreign}
    assert decisions[idle_one].action_label == "warn" and decisions[idle_one].kind.kind.value == "notebook"
    (warning,) = [c for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0BOB"]
    text = json.dumps(warning.params["blocks"])
    assert "idle-nb" in text and "ml.p3.2xlarge" in text and "$3.83 per hour" in text
    assert decisions[gpu].signal == "busy" and decisions[gpu].action_label == "none"
    assert decisions[dark].signal == "unknown" and decisions[dark].action_label == "none"
    assert "idle-reaper-notebook-agent" in record(dark).reason and "$3.83/h" in record(dark).reason
    assert "attached but nothing arrives" in record(broken).reason and "PutMetricData" in record(broken).reason
    assert "its lifecycle configuration is team-autostop, not this deployment's" in record(foreign).reason
    assert all(decisions[n].action_label == "none" for n in (broken, foreign))
    (note,) = admin_notes(slack)
    no_data, _, partial = note.partition("publish only part of their data")
    assert "no-agent (ml.p3.2xlarge, team ml, $3.83/h)" in no_data and "idle-nb" not in no_data
    assert "other-config (ml.p3.2xlarge, team ml, $3.83/h, lifecycle configuration team-autostop)" in no_data
    # CPU and GPU arrive, the activity collector's data does not (it never ran here): said, with the bucket's key.
    assert "idle-nb (ml.p3.2xlarge, team ml, $3.83/h: activity missing)" in partial and "no-agent" not in partial
    assert "s3:GetObject" in partial and "notebook-agent/idle_reaper_activity.py" in partial
    assert "s3:GetObject" not in record(idle_one).reason, "the owner's messages carry no admin chores"
    sweep(T0 + timedelta(minutes=5))
    assert len(admin_notes(slack)) == 1, "the admins hear of notebook instances without data once a day"

    click(slack, "keep_2h", warning_ref(slack))
    assert record(idle_one).state is State.SNOOZED
    assert sweep(T0 + timedelta(hours=1))[idle_one].action_label == "none"
    assert local.notebook_statuses([idle_one])[idle_one] == "InService"

    assert sweep(T0 + timedelta(hours=2))[idle_one].action_label == "warn"
    final = sweep(T0 + timedelta(hours=2, minutes=20))
    assert final[idle_one].action_label == "stop" and final[idle_one].error is None
    statuses = local.notebook_statuses([idle_one, gpu, dark])
    assert statuses == {idle_one: "Stopped", gpu: "InService", dark: "InService"}
    stopped = record(idle_one)
    assert stopped.state is State.REAPED and stopped.last_action == "stop"
    update = slack.calls_to("chat.update")[-1].params
    start = next(b for b in update["blocks"] if b["type"] == "actions")["elements"][0]
    assert start["action_id"] == "start_again"

    clock["t"] = T0 + timedelta(hours=4)
    click(slack, "start_again", start["value"])
    assert local.notebook_statuses([idle_one])[idle_one] == "InService"
    assert record(idle_one).state is State.ACTIVE
    assert not team, "SageMaker refused nothing: every call was made in a state it accepts"


def test_a_second_deployment_knows_its_own_lifecycle_configuration_from_its_prefix(
    aws_server, slack, sagemaker_as_aws, monkeypatch
):
    """A staging stack (prefix idle-reaper-staging: its table and parameters say so) ships
    idle-reaper-staging-notebook-agent; the default stack's configuration is another one to it."""
    monkeypatch.setenv("IDLE_REAPER_TABLE", "idle-reaper-staging-state")
    monkeypatch.setenv("IDLE_REAPER_SSM_PREFIX", "/idle-reaper-staging")
    local.init_account(
        Settings(admins=("U0ADMIN",)), teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)}
    )
    ours = notebook("staging-silent", None, lifecycle_config="idle-reaper-staging-notebook-agent")
    theirs = notebook("default-config", None, lifecycle_config="idle-reaper-notebook-agent")

    decisions = sweep(T0)
    assert all(decisions[n].action_label == "none" and decisions[n].signal == "unknown" for n in (ours, theirs))
    assert "idle-reaper-staging-notebook-agent is attached but nothing arrives" in record(ours).reason
    assert (
        "its lifecycle configuration is idle-reaper-notebook-agent, not this deployment's: attach the lifecycle "
        "configuration idle-reaper-staging-notebook-agent"
    ) in record(theirs).reason
    (note,) = admin_notes(slack)
    assert "--lifecycle-config-name idle-reaper-staging-notebook-agent`" in note
    assert "--lifecycle-config-name idle-reaper-notebook-agent`" not in note


def test_a_person_at_the_keyboard_keeps_a_notebook_busy(team, slack):
    policy = local.team_policy_json(idle_minutes=60, warn_minutes=20, human_active_minutes=30)
    aws.client("ssm").put_parameter(Name="/idle-reaper/teams/ml", Value=policy, Type="String", Overwrite=True)
    name = notebook("typing", instance_type="ml.t3.medium")
    cloudwatch = aws.client("cloudwatch")
    dims = [{"Name": "InstanceId", "Value": name}]
    data = [
        {
            "MetricName": "idle_reaper_minutes_since_input",
            "Dimensions": dims,
            "Timestamp": T0 - timedelta(minutes=m),
            "Value": 1.0,
        }
        for m in range(0, 120, 1)
    ]
    for i in range(0, len(data), 1000):
        cloudwatch.put_metric_data(Namespace="CWAgent", MetricData=data[i : i + 1000])
    d = sweep(T0)[name]
    assert d.signal == "busy" and d.action_label == "none", d.reason
    assert not slack.calls_to("chat.postMessage")


def test_a_notebook_not_in_service_is_held_and_a_refused_stop_is_recorded_and_retried(team, slack):
    updating = notebook("updating")
    local.set_notebook_status(updating, "Updating")
    racing = notebook("racing")
    decisions = sweep(T0)
    assert decisions[updating].action_label == "none" and "Updating, not InService" in decisions[updating].reason
    assert decisions[racing].action_label == "warn"

    # Between the warning and the stop the notebook began updating, after the sweep listed it InService.
    real_discover = aws.NotebookInstances.discover

    def racing_update(self, tags, names=None):
        found = real_discover(self, tags, names)
        if names is None:
            local.set_notebook_status(racing, "Updating")
        return found

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aws.NotebookInstances, "discover", racing_update)
        mp.setattr(aws.Fleet, "still_as_listed", lambda self, machines, tags: {m.instance_id for m in machines})
        d = sweep(T0 + timedelta(minutes=20))[racing]
    assert d.error and "ValidationException" in d.error
    assert team == [racing], "only the refused notebook was asked; nothing else was stopped"
    assert local.notebook_statuses([racing, updating]) == {racing: "Updating", updating: "Updating"}
    assert record(racing).state is not State.REAPED

    local.set_notebook_status(racing, "InService")
    assert sweep(T0 + timedelta(minutes=25))[racing].action_label == "stop"
    assert local.notebook_statuses([racing])[racing] == "Stopped"


def test_notebooks_that_cannot_be_listed_are_left_out_loudly_and_ec2_is_swept(team, slack):
    notebook("idle-nb")
    instance_id = local.launch("box", "m5.large", team="ml", launch_time=at(8), owner="U0BOB")
    local.write_metrics(instance_id, lambda _t: (1.0, None), at(11), at(23))

    def denied(**_: Any) -> None:
        error = {
            "Code": "AccessDeniedException",
            "Message": "not authorized to perform sagemaker:ListNotebookInstances",
        }
        raise ClientError({"Error": error}, "ListNotebookInstances")

    events = boto3._get_default_session().events
    events.register("before-parameter-build.sagemaker.ListNotebookInstances", denied, unique_id="deny-list")
    try:
        report = run_sweep(adapters_at(T0), now=T0)
    finally:
        events.unregister("before-parameter-build.sagemaker.ListNotebookInstances", unique_id="deny-list")
    assert [d.machine.instance_id for d in report.decisions] == [instance_id]
    assert report.decisions[0].action_label == "warn"
    assert any("could not list SageMaker notebook instances (AccessDeniedException" in w for w in report.warnings)
    (note,) = admin_notes(slack)
    assert "sagemaker:ListNotebookInstances" in note and local.notebook_statuses(["idle-nb"]) == {
        "idle-nb": "InService"
    }


def test_status_lists_a_notebook_without_data_with_its_cost_and_how_to_attach(team, slack, capsys):
    from idle_reaper_tools import cli

    dark = notebook("no-agent", None)
    without_collector = notebook("cpu-and-gpu-only")
    run_sweep(adapters_at(T0), now=T0)
    # A notebook instance no sweep has seen yet is listed too: status discovers as the sweep does.
    fresh = notebook("not-swept-yet", None, instance_type="ml.t3.medium")
    capsys.readouterr()
    assert cli.main(["status", "--json", "--now", T0.isoformat()]) == 0
    rows = {r["instance_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    row = rows[dark]
    assert row["kind"] == "notebook" and row["stop_saves"] == "$3.83/h"
    assert "update-notebook-instance --notebook-instance-name NAME" in row["reason"]
    assert (rows[fresh]["state"], rows[fresh]["stop_saves"]) == ("new", "$0.05/h")
    # Publishing CPU and GPU, not the collector's data: status says where the collector comes from.
    said = rows[without_collector]["human_signal"]
    assert said.startswith("no collector") and "s3:GetObject" in said and "NotebookAgentObject" in said


def put_network(name: str, bytes_per_second: float, *, end=T0) -> None:
    """What the lifecycle configuration's agent publishes (`net`: each interval's bytes, by the notebook's name)."""
    dims = [{"Name": "InstanceId", "Value": name}]
    data = []
    t = at(11)
    while t <= end:
        for metric in ("net_bytes_recv", "net_bytes_sent"):
            data.append({"MetricName": metric, "Dimensions": dims, "Timestamp": t, "Value": bytes_per_second * 300})
        t += timedelta(minutes=5)
    cloudwatch = aws.client("cloudwatch")
    for i in range(0, len(data), 1000):
        cloudwatch.put_metric_data(Namespace="CWAgent", MetricData=data[i : i + 1000])


def test_a_network_threshold_reads_the_notebooks_agent_busy_on_network_alone_is_never_stopped(team, slack):
    policy = local.team_policy_json(idle_minutes=60, warn_minutes=20, network_threshold_bytes_per_second=50_000)
    aws.client("ssm").put_parameter(Name="/idle-reaper/teams/ml", Value=policy, Type="String", Overwrite=True)
    downloading = notebook("downloading", instance_type="ml.t3.medium")  # 1 % CPU, no GPU
    quiet = notebook("quiet", instance_type="ml.t3.medium")
    silent = notebook("no-network-data", instance_type="ml.t3.medium")
    put_network(downloading, 2_000_000, end=T0 + timedelta(hours=3))
    put_network(quiet, 100, end=T0 + timedelta(hours=3))
    decisions = sweep(T0)
    assert decisions[downloading].signal == "busy" and "network" in decisions[downloading].reason
    assert decisions[quiet].action_label == "warn", "the agent's network is read: a quiet notebook is idle"
    assert decisions[silent].signal == "unknown" and decisions[silent].action_label == "none"
    assert "no network data" in record(silent).reason and "no network data" not in record(quiet).reason
    (note,) = admin_notes(slack)
    assert "no-network-data (ml.t3.medium, team ml, $0.05/h: network, activity missing)" in note
    assert "quiet (ml.t3.medium, team ml, $0.05/h: activity missing)" in note
    for minutes in (30, 90, 180):
        later = sweep(T0 + timedelta(minutes=minutes))
        assert later[downloading].action_label == "none" and later[silent].action_label == "none"
    assert local.notebook_statuses([downloading, silent]) == {downloading: "InService", silent: "InService"}
    assert local.notebook_statuses([quiet]) == {quiet: "Stopped"}
