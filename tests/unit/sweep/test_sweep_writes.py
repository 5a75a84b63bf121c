"""Write only what changed: a sweep rewrites a machine's record when its lifecycle changes, plus a bounded
refresh. The lifecycle counts a warning (and an idle-since) only while sweeps watch the machine
(`observed_at` within one idle window), so skipping writes must never make a stop come early, and a gap
in sweeps must still force a fresh warning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from idle_reaper.aws import Concurrency
from idle_reaper.core import Action
from idle_reaper.policy import Settings
from idle_reaper.sweep import REFRESH_EVERY, SweepReport, run_sweep
from testkit.aws import CountingStateStore, FakeAws, quiet_after, steady

T = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"
DAY_AGO = T - timedelta(days=1)


@pytest.fixture(autouse=True, scope="module")
def one_task_at_a_time() -> Iterator[None]:
    """The sweeps' thread pools run their tasks one after another: over the in-memory fakes the same calls and
    answers (what is counted here, reads and writes, does not depend on their order), without the threads each
    pool starts, which were half the time of the steady-state test below (about 2 s -> 0.9 s)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Concurrency, "runner", staticmethod(lambda fn, items, workers: [fn(item) for item in items]))
        yield


def account(policy: dict[str, int]) -> FakeAws:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())
    aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps(policy))
    return aws


def sweep(aws: FakeAws, store: CountingStateStore, now: datetime) -> SweepReport:
    return run_sweep(aws.adapters(store=store), now=now)


def quiet_since(start: datetime):  # busy until the 5-minute period before `start`, idle after
    return quiet_after(start - timedelta(minutes=5), (60.0,), (1.0,))


@pytest.mark.parametrize(("idle", "warn"), [(90, 30), (30, 20), (15, 5)])
def test_a_warned_machine_not_rewritten_every_sweep_is_stopped_on_time_and_never_early(idle: int, warn: int) -> None:
    aws = account({"idle_minutes": idle, "warn_minutes": warn})
    # Quiet for exactly the warning point at T: warned at T, due at T + warn.
    box = aws.launch(
        "m5.large", team="ml", profile=quiet_since(T - timedelta(minutes=idle - warn)), launch_time=DAY_AGO
    )
    store = CountingStateStore()
    first = sweep(aws, store, T).decisions[0]
    assert first.action is Action.WARN
    versions, stopped_at = [store.records[box].version], None
    for minutes in range(5, warn + 30, 5):
        now = T + timedelta(minutes=minutes)
        d = sweep(aws, store, now).decisions[0]
        if d.action is Action.STOP:
            stopped_at = now
            break
        assert aws.ec2.state_of(box) == "running", f"stopped early at +{minutes} min"
        versions.append(store.records[box].version)
    assert stopped_at == T + timedelta(minutes=warn), "stopped on time, on the first sweep the warning allows"
    assert aws.ec2.state_of(box) == "stopped"
    if idle // 3 > 5:  # the refresh bound is longer than a sweep: some sweeps wrote nothing for it
        assert len(set(versions)) < len(versions), versions


def test_a_gap_in_sweeps_forces_a_fresh_warning_even_when_the_record_lags() -> None:
    aws = account({"idle_minutes": 90, "warn_minutes": 30})
    box = aws.launch("m5.large", team="ml", profile=quiet_since(T - timedelta(minutes=60)), launch_time=DAY_AGO)
    store = CountingStateStore()
    assert sweep(aws, store, T).decisions[0].action is Action.WARN
    for minutes in (5, 10, 15):  # watched, nothing to write
        assert sweep(aws, store, T + timedelta(minutes=minutes)).decisions[0].action is Action.NONE
    assert store.records[box].observed_at == T, "the stored observation lags the last sweep"
    # Then no sweep for longer than the idle window since the stored observation: warned afresh, never stopped.
    d = sweep(aws, store, T + timedelta(minutes=91)).decisions[0]
    assert d.action is Action.WARN and aws.ec2.state_of(box) == "running"
    assert store.records[box].warned_at == T + timedelta(minutes=91)


