"""Machines a stop cannot reach or does not save, end to end: moto with EC2's real answers in front of it
(testkit/ec2_answers.py), the local Slack fake, the real handlers. Beside an ordinary machine that is still
warned and stopped: a one-time Spot notebook and an instance-store machine (EC2 refuses StopInstances), an EC2
Fleet member (the fleet would replace it), a machine in a capacity reservation (a stop saves nothing) and a p5
(scarce capacity). For each: the warning's words, no StopInstances, `status`, the audit and the savings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError

from idle_reaper import aws
from idle_reaper.core import State
from idle_reaper.handlers import slack as slack_handler
from idle_reaper.policy import Settings
from idle_reaper.sweep import SweepReport, run_sweep
from idle_reaper_tools import admin, local
from idle_reaper_tools.demo import adapters_at, at
from idle_reaper_tools.fake_slack import FakeSlack, LambdaContextStub, button_click
from testkit import ec2_answers
from testkit.ec2_answers import Ec2Answers

pytestmark = pytest.mark.integration

T0 = at(14)  # quiet since 11:00 on a 60-minute window: warned now, due 20 minutes after
RESERVATION_END = T0 + timedelta(hours=2)


def idle(_t: datetime) -> tuple[float, float | None]:
    return (1.0, 0.0)


@pytest.fixture
def answers(aws: Any) -> Iterator[Ec2Answers]:
    # The Slack handler's clients are made within the test (the `aws` fixture drops the kept ones): they meet these.
    with ec2_answers.real_ec2_answers() as answers:
        yield answers


def init(**policy: Any) -> None:
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20, **policy)})
    ssm = aws.client("ssm")
    settings = json.loads(ssm.get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"])
    settings["admins"] = ["U0ADMIN"]
    ssm.put_parameter(Name="/idle-reaper/settings", Value=json.dumps(settings), Type="String", Overwrite=True)


QUIET_FROM = at(11)


def machine(name: str, instance_type: str = "m5.large", since: datetime = QUIET_FROM, **tags: str) -> str:
    """Launched at 08:00 (or `since`, if earlier), quiet from `since`; owned by U0<NAME>."""
    owner = f"U0{name.upper().replace('-', '')}"
    launched = min(at(8), since)
    instance_id = local.launch(name, instance_type, team="ml", launch_time=launched, owner=owner, extra_tags=tags)
    local.write_metrics(instance_id, idle, since, at(23))
    return instance_id


@pytest.fixture
def fleet(answers: Ec2Answers, slack: FakeSlack) -> dict[str, str]:
    """Every kind, each with its own owner (one message each), and what EC2 really answers for it."""
    init()
    ids = {
        "ordinary": machine("ordinary"),
        "spot": machine("spot"),
        "scratch": machine("scratch"),
        "member": machine("member", **{"aws:ec2:fleet-id": "fleet-0abc"}),
        "reserved": machine("reserved"),
        "bigtrain": machine("bigtrain", "p5.48xlarge"),
        "persistent": machine("persistent"),
    }
    ec2_answers.make_spot(ids["persistent"], request_type="persistent", interruption="stop")
    ec2_answers.make_spot(ids["spot"], request_type="one-time")
    answers.refuse_stop[ids["spot"]] = ec2_answers.one_time_spot_stop(ids["spot"])
    ec2_answers.set_instance(ids["scratch"], root_device_type="instance-store")
    answers.refuse_stop[ids["scratch"]] = ec2_answers.instance_store_stop(ids["scratch"])
    ec2_answers.set_instance(ids["reserved"], capacity_reservation_id="cr-0res")
    answers.reservations["cr-0res"] = ec2_answers.capacity_reservation("cr-0res", "m5.large", end=RESERVATION_END)
    return ids


def sweep(now: datetime) -> SweepReport:
    return run_sweep(adapters_at(now), now=now)


def posted_to(slack: FakeSlack, instance_id: str) -> list[dict[str, Any]]:
    """The warnings and notices posted about one machine (admin alerts aside)."""
    return [
        c.params
        for c in slack.calls_to("chat.postMessage")
        if instance_id in json.dumps(c.params.get("blocks", [])) and "admin alert" not in c.params["text"]
    ]


def admin_alerts(slack: FakeSlack) -> list[str]:
    return [c.params["text"] for c in slack.calls_to("chat.postMessage") if "admin alert" in c.params["text"]]


def buttons(message: dict[str, Any]) -> list[str]:
    return [e["action_id"] for b in message["blocks"] if b["type"] == "actions" for e in b["elements"]]


def words(message: dict[str, Any]) -> str:
    return json.dumps(message["blocks"])


def audit(instance_id: str) -> list[dict[str, Any]]:
    out = aws.client("dynamodb").query(
        TableName=aws.table_name(),
        KeyConditionExpression="pk = :pk AND begins_with(sk, :audit)",
        ExpressionAttributeValues={":pk": {"S": f"machine#{instance_id}"}, ":audit": {"S": "audit#"}},
    )
    return [json.loads(item["entry"]["S"]) for item in out["Items"]]


def record(instance_id: str) -> Any:
    return aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).load([instance_id])[instance_id]


def test_each_kind_is_told_what_happens_and_only_a_stoppable_machine_is_stopped(
    fleet: dict[str, str], answers: Ec2Answers, slack: FakeSlack
) -> None:
    first = sweep(T0)
    by_id = {d.machine.instance_id: d for d in first.decisions}
    assert all(by_id[i].state is State.WARNED for i in fleet.values()), {n: by_id[i].reason for n, i in fleet.items()}

    # The words. An ordinary machine and a p5 are warned of a stop (the p5 that its capacity may not return);
    # the others are told what will not happen, and why, once.
    [ordinary] = posted_to(slack, fleet["ordinary"])
    assert "will be *stopped*" in words(ordinary) and "stop_now" in buttons(ordinary)
    [big] = posted_to(slack, fleet["bigtrain"])
    assert "will be *stopped* at <!date^" in words(big) and "may not start again for hours or days" in words(big)
    for name in ("spot", "scratch", "member", "reserved"):
        [notice] = posted_to(slack, fleet[name])
        assert "will be *stopped*" not in words(notice) and "stop_now" not in buttons(notice), name
        assert "keep_2h" in buttons(notice), name
    spot, scratch = posted_to(slack, fleet["spot"])[0], posted_to(slack, fleet["scratch"])[0]
    assert "one-time Spot instance" in words(spot) and "terminate_now" in buttons(spot)
    assert "root device is instance store" in words(scratch) and "terminate_now" in buttons(scratch)
    assert "can never be started again" in words(spot)
    member, reserved = posted_to(slack, fleet["member"])[0], posted_to(slack, fleet["reserved"])[0]
    assert "EC2 Fleet fleet-0abc" in words(member) and "terminate_now" not in buttons(member)
    assert "capacity reservation cr-0res" in words(reserved) and "save nothing" in words(reserved)
    assert f"{RESERVATION_END:%Y-%m-%d %H:%M} UTC" in words(reserved)
    # The admins hear of the fleet member and the idle reservation, with its hourly cost and end.
    alerts = admin_alerts(slack)
    assert len(alerts) == 2
    assert any(fleet["member"] in a and "lower its target capacity" in a for a in alerts)
    assert any(fleet["reserved"] in a and "$0.10 an hour" in a and "16:00 UTC" in a for a in alerts)

    # The window ends: the ordinary machine and the p5 are stopped; EC2 is never asked to stop the others.
    stopped = sweep(T0 + timedelta(minutes=25))
    sweep(T0 + timedelta(minutes=50))
    states = local.instance_states(list(fleet.values()))
    assert states[fleet["ordinary"]] == states[fleet["bigtrain"]] == states[fleet["persistent"]] == "stopped"
    for name in ("spot", "scratch", "member", "reserved"):
        assert states[fleet[name]] == "running", name
        assert answers.stop_calls_naming(fleet[name]) == 0, name
        assert len(posted_to(slack, fleet[name])) == 1, name  # told once, not again
    assert len(admin_alerts(slack)) == 2

    # The "Stopped" messages say what each stop saves: the price, or at most it for Spot.
    updates = json.dumps([c.params for c in slack.calls_to("chat.update")])
    assert "it saves $0.10/h while stopped" in updates and "it saves at most $0.10/h while stopped" in updates
    # Savings: only what a stop saves (m5.large $0.096 + p5.48xlarge $98.32, and the persistent Spot machine at
    # most its on-demand $0.096, so the total is marked an upper bound), never a reservation or a notice.
    totals = stopped.summary.teams["ml"]
    assert totals.reaped == 3 and round(totals.hourly_savings, 3) == 98.512 and totals.savings_upper_bound

    # status: the kind and what a stop saves.
    rows = {
        r["instance_id"]: r
        for r in admin.status_rows(
            aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).all_records(), {}, None, _settings(), T0
        )
    }
    assert rows[fleet["ordinary"]]["stop_saves"] == "$0.10/h" and rows[fleet["ordinary"]]["kind"] == "on-demand"
    assert (
        rows[fleet["reserved"]]["kind"] == "capacity-reservation" and rows[fleet["reserved"]]["stop_saves"] == "$0.00/h"
    )
    assert rows[fleet["spot"]]["kind"] == "spot-one-time"
    assert rows[fleet["persistent"]]["kind"] == "spot" and rows[fleet["persistent"]]["stop_saves"] == "at most $0.10/h"
    assert "EC2 cannot stop it" in rows[fleet["spot"]]["kind_note"]
    assert rows[fleet["member"]]["kind"] == "fleet" and rows[fleet["scratch"]]["kind"] == "instance-store"

    # The audit: the notice, with the kind and no savings; the stop, with its savings.
    [told] = [e for e in audit(fleet["reserved"]) if e["action"] == "warn"]
    assert told["kind"] == "capacity-reservation" and told["hourly_savings"] == 0.0
    [stop] = [e for e in audit(fleet["ordinary"]) if e["action"] == "stop"]
    assert stop["kind"] == "on-demand" and stop["hourly_savings"] == 0.096


def _settings() -> Any:
    from idle_reaper.policy import Settings

    return Settings()


# ---------------------------------------------------------------------------------------------
# Answers: terminate now (owner only, confirmed), start again without capacity, termination on opt-in


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, datetime]:
    now = {"t": T0}
    monkeypatch.setattr(slack_handler, "clock", lambda: now["t"])
    return now


def click(slack: FakeSlack, user: str, action_id: str, value: str) -> list[str]:
    """A signed click through the Slack handler; the ephemeral replies it sent."""
    name = f"click-{user}-{action_id}-{len(slack.calls_to('chat.update'))}"
    event = button_click(user, action_id, value, slack.response_url(name))
    response = slack_handler.handler(event, LambdaContextStub())
    assert response["statusCode"] == 200, response
    texts = [r["text"] for r in slack.replies_to(name)]
    if response["body"]:
        texts.append(json.loads(response["body"])["text"])
    return texts


def button(message: dict[str, Any], action_id: str) -> dict[str, Any]:
    return next(
        e for b in message["blocks"] if b["type"] == "actions" for e in b["elements"] if e["action_id"] == action_id
    )


def test_only_the_owner_terminates_a_machine_ec2_cannot_stop_and_the_button_says_what_is_lost(
    answers: Ec2Answers, slack: FakeSlack, clock: dict[str, datetime]
) -> None:
    init(members=["U0MEMBER"])
    spot = machine("spot")
    ec2_answers.make_spot(spot)
    answers.refuse_stop[spot] = ec2_answers.one_time_spot_stop(spot)
    sweep(T0)
    [notice] = posted_to(slack, spot)
    terminate = button(notice, "terminate_now")
    assert "root volume" in terminate["confirm"]["text"]["text"]
    ref = terminate["value"]
    # A team member may keep it, not terminate it; "Stop now" from an old message is refused without asking EC2.
    assert "Only the owner" in click(slack, "U0MEMBER", "terminate_now", ref)[0]
    assert "cannot stop" in click(slack, "U0SPOT", "stop_now", ref)[0]
    assert answers.stop_calls_naming(spot) == 0 and answers.calls_naming("TerminateInstances", spot) == 0
    assert click(slack, "U0SPOT", "terminate_now", ref) == []
    assert local.instance_states([spot])[spot] == "terminated"
    assert answers.calls_naming("TerminateInstances", spot) == 1
    assert record(spot).state is State.REAPED and record(spot).last_action == "terminate_instance"
    assert "cannot be started again" in json.dumps(slack.calls_to("chat.update")[-1].params["blocks"])


def test_opted_in_termination_warns_terminated_and_terminates_after_the_longer_window(
    answers: Ec2Answers, slack: FakeSlack
) -> None:
    init(terminate_unstoppable_after_minutes=240)
    scratch = machine("scratch", since=at(2))
    local.write_metrics(scratch, lambda _t: (60.0, 0.0), at(2), at(6))  # busy until 06:00, quiet since
    ec2_answers.set_instance(scratch, root_device_type="instance-store")
    answers.refuse_stop[scratch] = ec2_answers.instance_store_stop(scratch)
    # Three and a half hours quiet: far past the team's 60-minute window, not yet at the longer one's warning.
    [d] = sweep(at(9, 30)).decisions
    assert d.state is State.IDLE and "240-min window; warning at 220 min" in d.reason, d.reason
    assert not posted_to(slack, scratch)
    sweep(at(10))
    [warning] = posted_to(slack, scratch)
    assert "will be *terminated* at <!date^" in words(warning) and "can never be started again" in words(warning)
    assert "terminate_now" in buttons(warning) and "stop_now" not in buttons(warning)
    report = sweep(at(10, 25))
    assert local.instance_states([scratch])[scratch] == "terminated"
    assert answers.calls_naming("TerminateInstances", scratch) == 1 and answers.stop_calls_naming(scratch) == 0
    [terminated] = [d for d in report.decisions if d.machine.instance_id == scratch]
    assert terminated.action.value == "terminate_instance" and terminated.saving is not None
    assert terminated.saving.hourly == 0.0  # an instance-store machine's stop would save nothing: none counted
    assert report.summary.teams["ml"].hourly_savings == 0.0


def test_start_again_without_capacity_says_what_happened_and_offers_try_again(
    answers: Ec2Answers, slack: FakeSlack, clock: dict[str, datetime]
) -> None:
    init()
    big = machine("bigtrain", "p5.48xlarge")
    sweep(T0)
    sweep(T0 + timedelta(minutes=25))
    assert local.instance_states([big])[big] == "stopped"
    start = button(slack.calls_to("chat.update")[-1].params, "start_again")
    for answer in (
        ec2_answers.insufficient_capacity("p5.48xlarge"),
        ec2_answers.insufficient_capacity_on_host(),
        ec2_answers.unsupported("p5.48xlarge"),
    ):
        answers.refuse_start[big] = answer
        [reply] = click(slack, "U0BIGTRAIN", "start_again", start["value"])
        assert answer.code in reply and "still stopped" in reply
        update = slack.calls_to("chat.update")[-1].params
        assert "Not started" in words(update) and answer.code in words(update)
        retry = button(update, "start_again")
        assert retry["text"]["text"] == "Try again" and retry["value"] == start["value"]
        assert record(big).state is State.REAPED
    del answers.refuse_start[big]
    clock["t"] = T0 + timedelta(hours=3)
    assert click(slack, "U0BIGTRAIN", "start_again", start["value"]) == []
    assert local.instance_states([big])[big] == "running"
    assert answers.calls_naming("StartInstances", big) == 4  # one StartInstances a click


# ---------------------------------------------------------------------------------------------
# Bad inputs and faults: at most one refused action per machine per idle stretch, no promise of a stop that
# will not happen


def test_a_failed_kind_look_up_holds_the_machine_says_so_once_and_retries_no_storm(
    answers: Ec2Answers, slack: FakeSlack
) -> None:
    init()
    spot, reserved, ordinary = machine("spot"), machine("reserved"), machine("ordinary")
    ec2_answers.make_spot(spot)
    answers.refuse_stop[spot] = ec2_answers.one_time_spot_stop(spot)
    ec2_answers.set_instance(reserved, capacity_reservation_id="cr-0res")
    answers.reservations["cr-0res"] = ec2_answers.capacity_reservation("cr-0res", "m5.large")
    answers.fail["DescribeSpotInstanceRequests"] = ec2_answers.throttled()
    answers.fail["DescribeCapacityReservations"] = ec2_answers.denied("DescribeCapacityReservations")
    for minutes in (0, 5, 10):
        decisions = {d.machine.instance_id: d for d in sweep(T0 + timedelta(minutes=minutes)).decisions}
        for held in (spot, reserved):
            assert decisions[held].state is State.UNKNOWN and decisions[held].action.value == "none"
            assert "not stopped this sweep" in decisions[held].reason
    assert "RequestLimitExceeded" in decisions[spot].reason and "UnauthorizedOperation" in decisions[reserved].reason
    # Nothing said to their owners, nothing asked of EC2 but one look-up a sweep; the admins are told once.
    assert not posted_to(slack, spot) and not posted_to(slack, reserved)
    assert answers.calls["DescribeSpotInstanceRequests"] == answers.calls["DescribeCapacityReservations"] == 3
    [alert] = admin_alerts(slack)
    assert "2 machine(s)" in alert and "RequestLimitExceeded" in alert and "UnauthorizedOperation" in alert
    # The ordinary machine is not held back by them.
    assert decisions[ordinary].state is State.WARNED and len(posted_to(slack, ordinary)) == 1
    # The look-ups work again: each owner is told once, and nothing is ever stopped.
    answers.fail.clear()
    for minutes in (15, 40, 65):
        sweep(T0 + timedelta(minutes=minutes))
    assert len(posted_to(slack, spot)) == len(posted_to(slack, reserved)) == 1
    assert answers.stop_calls_naming(spot) == answers.stop_calls_naming(reserved) == 0
    assert local.instance_states([ordinary])[ordinary] == "stopped"


def test_a_refused_stop_is_asked_once_per_idle_stretch(answers: Ec2Answers, slack: FakeSlack) -> None:
    """A machine the reaper could not tell from an unstoppable one: EC2 refuses the stop. Six hours of
    sweeps ask once, not 47 times, and the machine is not reported stopped."""
    init()
    box = machine("box")
    answers.refuse_stop[box] = ec2_answers.instance_store_stop(box)
    sweep(T0)
    for minutes in range(25, 6 * 60, 30):
        sweep(T0 + timedelta(minutes=minutes))
    assert answers.stop_calls_naming(box) == 1
    kept = record(box)
    assert kept.state is State.WARNED and "EC2 refused it" in kept.reason and "not tried again" in kept.reason
    assert not [c for c in slack.calls_to("chat.update") if "Stopped" in json.dumps(c.params)]
    # Busy again, then idle again: a new stretch may ask once more.
    local.write_metrics(box, lambda _t: (80.0, 0.0), T0 + timedelta(hours=6), T0 + timedelta(hours=6, minutes=10))
    later = T0 + timedelta(hours=6, minutes=10)
    local.write_metrics(box, idle, later, later + timedelta(hours=3))
    for minutes in range(0, 150, 25):
        sweep(later + timedelta(minutes=minutes))
    assert answers.stop_calls_naming(box) == 2


def test_a_reservation_that_ends_mid_window_turns_the_notice_into_a_warning_then_a_stop(
    answers: Ec2Answers, slack: FakeSlack
) -> None:
    init()
    box = machine("reserved")
    ec2_answers.set_instance(box, capacity_reservation_id="cr-0res")
    end = T0 + timedelta(minutes=30)
    answers.reservations["cr-0res"] = ec2_answers.capacity_reservation("cr-0res", "m5.large", end=end)
    sweep(T0)
    sweep(T0 + timedelta(minutes=25))
    [notice] = posted_to(slack, box)
    assert "save nothing" in words(notice) and local.instance_states([box])[box] == "running"
    # From the reservation's end the machine is on-demand: warned afresh (a new promise), then stopped.
    [d] = sweep(end + timedelta(minutes=5)).decisions
    assert d.kind.kind.value == "on-demand" and d.action.value == "warn"
    _, warning = posted_to(slack, box)
    assert "will be *stopped*" in words(warning)
    report = sweep(end + timedelta(minutes=30))
    assert local.instance_states([box])[box] == "stopped" and answers.stop_calls_naming(box) == 1
    assert report.summary.teams["ml"].hourly_savings == 0.096


def test_a_spot_machine_whose_request_is_gone_is_told_once_and_never_stopped(
    answers: Ec2Answers, slack: FakeSlack
) -> None:
    init()
    spot = machine("spot")
    request = ec2_answers.make_spot(spot, request_type="persistent", interruption="stop")
    aws.client("ec2").cancel_spot_instance_requests(SpotInstanceRequestIds=[request])  # moto forgets it
    for minutes in (0, 25, 50, 75):
        sweep(T0 + timedelta(minutes=minutes))
    [notice] = posted_to(slack, spot)
    assert request in words(notice) and "cannot be found" in words(notice)
    assert "terminate_now" not in buttons(notice) and "stop_now" not in buttons(notice)
    assert answers.stop_calls_naming(spot) == 0 and local.instance_states([spot])[spot] == "running"


@pytest.mark.usefixtures("aws")
def test_the_local_worlds_capacity_reservation_is_described_as_ec2_describes_it(moto_server: Any) -> None:
    """What the demo's reserved machine runs on (local.reserve: moto has no capacity reservations): DescribeInstances
    names the reservation, DescribeCapacityReservations describes it (its one slot taken), and the sweep's look-up
    reads it; an id the account does not have fails the call with EC2's InvalidCapacityReservationId.NotFound, which
    the look-up splits off (not billing), and a reset forgets the reservation with the rest of the account."""
    box = machine("reserved")
    reservation = local.reserve(box, created=T0 - timedelta(days=1))
    ec2 = aws.client("ec2")
    [listed] = ec2.describe_instances(InstanceIds=[box])["Reservations"][0]["Instances"]
    assert listed["CapacityReservationId"] == reservation
    [item] = ec2.describe_capacity_reservations(CapacityReservationIds=[reservation])["CapacityReservations"]
    assert (item["InstanceType"], item["State"], item["TotalInstanceCount"], item["AvailableInstanceCount"]) == (
        "m5.large",
        "active",
        1,
        0,
    )
    with pytest.raises(ClientError) as refused:
        ec2.describe_capacity_reservations(CapacityReservationIds=[reservation, "cr-0123456789abcdef0"])
    assert refused.value.response["Error"]["Code"] == "InvalidCapacityReservationId.NotFound"
    fleet = adapters_at(T0).fleet
    [found] = [m for m in fleet.discover(Settings().tags) if m.instance_id == box]
    gone = replace(found, facts=replace(found.facts, reservation_id="cr-0123456789abcdef0"))
    lookups = fleet.kind_lookups([found, gone])
    assert set(lookups.reservations) == {reservation} and not lookups.failed
    moto_server.reset()
    assert ec2.describe_capacity_reservations()["CapacityReservations"] == []
