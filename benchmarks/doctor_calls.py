"""How many AWS calls `idle-reaper doctor` makes, and their API time at the benchmarks' per-call latencies.

Runs the doctor's REAL gatherers (PolicyStore, Fleet.discover, the last hour of metrics in the sweep's
GetMetricData batches) over the counting in-memory fakes of testkit/aws/ for fleets of several sizes.
Slack calls are counted from what the gatherers ask: one auth.test, one conversations.info per channel,
one users.info per admin or member, and one call per distinct Owner the sweep's cache does not hold.

The sweep's daily subset (sweep/doctor.py daily_subset) is measured the same way, twice: after a sweep in
place (it reuses the sweep's reads: only GPU machines the sweep did not read are read, CPU and GPU alone; the
sweep measured is the second of a steady fleet, whose busy machines are not due),
and after a sweep handed to the fan-out (it lists the fleet again and reads every GPU machine).

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
from idle_reaper.aws.state import InMemoryStateStore  # noqa: E402
from idle_reaper.policy import Settings  # noqa: E402
from idle_reaper.sweep import SHARD_SIZE, run_sweep  # noqa: E402
from idle_reaper.sweep.doctor import daily_subset, list_afresh  # noqa: E402
from testkit.aws import FakeAws, steady  # noqa: E402
from testkit.aws.clients import LATENCY  # noqa: E402

NOW = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
TEAMS = 20
GPU_SHARE = 10  # one machine in ten is a GPU type


def fleet(size: int, owners: int) -> FakeAws:
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
    return fake


def seconds_of(calls: dict[str, int]) -> float:
    return round(sum(LATENCY.get(op, 0.05) * n for op, n in calls.items()), 1)


def measure(size: int, owners: int) -> dict[str, object]:
    fake = fleet(size, owners)
    settings, _, refs = gather_policy(PolicyStore(fake.ssm, "/idle-reaper"))
    machines = Fleet(fake.ec2, fake.autoscaling).discover(settings.tags)
    gather_signals(MetricsReader(fake.cloudwatch), machines, settings, refs, NOW)
    calls = fake.calls()
    aws_seconds = seconds_of(calls)
    distinct_owners = len({m.owner for m in machines})
    slack = 1 + TEAMS + distinct_owners  # auth.test, conversations.info, one lookup per owner (none cached)
    return {
        "machines": size,
        "aws_calls": dict(sorted(calls.items())),
        "aws_calls_total": sum(calls.values()),
        "aws_seconds_sequential": aws_seconds,
        "dynamodb_owner_cache_reads": distinct_owners,
        "slack_calls_uncached": slack,
        "slack_calls_cached": 1 + TEAMS,
    }


def measure_daily(size: int, owners: int) -> dict[str, object]:
    """The daily subset's AWS calls after the sweep's own work (Slack is counted from what it asks: one
    auth.test, one conversations.info per channel, one call per distinct Owner the owner cache does not hold)."""
    fake = fleet(size, owners)
    store = InMemoryStateStore()
    for o in range(owners):  # the sweep's owner cache, as warnings leave it
        store.put_lookup(f"owner#user{o}@example.com", f"U{o:08d}", NOW + timedelta(days=7))
    adapters = fake.adapters(store)
    out: dict[str, object] = {"machines": size}
    if size <= SHARD_SIZE:  # the day's first sweep of a fleet in steady state: its busy machines are not due
        run_sweep(adapters, now=NOW - timedelta(minutes=5))
        report = run_sweep(adapters, now=NOW)
        assert report.read is not None
        out["in_place_machines_read_by_the_sweep"] = len(report.read.signals)
        before = fake.calls()
        daily_subset(adapters, report.read, NOW, None)
        after_sweep = fake.calls() - before
        out["in_place_aws_calls"] = dict(sorted(after_sweep.items()))
    before = fake.calls()
    read = list_afresh(adapters)
    daily_subset(adapters, read, NOW, None)
    fanned_out = fake.calls() - before
    out["fanned_out_aws_calls"] = dict(sorted(fanned_out.items()))
    out["fanned_out_aws_seconds_sequential"] = seconds_of(fanned_out)
    out["owner_cache_reads"] = len({m.owner for m in read.machines})
    out["slack_calls"] = 1 + TEAMS
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--owners", type=int, default=2000)
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(measure(size, args.owners)))
        print(json.dumps({"daily": measure_daily(size, args.owners)}))


if __name__ == "__main__":
    main()
