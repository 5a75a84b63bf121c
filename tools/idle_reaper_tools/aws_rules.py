"""AWS's documented limits, kept in front of moto: what a real account refuses, refused here with AWS's own codes
and messages, before moto sees the request.

moto stores items DynamoDB refuses, takes parameters too long for their SSM tier, and answers every call however
fast it comes. `AwsRules` sits on boto3's default session (botocore copies a session's handlers into every client
it makes), so every client of the code under test, in the integration tests and the demo, meets these rules. A
refusal is answered at `before-send`, as an HTTP answer in the protocol the client speaks (JSON, EC2's and the
query protocol's XML, CloudWatch's CBOR): botocore parses it and retries it exactly as it would AWS's own, so a
throttle goes through the client's adaptive retries and rate limiter.

The numbers are AWS's, stated here apart from the product's own (lambdas/idle_reaper/aws/limits.py): a wrong
number there is caught here, not copied. Each rule cites its page. Rate rules keep token buckets per account,
region and bucket on `clock` (the wall's monotonic clock unless a test sets its own); `reset()` refills them
between tests and, when anything was throttled, drops the kept clients (their adaptive rate limiters remember the
throttle), so one test's throttling never slows another. Calls the product never makes (RunInstances, the seeding
of a test's fleet) are left to moto.

Not used in Lambda: the local world (tools/idle_reaper_tools/local.py) installs it; testkit/aws_rules.py
re-exports it for the tests, and the in-memory fakes share its size and bucket rules (testkit/aws)."""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

# ---------------------------------------------------------------------------------------------
# Sizes

# DynamoDB's item size: "The maximum item size in DynamoDB is 400 KB, which includes both attribute name binary
# length (UTF-8 length) and attribute value lengths (again binary length)"; KB is 1,024 bytes.
# https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/ServiceQuotas.html#limits-items
ITEM_MAX_BYTES = 400 * 1024
ITEM_TOO_LARGE = "Item size has exceeded the maximum allowed size"
# BatchWriteItem: "up to 25 item put or delete operations"; BatchGetItem: "up to 100 items".
# https://docs.aws.amazon.com/amazondynamodb/latest/APIReference/API_BatchWriteItem.html
# https://docs.aws.amazon.com/amazondynamodb/latest/APIReference/API_BatchGetItem.html
BATCH_WRITE_MAX = 25
BATCH_GET_MAX = 100
# SSM: a Standard parameter's value holds 4,096 characters, an Advanced one's 8,192.
# https://docs.aws.amazon.com/systems-manager/latest/userguide/parameter-store-advanced-parameters.html
SSM_TIER_CHARS = {"Standard": 4096, "Advanced": 8192}
SSM_TOO_LONG = (
    "Standard tier parameters support a maximum parameter value of 4096 characters. To create a larger parameter "
    "value, upgrade the parameter to use the advanced-parameter tier. For more information, see "
    "https://docs.aws.amazon.com/systems-manager/latest/userguide/parameter-store-advanced-parameters.html"
)
SSM_NO_DOWNGRADE = (
    "This parameter uses the advanced-parameter tier. You can't downgrade a parameter from the advanced-parameter "
    "tier to the standard-parameter tier. If necessary, you can delete the advanced parameter and recreate it as a "
    "standard parameter."
)
# GetMetricData: at most 500 MetricDataQuery structures a call.
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_GetMetricData.html
METRIC_QUERIES_MAX = 500
# A dimension's name (1-255) and value (1-1,024) "must contain only ASCII characters", at least one that is not
# whitespace, no ASCII control character; a name cannot start with a colon. At most 30 dimensions a metric.
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_Dimension.html
DIMENSION_NAME_MAX, DIMENSION_VALUE_MAX, DIMENSIONS_MAX = 255, 1024, 30
# Step Functions: an execution's input is at most 256 KiB as UTF-8.
# https://docs.aws.amazon.com/step-functions/latest/dg/limits-overview.html
EXECUTION_INPUT_MAX_BYTES = 262_144


