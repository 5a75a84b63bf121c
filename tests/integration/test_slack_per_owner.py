"""One message per owner, against moto and the local Slack fake: an owner's machines warned in one sweep
share one message with per-machine buttons and "Keep all 2 h"; answers and later sweeps edit that
message instead of posting new ones."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from test_slack import _replies_from, click, ephemeral_text, record, silent, sweep  # noqa: F401

from idle_reaper.core import Action, State
from idle_reaper_tools import local
from idle_reaper_tools.demo import at

pytestmark = pytest.mark.integration

T0 = at(14)


def idle(_t):
    return (1.0, 0.0)


@pytest.fixture
def bobs(aws, slack, clock):
    """Three idle machines of bob's: two in team ml (U0MEMBER is a member), one in team cv."""
    local.init_account(
        teams={
            "ml": local.team_policy_json(idle_minutes=60, warn_minutes=20, members=["U0MEMBER"]),
            "cv": local.team_policy_json(idle_minutes=60, warn_minutes=20),
        }
    )
    slack.users_by_email["bob@example.com"] = "U0BOB"
    ids = {
        name: local.launch(name, "g5.xlarge", team=team, launch_time=at(8), owner="bob@example.com")
        for name, team in (("nb1", "ml"), ("nb2", "ml"), ("nb3", "cv"))
    }
    for instance_id in ids.values():
        local.write_metrics(instance_id, idle, at(11), at(23))
    return ids


def message(slack) -> dict:
    (post,) = slack.calls_to("chat.postMessage")
    return slack.messages[(post.params["channel"], post.params["_ts"])]


