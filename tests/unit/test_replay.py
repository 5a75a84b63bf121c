"""Trace replay: the real decision core over hand-made traces whose answers are worked out by hand,
every kind of bad input, the JSON report, the price-table failure path, and a real (NAB) excerpt.

Most traces here use a short policy so they stay small: idle window 30 min (6 buckets of 5 min), the
warning 10 min before the stop (at 20 min of quiet), max gap 15 min. Bucket i starts at T0 + 5i min; the
sweep at the start of bucket k sees buckets < k.
"""

from __future__ import annotations

import gzip
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.cli import main
from idle_reaper_tools.replay import (
    PolicySet,
    ReplayOptions,
    TraceError,
    parse_trace,
    read_trace,
    replay,
)
from testkit.generate_trace import fleet, generate, write_trace

DATA = Path(__file__).resolve().parents[1] / "data"
SAMPLE = Path(__file__).resolve().parents[2] / "testkit" / "sample-trace.csv.gz"
T0 = datetime(2026, 1, 5, tzinfo=UTC)
SHORT = {"idle_minutes": 30, "warn_minutes": 10}
SHORT_POLICY = PolicySet(default=TeamPolicy(**SHORT))  # type: ignore[arg-type]


def ts(i: int) -> str:
    return (T0 + timedelta(minutes=5 * i)).strftime("%Y-%m-%dT%H:%M:%SZ")


def csv_rows(instance: str, cpu: list[float | None], tail: str = "") -> list[str]:
    """One row per bucket from T0; None: no row (a gap)."""
    return [f"{ts(i)},{instance},{v:g}{tail}" for i, v in enumerate(cpu) if v is not None]


def trace(text_rows: list[str], header: str = "timestamp,instance_id,cpu") -> Any:
    return parse_trace(io.StringIO("\n".join([header, *text_rows]) + "\n"), "test.csv")


