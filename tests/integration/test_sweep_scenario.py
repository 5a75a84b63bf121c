"""The afternoon scenario that must hold, against moto in server mode with the real adapters."""

from __future__ import annotations

import pytest

from idle_reaper.core import Action, State
from idle_reaper.sweep import Adapters
from idle_reaper_tools import demo, local

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def afternoon(moto_server, slack_server):
    moto_server.reset()
    slack_server.reset()
    slack_server.users_by_email.update(demo.SLACK_USERS)
    seeded = demo.seed()
    reports = demo.simulate(seeded, demo.adapters_at)
    return seeded, reports


def history(reports, instance_id):
    return [(r.now, d) for r in reports for d in r.decisions if d.machine.instance_id == instance_id]


def test_gpu_training_box_with_low_cpu_is_never_warned_or_stopped(afternoon):
    seeded, reports = afternoon
    gpu = seeded.ids["gpu-train"]
    steps = history(reports, gpu)
    assert len(steps) == len(reports)
    assert all(d.action is Action.NONE and d.state is State.ACTIVE for _, d in steps)
    assert local.instance_states([gpu])[gpu] == "running"


def test_idle_notebook_is_warned_then_stopped_after_the_warning_period(afternoon):
    seeded, reports = afternoon
    nb = seeded.ids["notebook"]
    actions = [(now, d.action) for now, d in history(reports, nb) if d.action is not Action.NONE]
    assert [a for _, a in actions] == [Action.WARN, Action.STOP]
    (warned_at, _), (stopped_at, _) = actions
    assert (stopped_at - warned_at).total_seconds() >= 30 * 60
    assert (stopped_at - demo.at(12)).total_seconds() >= 90 * 60, "stopped before a full idle window"
    assert local.instance_states([nb])[nb] == "stopped"


def test_idle_asg_member_loses_protection_and_is_not_stopped(afternoon):
    seeded, reports = afternoon
    busy, idle = seeded.ids["workers-0"], seeded.ids["workers-1"]
    protection = local.protection(demo.GROUP)
    assert protection == {busy: True, idle: False}
    assert local.instance_states([busy, idle]) == {busy: "running", idle: "running"}
    idle_actions = [d.action for _, d in history(reports, idle) if d.action is not Action.NONE]
    assert idle_actions == [Action.WARN, Action.UNPROTECT]


@pytest.mark.parametrize("name,state", [("exempt-box", State.EXEMPT), ("research-box", State.SAFE_MODE)])
def test_exempt_box_and_invalid_policy_box_are_untouched(afternoon, name, state):
    seeded, reports = afternoon
    instance_id = seeded.ids[name]
    steps = history(reports, instance_id)
    assert steps and all(d.state is state and d.action is Action.NONE for _, d in steps)
    assert local.instance_states([instance_id])[instance_id] == "running"


def test_invalid_policy_error_names_parameter_and_field(afternoon):
    seeded, reports = afternoon
    _, d = history(reports, seeded.ids["research-box"])[0]
    assert "/idle-reaper/teams/research" in d.reason and "idle_minutes" in d.reason


def test_ten_minute_old_box_is_untouched(afternoon):
    seeded, reports = afternoon
    young = seeded.ids["young-box"]
    steps = history(reports, young)
    assert [now for now, _ in steps] == [demo.at(17)]
    _, d = steps[0]
    assert d.state is State.UNKNOWN and d.action is Action.NONE and "started 10 min ago" in d.reason
    assert local.instance_states([young])[young] == "running"


def test_every_action_is_audited_with_its_policy_version(afternoon):
    seeded, _ = afternoon
    store = Adapters.from_environment().store
    entries = store.history(seeded.ids["notebook"])  # type: ignore[attr-defined]
    assert [e["action"] for e in entries] == ["warn", "stop"]
    assert all(e["policy"] == "/idle-reaper/teams/ml@v1" for e in entries)
    assert entries[1]["max_gpu"] == 0.0 and entries[1]["window_minutes"] == 90
