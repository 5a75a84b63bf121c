"""`idle-reaper demo` end to end, and the afternoon scenario that must hold, read from one run of the demo.

The demo runs once for the module, in this process, as `idle-reaper demo` runs it (`demo.play`, the command's
whole body): against moto in server mode and the local Slack, with the real sweep, Slack handler and client.
Its text is what a user reads; its reports and the world it leaves (read before anything resets moto) are what
the scenario's tests check.

One thing differs: the pacers (aws/limits.py) and AWS's buckets in front of moto (aws_rules.py) read one virtual
clock, as in test_pacing.py. Every wait is computed and every bucket kept as on the wall clock, but a wait moves
that clock instead of sleeping: the simulated afternoon's sweeps waited about 6 s for EC2's Describe* buckets
(shards share their refill after the planner's listing), which the run's wall clock said nothing about."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import pytest

from idle_reaper.core import Action, State
from idle_reaper.handlers import slack as slack_handler
from idle_reaper.pricing import hourly_price
from idle_reaper.sweep import Adapters
from idle_reaper_tools import demo, local
from idle_reaper_tools.aws_rules import AwsRules
from testkit.virtual_clock import virtual_pacing

pytestmark = pytest.mark.integration


@dataclass
class Run:
    output: str
    afternoon: demo.Afternoon
    instance_states: dict[str, str]  # as the afternoon left them
    protection: dict[str, bool]
    audit: dict[str, list[dict[str, Any]]]  # instance id -> its recorded actions
    throttled: int  # calls AWS's buckets refused (aws_rules.py)


@pytest.fixture(scope="module")
def run(moto_server: Any) -> Run:
    lines: list[str] = []
    slack_handler.reset_clients()
    rules: list[AwsRules] = []

    def rules_on(clock: list[float]) -> AwsRules:  # the rules of the demo's own moto (local.local_aws makes them)
        rules.append(AwsRules(clock=lambda: clock[0]))
        return rules[-1]

    with virtual_pacing() as clock, pytest.MonkeyPatch.context() as patch:
        patch.setattr(local, "AwsRules", lambda: rules_on(clock))
        afternoon = demo.play(lines.append)
    slack_handler.reset_clients()  # the demo's Slack clicks made clients for its own moto endpoint, now gone
    ids = list(afternoon.seeded.ids.values())
    store = Adapters.from_environment().store
    return Run(
        output="\n".join(lines) + "\n",
        afternoon=afternoon,
        instance_states=local.instance_states([i for i in ids if i.startswith("i-")]),
        protection=local.protection(demo.GROUP),
        audit={i: store.history(i) for i in ids},  # type: ignore[attr-defined]
        throttled=sum(r.throttles() for r in rules),
    )


@pytest.fixture(scope="module")
def demo_output(run: Run) -> str:
    return run.output


def test_the_afternoon_keeps_within_aws_rates(run):
    """The pacers kept every call inside AWS's buckets: none refused (on their shared virtual clock, see above)."""
    assert run.throttled == 0


def summary_row(output: str, name: str) -> str:
    rows = output.split("summary (")[1].splitlines()
    return next(r for r in rows if r.split() and r.split()[0] == name)


@pytest.mark.parametrize("name", ["gpu-train", "vision-train", "data-loader", "cpu-box", "workers-0"])
def test_busy_machines_are_left_running(demo_output, name):
    assert "left running (active)" in summary_row(demo_output, name)


@pytest.mark.parametrize(
    "name,state",
    [("exempt-box", "exempt"), ("research-box", "safe_mode"), ("young-box", "unknown"), ("fleet-worker", "warned")],
)
def test_untouchable_machines_are_left_running(demo_output, name, state):
    assert f"left running ({state})" in summary_row(demo_output, name)


def test_a_fleet_member_is_told_not_stopped_and_saves_nothing(demo_output):
    assert "idle-reaper cannot stop it: it is a member of EC2 Fleet fleet-0demo" in demo_output
    assert summary_row(demo_output, "fleet-worker").split()[-1] in ("$0.00", "0.00")


