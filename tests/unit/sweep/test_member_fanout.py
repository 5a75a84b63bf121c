"""Organization mode in the fan-out (issue 30): the planner writes member (account, region) units as shards
after the machine shards, a shard worker sweeps its manifest's units, the gather step sums them per account and
keeps their outcomes for `status`; the metrics carry an `account` dimension. Over the in-memory fakes."""

from __future__ import annotations

import functools
import json
from datetime import timedelta
from typing import Any

import pytest
from test_member_sweep import NOW, REGION, Organization, WorldCredentials

from idle_reaper.aws.accounts import MemberAccount, OrganizationConfig, last_member_sweep
from idle_reaper.core.records import machine_key
from idle_reaper.handlers.sweep import emit_sweep_metrics
from idle_reaper.sweep import GatherTask, ShardDone, ShardTask, SweepCannotRun, gather_sweep, manifest_key
from idle_reaper.sweep.fanout import plan_sweep, result_key, run_shard
from idle_reaper.sweep.members import member_adapters, member_groups, sweep_member_accounts
from testkit.aws import steady

REGIONS = ("eu-west-1", "us-east-1")
WARN_SWEEP = NOW - timedelta(minutes=30)


def account(n: int) -> MemberAccount:
    return MemberAccount(f"{n:012d}", f"acct-{n}", ())


@pytest.mark.parametrize("per_group", [1, 2, 3, 4, 7])
def test_member_groups_keep_an_accounts_regions_together_and_are_stable(per_group: int) -> None:
    accounts = [account(n) for n in (5, 1, 9, 3, 7, 2)]
    groups = member_groups(accounts, lambda _: ("us-east-1", "eu-west-1"), per_group)
    units = [u for g in groups for u in g]
    # Every unit exactly once, in account order, an account's regions in one group.
    assert [(a.id, r) for a, r in units] == [
        (a.id, r) for a in sorted(accounts, key=lambda a: a.id) for r in ("eu-west-1", "us-east-1")
    ]
    for a in accounts:
        assert len({i for i, g in enumerate(groups) for acct, _ in g if acct.id == a.id}) == 1
    # Bounded (an account with more regions than the bound alone in its group), and no group could take the next
    # group's first account.
    for g in groups[:-1]:
        assert len(g) <= max(per_group, 2)
        assert len(g) + 2 > per_group
    # The same organization, listed in another order, gives the same groups.
    again = member_groups(list(reversed(accounts)), lambda _: ("eu-west-1", "us-east-1"), per_group)
    assert [[(a.id, r) for a, r in g] for g in again] == [[(a.id, r) for a, r in g] for g in groups]


def two_region_org(organization_settings: dict[str, Any] | None = None) -> Organization:
    org = Organization(organization_settings)
    config = OrganizationConfig(prefix="idle-reaper", targets=(org.orgs.root,), regions=(REGION,), hub_account="9" * 12)
    org.members = type(org.members)(config, org.members.directory, org.members.sessions)
    return org


def sweep_members(org: Organization) -> Any:
    return functools.partial(sweep_member_accounts, make_adapters=org.make)


def test_the_planner_writes_member_shards_after_the_machine_shards() -> None:
    org = two_region_org()
    hub_ids = [org.hub.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=1))]
    plan = plan_sweep(
        org.adapters(), now=NOW, in_place=True, members=org.members, units_per_shard=2, shards_at_once=2, sweep_id="s1"
    )
    # Four accounts of one region, two units a shard: two member shards after the one machine shard, and the
    # plan is not swept in place even though the hub's own machines fit one shard.
    assert (plan.shards, plan.member_shards, plan.member_units) == (1, 2, 4)
    assert not plan.in_place
    assert plan.execution_input()["shards"] == [0, 1, 2]
    assert json.loads(org.store.get_lookup(manifest_key("s1", 0), NOW) or "") == hub_ids
    members = [json.loads(org.store.get_lookup(manifest_key("s1", i), NOW) or "")["members"] for i in (1, 2)]
    assert [[m["id"] for m in ms] for ms in members] == [sorted((org.a, org.b)), sorted((org.c, org.d))]
    assert members[0][0]["regions"] == [REGION] and members[0][0]["name"] == "sandbox-a"
    # The organization listed once (cached), nothing swept by the planner.
    assert org.made_for == [] and org.sts.calls == {}


