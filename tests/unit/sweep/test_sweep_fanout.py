"""The fan-out over the in-memory AWS fakes: the planner splits the fleet into shards, shard workers sweep
them, the gather step sums them. Every machine in exactly one shard, a failed shard touches nothing and is
reported and retried, bad events change nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from idle_reaper.aws import GET_METRIC_DATA_SECONDS, GET_METRIC_DATA_TPS, METRIC_WORKERS
from idle_reaper.core import Action, Machine, State
from idle_reaper.notify import LoggingNotifier
from idle_reaper.policy import Settings
from idle_reaper.sweep import (
    FAILED_SHARDS_ALERT_AFTER,
    MIN_SHARD_SIZE,
    SHARD_SIZE,
    SHARDS_AT_ONCE,
    GatherTask,
    ShardDone,
    ShardTask,
    SweepCannotRun,
    SweepTotals,
    gather_sweep,
    logger,
    manifest_key,
    metric_workers,
    plan_sweep,
    run_shard,
    run_sharded,
    run_sweep,
    shard_count,
    split_into_shards,
)
from idle_reaper.sweep import run as sweep_run
from testkit.aws import CountingStateStore, FakeAws, client_error, steady

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
WARN_SWEEP = NOW - timedelta(minutes=30)
DAY_AGO = NOW - timedelta(days=1)
PREFIX = "/idle-reaper"
ML = '{"idle_minutes": 90, "warn_minutes": 30}'
IDLE, BUSY = steady(1.0), steady(70.0)


def account() -> FakeAws:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())
    aws.ssm.store(f"{PREFIX}/teams/ml", ML)
    aws.ssm.store(f"{PREFIX}/teams/vision", ML)
    return aws


def fleet(aws: FakeAws, idle: int = 7, busy: int = 3) -> tuple[list[str], list[str]]:
    """Idle and busy standalone machines of two teams, plus a group of three idle unprotected members."""
    aws.autoscaling.add_group("ml-workers", min_size=0)
    idle_ids = [
        aws.launch("m5.large", team=("ml", "vision")[i % 2], profile=IDLE, launch_time=DAY_AGO) for i in range(idle)
    ]
    busy_ids = [aws.launch("g5.xlarge", team="ml", profile=BUSY, launch_time=DAY_AGO) for _ in range(busy)]
    for _ in range(3):
        busy_ids.append(aws.launch("m5.large", team="ml", profile=BUSY, launch_time=DAY_AGO, group="ml-workers"))
    return idle_ids, busy_ids


def machine(instance_id: str, group: str | None = None) -> Machine:
    return Machine(instance_id=instance_id, instance_type="m5.large", team="ml", launch_time=DAY_AGO, asg_name=group)


@pytest.mark.parametrize(("groups", "singles", "shards"), [(0, 25, 4), (3, 10, 3), (1, 0, 2), (5, 40, 7)])
def test_every_machine_is_in_exactly_one_shard_and_a_group_stays_together(groups: int, singles: int, shards: int):
    machines = [machine(f"i-s{i:04d}") for i in range(singles)]
    machines += [machine(f"i-g{g}m{i}", f"group-{g}") for g in range(groups) for i in range(g + 2)]
    manifests = split_into_shards(machines, shards)
    assert len(manifests) == shards
    placed = [i for ids in manifests for i in ids]
    assert sorted(placed) == sorted(m.instance_id for m in machines), "each machine once, none lost"
    for g in range(groups):
        homes = {n for n, ids in enumerate(manifests) if any(i.startswith(f"i-g{g}m") for i in ids)}
        assert len(homes) == 1, f"group-{g} split over shards {homes}"
    sizes = [len(ids) for ids in manifests]
    largest_unit = max([g + 2 for g in range(groups)] + [1 if singles else 0])
    assert max(sizes) - min(sizes) <= largest_unit, sizes


def test_a_sharded_sweep_decides_and_acts_as_one_sweep_would():
    aws, twin = account(), account()
    idle, busy = fleet(aws)
    fleet(twin)
    store, twin_store = CountingStateStore(), CountingStateStore()
    for now in (WARN_SWEEP, NOW):
        sharded = run_sharded(aws.adapters(store=store), now=now, shard_size=3, workers=3)
        single = run_sweep(twin.adapters(store=twin_store), now=now)
        assert sharded.plan.shards == 5 and not sharded.gathered.failed
        assert sorted((d.machine.team, d.state, d.action) for d in sharded.merged().decisions) == sorted(
            (d.machine.team, d.state, d.action) for d in single.decisions
        )
        assert sharded.gathered.teams == dict(single.summary.teams), "one summary, summed over the shards"
        assert sharded.gathered.machines == len(idle) + len(busy)
    assert {i for i in idle if aws.ec2.state_of(i) == "stopped"} == set(idle)
    assert all(aws.ec2.state_of(i) == "running" for i in busy), "never stop a busy machine"
    assert sharded.gathered.hourly_savings > 0, "the stops are counted as savings"
    assert sharded.gathered.hourly_savings == pytest.approx(
        sum(t.hourly_savings for t in single.summary.teams.values())
    )


def test_a_large_shard_read_in_chunks_decides_and_acts_as_one_read_would(monkeypatch):
    """A shard of more than SHARD_CHUNK machines is described and read a chunk at a time, two at once (so that at
    200,000 machines one chunk's GetMetricData waits overlap the next one's Describe* waits): every machine is
    described, read and decided as when the shard is read whole, none twice, none lost."""
    aws, twin = account(), account()
    idle, busy = fleet(aws)
    assert fleet(twin) == (idle, busy)
    ids = idle + busy
    store, twin_store = CountingStateStore(), CountingStateStore()
    for now in (WARN_SWEEP, NOW):
        monkeypatch.setattr(sweep_run, "SHARD_CHUNK", 3)
        chunked = run_sweep(aws.adapters(store=store), now=now, instance_ids=ids)
        monkeypatch.setattr(sweep_run, "SHARD_CHUNK", 1_000)
        whole = run_sweep(twin.adapters(store=twin_store), now=now, instance_ids=ids)
        assert [d.machine.instance_id for d in chunked.decisions] == ids
        assert [(d.state, d.action, d.reason) for d in chunked.decisions] == [
            (d.state, d.action, d.reason) for d in whole.decisions
        ]
    assert aws.ec2.calls["DescribeInstances"] > twin.ec2.calls["DescribeInstances"], "it was read in chunks"
    assert {i for i in idle if aws.ec2.state_of(i) == "stopped"} == set(idle)
    assert all(aws.ec2.state_of(i) == "running" for i in busy), "never stop a busy machine"


def test_a_studio_listing_that_failed_is_said_once_by_a_sweep_read_in_chunks(monkeypatch):
    # It was said by each chunk's read: a shard of 13 machines in chunks of 3 repeated it five times.
    aws = account()
    idle, busy = fleet(aws)
    adapters = aws.adapters(store=CountingStateStore())
    adapters.fleet.studio_unlisted = "AccessDeniedException: not allowed"
    monkeypatch.setattr(sweep_run, "SHARD_CHUNK", 3)
    report = run_sweep(adapters, now=WARN_SWEEP, instance_ids=idle + busy)
    assert len(idle + busy) > 3 * 2
    assert sum("could not list SageMaker Studio apps" in w for w in report.warnings) == 1


class FailingShard(CountingStateStore):
    """The state table refuses one shard's manifest read (a throttling storm on that worker)."""

    def __init__(self, shard: int) -> None:
        super().__init__()
        self.shard: int | None = shard

    def get_lookup(self, key: str, now: datetime) -> str | None:
        if self.shard is not None and key.startswith("shard#") and key.endswith(f"#{self.shard}"):
            raise client_error("GetItem", "ProvisionedThroughputExceededException")
        return super().get_lookup(key, now)


