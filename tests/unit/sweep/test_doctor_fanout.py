"""The day's first sweep of a fleet handed to the fan-out lists the fleet once: the daily doctor checks the
machines the planner listed instead of listing them again (in-memory fakes, DescribeInstances counted)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.policy import Settings
from idle_reaper_tools.fake_slack import LambdaContextStub
from testkit.aws import CountingStateStore, FakeAws, steady

MACHINES = 25


class StepFunctions:
    def __init__(self) -> None:
        self.started: list[dict[str, Any]] = []

    def start_execution(self, **kwargs: Any) -> dict[str, Any]:
        self.started.append(kwargs)
        return {"executionArn": "arn:aws:states:us-east-1:123456789012:execution:sweep:" + kwargs["name"]}


def test_the_days_first_fanned_out_sweep_lists_the_fleet_once(monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.now(UTC)  # the handler uses the wall clock
    fake = FakeAws()
    fake.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    fake.ssm.store("/idle-reaper/teams/ml", json.dumps({}))
    for i in range(MACHINES):
        gpu = i % 5 == 0
        fake.launch(
            "g5.xlarge" if gpu else "m5.large",
            team="ml",
            profile=steady(10.0, None),  # the GPU machines publish no GPU metrics: the daily check's finding
            launch_time=now - timedelta(days=1),
            owner=f"user{i % 3}@example.com",
        )
    store = CountingStateStore()
    adapters = fake.adapters(store)
    settings, _ = adapters.policies.load_settings()
    before = fake.calls()["ec2:DescribeInstances"]
    adapters.fleet.discover(settings.tags, notebooks=settings.sagemaker_notebooks)
    one_listing = fake.calls()["ec2:DescribeInstances"] - before
    assert one_listing >= 1

    states = StepFunctions()

    def client(service: str, region: str | None = None) -> Any:
        if service == "stepfunctions":
            return states
        raise RuntimeError(f"no {service} here")  # the daily count of other regions: contained, not this fleet

    monkeypatch.setattr(sweep_handler, "Adapters", SimpleNamespace(from_environment=lambda **_: adapters))
    monkeypatch.setattr(sweep_handler, "client", client)
    monkeypatch.setattr(sweep_handler, "SHARD_SIZE", 10)
    monkeypatch.setenv(sweep_handler.FANOUT_ENV, "arn:aws:states:us-east-1:123456789012:stateMachine:sweep")
    for name in ("SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "IDLE_REAPER_SLACK_SECRET"):
        monkeypatch.delenv(name, raising=False)
    ran: list[Any] = []
    real_daily = sweep_handler.run_daily_doctor
    monkeypatch.setattr(sweep_handler, "run_daily_doctor", lambda *a, **k: ran.append(real_daily(*a, **k)))

    listed_before = fake.calls()["ec2:DescribeInstances"]
    metrics_before = fake.calls()["cloudwatch:GetMetricData"]
    result = sweep_handler.handler({}, LambdaContextStub())

    assert result == {"machines": MACHINES, "shards": 3, "dry_run": False} and len(states.started) == 1
    (done,) = ran
    assert done is not None, "the day's first sweep ran the daily check"
    gpu = next(f for f in done.findings if f.check == "signals.gpu")
    assert gpu.status == "fail" and len(gpu.subjects) == MACHINES // 5, "it checked the planner's machines"
    assert fake.calls()["cloudwatch:GetMetricData"] > metrics_before, "their GPU metrics read"
    assert fake.calls()["ec2:DescribeInstances"] - listed_before == one_listing, "the fleet listed once, not twice"
