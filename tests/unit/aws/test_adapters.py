"""The AWS adapters (idle_reaper.aws) over the in-memory fakes: batching, bisection, pagination and
the failure modes a sweep must survive. Fast, no network."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import NoReturn

import boto3
import pytest
from botocore.exceptions import ClientError

from idle_reaper.aws import Fleet, MetricsReader, PolicyStore
from idle_reaper.aws import fleet as fleet_module
from idle_reaper.aws.clients import ProcessFailed, client, error_code, for_this_process, run_in_processes
from idle_reaper.aws.fleet import ID_PARTS, ListingIncomplete, partition_errors
from idle_reaper.core import assess
from idle_reaper.policy import DEFAULT_GPU_FAMILIES, MetricSettings, PolicyError, Settings, TagKeys
from testkit.aws import FakeAws, client_error, steady
from testkit.aws.fleet import ZONES, filter_value_matcher

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
DAY_AGO = NOW - timedelta(days=1)
PREFIX = "/idle-reaper"


@pytest.fixture
def aws() -> FakeAws:
    return FakeAws()


def launch_many(aws: FakeAws, n: int, instance_type: str = "m5.large", **kw) -> list[str]:
    kw.setdefault("team", "ml")
    kw.setdefault("profile", steady(1.0))
    return [aws.launch(instance_type, launch_time=DAY_AGO, **kw) for _ in range(n)]


def fleet(aws: FakeAws) -> Fleet:
    return Fleet(aws.ec2, aws.autoscaling)


def id_values(request: dict) -> list[str] | None:
    """The instance-id filter's values of a DescribeInstances request (None: no such filter)."""
    return next((list(f["Values"]) for f in request["Filters"] if f["Name"] == "instance-id"), None)


def in_zone(zone: str) -> Callable[[dict], bool]:
    """Whether a DescribeInstances request lists the zone `zone`."""
    return lambda request: any(
        f["Name"] == "availability-zone" and f["Values"] == [zone] for f in request.get("Filters", ())
    )


def refuse(
    aws: FakeAws,
    monkeypatch: pytest.MonkeyPatch,
    when: Callable[[dict], bool],
    refusal: Callable[[], NoReturn] | None = None,
) -> None:
    """DescribeInstances refuses the requests `when` picks (RequestLimitExceeded, or `refusal()`: a child killed,
    say) and answers the others as ever."""
    listed = aws.ec2.describe_instances

    def describe(**request):
        if when(request):
            if refusal is not None:
                refusal()
            raise client_error("DescribeInstances", "RequestLimitExceeded")
        return listed(**request)

    monkeypatch.setattr(aws.ec2, "describe_instances", describe)


def stop_sizes(aws: FakeAws) -> list[int]:
    return [len(r["InstanceIds"]) for r in aws.ec2.requests_of("StopInstances")]


# ---------------------------------------------------------------------------------------------
# StopInstances: bisect on failure, hibernate with fallback


