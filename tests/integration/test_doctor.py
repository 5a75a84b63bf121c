"""`idle-reaper doctor` against moto in server mode and the local Slack fake: a healthy deploy is all ok,
each broken thing fails exactly its check naming the thing, Slack down is unknown, and nothing changes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from idle_reaper import aws
from idle_reaper.aws.metrics import HUMAN_METRIC_NAME, HUMAN_METRIC_NAMESPACE
from idle_reaper.core.doctor import MANIFEST_BOT_SCOPES
from idle_reaper.policy import Settings
from idle_reaper.sweep.fanout import LAST_SWEEP_KEY
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import BOT_USER, MANIFEST_SCOPES
from testkit.deploy_answers import DeployAnswers

pytestmark = pytest.mark.integration

ADMIN, MEMBER, OWNER = "U0ADMIN", "U0MEMBER", "U0BOB"
ADMIN_CHANNEL, TEAM_CHANNEL = "C0ADMINS", "C0MLTEAM"
GROUP = "train-asg"


@pytest.fixture
def healthy(aws: Any, slack: Any, deployed: DeployAnswers) -> dict[str, str]:
    """A deploy where everything is right: valid policies, the bot in both channels, owners who resolve."""
    settings = Settings.model_validate({"admins": [ADMIN], "admin_channel": ADMIN_CHANNEL})
    local.init_account(
        settings=settings,
        teams={"ml": local.team_policy_json(slack_channel=TEAM_CHANNEL, members=[MEMBER])},
    )
    slack.users_by_email["bob@example.com"] = OWNER
    slack.channels.update({ADMIN_CHANNEL: [BOT_USER, ADMIN], TEAM_CHANNEL: [BOT_USER, MEMBER]})
    ids = {
        "mail": local.launch("mail", "m5.large", team="ml", launch_time=at(8), owner="bob@example.com"),
        "uid": local.launch("uid", "m5.large", team="ml", launch_time=at(8), owner=OWNER),
        "gpu": local.launch("gpu", "g5.xlarge", team="ml", launch_time=at(8), owner=OWNER),
        "member": local.launch_group(GROUP, "m5.large", team="ml", size=1, min_size=0, launch_time=at(8), owner=OWNER)[
            0
        ],
    }
    for instance_id in ids.values():
        publish(instance_id, gpu=instance_id == ids["gpu"])
    swept(minutes_ago=3)
    return ids


def swept(minutes_ago: int, errors: int = 0) -> None:
    """What the sweep's gather step records when a sweep ends."""
    at_ = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    value = {"at": at_.isoformat(), "failed_shards": 0, "errors": errors}
    aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).put_lookup(
        LAST_SWEEP_KEY, json.dumps(value), at_ + timedelta(days=1)
    )


def _untag_group(_: Any) -> None:
    aws.client("autoscaling").delete_tags(
        Tags=[{"ResourceId": GROUP, "ResourceType": "auto-scaling-group", "Key": local.MANAGED_TAG}]
    )


def publish(instance_id: str, *, gpu: bool = False, collector: bool = True) -> None:
    """The last 70 minutes of CPU (GPU, collector) datapoints, as the agents publish them, but for a hole."""
    now = datetime.now(UTC)
    local.write_metrics(instance_id, lambda t: (5.0, 90.0 if gpu else None), now - timedelta(minutes=70), now)
    if collector:
        publish_collector(instance_id)


def publish_collector(instance_id: str) -> None:
    now = datetime.now(UTC)
    dims = [{"Name": "InstanceId", "Value": instance_id}]
    points = [
        {"MetricName": HUMAN_METRIC_NAME, "Dimensions": dims, "Timestamp": now - timedelta(minutes=m), "Value": 2.0}
        for m in range(0, 70, 5)
    ]
    aws.client("cloudwatch").put_metric_data(Namespace=HUMAN_METRIC_NAMESPACE, MetricData=points)