@pytest.mark.parametrize(("lanes", "groups"), [(20, [1, 1, 1, 1]), (3, [2, 2]), (2, [3, 1])])
def test_a_small_organization_is_spread_over_the_maps_lanes(lanes: int, groups: list[int]) -> None:
    org = two_region_org()
    plan = plan_sweep(
        org.adapters(), now=NOW, members=org.members, units_per_shard=3, shards_at_once=lanes, sweep_id="s"
    )
    manifests = [json.loads(org.store.get_lookup(manifest_key("s", i), NOW) or "") for i in range(1, plan.all_shards)]
    assert [len(m["members"]) for m in manifests] == groups


def test_a_hub_in_a_target_ou_is_a_member_unit_only_where_it_has_no_stack_of_its_own() -> None:
    """Sandbox-a is the hub (a delegated administrator inside the OU), with a stack in eu-west-1; the organization's
    regions are eu-west-1 and us-east-1. Its machines in us-east-1 have its member stack and no hub stack: a unit.
    In eu-west-1 its own stack sweeps them: no unit, or they would be swept twice under two keys."""
    org = Organization(None)
    regions = (REGION, "us-east-1")
    config = OrganizationConfig(
        prefix="idle-reaper", targets=(org.orgs.root,), regions=regions, hub_account=org.a, hub_regions=(REGION,)
    )
    directory = config.directory(org.orgs)
    org.members = type(org.members)(config, directory, config.sessions("sweep", directory, org.sts))
    plan = plan_sweep(org.adapters(), now=NOW, members=org.members, shards_at_once=2, sweep_id="s")
    manifests = [json.loads(org.store.get_lookup(manifest_key("s", i), NOW) or "") for i in range(1, plan.all_shards)]
    planned = {m["id"]: m["regions"] for manifest in manifests for m in manifest["members"]}
    assert planned[org.a] == ["us-east-1"]
    assert all(planned[acct] == sorted(regions) for acct in (org.b, org.c, org.d))
    assert plan.member_units == 1 + 3 * 2

    # A hub whose stacks cover every organization region is never a member, nor one deployed before its regions
    # were told (then, as before, it is left out of the listing).
    for hub_regions in (regions, ()):
        other = OrganizationConfig(
            prefix="idle-reaper", targets=(org.orgs.root,), regions=regions, hub_account=org.a, hub_regions=hub_regions
        )
        listed = [a.id for a in other.directory(org.orgs).current().accounts]
        assert org.a not in listed and org.b in listed
        assert other.regions_of(org.a) == ()


def test_the_planner_does_not_wait_for_the_hourly_relisting() -> None:
    org = two_region_org()
    at = [NOW]
    org.members.directory.clock = lambda: at[0]
    plan_sweep(org.adapters(), now=NOW, members=org.members, sweep_id="s1")
    calls = org.members.directory.calls
    at[0] = NOW + timedelta(minutes=61)
    later = plan_sweep(org.adapters(), now=at[0], members=org.members, sweep_id="s2")
    assert org.members.directory.calls == calls  # the hour-old listing: the member check relists after
    assert later.member_units == 4


def test_without_members_a_small_fleet_is_still_swept_in_place() -> None:
    org = two_region_org()
    plan = plan_sweep(org.adapters(), now=NOW, in_place=True, members=None, sweep_id="s1")
    assert plan.in_place and plan.member_shards == 0
    assert org.store.get_lookup(manifest_key("s1", 0), NOW) is None


def run_plan(
    org: Organization,
    now: Any,
    sweep_id: str,
    *,
    time_left: dict[int, Any] | None = None,
    fail: frozenset[int] = frozenset(),
) -> Any:
    adapters = org.adapters()
    plan = plan_sweep(adapters, now=now, members=org.members, units_per_shard=2, shards_at_once=2, sweep_id=sweep_id)
    results = []
    for index in range(plan.all_shards):
        if index in fail:
            results.append(ShardDone(shard=index, error="States.Timeout"))
            continue
        task = ShardTask(sweep_id=sweep_id, now=now, shard=index)
        left = (time_left or {}).get(index)
        run_shard(adapters, task, members=org.members, sweep_members=sweep_members(org), time_left=left)
        results.append(ShardDone(shard=index))
    task = GatherTask(sweep_id=sweep_id, now=now, shards=list(range(plan.all_shards)), results=results)
    return gather_sweep(adapters, task)


