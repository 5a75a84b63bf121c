"""How long the Slack and alarm handlers take, the figures behind the stack's Slack duration alarm (p99
2,500 ms; Slack gives up at 3 s) and the Slack function's reserved concurrency.

Runs the REAL handlers (idle_reaper.handlers.slack and .alarms) in this process against moto in server mode
and the local Slack fake, both on 127.0.0.1, so the AWS and Slack round trips are far shorter than in AWS
(there, count ~5-20 ms per DynamoDB/SSM call and ~100-300 ms per Slack call on top). Measured:

    cold import   a fresh interpreter importing the handler module (the Lambda init phase's Python part)
    unsigned      a request with a bad signature: what a flood of junk costs per request
    status        `/idle-reaper status` from a user with machines (a signed request that reads the table)
    stale click   a button whose reference expired (a signed request, one table read, an ephemeral answer)
    alarm relay   one CloudWatch alarm notification posted to an admin and the admin channel

    python benchmarks/handler_latency.py [--requests 200]
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

SECRET = "local-signing-secret"


def cold_import_ms(module: str, runs: int = 5) -> float:
    """Median wall time of `python -c 'import <module>'` in a fresh interpreter, minus a bare interpreter."""

    def median_of(code: str) -> float:
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    return median_of(f"import {module}") - median_of("pass")


def percentiles(call: Callable[[], Any], requests: int) -> dict[str, float]:
    call()  # warm: the first call builds clients and caches the secret, as a warm Lambda has
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    cuts = statistics.quantiles(times, n=100, method="inclusive")
    return {"p50": cuts[49], "p99": cuts[98], "max": max(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)

    from idle_reaper.handlers import alarms
    from idle_reaper.handlers import slack as slack_handler
    from idle_reaper.policy import Settings
    from idle_reaper.sweep import Adapters, run_sweep
    from idle_reaper_tools import local
    from idle_reaper_tools.demo import at
    from idle_reaper_tools.fake_slack import LambdaContextStub, fake_slack, signed_request, slack_environment

    context: Any = LambdaContextStub()
    figures: dict[str, dict[str, float]] = {}
    local.quiet_server_logs()
    with local.local_aws(), fake_slack() as slack, slack_environment(slack, SECRET):
        local.init_account(Settings.model_validate({"admins": ["U0ADMIN"], "admin_channel": "C0ADMINS"}))
        for i in range(20):  # a user with a few machines among others', known to the state table after a sweep
            instance_id = local.launch(
                f"box-{i}", "g5.xlarge", team="ml", launch_time=at(8), owner="U0BOB" if i < 3 else "U0ANN"
            )
            local.write_metrics(instance_id, lambda _t: (1.0, 0.0), at(11), at(14))
        run_sweep(Adapters.from_environment(), now=at(14))

        def command(text: str, secret: str = SECRET) -> dict[str, Any]:
            body = urllib.parse.urlencode({"command": "/idle-reaper", "text": text, "user_id": "U0BOB"})
            response: dict[str, Any] = slack_handler.handler(signed_request("/slack/commands", body, secret), context)
            return response

        def stale_click() -> dict[str, Any]:
            payload = {
                "type": "block_actions",
                "user": {"id": "U0BOB"},
                "actions": [{"action_id": "keep", "value": "expired-reference"}],
            }
            body = urllib.parse.urlencode({"payload": json.dumps(payload)})
            response: dict[str, Any] = slack_handler.handler(
                signed_request("/slack/interactions", body, SECRET), context
            )
            return response

        alarm = json.dumps(
            {
                "AlarmName": "IdleReaper-us-east-1-SweepErrorsAlarm",
                "NewStateValue": "ALARM",
                "OldStateValue": "OK",
                "NewStateReason": "Threshold Crossed",
                "Region": "US East (N. Virginia)",
                "AlarmArn": "arn:aws:cloudwatch:us-east-1:123456789012:alarm:IdleReaper-us-east-1-SweepErrorsAlarm",
            }
        )
        event = {"Records": [{"Sns": {"Subject": "ALARM", "Message": alarm}}]}

        assert command("status", secret="wrong")["statusCode"] == 401
        assert "box-0" in command("status")["body"]  # the status answer lists bob's machines
        figures["unsigned"] = percentiles(lambda: command("status", secret="wrong"), args.requests)
        figures["status"] = percentiles(lambda: command("status"), args.requests)
        figures["stale click"] = percentiles(stale_click, args.requests)
        figures["alarm relay"] = percentiles(lambda: alarms.handler(event, context), max(20, args.requests // 10))

    print(f"{'cold import (ms)':<22}{'slack':>10}{'alarms':>10}")
    print(
        f"{'':<22}{cold_import_ms('idle_reaper.handlers.slack'):>10.0f}"
        f"{cold_import_ms('idle_reaper.handlers.alarms'):>10.0f}"
    )
    print(f"\n{'warm request (ms)':<22}{'p50':>10}{'p99':>10}{'max':>10}")
    for name, values in figures.items():
        print(f"{name:<22}{values['p50']:>10.2f}{values['p99']:>10.2f}{values['max']:>10.2f}")
    print("\nLocal emulators: add the real AWS and Slack round trips (see the module docstring) before comparing")
    print("with the 2,500 ms p99 alarm of the Slack function.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
