"""Organization mode: each member account's regions outside the organization's `regions` are counted once a day,
through the member role of its unit in the first organization region, after the units are swept (issue 30's
"unwatched-regions count by account"), over the in-memory fakes. The count never breaks or delays a unit's
sweep, is tried again the next hour when it fails, names denied regions, is kept per account for `status`, and
the admins hear once a week per (account, region) where instances are tagged for idle-reaper."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from test_member_sweep import NOW, REGION, Organization
from test_sweep_fanout import Alerts

from idle_reaper.aws.accounts import MemberAccess, MemberCredentials, OrganizationConfig
from idle_reaper.aws.regions import (
    AccountCount,
    RegionCount,
    last_member_counted,
    members_unwatched,
    members_unwatched_lines,
    save_member_unwatched,
)
from idle_reaper.aws.state import InMemoryStateStore
from idle_reaper.slack.answers import status_reply
from idle_reaper.sweep.members import sweep_member_accounts
from idle_reaper.sweep.regions import MEMBER_COUNT_SECONDS
from testkit.aws.fleet import FakeEC2

OPTED_IN = {"Team": "ml", "idle-reaper:managed": "true"}
NORTH, SOUTH = "eu-north-1", "ap-south-1"


class Counted(Organization):
    """The fake organization, each account's EC2 in regions outside the organization's as a fake of its own."""

    def __init__(self, organization_settings: dict[str, Any] | None = None, regions: tuple[str, ...] = (REGION,)):
        super().__init__(organization_settings)
        self.notifier = Alerts()
        self.elsewhere: dict[str, dict[str, FakeEC2]] = {}
        for account, world in self.worlds.items():
            world.ec2.enabled_regions = (*regions, NORTH, SOUTH)
            self.elsewhere[account] = {NORTH: FakeEC2(), SOUTH: FakeEC2()}
        if regions != (REGION,):
            config = OrganizationConfig(
                prefix="idle-reaper", targets=(self.orgs.root,), regions=regions, hub_account="9" * 12
            )
            directory = config.directory(self.orgs)
            self.members = MemberAccess(config, directory, config.sessions("sweep", directory, self.sts))
        self.counted_with: list[tuple[str, str]] = []  # (account, region of the credentials) the count used

    def run(self, account: str, region: str, tags: dict[str, str], state: str = "running") -> None:
        self.elsewhere[account][region].add("m5.large", launch_time=NOW - timedelta(days=1), tags=tags, state=state)

    def regions_ec2(self, held: MemberCredentials) -> Callable[[str], Any]:
        self.counted_with.append((held.account, held.region))
        return lambda region: (
            self.worlds[held.account].ec2 if region == REGION else self.elsewhere[held.account][region]
        )

    def sweep(self, now: datetime, **kwargs: Any) -> dict[str, Any]:
        outcomes = sweep_member_accounts(
            self.adapters(), self.members, now, make_adapters=self.make, regions_ec2=self.regions_ec2, **kwargs
        )
        return {o.account: o for o in outcomes}

    def describe_regions_calls(self, account: str) -> int:
        return self.worlds[account].ec2.calls["DescribeRegions"]


def test_a_member_accounts_other_regions_are_counted_once_a_day_kept_by_name_and_told_once_a_week() -> None:
    org = Counted({"exclude": ["PROD_OU"]})
    machine = org.launch(org.a)
    org.run(org.a, NORTH, OPTED_IN)
    org.run(org.a, NORTH, {"Team": "ml"})  # a cost tag alone: running, not the reaper's
    org.run(org.a, SOUTH, OPTED_IN, state="stopped")  # not running: not counted
    org.run(org.c, NORTH, OPTED_IN)  # the excluded production account: never touched, not counted

    out = org.sweep(NOW)

    assert out[org.a].report is not None and [d.machine.instance_id for d in out[org.a].report.decisions] == [machine]
    (counted,) = members_unwatched(org.store, NOW)
    assert counted == AccountCount(org.a, "sandbox-a", NOW, (RegionCount(NORTH, running=2, opted_in=1),))
    # B was counted too (nothing found: not listed for status); C is excluded, D's role is missing.
    assert last_member_counted(org.store, org.b, NOW) == NOW
    assert last_member_counted(org.store, org.c, NOW) is None and last_member_counted(org.store, org.d, NOW) is None
    assert sorted(org.counted_with) == sorted([(org.a, REGION), (org.b, REGION)])
    (alert,) = org.notifier.alerts
    assert f"1 running instances in {NORTH} of member account sandbox-a ({org.a}) are tagged for idle-reaper" in alert
    assert f"Add {NORTH} to the `organization` block's `regions` and deploy" in alert
    # What `status` shows for it: the account by name and id.
    assert members_unwatched_lines([counted]) == [
        "Member accounts' regions outside the organization's `regions` (counted daily), never swept:",
        f"  account sandbox-a ({org.a}): {NORTH}: 2 running, 1 tagged for idle-reaper (counted 2026-11-20 15:00 UTC)",
    ]

    # The day's later sweeps: no count (one read of the account's item each), no alert.
    for minutes in (5, 10, 240):
        org.sweep(NOW + timedelta(minutes=minutes))
    assert org.describe_regions_calls(org.a) == 1 and len(org.notifier.alerts) == 1
    # The next day counts again (the same week: not told again); the next week tells again.
    org.sweep(NOW + timedelta(days=1))
    assert org.describe_regions_calls(org.a) == 2 and len(org.notifier.alerts) == 1
    org.sweep(NOW + timedelta(days=7))
    assert len(org.notifier.alerts) == 2
    # Once nothing runs there any more, the account leaves `status`.
    org.elsewhere[org.a][NORTH].instances.clear()
    org.sweep(NOW + timedelta(days=8))
    assert members_unwatched(org.store, NOW + timedelta(days=8)) == []


def test_a_denied_region_is_named_and_the_others_counted() -> None:
    org = Counted()
    org.run(org.a, SOUTH, OPTED_IN)
    org.elsewhere[org.a][NORTH].inject("DescribeInstances", "UnauthorizedOperation", message="explicit deny in an SCP")

    org.sweep(NOW)

    (counted,) = members_unwatched(org.store, NOW)
    assert counted.regions == (RegionCount(SOUTH, running=1, opted_in=1),) and counted.denied == (NORTH,)
    assert f"account sandbox-a ({org.a}): not counted, the member role may not look there" in "\n".join(counted.lines())


def test_a_failing_count_never_breaks_the_units_sweep_and_is_tried_again_the_next_hour() -> None:
    org = Counted()
    machine = org.launch(org.a)
    org.run(org.a, NORTH, OPTED_IN)
    org.worlds[org.a].ec2.inject("DescribeRegions", "RequestLimitExceeded")

    out = org.sweep(NOW)

    # A's unit is swept as ever; its count failed, nothing kept for it; B is counted all the same.
    assert out[org.a].error is None and [d.machine.instance_id for d in out[org.a].report.decisions] == [machine]
    assert last_member_counted(org.store, org.a, NOW) is None
    assert last_member_counted(org.store, org.b, NOW) == NOW
    assert org.notifier.alerts == []
    # Not retried every sweep: the next one, in the same hour, leaves it; the next hour counts it.
    org.worlds[org.a].ec2.clear_faults()
    org.sweep(NOW + timedelta(minutes=5))
    assert org.describe_regions_calls(org.a) == 1
    org.sweep(NOW + timedelta(hours=1))
    (counted,) = members_unwatched(org.store, NOW + timedelta(hours=1))
    assert counted.account == org.a and counted.regions == (RegionCount(NORTH, running=1, opted_in=1),)
    assert len(org.notifier.alerts) == 1


def test_a_count_that_raises_anything_leaves_the_outcomes_as_they_are() -> None:
    org = Counted()
    org.launch(org.a)

    def broken(held: MemberCredentials) -> Callable[[str], Any]:
        raise RuntimeError("no clients today")

    outcomes = sweep_member_accounts(org.adapters(), org.members, NOW, make_adapters=org.make, regions_ec2=broken)
    swept = {o.account: o for o in outcomes}
    assert swept[org.a].report is not None and swept[org.a].error is None
    assert members_unwatched(org.store, NOW) == []


def test_only_with_time_to_spare_and_never_in_a_dry_run() -> None:
    org = Counted()
    org.run(org.a, NORTH, OPTED_IN)
    machine = org.launch(org.a)

    out = org.sweep(NOW, time_left=lambda: MEMBER_COUNT_SECONDS - 1)  # enough for a unit (45 s), not for the count
    assert [d.machine.instance_id for d in out[org.a].report.decisions] == [machine]
    out = org.sweep(NOW, dry_run=True)
    assert out[org.a].report is not None
    assert org.describe_regions_calls(org.a) == 0 and members_unwatched(org.store, NOW) == []
    org.sweep(NOW, time_left=lambda: 600.0)
    assert org.describe_regions_calls(org.a) == 1


def test_counted_from_the_first_organization_region_only_every_organization_region_watched() -> None:
    org = Counted(
        {"exclude": ["PROD_OU"]}, regions=(REGION, NORTH)
    )  # eu-north-1 is an organization region now: watched, not counted
    org.run(org.a, NORTH, OPTED_IN)
    org.run(org.a, SOUTH, OPTED_IN)
    org.sweep(NOW)
    assert sorted(org.counted_with) == sorted([(org.a, REGION), (org.b, REGION)])  # not from the NORTH units
    (counted,) = members_unwatched(org.store, NOW)
    assert [c.region for c in counted.regions] == [SOUTH]


def test_fake_adapters_without_their_own_clients_count_nothing() -> None:
    org = Counted()
    org.run(org.a, NORTH, OPTED_IN)
    sweep_member_accounts(org.adapters(), org.members, NOW, make_adapters=org.make)
    assert org.describe_regions_calls(org.a) == 0 and org.counted_with == []


def test_the_status_item_keeps_every_account_that_found_something_when_they_write_at_once() -> None:
    store = InMemoryStateStore()
    real = store.replace_lookup
    raced = {"left": 1}

    def replace_lookup(key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        if raced["left"]:  # another shard writes its account first: this write must be retried, not lost
            raced["left"] -= 1
            other = AccountCount("222222222222", "b", now, (RegionCount(SOUTH, 3, 0),))
            save_member_unwatched(store, other, now)
        return real(key, value, expires, expected=expected, now=now)

    store.replace_lookup = replace_lookup  # type: ignore[method-assign]
    save_member_unwatched(store, AccountCount("111111111111", "a", NOW, (RegionCount(NORTH, 1, 1),)), NOW)
    assert [c.account for c in members_unwatched(store, NOW)] == ["222222222222", "111111111111"]  # most first
    # A week later without a new count: gone from `status`.
    assert members_unwatched(store, NOW + timedelta(days=8)) == []


def test_admins_see_the_member_counts_in_slack_status() -> None:
    count = AccountCount("111111111111", "sandbox-<a>", NOW, (RegionCount(NORTH, 4, 2),), (SOUTH,))
    text = status_reply([], None, members_unwatched_lines([count]), now=NOW).text
    assert f"account sandbox-&lt;a&gt; (111111111111): {NORTH}: 4 running, 2 tagged for idle-reaper" in text
    assert f"may not look there (a service control policy?): {SOUTH}" in text
    assert status_reply([], None, [], now=NOW).text.startswith("You own no machines")


def test_the_hubs_own_account_swept_as_a_member_is_left_to_the_hubs_count() -> None:
    """Sandbox-a is the hub, its stack in us-east-1 only: in eu-west-1, the first organization region, it is a
    member unit and swept, but its other regions are the hub's own daily count's (which knows the hub's stacks):
    counted here, they would call us-east-1 unwatched."""
    org = Counted()
    config = OrganizationConfig(
        prefix="idle-reaper",
        targets=(org.orgs.root,),
        regions=(REGION,),
        hub_account=org.a,
        hub_regions=("us-east-1",),
    )
    directory = config.directory(org.orgs)
    org.members = MemberAccess(config, directory, config.sessions("sweep", directory, org.sts))
    org.run(org.a, NORTH, OPTED_IN)
    org.run(org.b, NORTH, OPTED_IN)
    out = org.sweep(NOW)
    assert out[org.a].report is not None  # swept as a member in eu-west-1
    counted = [a for a, _ in org.counted_with]
    assert org.a not in counted and org.b in counted
    assert org.describe_regions_calls(org.a) == 0
    assert [c.account for c in members_unwatched(org.store, NOW)] == [org.b]