def test_steady_state_writes_stay_under_ten_percent_and_every_record_is_refreshed_within_the_hour() -> None:
    # Busy machines, and quiet ones whose warning (at 90 quiet minutes) falls after this hour. 400, kept (the time
    # went to the thread pools): the refresh points spread over the hour by a hash of the id, and at 200 machines
    # the busiest sweep writes 29 against the 15 % bound of 30; at 400, 45 against 60.
    aws = account({"idle_minutes": 120, "warn_minutes": 30})
    boxes = [aws.launch("m5.large", team="ml", profile=steady(70.0), launch_time=DAY_AGO) for _ in range(300)] + [
        aws.launch("m5.large", team="ml", profile=quiet_since(T - timedelta(minutes=10)), launch_time=DAY_AGO)
        for _ in range(100)
    ]
    store = CountingStateStore()
    sweep(aws, store, T)
    per_sweep = []
    for n in range(1, 13):  # one hour of 5-minute sweeps
        before = store.counts["save"]
        sweep(aws, store, T + timedelta(minutes=5 * n))
        per_sweep.append(store.counts["save"] - before)
    # One refresh per machine per hour, each at its own point: 1/12 of the fleet a 5-minute sweep on average.
    assert sum(per_sweep) / len(per_sweep) <= 0.10 * len(boxes), per_sweep
    assert max(per_sweep) <= 0.15 * len(boxes), per_sweep
    assert sum(per_sweep) >= len(boxes), "every record was refreshed within the hour"
    end = T + timedelta(minutes=60)
    assert all(end - store.records[b].updated_at <= REFRESH_EVERY for b in boxes)
    quiet = boxes[300:]
    assert all(end - store.records[b].observed_at <= timedelta(minutes=60) for b in quiet)


def test_a_lifecycle_change_is_written_at_once() -> None:
    aws = account({"idle_minutes": 90, "warn_minutes": 30})
    box = aws.launch("m5.large", team="ml", profile=steady(70.0), launch_time=DAY_AGO)
    store = CountingStateStore()
    sweep(aws, store, T)
    version = store.records[box].version
    sweep(aws, store, T + timedelta(minutes=5))
    assert store.records[box].version == version, "a busy machine with nothing new is not rewritten"
    aws.ssm.store(f"{PREFIX}/teams/ml", json.dumps({"idle_minutes": 60, "warn_minutes": 30}))
    d = sweep(aws, store, T + timedelta(minutes=10)).decisions[0]
    assert store.records[box].version == version + 1, "a new policy version is a lifecycle change"
    assert store.records[box].policy_version == d.record.policy_version


# ---------------------------------------------------------------------------------------------
# Time-aware sweeps: short of time, start nothing new, finish and record what began.


class Budget:
    """Seconds left, as a scripted series of answers (the sweep asks before each claim and each post);
    none once the script ends."""

    def __init__(self, *answers: float) -> None:
        self.answers = list(answers)

    def __call__(self) -> float:
        return self.answers.pop(0) if self.answers else 0.0


PLENTY, NONE = 600.0, 0.0


def quiet_boxes(aws: FakeAws, count: int, *, minutes: int) -> list[str]:
    """`count` machines of team ml, quiet for the last `minutes` at T."""
    profile = quiet_since(T - timedelta(minutes=minutes))
    return [aws.launch("m5.large", team="ml", profile=profile, launch_time=DAY_AGO) for _ in range(count)]


