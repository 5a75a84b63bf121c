"""What every AWS adapter shares: boto3 clients with bounded adaptive retries, the table and SSM names,
error codes, and bounded concurrency for independent calls."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

DEFAULT_TABLE = "idle-reaper-state"
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


def client(service: str, region: str | None = None) -> Any:
    return boto3.client(service, region_name=region, config=_RETRIES)  # type: ignore[call-overload]


def table_name() -> str:
    return os.environ.get("IDLE_REAPER_TABLE", DEFAULT_TABLE)


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
