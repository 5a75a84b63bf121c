"""`/idle-reaper status` in Slack groups a person's resources by kind as the CLI's `status` does (issue 46):
machines, then endpoints, then Studio apps, each with where it stands in words (core/sections.py) and what its
instances cost an hour; and however many there are, the reply stays one message within its length, every kind
shown. Pure: records in, text out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from idle_reaper.core.records import MachineRecord, State
from idle_reaper.core.sections import state_words
from idle_reaper.slack.answers import DOCTOR_REPLY_CHARS, status_reply

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
APP = "studio:d-1:lab:JupyterLab:default"


def _units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def test_each_kind_has_its_own_section_with_its_state_in_words_and_its_hourly_cost() -> None:
    records = [
        MachineRecord(
            APP, "vision", State.UNKNOWN, name="lab", reason="unknown: no metrics", instance_type="ml.g4dn.xlarge"
        ),
        MachineRecord(
            "endpoint:demo-llm",
            "ml",
            State.WARNED,
            name="demo-llm",
            reason="quiet",
            instance_type="ml.g4dn.xlarge x2",
            stop_not_before=NOW + timedelta(minutes=30),
        ),
        MachineRecord(
            "i-0old",
            "ml",
            State.REAPED,
            name="old",
            reason="idle past its window: hibernate",
            instance_type="g5.xlarge",
            last_action="hibernate",
            last_action_at=NOW - timedelta(hours=1),
        ),
    ]
    text = status_reply(records, now=NOW).text
    machines, endpoints, apps = text.split("\n\n")
    assert machines.splitlines() == [
        "*Machines* (1):",
        "• old (i-0old) · ml · g5.xlarge, $1.01/h · *hibernated since 2026-11-20 14:00 UTC*: idle past its window: "
        "hibernate",
    ]
    assert endpoints.splitlines() == [
        "*Endpoints* (1):",
        "• demo-llm (endpoint:demo-llm) · ml · ml.g4dn.xlarge x2, $1.47/h · *warned: deleted at 2026-11-20 15:30 UTC "
        "unless someone keeps it*: quiet",
    ]
    assert apps.splitlines() == [
        "*Studio apps* (1):",
        f"• lab ({APP}) · vision · ml.g4dn.xlarge, $0.74/h · *unknown: no metrics; never deleted while unknown*",
    ]


def test_a_stopped_machine_is_said_stopped_not_as_an_endpoint_with_nothing_kept() -> None:
    """state_words spoke of a deleted endpoint's configuration for any record without one: a stopped EC2 machine
    read "stopped since ...; nothing kept to recreate it"."""
    at = NOW - timedelta(hours=2)
    stopped = MachineRecord("i-1", "ml", State.REAPED, last_action="stop", last_action_at=at)
    released = MachineRecord("i-2", "ml", State.REAPED, last_action="unprotect", last_action_at=at, asg_name="g")
    gone = MachineRecord("endpoint:x", "ml", State.REAPED, last_action="stop", last_action_at=at)
    assert state_words(stopped, NOW) == "stopped since 2026-11-20 13:00 UTC"
    assert state_words(released, NOW) == "released to its Auto Scaling group since 2026-11-20 13:00 UTC"
    assert state_words(gone, NOW) == "deleted since 2026-11-20 13:00 UTC; nothing kept to recreate it"


def test_a_long_list_stays_one_reply_within_its_length_and_every_kind_is_shown() -> None:
    """400 machines with long names (the Name tag may be 256 characters, emoji count two in UTF-16) would bury
    the endpoints and the apps past the cut: each kind gets its share, the rest of each is counted."""
    name = "🚀" + "x" * 200
    machines = [
        MachineRecord(
            f"i-{n:08x}", "ml", State.ACTIVE, name=f"{name}{n}", reason="busy " * 40, instance_type="m5.large"
        )
        for n in range(400)
    ]
    endpoints = [
        MachineRecord(f"endpoint:e{n}", "ml", State.ACTIVE, name=f"e{n}", reason="busy", instance_type="ml.m5.large")
        for n in range(3)
    ]
    app = MachineRecord(APP, "ml", State.WARNED, name="lab", reason="quiet", instance_type="ml.t3.medium")
    text = status_reply([*machines, *endpoints, app], now=NOW).text
    assert _units(text) <= DOCTOR_REPLY_CHARS
    assert not text.endswith("…")  # never cut: whole lines, the rest counted
    machines_part, endpoints_part, apps_part = text.split("\n\n")
    shown = [line for line in machines_part.splitlines() if line.startswith("• ")]
    assert 5 < len(shown) < 400
    assert machines_part.splitlines()[-1] == f"… and {400 - len(shown)} more machines"
    assert len([line for line in endpoints_part.splitlines() if line.startswith("• ")]) == 3
    assert "more" not in endpoints_part and "• lab" in apps_part


def test_admin_lines_keep_their_place_after_a_long_list() -> None:
    machines = [
        MachineRecord(f"i-{n:08x}", "ml", State.ACTIVE, name="n" * 250, reason="busy " * 40) for n in range(300)
    ]
    text = status_reply(machines, None, ["account sandbox (111111111111): us-east-1: 4 running"], now=NOW).text
    assert _units(text) <= DOCTOR_REPLY_CHARS
    assert text.endswith("account sandbox (111111111111): us-east-1: 4 running")
