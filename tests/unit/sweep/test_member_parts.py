"""Organization mode: a member account-region too large for one worker is swept in parts (issue 30). The gather
step remembers the units its sweep saw with more than UNIT_PART_SIZE machines, the next plan makes such a unit
K manifests of one part each, and the worker of part i keeps the machines whose group (else owner, else id)
hashes to i, so that its parts run on K workers at once. Over the in-memory fakes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import pytest
from test_member_fanout import WARN_SWEEP, sweep_members, two_region_org
from test_member_sweep import NOW, REGION, Organization
from test_member_unwatched import Counted

from idle_reaper.aws.accounts import UNIT_SIZES_KEY, UnitSizes, last_member_sweep, load_unit_sizes
from idle_reaper.core.reports import part_key, part_of
from idle_reaper.sweep import GatherTask, ShardDone, ShardTask, SweepCannotRun, fanout, gather_sweep, manifest_key
from idle_reaper.sweep.fanout import plan_sweep, result_key, run_shard
from idle_reaper.sweep.members import MAX_UNIT_PARTS, sweep_member_accounts
from testkit.aws import FakeAws, steady

PART_SIZE = 4  # machines a part, for these tests (the stack's is SHARD_SIZE, 10,000)


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "UNIT_PART_SIZE", PART_SIZE)


def launch(world: FakeAws, *, owner: str | None = None, group: str | None = None) -> str:
    return world.launch(
        "m5.large",
        team="ml",
        profile=steady(1.0),
        launch_time=NOW - timedelta(days=1),
        owner=owner,
        group=group,
        protected=group is not None,
    )


def big_account(org: Organization) -> dict[str, list[str]]:
    """Account A: 11 machines (a group of 3, an owner's 2, 6 on their own); B: one machine."""
    world = org.worlds[org.a]
    world.autoscaling.add_group("trainers")
    machines = {
        "group": [launch(world, group="trainers") for _ in range(3)],
        "owner": [launch(world, owner="Ada@example.com"), launch(world, owner=" ada@example.com")],
        "alone": [launch(world) for _ in range(6)],
    }
    org.launch(org.b)
    return machines


def join_group(world: FakeAws, instance_id: str, group: str) -> None:
    """The machine is attached to an Auto Scaling group (EC2 tags it with the group's name)."""
    inst = world.ec2.instances[instance_id]
    inst.tags["aws:autoscaling:groupName"] = group
    inst.api["Tags"] = [{"Key": k, "Value": v} for k, v in inst.tags.items()]
    if group not in world.autoscaling.groups:
        world.autoscaling.add_group(group)
    world.autoscaling.attach(group, instance_id)


def sweep(
    org: Organization,
    now: datetime,
    sweep_id: str,
    *,
    before: Mapping[int, Callable[[], None]] | None = None,
    time_left: Mapping[int, Callable[[], float]] | None = None,
    fail: frozenset[int] = frozenset(),
) -> tuple[Any, dict[int, list[str]], list[dict[str, Any]]]:
    """Plan, each shard in turn (`before[i]` runs just before shard i: the world changing between the parts'
    listings), gather. Returns the gathered summary, the instance ids each shard swept, and the manifests."""
    adapters = org.adapters()
    plan = plan_sweep(adapters, now=now, members=org.members, units_per_shard=2, shards_at_once=8, sweep_id=sweep_id)
    manifests = [json.loads(org.store.get_lookup(manifest_key(sweep_id, i), now) or "") for i in range(plan.all_shards)]
    swept: dict[int, list[str]] = {}
    results = []
    for index in range(plan.all_shards):
        if index in fail:
            results.append(ShardDone(shard=index, error="States.Timeout"))
            continue
        (before or {}).get(index, lambda: None)()
        task = ShardTask(sweep_id=sweep_id, now=now, shard=index)
        report, _ = run_shard(
            adapters,
            task,
            members=org.members,
            sweep_members=sweep_members(org),
            time_left=(time_left or {}).get(index),
        )
        swept[index] = [d.machine.instance_id for d in report.decisions if d.machine.account == org.a]
        results.append(ShardDone(shard=index))
    task = GatherTask(sweep_id=sweep_id, now=now, shards=list(range(plan.all_shards)), results=results)
    return gather_sweep(adapters, task), swept, manifests


def parts_of(manifests: list[dict[str, Any]], account: str) -> dict[int, tuple[int, int]]:
    """Shard index -> (part, parts) of the account's part manifests."""
    return {
        i: (m["members"][0]["part"], m["members"][0]["parts"])
        for i, m in enumerate(manifests)
        if isinstance(m, dict) and m["members"][0]["id"] == account and "parts" in m["members"][0]
    }


def stops(world: FakeAws) -> list[str]:
    return [i for r in world.ec2.requests_of("StopInstances") for i in r["InstanceIds"]]


def test_a_large_unit_is_remembered_and_swept_in_parts_each_machine_once_groups_and_owners_together() -> None:
    org = two_region_org()
    machines = big_account(org)
    everyone = [i for ids in machines.values() for i in ids]

    # First sweep: no size known, A is one unit (as before); the gather step remembers it has 11 machines.
    _, swept, manifests = sweep(org, WARN_SWEEP, "first")
    assert parts_of(manifests, org.a) == {}
    assert sorted(i for ids in swept.values() for i in ids) == sorted(everyone)
    sizes = load_unit_sizes(org.store, WARN_SWEEP).of(WARN_SWEEP)
    assert sizes == {(org.a, REGION): 11}  # B (one machine) is not remembered

    # The next plan makes A ceil(11 / 4) = 3 parts, each a shard of its own; B stays in a group manifest.
    gathered, swept, manifests = sweep(org, NOW, "second")
    parts = parts_of(manifests, org.a)
    assert sorted(parts.values()) == [(0, 3), (1, 3), (2, 3)]
    member = [m for m in manifests if isinstance(m, dict)]
    assert sum(org.b in [a["id"] for a in m["members"]] for m in member) == 1
    # Every machine swept by exactly one part, no other shard; a group's members in one part, an owner's too.
    by_part = {parts[i][0]: ids for i, ids in swept.items() if i in parts}
    assert sorted(i for ids in by_part.values() for i in ids) == sorted(everyone)
    assert all(not ids for i, ids in swept.items() if i not in parts)
    part_of_machine = {i: p for p, ids in by_part.items() for i in ids}
    assert len({part_of_machine[i] for i in machines["group"]}) == 1
    assert len({part_of_machine[i] for i in machines["owner"]}) == 1
    assert sum(bool(ids) for ids in by_part.values()) >= 2  # the work is spread, not one part doing it all
    # Each idle machine on its own stopped once, each group member's protection released once.
    assert sorted(stops(org.worlds[org.a])) == sorted(machines["owner"] + machines["alone"])
    released = [
        i
        for r in org.worlds[org.a].autoscaling.requests_of("SetInstanceProtection")
        for i in r["InstanceIds"]
        if not r["ProtectedFromScaleIn"]
    ]
    assert sorted(released) == sorted(machines["group"])

    # The summary counts A once, swept in parts; the gather step's totals count each machine once.
    assert gathered.failed == {}
    assert gathered.accounts[org.a].scanned == 11
    summary = last_member_sweep(org.store, NOW)
    assert summary is not None
    assert (summary.units, summary.swept, summary.machines, summary.in_parts) == (4, 3, 12, 1)  # A, B, C; D refused
    assert summary.failed[0].account == org.d and len(summary.failed) == 1
    assert "1 large one(s) swept in parts by several workers" in summary.lines()[0]


@pytest.mark.parametrize("old_part_first", [True, False])
def test_a_machine_is_never_swept_by_two_parts_when_the_listing_changes_between_them(old_part_first: bool) -> None:
    org = two_region_org()
    machines = big_account(org)
    world = org.worlds[org.a]
    sweep(org, WARN_SWEEP - timedelta(minutes=5), "first")  # A remembered: 11 machines, 3 parts from now on
    # A machine on its own joins a group whose part is another, between the two parts' listings: after the first
    # of the two listed the account, before the second did. Parts run in order here (shards 1, 2, 3).
    moved, group, old, new = next(
        (i, g, old, new)
        for i in machines["alone"]
        for g in (f"g{n}" for n in range(100))
        if (old := part_of(part_key(i, None, None), 3)) != (new := part_of(part_key(i, g, None), 3))
        and (old < new) == old_part_first
    )
    late: list[str] = []

    def change() -> None:
        join_group(world, moved, group)
        late.extend(launch(world) for _ in range(3))  # and machines launched after some parts listed

    _, swept, manifests = sweep(org, WARN_SWEEP, "second", before={1 + max(old, new): change})
    assert sorted(parts_of(manifests, org.a).values()) == [(0, 3), (1, 3), (2, 3)]

    seen = [i for ids in swept.values() for i in ids]
    assert len(seen) == len(set(seen)), "a machine swept by two parts"
    assert set(machines["group"] + machines["owner"]) | (set(machines["alone"]) - {moved}) <= set(seen)
    assert set(seen) - set(machines["group"] + machines["owner"] + machines["alone"]) <= set(late)
    assert stops(world) == []  # warned only
    # Its old part swept it (as listed then) and the group's part handed it over; or neither part swept it.
    record = next(r for r in org.store.records.values() if r.instance_id == moved and r.account == org.a)
    assert (moved in seen, record.asg_name) == ((True, group) if old_part_first else (False, None))
    # The sweeps after (14 machines now: 4 parts): each machine once a sweep, the moved one by its group's part
    # (after a hand-over, if it came to its group's part with a record of the other), and every late machine.
    for n, at in enumerate((NOW, NOW + timedelta(minutes=5))):
        running = {i for i, inst in world.ec2.instances.items() if inst.state == "running"}
        _, swept, manifests = sweep(org, at, f"after{n}")
        seen = [i for ids in swept.values() for i in ids]
        assert len(seen) == len(set(seen))
        assert set(late) <= set(seen) if n == 0 else set(seen) == running  # the second: every machine, once
    parts = parts_of(manifests, org.a)
    (shard,) = [i for i, (p, k) in parts.items() if p == part_of(part_key(moved, group, None), k)]
    assert moved in swept[shard]


def test_only_part_zero_counts_the_accounts_other_regions() -> None:
    org = Counted()
    org.launch(org.a)
    (unit,) = [u for u in org.members.config.units(org.members.directory.current().accounts) if u[0].id == org.a]
    for index in (2, 1):
        out = org.sweep(NOW, units=[unit], part=(index, 3))
        assert out[org.a].report is not None and out[org.a].part == (index, 3)
    assert org.counted_with == []
    org.sweep(NOW, units=[unit], part=(0, 3))
    assert org.counted_with == [(org.a, REGION)]


def test_an_unreadable_or_corrupt_sizes_item_splits_nothing_and_the_plan_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    org = two_region_org()
    big_account(org)
    sweep(org, WARN_SWEEP, "first")
    assert load_unit_sizes(org.store, NOW).of(NOW) == {(org.a, REGION): 11}
    corrupt = [
        "not json",
        json.dumps({"units": [{"account": org.a, "region": REGION, "machines": -5, "seen": NOW.isoformat()}]}),
        json.dumps({"units": [{"account": "12", "region": REGION, "machines": 50, "seen": NOW.isoformat()}]}),
        json.dumps([org.a, REGION, 11]),
    ]
    for n, text in enumerate(corrupt):
        org.store.put_lookup(UNIT_SIZES_KEY, text, NOW + timedelta(days=1))
        plan = plan_sweep(org.adapters(), now=NOW, members=org.members, shards_at_once=8, sweep_id=f"c{n}")
        manifests = [
            json.loads(org.store.get_lookup(manifest_key(f"c{n}", i), NOW) or "") for i in range(plan.all_shards)
        ]
        assert parts_of(manifests, org.a) == {} and plan.member_units == 4
    assert "their sizes could not be read" in caplog.text

    # A store that cannot be read: no split either, the plan goes on.
    org.store.put_lookup(UNIT_SIZES_KEY, UnitSizes().model_dump_json(), NOW + timedelta(days=1))
    get_lookup = org.store.get_lookup

    def failing(key: str, now: datetime) -> str | None:
        if key == UNIT_SIZES_KEY:
            from testkit.aws.clients import client_error

            raise client_error("GetItem", "ProvisionedThroughputExceededException", "slow down", 400)
        return get_lookup(key, now)

    org.store.get_lookup = failing  # type: ignore[method-assign]
    plan = plan_sweep(org.adapters(), now=NOW, members=org.members, shards_at_once=8, sweep_id="down")
    assert plan.member_units == 4 and plan.all_shards >= 2
    org.store.get_lookup = get_lookup  # type: ignore[method-assign]

    # A corrupt item is rewritten by the next gather step from what its sweep saw.
    org.store.put_lookup(UNIT_SIZES_KEY, "not json", NOW + timedelta(days=1))
    sweep(org, NOW, "again")
    assert load_unit_sizes(org.store, NOW).of(NOW) == {(org.a, REGION): 11}


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"part": 1}, "part and parts are given together"),
        ({"parts": 3}, "part and parts are given together"),
        ({"part": 3, "parts": 3}, "part 3 is not one of 3 parts"),
        ({"part": -1, "parts": 3}, "members.0.part"),
        ({"part": 0, "parts": 1}, "members.0.parts"),
        ({"part": 0, "parts": MAX_UNIT_PARTS + 1}, "members.0.parts"),
        ({"part": "first", "parts": 3}, "members.0.part"),
        ({"part": 0, "parts": 3, "regions": [REGION, "us-east-1"]}, "one region"),
        ({"part": 0, "parts": 3, "second": True}, "a manifest of its own"),
    ],
)
def test_a_malformed_part_fails_its_shard_clearly_and_changes_nothing(entry: dict[str, Any], says: str) -> None:
    org = two_region_org()
    launch(org.worlds[org.a])
    second = entry.pop("second", False)
    members = [{"id": org.a, "regions": [REGION], **entry}]
    if second:
        members.append({"id": org.b, "regions": [REGION]})
    org.store.put_lookup(manifest_key("bad", 0), json.dumps({"members": members}), NOW + timedelta(hours=1))
    with pytest.raises(SweepCannotRun, match="nothing was changed") as caught:
        run_shard(
            org.adapters(),
            ShardTask(sweep_id="bad", now=NOW, shard=0),
            members=org.members,
            sweep_members=sweep_members(org),
        )
    assert says in str(caught.value)
    assert org.made_for == [] and org.sts.calls == {} and org.worlds[org.a].ec2.calls == {}
    assert org.store.records == {} and org.store.get_lookup(result_key("bad", 0), NOW) is None


