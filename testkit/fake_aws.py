"""In-memory fakes of the boto3 clients idle-reaper's adapters use, fast enough for 50,000 machines.

They answer like the real APIs where the adapters care: the same request and response shapes, the
documented per-call limits (raised as botocore ClientError with the real error codes), pagination
with NextToken, and the failure modes the sweep must survive. Every fake counts its calls per API
operation (`calls`, a Counter) and keeps the request arguments (`requests`) so tests can assert how
the adapters batched their work.

A fake raises what botocore would raise once its own retries are exhausted: an injected Throttling
error is "throttled even after the standard retry mode gave up".

    aws = FakeAws()
    aws.launch("g5.xlarge", team="ml", profile=steady(2.0, 90.0), launch_time=...)
    adapters = aws.adapters()           # the real PolicyStore, Fleet, MetricsReader over the fakes
    run_sweep(adapters, now=...)
    aws.calls()                         # Counter({"cloudwatch:GetMetricData": 2, ...})
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from botocore.exceptions import ClientError

from idle_reaper.aws import (
    DDB_BATCH_GET,
    DDB_WORKERS,
    AuditEntry,
    Concurrency,
    Fleet,
    InMemoryStateStore,
    MetricsReader,
    PolicyStore,
    run_concurrently,
)
from idle_reaper.core import MachineRecord
from idle_reaper.notify import LoggingNotifier, Notifier
from idle_reaper.sweep import Adapters, logger
from testkit import ec2_answers
from testkit.ec2_answers import Answer

ACCOUNT = "123456789012"
REGION = "us-east-1"

# A utilization profile: period start -> (cpu %, gpu % or None, network in bytes, network out bytes,
# minutes since a person's last input).
# Shorter tuples are fine: a missing or None entry means that metric has no datapoints.
Profile = Callable[[datetime], Sequence[float | None]]


def steady(cpu: float, gpu: float | None = None) -> Profile:
    values = (cpu, gpu)
    return lambda t: values


def quiet_after(change: datetime, before: Sequence[float | None], after: Sequence[float | None]) -> Profile:
    """Busy (`before`) until `change`, then `after` (typically quiet)."""
    before, after = tuple(before), tuple(after)
    return lambda t: before if t < change else after


def client_error(operation: str, code: str, message: str = "", status: int = 400) -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": message or code},
        "ResponseMetadata": {"HTTPStatusCode": status, "RequestId": "fake-request", "RetryAttempts": 0},
    }
    return ClientError(response, operation)


# ---------------------------------------------------------------------------------------------
# Shared machinery: call counting, fault injection, NextToken cursors, paginators


# In-region latency of one call (seconds), as issue 13 states them. A DynamoDB "page" is one BatchGetItem,
# BatchWriteItem or Query response.
LATENCY: dict[str, float] = {
    "dynamodb:PutItem": 0.004,
    "dynamodb:GetItem": 0.004,
    "dynamodb:DeleteItem": 0.004,
    "dynamodb:BatchGetItem": 0.010,
    "dynamodb:BatchWriteItem": 0.010,
    "dynamodb:Query": 0.010,
    "cloudwatch:GetMetricData": 0.6,
    "ec2:DescribeInstances": 0.25,
    "autoscaling:DescribeAutoScalingGroups": 0.2,
    "autoscaling:DescribeAutoScalingInstances": 0.2,
    "autoscaling:SetInstanceProtection": 0.2,
    "autoscaling:TerminateInstanceInAutoScalingGroup": 0.2,
    "ec2:StopInstances": 0.3,
    "ec2:StartInstances": 0.3,
    "ec2:TerminateInstances": 0.3,
    "ec2:DescribeSpotInstanceRequests": 0.25,
    "ec2:DescribeCapacityReservations": 0.25,
    "ssm:GetParameter": 0.03,
    "ssm:GetParametersByPath": 0.03,
    "ssm:PutParameter": 0.03,
    "states:StartExecution": 0.02,
    "states:InvokeLambda": 0.02,  # the state machine starting a shard worker or the gather step
    "sqs:SendMessageBatch": 0.02,
}


class LatencyModel:
    """Charges every fake call its in-region latency (LATENCY), in one of two ways:

    sleep=True   really sleeps it on the calling thread, and the code's own thread pools overlap the sleeps:
                 wall time is then measured, not modelled (the check of the model, at small sizes);
    sleep=False  adds it to a virtual clock. `install()` replaces the pools (aws.Concurrency.runner) by a
                 runner that runs the tasks one after another but schedules them on as many virtual lanes
                 as the pool has threads (each task starts on the lane that frees first), so the virtual
                 clock advances by what the real pool would overlap. Modelled wall = virtual latency plus
                 the code's own CPU time (serial, as under the GIL).
    """

    def __init__(self, *, sleep: bool = False, latency: Mapping[str, float] = LATENCY) -> None:
        self.sleep = sleep
        self.latency = dict(latency)
        self.virtual = 0.0  # seconds of modelled latency on the current lane
        self.charged: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._saved: Any = None

    def charge(self, operation: str, times: int = 1) -> None:
        seconds = self.latency.get(operation, 0.0) * times
        with self._lock:
            self.charged[operation] += times
        if self.sleep:
            time.sleep(seconds)
        else:
            self.virtual += seconds

    def lanes(self, fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
        start = self.virtual
        free = [start] * max(1, min(workers, len(items)))
        results = []
        for item in items:
            lane = heapq.heappop(free)
            self.virtual = lane
            results.append(fn(item))
            heapq.heappush(free, self.virtual)
        self.virtual = max(free)
        return results

    def install(self) -> None:
        """Model the pools (sleep=False only; with sleep=True the real thread pools run)."""
        if not self.sleep:
            self._saved = Concurrency.runner
            Concurrency.runner = self.lanes  # type: ignore[assignment]

    def uninstall(self) -> None:
        if self._saved is not None:
            Concurrency.runner = self._saved
            self._saved = None


def api(method: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Marks an API operation: the time spent inside it is the fake's, not the code under test's. With a
    latency model, the call is charged its latency first (outside the fake's lock, so sleeps overlap)."""

    @functools.wraps(method)
    def timed(self: FakeClient, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self.latency is not None:
            self.latency.charge(f"{self.service}:{_operation_name(method.__name__)}")
        with self._lock:
            started = time.thread_time()  # CPU, so other processes on the machine do not inflate it
            try:
                return method(self, *args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started

    return timed


def _operation_name(method: str) -> str:
    return "".join(part.capitalize() for part in method.split("_"))


class FakeClient:
    service = ""
    # boto3 paginator name -> (method, parameter that PaginationConfig.PageSize sets)
    paginators: ClassVar[dict[str, tuple[str, str]]] = {}
    _invalid_token_code = "InvalidNextToken"  # what this service answers to a token it did not issue

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.seconds = 0.0  # CPU time spent inside this fake's operations
        self.latency: LatencyModel | None = None
        self._lock = threading.RLock()  # the adapters call from several threads
        self.errors: Counter[tuple[str, str]] = Counter()  # (operation, error code) raised
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._faults: dict[str, tuple[set[int] | None, str, str]] = {}
        self._cursors: dict[str, Any] = {}
        self._tokens = itertools.count(1)

    def inject(self, operation: str, code: str, *, on_calls: Iterable[int] | None = None, message: str = "") -> None:
        """Make `operation` raise `code` on the given 1-based call numbers (every call when None)."""
        self._faults[operation] = (set(on_calls) if on_calls is not None else None, code, message)

    def clear_faults(self) -> None:
        self._faults.clear()

    def requests_of(self, operation: str) -> list[dict[str, Any]]:
        return [kw for op, kw in self.requests if op == operation]

    def _call(self, operation: str, kwargs: dict[str, Any]) -> None:
        self.calls[operation] += 1
        self.requests.append((operation, kwargs))
        fault = self._faults.get(operation)
        if fault and (fault[0] is None or self.calls[operation] in fault[0]):
            raise self._error(operation, fault[1], fault[2] or ("Rate exceeded" if "Throttl" in fault[1] else ""))

    def _error(self, operation: str, code: str, message: str = "") -> ClientError:
        self.errors[(operation, code)] += 1
        return client_error(operation, code, message)

    def _page(
        self, operation: str, token: str | None, limit: int, items: Callable[[], list[Any]]
    ) -> tuple[list[Any], str | None]:
        """One page of `items()` (computed once, on the first call) and the token for the next."""
        if token:
            if token not in self._cursors:
                raise self._error(operation, self._invalid_token_code, f"Invalid NextToken: {token}")
            everything, offset = self._cursors.pop(token)
        else:
            everything, offset = items(), 0
        page = everything[offset : offset + limit]
        offset += limit
        if offset >= len(everything):
            return page, None
        next_token = f"{operation}-{next(self._tokens)}"
        self._cursors[next_token] = (everything, offset)
        return page, next_token

    def get_paginator(self, name: str) -> _Paginator:
        if name not in self.paginators:
            raise NotImplementedError(f"fake {self.service} has no paginator {name!r}")
        method, limit_key = self.paginators[name]
        return _Paginator(getattr(self, method), limit_key)


class _Paginator:
    def __init__(self, method: Callable[..., dict[str, Any]], limit_key: str) -> None:
        self.method = method
        self.limit_key = limit_key

    def paginate(self, PaginationConfig: dict[str, Any] | None = None, **kwargs: Any) -> Iterator[dict[str, Any]]:
        if PaginationConfig and "PageSize" in PaginationConfig:
            kwargs[self.limit_key] = PaginationConfig["PageSize"]
        token = None
        while True:
            page = self.method(**kwargs, **({"NextToken": token} if token else {}))
            yield page
            token = page.get("NextToken")
            if not token:
                return


# ---------------------------------------------------------------------------------------------
# EC2


_STATE_CODES = {"pending": 0, "running": 16, "shutting-down": 32, "terminated": 48, "stopping": 64, "stopped": 80}


@dataclass
class FakeInstance:
    instance_id: str
    instance_type: str
    launch_time: datetime
    tags: dict[str, str]
    hibernation_configured: bool = False
    state: str = "running"
    api: dict[str, Any] = field(default_factory=dict)  # the DescribeInstances item, built once
    # What makes a machine another kind (machine_kinds.py): set with FakeEC2.make_* before a sweep lists it.
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
            "Placement": {"AvailabilityZone": f"{REGION}a", "Tenancy": "default"},
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
        self.spot_requests[request_id] = {
            "SpotInstanceRequestId": request_id,
            "InstanceId": instance_id,
            "Type": request_type,
            "InstanceInterruptionBehavior": interruption,
            "State": "active",
            "SpotPrice": price,
            "Status": {"Code": "fulfilled", "Message": "Your spot request is fulfilled."},
        }
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
        """DescribeInstances filters: AND across filters, OR across one filter's values."""
        wanted: list[tuple[str, set[str]]] = []
        for f in filters:
            name = f["Name"]
            if name not in ("instance-state-name", "tag-key", "instance-id") and not name.startswith("tag:"):
                raise self._error("DescribeInstances", "InvalidParameterValue", f"The filter '{name}' is invalid")
            wanted.append((name, set(f["Values"])))

        def matches(inst: FakeInstance) -> bool:
            for name, values in wanted:
                if name == "instance-state-name":
                    ok = inst.state in values
                elif name == "tag-key":
                    ok = not values.isdisjoint(inst.tags)
                elif name == "instance-id":
                    ok = inst.instance_id in values
                else:
                    ok = inst.tags.get(name[4:]) in values
                if not ok:
                    return False
            return True

        return matches

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
            pool = [self.instances[i] for i in InstanceIds] if InstanceIds else self.instances.values()
            return [inst for inst in pool if match(inst)]

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


# ---------------------------------------------------------------------------------------------
# CloudWatch


_QUERY_ID = re.compile(r"^[a-z][a-zA-Z0-9_]*$")
_STATS = {"Average", "Maximum", "Minimum", "Sum", "SampleCount"}

DEFAULT_METRICS = {
    ("AWS/EC2", "CPUUtilization"): 0,
    ("CWAgent", "nvidia_smi_utilization_gpu"): 1,
    ("AWS/EC2", "NetworkIn"): 2,
    ("AWS/EC2", "NetworkOut"): 3,
    ("CWAgent", "idle_reaper_minutes_since_input"): 4,  # the activity collector's minutes since input
}


class FakeCloudWatch(FakeClient):
    """GetMetricData over per-instance profiles. A datapoint for the period starting at t exists once
    t + period + `delay` has passed (EndTime is the clock) and t is not before the launch."""

    service = "cloudwatch"
    MAX_QUERIES = 500
    MAX_DATAPOINTS = 100_800

    def __init__(
        self,
        metrics: dict[tuple[str, str], int] | None = None,
        *,
        points_per_call: int = MAX_DATAPOINTS,
        delay: timedelta = timedelta(minutes=2),
    ) -> None:
        super().__init__()
        self.metric_index = dict(metrics or DEFAULT_METRICS)
        self.points_per_call = points_per_call
        self.delay = delay
        self.profiles: dict[str, Profile] = {}
        self.data_from: dict[str, datetime] = {}
        self.partial_data: set[str] = set()  # queries for these instances end PartialData after the last page
        self.throttled: set[str] = set()  # any call querying these instances raises Throttling
        self.metrics_requested = 0  # what GetMetricData bills: one per query per call
        self._grids: dict[tuple[datetime, datetime, int], tuple[list[int], list[datetime]]] = {}
        self.datapoints_returned = 0

    def add(self, instance_id: str, profile: Profile, data_from: datetime) -> None:
        self.profiles[instance_id] = profile
        self.data_from[instance_id] = data_from

    @api
    def get_metric_data(
        self,
        MetricDataQueries: Sequence[dict[str, Any]],
        StartTime: datetime,
        EndTime: datetime,
        NextToken: str | None = None,
        ScanBy: str = "TimestampDescending",
        **_: Any,
    ) -> dict[str, Any]:
        op = "GetMetricData"
        self._call(
            op,
            {
                "MetricDataQueries": MetricDataQueries,
                "StartTime": StartTime,
                "EndTime": EndTime,
                "NextToken": NextToken,
            },
        )
        self.metrics_requested += len(MetricDataQueries)
        self._validate(MetricDataQueries, StartTime, EndTime)
        if self.throttled and any(self._instance(q) in self.throttled for q in MetricDataQueries):
            raise self._error(op, "Throttling", "Rate exceeded")
        if NextToken:
            if NextToken not in self._cursors:
                raise self._error(op, "InvalidNextToken", "The service cannot decode the token")
            series, qi, pi = self._cursors.pop(NextToken)
            if len(series) != len(MetricDataQueries):
                raise self._error(op, "InvalidNextToken", "NextToken does not match the queries")
        else:
            series, qi, pi = self._series(MetricDataQueries, StartTime, EndTime, ScanBy == "TimestampAscending"), 0, 0
        budget = self.points_per_call
        results = []
        while qi < len(series) and budget > 0:
            query_id, label, timestamps, values, partial = series[qi]
            take = min(budget, len(timestamps) - pi)
            done = pi + take >= len(timestamps)
            results.append(
                {
                    "Id": query_id,
                    "Label": label,
                    "Timestamps": timestamps[pi : pi + take],
                    "Values": values[pi : pi + take],
                    "StatusCode": "PartialData" if partial or not done else "Complete",
                }
            )
            budget -= take
            self.datapoints_returned += take
            qi, pi = (qi + 1, 0) if done else (qi, pi + take)
        out: dict[str, Any] = {"MetricDataResults": results, "Messages": []}
        if qi < len(series):
            token = f"gmd-{next(self._tokens)}"
            self._cursors[token] = (series, qi, pi)
            out["NextToken"] = token
        return out

    def _validate(self, queries: Sequence[dict[str, Any]], start: datetime, end: datetime) -> None:
        op = "GetMetricData"
        if not queries:
            raise self._error(op, "ValidationError", "The parameter MetricDataQueries is required.")
        if len(queries) > self.MAX_QUERIES:
            raise self._error(
                op, "ValidationError", "The collection MetricDataQueries must not have a size greater than 500."
            )
        if start >= end:
            raise self._error(op, "ValidationError", "The parameter StartTime must be less than the parameter EndTime.")
        ids = [q["Id"] for q in queries]
        if len(set(ids)) != len(ids):
            raise self._error(op, "ValidationError", "The values for parameter Id in MetricDataQueries are not unique.")
        for q in queries:
            if not _QUERY_ID.match(q["Id"]):
                raise self._error(op, "ValidationError", f"Invalid metric data query Id {q['Id']!r}")
            stat = q["MetricStat"]
            if stat["Period"] % 60 or stat["Stat"] not in _STATS:
                raise self._error(op, "ValidationError", f"Invalid Period or Stat in query {q['Id']}")

    @staticmethod
    def _instance(query: dict[str, Any]) -> str | None:
        dims = query["MetricStat"]["Metric"].get("Dimensions", [])
        if len(dims) == 1 and dims[0]["Name"] == "InstanceId":
            return str(dims[0]["Value"])
        return None  # any other dimension set is a different metric: no data here

    def _series(
        self, queries: Sequence[dict[str, Any]], start: datetime, end: datetime, ascending: bool
    ) -> list[tuple[str, str, list[datetime], list[float], bool]]:
        series = []
        rows: dict[tuple[str, int], list[tuple[datetime, Sequence[float | None]]]] = {}
        for q in queries:
            stat = q["MetricStat"]
            metric, period = stat["Metric"], int(stat["Period"])
            index = self.metric_index.get((metric["Namespace"], metric["MetricName"]))
            instance = self._instance(q)
            timestamps: list[datetime] = []
            values: list[float] = []
            if index is not None and instance in self.profiles:
                key = (instance, period)
                if key not in rows:  # the profile is evaluated once per instance per call
                    profile = self.profiles[instance]
                    rows[key] = [(t, profile(t)) for t in self._grid(start, end, period, self.data_from[instance])]
                for t, sample in rows[key]:
                    if index < len(sample) and sample[index] is not None:
                        timestamps.append(t)
                        values.append(float(sample[index]))  # type: ignore[arg-type]
            if not ascending:
                timestamps.reverse()
                values.reverse()
            label = f"{metric['MetricName']} {instance}"
            series.append((q["Id"], label, timestamps, values, instance in self.partial_data))
        return series

    def _grid(self, start: datetime, end: datetime, period: int, data_from: datetime) -> list[datetime]:
        key = (start, end, period)
        if key not in self._grids:  # the same for every instance of a sweep: built once
            first = math.ceil(start.timestamp() / period) * period
            last_end = (end - self.delay).timestamp()  # the newest published period ends before this
            epochs = list(range(first, int(last_end) - period + 1, period))
            self._grids = {key: (epochs, [datetime.fromtimestamp(e, tz=UTC) for e in epochs])}
        epochs, times = self._grids[key]
        return times[bisect.bisect_left(epochs, data_from.timestamp()) :]


# ---------------------------------------------------------------------------------------------
# SSM Parameter Store


class FakeSSM(FakeClient):
    service = "ssm"
    paginators: ClassVar[dict[str, tuple[str, str]]] = {
        "get_parameters_by_path": ("get_parameters_by_path", "MaxResults")
    }
    _invalid_token_code = "ValidationException"

    def __init__(self) -> None:
        super().__init__()
        self.parameters: dict[str, dict[str, Any]] = {}

    @api
    def get_parameter(self, Name: str, WithDecryption: bool = False) -> dict[str, Any]:
        self._call("GetParameter", {"Name": Name})
        if Name not in self.parameters:
            raise self._error("GetParameter", "ParameterNotFound", f"Parameter {Name} not found.")
        return {"Parameter": dict(self.parameters[Name])}

    @api
    def get_parameters_by_path(
        self,
        Path: str,
        Recursive: bool = False,
        MaxResults: int | None = None,
        NextToken: str | None = None,
        WithDecryption: bool = False,
    ) -> dict[str, Any]:
        op = "GetParametersByPath"
        self._call(op, {"Path": Path, "Recursive": Recursive, "MaxResults": MaxResults})
        if MaxResults is not None and not 1 <= MaxResults <= 10:
            raise self._error(
                op, "ValidationException", "1 validation error detected: Value at 'maxResults' must be <= 10"
            )
        if not Path.startswith("/"):
            raise self._error(op, "ValidationException", "The parameter doesn't meet the parameter name requirements.")
        base = Path.rstrip("/") + "/"

        def everything() -> list[dict[str, Any]]:
            under = [n for n in sorted(self.parameters) if n.startswith(base)]
            if not Recursive:
                under = [n for n in under if "/" not in n[len(base) :]]
            return [dict(self.parameters[n]) for n in under]

        page, token = self._page(op, NextToken, MaxResults or 10, everything)
        return {"Parameters": page, **({"NextToken": token} if token else {})}

    @api
    def put_parameter(
        self,
        Name: str,
        Value: str,
        Type: str = "String",
        Overwrite: bool = False,
        **_: Any,
    ) -> dict[str, Any]:
        op = "PutParameter"
        self._call(op, {"Name": Name, "Value": Value, "Type": Type, "Overwrite": Overwrite})
        if len(Value.encode()) > 4096:
            raise self._error(op, "ValidationException", "Standard tier parameters support a maximum of 4 KB")
        if Name in self.parameters and not Overwrite:
            raise self._error(op, "ParameterAlreadyExists", "The parameter already exists.")
        return {"Version": self.store(Name, Value, Type), "Tier": "Standard"}

    def store(self, name: str, value: str, type_: str = "String") -> int:
        """Set a parameter directly (seeding; not counted as a call). Returns its new version."""
        existing = self.parameters.get(name)
        version = int(existing["Version"]) + 1 if existing else 1
        self.parameters[name] = {
            "Name": name,
            "Type": type_,
            "Value": value,
            "Version": version,
            "LastModifiedDate": datetime.now(UTC),
            "ARN": f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter{name}",
            "DataType": "text",
        }
        return version


# ---------------------------------------------------------------------------------------------
# The account: all fakes together, plus the real adapters over them

WRITE_OPERATIONS = frozenset(
    {
        "ec2:StopInstances",
        "ec2:TerminateInstances",
        "autoscaling:SetInstanceProtection",
        "autoscaling:TerminateInstanceInAutoScalingGroup",
        "ssm:PutParameter",
    }
)


class FakeAws:
    def __init__(
        self, *, points_per_call: int = FakeCloudWatch.MAX_DATAPOINTS, latency: LatencyModel | None = None
    ) -> None:
        self.ec2 = FakeEC2()
        self.autoscaling = FakeAutoScaling(self.ec2)
        self.cloudwatch = FakeCloudWatch(points_per_call=points_per_call)
        self.ssm = FakeSSM()
        self.set_latency(latency)

    def set_latency(self, latency: LatencyModel | None) -> None:
        for c in self.clients:
            c.latency = latency

    @property
    def clients(self) -> tuple[FakeClient, ...]:
        return (self.ec2, self.autoscaling, self.cloudwatch, self.ssm)

    def launch(
        self,
        instance_type: str,
        *,
        team: str | None,
        profile: Profile,
        launch_time: datetime,
        name: str | None = None,
        owner: str | None = None,
        tags: dict[str, str] | None = None,
        hibernation: bool = False,
        group: str | None = None,
        protected: bool = False,
        state: str = "running",
        managed: bool = True,
    ) -> str:
        """A machine with its metrics; `group` makes it a member of that (existing) Auto Scaling group.
        `managed`: it carries the reaper's opt-in tag."""
        all_tags = {
            **({"Name": name} if name else {}),
            **({"Team": team} if team else {}),
            **({"idle-reaper:managed": "true"} if managed else {}),
            **({"Owner": owner} if owner else {}),
            **(tags or {}),
        }
        if group:
            all_tags["aws:autoscaling:groupName"] = group
        inst = self.ec2.add(instance_type, launch_time=launch_time, tags=all_tags, hibernation=hibernation, state=state)
        if group:
            self.autoscaling.attach(group, inst.instance_id, protected=protected)
        self.cloudwatch.add(inst.instance_id, profile, launch_time)
        return inst.instance_id

    def calls(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in self.clients:
            total.update({f"{c.service}:{op}": n for op, n in c.calls.items()})
        return total

    def seconds(self) -> float:
        return sum(c.seconds for c in self.clients)

    def errors(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in self.clients:
            total.update({f"{c.service}:{op} {code}": n for (op, code), n in c.errors.items()})
        return total

    def write_calls(self) -> int:
        return sum(n for op, n in self.calls().items() if op in WRITE_OPERATIONS)

    def adapters(
        self, store: InMemoryStateStore | None = None, notifier: Notifier | None = None, prefix: str = "/idle-reaper"
    ) -> Adapters:
        """The real adapters (idle_reaper.aws) over these fakes, as a sweep.Adapters. The default notifier
        logs and reports every warning as delivered (a Slack that always answers)."""
        return Adapters(
            policies=PolicyStore(self.ssm, prefix),
            fleet=Fleet(self.ec2, self.autoscaling),
            metrics=MetricsReader(self.cloudwatch),
            store=store if store is not None else CountingStateStore(),
            notifier=notifier if notifier is not None else LoggingNotifier(logger, delivers=True),
        )


class CountingStateStore(InMemoryStateStore):
    """InMemoryStateStore that counts what the DynamoDB store would send: BatchGetItem (100 keys per
    call, the calls concurrently as DynamoStateStore makes them), PutItem per state save and per audit
    item. With a latency model, each request is charged."""

    def __init__(self, latency: LatencyModel | None = None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.latency = latency
        self._count_lock = threading.Lock()

    def _request(self, operation: str, n: int = 1) -> None:
        with self._count_lock:
            self.counts[operation] += n
        if self.latency is not None:
            self.latency.charge(f"dynamodb:{operation}", n)

    def load(self, instance_ids: Sequence[str]) -> dict[str, MachineRecord]:
        self.counts["load"] += 1
        ids = sorted(set(instance_ids))

        def get(start: int) -> dict[str, MachineRecord]:
            self._request("BatchGetItem")
            return super(CountingStateStore, self).load(ids[start : start + DDB_BATCH_GET])

        records: dict[str, MachineRecord] = {}
        for found in run_concurrently(get, list(range(0, len(ids), DDB_BATCH_GET)), DDB_WORKERS):
            records.update(found)
        return records

    def save(self, record: MachineRecord, holder: str | None = None, *, hold: bool = False) -> bool:
        self._request("PutItem")
        ok = super().save(record, holder, hold=hold)
        with self._count_lock:
            self.counts["save"] += 1
            if not ok:
                self.counts["ConditionalCheckFailed"] += 1
        return ok

    def put_lookup(self, key: str, value: str, expires: datetime) -> None:
        self._request("PutItem")  # shard manifests and results, alert counters
        super().put_lookup(key, value, expires)

    def get_lookup(self, key: str, now: datetime) -> str | None:
        self._request("GetItem")
        return super().get_lookup(key, now)

    def replace_lookup(self, key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        self._request("PutItem")  # conditional: the quiet-stops index
        return super().replace_lookup(key, value, expires, expected=expected, now=now)

    def audit(self, instance_id: str, at: datetime, entry: Mapping[str, Any]) -> None:
        self.counts["audit"] += 1
        self._request("PutItem")
        super().audit(instance_id, at, entry)

    def audit_many(self, entries: Sequence[AuditEntry]) -> list[str]:
        def write(a: AuditEntry) -> None:
            self._request("PutItem")
            with self._lock:
                self.audits.append((a.instance_id, a.at, dict(a.entry)))

        run_concurrently(write, list(entries), DDB_WORKERS)
        with self._count_lock:
            self.counts["audit"] += len(entries)
        return []
