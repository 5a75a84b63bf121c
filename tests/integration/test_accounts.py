"""Organization mode's accounts and credentials (issue 30) against moto in server mode: an organization with
OUs and accounts (moto's Organizations), member credentials from STS (moto's assume_role answers for the
role's account, so calls with them reach that account's resources), and the answers real AWS gives where moto
accepts what AWS refuses (AssumeRole of a role that is missing, denied by an SCP, throttled; an account
suspended or removed meanwhile), put in front of moto."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from test_sweep_faults import admin_alerts
from test_unwatched_regions import sweep_adapters

from idle_reaper import aws
from idle_reaper.aws.accounts import (
    REFRESH_MARGIN,
    AccountDirectory,
    AccountFailure,
    MemberAccess,
    MemberCredentials,
    MemberSessions,
    OrganizationConfig,
    Reason,
    last_member_check,
)
from idle_reaper.aws.state import InMemoryStateStore
from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.policy import Settings
from idle_reaper.sweep.members import check_member_accounts
from idle_reaper_tools import cli, local
from idle_reaper_tools.fake_slack import LambdaContextStub

# Organizations' pace (5 calls a second, aws/accounts.py) on a virtual clock shared with AWS's buckets: its waits,
# about 9 s of every run here, cost no time (conftest.py).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("aws_on_a_virtual_clock")]

HUB = local.ACCOUNT  # moto's default account: the organization's management account, and the hub
STARTED = datetime(2026, 11, 25, 10, 0, tzinfo=UTC)


@dataclass
class Org:
    root: str
    ml: str  # the target OU
    sandbox: str  # an OU inside it
    prod: str  # not a target
    accounts: dict[str, str]  # name -> id


def new_account(organizations: Any, name: str, parent: str, root: str) -> str:
    account: str = organizations.create_account(Email=f"{name}@example.com", AccountName=name)["CreateAccountStatus"][
        "AccountId"
    ]
    organizations.move_account(AccountId=account, SourceParentId=root, DestinationParentId=parent)
    return account


@pytest.fixture
def org(aws: object) -> Org:
    organizations = aws_client("organizations")
    organizations.create_organization(FeatureSet="ALL")
    root = organizations.list_roots()["Roots"][0]["Id"]

    def ou(name: str, parent: str) -> str:
        found: str = organizations.create_organizational_unit(ParentId=parent, Name=name)["OrganizationalUnit"]["Id"]
        return found

    ml = ou("ml", root)
    sandbox, prod = ou("sandbox", ml), ou("prod", root)
    accounts = {
        "training": new_account(organizations, "training", ml, root),
        "alice-sandbox": new_account(organizations, "alice-sandbox", sandbox, root),
        "payments": new_account(organizations, "payments", prod, root),
        "closed": new_account(organizations, "closed", ml, root),
    }
    organizations.close_account(AccountId=accounts["closed"])
    return Org(root, ml, sandbox, prod, accounts)


def aws_client(service: str, region: str | None = None) -> Any:
    return aws.client(service, region)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def answer(code: str, message: str, operation: str = "AssumeRole") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": 403}}, operation
    )


def real_sts(refusals: dict[str, Exception]) -> Any:
    """moto's STS, except that AssumeRole into an account in `refusals` gets AWS's real answer for it."""
    sts = aws_client("sts")

    def refuse(params: dict[str, Any], **_: Any) -> None:
        account = params["RoleArn"].split(":")[4]
        if account in refusals:
            raise refusals[account]

    sts.meta.events.register("provide-client-params.sts.AssumeRole", refuse)
    return sts


def denied(account: str, *, scp: bool = False) -> ClientError:
    """AWS's AccessDenied for AssumeRole: for a role that does not exist or does not trust the caller (the
    same answer for both), or, with `scp`, under a service control policy of the member account."""
    message = (
        f"User: arn:aws:sts::{HUB}:assumed-role/IdleReaper-SweepRole8A7451E2-abc/idle-reaper-sweep is not "
        f"authorized to perform: sts:AssumeRole on resource: arn:aws:iam::{account}:role/idle-reaper-member-us-east-1"
    )
    return answer("AccessDenied", message + (" with an explicit deny in a service control policy" if scp else ""))


# -- which accounts ----------------------------------------------------------------------------------


def test_the_accounts_under_the_target_ou_are_listed_with_their_ous_and_cached(org: Org) -> None:
    clock = Clock(STARTED)
    directory = AccountDirectory(aws_client("organizations"), [org.ml], hub_account=HUB, clock=clock)
    listing = directory.current()
    assert listing.error is None
    by_name = {a.name: a for a in listing.accounts}
    # Nested OUs are followed; an OU outside the targets and the management (hub) account are not listed.
    assert sorted(by_name) == ["alice-sandbox", "training"]
    assert by_name["alice-sandbox"].parents == (org.sandbox, org.ml)  # nearest first
    assert by_name["training"].parents == (org.ml,)
    # A suspended account is not swept, and says why.
    assert [(s.account, s.reason) for s in listing.skipped] == [(org.accounts["closed"], Reason.SUSPENDED)]
    calls = directory.calls
    clock.now += timedelta(minutes=59)
    assert directory.current() is listing and directory.calls == calls  # cached: no Organizations call
    clock.now += timedelta(minutes=2)
    assert directory.current() is not listing and directory.calls > calls  # listed again after an hour


def test_the_planner_takes_an_hour_old_listing_and_the_member_check_relists(org: Org) -> None:
    """The sweep's planner asks with `stale_for`: an expired listing is returned at once (no Organizations call on
    the sweep's path); the member check after it relists; past `ttl + stale_for` the planner waits for a listing."""
    clock = Clock(STARTED)
    directory = AccountDirectory(aws_client("organizations"), [org.ml], hub_account=HUB, clock=clock)
    listing = directory.current()
    calls = directory.calls
    clock.now += timedelta(minutes=61)
    assert directory.current(stale_for=timedelta(hours=1)) is listing and directory.calls == calls
    relisted = directory.current()  # the check after StartExecution
    assert relisted is not listing and directory.calls > calls
    assert directory.current(stale_for=timedelta(hours=1)) is relisted
    calls = directory.calls
    clock.now += timedelta(hours=2, minutes=1)  # nothing relisted since: too old even for the planner
    assert directory.current(stale_for=timedelta(hours=1)) is not relisted and directory.calls > calls


