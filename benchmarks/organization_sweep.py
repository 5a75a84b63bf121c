"""The whole sweep of an organization (issue 30): 1,000 member accounts x 4 regions x 50 machines (200,000
machines), through the REAL planner (plan_sweep: the account listing, the member manifests), shard workers
(run_shard: each member unit through sweep_member_accounts and member_adapters, credentials from MemberSessions)
and gather step (gather_sweep), over the in-memory fakes: one FakeAws per (account, region), FakeOrganizations
and FakeSts (testkit/aws/organization.py).

The latency model is benchmarks/sweep_latency.py's: every call charged its in-region latency (testkit LATENCY)
on the lanes of the pool that makes it, botocore's CPU per request (measured now, botocore_cpu.py) and the
code's own CPU serial; plus STS AssumeRole (50 ms) and Organizations (150 ms a call), and the CPU of making
the clients each member unit uses (EC2, Auto Scaling, SageMaker, CloudWatch: measured now, charged serially).
Each invocation is timed alone, as its own Lambda runs it, and composed as Step Functions runs them (the Map
SHARDS_AT_ONCE at a time).

Credentials: a Lambda process keeps what it assumed while it is warm (MemberSessions, up to an hour less the
16-minute margin), and only then. The Map's workers run on SHARDS_AT_ONCE warm processes, and Lambda gives an
invocation to any free one: the model hands each wave's shards to the processes in a random order, so a
unit's credentials are reused only when its shard happens to land on the process that assumed them before.
The planner is one process (reserved concurrency 1), warm from sweep to sweep: its credential check
(check_member_accounts) reuses its own credentials until they are renewed.

    python benchmarks/organization_sweep.py [--accounts 1000] [--regions 4] [--machines 50] [--compare 1000]
    python benchmarks/organization_sweep.py --accounts 1 --regions 1 --machines 50000 --compare 0 --split known off
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks", ROOT / "lambdas"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("POWERTOOLS_LOG_LEVEL", "INFO")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

from botocore_cpu import BotocoreCpu  # noqa: E402
from organization_calls import organization  # noqa: E402
from sweep_cost import PREFIX, T0, build_fleet  # noqa: E402
from sweep_latency import (  # noqa: E402
    STATE_OVERHEAD_S,
    SWEEP_TIMEOUT_S,
    WIDTH,
    Segments,
    map_wall,
    measured_botocore,
    request_cpu,
)
from sweep_latency import row as latency_row  # noqa: E402

from idle_reaper import sweep as sweep_module  # noqa: E402
from idle_reaper.aws.accounts import (  # noqa: E402
    UNIT_SIZES_KEY,
    AccountDirectory,
    MemberAccess,
    MemberCredentials,
    MemberSessions,
    OrganizationConfig,
    UnitSize,
    UnitSizes,
    save_unit_sizes,
)
from idle_reaper.aws.fleet import LISTING_PROCESSES  # noqa: E402
from idle_reaper.notify import LoggingNotifier  # noqa: E402
from idle_reaper.policy import Settings, TeamPolicy  # noqa: E402
from idle_reaper.sweep import (  # noqa: E402
    PLANNER_VCPUS,
    SHARDS_AT_ONCE,
    Adapters,
    GatherTask,
    ShardTask,
    gather_sweep,
    plan_sweep,
    run_shard,
    run_sweep,
)
from idle_reaper.sweep.members import (  # noqa: E402
    MEMBER_SWEEP_WORKERS,
    MEMBER_UNITS_PER_SHARD,
    check_member_accounts,
    member_adapters,
    sweep_member_accounts,
    whole_units,
)
from testkit.aws import LATENCY, CountingStateStore, FakeAws, LatencyModel  # noqa: E402
from testkit.aws.organization import ORGANIZATION_LATENCY, FakeOrganizations, FakeSts  # noqa: E402

REGIONS = ("us-east-1", "us-west-2", "eu-west-1", "eu-central-1")
HUB = "999999999999"
SWEEPS = (T0, T0 + timedelta(minutes=5))  # the first look, and the steady sweep 5 minutes later
LABELS = ("#1 first", "#2 steady")
SCHEDULE_S = 300.0  # the default 5-minute schedule: a sweep must end before the next is due
CLIENTS = ("ec2", "autoscaling", "sagemaker", "cloudwatch")  # member_adapters makes these for each unit


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@dataclass(frozen=True)
class WorldCredentials:
    """Stands in for MemberCredentials: one (account, region)'s fakes as its clients, each charged the CPU of
    making a real one (member_adapters makes them when first used)."""

    world: FakeAws
    model: LatencyModel

    def client(self, service: str) -> Any:
        self.model.charge_cpu(f"client:{service}", {}, {})
        return {"ec2": self.world.ec2, "autoscaling": self.world.autoscaling, "cloudwatch": self.world.cloudwatch}.get(
            service
        )


def client_cpu_s(samples: int = 10) -> dict[str, float]:
    """CPU of making one client with member credentials, per service, measured here (the first of each loads
    its service model, once per process: not counted, a warm Lambda has it)."""
    held = MemberCredentials("111111111111", "us-east-1", "ASIAFAKE", "fake", "fake", T0 + timedelta(hours=1))
    costs = {}
    for service in CLIENTS:
        held.client(service)
        started = time.process_time()
        for _ in range(samples):
            held.client(service)
        costs[service] = (time.process_time() - started) / samples
    return costs


class Fakes:
    """Every fake of the organization, for the time they spend (the code under test's CPU excludes it)."""

    def __init__(self, hub: FakeAws, worlds: dict[tuple[str, str], FakeAws], sts: FakeSts, orgs: FakeOrganizations):
        self.hub, self.worlds, self.sts, self.orgs = hub, worlds, sts, orgs

    def seconds(self) -> float:
        return (
            self.hub.seconds() + sum(w.seconds() for w in self.worlds.values()) + self.sts.seconds + self.orgs.seconds
        )

    def calls(self) -> Counter[str]:
        total = self.hub.calls()
        for w in self.worlds.values():
            total.update(w.calls())
        return total


@dataclass
class SweepRun:
    wall_s: float
    planner_s: float  # listing and manifests (the sweep starts when they are written)
    check_s: float  # the planner's side job after StartExecution: credentials in every unit
    shard_walls: list[float]
    machine_shards: int
    gather_s: float
    longest_s: float
    assume_workers: int  # AssumeRole calls of the shard workers
    assume_planner: int  # AssumeRole calls of the planner's credential check
    organizations_calls: int
    machines: int
    units_swept: int
    units_failed: int
    deferred: int
    assume_latency_s: float  # AssumeRole latency charged (serial sum)
    client_cpu_s: float  # member clients made (serial sum)
    botocore_s: float
    unit_parts: int = 0  # shards that were parts of a large account-region

    @property
    def map_s(self) -> float:
        return map_wall(self.shard_walls, SHARDS_AT_ONCE)


def run_organization(
    accounts: int,
    regions: Sequence[str],
    machines: int,
    *,
    seed: int,
    cpu: BotocoreCpu | None,
    clients: dict[str, float],
    hub_machines: int = 0,
    sweeps: Sequence[datetime] = SWEEPS,
    assume_role_s: float | None = None,
    units_per_shard: int = MEMBER_UNITS_PER_SHARD,
    unit_workers: int = MEMBER_SWEEP_WORKERS,
    split: str = "auto",
) -> list[SweepRun]:
    """The organization's sweeps as the stack runs them: the planner (listing, manifests, StartExecution, then
    its credential check), a worker invocation per shard on one of SHARDS_AT_ONCE warm processes, the gather
    step. `assume_role_s`: AssumeRole's latency instead of the model's (0: what the sweep costs without it).
    `split`: "auto" (a unit of more than UNIT_PART_SIZE machines is swept in parts from the sweep after the
    gather step saw its size), "known" (its size already remembered, so the first look is in parts too), "off"
    (every unit one shard, as before the split)."""
    rng = random.Random(seed)
    clock = Clock()
    orgs, targets = organization(accounts)
    hub = build_fleet(hub_machines, seed).aws
    ec2_only = Settings(sagemaker_notebooks=False, sagemaker_endpoints=False)  # the fleet has no SageMaker
    hub.ssm.store(f"{PREFIX}/settings", ec2_only.model_dump_json())
    ids = sorted(orgs.accounts)
    worlds = {
        (a, r): build_fleet(machines, seed + i).aws for i, (a, r) in enumerate((a, r) for a in ids for r in regions)
    }
    sts = FakeSts(clock)
    fakes = Fakes(hub, worlds, sts, orgs)

    latency = {**LATENCY, **ORGANIZATION_LATENCY}
    if assume_role_s is not None:
        latency["sts:AssumeRole"] = assume_role_s
    base = request_cpu(cpu) if cpu is not None else None

    def priced(operation: str, request: Any, response: Any) -> float:
        if operation.startswith("client:"):
            return clients[operation.split(":", 1)[1]]
        if operation == "sts:AssumeRole" and assume_role_s == 0:
            return 0.0
        return base(operation, request, response) if base is not None else 0.0

    model = LatencyModel(latency=latency, cpu=priced, vcpus=PLANNER_VCPUS)
    for fake in (hub, *worlds.values()):
        fake.set_latency(model)
    sts.latency = orgs.latency = model
    model.fake_seconds = fakes.seconds
    store = CountingStateStore(model)
    adapters = hub.adapters(
        store=store,
        notifier=LoggingNotifier(sweep_module.logger, delivers=True),
        prefix=PREFIX,
        listing_processes=LISTING_PROCESSES,
    )
    config = OrganizationConfig(prefix="idle-reaper", targets=tuple(targets), regions=tuple(regions), hub_account=HUB)
    directory = AccountDirectory(orgs, config.targets, hub_account=HUB, clock=clock)

    def access(purpose: str) -> MemberAccess:
        return MemberAccess(config, directory, MemberSessions(sts, config.prefix, purpose, clock=clock))

    if split == "known":
        sizes = [UnitSize(account=a, region=r, machines=machines, seen=sweeps[0]) for a, r in worlds]
        save_unit_sizes(store, UnitSizes(units=sizes), sweeps[0])
    planner = access("sweep")
    processes = [access("sweep") for _ in range(SHARDS_AT_ONCE)]  # the Map's warm worker processes

    def make(hub_adapters: Adapters, held: MemberCredentials, default: TeamPolicy | None) -> Adapters:
        return member_adapters(hub_adapters, WorldCredentials(worlds[(held.account, held.region)], model), default)  # type: ignore[arg-type]

    def sweep_members(*args: Any, **kwargs: Any) -> Any:
        return sweep_member_accounts(*args, make_adapters=make, workers=unit_workers, **kwargs)

    segments = Segments(model, fakes, sleep=False)  # type: ignore[arg-type]
    model.install()
    runs = []
    try:
        for now in sweeps:
            clock.now = now
            assume_before = {id(p): p.sessions.assume_calls for p in (planner, *processes)}
            orgs_before, charged_before = orgs.calls.total(), Counter(model.charged)
            botocore_before, client_before = segments.botocore_s, model.cpu_s
            client_before = sum(v for k, v in model.cpu_charged.items() if k.startswith("client:"))
            if split == "off":
                store.put_lookup(UNIT_SIZES_KEY, UnitSizes().model_dump_json(), now + timedelta(days=1))
            plan, planner_s, _ = segments.time(
                lambda now=now: plan_sweep(
                    adapters,
                    now=now,
                    in_place=True,
                    members=planner if accounts else None,
                    units_per_shard=units_per_shard,
                )
            )
            if plan.in_place:  # nothing in member accounts: today's single-account sweep
                _, swept_s, _ = segments.time(
                    lambda now=now, plan=plan: run_sweep(adapters, now=now, listed=plan.listed)
                )
                walls, wall, gathered_units, gathered = [planner_s + swept_s], planner_s + swept_s, [], None
                check_s, gather_s = 0.0, 0.0
                shard_walls: list[float] = []
            else:
                model.charge("states:StartExecution")
                _, check_s, _ = segments.time(lambda now=now: check_member_accounts(adapters, planner, now))
                order = list(range(plan.all_shards))
                shard_walls = []
                for wave_start in range(0, len(order), SHARDS_AT_ONCE):
                    wave = order[wave_start : wave_start + SHARDS_AT_ONCE]
                    homes = rng.sample(processes, len(wave))  # any free warm process takes an invocation
                    for index, home in zip(wave, homes, strict=True):
                        model.charge("states:InvokeLambda")
                        task = ShardTask(
                            sweep_id=plan.sweep_id,
                            now=plan.now,
                            shard=index,
                            concurrent_shards=min(plan.all_shards, SHARDS_AT_ONCE),
                        )
                        _, shard_s, _ = segments.time(
                            lambda task=task, home=home: run_shard(
                                adapters,
                                task,
                                members=home,
                                sweep_members=sweep_members,
                                time_left=lambda: SWEEP_TIMEOUT_S,
                            )
                        )
                        shard_walls.append(shard_s + model.latency["states:InvokeLambda"])
                model.charge("states:InvokeLambda")
                gather_task = GatherTask(sweep_id=plan.sweep_id, now=plan.now, shards=order)
                gathered, gather_s, _ = segments.time(lambda t=gather_task: gather_sweep(adapters, t))
                assert not gathered.failed, gathered.failed
                gathered_units = whole_units(gathered.units)
                start_s = model.latency["states:StartExecution"]
                walls = [planner_s + start_s + check_s, *shard_walls, gather_s]
                wall = planner_s + start_s + map_wall(shard_walls, SHARDS_AT_ONCE) + gather_s + STATE_OVERHEAD_S
            charged = model.charged - charged_before
            runs.append(
                SweepRun(
                    wall_s=wall,
                    planner_s=planner_s,
                    check_s=check_s,
                    shard_walls=shard_walls,
                    machine_shards=plan.shards,
                    gather_s=gather_s,
                    longest_s=max(walls),
                    assume_workers=sum(p.sessions.assume_calls - assume_before[id(p)] for p in processes),
                    assume_planner=planner.sessions.assume_calls - assume_before[id(planner)],
                    organizations_calls=orgs.calls.total() - orgs_before,
                    machines=gathered.machines if gathered is not None else plan.machines,
                    units_swept=sum(u.swept is not None for u in gathered_units),
                    units_failed=sum(bool(u.error) and not u.deferred for u in gathered_units),
                    deferred=sum(u.deferred for u in gathered_units),
                    unit_parts=sum(1 for u in gathered.units if u.parts) if gathered is not None else 0,
                    assume_latency_s=charged["sts:AssumeRole"] * model.latency["sts:AssumeRole"],
                    client_cpu_s=sum(v for k, v in model.cpu_charged.items() if k.startswith("client:"))
                    - client_before,
                    botocore_s=segments.botocore_s - botocore_before,
                )
            )
    finally:
        model.uninstall()
    return runs


row = functools.partial(latency_row, spec=",.1f")


def print_organization(accounts: int, regions: int, machines: int, runs: list[SweepRun], build_s: float) -> bool:
    units = accounts * regions
    print(
        f"\n== {accounts:,} accounts x {regions} regions x {machines} machines = {units * machines:,} machines "
        f"({units:,} units, at most {MEMBER_UNITS_PER_SHARD} a member shard, {MEMBER_SWEEP_WORKERS} at once; "
        f"benchmark ran {build_s:.0f} s here) =="
    )
    print(f"  {'':<{WIDTH}}" + "".join(f"{h:>12}" for h in LABELS[: len(runs)]))
    row("machines swept", [r.machines for r in runs], spec=",.0f")
    row("units swept", [r.units_swept for r in runs], spec=",.0f")
    row("  failed", [r.units_failed for r in runs], spec=",.0f")
    row("  left to the next sweep (time)", [r.deferred for r in runs], spec=",.0f")
    row("shards (the hub's own machines + member units)", [len(r.shard_walls) for r in runs], spec=",.0f")
    row("  parts of large account-regions among them", [r.unit_parts for r in runs], spec=",.0f")
    row("planner: listing, manifests, s", [r.planner_s for r in runs])
    row("  its credential check after StartExecution, s", [r.check_s for r in runs])
    row(f"Map ({SHARDS_AT_ONCE} at once): slowest wave's end, s", [r.map_s for r in runs])
    row("  slowest shard worker, s", [max(r.shard_walls, default=0.0) for r in runs])
    row(
        "  median shard worker, s",
        [sorted(r.shard_walls)[len(r.shard_walls) // 2] if r.shard_walls else 0 for r in runs],
    )
    row("gather, s", [r.gather_s for r in runs])
    row("total wall (planner + Map + gather), s", [r.wall_s for r in runs])
    row("  share of the 5-minute schedule", [100 * r.wall_s / SCHEDULE_S for r in runs], spec=",.0f", suffix="%")
    row("longest invocation, s", [r.longest_s for r in runs])
    row("  share of its timeout", [100 * r.longest_s / SWEEP_TIMEOUT_S for r in runs], spec=",.0f", suffix="%")
    row("AssumeRole calls: shard workers", [r.assume_workers for r in runs], spec=",.0f")
    row("AssumeRole calls: the planner's credential check", [r.assume_planner for r in runs], spec=",.0f")
    row("Organizations calls", [r.organizations_calls for r in runs], spec=",.0f")
    row("AssumeRole latency charged (serial sum), s", [r.assume_latency_s for r in runs])
    row("member clients made, CPU (serial sum), s", [r.client_cpu_s for r in runs])
    row("botocore's CPU (serialise, sign, parse, clients), s", [r.botocore_s for r in runs])
    ok = True
    for label, r in zip(LABELS, runs, strict=False):
        if r.wall_s > SCHEDULE_S:
            ok = False
            print(f"  MISSED sweep {label}: {r.wall_s:.0f} s > its {SCHEDULE_S:.0f} s schedule")
        if r.longest_s > SWEEP_TIMEOUT_S / 2:
            ok = False
            print(f"  MISSED sweep {label}: an invocation uses {r.longest_s / SWEEP_TIMEOUT_S:.0%} of its timeout")
        if r.deferred or r.units_failed:
            ok = False
            print(f"  MISSED sweep {label}: {r.deferred} units left, {r.units_failed} failed")
    print(
        f"  Lambda concurrency the hub needs: the Map's {SHARDS_AT_ONCE} shard workers + the planner (1, reserved; "
        f"its credential check overlaps the first wave) = {SHARDS_AT_ONCE + 1}; the gather step runs after the Map; "
        "the Slack function's reservation comes on top"
    )
    return ok


def print_comparison(n: int, seed: int, cpu: BotocoreCpu | None, clients: dict[str, float]) -> None:
    """n accounts with 1 machine each (one region) against n machines in one account (today's single-account
    sweep, in place), per machine; and the member case again with AssumeRole free, for its share."""
    member = run_organization(n, REGIONS[:1], 1, seed=seed, cpu=cpu, clients=clients)
    free = run_organization(n, REGIONS[:1], 1, seed=seed, cpu=cpu, clients=clients, assume_role_s=0.0)
    single = run_organization(0, REGIONS[:1], 1, seed=seed, cpu=cpu, clients=clients, hub_machines=n)
    print(f"\n== {n:,} accounts x 1 machine against {n:,} machines in one account (one region) ==")
    print(f"  {'':<{WIDTH}}" + "".join(f"{h:>12}" for h in LABELS))
    row(f"{n:,} machines in one account (swept in place), s", [r.wall_s for r in single])
    row(f"{n:,} accounts x 1 machine (fanned out), s", [r.wall_s for r in member])
    row("  of which the hourly account listing (planner), s", [r.planner_s for r in member])
    row("  the same with AssumeRole free, s", [r.wall_s for r in free])
    row("per machine: one account, ms", [1000 * r.wall_s / n for r in single], spec=",.2f")
    row("per machine: one account each, ms", [1000 * r.wall_s / n for r in member], spec=",.2f")
    row(
        "  of the difference, AssumeRole's, ms",
        [1000 * (m.wall_s - f.wall_s) / n for m, f in zip(member, free, strict=True)],
        spec=",.2f",
    )
    row(
        "  the rest (clients, listing, reads, state), ms",
        [1000 * (f.wall_s - s.wall_s) / n for f, s in zip(free, single, strict=True)],
        spec=",.2f",
    )
    row(
        "AssumeRole calls (workers + planner's check)",
        [r.assume_workers + r.assume_planner for r in member],
        spec=",.0f",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=1000)
    parser.add_argument("--regions", type=int, default=4, choices=range(1, len(REGIONS) + 1))
    parser.add_argument("--machines", type=int, default=50, help="machines in each (account, region)")
    parser.add_argument("--compare", type=int, default=1000, help="accounts of 1 machine against one account (0: skip)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-botocore", action="store_true", help="charge latency only, not botocore's CPU")
    parser.add_argument(
        "--split",
        choices=("auto", "known", "off"),
        nargs="+",
        default=["auto"],
        help="a unit of more than UNIT_PART_SIZE machines: in parts from the 2nd sweep (auto), from the 1st "
        "(known: its size remembered), never (off); several: each run in turn with the same botocore figures",
    )
    args = parser.parse_args(argv)
    print("idle-reaper organization sweep: the real planner, shard workers and gather over per-account fakes")
    cpu = measured_botocore(skip=args.no_botocore)
    clients = client_cpu_s()
    print(
        "a member unit's clients, CPU each (measured now): "
        + ", ".join(f"{s} {c * 1000:.1f} ms" for s, c in clients.items())
        + f" = {sum(clients.values()) * 1000:.0f} ms a unit"
    )
    regions = REGIONS[: args.regions]
    ok = True
    for split in args.split:
        started = time.perf_counter()
        runs = run_organization(
            args.accounts, regions, args.machines, seed=args.seed, cpu=cpu, clients=clients, split=split
        )
        if len(args.split) > 1:
            print(f"\n-- large account-regions in parts: {split}")
        ok &= print_organization(args.accounts, len(regions), args.machines, runs, time.perf_counter() - started)
    if args.compare:
        print_comparison(args.compare, args.seed, cpu, clients)
    print("\nOK: every target met" if ok else "\nMISSED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
