"""Every dollar figure true, and the same wherever it is shown (issue 44, items 5-8): what a stop, a termination,
a keep and an exemption save or waste, per kind of machine, is core/dollars.py's one rule; `status`, the sweep's
audit, the Slack answers' audit entries and the digest all say its figures (docs/policy.md, "What each action saves
or wastes")."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper.core.digest import KEEP, Week, answer_entry, build_digest
from idle_reaper.core.digest_text import digest_text
from idle_reaper.core.kinds import Kind, MachineKind
from idle_reaper.core.records import MachineRecord, State
from idle_reaper.policy import Settings
from idle_reaper.pricing import hourly_price
from idle_reaper_tools.admin import status_rows

W47 = Week(2026, 47)  # Monday 2026-11-16 .. Monday 2026-11-23
MON = datetime(2026, 11, 16, tzinfo=UTC)
END = datetime(2026, 11, 23, tzinfo=UTC)
TYPE = "g5.xlarge"
PRICE = hourly_price(TYPE)
assert PRICE is not None
ON_DEMAND = f"${PRICE:,.2f}/h"
NEVER_STOPPED = ("spot-one-time", "instance-store", "fleet", "spot-request-gone", "spot-relaunching")


def record(kind: str, state: State = State.WARNED, **more: Any) -> MachineRecord:
    return MachineRecord("i-0123456789abcdef0", "ml", state, machine_kind=kind, instance_type=TYPE, owner="ada", **more)


def status_of(kind: str) -> str:
    rows = status_rows([record(kind)], {}, {}, Settings(), MON)
    return str(rows[0]["stop_saves"])


@pytest.mark.parametrize("kind", NEVER_STOPPED)
def test_status_says_a_stop_saves_nothing_for_a_machine_that_is_never_stopped(kind: str) -> None:
    """Item 5: EC2 cannot stop it (or a fleet or request would replace it): the sweep records $0, and so does
    `status`, never the on-demand price."""
    assert status_of(kind) == "$0.00/h"


def test_status_says_the_price_of_what_a_stop_saves_where_it_saves_it() -> None:
    assert status_of("on-demand") == ON_DEMAND
    assert status_of("spot") == f"at most {ON_DEMAND}"
    assert status_of("capacity-reservation") == status_of("capacity-block") == "$0.00/h"


def digest_of(*entries: tuple[str, datetime, dict[str, Any]]) -> Any:
    return build_digest(list(entries), [], W47, now=END, team="ml")


def test_terminate_now_records_what_the_sweeps_own_termination_records() -> None:
    """Item 6: a one-time Spot or instance-store machine terminated by its owner's click counts what the sweep's
    termination of it counts: nothing (docs/policy.md), not its on-demand price for seven days."""
    for kind in ("spot-one-time", "instance-store"):
        entry = answer_entry(record(kind), "terminate_instance", "U1", PRICE)
        assert entry["hourly_savings"] == 0.0, kind
        d = digest_of(("i-0123456789abcdef0", MON, entry))
        assert d.recovered_dollars == 0.0
        assert d.recovered["terminations"].count == 1


def test_a_persons_stop_of_a_spot_machine_is_an_upper_bound() -> None:
    """Item 6: "Stop now" on a Spot machine records at most its on-demand price, marked as the upper bound."""
    entry = answer_entry(record("spot"), "stop", "U1", PRICE)
    assert entry["hourly_savings"] == PRICE and entry["savings_upper_bound"] is True
    reserved = answer_entry(record("capacity-reservation"), "stop", "U1", PRICE)
    assert reserved["hourly_savings"] == 0.0 and reserved["savings_upper_bound"] is False


def keep(kind: str) -> tuple[str, datetime, dict[str, Any]]:
    kept = record(kind, state=State.SNOOZED, snoozed_until=MON + timedelta(hours=10), snoozed_by="U1")
    return ("i-0123456789abcdef0", MON, answer_entry(kept, KEEP, "U1", PRICE))


def test_a_keep_wastes_what_the_machine_bills_while_idle() -> None:
    """Item 7: keeping a machine in a reservation idle wastes nothing more (the reservation bills either way);
    keeping a Spot machine idle wastes at most its on-demand price, said "up to"."""
    assert digest_of(keep("on-demand")).kept_dollars == pytest.approx(10 * PRICE)
    for kind in ("capacity-reservation", "capacity-block"):
        assert digest_of(keep(kind)).kept_dollars == 0.0, kind
    spot = digest_of(keep("spot"))
    assert spot.kept_dollars == pytest.approx(10 * PRICE)
    assert f"Still wasted, kept idle by answers: up to ${10 * PRICE:,.2f}" in digest_text(spot)
    assert "up to" not in digest_text(digest_of(keep("on-demand")))


def stop(upper_bound: bool) -> tuple[str, datetime, dict[str, Any]]:
    entry = {
        "action": "stop",
        "team": "ml",
        "owner": "ada",
        "hourly_savings": 1.0,
        "hourly_cost": 1.0,
        "savings_upper_bound": upper_bound,
    }
    return ("i-0123456789abcdef0", MON, entry)


def test_the_digest_says_spot_savings_up_to() -> None:
    """Item 8: a stop recorded with `savings_upper_bound` is shown as "up to", in the total, its kind's part and
    the 8 weeks' trend; an exact one is not."""
    text = digest_text(digest_of(stop(True)))
    assert "Saved: *up to $168.00*" in text
    assert "1 stops (168.0 h, up to $168.00)" in text
    assert "2026-W47 up to $168.00" in text
    exact = digest_text(digest_of(stop(False)))
    assert "Saved: *$168.00*" in exact and "up to" not in exact


