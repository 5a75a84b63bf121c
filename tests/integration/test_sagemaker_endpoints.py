"""SageMaker real-time endpoints end to end (issue 46): moto's SageMaker, Application Auto Scaling and CloudWatch
with SageMaker's refusals in front of them (tools/idle_reaper_tools/aws_rules_sagemaker.py), the real slack-sdk
against the local Slack fake, the Slack handler answering the buttons."""

from __future__ import annotations

import itertools
import json
import urllib.parse
from datetime import timedelta

import pytest
from botocore.exceptions import ClientError

from idle_reaper import aws
from idle_reaper.core import State
from idle_reaper.core.endpoints import Restore
from idle_reaper.handlers import slack as slack_handler
from idle_reaper.sweep import run_sweep
from idle_reaper_tools import local
from idle_reaper_tools.demo import adapters_at, at
from idle_reaper_tools.fake_slack import LambdaContextStub, button_click, signed_request

pytestmark = pytest.mark.integration

T0 = at(14)
_clicks = itertools.count()


@pytest.fixture
def team(aws, slack):
    policy = local.team_policy_json(idle_minutes=60, warn_minutes=20, endpoint_idle_minutes=120, members=["U0MEMBER"])
    local.init_account(teams={"ml": policy})
    return aws.rules


def endpoint(name: str, requests=lambda _t: 0.0, *, heartbeat: bool = True, **kw) -> str:
    local.launch_endpoint(name, team="ml", launch_time=at(6), owner="U0BOB", **kw)
    if heartbeat:
        local.write_invocations(name, requests, at(9), at(23))
    return name


def sweep(now):
    return {d.machine.instance_id: d for d in run_sweep(adapters_at(now), now=now).decisions}


def record(name):
    key = f"endpoint:{name}"
    return aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).load([key])[key]


def click(slack, action_id: str, value: str) -> str:
    """A button pressed by its owner; the ephemeral reply, if any."""
    name = f"click-{next(_clicks)}"
    event = button_click("U0BOB", action_id, value, slack.response_url(name))
    response = slack_handler.handler(event, LambdaContextStub())
    assert response["statusCode"] == 200, response
    return " ".join(r.get("text", "") for r in slack.replies_to(name))


def command(slack, user: str, text: str) -> str:
    """`/idle-reaper <text>` typed by `user`: its ephemeral answer."""
    name = f"command-{next(_clicks)}"
    form = {"command": "/idle-reaper", "text": text, "user_id": user, "response_url": slack.response_url(name)}
    response = slack_handler.handler(
        signed_request("/slack/commands", urllib.parse.urlencode(form), "local-signing-secret"), LambdaContextStub()
    )
    assert response["statusCode"] == 200, response
    said = [json.loads(response["body"])["text"]] if response["body"] else []
    return " ".join(said + [r.get("text", "") for r in slack.replies_to(name)])


def button(blocks, action_id: str) -> dict:
    return next(e for b in blocks if b["type"] == "actions" for e in b["elements"] if e["action_id"] == action_id)


def last_update(slack) -> dict:
    return slack.calls_to("chat.update")[-1].params


