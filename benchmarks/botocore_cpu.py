"""What a request costs the Lambda's CPU before and after the network: botocore serialising, signing (SigV4)
and parsing, measured with real botocore clients (the reaper's own client configuration) answered by a
local stub with the bytes AWS would send (JSON for CloudWatch, the protocol botocore picks; EC2's XML as
moto writes it; DynamoDB JSON), and for DynamoDB the adapter's own wire conversion (DynamoStateStore) too.

The latency benchmark charges each fake call this CPU (testkit/aws/ LatencyModel's `cpu`): fixed per
request plus per item (metric query, datapoint, instance listed, item read).

    python benchmarks/botocore_cpu.py        # prints the measured costs
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for key, value in {
    "AWS_ACCESS_KEY_ID": "botocore-cpu",
    "AWS_SECRET_ACCESS_KEY": "botocore-cpu",
    "AWS_DEFAULT_REGION": "us-east-1",
}.items():
    os.environ.setdefault(key, value)

from botocore.awsrequest import AWSResponse  # noqa: E402

from idle_reaper.aws.clients import client  # noqa: E402
from idle_reaper.aws.state import DynamoStateStore  # noqa: E402
from idle_reaper.core.records import MachineRecord  # noqa: E402

REGION = "us-east-1"
T0 = datetime(2026, 11, 20, 14, 0, tzinfo=UTC)


@dataclass
class BotocoreCpu:
    """Seconds of CPU per request: `fixed[op]` plus `per_item[op][item] x count`. An operation not listed costs
    `other` (a small request and answer)."""

    fixed: dict[str, float] = field(default_factory=dict)
    per_item: dict[str, dict[str, float]] = field(default_factory=dict)
    other: float = 0.0

    def cost(self, operation: str, items: Mapping[str, int]) -> float:
        per = self.per_item.get(operation, {})
        return self.fixed.get(operation, self.other) + sum(per.get(k, 0.0) * n for k, n in items.items())


def items_of(operation: str, request: Mapping[str, Any], response: Mapping[str, Any]) -> dict[str, int]:
    """What a request's botocore CPU grows with, read off the fake's request and answer."""
    if operation == "cloudwatch:GetMetricData":
        results = response.get("MetricDataResults", [])
        return {
            "queries": len(request.get("MetricDataQueries", [])),
            "datapoints": sum(len(r.get("Timestamps", [])) for r in results),
        }
    if operation == "dynamodb:BatchGetItem":  # CountingStateStore says how many keys a batch asked for
        return {"records": int(request.get("Keys", 0))}
    if operation == "ec2:DescribeInstances":
        return {"instances": sum(len(r.get("Instances", [])) for r in response.get("Reservations", []))}
    return {}


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Any:
        yield self.body


def _stubbed(service: str, answers: Mapping[str, tuple[dict[str, str], bytes]]) -> Any:
    """A real client (the reaper's configuration) whose requests never leave: each operation gets its canned
    answer after botocore has serialised and signed the request. A client of its own (not the process's kept one,
    aws/clients.py), so each set of answers is the only one its client has."""
    c = client(service, REGION, kept=False)

    def send(request: Any, **kwargs: Any) -> AWSResponse:
        operation = kwargs["event_name"].rsplit(".", 1)[-1]
        headers, body = answers[operation]
        return AWSResponse(request.url, 200, headers, _Raw(body))

    c.meta.events.register(f"before-send.{c.meta.service_model.endpoint_prefix}", send)
    return c


def _cpu_per_call(call: Callable[[], Any], repeat: int) -> float:
    """Median CPU seconds of one call (thread CPU: other processes on the machine do not inflate it)."""
    call()  # warm caches (models, signers)
    rounds = []
    for _ in range(5):
        started = time.thread_time()
        for _ in range(repeat):
            call()
        rounds.append((time.thread_time() - started) / repeat)
    return statistics.median(rounds)


def _metric_answer(queries: int, points: int) -> bytes:
    """GetMetricData's answer in the protocol botocore picks for CloudWatch (JSON: epoch-second timestamps)."""
    stamps = [(T0 - timedelta(minutes=5 * k)).timestamp() for k in range(points)]
    body = {
        "MetricDataResults": [
            {
                "Id": f"cu{q}",
                "Label": "CPUUtilization",
                "Timestamps": stamps,
                "Values": [1.5 + k for k in range(points)],
                "StatusCode": "Complete",
            }
            for q in range(queries)
        ],
        "Messages": [],
    }
    return json.dumps(body).encode()


def _metric_queries(queries: int) -> list[dict[str, Any]]:
    return [
        {
            "Id": f"cu{q}",
            "MetricStat": {
                "Metric": {
                    "Namespace": "AWS/EC2",
                    "MetricName": "CPUUtilization",
                    "Dimensions": [{"Name": "InstanceId", "Value": f"i-{q:017x}"}],
                },
                "Period": 300,
                "Stat": "Maximum",
            },
            "ReturnData": True,
        }
        for q in range(queries)
    ]


def _ec2_answers(instances: int) -> tuple[bytes, bytes, bytes]:
    """DescribeInstances (this many tagged instances), StopInstances and DescribeTags (their Team tags) answers,
    in EC2's XML as moto writes it."""
    import boto3
    import moto

    captured: dict[str, bytes] = {}

    def grab(http_response: Any, model: Any, **_: Any) -> None:
        captured[model.name] = http_response.content

    with moto.mock_aws():
        ec2 = boto3.client("ec2", region_name=REGION)
        ec2.meta.events.register("after-call.ec2", grab)
        tags = [
            {"Key": "Team", "Value": "ml"},
            {"Key": "Owner", "Value": "someone@example.com"},
            {"Key": "Name", "Value": "a notebook"},
        ]
        ran = ec2.run_instances(
            ImageId="ami-12c6146b",
            InstanceType="g5.xlarge",
            MinCount=instances,
            MaxCount=instances,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
        ec2.describe_instances()
        ec2.stop_instances(InstanceIds=[ran["Instances"][0]["InstanceId"]])
        ec2.describe_tags(Filters=[{"Name": "key", "Values": ["Team"]}])
    return captured["DescribeInstances"], captured["StopInstances"], captured["DescribeTags"]


def _records(count: int) -> list[MachineRecord]:
    """Records as a few sweeps leave them: the benchmark fleet's, after a first look and a steady sweep."""
    import logging

    from sweep_cost import PREFIX, build_fleet

    from idle_reaper.notify import LoggingNotifier
    from idle_reaper.sweep import logger, run_sweep
    from testkit.aws import CountingStateStore

    handler = logger.registered_handler
    if isinstance(handler, logging.StreamHandler):
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115  the decisions' log lines are not wanted here
    bench = build_fleet(count, 7)
    store = CountingStateStore()
    adapters = bench.aws.adapters(store=store, notifier=LoggingNotifier(logger, delivers=True), prefix=PREFIX)
    for minutes in (0, 5, 35):
        run_sweep(adapters, now=T0 + timedelta(minutes=minutes))
    return list(store.records.values())


def measure(repeat: int = 20) -> BotocoreCpu:
    """Each operation's CPU per request, fitted from two or three sizes of answer."""
    cpu = BotocoreCpu()
    # GetMetricData: fixed + per query (request and result) + per datapoint (timestamps dominate).
    answers = {(q, p): _metric_answer(q, p) for q, p in ((500, 12), (500, 1), (50, 1))}
    cw_json = {"Content-Type": "application/x-amz-json-1.0"}
    timed = {}
    for (q, p), body in answers.items():
        cw = _stubbed("cloudwatch", {"GetMetricData": (cw_json, body)})
        queries = _metric_queries(q)
        timed[(q, p)] = _cpu_per_call(
            lambda cw=cw, queries=queries: cw.get_metric_data(
                MetricDataQueries=queries, StartTime=T0 - timedelta(hours=1), EndTime=T0
            ),
            max(2, repeat // 4),
        )
    per_point = (timed[(500, 12)] - timed[(500, 1)]) / (500 * 11)
    per_query = (timed[(500, 1)] - timed[(50, 1)] - per_point * 450) / 450
    fixed = max(0.0, timed[(50, 1)] - 50 * (per_query + per_point))
    op = "cloudwatch:GetMetricData"
    cpu.fixed[op], cpu.per_item[op] = fixed, {"queries": max(0.0, per_query), "datapoints": max(0.0, per_point)}

    # DescribeInstances: fixed + per instance listed.
    xml = {"Content-Type": "text/xml;charset=UTF-8"}
    sizes = (20, 200)
    listed: dict[str, dict[int, float]] = {"DescribeInstances": {}, "DescribeTags": {}}
    stop_body = b""
    for n in sizes:
        body, stop_body, tags_body = _ec2_answers(n)
        ec2 = _stubbed("ec2", {"DescribeInstances": (xml, body), "DescribeTags": (xml, tags_body)})
        listed["DescribeInstances"][n] = _cpu_per_call(lambda ec2=ec2: ec2.describe_instances(), max(2, repeat // 4))
        listed["DescribeTags"][n] = _cpu_per_call(lambda ec2=ec2: ec2.describe_tags(), max(2, repeat // 4))
    # DescribeTags (a planning alternative, docs/deploying.md): an item per tag, not per instance.
    for name, item in (("DescribeInstances", "instances"), ("DescribeTags", "tags")):
        per_item = (listed[name][200] - listed[name][20]) / 180
        op = f"ec2:{name}"
        cpu.fixed[op], cpu.per_item[op] = max(0.0, listed[name][20] - 20 * per_item), {item: per_item}
    ec2 = _stubbed("ec2", {"StopInstances": (xml, stop_body)})
    cpu.other = _cpu_per_call(lambda: ec2.stop_instances(InstanceIds=["i-0123456789abcdef0"]), repeat)

    # DynamoDB through the real adapter: a record's conditional PutItem; BatchGetItem of 1 and of 100 records
    # (a call plus a record: an account-region with one machine reads one record, not a full batch).
    records = _records(200)
    store = DynamoStateStore(None, "idle-reaper-state")
    from idle_reaper.aws.state import record_to_item

    ddb_json = {"Content-Type": "application/x-amz-json-1.0"}
    loaded = {}
    for n in (1, 100):
        items = [store._wire(record_to_item(r)) for r in records[:n]]
        store.dynamodb = _stubbed(
            "dynamodb",
            {
                "PutItem": (ddb_json, b"{}"),
                "BatchGetItem": (ddb_json, json.dumps({"Responses": {"idle-reaper-state": items}}).encode()),
            },
        )
        ids = [r.instance_id for r in records[:n]]
        loaded[n] = _cpu_per_call(lambda ids=ids: store.load(ids), max(2, repeat // 4) if n > 1 else repeat)
    per_record = max(0.0, (loaded[100] - loaded[1]) / 99)
    op = "dynamodb:BatchGetItem"
    cpu.fixed[op], cpu.per_item[op] = max(0.0, loaded[1] - per_record), {"records": per_record}
    cycle = iter(records * (repeat * 10))
    cpu.fixed["dynamodb:PutItem"] = _cpu_per_call(lambda: store.save(next(cycle)), repeat)
    return cpu


def describe(cpu: BotocoreCpu) -> list[str]:
    ms = 1000
    gmd, di = cpu.per_item["cloudwatch:GetMetricData"], cpu.per_item["ec2:DescribeInstances"]
    full_call = cpu.cost("cloudwatch:GetMetricData", {"queries": 500, "datapoints": 6000})
    return [
        f"GetMetricData: {cpu.fixed['cloudwatch:GetMetricData'] * ms:.2f} ms a call"
        f" + {gmd['queries'] * ms:.3f} ms a query + {gmd['datapoints'] * ms:.4f} ms a datapoint"
        f" (500 queries x 12 points: {full_call * ms:.0f} ms)",
        f"DescribeInstances: {cpu.fixed['ec2:DescribeInstances'] * ms:.2f} ms a call + {di['instances'] * ms:.3f} ms an"
        f" instance (a page of 1,000: {cpu.cost('ec2:DescribeInstances', {'instances': 1000}) * ms:.0f} ms)",
        f"DescribeTags: {cpu.fixed['ec2:DescribeTags'] * ms:.2f} ms a call"
        f" + {cpu.per_item['ec2:DescribeTags']['tags'] * ms:.4f} ms a tag (one key of an instance)",
        f"DynamoDB PutItem (a record, through DynamoStateStore): {cpu.fixed['dynamodb:PutItem'] * ms:.2f} ms",
        f"DynamoDB BatchGetItem (through DynamoStateStore): {cpu.fixed['dynamodb:BatchGetItem'] * ms:.2f} ms a call"
        f" + {cpu.per_item['dynamodb:BatchGetItem']['records'] * ms:.3f} ms a record"
        f" (100 records: {cpu.cost('dynamodb:BatchGetItem', {'records': 100}) * ms:.1f} ms)",
        f"any other request (StopInstances as the example): {cpu.other * ms:.2f} ms",
    ]


def child_process_costs(machines: int = 10_000) -> list[str]:
    """What listing in a child process adds (aws.run_in_processes): starting a forked child and reading its
    Pipe, and the listed machines' way back (pickled in the child, unpickled in the parent: serial there)."""
    import multiprocessing
    import pickle

    from sweep_cost import build_fleet

    from idle_reaper.aws import Fleet
    from idle_reaper.policy import TagKeys

    fork = multiprocessing.get_context("fork")
    started = time.perf_counter()
    for _ in range(10):
        receive, send = fork.Pipe(duplex=False)
        child = fork.Process(target=send.send, args=(b"",))
        child.start()
        send.close()
        receive.recv()
        child.join()
    start_s = (time.perf_counter() - started) / 10
    aws = build_fleet(machines, 7).aws
    answer = Fleet(aws.ec2, aws.autoscaling).discover(TagKeys())
    blob = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    unpickled = time.thread_time()
    pickle.loads(blob)
    per_machine = (time.thread_time() - unpickled) / len(answer)
    return [
        f"a forked child process, started, its Pipe read and joined: {start_s * 1000:.1f} ms (wall)",
        f"a listed machine's way back: {len(blob) / len(answer):.0f} bytes, unpickled in"
        f" {per_machine * 1000:.4f} ms by the parent",
    ]


def main() -> int:
    cpu = measure()
    print("botocore's own CPU per request (serialise, sign, parse), measured on this machine:")
    for line in describe(cpu):
        print(f"  {line}")
    print("listing in child processes (the planner, aws/fleet.py):")
    for line in child_process_costs():
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
