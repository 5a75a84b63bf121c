"""`idle-reaper policy ...` and `idle-reaper status` end to end against moto's SSM, EC2, CloudWatch
and DynamoDB."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from test_accounts import org  # noqa: F401  (the organization fixture)

from idle_reaper import aws
from idle_reaper.core import State
from idle_reaper.notify import LoggingNotifier
from idle_reaper.policy import Settings
from idle_reaper.sweep import Adapters, logger, run_sweep
from idle_reaper_tools import admin, cli, local
from idle_reaper_tools.demo import at

pytestmark = pytest.mark.integration

NOW = at(15)
ML = "/idle-reaper/teams/ml"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, data: dict | str, name: str = "policy.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def stored(name: str = ML) -> aws.StoredParameter | None:
    return aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix()).read(name)


def quiet_from(change: datetime):
    """CPU 50 % until `change`, then 1 %."""
    return lambda t: (50.0 if t < change else 1.0, None)


# ---------------------------------------------------------------------------------------------
# schema and validate (offline)


def test_schema_prints_the_team_policy_json_schema(capsys):
    code, out, _ = run(capsys, "policy", "schema")
    schema = json.loads(out)
    assert code == 0 and schema["additionalProperties"] is False
    assert schema["properties"]["idle_minutes"]["minimum"] == 15
    code, out, _ = run(capsys, "policy", "schema", "--settings")
    assert code == 0 and "default_policy" in json.loads(out)["properties"]


def test_validate_a_good_file(tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 45, "schedules": [{"days": ["sat", "sun"], "idle_minutes": 40}]})
    code, out, err = run(capsys, "policy", "validate", path)
    assert (code, out, err) == (0, f"{path}: valid\n", "")


@pytest.mark.parametrize(
    "content,expected",
    [
        ('{"idle_minutes": 60,', "not valid JSON"),
        ({"idle_minutes": "sixty"}, "idle_minutes: Input should be a valid integer"),
        ({"idle_minutse": 60}, "idle_minutse: unknown field"),
        ({"idle_minutes": 2000}, "idle_minutes: Input should be less than or equal to 1440"),
        ({"schedules": [{"days": ["sat"], "timezone": "Mars/Olympus", "idle_minutes": 45}]}, "schedules[0].timezone"),
        (
            {"schedules": [{"days": ["sat"], "idle_minutes": 45}, {"days": ["sat"], "idle_minutes": 60}]},
            "schedules[1]: overlaps schedules[0]",
        ),
        ({"idle_minutes": 30, "warn_minutes": 30}, "warn_minutes: warn_minutes (30) must be shorter"),
    ],
)
def test_validate_names_the_file_and_the_field(tmp_path, capsys, content, expected):
    path = write(tmp_path, content)
    code, out, err = run(capsys, "policy", "validate", path)
    assert code == 1 and out == ""
    assert f"{path}: {expected}" in err


def test_validate_prints_every_error_each_with_its_path(tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 5, "cpu_threshold_percent": 150, "colour": "red"})
    code, _, err = run(capsys, "policy", "validate", path)
    assert code == 1
    lines = err.splitlines()
    assert [line.split(": ")[1] for line in lines[:3]] == ["idle_minutes", "cpu_threshold_percent", "colour"]
    assert lines[-1] == f"{path}: 3 problems"


def test_validate_settings_and_a_missing_file(tmp_path, capsys):
    path = write(tmp_path, {"dry_run": "perhaps"})
    code, _, err = run(capsys, "policy", "validate", "--settings", path)
    assert code == 1 and f"{path}: dry_run: Input should be a valid boolean" in err
    code, _, err = run(capsys, "policy", "validate", str(tmp_path / "nope.json"))
    assert code == 2 and "cannot read" in err


def test_validate_against_the_stored_defaults(aws, tmp_path, capsys):
    settings = Settings.model_validate({"default_policy": {"idle_minutes": 120, "warn_minutes": 45}})
    aws_ssm().put_parameter(Name="/idle-reaper/settings", Value=settings.model_dump_json(), Type="String")
    path = write(tmp_path, {"idle_minutes": 40})  # fine on the built-in default (warn 30), not on the stored one
    assert run(capsys, "policy", "validate", path)[0] == 0
    code, _, err = run(capsys, "policy", "validate", "--stored-defaults", path)
    assert code == 1 and "warn_minutes (45) must be shorter than idle_minutes (40)" in err


# ---------------------------------------------------------------------------------------------
# put


@pytest.fixture
def account(aws):
    local.init_account(teams={"ml": json.dumps({"idle_minutes": 90, "warn_minutes": 30})})


def test_put_shows_the_diff_and_writes_a_new_version(account, tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 60, "warn_minutes": 20})
    code, out, err = run(capsys, "policy", "put", "ml", path, "--yes")
    assert code == 0, err
    assert f"--- {ML} v1 (effective)" in out and '-  "idle_minutes": 90,' in out and '+  "idle_minutes": 60,' in out
    assert f"wrote {ML} v2" in out
    param = stored()
    assert param is not None and param.version == 2
    assert json.loads(param.value) == {"idle_minutes": 60, "warn_minutes": 20}, "the file's fields, not the merge"
    code, out, _ = run(capsys, "policy", "put", "ml", path, "--yes")
    assert code == 0 and "already holds this policy" in out and stored().version == 2


def test_put_a_new_team_diffs_against_the_default(account, tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 45})
    code, out, _ = run(capsys, "policy", "put", "vision", path, "--yes")
    assert code == 0 and "(absent: the team follows settings.default_policy)" in out
    assert stored("/idle-reaper/teams/vision").version == 1


@pytest.mark.parametrize(
    "content,field",
    [
        ("{not json", "not valid JSON"),
        ({"idle_minutes": [60]}, "idle_minutes"),
        ({"idle": 60}, "idle"),
        ({"gpu_threshold_percent": 101}, "gpu_threshold_percent"),
        ({"schedules": [{"days": ["sun"], "timezone": "Europe/Berlim", "idle_minutes": 45}]}, "schedules[0].timezone"),
        (
            {
                "schedules": [
                    {"days": ["fri"], "start": "22:00", "end": "07:00", "warn_minutes": 5},
                    {"days": ["sat"], "end": "06:00", "warn_minutes": 10},
                ]
            },
            "schedules[1]: overlaps",
        ),
        ({"warn_minutes": 90}, "warn_minutes"),
    ],
)
def test_put_invalid_writes_nothing(account, tmp_path, capsys, content, field):
    path = write(tmp_path, content)
    code, out, err = run(capsys, "policy", "put", "ml", path, "--yes")
    assert code == 1 and "wrote" not in out
    assert f"{path}: {field}" in err and "nothing was written" in err
    assert stored().version == 1


def test_put_without_a_terminal_or_yes_refuses(account, tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 60})
    code, _, err = run(capsys, "policy", "put", "ml", path)
    assert code == 1 and "stdin is not a terminal: pass --yes" in err
    assert stored().version == 1


def test_put_asks_and_a_no_writes_nothing(account, tmp_path, capsys, monkeypatch):
    prompts: list[str] = []
    monkeypatch.setattr(admin, "confirm", lambda prompt: prompts.append(prompt) or False)
    code, out, _ = run(capsys, "policy", "put", "ml", write(tmp_path, {"idle_minutes": 60}))
    assert code == 1 and "nothing written" in out
    assert prompts == [f"write {ML} (v1 -> v2)? [y/N] "]
    assert stored().version == 1


def test_put_refuses_when_the_parameter_changed_while_the_admin_was_reading_the_diff(
    account, tmp_path, capsys, monkeypatch
):
    def someone_else_writes_then_yes(prompt: str) -> bool:
        aws.client("ssm").put_parameter(Name=ML, Value='{"idle_minutes": 120}', Type="String", Overwrite=True)
        return True

    monkeypatch.setattr(admin, "confirm", someone_else_writes_then_yes)
    code, out, err = run(capsys, "policy", "put", "ml", write(tmp_path, {"idle_minutes": 60}))
    assert code == 1 and "wrote" not in out
    assert f"{ML} changed since it was read (was v1, now v2); nothing was written" in err
    param = stored()
    assert param is not None and param.version == 2 and json.loads(param.value) == {"idle_minutes": 120}


def test_put_refuses_while_the_stored_settings_are_invalid(account, tmp_path, capsys):
    aws.client("ssm").put_parameter(Name="/idle-reaper/settings", Value='{"dry_run": 3}', Type="String", Overwrite=True)
    code, _, err = run(capsys, "policy", "put", "ml", write(tmp_path, {"idle_minutes": 60}), "--yes")
    assert code == 1 and "/idle-reaper/settings: dry_run" in err and "fix them first" in err
    assert stored().version == 1


def test_put_refuses_a_team_name_ssm_cannot_hold(account, tmp_path, capsys):
    code, _, err = run(capsys, "policy", "put", "ml/x", write(tmp_path, {"idle_minutes": 60}), "--yes")
    assert code == 1 and "team 'ml/x'" in err


# ---------------------------------------------------------------------------------------------
# show and list


def test_show_says_where_each_value_came_from(aws, capsys):
    ssm = aws_ssm()
    ssm.put_parameter(
        Name="/idle-reaper/settings", Value='{"default_policy": {"cpu_threshold_percent": 10}}', Type="String"
    )
    aws_module_create_table()
    policy = {
        "idle_minutes": 60,
        "warn_minutes": 20,
        "timezone": "Europe/Berlin",
        "schedules": [{"name": "weekend", "days": ["sat", "sun"], "idle_minutes": 30}],
    }
    ssm.put_parameter(Name=ML, Value=json.dumps(policy), Type="String")
    saturday = "2026-11-21T12:00:00+00:00"
    code, out, _ = run(capsys, "policy", "show", "ml", "--json", "--now", saturday)
    shown = json.loads(out)
    assert code == 0
    assert shown["sources"]["idle_minutes"] == f"team parameter {ML}@v1"
    assert shown["sources"]["cpu_threshold_percent"] == "settings.default_policy (/idle-reaper/settings@v1)"
    assert shown["sources"]["gpu_threshold_percent"] == "built-in default"
    assert shown["policy"]["cpu_threshold_percent"] == 10 and shown["policy"]["gpu_threshold_percent"] == 5
    assert shown["active_schedules"] == ["schedules[0] 'weekend'"]
    assert shown["policy"]["idle_minutes"] == 60 and shown["effective_now"]["idle_minutes"] == 30

    code, out, _ = run(capsys, "policy", "show", "ml", "--now", saturday)
    assert code == 0
    assert out.splitlines()[0].startswith(f"team ml: {ML} v1, modified ")
    assert "in force at 2026-11-21T12:00:00+00:00 (Sat 13:00 CET): schedules[0] 'weekend' -> idle_minutes=30" in out

    code, out, _ = run(capsys, "policy", "show")
    assert code == 0 and "default policy: settings.default_policy in /idle-reaper/settings@v1" in out


def test_show_an_invalid_stored_policy_names_the_parameter_and_the_field(account, capsys):
    aws_ssm().put_parameter(Name=ML, Value='{"idle_minutes": 60, "warn_minutes": 60}', Type="String", Overwrite=True)
    code, _, err = run(capsys, "policy", "show", "ml")
    assert code == 1
    assert f"{ML}: warn_minutes: warn_minutes (60) must be shorter than idle_minutes (60)" in err
    assert "safe mode" in err


def test_list_teams_versions_and_machines(account, capsys):
    ssm = aws_ssm()
    ssm.put_parameter(Name=ML, Value='{"idle_minutes": 60}', Type="String", Overwrite=True)
    ssm.put_parameter(Name="/idle-reaper/teams/nlp", Value='{"idle_minutes": 1}', Type="String")
    for n, t in enumerate(("ml", "ml", "vision")):
        local.launch(f"box{n}", "m5.large", team=t, launch_time=at(8))
    code, out, _ = run(capsys, "policy", "list", "--json")
    assert code == 0
    rows = {r["team"]: r for r in map(json.loads, out.splitlines())}
    assert (rows["ml"]["version"], rows["ml"]["machines"], rows["ml"]["status"]) == (2, 2, "ok")
    assert rows["ml"]["last_modified"] is not None
    assert rows["nlp"]["machines"] == 0 and rows["nlp"]["status"].startswith("INVALID")
    assert rows["vision"] == {
        "team": "vision",
        "parameter": None,
        "version": None,
        "last_modified": None,
        "machines": 1,
        "status": "no parameter: default policy",
    }
    code, out, _ = run(capsys, "policy", "list")
    assert out.splitlines()[0].split() == ["TEAM", "VERSION", "LAST", "MODIFIED", "(UTC)", "MACHINES", "STATUS"]


# ---------------------------------------------------------------------------------------------
# plan


@pytest.fixture
def quiet_fleet(account):
    """Under ml's 90/30 policy at 15:00: `long` quiet 70 min (warned), `short` 40 min (idle), `busy` busy."""
    ids = {
        "long": local.launch("long", "m5.large", team="ml", launch_time=at(8), owner="bob@example.com"),
        "short": local.launch("short", "m5.large", team="ml", launch_time=at(8), owner="ann@example.com"),
        "busy": local.launch("busy", "m5.large", team="ml", launch_time=at(8)),
    }
    local.write_metrics(ids["long"], quiet_from(at(13, 50)), at(13, 30), NOW)
    local.write_metrics(ids["short"], quiet_from(at(14, 20)), at(13, 30), NOW)
    local.write_metrics(ids["busy"], lambda t: (60.0, None), at(13, 30), NOW)
    return ids