class Alerts(LoggingNotifier):
    def __init__(self) -> None:
        super().__init__(logger, delivers=True)
        self.alerts: list[str] = []

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        self.alerts.append(text)


def test_a_failed_shard_touches_nothing_is_reported_alerted_after_repeated_failures_and_retried():
    aws = account()
    idle, _ = fleet(aws, idle=9, busy=0)
    store, notifier = FailingShard(shard=1), Alerts()
    runs = []
    for minutes in range(FAILED_SHARDS_ALERT_AFTER):
        now = WARN_SWEEP + timedelta(minutes=minutes)
        runs.append(
            run_sharded(aws.adapters(store=store, notifier=notifier), now=now, shard_size=4, sweep_id=f"s{minutes}")
        )
        assert notifier.alerts == [] or minutes == FAILED_SHARDS_ALERT_AFTER - 1
    first = runs[0]
    assert set(first.gathered.failed) == {1} and "ProvisionedThroughputExceeded" in first.gathered.failed[1]
    assert any("shard 1 failed" in w for w in first.merged().warnings)
    failed_ids = set(json.loads(CountingStateStore.get_lookup(store, manifest_key("s0", 1), WARN_SWEEP) or "[]"))
    assert failed_ids
    assert not failed_ids & set(store.records), "the failed shard's machines are untouched"
    warned = {d.machine.instance_id for d in first.merged().decisions if d.action is Action.WARN}
    assert warned == set(idle) - failed_ids, "the other shards act normally"
    assert len(notifier.alerts) == 1 and f"{FAILED_SHARDS_ALERT_AFTER} sweeps in a row" in notifier.alerts[0]

    store.shard = None  # the storm is over: the next sweep plans them again and takes them
    retry = run_sharded(
        aws.adapters(store=store, notifier=notifier), now=WARN_SWEEP + timedelta(minutes=5), shard_size=4
    )
    assert not retry.gathered.failed
    assert {d.machine.instance_id for d in retry.merged().decisions if d.action is Action.WARN} == failed_ids
    assert len(notifier.alerts) == 1, "no new alert once shards succeed"


