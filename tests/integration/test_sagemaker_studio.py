"""SageMaker Studio apps end to end (issue 46): a team whose policy says `studio_apps: delete` has an idle app
warned, kept, deleted (its space kept) and started again from Slack. Studio's spaces and apps are the local world's
(local_studio.py: moto has none), SageMaker's refusals in front of them (aws_rules_sagemaker.py); the fixtures and
helpers are the endpoints' (test_sagemaker_endpoints.py)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from botocore.exceptions import ClientError
from test_sagemaker_endpoints import T0, button, click, last_update, sweep

from idle_reaper import aws
from idle_reaper.core import State
from idle_reaper.core.studio import AppRestore, studio_parts
from idle_reaper_tools import local, local_studio
from idle_reaper_tools.demo import at

pytestmark = pytest.mark.integration


@pytest.fixture
def team(aws, slack):
    acting = local.team_policy_json(idle_minutes=60, warn_minutes=20, studio_apps="delete")
    local.init_account(teams={"ml": acting, "lab": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    return aws.rules


def app(space: str, gpu: float | None = 0.0, *, metrics: bool = True, **kw) -> str:
    kw.setdefault("team", "ml")
    machine_id = local_studio.launch_studio_app(space, launch_time=at(6), owner="U0BOB", **kw)
    if metrics:  # what a lifecycle configuration's CloudWatch agent publishes, by InstanceId = the app's id
        local.write_metrics(machine_id, lambda _t: (1.0, gpu), at(9), at(23), notebook=True)
    return machine_id


def record(machine_id):
    return aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).load([machine_id])[machine_id]


def test_idle_studio_app_warned_kept_deleted_and_started_again_from_slack(team, slack, clock):
    idle = app("idle-space")
    busy = app("busy-space", 85.0)
    dark = app("dark-space", metrics=False)  # no CloudWatch data: unknown
    private = app("private-space", managed=False)  # no opt-in tag on its space: never listed
    reported = app("lab-space", team="lab")  # its team's policy reports Studio apps (the default)
    studios = app("short-space", idle_shutdown_minutes=60)  # Studio's own idle shutdown ends it within the window

    decisions = sweep(T0)
    assert set(decisions) & {private, reported, studios} == set()
    d = decisions[idle]
    assert (d.action_label, d.kind.kind.value, d.hourly_cost) == ("warn", "studio-app", 0.7364)
    assert decisions[busy].signal == "busy" and decisions[busy].action_label == "none"
    assert decisions[dark].signal == "unknown" and decisions[dark].action_label == "none"
    warnings = [c.params for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0BOB"]
    text = json.dumps(warnings)
    assert "Idle Studio app: idle-space" in text and "$0.74 per hour" in text and "Delete now" in text
    assert "space and the space's storage are kept" in text
    assert all(s not in text for s in ("busy-space", "dark-space", "private-space", "lab-space", "short-space"))
    # DescribeApp's LastUserActivityTimestamp is fresh for every running app (health checks update it): it is no
    # person signal, so it neither kept the idle app from its warning nor made the app without metrics busy.
    domain, space, app_type, name = studio_parts(idle)
    described = aws.client("sagemaker").describe_app(DomainId=domain, SpaceName=space, AppType=app_type, AppName=name)
    assert described["LastUserActivityTimestamp"] == described["LastHealthCheckTimestamp"]
    ref = button(next(w["blocks"] for w in warnings if "idle-space" in json.dumps(w)), "keep_2h")["value"]

    click(slack, "keep_2h", ref)
    assert record(idle).state is State.SNOOZED
    assert sweep(T0 + timedelta(hours=1))[idle].action_label == "none"
    assert sweep(T0 + timedelta(hours=2))[idle].action_label == "warn"
    final = sweep(T0 + timedelta(hours=2, minutes=20))[idle]
    assert final.action_label == "stop" and final.error is None
    others = [busy, dark, private, reported, studios]
    assert local_studio.app_statuses([idle, *others]) == {idle: "Deleted", **{m: "InService" for m in others}}
    sagemaker = aws.client("sagemaker")
    assert sagemaker.describe_space(DomainId=domain, SpaceName=space)["SpaceName"] == space  # the space stays
    restore = AppRestore.parse(record(idle).endpoint)
    assert record(idle).state is State.REAPED and restore is not None
    assert (restore.app_type, restore.app_name, restore.instance_type) == (app_type, name, "ml.g4dn.xlarge")
    notice = json.dumps(last_update(slack))
    assert "Deleted" in notice and f"create-app --domain-id {domain} --space-name idle-space" in notice
    start = button(last_update(slack)["blocks"], "start_again")
    assert start["text"]["text"] == "Start it again"

    # The account's quota of JupyterLab apps on ml.g4dn.xlarge is spent (the five others hold one each).
    team.studio_quotas[("JupyterLab", "ml.g4dn.xlarge")] = 5
    clock["t"] = T0 + timedelta(hours=4)
    reply = click(slack, "start_again", start["value"])
    assert "was not started again" in reply and "ResourceLimitExceeded" in reply and "Studio apps" in reply
    assert local_studio.app_statuses([idle]) == {idle: "Deleted"} and record(idle).state is State.REAPED
    again = button(last_update(slack)["blocks"], "start_again")
    assert again["text"]["text"] == "Try again"

    team.studio_quotas[("JupyterLab", "ml.g4dn.xlarge")] = 6
    assert click(slack, "start_again", again["value"]) == ""
    assert local_studio.app_statuses([idle]) == {idle: "Pending"}
    assert AppRestore.parse(record(idle).endpoint).pending_by == "U0BOB"
    assert "Being started again" in json.dumps(last_update(slack)["blocks"])
    # SageMaker's refusals: no deletion while Studio starts it, no second app in its space.
    for call, code in (("delete_app", "ResourceInUse"), ("create_app", "ResourceInUse")):
        with pytest.raises(ClientError) as err:
            getattr(sagemaker, call)(DomainId=domain, SpaceName=space, AppType=app_type, AppName=name)
        assert err.value.response["Error"]["Code"] == code
    arn = sagemaker.describe_app(DomainId=domain, SpaceName=space, AppType=app_type, AppName=name)["AppArn"]
    assert {t["Key"]: t["Value"] for t in sagemaker.list_tags(ResourceArn=arn)["Tags"]} == {
        "Team": "ml",
        "Owner": "U0BOB",
        "idle-reaper:managed": "true",
    }

    # The next sweep finds it InService: its message says so, once.
    local_studio.set_app(idle, created=T0 + timedelta(hours=4))
    sweep(T0 + timedelta(hours=4, minutes=10))
    told = json.dumps(last_update(slack)["blocks"])
    assert "Running again" in told and "is InService since" in told
    assert AppRestore.parse(record(idle).endpoint).pending_by is None
    updates = len(slack.calls_to("chat.update"))
    sweep(T0 + timedelta(hours=4, minutes=15))
    assert len(slack.calls_to("chat.update")) == updates


def test_the_doctor_warns_where_a_swept_app_would_never_be_deleted(team):
    """The local domain propagates no tags and runs no lifecycle configuration of ours; one app publishes nothing in
    the doctor's last hour (the wall clock's: the CLI's doctor reads the hour before now)."""
    from datetime import UTC, datetime

    from idle_reaper_tools.doctor import run_checks

    lit = app("doctor-lit", metrics=False)
    now = datetime.now(UTC)
    local.write_metrics(lit, lambda _t: (1.0, 0.0), now - timedelta(minutes=50), now, notebook=True)
    dark = app("doctor-dark", metrics=False)
    app("doctor-lab", team="lab", metrics=False)  # its team only reports Studio apps: not the doctor's concern
    found = {f.check: f for f in run_checks() if f.check.startswith("studio")}
    domain = local_studio.studio_domain()
    assert (found["studio.tags"].status, found["studio.tags"].subjects) == ("fail", (domain,))
    assert (found["studio.lifecycle"].status, found["studio.lifecycle"].subjects) == ("fail", (domain,))
    assert (found["studio.signals"].status, found["studio.signals"].subjects) == ("warn", (dark,))


