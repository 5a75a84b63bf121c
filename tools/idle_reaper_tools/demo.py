"""`idle-reaper demo`: the whole loop with no AWS account and no Slack workspace.

moto (in server mode, in-process) stands in for AWS and a local fake for Slack's Web API; the sweep,
the Slack handler and the slack-sdk client are the real ones. A dozen machines run through a simulated
afternoon; a scripted owner answers one warning with a real signed request."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import cast

from aws_lambda_powertools.utilities.typing import LambdaContext

from idle_reaper import aws
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.core import Action, Decision, State
from idle_reaper.core.digest import week_of
from idle_reaper.core.dollars import saves_while_running
from idle_reaper.core.sections import kinds_said, usd
from idle_reaper.policy import Settings
from idle_reaper.slack import blocks_text, load_secrets, make_client
from idle_reaper.slack.digest import DigestSender
from idle_reaper.sweep import Adapters, SweepReport, run_sharded
from idle_reaper.sweep.digest import send_week_digests
from idle_reaper_tools import local, local_studio
from idle_reaper_tools.admin import cmd_status, status_rows
from idle_reaper_tools.fake_slack import (
    FakeSlack,
    LambdaContextStub,
    button_click,
    fake_slack,
    slack_environment,
)

DAY = datetime(2026, 11, 20, tzinfo=UTC)
START = DAY.replace(hour=12)
END = DAY.replace(hour=17)
SWEEP_EVERY = timedelta(minutes=15)
BRING_BACK_AT = DAY.replace(hour=16, minute=30)  # carol brings the deleted endpoint back after this sweep
SIGNING_SECRET = "demo-signing-secret"
ADMIN_CHANNEL = "C0ADMINS"


def at(hour: int, minute: int = 0) -> datetime:
    return DAY.replace(hour=hour, minute=minute)


def _steady(cpu: float, gpu: float | None) -> local.Profile:
    return lambda t: (cpu, gpu)


def _until(change: datetime, before: tuple[float, float | None], after: tuple[float, float | None]) -> local.Profile:
    return lambda t: before if t < change else after


def _requests(profile: local.Profile) -> Callable[[datetime], float]:
    """An endpoint's requests per 5 minutes: its profile's first value."""
    return lambda t: profile(t)[0]


@dataclass
class Box:
    name: str
    instance_type: str
    team: str
    profile: local.Profile
    owner: str
    story: str
    launched: datetime = field(default_factory=lambda: at(8))
    tags: dict[str, str] = field(default_factory=dict)
    hibernation: bool = False
    sagemaker: bool = False  # a SageMaker notebook instance (its metrics as the lifecycle configuration publishes)
    spot: bool = False  # a Spot instance of a persistent request that stops it
    reserved: bool = False  # runs in an On-Demand Capacity Reservation (local.reserve)
    endpoint: int = 0  # a SageMaker real-time endpoint of this many instances (its profile's CPU: requests per 5 min)
    studio: bool = False  # a Studio JupyterLab app in a space of this name (its metrics as a lifecycle config's agent)


FLEET = [
    Box("gpu-train", "g5.xlarge", "ml", _steady(2.0, 90.0), "alice@example.com", "training run: 2 % CPU, 90 % GPU"),
    Box(
        "notebook",
        "g4dn.xlarge",
        "ml",
        _until(at(12), (40.0, 60.0), (1.0, 0.0)),
        "bob@example.com",
        "notebook left idle after lunch",
    ),
    Box("forgotten", "g5.2xlarge", "ml", _steady(0.5, 0.0), "carol@example.com", "forgotten since the morning"),
    Box("cpu-box", "m5.large", "ml", _steady(55.0, None), "carol@example.com", "busy CPU job"),
    Box(
        "exempt-box",
        "m5.large",
        "ml",
        _steady(1.0, None),
        "dave@example.com",
        "idle, but tagged exempt",
        tags={"idle-reaper:exempt": "true"},
    ),
    Box(
        "young-box",
        "m5.large",
        "ml",
        _steady(1.0, None),
        "erin@example.com",
        "started 10 minutes before the last sweep",
        launched=at(16, 50),
    ),
    Box(
        "vision-train",
        "p3.2xlarge",
        "vision",
        _steady(3.0, 97.0),
        "grace@example.com",
        "overnight training still running: 3 % CPU, 97 % GPU",
    ),
    Box(
        "data-loader", "g5.xlarge", "vision", _steady(85.0, 0.0), "grace@example.com", "data loading: 85 % CPU, 0 % GPU"
    ),
    Box(
        "vision-nb",
        "g5.2xlarge",
        "vision",
        _until(at(12, 30), (30.0, 40.0), (1.0, 0.0)),
        "heidi@example.com",
        "notebook idle from 12:30, team policy hibernates",
        hibernation=True,
    ),
    Box(
        "research-box",
        "m5.large",
        "research",
        _steady(1.0, None),
        "frank@example.com",
        "idle, but its team policy is invalid",
    ),
    Box(
        "sm-notebook",
        "ml.p3.2xlarge",
        "ml",
        _until(at(13), (20.0, 50.0), (1.0, 0.0)),
        "bob@example.com",
        "SageMaker notebook instance idle from 13:00: stopped with StopNotebookInstance, its ML volume kept",
        sagemaker=True,
    ),
    Box(
        "demo-llm",
        "ml.g4dn.xlarge",
        "ml",
        _until(at(12), (40.0, None), (0.0, None)),
        "carol@example.com",
        "SageMaker endpoint (2 instances) idle since 12:00: deleted (its configuration kept), brought back at 16:30",
        launched=at(6),
        endpoint=2,
    ),
    Box(
        "lab-space",
        "ml.g4dn.xlarge",
        "vision",
        _until(at(13), (30.0, 45.0), (1.0, 0.0)),
        "heidi@example.com",
        "SageMaker Studio JupyterLab app idle from 13:00: deleted with DeleteApp, its space and storage kept",
        launched=at(9),
        studio=True,
    ),
    Box(
        "fleet-worker",
        "m5.large",
        "ml",
        _steady(1.0, None),
        "ivan@example.com",
        "idle member of an EC2 Fleet: never stopped (the fleet would replace it), reported",
        tags={"aws:ec2:fleet-id": "fleet-0demo"},
    ),
    Box(
        "spot-nb",
        "g5.xlarge",
        "ml",
        _until(at(13), (35.0, 50.0), (1.0, 0.0)),
        "judy@example.com",
        "Spot notebook idle from 13:00: a stop saves up to its on-demand price (Spot prices are not read)",
        spot=True,
    ),
    Box(
        "reserved-box",
        "g5.xlarge",
        "ml",
        _steady(1.0, 0.0),
        "ken@example.com",
        "idle in a capacity reservation: a stop saves nothing while the reservation is paid; told, not stopped",
        reserved=True,
    ),
]
SLACK_USERS = {
    "alice@example.com": "U0ALICE",
    "bob@example.com": "U0BOB",
    "carol@example.com": "U0CAROL",
    "dave@example.com": "U0DAVE",
    "erin@example.com": "U0ERIN",
    "frank@example.com": "U0FRANK",
    "grace@example.com": "U0GRACE",
    "heidi@example.com": "U0HEIDI",
    "ivan@example.com": "U0IVAN",
    "judy@example.com": "U0JUDY",
    "ken@example.com": "U0KEN",
    "ops@example.com": "U0OPS",
}
GROUP = "workers"
GROUP_PROFILES = [_steady(70.0, None), _steady(1.0, None)]  # one busy member, one idle
TEAM_POLICIES = {
    "ml": local.team_policy_json(idle_minutes=90, warn_minutes=30, slack_channel="C0MLTEAM", endpoint_idle_minutes=90),
    "vision": local.team_policy_json(
        idle_minutes=60, warn_minutes=15, action="hibernate", notify="owner", studio_apps="delete"
    ),
    "research": local.team_policy_json(idle_minutes=5),  # invalid: below the 15-minute minimum
}


@dataclass
class Seeded:
    ids: dict[str, str]  # name -> instance id
    names: dict[str, str]  # instance id -> name


def launch_due(seeded: Seeded, now: datetime) -> None:
    """Start the boxes whose launch time the simulated clock has reached, with their metrics."""
    for box in FLEET:
        if box.name not in seeded.ids and box.launched <= now and box.endpoint:
            launched, count = box.launched, box.endpoint
            name = local.launch_endpoint(
                box.name, box.instance_type, team=box.team, launch_time=launched, owner=box.owner, count=count
            )
            seeded.ids[box.name], seeded.names[f"endpoint:{name}"] = f"endpoint:{name}", box.name
            local.write_invocations(name, _requests(box.profile), max(box.launched, at(6)), END)
        elif box.name not in seeded.ids and box.launched <= now and box.studio:
            name = local_studio.launch_studio_app(
                box.name, box.instance_type, team=box.team, launch_time=box.launched, owner=box.owner
            )
            seeded.ids[box.name], seeded.names[name] = name, box.name
            local.write_metrics(name, box.profile, max(box.launched, at(6)), END, notebook=True)
        elif box.name not in seeded.ids and box.launched <= now and box.sagemaker:
            name = local.launch_notebook(
                box.name, box.instance_type, team=box.team, launch_time=box.launched, owner=box.owner
            )
            seeded.ids[box.name], seeded.names[name] = name, box.name
            local.write_metrics(name, box.profile, max(box.launched, at(6)), END, notebook=True)
        elif box.name not in seeded.ids and box.launched <= now and box.spot:
            instance_id, _ = local.launch_spot(
                box.name, box.instance_type, team=box.team, launch_time=box.launched, owner=box.owner
            )
            seeded.ids[box.name], seeded.names[instance_id] = instance_id, box.name
            local.write_metrics(instance_id, box.profile, max(box.launched, at(6)), END)
        elif box.name not in seeded.ids and box.launched <= now:
            instance_id = local.launch(
                box.name,
                box.instance_type,
                team=box.team,
                launch_time=box.launched,
                owner=box.owner,
                extra_tags=box.tags,
                hibernation=box.hibernation,
            )
            seeded.ids[box.name], seeded.names[instance_id] = instance_id, box.name
            if box.reserved:
                local.reserve(instance_id, created=DAY - timedelta(days=30))
            local.write_metrics(instance_id, box.profile, max(box.launched, at(6)), END)


def seed() -> Seeded:
    """Policies, the machines already running at the start, and their metrics for the whole day."""
    local.init_account(settings=Settings(admin_channel=ADMIN_CHANNEL), teams=TEAM_POLICIES)
    seeded = Seeded({}, {})
    launch_due(seeded, START)
    members = local.launch_group(
        GROUP, "m5.large", team="ml", size=2, min_size=0, launch_time=at(8), owner="ops@example.com"
    )
    local.aws.client("autoscaling").set_instance_protection(
        AutoScalingGroupName=GROUP, InstanceIds=members, ProtectedFromScaleIn=True
    )
    for i, (instance_id, profile) in enumerate(zip(members, GROUP_PROFILES, strict=True)):
        seeded.ids[f"{GROUP}-{i}"], seeded.names[instance_id] = instance_id, f"{GROUP}-{i}"
        local.write_metrics(instance_id, profile, at(6), END)
    return seeded


DEMO_SHARD_SIZE = 4  # a handful of shards, so the demo runs the fan-out the way a large fleet does


def adapters_at(now: datetime) -> Adapters:
    """The local adapters of a sweep at `now` (the simulated day): Slack's notifier tells that time too, so the
    references it writes (a week's) are read as they were written, not against the wall clock, whatever the
    date the demo runs on."""
    return Adapters.from_environment(clock=lambda: now)


def simulate(
    seeded: Seeded,
    adapters_factory: Callable[[datetime], Adapters],
    on_sweep: Callable[[SweepReport], None] | None = None,
    start: datetime = START,
    end: datetime = END,
) -> list[SweepReport]:
    reports = []
    now = start
    while now <= end:
        launch_due(seeded, now)
        # The planner, shard workers on threads and the gather step, as the state machine runs them.
        adapters = adapters_factory(now)
        report = run_sharded(adapters, now=now, shard_size=DEMO_SHARD_SIZE, workers=DEMO_SHARD_SIZE).merged()
        reports.append(report)
        if on_sweep:
            on_sweep(report)
        now += SWEEP_EVERY
    return reports


# ---------------------------------------------------------------------------------------------
# The scripted owner: a real signed Slack request, fed to the real Slack Lambda handler.


def click_keep(slack: FakeSlack, instance_id: str, user: str, now: datetime, action: str = "keep_2h") -> int:
    """Click "Keep 2 h" (or the button `action`: "start_again" is Bring it back) on the newest message about
    `instance_id` that has it, as Slack would send it."""
    from idle_reaper.handlers import slack as handler

    ref = next(
        e["value"]
        for c in reversed(slack.calls)
        if c.method in ("chat.postMessage", "chat.update") and instance_id in c.params.get("text", "")
        for b in c.params.get("blocks") or []
        if b["type"] == "actions"
        for e in b["elements"]
        if e.get("action_id") == action
    )
    real_clock = handler.clock
    handler.clock = lambda: now  # the handler runs on the simulated clock
    try:
        event = button_click(user, action, ref, slack.response_url(f"click-{instance_id}"), SIGNING_SECRET)
        response = handler.handler(event, cast(LambdaContext, LambdaContextStub()))
    finally:
        handler.clock = real_clock
    return int(response["statusCode"])


# ---------------------------------------------------------------------------------------------
# Output


_VERBS = {
    Action.WARN: "WARNED",
    Action.STOP: "STOPPED",
    Action.HIBERNATE: "HIBERNATED",
    Action.PROTECT: "PROTECTED",
    Action.UNPROTECT: "RELEASED to its group",
    Action.TERMINATE: "TERMINATED",
}


def _verb(d: Decision) -> str:
    return "DELETED" if d.machine.deleted_by_stop and d.action is Action.STOP else _VERBS.get(d.action, d.state.value)


def _describe(d: Decision, name: str) -> str:
    return f"  {name:<13} {_verb(d):<22} {d.reason}"


class Timeline:
    def __init__(self, seeded: Seeded, slack: FakeSlack, out: Callable[[str], None]) -> None:
        self.seeded, self.slack, self.out = seeded, slack, out
        self.last_state: dict[str, State] = {}
        self.shown = 0
        self.total = int((END - START) / SWEEP_EVERY) + 1
        self.clicked = False
        self.brought_back: dict[str, datetime] = {}  # name -> when its owner clicked Bring it back

    def slack_messages(self) -> None:
        for call in self.slack.calls[self.shown :]:
            if call.method in ("chat.postMessage", "chat.update") and call.params.get("blocks"):
                verb = "posts to" if call.method == "chat.postMessage" else "updates in"
                body = blocks_text(call.params["blocks"]).replace("\n", "\n      | ")
                self.out(f"    Slack {verb} {call.params.get('channel')}:\n      | {body}")
        self.shown = len(self.slack.calls)

    def __call__(self, report: SweepReport) -> None:
        changes = []
        # Shards report in their own order; the story follows the fleet's.
        order = {instance_id: i for i, instance_id in enumerate(self.seeded.ids.values())}
        for d in sorted(report.decisions, key=lambda d: order.get(d.machine.instance_id, len(order))):
            name = self.seeded.names.get(d.machine.instance_id, d.machine.instance_id)
            if d.action is not Action.NONE or self.last_state.get(name) != d.state:
                changes.append(_describe(d, name))
            self.last_state[name] = d.state
        step = int((report.now - START) / SWEEP_EVERY) + 1
        self.out(
            f"[{step:>2}/{self.total}] {report.now:%H:%M} sweep of {len(report.decisions)} "
            + kinds_said(d.machine.key for d in report.decisions)[0]  # machines, endpoints and Studio apps
            + ("" if changes else ": nothing changed")
        )
        for line in changes:
            self.out(line)
        self.slack_messages()
        notebook = self.seeded.ids["notebook"]
        warned = any(d.machine.instance_id == notebook and d.action is Action.WARN for d in report.decisions)
        if warned and not self.clicked:
            self.clicked = True
            status = click_keep(self.slack, notebook, "U0BOB", report.now)
            self.out(f"  bob clicks [Keep 2 h] in Slack (a signed request to the Slack handler: HTTP {status})")
            self.slack_messages()
        if report.now == BRING_BACK_AT:  # the deleted endpoint: CreateEndpoint now, InService by the next sweep
            status = click_keep(self.slack, self.seeded.ids["demo-llm"], "U0CAROL", report.now, "start_again")
            local.set_endpoint("demo-llm", launch_time=report.now)  # moto dates it by the wall clock
            self.brought_back["demo-llm"] = report.now
            self.out(f"  carol clicks [Bring it back] in Slack (HTTP {status}): SageMaker creates demo-llm again")
            self.slack_messages()


Row = tuple[str, str, float, float, bool]  # machine, what happened, idle hours avoided, dollars saved, "up to"


def summary(seeded: Seeded, reports: list[SweepReport], back: Mapping[str, datetime] | None = None) -> list[Row]:
    """Per machine: what happened, idle hours avoided until the end of the day (or until it was brought back:
    `back`, by name), dollars saved (the most it can be, for a Spot machine: "up to")."""
    rows, back = [], back or {}
    for name, instance_id in seeded.ids.items():
        steps = [d for r in reports for d in r.decisions if d.machine.instance_id == instance_id]
        reaped = next((d for d in steps if d.state is State.REAPED and d.applied and d.action is not Action.NONE), None)
        if reaped and reaped.record.updated_at:
            hours = (back.get(name, END) - reaped.record.updated_at).total_seconds() / 3600
            what = f"{_verb(reaped).lower()} at {reaped.record.updated_at:%H:%M}"
            if name in back:
                what += f", brought back at {back[name]:%H:%M}"
            snoozes = sum(1 for d in steps if d.state is State.SNOOZED)
            if snoozes:
                what += " (after a 2 h keep)"
            # What the stop saves (nothing for reserved capacity), never the machine's price; a group member the
            # group kept running saves nothing yet, neither hours nor dollars (core/dollars.py, as the digest).
            saved = reaped.saving.hourly if reaped.saving and reaped.saving.hourly is not None else 0.0
            bound = bool(reaped.saving and reaped.saving.upper_bound and saved)
            if not saves_while_running(reaped.action) and any(
                d.machine.instance_id == instance_id for d in reports[-1].decisions
            ):
                what += ", still running"
                hours = saved = 0.0
                bound = False
            rows.append((name, what, hours, hours * saved, bound))
        else:
            final = steps[-1].state.value if steps else "not seen"
            rows.append((name, f"left running ({final})", 0.0, 0.0, False))
    return rows


def stop_saves(seeded: Seeded) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Per machine: its kind and what a stop of it saves an hour, as `idle-reaper status` shows them (its rows,
    from the records the sweeps left): on-demand its price, Spot at most its price, reserved capacity nothing.
    And the tables `idle-reaper status` itself prints (run here, at 17:00) for the kinds that are not machines
    (endpoints, Studio apps: core/sections.py), after its machines' table."""
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    rows = {r["instance_id"]: r for r in status_rows(store.all_records(), {}, None, Settings(), END)}
    kinds = [(name, rows[i]["kind"] or "-", rows[i]["stop_saves"]) for name, i in seeded.ids.items() if i in rows]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cmd_status(argparse.Namespace(now=END, team=None, owner=None, json=False))
    # After the machines' table, a table per other kind under its label and count ("Studio apps (1):").
    others = [
        p for p in printed.getvalue().split("\n\n")[1:] if re.fullmatch(r"[A-Z][a-z A-Z]+ \(\d+\):", p.split("\n")[0])
    ]
    return kinds, [line for part in others for line in ["", *part.splitlines()]]


def weekly_digests(slack: FakeSlack) -> list[str]:
    """The weekly digest of the simulated day's week (as of its end), sent to each team and the admins through
    the real sender and slack-sdk's upload flow, as the hourly digest function would on Monday: what the fake
    Slack received, one block of lines per channel message."""
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    policies = aws.PolicyStore(aws.client("ssm"), aws.ssm_prefix())
    sender = DigestSender(make_client(load_secrets().bot_token, 30.0))
    lines = []
    metrics = MetricsReader(aws.client("cloudwatch"))  # the exempt machine's week: did it sit idle?
    for o in send_week_digests(store, policies, sender, week_of(END), END, metrics=metrics):
        where = f"{o.channel}" + (" (the admin channel: the team has no channel)" if o.redirected else "")
        head = f"weekly digest: {'all teams (admins)' if o.destination == 'admins' else 'team ' + o.destination},"
        message = next((m for m in slack.messages_in(o.channel or "") if head in m.get("text", "")), {})
        chart = ""
        if message.get("files"):
            upload = slack.files[message["files"][0]]
            chart = f", with its chart {upload['filename']} ({len(upload['data']):,} bytes of PNG)"
        lines.append(f"  {o.destination} -> {where}{chart}{': ' + o.error if o.error else ''}")
        lines += [f"      | {line}" for line in str(message.get("text", "")).splitlines()]
    return lines


@dataclass
class Afternoon:
    """What the demo's afternoon left behind: the machines, every sweep's report, the summary's rows and the
    digests as Slack received them. The emulated world (moto's backends, this process's) stays as the afternoon
    ended until the next reset."""

    seeded: Seeded
    reports: list[SweepReport]
    rows: list[Row]


def play(out: Callable[[str], None]) -> Afternoon:
    """The whole demo, told line by line through `out`."""
    local.quiet_server_logs()
    t0 = time.perf_counter()
    out("idle-reaper demo: emulated AWS (moto) + a local Slack fake; the real sweep, Slack handler and client.\n")
    with local.local_aws() as aws, fake_slack() as slack, slack_environment(slack, SIGNING_SECRET):
        aws.reset()
        slack.users_by_email.update(SLACK_USERS)
        out("seeding team policies (SSM), machines and an Auto Scaling group (EC2), CPU/GPU metrics (CloudWatch):")
        seeded = seed()
        for box in FLEET:
            out(f"  {box.name:<13} {box.instance_type:<12} team={box.team:<9} {box.story}")
        out(f"  {GROUP}-0, -1   m5.large x2  team=ml        an Auto Scaling group: one busy member, one idle\n")
        timeline = Timeline(seeded, slack, out)
        reports = simulate(seeded, adapters_at, timeline)
        rows = summary(seeded, reports, timeline.brought_back)
        kinds, sections = stop_saves(seeded)
        digests = weekly_digests(slack)
    out("\nsummary (the simulated day ends at 17:00):")
    out(f"  {'name':<13} {'what happened':<46} {'idle hours avoided':>18} {'saved':>15}")
    for name, what, hours, dollars, bound in rows:
        out(f"  {name:<13} {what:<46} {hours:>18.2f} {usd(dollars, bound):>15}")
    total = usd(sum(r[3] for r in rows), any(r[4] for r in rows))
    out(f"  {'total':<13} {'':<46} {sum(r[2] for r in rows):>18.2f} {total:>15}")
    out("  (up to: a Spot machine's saving at the most it can be: idle-reaper does not read Spot prices)")
    out("\nwhat a stop (or a deletion) saves, by kind (`idle-reaper status`'s KIND and STOP SAVES, as of 17:00):")
    for name, kind, saves in kinds:
        out(f"  {name:<13} {kind:<22} {saves}")
    out("\nthe endpoints and Studio apps apart, as `idle-reaper status` shows them after its machines:")
    for line in sections[1:]:
        out(f"  {line}" if line else "")
    out(
        f"\ndone in {time.perf_counter() - t0:.1f} s: {len(reports)} sweeps, "
        f"{sum(len(r.decisions) for r in reports)} decisions, no training run touched."
    )
    out(f"\nthe weekly digest of {week_of(END).label} so far (as of {END:%a %H:%M}), as Slack received it:")
    for line in digests:
        out(line)
    return Afternoon(seeded, reports, rows)


def cmd_demo(args: argparse.Namespace) -> int:
    play(lambda line: print(line, flush=True))
    sys.stdout.flush()
    return 0
