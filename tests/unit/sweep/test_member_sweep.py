"""Organization mode: the hub sweeps every member (account, region) through that account's member-role
credentials, over the in-memory fakes (testkit/aws, testkit/aws/organization.py). Excluded accounts are only
counted, per-account defaults apply, and one account's failure never reaches the others."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.aws.accounts import MemberAccess, MemberCredentials, OrganizationConfig
from idle_reaper.core.records import machine_key
from idle_reaper.notify import LoggingNotifier, logger
from idle_reaper.policy import Settings, TeamPolicy
from idle_reaper.sweep.adapters import Adapters
from idle_reaper.sweep.delivery import explain
from idle_reaper.sweep.members import check_member_accounts, member_adapters, sweep_member_accounts
from testkit.aws import CountingStateStore, FakeAws, steady
from testkit.aws.clients import client_error
from testkit.aws.organization import FakeOrganizations, FakeSts

# A world without SageMaker: its notebook instances and endpoints are not listed.
NO_SAGEMAKER = Settings(sagemaker_notebooks=False, sagemaker_endpoints=False).model_dump_json()

REGION = "eu-west-1"
HUB = "999999999999"
NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"


class RoleMissingSts(FakeSts):
    """STS that refuses the member role of some accounts (no member stack there, or an SCP)."""

    def __init__(self, refused: set[str]) -> None:
        super().__init__(lambda: datetime.now(UTC))
        self.refused = refused

    def assume_role(self, RoleArn: str, RoleSessionName: str, DurationSeconds: int = 3600) -> dict[str, Any]:
        if RoleArn.split(":")[4] in self.refused:
            self._call("AssumeRole", {"RoleArn": RoleArn})
            raise client_error("AssumeRole", "AccessDenied", "not authorized to perform sts:AssumeRole", 403)
        return super().assume_role(RoleArn, RoleSessionName, DurationSeconds)


@dataclass(frozen=True)
class WorldCredentials:
    """Stands in for MemberCredentials: the clients of one fake account."""

    world: FakeAws

    def client(self, service: str) -> Any:
        return {"ec2": self.world.ec2, "autoscaling": self.world.autoscaling, "cloudwatch": self.world.cloudwatch}.get(
            service
        )


class Organization:
    def __init__(self, organization_settings: dict[str, Any] | None) -> None:
        self.orgs = FakeOrganizations()
        self.dev = self.orgs.add_ou(self.orgs.root)
        self.prod = self.orgs.add_ou(self.orgs.root)
        self.a = self.orgs.add_account(self.dev, "sandbox-a")
        self.b = self.orgs.add_account(self.dev, "sandbox-b")
        self.c = self.orgs.add_account(self.prod, "production")
        self.d = self.orgs.add_account(self.dev, "no-member-stack")
        self.hub = FakeAws()
        self.hub.ssm.store(f"{PREFIX}/settings", NO_SAGEMAKER)
        self.hub.ssm.store(f"{PREFIX}/teams/ml", '{"idle_minutes": 90, "warn_minutes": 30}')
        if organization_settings is not None:
            text = json.dumps(organization_settings).replace("PROD_OU", self.prod).replace("ACCOUNT_B", self.b)
            self.hub.ssm.store(f"{PREFIX}/organization", text)
        self.worlds = {acct: FakeAws() for acct in (self.a, self.b, self.c, self.d)}
        self.store = CountingStateStore()
        self.notifier = LoggingNotifier(logger, delivers=True)
        self.sts = RoleMissingSts({self.d})
        config = OrganizationConfig(prefix="idle-reaper", targets=(self.orgs.root,), regions=(REGION,), hub_account=HUB)
        directory = config.directory(self.orgs)
        self.members = MemberAccess(config, directory, config.sessions("sweep", directory, self.sts))
        self.made_for: list[str] = []

    def launch(self, account: str, team: str = "ml", profile: Any = None) -> str:
        return self.worlds[account].launch(
            "m5.large", team=team, profile=profile or steady(1.0), launch_time=NOW - timedelta(days=1)
        )

    def adapters(self) -> Adapters:
        return self.hub.adapters(store=self.store, notifier=self.notifier)

    def make(self, hub: Adapters, credentials: MemberCredentials, default: TeamPolicy | None) -> Adapters:
        self.made_for.append(credentials.account)
        return member_adapters(hub, WorldCredentials(self.worlds[credentials.account]), default)  # type: ignore[arg-type]

    def sweep(self, now: datetime) -> dict[str, Any]:
        outcomes = sweep_member_accounts(self.adapters(), self.members, now, make_adapters=self.make)
        return {o.account: o for o in outcomes}


def test_every_member_account_is_swept_through_its_own_clients() -> None:
    org = Organization({"exclude": ["PROD_OU"]})
    same = {acct: org.launch(acct) for acct in (org.a, org.b)}
    assert same[org.a] == same[org.b]
    busy = org.launch(org.a, profile=steady(80.0))
    org.sweep(NOW - timedelta(minutes=30))
    out = org.sweep(NOW)
    # A and B: warned, then stopped, each in its own account, under its own key.
    for acct in (org.a, org.b):
        rows = {explain(d)["instance_id"]: explain(d) for d in out[acct].report.decisions}
        assert rows[same[acct]]["action"] == "stop" and rows[same[acct]]["account"] == acct
        assert [r["InstanceIds"] for r in org.worlds[acct].ec2.requests_of("StopInstances")] == [[same[acct]]]
    assert explain(next(d for d in out[org.a].report.decisions if d.machine.instance_id == busy))["action"] == "none"
    assert set(org.store.records) == {
        machine_key(same[org.a], org.a, REGION),
        machine_key(same[org.b], org.b, REGION),
        machine_key(busy, org.a, REGION),
    }
    # The hub's own fakes were never used for a member's machines.
    assert org.hub.ec2.calls == {} and org.hub.cloudwatch.calls == {}
    # D: its role is refused; reported as its outcome, the others swept all the same.
    assert "the member role is missing" in (out[org.d].error or "") and out[org.d].report is None
    # A region not enabled in the account looks the same to the hub (no stack instance there, so no role): said so.
    assert "as it does in a region not enabled in this account" in (out[org.d].error or "")


def test_an_excluded_account_is_counted_and_never_touched() -> None:
    org = Organization({"exclude": ["PROD_OU"]})
    org.launch(org.c)
    org.launch(org.c)
    for t in (NOW - timedelta(minutes=30), NOW):
        out = org.sweep(t)
    assert out[org.c].excluded_machines == 2 and out[org.c].report is None
    prod = org.worlds[org.c]
    assert prod.write_calls() == 0 and prod.cloudwatch.calls == {}
    assert set(prod.ec2.calls) <= {"DescribeInstances", "DescribeAvailabilityZones"}
    assert not any(r.account == org.c for r in org.store.records.values())
    assert "excluded: 2 opted-in machine(s) counted, none touched" in out[org.c].describe()


def test_an_account_default_policy_applies_to_teams_without_their_own() -> None:
    org = Organization(
        {"defaults": [{"accounts": ["ACCOUNT_B"], "default_policy": {"idle_minutes": 30, "warn_minutes": 10}}]}
    )
    in_a, in_b = org.launch(org.a, team="sandbox"), org.launch(org.b, team="sandbox")
    ml_in_b = org.launch(org.b, team="ml")
    out = org.sweep(NOW)
    window = {
        (acct, explain(d)["instance_id"]): explain(d)["window_minutes"]
        for acct in (org.a, org.b)
        for d in out[acct].report.decisions
    }
    assert window[(org.a, in_a)] == Settings().default_policy.idle_minutes  # the settings' default
    assert window[(org.b, in_b)] == 30  # B's own default
    assert window[(org.b, ml_in_b)] == 90  # a team policy applies in every account
    # The explanation (and so `status` and the warning) names where each policy came from.
    source = {
        (acct, explain(d)["instance_id"]): explain(d)["policy"]
        for acct in (org.a, org.b)
        for d in out[acct].report.decisions
    }
    assert source[(org.a, in_a)] == "settings.default_policy"
    assert source[(org.b, in_b)] == f"organization.defaults[0].default_policy (account {org.b})"
    assert source[(org.b, ml_in_b)].startswith(f"{PREFIX}/teams/ml@v")
    assert {r.policy_version for r in org.store.records.values() if r.account == org.b and r.team == "sandbox"} == {
        f"organization.defaults[0].default_policy (account {org.b})"
    }


def test_the_hubs_settings_and_team_policies_are_read_once_per_invocation_not_once_per_unit() -> None:
    # Per unit, an organization of 4,000 units would make 8,000 SSM calls a sweep, past SSM's 40 a second.
    org = Organization(
        {"defaults": [{"accounts": ["ACCOUNT_B"], "default_policy": {"idle_minutes": 30, "warn_minutes": 10}}]}
    )
    for acct in (org.a, org.b, org.c):
        org.launch(acct, team="sandbox")
        org.launch(acct, team="ml")
    org.hub.ssm.calls.clear()
    out = org.sweep(NOW)
    assert all(out[acct].report is not None for acct in (org.a, org.b, org.c))
    # One read of the settings, one of the teams, one of the organization settings: not one per unit.
    assert org.hub.ssm.calls == {"GetParameter": 2, "GetParametersByPath": 1}
    windows = {
        (acct, explain(d)["team"]): explain(d)["window_minutes"]
        for acct in (org.a, org.b, org.c)
        for d in out[acct].report.decisions
    }
    assert windows[(org.a, "ml")] == windows[(org.b, "ml")] == 90  # the shared team policy
    assert windows[(org.b, "sandbox")] == 30  # B's own default, on top of the shared settings
    assert windows[(org.a, "sandbox")] == Settings().default_policy.idle_minutes

    # Read afresh by the next invocation: a policy changed between sweeps applies at the next one.
    org.hub.ssm.store(f"{PREFIX}/teams/ml", '{"idle_minutes": 120, "warn_minutes": 30}')
    out = org.sweep(NOW + timedelta(minutes=5))
    assert {
        explain(d)["window_minutes"]
        for acct in (org.a, org.c)
        for d in out[acct].report.decisions
        if d.machine.team == "ml"
    } == {120}


def test_a_failed_settings_read_is_not_kept_for_the_other_units() -> None:
    org = Organization(None)
    for acct in (org.a, org.b):
        org.launch(acct)
    org.hub.ssm.inject("GetParametersByPath", "ThrottlingException", on_calls=[1])
    out = org.sweep(NOW)
    # The first read was throttled; the units after it read again and were swept on the team policy.
    policies = {explain(d)["policy"] for acct in (org.a, org.b) if out[acct].report for d in out[acct].report.decisions}
    assert any(p.startswith(f"{PREFIX}/teams/ml@v") for p in policies)


def test_one_failing_account_does_not_stop_the_others() -> None:
    org = Organization(None)
    org.launch(org.a)
    in_b = org.launch(org.b)
    org.worlds[org.a].ec2.inject("DescribeInstances", "UnauthorizedOperation")  # an SCP denies the sweep in A
    for t in (NOW - timedelta(minutes=30), NOW):
        out = org.sweep(t)
    assert out[org.a].report is None and "UnauthorizedOperation" in out[org.a].error
    # The admins heard of A once that day (two sweeps), of nothing else; D (no credentials) is the check's to tell.
    alerts = [text for kind, text in org.notifier.sent if kind == "admin_alert"]
    assert len(alerts) == 1 and f"member account {org.a} 'sandbox-a' in {REGION}" in alerts[0]
    assert [r["InstanceIds"] for r in org.worlds[org.b].ec2.requests_of("StopInstances")] == [[in_b]]
    assert out[org.c].report is not None  # nothing excluded: production is swept like the rest


def test_an_account_is_told_once_a_day_whether_its_check_or_its_sweep_fails_first() -> None:
    """The admins are told at most once a day per account: the check's refused credentials and a unit's failed
    sweep are one account's news, claimed under one key, in either order; the next day it is told again."""
    org = Organization(None)
    org.launch(org.a)
    org.worlds[org.a].ec2.inject("DescribeInstances", "UnauthorizedOperation")

    def alerts() -> list[str]:
        return [text for kind, text in org.notifier.sent if kind == "admin_alert" and org.a in text]

    def check(now: datetime) -> None:
        check_member_accounts(org.adapters(), org.members, now)

    # Day 1: the check finds A's role refused and tells; later A's role works but its sweep is denied: silent.
    org.sts.refused = {org.a, org.d}
    check(NOW)
    assert len(alerts()) == 1 and "cannot work in member account" in alerts()[0]
    org.sts.refused = {org.d}
    out = org.sweep(NOW + timedelta(minutes=5))
    assert "UnauthorizedOperation" in (out[org.a].error or "") and out[org.a].reached
    assert len(alerts()) == 1
    # Day 2, the other order: the failed sweep tells, the check's refusal later that day is silent.
    day2 = NOW + timedelta(days=1)
    org.sweep(day2)
    assert len(alerts()) == 2 and "could not sweep member account" in alerts()[1]
    org.sts.refused = {org.a, org.d}
    org.members.sessions.forget(org.a, REGION)
    check(day2 + timedelta(minutes=5))
    assert len(alerts()) == 2
    # D (no member stack) is another account, told apart from A: once each day, by the check.
    told_d = [text for kind, text in org.notifier.sent if kind == "admin_alert" and org.d in text]
    assert len(told_d) == 2


