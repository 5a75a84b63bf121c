"""`idle-reaper doctor` against moto in server mode and the local Slack fake: a healthy deploy is all ok,
each broken thing fails exactly its check naming the thing, Slack down is unknown, and nothing changes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from idle_reaper import aws
from idle_reaper.core.doctor import MANIFEST_BOT_SCOPES
from idle_reaper.policy import Settings
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import BOT_USER, MANIFEST_SCOPES

pytestmark = pytest.mark.integration

ADMIN, MEMBER, OWNER = "U0ADMIN", "U0MEMBER", "U0BOB"
ADMIN_CHANNEL, TEAM_CHANNEL = "C0ADMINS", "C0MLTEAM"


@pytest.fixture
def healthy(aws: Any, slack: Any) -> dict[str, str]:
    """A deploy where everything is right: valid policies, the bot in both channels, owners who resolve."""
    settings = Settings.model_validate({"admins": [ADMIN], "admin_channel": ADMIN_CHANNEL})
    local.init_account(
        settings=settings,
        teams={"ml": local.team_policy_json(slack_channel=TEAM_CHANNEL, members=[MEMBER])},
    )
    slack.users_by_email["bob@example.com"] = OWNER
    slack.channels.update({ADMIN_CHANNEL: [BOT_USER, ADMIN], TEAM_CHANNEL: [BOT_USER, MEMBER]})
    return {
        "mail": local.launch("mail", "m5.large", team="ml", launch_time=at(8), owner="bob@example.com"),
        "uid": local.launch("uid", "m5.large", team="ml", launch_time=at(8), owner=OWNER),
    }


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
    }
    for f in findings:
        assert set(f) == {"check", "status", "subjects", "message", "fix"}


def test_the_text_answer_names_the_fix_and_counts(healthy: dict[str, str], slack: Any, capsys: Any) -> None:
    slack.channels[TEAM_CHANNEL] = [MEMBER]
    code = cli.main(["doctor"])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"^FAIL +slack\.channels: .*C0MLTEAM \(team ml\)", out, re.M)
    assert "fix: in each channel: /invite @idle-reaper" in out
    assert out.rstrip().splitlines()[-1].endswith("1 fail, 0 unknown")


def _bad_team_policy(_: Any) -> None:
    aws.client("ssm").put_parameter(
        Name="/idle-reaper/teams/cv", Value='{"idle_minutes": -5}', Type="String", Overwrite=True
    )


def _bad_settings(_: Any) -> None:
    aws.client("ssm").put_parameter(
        Name="/idle-reaper/settings", Value='{"admins": ["bob"]}', Type="String", Overwrite=True
    )


BROKEN: dict[str, tuple[Callable[[Any], None], str, str]] = {
    # name: (break it, the check that fails, a subject it must name)
    "bot not in the team channel": (
        lambda s: s.channels.update({TEAM_CHANNEL: [MEMBER]}),
        "slack.channels",
        TEAM_CHANNEL,
    ),
    "team channel deleted": (lambda s: s.channels.pop(TEAM_CHANNEL), "slack.channels", TEAM_CHANNEL),
    "scope missing": (
        lambda s: setattr(s, "scopes", [x for x in MANIFEST_SCOPES if x != "users:read.email"]),
        "slack.scopes",
        "users:read.email",
    ),
    "admin id unknown": (lambda s: s.missing_users.add(ADMIN), "slack.users", ADMIN),
    "member id unknown": (lambda s: s.missing_users.add(MEMBER), "slack.users", MEMBER),
    "token revoked": (lambda s: setattr(s, "auth_revoked", True), "slack.token", ""),
    "owner email matches nobody": (lambda s: s.users_by_email.clear(), "people.owners", "mail"),
    "team policy invalid": (_bad_team_policy, "policy.teams", "cv"),
    "settings invalid": (_bad_settings, "policy.settings", "/idle-reaper/settings"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_broken_thing_fails_exactly_its_check(name: str, healthy: dict[str, str], slack: Any, capsys: Any) -> None:
    breaks, check, subject = BROKEN[name]
    breaks(slack)
    code, findings = doctor(capsys)
    assert code == 1
    fails = by_status(findings, "fail")
    assert set(fails) == {check}, fails
    subject = healthy.get(subject, subject)
    if subject:
        assert subject in fails[check]["subjects"]
        assert subject in fails[check]["message"] and fails[check]["fix"]


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


def test_the_doctor_changes_nothing(healthy: dict[str, str], slack: Any, capsys: Any) -> None:
    _bad_team_policy(slack)
    slack.users_by_email["carol@example.com"] = "U0CAROL"
    local.launch("carol", "m5.large", team="ml", launch_time=at(8), owner="carol@example.com")

    def snapshot() -> dict[str, Any]:
        ddb = aws.client("dynamodb")
        items = ddb.scan(TableName=aws.table_name())["Items"]
        params = aws.client("ssm").get_parameters_by_path(Path="/idle-reaper", Recursive=True)["Parameters"]
        tags = aws.client("ec2").describe_tags()["Tags"]
        return {
            "items": sorted(json.dumps(i, sort_keys=True) for i in items),
            "params": sorted((p["Name"], p["Version"], p["Value"]) for p in params),
            "tags": sorted((t["ResourceId"], t["Key"], t["Value"]) for t in tags),
            "messages": dict(slack.messages),
            "files": dict(slack.files),
        }

    before = snapshot()
    code, _ = doctor(capsys)
    assert code == 1
    assert snapshot() == before
    assert not slack.calls_to("chat.postMessage") and not slack.calls_to("conversations.open")


def test_the_scopes_checked_are_the_manifests() -> None:
    manifest = (Path(__file__).parents[2] / "slack" / "manifest.yml").read_text()
    bot = manifest.split("    bot:\n", 1)[1].split("settings:", 1)[0]
    scopes = re.findall(r"^ +- ([a-z:.]+)", bot, re.M)
    assert len(scopes) == 11 and frozenset(scopes) == MANIFEST_BOT_SCOPES == frozenset(MANIFEST_SCOPES)
