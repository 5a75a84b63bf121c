"""The simulation: the real decision core over hand-made traces whose answers are worked out by hand, the
cloudwatch-cpu baseline, and proof that the fast paths and the worker processes change nothing.

The hand-made traces use the short policy of replay_support: idle window 30 min (6 buckets of 5 min), the
warning at 20 min of quiet, max gap 15 min.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from replay_support import (
    DATA,
    SHORT,
    SHORT_POLICY,
    T0,
    csv_rows,
    run_json,
    small_fleet_text,
    trace,
    ts,
    write_short_policy,
)

from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.replay import (
    STATE_NAMES,
    PolicySet,
    ReplayOptions,
    TraceError,
    fleet_timeline,
    parse_trace,
    read_trace,
    replay,
    simulate_fleet,
)
from idle_reaper_tools.replay.report import time_halves

# ---------------------------------------------------------------------------------------------
# Hand-made traces, answers by hand


def test_cpu_box_recovers_exactly_the_ideal(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # replay-cpu-box.csv, m5.large ($0.096/h): CPU 50 % in buckets 0-5, 1 % in 6-29, 50 % in 30-35.
    # Quiet stretch 6-29 = 24 buckets = 2.0 h of idle; the ideal stops it at 6 + 6 = bucket 12 and it
    # stays stopped until the activity at 30: buckets 12-29 = 18 = 1.5 h.
    # idle-reaper: quiet since 00:30 (end of bucket 5); warned at 00:50 (20 min quiet); at 01:00 the
    # window 00:30-01:00 is all quiet and the warning is 10 min old: stop. Stopped 12-29 = 1.5 h,
    # restarted by the activity at 02:30, 90 min later (> 60: not "wanted back").
    # The CPU alarm: 6 breaching datapoints (buckets 6-11) -> stops at 01:00 too.
    short_policy = write_short_policy(tmp_path)
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
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # replay-gpu-training.csv, g5.xlarge ($1.006/h): CPU 2 % throughout; GPU 90 % in buckets 0-23
    # (training), 0 % in 24-47. Idle 2.0 h; the ideal stops at 24 + 6 = 30: buckets 30-47 = 1.5 h.
    # idle-reaper: busy on GPU until 02:00; warned 02:20, stopped 02:30 (bucket 30): 1.5 h, no false stop.
    # The CPU alarm sees CPU < 5 % from the start: it stops at buckets 6, 12 and 18 (GPU busy in the
    # window: false stops; the training shows activity in the very next bucket, 0 min later: the
    # owner starts it again) and at 24 (GPU still busy in the window: a fourth false stop), then stays
    # stopped: buckets 24-47 = 2.0 h "recovered", more than the ideal, by killing the job 4 times.
    short_policy = write_short_policy(tmp_path)
    out = run_json(
        capsys, str(DATA / "replay-gpu-training.csv"), "--policy", short_policy, "--baseline", "cloudwatch-cpu"
    )
    assert (out["recovered_hours"], out["ideal_hours"], out["false_stops"], out["stops"]) == (1.5, 1.5, 0, 1)
    assert out["dollars_saved"] == 1.51  # 1.5 h x $1.006
    base = out["baseline"]
    assert (base["stops"], base["false_stops"], base["stops_followed_by_activity"]) == (4, 4, 3)
    assert base["recovered_hours"] == 2.0
    assert base["recovery_ratio"] == pytest.approx(2.0 / 1.5, abs=1e-4)


def test_a_gap_is_unknown_and_prevents_the_stop() -> None:
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


# ---------------------------------------------------------------------------------------------
# The fleet: instance types, baselines, the timeline


def test_the_default_instance_type_fills_only_machines_without_one() -> None:
    t = trace(
        [*csv_rows("i-typed", [1.0] * 3, ",g5.xlarge"), *csv_rows("i-bare", [1.0] * 3, ",")],
        header="timestamp,instance_id,cpu,instance_type",
    )
    pairs = simulate_fleet(t, ReplayOptions(default_instance_type="m5.large"))
    assert [(r.instance_id, r.instance_type, a) for r, a in pairs] == [
        ("i-typed", "g5.xlarge", None),
        ("i-bare", "m5.large", None),
    ]
    assert [s.instance_type for s in t.series] == ["g5.xlarge", ""]  # the trace itself is left as read


def test_an_unknown_baseline_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown baseline 'cpu'; known: cloudwatch-cpu"):
        simulate_fleet(trace(csv_rows("i-1", [1.0])), ReplayOptions(), baseline="cpu")


def test_the_timeline_counts_every_machine_once_per_bucket_it_reports() -> None:
    # Two machines starting 1 h apart, each busy 30 min then quiet to the end: i-a stopped at bucket 12
    # (24 buckets to the end), i-b at its own bucket 12 = the fleet's 24 (12 buckets). In every bucket
    # the states add up to the machines present, and the stopped buckets are the totals' stopped time.
    t = trace([*csv_rows("i-a", [50.0] * 6 + [1.0] * 30), *csv_rows("i-b", [None] * 12 + [50.0] * 6 + [1.0] * 18)])
    result = replay(t, ReplayOptions(policies=SHORT_POLICY, timeline=True))
    assert result.timeline is not None and result.timeline_start == T0
    assert list(result.timeline) == list(STATE_NAMES)
    per_bucket = [sum(column) for column in zip(*result.timeline.values(), strict=True)]
    assert per_bucket == [1] * 12 + [2] * 24
    assert sum(result.timeline["stopped"]) == result.reaper.fleet.stopped == 24 + 12
    assert result.timeline["stopped"][11:13] == [0, 1] and result.timeline["stopped"][23:25] == [1, 2]
    runs = [r for r, _ in simulate_fleet(t, ReplayOptions(policies=SHORT_POLICY, timeline=True))]
    assert fleet_timeline(runs, 300) == (result.timeline_start, result.timeline)
    assert replay(t, ReplayOptions(policies=SHORT_POLICY)).timeline is None  # only when asked (--plot)


# ---------------------------------------------------------------------------------------------
# The fast paths and the process pool change nothing


# The generated fleet the fast paths and the reads when due are checked on: the 12 machines of every kind, over 2
# days instead of 3 (a third less time for each of the two tests). Every machine still goes through its quiet
# stretches, stops, restarts and, for the trainer that loses its GPU metric, its holes, each day: a day less is
# fewer repeats of the same patterns. Seeded bugs the 3 days caught and the 2 still do: the fast path that skips
# an "unknown" machine taking a window with one datapoint for an empty one (only this fleet catches it, on its
# notebooks), a busy machine not read again for an hour whenever its warning could first come.
GENERATED_DAYS = 2


@pytest.mark.parametrize(
    "source",
    ["replay-cpu-box.csv", "replay-gpu-training.csv", "replay-gap.csv", "nab-ec2-excerpt.csv", "generated"],
)
def test_fast_paths_match_calling_the_core_every_period(source: str) -> None:
    if source == "generated":
        t = parse_trace(io.StringIO(small_fleet_text(days=GENERATED_DAYS)), "generated")
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
# --split time: each half of the days scored alone, the machines swept over the whole trace


def test_the_judged_halves_add_up_to_the_whole_and_change_no_decision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 6 machines instead of 12 (half the time): two notebooks, two trainers, a batch job and a dev box, whose stops
    # and stopped stretches still cross the middle of the trace; a stopped or recovered time counted from the stop
    # rather than from the start of the half judged (seeded) still breaks the sums.
    text = small_fleet_text(6, days=4)
    t = parse_trace(io.StringIO(text), "generated")
    whole = replay(t, ReplayOptions(), workers=1).reaper
    halves = [replay(t, ReplayOptions(judged=span), workers=1).reaper for _, span in time_halves(t)]
    assert [label for label, _ in time_halves(t)] == [
        "first half judged (2026-01-05 to 2026-01-07)",
        "second half judged (2026-01-07 to 2026-01-09)",
    ]
    for key in ("stops", "warnings", "warnings_without_stop", "recovered", "ideal", "quiet", "stopped", "wanted"):
        assert sum(getattr(h.fleet, key) for h in halves) == getattr(whole.fleet, key), key
    assert all(h.fleet.stops and h.fleet.warnings for h in halves)  # both halves hold something to judge
    assert sorted(halves[0].stops + halves[1].stops, key=lambda s: (s.instance_id, s.at)) == sorted(
        whole.stops, key=lambda s: (s.instance_id, s.at)
    )
    # The command prints the same figures, one half after the other.
    path = tmp_path / "t.csv"
    path.write_text(text)
    out = run_json(capsys, str(path), "--split", "time")
    assert [h["stops"] for h in out["halves"]] == [h.fleet.stops for h in halves]
    assert out["halves"][1]["judged"].startswith("second half judged")


@pytest.mark.parametrize(
    "source",
    ["replay-cpu-box.csv", "replay-gpu-training.csv", "replay-gap.csv", "nab-ec2-excerpt.csv", "generated"],
)
def test_reading_only_when_due_warns_and_stops_exactly_as_reading_every_period(source: str) -> None:
    t = (
        parse_trace(io.StringIO(small_fleet_text(days=GENERATED_DAYS)), "generated")
        if source == "generated"
        else read_trace(DATA / source)
    )
    for policies in (PolicySet(), SHORT_POLICY):
        every, due = (
            replay(t, ReplayOptions(policies=policies, fast_path=False, read_when_due=when), workers=1)
            for when in (False, True)
        )
        # The same stops, warnings and every outcome figure; only what a state timeline would show between
        # reads differs (a machine not read is not seen go quiet until it is read).
        assert due.reaper.stops == every.reaper.stops
        strip = lambda s: {k: v for k, v in s.items() if k != "core_calls"}  # noqa: E731
        assert strip(due.reaper.summary()) == strip(every.reaper.summary())
        assert due.reaper.fleet.core_calls < every.reaper.fleet.core_calls, "fewer reads"


def test_the_kind_column_replays_sagemaker_notebook_instances_and_refuses_an_unknown_kind() -> None:
    header = "timestamp,instance_id,cpu,instance_type,kind"
    t = trace(
        [
            *csv_rows("cpu-nb", [1.0] * 30, ",ml.t3.medium,notebook"),
            *csv_rows("gpu-nb", [1.0] * 30, ",ml.p3.2xlarge,notebook"),  # no GPU column: could be training
            *csv_rows("i-ec2", [1.0] * 30, ",m5.large,"),
        ],
        header=header,
    )
    assert [s.kind for s in t.series] == ["notebook", "notebook", "ec2"]
    runs = {r.instance_id: r for r, _ in simulate_fleet(t, ReplayOptions(policies=SHORT_POLICY))}
    assert runs["cpu-nb"].stopped and runs["i-ec2"].stopped
    assert not runs["gpu-nb"].stopped, "an ml.p3 notebook without GPU data is unknown, never stopped"
    with pytest.raises(TraceError, match=r"test.csv:3: column 'kind': 'sagemaker' is not one of ec2, notebook"):
        trace([*csv_rows("nb", [1.0], ",ml.t3.medium,notebook"), *csv_rows("x", [1.0], ",m5.large,sagemaker")], header)
    with pytest.raises(TraceError, match="nb was 'notebook' at line 2, now 'ec2'"):
        trace([f"{ts(0)},nb,1,ml.t3.medium,notebook", f"{ts(1)},nb,1,ml.t3.medium,ec2"], header)


# ---------------------------------------------------------------------------------------------
# --split machines: two sides of the machines, look-alikes never cut across them


def _hourly_rows(name: str, hours: list[float]) -> list[str]:
    """One sample an hour from 2026-01-05 00:00 UTC (the grid's other buckets are holes)."""
    start = datetime(2026, 1, 5, tzinfo=UTC)
    return [f"{start + timedelta(hours=h):%Y-%m-%dT%H:%M:%SZ},{name},{v}" for h, v in enumerate(hours)]


def test_look_alike_machines_stay_on_one_side_and_the_sides_are_about_even() -> None:
    from idle_reaper_tools.replay.split import correlation, look_alike_groups, machine_sides, subset

    days = 3
    wave = [50.0 if 9 <= h % 24 < 17 else 1.0 for h in range(24 * days)]  # office hours
    night = [50.0 if h % 24 < 4 else 1.0 for h in range(24 * days)]  # a nightly batch
    noise = [float((h * 37) % 11) for h in range(24 * days)]  # unlike anything
    rows = [
        *_hourly_rows("clone-1", wave),
        *_hourly_rows("clone-2", [v + 0.5 for v in wave]),  # the same shape a little higher: alike
        *_hourly_rows("clone-3", wave),
        *_hourly_rows("batch-1", night),
        *_hourly_rows("batch-2", night),
        *_hourly_rows("odd-1", noise),
    ]
    t = trace(rows)
    groups = look_alike_groups(t)
    assert groups == [["clone-1", "clone-2", "clone-3"], ["batch-1", "batch-2"], ["odd-1"]]
    sides = machine_sides(t)
    assert sides.a == {"clone-1", "clone-2", "clone-3"} and sides.b == {"batch-1", "batch-2", "odd-1"}
    assert [s.instance_id for s in subset(t, sides.b).series] == ["batch-1", "batch-2", "odd-1"]
    assert correlation({0: 1.0}, {0: 1.0}) == 0.0  # too few hours in common to call anything alike


def test_the_command_splits_by_machines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    path.write_text(small_fleet_text(6, days=4))
    out = run_json(capsys, str(path), "--split", "machines")
    assert out["split"] == "machines" and len(out["halves"]) == 2
    label = out["halves"][0]["judged"]
    assert label.startswith("side a judged (") and "look-alikes kept on one side" in label