@pytest.mark.parametrize("code", ["AuthFailure", "UnauthorizedOperation", "OptInRequired", "Blocked"])
def test_an_account_suspended_while_its_credentials_are_held_is_reported_as_suspended(code: str) -> None:
    """Credentials held from an earlier sweep still sign calls into an account suspended since: AWS refuses them
    with an error of its own. The unit says the account is suspended (Organizations, asked then), not the bare
    error; the credentials are dropped, and the other accounts are swept as ever."""
    org = Organization(None)
    org.launch(org.a)
    in_b = org.launch(org.b)
    org.sweep(NOW - timedelta(minutes=30))
    assumed = org.sts.calls["AssumeRole"]
    org.orgs.accounts[org.a]["Status"] = "SUSPENDED"
    org.worlds[org.a].ec2.inject("DescribeInstances", code)
    out = org.sweep(NOW)
    assert org.sts.calls["AssumeRole"] == assumed + 1  # A's and B's held credentials reused (D's refused again)
    error = out[org.a].error or ""
    assert error.startswith(f"account {org.a} in {REGION}: the account is suspended or closed ({code}")
    assert out[org.a].report is None and org.orgs.calls["DescribeAccount"] >= 1
    assert [r["InstanceIds"] for r in org.worlds[org.b].ec2.requests_of("StopInstances")] == [[in_b]]
    # Dropped: the next use of A asks STS again.
    org.members.sessions.credentials(org.a, REGION)
    assert org.sts.calls["AssumeRole"] == assumed + 2