def plan_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[:5] for line in out.splitlines() if line.startswith("i-")}


def test_plan_lists_machines_that_would_now_be_warned_or_stopped(quiet_fleet, tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 60, "warn_minutes": 20})
    code, out, err = run(capsys, "policy", "plan", "ml", path, "--now", NOW.isoformat())
    assert code == 0, err
    rows = plan_rows(out)
    assert rows[quiet_fleet["long"]][3:] == ["warned", "stopped"]
    assert rows[quiet_fleet["short"]][3:] == ["none", "warned"]
    assert quiet_fleet["busy"] not in rows
    assert "2 machines would be warned or stopped that were not before, 0 the reverse, 1 unchanged" in out
    assert f"current: {ML}@v1" in out
    assert aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).all_records() == [], "a plan writes nothing"


def test_plan_shows_the_reverse_too(quiet_fleet, tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 240, "warn_minutes": 30})
    code, out, _ = run(capsys, "policy", "plan", "ml", path, "--now", NOW.isoformat())
    assert code == 0
    assert plan_rows(out)[quiet_fleet["long"]][3:] == ["warned", "none"]
    assert "0 machines would be warned or stopped that were not before, 1 the reverse" in out


def test_put_with_plan_prints_the_plan_before_writing(quiet_fleet, tmp_path, capsys):
    path = write(tmp_path, {"idle_minutes": 60, "warn_minutes": 20})
    code, out, _ = run(capsys, "policy", "put", "ml", path, "--plan", "--yes", "--now", NOW.isoformat())
    assert code == 0
    assert out.index("+++ ") < out.index("plan for team ml") < out.index(f"wrote {ML} v2")


