"""The time-of-day wait's pure parts: the usage profile (its encoding, bad input, updates, restarts) and the
rule (when it holds a warning, how far, and what it says)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from idle_reaper.core.time_of_day import (
    PROFILE_DAYS,
    PROFILE_MAX_CHARS,
    RESTART_AFTER_DAYS,
    Profile,
    chance_used,
    epoch_day,
    epoch_hours,
    format_profile,
    observe,
    observe_text,
    parse_profile,
    time_of_day_wait,
)

MONDAY = datetime(2026, 11, 23, tzinfo=UTC)  # a Monday


def office_hours(days: int = PROFILE_DAYS, end: datetime = MONDAY) -> Profile | None:
    """A machine busy 10:00-11:59 UTC on weekdays, quiet at weekends, with data every day up to `end`."""
    profile: Profile | None = None
    for back in range(days, 0, -1):
        day = end - timedelta(days=back)
        busy = epoch_hours([day + timedelta(hours=10), day + timedelta(hours=11)]) if day.weekday() < 5 else ()
        profile = observe(profile, epoch_day(day), busy)
    return profile


def test_the_encoding_is_compact_and_reads_back() -> None:
    profile = office_hours()
    assert profile is not None and profile.days_seen == PROFILE_DAYS
    text = format_profile(profile)
    assert len(text) <= PROFILE_MAX_CHARS <= 100  # on the record: well under a few hundred bytes
    assert parse_profile(text) == (profile, "")
    assert format_profile(None) == "" and parse_profile("") == (None, "")


@pytest.mark.parametrize(
    "corrupt",
    [
        "garbage",
        "t1.20000.AAAA.AA==",  # truncated hours
        "t2" + format_profile(Profile(20000))[2:],  # a version we do not know
        format_profile(Profile(20000))[:-3],  # cut short
        format_profile(Profile(20000)).replace("A", "!", 1),  # not base64
        "t1.-5.AAAA.AAAA",
        "t1." + "9" * 200,  # oversized
    ],
)
def test_a_corrupt_or_truncated_profile_is_no_profile_never_an_error(corrupt: str) -> None:
    profile, note = parse_profile(corrupt)
    assert profile is None and "started again" in note
    # ...and an update starts it again from this sweep's data.
    text, note = observe_text(corrupt, 20000, (20000 * 24 + 9,))
    assert parse_profile(text)[0] == Profile(20000, 1 << ((PROFILE_DAYS - 1) * 24 + 9), 1 << (PROFILE_DAYS - 1))
    assert "started again" in note


def test_marking_is_idempotent_and_old_days_fall_off() -> None:
    day = epoch_day(MONDAY)
    once = observe(None, day, (day * 24 + 10,))
    assert observe(once, day, (day * 24 + 10,)) is once  # a bucket read again changes nothing
    later = observe(once, day + 3, ())
    assert later is not None and later.newest_day == day + 3 and later.days_seen == 2
    assert later.busy == 1 << ((PROFILE_DAYS - 4) * 24 + 10)  # the same hour, three days further back
    # Data from before the profile's oldest day is not marked; a day past the end shifts everything out.
    assert observe(later, day + 3, ((day - 20) * 24,)) == later
    gone = observe(later, day + PROFILE_DAYS + 2, ())
    assert gone is not None and gone.busy == 0


def test_a_history_that_jumps_starts_again() -> None:
    profile = office_hours()
    assert profile is not None
    after_a_pause = observe(profile, profile.newest_day + RESTART_AFTER_DAYS, ())
    assert after_a_pause == Profile(profile.newest_day + RESTART_AFTER_DAYS, 0, 1 << (PROFILE_DAYS - 1))
    clock_went_back = observe(profile, profile.newest_day - 3, ())
    assert clock_went_back is not None and clock_went_back.newest_day == profile.newest_day - 3
    assert clock_went_back.days_seen == 1 and clock_went_back.busy == 0


def test_the_chance_reads_this_time_of_day_on_the_same_kind_of_day() -> None:
    profile = office_hours()
    assert profile is not None
    at_nine = MONDAY + timedelta(hours=9)
    # Yesterday (Sunday) quiet, a week ago busy, all 10 weekdays of the two weeks busy: (0 + 1 + 1) / 3.
    assert chance_used(profile, at_nine, 90) == (2 / 3, 10, 10)
    assert chance_used(profile, MONDAY + timedelta(hours=13), 90)[0] == 0.0
    saturday_nine = MONDAY - timedelta(days=2) + timedelta(hours=9)
    assert chance_used(profile, saturday_nine, 90)[0] < 0.5  # yesterday was a weekday, but weekends are quiet


def test_the_wait_holds_the_warning_until_the_usual_busy_hours_have_passed() -> None:
    profile = office_hours()
    began = MONDAY + timedelta(hours=8)  # quiet since 08:00; usually warned after 60 min
    wait = time_of_day_wait(profile, began, usual=60, most=240, percent=30, horizon=90)
    assert wait is not None
    # Busy 10:00-11:59 on weekdays: use within 90 min is likely from 09:00 to 11:45, not from 12:00; the
    # warning waits until the chance has been low for a step (12:15), 195 min after the usual point.
    assert wait.extra_minutes == 195
    assert "usually busy around 10:00 UTC on weekdays (10 of its last 10)" in wait.why
    assert "waiting until 12:15 UTC" in wait.why
    # Bounded: never more than `most`.
    short = time_of_day_wait(profile, began, usual=60, most=45, percent=30, horizon=90)
    assert short is not None and short.extra_minutes == 45 and "waiting until 09:45 UTC" in short.why


def test_no_wait_when_the_machine_is_not_usually_used_then() -> None:
    profile = office_hours()
    evening = MONDAY + timedelta(hours=15)
    assert time_of_day_wait(profile, evening, usual=60, most=240, percent=30, horizon=90) == (
        time_of_day_wait(profile, evening, usual=60, most=240, percent=30, horizon=90)
    )
    wait = time_of_day_wait(profile, evening, usual=60, most=240, percent=30, horizon=90)
    assert wait is not None and wait.extra_minutes == 0 and wait.why == ""


def test_no_profile_or_too_few_days_or_the_wait_off_is_todays_behaviour() -> None:
    began = MONDAY + timedelta(hours=8)
    assert time_of_day_wait(None, began, 60, 240, 30, 90) is None
    assert time_of_day_wait(office_hours(days=2), began, 60, 240, 30, 90) is None
    assert time_of_day_wait(office_hours(), began, 60, 0, 30, 90) is None
    assert time_of_day_wait(office_hours(), began, 60, 240, 0, 90) is None