@pytest.fixture
def short_policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(SHORT))
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["replay", *argv, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


# ---------------------------------------------------------------------------------------------
# Hand-made traces, answers by hand


def test_cpu_box_recovers_exactly_the_ideal(capsys: pytest.CaptureFixture[str], short_policy: str) -> None:
    # replay-cpu-box.csv, m5.large ($0.096/h): CPU 50 % in buckets 0-5, 1 % in 6-29, 50 % in 30-35.
    # Quiet stretch 6-29 = 24 buckets = 2.0 h of idle; the ideal stops it at 6 + 6 = bucket 12 and it
    # stays stopped until the activity at 30: buckets 12-29 = 18 = 1.5 h.
    # idle-reaper: quiet since 00:30 (end of bucket 5); warned at 00:50 (20 min quiet); at 01:00 the
    # window 00:30-01:00 is all quiet and the warning is 10 min old: stop. Stopped 12-29 = 1.5 h,
    # restarted by the activity at 02:30, 90 min later (> 60: not "wanted back").
    # The CPU alarm: 6 breaching datapoints (buckets 6-11) -> stops at 01:00 too.
    out = run_json(capsys, str(DATA / "replay-cpu-box.csv"), "--policy", short_policy, "--baseline", "cloudwatch-cpu")
    assert out["idle_hours"] == 2.0
    assert out["ideal_hours"] == 1.5
    assert out["recovered_hours"] == 1.5
    assert out["recovery_ratio"] == 1.0
    assert (out["stops"], out["false_stops"], out["stops_followed_by_activity"]) == (1, 0, 0)
    assert out["warnings"] == 1
    assert out["warnings_per_machine_day"] == 8.0  # 1 warning in 36 buckets = 3 h = 1/8 day
    assert out["dollars_saved"] == 0.14  # 1.5 h x $0.096
    base = out["baseline"]
    assert (base["recovered_hours"], base["stops"], base["false_stops"], base["warnings"]) == (1.5, 1, 0, 0)


def test_cpu_alarm_stops_a_gpu_busy_machine_and_idle_reaper_does_not(
    capsys: pytest.CaptureFixture[str], short_policy: str
) -> None:
    # replay-gpu-training.csv, g5.xlarge ($1.006/h): CPU 2 % throughout; GPU 90 % in buckets 0-23
    # (training), 0 % in 24-47. Idle 2.0 h; the ideal stops at 24 + 6 = 30: buckets 30-47 = 1.5 h.
    # idle-reaper: busy on GPU until 02:00; warned 02:20, stopped 02:30 (bucket 30): 1.5 h, no false stop.
    # The CPU alarm sees CPU < 5 % from the start: it stops at buckets 6, 12 and 18 (GPU busy in the
    # window: false stops; the training shows activity in the very next bucket, 0 min later: the
    # owner starts it again) and at 24 (GPU still busy in the window: a fourth false stop), then stays
    # stopped: buckets 24-47 = 2.0 h "recovered", more than the ideal, by killing the job 4 times.
    out = run_json(
        capsys, str(DATA / "replay-gpu-training.csv"), "--policy", short_policy, "--baseline", "cloudwatch-cpu"
    )
    assert (out["recovered_hours"], out["ideal_hours"], out["false_stops"], out["stops"]) == (1.5, 1.5, 0, 1)
    assert out["dollars_saved"] == 1.51  # 1.5 h x $1.006
    base = out["baseline"]
    assert (base["stops"], base["false_stops"], base["stops_followed_by_activity"]) == (4, 4, 3)
    assert base["recovered_hours"] == 2.0
    assert base["recovery_ratio"] == pytest.approx(2.0 / 1.5, abs=1e-4)


def test_a_gap_is_unknown_and_prevents_the_stop(short_policy: str) -> None:
    # replay-gap.csv: CPU 50 % in 0-5, 1 % in 6-7, no rows in 8-13 (30 min), 1 % in 14-16, 50 % in 17-22.
    # Quiet before the hole: 10 min observed (the unreported lag is not counted as quiet), short of
    # the 15-min warning point: never warned, never stopped; once the lag passes max_gap the machine
    # is unknown; after the hole quiet restarts at 01:10 and lasts 15 min.
    # Ideal 0: no covered quiet stretch is a window long. Idle hours: buckets
    # 6-7, the hole's first 3 (counted covered, as the core counts lag), 14-16 = 8 buckets = 0.667 h.
    result = replay(read_trace(DATA / "replay-gap.csv"), ReplayOptions(policies=SHORT_POLICY))
    summary = result.reaper.summary()
    assert (summary["stops"], summary["recovered_hours"], summary["ideal_hours"]) == (0, 0.0, 0.0)
    assert summary["idle_hours"] == pytest.approx(0.667, abs=1e-3)
    assert summary["recovery_ratio"] is None  # nothing to recover
    assert summary["warnings"] == 0

    # The same trace with the hole filled with quiet samples: quiet 6-16 (55 min) -> warned 00:50,
    # stopped 01:00 (bucket 12), wanted back by the activity at bucket 17, 25 min later.
    filled = trace(csv_rows("i-gap", [50.0] * 6 + [1.0] * 11 + [50.0] * 6))
    summary = replay(filled, ReplayOptions(policies=SHORT_POLICY)).reaper.summary()
    assert (summary["stops"], summary["stops_followed_by_activity"]) == (1, 1)
    assert summary["recovered_hours"] == pytest.approx(25 / 60, abs=1e-3)


def test_a_new_machine_is_not_idle_for_its_first_window() -> None:
    # CPU 1 % in buckets 0-23, then 50 % in 24-29; the first sample is the launch time (00:00).
    # The ideal stops at bucket 6. idle-reaper: "started less than one idle window ago" until 00:30,
    # then quiet 30 min >= 20: warned at 00:30, stopped at 00:40 (bucket 8): buckets 8-23 = 16 = 1.333 h.
    # The alarm has no launch rule and no warning: stopped at bucket 6, 1.5 h.
    t = trace(csv_rows("i-new", [1.0] * 24 + [50.0] * 6))
    result = replay(t, ReplayOptions(policies=SHORT_POLICY), baseline="cloudwatch-cpu")
    summary = result.reaper.summary()
    assert summary["recovered_hours"] == pytest.approx(16 / 12, abs=1e-3)
    assert summary["recovery_ratio"] == pytest.approx(16 / 18, abs=1e-4)
    assert [e.at for e in result.reaper.stops] == [T0 + timedelta(minutes=40)]
    assert result.baseline is not None and result.baseline.summary()["recovered_hours"] == 1.5


def test_assumed_snoozes_follow_the_core_until_the_daily_limit() -> None:
    # CPU 50 % in 0-5, then 1 % for 8.5 h (buckets 6-107). Every delivered warning is answered
    # "Keep 2 h" (rate 1.0), at most 3 a day. core.snooze() clears the warning, so each keep ends
    # in a fresh warning: 00:50 (kept to 02:50), 02:50 (to 04:50), 04:50 (to 06:50), 06:50 (refused:
    # 3 already today) -> stopped at 07:00 (bucket 84): buckets 84-107 = 2.0 h of the ideal 8.0 h
    # (stopped at bucket 12).
    policy = TeamPolicy(**SHORT, max_snooze_hours=8, max_snoozes_per_day=3, timezone="UTC")  # type: ignore[arg-type]
    t = trace(csv_rows("i-kept", [50.0] * 6 + [1.0] * 102))
    result = replay(t, ReplayOptions(policies=PolicySet(default=policy), snooze_rate=1.0))
    summary = result.reaper.summary()
    assert (summary["warnings"], summary["snoozes"], summary["stops"]) == (4, 3, 1)
    assert [e.at for e in result.reaper.stops] == [T0 + timedelta(hours=7)]
    assert (summary["recovered_hours"], summary["ideal_hours"]) == (2.0, 8.0)


def test_samples_in_one_period_are_bucketed_to_their_maximum() -> None:
    # Off-grid samples at 00:01 (3 %) and 00:04 (7 %) fall in the 00:00 bucket: its Maximum, 7 %, is busy.
    t = trace(["2026-01-05T00:01:00Z,i-1,3", "2026-01-05T00:04:00Z,i-1,7", "2026-01-05T00:11:00Z,i-1,1"])
    [s] = t.series
    assert list(s.cpu) == [7.0, pytest.approx(float("nan"), nan_ok=True), 1.0]


# ---------------------------------------------------------------------------------------------
# The fast paths and the process pool change nothing


def small_fleet_text(machines: int = 12, days: int = 3) -> str:
    out = io.StringIO()
    write_trace(fleet(machines, days, seed=3), T0, out)
    return out.getvalue()


@pytest.mark.parametrize(
    "source",
    ["replay-cpu-box.csv", "replay-gpu-training.csv", "replay-gap.csv", "nab-ec2-excerpt.csv", "generated"],
)
def test_fast_paths_match_calling_the_core_every_period(source: str) -> None:
    if source == "generated":
        t = parse_trace(io.StringIO(small_fleet_text()), "generated")
    else:
        t = read_trace(DATA / source)
    for policies in (PolicySet(), SHORT_POLICY):
        runs = [
            replay(t, ReplayOptions(policies=policies, fast_path=fast, timeline=True, snooze_rate=0.3), workers=1)
            for fast in (True, False)
        ]
        fast, slow = (r.reaper for r in runs)
        assert fast.stops == slow.stops
        assert runs[0].timeline == runs[1].timeline
        strip = lambda s: {k: v for k, v in s.items() if k != "core_calls"}  # noqa: E731
        assert strip(fast.summary()) == strip(slow.summary())
        assert fast.fleet.core_calls <= slow.fleet.core_calls


def test_worker_processes_give_the_same_report() -> None:
    t = parse_trace(io.StringIO(small_fleet_text(16, 2)), "generated")
    serial, parallel = (replay(t, baseline="cloudwatch-cpu", workers=w) for w in (1, 2))
    assert {**serial.to_json(), "replay_seconds": 0} == {**parallel.to_json(), "replay_seconds": 0}
    assert serial.reaper.stops == parallel.reaper.stops


def test_generated_fleet_never_false_stops_and_the_alarm_does() -> None:
    t = parse_trace(io.StringIO(small_fleet_text(16, 3)), "generated")
    result = replay(t, baseline="cloudwatch-cpu")
    reaper, alarm = result.reaper.summary(), result.to_json()["baseline"]
    assert reaper["false_stops"] == 0
    assert reaper["recovered_hours"] <= reaper["ideal_hours"] <= reaper["idle_hours"]
    assert alarm["false_stops"] > 0  # trainers and serving boxes: GPU busy, CPU low


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the line (and the column), exit 2, nothing on stdout

HEADER = "timestamp,instance_id,cpu,gpu,network"
GOOD = "2026-01-05T00:00:00Z,i-1,1,2,300"


@pytest.mark.parametrize(
    ("rows", "line", "column", "words"),
    [
        (["timestamp,instance_id,gpu", "2026-01-05T00:00:00Z,i-1,2"], 1, None, "missing column(s) cpu"),
        ([HEADER, GOOD, "2026-01-05T00:05:00,i-1,1,2,3", "5 Jan 2026,i-1,1,2,3"], 4, "timestamp", "ISO-8601"),
        ([HEADER, GOOD, "2026-01-05T00:10:00Z,i-1,1,2,3", "2026-01-05T00:05:00Z,i-1,1,2,3"], 4, None, "not sorted"),
        ([HEADER, GOOD, "2026-01-05T00:00:00Z,i-1,3,2,300"], 3, None, "duplicate sample for i-1"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,100.5,2,3"], 3, "cpu", "outside 0-100"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,1,-1,3"], 3, "gpu", "outside 0-100"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,1,2,-3"], 3, "network", "0 or more"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,busy,2,3"], 3, "cpu", "not a number"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,nan,2,3"], 3, "cpu", "outside 0-100"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,i-1,1,2"], 3, None, "expected 5 fields"),
        ([HEADER, GOOD, "2026-01-05T00:05:00Z,,1,2,3"], 3, "instance_id", "empty"),
        (
            ["timestamp,instance_id,cpu,team", "2026-01-05T00:00:00Z,i-1,1,ml", "2026-01-05T00:05:00Z,i-1,1,data"],
            3,
            "team",
            "was 'ml' at line 2",
        ),
    ],
)
def test_bad_input_names_the_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rows: list[str],
    line: int,
    column: str | None,
    words: str,
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}:{line}:" in err
    assert words in err
    if column:
        assert f"column {column!r}" in err