def test_scripted_keep_click_goes_through_the_signed_handler_and_delays_the_stop(demo_output):
    assert "bob clicks [Keep 2 h] in Slack (a signed request to the Slack handler: HTTP 200)" in demo_output
    assert "<@U0BOB> kept notebook" in demo_output
    assert "stopped at 15:30 (after a 2 h keep)" in summary_row(demo_output, "notebook")


def test_idle_machines_are_reaped_and_savings_reported(demo_output):
    assert "stopped at 12:30" in summary_row(demo_output, "forgotten")
    assert "hibernated at 13:30" in summary_row(demo_output, "vision-nb")
    # Released, and its group keeps it running: no idle hour avoided, nothing saved (core/dollars.py), as the digest.
    released = summary_row(demo_output, "workers-1")
    assert "released to its group" in released and released.split()[-2:] == ["0.00", "$0.00"]
    total = re.search(r"total\s+([\d.]+)\s+up to \$([\d,.]+)", demo_output)  # a Spot machine's stop is in it
    assert total and float(total.group(1)) > 10 and float(total.group(2).replace(",", "")) > 10


def test_slack_messages_are_rendered_and_the_demo_says_how_long_it_took(demo_output):
    assert "Why it counts as idle:" in demo_output and "[Keep 2 h]" in demo_output and "[Start it again]" in demo_output
    # How long, not a limit: speed is a benchmark's to judge, and a loaded machine is no failure of the demo.
    assert float(re.search(r"done in ([\d.]+) s", demo_output).group(1)) > 0


def test_the_demo_ends_with_each_destinations_weekly_digest_with_its_chart(demo_output):
    digests = demo_output.split("the weekly digest of 2026-W47")[1]
    sent = re.findall(r"^  (\w+) -> (C\w+)(.*), with its chart (\S+\.png)", digests, re.M)
    assert sorted((dest, channel, chart) for dest, channel, _, chart in sent) == [
        ("admins", "C0ADMINS", "idle-reaper-admins-2026-W47.png"),
        ("ml", "C0MLTEAM", "idle-reaper-ml-2026-W47.png"),
        ("research", "C0ADMINS", "idle-reaper-research-2026-W47.png"),
        ("vision", "C0ADMINS", "idle-reaper-vision-2026-W47.png"),
    ]
    assert "Team vision has no slack_channel" in digests and "team research, 2026-W47" in digests
    # The admins' figure is the day's total of the summary above: the same stops, counted once.
    total = re.search(r"total\s+([\d.]+)\s+(up to \$[\d,.]+)", demo_output)
    assert total and f"Saved: *{total.group(2)}* over {float(total.group(1)):.1f} hours stopped or deleted" in digests


def test_the_sagemaker_notebook_instance_is_warned_then_stopped_at_its_sagemaker_price(demo_output):
    row = summary_row(demo_output, "sm-notebook")
    assert "stopped at 14:30" in row and row.split()[-1] == "$9.56"  # 2.5 h at ml.p3.2xlarge's $3.825
    assert "sm-notebook was stopped at 2026-11-20 14:30 UTC; it saves $3.83/h" in demo_output


def kind_row(output: str, name: str) -> list[str]:
    """A machine's line of the demo's `status` section: its name, kind and what a stop saves."""
    rows = output.split("what a stop (or a deletion) saves, by kind")[1].split("\n\n")[0].splitlines()[1:]
    return next(r.split(None, 2) for r in rows if r.split()[0] == name)