def test_a_unit_that_shrinks_is_swept_whole_again_and_one_not_seen_for_a_week_is_forgotten() -> None:
    org = two_region_org()
    machines = big_account(org)
    sweep(org, WARN_SWEEP, "first")
    _, _, manifests = sweep(org, NOW, "split")
    assert len(parts_of(manifests, org.a)) == 3
    # Seven machines go away: 4 left, not more than a part's size. The split sweep sees 4 and forgets A.
    for instance_id in machines["alone"] + machines["owner"][:1]:
        org.worlds[org.a].ec2.forget(instance_id)
    later = NOW + timedelta(minutes=5)
    _, _, manifests = sweep(org, later, "shrunk")
    assert len(parts_of(manifests, org.a)) == 3
    assert load_unit_sizes(org.store, later).of(later) == {}
    _, swept, manifests = sweep(org, later + timedelta(minutes=5), "whole")
    assert parts_of(manifests, org.a) == {}
    running = [i for i in machines["group"] + machines["owner"][1:] if org.worlds[org.a].ec2.state_of(i) == "running"]
    assert running and sorted(i for ids in swept.values() for i in ids) == sorted(running)

    # A large unit whose account is no longer swept (it left the OU, say) drops out after a week.
    org.store.put_lookup(
        UNIT_SIZES_KEY,
        json.dumps({"units": [{"account": org.c, "region": REGION, "machines": 50, "seen": NOW.isoformat()}]}),
        NOW + timedelta(days=30),
    )
    assert load_unit_sizes(org.store, NOW + timedelta(days=6)).of(NOW + timedelta(days=6)) == {(org.c, REGION): 50}
    assert load_unit_sizes(org.store, NOW + timedelta(days=8)).of(NOW + timedelta(days=8)) == {}