def test_a_sweep_short_of_time_claims_nothing_more_and_the_next_sweep_takes_the_rest() -> None:
    aws = account({"idle_minutes": 90, "warn_minutes": 30})
    idle = quiet_boxes(aws, 6, minutes=60)
    store = CountingStateStore()
    # Time for two of the six claims; then, asked again before posting, time for those two posts.
    script = (PLENTY, PLENTY, NONE, NONE, NONE, NONE, PLENTY, PLENTY)
    report = run_sweep(aws.adapters(store=store), now=T, time_left=Budget(*script))
    warned = {d.machine.instance_id for d in report.decisions if d.action is Action.WARN and not d.error}
    deferred = {d.machine.instance_id for d in report.deferred}
    assert len(warned) == 2 and deferred == set(idle) - warned
    assert report.errors == [], "running short of time is not an error"
    # Deferred machines: no record, no claim, no warning; warned ones are recorded and released.
    assert all(i not in store.records for i in deferred)
    assert all(store.records[i].warning_delivered_at == T and store.claim_of(i) is None for i in warned)

    later = run_sweep(aws.adapters(store=store), now=T + timedelta(minutes=5))
    assert {d.machine.instance_id for d in later.decisions if d.action is Action.WARN} == deferred


def test_out_of_time_after_acting_still_records_every_stop_and_posts_nothing_new() -> None:
    aws = account({"idle_minutes": 90, "warn_minutes": 30})
    due = quiet_boxes(aws, 3, minutes=60)
    store = CountingStateStore()
    run_sweep(aws.adapters(store=store), now=T)  # warned at T, due at T + 30
    [fresh] = quiet_boxes(aws, 1, minutes=30)
    # Enough time to claim the four machines, none left once the stops are done.
    report = run_sweep(
        aws.adapters(store=store), now=T + timedelta(minutes=30), time_left=Budget(PLENTY, PLENTY, PLENTY, PLENTY)
    )
    actions = {d.machine.instance_id: d for d in report.decisions}
    for i in due:
        assert aws.ec2.state_of(i) in ("stopping", "stopped")
        assert store.records[i].state.value == "reaped" and store.claim_of(i) is None, "a stop is always recorded"
        assert actions[i].error is None
    # The new warning was not posted: its record is as before the sweep (none), its claim released.
    assert actions[fresh].error is not None and "deferred" in actions[fresh].error
    assert store.claim_of(fresh) is None
    assert store.records[fresh].warned_at is None


def test_a_learned_wait_longer_than_the_fetched_window_is_still_reached_and_the_machine_stopped() -> None:
    """Issue 22, point 7: the machine's history moves its warning point past idle_minutes + max_gap_minutes
    (what a sweep fetches); quiet is measured from the stretch the record knows, so it is warned and then
    stopped, within idle_minutes + adaptive_wait_max_minutes of quiet plus the answer time."""
    from dataclasses import replace as with_fields

    from idle_reaper.core import MachineRecord, format_history

    policy = {"idle_minutes": 60, "warn_minutes": 20, "adaptive_wait_max_minutes": 120}
    aws = account(policy)
    quiet_from = T - timedelta(minutes=5)
    box = aws.launch("m5.large", team="ml", profile=quiet_since(quiet_from), launch_time=DAY_AGO)
    store = CountingStateStore()
    sweep(aws, store, T - timedelta(minutes=10))  # busy: the record exists
    stretches = [(quiet_from.hour, m) for m in (45, 60, 75, 90, 105, 120, 135, 150, 165, 180)]
    stored = store.records[box]
    store.records[box] = with_fields(stored, quiet_history=format_history(stretches))
    assert isinstance(store.records[box], MachineRecord)
    warned_at = stopped_at = None
    for n in range(0, 60):  # five hours of 5-minute sweeps
        now = T + timedelta(minutes=5 * n)
        d = sweep(aws, store, now).decisions[0]
        if d.action is Action.WARN and warned_at is None:
            warned_at = now
            assert "waits" in d.reason, "the learned wait is said"
        if d.action is Action.STOP:
            stopped_at = now
            break
    assert warned_at is not None and warned_at - quiet_from > timedelta(minutes=60 + 15), "past the fetched window"
    assert stopped_at is not None and stopped_at - quiet_from <= timedelta(minutes=60 + 120 + 20 + 5)