class TestStop:
    def test_one_good_batch_is_one_call(self, aws):
        ids = launch_many(aws, 10)
        outcomes = fleet(aws).stop(ids, hibernate=False)
        assert [o.error for o in outcomes] == [None] * 10
        assert stop_sizes(aws) == [10]
        assert {aws.ec2.state_of(i) for i in ids} == {"stopped"}

    def test_one_bad_id_among_ten_is_bisected_out(self, aws):
        ids = launch_many(aws, 10)
        bad = ids[7]
        aws.ec2.instances[bad].set_state("shutting-down")  # terminated by its owner after discovery

        outcomes = {o.instance_id: o.error for o in fleet(aws).stop(ids, hibernate=False)}

        assert set(outcomes) == set(ids)
        assert outcomes[bad] is not None and outcomes[bad].startswith("IncorrectInstanceState")
        assert all(outcomes[i] is None for i in ids if i != bad)
        assert all(aws.ec2.state_of(i) == "stopped" for i in ids if i != bad)
        # 10 fails -> [0:5] ok, [5:10] fails -> [5:7] ok, [7:10] fails -> [7] fails, [8:10] ok
        assert sorted(stop_sizes(aws)) == sorted([10, 5, 5, 2, 3, 1, 2])  # halves run concurrently
        assert aws.ec2.calls["StopInstances"] == 7

    @pytest.mark.parametrize("position", range(10))
    def test_bisection_is_logarithmic_wherever_the_bad_id_is(self, aws, position):
        ids = launch_many(aws, 10)
        aws.ec2.fail_stop[ids[position]] = "UnsupportedOperation"
        outcomes = {o.instance_id: o.error for o in fleet(aws).stop(ids, hibernate=False)}
        assert [i for i, e in outcomes.items() if e] == [ids[position]]
        assert "UnsupportedOperation" in (outcomes[ids[position]] or "")
        assert sum(aws.ec2.state_of(i) == "stopped" for i in ids) == 9
        assert aws.ec2.calls["StopInstances"] <= 1 + 2 * math.ceil(math.log2(10))

    def test_two_bad_ids_do_not_block_the_other_eight(self, aws):
        ids = launch_many(aws, 10)
        aws.ec2.forget(ids[2])  # gone: InvalidInstanceID.NotFound
        aws.ec2.fail_stop[ids[8]] = "IncorrectInstanceState"
        outcomes = {o.instance_id: o.error for o in fleet(aws).stop(ids, hibernate=False)}
        assert "InvalidInstanceID.NotFound" in (outcomes[ids[2]] or "")
        assert "IncorrectInstanceState" in (outcomes[ids[8]] or "")
        assert [i for i in ids if aws.ec2.state_of(i) == "stopped"] == [i for i in ids if i not in (ids[2], ids[8])]

    def test_no_ids_no_call(self, aws):
        assert fleet(aws).stop([], hibernate=True) == []
        assert aws.ec2.calls["StopInstances"] == 0

    def test_hibernate_when_supported(self, aws):
        ids = launch_many(aws, 3, hibernation=True)
        outcomes = fleet(aws).stop(ids, hibernate=True)
        assert [o.error for o in outcomes] == [None] * 3
        assert aws.ec2.hibernated == set(ids)
        assert [r["Hibernate"] for r in aws.ec2.requests_of("StopInstances")] == [True]

    def test_hibernate_falls_back_to_plain_stop_on_unsupported_configuration(self, aws):
        [box] = launch_many(aws, 1, hibernation=True)
        aws.ec2.unhibernatable.add(box)  # configured, but EC2 answers UnsupportedHibernationConfiguration
        [outcome] = fleet(aws).stop([box], hibernate=True)
        assert outcome.error is None
        assert aws.ec2.state_of(box) == "stopped"
        assert box not in aws.ec2.hibernated
        assert [r["Hibernate"] for r in aws.ec2.requests_of("StopInstances")] == [True, False]

    def test_hibernation_fallback_applies_only_to_the_machine_that_cannot_hibernate(self, aws):
        # BUG (aws.py Fleet.stop): on UnsupportedHibernationConfiguration the WHOLE batch is retried
        # with Hibernate=False, so one machine that cannot hibernate makes every other machine in the
        # batch lose its memory (notebook kernels, in-RAM state) to a plain stop. The fallback should
        # apply to the failing machine alone (bisect with hibernation first, plain stop at size 1).
        ids = launch_many(aws, 4, hibernation=True)
        aws.ec2.unhibernatable.add(ids[1])
        outcomes = fleet(aws).stop(ids, hibernate=True)
        assert [o.error for o in outcomes] == [None] * 4
        assert {aws.ec2.state_of(i) for i in ids} == {"stopped"}
        assert aws.ec2.hibernated == {ids[0], ids[2], ids[3]}, (
            "3 machines that support hibernation were plain-stopped because another machine in the "
            f"same StopInstances batch could not hibernate; hibernated={sorted(aws.ec2.hibernated)}"
        )


# ---------------------------------------------------------------------------------------------
# Discovery: DescribeInstances pages, ASG membership only for tagged instances, 50 per call


