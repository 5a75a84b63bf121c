"""The daily doctor of a sweep handed to the fan-out (issue 43, item 13). The planner ran the whole daily subset
after starting the execution, and read the GPU metric of every GPU machine for it: at 200,000 machines about 305
GetMetricData calls and 100 s of botocore's CPU in the one invocation, while the Map finished long before. Now
the planner claims the day, starts the execution asking its machine shards for their GPU machines' facts (each
reads them where it has just read its machines' metrics), runs the checks of what it listed (the fleet listed
once) and reads no metric; the gather step makes the GPU check of the shards' facts and tells it. The same
findings; once a day; a failed shard is unknown, never ok. In-memory fakes, every call counted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from idle_reaper.core.doctor import Finding
from idle_reaper.handlers import fanout as fanout_handler
from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.policy import Settings
from idle_reaper.sweep import doctor_daily, fanout
from idle_reaper.sweep.adapters import Adapters
from idle_reaper.sweep.doctor_daily import FAILING_KEY, DailyDoctor, daily_subset, list_afresh, tell_new_failures
from idle_reaper_tools.fake_slack import LambdaContextStub
from testkit.aws import CountingStateStore, FakeAws, steady

MACHINES = 25  # 3 machine shards of at most 10
GPU_EVERY = 5  # one machine in five a GPU type: 5 GPU machines, none publishing GPU metrics
ITEM_SELECTOR = ("sweep_id", "now", "dry_run", "concurrent_shards", "doctor")  # infra/constructs.py, the Map's


class StepFunctions:
    def __init__(self) -> None:
        self.started: list[dict[str, Any]] = []

    def start_execution(self, **kwargs: Any) -> dict[str, Any]:
        self.started.append(kwargs)
        return {"executionArn": "arn:aws:states:us-east-1:123456789012:execution:sweep:" + kwargs["name"]}


class Deployed:
    """The sweep function (the planner), the shard workers and the gather step over one fake account: the
    handlers Lambda runs, with the Map's events built as the state machine builds them."""

    def __init__(self, fake: FakeAws, adapters: Adapters, states: StepFunctions) -> None:
        self.fake, self.adapters, self.states = fake, adapters, states
        self.gpu_checks: list[DailyDoctor | None] = []  # what each gather step's GPU check found and told
        self.planner_checks: list[DailyDoctor | None] = []  # what each planner's part found and told

    def metric_calls(self) -> int:
        return self.fake.calls()["cloudwatch:GetMetricData"]

    def plan(self, shards: int = 3) -> tuple[dict[str, Any], int]:
        """The scheduled sweep: its execution's input, and the GetMetricData calls the planner made."""
        before = self.metric_calls()
        result = sweep_handler.handler({}, LambdaContextStub())
        assert result["shards"] == shards, result
        return json.loads(self.states.started[-1]["input"]), self.metric_calls() - before

    def execute(self, plan: dict[str, Any], failing: frozenset[int] = frozenset()) -> dict[str, Any]:
        """The Map (a shard in `failing` fails, caught: its error goes on), then the gather step."""
        results: list[dict[str, Any]] = []
        for shard in plan["shards"]:
            if shard in failing:
                results.append({"shard": shard, "error": "Sandbox.Timedout"})
                continue
            event = {k: plan[k] for k in ITEM_SELECTOR} | {"shard": shard}
            results.append(fanout_handler.shard_handler(event, LambdaContextStub()))
        return fanout_handler.gather_handler({**plan, "results": results}, LambdaContextStub())