def test_a_shard_whose_manifest_is_missing_sweeps_nothing():
    aws = account()
    fleet(aws)
    store = CountingStateStore()
    task = ShardTask(sweep_id="never-planned", now=NOW, shard=0)
    with pytest.raises(SweepCannotRun, match="no manifest"):
        run_shard(aws.adapters(store=store), task)
    assert store.records == {} and aws.write_calls() == 0


def test_a_planned_shard_sweeps_its_own_machines_only():
    aws = account()
    fleet(aws)
    store = CountingStateStore()
    plan = plan_sweep(aws.adapters(store=store), now=WARN_SWEEP, shard_size=4)
    assert plan.shards == 4 and len(plan.listed) == plan.machines, "kept for the daily doctor, never in the input"
    report, totals = run_shard(aws.adapters(store=store), ShardTask(sweep_id=plan.sweep_id, now=WARN_SWEEP, shard=2))
    manifest = json.loads(store.get_lookup(manifest_key(plan.sweep_id, 2), WARN_SWEEP) or "[]")
    assert sorted(d.machine.instance_id for d in report.decisions) == sorted(manifest)
    assert totals.machines == len(manifest) and set(store.records) <= set(manifest)


def test_a_fleet_that_fits_one_shard_is_planned_in_place_without_manifests():
    aws = account()
    idle, busy = fleet(aws)
    store = CountingStateStore()
    plan = plan_sweep(aws.adapters(store=store), now=NOW, in_place=True)
    assert plan.shards == 1 and len(plan.listed) == len(idle) + len(busy)
    assert store.counts["PutItem"] == 0 and store.lookups == {}


@pytest.mark.parametrize(
    "event",
    [
        {},
        {"sweep_id": "s1", "now": NOW.isoformat(), "shard": -1},
        {"sweep_id": "s1", "now": "2026-11-20T15:00:00", "shard": 0},  # no time zone
        {"sweep_id": "s1/../x", "now": NOW.isoformat(), "shard": 0},
        {"sweep_id": "s1", "now": NOW.isoformat(), "shard": 0, "instance_ids": ["i-1"]},  # no smuggled ids
    ],
)
def test_a_malformed_shard_event_is_refused(event: dict[str, Any]):
    with pytest.raises(ValidationError):
        ShardTask.model_validate(event)


def test_gather_counts_a_shard_without_result_as_failed_and_a_dry_run_counts_nothing():
    aws = account()
    fleet(aws)
    store = CountingStateStore()
    plan = plan_sweep(aws.adapters(store=store), now=NOW, shard_size=6)
    run_shard(aws.adapters(store=store), ShardTask(sweep_id=plan.sweep_id, now=NOW, shard=0))
    event = {
        "sweep_id": plan.sweep_id,
        "now": NOW.isoformat(),
        "shards": [0, 1],
        "results": [{"shard": 0}, {"shard": 1}],
    }
    task = GatherTask.model_validate(event)
    gathered = gather_sweep(aws.adapters(store=store), task)
    assert gathered.failed == {1: "no result recorded"} and gathered.machines > 0
    assert store.get_lookup("fanout#consecutive-failed-sweeps", NOW) == "1"
    gather_sweep(aws.adapters(store=store), task.model_copy(update={"dry_run": True}))
    assert store.get_lookup("fanout#consecutive-failed-sweeps", NOW) == "1", "a dry run is no sweep"


