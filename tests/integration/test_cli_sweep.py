"""`idle-reaper init` and `idle-reaper sweep` end to end against moto."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest

from idle_reaper import aws
from idle_reaper.core import MachineRecord, State
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at

pytestmark = pytest.mark.integration

NOW = at(15)


def idle(_t):
    return (1.0, None)


def busy_gpu(_t):
    return (2.0, 95.0)


@pytest.fixture
def fleet(aws, slack):
    slack.users_by_email["bob@example.com"] = "U0BOB"
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    ids = {
        "idle": local.launch("idle", "m5.large", team="ml", launch_time=at(8), owner="bob@example.com"),
        "train": local.launch("train", "g5.xlarge", team="ml", launch_time=at(8)),
        "nogpu": local.launch("nogpu", "p3.2xlarge", team="ml", launch_time=at(8)),
    }
    local.write_metrics(ids["idle"], idle, at(12), NOW + timedelta(hours=1))
    local.write_metrics(ids["train"], busy_gpu, at(12), NOW + timedelta(hours=1))
    local.write_metrics(ids["nogpu"], idle, at(12), NOW + timedelta(hours=1))  # a GPU box with no GPU metrics
    return ids


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_init_is_idempotent(aws, capsys):
    code, out, _ = run(capsys, "init")
    assert code == 0 and "created" in out
    code, out, _ = run(capsys, "init")
    assert code == 0 and "already exists" in out
    settings = aws_settings()
    assert json.loads(settings)["default_policy"]["idle_minutes"] == 90


def aws_settings() -> str:
    return aws.client("ssm").get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"]


def test_sweep_json_prints_one_object_per_machine(fleet, capsys):
    code, out, _ = run(capsys, "sweep", "--json", "--now", NOW.isoformat())
    assert code == 0
    rows = {r["instance_id"]: r for r in map(json.loads, out.splitlines())}
    assert set(rows) == set(fleet.values())
    for row in rows.values():
        assert {"instance_id", "team", "state", "action", "reason"} <= set(row)
    assert rows[fleet["idle"]]["action"] == "warn"
    assert rows[fleet["train"]]["state"] == "active" and rows[fleet["train"]]["action"] == "none"
    assert rows[fleet["nogpu"]]["state"] == "unknown" and "missing_gpu_metrics=busy" in rows[fleet["nogpu"]]["reason"]


def test_sweep_table_is_readable(fleet, capsys):
    code, out, _ = run(capsys, "sweep", "--now", NOW.isoformat())
    assert code == 0
    assert out.splitlines()[1].split()[:5] == ["INSTANCE", "TEAM", "STATE", "ACTION", "REASON"]
    assert fleet["idle"] in out


def test_dry_run_reports_would_stop_and_changes_nothing(fleet, capsys):
    code, out, _ = run(capsys, "sweep", "--json", "--dry-run", "--now", NOW.isoformat())
    assert code == 0
    rows = {r["instance_id"]: r for r in map(json.loads, out.splitlines())}
    assert rows[fleet["idle"]]["action"] == "would_stop"
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    assert store.all_records() == []
    assert set(local.instance_states(list(fleet.values())).values()) == {"running"}


def test_warn_then_stop_across_sweeps(fleet, capsys):
    run(capsys, "sweep", "--json", "--now", NOW.isoformat())
    _, out, _ = run(capsys, "sweep", "--json", "--now", (NOW + timedelta(minutes=19)).isoformat())
    rows = {r["instance_id"]: r for r in map(json.loads, out.splitlines())}
    assert rows[fleet["idle"]]["action"] == "none" and rows[fleet["idle"]]["state"] == "warned"
    _, out, _ = run(capsys, "sweep", "--json", "--now", (NOW + timedelta(minutes=20)).isoformat())
    rows = {r["instance_id"]: r for r in map(json.loads, out.splitlines())}
    assert rows[fleet["idle"]]["action"] == "stop"
    states = local.instance_states(list(fleet.values()))
    assert states == {fleet["idle"]: "stopped", fleet["train"]: "running", fleet["nogpu"]: "running"}


def test_invalid_settings_exit_non_zero_and_change_nothing(fleet, capsys):
    aws.client("ssm").put_parameter(
        Name="/idle-reaper/settings", Value='{"dry_run": "maybe", "colour": 1}', Type="String", Overwrite=True
    )
    code, out, err = run(capsys, "sweep", "--now", (NOW + timedelta(hours=3)).isoformat())
    assert code == 2 and out == ""
    assert "/idle-reaper/settings" in err and "dry_run" in err and "colour" in err
    assert set(local.instance_states(list(fleet.values())).values()) == {"running"}


def test_bad_now_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["sweep", "--now", "yesterday"])
    assert exc.value.code == 2
    assert "not an ISO-8601 time" in capsys.readouterr().err


def test_state_table_writes_are_conditional(aws):
    aws_client = local.aws.client("dynamodb")
    local.aws.create_table(aws_client, local.aws.table_name())
    store = local.aws.DynamoStateStore(aws_client, local.aws.table_name())
    first = MachineRecord("i-1", "ml", State.IDLE, version=1, idle_since=NOW)
    assert store.save(first)
    assert not store.save(first), "a second writer with the same expected version must lose"
    assert store.save(replace(first, version=2, state=State.WARNED, warned_at=NOW))
    assert store.load(["i-1"])["i-1"] == replace(first, version=2, state=State.WARNED, warned_at=NOW)


def test_a_team_tag_without_the_opt_in_tag_is_never_swept(fleet, capsys):
    """`Team` is a common cost-allocation tag: production machines carry it too. Only the reaper's own
    opt-in (`idle-reaper:managed=true`) makes a machine reapable."""
    prod = local.launch("prod-db", "m5.large", team="ml", launch_time=at(8), managed=False)
    local.write_metrics(prod, idle, at(12), NOW + timedelta(hours=1))
    for minutes in range(0, 120, 15):
        code, out, _ = run(capsys, "sweep", "--now", (NOW + timedelta(minutes=minutes)).isoformat(), "--json")
        assert code == 0
        assert prod not in out
    assert local.instance_states([prod, fleet["idle"]]) == {prod: "running", fleet["idle"]: "stopped"}
