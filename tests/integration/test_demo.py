"""`idle-reaper demo` end to end, in a fresh process, as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def demo_output() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "idle_reaper_tools.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


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
    assert "released to its group" in summary_row(demo_output, "workers-1")
    total = re.search(r"total\s+([\d.]+)\s+\$([\d,.]+)", demo_output)
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
    total = re.search(r"total\s+([\d.]+)\s+(\$[\d,.]+)", demo_output)
    assert total and f"Saved: *{total.group(2)}* over {float(total.group(1)):.1f} machine-hours" in digests


def test_the_sagemaker_notebook_instance_is_warned_then_stopped_at_its_sagemaker_price(demo_output):
    row = summary_row(demo_output, "sm-notebook")
    assert "stopped at 14:30" in row and row.split()[-1] == "$9.56"  # 2.5 h at ml.p3.2xlarge's $3.825
    assert "sm-notebook was stopped at 2026-11-20 14:30 UTC; it saves $3.83/h" in demo_output