def test_a_root_target_lists_every_account_but_the_management_account_and_the_hub(org: Org) -> None:
    training = org.accounts["training"]
    directory = AccountDirectory(aws_client("organizations"), [org.root, org.ml], hub_account=training)
    names = sorted(a.name for a in directory.current().accounts)
    assert names == ["alice-sandbox", "payments"]  # the hub (training) and the management account are swept apart


def test_a_failed_listing_keeps_the_last_good_one_and_says_so(org: Org) -> None:
    clock = Clock(STARTED)
    organizations = aws_client("organizations")
    directory = AccountDirectory(organizations, [org.ml], hub_account=HUB, clock=clock)
    good = directory.current()
    throttled = answer("TooManyRequestsException", "AWS Organizations can't complete your request", "ListChildren")
    organizations.meta.events.register(
        "provide-client-params.organizations.DescribeOrganization", lambda **_: (_ for _ in ()).throw(throttled)
    )
    clock.now += timedelta(hours=2)
    failed = directory.current()
    assert failed.accounts == good.accounts and failed.listed_at == good.listed_at
    assert failed.error is not None and "TooManyRequestsException" in failed.error
    # Without any good listing: no accounts, the error, and nothing raised.
    fresh = AccountDirectory(organizations, [org.ml], hub_account=HUB, clock=clock).current()
    assert fresh.accounts == () and fresh.error is not None


# -- credentials -------------------------------------------------------------------------------------


