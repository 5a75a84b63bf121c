"""What kind of machine this is (from EC2's own answer shapes), what a stop saves, and what a team's policy
makes of it. Pure: no AWS."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from test_core import NOW as CORE_NOW
from test_core import machine, quiet_assessment, warned_record

from idle_reaper.core import Action, State, decide, kind_policy, owner_message_groups
from idle_reaper.core.dollars import of_kind
from idle_reaper.core.kinds import (
    InstanceFacts,
    Kind,
    Lookups,
    Reservation,
    SpotRequest,
    classify,
    handling,
    notice_sentence,
    warning_sentence,
)
from idle_reaper.policy import PolicyError, TeamPolicy, TeamPolicyRef, parse_team_policy
from idle_reaper.slack import owner_warning_line
from testkit import ec2_answers

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def instance(**item: Any) -> dict[str, Any]:
    """A DescribeInstances item, as botocore parses it."""
    return {"InstanceId": "i-0abc", "InstanceType": "m5.large", "RootDeviceType": "ebs", **item}


def spot_request(request_id: str = "sir-1", **item: Any) -> dict[str, Any]:
    """A DescribeSpotInstanceRequests item (a one-time request by default)."""
    return {**ec2_answers.spot_request(request_id, "i-0abc"), **item}


def reservation(reservation_id: str = "cr-1", **item: Any) -> dict[str, Any]:
    """A DescribeCapacityReservations item (an open-ended p5 reservation by default)."""
    return {**ec2_answers.capacity_reservation(reservation_id, "p5.48xlarge", total=2, available=1), **item}


def kind_of(item: dict[str, Any], tags: dict[str, str] | None = None, *, spot=(), reservations=(), failed=None):
    facts = InstanceFacts.of(item, tags or {})
    lookups = Lookups(
        spot_requests={r["SpotInstanceRequestId"]: SpotRequest.of(r) for r in spot},
        reservations={r["CapacityReservationId"]: Reservation.of(r) for r in reservations},
        failed=failed or {},
    )
    return classify(facts, lookups, NOW)


class TestKind:
    def test_an_ordinary_machine_is_stoppable_and_saves_its_price(self):
        k = kind_of(instance())
        assert (k.kind, k.can_stop, k.saves) == (Kind.ON_DEMAND, True, "price")
        assert of_kind(k, 0.096).stop.text() == "$0.10/h"

    def test_one_time_spot_cannot_be_stopped_only_terminated(self):
        k = kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[spot_request()])
        assert (k.kind, k.can_stop, k.can_terminate) == (Kind.SPOT_ONE_TIME, False, True)
        assert "sir-1" in k.why and "root volume" in k.loses

    @pytest.mark.parametrize("behaviour", ["stop", "hibernate"])
    def test_persistent_spot_that_stops_or_hibernates_is_stopped_as_today(self, behaviour):
        req = spot_request(Type="persistent", InstanceInterruptionBehavior=behaviour, SpotPrice="0.05")
        k = kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[req])
        assert (k.kind, k.can_stop) == (Kind.SPOT, True)
        # The Spot price is not read: its maximum price (lower than on-demand here) bounds what a stop saves.
        saving = of_kind(k, 0.096).stop
        assert (saving.hourly, saving.upper_bound, saving.text()) == (0.05, True, "at most $0.05/h")
        assert of_kind(k, None).stop.hourly == 0.05

    def test_a_disabled_persistent_request_still_stands_behind_its_instance(self):
        req = spot_request(Type="persistent", InstanceInterruptionBehavior="stop", State="disabled")
        assert kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[req]).can_stop

    def test_persistent_spot_that_terminates_would_relaunch(self):
        req = spot_request(Type="persistent", InstanceInterruptionBehavior="terminate")
        k = kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[req])
        assert (k.kind, k.can_stop, k.can_terminate) == (Kind.SPOT_RELAUNCHING, False, False)

    def test_a_cancelled_persistent_request_leaves_a_machine_only_terminate_can_end(self):
        req = spot_request(Type="persistent", InstanceInterruptionBehavior="stop", State="cancelled")
        k = kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[req])
        assert (k.kind, k.can_stop, k.can_terminate) == (Kind.SPOT_ONE_TIME, False, True)

    def test_a_spot_request_that_no_longer_exists_is_never_stoppable(self):
        k = kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-gone"))
        assert (k.kind, k.can_stop, k.can_terminate) == (Kind.SPOT_REQUEST_GONE, False, False)
        assert "sir-gone" in k.why

    def test_instance_store_root_cannot_be_stopped(self):
        k = kind_of(instance(RootDeviceType="instance-store"))
        assert (k.kind, k.can_stop, k.can_terminate) == (Kind.INSTANCE_STORE, False, True)
        assert of_kind(k, 1.0).stop.hourly == 0.0

    @pytest.mark.parametrize(
        ("tag", "words"), [("aws:ec2:fleet-id", "EC2 Fleet fleet-9"), ("aws:ec2spot:fleet-request-id", "Spot Fleet")]
    )
    def test_a_fleet_member_is_never_stopped_whatever_else_it_is(self, tag, words):
        item = instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1")
        k = kind_of(item, {tag: "fleet-9"}, failed={"sir-1": "Throttling"})
        assert (k.kind, k.can_stop, k.can_terminate, k.saves) == (Kind.FLEET, False, False, "nothing")
        assert words in k.why

    @pytest.mark.parametrize(
        ("item", "failed_id"),
        [
            (instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), "sir-1"),
            (instance(CapacityReservationId="cr-1"), "cr-1"),
        ],
    )
    def test_a_failed_look_up_is_unknown_and_never_stoppable(self, item, failed_id):
        k = kind_of(item, failed={failed_id: "RequestLimitExceeded"})
        assert (k.kind, k.can_stop, k.can_terminate) == (Kind.UNKNOWN, False, False)
        assert "RequestLimitExceeded" in k.why
        assert handling(k, "m5.large", TeamPolicy()).mode == "hold"

    def test_a_machine_in_a_reservation_saves_nothing_until_the_reservation_ends(self):
        end = NOW + timedelta(hours=3)
        item = instance(InstanceType="p5.48xlarge", CapacityReservationId="cr-1")
        k = kind_of(item, reservations=[reservation(EndDate=end, EndDateType="limited")])
        assert (k.kind, k.saves, k.can_stop) == (Kind.RESERVED, "nothing", True)
        assert "2026-11-25 15:00 UTC" in k.why
        assert of_kind(k, 98.32).stop.hourly == 0.0
        ended = classify(
            InstanceFacts.of(item, {}), Lookups(reservations={"cr-1": Reservation.of(reservation(EndDate=end))}), end
        )
        assert (ended.kind, ended.saves) == (Kind.ON_DEMAND, "price")

    def test_a_capacity_block_is_named_as_one(self):
        item = instance(InstanceLifecycle="capacity-block", CapacityReservationId="cr-b")
        block = reservation("cr-b", ReservationType="capacity-block", EndDate=NOW + timedelta(days=2))
        k = kind_of(item, reservations=[block])
        assert (k.kind, k.saves) == (Kind.CAPACITY_BLOCK, "nothing")
        assert "Capacity Block cr-b" in k.why

    @pytest.mark.parametrize("state", ["expired", "cancelled", "pending"])
    def test_a_reservation_that_does_not_bill_now_changes_nothing(self, state):
        k = kind_of(instance(CapacityReservationId="cr-1"), reservations=[reservation(State=state)])
        assert k.kind is Kind.ON_DEMAND

    def test_a_reservation_not_listed_any_more_is_treated_as_ended(self):
        assert kind_of(instance(CapacityReservationId="cr-gone")).kind is Kind.ON_DEMAND

    def test_unreadable_spot_price_is_no_price(self):
        assert SpotRequest.of(spot_request(SpotPrice="n/a")).max_price is None


class TestHandling:
    def one_time(self):
        return kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[spot_request()])

    def test_unstoppable_machines_are_told_by_default_and_terminated_only_when_opted_in(self):
        k = self.one_time()
        assert handling(k, "g5.xlarge", TeamPolicy()).mode == "notify"
        opted = handling(k, "g5.xlarge", TeamPolicy(idle_minutes=90, terminate_unstoppable_after_minutes=480))
        assert (opted.mode, opted.idle_minutes) == ("terminate", 480)

    def test_relaunching_spot_and_fleets_are_never_terminated_even_when_opted_in(self):
        policy = TeamPolicy(terminate_unstoppable_after_minutes=480)
        req = spot_request(Type="persistent")
        relaunching = kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[req])
        fleet = kind_of(instance(), {"aws:ec2:fleet-id": "fleet-1"})
        assert handling(relaunching, "m5.large", policy).mode == "notify"
        how = handling(fleet, "m5.large", policy)
        assert (how.mode, how.tell_admins) == ("notify", True)

    def test_reserved_machines_are_told_to_owner_and_admins_unless_the_policy_stops_them(self):
        k = kind_of(instance(CapacityReservationId="cr-1"), reservations=[reservation()])
        assert (
            handling(k, "p5.48xlarge", TeamPolicy()).mode,
            handling(k, "p5.48xlarge", TeamPolicy()).tell_admins,
        ) == (
            "notify",
            True,
        )
        stopped = handling(k, "p5.48xlarge", TeamPolicy(reserved_capacity_action="stop"))
        assert (stopped.mode, stopped.tell_admins) == ("stop", False)

    def test_an_unstoppable_reserved_machine_is_not_stopped_even_when_the_policy_says_stop(self):
        k = kind_of(
            instance(RootDeviceType="instance-store", CapacityReservationId="cr-1"), reservations=[reservation()]
        )
        assert handling(k, "p5.48xlarge", TeamPolicy(reserved_capacity_action="stop")).mode == "notify"

    def test_scarce_families_get_their_words_their_window_or_notify_only(self):
        k = kind_of(instance(InstanceType="p5.48xlarge"))
        how = handling(k, "p5.48xlarge", TeamPolicy())
        assert (how.mode, how.scarce, how.idle_minutes) == ("stop", True, 90)
        assert "may not start again" in warning_sentence(k, how, "p5.48xlarge", "15:00", reaped_verb="stopped")
        own = handling(k, "p5.48xlarge", TeamPolicy(scarce_idle_minutes=240))
        assert (own.mode, own.idle_minutes) == ("stop", 240)
        only = handling(k, "p5.48xlarge", TeamPolicy(scarce_action="notify_only"))
        assert only.mode == "notify"
        assert not handling(k, "m5.large", TeamPolicy()).scarce
        assert not handling(k, "p5.48xlarge", TeamPolicy(scarce_families=("p4d",))).scarce


class TestWords:
    @pytest.mark.parametrize(
        "case",
        ["one_time", "instance_store", "fleet", "reserved", "relaunching", "gone"],
    )
    def test_a_notice_never_promises_a_stop(self, case):
        items = {
            "one_time": (instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), {}),
            "instance_store": (instance(RootDeviceType="instance-store"), {}),
            "fleet": (instance(), {"aws:ec2:fleet-id": "fleet-1"}),
            "reserved": (instance(CapacityReservationId="cr-1"), {}),
            "relaunching": (instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-2"), {}),
            "gone": (instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-x"), {}),
        }
        item, tags = items[case]
        k = kind_of(
            item,
            tags,
            spot=[spot_request(), spot_request("sir-2", Type="persistent")],
            reservations=[reservation(EndDate=NOW + timedelta(hours=5))],
        )
        how = handling(k, "m5.large", TeamPolicy())
        assert how.mode == "notify"
        text = warning_sentence(k, how, "m5.large", "15:00", reaped_verb="stopped")
        assert text == notice_sentence(k, how, "m5.large")
        assert "will be" not in text and "stopped at" not in text

    def test_the_terminate_warning_says_what_is_lost(self):
        k = kind_of(instance(RootDeviceType="instance-store"))
        how = handling(k, "m5.large", TeamPolicy(terminate_unstoppable_after_minutes=480))
        text = warning_sentence(k, how, "m5.large", "20:00", reaped_verb="stopped")
        assert text.startswith("It will be *terminated* at 20:00") and "can never be started again" in text

    def test_the_reservation_notice_gives_its_end(self):
        k = kind_of(
            instance(CapacityReservationId="cr-1"), reservations=[reservation(EndDate=NOW + timedelta(hours=5))]
        )
        text = notice_sentence(k, handling(k, "p5.48xlarge", TeamPolicy()), "p5.48xlarge")
        assert "capacity reservation cr-1" in text and "2026-11-25 17:00 UTC" in text and "save nothing" in text

    def test_a_capacity_block_notice_never_advises_releasing_it(self):
        """Issue 44, item 9: AWS does not allow a Capacity Block to be modified or cancelled
        (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-capacity-blocks.html)."""
        block = reservation("cr-b", ReservationType="capacity-block", EndDate=NOW + timedelta(hours=5))
        k = kind_of(instance(InstanceLifecycle="capacity-block", CapacityReservationId="cr-b"), reservations=[block])
        text = notice_sentence(k, handling(k, "p5.48xlarge", TeamPolicy()), "p5.48xlarge")
        assert "Capacity Block cr-b" in text and "release" not in text and "cancel it" not in text
        assert "does not allow a Capacity Block to be modified or cancelled" in text

    def test_a_reservation_whose_other_slots_are_used_is_not_called_idle(self):
        """Issue 44, item 9: TotalInstanceCount and AvailableInstanceCount say whether other machines use it."""
        busy = reservation(TotalInstanceCount=4, AvailableInstanceCount=0)  # this machine and three others run in it
        k = kind_of(instance(CapacityReservationId="cr-1"), reservations=[busy])
        text = notice_sentence(k, handling(k, "p5.48xlarge", TeamPolicy()), "p5.48xlarge")
        assert "and so is its" not in text and "release the reservation" not in text
        assert "3 of its other 3 slots are in use" in text
        alone = reservation(TotalInstanceCount=3, AvailableInstanceCount=2)  # only this machine runs in it
        k = kind_of(instance(CapacityReservationId="cr-1"), reservations=[alone])
        text = notice_sentence(k, handling(k, "p5.48xlarge", TeamPolicy()), "p5.48xlarge")
        assert "and so is its capacity reservation cr-1 (2 more of its slots unused)" in text
        assert "release the reservation" in text


class TestPolicyFields:
    def test_termination_must_wait_longer_than_a_stop(self):
        with pytest.raises(PolicyError) as err:
            parse_team_policy(
                "/p", json.dumps({"idle_minutes": 120, "terminate_unstoppable_after_minutes": 90}), TeamPolicy()
            )
        assert "terminate_unstoppable_after_minutes (90) must be longer than idle_minutes (120)" in str(err.value)

    def test_scarce_window_must_leave_time_to_warn(self):
        with pytest.raises(PolicyError) as err:
            parse_team_policy("/p", json.dumps({"warn_minutes": 30, "scarce_idle_minutes": 20}), TeamPolicy())
        assert "scarce_idle_minutes" in str(err.value)

    def test_bad_values_are_refused(self):
        with pytest.raises(PolicyError):
            parse_team_policy("/p", json.dumps({"reserved_capacity_action": "terminate"}), TeamPolicy())
        with pytest.raises(PolicyError):
            parse_team_policy("/p", json.dumps({"scarce_families": ["P5!"]}), TeamPolicy())

    def test_defaults_change_nothing_for_an_ordinary_machine(self):
        policy = TeamPolicy()
        assert policy.terminate_unstoppable_after_minutes is None
        assert policy.reserved_capacity_action == "notify"
        assert "p5" in policy.scarce_families and "g5" not in policy.scarce_families


class TestDecideByKind:
    """core.decide with a kind: a notice instead of a stop, termination on opt-in, a failed look-up holds, a
    kind change warns afresh, quiet hours hold what nobody would read, a refused action is asked once."""

    @staticmethod
    def one_time():
        return kind_of(instance(InstanceLifecycle="spot", SpotInstanceRequestId="sir-1"), spot=[spot_request()])

    @staticmethod
    def ref(**fields: Any) -> TeamPolicyRef:
        return TeamPolicyRef(team="ml", policy=TeamPolicy(**fields), source="/idle-reaper/teams/ml", version=3)

    def test_a_machine_ec2_cannot_stop_is_told_once_and_never_stopped(self):
        kind = self.one_time()
        d = decide(machine(), self.ref(), quiet_assessment(65), None, now=CORE_NOW, kind=kind)
        assert (d.state, d.action, d.notify) == (State.WARNED, Action.WARN, "warning")
        assert "not stopped: a one-time Spot instance" in d.reason and d.record.stop_not_before is None
        assert d.record.machine_kind == "spot-one-time"
        record = replace(d.record, warning_delivered_at=CORE_NOW)
        for minutes in (30, 60, 120, 180, 240):
            later = decide(
                machine(),
                self.ref(),
                quiet_assessment(65 + minutes),
                record,
                now=CORE_NOW + timedelta(minutes=minutes),
                kind=kind,
            )
            assert (later.state, later.action, later.deliver_warning) == (State.WARNED, Action.NONE, False), (
                later.reason
            )
            assert later.reason.startswith("told at")
            record = later.record

    def test_opted_in_termination_uses_the_longer_window_and_terminates(self):
        kind = self.one_time()
        ref = kind_policy(self.ref(terminate_unstoppable_after_minutes=180), kind, machine())
        assert ref.policy is not None and ref.policy.idle_minutes == 180
        d = decide(machine(), ref, quiet_assessment(65), None, now=CORE_NOW, kind=kind)
        assert (d.state, d.action) == (State.IDLE, Action.NONE) and "warning at 150 min" in d.reason
        warned = decide(machine(), ref, quiet_assessment(155), None, now=CORE_NOW, kind=kind)
        assert warned.action is Action.WARN and "will terminate it" in warned.reason and "root volume" in warned.reason

    def test_a_failed_look_up_holds_without_a_message(self):
        kind = kind_of(instance(CapacityReservationId="cr-1"), failed={"cr-1": "Throttling"})
        d = decide(machine(), self.ref(), quiet_assessment(120), None, now=CORE_NOW, kind=kind)
        assert (d.state, d.action, d.notify, d.deliver_warning) == (State.UNKNOWN, Action.NONE, None, False)
        assert d.record.machine_kind == ""  # the last kind known stays (none yet)

    def test_a_kind_change_after_a_warning_warns_afresh(self):
        reserved = kind_of(instance(CapacityReservationId="cr-1"), reservations=[reservation()])
        d = decide(machine(), self.ref(), quiet_assessment(65), None, now=CORE_NOW, kind=reserved)
        assert d.action is Action.WARN and d.record.machine_kind == "capacity-reservation"
        later = CORE_NOW + timedelta(minutes=10)
        record = replace(d.record, warning_delivered_at=CORE_NOW)
        d2 = decide(machine(), self.ref(), quiet_assessment(75), record, now=later, kind=kind_of(instance()))
        assert d2.action is Action.WARN and "will stop it" in d2.reason and d2.record.warned_at == later

    def test_quiet_hours_hold_a_notice_until_someone_can_read_it(self):
        d = decide(
            machine(), self.ref(quiet_hours=True), quiet_assessment(65), None, now=CORE_NOW, kind=self.one_time()
        )
        assert (d.state, d.action, d.record.warned_at) == (State.IDLE, Action.NONE, None)
        assert "waits until quiet hours end" in d.reason

    def test_an_action_ec2_refused_is_not_asked_again_this_stretch(self):
        record = warned_record(
            timedelta(minutes=60),
            machine_kind="on-demand",
            last_action="stop_failed",
            action_refused_at=CORE_NOW - timedelta(minutes=30),
        )
        d = decide(machine(), self.ref(), quiet_assessment(150), record, now=CORE_NOW)
        assert (d.state, d.action) == (State.WARNED, Action.NONE)
        assert "EC2 refused it" in d.reason and "not tried again" in d.reason
        fresh = replace(record, action_refused_at=None)
        assert decide(machine(), self.ref(), quiet_assessment(150), fresh, now=CORE_NOW).action is Action.STOP

    def test_termination_never_follows_a_warning_nobody_received(self):
        kind = kind_of(instance(RootDeviceType="instance-store"))
        ref = kind_policy(self.ref(terminate_unstoppable_after_minutes=180), kind, machine())
        undelivered = warned_record(timedelta(minutes=300), warning_delivered_at=None, machine_kind="instance-store")
        d = decide(machine(), ref, quiet_assessment(480), undelivered, now=CORE_NOW, kind=kind)
        assert d.action is Action.NONE and "not delivered yet" in d.reason
        # An ordinary machine's stop does follow after undelivered_warning_max_minutes (240).
        ordinary = replace(undelivered, machine_kind="on-demand")
        assert decide(machine(), self.ref(), quiet_assessment(480), ordinary, now=CORE_NOW).action is Action.STOP

    def test_a_scarce_machine_in_its_owners_shared_message_keeps_its_capacity_note(self):
        kind = kind_of(instance(InstanceType="p5.48xlarge"))
        p5 = machine(instance_type="p5.48xlarge", owner="U0BOB")
        other = machine(instance_id="i-2", owner="U0BOB")
        decisions = [
            decide(p5, self.ref(), quiet_assessment(65), None, now=CORE_NOW, kind=kind),
            decide(other, self.ref(), quiet_assessment(65), None, now=CORE_NOW),
        ]
        [group] = owner_message_groups(decisions)  # both are stops: one message
        line = owner_warning_line(group[0], CORE_NOW)
        assert "P5 capacity is scarce" in line and "InsufficientInstanceCapacity" in line
        assert "scarce" not in owner_warning_line(group[1], CORE_NOW)
        notice = decide(other, self.ref(), quiet_assessment(65), None, now=CORE_NOW, kind=self.one_time())
        assert len(owner_message_groups([decisions[0], notice])) == 2  # a notice has a message of its own
