"""The fewer-unwanted-stops figures of the replay: warnings that led to no stop, unwanted stops as a
share of stops, messages per owner-day, and the trace's `user` and `owner` columns.

Hand-made traces under the short policy of replay_support: idle window 30 min (6 buckets of 5 min), the
warning at 20 min of quiet (the sweep at the start of bucket k sees buckets < k).
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from replay_support import SHORT, SHORT_POLICY, T0, csv_rows, trace, ts

from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.replay import PolicySet, ReplayOptions, TraceError, replay
from idle_reaper_tools.replay.report import count_messages
from idle_reaper_tools.replay.simulate import MachineRun

BUSY, QUIET = 50.0, 1.0


def test_a_warning_the_machine_outran_is_counted_as_leading_to_no_stop() -> None:
    # Busy 0-1, quiet 2-6: quiet since 00:10, warned by the sweep at 00:30 (20 min of quiet); busy again
    # in bucket 7, before the stop at 30 min of quiet: no stop. Then quiet 8-30: warned and stopped.
    # 2 warnings, 1 stop, 1 warning without a stop.
    cpu = [BUSY] * 2 + [QUIET] * 5 + [BUSY] + [QUIET] * 23
    result = replay(trace(csv_rows("i-1", cpu)), ReplayOptions(policies=SHORT_POLICY), prices=None)
    s = result.reaper.summary()
    assert (s["warnings"], s["stops"], s["warnings_without_stop"]) == (2, 1, 1)
    assert s["warnings_without_stop_share"] == 0.5


def test_unwanted_stop_share_counts_stops_with_activity_within_the_limit() -> None:
    # Two stops: after the first the machine is busy again 10 min later (unwanted within 60), after
    # the second 2 h later (wanted gone).
    stretch = [QUIET] * 8
    cpu = [BUSY] + stretch + [QUIET] * 2 + [BUSY] + stretch + [QUIET] * 24 + [BUSY]
    t = trace(csv_rows("i-1", cpu))
    s = replay(t, ReplayOptions(policies=SHORT_POLICY), prices=None).reaper.summary()
    assert (s["stops"], s["stops_followed_by_activity"], s["unwanted_stop_share"]) == (2, 1, 0.5)
    s = replay(t, ReplayOptions(policies=SHORT_POLICY, still_wanted_minutes=5), prices=None).reaper.summary()
    assert (s["stops_followed_by_activity"], s["unwanted_stop_share"]) == (0, 0.0)


def _run(iid: str, owner: str, first: int, buckets: int, warned: list[int]) -> MachineRun:
    run = MachineRun(iid, "t", "", first, buckets, 0, 0, owner=owner)
    run.warning_buckets = warned
    return run


def test_one_message_per_owner_per_sweep_and_owner_days_per_utc_day() -> None:
    day = 288  # 5-min buckets in a day
    runs = [
        _run("a", "ana", 0, day, [10, 20]),
        _run("b", "ana", 0, 2 * day, [10, day + 5]),  # warned in the same sweep as a at 10: one message
        _run("c", "bo", day, day, [day + 5]),
    ]
    messages, owner_days = count_messages(runs, 300)
    assert messages == 3 + 1  # ana: sweeps 10, 20, day+5; bo: day+5
    assert owner_days == 2 + 1  # ana on days 0 and 1, bo on day 1


def test_owner_and_user_columns_are_read_and_bucketed_to_the_minimum() -> None:
    header = "timestamp,instance_id,cpu,user,owner"
    rows = [
        "2026-01-05T00:01:00Z,i-1,3,12,ana@example.com",
        "2026-01-05T00:04:00Z,i-1,3,2,",
        "2026-01-05T00:06:00Z,i-1,3,,ana@example.com",
        "2026-01-05T00:11:00Z,i-1,3,10080,",
    ]
    [s] = trace(rows, header).series
    assert s.owner == "ana@example.com"
    assert len(s.user) == 3 and s.user[0] == 2.0 and math.isnan(s.user[1]) and s.user[2] == 10080.0


@pytest.mark.parametrize(
    ("cell", "message"),
    [("-1", "not minutes from 0 to 10080"), ("10081", "not minutes from 0 to 10080"), ("soon", "not a number")],
)
def test_a_bad_user_value_names_the_line_and_column(cell: str, message: str) -> None:
    with pytest.raises(TraceError, match=rf"test.csv:3: column 'user': .*{message}"):
        trace(["2026-01-05T00:00:00Z,i-1,3,5", f"2026-01-05T00:05:00Z,i-1,3,{cell}"], "timestamp,instance_id,cpu,user")


def test_an_owner_that_changes_within_an_instance_is_an_error() -> None:
    with pytest.raises(TraceError, match="column 'owner'"):
        trace(["2026-01-05T00:00:00Z,i-1,3,ana", "2026-01-05T00:05:00Z,i-1,3,bo"], "timestamp,instance_id,cpu,owner")


def _notebook_trace() -> list[str]:
    """A notebook at 1 % CPU for 3 h: a person types until 00:53 (each sample: input 2 min before it),
    then the collector counts the minutes since that last input."""
    rows = []
    for i in range(36):
        user = 2 if i < 12 else 2 + 5 * (i - 11)
        rows.append(f"{ts(i)},nb-1,1,{user},ana")
    return rows


def test_a_person_at_the_keyboard_holds_the_stop_and_the_replay_names_it() -> None:
    header = "timestamp,instance_id,cpu,user,owner"
    t = trace(_notebook_trace(), header)
    # Short policy (30-min window) plus the default human_active_minutes 30: the last input at 00:53,
    # read as the sweep reads it (its period's Minimum timed at the period's end, 01:00: placed at 00:58,
    # never earlier than it was) counts as activity until 01:28, then 30 quiet minutes (the window) end at
    # 01:58: the sweep at 02:00 stops it, with no person active in the 30 minutes before.
    s = replay(t, ReplayOptions(policies=SHORT_POLICY), prices=None)
    [stop] = s.reaper.stops
    assert stop.at == T0 + timedelta(minutes=120) and not stop.person_active
    assert s.reaper.summary()["person_active_stops"] == 0
    # The signal off: warned once a window from launch (00:30), stopped at 00:40 while the person types.
    off = PolicySet(default=TeamPolicy(**SHORT, human_active_minutes=0))  # type: ignore[arg-type]
    s = replay(t, ReplayOptions(policies=off), prices=None)
    assert s.reaper.stops[0].at == T0 + timedelta(minutes=40) and s.reaper.stops[0].person_active
    assert s.reaper.summary()["person_active_stops"] >= 1


def test_the_fast_path_changes_nothing_with_a_user_column() -> None:
    t = trace(_notebook_trace(), "timestamp,instance_id,cpu,user,owner")
    fast = replay(t, ReplayOptions(policies=SHORT_POLICY), prices=None).reaper.summary()
    slow = replay(t, ReplayOptions(policies=SHORT_POLICY, fast_path=False), prices=None).reaper.summary()
    assert {k: v for k, v in fast.items() if k != "core_calls"} == {k: v for k, v in slow.items() if k != "core_calls"}


def test_sweep_policy_replays_each_setting_against_the_first_ideal() -> None:
    from idle_reaper_tools.replay.report import sweep_policies

    stretch = [QUIET] * 8
    cpu = [BUSY] + stretch + [QUIET] * 2 + [BUSY] + stretch + [QUIET] * 24 + [BUSY]
    points = sweep_policies(trace(csv_rows("i-1", cpu)), ReplayOptions(policies=SHORT_POLICY), ['{"idle_minutes": 60}'])
    first, longer = points
    assert (first.label, longer.label) == ("as given", '{"idle_minutes": 60}')
    assert first.recovery_vs_base == first.summary["recovery_ratio"]
    # A 60-min window skips the short stretch (no unwanted stop) and recovers less of the first ideal.
    assert (first.summary["stops"], longer.summary["stops"]) == (2, 1)
    assert longer.summary["unwanted_stop_share"] == 0.0
    assert longer.recovery_vs_base is not None and first.recovery_vs_base is not None
    assert longer.recovery_vs_base < first.recovery_vs_base


def test_a_bad_sweep_policy_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from replay_support import DATA

    from idle_reaper_tools.cli import main

    assert main(["replay", str(DATA / "replay-cpu-box.csv"), "--sweep-policy", '{"idle_minutes": 5}']) == 2
    out, err = capsys.readouterr()
    assert out == "" and "invalid --sweep-policy" in err and "idle_minutes" in err


def test_the_pareto_plot_has_a_dot_per_setting_and_one_label_per_dot() -> None:
    pytest.importorskip("matplotlib")
    from idle_reaper_tools.replay.plotting import draw_sweep
    from idle_reaper_tools.replay.report import sweep_policies

    cpu = [BUSY] + [QUIET] * 30 + [BUSY]
    overrides = ['{"idle_minutes": 60}', '{"adaptive_wait_max_minutes": 0}']
    points = sweep_policies(trace(csv_rows("i-1", cpu)), ReplayOptions(policies=SHORT_POLICY), overrides)
    [ax, _colorbar] = draw_sweep(points, "t").axes
    assert len(ax.collections[0].get_offsets()) == 3
    # One quiet stretch teaches nothing, so learned waiting off lands on the policy as given: one label.
    assert [t.get_text() for t in ax.texts] == [f"as given = {overrides[1]}", overrides[0]]


def test_the_people_generator_keeps_the_plain_fleet_and_adds_realistic_columns() -> None:
    from testkit.generate_trace import USER_NONE, fleet

    plain, people = fleet(12, 3, seed=3), fleet(12, 3, seed=3, people=True)
    for a, b in zip(plain, people, strict=True):
        assert a.instance_id == b.instance_id and b.owner.endswith("@example.com")
        if a.kind != "notebook":  # only notebooks' writing afternoons change CPU
            assert a.samples == b.samples
        values = [v for v in b.user if v is not None]
        assert all(0.0 <= v <= USER_NONE for v in values)
        # No row, no user value: a stopped machine reports nothing.
        assert all(v is None for v, s in zip(b.user, b.samples, strict=True) if s is None) or not b.user
    typed = [m for m in people if any(v is not None and v < 5 for v in m.user)]
    assert typed and all(m.kind in ("notebook", "dev", "forgotten") for m in typed)
    assert any(all(v is None for v in m.user) for m in fleet(48, 2, seed=7, people=True))  # no collector