def test_member_credentials_reach_that_account_and_are_reused_until_near_expiry(org: Org) -> None:
    training, sandbox = org.accounts["training"], org.accounts["alice-sandbox"]
    clock = Clock(datetime.now(UTC))  # moto's credentials expire an hour after the real now
    sessions = MemberSessions(aws_client("sts"), prefix="idle-reaper", purpose="sweep", clock=clock)
    pairs = [(training, "us-east-1"), (training, "eu-west-1"), (sandbox, "us-east-1")]
    found = sessions.all_credentials(pairs, started=STARTED)
    assert sessions.assume_calls == 3  # one role per account and region
    launched = {}
    for (account, region), held in found.items():
        assert isinstance(held, MemberCredentials)
        identity = held.client("sts").get_caller_identity()
        assert identity["Account"] == account
        assert identity["Arn"].endswith(f":assumed-role/idle-reaper-member-{region}/idle-reaper-sweep-20261125T1000Z")
        ec2 = held.client("ec2")
        assert ec2.meta.region_name == region
        launched[(account, region)] = ec2.run_instances(ImageId=local.AMI, MinCount=1, MaxCount=1)["Instances"][0][
            "InstanceId"
        ]
    # Each account sees its own machines only; the hub's own account sees none of them.
    for (account, region), held in found.items():
        assert isinstance(held, MemberCredentials)
        seen = {
            i["InstanceId"] for r in held.client("ec2").describe_instances()["Reservations"] for i in r["Instances"]
        }
        assert seen == {launched[(account, region)]}
    assert not aws_client("ec2").describe_instances()["Reservations"]
    # Reused while valid ... (timed from their expiry as moto gave it: an hour after moto's real now, which is
    # later than the clock's start by however long the calls above took on a loaded machine)
    held = found[pairs[0]]
    assert isinstance(held, MemberCredentials) and held.expires - clock.now >= timedelta(minutes=55)
    clock.now = held.expires - REFRESH_MARGIN - timedelta(seconds=1)
    assert sessions.credentials(training, "us-east-1") is held and sessions.assume_calls == 3
    # ... and renewed before a sweep could outlive them.
    clock.now += timedelta(seconds=2)
    renewed = sessions.credentials(training, "us-east-1")
    assert renewed is not found[pairs[0]] and sessions.assume_calls == 4


def test_each_accounts_failure_is_classified_and_the_others_are_served(org: Org) -> None:
    organizations = aws_client("organizations")
    ids = dict(org.accounts)
    ids.update(
        scp=new_account(organizations, "scp", org.ml, org.root),
        throttled=new_account(organizations, "throttled", org.ml, org.root),
        optin=new_account(organizations, "optin", org.ml, org.root),
        suspended=new_account(organizations, "suspended", org.ml, org.root),
        gone=new_account(organizations, "gone", org.ml, org.root),
        broken=new_account(organizations, "broken", org.ml, org.root),
    )
    directory = AccountDirectory(organizations, [org.ml], hub_account=HUB)
    listed = {a.id for a in directory.current().accounts}
    assert {ids["suspended"], ids["gone"]} <= listed
    # Meanwhile one account is suspended and one leaves the organization: AssumeRole into them is refused.
    organizations.close_account(AccountId=ids["suspended"])
    organizations.remove_account_from_organization(AccountId=ids["gone"])
    sts = real_sts(
        {
            ids["alice-sandbox"]: denied(ids["alice-sandbox"]),
            ids["scp"]: denied(ids["scp"], scp=True),
            ids["throttled"]: answer("Throttling", "Rate exceeded"),
            ids["optin"]: answer("RegionDisabledException", "STS is not activated in this region for account"),
            ids["suspended"]: denied(ids["suspended"]),
            ids["gone"]: denied(ids["gone"]),
            ids["broken"]: EndpointConnectionError(endpoint_url="https://sts.us-east-1.amazonaws.com"),
        }
    )
    config = OrganizationConfig(prefix="idle-reaper", targets=(org.ml,), regions=("us-east-1",), hub_account=HUB)
    sessions = config.sessions("sweep", directory, sts=sts)
    found = sessions.all_credentials([(a, "us-east-1") for a in sorted(listed)], started=STARTED)
    reasons = {a: r.reason if isinstance(r, AccountFailure) else "ok" for (a, _), r in found.items()}
    assert reasons == {
        ids["training"]: "ok",
        ids["alice-sandbox"]: Reason.ROLE_MISSING,
        ids["scp"]: Reason.DENIED_BY_SCP,
        ids["throttled"]: Reason.THROTTLED,
        ids["optin"]: Reason.REGION_DISABLED,
        ids["suspended"]: Reason.SUSPENDED,
        ids["gone"]: Reason.LEFT_ORGANIZATION,
        ids["broken"]: Reason.ERROR,
    }
    scp = found[(ids["scp"], "us-east-1")]
    assert isinstance(scp, AccountFailure)
    assert scp.describe().startswith(f"account {ids['scp']} in us-east-1: a service control policy denies the hub")
    # Nothing is held for a failed account: the next sweep asks again.
    assert sessions.assume_calls == len(listed)
    sessions.credentials(ids["throttled"], "us-east-1")
    assert sessions.assume_calls == len(listed) + 1