def test_idle_endpoint_warned_kept_deleted_and_brought_back_from_slack(team, slack, clock):
    idle = endpoint("idle-ep")
    busy = endpoint("busy-ep", lambda _t: 12.0)
    dark = endpoint("dark-ep", heartbeat=False)  # SageMaker published nothing for it: unknown
    private = endpoint("private-ep", managed=False)  # no opt-in tag: never listed, never touched
    serverless = endpoint("serverless-ep", serverless=True)
    scaled = endpoint("scaled-ep")
    aws.client("application-autoscaling").register_scalable_target(
        ServiceNamespace="sagemaker",
        ResourceId="endpoint/scaled-ep/variant/AllTraffic",
        ScalableDimension="sagemaker:variant:DesiredInstanceCount",
        MinCapacity=0,
        MaxCapacity=2,
    )

    decisions = sweep(T0)
    assert set(decisions) == {f"endpoint:{n}" for n in (idle, busy, dark, serverless, scaled)}
    d = decisions[f"endpoint:{idle}"]
    assert (d.action_label, d.kind.kind.value, d.hourly_cost) == ("warn", "endpoint", 0.7364)
    assert decisions[f"endpoint:{busy}"].signal == "busy" and decisions[f"endpoint:{busy}"].action_label == "none"
    assert (
        decisions[f"endpoint:{dark}"].signal == "unknown"
        and "no metrics from variant" in decisions[f"endpoint:{dark}"].reason
    )
    for reported in (serverless, scaled):
        assert decisions[f"endpoint:{reported}"].kind.kind.value == "endpoint-scales-to-zero"
    warnings = [c.params for c in slack.calls_to("chat.postMessage") if c.params["channel"] == "D0BOB"]
    text = json.dumps(warnings)
    assert "Idle endpoint: idle-ep" in text and "$0.74 per hour" in text and "Delete now" in text
    assert "endpoint configuration idle-ep-config, model and tags are kept" in text
    assert "serverless variant AllTraffic" in text and "does not delete it" in text
    assert "busy-ep" not in text and "dark-ep" not in text and "private-ep" not in text
    assert button(next(w["blocks"] for w in warnings if "Idle endpoint: idle-ep" in json.dumps(w)), "keep_2h")

    # `/idle-reaper keep` by name: the owner's own by its name; anyone's (who may answer for it) by endpoint:<name>.
    assert "can't change idle-ep" in command(slack, "U0STRANGER", "keep endpoint:idle-ep 2h")
    assert "among yours" in command(slack, "U0MEMBER", "keep idle-ep 2h")  # names are looked up among one's own
    unknown = command(slack, "U0BOB", "keep nosuch-ep 2h")
    assert "No machine, endpoint or Studio app named `nosuch-ep`" in unknown and "endpoint:<name>" in unknown
    assert record(idle).state is State.WARNED  # nothing changed
    assert command(slack, "U0MEMBER", "keep endpoint:idle-ep 1h").startswith("Kept idle-ep (endpoint:idle-ep) until")
    assert (record(idle).state, record(idle).snoozed_by) == (State.SNOOZED, "U0MEMBER")
    assert command(slack, "U0BOB", "keep idle-ep 2h").startswith("Kept idle-ep (endpoint:idle-ep) until")
    assert (record(idle).snoozed_until, record(idle).snoozed_by) == (T0 + timedelta(hours=2), "U0BOB")
    assert sweep(T0 + timedelta(hours=1))[f"endpoint:{idle}"].action_label == "none"
    assert sweep(T0 + timedelta(hours=2))[f"endpoint:{idle}"].action_label == "warn"
    final = sweep(T0 + timedelta(hours=2, minutes=20))
    assert final[f"endpoint:{idle}"].action_label == "stop" and final[f"endpoint:{idle}"].error is None
    names = [idle, busy, dark, private, serverless, scaled]
    assert local.endpoint_statuses(names) == {n: (None if n == idle else "InService") for n in names}
    sagemaker = aws.client("sagemaker")
    assert sagemaker.describe_endpoint_config(EndpointConfigName="idle-ep-config")["ProductionVariants"]
    assert sagemaker.describe_model(ModelName="idle-ep-model")["ModelName"] == "idle-ep-model"
    deleted = record(idle)
    assert deleted.state is State.REAPED and Restore.parse(deleted.endpoint).config == "idle-ep-config"
    notice = last_update(slack)
    assert "Deleted" in json.dumps(notice["blocks"]) and "create-endpoint --endpoint-name idle-ep" in json.dumps(notice)
    back = button(notice["blocks"], "start_again")
    assert back["text"]["text"] == "Bring it back"
    assert "Not kept: the endpoint is already deleted" in command(slack, "U0BOB", "keep idle-ep 1h")
    # `/idle-reaper status` in Slack: the endpoints in a section of their own, as the CLI's, with cost and state.
    status = command(slack, "U0BOB", "status")
    assert "*Endpoints* (" in status and "*Machines*" not in status  # bob owns endpoints alone here
    assert "• idle-ep (endpoint:idle-ep) · ml · ml.g4dn.xlarge, $0.74/h · *deleted since " in status
    assert "restorable: Bring it back recreates it*" in status

    # The account's quota of ml.g5.2xlarge for endpoint usage is spent: said, still deleted, Try again offered.
    team.sagemaker_quotas["ml.g4dn.xlarge"] = 4  # busy, dark, private and scaled hold one each
    clock["t"] = T0 + timedelta(hours=4)
    reply = click(slack, "start_again", back["value"])
    assert "was not brought back" in reply and "ResourceLimitExceeded" in reply
    assert team.refused[("CreateEndpoint", "ResourceLimitExceeded")] == 1
    assert local.endpoint_statuses([idle]) == {idle: None} and record(idle).state is State.REAPED
    again = button(last_update(slack)["blocks"], "start_again")
    assert again["text"]["text"] == "Try again"

    team.sagemaker_quotas["ml.g4dn.xlarge"] = 5
    assert click(slack, "start_again", again["value"]) == ""
    assert local.endpoint_statuses([idle]) == {idle: "InService"}
    arn = sagemaker.describe_endpoint(EndpointName=idle)["EndpointArn"]
    tags = {t["Key"]: t["Value"] for t in sagemaker.list_tags(ResourceArn=arn)["Tags"]}
    assert tags == {"Team": "ml", "Owner": "U0BOB", "idle-reaper:managed": "true"}
    assert Restore.parse(record(idle).endpoint).pending_by == "U0BOB"
    assert "Being brought back" in json.dumps(last_update(slack)["blocks"])

    # SageMaker took the request, then could not create it (Failed): the next sweep says so once, with its reason,
    # deletes the failed endpoint (SageMaker creates no endpoint under a name that exists) and offers Try again.
    full = "Unable to provision requested ML compute capacity. Please retry using a different ML instance type."
    local.set_endpoint(idle, status="Failed", failure=full)
    sweep(T0 + timedelta(hours=4, minutes=5))
    failed = last_update(slack)
    assert "Not brought back" in json.dumps(failed["blocks"]) and "Unable to provision requested ML" in failed["text"]
    assert local.endpoint_statuses([idle]) == {idle: None} and team.calls["DeleteEndpoint"] == 2
    after = record(idle)
    kept = Restore.parse(after.endpoint)
    assert after.state is State.REAPED and (kept.failed, kept.pending_by, kept.config) == (full, None, "idle-ep-config")
    assert "SageMaker could not create it" in after.reason and after.last_action == "stop"
    retry = button(failed["blocks"], "start_again")
    assert retry["text"]["text"] == "Try again"
    assert click(slack, "start_again", retry["value"]) == ""
    assert local.endpoint_statuses([idle]) == {idle: "InService"}
    assert Restore.parse(record(idle).endpoint).failed is None

    # The next sweep finds it InService: its message says so, once.
    local.set_endpoint(idle, launch_time=T0 + timedelta(hours=4))
    sweep(T0 + timedelta(hours=4, minutes=10))
    told = json.dumps(last_update(slack)["blocks"])
    assert "Back in service" in told and "InService again" in told
    assert Restore.parse(record(idle).endpoint).pending_by is None
    updates = len(slack.calls_to("chat.update"))
    sweep(T0 + timedelta(hours=4, minutes=15))
    assert len(slack.calls_to("chat.update")) == updates
    told_failed = [c for c in slack.calls_to("chat.update") if "Not brought back" in json.dumps(c.params["blocks"])]
    assert len(told_failed) == 2  # the quota's refusal at the click, and the failure the sweep found: each once


