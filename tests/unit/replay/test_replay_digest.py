"""The weekly digest's savings agree with the replay's for the same trace: the replay core writes the audit
trail a sweep would, and the digest built from it finds the same dollars, team by team, within a cent."""

from __future__ import annotations

import io
from datetime import UTC, datetime

import pytest

from idle_reaper.core.digest import build_digest, week_of
from idle_reaper.pricing import DEFAULT_PRICES
from idle_reaper_tools.replay import ReplayOptions, parse_trace, replay
from testkit.generate_trace import DEFAULT_START, fleet, write_trace


def test_digest_savings_match_the_replay_within_a_cent() -> None:
    text = io.StringIO()
    # Monday to Friday: one ISO week. Every machine reports every period, so every stopped hour is a quiet
    # one (the replay counts quiet hours while stopped; the digest, which cannot see a stopped machine,
    # counts stopped hours: docs/policy.md says so).
    write_trace(fleet(24, 5, seed=7, always_on=True), DEFAULT_START, text)
    trace = parse_trace(io.StringIO(text.getvalue()), "generated")
    result = replay(trace, ReplayOptions(audit_prices=DEFAULT_PRICES), workers=1)
    last_bucket = max(s.first_bucket + len(s) for s in trace.series)
    end = datetime.fromtimestamp(last_bucket * trace.period_seconds, UTC)  # the replay's end point: the trace's end
    week = week_of(DEFAULT_START)
    assert result.reaper.fleet.stops >= 10 and len(result.reaper.teams) >= 2, "a trace with stops to count"
    for team, totals in result.reaper.teams.items():
        digest = build_digest(result.audit, [], week, now=end, team=team)
        assert totals.dollars is not None and digest.stops == totals.stops
        assert digest.recovered_dollars == pytest.approx(totals.dollars, abs=0.01), team
    admins = build_digest(result.audit, [], week, now=end)
    assert result.reaper.fleet.dollars is not None and result.reaper.fleet.dollars > 10
    assert admins.recovered_dollars == pytest.approx(result.reaper.fleet.dollars, abs=0.01)