def attribute_size(value: Mapping[str, Any]) -> int:
    """The size DynamoDB counts for one attribute value (DynamoDB's JSON: {"S": ...}, {"N": ...}, ...): strings
    and binaries by their bytes, a number about one byte per two significant digits plus one, booleans and nulls one
    byte, a list or map three bytes plus one per element plus its elements (names included).
    https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/CapacityUnitCalculations.html"""
    ((kind, inner),) = value.items()
    if kind == "S":
        return len(str(inner).encode())
    if kind == "B":
        return len(inner) if isinstance(inner, bytes | bytearray) else len(str(inner).encode())
    if kind == "N":
        digits = str(inner).lstrip("-").replace(".", "").lstrip("0").rstrip("0") or "0"
        return 1 + math.ceil(len(digits) / 2) + (1 if str(inner).startswith("-") else 0)
    if kind in ("BOOL", "NULL"):
        return 1
    if kind in ("SS", "NS", "BS"):
        member = {"SS": "S", "NS": "N", "BS": "B"}[kind]
        return sum(attribute_size({member: v}) for v in inner)
    if kind == "L":
        return 3 + sum(1 + attribute_size(v) for v in inner)
    if kind == "M":
        return 3 + sum(1 + len(k.encode()) + attribute_size(v) for k, v in inner.items())
    raise ValueError(f"not a DynamoDB attribute value: {kind}")


def item_size(item: Mapping[str, Mapping[str, Any]]) -> int:
    """An item's size as DynamoDB counts it against ITEM_MAX_BYTES: every attribute's name and value."""
    return sum(len(name.encode()) + attribute_size(value) for name, value in item.items())


def dimension_problems(dimensions: Sequence[Mapping[str, Any]], where: str) -> list[str]:
    """What CloudWatch says of dimensions it refuses (InvalidParameterValue; one line each). `where` is the
    parameter's path, e.g. "MetricData.member.1.Dimensions"."""
    problems = []
    if len(dimensions) > DIMENSIONS_MAX:
        problems.append(f"The collection {where} must not have a size greater than {DIMENSIONS_MAX}.")
    for j, dimension in enumerate(dimensions, 1):
        for part, longest in (("Name", DIMENSION_NAME_MAX), ("Value", DIMENSION_VALUE_MAX)):
            text = str(dimension.get(part, ""))
            path = f"{where}.member.{j}.{part}"
            if not text.isascii():
                problems.append(f"The value for parameter {path} contains non-ASCII characters.")
            elif any(ord(c) < 32 or ord(c) == 127 for c in text):
                problems.append(f"The value for parameter {path} contains ASCII control characters.")
            elif not text.strip():
                problems.append(f"The parameter {path} must contain at least one non-whitespace character.")
            if len(text) > longest:
                problems.append(f"The parameter {path} must be shorter than {longest + 1} characters.")
            if part == "Name" and text.startswith(":"):
                problems.append(f"The value for parameter {path} must not start with a colon.")
    return problems


# ---------------------------------------------------------------------------------------------
# Rates


@dataclass
class TokenBucket:
    """AWS's token bucket: `capacity` tokens, `refill` a second; a request takes its tokens or is throttled."""

    capacity: float
    refill: float
    tokens: float = -1.0
    stamp: float = 0.0

    def take(self, now: float, weight: float = 1.0) -> bool:
        if self.tokens < 0:
            self.tokens, self.stamp = self.capacity, now
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.stamp) * self.refill)
        self.stamp = max(self.stamp, now)
        if self.tokens < weight:
            return False
        self.tokens -= weight
        return True


@dataclass(frozen=True)
class Rate:
    """One throttle: `bucket` (shared by the operations naming it) of `capacity` tokens refilled `refill` a second,
    each request weighing `weight(params)`; over it, `code` and `message` at `status`."""

    bucket: str
    capacity: float
    refill: float
    code: str
    message: str = "Rate exceeded"
    status: int = 400
    weight: Callable[[Mapping[str, Any]], float] = lambda _: 1.0


# EC2: a bucket per API action, per account and region; a request over it is answered RequestLimitExceeded, HTTP
# 503. Non-mutating actions 100 tokens, 20 a second; DescribeInstances with neither a filter nor pagination 50, 10;
# StopInstances 50, 5 and a resource bucket of 1,000 instances, 20 a second; StartInstances 5, 2 and 1,000, 2;
# TerminateInstances 100, 5 and 1,000, 20; CreateTags and DeleteTags 100, 10; other mutating actions 50, 5.
# https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-throttling.html
EC2_THROTTLED = ("RequestLimitExceeded", "Request limit exceeded.", 503)