def test_what_cannot_be_brought_back_is_never_deleted_and_sagemakers_refusals_are_kept(team, slack, clock):
    orphan = endpoint("orphan-ep")
    aws.client("sagemaker").delete_model(ModelName="orphan-ep-model")
    gone_later = endpoint("later-ep")

    decisions = sweep(T0)
    d = decisions[f"endpoint:{orphan}"]
    assert d.kind.kind.value == "endpoint-not-restorable" and d.action_label == "warn"
    text = next(t for c in slack.calls_to("chat.postMessage") if "orphan-ep" in (t := json.dumps(c.params)))
    assert "model orphan-ep-model is gone" in text and "does not delete it" in text and "Delete now" not in text
    final = sweep(T0 + timedelta(minutes=20))  # past the window, and the warning's time to answer
    assert final[f"endpoint:{orphan}"].action_label == "none"
    assert final[f"endpoint:{gone_later}"].action_label == "stop"
    assert local.endpoint_statuses([orphan, gone_later]) == {orphan: "InService", gone_later: None}

    # Its model deleted after the endpoint was: Bring it back says so, and creates nothing.
    back = button(last_update(slack)["blocks"], "start_again")
    aws.client("sagemaker").delete_model(ModelName="later-ep-model")
    created = team.calls["CreateEndpoint"]  # the two the test's console made
    reply = click(slack, "start_again", back["value"])
    assert "cannot be brought back" in reply and "model later-ep-model" in reply
    assert team.calls["CreateEndpoint"] == created and local.endpoint_statuses([gone_later]) == {gone_later: None}
    assert record(gone_later).state is State.REAPED

    # SageMaker's own refusals, in front of moto: no deletion while it changes, no creation without a model. An
    # endpoint that began updating after the sweep listed it InService: refused, recorded, tried again later.
    racing = endpoint("racing-ep")
    assert sweep(T0 + timedelta(minutes=25))[f"endpoint:{racing}"].action_label == "warn"
    real_discover = aws.Endpoints.discover

    def racing_update(self, tags, names=None, failed=None):
        found = real_discover(self, tags, names, failed)
        if names is None:  # the sweep's listing, not its check before acting
            local.set_endpoint(racing, status="Updating")
        return found

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aws.Endpoints, "discover", racing_update)
        checked = sweep(T0 + timedelta(minutes=45))[f"endpoint:{racing}"]
        assert "changed since this sweep listed it" in (checked.error or "")  # described again before acting
        assert team.calls["DeleteEndpoint"] == 1  # later-ep's alone
        local.set_endpoint(racing, status="InService")
        # ... and when it begins updating after that check too, SageMaker refuses.
        mp.setattr(aws.Fleet, "still_as_listed", lambda self, machines, tags: {m.instance_id for m in machines})
        refused = sweep(T0 + timedelta(minutes=50))[f"endpoint:{racing}"]
    assert refused.error and "ValidationException" in refused.error and "not tried again" not in refused.error
    assert team.refused[("DeleteEndpoint", "ValidationException")] == 1
    assert local.endpoint_statuses([racing]) == {racing: "Updating"} and record(racing).state is State.WARNED
    local.set_endpoint(racing, status="InService")
    assert sweep(T0 + timedelta(minutes=55))[f"endpoint:{racing}"].action_label == "stop"
    assert local.endpoint_statuses([racing]) == {racing: None}
    with pytest.raises(ClientError) as err:
        aws.client("sagemaker").create_endpoint(EndpointName="again", EndpointConfigName="later-ep-config")
    assert err.value.response["Error"]["Code"] == "ValidationException"
    assert "Could not find model" in err.value.response["Error"]["Message"]
