"""`idle-reaper sweep` against moto with poisoned parameters: one bad team is in safe mode and the rest
is swept (exit 0); bad settings stop the sweep with one clear line, a non-zero exit and nothing changed."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from idle_reaper import aws
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at

pytestmark = pytest.mark.integration

NOW = at(15)


def idle(_t):
    return (1.0, None)


@pytest.fixture
def fleet(aws):
    teams = {
        "ml": local.team_policy_json(idle_minutes=60, warn_minutes=20),
        "bomb": "[" * 2000 + "]" * 2000,  # json.loads alone would raise RecursionError
        "zone": json.dumps({"timezone": "Europe/" + "x" * 3990}),  # ZoneInfo alone would raise OSError
    }
    local.init_account(teams=teams)
    ids = {team: local.launch(team, "m5.large", team=team, launch_time=at(8)) for team in teams}
    for instance_id in ids.values():
        local.write_metrics(instance_id, idle, at(12), NOW + timedelta(hours=1))
    return ids


def test_a_poisoned_team_is_in_safe_mode_and_the_rest_is_swept(fleet, capsys):
    code = cli.main(["sweep", "--json", "--now", NOW.isoformat()])
    out, err = capsys.readouterr()
    assert code == 0
    rows = {r["team"]: r for r in map(json.loads, out.splitlines())}
    assert rows["ml"]["action"] == "warn", "the good team's idle machine is still warned"
    for team, problem in (("bomb", "nested too deeply"), ("zone", "timezone: String should have at most 64")):
        assert rows[team]["state"] == "safe_mode" and rows[team]["action"] == "none"
        assert f"/idle-reaper/teams/{team}: {problem}" in rows[team]["reason"]
        assert len(rows[team]["reason"]) < 400, "the bad value is cut short"
    assert "Traceback" not in err
    assert "invalid team policy, team in safe mode: /idle-reaper/teams/bomb" in err


def test_poisoned_settings_exit_non_zero_with_one_clear_line_and_change_nothing(fleet, capsys):
    ssm = aws.client("ssm")
    settings = json.loads(ssm.get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"])
    settings["admins"] = ["U" + "A" * 3000]
    settings["default_policy"]["timezone"] = "America"
    # Over 4,096 characters: an admin writing it by hand must ask for the Advanced tier, as SSM says.
    value = json.dumps(settings)
    ssm.put_parameter(Name="/idle-reaper/settings", Value=value, Type="String", Overwrite=True, Tier="Advanced")
    before = aws.client("dynamodb").scan(TableName=aws.table_name())["Items"]

    code = cli.main(["sweep", "--now", NOW.isoformat()])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("idle-reaper: sweep could not run: settings are invalid, nothing was changed: ")
    assert "default_policy.timezone: unknown IANA time zone 'America'" in line
    assert "admins[0]: String should have at most 32 characters" in line and len(line) < 500
    assert aws.client("dynamodb").scan(TableName=aws.table_name())["Items"] == before
    assert set(local.instance_states(list(fleet.values())).values()) == {"running"}