def test_a_deferred_part_is_left_to_the_next_sweep_and_a_failed_part_names_its_part() -> None:
    org = two_region_org()
    big_account(org)
    sweep(org, WARN_SWEEP, "first")
    plan = plan_sweep(org.adapters(), now=NOW, members=org.members, shards_at_once=8, sweep_id="peek")
    manifests = [json.loads(org.store.get_lookup(manifest_key("peek", i), NOW) or "") for i in range(plan.all_shards)]
    shard_of_part = {p: i for i, (p, _) in parts_of(manifests, org.a).items()}

    # Part 2 has no time left: not started, so A is left to the next sweep (not failed), and its size is kept.
    gathered, swept, _ = sweep(org, NOW, "short", time_left={shard_of_part[2]: lambda: 10.0})
    assert swept[shard_of_part[2]] == []
    summary = last_member_sweep(org.store, NOW)
    assert summary is not None
    assert [f.account for f in summary.failed] == [org.d]  # D's role is refused; A is not failed
    assert (summary.units, summary.swept, summary.deferred, summary.in_parts) == (4, 2, 1, 1)  # B, C swept
    (kept,) = load_unit_sizes(org.store, NOW).units
    assert (kept.account, kept.machines, kept.seen) == (org.a, 11, NOW)  # still seen: kept a week from now
    assert not any("part" in w for w in gathered.warnings)

    # Part 1's shard fails: A is one failed unit whose reason names the part; the other parts swept theirs.
    later = NOW + timedelta(minutes=5)
    gathered, swept, _ = sweep(org, later, "failed", fail=frozenset({shard_of_part[1]}))
    summary = last_member_sweep(org.store, later)
    assert summary is not None
    failed = {f.account: f.why for f in summary.failed}
    assert set(failed) == {org.a, org.d}
    assert failed[org.a] == f"part 2 of 3: its shard ({shard_of_part[1]}) failed: States.Timeout"
    assert summary.units == 4 and summary.machines == gathered.machines
    assert shard_of_part[1] not in swept and swept[shard_of_part[2]]  # part 3, deferred before, swept now


