"""Organization mode in a wide outage (issue 43, 1 and 12): a service control policy or a failed StackSet rollout
fails every member account-region at once. The check is kept within DynamoDB's item (the in-memory store keeps
DynamoDB's 400 KB, testkit/aws/state.py), every account is told to the admins, and Organizations is asked why
(DescribeAccount) a bounded number of times, not once per failing account-region."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper.aws.accounts import (
    STATUS_LOOKUPS,
    MemberAccess,
    OrganizationConfig,
    Reason,
    last_member_check,
)
from idle_reaper.notify import LoggingNotifier, logger
from idle_reaper.policy import Settings
from idle_reaper.sweep.doctor import members_as_last_checked
from idle_reaper.sweep.members import check_member_accounts
from idle_reaper_tools.admin import format_member_check
from testkit.aws import FakeAws
from testkit.aws.clients import client_error
from testkit.aws.organization import FakeOrganizations, FakeSts
from testkit.aws.state import CountingStateStore

NOW = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)
HUB = "999999999999"
REGIONS = ("us-east-1", "us-west-2", "eu-west-1", "ap-southeast-2")
PREFIX = "/idle-reaper"


class DeniedSts(FakeSts):
    """Every AssumeRole refused with AWS's (long) message: by a service control policy (`scp`), or as when the
    member role is missing (a failed StackSet rollout)."""

    def __init__(self, *, scp: bool) -> None:
        super().__init__(lambda: NOW)
        self.scp = scp

    def assume_role(self, RoleArn: str, RoleSessionName: str, DurationSeconds: int = 3600) -> dict[str, Any]:
        self._call("AssumeRole", {"RoleArn": RoleArn})
        message = (
            f"User: arn:aws:sts::{HUB}:assumed-role/idle-reaper-sweep-us-east-1/idle-reaper-sweep-20261127T0900Z "
            f"is not authorized to perform: sts:AssumeRole on resource: {RoleArn}"
        ) + (" with an explicit deny in a service control policy" if self.scp else "")
        raise client_error("AssumeRole", "AccessDenied", message, 403)


class Alerts(LoggingNotifier):
    def __init__(self) -> None:
        super().__init__(logger, delivers=True)

    @property
    def texts(self) -> list[str]:
        return [text for kind, text in self.sent if kind == "admin_alert"]


def outage(accounts: int, *, scp: bool) -> tuple[MemberAccess, Any, FakeOrganizations, CountingStateStore, Alerts]:
    orgs = FakeOrganizations()
    for n in range(accounts):
        orgs.add_account(orgs.root, f"team-{n}")
    hub = FakeAws()
    hub.ssm.store(f"{PREFIX}/settings", Settings(admins=("U0ADMIN",)).model_dump_json())
    store, alerts = CountingStateStore(), Alerts()
    config = OrganizationConfig(prefix="idle-reaper", targets=(orgs.root,), regions=REGIONS, hub_account=HUB)
    directory = config.directory(orgs)
    members = MemberAccess(config, directory, config.sessions("sweep", directory, DeniedSts(scp=scp)))
    return members, hub.adapters(store=store, notifier=alerts), orgs, store, alerts


def test_a_wide_outage_is_kept_within_one_item_and_no_failure_is_taken_for_healthy(virtual_pacing):
    """Issue 43 (1): 300 accounts x 4 regions fail (about 370 bytes each, 440 KB): the one item passed
    DynamoDB's 400 KB, the write failed, and the check returned before the per-account alerts: the widest outage
    was told to nobody. Now the item keeps what fits, counts the rest with their accounts, and every account is
    told; the doctor says of a failure not kept that it failed, never that it is fine."""
    members, adapters, _, store, alerts = outage(300, scp=True)
    lines = check_member_accounts(adapters, members, NOW)
    check = last_member_check(store, NOW)
    assert check is not None and check.checked is not None and len(check.checked) == 300
    assert check.failures and check.failures_more > 0
    assert len(check.failures) + check.failures_more == 1200, "every failure kept or counted"
    kept = {(f.account, f.region) for f in check.failures}
    for account in check.checked:
        for region in REGIONS:
            assert (account, region) in kept or check.failing_unkept(account, region), (account, region)
    assert any("failures not kept for `status`" in line for line in lines)
    assert len({t.split("member account ")[1].split(" ")[0] for t in alerts.texts}) == 300, "every account told"
    assert f"and {check.failures_more} more account-regions that failed" in format_member_check(check)
    read = members_as_last_checked(check, members.directory.current(), members.config.regions_of, NOW, timedelta(1))
    assert all(u.role_reason or (u.unreadable and "failed" in u.unreadable) for u in read.units)


def test_organizations_is_asked_why_a_bounded_number_of_times(virtual_pacing):
    """Issue 43 (12): DescribeAccount was called once per failing account-region, uncached, against Organizations'
    one rate for the whole organization: 1,200 calls in one check here. It is asked once per account at most,
    its answer kept an hour, and at most STATUS_LOOKUPS times an hour."""
    members, adapters, orgs, _, _ = outage(300, scp=False)
    check_member_accounts(adapters, members, NOW)
    asked = orgs.calls["DescribeAccount"]
    assert 0 < asked <= STATUS_LOOKUPS
    calls = orgs.calls["DescribeAccount"] + orgs.calls["ListAccountsForParent"] + orgs.calls["DescribeOrganization"]
    assert virtual_pacing[0] - 1000.0 >= (calls - 10) / 5, "Organizations paced at 5 a second, bursts of 10"
    check_member_accounts(adapters, members, NOW + timedelta(minutes=5))
    assert orgs.calls["DescribeAccount"] == asked, "the answers are kept, and the hour's lookups spent"
    assert members.directory.status_of(next(iter(members.directory.current().accounts)).id) in (None, Reason.SUSPENDED)