def test_a_spot_machine_is_stopped_and_its_saving_is_said_as_an_upper_bound(run: Run, demo_output: str) -> None:
    """Issue 44: beside the on-demand machines, a Spot machine (a persistent request that stops it) is stopped like
    them, and what its stop saves is the most it can be: "at most" in Slack and `status`, "up to" in the summary."""
    price = hourly_price("g5.xlarge")
    assert price is not None
    row = summary_row(demo_output, "spot-nb")
    assert "stopped at 14:30" in row and row.endswith(f"up to ${2.5 * price:,.2f}")
    stopped = f"spot-nb ({run.afternoon.seeded.ids['spot-nb']}) was stopped at 2026-11-20 14:30 UTC"
    assert f"{stopped}; it saves at most ${price:,.2f}/h while stopped" in demo_output
    assert kind_row(demo_output, "spot-nb") == ["spot-nb", "spot", f"at most ${price:,.2f}/h"]
    assert kind_row(demo_output, "forgotten") == ["forgotten", "on-demand", f"${hourly_price('g5.2xlarge'):,.2f}/h"]
    assert run.instance_states[run.afternoon.seeded.ids["spot-nb"]] == "stopped"


def test_a_reserved_machine_is_told_not_stopped_and_saves_nothing(run: Run, demo_output: str) -> None:
    """Issue 44: a machine in an On-Demand Capacity Reservation, idle all day, is told to its owner (and its team's
    channel) and never stopped: a stop saves nothing while the reservation is paid ($0 in `status` and the summary).
    The reservation is the local world's (local.reserve): DescribeCapacityReservations answered in moto's server."""
    instance_id = run.afternoon.seeded.ids["reserved-box"]
    assert summary_row(demo_output, "reserved-box").split()[-3:] == ["(warned)", "0.00", "$0.00"]
    assert kind_row(demo_output, "reserved-box") == ["reserved-box", "capacity-reservation", "$0.00/h"]
    told = "Slack posts to D0KEN:\n      | Idle machine: reserved-box"
    assert told in demo_output and "so idle-reaper does not stop it (a stop would save nothing)" in demo_output
    assert [e["action"] for e in run.audit[instance_id]] == ["warn"]
    assert run.instance_states[instance_id] == "running"


def test_the_idle_endpoint_is_warned_with_its_hourly_cost_then_deleted_and_its_configuration_kept(demo_output):
    row = summary_row(demo_output, "demo-llm")
    # Deleted 13:30 to 16:30: 3 h at 2 x ml.g4dn.xlarge's $0.7364.
    assert "deleted at 13:30, brought back at 16:30" in row and row.split()[-2:] == ["3.00", "$4.42"]
    assert "Idle endpoint: demo-llm" in demo_output and "*Cost*: $1.47 per hour" in demo_output
    assert "demo-llm (endpoint:demo-llm) was deleted at 2026-11-20 13:30 UTC; it saves $1.47/h" in demo_output
    assert "[Bring it back]" in demo_output and "--endpoint-config-name demo-llm-config" in demo_output


def test_the_deleted_endpoint_is_brought_back_from_slack_and_in_service_at_the_next_sweep(run, demo_output):
    """Carol clicks Bring it back (the signed Slack handler: CreateEndpoint from its configuration); the next sweep
    finds it InService and says so; the digest has it in the endpoints' own line, with what deleting it saved."""
    clicked, later = demo_output.split("carol clicks [Bring it back] in Slack (HTTP 200)")
    assert "[19/21] 16:30 sweep" in clicked.rstrip().splitlines()[-1]
    back, after = later.split("[20/21] 16:45 sweep")
    assert "*Being brought back*" in back and "*Back in service*" not in back
    assert "*Back in service*" in after.split("[21/21]")[0]
    assert "is InService again since 2026-11-20 16:45 UTC" in after
    assert local.endpoint_statuses(["demo-llm"]) == {"demo-llm": "InService"}
    [digest] = [line for line in demo_output.splitlines() if "team ml, 2026-W47" in line]
    ml = "\n".join(
        itertools.takewhile(lambda line: line.startswith("      |"), demo_output.split(digest)[1].splitlines()[1:])
    )
    assert "Endpoints (1): deleted ones saved $4.42 (3.0 h this week). demo-llm (ml, ml.g4dn.xlarge x2, $1.47/h)" in ml
    assert "saved $4.42 (3.0 h deleted)" in ml and "of it, endpoints $4.42" in ml