def test_the_hub_stack_tells_its_functions_where_the_members_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IDLE_REAPER_ORGANIZATION", raising=False)
    assert OrganizationConfig.from_environment() is None  # single-account mode
    monkeypatch.setenv(
        "IDLE_REAPER_ORGANIZATION",
        '{"prefix": "ml-reaper", "targets": ["ou-ab12-cd34ef56"], "regions": ["eu-west-1", "us-east-2"], '
        '"hubAccount": "123456789012", "partition": "aws-cn"}',
    )
    config = OrganizationConfig.from_environment()
    assert config == OrganizationConfig("ml-reaper", ("ou-ab12-cd34ef56",), ("eu-west-1", "us-east-2"), HUB, "aws-cn")


# -- each sweep: credentials held, failures reported -------------------------------------------------


def member_access(org: Org, refusals: dict[str, Exception], clock: Clock) -> MemberAccess:
    config = OrganizationConfig(
        prefix="idle-reaper", targets=(org.ml,), regions=("us-east-1", "eu-west-1"), hub_account=HUB
    )
    directory = AccountDirectory(aws_client("organizations"), config.targets, hub_account=HUB, clock=clock)
    sessions = config.sessions("sweep", directory, sts=real_sts(refusals))
    sessions.clock = clock
    return MemberAccess(config, directory, sessions)


