"""The doctor's look at every member account (sweep/doctor.py gather_members, member_findings), over the
in-memory fakes: each (account, region) through its own member-role credentials, concurrently and bounded by a
deadline; what is not reached in time is unknown, never ok."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.aws.accounts import (
    DIGEST_READS_KEY,
    AccountFailure,
    MemberAccess,
    MemberCheck,
    MemberCredentials,
    OrganizationConfig,
    Reason,
    save_member_check,
)
from idle_reaper.aws.fleet import Fleet
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.aws.policies import PolicyStore
from idle_reaper.aws.state import InMemoryStateStore
from idle_reaper.policy import Settings
from idle_reaper.sweep import doctor
from idle_reaper.sweep.doctor import gather_members, member_findings
from testkit.aws import FakeAws, steady
from testkit.aws.clients import client_error
from testkit.aws.organization import FakeOrganizations, FakeSts

# A world without SageMaker: its notebook instances and endpoints are not listed.
NO_SAGEMAKER = Settings(sagemaker_notebooks=False, sagemaker_endpoints=False).model_dump_json()

REGIONS = ("eu-west-1", "us-east-2")
NOW = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)
PREFIX = "/idle-reaper"


class RefusingSts(FakeSts):
    def __init__(self, refused: dict[str, str]) -> None:
        super().__init__(lambda: NOW)
        self.refused = refused  # account -> the AccessDenied message

    def assume_role(self, RoleArn: str, RoleSessionName: str, DurationSeconds: int = 3600) -> dict[str, Any]:
        account = RoleArn.split(":")[4]
        if account in self.refused:
            self._call("AssumeRole", {"RoleArn": RoleArn})
            raise client_error("AssumeRole", "AccessDenied", self.refused[account], 403)
        return super().assume_role(RoleArn, RoleSessionName, DurationSeconds)


class Organization:
    def __init__(self, names: list[str], refused: dict[str, str] | None = None) -> None:
        self.orgs = FakeOrganizations()
        ou = self.orgs.add_ou(self.orgs.root)
        self.ids = {name: self.orgs.add_account(ou, name) for name in names}
        self.worlds = {(a, r): FakeAws() for a in self.ids.values() for r in REGIONS}
        self.hub = FakeAws()
        self.hub.ssm.store(f"{PREFIX}/settings", NO_SAGEMAKER)
        self.policies = PolicyStore(self.hub.ssm, PREFIX)
        refusals = {self.ids[n]: text for n, text in (refused or {}).items()}
        config = OrganizationConfig(
            prefix="idle-reaper", targets=(self.orgs.root,), regions=REGIONS, hub_account="9" * 12
        )
        directory = config.directory(self.orgs)
        self.members = MemberAccess(config, directory, config.sessions("answer", directory, RefusingSts(refusals)))
        self.read: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def launch(self, name: str, region: str, gpu: float | None) -> str:
        return self.worlds[(self.ids[name], region)].launch(
            "g5.xlarge", team="ml", profile=steady(1.0, gpu), launch_time=NOW - timedelta(days=1)
        )

    def reads_in(self, held: MemberCredentials) -> tuple[Fleet, MetricsReader]:
        with self.lock:
            self.read.append((held.account, held.region))
        world = self.worlds[(held.account, held.region)]
        return Fleet(world.ec2, world.autoscaling), MetricsReader(world.cloudwatch)


def test_every_member_account_and_region_is_read_through_its_own_credentials() -> None:
    org = Organization(
        ["sandbox-a", "sandbox-b", "no-stack", "scp"],
        refused={
            "no-stack": "User: arn:aws:sts::999999999999:assumed-role/x is not authorized to perform: sts:AssumeRole",
            "scp": "... with an explicit deny in a service control policy",
        },
    )
    for region in REGIONS:
        org.launch("sandbox-a", region, gpu=90.0)
    blind = org.launch("sandbox-b", "us-east-2", gpu=None)  # its GPU agent is missing
    org.launch("sandbox-b", "eu-west-1", gpu=50.0)
    findings = member_findings(org.members, org.policies, NOW, time.monotonic() + 30, reads_in=org.reads_in)
    a, b = org.ids["sandbox-a"], org.ids["sandbox-b"]
    # Only the accounts whose role was assumed were read, each region in its own account.
    assert sorted(org.read) == sorted((acct, r) for acct in (a, b) for r in REGIONS)
    assert org.hub.ec2.calls == {} and org.hub.cloudwatch.calls == {}
    lines = {f.subjects[0]: f for f in findings if f.check == "members.account"}
    assert sorted(lines) == sorted([b, org.ids["no-stack"], org.ids["scp"]])
    assert lines[b].message == (
        f"member account {b} 'sandbox-b': us-east-2: 1 GPU machine(s) without GPU metrics in the last hour: {blind}"
    )
    assert "eu-west-1: role-missing" in lines[org.ids["no-stack"]].message
    assert "us-east-2: role-missing" in lines[org.ids["no-stack"]].message  # both regions, one line
    # Its fix names the other cause of a missing role: a region not enabled in the account.
    assert "the region is not enabled in this account: enable it there" in (lines[org.ids["no-stack"]].fix or "")
    assert "denied-by-scp" in lines[org.ids["scp"]].message
    assert [f.message[:31] for f in findings if f.check == "members"] == ["1 of 4 member account(s) health"]
    assert not [f for f in findings if f.status == "unknown"]


def test_accounts_not_reached_by_the_deadline_are_unknown_and_the_others_are_not_held_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(doctor, "MEMBER_UNIT_SECONDS", 0.05)
    org = Organization([f"acct-{i}" for i in range(12)])
    stuck = org.ids["acct-3"]
    release = threading.Event()

    def reads_in(held: MemberCredentials) -> tuple[Fleet, MetricsReader]:
        if held.account == stuck:
            release.wait(10)  # a call that hangs
        return org.reads_in(held)

    settings, _ = org.policies.load_settings()
    started = time.monotonic()
    try:
        read = gather_members(org.members, settings, {}, NOW, started + 1.0, reads_in=reads_in, workers=4)
    finally:
        release.set()
    assert time.monotonic() - started < 3.0  # the deadline holds, whatever hangs
    reached = {(u.account, u.region): u.reached for u in read.units}
    assert len(reached) == 24
    assert not reached[(stuck, REGIONS[0])] and not reached[(stuck, REGIONS[1])]
    assert sum(reached.values()) == 22  # every other unit was read


def test_the_cli_finds_the_organization_in_the_hub_stacks_sweep_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """`idle-reaper doctor` reads IDLE_REAPER_ORGANIZATION from the sweep function of a stack with the
    MemberStackSetId output only: a single-account stack costs no call."""
    import json

    from idle_reaper import aws as aws_module
    from idle_reaper.aws.accounts import ORGANIZATION_ENV
    from idle_reaper_tools import doctor as cli_doctor

    asked: list[str] = []
    config = {"prefix": "ml", "targets": ["ou-ab12-cd34ef56"], "regions": ["eu-west-1"], "hubAccount": "9" * 12}

    class Pages:
        def paginate(self, StackName: str) -> list[dict[str, Any]]:
            asked.append(f"ListStackResources {StackName}")
            resources = [
                {"ResourceType": "AWS::IAM::Role", "LogicalResourceId": "SweepRole1", "PhysicalResourceId": "r"},
                {
                    "ResourceType": "AWS::Lambda::Function",
                    "LogicalResourceId": "SlackFunctionAB",
                    "PhysicalResourceId": "s",
                },
                {
                    "ResourceType": "AWS::Lambda::Function",
                    "LogicalResourceId": "SweepFunction12",
                    "PhysicalResourceId": "fn",
                },
            ]
            return [{"StackResourceSummaries": resources}]

    class Clients:
        def get_paginator(self, name: str) -> Pages:
            return Pages()

        def get_function_configuration(self, FunctionName: str) -> dict[str, Any]:
            asked.append(f"GetFunctionConfiguration {FunctionName}")
            return {"Environment": {"Variables": {ORGANIZATION_ENV: json.dumps(config)}}}

    monkeypatch.setattr(aws_module, "client", lambda service, region=None: Clients())
    assert cli_doctor.organization_of("eu-west-1", "ml", {"Version": "1"}) is None and asked == []
    found = cli_doctor.organization_of("eu-west-1", "ml", {"MemberStackSetId": "ml-members:1"})
    assert found == OrganizationConfig(
        prefix="ml", targets=("ou-ab12-cd34ef56",), regions=("eu-west-1",), hub_account="9" * 12
    )
    assert asked == ["ListStackResources ml", "GetFunctionConfiguration fn"]


def test_one_unit_whose_check_raises_is_unknown_and_every_other_account_is_still_reported() -> None:
    org = Organization(["sandbox-a", "broken", "no-stack"], refused={"no-stack": "not authorized to perform"})
    org.launch("sandbox-a", REGIONS[0], gpu=None)  # a GPU machine without GPU metrics: a failure to report
    broken = org.ids["broken"]
    sessions = org.members.sessions
    real = sessions.credentials

    def credentials(account: str, region: str, *, started: datetime | None = None) -> Any:
        if account == broken and region == REGIONS[1]:
            raise KeyError("Expiration")  # a malformed STS answer, say: raised past the sessions' own catch
        return real(account, region, started=started)

    sessions.credentials = credentials  # type: ignore[method-assign]
    findings = member_findings(org.members, org.policies, NOW, time.monotonic() + 10, reads_in=org.reads_in)
    by_check: dict[str, list[Any]] = {}
    for f in findings:
        by_check.setdefault(f.check, []).append(f)
    assert "members" not in by_check or by_check["members"][0].status == "ok"
    failing = {f.subjects[0] for f in by_check["members.account"]}
    assert failing == {org.ids["sandbox-a"], org.ids["no-stack"]}  # the others' results are not hidden
    [unknown] = by_check["members.unknown"]
    assert unknown.subjects == (f"{broken}/{REGIONS[1]} (its check failed (KeyError: 'Expiration'))",)


def test_slack_doctor_says_where_the_digest_could_not_assume_its_read_role() -> None:
    org = Organization(["sandbox-a", "sandbox-b"])
    a, b = org.ids["sandbox-a"], org.ids["sandbox-b"]
    store = InMemoryStateStore(lambda: NOW)
    deadline = time.monotonic() + 30
    healthy = member_findings(org.members, org.policies, NOW, deadline, reads_in=org.reads_in, store=store)
    assert [f.message[:34] for f in healthy if f.check == "members"] == ["2 of 2 member account(s) healthy i"]
    refused = AccountFailure(b, "us-east-2", Reason.DENIED_BY_SCP, "AccessDenied: ... service control policy")
    save_member_check(store, MemberCheck(NOW, 2, 3, (refused,), checked=(a, b)), NOW, key=DIGEST_READS_KEY)
    found = member_findings(org.members, org.policies, NOW, deadline, reads_in=org.reads_in, store=store)
    [line] = [f for f in found if f.check == "members.account"]
    assert line.status == "warn" and line.subjects == (b,)
    assert "us-east-2: the weekly digest's read role: denied-by-scp (AccessDenied" in line.message
    assert "eu-west-1" not in line.message  # its other region was read
    # A week later the digest's reads have expired with nothing new: no line.
    later = member_findings(
        org.members, org.policies, NOW + timedelta(days=9), deadline, reads_in=org.reads_in, store=store
    )
    assert not [f for f in later if f.check == "members.account"]