@pytest.mark.parametrize(
    ("machines", "shards"),
    [
        (0, 1),
        (SHARD_SIZE, 1),  # one shard: swept in place, however many lanes are idle
        (SHARD_SIZE + 1, 2),
        (3 * MIN_SHARD_SIZE, 3),  # spread over idle lanes down to MIN_SHARD_SIZE a shard
        (50_000, 10),
        (200_000, 30),  # 30 shards of 6,667, not 20 of 10,000
        (SHARDS_AT_ONCE * SHARD_SIZE, SHARDS_AT_ONCE),
        (SHARDS_AT_ONCE * SHARD_SIZE + 1, SHARDS_AT_ONCE + 1),  # past one wave: never more than SHARD_SIZE a shard
        (1_000_000, 100),
    ],
)
def test_a_fleet_is_spread_over_the_idle_lanes_without_passing_either_shard_size(machines: int, shards: int):
    assert shard_count(machines, SHARD_SIZE, SHARDS_AT_ONCE) == shards
    if shards > 1:
        largest = -(-machines // shards)
        assert largest <= SHARD_SIZE
        assert machines // shards >= MIN_SHARD_SIZE or shards == -(-machines // SHARD_SIZE)


def test_a_small_shard_size_keeps_its_own_count():
    # Tests and local runs shard tiny fleets: the spreading never goes below MIN_SHARD_SIZE machines a shard.
    assert shard_count(9, 3, SHARDS_AT_ONCE) == 3
    assert shard_count(10, 3, 2) == 4


def test_the_shards_at_once_keep_get_metric_data_within_its_quota():
    # One metric thread a shard at the Map's full width, and no more calls in flight than the quota allows.
    assert metric_workers(SHARDS_AT_ONCE) == 1
    assert SHARDS_AT_ONCE <= GET_METRIC_DATA_TPS * GET_METRIC_DATA_SECONDS


@pytest.mark.parametrize("concurrent", [1, 2, 5, 20, 40, 1000])
def test_shards_running_at_once_share_the_get_metric_data_quota(concurrent: int):
    threads = metric_workers(concurrent)
    assert 1 <= threads <= METRIC_WORKERS
    # Calls in flight across the shards, at ~0.6 s a call, stay under the quota's 50 a second (one each at least).
    assert concurrent * threads <= max(concurrent, GET_METRIC_DATA_TPS * GET_METRIC_DATA_SECONDS)
    if concurrent == 1:
        assert threads == METRIC_WORKERS, "a sweep alone keeps its full pool"


def test_a_shard_worker_out_of_time_touches_nothing_more_and_the_gather_step_counts_what_it_left():
    aws = account()
    idle, busy = fleet(aws)
    store = CountingStateStore()
    plan = plan_sweep(aws.adapters(store=store), now=WARN_SWEEP, shard_size=7)
    out_of_time = ShardTask(sweep_id=plan.sweep_id, now=WARN_SWEEP, shard=0)
    report, totals = run_shard(aws.adapters(store=store), out_of_time, time_left=lambda: 1.0)
    assert report.decisions and totals.deferred == len(report.deferred) == len(report.decisions)
    assert not {d.machine.instance_id for d in report.decisions} & set(store.records), "nothing claimed or written"
    run_shard(aws.adapters(store=store), ShardTask(sweep_id=plan.sweep_id, now=WARN_SWEEP, shard=1))
    gathered = gather_sweep(
        aws.adapters(store=store), GatherTask(sweep_id=plan.sweep_id, now=WARN_SWEEP, shards=[0, 1])
    )
    assert gathered.deferred == totals.deferred and gathered.failed == {}
    assert gathered.machines == len(idle) + len(busy), "a deferred machine is still a machine seen"
    shard_1 = set(json.loads(store.get_lookup(manifest_key(plan.sweep_id, 1), WARN_SWEEP) or "[]"))
    assert set(idle) & shard_1
    assert {i for i, r in store.records.items() if r.warned_at} == set(idle) & shard_1, "shard 1 went on"


def test_an_owners_machines_share_a_shard_so_their_warnings_share_a_message():
    from dataclasses import replace as with_

    from idle_reaper.sweep import OWNER_UNIT_MAX

    ann = [with_(machine(f"i-ann{i:03d}"), owner="ann@example.com") for i in range(5)]
    ann[0] = with_(ann[0], owner=" ANN@example.com")  # the same person, as core.owner_message_groups reads it
    bob = [with_(machine(f"i-bob{i:04d}"), owner="U0BOB") for i in range(OWNER_UNIT_MAX * 2 + 10)]
    others = [machine(f"i-s{i:04d}") for i in range(300)]
    manifests = split_into_shards([*ann, *bob, *others], 6)

    homes = {n for n, ids in enumerate(manifests) for i in ids if i.startswith("i-ann")}
    assert len(homes) == 1, "one owner's machines in one shard"
    bob_homes = [sum(i.startswith("i-bob") for i in ids) for ids in manifests]
    assert sum(1 for n in bob_homes if n) >= 2, "an owner with very many machines is split in chunks"
    assert sorted(i for ids in manifests for i in ids) == sorted(m.instance_id for m in [*ann, *bob, *others])


def test_a_shards_stops_keep_to_its_share_of_ec2s_stop_buckets_and_the_rest_wait_for_the_next_sweep(
    virtual_pacing: list[float],
):
    """Issue 43 (4), EC2's mutating buckets: StopInstances allows 1,000 instances at once, then 20 a second, per
    account and region, shared by the 30 shards of a sweep: a shard's share is 33 at once and 0.67 a second.
    Before, a shard sent all its stops at once (200 a call), whatever the share: past EC2's bucket they were
    throttled, and failed. Now a batch waits for its share (at most 10 s) or is not sent: its machines are left
    to the next sweep, untouched and counted as deferred, never as errors."""
    aws = account()
    idle = [aws.launch("m5.large", team="ml", profile=IDLE, launch_time=DAY_AGO) for _ in range(60)]
    store = CountingStateStore()

    def sweep(sweep_id: str, now: datetime) -> SweepTotals:
        adapters = aws.adapters(store=store)
        assert plan_sweep(adapters, now=now, sweep_id=sweep_id).shards == 1
        return run_shard(adapters, ShardTask(sweep_id=sweep_id, now=now, shard=0, concurrent_shards=SHARDS_AT_ONCE))[1]

    sweep("warn", WARN_SWEEP)
    reaping = sweep("reap", NOW)
    stopped = {i for i in idle if aws.ec2.state_of(i) == "stopped"}
    assert len(stopped) in (27, 33), "one batch of at most the shard's 33, the other not sent"
    assert max(len(r["InstanceIds"]) for r in aws.ec2.requests_of("StopInstances")) <= 33
    assert reaping.deferred == 60 - len(stopped) and reaping.errors == 0
    assert all(
        store.records[i].state is State.WARNED and store.records[i].last_action != "stop_failed"
        for i in set(idle) - stopped
    ), "left as they were, for the next sweep"
    later = sweep("next", NOW + timedelta(minutes=5))
    assert all(aws.ec2.state_of(i) == "stopped" for i in idle) and later.errors == 0


def test_a_shard_that_cannot_describe_its_machines_leaves_them_unknown_and_says_how_many():
    """Issue 43 (4): a throttled describe never makes a machine idle. A shard whose DescribeInstances is refused
    past its retries sweeps nothing; the gather step reports it with the number of its machines, untouched and
    unknown until the next sweep, and the other shards go on."""
    aws = account()
    idle, busy = fleet(aws)
    store = CountingStateStore()
    adapters = aws.adapters(store=store)
    plan = plan_sweep(adapters, now=WARN_SWEEP, sweep_id="t", shard_size=5)
    held = json.loads(store.get_lookup(manifest_key("t", 0), WARN_SWEEP) or "[]")
    aws.ec2.inject("DescribeInstances", "RequestLimitExceeded")
    with pytest.raises(SweepCannotRun, match="RequestLimitExceeded"):
        run_shard(adapters, ShardTask(sweep_id="t", now=WARN_SWEEP, shard=0, concurrent_shards=plan.shards))
    aws.ec2.clear_faults()
    for shard in range(1, plan.shards):
        run_shard(adapters, ShardTask(sweep_id="t", now=WARN_SWEEP, shard=shard, concurrent_shards=plan.shards))
    task = GatherTask(
        sweep_id="t", now=WARN_SWEEP, shards=list(range(plan.shards)), results=[ShardDone(shard=0, error="throttled")]
    )
    gathered = gather_sweep(adapters, task)
    assert set(gathered.failed) == {0} and gathered.unswept == len(held) > 0
    assert any(f"its {len(held)} machines are untouched and unknown" in w for w in gathered.warnings)
    assert not set(held) & set(store.records), "none of them touched, none counted idle"
    assert gathered.machines == len(idle) + len(busy) - len(held)
