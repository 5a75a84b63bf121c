"""Fake EC2 and Auto Scaling: instances, groups, tags and the per-call limits of the real APIs."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

from botocore.exceptions import ClientError

from testkit import ec2_answers
from testkit.aws.clients import ACCOUNT, REGION, FakeClient, api
from testkit.ec2_answers import Answer

# ---------------------------------------------------------------------------------------------
# EC2


_STATE_CODES = {"pending": 0, "running": 16, "shutting-down": 32, "terminated": 48, "stopping": 64, "stopped": 80}


ZONES = tuple(f"{REGION}{letter}" for letter in "abc")


def zone_of(instance_id: str) -> str:
    """Machines spread over the region's zones, the same zone for the same id."""
    return ZONES[sum(instance_id.encode()) % len(ZONES)]


@dataclass
class FakeInstance:
    instance_id: str
    instance_type: str
    launch_time: datetime
    tags: dict[str, str]
    hibernation_configured: bool = False
    state: str = "running"
    api: dict[str, Any] = field(default_factory=dict)  # the DescribeInstances item, built once
    # What makes a machine another kind (kinds.py): set with FakeEC2.make_* before a sweep lists it.
    lifecycle: str | None = None  # InstanceLifecycle
    root_device: str = "ebs"
    spot_request_id: str | None = None
    reservation_id: str | None = None

    def __post_init__(self) -> None:
        self.api = {
            "InstanceId": self.instance_id,
            "InstanceType": self.instance_type,
            "ImageId": "ami-12345678",
            "LaunchTime": self.launch_time,
            "Placement": {"AvailabilityZone": zone_of(self.instance_id), "Tenancy": "default"},
            "PrivateIpAddress": "10.0.0.1",
            "HibernationOptions": {"Configured": self.hibernation_configured},
            "Tags": [{"Key": k, "Value": v} for k, v in self.tags.items()],
        }
        self.set_state(self.state)
        self.set_kind()

    def set_state(self, state: str) -> None:
        self.state = state
        self.api["State"] = {"Code": _STATE_CODES[state], "Name": state}

    def set_kind(self) -> None:
        self.api["RootDeviceType"] = self.root_device
        for key, value in (
            ("InstanceLifecycle", self.lifecycle),
            ("SpotInstanceRequestId", self.spot_request_id),
            ("CapacityReservationId", self.reservation_id),
        ):
            if value:
                self.api[key] = value
            else:
                self.api.pop(key, None)


def filter_value_matcher(values: Sequence[str]) -> Callable[[str | None], bool]:
    """Whether a resource's value matches any of a filter's values, as EC2 compares them: case-sensitive, the
    whole value, "*" matching zero or more characters and "?" zero or one, a backslash making the next character
    literal (Amazon EC2 User Guide, "List and filter using the CLI and API"). Values without wildcards are
    compared exactly (a set lookup: the fake lists 200,000 machines)."""
    exact = {v for v in values if not any(c in v for c in "*?\\")}
    patterns = [re.compile(_wildcard_regex(v), re.DOTALL) for v in values if v not in exact]

    def matches(value: str | None) -> bool:
        if value is None:
            return False
        return value in exact or any(p.fullmatch(value) for p in patterns)

    return matches


def _wildcard_regex(value: str) -> str:
    out, chars = [], iter(value)
    for c in chars:
        if c == "\\":
            out.append(re.escape(next(chars, "\\")))
        elif c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".?")
        else:
            out.append(re.escape(c))
    return "".join(out)


