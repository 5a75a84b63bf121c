"""The weekly digest by account (organization mode, core/digest.py): every figure also belongs to the account
its machine runs in, said with the account's name; a digest of the hub's account alone looks as it always did."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper.core.digest import Week, build_digest, running_again_entry
from idle_reaper.core.digest_text import HUB_ACCOUNT, account_label, digest_text
from idle_reaper.core.records import MachineRecord, State, machine_key

W47 = Week(2026, 47)
MON = datetime(2026, 11, 16, tzinfo=UTC)
END = datetime(2026, 11, 23, tzinfo=UTC)
A, B, GONE = "111111111111", "222222222222", "333333333333"  # GONE: left the organization (not in the names)
NAMES = {A: "sandbox-a", B: ""}  # B: the directory lists it without a name
REGION = "eu-west-1"


def stopped(key: str, day: int, hours: float, hourly: float, team: str = "ml") -> list[Any]:
    at = MON + timedelta(days=day, hours=10)
    back = at + timedelta(hours=hours)
    return [
        (key, at, {"action": "stop", "team": team, "hourly_savings": hourly, "error": None}),
        (key, back, running_again_entry(key, team, "ada", "m5.large", back)),
    ]


def entries() -> list[Any]:
    # The same instance id in the hub and in A: two machines, each its own money.
    return [
        *stopped("i-0abc", 1, 4, 1.0),  # the hub's: $4
        *stopped(machine_key("i-0abc", A, REGION), 1, 5, 2.0),  # A: $10
        *stopped(machine_key("i-0def", B, REGION), 2, 3, 1.0, team="cv"),  # B: $3
        *stopped(machine_key("i-0fed", GONE, REGION), 3, 2, 3.0),  # an account gone since: $6, under its id
    ]


def test_money_is_said_per_account_with_the_accounts_name_or_its_id() -> None:
    d = build_digest(entries(), [], W47, now=END, account_names=NAMES)
    assert d.accounts == {None: (4.0, 0.0), A: (10.0, 0.0), B: (3.0, 0.0), GONE: (6.0, 0.0)}
    assert d.recovered_dollars == 23.0  # each stretch once, whatever its account
    line = next(x for x in digest_text(d).splitlines() if x.startswith("By account: "))
    assert line == (
        f"By account: {HUB_ACCOUNT} saved $4.00, kept idle $0.00; 222222222222 saved $3.00, kept idle $0.00; "
        "333333333333 saved $6.00, kept idle $0.00; sandbox-a (111111111111) saved $10.00, kept idle $0.00"
    )
    # A team's digest says the accounts of that team's machines only.
    cv = build_digest(entries(), [], W47, now=END, team="cv", account_names=NAMES)
    assert cv.accounts == {B: (3.0, 0.0)}


def test_a_digest_of_the_hubs_account_alone_has_no_account_section_and_reads_as_before() -> None:
    hub_only = [e for e in entries() if "/" not in e[0]]
    plain = build_digest(hub_only, [], W47, now=END)
    named = build_digest(hub_only, [], W47, now=END, account_names=NAMES)
    assert plain.accounts == {} and "By account" not in digest_text(named)
    assert digest_text(plain) == digest_text(named)
    # A record of a machine not watched names no account either.
    exempt = MachineRecord("i-0abc", "ml", name="box", state=State.EXEMPT, updated_at=END)
    assert "(exempt" in digest_text(build_digest(hub_only, [exempt], W47, now=END, account_names=NAMES))


def test_machines_not_watched_are_counted_per_account_and_named_with_it() -> None:
    records = [
        MachineRecord("i-0abc", "ml", name="hub-box", state=State.UNKNOWN, updated_at=END),
        MachineRecord(
            "i-0abc", "ml", name="a-box", state=State.EXEMPT, updated_at=END, account=A, region=REGION
        ),  # the same id, in A
        MachineRecord(
            "i-0abd", "ml", name="gone-box", state=State.UNKNOWN, updated_at=END, account=GONE, region=REGION
        ),
    ]
    idle = {machine_key("i-0abc", A, REGION): 10.0}  # by key: the hub's i-0abc was not read
    d = build_digest([], records, W47, now=END, account_names=NAMES, exempt_idle=idle)
    assert {a.key: a.idle_hours for a in d.at_risk} == {
        "i-0abc": None,
        machine_key("i-0abc", A, REGION): 10.0,
        machine_key("i-0abd", GONE, REGION): None,
    }
    text = digest_text(d)
    assert "a-box (sandbox-a, exempt)" in text and "gone-box (333333333333, unknown)" in text
    assert "hub-box (unknown)" in text
    line = next(x for x in text.splitlines() if x.startswith("By account: "))
    assert f"{HUB_ACCOUNT} saved $0.00, kept idle $0.00, 1 not watched" in line
    assert "sandbox-a (111111111111) saved $0.00, kept idle $0.00, 1 not watched" in line


def test_account_labels() -> None:
    assert account_label(None, NAMES) == HUB_ACCOUNT
    assert account_label(A, NAMES) == "sandbox-a (111111111111)"
    assert account_label(B, NAMES) == B  # no name: the id
    assert account_label(GONE, NAMES) == GONE  # unknown to the directory: the id
