"""The weekly digest's figures (core/digest.py): weeks, when it is due, savings, waste, and the words."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.core.digest import (
    Week,
    build_digest,
    claim_key,
    digest_due,
    parse_week,
    running_again_entry,
)
from idle_reaper.core.digest_text import digest_text
from idle_reaper.core.records import MachineRecord, State
from idle_reaper.policy import PolicyError, TeamPolicy, parse_team_policy

W47 = Week(2026, 47)  # Monday 2026-11-16 .. Monday 2026-11-23
MON = datetime(2026, 11, 16, tzinfo=UTC)
END = datetime(2026, 11, 23, tzinfo=UTC)


def at(day: int, hour: float) -> datetime:
    return MON + timedelta(days=day, hours=hour)


def stop(i: str, when: datetime, team: str = "ml", hourly: float | None = 1.0, action: str = "stop") -> Any:
    entry = {"action": action, "team": team, "owner": "ada", "hourly_savings": hourly, "hourly_cost": hourly}
    return (i, when, entry)


def running(i: str, when: datetime, team: str = "ml") -> Any:
    return (i, when + timedelta(minutes=4), running_again_entry(i, team, "ada", "g5.xlarge", when))


def warn(i: str, when: datetime, team: str = "ml") -> Any:
    return (i, when, {"action": "warn", "team": team, "warned_at": when.isoformat(), "hourly_savings": 1.0})


def test_weeks_parse_and_span_in_the_teams_zone() -> None:
    assert parse_week("2026-W47") == W47
    assert W47.span() == (MON, END)
    start, _ = W47.span("Europe/Berlin")
    assert start == MON - timedelta(hours=1)
    assert W47.previous(8).label == "2026-W39"
    assert parse_week("2026-W53").label == "2026-W53"  # 2026 has 53 ISO weeks
    for bad in ("2026-47", "2025-W53", "W47", "2026-W00", "2026-W47; drop"):
        with pytest.raises(ValueError, match="ISO week"):
            parse_week(bad)
    assert claim_key("ml", W47) == "digest#ml#2026-W47"


def test_due_after_the_teams_local_digest_time_and_never_in_quiet_hours() -> None:
    policy = TeamPolicy(timezone="America/New_York")  # Monday 09:00 local = 14:00 UTC
    assert digest_due(policy, datetime(2026, 11, 23, 13, 59, tzinfo=UTC)) is None
    assert digest_due(policy, datetime(2026, 11, 23, 14, 0, tzinfo=UTC)) == W47
    assert digest_due(policy, datetime(2026, 11, 27, 3, tzinfo=UTC)) == W47  # late is still sent
    friday = TeamPolicy(digest_day="FRI", digest_time="16:30")
    assert friday.digest_day == "fri"
    assert digest_due(friday, datetime(2026, 11, 26, 23, tzinfo=UTC)) is None
    assert digest_due(friday, datetime(2026, 11, 27, 16, 30, tzinfo=UTC)) == W47
    quiet = TeamPolicy(schedules=[{"days": ["mon"], "start": "08:00", "end": "12:00", "quiet_hours": True}])
    assert digest_due(quiet, datetime(2026, 11, 23, 9, tzinfo=UTC)) is None
    assert digest_due(quiet, datetime(2026, 11, 23, 12, tzinfo=UTC)) == W47
    with pytest.raises(PolicyError, match=r"digest_time.*HH:MM"):
        parse_team_policy("/idle-reaper/teams/ml", '{"digest_time": "9am"}', TeamPolicy())
    with pytest.raises(PolicyError, match="digest_day"):
        parse_team_policy("/idle-reaper/teams/ml", '{"digest_day": "monday"}', TeamPolicy())


def test_a_stop_saves_until_seen_running_again_or_the_end_point() -> None:
    entries = [
        stop("i-1", at(0, 10)),
        running("i-1", at(0, 14)),  # 4 h
        stop("i-2", at(2, 0), hourly=2.0, action="hibernate"),  # still stopped at `now`: 12 h
        stop("i-3", at(1, 0), action="stop"),
        stop("i-3", at(1, 1), action="stop"),  # stopped again while stopped: counted once
        running("i-3", at(1, 2)),
        ("i-4", at(1, 0), {"action": "stop", "team": "ml", "error": "stop failed", "hourly_savings": 5.0}),
        ("i-5", at(1, 0), {"action": "would_stop", "team": "ml", "hourly_savings": 5.0}),
        running("i-6", at(1, 5)),  # back at the very moment of its stop (listed first here): saved nothing
        stop("i-6", at(1, 5)),
    ]
    d = build_digest(entries, [], W47, now=at(2, 12), team="ml")
    assert d.recovered["stops"].count == 3
    assert d.recovered["stops"].dollars == pytest.approx(4.0 + 2.0)
    assert d.recovered["hibernations"].dollars == pytest.approx(24.0)
    assert d.recovered_hours == pytest.approx(4 + 2 + 12)
    assert d.stops == 4 and d.unwanted_stops == 1
    # A stop from the week before counts only its hours inside this week; the trend has the rest.
    before = [stop("i-9", at(-1, 0)), running("i-9", at(0, 6))]
    d = build_digest(before, [], W47, now=END)
    assert d.recovered["stops"].dollars == pytest.approx(6.0) and d.stops == 0
    assert d.trend[-2].recovered == pytest.approx(24.0) and d.trend[-1].recovered == pytest.approx(6.0)
    assert [t.week.label for t in d.trend][::7] == ["2026-W40", "2026-W47"]


def test_a_machine_that_moved_teams_is_counted_where_it_was_and_never_twice() -> None:
    entries = [
        stop("i-1", at(0, 10), team="vision"),
        running("i-1", at(0, 12), team="nlp"),  # retagged while stopped: seen again in nlp
        stop("i-1", at(1, 10), team="nlp"),
        running("i-1", at(1, 13), team="nlp"),
    ]
    vision = build_digest(entries, [], W47, now=END, team="vision")
    nlp = build_digest(entries, [], W47, now=END, team="nlp")
    admins = build_digest(entries, [], W47, now=END)
    assert vision.recovered_dollars == pytest.approx(2.0)
    assert nlp.recovered_dollars == pytest.approx(3.0)
    assert admins.recovered_dollars == pytest.approx(5.0)
    assert admins.teams == {"vision": (pytest.approx(2.0), 0.0), "nlp": (pytest.approx(3.0), 0.0)}


def test_a_week_without_data_says_no_data_not_zero_savings() -> None:
    d = build_digest([stop("i-1", at(-20, 0)), running("i-1", at(-20, 1))], [], W47, now=END, team="ml")
    text = digest_text(d)
    assert not d.has_data and "No data for this week" in text
    assert "Saved:" not in text and "$0.00" not in text.split("Saved, last 8 weeks")[0]
    quiet = build_digest([warn("i-1", at(1, 0))], [], W47, now=END, team="ml")
    assert quiet.has_data and "Saved: $0.00 (no stops this week)" in digest_text(quiet)


def test_unwanted_stops_warnings_without_stop_and_the_window_suggestion() -> None:
    entries = []
    for day in range(3):  # three stops started again within the hour, one kept for a day
        entries += [warn("i-1", at(day, 9)), stop("i-1", at(day, 10)), running("i-1", at(day, 10.5))]
    entries += [warn("i-2", at(3, 9)), warn("i-2", at(3, 9)), warn("i-2", at(4, 9))]  # busy again each time
    entries += [warn("i-3", at(5, 9))]  # still open now: not counted as without stop
    records = [MachineRecord("i-3", "ml", State.WARNED, warned_at=at(5, 9))]
    d = build_digest(entries, records, W47, now=END, team="ml", policy=TeamPolicy(idle_minutes=60))
    assert (d.stops, d.unwanted_stops) == (3, 3)
    assert (d.warnings, d.warnings_without_stop) == (6, 2)
    assert "too short" in d.suggestion and "now 60 min" in d.suggestion
    assert "Suggestion:" in digest_text(d)


def test_the_window_suggestion_reads_the_machines_stops_not_the_deletions_of_endpoints() -> None:
    # Endpoints and Studio apps are deleted after their own window (endpoint_idle_minutes): five deletions none
    # of them unwanted said "the window could be shorter" of the machines' idle_minutes, which decided none.
    entries = []
    for day in range(5):
        entries += [warn(f"endpoint:demo-{day}", at(day, 9)), stop(f"endpoint:demo-{day}", at(day, 10))]
    d = build_digest(entries, [], W47, now=END, team="ml", policy=TeamPolicy(idle_minutes=60))
    assert (d.stops, d.unwanted_stops, d.window_stops) == (5, 0, (0, 0))
    assert d.suggestion == ""
    machines = entries + [e for day in range(5) for e in (warn(f"i-{day}", at(day, 9)), stop(f"i-{day}", at(day, 10)))]
    d = build_digest(machines, [], W47, now=END, team="ml", policy=TeamPolicy(idle_minutes=60))
    assert d.window_stops == (5, 0) and "could be shorter" in d.suggestion and "none of 5 stops" in d.suggestion


def test_keeps_are_waste_by_owner_and_unwatched_machines_are_listed_with_their_cost() -> None:
    keep = {
        "action": "keep",
        "team": "ml",
        "owner": "ada@example.com",
        "by": "U1",
        "snoozed_until": at(0, 12).isoformat(),
        "hourly_cost": 2.0,
    }
    entries = [("i-1", at(0, 10), keep), warn("i-1", at(0, 13))]
    records = [
        MachineRecord("i-7", "ml", State.UNKNOWN, updated_at=END - timedelta(minutes=30), instance_type="g5.xlarge"),
        MachineRecord("i-8", "ml", State.EXEMPT, updated_at=END - timedelta(days=3), instance_type="g5.xlarge"),
        MachineRecord("i-9", "cv", State.SAFE_MODE, updated_at=END, instance_type="g5.xlarge"),
    ]
    d = build_digest(entries, records, W47, now=END, team="ml", prices={"g5.xlarge": 1.006})
    assert [(k.owner, k.keeps, k.hours, k.dollars, k.by) for k in d.kept] == [("ada@example.com", 1, 2.0, 4.0, ("U1",))]
    assert d.top_waste == [("i-1", 4.0)]
    assert [(a.instance_id, a.hourly_cost) for a in d.at_risk] == [("i-7", 1.006)]  # i-8's record is stale
    text = digest_text(d, redirected=True, chart_note="the chart could not be uploaded")
    assert "has no slack_channel" in text and "$1.01/h" in text and "could not be uploaded" in text


def test_under_used_machines_get_the_next_smaller_type_as_a_suggestion() -> None:
    from idle_reaper.core.under_used import next_smaller, under_used, with_peak
    from idle_reaper.pricing import DEFAULT_PRICES

    r = MachineRecord("i-1", "ml", name="big-box", instance_type="g5.2xlarge")
    for value in (12.0, 19.5, 7.0):
        r = with_peak(r, at(1, 0), value)
    assert r.week_peaks == "2026-W47:19.5:3"
    r = with_peak(with_peak(r, at(8, 0), 3.0), at(15, 0), 4.0)  # two later weeks: the oldest is dropped
    assert r.week_peaks == "2026-W48:3:1,2026-W49:4:1"
    assert with_peak(replace(r, week_peaks="garbage,2026-W49:x:1"), at(15, 0), 5.0).week_peaks == "2026-W49:5:1"
    assert next_smaller("g5.2xlarge", DEFAULT_PRICES) == "g5.xlarge"
    assert next_smaller("p3.2xlarge", DEFAULT_PRICES) is None  # no smaller p3 with a price
    assert next_smaller("t3.medium", DEFAULT_PRICES) is None and next_smaller("odd", DEFAULT_PRICES) is None
    records = [
        replace(r, week_peaks="2026-W47:19.5:30"),
        MachineRecord("i-2", "ml", name="busy", instance_type="g5.2xlarge", week_peaks="2026-W47:88:30"),
        MachineRecord("i-3", "ml", name="brief", instance_type="g5.2xlarge", week_peaks="2026-W47:9:3"),
        MachineRecord("i-4", "cv", name="other", instance_type="g5.2xlarge", week_peaks="2026-W47:9:30"),
    ]
    [u] = under_used(records, W47, "ml", DEFAULT_PRICES)
    assert (u.name, u.smaller, u.peak) == ("big-box", "g5.xlarge", 19.5)
    assert u.saves_hourly == pytest.approx(1.212 - 1.006)
    d = build_digest([warn("i-1", at(1, 0))], records, W47, now=END, team="ml", prices=DEFAULT_PRICES)
    assert "Under-used" in digest_text(d) and "g5.xlarge would save $0.21/h" in digest_text(d)
