"""How fast the Slack endpoint answers: time to the acknowledgement (what Slack waits for, and gives up
on after 3 s) against the time of the full work, which now runs in an asynchronous invocation.

Runs the REAL handler: signature check, payload validation, the acknowledgement and the hand-off to
Lambda's Invoke API; then the REAL work (routing, authorization, effects) over in-memory fakes whose
every call waits a modelled AWS or Slack latency:

    DynamoDB 4 ms · SSM 30 ms · EC2 0.3 s · Slack API (and response_url) 0.25 s · Lambda Invoke 20 ms

    cold   a fresh interpreter: import the handler module + the first request (its boto3 client included)
    warm   later requests in the same process

    python benchmarks/slack_latency.py [--warm 50] [--cold 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECRET = "bench-signing-secret"
ENV = {
    "SLACK_BOT_TOKEN": "xoxb-bench",
    "SLACK_SIGNING_SECRET": SECRET,
    "AWS_LAMBDA_FUNCTION_NAME": "idle-reaper-slack",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "POWERTOOLS_LOG_LEVEL": "WARNING",
}
os.environ.update(ENV)

from idle_reaper.aws import Fleet, InMemoryStateStore  # noqa: E402
from idle_reaper.core import MachineRecord, State  # noqa: E402
from idle_reaper.handlers import slack as handler  # noqa: E402
from idle_reaper.slack import SlackNotifier  # noqa: E402
from idle_reaper.slack.requests import ButtonWork, CommandWork  # noqa: E402
from idle_reaper.slack.routing import Region, Router  # noqa: E402
from idle_reaper_tools.fake_slack import LambdaContextStub, signed_request  # noqa: E402
from testkit.aws import FakeAutoScaling, FakeEC2, FakeSSM  # noqa: E402

DYNAMODB, SSM, EC2, SLACK, INVOKE = 0.004, 0.030, 0.300, 0.250, 0.020
SLACK_GIVES_UP = 3.0
NOW = datetime(2026, 11, 20, 14, 0, tzinfo=UTC)
HOOK = "https://hooks.slack.com/actions/T0/1/bench"


class Modelled:
    """Every method call on the wrapped object first waits one modelled round trip."""

    def __init__(self, target: Any, seconds: float) -> None:
        self._target, self._seconds = target, seconds
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            time.sleep(self._seconds)
            return attr(*args, **kwargs)

        return call


class SlackApi:
    """The two Web API methods the work calls, each one round trip."""

    def chat_update(self, **kwargs: Any) -> dict[str, Any]:
        return {"ok": True}

    def usergroups_users_list(self, **kwargs: Any) -> dict[str, Any]:
        return {"ok": True, "users": ["U0GROUPIE"]}


class LambdaApi:
    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def invoke(self, **kwargs: Any) -> dict[str, Any]:
        self.payloads.append(kwargs["Payload"])
        return {"StatusCode": 202}


def world() -> tuple[Router, dict[str, Modelled]]:
    """One region: a warned notebook owned by U0BOB in team ml (whose members include a user group)."""
    ssm, ec2 = FakeSSM(), FakeEC2()
    ssm.put_parameter(Name="/idle-reaper/settings", Value=json.dumps({"admins": ["U0ADMIN"]}))
    ssm.put_parameter(Name="/idle-reaper/teams/ml", Value=json.dumps({"members": ["U0MEMBER", "S0GROUP"]}))
    for team in range(30):  # other teams' policies: a Slack answer reads only its own team's
        ssm.put_parameter(Name=f"/idle-reaper/teams/team{team}", Value="{}")
    instance = ec2.add("g5.xlarge", launch_time=NOW - timedelta(hours=6), tags={"Team": "ml", "Owner": "U0BOB"})
    store = InMemoryStateStore()
    record = MachineRecord(
        instance_id=instance.instance_id,
        team="ml",
        state=State.WARNED,
        version=3,
        warned_at=NOW - timedelta(minutes=10),
        warning_delivered_at=NOW - timedelta(minutes=10),
        name="notebook",
        instance_type="g5.xlarge",
        owner="U0BOB",
        owner_slack_id="U0BOB",
        warning_ref="ref-bench",
        messages=("D0BOB|1.1", "C0ML|1.2"),
        reason="idle",
    )
    store.save(record)
    store.put_lookup("ref#ref-bench", instance.instance_id, NOW + timedelta(days=1))
    fakes = {
        "dynamodb": Modelled(store, DYNAMODB),
        "ssm": Modelled(ssm, SSM),
        "ec2": Modelled(ec2, EC2),
        "autoscaling": Modelled(FakeAutoScaling(ec2), EC2),
        "slack": Modelled(SlackApi(), SLACK),
    }
    region = Region(fakes.__getitem__, "idle-reaper-state", "/idle-reaper", fakes["slack"], lambda: NOW)
    region.store = fakes["dynamodb"]  # the in-memory twin stands in for the table
    region.fleet = Fleet(fakes["ec2"], fakes["autoscaling"])
    region.effects.slack = SlackNotifier(fakes["slack"], fakes["dynamodb"], lambda: NOW)
    return Router([region]), fakes


def click_event(user: str, action_id: str) -> dict[str, Any]:
    payload = {
        "type": "block_actions",
        "user": {"id": user},
        "actions": [{"action_id": action_id, "value": "ref-bench"}],
        "response_url": HOOK,
    }
    return signed_request("/slack/interactions", urllib.parse.urlencode({"payload": json.dumps(payload)}), SECRET)


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


# ---------------------------------------------------------------------------------------------


COLD = """
import json, sys, time
from idle_reaper_tools.fake_slack import LambdaContextStub  # test support, not part of the Lambda
event = json.loads(sys.stdin.read())
started = time.perf_counter()
from idle_reaper.handlers import slack as h
imported = time.perf_counter()
real_client = h.client
class Invoke:  # a real boto3 client is built (a cold container's cost); the call itself is modelled
    def __init__(self, client): self.client = client
    def invoke(self, **kwargs):
        time.sleep(%(invoke)s)
        return {"StatusCode": 202}
