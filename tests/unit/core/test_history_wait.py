"""History waiting (issue 45): each machine's wait learned from what it did after its own past quiet stretches
(at this hour, on this kind of day, after this long a quiet), the fleet's prior for a machine with little
history, a confidence that widens the wait while the history is thin or has just changed, and the reason a
warning shows. Small hand-made histories; the long replays are in benchmarks/carries.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from idle_reaper.core import MachineRecord, Signals, State, decide, format_history, parse_history
from idle_reaper.core import waiting as waiting_module
from idle_reaper.core.records import _HISTORY_MAX_CHARS, HISTORY_CAP_MINUTES, HISTORY_SIZE, NO_WEEKDAY
from idle_reaper.core.waiting import WaitingRule, history_wait, wait_for
from idle_reaper.policy import TeamPolicy

# A Tuesday, 10:00 UTC: the quiet stretch began at 09:00, a weekday.
BEGAN = datetime(2026, 11, 17, 9, 0, tzinfo=UTC)
TUESDAY = BEGAN.weekday()
POLICY = TeamPolicy(history_wait_percent=35, adaptive_wait_max_minutes=180)  # usual point 60 min, soon = 90 min


def wait(history: list[tuple[int, int, int]], policy: TeamPolicy = POLICY, began: datetime = BEGAN) -> tuple[int, str]:
    got = history_wait(tuple(history), policy, began)
    return got.extra_minutes, got.why


def test_used_again_soon_after_most_stretches_at_this_hour_waits_and_says_so_in_numbers() -> None:
    # 4 of its last 6 stretches begun about 09:00 on weekdays ended 60-150 min in: used again soon.
    history = [(9, 100, TUESDAY)] * 4 + [(9, 900, TUESDAY)] * 2
    extra, why = wait(history)
    assert extra > 0
    assert "used again within 90 min after 4 of its last 6 quiet stretches of 60 min or more" in why
    assert "begun about this hour on weekdays" in why and f"waits {extra} more min" in why


def test_a_machine_whose_stretches_go_on_for_hours_is_warned_at_the_usual_point_and_told_why() -> None:
    history = [(9, 900, d) for d in (0, 1, 2, 3, 4, 0, 1, 2, 3, 4)]
    extra, why = wait(history)
    assert extra == 0
    assert "after 0 of its last 10 quiet stretches" in why and "warned at the usual 60 min" in why


def test_the_wait_moves_to_the_point_past_which_its_stretches_no_longer_end_soon() -> None:
    # Every stretch at this hour lasted 100 min, then long ones: once past 100 min of quiet, none ends soon.
    history = [(9, 100, TUESDAY), (9, 2000, TUESDAY)] * 8
    extra, _ = wait(history)
    assert 45 <= extra <= 60  # 60 + 45 = 105 min of quiet: past every short stretch
    shorter = POLICY.model_copy(update={"adaptive_wait_max_minutes": 30})
    assert wait(history, shorter)[0] == 30  # never past the policy's most


def test_a_thin_history_widens_the_wait_against_the_same_share_with_more_evidence() -> None:
    # The same share (a fifth used soon) from 5 stretches and from 50: less evidence, a longer wait.
    thin = [(9, 100, TUESDAY)] + [(9, 900, TUESDAY)] * 4
    thick = thin * 10
    thin_extra, thin_why = wait(thin)
    thick_extra, _ = wait(thick)
    assert thin_extra > thick_extra == 0
    assert "chance of use soon 23%, up to 39% with its uncertainty" in thin_why


def test_a_new_machine_goes_by_the_fleets_prior_and_the_confidence_it_lacks() -> None:
    extra, why = wait([])
    assert "has no past quiet stretch" in why and "the fleet's 30% counts as 2 more" in why
    assert extra == 180  # 30 % + one standard error of two stretches' worth is over 35 %: the most it may wait
    # A sure prior (no confidence margin) that is under the limit warns at the usual point.
    sure = WaitingRule(confidence=0.0)
    assert waiting_module._history_wait((), 9, TUESDAY, 60, 30, 180, 35, sure).extra_minutes == 0


def test_a_recent_change_counts_only_the_new_stretches() -> None:
    # Ten stretches that went on for hours, then four used again soon: the machine changed.
    history = [(9, 900, TUESDAY)] * 10 + [(9, 100, TUESDAY)] * 4
    extra, why = wait(history)
    assert extra > 0
    assert "its last 4 went otherwise (4 of 4 used soon, 0 of 10 before): only they count" in why


def test_stretches_at_other_hours_and_on_the_other_kind_of_day_count_less() -> None:
    soon_at_night = [(2, 100, TUESDAY)] * 6  # another time of day
    soon_on_weekends = [(9, 100, 5)] * 6  # the same hour, Saturdays
    long_here = [(9, 900, TUESDAY)] * 12
    extra, why = wait(soon_at_night + soon_on_weekends + long_here)
    assert extra == 0  # this hour on weekdays: never used soon, and the rest counts a quarter each
    assert "(12 of 12 at other times, counted less)" in why
    assert wait(soon_on_weekends + long_here, began=BEGAN + timedelta(days=4))[0] > 0  # on a Saturday it waits


def test_history_waiting_comes_before_the_time_of_day_wait_and_only_past_the_usual_point() -> None:
    history = ((9, 100, TUESDAY),) * 6
    both = POLICY.model_copy(update={"time_of_day_wait_percent": 45})
    alone = history_wait(history, POLICY, BEGAN).extra_minutes
    assert wait_for(history, "", both, BEGAN, quiet=61).extra_minutes == alone > 0
    assert wait_for(history, "", both, BEGAN, quiet=30).extra_minutes == 0  # before the usual point it changes nothing
    assert history_wait(history, POLICY.model_copy(update={"history_wait_percent": 0}), BEGAN).why == ""  # off


def test_old_entries_without_a_weekday_still_read_and_new_ones_keep_it() -> None:
    parsed, note = parse_history("9:100,10:200:6")
    assert note == "" and parsed == ((9, 100, NO_WEEKDAY), (10, 200, 6))
    assert format_history(parsed) == "9:100,10:200:6"
    for bad in ("9:100:8", "9:100:1:2", "9:100:x"):
        assert parse_history(bad)[0] == () and "reset to empty" in parse_history(bad)[1]


def test_the_learned_state_per_machine_is_bounded() -> None:
    longest = format_history([(23, HISTORY_CAP_MINUTES + 5, 6)] * (HISTORY_SIZE + 10))
    assert len(longest.encode()) <= _HISTORY_MAX_CHARS == 352
    assert len(parse_history(longest)[0]) == HISTORY_SIZE


@pytest.mark.parametrize("stretch_minutes", [100, 900])
def test_a_warning_through_the_lifecycle_carries_the_explanation(stretch_minutes: int) -> None:
    from test_core import machine, run_assess, series

    from idle_reaper.policy import TeamPolicyRef

    policy = TeamPolicy(history_wait_percent=35, adaptive_wait_max_minutes=180, time_of_day_wait_percent=0)
    ref = TeamPolicyRef(team="ml", policy=policy, source="/idle-reaper/teams/ml", version=3)
    now = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
    began = now - timedelta(minutes=61)
    history = format_history([(began.hour, stretch_minutes, began.weekday())] * 10)
    seen = now - timedelta(minutes=5)
    record = MachineRecord("i-0abc", "ml", State.IDLE, idle_since=began, observed_at=seen, quiet_history=history)
    a = run_assess(machine(), Signals(cpu=series(1.0)))
    d = decide(machine(), ref, a, record, now=now)
    assert "quiet stretches of 60 min or more begun about this hour" in d.reason
    assert (d.state is State.WARNED) == (stretch_minutes == 900)
