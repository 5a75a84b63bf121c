"""EC2's real answers where moto differs, and a way to put them in front of moto.

moto stops a one-time Spot instance, reports every root device as EBS, always starts a stopped machine and has
no DescribeCapacityReservations. Real EC2 answers with the codes and messages below (as EC2 words them; the ids
and types are filled in). `Ec2Answers` registers on boto3's default session, so every EC2 client the code
under test creates afterwards (a sweep's, a Slack answer's) meets them before moto does; the in-memory
FakeEC2 (testkit/aws/fleet.py) answers the same way.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import boto3


@dataclass(frozen=True)
class Answer:
    code: str
    message: str
    status: int = 400


def one_time_spot_stop(instance_id: str) -> Answer:
    """StopInstances (and Hibernate) on an instance of a one-time Spot request."""
    return Answer(
        "UnsupportedOperation",
        f"You can't stop the Spot Instance '{instance_id}' because it is associated with a one-time Spot Instance "
        "request. You can only stop Spot Instances associated with persistent Spot Instance requests.",
    )


def instance_store_stop(instance_id: str) -> Answer:
    """StopInstances on an instance whose root device is instance store."""
    return Answer(
        "UnsupportedOperation",
        f"The instance '{instance_id}' does not have an 'ebs' root device type and cannot be stopped.",
    )


def hibernation_not_configured(instance_id: str) -> Answer:
    """StopInstances with Hibernate=true on an instance not configured for hibernation at launch."""
    return Answer(
        "UnsupportedHibernationConfiguration",
        f"The instance can't be hibernated because it was not configured at launch for hibernation: {instance_id}",
    )


def insufficient_capacity(instance_type: str, zone: str = "us-east-1a", others: str = "us-east-1b") -> Answer:
    """StartInstances (or RunInstances) when the zone has no capacity of the type: a server error (500)."""
    return Answer(
        "InsufficientInstanceCapacity",
        f"We currently do not have sufficient {instance_type} capacity in the Availability Zone you requested "
        f"({zone}). Our system will be working on provisioning additional capacity. You can currently get "
        f"{instance_type} capacity by not specifying an Availability Zone in your request or choosing {others}.",
        500,
    )


def insufficient_capacity_on_host(host: str = "h-0123456789abcdef0") -> Answer:
    """StartInstances of an instance on a Dedicated Host without room for it."""
    return Answer(
        "InsufficientCapacityOnHost",
        f"Dedicated host {host} has insufficient capacity to launch the instances in this request.",
    )


def unsupported(instance_type: str, zone: str = "us-east-1e") -> Answer:
    """StartInstances when the type is (no longer) offered in the machine's zone."""
    return Answer(
        "Unsupported",
        f"Your requested instance type ({instance_type}) is not supported in your requested Availability Zone "
        f"({zone}). Please retry your request by not specifying an Availability Zone or choosing us-east-1a, "
        "us-east-1b, us-east-1c, us-east-1d, us-east-1f.",
    )


def throttled() -> Answer:
    return Answer("RequestLimitExceeded", "Request limit exceeded.", 503)


def denied(action: str) -> Answer:
    return Answer(
        "UnauthorizedOperation",
        f"You are not authorized to perform this operation. User: arn:aws:sts::123456789012:assumed-role/"
        f"idle-reaper-sweep/idle-reaper is not authorized to perform: ec2:{action} because no identity-based "
        f"policy allows the ec2:{action} action",
        403,
    )


def spot_request(
    request_id: str,
    instance_id: str,
    *,
    request_type: str = "one-time",
    interruption: str = "terminate",
    price: str = "0.500000",
    state: str = "active",
) -> dict[str, Any]:
    """A DescribeSpotInstanceRequests item as botocore parses it."""
    return {
        "SpotInstanceRequestId": request_id,
        "InstanceId": instance_id,
        "Type": request_type,
        "InstanceInterruptionBehavior": interruption,
        "State": state,
        "SpotPrice": price,
        "Status": {"Code": "fulfilled", "Message": "Your spot request is fulfilled."},
    }


def capacity_reservation(
    reservation_id: str,
    instance_type: str,
    *,
    end: datetime | None = None,
    block: bool = False,
    state: str = "active",
    total: int = 1,
    available: int = 0,
) -> dict[str, Any]:
    """A DescribeCapacityReservations item as botocore parses it (moto has none)."""
    item: dict[str, Any] = {
        "CapacityReservationId": reservation_id,
        "OwnerId": "123456789012",
        "InstanceType": instance_type,
        "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": "us-east-1a",
        "Tenancy": "default",
        "TotalInstanceCount": total,
        "AvailableInstanceCount": available,
        "State": state,
        "EndDateType": "limited" if end else "unlimited",
        "InstanceMatchCriteria": "targeted" if block else "open",
        "ReservationType": "capacity-block" if block else "default",
    }
    if end is not None:
        item["EndDate"] = end
    return item


class _Http:
    """The little of an HTTP response botocore reads from a before-call answer."""

    def __init__(self, status: int) -> None:
        self.status_code = status
        self.headers: dict[str, str] = {}
        self.content = b""
        self.raw = None