class FakeEC2(FakeClient):
    service = "ec2"
    paginators: ClassVar[dict[str, tuple[str, str]]] = {
        "describe_instances": ("describe_instances", "MaxResults"),
        "describe_spot_instance_requests": ("describe_spot_instance_requests", "MaxResults"),
        "describe_capacity_reservations": ("describe_capacity_reservations", "MaxResults"),
    }
    _invalid_token_code = "InvalidParameterValue"

    def __init__(self) -> None:
        super().__init__()
        self.instances: dict[str, FakeInstance] = {}
        self.fail_stop: dict[str, str] = {}  # instance id -> error code for any StopInstances naming it
        self.unhibernatable: set[str] = set()  # configured, but hibernation fails (UnsupportedHibernationConfiguration)
        self.hibernated: set[str] = set()
        self.spot_requests: dict[str, dict[str, Any]] = {}  # DescribeSpotInstanceRequests items by request id
        self.reservations: dict[str, dict[str, Any]] = {}  # DescribeCapacityReservations items by reservation id
        self.refuse_start: dict[str, Answer] = {}  # instance id -> EC2's answer to StartInstances (no capacity...)
        self.enabled_regions: tuple[str, ...] = ()  # DescribeRegions' answer
        self._ids = itertools.count(1)

    def add(
        self,
        instance_type: str,
        *,
        launch_time: datetime,
        tags: dict[str, str],
        hibernation: bool = False,
        state: str = "running",
    ) -> FakeInstance:
        instance_id = f"i-{next(self._ids):017x}"
        inst = FakeInstance(instance_id, instance_type, launch_time, dict(tags), hibernation, state)
        self.instances[instance_id] = inst
        return inst

    def make_spot(
        self, instance_id: str, *, request_type: str = "one-time", interruption: str = "terminate", price: str = "0.5"
    ) -> str:
        """Make the machine a Spot instance of a new request of that type; the request's id."""
        request_id = f"sir-{instance_id[2:]}"
        self.spot_requests[request_id] = ec2_answers.spot_request(
            request_id, instance_id, request_type=request_type, interruption=interruption, price=price
        )
        inst = self.instances[instance_id]
        inst.lifecycle, inst.spot_request_id = "spot", request_id
        inst.set_kind()
        return request_id

    def make_kind(self, instance_id: str, **facts: Any) -> None:
        """Set FakeInstance kind fields (root_device, reservation_id, lifecycle) as DescribeInstances shows them."""
        inst = self.instances[instance_id]
        for name, value in facts.items():
            setattr(inst, name, value)
        inst.set_kind()

    def forget(self, instance_id: str) -> None:
        """The instance is gone (terminated long enough ago that EC2 no longer knows it)."""
        del self.instances[instance_id]

    def state_of(self, instance_id: str) -> str:
        inst = self.instances.get(instance_id)
        return inst.state if inst else "gone"

    # -- API ---------------------------------------------------------------------------------

    def _matcher(self, filters: Sequence[dict[str, Any]]) -> Callable[[FakeInstance], bool]:
        """DescribeInstances filters: AND across filters, OR across one filter's values, each value with EC2's
        wildcards (`filter_value_matcher`)."""
        wanted: list[tuple[str, Callable[[str | None], bool]]] = []
        for f in filters:
            name = f["Name"]
            known = ("instance-state-name", "tag-key", "instance-id", "availability-zone")
            if name not in known and not name.startswith("tag:"):
                raise self._error("DescribeInstances", "InvalidParameterValue", f"The filter '{name}' is invalid")
            wanted.append((name, filter_value_matcher(f["Values"])))

        def matches(inst: FakeInstance) -> bool:
            for name, value_matches in wanted:
                if name == "instance-state-name":
                    ok = value_matches(inst.state)
                elif name == "tag-key":
                    ok = any(value_matches(key) for key in inst.tags)
                elif name == "instance-id":
                    ok = value_matches(inst.instance_id)
                elif name == "availability-zone":
                    ok = value_matches(inst.api["Placement"]["AvailabilityZone"])
                else:
                    ok = value_matches(inst.tags.get(name[4:]))
                if not ok:
                    return False
            return True

        return matches

    def _pool(self, instance_ids: Sequence[str], filters: Sequence[dict[str, Any]]) -> Iterable[FakeInstance]:
        """The instances a call can match: the ids asked for, or those an `instance-id` filter of exact values
        names (looked up, not scanned: the shard workers describe 200 ids a call of a 200,000-machine fleet),
        or whose id ends as the planner's parts by instance id ask ("i-*" and a suffix: str.endswith, not a regex
        per machine), else every instance. The matcher still applies every filter."""
        if instance_ids:
            return [self.instances[i] for i in instance_ids]
        for f in filters:
            values = f["Values"]
            if f["Name"] == "instance-id" and not any(c in v for v in values for c in "*?\\"):
                return [self.instances[i] for i in dict.fromkeys(values) if i in self.instances]
            suffixes = tuple(v[3:] for v in values if v.startswith("i-*") and not any(c in v[3:] for c in "*?\\"))
            if f["Name"] == "instance-id" and len(suffixes) == len(values):
                return [inst for key, inst in self.instances.items() if key.endswith(suffixes)]
        return self.instances.values()

    @api
    def describe_availability_zones(
        self, AllAvailabilityZones: bool = False, Filters: Sequence[dict[str, Any]] = ()
    ) -> dict[str, Any]:
        self._call("DescribeAvailabilityZones", {"AllAvailabilityZones": AllAvailabilityZones})
        return {
            "AvailabilityZones": [
                {"ZoneName": zone, "State": "available", "OptInStatus": "opt-in-not-required"} for zone in ZONES
            ]
        }

    @api
    def describe_regions(self, AllRegions: bool = False) -> dict[str, Any]:
        """The account's enabled regions (`enabled_regions`, set by a test): what the daily count of regions
        without a stack asks first."""
        self._call("DescribeRegions", {"AllRegions": AllRegions})
        return {
            "Regions": [
                {"RegionName": r, "Endpoint": f"ec2.{r}.amazonaws.com", "OptInStatus": "opt-in-not-required"}
                for r in self.enabled_regions
            ]
        }

    @api
    def describe_instances(
        self,
        Filters: Sequence[dict[str, Any]] = (),
        InstanceIds: Sequence[str] = (),
        MaxResults: int | None = None,
        NextToken: str | None = None,
    ) -> dict[str, Any]:
        self._call("DescribeInstances", {"Filters": Filters, "InstanceIds": InstanceIds, "MaxResults": MaxResults})
        if MaxResults is not None and not 5 <= MaxResults <= 1000:
            raise self._error(
                "DescribeInstances", "InvalidParameterValue", f"MaxResults must be between 5 and 1000: {MaxResults}"
            )
        if MaxResults is not None and InstanceIds:
            raise self._error(
                "DescribeInstances", "InvalidParameterCombination", "MaxResults cannot be used with InstanceIds"
            )
        missing = [i for i in InstanceIds if i not in self.instances]
        if missing:
            ids = ", ".join(missing)
            raise self._error(
                "DescribeInstances", "InvalidInstanceID.NotFound", f"The instance IDs '{ids}' do not exist"
            )
        match = self._matcher(Filters)

        def everything() -> list[FakeInstance]:
            return [inst for inst in self._pool(InstanceIds, Filters) if match(inst)]

        page, token = self._page("DescribeInstances", NextToken, MaxResults or 1000, everything)
        reservations = [
            {"ReservationId": f"r-{inst.instance_id[2:]}", "OwnerId": ACCOUNT, "Instances": [inst.api]} for inst in page
        ]
        return {"Reservations": reservations, **({"NextToken": token} if token else {})}

    @api
    def stop_instances(
        self,
        InstanceIds: Sequence[str],
        Hibernate: bool = False,
        Force: bool = False,
        DryRun: bool = False,
    ) -> dict[str, Any]:
        """All or nothing, like the real call: one bad id fails the whole request."""
        op = "StopInstances"
        self._call(op, {"InstanceIds": list(InstanceIds), "Hibernate": Hibernate})
        if not InstanceIds:
            raise self._error(op, "MissingParameter", "The request must contain the parameter InstanceId")
        missing = [i for i in InstanceIds if i not in self.instances]
        if missing:
            verb = "does not exist" if len(missing) == 1 else "do not exist"
            noun = "ID" if len(missing) == 1 else "IDs"
            raise self._error(op, "InvalidInstanceID.NotFound", f"The instance {noun} '{', '.join(missing)}' {verb}")
        for i in InstanceIds:
            if i in self.fail_stop:
                raise self._error(op, self.fail_stop[i], f"injected failure for {i}")
            refusal = self._stop_refusal(self.instances[i])
            if refusal is not None:
                raise self._error(op, refusal.code, refusal.message)
            if self.instances[i].state in ("shutting-down", "terminated"):
                raise self._error(
                    op, "IncorrectInstanceState", f"This instance '{i}' is not in a state from which it can be stopped."
                )
        if Hibernate:
            for i in InstanceIds:
                if not self.instances[i].hibernation_configured or i in self.unhibernatable:
                    answer = ec2_answers.hibernation_not_configured(i)
                    raise self._error(op, answer.code, answer.message)
        out = []
        for i in InstanceIds:
            inst = self.instances[i]
            previous = dict(inst.api["State"])
            if inst.state in ("running", "pending"):
                inst.set_state("stopped")
                if Hibernate:
                    self.hibernated.add(i)
            out.append({"InstanceId": i, "PreviousState": previous, "CurrentState": dict(inst.api["State"])})
        return {"StoppingInstances": out}

    def _stop_refusal(self, inst: FakeInstance) -> Answer | None:
        """EC2's answer to stopping a one-time Spot instance or an instance-store root."""
        if inst.root_device != "ebs":
            return ec2_answers.instance_store_stop(inst.instance_id)
        if inst.lifecycle == "spot":
            request = self.spot_requests.get(inst.spot_request_id or "")
            if request is None or request["Type"] != "persistent":
                return ec2_answers.one_time_spot_stop(inst.instance_id)
        return None

    @api
    def start_instances(self, InstanceIds: Sequence[str], DryRun: bool = False) -> dict[str, Any]:
        op = "StartInstances"
        self._call(op, {"InstanceIds": list(InstanceIds)})
        missing = [i for i in InstanceIds if i not in self.instances]
        if missing:
            raise self._error(op, "InvalidInstanceID.NotFound", f"The instance IDs '{', '.join(missing)}' do not exist")
        for i in InstanceIds:
            if i in self.refuse_start:
                raise self._error(op, self.refuse_start[i].code, self.refuse_start[i].message)
        for i in InstanceIds:
            if self.instances[i].state not in ("stopped", "running", "pending"):
                raise self._error(
                    op, "IncorrectInstanceState", f"The instance '{i}' is not in a state from which it can be started."
                )
        out = []
        for i in InstanceIds:
            inst = self.instances[i]
            previous = dict(inst.api["State"])
            inst.set_state("running")
            self.hibernated.discard(i)
            out.append({"InstanceId": i, "PreviousState": previous, "CurrentState": dict(inst.api["State"])})
        return {"StartingInstances": out}

    @api
    def terminate_instances(self, InstanceIds: Sequence[str], DryRun: bool = False) -> dict[str, Any]:
        op = "TerminateInstances"
        self._call(op, {"InstanceIds": list(InstanceIds)})
        missing = [i for i in InstanceIds if i not in self.instances]
        if missing:
            raise self._error(op, "InvalidInstanceID.NotFound", f"The instance IDs '{', '.join(missing)}' do not exist")
        out = []
        for i in InstanceIds:
            inst = self.instances[i]
            previous = dict(inst.api["State"])
            inst.set_state("terminated")
            request = self.spot_requests.get(inst.spot_request_id or "")
            if request is not None and request["Type"] == "one-time":
                request["State"] = "closed"
            out.append({"InstanceId": i, "PreviousState": previous, "CurrentState": dict(inst.api["State"])})
        return {"TerminatingInstances": out}

    @api
    def describe_spot_instance_requests(
        self,
        Filters: Sequence[dict[str, Any]] = (),
        SpotInstanceRequestIds: Sequence[str] = (),
        MaxResults: int | None = None,
        NextToken: str | None = None,
    ) -> dict[str, Any]:
        op = "DescribeSpotInstanceRequests"
        self._call(op, {"Filters": Filters, "SpotInstanceRequestIds": SpotInstanceRequestIds})
        missing = [i for i in SpotInstanceRequestIds if i not in self.spot_requests]
        if missing:
            message = f"The spot instance request ID '{missing[0]}' does not exist"
            raise self._error(op, "InvalidSpotInstanceRequestID.NotFound", message)
        wanted = set(SpotInstanceRequestIds)
        for f in Filters:
            if f["Name"] != "spot-instance-request-id":
                raise self._error(op, "InvalidParameterValue", f"The filter '{f['Name']}' is invalid")
            wanted |= set(f["Values"])
        items = [r for key, r in self.spot_requests.items() if not wanted or key in wanted]
        page, token = self._page(op, NextToken, MaxResults or 1000, lambda: items)
        return {"SpotInstanceRequests": page, **({"NextToken": token} if token else {})}

    @api
    def describe_capacity_reservations(
        self,
        CapacityReservationIds: Sequence[str] = (),
        MaxResults: int | None = None,
        NextToken: str | None = None,
    ) -> dict[str, Any]:
        op = "DescribeCapacityReservations"
        self._call(op, {"CapacityReservationIds": CapacityReservationIds})
        missing = [i for i in CapacityReservationIds if i not in self.reservations]
        if missing:
            message = f"The capacity reservation ID '{missing[0]}' does not exist"
            raise self._error(op, "InvalidCapacityReservationId.NotFound", message)
        wanted = set(CapacityReservationIds)
        items = [r for key, r in self.reservations.items() if not wanted or key in wanted]
        page, token = self._page(op, NextToken, MaxResults or 1000, lambda: items)
        return {"CapacityReservations": page, **({"NextToken": token} if token else {})}