def test_a_refusal_in_an_active_account_is_reported_as_aws_gave_it_and_its_credentials_dropped() -> None:
    org = Organization(None)
    org.launch(org.a)
    org.worlds[org.a].ec2.inject("DescribeInstances", "UnauthorizedOperation")
    out = org.sweep(NOW)
    error = out[org.a].error or ""
    assert "(UnauthorizedOperation)" in error and "suspended" not in error
    assumed = org.sts.calls["AssumeRole"]
    org.members.sessions.credentials(org.a, REGION)  # dropped: a changed role or policy is picked up at once
    assert org.sts.calls["AssumeRole"] == assumed + 1


@pytest.mark.parametrize(
    "bad", [{"exclude": ["12345"]}, {"defaults": [{"accounts": ["ACCOUNT_B"], "default_policy": {"idle_minutes": 1}}]}]
)
def test_invalid_organization_settings_sweep_no_member_account(bad: dict[str, Any]) -> None:
    org = Organization(bad)
    org.launch(org.a)
    out = sweep_member_accounts(org.adapters(), org.members, NOW, make_adapters=org.make)
    assert len(out) == 1 and "/idle-reaper/organization" in (out[0].error or "")
    assert org.made_for == [] and org.sts.calls == {}
    assert all(w.ec2.calls == {} for w in org.worlds.values())


def test_units_are_not_started_when_the_invocation_is_short_of_time() -> None:
    org = Organization(None)
    org.launch(org.a)
    left = iter([120.0, 10.0, 10.0, 10.0])  # room for one unit only, then short of time
    outcomes = sweep_member_accounts(
        org.adapters(), org.members, NOW, make_adapters=org.make, workers=1, time_left=lambda: next(left, 10.0)
    )
    swept = [o for o in outcomes if o.report is not None]
    assert len(swept) == 1 and org.made_for == [swept[0].account]
    assert all("time" in (o.error or "") and not o.reached for o in outcomes if o.report is None)
    assert not [kind for kind, _ in org.notifier.sent if kind == "admin_alert"]