def test_studio_apps_that_cannot_be_listed_are_not_swept_and_the_admins_hear_it_once_a_day(team, slack):
    import boto3

    from idle_reaper.sweep import run_sweep
    from idle_reaper_tools.demo import adapters_at

    idle = app("unlisted-space")
    ssm = aws.client("ssm")
    settings = json.loads(ssm.get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"])
    ssm.put_parameter(
        Name="/idle-reaper/settings",
        Value=json.dumps({**settings, "admins": ["U0ADMIN"]}),
        Type="String",
        Overwrite=True,
    )

    def denied(**_):
        error = {"Code": "AccessDeniedException", "Message": "not authorized to perform sagemaker:ListApps"}
        raise ClientError({"Error": error}, "ListApps")

    def notes():
        return [
            c.params["text"]
            for c in slack.calls_to("chat.postMessage")
            if "could not list SageMaker Studio" in json.dumps(c.params)
        ]

    events = boto3._get_default_session().events
    events.register("before-parameter-build.sagemaker.ListApps", denied, unique_id="deny-apps")
    try:
        first = run_sweep(adapters_at(T0), now=T0)
        second = run_sweep(adapters_at(T0 + timedelta(minutes=5)), now=T0 + timedelta(minutes=5))
    finally:
        events.unregister("before-parameter-build.sagemaker.ListApps", unique_id="deny-apps")
    for report in (first, second):
        assert idle not in {d.machine.instance_id for d in report.decisions}
        assert any("could not list SageMaker Studio apps (AccessDeniedException" in w for w in report.warnings)
    (note,) = notes()
    assert "sagemaker:ListApps" in note, "told once a day, not at every sweep"
    assert local_studio.app_statuses([idle]) == {idle: "InService"}


def test_an_app_started_again_that_fails_is_told_once_with_try_again(team, slack, clock):
    idle = app("failing-space")
    assert sweep(T0)[idle].action_label == "warn"
    assert sweep(T0 + timedelta(minutes=20))[idle].action_label == "stop"
    clock["t"] = T0 + timedelta(hours=1)
    assert click(slack, "start_again", button(last_update(slack)["blocks"], "start_again")["value"]) == ""
    assert AppRestore.parse(record(idle).endpoint).pending_by == "U0BOB"
    # Studio took CreateApp and then could not start the app.
    local_studio.fail_app(idle, "InsufficientCapacityError: no ml.g4dn.xlarge capacity in the Availability Zone")

    sweep(T0 + timedelta(hours=1, minutes=10))
    told = json.dumps(last_update(slack)["blocks"])
    assert "Not started again" in told and "space's storage are kept" in told
    assert "/aws/sagemaker/studio" in told, "where Studio says why (ListApps does not)"
    kept = AppRestore.parse(record(idle).endpoint)
    assert kept.pending_by is None and "/aws/sagemaker/studio" in kept.failed
    assert record(idle).state is State.REAPED and "could not start it" in record(idle).reason
    assert local_studio.app_statuses([idle]) == {idle: "Deleted"}, "the failed app deleted: Try again creates it"
    updates = len(slack.calls_to("chat.update"))
    sweep(T0 + timedelta(hours=1, minutes=15))
    assert len(slack.calls_to("chat.update")) == updates, "told once"

    again = button(last_update(slack)["blocks"], "start_again")
    assert again["text"]["text"] == "Try again"
    clock["t"] = T0 + timedelta(hours=2)
    assert click(slack, "start_again", again["value"]) == ""
    assert local_studio.app_statuses([idle]) == {idle: "Pending"}
    retried = AppRestore.parse(record(idle).endpoint)
    assert (retried.pending_by, retried.failed) == ("U0BOB", None)
