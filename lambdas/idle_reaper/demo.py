"""`idle-reaper demo`: the real sweep against a local emulated AWS (moto, in-process) with a seeded
fleet, over a simulated afternoon. No AWS account needed."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from idle_reaper import local
from idle_reaper.core import Action, Decision, State
from idle_reaper.sweep import Adapters, SweepReport, run_sweep

DAY = datetime(2026, 11, 20, tzinfo=UTC)
START = DAY.replace(hour=12)
END = DAY.replace(hour=17)
SWEEP_EVERY = timedelta(minutes=15)


def at(hour: int, minute: int = 0) -> datetime:
    return DAY.replace(hour=hour, minute=minute)


def _steady(cpu: float, gpu: float | None) -> local.Profile:
    return lambda t: (cpu, gpu)


def _until(change: datetime, before: tuple[float, float | None], after: tuple[float, float | None]) -> local.Profile:
    return lambda t: before if t < change else after


@dataclass
class Box:
    name: str
    instance_type: str
    team: str
    profile: local.Profile
    launched: datetime = field(default_factory=lambda: at(8))
    owner: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    story: str = ""


FLEET = [
    Box(
        "gpu-train",
        "g5.xlarge",
        "ml",
        _steady(2.0, 90.0),
        owner="alice@example.com",
        story="training run: 2 % CPU, 90 % GPU",
    ),
    Box(
        "notebook",
        "g4dn.xlarge",
        "ml",
        _until(at(12), (40.0, 60.0), (1.0, 0.0)),
        owner="bob@example.com",
        story="notebook left idle after lunch",
    ),
    Box("cpu-box", "m5.large", "ml", _steady(55.0, None), owner="carol@example.com", story="busy CPU job"),
    Box(
        "exempt-box",
        "m5.large",
        "ml",
        _steady(1.0, None),
        owner="dave@example.com",
        tags={"idle-reaper:exempt": "true"},
        story="idle, but tagged exempt",
    ),
    Box(
        "young-box",
        "m5.large",
        "ml",
        _steady(1.0, None),
        launched=at(16, 50),
        owner="erin@example.com",
        story="started 10 minutes before the last sweep",
    ),
    Box(
        "research-box",
        "m5.large",
        "research",
        _steady(1.0, None),
        owner="frank@example.com",
        story="idle, but its team policy is invalid",
    ),
]
GROUP = "workers"
GROUP_PROFILES = [_steady(70.0, None), _steady(1.0, None)]  # one busy member, one idle
TEAM_POLICIES = {
    "ml": local.team_policy_json(idle_minutes=90, warn_minutes=30),
    "research": local.team_policy_json(idle_minutes=5),  # invalid: below the 15-minute minimum
}


@dataclass
class Seeded:
    ids: dict[str, str]  # name -> instance id
    names: dict[str, str]  # instance id -> name


def launch_due(seeded: Seeded, now: datetime) -> None:
    """Start the boxes whose launch time the simulated clock has reached, with their metrics."""
    for box in FLEET:
        if box.name not in seeded.ids and box.launched <= now:
            instance_id = local.launch(
                box.name,
                box.instance_type,
                team=box.team,
                launch_time=box.launched,
                owner=box.owner,
                extra_tags=box.tags,
            )
            seeded.ids[box.name], seeded.names[instance_id] = instance_id, box.name
            local.write_metrics(instance_id, box.profile, max(box.launched, at(6)), END)


def seed() -> Seeded:
    """Policies, the machines already running at the start, and their metrics for the whole day."""
    local.init_account(teams=TEAM_POLICIES)
    seeded = Seeded({}, {})
    launch_due(seeded, START)
    ids = seeded.ids
    members = local.launch_group(
        GROUP, "m5.large", team="ml", size=2, min_size=0, launch_time=at(8), owner="ops@example.com"
    )
    local.aws.client("autoscaling").set_instance_protection(
        AutoScalingGroupName=GROUP, InstanceIds=members, ProtectedFromScaleIn=True
    )
    for i, (instance_id, profile) in enumerate(zip(members, GROUP_PROFILES, strict=True)):
        ids[f"{GROUP}-{i}"] = instance_id
        seeded.names[instance_id] = f"{GROUP}-{i}"
        local.write_metrics(instance_id, profile, at(6), END)
    return seeded


def simulate(
    seeded: Seeded,
    adapters_factory: Callable[[], Adapters],
    on_sweep: Callable[[SweepReport], None] | None = None,
    start: datetime = START,
    end: datetime = END,
) -> list[SweepReport]:
    reports = []
    now = start
    while now <= end:
        launch_due(seeded, now)
        report = run_sweep(adapters_factory(), now=now)
        reports.append(report)
        if on_sweep:
            on_sweep(report)
        now += SWEEP_EVERY
    return reports


def _describe(d: Decision, name: str) -> str:
    verb = {
        Action.WARN: "WARNED",
        Action.STOP: "STOPPED",
        Action.HIBERNATE: "HIBERNATED",
        Action.PROTECT: "PROTECTED",
        Action.UNPROTECT: "RELEASED to its group",
        Action.TERMINATE: "TERMINATED",
    }.get(d.action, d.state.value)
    return f"  {name:<13} {verb:<22} {d.reason}"


def cmd_demo(args: argparse.Namespace) -> int:
    local.quiet_server_logs()
    t0 = time.perf_counter()
    print("idle-reaper demo: a local emulated AWS (moto) and the real sweep, over a simulated afternoon.\n")
    with local.local_aws():
        print("seeding: team policies in SSM, machines in EC2 and an Auto Scaling group, CPU/GPU metrics ...")
        seeded = seed()
        for box in FLEET:
            print(f"  {box.name:<13} {box.instance_type:<12} team={box.team:<9} {box.story}")
        print(f"  {GROUP}-0 / -1   m5.large x2  team=ml        Auto Scaling group: one busy member, one idle\n")
        last_state: dict[str, State] = {}
        total = int((END - START) / SWEEP_EVERY) + 1

        def show(report: SweepReport) -> None:
            changes = []
            for d in report.decisions:
                name = seeded.names.get(d.machine.instance_id, d.machine.instance_id)
                if d.action is not Action.NONE or last_state.get(name) != d.state:
                    changes.append(_describe(d, name))
                last_state[name] = d.state
            step = int((report.now - START) / SWEEP_EVERY) + 1
            print(
                f"[{step:>2}/{total}] {report.now:%H:%M} sweep: {len(report.decisions)} machines"
                + ("" if changes else ", nothing changed")
            )
            for line in changes:
                print(line)

        reports = simulate(seeded, Adapters.from_environment, show)
        print("\nsummary (simulated day ends at 17:00):")
        print(f"  {'machine':<13} {'what happened':<34} {'idle hours avoided':>18} {'saved':>9}")
        saved_total = 0.0
        for name, instance_id in seeded.ids.items():
            reaped = next(
                (
                    d
                    for r in reports
                    for d in r.decisions
                    if d.machine.instance_id == instance_id
                    and d.state is State.REAPED
                    and d.applied
                    and d.action is not Action.NONE
                ),
                None,
            )
            final = next(
                (d for r in reversed(reports) for d in r.decisions if d.machine.instance_id == instance_id), None
            )
            if reaped:
                hours = (END - reaped.record.updated_at).total_seconds() / 3600 if reaped.record.updated_at else 0
                dollars = hours * (reaped.hourly_cost or 0.0)
                saved_total += dollars
                what = f"{reaped.action.value} at {reaped.record.updated_at:%H:%M}" if reaped.record.updated_at else ""
                print(f"  {name:<13} {what:<34} {hours:>18.2f} {f'${dollars:,.2f}':>9}")
            else:
                what = final.state.value if final else "not seen"
                print(f"  {name:<13} {'left running (' + what + ')':<34} {0:>18.2f} {'$0.00':>9}")
        print(f"  {'total':<13} {'':<34} {'':>18} {f'${saved_total:,.2f}':>9}")
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    sys.stdout.flush()
    return 0