class TestDiscover:
    def test_running_team_tagged_instances_in_pages_of_1000(self, aws):
        wanted = launch_many(aws, 2100)
        launch_many(aws, 40, state="stopped")
        launch_many(aws, 30, team=None)  # no Team tag: not ours
        launch_many(aws, 20, managed=False)  # a cost-allocation Team tag without the opt-in: not ours

        machines = fleet(aws).discover(TagKeys())

        assert [m.instance_id for m in machines] == sorted(wanted)  # each once, whatever zone listed it
        requests = aws.ec2.requests_of("DescribeInstances")
        # One listing per zone, side by side (pages of one zone follow each other): 700 a zone, one page each.
        assert len(requests) == 3 and all(r["MaxResults"] == 1000 for r in requests)
        assert sorted(
            tuple(f["Values"]) for r in requests for f in r["Filters"] if f["Name"] == "availability-zone"
        ) == [
            ("us-east-1a",),
            ("us-east-1b",),
            ("us-east-1c",),
        ]
        assert {f["Name"]: f["Values"] for f in requests[0]["Filters"] if f["Name"] != "availability-zone"} == {
            "instance-state-name": ["running"],
            "tag-key": ["Team"],
            "tag:idle-reaper:managed": ["true"],
        }

    def test_without_the_zones_the_fleet_is_listed_in_parts_by_id_and_a_failed_part_fails_the_listing(self, aws):
        wanted = launch_many(aws, 1200)
        aws.ec2.inject("DescribeAvailabilityZones", "UnauthorizedOperation")
        assert [m.instance_id for m in fleet(aws).discover(TagKeys())] == sorted(wanted)
        requests = aws.ec2.requests_of("DescribeInstances")
        # The region's first page is full: the region is listed again in 16 parts by the id's last digit.
        assert not any(f["Name"] == "availability-zone" for r in requests for f in r["Filters"])
        assert id_values(requests[0]) is None
        assert sorted(id_values(r) for r in requests[1:]) == [[f"i-*{d}"] for d in "0123456789abcdef"]
        # One part's listing fails: the whole listing fails, never a fleet listed in part.
        aws.ec2.inject("DescribeInstances", "UnauthorizedOperation", on_calls=[17 + 5])  # a part's, next time
        with pytest.raises(ClientError):
            fleet(aws).discover(TagKeys())

    def test_without_an_opt_in_tag_every_team_tagged_machine_is_swept(self, aws):
        opted_in = launch_many(aws, 3)
        plain = launch_many(aws, 2, managed=False)
        machines = fleet(aws).discover(TagKeys(managed=None))
        assert sorted(m.instance_id for m in machines) == sorted(opted_in + plain)

    def test_machine_fields_come_from_tags_and_description(self, aws):
        box = aws.launch(
            "g5.xlarge",
            team="cv",
            profile=steady(1.0),
            launch_time=DAY_AGO,
            name="nb-1",
            owner="ana@example.com",
            tags={"idle-reaper:exempt": "true"},
            hibernation=True,
        )
        [m] = fleet(aws).discover(TagKeys())
        assert (m.instance_id, m.instance_type, m.team, m.owner, m.name) == (
            box,
            "g5.xlarge",
            "cv",
            "ana@example.com",
            "nb-1",
        )
        assert m.exempt_tag == "true" and m.hibernation_configured and m.asg_name is None
        assert m.launch_time == DAY_AGO

    def test_asg_membership_comes_in_bulk_from_the_groups_the_tags_name(self, aws):
        aws.autoscaling.add_group("workers-a")
        aws.autoscaling.add_group("workers-b")
        aws.autoscaling.add_group("unrelated")
        protected_a = launch_many(aws, 70, group="workers-a", protected=True)
        plain_b = launch_many(aws, 50, group="workers-b")
        standalone = launch_many(aws, 30)

        machines = {m.instance_id: m for m in fleet(aws).discover(TagKeys())}

        # 120 members in 2 groups: one DescribeAutoScalingGroups call, not 3 DescribeAutoScalingInstances.
        requests = aws.autoscaling.requests_of("DescribeAutoScalingGroups")
        assert [sorted(r["AutoScalingGroupNames"]) for r in requests] == [["workers-a", "workers-b"]]
        assert aws.autoscaling.calls["DescribeAutoScalingInstances"] == 0
        assert all(machines[i].asg_name == "workers-a" and machines[i].asg_protected for i in protected_a)
        assert all(machines[i].asg_name == "workers-b" and not machines[i].asg_protected for i in plain_b)
        assert all(machines[i].asg_name is None for i in standalone)

    def test_asg_membership_asks_50_groups_a_call(self, aws):
        for n in range(120):
            aws.autoscaling.add_group(f"g{n:03d}")
            launch_many(aws, 1, group=f"g{n:03d}")
        machines = fleet(aws).discover(TagKeys())
        requests = aws.autoscaling.requests_of("DescribeAutoScalingGroups")
        assert sorted(len(r["AutoScalingGroupNames"]) for r in requests) == [20, 50, 50]
        assert {m.asg_name for m in machines} == {f"g{n:03d}" for n in range(120)}

    def test_a_tagged_machine_its_group_does_not_list_stays_standalone(self, aws):
        aws.autoscaling.add_group("workers")
        (member,) = launch_many(aws, 1, group="workers")
        (detached,) = launch_many(aws, 1, group="workers")
        del aws.autoscaling.groups["workers"].members[detached]  # detached: the tag stays behind
        machines = {m.instance_id: m for m in fleet(aws).discover(TagKeys())}
        assert machines[member].asg_name == "workers"
        assert machines[detached].asg_name is None

    def test_no_asg_call_without_members(self, aws):
        launch_many(aws, 5)
        fleet(aws).discover(TagKeys())
        assert aws.autoscaling.calls["DescribeAutoScalingInstances"] == 0
        assert aws.autoscaling.calls["DescribeAutoScalingGroups"] == 0


