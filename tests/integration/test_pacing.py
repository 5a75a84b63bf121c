"""The product's pacing against AWS's rates, as the rules in front of moto keep them (aws_rules.py): a paced call
never finds AWS's bucket empty (GetMetricData's calls and datapoints; EC2's Describe* bucket). The pacers and the
rules read one virtual clock here, so a wait costs no real time; unpaced, the same calls are throttled until
botocore's retries run out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idle_reaper import aws as adapters
from idle_reaper.aws import fleet as fleet_module
from idle_reaper.notify import LoggingNotifier
from idle_reaper.policy import MetricSettings
from idle_reaper.sweep import Adapters, ShardTask, logger, plan_sweep, run_shard
from idle_reaper_tools import local

pytestmark = pytest.mark.integration


@pytest.fixture
def virtual_clock(aws: Any, virtual_pacing: list[float]) -> list[float]:
    """One clock for the product's pacers and AWS's buckets: a pacer's wait moves it, nothing sleeps."""
    aws.rules.clock = lambda: virtual_pacing[0]
    return virtual_pacing


def test_metric_reads_keep_to_getmetricdata_datapoints_a_second(aws, virtual_clock):
    """Issue 43 (3): GetMetricData allows 180,000 datapoints a second besides its 50 calls. 3,000 machines' CPU,
    GPU and activity (22 five-minute points each) over 110 minutes ask for 198,000 in 18 calls:
    unpaced, the calls past the first 180,000 datapoints were throttled past their retries and their machines left
    unknown. Paced, every call waits for its datapoints and every machine is read. One thread: on this test's
    clock, threads that wait at once can wake later than they meant to (another's longer wait moved the clock), and
    their requests then reach AWS's bucket together, which no real clock does; the pace shared by threads is
    tested in tests/unit/aws/test_paces.py."""
    ids = [f"i-{n:017x}" for n in range(3000)]
    end = datetime.now(UTC).replace(second=0, microsecond=0)
    reader = adapters.MetricsReader(adapters.client("cloudwatch"), workers=1)
    found = reader.fetch(ids, MetricSettings(), start=end - timedelta(minutes=110), end=end)
    assert aws.rules.throttles("GetMetricData") == 0
    assert all(s.complete for s in found.values()) and reader.stats.failed_calls == 0
    assert virtual_clock[0] - 1000.0 >= (198_000 - 180_000) / 180_000 - 1e-3, "it waited for the datapoints"


SHARDS = 6  # shards describing at once (the Map runs 30 at 200,000 machines)
MACHINES = 108  # 18 a shard
IDS_A_CALL = 1  # instead of 200: the calls of a larger fleet, with fewer machines (moto's time is per call)


def test_shards_describing_at_once_keep_to_ec2s_describe_bucket(aws, virtual_clock, monkeypatch):
    """Issue 43 (4): EC2's Describe* requests share a bucket of 100 tokens refilled 20 a second per account and
    region. The shard workers of one sweep describe their manifests at once, just after the planner's listing: at
    200,000 machines about 1,000 DescribeInstances calls of 200 ids. Here 6 shards of 18 machines describe one id a
    call, 108 calls at once after the planner's 6 (the calls of a larger fleet, with fewer machines). Unpaced, those
    past the bucket were throttled past their retries and their shards failed, every machine in them skipped.
    Paced, each shard waits for its share of the bucket's refill (the planner may have emptied it) and every
    shard's machines are described and decided."""
    monkeypatch.setattr(fleet_module, "FILTER_VALUES", IDS_A_CALL)
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    tags = [{"Key": "Team", "Value": "ml"}, {"Key": local.MANAGED_TAG, "Value": "true"}]
    with aws.rules.unmetered():  # the test's console seeds the fleet
        adapters.client("ec2").run_instances(
            ImageId=local.AMI,
            MinCount=MACHINES,
            MaxCount=MACHINES,
            InstanceType="m5.large",
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
    moto = Adapters(
        policies=adapters.PolicyStore(adapters.client("ssm"), adapters.ssm_prefix()),
        fleet=adapters.Fleet(adapters.client("ec2"), adapters.client("autoscaling")),
        metrics=adapters.MetricsReader(adapters.client("cloudwatch")),
        store=adapters.DynamoStateStore(adapters.client("dynamodb"), adapters.table_name()),
        notifier=LoggingNotifier(logger, delivers=True),
    )
    now = datetime.now(UTC)
    plan = plan_sweep(moto, now=now, sweep_id="paced", shard_size=MACHINES // SHARDS)
    assert plan.shards == SHARDS
    before = aws.rules.calls["DescribeInstances"]

    def shard(index: int) -> int:
        task = ShardTask(sweep_id="paced", now=now, shard=index, concurrent_shards=SHARDS, dry_run=True)
        return len(run_shard(moto, task)[0].decisions)

    decided = adapters.run_concurrently(shard, list(range(SHARDS)), SHARDS)
    assert aws.rules.calls["DescribeInstances"] - before >= MACHINES // IDS_A_CALL
    assert aws.rules.throttles() == 0, aws.rules.refused
    assert decided == [MACHINES // SHARDS] * SHARDS, "every shard's machines described and decided"