def launch_and_publish(name: str, instance_type: str, **published: Any) -> str:
    instance_id = local.launch(name, instance_type, team="ml", launch_time=at(8), owner=OWNER)
    publish(instance_id, **published)
    return instance_id


def launch_with_hole(name: str) -> str:
    """A machine whose CPU series has a 30-minute hole in the last hour."""
    instance_id = local.launch(name, "m5.large", team="ml", launch_time=at(8), owner=OWNER)
    now = datetime.now(UTC)
    local.write_metrics(instance_id, lambda t: (5.0, None), now - timedelta(minutes=70), now - timedelta(minutes=40))
    local.write_metrics(instance_id, lambda t: (5.0, None), now - timedelta(minutes=10), now)
    publish_collector(instance_id)
    return instance_id


def doctor(capsys: Any, *argv: str) -> tuple[int, list[dict[str, Any]]]:
    code = cli.main(["doctor", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def by_status(findings: list[dict[str, Any]], status: str) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in findings if f["status"] == status}


def test_a_healthy_deploy_is_all_ok_and_exits_0(healthy: dict[str, str], capsys: Any) -> None:
    code, findings = doctor(capsys)
    assert code == 0
    assert {f["status"] for f in findings} == {"ok"}, [f for f in findings if f["status"] != "ok"]
    assert {f["check"] for f in findings} >= {
        "policy.settings",
        "policy.teams",
        "policy.default",
        "slack.signing_secret",
        "slack.token",
        "slack.scopes",
        "slack.channels",
        "slack.users",
        "people.owners",
        "people.reachable",
        "signals.gpu",
        "signals.collector",
        "signals.cpu",
        "deploy.last_sweep",
        "deploy.groups",
    }
    for f in findings:
        assert set(f) == {"check", "status", "subjects", "message", "fix"}


def test_the_text_answer_names_the_fix_and_counts(healthy: dict[str, str], slack: Any, capsys: Any) -> None:
    slack.channels[TEAM_CHANNEL] = [MEMBER]
    slack.private_channels.add(TEAM_CHANNEL)  # private, and the bot was never invited: Slack hides it
    code = cli.main(["doctor"])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"^FAIL +slack\.channels: .*C0MLTEAM \(team ml\)", out, re.M)
    assert "invite the bot to the private channel: /invite @idle-reaper" in out
    assert out.rstrip().splitlines()[-1].endswith("1 fail, 0 unknown")


def test_a_public_channel_the_bot_has_not_joined_yet_is_fine_and_named(
    healthy: dict[str, str], slack: Any, capsys: Any
) -> None:
    """The bot joins a public team channel the first time it posts there (README, the manifest's channels:join):
    the doctor says so rather than asking for an invite."""
    slack.channels[TEAM_CHANNEL] = [MEMBER]
    code, findings = doctor(capsys)
    [channels] = [f for f in findings if f["check"] == "slack.channels"]
    assert code == 0 and channels["status"] == "ok"
    assert "joins the public one(s) it is not in yet" in channels["message"] and TEAM_CHANNEL in channels["message"]


def _bad_team_policy(_: Any) -> str:
    aws.client("ssm").put_parameter(
        Name="/idle-reaper/teams/cv", Value='{"idle_minutes": -5}', Type="String", Overwrite=True
    )
    return "cv"


def _bad_settings(_: Any) -> str:
    aws.client("ssm").put_parameter(
        Name="/idle-reaper/settings", Value='{"admins": ["bob"]}', Type="String", Overwrite=True
    )
    return "/idle-reaper/settings"