@pytest.fixture
def deployed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Deployed]:
    now = datetime.now(UTC)  # the handlers use the wall clock
    fake = FakeAws()
    fake.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    fake.ssm.store("/idle-reaper/teams/ml", json.dumps({}))
    for i in range(MACHINES):
        gpu = i % GPU_EVERY == 0
        fake.launch(
            "g5.xlarge" if gpu else "m5.large",
            team="ml",
            profile=steady(10.0, None),  # the GPU machines publish no GPU metrics: the daily check's finding
            launch_time=now - timedelta(days=1),
            owner=f"user{i % 3}@example.com",
        )
    adapters = fake.adapters(CountingStateStore())
    states = StepFunctions()
    world = Deployed(fake, adapters, states)

    def client(service: str, region: str | None = None) -> Any:
        if service == "stepfunctions":
            return states
        raise RuntimeError(f"no {service} here")  # the daily count of other regions: contained, not this fleet

    environment = SimpleNamespace(from_environment=lambda **_: adapters)
    monkeypatch.setattr(sweep_handler, "Adapters", environment)
    monkeypatch.setattr(fanout_handler, "Adapters", environment)
    monkeypatch.setattr(sweep_handler, "client", client)
    monkeypatch.setattr(sweep_handler, "SHARD_SIZE", 10)
    monkeypatch.setenv(sweep_handler.FANOUT_ENV, "arn:aws:states:us-east-1:123456789012:stateMachine:sweep")
    for name in ("SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "IDLE_REAPER_SLACK_SECRET"):
        monkeypatch.delenv(name, raising=False)
    real_gpu, real_daily = fanout.report_gpu_facts, sweep_handler.run_daily_doctor
    monkeypatch.setattr(fanout, "report_gpu_facts", lambda *a, **k: world.gpu_checks.append(real_gpu(*a, **k)))
    monkeypatch.setattr(
        sweep_handler, "run_daily_doctor", lambda *a, **k: world.planner_checks.append(real_daily(*a, **k))
    )
    yield world


def gpu_ids(fake: FakeAws) -> list[str]:
    return sorted(i for i, m in fake.ec2.instances.items() if m.api["InstanceType"].startswith("g5"))


def the_gpu_finding(findings: list[Finding]) -> Finding:
    [gpu] = [f for f in findings if f.check == "signals.gpu"]
    return gpu


def test_the_planner_reads_no_metric_for_the_doctor_and_the_shards_and_gather_make_its_gpu_check(
    deployed: Deployed,
) -> None:
    fake, adapters = deployed.fake, deployed.adapters
    before = fake.calls()["ec2:DescribeInstances"]
    adapters.fleet.discover(Settings().tags, notebooks=False)
    one_listing = fake.calls()["ec2:DescribeInstances"] - before
    before = fake.calls()["ec2:DescribeInstances"]
    plan, planner_metric_calls = deployed.plan()
    assert fake.calls()["ec2:DescribeInstances"] - before == one_listing, "the planner lists the fleet once"

    # The planner on the doctor's day: no GetMetricData call at all, as on any other day (it was 1 here, and 305
    # at 200,000 machines).
    assert planner_metric_calls == 0, "the planner read GPU metrics for the doctor"
    assert plan["doctor"] is True and plan["machine_shards"] == 3, "the execution asks its shards for their part"
    (planner_part,) = deployed.planner_checks
    assert planner_part is not None and planner_part.metric_calls == 0
    assert {f.check for f in planner_part.findings} == {"policy.teams", "slack.channels", "people.owners"}

    before_map = deployed.metric_calls()
    deployed.execute(plan)
    (gpu_check,) = deployed.gpu_checks
    assert gpu_check is not None, "the gather step made the day's GPU check"
    gpu = the_gpu_finding(gpu_check.findings)
    assert gpu.status == "fail" and list(gpu.subjects) == gpu_ids(fake), "every GPU machine, found by its shard"
    assert [f.check for f in gpu_check.told] == ["signals.gpu"], "told to the admins"
    assert deployed.metric_calls() > before_map, "their metrics read by the shards"

    # The same finding as the daily subset of a sweep in one invocation makes of the same fleet.
    read = list_afresh(adapters)
    in_place, _ = daily_subset(adapters, read, datetime.fromisoformat(plan["now"]), None)
    assert gpu == the_gpu_finding(in_place)
    remembered = json.loads(adapters.store.get_lookup(FAILING_KEY, datetime.now(UTC)) or "{}")
    assert set(remembered) == {"signals.gpu"}, "what was told is remembered, to be released when it clears"


def test_once_a_day_the_next_sweep_asks_its_shards_for_nothing(deployed: Deployed) -> None:
    first, _ = deployed.plan()
    deployed.execute(first)
    shard_metric_calls = deployed.metric_calls()
    second, planner_metric_calls = deployed.plan()
    assert first["doctor"] is True and second["doctor"] is False and planner_metric_calls == 0
    assert len(deployed.planner_checks) == 1, "the planner's part ran on the day's first sweep only"
    before = deployed.metric_calls()
    deployed.execute(second)
    assert len(deployed.gpu_checks) == 1, "no GPU check on the day's next sweeps"
    assert deployed.metric_calls() - before < shard_metric_calls, "the shards read only what their sweep needs"


def test_a_failed_shard_leaves_its_gpu_machines_unknown_never_ok_and_tells_the_rest(deployed: Deployed) -> None:
    plan, _ = deployed.plan()
    deployed.execute(plan, failing=frozenset({1}))
    (gpu_check,) = deployed.gpu_checks
    assert gpu_check is not None
    statuses = sorted(f.status for f in gpu_check.findings)
    assert statuses == ["fail", "unknown"], "what the failed shard held could not be looked at"
    unknown = next(f for f in gpu_check.findings if f.status == "unknown")
    assert "shard 1's (it failed: Sandbox.Timedout)" in unknown.message
    found = set(the_gpu_finding([f for f in gpu_check.findings if f.status == "fail"]).subjects)
    assert found and found < set(gpu_ids(deployed.fake)), "the other shards' GPU machines are found and told"


def test_a_doctor_that_fails_in_a_shard_or_the_gather_step_never_fails_the_sweep(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("CloudWatch is having a day")

    monkeypatch.setattr(doctor_daily, "gather_signals", broken)
    plan, _ = deployed.plan()
    gathered = deployed.execute(plan)
    assert gathered["machines"] == MACHINES and gathered["shards_failed"] == [], "every shard swept and summed"
    (gpu_check,) = deployed.gpu_checks
    assert gpu_check is not None and {f.status for f in gpu_check.findings} == {"ok", "unknown"}
    unknown = next(f for f in gpu_check.findings if f.status == "unknown")
    assert "RuntimeError: CloudWatch is having a day" in unknown.message, "each shard says why it could not look"

    monkeypatch.setattr(doctor_daily, "tell_new_failures", broken)
    deployed.adapters.store.release_claim(doctor_daily.daily_claim_key(datetime.now(UTC)))
    gathered = deployed.execute(deployed.plan()[0])
    assert gathered["machines"] == MACHINES and deployed.gpu_checks[-1] is None, "the fault is logged, no more"


def test_the_planner_and_the_gather_step_remember_what_each_told(deployed: Deployed) -> None:
    """The two parts of one day's run tell their checks from two invocations, maybe at once: each writes the
    memory only if nobody wrote it since it read it, else reads again, so neither forgets the other's."""
    store, settings, now = deployed.adapters.store, Settings(), datetime.now(UTC)
    mine = Finding(check="signals.gpu", status="fail", subjects=("i-1",), message="no GPU metrics", fix="the agent")
    theirs = Finding(check="people.owners", status="fail", subjects=("i-2",), message="no Slack user", fix="a tag")
    real_replace = store.replace_lookup
    interleaved: list[bool] = []

    def replace_lookup(key: str, value: str, expires: datetime, *, expected: str | None, now: datetime) -> bool:
        if not interleaved:  # the other part writes between this one's read and its write
            interleaved.append(True)
            tell_new_failures(deployed.adapters, [theirs], settings, now)
        return real_replace(key, value, expires, expected=expected, now=now)

    store.replace_lookup = replace_lookup  # type: ignore[method-assign]
    told = tell_new_failures(deployed.adapters, [mine], settings, now)
    assert told == [mine], "told once, not again when its memory is written a second time"
    remembered = json.loads(store.get_lookup(FAILING_KEY, now) or "{}")
    assert set(remembered) == {"signals.gpu", "people.owners"}, "neither part forgot the other's"


def test_a_shard_short_of_time_or_whose_reads_hang_says_so_and_its_machines_are_unknown(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapters, now = deployed.adapters, datetime.now(UTC)
    read = list_afresh(adapters)
    short = doctor_daily.note_gpu_facts(adapters, read, now, ("s", 0), lambda: doctor_daily.SHARD_GPU_SECONDS - 1)
    assert short.unchecked == ["shard 0's (out of time)"] and not short.no_gpu

    released = threading.Event()
    monkeypatch.setattr(doctor_daily, "gather_signals", lambda *_, **__: released.wait(30))
    monkeypatch.setattr(doctor_daily, "SHARD_RESERVE_SECONDS", doctor_daily.SHARD_GPU_SECONDS - 0.2)
    hung = doctor_daily.note_gpu_facts(adapters, read, now, ("s", 1), lambda: doctor_daily.SHARD_GPU_SECONDS)
    released.set()
    assert hung.unchecked == ["shard 1's (out of time)"], "a read still hanging at the deadline is not waited for"
    short_gather = doctor_daily.report_gpu_facts(adapters, "s", now, 2, {}, dry_run=True, time_left=lambda: 5.0)
    assert short_gather is None, "a gather step short of time sends its summary, not the GPU check"
    findings = doctor_daily.report_gpu_facts(adapters, "s", now, 2, {}, dry_run=True)
    assert findings is not None and [f.status for f in findings.findings] == ["ok", "unknown"]
    assert "shard 0's (out of time), shard 1's (out of time)" in findings.findings[1].message


def test_a_shard_holding_part_of_a_group_cut_across_shards_reads_its_gpu_machines_too(deployed: Deployed) -> None:
    """A group larger than a shard is cut across shards, whose manifests then name its parts (sweep/shards.py):
    those machine shards keep their GPU facts as any other."""
    fake, now = deployed.fake, datetime.now(UTC)
    fake.autoscaling.add_group("training")
    for _ in range(12):  # more than a shard's 10 machines
        day_ago = now - timedelta(days=1)
        fake.launch("g5.xlarge", team="ml", profile=steady(10.0, None), launch_time=day_ago, group="training")
    plan, planner_metric_calls = deployed.plan(shards=4)
    assert planner_metric_calls == 0
    deployed.execute(plan)
    (gpu_check,) = deployed.gpu_checks
    assert gpu_check is not None and [f.status for f in gpu_check.findings] == ["fail"], "every shard looked"
    assert list(the_gpu_finding(gpu_check.findings).subjects) == gpu_ids(fake)
