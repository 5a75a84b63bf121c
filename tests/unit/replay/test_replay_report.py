"""The report: the JSON's shape, the text report's figures and events, prices (missing, malformed, partial),
and a real (NAB) excerpt end to end."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from replay_support import DATA, SHORT_POLICY, run_json, small_fleet_text, write_short_policy

from idle_reaper_tools.cli import main
from idle_reaper_tools.replay import ReplayOptions, format_report, parse_trace, read_trace, replay

FIGURES = {
    "machines",
    "machine_days",
    "idle_hours",
    "ideal_hours",
    "recovered_hours",
    "recovery_ratio",
    "stopped_hours",
    "stops",
    "false_stops",
    "person_active_stops",
    "stops_followed_by_activity",
    "unwanted_stop_share",
    "warnings",
    "warnings_without_stop",
    "warnings_without_stop_share",
    "messages",
    "owner_days",
    "messages_per_owner_day",
    "warnings_per_machine_day",
    "silent_warnings",
    "snoozes",
    "dollars_saved",
    "ideal_dollars",
    "unpriced_hours",
    "core_calls",
}
RUN = {"trace", "period_minutes", "policy", "price_table", "still_wanted_minutes", "snooze_rate", "replay_seconds"}


def test_json_keys_with_a_baseline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    short_policy = write_short_policy(tmp_path)
    out = run_json(capsys, str(DATA / "replay-gpu-training.csv"), "--policy", short_policy, "--baseline=cloudwatch-cpu")
    keys = {
        "idle_hours",
        "recovered_hours",
        "recovery_ratio",
        "false_stops",
        "warnings_per_machine_day",
        "dollars_saved",
    }
    assert keys <= out.keys()
    assert keys <= out["baseline"].keys()
    assert out["baseline"]["name"] == "cloudwatch-cpu"
    assert {"stops_followed_by_activity", "snoozes", "unpriced_hours", "teams"} <= out.keys()
    assert out["teams"]["training"]["recovered_hours"] == 1.5
    no_baseline = run_json(capsys, str(DATA / "replay-gpu-training.csv"))
    assert "baseline" not in no_baseline


def test_json_shape_and_teams_add_up_to_the_fleet() -> None:
    t = parse_trace(io.StringIO(small_fleet_text(12, 2)), "generated")
    out = json.loads(json.dumps(replay(t, ReplayOptions(snooze_rate=0.5), baseline="cloudwatch-cpu").to_json()))
    assert out.keys() == RUN | FIGURES | {"teams", "baseline"}
    assert out["baseline"].keys() == FIGURES | {"name", "teams"}
    assert (out["trace"], out["period_minutes"], out["snooze_rate"]) == ("generated", 5, 0.5)
    assert out["policy"]["source"] == "default policy" and out["policy"]["default"]["idle_minutes"] == 90
    assert "teams" not in out["policy"]  # no per-team overrides
    for report in (out, out["baseline"]):
        teams = report["teams"]
        assert len(teams) > 1 and list(teams) == sorted(teams)
        assert all(figures.keys() == FIGURES for figures in teams.values())
        for key in ("machines", "stops", "false_stops", "warnings", "snoozes", "core_calls"):
            assert sum(figures[key] for figures in teams.values()) == report[key], key
        for key in ("idle_hours", "recovered_hours", "dollars_saved"):
            assert sum(figures[key] for figures in teams.values()) == pytest.approx(report[key], abs=0.02), key
    assert out["snoozes"] > 0 and out["baseline"]["snoozes"] == 0


def test_text_report_shows_both_reapers_side_by_side_and_the_false_stops() -> None:
    t = read_trace(DATA / "replay-gpu-training.csv")
    text = format_report(replay(t, ReplayOptions(policies=SHORT_POLICY), baseline="cloudwatch-cpu"))
    lines = text.splitlines()
    assert lines[0].startswith(f"replay of {DATA / 'replay-gpu-training.csv'}: 1 machines, 0.2 machine-days")
    assert "idle 30 min, warn 10 min before" in lines[1]
    assert lines[4].split() == ["idle-reaper", "cloudwatch-cpu", "alarm"]
    rows = {line[:38].strip(): line[38:].split() for line in lines[5:22]}
    assert rows["false stops (busy within the window)"] == ["0", "4"]
    assert rows["recovered hours"] == ["1.5", "2.0"] and rows["dollars saved"] == ["$1.51", "$2.01"]
    assert rows["stops followed by activity <= 60 min"] == ["0", "3"]
    team_row = next(line for line in lines if line.strip().startswith("training"))
    assert team_row.split() == ["training", "1", "2.0", "1.5", "$1.51", "1", "1", "0"]
    # Only the alarm has notable stops: four false stops, three of them with the job back 0 min later.
    assert "idle-reaper: false stops" not in text
    events = lines[lines.index("cloudwatch-cpu: false stops and stops followed by activity (first 8):") + 1 :]
    assert len(events) == 4 and all("i-gpu FALSE STOP" in e for e in events)
    assert sum("activity 0 min later" in e for e in events) == 3
    short = format_report(replay(t, ReplayOptions(policies=SHORT_POLICY), baseline="cloudwatch-cpu"), max_events=2)
    assert sum("FALSE STOP" in line for line in short.splitlines()) == 2


def test_text_report_without_prices_and_with_input_notes() -> None:
    rows = ["2026-01-05T00:00:00Z,i-1,104", *(f"2026-01-05T{h:02d}:{m:02d}:00Z,i-1,1" for h in (0, 1) for m in (5, 35))]
    t = parse_trace(
        io.StringIO("timestamp,instance_id,cpu\n" + "\n".join(rows) + "\n"), "t.csv", clamp_utilization=True
    )
    text = format_report(replay(t, prices=None))
    assert "input: 1 values above 100 read as 100" in text
    assert "prices: unknown (no usable price table)" in text
    assert [line.split()[-1] for line in text.splitlines() if line.startswith("dollars saved")] == ["unknown"]


@pytest.mark.parametrize("table", ["missing.json", "malformed.json"])
def test_a_bad_price_table_makes_savings_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str
) -> None:
    short_policy = write_short_policy(tmp_path)
    (tmp_path / "malformed.json").write_text('{"m5.large": "cheap"')
    argv = [str(DATA / "replay-cpu-box.csv"), "--policy", short_policy, "--price-table", str(tmp_path / table)]
    assert main(["replay", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["dollars_saved"] is None and out["unpriced_hours"] is None
    assert out["recovered_hours"] == 1.5  # the rest of the report is there
    assert f"price table {tmp_path / table}" in captured.err and "unknown" in captured.err
    assert main(["replay", *argv]) == 0
    assert "dollars saved" in capsys.readouterr().out


def test_instance_types_missing_from_the_table_are_unpriced_hours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short_policy = write_short_policy(tmp_path)
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"g5.xlarge": 2.0}))
    out = run_json(capsys, str(DATA / "replay-cpu-box.csv"), "--policy", short_policy, "--price-table", str(table))
    assert (out["dollars_saved"], out["unpriced_hours"]) == (0.0, 1.5)  # m5.large is not in the table


def test_real_nab_excerpt_replays(capsys: pytest.CaptureFixture[str]) -> None:
    # Off-grid timestamps (14:27, 14:32, ...), no team or instance type: priced with --instance-type.
    out = run_json(
        capsys, str(DATA / "nab-ec2-excerpt.csv"), "--instance-type", "m5.large", "--baseline=cloudwatch-cpu"
    )
    assert out["machines"] == 2 and out["machine_days"] == pytest.approx(6.0, abs=0.01)
    assert out["false_stops"] == 0
    assert 0 < out["recovered_hours"] <= out["ideal_hours"] <= out["idle_hours"]
    assert out["dollars_saved"] == pytest.approx(out["recovered_hours"] * 0.096, abs=0.01)
    assert main(["replay", str(DATA / "nab-ec2-excerpt.csv")]) == 0
    text = capsys.readouterr().out
    assert "recovered hours" in text and "nab-fe7f93" in text
