"""What every AWS adapter shares: boto3 clients with bounded adaptive retries, the table and SSM names,
error codes, and bounded concurrency for independent calls."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import boto3
from botocore.client import BaseClient, ClientCreator
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.utils import parse_timestamp as botocore_parse_timestamp

from idle_reaper.aws.limits import RATE_HELD

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
        RATE_HELD,  # not sent: the product's own pacing held it back
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
# (session's event emitter, service, API version) -> (the emitter, kept so its id is never reused; the class)
_client_classes: dict[tuple[int, str, str | None], tuple[Any, type]] = {}
_make_client_class = ClientCreator._create_client_class  # type: ignore[attr-defined]


def _client_class(creator: ClientCreator, service_name: str, service_model: Any) -> type:
    """botocore builds a client's class anew for every client: a method per operation (EC2's 600 and more), two
    thirds of the 15-25 ms a member unit's EC2 client costs. The class holds no identity (credentials, region
    and endpoint are the instance's), so one per service and session's event handlers serves every account.
    A handler registered for `creating-client-class` after a service's first client would not apply: none is."""
    emitter = getattr(creator, "_event_emitter", None)
    key = (id(emitter), service_name, getattr(service_model, "api_version", None))
    made = _client_classes.get(key)
    if made is None:
        made = _client_classes.setdefault(key, (emitter, _make_client_class(creator, service_name, service_model)))
    return made[1]


ClientCreator._create_client_class = _client_class  # type: ignore[attr-defined]


# Clients are kept for the process's life, as AWS advises for Lambda: a warm container's next invocation reuses
# them and their open connections instead of building each again (10-25 ms of CPU a client: its event handlers
# copied, its endpoint rules, an SSL context) and opening new TLS connections. One per service, region,
# endpoint and identity; a member account's fresh credentials make a new one, and the least recently used go
# past KEPT_CLIENTS. A forked child (run_concurrently's processes) makes its own: the parent's pooled
# connections are not the child's to use.
KEPT_CLIENTS = 256
_kept: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_kept_by_events: dict[int, tuple[Any, ...]] = {}  # id of a kept client's event emitter -> its key
_kept_lock = threading.Lock()


def client(
    service: str,
    region: str | None = None,
    *,
    credentials: Mapping[str, str] | None = None,
    endpoint_url: str | None = None,
    kept: bool = True,
) -> Any:
    """A client as boto3.client makes it, from boto3's default session (so its credentials, region, endpoint
    and any handler registered on it apply), whose responses parse timestamps with `parse_timestamp`, kept for
    reuse (see KEPT_CLIENTS; forget_clients() drops them, for a session whose handlers changed; `kept=False`
    makes one of its own).
    `credentials` (aws_access_key_id, aws_secret_access_key, aws_session_token): another identity's, such as a
    member account's (aws/accounts.py), still from the default session: a session of its own would load every
    service model again (about 0.4 s a client)."""
    session = boto3._get_default_session()
    key = (
        os.getpid(),
        id(session),
        service,
        region or session.region_name,
        endpoint_url or os.environ.get("AWS_ENDPOINT_URL"),
        tuple(sorted((credentials or {}).items())),
    )
    with _kept_lock:
        found = _kept.get(key) if kept else None
        if found is not None:
            _kept.move_to_end(key)
            return found
    core = session._session  # boto3 has no public accessor for the botocore session it wraps
    if id(core) not in _quick_parsers:
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=parse_timestamp)
        _quick_parsers.add(id(core))
    made = session.client(  # type: ignore[call-overload]
        service, region_name=region, endpoint_url=endpoint_url, config=_RETRIES, **(credentials or {})
    )
    if not kept:
        return made
    with _kept_lock:
        if key in _kept:  # another thread made one meanwhile: both callers share it
            return _kept[key]
        _kept[key] = made
        _kept_by_events[id(made.meta.events)] = key
        while len(_kept) > KEPT_CLIENTS:
            _, dropped = _kept.popitem(last=False)
            _kept_by_events.pop(id(dropped.meta.events), None)
        return made


def forget_clients() -> None:
    """Drop the kept clients: the next ones are made afresh, with the session's handlers as they are then."""
    with _kept_lock:
        _kept.clear()
        _kept_by_events.clear()