def test_rows_of_different_instances_may_interleave_in_any_order() -> None:
    t = trace(["2026-01-05T00:05:00Z,i-1,1", "2026-01-05T00:00:00Z,i-2,1", "2026-01-05T00:10:00Z,i-1,1"])
    assert [len(s) for s in t.series] == [2, 1]


@pytest.mark.parametrize("content", [b"", b"timestamp,instance_id,cpu\n"])
def test_empty_trace_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    path = tmp_path / "empty.csv"
    path.write_bytes(content)
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and str(path) in err


def test_missing_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "nope.csv")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "cannot read" in err


def test_real_export_quirks_are_opt_in() -> None:
    # Bitbrains-style: a value just over 100 and a repeated row. Errors by default, with a hint.
    rows = ["2026-01-05T00:00:00Z,i-1,104.2", "2026-01-05T00:00:00Z,i-1,104.2", "2026-01-05T00:05:00Z,i-1,1"]
    text = "timestamp,instance_id,cpu\n" + "\n".join(rows) + "\n"
    with pytest.raises(TraceError, match="--clamp-utilization"):
        parse_trace(io.StringIO(text), "t.csv")
    with pytest.raises(TraceError, match=r"t.csv:3: .*--skip-duplicates"):
        parse_trace(io.StringIO(text), "t.csv", clamp_utilization=True)
    t = parse_trace(io.StringIO(text), "t.csv", clamp_utilization=True, skip_duplicates=True)
    assert (t.clamped, t.skipped_duplicates, list(t.series[0].cpu)) == (1, 1, [100.0, 1.0])
    conflicting = text.replace("104.2\n2026-01-05T00:00:00Z,i-1,104.2", "104.2\n2026-01-05T00:00:00Z,i-1,3")
    with pytest.raises(TraceError, match="duplicate"):
        parse_trace(io.StringIO(conflicting), "t.csv", clamp_utilization=True, skip_duplicates=True)


