"""The sharded sweep against moto: the scheduled planner hands a fleet larger than one shard to the state
machine, the shard workers and the gather step (the handlers the Map and the next state invoke) sweep it;
a failing shard touches nothing and is retried; two overlapping sharded sweeps act once; the CLI runs the
same path on threads."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError

from idle_reaper import aws
from idle_reaper.core import State
from idle_reaper.handlers import fanout
from idle_reaper.handlers import sweep as sweep_handler
from idle_reaper.notify import LoggingNotifier
from idle_reaper.sweep import Adapters, SweepCannotRun, SweepReport, logger, manifest_key, plan_sweep, run_sharded
from idle_reaper_tools import cli, local
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import LambdaContextStub
from testkit.emf import emf_blobs
from testkit.interleave import Gate, interleave, stepped

pytestmark = pytest.mark.integration

T0 = at(14)  # quiet since 11:00: warned at T0; the stop is due 20 minutes after the delivered warning


def idle(_t: datetime) -> tuple[float, float | None]:
    return (1.0, None)


def busy(_t: datetime) -> tuple[float, float | None]:
    return (90.0, None)


def ml_fleet(idle_count: int, busy_count: int, since: datetime, until: datetime) -> tuple[list[str], list[str]]:
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    idle_ids = [local.launch(f"idle-{i}", "m5.large", team="ml", launch_time=since) for i in range(idle_count)]
    busy_ids = [local.launch(f"busy-{i}", "m5.large", team="ml", launch_time=since) for i in range(busy_count)]
    for i in idle_ids:
        local.write_metrics(i, idle, since, until)
    for i in busy_ids:
        local.write_metrics(i, busy, since, until)
    return idle_ids, busy_ids


def records(ids: list[str]) -> dict[str, Any]:
    return aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).load(ids)


def records_lookup(key: str) -> str | None:
    return aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name()).get_lookup(key, T0)


def test_the_planner_hands_a_large_fleet_to_the_state_machine_whose_shards_and_gather_sweep_it(
    aws: Any, slack: Any, capsys: Any, monkeypatch: Any
) -> None:
    now = datetime.now(UTC)  # the handlers use the wall clock
    idle_ids, busy_ids = ml_fleet(5, 2, now - timedelta(hours=3), now)
    sfn = local.aws.client("stepfunctions")
    definition = {"StartAt": "Wait", "States": {"Wait": {"Type": "Pass", "End": True}}}
    arn = sfn.create_state_machine(
        name="idle-reaper-sweep",
        definition=json.dumps(definition),
        roleArn="arn:aws:iam::123456789012:role/idle-reaper-sweep",
    )["stateMachineArn"]
    monkeypatch.setenv(sweep_handler.FANOUT_ENV, arn)
    monkeypatch.setattr(sweep_handler, "SHARD_SIZE", 3)

    planned = sweep_handler.handler({}, LambdaContextStub())
    assert planned == {"machines": 7, "shards": 3, "dry_run": False}
    assert records(idle_ids + busy_ids) == {}, "the planner itself acts on nothing"
    [execution] = sfn.list_executions(stateMachineArn=arn)["executions"]
    plan = json.loads(sfn.describe_execution(executionArn=execution["executionArn"])["input"])
    assert plan["shards"] == [0, 1, 2] and execution["name"] == plan["sweep_id"]
    assert plan["concurrent_shards"] == 3
    assert plan["doctor"] is True, "the day's first sweep: its shards read their GPU machines for the doctor"
    assert len(json.dumps(plan)) < 200, "only indices travel between states, never the instance ids"

    # What the Map does: one worker per index, with the item selector's event.
    results = []
    for shard in plan["shards"]:
        event = {k: plan[k] for k in ("sweep_id", "now", "dry_run", "concurrent_shards", "doctor")} | {"shard": shard}
        results.append(fanout.shard_handler(event, LambdaContextStub()))
    assert sum(r["machines"] for r in results) == 7
    capsys.readouterr()
    gathered = fanout.gather_handler({**plan, "results": results}, LambdaContextStub())
    assert gathered["machines"] == 7 and gathered["shards"] == 3 and gathered["shards_failed"] == []
    blobs = emf_blobs(capsys.readouterr().out)
    [ml] = [b for b in blobs if b.get("team") == "ml"]
    assert ml["MachinesScanned"] == 7 and ml["WarningsSent"] == 5, "one summary over the shards"
    assert any(b.get("ShardsFailed") == 0 and b.get("SweepShards") == 3 for b in blobs)
    stored = records(idle_ids + busy_ids)
    assert {i for i, r in stored.items() if r.state is State.WARNED} == set(idle_ids)
    assert all(stored[i].state is State.ACTIVE for i in busy_ids if i in stored)


def test_a_scheduled_event_delivered_twice_starts_one_sweep(aws: Any, slack: Any, monkeypatch: Any) -> None:
    """Issue 43 (10): EventBridge delivers a scheduled event at least once. The execution was named after a
    fresh uuid per invocation, so a second delivery started a second execution over the same fleet. The sweep
    is named after the schedule's time and claimed once: the second delivery starts nothing and writes no
    manifest; an invocation by hand (no scheduled event) is a sweep of its own."""
    now = datetime.now(UTC)
    ml_fleet(5, 2, now - timedelta(hours=3), now)
    sfn = local.aws.client("stepfunctions")
    definition = {"StartAt": "Wait", "States": {"Wait": {"Type": "Pass", "End": True}}}
    role = "arn:aws:iam::123456789012:role/idle-reaper-sweep"
    arn = sfn.create_state_machine(name="idle-reaper-sweep", definition=json.dumps(definition), roleArn=role)[
        "stateMachineArn"
    ]
    monkeypatch.setenv(sweep_handler.FANOUT_ENV, arn)
    monkeypatch.setattr(sweep_handler, "SHARD_SIZE", 3)
    event = {
        "version": "0",
        "id": "6a7e8feb-b491-4cf7-a9f1-bf3703467718",
        "detail-type": "Scheduled Event",
        "source": "aws.events",
        "time": now.strftime("%Y-%m-%dT%H:%M:00Z"),
        "resources": ["arn:aws:events:us-east-1:123456789012:rule/idle-reaper-schedule"],
        "detail": {},
    }
    assert sweep_handler.handler(event, LambdaContextStub())["shards"] == 3
    [execution] = sfn.list_executions(stateMachineArn=arn)["executions"]
    assert execution["name"] == f"sweep-{now:%Y%m%dT%H%M}00Z"
    manifest = records_lookup(f"shard#{execution['name']}#0")
    again = sweep_handler.handler(event, LambdaContextStub())
    assert again == {"sweep_id": execution["name"], "duplicate": True}
    assert len(sfn.list_executions(stateMachineArn=arn)["executions"]) == 1, "one sweep for one scheduled time"
    assert records_lookup(f"shard#{execution['name']}#0") == manifest, "its manifests were not written again"
    sweep_handler.handler({}, LambdaContextStub())
    assert len(sfn.list_executions(stateMachineArn=arn)["executions"]) == 2, "a sweep by hand is its own"


class ThrottledManifest:
    """moto's DynamoDB, except that one shard's manifest cannot be read (a throttling storm on its worker)."""

    def __init__(self, inner: Any, shard: int) -> None:
        self.inner, self.shard = inner, shard

    def get_item(self, **kwargs: Any) -> Any:
        pk = kwargs["Key"]["pk"]["S"]
        if pk.startswith("lookup#shard#") and pk.endswith(f"#{self.shard}"):
            error = {"Code": "ThrottlingException", "Message": "Rate of requests exceeds the allowed throughput."}
            raise ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 400}}, "GetItem")
        return self.inner.get_item(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def moto_adapters(dynamodb: Any = None, notifier: Any = None) -> Adapters:
    store = aws.DynamoStateStore(dynamodb or aws.client("dynamodb"), aws.table_name())
    return Adapters(
        policies=aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix()),
        fleet=aws.Fleet(aws.client("ec2"), aws.client("autoscaling")),
        metrics=aws.MetricsReader(aws.client("cloudwatch")),
        store=store,
        notifier=notifier or LoggingNotifier(logger, delivers=True),
    )


def test_a_failing_shard_leaves_its_machines_untouched_while_the_others_act_and_the_next_sweep_retries(
    aws: Any,
) -> None:
    idle_ids, _ = ml_fleet(6, 0, at(8), at(23))
    throttled = ThrottledManifest(aws_client("dynamodb"), shard=1)
    first = run_sharded(moto_adapters(throttled), now=T0, shard_size=2, workers=3, sweep_id="first")
    assert first.plan.shards == 3 and set(first.gathered.failed) == {1}
    assert "ThrottlingException" in first.gathered.failed[1]
    assert any("shard 1 failed" in w for w in first.merged().warnings)
    stranded = json.loads(moto_adapters().store.get_lookup(manifest_key("first", 1), T0) or "[]")
    assert len(stranded) == 2
    stored = records(idle_ids)
    assert not set(stranded) & set(stored), "the failed shard's machines have no record: untouched"
    assert {i for i, r in stored.items() if r.state is State.WARNED} == set(idle_ids) - set(stranded)
    assert moto_adapters().store.get_lookup("fanout#consecutive-failed-sweeps", T0) == "1"

    retry = run_sharded(moto_adapters(), now=T0 + timedelta(minutes=5), shard_size=2, sweep_id="retry")
    assert retry.gathered.failed == {}
    assert {i for i, r in records(idle_ids).items() if r.state is State.WARNED} == set(idle_ids)
    assert moto_adapters().store.get_lookup("fanout#consecutive-failed-sweeps", T0) == "0"


def aws_client(service: str) -> Any:
    return aws.client(service)


@pytest.mark.parametrize(("pause_a", "pause_b"), [("claimed", None), ("listed", "claimed"), ("acted", "loaded")])
def test_two_overlapping_sharded_sweeps_warn_once_and_stop_once(aws: Any, pause_a: str, pause_b: str | None) -> None:
    idle_ids, busy_ids = ml_fleet(3, 1, at(8), at(23))
    notifier = LoggingNotifier(logger, delivers=True)

    def sharded(now: datetime) -> Any:
        def sweep(name: str) -> Any:
            def run(gate: Gate) -> SweepReport:
                result = run_sharded(
                    stepped(moto_adapters(notifier=notifier), gate), now=now, sweep_id=name, shard_size=1
                )
                assert not result.gathered.failed, result.gathered.failed
                return result.merged()

            return run

        return sweep

    warn = sharded(T0)
    interleave(warn("A"), warn("B"), pause_a="claimed" if pause_a == "acted" else pause_a, pause_b=pause_b)
    assert sorted(i for kind, i in notifier.sent if kind == "warning") == sorted(idle_ids), "each warned once"

    stop = sharded(T0 + timedelta(minutes=25))
    result = interleave(stop("A"), stop("B"), pause_a=pause_a, pause_b=pause_b)
    assert result.gate_a.reached.is_set()
    assert sorted(i for kind, i in notifier.sent if kind == "reaped") == sorted(idle_ids), "each stopped once"
    assert result.gate_a.passed.count("acted") + result.gate_b.passed.count("acted") == len(idle_ids)
    assert local.instance_states(idle_ids + busy_ids) == {
        **{i: "stopped" for i in idle_ids},
        **{i: "running" for i in busy_ids},
    }
    store = moto_adapters().store
    assert all(store.claim_of(i) is None for i in idle_ids), "no claim left behind"
    assert all(r.state is State.REAPED for r in records(idle_ids).values())


def test_the_cli_sweeps_in_shards_on_threads_with_the_same_rows(aws: Any, slack: Any, capsys: Any) -> None:
    idle_ids, busy_ids = ml_fleet(3, 2, at(8), at(23))
    code = cli.main(["sweep", "--now", T0.isoformat(), "--shard-size", "2", "--workers", "3", "--json"])
    out, _ = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and sorted(r["instance_id"] for r in rows) == sorted(idle_ids + busy_ids)
    assert {r["instance_id"] for r in rows if r["action"] == "warn"} == set(idle_ids)
    assert all(set(r) == set(rows[0]) for r in rows) and {"instance_id", "state", "action", "reason"} <= set(rows[0])

    with pytest.raises(SystemExit) as refused:
        cli.main(["sweep", "--shard-size", "0"])
    assert refused.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_the_planner_lists_the_zones_in_child_processes_and_a_zone_that_fails_fails_the_plan(
    aws: Any, monkeypatch: Any
) -> None:
    """The deployed planner (Adapters.from_environment in Lambda: zones in child processes, each with its own
    boto3 client) against moto: machines in three zones and an Auto Scaling group, each machine in exactly one
    manifest, the group in one; then EC2 refuses one zone's listing (in its child): the plan fails and writes
    no manifest."""
    since = datetime.now(UTC) - timedelta(hours=3)
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    group = local.launch_group("trainers", "m5.large", team="ml", size=3, min_size=0, launch_time=since)
    machines = list(group)  # moto places the group's members in us-east-1a
    for i, zone in enumerate(["us-east-1a", "us-east-1b", "us-east-1c"] * 3):
        tags = {"Team": "ml", local.MANAGED_TAG: "true", "Owner": f"U{i % 4}"}
        ran = local.aws.client("ec2").run_instances(
            ImageId=local.AMI,
            MinCount=1,
            MaxCount=1,
            InstanceType="m5.large",
            Placement={"AvailabilityZone": zone},
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}],
        )
        machines.append(ran["Instances"][0]["InstanceId"])
    assert Adapters.from_environment(notifier=LoggingNotifier(logger)).fleet.listing_processes == 1  # locally
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "idle-reaper-sweep")  # as the planner runs in Lambda
    live = Adapters.from_environment(notifier=LoggingNotifier(logger))
    assert live.fleet.listing_processes > 1

    plan = plan_sweep(live, now=T0, shard_size=4)
    manifests = [json.loads(records_lookup(manifest_key(plan.sweep_id, i))) for i in range(plan.shards)]
    assert sorted(i for m in manifests for i in m) == sorted(machines)  # every machine, once
    assert sum(set(group) <= set(m) for m in manifests) == 1  # the group's members share one shard

    def refuse_zone_b(params: dict[str, Any], **_: Any) -> Any:
        if "us-east-1b" in params["body"].values():  # the serialised request: Filter.N.Value.1
            error = {"Code": "RequestLimitExceeded", "Message": "Request limit exceeded."}
            return AWSResponse("https://ec2", 503, {}, None), {"Error": error, "ResponseMetadata": {}}
        return None

    events = boto3._get_default_session().events  # the children's new clients are made from this session
    events.register("before-call.ec2.DescribeInstances", refuse_zone_b)
    try:
        with pytest.raises(SweepCannotRun, match="RequestLimitExceeded"):
            plan_sweep(Adapters.from_environment(notifier=LoggingNotifier(logger)), now=T0, sweep_id="b", shard_size=4)
    finally:
        events.unregister("before-call.ec2.DescribeInstances", refuse_zone_b)
    assert records_lookup(manifest_key("b", 0)) is None, "a fleet listed in part is never planned"