def _instances(params: Mapping[str, Any]) -> float:
    return float(len(params.get("InstanceIds") or ()))


def _ec2_rates(operation: str, params: Mapping[str, Any]) -> list[Rate]:
    code, message, status = EC2_THROTTLED
    if operation == "RunInstances":  # never called by the product; every test seeds its fleet with it
        return []
    if operation.startswith(("Describe", "Get", "List", "Search")):
        if operation == "DescribeInstances" and not params.get("Filters") and not params.get("MaxResults"):
            return [Rate(f"ec2:{operation}:unfiltered", 50, 10, code, message, status)]
        return [Rate(f"ec2:{operation}", 100, 20, code, message, status)]
    resource = {
        "StopInstances": ((50, 5), (1000, 20)),
        "StartInstances": ((5, 2), (1000, 2)),
        "TerminateInstances": ((100, 5), (1000, 20)),
    }.get(operation)
    if resource is not None:
        (cap, refill), (rcap, rrefill) = resource
        return [
            Rate(f"ec2:{operation}", cap, refill, code, message, status),
            Rate(f"ec2:{operation}:instances", rcap, rrefill, code, message, status, _instances),
        ]
    if operation in ("CreateTags", "DeleteTags"):
        return [Rate(f"ec2:{operation}", 100, 10, code, message, status)]
    return [Rate(f"ec2:{operation}", 50, 5, code, message, status)]


def requested_datapoints(params: Mapping[str, Any]) -> float:
    """The datapoints a GetMetricData call asks for: each query's (EndTime - StartTime) / Period."""
    start, end = _when(params.get("StartTime")), _when(params.get("EndTime"))
    if start is None or end is None:
        return 0.0
    span = max(0.0, (end - start).total_seconds())
    points = 0.0
    for query in params.get("MetricDataQueries") or ():
        period = float((query.get("MetricStat") or {}).get("Period") or query.get("Period") or 60)
        points += math.ceil(span / period)
    return points


def _when(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str):
        try:
            found = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return found if found.tzinfo else found.replace(tzinfo=UTC)
    return None


def _recent(params: Mapping[str, Any]) -> bool:
    start = _when(params.get("StartTime"))
    return start is None or datetime.now(UTC) - start <= timedelta(hours=3)


# GetMetricData: 50 transactions a second, and 180,000 datapoints a second when StartTime is within the last three
# hours (396,000 for older data), per account and region; over either, Throttling "Rate exceeded". PutMetricData:
# 500 a second. https://repost.aws/knowledge-center/cloudwatch-getmetricdata-api ,
# https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/cloudwatch_limits.html
GET_METRIC_DATA_TPS = 50
GET_METRIC_DATA_DPS = 180_000
GET_METRIC_DATA_DPS_OLD = 396_000


def _cloudwatch_rates(operation: str, params: Mapping[str, Any]) -> list[Rate]:
    if operation == "GetMetricData":
        dps = GET_METRIC_DATA_DPS if _recent(params) else GET_METRIC_DATA_DPS_OLD
        return [
            Rate("cloudwatch:GetMetricData", GET_METRIC_DATA_TPS, GET_METRIC_DATA_TPS, "Throttling"),
            Rate(f"cloudwatch:GetMetricData:datapoints:{dps}", dps, dps, "Throttling", weight=requested_datapoints),
        ]
    if operation == "PutMetricData":
        return [Rate("cloudwatch:PutMetricData", 500, 500, "Throttling")]
    return []