def test_the_idle_studio_app_is_warned_with_its_hourly_cost_then_deleted_and_its_space_kept(run: Run, demo_output):
    row = summary_row(demo_output, "lab-space")
    assert "deleted at 14:00" in row and row.split()[-1] == "$2.21"  # 3 h at ml.g4dn.xlarge's $0.7364
    assert "Idle Studio app: lab-space" in demo_output and "*Cost*: $0.74 per hour" in demo_output
    assert "lab-space (studio:d-local-studio:lab-space:JupyterLab:default) was deleted at 2026-11-20 14:00 UTC" in (
        demo_output
    )
    assert "--space-name lab-space --app-type JupyterLab" in demo_output
    assert kind_row(demo_output, "lab-space") == ["lab-space", "studio-app", "$0.74/h"]
    assert [e["action"] for e in run.audit[run.afternoon.seeded.ids["lab-space"]]] == ["warn", "stop"]
    # The weekly digest has Studio apps in their own line, as endpoints (core/sections.py: a kind by its words).
    assert "Studio apps (1): deleted ones saved $2.21 (3.0 h this week). lab-space (vision" in demo_output
    # Its deletion saved what the one rule says (its instance's price x the hours deleted), counted as a deletion.
    assert "Saved: *$6.45* over 6.5 hours stopped or deleted: 1 deletions (3.0 h, $2.21), 1 hibernations" in demo_output
    assert "of it, Studio apps $2.21 (each kind's own line below)" in demo_output
    # Each sweep's line counts what it swept by kind: the app and the endpoint are not machines.
    assert "[ 1/21] 12:00 sweep of 17 machines, endpoints and Studio apps" in demo_output
    assert "[ 8/21] 13:45 sweep of 14 machines and Studio apps" in demo_output  # the endpoint deleted at 13:30
    # `idle-reaper status` (run by the demo at 17:00) shows it in a table of its own, after the endpoints'.
    status = demo_output.split("as `idle-reaper status` shows them after its machines:")[1].split("\n\ndone in")[0]
    endpoints, apps = status.strip("\n").split("\n\n")
    assert endpoints.strip().startswith("Endpoints (1):") and "endpoint:demo-llm" in endpoints
    [app] = [line for line in apps.splitlines() if "lab-space" in line]
    assert (
        apps.strip().startswith("Studio apps (1):") and "ml.g4dn.xlarge  $0.74/h  deleted since 2026-11-20 14:00" in app
    )


# --- The afternoon scenario, from the same run's reports and the world it left ------------------------------


def history(run: Run, name: str) -> list[tuple[Any, Any]]:
    instance_id = run.afternoon.seeded.ids[name]
    return [(r.now, d) for r in run.afternoon.reports for d in r.decisions if d.machine.instance_id == instance_id]


def test_gpu_training_box_with_low_cpu_is_never_warned_or_stopped(run: Run) -> None:
    steps = history(run, "gpu-train")
    assert len(steps) == len(run.afternoon.reports)
    assert all(d.action is Action.NONE and d.state is State.ACTIVE for _, d in steps)
    assert run.instance_states[run.afternoon.seeded.ids["gpu-train"]] == "running"