@pytest.mark.parametrize("kind", ["", *(k.value for k in Kind)])
def test_every_surface_says_the_rules_figures(kind: str) -> None:
    """The one rule (core/dollars.py), per kind: `status`'s STOP SAVES, the sweep's audit of its action, a
    person's stop, termination and keep all record its figures."""
    from idle_reaper.core.dollars import dollars, of_kind

    rule = dollars(kind, PRICE)
    assert status_of(kind) == rule.stop.text()
    for action, saving in (("stop", rule.stop), ("terminate_instance", rule.terminate)):
        entry = answer_entry(record(kind), action, "U1", PRICE)
        assert (entry["hourly_savings"], entry["savings_upper_bound"]) == (saving.hourly, saving.upper_bound)
    _, _, kept = keep(kind)
    assert (kept["hourly_waste"], kept["waste_upper_bound"]) == (rule.idle.hourly, rule.idle.upper_bound)
    if kind:  # what the sweep records for a machine it has just classified: the same figures
        classified = MachineKind(Kind(kind), can_stop=True, can_terminate=True, saves="price")
        assert of_kind(classified, PRICE) == rule


def test_the_sweeps_audit_and_a_persons_click_record_the_same_figure_per_machine() -> None:
    """Item 6, end to end: a sweep over on-demand, persistent Spot and one-time Spot machines (terminated on opt-in)
    audits each stop and termination; a person's click on the same machine (answer_entry, from its record) records
    the same hourly saving and the same upper-bound mark."""
    from idle_reaper.sweep import run_sweep
    from testkit.aws import CountingStateStore, FakeAws, steady

    aws = FakeAws()
    aws.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    policy = '{"idle_minutes": 90, "warn_minutes": 30, "terminate_unstoppable_after_minutes": 120}'
    aws.ssm.store("/idle-reaper/teams/ml", policy)
    launched = [
        aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=MON - timedelta(days=1), owner=f"U0{n}")
        for n in range(3)
    ]
    _, persistent, one_time = launched
    aws.ec2.make_spot(persistent, request_type="persistent", interruption="stop")
    aws.ec2.make_spot(one_time)
    store = CountingStateStore()
    for minutes in range(0, 121, 10):
        run_sweep(aws.adapters(store=store), now=MON + timedelta(minutes=minutes))
    reaped = {i: (a, e) for i, _, e in store.audits if (a := e["action"]) in ("stop", "terminate_instance")}
    assert set(reaped) == set(launched)
    for instance_id, (action, entry) in reaped.items():
        clicked = answer_entry(store.records[instance_id], action, "U1", hourly_price("m5.large"))
        figure = (entry["hourly_savings"], entry["savings_upper_bound"])
        assert figure == (clicked["hourly_savings"], clicked["savings_upper_bound"]), instance_id
    assert reaped[persistent][1]["savings_upper_bound"] is True
    assert reaped[one_time][1]["hourly_savings"] == 0.0