def test_member_shards_sweep_their_units_and_one_failing_unit_fails_nothing_else() -> None:
    org = two_region_org({"exclude": ["PROD_OU"]})
    idle = {acct: org.launch(acct) for acct in (org.a, org.b)}
    org.launch(org.c)
    org.launch(org.c)
    hub_machine = org.hub.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=1))
    run_plan(org, WARN_SWEEP, "first")
    gathered = run_plan(org, NOW, "second")

    # A and B stopped in their own accounts; the hub's own machine in the hub; production only counted; D (its
    # role refused) is its unit's outcome, and no shard failed.
    for acct in (org.a, org.b):
        assert [r["InstanceIds"] for r in org.worlds[acct].ec2.requests_of("StopInstances")] == [[idle[acct]]]
    assert [r["InstanceIds"] for r in org.hub.ec2.requests_of("StopInstances")] == [[hub_machine]]
    assert org.worlds[org.c].write_calls() == 0
    assert gathered.failed == {}
    assert gathered.machines == 3
    assert {u.account: (u.swept, u.excluded_machines) for u in gathered.units} == {
        org.a: (1, None),
        org.b: (1, None),
        org.c: (None, 2),
        org.d: (None, None),
    }
    assert set(gathered.accounts) == {"9" * 12, org.a, org.b}
    assert all(t.reaped == 1 and t.scanned == 1 for t in gathered.accounts.values())
    assert sum(t.reaped for t in gathered.teams.values()) == 3
    assert machine_key(idle[org.a], org.a, REGION) in org.store.records

    # The gather step kept one summary for `status`.
    summary = last_member_sweep(org.store, NOW)
    assert summary is not None
    assert (summary.units, summary.swept, summary.machines, summary.deferred) == (4, 2, 2, 0)
    assert summary.excluded == ((org.c, "production", 2),)
    (failure,) = summary.failed
    assert (failure.account, failure.region, failure.name) == (org.d, REGION, "no-member-stack")
    assert "the member role is missing" in failure.why
    text = "\n".join(summary.lines())
    assert f"excluded, never touched: account {org.c} 'production': 2 opted-in machine(s)" in text
    assert f"not swept: account {org.d} 'no-member-stack' in {REGION}" in text


def test_a_failed_member_shard_is_a_failed_shard_and_names_its_units() -> None:
    org = two_region_org()
    for acct in (org.a, org.b, org.c):
        org.launch(acct)
    gathered = run_plan(org, NOW, "s", fail=frozenset({1}))  # shard 1: accounts A and B
    assert gathered.failed == {1: "States.Timeout"}
    assert any("shard 1 failed" in w for w in gathered.warnings)
    assert org.worlds[org.a].ec2.calls == {} and org.worlds[org.b].ec2.calls == {}
    summary = last_member_sweep(org.store, NOW)
    assert summary is not None
    failed = {(f.account, f.why) for f in summary.failed}
    assert (org.a, "its shard (1) failed: States.Timeout") in failed
    assert (org.b, "its shard (1) failed: States.Timeout") in failed
    assert summary.swept == 1  # C swept; D refused


def test_units_left_when_the_worker_runs_short_of_time_wait_for_the_next_sweep() -> None:
    org = two_region_org()
    for acct in (org.a, org.b, org.c):
        org.launch(acct)
    # Shard 2 (accounts C and D) has less time left than a unit's reserve: neither is started.
    gathered = run_plan(org, NOW, "s", time_left={2: lambda: 10.0})
    assert gathered.failed == {}
    assert {u.account for u in gathered.units if u.deferred} == {org.c, org.d}
    assert org.worlds[org.c].ec2.calls == {} and org.made_for == [org.a, org.b]
    summary = last_member_sweep(org.store, NOW)
    assert summary is not None and (summary.swept, summary.deferred, summary.failed) == (2, 2, ())
    assert "2 left to the next sweep (time ran short)" in summary.lines()[0]


@pytest.mark.parametrize(
    ("manifest", "says"),
    [
        ({"members": []}, "members"),
        ({"members": [{"id": "12345", "regions": ["eu-west-1"]}]}, "members.0.id"),
        ({"members": [{"id": "111111111111", "regions": ["eu-west-1"], "extra": 1}]}, "members.0.extra"),
        ({"members": [{"id": "111111111111", "regions": []}]}, "members.0.regions"),
        ({"machines": ["i-1"]}, "neither a list of instance ids nor member units"),
        ([1, 2], "neither a list of instance ids nor member units"),
        ("not json", "is not JSON"),
    ],
)
def test_a_malformed_member_manifest_fails_its_shard_and_changes_nothing(manifest: Any, says: str) -> None:
    org = two_region_org()
    org.launch(org.a)
    text = manifest if manifest == "not json" else json.dumps(manifest)
    org.store.put_lookup(manifest_key("bad", 0), text, NOW + timedelta(hours=1))
    with pytest.raises(SweepCannotRun, match="nothing was changed") as caught:
        run_shard(org.adapters(), ShardTask(sweep_id="bad", now=NOW, shard=0), members=org.members)
    assert says in str(caught.value)
    assert org.made_for == [] and org.sts.calls == {} and org.worlds[org.a].ec2.calls == {}
    assert org.store.records == {} and org.store.get_lookup(result_key("bad", 0), NOW) is None