def _ids(body: Mapping[str, Any], prefix: str) -> list[str]:
    """Values of a serialized EC2 query list (InstanceId.1, InstanceId.2, ...)."""
    return [str(v) for k, v in sorted(body.items()) if k.startswith(prefix + ".")]


@dataclass
class Ec2Answers:
    """What EC2 answers in front of moto. `refuse_stop` / `refuse_start`: instance id -> the answer to any
    StopInstances / StartInstances naming it (all or nothing, as EC2: one refused id fails the call).
    `reservations`: what DescribeCapacityReservations lists. `fail`: operation -> an answer to every call."""

    refuse_stop: dict[str, Answer] = field(default_factory=dict)
    refuse_start: dict[str, Answer] = field(default_factory=dict)
    reservations: dict[str, dict[str, Any]] = field(default_factory=dict)
    fail: dict[str, Answer] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)  # operation -> calls seen
    named: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (operation, instance ids) per call
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)  # (operation, instance id) answered no
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stop_calls_naming(self, instance_id: str) -> int:
        return sum(1 for op, ids in self.named if op == "StopInstances" and instance_id in ids)

    def calls_naming(self, operation: str, instance_id: str) -> int:
        return sum(1 for op, ids in self.named if op == operation and instance_id in ids)

    def before_call(self, model: Any, params: Mapping[str, Any], **_: Any) -> tuple[_Http, dict[str, Any]] | None:
        operation = model.name
        body = params.get("body") or {}
        body = body if isinstance(body, Mapping) else {}
        ids = tuple(_ids(body, "InstanceId"))
        with self._lock:
            self.calls[operation] += 1
            self.named.append((operation, ids))
        if operation in self.fail:
            return self._error(self.fail[operation])
        refusals = {"StopInstances": self.refuse_stop, "StartInstances": self.refuse_start}.get(operation, {})
        for instance_id in ids:
            if instance_id in refusals:
                with self._lock:
                    self.refused[(operation, instance_id)] += 1
                return self._error(refusals[instance_id])
        if operation == "DescribeCapacityReservations":
            wanted = set(_ids(body, "CapacityReservationId"))
            items = [r for key, r in self.reservations.items() if not wanted or key in wanted]
            return _Http(200), {"CapacityReservations": items, "ResponseMetadata": {"HTTPStatusCode": 200}}
        return None

    @staticmethod
    def _error(answer: Answer) -> tuple[_Http, dict[str, Any]]:
        return _Http(answer.status), {
            "Error": {"Code": answer.code, "Message": answer.message},
            "ResponseMetadata": {"HTTPStatusCode": answer.status},
        }


# ---------------------------------------------------------------------------------------------
# Machines of each kind in moto (its backend runs in this process, as tools/idle_reaper_tools/local.py uses it)


def _moto_instance(instance_id: str) -> Any:
    from moto.ec2.models import ec2_backends

    return ec2_backends["123456789012"]["us-east-1"].get_instance(instance_id)


def make_spot(instance_id: str, *, request_type: str = "one-time", interruption: str = "terminate") -> str:
    """Make a launched machine a Spot instance of a new Spot request of that type; the request's id."""
    ec2: Any = boto3.client("ec2")
    request = ec2.request_spot_instances(
        InstanceCount=1,
        Type=request_type,
        InstanceInterruptionBehavior=interruption,
        SpotPrice="0.5",
        LaunchSpecification={"ImageId": "ami-12345678", "InstanceType": "m5.large"},
    )["SpotInstanceRequests"][0]
    # moto launched an instance of its own for the request: the request now stands behind ours instead.
    ec2.terminate_instances(InstanceIds=[request["InstanceId"]])
    from moto.ec2.models import ec2_backends

    backend = ec2_backends["123456789012"]["us-east-1"]
    backend.spot_instance_requests[request["SpotInstanceRequestId"]].instance = _moto_instance(instance_id)
    machine = _moto_instance(instance_id)
    machine.instance_lifecycle = "spot"
    machine.spot_instance_request_id = request["SpotInstanceRequestId"]
    return str(request["SpotInstanceRequestId"])


def set_instance(instance_id: str, **attributes: Any) -> None:
    """Set what DescribeInstances reports of a moto instance: root_device_type, capacity_reservation_id, ..."""
    machine = _moto_instance(instance_id)
    for name, value in attributes.items():
        setattr(machine, name, value)


@contextmanager
def real_ec2_answers() -> Iterator[Ec2Answers]:
    """EC2's answers in front of moto for every EC2 client created inside the block (boto3's default session:
    botocore copies a session's handlers into each client it creates)."""
    answers = Ec2Answers()
    session: Any = boto3._get_default_session()._session  # where clients inherit handlers from
    session.register("before-call.ec2", answers.before_call, unique_id="idle-reaper-real-ec2-answers")
    try:
        yield answers
    finally:
        session.unregister("before-call.ec2", unique_id="idle-reaper-real-ec2-answers")
