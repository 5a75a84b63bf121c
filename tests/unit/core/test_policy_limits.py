"""Policies that cannot take the sweep down: bounded input, identifiers checked as their kind, every
failure a PolicyError naming the parameter, and one poisoned team in safe mode while the rest is swept."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.aws import PolicyStore
from idle_reaper.policy import (
    MAX_NESTING,
    MAX_PARAMETER_CHARS,
    PolicyError,
    Settings,
    TeamPolicy,
    json_schema,
    parse_settings,
    parse_team_policy,
)
from idle_reaper.sweep import run_sweep
from testkit.aws import FakeAws, steady

PARAM = "/idle-reaper/teams/ml"
SETTINGS = "/idle-reaper/settings"
NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)


def team_problems(text: str | dict[str, Any]) -> list[str]:
    raw = text if isinstance(text, str) else json.dumps(text)
    with pytest.raises(PolicyError) as err:
        parse_team_policy(PARAM, raw, TeamPolicy())
    assert str(err.value).startswith(f"{PARAM}: ")
    return err.value.problems


def settings_problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(PolicyError) as err:
        parse_settings(SETTINGS, json.dumps(data))
    assert str(err.value).startswith(f"{SETTINGS}: ")
    return err.value.problems


# ---------------------------------------------------------------------------------------------
# Bounded before parsing


@pytest.mark.parametrize(
    "text",
    [
        "[" * 4000 + "]" * 4000,  # a depth bomb: json.loads alone raises RecursionError
        '{"schedules": ' + "[" * 2000 + "]" * 2000 + "}",
        '{"a": ' + '{"a": ' * 1000 + "1" + "}" * 1001,
    ],
)
def test_a_depth_bomb_is_a_policy_error_not_a_recursion_error(text):
    assert team_problems(text) == [f"nested too deeply (more than {MAX_NESTING} levels of [ and {{)"]


def test_brackets_inside_strings_do_not_count_as_nesting():
    policy = parse_team_policy(
        PARAM,
        json.dumps({"schedules": [{"name": "[[[[[[[[[[[[{{{{{{{{", "days": ["sat"], "idle_minutes": 45}]}),
        TeamPolicy(),
    )
    assert policy.schedules[0].name == "[[[[[[[[[[[[{{{{{{{{"
    escaped = json.dumps({"schedules": [{"name": 'a\\"[[[[[[[[[[[[', "days": ["sat"], "idle_minutes": 45}]})
    assert parse_team_policy(PARAM, escaped, TeamPolicy()).schedules[0].name == 'a\\"[[[[[[[[[[[['


def test_an_oversized_parameter_is_refused_before_parsing():
    text = json.dumps({"members": ["U0123ABCD"] * 1000})
    assert len(text) > MAX_PARAMETER_CHARS
    assert team_problems(text) == [
        f"too large: {len(text)} characters (at most {MAX_PARAMETER_CHARS}: SSM's Advanced tier holds no more)"
    ]


def test_any_failure_while_validating_becomes_a_policy_error(monkeypatch):
    def explode(*_args: Any, **_kw: Any) -> TeamPolicy:
        raise MemoryError("out of memory")

    monkeypatch.setattr(TeamPolicy, "model_validate", explode)
    assert team_problems({"idle_minutes": 60}) == ["cannot be validated (MemoryError: 'out of memory')"]


# ---------------------------------------------------------------------------------------------
# Identifiers as their kind, bounded, the bad value named (and cut short)


def test_a_4000_character_time_zone_is_a_clear_error():
    (problem,) = team_problems({"timezone": "Europe/" + "x" * 4000})
    assert problem.startswith('timezone: String should have at most 64 characters (got "Europe/xxx')
    assert len(problem) < 200


@pytest.mark.parametrize("zone", ["America", "../etc/passwd", "Europe/Berln", "UTC\u0000"])
def test_a_time_zone_that_is_no_zone_is_refused(zone):
    (problem,) = team_problems({"timezone": zone})
    assert problem.startswith("timezone: ")
    assert "IANA time zone" in problem


def test_a_4000_character_member_id_is_refused_and_named_short():
    problems = team_problems({"members": ["U0OK", "U" + "A" * 4000, "alice@example.com", "S0GROUP", "C0CHAN"]})
    assert problems[0].startswith('members[1]: String should have at most 32 characters (got "UAAA')
    assert len(problems[0]) < 200
    assert problems[1:] == [
        'members[2]: not a Slack user id (U..., W...) or user group id (S...) (got "alice@example.com")',
        'members[4]: not a Slack user id (U..., W...) or user group id (S...) (got "C0CHAN")',
    ]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"slack_channel": "#ml-team"}, "slack_channel: not a Slack channel id (C..., G... or D..., e.g. C0123ABCD)"),
        ({"slack_channel": "C" + "0" * 40}, "slack_channel: String should have at most 32 characters"),
        ({"morning": "9:00"}, "morning: not a time of day HH:MM (00:00-23:59)"),
        ({"morning": "09:00:00"}, "morning: String should have at most 5 characters"),
    ],
)
def test_team_identifiers_are_checked_as_their_kind(data, expected):
    (problem,) = team_problems(data)
    assert problem.startswith(expected)


def test_valid_identifiers_pass():
    policy = parse_team_policy(
        PARAM,
        json.dumps(
            {
                "slack_channel": "G0PRIVATE1",
                "members": ["U0A", "W0ENTERPRISE", "S0GROUP"],
                "morning": "07:30",
                "timezone": "America/Argentina/Buenos_Aires",
            }
        ),
        TeamPolicy(),
    )
    assert policy.members == ("U0A", "W0ENTERPRISE", "S0GROUP")


def test_settings_identifiers_are_checked_as_their_kind():
    problems = settings_problems(
        {
            "admins": ["U0ADMIN", "S0GROUP"],
            "admin_channel": "general",
            "slack_command": "/Idle Reaper",
            "tags": {"team": "Team\n", "owner": "o" * 129},
            "metrics": {"cpu": {"namespace": " AWS/EC2", "name": "CPU\u0007"}},
            "gpu_instance_families": ["g5", "G5.XLARGE"],
        }
    )
    assert problems == [
        'tags.team: not an EC2 tag key (letters, digits, spaces, _ . : / = + - @) (got "Team\\n")',
        'tags.owner: String should have at most 128 characters (got "' + "o" * 58 + "…)",
        'metrics.cpu.namespace: not a CloudWatch namespace (e.g. AWS/EC2, CWAgent) (got " AWS/EC2")',
        'metrics.cpu.name: not a CloudWatch metric name (printable characters) (got "CPU\\u0007")',
        'gpu_instance_families[1]: not an EC2 instance family (e.g. g5, p4d) (got "G5.XLARGE")',
        'admins[1]: not a Slack user id (U... or W..., e.g. U0123ABCD) (got "S0GROUP")',
        'admin_channel: not a Slack channel id (C..., G... or D..., e.g. C0123ABCD) (got "general")',
        'slack_command: not a slash command (e.g. /idle-reaper) (got "/Idle Reaper")',
    ]


def test_unicode_tag_keys_and_the_default_settings_are_valid():
    settings = parse_settings(SETTINGS, json.dumps({"tags": {"team": "Équipe", "owner": "aws:owner @x"}}))
    assert settings.tags.team == "Équipe"
    assert parse_settings(SETTINGS, Settings().model_dump_json()) == Settings()


def test_the_json_schema_carries_the_identifier_kinds():
    team = json_schema(TeamPolicy)["properties"]
    assert team["timezone"]["maxLength"] == 64 and team["timezone"]["pattern"].startswith("^[A-Za-z]")
    assert team["members"]["items"]["pattern"] == "^[UWS][A-Z0-9]{2,31}$"
    assert team["members"]["items"]["maxLength"] == 32
    assert team["morning"]["maxLength"] == 5
    channel = team["slack_channel"]["anyOf"][0]
    assert channel["pattern"] == "^[CGD][A-Z0-9]{2,31}$" and channel["maxLength"] == 32
    schema = json_schema(Settings)
    defs = schema["$defs"]
    assert schema["properties"]["admins"]["items"]["pattern"] == "^[UW][A-Z0-9]{2,31}$"
    assert defs["TagKeys"]["properties"]["team"]["maxLength"] == 128
    assert defs["MetricSource"]["properties"]["namespace"]["maxLength"] == 255


# ---------------------------------------------------------------------------------------------
# One poisoned team: that team alone in safe mode, the rest swept


def test_a_poisoned_team_is_in_safe_mode_and_the_others_are_swept():
    aws = FakeAws()
    aws.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    aws.ssm.store("/idle-reaper/teams/ml", json.dumps({"idle_minutes": 60, "warn_minutes": 20}))
    aws.ssm.store("/idle-reaper/teams/bomb", "[" * 3000 + "]" * 3000)
    aws.ssm.store("/idle-reaper/teams/zone", json.dumps({"timezone": "x" * 4000}))
    launched = NOW - timedelta(hours=6)
    good, bomb, zone = (
        aws.launch("m5.large", team=team, profile=steady(1.0), launch_time=launched) for team in ("ml", "bomb", "zone")
    )

    refs = PolicyStore(aws.ssm, "/idle-reaper").load_teams(Settings())
    assert refs["ml"].policy is not None
    assert refs["bomb"].policy is None and refs["bomb"].error is not None
    assert refs["bomb"].error.startswith("/idle-reaper/teams/bomb: nested too deeply")
    assert refs["zone"].policy is None and refs["zone"].error is not None
    assert refs["zone"].error.startswith("/idle-reaper/teams/zone: timezone: String should have at most 64")

    report = run_sweep(aws.adapters(), now=NOW)
    by_id = {d.machine.instance_id: d for d in report.decisions}
    assert by_id[good].action.value == "warn"
    for poisoned in (bomb, zone):
        assert by_id[poisoned].action.value == "none"
        assert by_id[poisoned].state.value == "safe_mode" and "nothing is changed" in by_id[poisoned].reason
    assert aws.ec2.state_of(good) == "running"
    assert sum("safe mode" in w for w in report.warnings) == 2
