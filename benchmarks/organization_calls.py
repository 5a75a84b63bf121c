"""Organization mode's own calls (issue 30): listing the enrolled accounts and assuming member roles, at the
scale the issue names (1,000 accounts x 4 regions), over the counting fakes of testkit/aws/organization.py.

Runs the REAL aws.accounts.AccountDirectory and MemberSessions. Latencies: testkit's ORGANIZATION_LATENCY
(AssumeRole 50 ms, Organizations 150 ms a call), scheduled on the pool's lanes as benchmarks/sweep_latency.py
does. It measures discovery and credentials alone; the whole sweep of 200,000 machines in member accounts (the
planner, the member shards, the gather step) is benchmarks/organization_sweep.py.

    python benchmarks/organization_calls.py [--accounts 1000] [--regions 4] [--every 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tools", ROOT / "lambdas"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "WARNING")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

from idle_reaper.aws.accounts import (  # noqa: E402
    STS_WORKERS,
    AccountDirectory,
    MemberCredentials,
    MemberSessions,
)
from testkit.aws.clients import LATENCY, LatencyModel  # noqa: E402
from testkit.aws.organization import ORGANIZATION_LATENCY, FakeOrganizations, FakeSts  # noqa: E402

START = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
REGIONS = ("us-east-1", "us-west-2", "eu-west-1", "eu-central-1")


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


def organization(accounts: int) -> tuple[FakeOrganizations, list[str]]:
    """Five top-level OUs, ten team OUs in each, the accounts spread over the team OUs."""
    org = FakeOrganizations()
    tops = [org.add_ou(org.root) for _ in range(5)]
    teams = [org.add_ou(top) for top in tops for _ in range(10)]
    for i in range(accounts):
        org.add_account(teams[i % len(teams)])
    return org, tops


def client_cpu_ms(samples: int = 10) -> float:
    """CPU of making one client with member credentials (from the default session), measured here."""
    held = MemberCredentials("111111111111", "us-east-1", "ASIAFAKE", "fake", "fake", START + timedelta(hours=1))
    held.client("ec2")  # the first loads the service model once per process
    started = time.process_time()
    for _ in range(samples):
        held.client("ec2")
    return (time.process_time() - started) / samples * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accounts", type=int, default=1000)
    parser.add_argument("--regions", type=int, default=4)
    parser.add_argument("--every", type=int, default=5, help="minutes between sweeps")
    args = parser.parse_args()
    regions = REGIONS[: args.regions]
    model = LatencyModel(latency={**LATENCY, **ORGANIZATION_LATENCY})
    model.install()
    try:
        clock = Clock()
        org, targets = organization(args.accounts)
        org.latency = model
        directory = AccountDirectory(org, targets, hub_account="999999999999", clock=clock)
        before = model.virtual
        cpu = time.process_time()
        listing = directory.current()
        listing_s, listing_cpu = model.virtual - before, time.process_time() - cpu
        pairs = [(a.id, r) for a in listing.accounts for r in regions]

        sts = FakeSts(clock)
        sts.latency = model
        sessions = MemberSessions(sts, prefix="idle-reaper", purpose="sweep", clock=clock)
        before, cpu = model.virtual, time.process_time()
        first = sessions.all_credentials(pairs, started=clock.now)
        assume_s, assume_cpu = model.virtual - before, time.process_time() - cpu
        failed = sum(not isinstance(c, MemberCredentials) for c in first.values())

        # Three hours of sweeps: how many AssumeRole calls each makes once credentials are held.
        per_sweep = []
        sweeps = 3 * 60 // args.every
        for _ in range(sweeps):
            clock.now += timedelta(minutes=args.every)
            calls = sessions.assume_calls
            sessions.all_credentials(pairs, started=clock.now)
            directory.current()
            per_sweep.append(sessions.assume_calls - calls)
    finally:
        model.uninstall()

    print(f"organization mode: {len(listing.accounts):,} accounts x {len(regions)} regions = {len(pairs):,} units")
    print(
        f"  listing the accounts: {org.calls.total():,} Organizations calls "
        f"({dict(sorted(org.calls.items()))}) in the first listing and {sweeps} sweeps, "
        f"{listing_s:.1f} s modelled for one listing (walked one call at a time), {listing_cpu * 1000:.0f} ms CPU"
    )
    print(
        f"  first sweep: {len(pairs):,} AssumeRole calls on {STS_WORKERS} threads, {assume_s:.1f} s modelled, "
        f"{assume_cpu * 1000:.0f} ms CPU of our own; {failed} failed"
    )
    print(
        f"  then, every {args.every} min for 3 h: {sum(per_sweep):,} AssumeRole calls in {sweeps} sweeps "
        f"({sum(per_sweep) / 3:,.0f} an hour), "
        f"at most {max(per_sweep):,} in one sweep (credentials renewed together, 16 min before they expire)"
    )
    per_client = client_cpu_ms()
    print(
        f"  a client made with member credentials: {per_client:.0f} ms CPU each "
        f"({len(pairs) * 2:,} clients for EC2 and CloudWatch in every unit: "
        f"{len(pairs) * 2 * per_client / 1000:,.0f} CPU-s per fresh set, spread over the shard workers)"
    )


if __name__ == "__main__":
    main()