h.client = lambda service, region=None: Invoke(real_client(service, region))
response = h.handler(event, LambdaContextStub())
answered = time.perf_counter()
print(json.dumps({"import": imported - started, "first": answered - imported, "status": response["statusCode"]}))
"""


def cold(runs: int) -> None:
    imports, firsts, processes = [], [], []
    for _ in range(runs):
        event = json.dumps(click_event("U0BOB", "keep_2h"))
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", COLD % {"invoke": INVOKE}],
            input=event,
            capture_output=True,
            text=True,
            env={**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])},
            check=True,
        )
        processes.append(time.perf_counter() - started)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["status"] == 200, out
        imports.append(out["import"])
        firsts.append(out["first"])
    print(f"cold ack (median of {runs} fresh interpreters)")
    print(f"  import of the handler module {ms(statistics.median(imports))}")
    print(f"  first request to its ack     {ms(statistics.median(firsts))}")
    print(
        f"  import + first request       {ms(statistics.median(i + f for i, f in zip(imports, firsts, strict=True)))}"
    )
    print(f"  whole process (+ interpreter) {ms(statistics.median(processes))}")


def warm(runs: int) -> None:
    invoker = Modelled(LambdaApi(), INVOKE)
    handler.lambda_client = lambda: invoker
    handler.handler(click_event("U0BOB", "keep_2h"), LambdaContextStub())  # warm up
    samples = sorted(
        timed(lambda: handler.handler(click_event("U0BOB", "keep_2h"), LambdaContextStub())) for _ in range(runs)
    )
    rejected = sorted(
        timed(lambda: handler.handler({**click_event("U0BOB", "keep_2h"), "body": "tampered"}, LambdaContextStub()))
        for _ in range(runs)
    )
    p95 = samples[int(0.95 * (len(samples) - 1))]
    print(f"warm ack ({runs} requests; the hand-off is one Lambda Invoke of {INVOKE * 1000:.0f} ms)")
    print(f"  median {ms(statistics.median(samples))}   p95 {ms(p95)}   max {ms(samples[-1])}")
    print(f"  a rejected (unsigned) request: median {ms(statistics.median(rejected))}")


def full_work() -> None:
    print("full work in the asynchronous invocation (modelled latencies; reply through response_url)")
    scenarios: list[tuple[str, ButtonWork | CommandWork]] = [
        ("Keep 2 h by the owner", ButtonWork(user="U0BOB", action_id="keep_2h", value="ref-bench", response_url=HOOK)),
        (
            "Keep 2 h by a group member",
            ButtonWork(user="U0GROUPIE", action_id="keep_2h", value="ref-bench", response_url=HOOK),
        ),
        ("Stop now", ButtonWork(user="U0BOB", action_id="stop_now", value="ref-bench", response_url=HOOK)),
        ("refused (a stranger)", ButtonWork(user="U0X", action_id="stop_now", value="ref-bench", response_url=HOOK)),
        ("/idle-reaper status", CommandWork(user="U0BOB", command="/idle-reaper", text="status", response_url=HOOK)),
        (
            "/idle-reaper keep notebook 2h",
            CommandWork(user="U0BOB", command="/idle-reaper", text="keep notebook 2h", response_url=HOOK),
        ),
    ]
    replies: list[str] = []

    def reply(url: str, text: str) -> None:
        time.sleep(SLACK)
        replies.append(text)

    handler.send_reply = reply
    worst = 0.0
    for label, work in scenarios:
        router, fakes = world()
        handler.build_router = lambda token, router=router: router
        event = {"idle_reaper_slack_work": work.model_dump(mode="json")}
        seconds = timed(lambda event=event: handler.handler(event, LambdaContextStub()))
        worst = max(worst, seconds)
        calls = ", ".join(f"{name} {m.calls}" for name, m in fakes.items() if m.calls)
        print(f"  {label:32} {ms(seconds)}   ({calls}{', response_url 1' if replies else ''})")
        replies.clear()
    print(
        f"  slowest: {worst:.2f} s; before this change Slack waited for all of it (its limit: {SLACK_GIVES_UP:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=int, default=50, help="warm requests to time")
    parser.add_argument("--cold", type=int, default=5, help="fresh interpreters to time")
    args = parser.parse_args()
    print(
        f"modelled: DynamoDB {DYNAMODB * 1000:.0f} ms, SSM {SSM * 1000:.0f} ms, EC2 {EC2:.1f} s, "
        f"Slack {SLACK:.2f} s, Lambda Invoke {INVOKE * 1000:.0f} ms; Slack gives up after {SLACK_GIVES_UP:.0f} s\n"
    )
    cold(args.cold)
    print()
    warm(args.warm)
    print()
    full_work()


if __name__ == "__main__":
    main()
