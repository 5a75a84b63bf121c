"""The human-activity signal in assess: a person at the keyboard makes a machine busy at 1 % CPU; a missing
signal changes nothing (judged on CPU/GPU alone); garbage is ignored and named, never read as active."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from test_core import NOW, POLICY, machine, run_assess, series

from idle_reaper.core import HUMAN_NONE, Signals

QUIET_CPU = series(1.0)  # 1 % CPU for the last 3 hours: idle on CPU alone


def user_points(input_ago: float) -> list:
    """The collector's newest datapoint (period 14:50) naming a last input `input_ago` minutes before now;
    HUMAN_NONE: no input seen."""
    t = NOW - timedelta(minutes=10)
    return [(t - timedelta(minutes=15), HUMAN_NONE), (t, input_ago if input_ago == HUMAN_NONE else input_ago - 10)]


def test_a_person_typing_ten_minutes_ago_makes_a_quiet_box_busy() -> None:
    a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=user_points(10)))  # input at 14:50
    assert a.signal == "busy" and a.human_signal == "active"
    assert "a person was active at 14:50 UTC" in a.reason
    assert a.interrupted_at == NOW  # the quiet stretch starts again after the person


def test_input_before_the_window_still_counts_within_human_active_minutes() -> None:
    # Window 13:30-15:00; input at 13:10 + 30 min = 13:40, inside the window: busy.
    a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=user_points(105)))
    assert a.signal == "busy" and a.human_signal == "active"
    # Input at 12:50: active until 13:20, before the window: idle, and quiet only since 13:20.
    a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=user_points(130)))
    assert a.signal == "idle" and a.human_signal == "quiet"
    assert a.quiet_since == NOW - timedelta(minutes=100)


def test_no_input_seen_is_quiet_and_missing_data_is_judged_on_cpu_alone() -> None:
    a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=user_points(HUMAN_NONE)))
    assert (a.signal, a.human_signal) == ("idle", "quiet")
    a = run_assess(machine(), Signals(cpu=QUIET_CPU))
    assert (a.signal, a.human_signal) == ("idle", "missing")
    # Missing is never idle by itself: a busy CPU stays busy.
    a = run_assess(machine(), Signals(cpu=series(50.0)))
    assert (a.signal, a.human_signal) == ("busy", "missing")


def test_a_policy_that_ignores_the_signal_ignores_a_person() -> None:
    for minutes in (None, 0):
        policy = POLICY.model_copy(update={"human_active_minutes": minutes})
        a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=user_points(1)), policy)
        assert (a.signal, a.human_signal) == ("idle", "off")


@pytest.mark.parametrize("value", [-1.0, HUMAN_NONE + 1, math.nan, math.inf])
def test_garbage_values_are_ignored_and_named(value: float) -> None:
    a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=[(NOW - timedelta(minutes=10), value)]))
    assert (a.signal, a.human_signal) == ("idle", "missing")
    assert "ignored 1 unusable human-activity value" in a.reason


def test_an_input_time_in_the_future_is_a_skewed_clock_and_ignored() -> None:
    # A point stamped 10 min ahead, or one whose value puts the input after now: never "active forever".
    future = [(NOW + timedelta(minutes=10), 0.0), (NOW - timedelta(minutes=5), 0.0)]
    a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=future[:1]))
    assert (a.signal, a.human_signal) == ("idle", "missing") and "ignored 1" in a.reason
    # Garbage beside a good point: the good point decides, the garbage is still named.
    a = run_assess(machine(), Signals(cpu=QUIET_CPU, user=[*future, (NOW - timedelta(minutes=5), -3.0)]))
    assert (a.signal, a.human_signal) == ("busy", "active") and "ignored 2 unusable" in a.reason


def test_a_busy_gpu_is_still_busy_whatever_the_person_signal_says() -> None:
    a = run_assess(
        machine(instance_type="g5.xlarge"),
        Signals(cpu=QUIET_CPU, gpu=series(95.0), user=user_points(HUMAN_NONE)),
    )
    assert a.signal == "busy" and "GPU 95.0%" in a.reason