def test_invalid_policy_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"idle_minutes": 30, "warn_minutes": 45}))
    assert main(["replay", str(DATA / "replay-cpu-box.csv"), "--policy", str(policy)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "warn_minutes" in err


# ---------------------------------------------------------------------------------------------
# The report


def test_json_keys_with_a_baseline(capsys: pytest.CaptureFixture[str], short_policy: str) -> None:
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


@pytest.mark.parametrize("table", ["missing.json", "malformed.json"])
def test_a_bad_price_table_makes_savings_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], short_policy: str, table: str
) -> None:
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
    tmp_path: Path, capsys: pytest.CaptureFixture[str], short_policy: str
) -> None:
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


def test_plot_and_gzip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gz = tmp_path / "trace.csv.gz"
    gz.write_bytes(gzip.compress((DATA / "replay-gpu-training.csv").read_bytes()))
    png = tmp_path / "out.png"
    assert main(["replay", str(gz), "--plot", str(png), "--baseline", "cloudwatch-cpu"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().err


def test_per_team_policies_from_a_structured_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The data team keeps the 90-min default: 2 h of quiet minus the window = 30 min, stopped at
    # 02:00 when warned at 01:30 and quiet since 00:30 (no earlier: 24 quiet buckets, stop at 18).
    policy = tmp_path / "teams.json"
    policy.write_text(
        json.dumps({"default_policy": SHORT, "teams": {"data": {"idle_minutes": 90, "warn_minutes": 30}}})
    )
    out = run_json(capsys, str(DATA / "replay-cpu-box.csv"), "--policy", str(policy))
    assert (out["recovered_hours"], out["ideal_hours"]) == (0.5, 0.5)


# ---------------------------------------------------------------------------------------------
# The generator and the shipped sample


def test_generator_is_seeded_and_the_sample_is_small(tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv.gz", tmp_path / "b.csv.gz"
    assert generate(a, 6, 1, seed=5) == generate(b, 6, 1, seed=5)
    assert a.read_bytes() == b.read_bytes()
    assert SAMPLE.stat().st_size < 3_000_000
    with gzip.open(SAMPLE, "rt") as f:
        assert f.readline().strip() == "timestamp,instance_id,cpu,gpu,team,instance_type"