# ---------------------------------------------------------------------------------------------
# status


def test_status_shows_the_lifecycle_with_owner_snooze_and_next_action(quiet_fleet, capsys):
    adapters = Adapters.from_environment(notifier=LoggingNotifier(logger, delivers=True))
    run_sweep(adapters, now=NOW)
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    record = store.load([quiet_fleet["short"]])[quiet_fleet["short"]]
    from dataclasses import replace

    store.save(
        replace(
            record,
            version=record.version + 1,
            state=State.SNOOZED,
            snoozed_until=NOW + timedelta(hours=2),
            snoozed_by="U0ANN",
        )
    )
    code, out, _ = run(capsys, "status", "--json", "--now", (NOW + timedelta(minutes=5)).isoformat())
    assert code == 0
    rows = {r["instance_id"]: r for r in map(json.loads, out.splitlines())}
    long, short, busy = (rows[quiet_fleet[k]] for k in ("long", "short", "busy"))
    assert (long["state"], long["owner"], long["name"]) == ("warned", "bob@example.com", "long")
    assert long["next_action"] == "stop if still idle" and long["next_at"] == (NOW + timedelta(minutes=30)).isoformat()
    assert long["idle_since"] == at(13, 50).isoformat()
    assert (short["state"], short["snoozed_by"]) == ("snoozed", "U0ANN")
    assert short["snoozed_until"] == (NOW + timedelta(hours=2)).isoformat()
    assert short["next_at"] == short["snoozed_until"]
    assert busy["state"] == "active" and busy["next_action"] == "warn after 60 min quiet"
    # When each machine was read and when it next must be: a busy one about hourly, a warned one every sweep.
    assert busy["last_read"] == NOW.isoformat() and busy["next_read_why"].startswith("busy until")
    assert NOW < datetime.fromisoformat(busy["next_read"]) <= NOW + timedelta(hours=1)
    assert (long["last_read"], long["next_read"], long["next_read_why"]) == (
        NOW.isoformat(),
        None,
        "read at every sweep",
    )

    code, out, _ = run(capsys, "status", "--owner", "BOB@example.com", "--now", NOW.isoformat())
    lines = out.splitlines()
    assert code == 0 and lines[1].split()[:5] == ["INSTANCE", "NAME", "TEAM", "OWNER", "STATE"]
    assert len(lines) == 3 and quiet_fleet["long"] in lines[2] and "warned" in lines[2]
    code, out, _ = run(capsys, "status", "--team", "nobody", "--json")
    assert code == 0 and out == ""


