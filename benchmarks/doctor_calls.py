"""How many AWS calls `idle-reaper doctor` makes, and their API time at the benchmarks' per-call latencies.

Runs the doctor's REAL gatherers (PolicyStore, Fleet.discover, the last hour of metrics in the sweep's
GetMetricData batches) over the counting in-memory fakes of testkit/aws/ for fleets of several sizes.
Slack calls are counted from what the gatherers ask: one auth.test, one conversations.info per channel,
one users.info per admin or member, and one call per distinct Owner the sweep's cache does not hold.

    python benchmarks/doctor_calls.py [--sizes 1000,10000,50000] [--owners 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

from idle_reaper.aws import Fleet, MetricsReader, PolicyStore  # noqa: E402
from idle_reaper.aws.doctor import gather_policy, gather_signals  # noqa: E402
from idle_reaper.policy import Settings  # noqa: E402
from testkit.aws import FakeAws, steady  # noqa: E402
from testkit.aws.clients import LATENCY  # noqa: E402

NOW = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
TEAMS = 20
GPU_SHARE = 10  # one machine in ten is a GPU type


def measure(size: int, owners: int) -> dict[str, object]:
    fake = FakeAws()
    fake.ssm.store("/idle-reaper/settings", Settings().model_dump_json())
    for t in range(TEAMS):
        fake.ssm.store(f"/idle-reaper/teams/team{t}", json.dumps({"slack_channel": f"C0TEAM{t}"}))
    for i in range(size):
        gpu = i % GPU_SHARE == 0
        fake.launch(
            "g5.xlarge" if gpu else "m5.large",
            team=f"team{i % TEAMS}",
            profile=steady(10.0, 50.0 if gpu else None),
            launch_time=NOW - timedelta(days=1),
            owner=f"user{i % owners}@example.com",
        )
    settings, _, refs = gather_policy(PolicyStore(fake.ssm, "/idle-reaper"))
    machines = Fleet(fake.ec2, fake.autoscaling).discover(settings.tags)
    gather_signals(MetricsReader(fake.cloudwatch), machines, settings, refs, NOW)
    calls = fake.calls()
    aws_seconds = sum(LATENCY.get(op, 0.05) * n for op, n in calls.items())
    distinct_owners = len({m.owner for m in machines})
    slack = 1 + TEAMS + distinct_owners  # auth.test, conversations.info, one lookup per owner (none cached)
    return {
        "machines": size,
        "aws_calls": dict(sorted(calls.items())),
        "aws_calls_total": sum(calls.values()),
        "aws_seconds_sequential": round(aws_seconds, 1),
        "dynamodb_owner_cache_reads": distinct_owners,
        "slack_calls_uncached": slack,
        "slack_calls_cached": 1 + TEAMS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--owners", type=int, default=2000)
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(measure(size, args.owners)))


if __name__ == "__main__":
    main()
