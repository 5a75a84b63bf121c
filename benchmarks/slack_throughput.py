"""How fast a first look reaches every owner under Slack's documented rate limits.

Runs the REAL sweep (run_sweep, the delivery's concurrent conversations, the REAL SlackNotifier and the REAL
slack-sdk WebClient with its Retry-After handling) against the Slack fake holding Slack's documented limits
(tools/idle_reaper_tools/fake_slack.py RateLimits: Tier 2/3/4 calls a minute per method, chat.postMessage
about one a second per conversation and 300 a minute across the workspace), answered in-process. Every
Slack call is charged 0.25 s and every AWS call its latency (testkit/aws/ LATENCY) on the latency model's
virtual clock; the sweep's thread pools are modelled as lanes (as benchmarks/sweep_latency.py does), the
waits a 429 asks for advance the waiting lane's clock, and the sweep's time budget is the Lambda's timeout
on that clock. Sweeps #1 (first look) and #2 (5 minutes later) of benchmarks/sweep_cost.py's fleet.

    python benchmarks/slack_throughput.py [--size 10000]
"""

from __future__ import annotations

import argparse
import email.message
import io
import json
import logging
import os
import sys
import urllib.parse
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

from slack_sdk.http_retry import builtin_handlers  # noqa: E402
from slack_sdk.web import WebClient  # noqa: E402
from sweep_cost import PREFIX, T0, build_fleet  # noqa: E402

from idle_reaper.core import Action  # noqa: E402
from idle_reaper.slack import SlackNotifier, make_client  # noqa: E402
from idle_reaper.slack import notifier as notifier_module  # noqa: E402
from idle_reaper.sweep import logger, run_sweep  # noqa: E402
from idle_reaper_tools.fake_slack import FakeSlack, RateLimits  # noqa: E402
from testkit.aws import CountingStateStore, LatencyModel  # noqa: E402

SLACK_LATENCY = 0.25  # a Slack Web API call from us-east-1
SWEEP_TIMEOUT_S = 240.0  # the sweep Lambda's timeout at the default 5-minute schedule
SWEEPS = (T0, T0 + timedelta(minutes=5))


class VirtualTime:
    """What slack-sdk's retry handler and the notifier's budget see: the model's clock, and a sleep that
    advances the sleeping lane's clock instead of waiting."""

    def __init__(self, model: LatencyModel) -> None:
        self.model = model
        self.slept = 0.0

    def monotonic(self) -> float:
        return self.model.virtual

    def time(self) -> float:
        return self.model.virtual

    def sleep(self, seconds: float) -> None:
        self.model.virtual += seconds
        self.slept += seconds


