"""Every constant of waiting is a field of WaitingRule (issue 45): the sweep's defaults are the constants it
always had, the replay may set any of them, a bad one is refused, and each one set changes what it should."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from test_time_of_day import MONDAY, office_hours

from idle_reaper.core import MachineRecord, Signals, State, decide, learned_wait
from idle_reaper.core.time_of_day import MIN_DAYS_SEEN, PROFILE_DAYS, epoch_day, observe, time_of_day_wait
from idle_reaper.core.waiting import (
    CHANGED_BY,
    HISTORY_STEP_MINUTES,
    LEARN_HOURS_AROUND,
    LEARN_MIN_STRETCHES,
    LEARN_SOON_SHARE,
    LEARN_STEP_MINUTES,
    WaitingRule,
    fleet_prior,
    history_wait,
)
from idle_reaper.policy import TeamPolicy

BEGAN = datetime(2026, 11, 17, 9, 0, tzinfo=UTC)  # a Tuesday
HISTORY = TeamPolicy(history_wait_percent=35, adaptive_wait_max_minutes=180)
LEARNED = TeamPolicy(time_of_day_wait_percent=0, adaptive_wait_max_minutes=180)


def test_the_defaults_are_the_constants_the_sweep_always_had() -> None:
    rule = WaitingRule()
    assert (
        (rule.learn_min_stretches, rule.learn_soon_share, rule.learn_step_minutes, rule.learn_hours_around)
        == (
            LEARN_MIN_STRETCHES,
            LEARN_SOON_SHARE,
            LEARN_STEP_MINUTES,
            LEARN_HOURS_AROUND,
        )
        == (3, 0.4, 15, 1)
    )
    assert (rule.profile_days, rule.min_days_seen) == (PROFILE_DAYS, MIN_DAYS_SEEN) == (14, 3)
    assert (rule.step_minutes, rule.changed_by, rule.prior_percent, rule.prior_stretches) == (
        HISTORY_STEP_MINUTES,
        CHANGED_BY,
        30,
        2.0,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("profile_days", 15), ("profile_days", 0), ("min_days_seen", 0), ("learn_soon_share", 1.5), ("recent", 0)],
)
def test_a_bad_constant_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        WaitingRule.model_validate({field: value})
    with pytest.raises(ValidationError, match="extra"):
        WaitingRule.model_validate({"profile_dayz": 7})
    with pytest.raises(ValidationError):  # frozen: a rule in use cannot be changed under the lru caches
        WaitingRule().profile_days = 7  # type: ignore[misc]


def test_profile_days_reads_only_the_newest_days_the_record_keeps() -> None:
    # Busy at 10:00 on weekdays until a week ago, never since: fourteen days remember it (5 of 10 weekdays,
    # a chance of (0 + 0 + 0.5) / 3, over 15 %), the newest seven do not (0 of 5).
    profile = office_hours()
    for back in range(7, 0, -1):
        profile = observe(profile, epoch_day(MONDAY) - back + 7, ())
    began = MONDAY + timedelta(days=7, hours=8)
    whole = time_of_day_wait(profile, began, 60, 240, 15, 90)
    recent = time_of_day_wait(profile, began, 60, 240, 15, 90, days=7)
    assert whole is not None and whole.extra_minutes > 0
    assert recent is not None and recent.extra_minutes == 0


def test_min_days_seen_decides_when_a_profile_is_used() -> None:
    wednesday = MONDAY + timedelta(days=2)
    two_days = office_hours(days=2, end=wednesday)  # Monday and Tuesday, busy at 10:00
    began = wednesday + timedelta(hours=8)
    assert time_of_day_wait(two_days, began, 60, 240, 30, 90) is None  # 3 days by default: learned waiting
    early = time_of_day_wait(two_days, began, 60, 240, 30, 90, min_days=2)
    assert early is not None and early.extra_minutes > 0


def test_restart_after_days_decides_when_days_without_data_start_the_profile_again() -> None:
    profile = office_hours()
    assert profile is not None
    back_after_ten_days = profile.newest_day + 10
    assert observe(profile, back_after_ten_days, ()).days_seen == 1  # type: ignore[union-attr]  # 7 by default
    kept = observe(profile, back_after_ten_days, (), restart_after=PROFILE_DAYS)
    assert kept is not None and kept.days_seen == 5  # the 4 newest old days still in the window, and today


def test_learned_waitings_constants_change_its_wait() -> None:
    at_nine = [(9, 100), (9, 110), (9, 900), (9, 120)]  # 3 of 4 begun about 09:00 ended soon
    usual = learned_wait(at_nine, LEARNED, BEGAN)
    assert usual.extra_minutes > 0
    assert learned_wait(at_nine, LEARNED, BEGAN, WaitingRule(learn_soon_share=1.0)).extra_minutes == 0
    assert learned_wait(at_nine, LEARNED, BEGAN, WaitingRule(learn_min_stretches=5)).extra_minutes == 0
    assert learned_wait(at_nine, LEARNED, BEGAN, WaitingRule(learn_step_minutes=40)).extra_minutes % 40 == 0
    # The same stretches at 13:00: alike within 4 hours, not within 1 (then all the machine's count, unscoped).
    at_one = [(13, m) for _, m in at_nine]
    assert "about this time of day" in learned_wait(at_one, LEARNED, BEGAN, WaitingRule(learn_hours_around=4)).why
    assert "about this time of day" not in learned_wait(at_one, LEARNED, BEGAN).why


def test_history_waitings_step_and_change_threshold() -> None:
    monday = BEGAN.weekday()
    soon = [(9, 100, monday)] * 6
    stepped = history_wait(soon, HISTORY, BEGAN, WaitingRule(step_minutes=50)).extra_minutes
    assert stepped > 0 and (stepped % 50 == 0 or stepped == 180)
    # Ten stretches one in ten used soon, then 3 of 4: a change of 0.65, a change at 0.5, not at 0.7.
    changed = [(9, 900, monday)] * 9 + [(9, 100, monday)] + [(9, 100, monday)] * 3 + [(9, 900, monday)]
    assert "went otherwise" in history_wait(changed, HISTORY, BEGAN).why
    assert "went otherwise" not in history_wait(changed, HISTORY, BEGAN, WaitingRule(changed_by=0.7)).why


def test_decide_waits_by_the_rule_it_is_given() -> None:
    from test_core import machine, run_assess, series

    from idle_reaper.policy import TeamPolicyRef

    ref = TeamPolicyRef(team="ml", policy=HISTORY, source="/idle-reaper/teams/ml", version=3)
    now = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
    record = MachineRecord(
        "i-0abc", "ml", State.IDLE, idle_since=now - timedelta(minutes=61), observed_at=now - timedelta(minutes=5)
    )
    a = run_assess(machine(), Signals(cpu=series(1.0)))
    # No history: the fleet's 30 % plus a standard error of two stretches' worth is over 35 %: it waits.
    assert decide(machine(), ref, a, record, now=now).state is State.IDLE
    sure = decide(machine(), ref, a, record, now=now, waiting=WaitingRule(confidence=0.0))
    assert sure.state is State.WARNED and "the fleet's 30% counts as 2 more" in sure.reason


def test_the_fleet_prior_is_the_pooled_share_used_again_soon() -> None:
    # Of the stretches that reached 60 min, 2 of 5 ended within 90 min after it; the 30-min one never counts.
    assert fleet_prior([30, 70, 140, 151, 600, 900], usual=60, span=90) == 40
    assert fleet_prior([30, 45], usual=60, span=90) is None
    assert fleet_prior([], usual=60, span=90) is None


def test_every_constant_of_waiting_is_a_field_with_a_bound() -> None:
    schema = WaitingRule.model_json_schema()["properties"]
    assert len(schema) == 14
    assert all(("maximum" in p or "exclusiveMaximum" in p) for p in schema.values())