def forget_client_with(events: Any) -> None:
    """Drop the kept client whose event emitter is `events`, if any: its owner changed its handlers, so it is
    that owner's own now, as a client made anew for it would have been."""
    with _kept_lock:
        key = _kept_by_events.pop(id(events), None)
        if key is not None:
            _kept.pop(key, None)


def for_this_process(aws_client: Any) -> Any:
    """A client a forked child process can use: a botocore client's pooled connections (and their TLS state)
    belong to the parent and to every sibling, so the child makes its own, to the same endpoint, with the same
    identity (a member account's, aws/accounts.py, stays that account's); anything else (the in-memory fakes)
    is the child's own copy already."""
    if not isinstance(aws_client, BaseClient):
        return aws_client
    meta = aws_client.meta
    # botocore has no public accessor for a client's credentials; frozen, they last the child's listing.
    signer: Any = aws_client._request_signer  # type: ignore[attr-defined]
    found = signer._credentials
    frozen = found.get_frozen_credentials() if found is not None else None
    credentials = (
        {
            "aws_access_key_id": frozen.access_key,
            "aws_secret_access_key": frozen.secret_key,
            **({"aws_session_token": frozen.token} if frozen.token else {}),
        }
        if frozen is not None
        else None
    )
    return client(
        meta.service_model.service_name,
        meta.region_name,
        credentials=credentials,
        endpoint_url=meta.endpoint_url,
        kept=False,
    )


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


class ProcessFailed(BotoCoreError):
    """A child process ended without an answer (killed, out of memory, or its answer could not be sent)."""

    fmt = "{what}"


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


def _child(fn: Callable[[Any], Any], item: Any, send: Connection) -> None:
    try:
        answer: tuple[bool, Any] = (True, fn(item))
    except Exception as exc:
        answer = (False, exc)
    try:
        send.send(answer)
    except Exception as exc:  # an answer that cannot be pickled still reports, as a failure
        send.send((False, ProcessFailed(what=f"its answer could not be sent: {type(exc).__name__}: {exc}")))
    finally:
        send.close()


def _in_processes(fn: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
    """`fn` over `items`, each in a forked child process (its own interpreter, so its own GIL: CPU-bound work
    such as parsing runs side by side on a Lambda with several vCPUs); answers travel back through a Pipe
    (Pool and Queue need /dev/shm, which Lambda lacks). Any child's error is raised here, a child that ends
    without an answer raises ProcessFailed: no result is ever returned in part."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    fork = multiprocessing.get_context("fork")  # the children inherit the code and the fakes' state; no re-import
    running: dict[Connection, tuple[int, Any]] = {}
    answers: dict[int, Result] = {}
    try:
        for index, item in enumerate(items):
            receive, send = fork.Pipe(duplex=False)
            process = fork.Process(target=_child, args=(fn, item, send), daemon=True)
            process.start()
            send.close()  # the parent keeps only its end, so a dead child reads as EOF
            running[receive] = (index, process)
        while running:
            for ready in wait(list(running)):
                assert isinstance(ready, Connection)
                index, process = running.pop(ready)
                try:
                    ok, answer = ready.recv()
                except EOFError:
                    process.join()
                    raise ProcessFailed(
                        what=f"a child process ended without an answer (exit {process.exitcode})"
                    ) from None
                finally:
                    ready.close()
                if not ok:
                    raise answer
                answers[index] = answer
                process.join()
    finally:
        for receive, (_, process) in running.items():  # after a failure: the others are not waited for
            process.kill()
            process.join()
            receive.close()
    return [answers[index] for index in range(len(items))]


class Concurrency:
    """Where independent calls run: on a bounded thread pool, or (CPU-bound work) in child processes. The
    latency-model benchmark swaps in runners that schedule the same tasks on virtual lanes (testkit/aws/
    LatencyModel)."""

    runner: Callable[[Callable[[Any], Any], Sequence[Any], int], list[Any]] = staticmethod(_on_threads)
    processes: Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]] = staticmethod(_in_processes)


def run_concurrently(fn: Callable[[Item], Result], items: Sequence[Item], workers: int) -> list[Result]:
    """`fn` over `items` on at most `workers` threads, results in order. `fn` handles its own errors."""
    return Concurrency.runner(fn, items, workers)


def run_in_processes(fn: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
    """`fn` over `items`, each in its own child process, results in order; any failure raises (AwsError)."""
    return Concurrency.processes(fn, items)