BROKEN: dict[str, tuple[Callable[[Any], object], str, str]] = {
    # name: (break it, the check that fails or warns, a subject it must name: given, or what breaking returned)
    "bot not in the private team channel": (
        lambda s: s.channels.update({TEAM_CHANNEL: [MEMBER]}) or s.private_channels.add(TEAM_CHANNEL),
        "slack.channels",
        TEAM_CHANNEL,
    ),
    "team channel deleted": (
        lambda s: s.channels.pop(TEAM_CHANNEL) and setattr(s, "unknown_channels_exist", False),
        "slack.channels",
        TEAM_CHANNEL,
    ),
    "scope missing": (
        lambda s: setattr(s, "scopes", [x for x in MANIFEST_SCOPES if x != "users:read.email"]),
        "slack.scopes",
        "users:read.email",
    ),
    "admin id unknown": (lambda s: s.missing_users.add(ADMIN), "slack.users", ADMIN),
    "member id unknown": (lambda s: s.missing_users.add(MEMBER), "slack.users", MEMBER),
    "token revoked": (lambda s: setattr(s, "auth_revoked", True), "slack.token", "None"),
    "owner email matches nobody": (lambda s: s.users_by_email.clear(), "people.owners", "mail"),
    "team policy invalid": (_bad_team_policy, "policy.teams", ""),
    "settings invalid": (_bad_settings, "policy.settings", ""),
    "GPU agent missing": (lambda s: launch_and_publish("nogpu", "p3.2xlarge"), "signals.gpu", ""),
    "schedule stopped": (lambda s: swept(minutes_ago=45), "deploy.last_sweep", "None"),
    "group without the opt-in tag": (_untag_group, "deploy.groups", GROUP),
}
WARNED: dict[str, tuple[Callable[[Any], object], str, str]] = {
    "collector missing": (
        lambda s: launch_and_publish("nocollector", "m5.large", collector=False),
        "signals.collector",
        "",
    ),
    "CPU hole": (lambda s: launch_with_hole("holey"), "signals.cpu", ""),
    "last sweep had errors": (lambda s: swept(minutes_ago=2, errors=3), "deploy.last_sweep", "None"),
}


@pytest.mark.parametrize("name", [*BROKEN, *WARNED])
def test_each_broken_thing_fails_exactly_its_check(name: str, healthy: dict[str, str], slack: Any, capsys: Any) -> None:
    status = "fail" if name in BROKEN else "warn"
    breaks, check, subject = {**BROKEN, **WARNED}[name]
    subject = str(breaks(slack) or healthy.get(subject, subject))
    code, findings = doctor(capsys)
    assert code == (1 if status == "fail" else 0)
    assert {f["check"] for f in findings if f["status"] in ("fail", "warn")} == {check}, findings
    found = by_status(findings, status)[check]
    assert found["fix"]
    if subject != "None":
        assert subject in found["subjects"] and subject in found["message"]


def test_a_team_without_policy_uses_the_default_said_once(healthy: dict[str, str], capsys: Any) -> None:
    local.launch("stray", "m5.large", team="nlp", launch_time=at(8), owner=OWNER)
    local.launch("stray2", "m5.large", team="nlp", launch_time=at(8), owner=OWNER)
    code, findings = doctor(capsys)
    assert code == 0
    warned = [f for f in findings if f["check"] == "policy.default"]
    assert len(warned) == 1 and warned[0]["status"] == "warn" and warned[0]["subjects"] == ["nlp"]