class TestDiscoverInProcesses:
    """The planner's listing in forked child processes (zones dealt round-robin): the same machines as the
    listing on threads, each once; any child's failure, or a child that dies, fails the whole listing."""

    def fleet_of_three_zones(self, aws: FakeAws) -> list[str]:
        aws.autoscaling.add_group("workers")
        ids = launch_many(aws, 1500, owner="ana@example.com")
        ids += launch_many(aws, 60, group="workers", protected=True)
        launch_many(aws, 30, state="stopped")
        assert {aws.ec2.instances[i].api["Placement"]["AvailabilityZone"] for i in ids} == set(ZONES)
        return ids

    @pytest.mark.parametrize("processes", [2, 3])  # 2: one child lists two zones
    def test_every_machine_once_and_as_the_threads_list_it(self, aws, processes):
        ids = self.fleet_of_three_zones(aws)
        on_threads = fleet(aws).discover(TagKeys())
        in_children = Fleet(aws.ec2, aws.autoscaling, listing_processes=processes).discover(TagKeys())
        assert [m.instance_id for m in in_children] == sorted(ids)
        assert in_children == on_threads  # facts, owners, groups and protection included
        assert sum(m.asg_name == "workers" and m.asg_protected for m in in_children) == 60
        # The children listed the zones (on their copies of the fake); this process only joined the groups.
        assert aws.ec2.calls["DescribeInstances"] == 3  # the listing on threads above, one page a zone

    def test_a_zone_that_fails_in_its_child_fails_the_listing(self, aws, monkeypatch):
        self.fleet_of_three_zones(aws)
        refuse(aws, monkeypatch, in_zone(ZONES[1]))
        with pytest.raises(ClientError) as raised:
            Fleet(aws.ec2, aws.autoscaling, listing_processes=3).discover(TagKeys())
        assert error_code(raised.value) == "RequestLimitExceeded"

    def test_a_child_that_dies_without_an_answer_fails_the_listing(self, aws, monkeypatch):
        self.fleet_of_three_zones(aws)
        refuse(aws, monkeypatch, in_zone(ZONES[2]), lambda: os._exit(9))  # killed: out of memory, say
        with pytest.raises(ProcessFailed, match="without an answer"):
            Fleet(aws.ec2, aws.autoscaling, listing_processes=3).discover(TagKeys())


class TestDiscoverInParts:
    """A zone whose first page comes back full is listed again in 16 parts by the instance id's last hex digit
    (EC2 filter wildcards), side by side: the listing no longer depends on how the fleet spreads over zones.
    The parts are a partition (proven, and checked against EC2's answers); any doubt fails the listing."""

    # 2,500 machines -> 1,200 (the class: 1.6 s -> 1.0 s): the zone's first page (PAGE_SIZE, 1,000) still comes
    # back full, so the zone is split into its 16 parts, each still one page, with ids ending in every hex digit
    # among both the first page's machines and the rest. Seeded bugs both sizes catch: a first page's machine that
    # no part listed not looked for, a part's answer not checked to be of its part and listed once.
    def one_zone_fleet(self, aws: FakeAws, n: int = 1200) -> list[str]:
        aws.autoscaling.add_group("gpu")
        ids = launch_many(aws, n - 40) + launch_many(aws, 40, group="gpu", protected=True)
        launch_many(aws, 30, state="stopped")
        for inst in aws.ec2.instances.values():
            inst.api["Placement"]["AvailabilityZone"] = ZONES[0]  # a GPU capacity cluster: one zone
        return ids

    @pytest.mark.parametrize("processes", [1, 3])
    def test_a_full_zone_is_listed_in_16_parts_each_machine_once(self, aws, processes):
        ids = self.one_zone_fleet(aws)
        machines = Fleet(aws.ec2, aws.autoscaling, listing_processes=processes).discover(TagKeys())
        assert [m.instance_id for m in machines] == sorted(ids)
        assert sum(m.asg_name == "gpu" and m.asg_protected for m in machines) == 40
        if processes == 1:  # (in processes the children call their own copies of the fake)
            requests = aws.ec2.requests_of("DescribeInstances")
            firsts = [r for r in requests if id_values(r) is None]
            zones = [z for r in firsts for f in r["Filters"] if f["Name"] == "availability-zone" for z in f["Values"]]
            assert sorted(zones) == sorted(ZONES)  # one first page a zone; only the full one is split
            parts = [r for r in requests if id_values(r) is not None]
            assert sorted(id_values(r)[0] for r in parts) == [f"i-*{d}" for d in "0123456789abcdef"]
            assert all(
                f["Values"] == [ZONES[0]] for r in parts for f in r["Filters"] if f["Name"] == "availability-zone"
            )
            assert len(parts) == 16  # 1,200 machines: one page a part
        on_threads = fleet(aws).discover(TagKeys())
        assert machines == on_threads

    def test_the_parts_are_a_partition_of_every_instance_id(self):
        assert partition_errors(ID_PARTS) == []
        # Checked against EC2's own matching (the fake's, written from the User Guide), not the code's:
        parts = [filter_value_matcher(values) for values in ID_PARTS]
        rng = random.Random(5)
        ids = [f"i-{rng.getrandbits(68):017x}" for _ in range(2000)]
        ids += [f"i-{rng.getrandbits(32):08x}" for _ in range(500)]  # the older, 8-digit ids
        assert all(sum(part(i) for part in parts) == 1 for i in ids)

    @pytest.mark.parametrize(
        "wrong",
        [
            ID_PARTS[:15],  # digit f in no part
            (*ID_PARTS, ("i-*3",)),  # digit 3 in two parts
            (*ID_PARTS[:10], ("i-*A", "i-*B", "i-*C", "i-*D", "i-*E", "i-*F")),  # EC2 ids are lowercase
            (*ID_PARTS[1:], ("i-*00", "i-*10")),  # 14 of the 16 ids ending in 0 in no part, and unprovable
            tuple((f"i-{d}*",) for d in "0123456789abcdef"),  # the first digit: a prefix, not a suffix
            (),
        ],
    )
    def test_a_wrong_partition_is_refused(self, wrong):
        assert partition_errors(wrong) != []

    @pytest.mark.parametrize(
        "parts",
        [
            ID_PARTS[:15],  # ids ending in f: listed by the first page, by no part
            (*ID_PARTS, ("i-*3",)),  # ids ending in 3: listed twice
        ],
    )
    def test_a_wrong_partition_in_use_is_caught_and_the_zone_listed_in_sequence(self, aws, monkeypatch, parts):
        ids = self.one_zone_fleet(aws)
        monkeypatch.setattr(fleet_module, "ID_PARTS", parts)
        caught: list[Exception] = []
        listed_in_parts = fleet_module._listed_in_parts

        def watched(*args):
            try:
                return listed_in_parts(*args)
            except ListingIncomplete as exc:
                caught.append(exc)
                raise

        monkeypatch.setattr(fleet_module, "_listed_in_parts", watched)
        machines = fleet(aws).discover(TagKeys())
        assert len(caught) == 1  # the wrong partition was seen for what it is
        assert [m.instance_id for m in machines] == sorted(ids)  # and every machine listed once all the same

    @pytest.mark.parametrize("ec2", ["takes the wildcard literally (moto)", "ignores the instance-id filter"])
    def test_an_ec2_that_does_not_apply_the_wildcard_is_listed_in_sequence_whole(self, aws, monkeypatch, ec2):
        ids = self.one_zone_fleet(aws)
        listed = aws.ec2.describe_instances

        def describe(**kw):
            filters = kw.get("Filters", ())
            values = id_values(kw) if filters else None
            if values and values[0].startswith("i-*"):
                if ec2.startswith("takes"):
                    return {"Reservations": []}  # no id equals "i-*0"
                kw["Filters"] = [f for f in filters if f["Name"] != "instance-id"]
            return listed(**kw)

        monkeypatch.setattr(aws.ec2, "describe_instances", describe)
        machines = fleet(aws).discover(TagKeys())
        assert [m.instance_id for m in machines] == sorted(ids)  # never a part of the fleet swept as the whole

    def test_a_machine_stopped_after_the_first_page_is_no_miss(self, aws, monkeypatch):
        ids = self.one_zone_fleet(aws)
        listed = aws.ec2.describe_instances
        stopped: list[str] = []

        def describe(**kw):
            page = listed(**kw)
            if not stopped and page.get("NextToken") and id_values(kw) is None:
                stopped.append(page["Reservations"][0]["Instances"][0]["InstanceId"])
                aws.ec2.instances[stopped[0]].set_state("stopped")  # stopped by its owner meanwhile
            return page

        monkeypatch.setattr(aws.ec2, "describe_instances", describe)
        machines = fleet(aws).discover(TagKeys())
        assert [m.instance_id for m in machines] == sorted(set(ids) - set(stopped))
        # Its absence was checked: described again by id, no longer running.
        assert [id_values(r) for r in aws.ec2.requests_of("DescribeInstances")][-1] == stopped

    def test_a_part_that_fails_in_its_child_fails_the_listing(self, aws, monkeypatch):
        self.one_zone_fleet(aws)
        refuse(aws, monkeypatch, lambda request: id_values(request) == ["i-*7"])
        with pytest.raises(ClientError) as raised:
            Fleet(aws.ec2, aws.autoscaling, listing_processes=3).discover(TagKeys())
        assert error_code(raised.value) == "RequestLimitExceeded"