def test_an_invalid_stored_policy_is_alerted_once_through_the_state_table(account, capsys):
    aws_ssm().put_parameter(Name=ML, Value='{"idle_minutes": 5}', Type="String", Overwrite=True)
    local.launch("box", "m5.large", team="ml", launch_time=at(8))
    notifier = LoggingNotifier(logger)
    adapters = Adapters.from_environment(notifier=notifier)
    for minutes in (0, 5):
        (d,) = run_sweep(adapters, now=NOW + timedelta(minutes=minutes)).decisions
        assert d.state is State.SAFE_MODE
    alerts = [text for kind, text in notifier.sent if kind == "admin_alert"]
    assert len(alerts) == 1 and f"{ML}: idle_minutes" in alerts[0]
    # A second Lambda (a fresh notifier, same table) does not alert again.
    other = LoggingNotifier(logger)
    run_sweep(Adapters.from_environment(notifier=other), now=NOW + timedelta(minutes=10))
    assert other.sent == []


def aws_ssm():
    return aws.client("ssm")


def aws_module_create_table() -> None:
    aws.create_table(aws.client("dynamodb"), aws.table_name())


def test_show_in_a_member_account_names_the_organization_entry_its_default_comes_from(org, capsys):  # noqa: F811
    local.init_account(teams={"ml": json.dumps({"idle_minutes": 90, "warn_minutes": 30})})
    organization = {
        "defaults": [{"accounts": [org.sandbox], "default_policy": {"idle_minutes": 30, "warn_minutes": 10}}]
    }
    aws_ssm().put_parameter(Name="/idle-reaper/organization", Value=json.dumps(organization), Type="String")
    sandbox, training = org.accounts["alice-sandbox"], org.accounts["training"]
    code, out, _ = run(capsys, "policy", "show", "--account", sandbox, "--json")
    shown = json.loads(out)
    label = f"organization.defaults[0].default_policy (account {sandbox} via {org.sandbox})"
    assert code == 0 and shown["account"] == sandbox and shown["policy"]["idle_minutes"] == 30
    assert shown["sources"]["idle_minutes"] == label and shown["sources"]["gpu_threshold_percent"] == "built-in default"
    code, out, _ = run(capsys, "policy", "show", "--account", sandbox)
    assert code == 0 and out.splitlines()[0] == f"default policy in account {sandbox}: {label}"
    # A team's own fields are its parameter's, in every account.
    code, out, _ = run(capsys, "policy", "show", "ml", "--account", sandbox, "--json")
    shown = json.loads(out)
    assert shown["sources"]["idle_minutes"] == f"team parameter {ML}@v1" and shown["policy"]["idle_minutes"] == 90
    # An account no entry names follows settings.default_policy, as everywhere.
    code, out, _ = run(capsys, "policy", "show", "--account", training, "--json")
    assert code == 0 and json.loads(out)["sources"]["idle_minutes"].startswith("settings.default_policy (")
    # Not an account id: a clear error, nothing read.
    with pytest.raises(SystemExit) as raised:
        cli.main(["policy", "show", "--account", "12345"])
    assert raised.value.code == 2 and "not an AWS account id (12 digits): '12345'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# What SSM can hold (issue 43, 5)