def buttons(blocks: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for block in blocks:
        if block["type"] == "actions":
            for element in block["elements"]:
                out.setdefault(element["action_id"], []).append(element["value"])
    return out


def test_three_idle_machines_one_message_keep_all_edits_it(bobs, slack, clock):
    report = sweep(T0)
    assert [d.action for d in report.decisions] == [Action.WARN] * 3
    (post,) = slack.calls_to("chat.postMessage")
    assert post.params["channel"] == "D0BOB"
    text = json.dumps(post.params["blocks"])
    for name, instance_id in bobs.items():
        assert name in text and instance_id in text
    assert "team ml" in text and "team cv" in text and "<!date^" in text
    records = {name: record(i) for name, i in bobs.items()}
    assert {r.messages for r in records.values()} == {(f"D0BOB|{post.params['_ts']}",)}
    (group_ref,) = {r.group_ref for r in records.values()}
    assert group_ref and all(r.warning_delivered_at == T0 for r in records.values())
    assert len({r.warning_ref for r in records.values()}) == 3  # each machine its own buttons
    shown = buttons(post.params["blocks"])
    assert shown["keep_all"] == [group_ref] and sorted(shown["keep_2h"]) == sorted(
        r.warning_ref for r in records.values()
    )

    # A member of ml only: ml's two are kept, cv's is named and left as it was.
    reply = ephemeral_text(click("U0MEMBER", "keep_all", group_ref))
    assert reply.startswith("Kept 2 of 3") and "nb3" in reply and "can't change" in reply
    assert [record(bobs[n]).state for n in ("nb1", "nb2", "nb3")] == [State.SNOOZED, State.SNOOZED, State.WARNED]
    assert len(slack.calls_to("chat.update")) == 1  # one edit for the two kept
    edited = message(slack)["blocks"]
    assert json.dumps(edited).count("<@U0MEMBER> kept") == 2
    assert buttons(edited)["keep_all"] == [group_ref] and buttons(edited)["keep_2h"] == [
        record(bobs["nb3"]).warning_ref
    ]
    assert len(slack.calls_to("chat.postMessage")) == 1

    # bob keeps the rest; a second click (or a Slack retry) changes nothing.
    assert silent(click("U0BOB", "keep_all", group_ref))
    assert record(bobs["nb3"]).state is State.SNOOZED and record(bobs["nb3"]).snoozed_by == "U0BOB"
    assert "keep_all" not in buttons(message(slack)["blocks"])
    before = {n: record(i) for n, i in bobs.items()}
    assert "no longer current" in ephemeral_text(click("U0BOB", "keep_all", group_ref))
    assert {n: record(i) for n, i in bobs.items()} == before
    assert len(slack.calls_to("chat.update")) == 2 and len(slack.calls_to("chat.postMessage")) == 1


def test_a_forged_or_unknown_keep_all_changes_nothing(bobs, slack, clock):
    sweep(T0)
    before = {n: record(i) for n, i in bobs.items()}
    for forged in ("forged-reference", bobs["nb1"], ""):
        assert "no longer current" in ephemeral_text(click("U0BOB", "keep_all", forged))
    assert {n: record(i) for n, i in bobs.items()} == before
    assert not slack.calls_to("chat.update")


def test_later_answers_and_stops_edit_the_shared_message(bobs, slack, clock):
    sweep(T0)
    refs = {n: record(i).warning_ref for n, i in bobs.items()}
    assert silent(click("U0BOB", "keep_2h", refs["nb1"]))  # one kept by its own button
    later = T0 + timedelta(minutes=25)
    clock["t"] = later
    report = sweep(later)
    stopped = {d.machine.name for d in report.decisions if d.action is Action.STOP}
    assert stopped == {"nb2", "nb3"}
    assert len(slack.calls_to("chat.postMessage")) == 1, "updates edit the shared message, never post anew"
    blocks = message(slack)["blocks"]
    text = json.dumps(blocks)
    assert "<@U0BOB> kept" in text and text.count("Stopped") == 2
    starts = buttons(blocks)["start_again"]
    assert sorted(starts) == sorted(record(bobs[n]).warning_ref for n in ("nb2", "nb3"))
    assert "keep_all" not in buttons(blocks)

    # "Start it again" on one line of the shared message starts that machine only, and edits the message.
    assert silent(click("U0BOB", "start_again", record(bobs["nb2"]).warning_ref))
    assert local.instance_states([bobs["nb2"], bobs["nb3"]]) == {bobs["nb2"]: "running", bobs["nb3"]: "stopped"}
    assert "started" in json.dumps(message(slack)["blocks"]) and len(slack.calls_to("chat.postMessage")) == 1


@pytest.mark.parametrize("first", [" bob@example.com ", "U0BOB", "BOB@example.com"])
def test_one_person_spelled_two_ways_gets_one_message_and_no_machine_is_marked_undeliverable(
    aws,
    slack,
    clock,
    first,
):
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    slack.users_by_email["bob@example.com"] = "U0BOB"
    ids = [
        local.launch(name, "g5.xlarge", team="ml", launch_time=at(8), owner=owner)
        for name, owner in (("spelled", first), ("plain", "bob@example.com"))
    ]
    for instance_id in ids:
        local.write_metrics(instance_id, idle, at(11), at(23))
    report = sweep(T0)
    assert {d.action for d in report.decisions} == {Action.WARN}
    (post,) = slack.calls_to("chat.postMessage")
    assert post.params["channel"] == "D0BOB" and all(i in json.dumps(post.params["blocks"]) for i in ids)
    for instance_id in ids:
        stored = record(instance_id)
        assert stored.warning_delivered_at == T0 and stored.delivery_error is None
        assert stored.owner_slack_id == "U0BOB"


def test_a_machine_whose_owner_does_not_resolve_is_never_hidden_in_another_owners_message(
    aws,
    slack,
    clock,
):
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    slack.users_by_email["bob@example.com"] = "U0BOB"
    bob = local.launch("bobs", "g5.xlarge", team="ml", launch_time=at(8), owner="bob@example.com")
    ghost = local.launch("ghosts", "g5.xlarge", team="ml", launch_time=at(8), owner="bob@example.org")
    other = local.launch("bobs2", "g5.xlarge", team="ml", launch_time=at(8), owner="Bob@Example.com")
    for instance_id in (bob, ghost, other):
        local.write_metrics(instance_id, idle, at(11), at(23))
    sweep(T0)
    (post,) = slack.calls_to("chat.postMessage")
    assert ghost not in json.dumps(post.params["blocks"])
    assert record(ghost).delivery_error and "not a Slack user" in record(ghost).delivery_error
    assert record(bob).warning_delivered_at == T0 and record(other).warning_delivered_at == T0
