"""What every AWS adapter shares: boto3 clients with bounded adaptive retries, the table and SSM names,
error codes, and bounded concurrency for independent calls."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.utils import parse_timestamp as botocore_parse_timestamp

DEFAULT_DEPLOY_PREFIX = "idle-reaper"  # the stack's prefix (infra/stack.py) when none is chosen
TABLE_SUFFIX = "-state"  # a stack's table is <prefix>-state
DEFAULT_TABLE = f"{DEFAULT_DEPLOY_PREFIX}{TABLE_SUFFIX}"
DEFAULT_PREFIX = "/idle-reaper"
# Errors about the call, not about one machine: splitting the batch would only multiply them.
CALL_WIDE_ERRORS = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Unavailable",
    }
)
DDB_WORKERS = 32

_RETRIES = Config(
    retries={"mode": "adaptive", "max_attempts": 5},
    connect_timeout=5,
    read_timeout=30,
    max_pool_connections=DDB_WORKERS,
)


def parse_timestamp(value: Any) -> datetime:
    """botocore's timestamp parser, quicker for the two shapes AWS sends us: ISO 8601 (EC2's LaunchTime,
    XML) and epoch seconds (CloudWatch's datapoints, JSON). botocore's own (dateutil) costs about half of
    parsing a DescribeInstances page (benchmarks/botocore_cpu.py); anything else still goes to it."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str) and len(value) >= 19 and value[4] == "-" and value[10] == "T":
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if parsed.tzinfo is not None:  # AWS always says the zone; anything else is botocore's to read
                return parsed
    return botocore_parse_timestamp(value)


_quick_parsers: set[int] = set()  # the botocore sessions whose parsers already use parse_timestamp


def client(service: str, region: str | None = None, *, credentials: Mapping[str, str] | None = None) -> Any:
    """A client as boto3.client makes it, from boto3's default session (so its credentials, region, endpoint
    and any handler registered on it apply), whose responses parse timestamps with `parse_timestamp`.
    `credentials` (aws_access_key_id, aws_secret_access_key, aws_session_token): another identity's, such as a
    member account's (aws/accounts.py), still from the default session: a session of its own would load every
    service model again (about 0.4 s a client)."""
    session = boto3._get_default_session()
    core = session._session  # boto3 has no public accessor for the botocore session it wraps
    if id(core) not in _quick_parsers:
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
        _quick_parsers.add(id(core))
    return session.client(service, region_name=region, config=_RETRIES, **(credentials or {}))  # type: ignore[call-overload]


def table_name() -> str:
    return os.environ.get("IDLE_REAPER_TABLE", DEFAULT_TABLE)


def deploy_prefix() -> str:
    """The deploy prefix of the stack this runs for, from its table's name (`<prefix>-state`, the name the stack
    gives it and passes in IDLE_REAPER_TABLE); a table named otherwise (a local run's own) is the default's."""
    table = table_name()
    prefix = table.removesuffix(TABLE_SUFFIX)
    return prefix if prefix and prefix != table else DEFAULT_DEPLOY_PREFIX


def ssm_prefix() -> str:
    return os.environ.get("IDLE_REAPER_SSM_PREFIX", DEFAULT_PREFIX).rstrip("/")


def error_code(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", "ClientError"))
    return type(exc).__name__


AwsError = (ClientError, BotoCoreError)


def wall_clock() -> datetime:
    return datetime.now(UTC)


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


Item = TypeVar("Item")
Result = TypeVar("Result")


def _on_threads(fn: Callable[[Item], Result], items: Sequence[Item], workers: int) -> list[Result]:
    if len(items) <= 1 or workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="idle-reaper") as pool:
        return list(pool.map(fn, items))


class Concurrency:
    """Where independent calls run: on a bounded thread pool. The latency-model benchmark swaps in a
    runner that schedules the same tasks on virtual lanes (testkit/aws/ LatencyModel)."""

    runner: Callable[[Callable[[Any], Any], Sequence[Any], int], list[Any]] = staticmethod(_on_threads)


def run_concurrently(fn: Callable[[Item], Result], items: Sequence[Item], workers: int) -> list[Result]:
    """`fn` over `items` on at most `workers` threads, results in order. `fn` handles its own errors."""
    return Concurrency.runner(fn, items, workers)
