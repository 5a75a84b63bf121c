"""Endpoints (and any kind after machines) in a section of their own in the weekly digest and `status`
(core/sections.py): each with its hardware, hourly cost, where it stands, and what deleting it saved by the one rule.
Pure: records and audit entries, no AWS."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from idle_reaper.core import sections as sections_module
from idle_reaper.core.digest import Week, build_digest
from idle_reaper.core.digest_text import digest_text
from idle_reaper.core.endpoints import MACHINE_WORDS, Restore, Words, words_for
from idle_reaper.core.records import MachineRecord, State
from idle_reaper.core.sections import section_of, state_words
from idle_reaper.core.signals import Machine

W47 = Week(2026, 47)  # Monday 2026-11-16 .. Monday 2026-11-23
MON = datetime(2026, 11, 16, tzinfo=UTC)
END = datetime(2026, 11, 23, tzinfo=UTC)
PRICES = {"ml.g5.2xlarge": 1.515, "ml.g4dn.xlarge": 0.7364, "g5.xlarge": 1.006}
FRESH = END - timedelta(minutes=10)  # written by the last sweep: running now


def at(day: int, hour: float) -> datetime:
    return MON + timedelta(days=day, hours=hour)


def endpoint(name: str, state: State = State.ACTIVE, hardware: str = "ml.g5.2xlarge x2", **kw) -> MachineRecord:
    kept = Restore(f"{name}-config", (("Team", "ml"),)).to_json()
    fields = {"updated_at": FRESH, "machine_kind": "endpoint", "endpoint": kept, **kw}
    return MachineRecord(f"endpoint:{name}", "ml", state, instance_type=hardware, name=name, **fields)


def deleted(key: str, when: datetime, hourly: float) -> tuple:
    entry = {"action": "stop", "team": "ml", "owner": "U0BOB", "hourly_savings": hourly, "hourly_cost": hourly}
    return (key, when, entry)


def test_endpoints_have_their_own_line_with_cost_state_and_what_deleting_them_saved() -> None:
    records = [
        endpoint("gone-ep", State.REAPED, last_action="stop", last_action_at=at(4, 0), updated_at=at(4, 0)),
        endpoint("warned-ep", State.WARNED, stop_not_before=END + timedelta(minutes=20)),
        endpoint("kept-ep", State.SNOOZED, snoozed_until=END + timedelta(hours=2), snoozed_by="U0ANN"),
        endpoint(
            "zero-ep",
            machine_kind="endpoint-scales-to-zero",
            kind_note="endpoint-scales-to-zero: a SageMaker endpoint whose deletion saves nothing: serverless variant",
        ),
        endpoint("dark-ep", State.UNKNOWN, "ml.g4dn.xlarge", reason="no metrics from variant AllTraffic"),
        endpoint(
            "failed-ep",
            State.REAPED,
            last_action="stop",
            last_action_at=at(6, 0),
            endpoint=Restore("failed-ep-config", failed="Unable to provision capacity").to_json(),
        ),
        MachineRecord("i-0dark", "ml", State.UNKNOWN, instance_type="g5.xlarge", name="box", updated_at=FRESH),
    ]
    entries = [deleted("endpoint:gone-ep", at(4, 0), 3.03), deleted("endpoint:failed-ep", at(6, 0), 3.03)]
    d = build_digest(entries, records, W47, now=END, team="ml", prices=PRICES)

    [section] = d.sections
    assert section.label == "endpoints"
    found = {r.name: r for r in section.resources}
    assert set(found) == {"gone-ep", "warned-ep", "kept-ep", "zero-ep", "dark-ep", "failed-ep"}
    # The one rule: its instances' price times their count, for every hour it was not running.
    assert (found["gone-ep"].saved_hours, round(found["gone-ep"].saved_dollars, 2)) == (72.0, 218.16)
    assert (found["failed-ep"].saved_hours, round(found["failed-ep"].saved_dollars, 2)) == (24.0, 72.72)
    assert (found["warned-ep"].hardware, found["warned-ep"].hourly, found["warned-ep"].saved_dollars) == (
        "ml.g5.2xlarge x2",
        3.03,
        0.0,
    )
    assert [r.name for r in section.resources][:2] == ["gone-ep", "failed-ep"]  # most saved first
    assert round(section.saved_dollars, 2) == 290.88
    # Not watched right now: the machine; the unknown endpoint is in its own section, not counted twice.
    assert [a.name for a in d.at_risk] == ["box"]

    text = digest_text(d)
    assert "Endpoints (6): deleted ones saved $290.88 (96.0 h this week)." in text
    assert "over 96.0 hours stopped or deleted: 2 deletions (96.0 h, $290.88); of it, endpoints $290.88 (each" in text
    assert "Stops and deletions: 2, of which 0 started again" in text
    assert (
        "gone-ep (ml, ml.g5.2xlarge x2, $3.03/h): deleted since 2026-11-20 00:00 UTC, restorable: Bring it back "
        "recreates it; saved $218.16 (72.0 h deleted)"
    ) in text
    assert "failed-ep (ml, ml.g5.2xlarge x2, $3.03/h): deleted since 2026-11-22 00:00 UTC, restorable" in text
    assert "(the last try failed: Unable to provision capacity)" in text
    assert "warned-ep (ml, ml.g5.2xlarge x2, $3.03/h): warned: deleted at 2026-11-23 00:20 UTC unless" in text
    assert "kept-ep (ml, ml.g5.2xlarge x2, $3.03/h): kept until 2026-11-23 02:00 UTC by U0ANN" in text
    assert "zero-ep (ml, ml.g5.2xlarge x2, $3.03/h): reported, never deleted: a SageMaker endpoint whose" in text
    assert (
        "dark-ep (ml, ml.g4dn.xlarge, $0.74/h): unknown: no metrics from variant AllTraffic; never deleted while"
        in text
    )
    assert "Not watched right now ($1.01/h): box (unknown, $1.01/h)" in text


def test_another_team_s_endpoints_and_a_week_without_any_show_no_section() -> None:
    records = [endpoint("theirs")]
    assert build_digest([], records, W47, now=END, team="vision", prices=PRICES).sections == []
    admins = build_digest([], records, W47, now=END, prices=PRICES)  # the admins': every team's
    assert [r.name for r in admins.sections[0].resources] == ["theirs"]
    assert "Endpoints (1): deleted ones saved $0.00" in digest_text(admins)
    assert "theirs (ml, ml.g5.2xlarge x2, $3.03/h): watched" in digest_text(admins)


def test_a_kind_added_to_words_for_is_a_section_of_its_own_with_nothing_else_added(monkeypatch) -> None:
    app = Words("Studio app", "deleted", "Delete now", "Deleted", "Start it again")

    def words(key: str) -> Words:
        return app if key.rsplit("/", 1)[-1].startswith("studio:") else words_for(key)

    monkeypatch.setattr(sections_module, "words_for", words)
    studio = MachineRecord("studio:d-1:space:JupyterLab:default", "ml", instance_type="ml.g4dn.xlarge", name="lab")
    records = [endpoint("ep"), studio, MachineRecord("i-0abc", "ml", instance_type="g5.xlarge", updated_at=FRESH)]
    d = build_digest([], records, W47, now=END, team="ml", prices=PRICES)
    assert [(s.label, [r.name for r in s.resources]) for s in d.sections] == [
        ("endpoints", ["ep"]),
        ("Studio apps", ["lab"]),
    ]
    assert "Studio apps (1): deleted ones saved $0.00" in digest_text(d)
    assert section_of("i-0abc") == section_of("nb-notebook") == MACHINE_WORDS.noun + "s" == "machines"
    assert section_of("123456789012/eu-west-1/endpoint:ep") == "endpoints"


def test_state_words_say_a_bring_back_under_way_and_a_deletion_with_nothing_kept() -> None:
    pending = Restore("c", pending_by="U0BOB", pending_since="2026-11-22T10:00:00+00:00").to_json()
    assert state_words(endpoint("ep", endpoint=pending), END) == (
        "being brought back by U0BOB since 2026-11-22T10:00:00+00:00"
    )
    gone = endpoint("ep", State.REAPED, endpoint=None, last_action_at=at(1, 0))
    assert state_words(gone, END) == "deleted since 2026-11-17 00:00 UTC; nothing kept to recreate it"
    assert state_words(endpoint("ep", State.EXEMPT), END) == "exempt (tagged): reported, never deleted"
    assert state_words(endpoint("ep", idle_since=at(6, 12)), END) == "watched, idle since 2026-11-22 12:00 UTC"


def test_status_shows_endpoints_in_a_table_of_their_own_after_the_machines() -> None:
    from idle_reaper.policy import Settings, TeamPolicyRef
    from idle_reaper_tools import admin

    records = [
        endpoint("gone-ep", State.REAPED, last_action="stop", last_action_at=at(4, 0), owner="U0BOB"),
        endpoint("kept-ep", State.SNOOZED, snoozed_until=END + timedelta(hours=2), snoozed_by="U0ANN"),
        MachineRecord("i-0abc", "ml", State.IDLE, instance_type="g5.xlarge", name="box", idle_since=at(6, 23)),
    ]
    refs = {"ml": TeamPolicyRef(team="ml", policy=Settings().default_policy, source="/idle-reaper/teams/ml", version=1)}
    running = {
        m.instance_id: m
        for m in (
            Machine("endpoint:kept-ep", "ml.g5.2xlarge x2", "ml", at(0, 0), name="kept-ep"),
            Machine("endpoint:idle-ep", "ml.g4dn.xlarge", "ml", at(0, 0), name="idle-ep"),
            Machine("endpoint:warned-ep", "ml.g4dn.xlarge", "ml", at(0, 0), name="warned-ep"),
            Machine("i-0abc", "g5.xlarge", "ml", at(0, 0), name="box"),
        )
    }
    records.append(endpoint("idle-ep", State.IDLE, "ml.g4dn.xlarge", idle_since=at(6, 12)))
    warned = {"warned_at": at(6, 23), "warning_delivered_at": at(6, 23), "idle_since": at(6, 1)}
    records.append(endpoint("warned-ep", State.WARNED, "ml.g4dn.xlarge", **warned))
    rows = admin.status_rows(records, running, refs, Settings(), END)
    by_id = {r["instance_id"]: r for r in rows}
    assert (by_id["endpoint:gone-ep"]["section"], by_id["i-0abc"]["section"]) == ("endpoints", "machines")
    assert (by_id["endpoint:gone-ep"]["hardware"], by_id["endpoint:gone-ep"]["hourly_cost"]) == (
        "ml.g5.2xlarge x2",
        3.03,
    )
    text = admin.format_status(rows, END)
    machines, endpoints = text.split("\n\nEndpoints (4):\n")
    assert "i-0abc" in machines and "endpoint:" not in machines
    header, *lines = endpoints.splitlines()
    assert header.split() == ["NAME", "TEAM", "OWNER", "INSTANCES", "COST", "STATE", "NEXT", "REASON"]
    gone = next(line for line in lines if line.startswith("endpoint:gone-ep"))
    assert "U0BOB" in gone and "ml.g5.2xlarge x2  $3.03/h" in gone
    assert "deleted since 2026-11-20 00:00 UTC, restorable: Bring it back recreates it" in gone
    kept = next(line for line in lines if line.startswith("endpoint:kept-ep"))
    assert "kept until 2026-11-23 02:00 UTC by U0ANN" in kept and "warn if still quiet (the keep ends)" in kept
    # Its own window (endpoint_idle_minutes, a day by default) and its own action: idle from 12:00, warned at 11:30.
    idle = next(line for line in lines if line.startswith("endpoint:idle-ep"))
    assert "$0.74/h  watched, idle since 2026-11-22 12:00 UTC " in idle
    assert idle.rstrip().endswith("warn if still quiet at 2026-11-23 11:30")
    assert "delete" not in machines and "stop" not in idle
    warned_line = next(line for line in lines if line.startswith("endpoint:warned-ep"))
    assert "delete if still idle at 2026-11-23 01:00" in warned_line  # its window's end, not a stop


def test_status_says_a_studio_app_is_deleted_whatever_its_teams_action_for_machines() -> None:
    # The sweep deletes an idle app of a studio_apps: delete team (core/lifecycle: deleted_by_stop); status said
    # "hibernate" for a team whose machines hibernate.
    from idle_reaper.core.kinds import Kind
    from idle_reaper.policy import TeamPolicy
    from idle_reaper_tools import admin

    app = "studio:d-1:lab:JupyterLab:default"
    warned = {"warned_at": at(6, 23), "warning_delivered_at": at(6, 23), "idle_since": at(6, 1)}
    record = MachineRecord(app, "vision", State.WARNED, machine_kind=Kind.STUDIO_APP, **warned)
    running = Machine(app, "ml.g4dn.xlarge", "vision", at(0, 0), name="lab")
    step, _ = admin.next_step(record, TeamPolicy(action="hibernate", studio_apps="delete"), running, END)
    assert step == "delete if still idle"