@pytest.mark.parametrize("fault", ["down", "rate limited"])
def test_slack_down_or_rate_limited_is_unknown_never_ok(
    fault: str, healthy: dict[str, str], slack: Any, capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr("idle_reaper_tools.doctor.SLACK_BUDGET_SECONDS", 0.0)
    if fault == "down":
        slack.down = True
    else:
        slack.rate_limit_next = 1000
    code, findings = doctor(capsys)
    statuses = {f["check"]: f["status"] for f in findings}
    assert statuses["slack.token"] == "unknown" and statuses["people.owners"] == "unknown"
    assert not any(
        f["check"].startswith(("slack.", "people.")) and f["status"] == "ok"
        for f in findings
        if f["check"] != "slack.signing_secret"
    )
    assert code == 0  # nothing is known to fail


def snapshot(slack: Any) -> dict[str, Any]:
    """Every table item, parameter, instance and group tag, schedule rule state and Slack message and file."""
    items = aws.client("dynamodb").scan(TableName=aws.table_name())["Items"]
    params = aws.client("ssm").get_parameters_by_path(Path="/idle-reaper", Recursive=True)["Parameters"]
    tags = aws.client("ec2").describe_tags()["Tags"]
    group_tags = aws.client("autoscaling").describe_tags()["Tags"]
    rules = aws.client("events").list_rules()["Rules"]
    return {
        "items": sorted(json.dumps(i, sort_keys=True) for i in items),
        "params": sorted((p["Name"], p["Version"], p["Value"]) for p in params),
        "tags": sorted((t["ResourceId"], t["Key"], t["Value"]) for t in tags),
        "group_tags": sorted((t["ResourceId"], t["Key"], t["Value"]) for t in group_tags),
        "rules": sorted((r["Name"], r["State"]) for r in rules),
        "messages": dict(slack.messages),
        "files": dict(slack.files),
    }


def test_the_doctor_changes_nothing(healthy: dict[str, str], slack: Any, capsys: Any) -> None:
    _bad_team_policy(slack)
    slack.users_by_email["carol@example.com"] = "U0CAROL"
    local.launch("carol", "m5.large", team="ml", launch_time=at(8), owner="carol@example.com")

    before = snapshot(slack)
    code, _ = doctor(capsys)
    assert code == 1
    assert snapshot(slack) == before
    assert not slack.calls_to("chat.postMessage") and not slack.calls_to("conversations.open")


def test_the_scopes_checked_are_the_manifests() -> None:
    manifest = (Path(__file__).parents[2] / "slack" / "manifest.yml").read_text()
    bot = manifest.split("    bot:\n", 1)[1].split("settings:", 1)[0]
    scopes = re.findall(r"^ +- ([a-z:.]+)", bot, re.M)
    assert len(scopes) == 14 and frozenset(scopes) == MANIFEST_BOT_SCOPES == frozenset(MANIFEST_SCOPES)


def test_a_sweep_records_itself_for_the_doctor(real_answers: DeployAnswers, slack: Any, capsys: Any) -> None:
    local.init_account()
    code, findings = doctor(capsys)
    assert code == 1
    assert "no sweep has finished" in by_status(findings, "fail")["deploy.last_sweep"]["message"]
    assert cli.main(["sweep"]) == 0
    capsys.readouterr()
    _, findings = doctor(capsys)
    assert "deploy.last_sweep" in by_status(findings, "ok")


def test_an_owner_the_sweep_already_resolved_costs_no_slack_call(
    healthy: dict[str, str], slack: Any, capsys: Any
) -> None:
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    store.put_lookup("owner#carol@example.com", "U0CAROL", datetime.now(UTC) + timedelta(days=7))
    publish(local.launch("carol", "m5.large", team="ml", launch_time=at(8), owner="Carol@example.com"))
    code, findings = doctor(capsys)
    assert code == 0 and "people.owners" in by_status(findings, "ok")
    asked = [c.params.get("email") for c in slack.calls_to("users.lookupByEmail")]
    assert asked == ["bob@example.com"]


def test_send_test_posts_one_message_to_the_admins_and_the_named_user(
    healthy: dict[str, str], slack: Any, capsys: Any
) -> None:
    code, findings = doctor(capsys, "--send-test", "U0CAROL")
    assert code == 0 and "slack.send_test" in by_status(findings, "ok")
    posted = sorted(c.params["channel"] for c in slack.calls_to("chat.postMessage"))
    assert posted == sorted([ADMIN_CHANNEL, "D0ADMIN", "D0CAROL"])
    slack.errors[f"chat.postMessage {ADMIN_CHANNEL}"] = "not_in_channel"
    code, findings = doctor(capsys, "--send-test")
    failed_send = by_status(findings, "fail")["slack.send_test"]
    assert code == 1 and failed_send["subjects"] == [ADMIN_CHANNEL] and "not_in_channel" in failed_send["message"]
