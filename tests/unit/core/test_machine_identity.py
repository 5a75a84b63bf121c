"""A machine is (account, region, instance) (issue 30): one function makes and reads machine keys; a hub
machine's key is its instance id, exactly as before organization mode; the same instance id in two member
accounts gives two records, two audit trails and two explanations that say where each runs."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idle_reaper.aws.state import InMemoryStateStore, item_to_record, record_to_item
from idle_reaper.core.records import MachineId, MachineRecord, State, machine_key, parse_machine_key
from idle_reaper.core.signals import Machine
from idle_reaper.policy import Settings, TeamPolicy, TeamPolicyRef
from idle_reaper.slack.answers import status_reply
from idle_reaper.sweep import run_sweep
from idle_reaper.sweep.delivery import explain
from idle_reaper_tools.admin import format_status, status_rows
from testkit.aws import FakeAws, steady

A, B = "111111111111", "222222222222"
REGION = "eu-west-1"
NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)

instance_ids = st.from_regex(r"i-[0-9a-f]{8,17}", fullmatch=True)
accounts = st.from_regex(r"\d{12}", fullmatch=True)
regions = st.sampled_from(["us-east-1", "eu-central-2", "us-gov-west-1", "cn-northwest-1", "ap-southeast-7"])


@given(instance_ids, accounts, regions)
def test_member_key_round_trips(instance_id: str, account: str, region: str) -> None:
    key = machine_key(instance_id, account, region)
    assert parse_machine_key(key) == MachineId(instance_id, account, region)
    assert key != machine_key(instance_id)  # never the hub machine's key


@given(instance_ids)
def test_hub_key_is_the_instance_id_as_before(instance_id: str) -> None:
    assert machine_key(instance_id) == instance_id
    assert parse_machine_key(instance_id) == MachineId(instance_id)


@given(instance_ids, accounts, accounts, regions)
def test_two_accounts_never_share_a_key(instance_id: str, a: str, b: str, region: str) -> None:
    assert (machine_key(instance_id, a, region) == machine_key(instance_id, b, region)) == (a == b)


@pytest.mark.parametrize(
    "key",
    [
        "",
        "i-1/",
        "/i-1",
        "111111111111/i-1",  # two parts
        "11111111111/eu-west-1/i-1",  # 11 digits
        "111111111111/europe/i-1",
        "111111111111/eu-west-1/",
        "111111111111/eu-west-1/i-1/extra",
        "111111111111/eu-west-1/i 1",
    ],
)
def test_bad_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match=r"not a machine key|not an instance id|a member machine needs"):
        parse_machine_key(key)


@pytest.mark.parametrize(
    ("instance_id", "account", "region"),
    [("i-1", A, None), ("i-1", None, REGION), ("i-1", "12", REGION), ("i-1", A, "nowhere"), ("a/b", None, None)],
)
def test_bad_parts_make_no_key(instance_id: str, account: str | None, region: str | None) -> None:
    with pytest.raises(ValueError):
        machine_key(instance_id, account, region)


def test_hub_item_is_unchanged_and_member_item_carries_its_account() -> None:
    hub = MachineRecord("i-0abc", "ml")
    assert record_to_item(hub) == {"pk": "machine#i-0abc", "sk": "state", "instance_id": "i-0abc", "team": "ml",
                                   "state": "active", "version": 0, "reason": "", "messages": [], "snoozes_today": 0,
                                   "quiet_history": "", "usage_profile": "", "human_signal": "",
                                   "warning_held": False, "machine_kind": "", "kind_note": "", "next_read_at": "",
                                   "next_read_why": "", "week_peaks": ""}  # fmt: skip
    member = replace(hub, account=A, region=REGION)
    item = record_to_item(member)
    assert item["pk"] == f"machine#{A}/{REGION}/i-0abc"
    assert item_to_record(item) == member and item_to_record(record_to_item(hub)) == hub


def test_store_keeps_the_same_instance_id_in_two_accounts_apart() -> None:
    store = InMemoryStateStore()
    in_a = MachineRecord("i-0abc", "ml", account=A, region=REGION, version=1, owner="ann")
    in_b = MachineRecord("i-0abc", "ml", account=B, region=REGION, version=1, owner="bob")
    hub = MachineRecord("i-0abc", "ml", version=1, owner="hub")
    assert store.save(in_a) and store.save(in_b) and store.save(hub)
    loaded = store.load([in_a.key, in_b.key, hub.key, "not a key"])
    assert {k: r.owner for k, r in loaded.items()} == {in_a.key: "ann", in_b.key: "bob", "i-0abc": "hub"}
    # Writing one never touches the other: B's record is still at version 1 after A's moves on.
    assert store.save(replace(in_a, version=2, owner="ann2"))
    assert not store.save(replace(in_b, version=3))
    assert store.load([in_b.key])[in_b.key].owner == "bob"


def _member_world() -> FakeAws:
    aws = FakeAws()
    aws.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    aws.ssm.store("/idle-reaper/teams/ml", '{"idle_minutes": 90, "warn_minutes": 30}')
    return aws


def test_same_instance_id_in_two_accounts_is_two_machines() -> None:
    """Two member accounts whose EC2 hands out the same instance id: one sweep of each (through its own
    clients) gives two records, two audit trails and two explanations naming the account and region."""
    store = InMemoryStateStore()
    worlds = {A: _member_world(), B: _member_world()}
    ids = {a: w.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=1))
           for a, w in worlds.items()}  # fmt: skip
    assert ids[A] == ids[B]  # the collision under test
    instance_id = ids[A]
    for t in (NOW - timedelta(minutes=30), NOW):  # warned, then stopped 30 minutes later
        reports = {a: run_sweep(w.adapters(store=store), now=t, member=(a, REGION)) for a, w in worlds.items()}
    rows = {a: explain(r.decisions[0]) for a, r in reports.items()}
    assert {a: (row["account"], row["region"], row["instance_id"]) for a, row in rows.items()} == {
        A: (A, REGION, instance_id),
        B: (B, REGION, instance_id),
    }
    assert {row["action"] for row in rows.values()} == {"stop"}
    # Each account's stop went through its own clients, and only there.
    for w in worlds.values():
        assert [r["InstanceIds"] for r in w.ec2.requests_of("StopInstances")] == [[instance_id]]
    keys = {machine_key(instance_id, A, REGION), machine_key(instance_id, B, REGION)}
    assert set(store.records) == keys  # nothing under the bare instance id (the hub's key)
    assert all(r.state.value == "reaped" for r in store.records.values())
    audited = {key for key, _, entry in store.audits if entry.get("action") in ("warn", "stop")}
    assert audited == keys
    for key in keys:
        where = parse_machine_key(key)
        assert {e["account"] for e in store.history(key)} == {where.account}


def test_hub_sweep_is_unchanged_by_identity() -> None:
    """No `member`: records and audit items keyed by the bare instance id, no account in the explanation."""
    store = InMemoryStateStore()
    aws = _member_world()
    instance_id = aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=NOW - timedelta(days=1))
    report = run_sweep(aws.adapters(store=store), now=NOW)
    assert set(store.records) == {instance_id}
    assert store.records[instance_id].account is None
    assert "account" not in explain(report.decisions[0]) and "region" not in explain(report.decisions[0])


def test_status_names_the_account_and_never_mixes_a_member_machine_with_the_hubs() -> None:
    hub_machine = Machine("i-0abc", "m5.large", "hub-team", NOW - timedelta(days=1), owner="hub-owner")
    hub = MachineRecord("i-0abc", "hub-team", owner="hub-owner", owner_slack_id="U0ME", version=1)
    member = MachineRecord("i-0abc", "ml", account=A, region=REGION, owner="ann", owner_slack_id="U0ME", version=1)
    rows = status_rows([hub, member], {"i-0abc": hub_machine}, None, Settings(), NOW)
    by_account = {r.get("account"): r for r in rows}
    assert set(by_account) == {None, A} and len(rows) == 2  # the hub's running machine is not listed twice
    assert (by_account[A]["team"], by_account[A]["owner"], by_account[A]["region"]) == ("ml", "ann", REGION)
    assert by_account[None]["team"] == "hub-team"
    table = format_status(rows, NOW)
    assert f"{A}/{REGION}/i-0abc" in table
    text = status_reply([hub, member], now=NOW).text
    assert f"account {A} ({REGION})" in text and text.count("account ") == 1


def test_status_says_what_a_member_machines_record_holds_never_not_running() -> None:
    """The CLI lists only the hub account's EC2: a member machine is known from its record. A warned one is
    shown with its stop and when (as its account's last sweep saw it), not as a machine that is not running;
    a hub record without a running machine is still "not running"."""
    warned_at = NOW - timedelta(minutes=10)
    member = MachineRecord(
        "i-0abc",
        "ml",
        account=A,
        region=REGION,
        owner="ann",
        state=State.WARNED,
        idle_since=NOW - timedelta(minutes=60),
        warned_at=warned_at,
        warning_delivered_at=warned_at,
        version=3,
    )
    grouped = replace(member, instance_id="i-0def", asg_name="trainers")  # its group, as its record names it
    gone = MachineRecord("i-0fff", "ml", owner="bob", state=State.IDLE, idle_since=NOW, version=1)
    policy = TeamPolicy(idle_minutes=90, warn_minutes=30)
    refs = {"ml": TeamPolicyRef(team="ml", policy=policy, source="/idle-reaper/teams/ml", version=1)}
    rows = {r["instance_id"]: r for r in status_rows([member, grouped, gone], {}, refs, Settings(), NOW)}
    assert rows["i-0abc"]["next_action"] == "stop if still idle (as its account's last sweep saw it)"
    # The stop: 30 min after the delivered warning, and not before 90 min quiet (the later of the two).
    assert rows["i-0abc"]["next_at"] == (NOW + timedelta(minutes=30)).isoformat()
    assert rows["i-0def"]["next_action"] == "release to its group if still idle (as its account's last sweep saw it)"
    assert rows["i-0fff"]["next_action"] == "none: not running"
