"""What kind each machine is, read in bulk by the real adapter over the in-memory FakeEC2 (which answers as EC2
does: it refuses to stop a one-time Spot or an instance-store machine), and a sweep of a mixed fleet at scale.
Fast, no network."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from idle_reaper.aws import Fleet
from idle_reaper.core.kinds import Kind
from idle_reaper.policy import Settings
from idle_reaper.sweep import run_sweep
from testkit.aws import CountingStateStore, FakeAws, steady
from testkit.ec2_answers import capacity_reservation

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
DAY_AGO = NOW - timedelta(days=1)


def account(policy: str = '{"idle_minutes": 90, "warn_minutes": 30}') -> FakeAws:
    aws = FakeAws()
    aws.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    aws.ssm.store("/idle-reaper/teams/ml", policy)
    return aws


def launch(aws: FakeAws, n: int, **tags: str) -> list[str]:
    return [
        aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=DAY_AGO, owner=f"U0{i}", tags=tags or None)
        for i in range(n)
    ]


def test_look_ups_are_batched_and_asked_only_for_the_machines_that_need_them() -> None:
    aws = account()
    ordinary = launch(aws, 300)
    spot = launch(aws, 450)
    for instance_id in spot:
        aws.ec2.make_spot(instance_id)
    reserved = launch(aws, 150)
    for i, instance_id in enumerate(reserved):
        aws.ec2.make_kind(instance_id, reservation_id=f"cr-{i:04d}")
        aws.ec2.reservations[f"cr-{i:04d}"] = capacity_reservation(f"cr-{i:04d}", "m5.large")
    fleet_members = launch(aws, 50, **{"aws:ec2:fleet-id": "fleet-1"})
    fleet = Fleet(aws.ec2, aws.autoscaling)
    machines = fleet.discover(Settings().tags)
    lookups = fleet.kind_lookups(machines)
    # 450 Spot requests: 3 filtered calls of at most 200; 150 reservations: 2 calls of at most 100. The 300
    # ordinary machines and the fleet members cost nothing.
    assert aws.ec2.calls["DescribeSpotInstanceRequests"] == 3
    assert aws.ec2.calls["DescribeCapacityReservations"] == 2
    assert all(len(r["Filters"][0]["Values"]) <= 200 for r in aws.ec2.requests_of("DescribeSpotInstanceRequests"))
    assert len(lookups.spot_requests) == 450 and len(lookups.reservations) == 150 and not lookups.failed
    assert not {m.instance_id for m in machines} - {*ordinary, *spot, *reserved, *fleet_members}


def test_a_reservation_ec2_no_longer_knows_is_split_out_not_failed() -> None:
    aws = account()
    boxes = launch(aws, 8)
    for i, instance_id in enumerate(boxes):
        aws.ec2.make_kind(instance_id, reservation_id=f"cr-{i}")
        if i != 5:
            aws.ec2.reservations[f"cr-{i}"] = capacity_reservation(f"cr-{i}", "m5.large")
    fleet = Fleet(aws.ec2, aws.autoscaling)
    lookups = fleet.kind_lookups(fleet.discover(Settings().tags))
    assert set(lookups.reservations) == {f"cr-{i}" for i in range(8)} - {"cr-5"} and not lookups.failed
    assert aws.ec2.errors[("DescribeCapacityReservations", "InvalidCapacityReservationId.NotFound")] == 4  # 8,4,2,1


def test_a_failed_batch_marks_only_its_ids_failed() -> None:
    aws = account()
    spot = launch(aws, 250)
    for instance_id in spot:
        aws.ec2.make_spot(instance_id)
    aws.ec2.inject("DescribeSpotInstanceRequests", "RequestLimitExceeded", on_calls=[1])
    fleet = Fleet(aws.ec2, aws.autoscaling)
    lookups = fleet.kind_lookups(fleet.discover(Settings().tags))
    assert len(lookups.failed) + len(lookups.spot_requests) == 250
    assert set(lookups.failed.values()) == {"RequestLimitExceeded"} and len(lookups.failed) in (50, 200)


def test_a_mixed_fleet_sweep_never_asks_ec2_to_stop_what_it_cannot_and_terminates_only_on_opt_in() -> None:
    aws = account('{"idle_minutes": 90, "warn_minutes": 30, "terminate_unstoppable_after_minutes": 120}')
    ordinary = launch(aws, 40)
    one_time = launch(aws, 40)
    persistent = launch(aws, 40)
    for instance_id in one_time:
        aws.ec2.make_spot(instance_id)
    for instance_id in persistent:
        aws.ec2.make_spot(instance_id, request_type="persistent", interruption="hibernate", price="0.02")
    members = launch(aws, 20, **{"aws:ec2spot:fleet-request-id": "sfr-1"})
    store = CountingStateStore()
    reports = [
        run_sweep(aws.adapters(store=store), now=NOW + timedelta(minutes=minutes)) for minutes in range(0, 121, 10)
    ]
    stopped = {i for r in aws.ec2.requests_of("StopInstances") for i in r["InstanceIds"]}
    terminated = {i for r in aws.ec2.requests_of("TerminateInstances") for i in r["InstanceIds"]}
    assert stopped == {*ordinary, *persistent}  # EC2 refused nothing: nothing it would refuse was asked
    assert terminated == set(one_time)  # after the longer window, opted in
    assert not aws.ec2.errors
    assert {aws.ec2.state_of(i) for i in members} == {"running"}
    # The persistent Spot machines save at most their maximum price ($0.02), not the on-demand $0.096.
    saved = sum(r.summary.teams["ml"].hourly_savings for r in reports)
    assert round(saved, 2) == round(40 * 0.096 + 40 * 0.02, 2)
    kinds = {d.kind.kind for r in reports for d in r.decisions}
    assert kinds == {Kind.ON_DEMAND, Kind.SPOT, Kind.SPOT_ONE_TIME, Kind.FLEET}


def test_persistent_spot_hibernates_where_the_policy_asks_and_the_machine_can_and_one_time_spot_never() -> None:
    aws = account('{"idle_minutes": 90, "warn_minutes": 30, "action": "hibernate"}')
    configured, plain, one_time = (
        aws.launch("m5.large", team="ml", profile=steady(1.0), launch_time=DAY_AGO, owner=f"U0{n}", hibernation=h)
        for n, h in ((1, True), (2, False), (3, True))
    )
    aws.ec2.make_spot(configured, request_type="persistent", interruption="hibernate")
    aws.ec2.make_spot(plain, request_type="persistent", interruption="stop")
    aws.ec2.make_spot(one_time)
    store = CountingStateStore()
    for minutes in range(0, 121, 10):
        run_sweep(aws.adapters(store=store), now=NOW + timedelta(minutes=minutes))
    calls = aws.ec2.requests_of("StopInstances")
    assert {(tuple(c["InstanceIds"]), c["Hibernate"]) for c in calls} == {((configured,), True), ((plain,), False)}
    assert aws.ec2.hibernated == {configured} and aws.ec2.state_of(one_time) == "running"
    assert not aws.ec2.errors  # nothing EC2 would refuse (UnsupportedOperation) was asked
