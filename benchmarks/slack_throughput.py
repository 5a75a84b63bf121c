"""How a first look at a fleet, and the stops that follow, reach every owner under Slack's documented limits.

Runs the REAL sweep (run_sweep as handlers/sweep.py calls it: the owner messages, the delivery's conversations, the
stop-notice pass at its end), the REAL SlackNotifier and the REAL slack-sdk WebClient with its Retry-After handling
(slack.client.make_client, with the handler's 429 budget: slack_budget of the invocation's time left) against the
local Slack (tools/idle_reaper_tools/fake_slack.py) holding Slack's documented limits (RateLimits: Tier 2/3/4 calls
a minute per method; chat.postMessage POST_BURST then one a second per conversation, and 300 a minute across the
workspace), answered in-process. Every Slack call is charged SLACK_LATENCY, every AWS call its latency (testkit/aws
LATENCY: DynamoDB 4-10 ms, GetMetricData 0.6 s, EC2 0.25-0.3 s, Auto Scaling 0.2 s, SSM 30 ms). The handler's side
jobs after the sweep (the daily doctor, the count of unwatched regions) are not run.

The clock is virtual and discrete-event (VirtualTime): the sweep's thread pools (aws.Concurrency) run on real
threads, one at a time, and every wait (a call's latency, a Retry-After slack-sdk sleeps, the notifier's pace of one
post a second in a channel, the notice pass's chat.update pace, the AWS pacers, a lease poll) moves the waiting
thread's clock; the thread whose clock is earliest runs next. So the calls of concurrent threads reach the local
Slack in the order of their virtual time, and its limits see exactly the calls of the past minute. The code's own
CPU is not modelled (it takes no virtual time). The run is deterministic: the same figures every time.

Sweeps every 5 minutes from T0, each an invocation of the sweep Lambda: its own client and notifier (as
Adapters.from_environment makes them), time_left from the 240 s timeout on the virtual clock, and the client's 429
budget slack_budget(context) at its start. They run until every warning due is delivered, every machine due is
stopped and every stop is told (or --max-sweeps).

Fleet: benchmarks/sweep_cost.py's build_fleet, its Owner tags re-tagged to --owners people (the k-th tagged machine:
user{k % owners}), every owner a Slack user; the Auto Scaling groups' workers have no Owner tag. Each valid team's
policy names a public team channel the bot has not joined (notify: both, the default), so warnings go to the owner's
DM and the channel (--no-channels: the owner's DM alone, as build_fleet's policies have it).

Measured from the calls the local Slack answered, not from what the product reports: per method, the most calls in
any minute (taken by Slack, and asked: 429s included) against its limit; posts per conversation; from each stop (its
EC2 or Auto Scaling call done) to the first post or edit of its notice Slack took; and the account: every warning
due delivered to every conversation its policy names, once, before any stop (and, from the records, the warnings
that owed a conversation its copy after a sweep: posted there by a later one); every stop told, in a message that
still names the machine. Exits 1 when any of that fails, or the sweeps do not finish.

    python benchmarks/slack_throughput.py [--size 10000] [--owners 2000] [--max-sweeps 72] [--no-channels]
"""

from __future__ import annotations

import argparse
import email.message
import faulthandler
import heapq
import io
import itertools
import json
import logging
import os
import random
import statistics
import sys
import threading
import time
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

from slack_sdk.http_retry import builtin_handlers  # noqa: E402
from slack_sdk.http_retry import handler as retry_handler_module  # noqa: E402
from slack_sdk.web import WebClient  # noqa: E402
from sweep_cost import PREFIX, T0, TEAM_POLICIES, build_fleet  # noqa: E402

import testkit.aws.clients as testkit_clients  # noqa: E402
from idle_reaper.aws import Concurrency, Pacing  # noqa: E402
from idle_reaper.core.records import State  # noqa: E402
from idle_reaper.handlers.sweep import slack_budget  # noqa: E402
from idle_reaper.slack import SlackNotifier, make_client  # noqa: E402
from idle_reaper.slack.notices import StopNotice  # noqa: E402
from idle_reaper.slack.shared import WARNING_EVENT  # noqa: E402
from idle_reaper.sweep import logger, run_sweep  # noqa: E402
from idle_reaper_tools.fake_slack import POST_BURST, TIER_PER_MINUTE, FakeSlack, RateLimits  # noqa: E402
from testkit.aws import CountingStateStore, LatencyModel  # noqa: E402