class InProcessClient(WebClient):
    """slack-sdk's WebClient with its retries and Retry-After handling intact; only the HTTP exchange is
    answered by the fake in-process, each call charged SLACK_LATENCY on the model's clock."""

    def __init__(self, fake: FakeSlack, model: LatencyModel, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fake, self.model = fake, model

    def _perform_urllib_http_request_internal(self, url: str, req: Request) -> dict[str, Any]:
        parsed = urllib.parse.urlsplit(url)
        method = parsed.path.rsplit("/", 1)[-1]
        body = req.data.decode() if isinstance(req.data, bytes) else str(req.data or "")
        params = {k: v[0] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        if body.startswith("{"):
            params.update(json.loads(body))
        else:
            params.update({k: v[0] for k, v in urllib.parse.parse_qs(body).items()})
        self.model.charge(f"slack:{method}")
        status, headers, answer = self.fake.answer(method, params)
        if status == 429:
            message = email.message.Message()
            for key, value in headers.items():
                message[key] = value
            raise HTTPError(url, 429, "Too Many Requests", message, io.BytesIO(json.dumps(answer).encode()))
        return {"status": status, "headers": headers, "body": json.dumps(answer)}


def run(size: int, seed: int) -> None:
    bench = build_fleet(size, seed)
    aws = bench.aws
    model = LatencyModel(sleep=False)
    model.latency.update({f"slack:{m}": SLACK_LATENCY for m in (
        "chat.postMessage", "chat.update", "conversations.open", "conversations.history",
        "users.lookupByEmail", "users.list", "users.info", "usergroups.users.list", "auth.test",
    )})  # fmt: skip
    aws.set_latency(model)
    store = CountingStateStore(model)
    fake = FakeSlack(limits=RateLimits(clock=lambda: model.virtual))
    owners = {m.tags.get("Owner") for m in aws.ec2.instances.values()} - {None}
    fake.users_by_email = {o.lower(): f"U{n:06d}" for n, o in enumerate(sorted(o for o in owners if o))}
    clock = VirtualTime(model)
    saved = (builtin_handlers.time, notifier_module.time)
    builtin_handlers.time, notifier_module.time = clock, clock  # type: ignore[assignment]
    model.install()
    try:
        client = make_client("xoxb-bench", SWEEP_TIMEOUT_S)  # its budget on the virtual clock
        web = InProcessClient(fake, model, token="xoxb-bench", retry_handlers=client.retry_handlers)
        # The notifier tells the sweep's time (T0's day), not the wall clock: its references last a week.
        swept = {"at": SWEEPS[0]}
        notifier = SlackNotifier(web, store, lambda: swept["at"])
        adapters = aws.adapters(store=store, notifier=notifier, prefix=PREFIX)
        print(f"\n== a first look at {size:,} machines, {len(owners)} owners, under Slack's documented limits ==")
        must_warn: set[str] = set()
        calls_before: Counter[str] = Counter()
        for n, now in enumerate(SWEEPS, 1):
            start, swept["at"] = model.virtual, now
            for budget in builtin_handlers_budgets(web):
                budget.deadline = start + SWEEP_TIMEOUT_S
            report = run_sweep(adapters, now=now, time_left=lambda s=start: SWEEP_TIMEOUT_S - (model.virtual - s))
            must_warn |= {  # a warning someone can receive (a machine without an Owner is undeliverable)
                d.machine.instance_id
                for d in report.decisions
                if (d.action is Action.WARN or d.record.warned_at) and d.machine.owner and not d.record.delivery_error
            }
            warned = {i for i in must_warn if (r := store.records.get(i)) and r.warning_delivered_at is not None}
            owners_due = {store.records[i].owner for i in must_warn if i in store.records}
            owners_told = {store.records[i].owner for i in warned if store.records[i].warning_delivered_at is not None}
            calls = Counter(c.method for c in fake.calls) - calls_before
            calls_before += calls
            print(f"  sweep #{n} (+{(now - T0).total_seconds() / 60:.0f} min): {model.virtual - start:,.0f} s modelled")
            print(
                f"    Slack calls: {sum(calls.values()):,} ({', '.join(f'{m} {c:,}' for m, c in calls.most_common())})"
            )
            print(f"    warnings delivered so far: {len(warned):,} of {len(must_warn):,} machines;")
            print(
                f"    owners reached: {len(owners_told):,} of {len(owners_due):,};"
                f" deferred this sweep: {len(report.deferred):,}"
            )
            print(f"    429s answered by the fake so far: {fake.limits.refused if fake.limits else 0:,}")
            if n == 2:
                ok = len(warned) == len(must_warn)
                print(
                    "  OK: every idle machine's owner warned within two sweeps"
                    if ok
                    else f"  MISSED: {len(must_warn) - len(warned):,} warnings still undelivered after two sweeps"
                )
    finally:
        model.uninstall()
        builtin_handlers.time, notifier_module.time = saved  # type: ignore[assignment]


def builtin_handlers_budgets(client: WebClient) -> list[Any]:
    """The budgeted Retry-After handlers of the client (their deadline is reset per sweep, as the sweep
    Lambda makes a client per invocation)."""
    return [h for h in client.retry_handlers if hasattr(h, "deadline")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    handler = logger.registered_handler
    if isinstance(handler, logging.StreamHandler):
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115
    run(args.size, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