def test_the_admins_digest_says_up_to_for_the_team_and_account_whose_savings_are_spot() -> None:
    spot = ("i-0123456789abcdef0", MON, {**stop(True)[2], "team": "ml"})
    exact = ("111111111111/us-east-1/i-0fedcba9876543210", MON, {**stop(False)[2], "team": "cv"})
    text = digest_text(build_digest([spot, exact], [], W47, now=END))
    assert "By team: cv saved $168.00, kept idle $0.00; ml saved up to $168.00, kept idle $0.00" in text
    assert "By account: the hub's account saved up to $168.00" in text and "111111111111 saved $168.00" in text


def test_a_release_its_group_keeps_running_saves_no_machine_hours_either() -> None:
    """Issue 44 read-over, 2: a group member released (scale-in protection removed, not stopped) that its group still
    runs saves nothing (core/dollars.py saves_while_running): neither dollars nor machine-hours in the digest's
    Saved line, while a stop beside it counts its hours."""
    member = MachineRecord("i-0member", "ml", State.REAPED, asg_name="workers", last_action="unprotect", updated_at=END)
    release = {**stop(False)[2], "action": "unprotect"}
    d = build_digest([("i-0member", MON, release), stop(False)], [member], W47, now=END, team="ml")
    assert d.recovered["releases"].count == 1 and d.recovered["releases"].hours == 0.0
    assert d.recovered_hours == 168.0  # the stop's week alone
    assert "Saved: *$168.00* over 168.0 machine-hours: 1 releases (0.0 h, $0.00), 1 stops" in digest_text(d)


def test_the_admins_digest_says_up_to_for_the_kept_idle_waste_of_a_spot_machine() -> None:
    """Issue 44 read-over, 3: the By team and By account lines say "kept idle up to $…" where the waste holds a Spot
    machine's keep (at most its bound), as the kept-idle line above them does; an exact waste stays exact. An exempt
    Spot machine's idle hours, and a Spot group member its group keeps running, are "up to" too."""
    _, _, spot_keep = keep("spot")
    _, _, exact_keep = keep("on-demand")
    entries = [
        ("i-0123456789abcdef0", MON, spot_keep),
        ("111111111111/us-east-1/i-0fedcba9876543210", MON, {**exact_keep, "team": "cv"}),
    ]
    exempt = record("spot", state=State.EXEMPT, updated_at=END, name="spot-box")
    member = MachineRecord(
        "i-0member", "ml", State.REAPED, machine_kind="spot", instance_type=TYPE, asg_name="g", updated_at=END
    )
    d = build_digest(entries, [exempt, member], W47, now=END, prices={TYPE: PRICE}, exempt_idle={exempt.key: 2.0})
    text = digest_text(d)
    waste = f"${10 * PRICE:,.2f}"
    assert f"Still wasted, kept idle by answers: up to ${20 * PRICE:,.2f}" in text
    assert f"By team: cv saved $0.00, kept idle {waste}; ml saved $0.00, kept idle up to {waste}" in text
    assert f"the hub's account saved $0.00, kept idle up to {waste}" in text
    assert f"111111111111 saved $0.00, kept idle {waste}" in text
    assert f"Still wasted, exempt and idle: up to ${2 * PRICE:,.2f} (2 h): spot-box 2 h" in text
    assert f"Idle in an Auto Scaling group, still running (up to {ON_DEMAND}): i-0member (up to {ON_DEMAND})" in text