def test_put_a_policy_of_400_members_is_stored_in_the_tier_that_holds_it(account, tmp_path, capsys):
    """A valid policy of 400 members was written re-indented (7,243 characters) without a tier, and SSM's
    Standard tier holds 4,096: it could never be written. It is written compact, in the Advanced tier, and the
    admin is told what that costs; a small policy stays indented, in the Standard tier."""
    members = [f"U{n:010d}" for n in range(400)]
    code, out, err = run(capsys, "policy", "put", "ml", write(tmp_path, {"members": members}), "--yes")
    assert code == 0, err
    assert "stored in the Advanced tier, which AWS charges $0.05 a month for" in out
    assert json.loads(stored().value) == {"members": members}
    tiers = {p["Name"]: p["Tier"] for p in aws.client("ssm").describe_parameters()["Parameters"]}
    assert tiers[ML] == "Advanced"
    code, out, _ = run(capsys, "policy", "put", "vision", write(tmp_path, {"idle_minutes": 45}), "--yes")
    assert code == 0 and "Advanced" not in out and stored("/idle-reaper/teams/vision").value.startswith("{\n  ")
    # Back under 4,096 characters: SSM cannot move it back to Standard, and it is written all the same.
    assert run(capsys, "policy", "put", "ml", write(tmp_path, {"idle_minutes": 45}), "--yes")[0] == 0
    assert stored().version == 3


