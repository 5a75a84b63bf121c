"""What an owner reads of an endpoint or a Studio app never calls it a machine, nor its deletion a stop (issue 46):
the shared message that lists them beside machines, its fallback, the quiet hours summary's line, and the
answers that refuse a keep or a start. Pure: blocks and records, no Slack."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper.core.answers import snooze
from idle_reaper.core.records import MachineRecord, State
from idle_reaper.core.sections import kinds_said
from idle_reaper.policy import TeamPolicy
from idle_reaper.slack.blocks import Listed, blocks_json, owner_message_blocks, quiet_stop_line

NOW = datetime(2026, 11, 20, 15, 0, tzinfo=UTC)
APP = "studio:d-1:lab:JupyterLab:default"


def test_a_shared_message_names_the_kinds_it_lists_and_what_is_done_to_them() -> None:
    both = [Listed("i-1", "waiting", ref="r1"), Listed("endpoint:llm", "waiting", ref="r2")]
    blocks = blocks_json(owner_message_blocks(both, "g"))
    assert blocks[0]["text"]["text"] == "Idle machines and endpoints: 2 of yours will be stopped or deleted unless kept"
    assert blocks[-1]["elements"][0]["text"] == (
        "idle-reaper · your machines and endpoints that became idle together, in one message"
    )
    apps = blocks_json(owner_message_blocks([Listed(APP, "waiting", ref="r3"), Listed(APP + "2", "x")], "g"))
    assert apps[0]["text"]["text"] == "Idle Studio apps: 1 of yours will be deleted unless kept"
    assert blocks_json(owner_message_blocks([Listed("endpoint:llm", "gone")], "g"))[0]["text"]["text"] == (
        "Your idle endpoints"
    )
    member = "111111111111/eu-west-1/endpoint:llm"
    assert kinds_said([APP, member, "i-2"]) == ("machines, endpoints and Studio apps", "stopped or deleted")


def test_the_quiet_hours_line_of_an_endpoint_says_it_was_deleted() -> None:
    deleted = MachineRecord(
        "endpoint:llm", "ml", State.REAPED, last_action="stop", last_action_at=NOW, reason="idle past its window"
    )
    assert "*Deleted at " in quiet_stop_line(deleted) and "Stopped" not in quiet_stop_line(deleted)
    stopped = MachineRecord("i-1", "ml", State.REAPED, last_action="stop", last_action_at=NOW, reason="idle")
    assert "*Stopped at " in quiet_stop_line(stopped)


def test_a_refused_keep_names_the_endpoint_not_a_machine() -> None:
    policy = TeamPolicy(max_snoozes_per_day=1)
    day = NOW.date().isoformat()
    kept_once = MachineRecord("endpoint:llm", "ml", State.WARNED, snooze_day=day, snoozes_today=1)
    assert snooze(kept_once, policy, "U0BOB", NOW + timedelta(hours=1), NOW) == (
        "this endpoint was already kept 1 times today (the team allows 1)"
    )
    app = MachineRecord(APP, "ml", State.REAPED)
    assert snooze(app, policy, "U0BOB", NOW + timedelta(hours=1), NOW) == "the Studio app is already deleted"


def test_metrics_that_did_not_come_back_leave_an_endpoint_unknown_in_its_own_words() -> None:
    from idle_reaper.core.signals import Machine, Signals, assess

    def reason(machine_id: str) -> str:
        machine = Machine(machine_id, "ml.g5.xlarge", "ml", NOW - timedelta(days=1))
        got = assess(
            machine, Signals(complete=False), TeamPolicy(), now=NOW, period=timedelta(minutes=5), gpu_families=()
        )
        assert got.signal == "unknown"
        return got.reason

    assert reason("endpoint:llm") == "CloudWatch did not return complete metrics for this endpoint"
    assert reason(APP).endswith("for this Studio app") and reason("i-1").endswith("for this machine")


def test_delete_now_on_an_endpoint_that_saves_nothing_says_it_cannot_be_deleted() -> None:
    from idle_reaper.slack.answers import Effects

    note = "endpoint-scales-to-zero: a SageMaker endpoint whose deletion saves nothing: serverless variant"
    record = MachineRecord("endpoint:llm", "ml", State.WARNED, machine_kind="endpoint-scales-to-zero", kind_note=note)
    effects = Effects(store=None, fleet=None, slack=None, clock=lambda: NOW)  # type: ignore[arg-type]  # never reached
    reply = effects.stop_now("U0BOB", record)
    assert reply is not None and reply.text.startswith("idle-reaper cannot delete endpoint:llm: endpoint-scales")


def test_keep_by_an_ambiguous_name_and_a_policy_plan_name_endpoints_as_endpoints() -> None:
    from idle_reaper.core.signals import Machine
    from idle_reaper.slack.routing import which_one
    from idle_reaper_tools.admin import Plan, PlanChange, format_plan

    both = [MachineRecord("i-0abc", "ml", name="demo"), MachineRecord("endpoint:demo", "ml")]
    assert which_one("demo", both).startswith("2 of your machines and endpoints are `demo`")
    endpoint = Machine("endpoint:demo", "ml.g5.xlarge", "ml", NOW - timedelta(days=1), "demo", "U1")
    plan = Plan("ml", NOW, "{}", "{}", [PlanChange(endpoint, "none", "delete", "idle past its window")], 0)
    assert "1 endpoints would be warned or deleted that were not before, 0 the reverse" in format_plan(plan)


def test_a_studio_app_is_found_by_its_id_for_anyone_who_may_keep_it_as_an_endpoint_is() -> None:
    # Keep is what protects: a team member could keep someone's endpoint by endpoint:<name>, but not someone's Studio
    # app by its id (only its owner's own records were searched).
    from types import SimpleNamespace

    from idle_reaper.slack.routing import Region

    app = MachineRecord(APP, "ml", owner="U0ALICE")
    loaded: list[list[str]] = []

    def load(keys: list[str]) -> dict[str, MachineRecord]:
        loaded.append(keys)
        return {APP: app} if keys == [APP] else {}

    region: Any = SimpleNamespace(records_of_owner=lambda user: [], store=SimpleNamespace(load=load))
    assert Region.find(region, "U0BOB", APP) == [app]
    assert Region.find(region, "U0BOB", "lab") == [] and loaded == [[APP]], "a name is the caller's own machines'"