SLACK_LATENCY = 0.25  # a Slack Web API call from us-east-1
SWEEP_TIMEOUT_S = 240.0  # the sweep Lambda's timeout at the default 5-minute schedule
SWEEP_EVERY = timedelta(minutes=5)
WATCHDOG_SECONDS = 300.0  # real seconds without a thread switch: a deadlock in the model, reported and ended
# Each valid team's public channel (research's policy is invalid: safe mode, it warns nobody).
TEAM_CHANNELS = {"ml": "C0BENCHML", "cv": "C0BENCHCV", "nlp": "C0BENCHNLP", "data": "C0BENCHDATA",
                 "platform": "C0BENCHPLAT"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The virtual clock


class VirtualTime:
    """The `time` of every module that waits or reads the clock (idle_reaper.*, slack-sdk's retry handlers, the
    latency model): a discrete-event clock. Threads run one at a time; a thread that sleeps (a call's latency, a
    Retry-After, a pace) is queued to run again at now + seconds, and the thread queued earliest runs next, the
    clock moving to its time. `run` stands in for the sweep's thread pools (aws.Concurrency.runner): the pool's
    threads are real, queued at the caller's time, and the caller runs again when the last of them ends. Anything
    else (perf_counter, thread_time) is the real time module's."""

    def __init__(self, origin: float) -> None:
        self.origin = origin  # epoch seconds at virtual 0 (T0)
        self.now = 0.0
        self.switches = 0
        self._lock = threading.Lock()
        self._ready: list[tuple[float, int, threading.Event]] = []
        self._order = itertools.count()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.origin + self.now

    def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        wake = threading.Event()
        with self._lock:
            heapq.heappush(self._ready, (self.now + seconds, next(self._order), wake))
            self._run_next()
        wake.wait()

    def _run_next(self) -> None:
        """(Lock held.) The calling thread stops running; the thread queued earliest runs."""
        at, _, wake = heapq.heappop(self._ready)
        self.now = max(self.now, at)
        self.switches += 1
        wake.set()

    def advance_to(self, at: float) -> None:
        """Between sweeps (only the main thread alive): the clock moves on to the next sweep's start."""
        assert not self._ready
        self.now = max(self.now, at)

    def run(self, fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
        items = list(items)
        if len(items) <= 1 or workers <= 1:
            return [fn(item) for item in items]
        results: list[Any] = [None] * len(items)
        failures: list[BaseException] = []
        queue = iter(list(enumerate(items)))
        left = [min(workers, len(items))]
        resume = threading.Event()

        def worker(go: threading.Event) -> None:
            go.wait()
            try:
                for index, item in queue:
                    results[index] = fn(item)
            except BaseException as exc:
                failures.append(exc)
            finally:
                with self._lock:
                    left[0] -= 1
                    if left[0] == 0:  # the caller runs again, now
                        heapq.heappush(self._ready, (self.now, next(self._order), resume))
                    self._run_next()

        with self._lock:
            for _ in range(left[0]):
                go = threading.Event()
                heapq.heappush(self._ready, (self.now, next(self._order), go))
                threading.Thread(target=worker, args=(go,), daemon=True).start()
            self._run_next()
        resume.wait()
        if failures:
            raise failures[0]
        return results

    def processes(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        return self.run(fn, items, len(items))

    def watchdog(self) -> None:
        """A model that deadlocks (a thread blocked for real on another that waits on the clock) says where."""

        def watch() -> None:
            seen = -1
            while True:
                time.sleep(WATCHDOG_SECONDS)
                if self.switches == seen and self._ready:
                    print("the virtual clock is stuck: every thread's stack follows", file=sys.stderr)
                    faulthandler.dump_traceback(all_threads=True)
                    os._exit(3)
                seen = self.switches

        threading.Thread(target=watch, daemon=True).start()


@contextmanager
def on_virtual_time(clock: VirtualTime) -> Iterator[None]:
    """While it lasts, everything the sweep waits on or reads the time from is the virtual clock: the `time` of
    every idle_reaper module that holds the time module (slack.client, slack.notices, slack.notifier, slack.shared,
    sweep.notices, ...), of slack-sdk's retry handlers and of the latency model; the AWS pacers (aws.limits.Pacing,
    bound to time.monotonic and time.sleep when imported); and the sweep's thread pools (aws.Concurrency)."""
    saved: list[tuple[ModuleType, Any]] = []
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("idle_reaper.") and m is not None]
    for module in [*modules, builtin_handlers, retry_handler_module, testkit_clients]:
        if getattr(module, "time", None) is time:
            saved.append((module, time))
            module.time = clock  # type: ignore[attr-defined]
    pacing, runners = (Pacing.clock, Pacing.sleep), (Concurrency.runner, Concurrency.processes)
    Pacing.clock, Pacing.sleep = clock.monotonic, clock.sleep  # type: ignore[method-assign,assignment]
    Concurrency.runner, Concurrency.processes = clock.run, clock.processes  # type: ignore[assignment]
    try:
        yield
    finally:
        Concurrency.runner, Concurrency.processes = runners  # type: ignore[method-assign]
        Pacing.clock, Pacing.sleep = pacing  # type: ignore[method-assign]
        for module, original in saved:
            module.time = original  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# The Slack client: slack-sdk's, each HTTP exchange answered by the local Slack in-process


@dataclass(frozen=True)
class SlackCall:
    at: float  # virtual seconds when the local Slack answered
    method: str
    status: int
    ok: bool
    channel: str
    ts: str
    warning_for: tuple[str, ...] = ()  # a warning post (whatever Slack answered): the machines its metadata names

    @property
    def warned(self) -> tuple[str, ...]:
        """The machines a warning post Slack took names."""
        return self.warning_for if self.ok else ()


class InProcessClient(WebClient):
    """slack-sdk's WebClient with its retries and Retry-After handling intact; only the HTTP exchange is
    answered by the local Slack in-process, each call charged SLACK_LATENCY on the virtual clock first."""

    def __init__(self, fake: FakeSlack, model: LatencyModel, clock: VirtualTime, log: list[SlackCall], **kw: Any):
        super().__init__(**kw)
        self.fake, self.model, self.clock, self.log = fake, model, clock, log

    def _perform_urllib_http_request_internal(self, url: str, req: Request) -> dict[str, Any]:
        parsed = urllib.parse.urlsplit(url)
        method = parsed.path.rsplit("/", 1)[-1]
        body = req.data.decode() if isinstance(req.data, bytes) else str(req.data or "")
        params: dict[str, Any] = {k: v[0] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        if body.startswith("{"):
            params.update(json.loads(body))
        else:
            params.update({k: v[0] for k, v in urllib.parse.parse_qs(body).items()})
        self.model.latency.setdefault(f"slack:{method}", SLACK_LATENCY)
        self.model.charge(f"slack:{method}")
        status, headers, answer = self.fake.answer(method, params)
        ok = status == 200 and bool(answer.get("ok"))
        metadata = params.get("metadata")
        if isinstance(metadata, str):
            metadata = json.loads(metadata)
        warning_for: tuple[str, ...] = ()
        if method == "chat.postMessage" and isinstance(metadata, dict) and metadata.get("event_type") == WARNING_EVENT:
            warning_for = tuple((metadata.get("event_payload") or {}).get("instance_ids") or ())
        # A post to a user id is recorded by the local Slack where it lands (the app's DM with them: D...).
        channel = str(answer.get("channel") or params.get("channel") or params.get("users") or "")
        ts = str(answer.get("ts") or "")
        self.log.append(SlackCall(self.clock.now, method, status, ok, channel, ts, warning_for))
        if status == 429:
            message = email.message.Message()
            for key, value in headers.items():
                message[key] = value
            raise HTTPError(url, 429, "Too Many Requests", message, io.BytesIO(json.dumps(answer).encode()))
        return {"status": status, "headers": headers, "body": json.dumps(answer)}


@dataclass
class Invocation:
    """What the sweep handler reads of its Lambda context: the time left of its timeout, on the virtual clock."""

    clock: VirtualTime
    started: float

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((SWEEP_TIMEOUT_S - (self.clock.now - self.started)) * 1000))

    def time_left(self) -> float:  # as handlers/sweep.py hands it to run_sweep
        return self.get_remaining_time_in_millis() / 1000


# ---------------------------------------------------------------------------------------------
# What the benchmark watches


@dataclass
class NoticePassSeen:
    started: float
    ended: float
    records: dict[str, Any]  # key -> the record as the pass got it (its notice, its message copies)
    told: dict[str, tuple[str, tuple[str, ...]]]  # key -> ("sent" | "retry" | "gone", copies of a message of its own)


@dataclass
class Ledger:
    """What became of each machine: from the sweeps' decisions, the records, and the calls the local Slack took."""

    due: dict[str, int] = field(default_factory=dict)  # machine -> first sweep its warning was due
    delivered: dict[str, int] = field(default_factory=dict)  # machine -> sweep its warning was delivered
    undeliverable: dict[str, str] = field(default_factory=dict)  # machine -> why (the record's delivery_error)
    stopped: dict[str, tuple[int, float]] = field(default_factory=dict)  # machine -> (sweep, when acted on)
    told: dict[str, float] = field(default_factory=dict)  # machine -> when Slack took its notice
    gone: dict[str, str] = field(default_factory=dict)  # machine -> why its notice was given up
    titles: dict[str, str] = field(default_factory=dict)  # machine -> its notice's title
    untellable: set[str] = field(default_factory=set)  # stopped with no notice drafted (nobody to tell)
    actions: dict[str, str] = field(default_factory=dict)  # stopped machine -> what was done (stop, unprotect, ...)
    targets: dict[str, int] = field(default_factory=dict)  # machine due a warning -> conversations it goes to
    owed: set[str] = field(default_factory=set)  # delivered warnings that owed a copy after some sweep (warning_owed)
    passes: list[NoticePassSeen] = field(default_factory=list)
    taken: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # "channel|ts" -> posts, edits
    indexed: int = 0  # calls of the log in `taken`

    def index(self, log: Sequence[SlackCall]) -> None:
        for call in log[self.indexed :]:
            if call.ok and call.method in ("chat.update", "chat.postMessage"):
                self.taken[f"{call.channel}|{call.ts}"].append(call.at)
        self.indexed = len(log)

    def first_taken(self, copies: set[str], start: float, end: float) -> float | None:
        """When Slack first took a post or an edit of one of `copies` ("channel|ts") in [start, end]."""
        return min((t for copy in copies for t in self.taken.get(copy, ()) if start <= t <= end), default=None)

    def note_sweep(self, n: int, report: Any, start: float, acted: dict[str, float], store: Any) -> int:
        """Sweep #n's decisions and notice passes: how many warnings were delivered, stops made, notices told."""
        changed = 0
        for d in report.decisions:
            key, record = d.machine.key, d.record
            if (record.warned_at is not None or d.deliver_warning) and key not in self.due:
                self.due[key] = n
                policy = d.policy.policy if d.policy else None
                owned = bool(d.machine.owner) and (policy is None or policy.notify != "channel")
                channel = policy is not None and bool(policy.slack_channel) and policy.notify != "owner"
                self.targets[key] = int(owned) + int(channel)
            if record.warning_delivered_at is not None and key in self.due and key not in self.delivered:
                self.delivered[key] = n
                changed += 1
            if record.delivery_error and key not in self.delivered:
                self.undeliverable[key] = record.delivery_error
            if record.warning_owed:
                self.owed.add(key)
            if d.notify == "reaped" and d.applied and d.error is None and key not in self.stopped:
                self.stopped[key] = (n, acted.get(d.machine.instance_id, start))
                self.actions[key] = d.action.value
                changed += 1
                if not record.notice:
                    self.untellable.add(key)
        for seen in [p for p in self.passes if p.started >= start]:
            for key, (status, posted) in seen.told.items():
                before = seen.records[key]
                notice = StopNotice.parse(before.notice)
                if notice is not None:
                    self.titles[key] = notice.title
                stored = store.records.get(key)
                if stored is None or stored.notice is not None or key in self.told:
                    continue  # still pending (or told before)
                if status == "sent":
                    at = self.first_taken(set(before.messages) | set(posted), seen.started, seen.ended)
                    self.told[key] = at if at is not None else seen.ended
                    changed += 1
                elif status == "gone":
                    self.gone[key] = "nowhere to tell it (its message gone, no target)"
        return changed


def watch_actions(fleet: Any, clock: VirtualTime, acted: dict[str, float]) -> None:
    """When each stop, hibernation, termination or release (protection dropped) EC2 or Auto Scaling took ended."""
    for name in ("stop", "terminate", "terminate_in_groups", "set_protection"):
        real = getattr(fleet, name)

        def wrapped(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            outcomes = _real(*args, **kwargs)
            if _name != "set_protection" or kwargs.get("protected") is False:
                for o in outcomes:
                    if o.error is None:
                        acted.setdefault(o.instance_id, clock.now)
            return outcomes

        setattr(fleet, name, wrapped)


def watch_notices(notifier: SlackNotifier, clock: VirtualTime, ledger: Ledger) -> None:
    """Each notice pass: when it ran, the records it was given and what it says became of each."""
    real = notifier.send_notices

    def send_notices(records: Sequence[Any], pace: Any) -> Any:
        started = clock.now
        told = real(records, pace)
        ledger.passes.append(NoticePassSeen(started, clock.now, {r.key: r for r in records}, dict(told)))
        return told

    notifier.send_notices = send_notices  # type: ignore[method-assign]


def texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in texts(v)]
    return []


def shown(fake: FakeSlack, copies: Sequence[str], key: str, title: str) -> str:
    """What a copy of the machine's message, as Slack holds it now, says of its stop: "named" (a line with the
    notice's title and the machine's id), "unnamed" (the title, but no line names the machine), or "" (nothing)."""
    best = ""
    for copy in copies:
        channel, _, ts = copy.partition("|")
        message = fake.messages.get((channel, ts))
        if message is None:
            continue
        blocks = message.get("blocks")
        if isinstance(blocks, str):
            blocks = json.loads(blocks)
        lines = [*texts(blocks), str(message.get("text") or "")]
        if any(key in t and title in t for t in lines):
            return "named"
        if any(title in t for t in lines):
            best = "unnamed"
    return best


def peak_within(times: Sequence[float], seconds: float = 60.0) -> int:
    """The most calls in any window (t - seconds, t] of virtual time."""
    ordered, peak, start = sorted(times), 0, 0
    for i, t in enumerate(ordered):
        while ordered[start] <= t - seconds:
            start += 1
        peak = max(peak, i - start + 1)
    return peak


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def by_count(counts: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{m} {c:,}" for m, c in sorted(counts.items(), key=lambda mc: (-mc[1], mc[0]))) or "none"


def e_g(keys: Sequence[str]) -> str:
    return f" (e.g. {', '.join(keys[:4])})" if keys else ""


# ---------------------------------------------------------------------------------------------


def build(size: int, seed: int, owners: int, channels: bool) -> tuple[Any, list[str]]:
    """build_fleet's fleet, its Owner tags re-tagged to `owners` people (the k-th tagged machine: user{k % owners}),
    and (`channels`) each valid team's public channel in its policy. The fleet, and its owners' e-mails."""
    aws = build_fleet(size, seed).aws
    tagged = [inst for inst in aws.ec2.instances.values() if inst.tags.get("Owner")]
    for k, inst in enumerate(tagged):
        inst.tags["Owner"] = f"user{k % owners}@example.com"
        inst.api["Tags"] = [{"Key": key, "Value": value} for key, value in inst.tags.items()]  # DescribeInstances'
    if channels:
        for team, policy in {**TEAM_POLICIES, "data": {}}.items():
            if team in TEAM_CHANNELS:
                aws.ssm.store(f"{PREFIX}/teams/{team}", json.dumps({**policy, "slack_channel": TEAM_CHANNELS[team]}))
    return aws, sorted({inst.tags["Owner"] for inst in tagged})


def run(size: int, seed: int, owners: int, max_sweeps: int, channels: bool) -> int:
    started_real = time.perf_counter()
    random.seed(seed)  # slack-sdk's Retry-After jitter
    aws, people = build(size, seed, owners, channels)
    clock = VirtualTime(T0.timestamp())
    model = LatencyModel(sleep=True)  # every charge sleeps: on the virtual clock
    aws.set_latency(model)
    store = CountingStateStore(model)
    virtual_now: Callable[[], datetime] = lambda: T0 + timedelta(seconds=clock.now)  # noqa: E731
    store.clock = virtual_now  # claims and leases lapse on the sweeps' clock
    fake = FakeSlack(limits=RateLimits(clock=clock.monotonic), clock=clock.time)
    fake.users_by_email = {o.lower(): f"U{n:06d}" for n, o in enumerate(people)}
    log: list[SlackCall] = []
    ledger = Ledger()

    where = "the owner's DM and the team's public channel (not joined)" if channels else "the owner's DM"
    print(
        f"\n== {size:,} machines, {len(people):,} owners; warnings to {where}, a group's workers (no Owner tag) to "
        f"the team channel; sweeps every 5 min, each a {SWEEP_TIMEOUT_S:.0f} s invocation ==",
        flush=True,
    )
    refused_before: Counter[str] = Counter()
    done_at = 0
    with on_virtual_time(clock):
        clock.watchdog()
        for n in range(1, max_sweeps + 1):
            now = T0 + SWEEP_EVERY * (n - 1)
            clock.advance_to((now - T0).total_seconds())
            start = clock.now
            invocation = Invocation(clock, start)
            # As the handler: a client whose 429 budget is the invocation's time less what finishing needs.
            production = make_client("xoxb-bench", slack_budget(invocation))  # type: ignore[arg-type]
            web = InProcessClient(fake, model, clock, log, token="xoxb-bench", retry_handlers=production.retry_handlers)
            notifier = SlackNotifier(web, store, virtual_now)
            watch_notices(notifier, clock, ledger)
            adapters = aws.adapters(store=store, notifier=notifier, prefix=PREFIX)
            acted: dict[str, float] = {}
            watch_actions(adapters.fleet, clock, acted)
            calls_before, passes_before = len(log), len(ledger.passes)
            report = run_sweep(adapters, now=now, time_left=invocation.time_left)
            modelled = clock.now - start
            ledger.index(log)
            changed = ledger.note_sweep(n, report, start, acted, store)

            calls = Counter(c.method for c in log[calls_before:])
            refused = Counter(fake.limits.refused_by_method if fake.limits else {})
            refused_now, refused_before = refused - refused_before, refused
            stops = len(ledger.stopped)
            notice_pass = ledger.passes[passes_before:]
            took = f"; notice pass {notice_pass[-1].ended - notice_pass[-1].started:.0f} s" if notice_pass else ""
            over = f" OVER ITS {SWEEP_TIMEOUT_S:.0f} s TIMEOUT" if modelled > SWEEP_TIMEOUT_S else ""
            print(f"  sweep #{n} (+{(now - T0).total_seconds() / 60:.0f} min): {modelled:,.1f} s modelled{over}{took}; "
                  f"deferred {len(report.deferred):,}")  # fmt: skip
            print(f"    Slack calls (429s included): {sum(calls.values()):,} ({by_count(calls)})")
            print(f"    429s the local Slack answered: {sum(refused_now.values()):,} ({by_count(refused_now)})")
            print(
                f"    warnings delivered so far: {len(ledger.delivered):,} of {len(ledger.due):,} due;"
                f" stops so far: {stops:,}; stop notices told so far: {len(ledger.told):,} of {stops:,}",
                flush=True,
            )

            # Done: every warning due delivered (or undeliverable), no stop still ahead, every stop told (or given
            # up), and this sweep changed nothing.
            undelivered = set(ledger.due) - set(ledger.delivered) - set(ledger.undeliverable)
            ahead = [
                r
                for r in store.records.values()
                if r.state is State.WARNED and r.stop_not_before is not None and r.stop_not_before > now
            ]
            pending = stops - len(ledger.told) - len(ledger.gone) - len(ledger.untellable)
            if not undelivered and not ahead and not pending and not changed and not report.deferred:
                done_at = n
                break

    status = report_totals(ledger, log, fake, store, done_at, max_sweeps)
    print(
        f"\n  real time: {time.perf_counter() - started_real:,.1f} s for {clock.now / 3600:.1f} h of sweeps on the "
        f"virtual clock ({clock.switches:,} thread switches)"
    )
    return status


def report_totals(ledger: Ledger, log: list[SlackCall], fake: FakeSlack, store: Any, done_at: int, bound: int) -> int:
    print(
        f"\n  every warning due delivered, every due stop made and told: done after sweep #{done_at}"
        if done_at
        else f"\n  NOT DONE after {bound} sweeps (--max-sweeps)"
    )
    report_rates(log)
    stops = ledger.stopped
    delays = sorted(ledger.told[k] - stops[k][1] for k in ledger.told if k in stops)
    print(f"\n  From a stop (its EC2 or Auto Scaling call done) to its notice taken by Slack ({len(delays):,} told):")
    if delays:
        p90 = delays[min(len(delays) - 1, int(0.9 * len(delays)))]
        print(
            f"    longest {minutes(delays[-1])}, median {minutes(statistics.median(delays))}, 90th percentile "
            f"{minutes(p90)}, shortest {minutes(delays[0])}"
        )
    failed = account(ledger, log, fake, store)
    return 1 if failed or not done_at else 0


def report_rates(log: Sequence[SlackCall]) -> None:
    """Per method, the most calls in any minute: those Slack took (the local Slack answers 429 past the limit, so
    never more than it) and those asked (429s included: more than the limit means 429s waited out or given up)."""
    print("\n  Slack calls per method, most in any minute of virtual time (taken by Slack; asked, 429s included):")
    taken: dict[str, list[float]] = defaultdict(list)
    asked: dict[str, list[float]] = defaultdict(list)
    for call in log:
        asked[call.method].append(call.at)
        if call.status != 429:
            taken[call.method].append(call.at)
    for method in sorted(asked, key=lambda m: -len(asked[m])):
        limit = TIER_PER_MINUTE.get(method)
        peak = peak_within(taken[method]) if taken[method] else 0
        flag = "  OVER THE LIMIT" if limit is not None and peak > limit else ""
        print(
            f"    {method:22s} {peak:4d}/min taken, {peak_within(asked[method]):4d}/min asked; limit "
            f"{limit if limit is not None else 'none'}; {len(taken[method]):,} taken in all, "
            f"{len(asked[method]) - len(taken[method]):,} answered 429{flag}"
        )
    posts: dict[str, list[float]] = defaultdict(list)
    for call in log:
        if call.method == "chat.postMessage" and call.status != 429:
            posts[call.channel].append(call.at)
    if posts:
        busiest = max(posts, key=lambda c: peak_within(posts[c]))
        per_second = max(peak_within(times, 1.0) for times in posts.values())
        print(
            f"    chat.postMessage per conversation: at most {peak_within(posts[busiest])} in a minute ({busiest}, "
            f"{len(posts[busiest]):,} in all), {per_second} in a second (limit: a burst of {POST_BURST}, then one a "
            f"second); {len(posts):,} conversations"
        )


def account(ledger: Ledger, log: Sequence[SlackCall], fake: FakeSlack, store: Any) -> int:
    """Every warning due delivered, to every conversation its policy names, once, before any stop; every stop told,
    in a message that names the machine. Prints what failed; returns how many failed."""
    print("\n  Account:")
    failed = 0
    stops = ledger.stopped
    undelivered = sorted(set(ledger.due) - set(ledger.delivered))
    owners_due = {store.records[k].owner for k in ledger.due if k in store.records} - {None}
    owners_warned = {store.records[k].owner for k in ledger.delivered if k in store.records} - {None}
    print(
        f"    warnings due: {len(ledger.due):,}; delivered: {len(ledger.delivered):,}; owners warned: "
        f"{len(owners_warned):,} of {len(owners_due):,}"
    )
    for key in undelivered[:10]:
        record = store.records.get(key)
        why = ledger.undeliverable.get(key) or (record.reason if record else "no record")
        print(f"      NOT DELIVERED {key}: {why}")
    failed += len(undelivered)

    print(f"    stops: {len(stops):,} ({by_count(Counter(ledger.actions.values()))}); told (Slack took the notice): "
          f"{len(ledger.told):,}")  # fmt: skip
    untold = [k for k in stops if k not in ledger.told]
    for key in untold[:10]:
        why = ledger.gone.get(key) or ("no notice drafted (nobody to tell)" if key in ledger.untellable else "pending")
        print(f"      NOT TOLD {key} (stopped in sweep #{stops[key][0]}): {why}")
    failed += len(untold)
    says = {k: shown(fake, store.records[k].messages, k, ledger.titles.get(k, "?")) for k in ledger.told}
    hidden = sorted(k for k, said in says.items() if not said)
    print(f"    notices told that no copy of the message shows now (as the local Slack holds it): {len(hidden):,}"
          f"{e_g(hidden)}")  # fmt: skip
    unnamed = sorted(k for k, said in says.items() if said == "unnamed")
    titled = Counter(f"{ledger.titles.get(k)} in team {store.records[k].team}" for k in unnamed)
    print(f"    notices shown on a line that does not name the machine: {len(unnamed):,}"
          + (f" ({by_count(titled)})" if unnamed else ""))  # fmt: skip
    failed += len(hidden) + len(unnamed)

    warning_posts: Counter[tuple[str, str]] = Counter()
    first_warned: dict[str, float] = {}
    for call in log:
        for key in call.warned:
            warning_posts[(call.channel, key)] += 1
            first_warned.setdefault(key, call.at)
    reached: dict[str, set[str]] = defaultdict(set)
    for conversation, key in warning_posts:
        reached[key].add(conversation[:1])
    short = sorted(k for k in ledger.delivered if len(reached[k]) < ledger.targets.get(k, 1))
    still = sorted(k for k, r in store.records.items() if r.warning_owed)
    owed = sorted(ledger.owed)
    print(f"    warnings that owed a conversation its copy after a sweep: {len(owed):,}{e_g(owed)}; still owed: "
          f"{len(still):,}{e_g(still)}")  # fmt: skip
    print(f"    warnings delivered to fewer conversations than their policy names: {len(short):,}{e_g(short)}")
    if short:
        missed: Counter[str] = Counter()
        for key in short:
            lost = "C" if "D" in reached[key] else "D"
            tries = [c.status for c in log if key in c.warning_for and c.channel[:1] == lost]
            where = "the team channel" if lost == "C" else "the owner's DM"
            missed[f"{where} (its post answered {', '.join(map(str, tries)) or 'never made'})"] += 1
        for what, count in missed.most_common():
            print(f"      {count:,} without {what}")
        print(f"      {sum(1 for k in short if k in stops):,} of them stopped since")
    failed += len(short)
    twice = sorted({key for (_, key), count in warning_posts.items() if count > 1})
    print(f"    machines with two warning posts in one conversation: {len(twice):,}{e_g(twice)}")
    failed += len(twice)
    unwarned = [k for k, (n, at) in stops.items() if ledger.delivered.get(k, n) >= n or first_warned.get(k, at) >= at]
    print(f"    stops without a warning delivered (and posted) before them: {len(unwarned):,}{e_g(unwarned)}")
    failed += len(unwarned)

    warned_left = Counter(
        (r.team, r.reason.split(";")[0][:90])
        for r in store.records.values()
        if r.state is State.WARNED and r.instance_id in ledger.delivered and r.instance_id not in stops
    )
    if warned_left:
        print("    warned, delivered and not stopped (their records' reasons):")
        for (team, reason), count in warned_left.most_common(6):
            print(f"      {count:,} of team {team}: {reason}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--owners", type=int, default=2_000, help="people the Owner tags name (build_fleet: 500)")
    parser.add_argument("--max-sweeps", type=int, default=72, help="at most this many sweeps (72: six hours)")
    parser.add_argument("--no-channels", action="store_true", help="warnings to the owner's DM alone")
    args = parser.parse_args(argv)
    handler = logger.registered_handler
    if isinstance(handler, logging.StreamHandler):
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115
    return run(args.size, args.seed, args.owners, args.max_sweeps, not args.no_channels)


if __name__ == "__main__":
    sys.exit(main())