@pytest.mark.parametrize(
    "name,idle_from,warn_minutes,window,stop",
    [
        ("forgotten", demo.at(8), 30, 90, Action.STOP),  # idle since it started
        ("vision-nb", demo.at(12, 30), 15, 60, Action.HIBERNATE),  # the vision team's policy hibernates
        ("sm-notebook", demo.at(13), 30, 90, Action.STOP),  # a SageMaker notebook instance
    ],
)
def test_an_idle_machine_is_warned_then_stopped_after_the_warning_period_and_a_full_idle_window(
    run: Run, name: str, idle_from: Any, warn_minutes: int, window: int, stop: Action
) -> None:
    actions = [(now, d.action) for now, d in history(run, name) if d.action is not Action.NONE]
    assert [a for _, a in actions] == [Action.WARN, stop]
    (warned_at, _), (stopped_at, _) = actions
    assert (stopped_at - warned_at).total_seconds() >= warn_minutes * 60
    assert (stopped_at - idle_from).total_seconds() >= window * 60, "stopped before a full idle window"
    if name != "sm-notebook":  # a notebook instance's state is SageMaker's, checked by the demo's own lines
        assert run.instance_states[run.afternoon.seeded.ids[name]] == "stopped"


def test_a_kept_notebook_is_warned_again_when_the_keep_ends_and_stopped_a_warning_period_later(run: Run) -> None:
    """bob clicks Keep 2 h on the first warning (13:00): no stop until 15:00, a new warning then, the stop at
    15:30; the click, both warnings and the stop are in the machine's record."""
    actions = [(now, d.action) for now, d in history(run, "notebook") if d.action is not Action.NONE]
    assert [(now.strftime("%H:%M"), a) for now, a in actions] == [
        ("13:00", Action.WARN),
        ("15:00", Action.WARN),
        ("15:30", Action.STOP),
    ]
    assert run.instance_states[run.afternoon.seeded.ids["notebook"]] == "stopped"


def test_idle_asg_member_loses_protection_and_is_not_stopped(run: Run) -> None:
    busy, idle = run.afternoon.seeded.ids["workers-0"], run.afternoon.seeded.ids["workers-1"]
    assert run.protection == {busy: True, idle: False}
    assert run.instance_states[busy] == run.instance_states[idle] == "running"
    idle_actions = [d.action for _, d in history(run, "workers-1") if d.action is not Action.NONE]
    assert idle_actions == [Action.WARN, Action.UNPROTECT]


@pytest.mark.parametrize("name,state", [("exempt-box", State.EXEMPT), ("research-box", State.SAFE_MODE)])
def test_exempt_box_and_invalid_policy_box_are_untouched(run: Run, name: str, state: State) -> None:
    steps = history(run, name)
    assert steps and all(d.state is state and d.action is Action.NONE for _, d in steps)
    assert run.instance_states[run.afternoon.seeded.ids[name]] == "running"


def test_invalid_policy_error_names_parameter_and_field(run: Run) -> None:
    _, d = history(run, "research-box")[0]
    assert "/idle-reaper/teams/research" in d.reason and "idle_minutes" in d.reason


def test_ten_minute_old_box_is_untouched(run: Run) -> None:
    steps = history(run, "young-box")
    assert [now for now, _ in steps] == [demo.at(17)]
    _, d = steps[0]
    assert d.state is State.UNKNOWN and d.action is Action.NONE and "started 10 min ago" in d.reason
    assert run.instance_states[run.afternoon.seeded.ids["young-box"]] == "running"


def test_every_action_is_audited_with_its_policy_version(run: Run) -> None:
    entries = run.audit[run.afternoon.seeded.ids["forgotten"]]
    assert [e["action"] for e in entries] == ["warn", "stop"]
    assert all(e["policy"] == "/idle-reaper/teams/ml@v1" for e in entries)
    assert entries[1]["max_gpu"] == 0.0 and entries[1]["window_minutes"] == 90
    # The kept notebook's record says who kept it and until when, and its stop names the keep it followed.
    kept = run.audit[run.afternoon.seeded.ids["notebook"]]
    assert sorted(e["action"] for e in kept) == ["keep", "stop", "warn", "warn"]
    keep = next(e for e in kept if e["action"] == "keep")
    stop = next(e for e in kept if e["action"] == "stop")
    assert keep["by"] == "U0BOB" and keep["snoozed_until"] == "2026-11-20T15:00:00+00:00"
    assert stop["snoozed_by"] == "U0BOB" and stop["policy"] == "/idle-reaper/teams/ml@v1"
