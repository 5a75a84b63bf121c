"""The policies a replay runs under: one team policy for every team, or a default with per-team overrides;
a bad policy file is a clear error naming the file and the field, and the replay does not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_support import DATA, SHORT, run_json

from idle_reaper.policy import PolicyError, TeamPolicy
from idle_reaper_tools.cli import main
from idle_reaper_tools.replay import PolicySet, load_policies


def test_no_file_is_the_built_in_default() -> None:
    policies = load_policies(None)
    assert policies == PolicySet()
    assert policies.for_team("anyone") == TeamPolicy()
    assert policies.describe() == "idle 90 min, warn 30 min before, CPU < 5%, GPU < 5%, max gap 15 min"


def test_one_team_policy_applies_to_every_team(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({**SHORT, "network_threshold_bytes_per_second": 2000}))
    policies = load_policies(path)
    assert policies.source == str(path) and policies.teams == {}
    for team in ("ml", "data"):
        assert (policies.for_team(team).idle_minutes, policies.for_team(team).warn_minutes) == (30, 10)
        assert policies.ref(team).team == team and policies.ref(team).source == str(path)
    assert policies.describe().endswith("GPU < 5%, network < 2,000 B/s, max gap 15 min")


def test_team_overrides_start_from_the_files_default(tmp_path: Path) -> None:
    path = tmp_path / "teams.json"
    path.write_text(
        json.dumps(
            {
                "default_policy": {**SHORT, "cpu_threshold_percent": 3},
                "teams": {"data": {"idle_minutes": 90, "warn_minutes": 30}},
                "gpu_instance_families": ["p5", "g6"],
            }
        )
    )
    policies = load_policies(path)
    data, other = policies.for_team("data"), policies.for_team("ml")
    assert (data.idle_minutes, data.cpu_threshold_percent) == (90, 3.0)  # the override, on the file's default
    assert (other.idle_minutes, other.cpu_threshold_percent) == (30, 3.0)
    assert policies.gpu_families == ("p5", "g6")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"idle_minutes": 30, "warn_minutes": 45}', "warn_minutes"),
        ('{"idle_minutes": 30', "policy.json"),  # not JSON
        ('{"default_policy": {}, "team": {}}', "team: unknown key"),
        ('{"teams": ["ml"]}', "teams: expected an object"),
        ('{"teams": {"ml": {"idle_minutes": 5}}}', "teams.ml"),
        ('{"default_policy": {"cpu_threshold_percent": 120}}', "default_policy"),
        ('{"gpu_instance_families": "p5"}', "gpu_instance_families: expected a list"),
    ],
)
def test_a_bad_policy_file_names_the_field(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "policy.json"
    path.write_text(content)
    with pytest.raises(PolicyError) as caught:
        load_policies(path)
    assert str(caught.value).startswith(str(path)) and words in str(caught.value)


def test_an_unreadable_policy_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policies(tmp_path / "absent.json")


def test_invalid_policy_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"idle_minutes": 30, "warn_minutes": 45}))
    assert main(["replay", str(DATA / "replay-cpu-box.csv"), "--policy", str(policy)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "warn_minutes" in err


def test_per_team_policies_from_a_structured_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The data team keeps the 90-min default: 2 h of quiet minus the window = 30 min, stopped at
    # 02:00 when warned at 01:30 and quiet since 00:30 (no earlier: 24 quiet buckets, stop at 18).
    policy = tmp_path / "teams.json"
    policy.write_text(
        json.dumps({"default_policy": SHORT, "teams": {"data": {"idle_minutes": 90, "warn_minutes": 30}}})
    )
    out = run_json(capsys, str(DATA / "replay-cpu-box.csv"), "--policy", str(policy))
    assert (out["recovered_hours"], out["ideal_hours"]) == (0.5, 0.5)