def _rates(service: str, operation: str, params: Mapping[str, Any]) -> list[Rate]:
    if service == "ec2":
        return _ec2_rates(operation, params)
    if service == "cloudwatch":
        return _cloudwatch_rates(operation, params)
    if service == "ssm" and operation in ("GetParameter", "GetParameters", "GetParametersByPath"):
        # 40 transactions a second shared by the three (default throughput), ThrottlingException "Rate exceeded".
        # https://docs.aws.amazon.com/general/latest/gr/ssm.html ,
        # https://repost.aws/knowledge-center/ssm-parameter-store-rate-exceeded
        return [Rate("ssm:GetParameter*", 40, 40, "ThrottlingException")]
    if service == "sts":
        # 600 requests a second per account and region, shared by AssumeRole, GetCallerIdentity and the others,
        # counted against the calling account: Throttling "Rate exceeded".
        # https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_iam-quotas.html ,
        # https://repost.aws/knowledge-center/iam-sts-throttling-error
        return [Rate("sts", 600, 600, "Throttling")]
    if service == "organizations" and operation.startswith(("Describe", "List")):
        # Organizations throttles per organization with TooManyRequestsException (HTTP 400) but publishes no
        # numbers (https://github.com/awsdocs/aws-organizations-docs/issues/39; the botocore model's
        # TooManyRequestsException). Kept here at 10 a second, bursts of 10, for the reads the product makes (a
        # test's organization is built with CreateAccount and MoveAccount, its console's calls).
        return [
            Rate(
                "organizations",
                10,
                10,
                "TooManyRequestsException",
                "AWS Organizations can't complete your request because another request is already in progress. "
                "Try again later.",
            )
        ]
    return []


# ---------------------------------------------------------------------------------------------
# Shape and size rules (ValidationException and kin)


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    status: int = 400


def _dynamodb(operation: str, params: Mapping[str, Any]) -> Refusal | None:
    too_large = Refusal("ValidationException", ITEM_TOO_LARGE)
    if operation == "PutItem" and item_size(params.get("Item") or {}) > ITEM_MAX_BYTES:
        return too_large
    if operation == "BatchWriteItem":
        requests = [r for rs in (params.get("RequestItems") or {}).values() for r in rs]
        if len(requests) > BATCH_WRITE_MAX:
            return Refusal("ValidationException", "Too many items requested for the BatchWriteItem call")
        if any(item_size((r.get("PutRequest") or {}).get("Item") or {}) > ITEM_MAX_BYTES for r in requests):
            return too_large
    if operation == "BatchGetItem":
        keys = sum(len(t.get("Keys") or ()) for t in (params.get("RequestItems") or {}).values())
        if keys > BATCH_GET_MAX:
            return Refusal("ValidationException", "Too many items requested for the BatchGetItem call")
    if operation == "TransactWriteItems":
        puts = [a["Put"].get("Item") or {} for a in params.get("TransactItems") or () if "Put" in a]
        if any(item_size(item) > ITEM_MAX_BYTES for item in puts):
            return too_large
    return None


def _ssm(operation: str, params: Mapping[str, Any], stored_tier: Callable[[str], str | None]) -> Refusal | None:
    if operation == "PutParameter":
        value, tier = str(params.get("Value", "")), params.get("Tier")
        before = stored_tier(str(params.get("Name", "")))
        if tier == "Intelligent-Tiering":  # Standard unless the request needs Advanced (a value over 4 KB)
            tier = "Advanced" if len(value) > SSM_TIER_CHARS["Standard"] or before == "Advanced" else "Standard"
        # No tier: the account's default tier (Standard unless changed) for a new parameter.
        # https://docs.aws.amazon.com/systems-manager/latest/userguide/ps-default-tier.html
        tier = tier or before or "Standard"
        if before == "Advanced" and tier == "Standard":
            return Refusal("ValidationException", SSM_NO_DOWNGRADE)
        if tier == "Standard" and len(value) > SSM_TIER_CHARS["Standard"]:
            return Refusal("ValidationException", SSM_TOO_LONG)
        if len(value) > SSM_TIER_CHARS["Advanced"]:
            return Refusal(
                "ValidationException",
                "1 validation error detected: Value at 'value' failed to satisfy constraint: Member must have "
                f"length less than or equal to {SSM_TIER_CHARS['Advanced']}",
            )
    # GetParametersByPath: MaxResults 1-10; GetParameters: at most 10 names (the API's model).
    if operation == "GetParametersByPath" and int(params.get("MaxResults") or 10) > 10:
        return Refusal(
            "ValidationException",
            f"1 validation error detected: Value '{params['MaxResults']}' at 'maxResults' failed to satisfy "
            "constraint: Member must have value less than or equal to 10",
        )
    if operation == "GetParameters" and len(params.get("Names") or ()) > 10:
        return Refusal(
            "ValidationException",
            "1 validation error detected: Value at 'names' failed to satisfy constraint: Member must have length "
            "less than or equal to 10",
        )
    return None


