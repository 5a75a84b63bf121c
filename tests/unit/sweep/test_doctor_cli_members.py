"""`idle-reaper doctor` in organization mode (tools doctor.member_checks), over the in-memory fakes: an account
is known only as far as the sweep's last check tried it, what the CLI cannot read (member metrics, a stored
check that is corrupt, an Organizations listing or StackSet that does not answer in time) is unknown, never
ok, and never a warning that says something else."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper import aws
from idle_reaper.aws.accounts import (
    DIGEST_READS_KEY,
    MEMBERS_KEY,
    ORGANIZATION_ENV,
    AccountFailure,
    MemberCheck,
    Reason,
    last_member_check,
    save_member_check,
)
from idle_reaper.aws.state import InMemoryStateStore
from idle_reaper.core.doctor import MEMBER_READ_FIX, Finding
from idle_reaper_tools import doctor as cli_doctor
from testkit.aws.organization import FakeOrganizations

REGION = "eu-west-1"
NOW = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)


class StackSet:
    """The member StackSet's instances, every one CURRENT; `hang` seconds before it answers."""

    def __init__(self, accounts: list[str], hang: float = 0.0) -> None:
        self.accounts, self.hang = accounts, hang

    def get_paginator(self, name: str) -> StackSet:
        assert name == "list_stack_instances"
        return self

    def paginate(self, StackSetName: str, CallAs: str) -> list[dict[str, Any]]:
        time.sleep(self.hang)
        return [{"Summaries": [{"Account": a, "Region": REGION, "Status": "CURRENT"} for a in self.accounts]}]


class SlowOrganizations(FakeOrganizations):
    def __init__(self, hang: float) -> None:
        super().__init__()
        self.hang = hang
        self.released = threading.Event()

    def describe_organization(self) -> dict[str, Any]:
        self.released.wait(self.hang)
        return super().describe_organization()


class World:
    def __init__(self, names: list[str], *, organizations: FakeOrganizations | None = None) -> None:
        self.orgs = organizations or FakeOrganizations()
        self.ou = self.orgs.add_ou(self.orgs.root)
        self.ids = {name: self.orgs.add_account(self.ou, name) for name in names}
        self.store = InMemoryStateStore(lambda: NOW)
        self.stack_set = StackSet(list(self.ids.values()))

    def doctor(self, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Finding]]:
        config = {"prefix": "idle-reaper", "targets": [self.ou], "regions": [REGION], "hubAccount": "9" * 12}
        monkeypatch.setenv(ORGANIZATION_ENV, json.dumps(config))
        clients = {"organizations": self.orgs, "cloudformation": self.stack_set, "dynamodb": None}
        monkeypatch.setattr(aws, "client", lambda service, region=None: clients[service])
        monkeypatch.setattr(aws, "DynamoStateStore", lambda dynamodb, table: self.store)
        monkeypatch.setattr(aws, "table_name", lambda: "idle-reaper")
        out: dict[str, list[Finding]] = {}
        for f in cli_doctor.member_checks(REGION, "IdleReaper", 5, NOW, True, {}):
            out.setdefault(f.check, []).append(f)
        return out


def test_an_account_the_last_sweep_did_not_try_is_unknown_and_the_ok_line_claims_no_gpu_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(["training", "sandbox"])
    training = world.ids["training"]
    # The sweep's (hour-cached) listing had training alone; sandbox joined since. Nothing failed.
    check = MemberCheck(NOW - timedelta(minutes=5), 1, 1, (), checked=(training,))
    save_member_check(world.store, check, NOW)
    assert last_member_check(world.store, NOW) == check  # the accounts it tried are kept
    found = world.doctor(monkeypatch)
    [unknown] = found["members.unknown"]
    assert unknown.subjects == (f"{world.ids['sandbox']}/{REGION} (not in the sweep's last check)",)
    # training: its role as the sweep saw it; its GPU metrics were not read here, and the line does not say so.
    assert [f.message for f in found["members"]] == [
        "1 of 2 member account(s) in every region: member role assumed (as the sweep last saw it)"
    ]
    assert found["members.gpu"][0].status == "unknown"


def test_a_check_stored_without_its_accounts_leaves_every_account_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(["training", "sandbox"])
    # As a sweep before this change stored it: counts and failures, not which accounts it tried.
    old = {"checked_at": (NOW - timedelta(minutes=5)).isoformat(), "accounts": 2, "units": 2, "failures": []}
    world.store.put_lookup(MEMBERS_KEY, json.dumps(old), NOW + timedelta(days=1))
    found = world.doctor(monkeypatch)
    assert "members" not in found and "members.account" not in found
    assert sorted(found["members.unknown"][0].subjects) == sorted(
        f"{a}/{REGION} (not in the sweep's last check)" for a in world.ids.values()
    )