def test_put_a_policy_no_tier_holds_names_the_limit_and_writes_nothing(account, tmp_path, capsys):
    """500 member ids (as many as the schema allows) of 15 characters: 9,013 characters even compact, and no SSM
    tier holds more than 8,192. Refused before the diff or any write, naming the limit."""
    members = [f"U{n:014d}" for n in range(500)]
    path = write(tmp_path, json.dumps({"members": members}, separators=(",", ":")))
    code, out, err = run(capsys, "policy", "put", "ml", path, "--yes")
    assert code == 1 and "---" not in out
    assert f"{path}: too large: 9013 characters (at most 8192: SSM's Advanced tier holds no more)" in err
    assert "nothing was written" in err and stored().version == 1
    with pytest.raises(aws.TooLargeToStore, match="holds at most 8,192"):
        aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix()).put(ML, json.dumps({"members": members}))
    assert stored().version == 1


def test_validate_settings_says_which_tier_they_need(tmp_path, capsys):
    """Settings are stored by hand: `policy validate --settings` says when they need the Advanced tier."""
    small = write(tmp_path, Settings().model_dump_json(indent=2), "small.json")
    assert run(capsys, "policy", "validate", "--settings", small)[1] == f"{small}: valid\n"
    admins = [f"U{n:010d}" for n in range(100)]
    large = write(tmp_path, Settings(admins=admins).model_dump_json(indent=2), "large.json")
    code, out, _ = run(capsys, "policy", "validate", "--settings", large)
    assert code == 0 and "over the 4,096 of SSM's Standard tier: store it in the Advanced tier" in out
