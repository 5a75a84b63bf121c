"""AWS's documented limits the product keeps itself (sizes it checks before writing, rates it paces its calls to),
and the pacing: a client-side token bucket per quota, shared out between the workers that call at once.

The test doubles state the same limits apart (tools/idle_reaper_tools/aws_rules.py), so a wrong number here is
refused there rather than copied."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError

# ---------------------------------------------------------------------------------------------
# Sizes

# DynamoDB's largest item, attribute names and values together (UTF-8 bytes), KB = 1,024 bytes.
# https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/ServiceQuotas.html#limits-items
ITEM_MAX_BYTES = 400 * 1024
# What the product keeps in one item of its own (a lookup's JSON value), at most: the rest of the item (keys,
# expiry) and a margin stay under ITEM_MAX_BYTES.
LOOKUP_VALUE_MAX_BYTES = 380_000

# SSM Parameter Store: a Standard parameter holds 4,096 characters, an Advanced one 8,192 (and costs $0.05 a
# month). https://docs.aws.amazon.com/systems-manager/latest/userguide/parameter-store-advanced-parameters.html
SSM_STANDARD_CHARS = 4096
SSM_ADVANCED_CHARS = 8192


class TooLargeToStore(ValueError):
    """A value no tier of SSM Parameter Store holds: nothing was written."""


def ssm_tier(value: str, name: str = "the parameter") -> str:
    """The cheapest tier that holds `value`: Standard up to 4,096 characters, Advanced up to 8,192 (a charge of
    $0.05 a month per parameter, https://aws.amazon.com/systems-manager/pricing/). TooLargeToStore beyond."""
    if len(value) <= SSM_STANDARD_CHARS:
        return "Standard"
    if len(value) <= SSM_ADVANCED_CHARS:
        return "Advanced"
    raise TooLargeToStore(
        f"{name} would be {len(value):,} characters; SSM Parameter Store holds at most {SSM_ADVANCED_CHARS:,} "
        f"(the Advanced tier; {SSM_STANDARD_CHARS:,} in the Standard tier): nothing was written"
    )


# A CloudWatch dimension's value: 1-1,024 characters, ASCII only, no control characters, not blank.
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_Dimension.html
DIMENSION_VALUE_MAX = 1024


def cloudwatch_dimension(value: str) -> str:
    """`value` (a tag's: any Unicode) as a dimension value CloudWatch accepts, one to one for the values a tag can
    hold: every character outside printable ASCII, and "%", percent-encoded as UTF-8 (team "données" is
    "donn%C3%A9es"); a blank value is encoded too; one longer than 1,024 characters is cut, with a checksum of the
    whole so that two long values stay apart."""
    blank = not value.strip()
    text = "".join(
        c if " " <= c <= "~" and c != "%" and not (blank and c == " ") else "".join(f"%{b:02X}" for b in c.encode())
        for c in value
    )
    text = text or "%00"
    if len(text) <= DIMENSION_VALUE_MAX:
        return text
    return f"{text[: DIMENSION_VALUE_MAX - 9]}~{zlib.crc32(value.encode()):08x}"


# ---------------------------------------------------------------------------------------------
# Rates (per account and region unless said otherwise)

# EC2: a token bucket per API action. Non-mutating actions (DescribeInstances with a filter or pagination, as the
# product always calls it): 100 tokens, 20 a second. StopInstances: 50 tokens, 5 a second, and a resource bucket of
# 1,000 instances, 20 a second; StartInstances: 5 and 2, and 1,000 instances, 2 a second; TerminateInstances 100 and
# 5, and 1,000 instances, 20 a second. https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-throttling.html
EC2_DESCRIBE = (100.0, 20.0)  # (bucket, refill a second)
EC2_STOP_CALLS, EC2_STOP_INSTANCES = (50.0, 5.0), (1000.0, 20.0)
EC2_START_CALLS, EC2_START_INSTANCES = (5.0, 2.0), (1000.0, 2.0)
EC2_TERMINATE_CALLS, EC2_TERMINATE_INSTANCES = (100.0, 5.0), (1000.0, 20.0)
# CloudWatch GetMetricData: 50 calls a second, and 180,000 datapoints a second for data of the last three hours.
# https://repost.aws/knowledge-center/cloudwatch-getmetricdata-api
GET_METRIC_DATA_TPS = 50.0
GET_METRIC_DATA_DPS = 180_000.0
# STS: 600 requests a second per account and region (AssumeRole among them).
# https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_iam-quotas.html
STS_RPS = 600.0
# AWS Organizations publishes no numbers (https://github.com/awsdocs/aws-organizations-docs/issues/39) and
# refuses bursts with TooManyRequestsException: the product keeps to 5 calls a second, one organization-wide
# listing or look-up at a time.
ORGANIZATIONS_RPS = 5.0


# ---------------------------------------------------------------------------------------------
# Pacing


class Pacing:
    """The clock pacers read and how they wait: the wall's, unless the latency-model benchmark swaps in its
    virtual ones (testkit/aws LatencyModel), as it does aws.Concurrency's runners."""

    clock: Callable[[], float] = staticmethod(time.monotonic)
    sleep: Callable[[float], None] = staticmethod(time.sleep)


@dataclass(frozen=True)
class Quota:
    """A token bucket AWS keeps: `burst` tokens, refilled `rate` a second."""

    burst: float
    rate: float

    def share(self, workers: int) -> Quota:
        """One worker's part when `workers` call under the same quota at once: together they stay inside it."""
        n = max(1, workers)
        return Quota(self.burst / n, self.rate / n)


# The quotas the product paces itself to (each shared out between the workers calling at once, Quota.share).
# EC2: every Describe* call the product makes in an account and region (DescribeInstances,
# DescribeAvailabilityZones, DescribeSpotInstanceRequests, DescribeCapacityReservations) waits on one bucket of
# EC2_DESCRIBE (aws.fleet.Fleet.shared_by shares it between the shards describing one account-region at once):
# whether EC2 counts them per action or together, they never find its bucket empty.
EC2_DESCRIBE_QUOTA = Quota(*EC2_DESCRIBE)
# StopInstances (stops and hibernations) and TerminateInstances: each its bucket of requests and its bucket of the
# instances they name (EC2's resource rate limiting, same page). A sweep's batches wait for both, together at most
# MUTATING_WAIT_SECONDS; the machines of a batch that would wait longer are not sent (RateHeld): untouched, their
# claims released, and left to the next sweep. 1,000 stops at once, then 20 a second, per account and region.
EC2_STOP_QUOTAS = (Quota(*EC2_STOP_CALLS), Quota(*EC2_STOP_INSTANCES))
EC2_TERMINATE_QUOTAS = (Quota(*EC2_TERMINATE_CALLS), Quota(*EC2_TERMINATE_INSTANCES))
MUTATING_WAIT_SECONDS = 10.0
RATE_HELD = "RateHeld"  # the error code (aws.clients.error_code) of a request the product held back for its rate

_MARGIN = 1e-6  # seconds


class Pace:
    """A client-side token bucket a caller waits on before each request, so that its requests (and those of the
    workers it shares the quota with, each pacing its share) never pass AWS's bucket: a request never finds it
    empty, so none is throttled and none waits out a retry's backoff. Thread-safe; a request heavier than the
    bucket waits for a full bucket and leaves it in debt, so the rate still holds."""

    def __init__(self, quota: Quota, *, full: bool = True) -> None:
        """`full` False: AWS's bucket may have been emptied just now (another worker's listing): none of its burst
        is counted on, only its refill."""
        self.quota = quota
        self._tokens = quota.burst if full else 0.0
        self._stamp: float | None = None
        self._lock = threading.Lock()
        self.waited = 0.0  # seconds spent waiting, summed over callers

    def _refill(self, now: float) -> None:
        if self._stamp is None:
            self._stamp = now
        elif now > self._stamp:
            self._tokens = min(self.quota.burst, self._tokens + (now - self._stamp) * self.quota.rate)
            self._stamp = now

    def take(self, weight: float = 1.0, *, within: float | None = None) -> bool:
        """Wait until `weight` tokens are there and take them. `within` seconds at most: False (nothing taken)
        when they would not be there in time."""
        waited = 0.0
        while True:
            with self._lock:
                now = Pacing.clock()
                self._refill(now)
                assert self._stamp is not None
                need = min(weight, self.quota.burst)
                if self._tokens >= need and now >= self._stamp:
                    self._tokens -= weight
                    self.waited += waited
                    return True
                # The clock can stand behind the bucket's last request (the benchmark's lanes): wait up to it.
                # A microsecond more: a refill's rounding never leaves the bucket a hair short (and a clock of
                # the benchmark's always moves).
                wait = max(self._stamp - now, 0.0) + max(0.0, need - self._tokens) / self.quota.rate + _MARGIN
            if within is not None and waited + wait > within:
                self.waited += waited
                return False
            Pacing.sleep(wait)
            waited += wait

    @contextmanager
    def handed_out(self, workers: int) -> Iterator[list[Pace]]:
        """`workers` paces that together keep this one's bucket, for workers that cannot share this object (forked
        child processes, each with its copy): each gets its share of the quota and of the tokens left now. When the
        block ends this bucket counts what they may have taken as spent (empty, now)."""
        n = max(1, workers)
        with self._lock:
            now = Pacing.clock()
            self._refill(now)
            parts = [Pace(self.quota.share(n)) for _ in range(n)]
            for part in parts:
                part._tokens, part._stamp = self._tokens / n, self._stamp
        try:
            yield parts
        finally:
            with self._lock:
                now = Pacing.clock()
                self._refill(now)
                self._tokens = min(self._tokens, 0.0)
                self.waited += sum(part.waited for part in parts)


def paced_pages(pace: Pace, call: Callable[..., Mapping[str, Any]], **kwargs: Any) -> Iterator[Mapping[str, Any]]:
    """Every page of a NextToken-paged call, each request paced on `pace` (what a boto3 paginator does, unpaced;
    no token is taken after the last page)."""
    token: str | None = None
    while True:
        pace.take()
        page = call(**kwargs, **({"NextToken": token} if token else {}))
        yield page
        token = page.get("NextToken")
        if not token:
            return


class RateHeld(BotoCoreError):
    """A request the product did not send: its share of the AWS quota would not be there in time."""

    fmt = "{what}"


class ResourcePace:
    """EC2's two buckets for a mutating action (StopInstances, TerminateInstances): its requests, and the instances
    they name. `take` waits for both, until `deadline` (a Pacing.clock time) at the latest."""

    def __init__(self, action: str, quotas: tuple[Quota, Quota], workers: int = 1) -> None:
        self.action, self.quotas = action, quotas
        self.calls, self.instances = Pace(quotas[0].share(workers)), Pace(quotas[1].share(workers))

    def shared_by(self, workers: int) -> ResourcePace:
        return ResourcePace(self.action, self.quotas, workers)

    @property
    def batch(self) -> int:
        """The most instances a request may name: no more than the instance bucket (this worker's share) holds."""
        return max(1, int(self.instances.quota.burst))

    def take(self, instances: int, deadline: float) -> None:
        """Wait for one request's token and `instances` instances' tokens, or raise RateHeld (nothing sent) when they
        would not be there by `deadline`."""
        left = deadline - Pacing.clock()
        if not (self.calls.take(within=left) and self.instances.take(instances, within=deadline - Pacing.clock())):
            raise RateHeld(
                what=f"not sent: this sweep's share of EC2's {self.action} rate for the account and region "
                f"({self.quotas[1].burst:,.0f} instances at once, {self.quotas[1].rate:,.0f} a second) is used for "
                "now; the next sweep tries again"
            )