def test_the_parts_of_an_account_region_share_its_metric_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    from idle_reaper.aws.metrics import METRIC_WORKERS
    from idle_reaper.sweep import members as members_module

    org = two_region_org()
    org.launch(org.a)
    seen: list[tuple[Any, int]] = []
    real = members_module.run_sweep

    def spy(adapters: Any, **kwargs: Any) -> Any:
        seen.append((kwargs.get("part"), adapters.metrics.workers))
        return real(adapters, **kwargs)

    monkeypatch.setattr(members_module, "run_sweep", spy)
    (unit,) = [u for u in org.members.config.units(org.members.directory.current().accounts) if u[0].id == org.a]
    for part in ((1, 5), None):
        sweep_member_accounts(org.adapters(), org.members, NOW, make_adapters=org.make, units=[unit], part=part)
    # 5 parts at once keep 30 GetMetricData calls in flight in the account (6 each), as one worker alone does.
    assert seen == [((1, 5), 6), (None, METRIC_WORKERS)]


def test_a_hand_over_to_a_new_owner_drops_the_old_owners_slack_id_and_keeps_the_records_time() -> None:
    """Alice's machine becomes Bob's, and Bob's key falls in another part: the receiving part hands it over. The
    record must not keep Alice's Slack id (Bob's warnings would go to Alice, and the machine could be stopped with
    its owner never told), and nothing of its lifecycle changed, so its updated_at stays (the import's "newer")."""
    from idle_reaper.aws import InMemoryStateStore
    from idle_reaper.core.records import MachineRecord, State
    from idle_reaper.core.signals import Machine
    from idle_reaper.sweep.run import keep_part

    parts = 2
    alice, bob = (
        "alice@example.com",
        next(
            f"bob{n}@example.com"
            for n in range(100)
            if part_of(part_key("i-1", None, f"bob{n}@example.com"), parts)
            != part_of(part_key("i-1", None, "alice@example.com"), parts)
        ),
    )
    bobs_part = part_of(part_key("i-1", None, bob), parts)
    account = "111111111111"
    store = InMemoryStateStore()
    then = NOW - timedelta(hours=3)
    record = MachineRecord(
        instance_id="i-1",
        team="ml",
        state=State.WARNED,
        owner=alice,
        owner_slack_id="U0ALICE",
        updated_at=then,
        warned_at=then,
        account=account,
        region=REGION,
    )
    assert store.save(record)
    (stored,) = store.load([record.key]).values()
    machine = Machine("i-1", "m5.large", "ml", NOW - timedelta(days=1), owner=bob, account=account, region=REGION)
    adapters = FakeAws().adapters(store=store)
    kept = keep_part(adapters, [machine], {"i-1": stored}, (bobs_part, parts), "sweep-1", NOW, dry_run=False)
    assert kept == []  # swept from the next sweep, by this part
    (after,) = store.load([record.key]).values()
    assert after.owner == bob and after.owner_slack_id is None
    assert after.updated_at == then and after.state is State.WARNED and after.warned_at == then
    assert after.version == stored.version + 1


def test_a_part_that_sweeps_nothing_for_invalid_settings_says_which_part() -> None:
    from idle_reaper.aws.accounts import MemberAccount
    from idle_reaper.sweep.members import UnitResult, whole_units

    org = Organization({"exclude": "not a list"})  # `{prefix}/organization` invalid: no member account swept
    unit = [(MemberAccount(org.a, "sandbox-a", ()), REGION)]
    results = []
    for index in range(3):
        (outcome,) = sweep_member_accounts(
            org.adapters(), org.members, NOW, units=unit, part=(index, 3), make_adapters=org.make
        )
        assert outcome.part == (index, 3) and "settings invalid" in (outcome.error or "")
        results.append(UnitResult.of(outcome))
    (whole,) = whole_units(results)
    assert "part 1 of 3" in (whole.error or "") and "part 3 of 3" in (whole.error or "")
    assert org.made_for == []  # nothing swept in the account
