"""`idle-reaper replay` wiring: bad option values are refused before anything runs (exit 2, argparse's
message), and the options reach the replay."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from replay_support import DATA, run_json

from idle_reaper_tools.cli import main


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--snooze-rate", "2", "a fraction from 0 to 1, got 2"),
        ("--snooze-rate", "often", "not a number: 'often'"),
        ("--period-minutes", "0", "from 1 to 60 minutes, got 0"),
        ("--period-minutes", "61", "from 1 to 60 minutes, got 61"),
        ("--period-minutes", "2.5", "not a whole number of minutes: '2.5'"),
        ("--still-wanted-minutes", "-1", "0 or more minutes, got -1"),
        ("--unwanted-within", "soon", "not a whole number of minutes: 'soon'"),
        ("--baseline", "cpu", "invalid choice: 'cpu'"),
        ("--waiting", '{"profile_days": 15}', "invalid waiting rule: profile_days: Input should be less than or equal"),
        ("--waiting", '{"profile_dayz": 7}', "invalid waiting rule: profile_dayz: Extra inputs are not permitted"),
        ("--waiting", "[7", "invalid waiting rule: JSON: Invalid JSON"),
    ],
)
def test_bad_option_values_exit_2_with_the_reason(
    capsys: pytest.CaptureFixture[str], option: str, value: str, words: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["replay", str(DATA / "replay-cpu-box.csv"), option, value])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    # an option with an alias is named with it: "argument --unwanted-within/--still-wanted-minutes: ..."
    assert re.search(rf"argument (\S+/)?{option}(/\S+)?: {re.escape(words)}", err), err


def test_options_reach_the_replay(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        str(DATA / "replay-cpu-box.csv"),
        "--period-minutes=10",
        "--still-wanted-minutes=0",
        "--snooze-rate=0.25",
    )
    assert (out["period_minutes"], out["still_wanted_minutes"], out["snooze_rate"]) == (10, 0, 0.25)
    assert out["machine_days"] == pytest.approx(3 / 24, abs=1e-3)  # 18 buckets of 10 min
    assert main(["replay", str(DATA / "replay-cpu-box.csv"), "--period-minutes", "10"]) == 0
    assert "a sweep every 10 min" in capsys.readouterr().out


def test_the_waiting_rule_reaches_the_core(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A machine with no history under history waiting: the fleet's 30 % plus its uncertainty holds the warning
    # past the box's quiet hour; without the confidence margin it is warned and stopped.
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"history_wait_percent": 35, "adaptive_wait_max_minutes": 60}))
    box = str(DATA / "replay-cpu-box.csv")
    assert run_json(capsys, box, "--policy", str(policy))["stops"] == 0
    assert run_json(capsys, box, "--policy", str(policy), "--waiting", '{"confidence": 0}')["stops"] == 1


def test_a_network_policy_on_a_trace_without_network_warns_that_all_is_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"network_threshold_bytes_per_second": 1000}))
    assert main(["replay", str(DATA / "replay-cpu-box.csv"), "--policy", str(policy), "--json"]) == 0
    captured = capsys.readouterr()
    assert "the trace has no network column; every machine will be unknown" in captured.err
    out = json.loads(captured.out)
    assert (out["idle_hours"], out["stops"]) == (0.0, 0)
