"""The fake boto3 client machinery: call counting, pagination, botocore errors, and the latency model
the benchmarks schedule calls on."""

from __future__ import annotations

import functools
import heapq
import itertools
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from botocore.exceptions import ClientError

from idle_reaper.aws import (
    Concurrency,
    Pacing,
)

ACCOUNT = "123456789012"
REGION = "us-east-1"


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
    "ec2:DescribeAvailabilityZones": 0.1,
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


# Starting a child process and reading its answer's Pipe, beyond the answer's pickling: benchmarks/botocore_cpu.py
# measures a fork, a Pipe and a join at 8-80 ms on a busy 2-core machine; charged at the top of that, rounded up.
PROCESS_START_S = 0.1

# A request's CPU in the client library: (operation, request, answer) -> seconds (benchmarks/botocore_cpu.py).
RequestCpu = Callable[[str, Mapping[str, Any], Mapping[str, Any]], float]


class LatencyModel:
    """Charges every fake call its in-region latency (LATENCY), in one of two ways:

    sleep=True   really sleeps it on the calling thread, and the code's own thread pools overlap the sleeps:
                 wall time is then measured, not modelled (the check of the model, at small sizes);
    sleep=False  adds it to a virtual clock. `install()` replaces the pools (aws.Concurrency.runner) by a
                 runner that runs the tasks one after another but schedules them on as many virtual lanes
                 as the pool has threads (each task starts on the lane that frees first), so the virtual
                 clock advances by what the real pool would overlap. Modelled wall = virtual latency plus
                 the code's own CPU time (serial, as under the GIL).

    `cpu` prices each request's CPU in botocore (kept apart in `cpu_charged`; burnt for real when sleeping).
    Work the code runs in child processes (aws.run_in_processes) is modelled as CPU lanes, `vcpus` of them
    (the invoked function's vCPUs): see `in_processes`.
    """

    def __init__(
        self,
        *,
        sleep: bool = False,
        latency: Mapping[str, float] = LATENCY,
        cpu: RequestCpu | None = None,
        vcpus: int = 1,
    ) -> None:
        self.sleep = sleep
        self.latency = dict(latency)
        self.cpu = cpu
        self.vcpus = vcpus
        # CPU (the code's and botocore's) spent on process lanes: already in the virtual clock, so a caller that
        # adds the invocation's CPU serially must not add it again.
        self.lanes_cpu_s = 0.0
        self.fake_seconds: Callable[[], float] = lambda: 0.0  # the fakes' own time (FakeAws.set_latency sets it)
        self.virtual = 0.0  # seconds of modelled latency on the current lane
        self.charged: Counter[str] = Counter()
        # The client library's own CPU per request (serialise, sign, parse), when `cpu` prices it: summed, as
        # it runs under the GIL one request after another; with sleep=True really burnt on the calling thread.
        self.cpu_charged: Counter[str] = Counter()
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

    def idle_until(self, at: float) -> None:
        """Nothing runs until `at` (modelled seconds): the time between two invocations, such as a schedule's minutes
        between sweeps. AWS's buckets refill meanwhile, and so do the product's pacers on this clock (aws/limits.py
        Pacing): a Lambda's next invocation finds them as AWS's would be, not as the last one left them. A clock
        already past `at` (an invocation that overran) stays where it is. With sleep=True the wall's clock runs on."""
        if not self.sleep:
            self.virtual = max(self.virtual, at)

    def charge_cpu(self, operation: str, request: Mapping[str, Any], response: Mapping[str, Any]) -> None:
        if self.cpu is None:
            return
        seconds = self.cpu(operation, request, response)
        with self._lock:
            self.cpu_charged[operation] += seconds
        if self.sleep:
            until = time.thread_time() + seconds
            while time.thread_time() < until:
                pass

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu_charged.values())

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

    def in_processes(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """Child processes, modelled: each task runs here, one after another, and is timed as its own
        process would run it (its latency, its botocore CPU and the code's own CPU, plus PROCESS_START_S) on
        one of `vcpus` lanes (the lane that frees first; more processes than vCPUs are modelled as waiting
        for one, the worst case of their sharing). The parent's clock moves to the last lane's end. Answers
        are pickled in the task and unpickled after it, as the Pipe does: the unpickling is the parent's CPU."""
        start = self.virtual
        free = [start] * max(1, min(self.vcpus, len(items)))
        blobs = []
        for item in items:
            self.virtual = heapq.heappop(free)
            cpu_started, fake_started, botocore_started = time.process_time(), self.fake_seconds(), self.cpu_s
            blobs.append(pickle.dumps(fn(item), protocol=pickle.HIGHEST_PROTOCOL))
            own = time.process_time() - cpu_started - (self.fake_seconds() - fake_started)
            spent = own + self.cpu_s - botocore_started
            self.lanes_cpu_s += spent
            heapq.heappush(free, self.virtual + spent + PROCESS_START_S)
        self.virtual = max(free)
        return [pickle.loads(blob) for blob in blobs]

    def wait(self, seconds: float) -> None:
        """A pacer's wait (aws/limits.py Pacing), modelled: the current lane's clock moves on."""
        self.virtual += seconds

    def install(self) -> None:
        """Model the pools, the child processes and the pacers' clock (sleep=False only; with sleep=True the real
        ones run): a request a pacer holds back waits on the lane that makes it, as it would on its thread."""
        if not self.sleep:
            self._saved = (Concurrency.runner, Concurrency.processes, Pacing.clock, Pacing.sleep)
            Concurrency.runner = self.lanes  # type: ignore[assignment]
            Concurrency.processes = self.in_processes  # type: ignore[assignment]
            Pacing.clock = lambda: self.virtual  # type: ignore[method-assign]
            Pacing.sleep = self.wait  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        if self._saved is not None:
            Concurrency.runner, Concurrency.processes, Pacing.clock, Pacing.sleep = self._saved  # type: ignore[method-assign]
            self._saved = None


def api(method: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Marks an API operation: the time spent inside it is the fake's, not the code under test's. With a
    latency model, the call is charged its latency first (outside the fake's lock, so sleeps overlap)."""

    @functools.wraps(method)
    def timed(self: FakeClient, *args: Any, **kwargs: Any) -> dict[str, Any]:
        operation = f"{self.service}:{_operation_name(method.__name__)}"
        if self.latency is not None:
            self.latency.charge(operation)
        response: dict[str, Any] = {}
        try:
            with self._lock:
                started = time.thread_time()  # CPU, so other processes on the machine do not inflate it
                try:
                    response = method(self, *args, **kwargs)
                    return response
                finally:
                    self.seconds += time.thread_time() - started
        finally:
            if self.latency is not None:  # after the fake's own time: this CPU is the client library's
                self.latency.charge_cpu(operation, kwargs, response)

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
