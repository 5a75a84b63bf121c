"""How many AWS calls `idle-reaper doctor` makes, and their API time at the benchmarks' per-call latencies.

Runs the doctor's REAL gatherers (PolicyStore, Fleet.discover, the last hour of metrics in the sweep's
GetMetricData batches) over the counting in-memory fakes of testkit/aws/ for fleets of several sizes.
Slack calls are counted by running the REAL Slack gatherers (gather_slack, gather_people) against an in-process
workspace holding every owner: one auth.test, one conversations.info per channel, one users.info per admin or
member, and for the owners the sweep's cache does not hold, users.list pages of 200 users (the sweep's bulk path,
slack/owners.py) from 20 uncached owners on, else one users.lookupByEmail each. Printed with their API time at
0.25 s a call and the minutes of Slack's documented per-method allowance they use (Tier 2 users.list: 20 a minute).

The sweep's daily subset (sweep/doctor_daily.py daily_subset) is measured the same way, twice: after a sweep in
place (it reuses the sweep's reads: only GPU machines the sweep did not read are read, CPU and GPU alone; the
sweep measured is the second of a steady fleet, whose busy machines are not due),
and after a sweep handed to the fan-out, in its two places: the planner's part (the machines it listed, not listed
again; no metric read) and the machine shards' GPU facts (sweep/doctor_daily.py gpu_facts, each shard's GPU machines
its sweep did not read: here none, every GPU machine busy and not due, the most they can read).

The deploy checks (finding the stack in every enabled region, then its schedule, alarm topic, concurrency and
association) are counted against moto in server mode with AWS's real answers in front
(testkit/deploy_answers.py): the 17 regions an account has enabled by default, a stack in 1 and in 2 of them.
Their calls do not grow with the fleet; each is charged CROSS_REGION_SECONDS (a Describe call to another
region's endpoint from an admin's machine).

    python benchmarks/doctor_calls.py [--sizes 1000,10000,50000] [--owners 2000] [--deploy-regions 17]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")

from idle_reaper.aws import Fleet, MetricsReader, PolicyStore  # noqa: E402
from idle_reaper.aws.doctor import gather_policy, gather_signals  # noqa: E402
from idle_reaper.aws.state import InMemoryStateStore  # noqa: E402
from idle_reaper.core.doctor import MANIFEST_BOT_SCOPES  # noqa: E402
from idle_reaper.core.signals import Machine  # noqa: E402
from idle_reaper.policy import Settings  # noqa: E402
from idle_reaper.slack.doctor import SlackReader, gather_people, gather_slack  # noqa: E402
from idle_reaper.sweep import SHARD_SIZE, run_sweep  # noqa: E402
from idle_reaper.sweep.adapters import SweepRead  # noqa: E402
from idle_reaper.sweep.doctor_daily import daily_subset, gpu_facts, list_afresh  # noqa: E402
from idle_reaper.sweep.fanout import SHARDS_AT_ONCE, shard_count, split_into_shards  # noqa: E402
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


# Slack's documented rate limits, calls a minute per method (Tier 2, 3, 4; the fake holds the same floor).
TIER_PER_MINUTE = {"users.list": 20, "users.lookupByEmail": 50, "users.info": 100, "conversations.info": 50}
SLACK_LATENCY = 0.25  # a Slack Web API call (benchmarks/slack_throughput.py)


class Workspace:
    """The Slack Web API calls the doctor's Slack gatherers make, answered in-process for a workspace where
    every owner is a user (the bot in every channel), each call counted by method."""

    def __init__(self, people: dict[str, str]) -> None:
        self.people = people  # email -> user id
        self.by_id = sorted(people.items(), key=lambda item: item[1])
        self.calls: Counter[str] = Counter()

    def auth_test(self) -> Any:
        self.calls["auth.test"] += 1
        return SimpleNamespace(headers={"x-oauth-scopes": ",".join(sorted(MANIFEST_BOT_SCOPES))})

    def conversations_info(self, channel: str) -> dict[str, Any]:
        self.calls["conversations.info"] += 1
        return {"channel": {"id": channel, "is_member": True}}

    def users_info(self, user: str) -> dict[str, Any]:
        self.calls["users.info"] += 1
        return {"user": {"id": user, "deleted": False}}

    def users_lookupByEmail(self, email: str) -> dict[str, Any]:
        self.calls["users.lookupByEmail"] += 1
        return {"user": {"id": self.people[email.lower()]}}

    def users_list(self, limit: int, cursor: str | None = None) -> dict[str, Any]:
        self.calls["users.list"] += 1
        start = int(cursor or 0)
        page = [{"id": uid, "profile": {"email": email}} for email, uid in self.by_id[start : start + limit]]
        more = start + limit < len(self.by_id)
        return {"members": page, "response_metadata": {"next_cursor": str(start + limit) if more else ""}}


def slack_figures(calls: Counter[str]) -> dict[str, object]:
    """The calls, their API time one after another, and the minutes of Slack's documented per-method allowance
    they use (under 1: every call fits one minute's allowance, no 429 at all)."""
    return {
        "slack_calls": dict(sorted(calls.items())),
        "slack_calls_total": sum(calls.values()),
        "slack_seconds_sequential": round(sum(calls.values()) * SLACK_LATENCY, 1),
        "slack_tier_minutes": round(max(n / TIER_PER_MINUTE.get(m, 100) for m, n in calls.items()), 2),
    }


def measure_slack(machines: list[Machine], settings: Settings, refs: Any, cached: bool) -> dict[str, object]:
    """The REAL Slack gatherers (gather_slack, gather_people: the sweep's bulk owner path) over a workspace of
    the fleet's owners; `cached`: the sweep's owner cache holds every owner (else none)."""
    owners = sorted({m.owner for m in machines if m.owner})
    workspace = Workspace({o.lower(): f"U{n:08d}" for n, o in enumerate(owners)})
    reader = SlackReader(workspace)  # type: ignore[arg-type]
    gather_slack(reader, True, settings, refs)
    gather_people(reader, machines, refs, (lambda key: "U-cached") if cached else (lambda key: None))
    return {"workspace_users": len(owners), **slack_figures(workspace.calls)}


def measure(size: int, owners: int) -> dict[str, object]:
    fake = fleet(size, owners)
    settings, _, refs = gather_policy(PolicyStore(fake.ssm, "/idle-reaper"))
    machines = Fleet(fake.ec2, fake.autoscaling).discover(settings.tags)
    gather_signals(MetricsReader(fake.cloudwatch), machines, settings, refs, NOW)
    calls = fake.calls()
    aws_seconds = seconds_of(calls)
    distinct_owners = len({m.owner for m in machines})
    return {
        "machines": size,
        "aws_calls": dict(sorted(calls.items())),
        "aws_calls_total": sum(calls.values()),
        "aws_seconds_sequential": aws_seconds,
        "dynamodb_owner_cache_reads": distinct_owners,
        "owners": distinct_owners,
        "slack_uncached": measure_slack(machines, settings, refs, cached=False),
        "slack_cached": measure_slack(machines, settings, refs, cached=True),
        # What one users.lookupByEmail per owner (the path before the bulk listing) would take.
        "one_lookup_per_owner_tier_minutes": round(distinct_owners / TIER_PER_MINUTE["users.lookupByEmail"], 1),
    }


# The regions every account has enabled by default (the opt-in regions are off until enabled).
DEFAULT_REGIONS = [
    "us-east-1", "us-east-2", "us-west-1", "us-west-2", "ca-central-1", "sa-east-1", "eu-west-1", "eu-west-2",
    "eu-west-3", "eu-central-1", "eu-north-1", "ap-south-1", "ap-northeast-1", "ap-northeast-2",
    "ap-northeast-3", "ap-southeast-1", "ap-southeast-2",
]  # fmt: skip
CROSS_REGION_SECONDS = 0.2


def measure_deploy(enabled: int, stacks: int) -> dict[str, object]:
    """The deploy checks' calls with a stack in `stacks` of `enabled` regions (the other checks excluded)."""
    from idle_reaper_tools import local
    from idle_reaper_tools.doctor_deploy import REGIONS_AT_ONCE, check_deploy
    from testkit.deploy_answers import deploy_stack, real_deploy_answers

    local.quiet_server_logs()
    with local.local_aws() as server, real_deploy_answers() as answers:
        server.reset()
        answers.enabled_regions = DEFAULT_REGIONS[:enabled]
        for region in DEFAULT_REGIONS[:stacks]:
            deploy_stack(answers, region)
        answers.calls.clear()
        check_deploy(None, "IdleReaper", None, lambda region, first, outputs: [])
    calls: dict[str, int] = {}
    for (_, operation), n in answers.calls.items():
        calls[operation] = calls.get(operation, 0) + n
    total = sum(calls.values())
    stacks_found = calls.get("DescribeStacks", 0)
    return {
        "enabled_regions": enabled,
        "regions_with_stack": stacks,
        "deploy_calls": dict(sorted(calls.items())),
        "deploy_calls_total": total,
        "deploy_seconds_sequential": round(total * CROSS_REGION_SECONDS, 1),
        # The DescribeStacks calls run REGIONS_AT_ONCE at a time; the rest one after another.
        "deploy_seconds_wall": round(
            (total - stacks_found + math.ceil(stacks_found / REGIONS_AT_ONCE)) * CROSS_REGION_SECONDS, 1
        ),
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
    listed = adapters.fleet.discover(Settings().tags)  # what the fan-out's planner listed (handlers/sweep.py)
    before = fake.calls()
    read = list_afresh(adapters, listed)
    daily_subset(adapters, read, NOW, None, gpu=False)
    planner = fake.calls() - before
    out["fanned_out_planner_aws_calls"] = dict(sorted(planner.items()))
    out["fanned_out_planner_aws_seconds_sequential"] = seconds_of(planner)
    by_id = {m.instance_id: m for m in listed}
    shards = split_into_shards(listed, shard_count(len(listed), SHARD_SIZE, SHARDS_AT_ONCE))
    before = fake.calls()
    for ids in shards:  # each machine shard, its sweep having read none of its GPU machines, at its share
        shard = replace(adapters, metrics=adapters.metrics.shared_by(min(len(shards), SHARDS_AT_ONCE)))
        gpu_facts(shard, SweepRead(read.settings, read.refs, [by_id[i] for i in ids], {}), NOW)
    in_shards = fake.calls() - before
    out["fanned_out_shards"] = len(shards)
    out["fanned_out_shards_aws_calls_at_most"] = dict(sorted(in_shards.items()))
    out["owner_cache_reads"] = len({m.owner for m in read.machines})
    out["slack_calls"] = 1 + TEAMS
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000,50000")
    parser.add_argument("--owners", type=int, default=2000)
    parser.add_argument("--deploy-regions", type=int, default=len(DEFAULT_REGIONS))
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(measure(size, args.owners)))
        print(json.dumps({"daily": measure_daily(size, args.owners)}))
    for stacks in (1, 2):
        print(json.dumps(measure_deploy(args.deploy_regions, stacks)))


if __name__ == "__main__":
    main()