def _cloudwatch(operation: str, params: Mapping[str, Any]) -> Refusal | None:
    if operation == "GetMetricData":
        queries = params.get("MetricDataQueries") or ()
        if len(queries) > METRIC_QUERIES_MAX:
            return Refusal(
                "ValidationError",
                f"The collection MetricDataQueries must not have a size greater than {METRIC_QUERIES_MAX}.",
            )
        problems = []
        for i, query in enumerate(queries, 1):
            metric = (query.get("MetricStat") or {}).get("Metric") or {}
            where = f"MetricDataQueries.member.{i}.MetricStat.Metric.Dimensions"
            problems += dimension_problems(metric.get("Dimensions") or (), where)
        if problems:
            return Refusal("InvalidParameterValue", "\n".join(problems))
    if operation == "PutMetricData":
        data = params.get("MetricData") or ()
        if len(data) > 1000:
            return Refusal("InvalidParameterValue", "The collection MetricData must not have a size greater than 1000.")
        problems = [
            p
            for i, datum in enumerate(data, 1)
            for p in dimension_problems(datum.get("Dimensions") or (), f"MetricData.member.{i}.Dimensions")
        ]
        if problems:
            return Refusal("InvalidParameterValue", "\n".join(problems))
    return None


def _others(service: str, operation: str, params: Mapping[str, Any]) -> Refusal | None:
    # StartExecution's name rules and ExecutionAlreadyExists: moto keeps them as Step Functions does.
    if (
        service == "sfn"
        and operation == "StartExecution"
        and len(str(params.get("input", "")).encode()) > EXECUTION_INPUT_MAX_BYTES
    ):
        return Refusal(
            "ValidationException",
            "1 validation error detected: Value at 'input' failed to satisfy constraint: Member must have "
            f"length less than or equal to {EXECUTION_INPUT_MAX_BYTES}",
        )
    if service == "organizations" and operation.startswith("List") and int(params.get("MaxResults") or 20) > 20:
        # ListAccounts, ListAccountsForParent, ListChildren, ListParents: MaxResults 1-20 (the API's model).
        return Refusal(
            "InvalidInputException",
            "You provided a value that does not match the required pattern. MaxResults must be at most 20.",
        )
    if service == "auto-scaling":
        # SetInstanceProtection: 50 instance ids; DescribeAutoScalingGroups: MaxRecords at most 100.
        # https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_SetInstanceProtection.html
        if operation == "SetInstanceProtection" and len(params.get("InstanceIds") or ()) > 50:
            return Refusal(
                "ValidationError",
                "1 validation error detected: Value at 'instanceIds' failed to satisfy constraint: Member must have "
                "length less than or equal to 50",
            )
        if operation == "DescribeAutoScalingGroups" and int(params.get("MaxRecords") or 50) > 100:
            return Refusal(
                "ValidationError",
                "1 validation error detected: Value at 'maxRecords' failed to satisfy constraint: Member must have "
                "value less than or equal to 100",
            )
    return None


# ---------------------------------------------------------------------------------------------
# The rules in front of moto


