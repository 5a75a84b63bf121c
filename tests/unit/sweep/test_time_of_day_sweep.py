"""The time-of-day wait through a whole sweep over the in-memory fakes: the usage profile is kept on the
record from the datapoints the sweep already reads (no extra AWS call), a machine usually used soon is
not warned and every place that shows the decision says why, a corrupt profile is today's behaviour, and a
policy that turns the wait off takes effect at the next sweep."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from idle_reaper.core import Action, MachineRecord, State
from idle_reaper.core.time_of_day import (
    PROFILE_DAYS,
    Profile,
    epoch_day,
    epoch_hours,
    format_profile,
    observe,
    parse_profile,
)
from idle_reaper.policy import Settings
from idle_reaper.slack.blocks import warning_blocks
from idle_reaper.sweep import run_sweep
from idle_reaper_tools.admin import status_rows
from testkit.aws import CountingStateStore, FakeAws

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)  # a Friday
PREFIX = "/idle-reaper"
POLICY = '{"idle_minutes": 60, "warn_minutes": 20, "human_active_minutes": 0, "adaptive_wait_max_minutes": 120'


def account(extra: str = "") -> FakeAws:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())
    aws.ssm.store(f"{PREFIX}/teams/ml", POLICY + extra + "}")
    return aws


def busy_at_three_on_weekdays() -> str:
    """Two weeks of a machine used 15:00-15:59 UTC on weekdays."""
    profile: Profile | None = None
    for back in range(PROFILE_DAYS, 0, -1):
        day = NOW.replace(hour=0) - timedelta(days=back)
        busy = epoch_hours([day + timedelta(hours=15)]) if day.weekday() < 5 else ()
        profile = observe(profile, epoch_day(day), busy)
    return format_profile(profile)


def sweep(aws: FakeAws, store: CountingStateStore, now: datetime = NOW) -> dict[str, object]:
    return {d.machine.instance_id: d for d in run_sweep(aws.adapters(store=store), now=now).decisions}


def quiet(t: datetime) -> tuple[float, None, None, None, None]:
    return (1.0, None, None, None, None)


def test_the_profile_is_kept_from_the_sweeps_own_reads_with_no_extra_call() -> None:
    calls = []
    for extra in ("", ', "time_of_day_wait_percent": 0'):
        aws = account(extra)
        busy = aws.launch(
            "m5.large", team="ml", profile=lambda t: (50.0, None, None, None, None), launch_time=NOW - timedelta(days=1)
        )
        store = CountingStateStore()
        sweep(aws, store)
        profile, note = parse_profile(store.load([busy])[busy].usage_profile)
        assert note == "" and profile is not None and profile.newest_day == epoch_day(NOW)
        # The hours of the datapoints read (the window before 15:00) are marked busy.
        assert profile.busy >> ((PROFILE_DAYS - 1) * 24 + 14) & 1
        calls.append((aws.calls(), dict(store.counts)))
    assert calls[0] == calls[1]  # the same AWS and DynamoDB requests with the wait on and off


def test_a_machine_usually_used_soon_is_not_warned_and_says_why_everywhere() -> None:
    aws = account()
    box = aws.launch("m5.large", team="ml", profile=quiet, launch_time=NOW - timedelta(days=1), name="nb")
    plain = aws.launch("m5.large", team="ml", profile=quiet, launch_time=NOW - timedelta(days=1), name="plain")
    store = CountingStateStore()
    profile = busy_at_three_on_weekdays()
    store.save(MachineRecord(box, "ml", usage_profile=profile))
    store.save(MachineRecord(plain, "ml", usage_profile="t1.corrupt"))
    decisions = sweep(aws, store)

    held = decisions[box]
    assert held.action is Action.NONE and held.state is State.IDLE  # type: ignore[attr-defined]
    assert "usually busy around 15:00 UTC on weekdays (9 of its last 9)" in held.reason  # type: ignore[attr-defined]
    # Quiet since 13:25 (the fetched window): usual point 40 min, held the most, 120 min more.
    assert "waiting until 16:05 UTC to warn" in held.reason  # type: ignore[attr-defined]
    rows = {r["instance_id"]: r for r in status_rows(store.load([box, plain]).values(), {}, None, Settings(), NOW)}
    assert "waiting until 16:05 UTC" in rows[box]["reason"]  # `status` says it

    # A corrupt profile is no profile: warned as today, and its profile starts again from this sweep.
    assert decisions[plain].action is Action.WARN  # type: ignore[attr-defined]
    restarted, note = parse_profile(store.load([plain])[plain].usage_profile)
    assert restarted is not None and note == "" and restarted.days_seen == 1

    # Watched all along, it is warned once 160 min of quiet are observed (the newest datapoint lags a
    # period: at 16:10), and the warning and the audit trail say why it waited.
    for minutes in (30, 60, 65):
        assert sweep(aws, store, NOW + timedelta(minutes=minutes))[box].action is Action.NONE  # type: ignore[attr-defined]
    warned = sweep(aws, store, NOW + timedelta(minutes=70))[box]
    assert warned.action is Action.WARN  # type: ignore[attr-defined]
    blocks = warning_blocks(warned, "ref", NOW + timedelta(minutes=70))  # type: ignore[arg-type]
    text = json.dumps([b.to_dict() for b in blocks])
    assert "usually busy around 15:00 UTC on weekdays" in text
    assert any(i == box and "usually busy around 15:00" in entry["reason"] for i, _, entry in store.audits)


def test_a_policy_that_turns_the_wait_off_takes_effect_at_the_next_sweep() -> None:
    aws = account()
    box = aws.launch("m5.large", team="ml", profile=quiet, launch_time=NOW - timedelta(days=1))
    store = CountingStateStore()
    store.save(MachineRecord(box, "ml", usage_profile=busy_at_three_on_weekdays()))
    assert sweep(aws, store)[box].action is Action.NONE  # type: ignore[attr-defined]
    aws.ssm.store(f"{PREFIX}/teams/ml", POLICY + ', "time_of_day_wait_percent": 0}')
    later = sweep(aws, store, NOW + timedelta(minutes=5))[box]
    assert later.action is Action.WARN and "usually busy" not in later.reason  # type: ignore[attr-defined]


def test_a_machine_moved_to_another_team_starts_its_profile_again() -> None:
    aws = account()
    aws.ssm.store(f"{PREFIX}/teams/data", POLICY + "}")
    box = aws.launch("m5.large", team="data", profile=quiet, launch_time=NOW - timedelta(days=1))
    store = CountingStateStore()
    store.save(replace(MachineRecord(box, "ml"), usage_profile=busy_at_three_on_weekdays()))
    decisions = sweep(aws, store)
    assert decisions[box].action is Action.WARN  # type: ignore[attr-defined]
    moved, _ = parse_profile(store.load([box])[box].usage_profile)
    assert moved is not None and moved.days_seen == 1 and moved.busy == 0