@pytest.mark.parametrize("stored", ["{not json", json.dumps({"checked_at": "yesterday"}), json.dumps([1])])
def test_a_corrupt_stored_check_is_unknown_with_the_reason(monkeypatch: pytest.MonkeyPatch, stored: str) -> None:
    world = World(["training"])
    world.store.put_lookup(MEMBERS_KEY, stored, NOW + timedelta(days=1))
    found = world.doctor(monkeypatch)
    [unknown] = found["members.unknown"]
    assert "the sweep's last check of the member accounts could not be read" in unknown.message
    assert "not readable" in unknown.message  # with what was wrong
    assert "members" not in found


def test_a_listing_that_does_not_answer_in_time_is_unknown_not_no_account_enrolled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = SlowOrganizations(hang=5.0)
    world = World(["training"], organizations=slow)
    save_member_check(world.store, MemberCheck(NOW - timedelta(minutes=5), 1, 1, ()), NOW)
    monkeypatch.setattr(cli_doctor, "MEMBERS_SECONDS", 0.3, raising=False)
    started = time.monotonic()
    try:
        found = world.doctor(monkeypatch)
    finally:
        slow.released.set()
    assert time.monotonic() - started < 2.0  # bounded, not the 5 s Organizations hangs
    [listing] = found["members.listing"]
    assert listing.status == "unknown" and "did not answer in time" in listing.message
    assert "no earlier listing is known" in listing.message
    assert "members" not in found  # not "no member account is enrolled"


def test_a_stack_set_that_does_not_answer_in_time_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(["training"])
    world.stack_set.hang = 3.0
    check = MemberCheck(NOW - timedelta(minutes=5), 1, 1, (), checked=(world.ids["training"],))
    save_member_check(world.store, check, NOW)
    monkeypatch.setattr(cli_doctor, "MEMBERS_SECONDS", 0.3, raising=False)
    started = time.monotonic()
    found = world.doctor(monkeypatch)
    assert time.monotonic() - started < 2.0
    [stacks] = found["members.stacks"]
    assert stacks.status == "unknown" and "not done in" in stacks.message
    assert "members.account" not in found  # not read is not "missing"


def test_an_account_where_the_digest_could_not_assume_its_read_role_is_a_warning_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(["training", "sandbox"])
    training, sandbox = world.ids["training"], world.ids["sandbox"]
    save_member_check(world.store, MemberCheck(NOW - timedelta(minutes=5), 2, 2, (), checked=(training, sandbox)), NOW)
    # The digest of Monday read training's exempt machines; sandbox's read role is missing (its member role is not).
    refused = AccountFailure(sandbox, REGION, Reason.ROLE_MISSING, "AccessDenied: not authorized")
    monday = NOW - timedelta(days=4)
    digest = MemberCheck(monday, 2, 1, (refused,), checked=(training, sandbox))
    save_member_check(world.store, digest, monday, key=DIGEST_READS_KEY)
    assert last_member_check(world.store, NOW) != digest  # another item than the sweep's check
    found = world.doctor(monkeypatch)
    [line] = found["members.account"]
    assert line.status == "warn" and line.subjects == (sandbox,)
    assert line.message == (
        f"member account {sandbox} 'sandbox': {REGION}: the weekly digest's read role: role-missing "
        "(AccessDenied: not authorized; the digest of 2026-11-23 09:00 UTC)"
    )
    assert line.fix == MEMBER_READ_FIX
    assert [f.message[:31] for f in found["members"]] == ["1 of 2 member account(s) in eve"]


def test_the_hubs_own_account_is_checked_only_where_it_is_a_member() -> None:
    """The hub sits in a target OU with a stack in eu-west-1 alone: the doctor lists it as a member in us-east-1
    (where the sweep assumes its member role) and not in eu-west-1 (its own stack's: no member unit there)."""
    from idle_reaper.aws.accounts import Directory, MemberAccount, OrganizationConfig
    from idle_reaper.sweep.doctor import members_as_last_checked

    hub, training = "9" * 12, "1" * 12
    config = OrganizationConfig(
        prefix="idle-reaper", targets=("r-ab12",), regions=(REGION, "us-east-1"), hub_account=hub, hub_regions=(REGION,)
    )
    listing = Directory((MemberAccount(hub, "hub", ()), MemberAccount(training, "training", ())), listed_at=NOW)
    check = MemberCheck(NOW - timedelta(minutes=5), 2, 3, (), checked=(hub, training))
    read = members_as_last_checked(check, listing, config.regions_of, NOW, timedelta(minutes=15))
    assert sorted((u.account, u.region) for u in read.units) == sorted(
        [(hub, "us-east-1"), (training, REGION), (training, "us-east-1")]
    )