class AwsRules:
    """AWS's limits for every client made from boto3's default session while installed. `refused` counts the
    refusals by (operation, code); `calls` every request judged, by operation."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = self._wall = clock
        self.refused: Counter[tuple[str, str]] = Counter()
        self.calls: Counter[str] = Counter()
        self._buckets: dict[tuple[str, str, str], TokenBucket] = {}
        self._accounts: dict[str, str] = {}
        self._lock = threading.Lock()
        self._installed: Any = None
        self.metered = True  # rate rules on (a test that seeds a fleet with many calls may turn them off a while)
        # SageMaker's quota of each instance type for endpoint usage, in instances (aws_rules_sagemaker.py): a test's.
        self.sagemaker_quotas: dict[str, int] = {}
        # And of Studio apps, by (app type, instance type), in apps (aws_rules_sagemaker.py): a test's.
        self.studio_quotas: dict[tuple[str, str], int] = {}

    # -- lifecycle

    def install(self) -> None:
        """In front of every client made from boto3's default session from now on. Rules installed while others are
        (the demo's world started in a test process that has its own) take over until they are uninstalled, then
        hand back: botocore keeps one handler per unique id, so before, the inner world's rules were never
        installed, and uninstalling them took the outer world's away for the rest of the process."""
        import boto3

        session: Any = boto3._get_default_session()._session  # where clients copy their handlers from
        if _INSTALLED:
            _INSTALLED[-1]._unregister()
        self._register(session)
        _INSTALLED.append(self)

    def uninstall(self) -> None:
        if self not in _INSTALLED:
            return
        session = self._installed
        self._unregister()
        _INSTALLED.remove(self)
        if _INSTALLED and _INSTALLED[-1]._installed is None and session is not None:
            _INSTALLED[-1]._register(session)

    def _register(self, session: Any) -> None:
        session.register("before-parameter-build", self._keep_params, unique_id="idle-reaper-aws-rules-params")
        session.register("before-send", self._judge, unique_id="idle-reaper-aws-rules")
        self._installed = session

    def _unregister(self) -> None:
        if self._installed is not None:
            self._installed.unregister("before-parameter-build", unique_id="idle-reaper-aws-rules-params")
            self._installed.unregister("before-send", unique_id="idle-reaper-aws-rules")
            self._installed = None

    def reset(self) -> None:
        """Full buckets, no counts and the wall's clock, as for a new account; the kept clients are dropped when
        anything was throttled (botocore's adaptive rate limiter in each remembers it)."""
        from idle_reaper import aws

        with self._lock:
            throttled = any(code in _THROTTLES for _, code in self.refused)
            self._buckets.clear()
            self._accounts.clear()
            self.refused.clear()
            self.calls.clear()
            self.metered = True
            self.sagemaker_quotas.clear()
            self.studio_quotas.clear()
            self.clock = self._wall  # a test's own clock ends with it
        if throttled:
            aws.forget_clients()

    @contextmanager
    def unmetered(self) -> Iterator[None]:
        """No rate rule inside the block (seeding a test's world: its console, not the product, calls)."""
        self.metered = False
        try:
            yield
        finally:
            self.metered = True

    def throttles(self, operation: str | None = None) -> int:
        return sum(n for (op, code), n in self.refused.items() if code in _THROTTLES and operation in (None, op))

    # -- the handlers

    @staticmethod
    def _keep_params(params: Mapping[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["idle_reaper_params"] = params

    def _judge(self, request: Any, event_name: str, **_: Any) -> Any:
        service, operation = event_name.split(".", 2)[1:]
        context: Mapping[str, Any] = getattr(request, "context", None) or {}
        params = context.get("idle_reaper_params")
        if params is None:
            return None
        with self._lock:
            self.calls[operation] += 1
        refusal = self.judge(service, operation, params, self._account(request), str(context.get("client_region")))
        if refusal is None:
            return None
        with self._lock:
            self.refused[(operation, refusal.code)] += 1
        return _answer(request, service, operation, refusal)

    def judge(
        self, service: str, operation: str, params: Mapping[str, Any], account: str, region: str
    ) -> Refusal | None:
        """The refusal AWS would answer this request with, or None."""
        if service == "dynamodb":
            refusal = _dynamodb(operation, params)
        elif service == "ssm":
            refusal = _ssm(operation, params, lambda name: _stored_tier(account, region, name))
        elif service == "cloudwatch":
            refusal = _cloudwatch(operation, params)
        elif service == "sagemaker":
            from idle_reaper_tools.aws_rules_sagemaker import sagemaker_refusal

            refusal = sagemaker_refusal(operation, params, account, region, self.sagemaker_quotas, self.studio_quotas)
        else:
            refusal = _others(service, operation, params)
        if refusal is not None or not self.metered:
            return refusal
        rates = _rates(service, operation, params)
        if not rates:
            return None
        # Organizations is global (one organization); everything else per account and region.
        where = (account, "global" if service == "organizations" else region)
        now = self.clock()
        with self._lock:
            for rate in rates:
                bucket = self._buckets.setdefault((*where, rate.bucket), TokenBucket(rate.capacity, rate.refill))
                if not bucket.take(now, rate.weight(params)):
                    return Refusal(rate.code, rate.message, rate.status)
        return None

    def _account(self, request: Any) -> str:
        """The account moto serves the request's access key as (a member account's assumed role is its own)."""
        auth = str(request.headers.get("Authorization", b"") or "")
        key = auth.split("Credential=", 1)[1].split("/", 1)[0] if "Credential=" in auth else ""
        found = self._accounts.get(key)
        if found is None:
            from moto.iam.models import get_account_id_from

            found = self._accounts[key] = get_account_id_from(key)
        return found


_INSTALLED: list[AwsRules] = []  # the rules installed, innermost last: only that one is on the session

_THROTTLES = frozenset({"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException"})


def _stored_tier(account: str, region: str, name: str) -> str | None:
    """The tier of the parameter moto holds under `name` (None: none), read from moto's backend in this process."""
    from moto.ssm.models import ssm_backends

    try:
        found = ssm_backends[account][region].get_parameter(name) if name else None
    except Exception:  # moto's own refusal of the name: no parameter, as far as the tier goes
        return None
    return str(found.tier) if found is not None else None


# ---------------------------------------------------------------------------------------------
# Refusals on the wire: in the protocol the client speaks, so that botocore parses (and retries) them as AWS's


_JSON_TARGETS = {
    "dynamodb": "com.amazonaws.dynamodb.v20120810",
    "ssm": "com.amazonaws.ssm",
    "organizations": "com.amazonaws.organizations.v20161128",
    "sfn": "com.amazonaws.states",
}


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._body


def _answer(request: Any, service: str, operation: str, refusal: Refusal) -> Any:
    from botocore.awsrequest import AWSResponse, HeadersDict

    request_id = str(uuid.uuid4())
    content_type = str(request.headers.get("Content-Type", b"") or "")
    headers = {"x-amzn-RequestId": request_id}
    if request.headers.get("smithy-protocol"):  # CloudWatch: Smithy RPC v2 CBOR, query-compatible error codes
        body = _cbor({"__type": f"com.amazonaws.cloudwatch#{refusal.code}", "message": refusal.message})
        headers.update({"smithy-protocol": "rpc-v2-cbor", "Content-Type": "application/cbor"})
        headers["x-amzn-query-error"] = f"{refusal.code};Sender"
    elif "json" in content_type:
        namespace = _JSON_TARGETS.get(service, "com.amazonaws")
        body = json.dumps({"__type": f"{namespace}#{refusal.code}", "message": refusal.message}).encode()
        headers["Content-Type"] = content_type
    elif service == "ec2":
        body = (
            f"<Response><Errors><Error><Code>{refusal.code}</Code><Message>{_xml(refusal.message)}</Message></Error>"
            f"</Errors><RequestID>{request_id}</RequestID></Response>"
        ).encode()
        headers["Content-Type"] = "text/xml"
    else:  # the query protocol (STS, Auto Scaling)
        body = (
            f"<ErrorResponse><Error><Type>Sender</Type><Code>{refusal.code}</Code><Message>{_xml(refusal.message)}"
            f"</Message></Error><RequestId>{request_id}</RequestId></ErrorResponse>"
        ).encode()
        headers["Content-Type"] = "text/xml"
    answer: Any = HeadersDict(headers)  # what botocore's own responses carry (its stubs say HTTPHeaders)
    return AWSResponse(request.url, refusal.status, answer, _Raw(body))


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cbor(value: Mapping[str, str]) -> bytes:
    """A CBOR map of text to text (RFC 8949: major type 5 holding major type 3 items)."""

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for extra, size in ((24, 1), (25, 2), (26, 4)):
            if n < 1 << (8 * size):
                return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
        raise ValueError("too long")

    def text(s: str) -> bytes:
        raw = s.encode()
        return head(3, len(raw)) + raw

    return head(5, len(value)) + b"".join(text(k) + text(v) for k, v in value.items())