# ---------------------------------------------------------------------------------------------
# Auto Scaling


@dataclass
class FakeGroup:
    name: str
    min_size: int
    max_size: int
    members: dict[str, bool] = field(default_factory=dict)  # instance id -> protected from scale-in
    desired: int = 0


class FakeAutoScaling(FakeClient):
    service = "autoscaling"
    paginators: ClassVar[dict[str, tuple[str, str]]] = {
        "describe_auto_scaling_instances": ("describe_auto_scaling_instances", "MaxRecords"),
        "describe_auto_scaling_groups": ("describe_auto_scaling_groups", "MaxRecords"),
    }

    def __init__(self, ec2: FakeEC2) -> None:
        super().__init__()
        self.ec2 = ec2
        self.groups: dict[str, FakeGroup] = {}
        self.group_of: dict[str, str] = {}

    def add_group(self, name: str, *, min_size: int = 0, max_size: int = 1000) -> FakeGroup:
        self.groups[name] = FakeGroup(name, min_size, max_size)
        return self.groups[name]

    def attach(self, group: str, instance_id: str, *, protected: bool = False) -> None:
        g = self.groups[group]
        g.members[instance_id] = protected
        g.desired = len(g.members)
        self.group_of[instance_id] = group

    def protected(self, instance_id: str) -> bool:
        return self.groups[self.group_of[instance_id]].members[instance_id]

    def _validation(self, operation: str, message: str) -> ClientError:
        return self._error(operation, "ValidationError", message)

    @api
    def describe_auto_scaling_instances(
        self,
        InstanceIds: Sequence[str] | None = None,
        MaxRecords: int | None = None,
        NextToken: str | None = None,
    ) -> dict[str, Any]:
        op = "DescribeAutoScalingInstances"
        self._call(op, {"InstanceIds": list(InstanceIds or []), "MaxRecords": MaxRecords})
        if InstanceIds is not None and len(InstanceIds) > 50:
            raise self._validation(op, "The number of instance IDs must not exceed 50.")
        if MaxRecords is not None and not 1 <= MaxRecords <= 50:
            raise self._validation(op, "MaxRecords must be between 1 and 50.")

        def everything() -> list[dict[str, Any]]:
            ids = InstanceIds if InstanceIds is not None else list(self.group_of)
            return [self._describe_member(i) for i in ids if i in self.group_of]  # unknown ids are ignored

        page, token = self._page(op, NextToken, MaxRecords or 50, everything)
        return {"AutoScalingInstances": page, **({"NextToken": token} if token else {})}

    def _describe_member(self, instance_id: str) -> dict[str, Any]:
        group = self.group_of[instance_id]
        return {
            "InstanceId": instance_id,
            "InstanceType": self.ec2.instances[instance_id].instance_type if instance_id in self.ec2.instances else "",
            "AutoScalingGroupName": group,
            "AvailabilityZone": f"{REGION}a",
            "LifecycleState": "InService",
            "HealthStatus": "HEALTHY",
            "ProtectedFromScaleIn": self.groups[group].members[instance_id],
        }

    @api
    def describe_auto_scaling_groups(
        self,
        AutoScalingGroupNames: Sequence[str] | None = None,
        MaxRecords: int | None = None,
        NextToken: str | None = None,
    ) -> dict[str, Any]:
        op = "DescribeAutoScalingGroups"
        self._call(op, {"AutoScalingGroupNames": list(AutoScalingGroupNames or []), "MaxRecords": MaxRecords})
        if MaxRecords is not None and not 1 <= MaxRecords <= 100:
            raise self._validation(op, "MaxRecords must be between 1 and 100.")
        # "By default, you can only specify up to 50 names. You can optionally increase this limit
        # using the MaxRecords property." (AutoScaling API reference)
        if AutoScalingGroupNames is not None and len(AutoScalingGroupNames) > (MaxRecords or 50):
            raise self._validation(
                op, f"The number of group names ({len(AutoScalingGroupNames)}) exceeds MaxRecords ({MaxRecords or 50})."
            )

        def everything() -> list[dict[str, Any]]:
            names = AutoScalingGroupNames if AutoScalingGroupNames is not None else sorted(self.groups)
            return [self._describe_group(self.groups[n]) for n in names if n in self.groups]

        page, token = self._page(op, NextToken, MaxRecords or 50, everything)
        return {"AutoScalingGroups": page, **({"NextToken": token} if token else {})}

    def _describe_group(self, g: FakeGroup) -> dict[str, Any]:
        return {
            "AutoScalingGroupName": g.name,
            "MinSize": g.min_size,
            "MaxSize": g.max_size,
            "DesiredCapacity": g.desired,
            "Instances": [
                {"InstanceId": i, "LifecycleState": "InService", "ProtectedFromScaleIn": p}
                for i, p in g.members.items()
            ],
        }

    @api
    def set_instance_protection(
        self,
        InstanceIds: Sequence[str],
        AutoScalingGroupName: str,
        ProtectedFromScaleIn: bool,
    ) -> dict[str, Any]:
        op = "SetInstanceProtection"
        self._call(
            op,
            {
                "InstanceIds": list(InstanceIds),
                "AutoScalingGroupName": AutoScalingGroupName,
                "ProtectedFromScaleIn": ProtectedFromScaleIn,
            },
        )
        if len(InstanceIds) > 50:
            raise self._validation(op, "The number of instance IDs must not exceed 50.")
        group = self.groups.get(AutoScalingGroupName)
        if group is None:
            raise self._validation(op, f"AutoScalingGroup name not found - {AutoScalingGroupName}")
        for i in InstanceIds:
            if i not in group.members:
                message = f"The instance {i} is not part of Auto Scaling group {AutoScalingGroupName}."
                raise self._validation(op, message)
        for i in InstanceIds:
            group.members[i] = ProtectedFromScaleIn
        return {}

    @api
    def terminate_instance_in_auto_scaling_group(
        self,
        InstanceId: str,
        ShouldDecrementDesiredCapacity: bool,
    ) -> dict[str, Any]:
        op = "TerminateInstanceInAutoScalingGroup"
        self._call(op, {"InstanceId": InstanceId, "ShouldDecrementDesiredCapacity": ShouldDecrementDesiredCapacity})
        name = self.group_of.get(InstanceId)
        if name is None:
            message = f"Instance Id not found - No managed instance found for instance ID: {InstanceId}"
            raise self._validation(op, message)
        group = self.groups[name]
        if ShouldDecrementDesiredCapacity and group.desired - 1 < group.min_size:
            raise self._validation(
                op,
                f"Currently, desiredSize equals minSize ({group.min_size}). Terminating instance without replacement "
                "will violate group's min size constraint.",
            )
        del group.members[InstanceId]
        del self.group_of[InstanceId]
        if ShouldDecrementDesiredCapacity:
            group.desired -= 1
        if InstanceId in self.ec2.instances:
            self.ec2.instances[InstanceId].set_state("shutting-down")
        activity = {"ActivityId": f"act-{InstanceId}", "AutoScalingGroupName": name, "StatusCode": "InProgress"}
        return {"Activity": activity}