def test_a_sweep_holds_member_credentials_and_tells_the_admins_once_a_day_per_account_it_cannot_reach(
    org: Org, slack: Any, capsys: pytest.CaptureFixture[str], aws_on_a_virtual_clock: list[float]
) -> None:
    local.init_account(Settings(admins=["U0ADMIN"]))
    sandbox = org.accounts["alice-sandbox"]
    # Early in today (UTC), so the sweeps 5 minutes later fall on the same day; never after the real now, so
    # moto's credentials (an hour past the real now) are still fresh for them.
    now = datetime.now(UTC)
    clock = Clock(min(now, now.replace(hour=6, minute=0, second=0, microsecond=0)))
    members = member_access(org, {sandbox: denied(sandbox)}, clock)
    adapters = sweep_adapters()

    lines = check_member_accounts(adapters, members, clock.now)
    assert lines[0] == "member accounts: 2 accounts, credentials in 2 of 4 regions"
    assert sum(f"account {sandbox} in" in line for line in lines) == 1  # one line per account, both regions in it
    assert f"account {org.accounts['closed']} left out: Status SUSPENDED" in lines
    (alert,) = admin_alerts(slack)
    assert f"cannot work in member account {sandbox} 'alice-sandbox' (role-missing)" in alert
    assert "us-east-1" in alert and "eu-west-1" in alert and "the other accounts are not affected" in alert
    assert members.sessions.assume_calls == 4
    # The doctor tells accounts this check covered from those it never saw (joined since): it keeps their ids.
    kept = last_member_check(adapters.store, clock.now)
    assert kept is not None and kept.checked is not None
    assert sorted(kept.checked) == sorted(a.id for a in members.directory.current().accounts)
    assert sandbox in kept.checked

    # Later sweeps the same day: credentials reused, the failing account asked again, no second alert. AWS's buckets
    # (on the pacers' virtual clock) see the same five minutes pass: the `status` below lists the organization with
    # a pace of its own, as another process would.
    clock.now += timedelta(minutes=5)
    aws_on_a_virtual_clock[0] += 300
    check_member_accounts(adapters, members, clock.now)
    assert members.sessions.assume_calls == 6 and len(admin_alerts(slack)) == 1
    # `status` shows the last check.
    assert cli.main(["status", "--now", clock.now.isoformat()]) == 0
    out = capsys.readouterr().out
    assert "Member accounts (checked" in out and "2 accounts, credentials in 2 account-regions" in out
    assert f"account {sandbox} in eu-west-1: the member role is missing" in out
    assert f"account {org.accounts['closed']}: the account is suspended or closed" in out
    assert cli.main(["status", "--json", "--now", clock.now.isoformat()]) == 0
    [found] = [json.loads(x) for x in capsys.readouterr().out.splitlines() if "member_accounts" in x]
    assert found["member_units"] == 2 and {f["reason"] for f in found["member_failures"]} == {
        "role-missing",
        "suspended",
    }
    # The next day: told again.
    clock.now += timedelta(days=1)
    aws_on_a_virtual_clock[0] += 86_400
    check_member_accounts(adapters, members, clock.now)
    assert len(admin_alerts(slack)) == 2


def test_a_failing_check_never_takes_the_sweep_down(org: Org, slack: Any) -> None:
    local.init_account(Settings(admins=["U0ADMIN"]))
    clock = Clock(datetime.now(UTC))
    members = member_access(org, {}, clock)
    organizations = members.directory.organizations
    broken = answer(
        "AccessDeniedException", "You don't have permissions to access this resource.", "DescribeOrganization"
    )
    organizations.meta.events.register(
        "provide-client-params.organizations.DescribeOrganization", lambda **_: (_ for _ in ()).throw(broken)
    )
    lines = check_member_accounts(sweep_adapters(), members, clock.now)
    assert lines[0] == "member accounts: 0 accounts, credentials in 0 of 0 regions"
    assert "could not be listed (AccessDeniedException" in lines[1]
    (alert,) = admin_alerts(slack)
    assert "could not list the organization's member accounts" in alert

    class BrokenStore(InMemoryStateStore):
        def put_lookup(self, key: str, value: str, expires: datetime) -> None:
            raise RuntimeError("the table is down")

    adapters = sweep_adapters()
    adapters.store = BrokenStore()
    lines = check_member_accounts(adapters, members, clock.now)
    # The check is told though it could not be kept (issue 43, 1: a failed save no longer hides the outage).
    assert lines[0] == "member accounts: 0 accounts, credentials in 0 of 0 regions"
    assert "the member accounts' check could not be kept for `status` (the table is down)" in lines


def test_the_sweep_handler_checks_the_members_in_organization_mode_only(
    org: Org, slack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    local.init_account()
    sweep_handler.member_access.cache_clear()
    assert sweep_handler.handler({}, LambdaContextStub())["machines"] == 0
    assert last_member_check(sweep_adapters().store, datetime.now(UTC)) is None  # single-account mode: nothing
    config = {"prefix": "idle-reaper", "targets": [org.ml], "regions": ["us-east-1"], "hubAccount": HUB}
    monkeypatch.setenv("IDLE_REAPER_ORGANIZATION", json.dumps(config))
    sweep_handler.member_access.cache_clear()
    try:
        assert sweep_handler.handler({}, LambdaContextStub())["machines"] == 0
        check = last_member_check(sweep_adapters().store, datetime.now(UTC))
        assert check is not None and (check.accounts, check.units) == (2, 2)
    finally:
        sweep_handler.member_access.cache_clear()
