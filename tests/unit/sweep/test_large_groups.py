"""Issue 43 (7): a shard manifest kept in the state table never passes DynamoDB's 400 KB item, however large an Auto
Scaling group or a shard: a group larger than a shard is cut across shards, whose parts share its termination
headroom, and a manifest that would not fit one item is kept in pages. Small groups are planned as before."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.core import GroupPart, Machine
from idle_reaper.policy import Settings
from idle_reaper.sweep import (
    SHARD_SIZE,
    GatherTask,
    ShardTask,
    SweepReport,
    fanout,
    gather_sweep,
    plan_sweep,
    run_shard,
    run_sharded,
    split_into_shards,
)
from idle_reaper.sweep.shards import ShardManifest, manifest_pages, plan_shards, read_manifest
from testkit.aws import CountingStateStore, FakeAws, steady
from testkit.aws_rules import ITEM_MAX_BYTES

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
WARN_SWEEP = NOW - timedelta(minutes=30)
DAY_AGO = NOW - timedelta(days=1)
PREFIX = "/idle-reaper"
FLEET = 20_000  # a manifest of all of them: 20,000 ids of 23 bytes with their quotes and separator, 460 KB


def account(teams: dict[str, str]) -> FakeAws:
    aws = FakeAws()
    aws.ssm.store(f"{PREFIX}/settings", Settings().model_dump_json())
    for team, policy in teams.items():
        aws.ssm.store(f"{PREFIX}/teams/{team}", policy)
    return aws


@pytest.mark.parametrize(
    ("group", "shard_size"),
    [
        pytest.param("big", SHARD_SIZE, id="a group of 20,000 machines"),
        pytest.param(None, 25_000, id="a shard of 20,000 machines"),
    ],
)
def test_a_manifest_too_large_for_one_item_never_fails_the_sweep(monkeypatch, group: str | None, shard_size: int):
    """Before: the planner wrote one item per shard, and a shard holding a group of 20,000 machines (or 20,000 machines
    at all) made a 460 KB item: DynamoDB refused it (ValidationException), the plan failed and nothing was swept.
    Now every item fits, and every machine reaches exactly one shard's sweep. The machines' own sweep is not run
    here (20,000 machines' decisions take seconds; benchmarks/ sweep fleets of that size): each shard worker hands
    its manifest to run_sweep, recorded."""
    aws = account({"ml": '{"idle_minutes": 90, "warn_minutes": 30}'})
    if group:
        aws.autoscaling.add_group(group, min_size=0, max_size=FLEET)
    idle = steady(1.0)
    ids = {aws.launch("m5.large", team="ml", profile=idle, launch_time=DAY_AGO, group=group) for _ in range(FLEET)}
    store = CountingStateStore()  # refuses an item over 400 KB, as DynamoDB does
    adapters = aws.adapters(store=store)
    handed: dict[int, tuple[list[str], dict[str, GroupPart]]] = {}

    def sweep(_: Any, **asked: Any) -> SweepReport:
        shard = int(asked["sweep_id"].rsplit("-", 1)[1])
        handed[shard] = (list(asked["instance_ids"]), dict(asked.get("group_parts") or {}))
        return SweepReport(now=asked["now"], dry_run=asked["dry_run"], decisions=[], settings_version=None)

    monkeypatch.setattr(fanout, "run_sweep", sweep)
    plan = plan_sweep(adapters, now=NOW, sweep_id="large", shard_size=shard_size)
    for shard in range(plan.shards):
        run_shard(adapters, ShardTask(sweep_id="large", now=NOW, shard=shard, concurrent_shards=plan.shards))
    gathered = gather_sweep(adapters, GatherTask(sweep_id="large", now=NOW, shards=list(range(plan.shards))))

    assert not gathered.failed and sorted(handed) == list(range(plan.shards))
    swept = [i for shard_ids, _ in handed.values() for i in shard_ids]
    assert len(swept) == len(ids) and set(swept) == ids, "every machine in exactly one shard"
    assert max(len(v.encode()) for v, _ in store.lookups.values()) < ITEM_MAX_BYTES
    if group:
        assert plan.shards == 4 and all(len(shard_ids) == FLEET // 4 for shard_ids, _ in handed.values())
        parts = [p[group] for _, p in handed.values()]
        assert sorted(j for p in parts for j in p.held) == [0, 1, 2, 3] and {p.parts for p in parts} == {4}
        for headroom in (0, 1, 3, 5, 20_000):  # the parts' shares always sum to the group's headroom
            assert sum(p.headroom(headroom) for p in parts) == headroom
    else:
        assert plan.shards == 1 and len(store.lookups) >= 2, "one shard's manifest in pages"


def test_a_group_cut_across_shards_is_never_terminated_below_its_min_size():
    """A real sharded sweep of a group larger than a shard: each shard holds part of it and terminates at most its
    share of the group's headroom, so the shards together leave MinSize members, as one sweep would."""
    aws = account({"platform": '{"asg_action": "terminate"}'})
    aws.autoscaling.add_group("workers", min_size=9)
    idle = steady(1.0)
    members = [
        aws.launch("m5.large", team="platform", profile=idle, launch_time=DAY_AGO, group="workers", protected=True)
        for _ in range(12)
    ]
    store = CountingStateStore()
    for now in (WARN_SWEEP, NOW):
        sharded = run_sharded(aws.adapters(store=store), now=now, shard_size=4, workers=3)
        assert not sharded.gathered.failed
    holders = [n for n, ids in enumerate(split_into_shards(sharded.plan.listed, 3, group_max=4)) if ids]
    assert len(holders) == 3, "the group is cut across the three shards"
    decided = sharded.merged().decisions
    assert sorted(d.machine.instance_id for d in decided) == sorted(members), "every member decided"
    group = aws.autoscaling.groups["workers"]
    assert group.desired == group.min_size == 9 and len(group.members) == 9
    assert sum(d.action.value == "terminate" for d in decided) == 3
    assert not aws.autoscaling.errors, "no termination refused for MinSize"


def test_small_groups_are_planned_as_before():
    """A group of at most a shard's machines is never cut: it stays in one shard, in the manifest of old."""
    machines = [
        Machine(instance_id=f"i-{g}{n:04d}", instance_type="m5.large", team="ml", launch_time=DAY_AGO, asg_name=f"g{g}")
        for g in range(5)
        for n in range(40 * (g + 1))
    ]
    planned = plan_shards(machines, 3, group_max=200, turn="s")
    assert [m.ids for m in planned] == split_into_shards(machines, 3), "no group of 200 or fewer is cut"
    assert not any(m.groups for m in planned)
    assert all(manifest_pages(m) == [json.dumps(m.ids)] for m in planned), "one item, a list of ids, as before"


def test_a_manifest_in_pages_is_read_back_whole_or_not_at_all():
    manifest = ShardManifest([f"i-{n:017x}" for n in range(500)], {"big": GroupPart(3, (0, 2))})
    pages = manifest_pages(manifest, most=2_000)
    assert len(pages) > 5 and all(len(p.encode()) <= 2_000 for p in pages)
    stored = dict(enumerate(pages))
    read = read_manifest(json.loads(pages[0]), stored.get, "shard 0")
    assert read == manifest
    del stored[3]
    with pytest.raises(fanout.SweepCannotRun, match="page 4 of"):
        read_manifest(json.loads(pages[0]), stored.get, "shard 0")