class TestRunInProcesses:
    def test_answers_in_order_from_separate_processes(self):
        answers = run_in_processes(lambda n: (n * n, os.getpid()), [3, 1, 2])
        assert [a for a, _ in answers] == [9, 1, 4]
        assert len({pid for _, pid in answers} | {os.getpid()}) == 4

    def test_an_answer_that_cannot_travel_is_a_failure_not_a_gap(self):
        with pytest.raises(ProcessFailed, match="could not be sent"):
            run_in_processes(lambda n: (lambda: n) if n == 2 else n, [1, 2, 3])

    def test_a_botocore_client_is_made_anew_for_a_child_and_a_fake_is_its_own_copy(self, aws):
        member = {"aws_access_key_id": "AKIAMEMBER", "aws_secret_access_key": "secret", "aws_session_token": "tok"}
        parent = client("ec2", "eu-west-1", endpoint_url="http://127.0.0.1:1", credentials=member)
        child = for_this_process(parent)
        assert child is not parent and child.meta.endpoint_url == parent.meta.endpoint_url
        assert child.meta.region_name == "eu-west-1"
        # The same identity (a member account's stays that account's), not the default chain's.
        frozen = child._request_signer._credentials.get_frozen_credentials()
        assert (frozen.access_key, frozen.secret_key, frozen.token) == ("AKIAMEMBER", "secret", "tok")
        assert for_this_process(aws.ec2) is aws.ec2