def test_a_member_manifest_in_a_single_account_hub_is_refused() -> None:
    org = two_region_org()
    manifest = {"members": [{"id": org.a, "regions": [REGION]}]}
    org.store.put_lookup(manifest_key("s", 0), json.dumps(manifest), NOW + timedelta(hours=1))
    with pytest.raises(SweepCannotRun, match="not in organization mode"):
        run_shard(org.adapters(), ShardTask(sweep_id="s", now=NOW, shard=0), members=None)
    assert org.sts.calls == {} and org.store.get_lookup(result_key("s", 0), NOW) is None


def test_metrics_carry_an_account_dimension(capsys: pytest.CaptureFixture[str]) -> None:
    from aws_lambda_powertools import Metrics

    org = two_region_org()
    org.launch(org.a)
    org.launch(org.a, profile=steady(80.0))
    org.hub.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=1))
    gathered = run_plan(org, NOW, "s")
    capsys.readouterr()
    metrics = Metrics(namespace="IdleReaper", service="idle-reaper")
    emit_sweep_metrics(metrics, gathered)
    blobs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    by_account = {b["account"]: b for b in blobs if "account" in b}

    def value(blob: dict[str, Any], name: str) -> float:
        found = blob[name]
        return float(found[0] if isinstance(found, list) else found)

    # Every account swept, those without machines too (a steady series); D (its role refused) is not.
    assert set(by_account) == {"9" * 12, org.a, org.b, org.c}
    assert value(by_account[org.b], "MachinesScanned") == 0
    a = by_account[org.a]
    counts = [value(a, n) for n in ("MachinesScanned", "MachinesIdle", "MachinesReaped", "MachinesUnknown")]
    assert counts == [2, 1, 0, 0]
    assert value(by_account["9" * 12], "MachinesScanned") == 1
    dimensions = a["_aws"]["CloudWatchMetrics"][0]["Dimensions"]
    assert ["account"] in dimensions or any("account" in d for d in dimensions)
    names = {m["Name"] for m in a["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert names == {"MachinesScanned", "MachinesIdle", "MachinesReaped", "MachinesUnknown"}
    # The team blobs are as before: no account in them.
    assert any("team" in b and "account" not in b for b in blobs)


def test_a_member_unit_makes_only_the_clients_its_sweep_uses() -> None:
    org = two_region_org()  # notebooks off
    org.launch(org.a)
    made: list[tuple[str, str]] = []

    def make(hub: Any, credentials: Any, default: Any) -> Any:
        world = WorldCredentials(org.worlds[credentials.account])

        class Counted:
            def client(self, service: str) -> Any:
                made.append((credentials.account, service))
                return world.client(service)

        return member_adapters(hub, Counted(), default)  # type: ignore[arg-type]

    outcomes = sweep_member_accounts(org.adapters(), org.members, NOW, make_adapters=make)
    assert sum(o.report is not None for o in outcomes) == 3
    # A has a machine to read; B and C have none (no metric read); no account has a group or notebooks.
    assert sorted(s for a, s in made if a == org.a) == ["cloudwatch", "ec2"]
    assert [s for a, s in made if a == org.b] == ["ec2"] and [s for a, s in made if a == org.c] == ["ec2"]


def test_the_digest_names_the_hubs_account_where_it_is_swept_as_a_member() -> None:
    from idle_reaper.sweep.digest import DigestAccounts

    org = Organization(None)
    config = OrganizationConfig(
        prefix="idle-reaper",
        targets=(org.orgs.root,),
        regions=(REGION, "us-east-1"),
        hub_account=org.a,
        hub_regions=(REGION,),
    )
    directory = config.directory(org.orgs)
    names = DigestAccounts.of(type(org.members)(config, directory, config.sessions("digest", directory)), NOW).names
    assert names[org.a] == "the hub's account in us-east-1"  # not "sandbox-a", beside "the hub's account"
    assert names[org.b] == "sandbox-b"
