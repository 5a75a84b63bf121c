"""Learned waiting: the quiet history's encoding (and its reset when corrupted), the rule that moves the
warning point, and the lifecycle carrying both (the history grows when a stretch ends)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from test_core import NOW, POLICY, REF, machine, run_assess, series

from idle_reaper.core import (
    HISTORY_CAP_MINUTES,
    HISTORY_SIZE,
    NO_WEEKDAY,
    LearnedWait,
    MachineRecord,
    Signals,
    State,
    decide,
    earliest_warn_minutes,
    format_history,
    learned_wait,
    parse_history,
    started_by_person,
)

BEGAN = NOW - timedelta(minutes=60)  # 14:00 UTC: stretches at 13-15 h count as alike


def test_history_round_trips_and_is_bounded() -> None:
    stretches = [(13, 70 + i) for i in range(HISTORY_SIZE + 5)] + [(2, HISTORY_CAP_MINUTES + 999)]
    text = format_history(stretches)
    parsed, note = parse_history(text)
    assert note == "" and len(parsed) == HISTORY_SIZE
    assert parsed[-1] == (2, HISTORY_CAP_MINUTES, NO_WEEKDAY)  # the newest kept, capped at a week
    assert parsed[0] == (13, 70 + 6, NO_WEEKDAY)  # the oldest dropped


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("13:abc", "unreadable"),
        ("24:60", "unreadable"),
        ("13:-5", "unreadable"),
        (f"13:{HISTORY_CAP_MINUTES + 1}", "unreadable"),
        ("13:60,,", "unreadable"),
        (",".join(["1:1"] * (HISTORY_SIZE + 1)), "oversized"),
        ("1:1" * 5000, "oversized"),
        ("١٣:60", "unreadable"),  # non-ASCII digits
    ],
)
def test_a_corrupted_or_oversized_history_resets_to_empty_with_a_note(text: str, words: str) -> None:
    parsed, note = parse_history(text)
    assert parsed == () and words in note and "reset to empty" in note


def test_stretches_that_usually_ended_soon_make_it_wait_longer_and_say_why() -> None:
    # Warning point 60 min; the span that makes a warning (or a stop) for nothing: 30 + 60 = 90 min.
    # Six of eight stretches ended between 60 and 150 min (soon), two went on for hours.
    history = [(13, 100)] * 6 + [(14, 600)] * 2
    wait = learned_wait(history, POLICY, BEGAN)
    assert 0 < wait.extra_minutes <= POLICY.adaptive_wait_max_minutes  # type: ignore[operator]
    assert "6 of its last 8 quiet stretches of 60 min or more" in wait.why
    assert wait.why.startswith(f"waits {wait.extra_minutes} more min")


def test_stretches_begun_about_this_time_of_day_win_when_there_are_enough_of_them() -> None:
    # Short stretches at night, three long ones about 14:00: a 14:00 stretch learns from the long ones.
    history = [(2, 100)] * 6 + [(14, 600)] * 3
    assert learned_wait(history, POLICY, BEGAN) == LearnedWait()


def test_with_too_few_stretches_about_this_time_of_day_all_of_them_count_and_the_reason_says_so() -> None:
    # Only two stretches about 14:00 reached the warning point: the machine's whole history is the evidence.
    history = [(2, 100)] * 6 + [(14, 600)] * 2
    wait = learned_wait(history, POLICY, BEGAN)
    assert wait.extra_minutes == 45
    assert wait.why == "waits 45 more min: 6 of its last 8 quiet stretches of 60 min or more ended within 90 min"
    assert "time of day" not in wait.why
    # Up to LEARN_SOON_SHARE of the stretches ending soon is a risk worth taking: no wait.
    assert learned_wait([(2, 100)] * 2 + [(2, 600)] * 3, POLICY, BEGAN) == LearnedWait()  # 2 of 5
    assert learned_wait([(2, 100)] * 3 + [(2, 600)] * 2, POLICY, BEGAN).extra_minutes > 0  # 3 of 5


def test_no_learning_without_evidence_or_when_the_policy_turns_it_off() -> None:
    assert learned_wait([(13, 100)] * 2, POLICY, BEGAN).extra_minutes == 0  # fewer than 3 stretches
    off = POLICY.model_copy(update={"adaptive_wait_max_minutes": 0})
    assert learned_wait([(13, 100)] * 8, off, BEGAN).extra_minutes == 0


def test_long_stretches_warn_sooner_but_never_before_the_team_minimum() -> None:
    history = [(14, 900)] * 5
    # Without adaptive_earliest_warn_minutes the team's point is also the earliest: never sooner.
    assert learned_wait(history, POLICY, BEGAN).extra_minutes == 0
    sooner = POLICY.model_copy(update={"adaptive_earliest_warn_minutes": 40})
    wait = learned_wait(history, sooner, BEGAN)
    assert wait.extra_minutes == -20 and earliest_warn_minutes(sooner) == 40
    assert wait.why.startswith("warned 20 min sooner")


def _idle_record(history: str, quiet: int) -> MachineRecord:
    return MachineRecord(
        instance_id="i-1",
        team="ml",
        state=State.IDLE,
        idle_since=NOW - timedelta(minutes=quiet + 5),
        observed_at=NOW - timedelta(minutes=5),
        quiet_history=history,
    )


def test_decide_holds_the_warning_when_the_history_says_wait() -> None:
    # Busy until 13:35, quiet since: 80 min observed (to 14:55), past the usual 60-min warning point, so
    # without history it warns. Six stretches begun about 13:00 that ended at 100 min: it waits 45 more.
    sig = Signals(cpu=series([50.0] * 19 + [1.0] * 16))
    a = run_assess(machine(), sig)
    assert a.quiet_minutes(NOW) == 80
    plain = decide(machine(), REF, a, _idle_record("", 80), now=NOW)
    assert plain.state is State.WARNED
    learned = decide(machine(), REF, a, _idle_record(format_history([(13, 100)] * 6), 80), now=NOW)
    assert learned.state is State.IDLE and "warning at 105 min; waits 45 more min" in learned.reason


def test_over_the_runtime_cap_history_does_not_hold_the_warning_even_with_a_keep() -> None:
    # The same quiet stretch and history that make it wait 45 more min, on a machine up past its hard cap
    # and kept by its owner: the cap overrides the keep and the learned wait alike (a found counterexample).
    sig = Signals(cpu=series([50.0] * 19 + [1.0] * 16))
    capped = REF.model_copy(update={"policy": POLICY.model_copy(update={"max_runtime_hours": 12})})
    a = run_assess(machine(), sig, capped.policy)
    record = replace(
        _idle_record(format_history([(13, 100)] * 6), 80),
        snoozed_until=NOW + timedelta(hours=2),
        snoozed_by="U0OWNER",
    )
    d = decide(machine(), capped, a, record, now=NOW)
    assert d.state is State.WARNED, d.reason
    assert "over max_runtime_hours (12): the keep by U0OWNER no longer holds" in d.reason
    assert "waits" not in d.reason
    uncapped = decide(machine(), REF, a, replace(record, snoozed_until=None, snoozed_by=None), now=NOW)
    assert uncapped.state is State.IDLE and "waits 45 more min" in uncapped.reason


def test_decide_resets_a_corrupted_history_and_says_so_never_fails() -> None:
    a = run_assess(machine(), Signals(cpu=series(1.0)))
    d = decide(machine(), REF, a, _idle_record("garbage!", 30), now=NOW)
    assert d.record.quiet_history == "" and "reset to empty" in d.reason


def test_an_ended_stretch_joins_the_history() -> None:
    # Quiet since 12:55, last seen quiet at 14:55; now a busy point at 14:50: the stretch lasted 120 min.
    record = _idle_record("", 120)
    a = run_assess(machine(), Signals(cpu=series([1.0] * 34 + [50.0])))
    assert a.signal == "busy"
    d = decide(machine(), REF, a, record, now=NOW)
    weekday = NOW.weekday()  # the stretch began on the day it ended, and the record says which
    assert parse_history(d.record.quiet_history) == (((12, 120, weekday),), "")
    # A stopped machine started again: the stretch lasted until the start.
    stopped = replace(record, state=State.REAPED, last_action="stop")
    again = started_by_person(stopped, "U1", NOW + timedelta(hours=2))
    assert parse_history(again.quiet_history)[0] == ((12, 245, weekday),) and again.idle_since is None