def test_clients_of_one_service_share_their_class_and_keep_their_own_identity():
    # A member unit makes an EC2 client per account: its class (a method per operation) is built once.
    made = []
    boto3._get_default_session().events.register("creating-client-class.ec2", lambda **_: made.append(1))
    identities = [
        {"aws_access_key_id": f"AKIA{n}", "aws_secret_access_key": f"secret{n}", "aws_session_token": f"tok{n}"}
        for n in range(3)
    ]
    made_before = len(made)
    clients = [
        client("ec2", region, credentials=i)
        for i, region in zip(identities, ("us-east-1", "eu-west-1", "us-east-1"), strict=True)
    ]
    assert len(made) - made_before <= 1  # none when this process made an EC2 client before
    assert len({type(c) for c in clients}) == 1 and hasattr(clients[0], "describe_instances")
    frozen = [c._request_signer._credentials.get_frozen_credentials() for c in clients]
    assert [(f.access_key, f.secret_key, f.token) for f in frozen] == [
        (i["aws_access_key_id"], i["aws_secret_access_key"], i["aws_session_token"]) for i in identities
    ]
    assert [c.meta.region_name for c in clients] == ["us-east-1", "eu-west-1", "us-east-1"]
    assert type(client("cloudwatch", "us-east-1")) is not type(clients[0])


class TestGroups:
    def test_set_protection_in_batches_of_50_bisecting_a_non_member(self, aws):
        aws.autoscaling.add_group("workers")
        members = launch_many(aws, 119, group="workers")
        [stranger] = launch_many(aws, 1)  # not in the group: ValidationError for its whole batch
        ids = [*members[:60], stranger, *members[60:]]

        outcomes = {o.instance_id: o.error for o in fleet(aws).set_protection("workers", ids, protected=True)}

        assert [i for i, e in outcomes.items() if e] == [stranger]
        assert "ValidationError" in (outcomes[stranger] or "")
        assert all(aws.autoscaling.protected(i) for i in members)
        sizes = [len(r["InstanceIds"]) for r in aws.autoscaling.requests_of("SetInstanceProtection")]
        assert max(sizes) <= 50
        # 120 ids: 50 ok, 50 bisected around the stranger, 20 ok (the batches run concurrently: any order)
        assert sorted(sizes) == sorted([50, 50, 25, 12, 6, 6, 3, 3, 1, 2, 1, 1, 13, 25, 20])

    def test_group_capacity_of_many_groups(self, aws):
        # BUG (aws.py Fleet.group_capacity): DescribeAutoScalingGroups accepts at most 50 names unless
        # MaxRecords is raised (max 100); the adapter sends batches of 100 names without MaxRecords, so
        # 51+ groups with terminations in one sweep raise ValidationError, run_sweep treats capacity as
        # unknown and turns every termination into an unprotect. Fix: chunk names by 50, or pass
        # PaginationConfig={"PageSize": 100} with batches of 100.
        for n in range(60):
            aws.autoscaling.add_group(f"g{n:02d}", min_size=n % 3)
            launch_many(aws, 3, group=f"g{n:02d}")
        try:
            capacity = fleet(aws).group_capacity(f"g{n:02d}" for n in range(60))
        except ClientError as exc:
            pytest.fail(f"group_capacity sent more than 50 group names without MaxRecords: {exc}")
        assert len(capacity) == 60
        assert (capacity["g05"].min_size, capacity["g05"].desired) == (2, 3)

    def test_terminate_in_group_reports_the_min_size_refusal(self, aws):
        aws.autoscaling.add_group("workers", min_size=1)
        a, b = launch_many(aws, 2, group="workers")
        assert fleet(aws).terminate_in_group(a).error is None
        refused = fleet(aws).terminate_in_group(b)
        assert refused.error is not None and refused.error.startswith("ValidationError")
        assert aws.autoscaling.groups["workers"].desired == 1


# ---------------------------------------------------------------------------------------------
# GetMetricData: packing, NextToken, PartialData, a failing batch


START = NOW - timedelta(hours=2)
# 5-minute points from 13:00 whose period has been published by 15:00 (the fake's 2-minute delay): 13:00 .. 14:50
POINTS = 23


def fetch(aws: FakeAws, ids: list[str]):
    reader = MetricsReader(aws.cloudwatch)
    return reader, reader.fetch(ids, MetricSettings(), start=START, end=NOW)


class TestMetrics:
    @pytest.mark.parametrize("machines", [1, 166, 167, 1000])
    def test_three_queries_per_machine_packed_500_per_call(self, aws, machines):
        # CPU, GPU and the human-activity collector's minutes since input, in the same calls.
        ids = launch_many(aws, machines, "g5.xlarge", profile=steady(2.0, 90.0))
        reader, signals = fetch(aws, ids)

        requests = aws.cloudwatch.requests_of("GetMetricData")
        assert len(requests) == math.ceil(3 * machines / 500)
        assert all(len(r["MetricDataQueries"]) <= 500 for r in requests)
        assert reader.stats.calls == len(requests)
        assert set(signals) == set(ids)
        sample = signals[ids[-1]]
        assert sample.complete
        assert len(sample.cpu) == len(sample.gpu) == POINTS
        assert sample.cpu[0][0] == START and sample.cpu[-1][0] == NOW - timedelta(minutes=10)
        assert {v for _, v in sample.gpu} == {90.0}

    def test_the_activity_metric_is_read_at_the_sweep_period_and_timed_at_its_end(self, aws):
        # One datapoint a five-minute period (a fifth of what the collector's one-minute values would ask
        # CloudWatch for), each a Minimum timed at its period's end: the input it places is never early.
        ids = launch_many(aws, 1, "g5.xlarge", profile=lambda t: (2.0, 90.0, None, None, 3.0))
        _, signals = fetch(aws, ids)

        [request] = aws.cloudwatch.requests_of("GetMetricData")
        assert {q["MetricStat"]["Period"] for q in request["MetricDataQueries"]} == {300}
        user = signals[ids[0]].user
        assert len(user) == POINTS and {v for _, v in user} == {3.0}
        assert user[0][0] == START + timedelta(minutes=5) and user[-1][0] == NOW - timedelta(minutes=5)

    def test_next_token_pages_are_followed(self, aws):
        aws.cloudwatch.points_per_call = 50  # 10 machines x 2 metrics x 23 points = 460 points: 10 pages
        ids = launch_many(aws, 10, "g5.xlarge", profile=lambda t: (2.0, 40.0 + t.minute))
        _, signals = fetch(aws, ids)

        assert aws.cloudwatch.calls["GetMetricData"] == math.ceil(10 * 2 * POINTS / 50)
        tokens = [r["NextToken"] for r in aws.cloudwatch.requests_of("GetMetricData")]
        assert tokens[0] is None and all(tokens[1:]) and len(set(tokens[1:])) == 9
        for i in ids:
            assert signals[i].complete
            assert len(signals[i].cpu) == len(signals[i].gpu) == POINTS
        # The last machine's GPU series only arrives on the last pages.
        last = signals[ids[-1]].gpu
        assert [v for _, v in last] == [40.0 + t.minute for t, _ in last]
        assert last[-1][0] == NOW - timedelta(minutes=10)

    def test_partial_data_left_after_the_last_page_marks_the_machine_incomplete(self, aws):
        ids = launch_many(aws, 5, "g5.xlarge", profile=steady(1.0, 0.0))
        aws.cloudwatch.partial_data.add(ids[3])
        _, signals = fetch(aws, ids)

        assert [signals[i].complete for i in ids] == [True, True, True, False, True]
        machine = fleet(aws).discover(TagKeys())[3]
        assert machine.instance_id == ids[3]
        settings = Settings()
        verdict = assess(
            machine,
            signals[ids[3]],
            settings.default_policy,
            now=NOW,
            period=timedelta(minutes=5),
            gpu_families=DEFAULT_GPU_FAMILIES,
        )
        assert verdict.signal == "unknown"

    def test_a_batch_throttled_after_retries_marks_only_its_machines_incomplete(self, aws):
        ids = launch_many(aws, 300)  # 900 queries (CPU, GPU, human activity): two calls
        aws.cloudwatch.inject("GetMetricData", "Throttling", on_calls={2})
        reader, signals = fetch(aws, ids)

        first, second = aws.cloudwatch.requests_of("GetMetricData")
        in_second = {q["MetricStat"]["Metric"]["Dimensions"][0]["Value"] for q in second["MetricDataQueries"]}
        in_first = {q["MetricStat"]["Metric"]["Dimensions"][0]["Value"] for q in first["MetricDataQueries"]}
        assert len(in_second) == 134  # the machine whose queries straddle the calls is in both
        assert {i for i in ids if not signals[i].complete} == in_second
        assert all(len(signals[i].cpu) == POINTS for i in in_first - in_second)
        assert reader.stats.failed_calls == 1

    def test_throttling_on_a_later_page_loses_the_whole_batch(self, aws):
        aws.cloudwatch.points_per_call = 100
        ids = launch_many(aws, 10)  # 10 x 23 CPU points: 3 pages
        aws.cloudwatch.inject("GetMetricData", "Throttling", on_calls={2})
        _, signals = fetch(aws, ids)
        assert not any(signals[i].complete for i in ids)


# ---------------------------------------------------------------------------------------------
# Policies in SSM


class TestPolicyStore:
    @pytest.fixture
    def store(self, aws) -> PolicyStore:
        return PolicyStore(aws.ssm, PREFIX)

    def test_missing_settings_parameter_means_defaults(self, aws, store):
        settings, version = store.load_settings()
        assert settings == Settings() and version is None
        assert aws.ssm.calls["GetParameter"] == 1

    def test_settings_parameter_is_read_with_its_version(self, aws, store):
        aws.ssm.store(f"{PREFIX}/settings", '{"dry_run": true}')
        aws.ssm.store(f"{PREFIX}/settings", '{"dry_run": true, "default_policy": {"idle_minutes": 120}}')
        settings, version = store.load_settings()
        assert settings.dry_run and settings.default_policy.idle_minutes == 120 and version == 2

    def test_invalid_settings_raise_naming_the_parameter(self, aws, store):
        aws.ssm.store(f"{PREFIX}/settings", '{"dry_rn": true}')
        with pytest.raises(PolicyError) as err:
            store.load_settings()
        assert f"{PREFIX}/settings" in str(err.value) and "dry_rn" in str(err.value)

    @pytest.mark.parametrize(
        "text,field",
        [
            ('{"idle_minutes": 60', "JSON"),  # not JSON at all
            ('{"idle_minutes": 60, "idle_minutse": 30}', "idle_minutse"),  # unknown field
            ('{"idle_minutes": 5}', "idle_minutes"),  # out of range (15-1440)
            ('{"action": "shutdown"}', "action"),  # not one of the choices
        ],
    )
    def test_invalid_team_policy_is_a_ref_without_policy_naming_parameter_and_field(self, aws, store, text, field):
        aws.ssm.store(f"{PREFIX}/teams/good", '{"idle_minutes": 60}')
        aws.ssm.store(f"{PREFIX}/teams/bad", text)
        refs = store.load_teams(Settings())

        assert refs["good"].policy is not None and refs["good"].error is None
        bad = refs["bad"]
        assert bad.policy is None
        assert bad.error and f"{PREFIX}/teams/bad" in bad.error and field in bad.error
        assert bad.source == f"{PREFIX}/teams/bad" and bad.version == 1

    def test_team_policy_overrides_the_default_field_by_field(self, aws, store):
        aws.ssm.store(f"{PREFIX}/teams/ml", '{"idle_minutes": 60}')
        aws.ssm.store(f"{PREFIX}/teams/ml", '{"idle_minutes": 45}')
        default = Settings.model_validate({"default_policy": {"warn_minutes": 10, "cpu_threshold_percent": 8}})
        ref = store.load_teams(default)["ml"]
        assert ref.policy is not None
        assert (ref.policy.idle_minutes, ref.policy.warn_minutes, ref.policy.cpu_threshold_percent) == (45, 10, 8)
        assert ref.version == 2 and ref.label == f"{PREFIX}/teams/ml@v2"

    def test_many_teams_are_read_10_per_call_and_nested_parameters_ignored(self, aws, store):
        for n in range(23):
            aws.ssm.store(f"{PREFIX}/teams/team{n:02d}", '{"idle_minutes": 60}')
        aws.ssm.store(f"{PREFIX}/teams/team00/extra", '{"idle_minutes": 60}')
        refs = store.load_teams(Settings())
        assert sorted(refs) == [f"team{n:02d}" for n in range(23)]
        assert aws.ssm.calls["GetParametersByPath"] == 3


# ---------------------------------------------------------------------------------------------
# The fakes enforce the limits the tests above rely on


class TestFakesEnforceApiLimits:
    def code(self, call) -> str:
        with pytest.raises(ClientError) as err:
            call()
        return str(err.value.response["Error"]["Code"])

    def test_limits(self, aws):
        ids = launch_many(aws, 51)
        aws.autoscaling.add_group("g")
        query = {
            "MetricStat": {
                "Metric": {"Namespace": "AWS/EC2", "MetricName": "CPUUtilization", "Dimensions": []},
                "Period": 300,
                "Stat": "Maximum",
            }
        }
        queries = [{"Id": f"q{n}", **query} for n in range(501)]
        cw = aws.cloudwatch
        assert self.code(lambda: cw.get_metric_data(MetricDataQueries=queries, StartTime=START, EndTime=NOW)) == (
            "ValidationError"
        )
        asg = aws.autoscaling
        assert self.code(lambda: asg.describe_auto_scaling_instances(InstanceIds=ids)) == "ValidationError"
        assert self.code(
            lambda: asg.set_instance_protection(InstanceIds=ids, AutoScalingGroupName="g", ProtectedFromScaleIn=True)
        ) == ("ValidationError")
        assert self.code(lambda: aws.ssm.get_parameters_by_path(Path="/x", MaxResults=11)) == "ValidationException"
        assert self.code(lambda: aws.ec2.describe_instances(MaxResults=1001)) == "InvalidParameterValue"
        assert self.code(lambda: aws.ssm.get_parameter(Name="/nope")) == "ParameterNotFound"


@pytest.mark.parametrize(
    ("table", "prefix"),
    [
        (None, "idle-reaper"),  # unset: the default deployment's
        ("idle-reaper-state", "idle-reaper"),
        ("idle-reaper-staging-state", "idle-reaper-staging"),
        ("my-local-table", "idle-reaper"),  # not a stack's table name: the default's
        ("-state", "idle-reaper"),
    ],
)
def test_the_deploy_prefix_comes_from_the_table_the_stack_names(
    table: str | None, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idle_reaper.aws import deploy_prefix

    if table is None:
        monkeypatch.delenv("IDLE_REAPER_TABLE", raising=False)
    else:
        monkeypatch.setenv("IDLE_REAPER_TABLE", table)
    assert deploy_prefix() == prefix
