"""Quiet hours are not lost, against moto and the local Slack fake: machines stopped at night without a
word get ONE summary to their owner at the first sweep after quiet hours end, with "Start it again" per
machine; a re-run sweep does not send it twice; a failed post is tried again at the next sweep."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from test_slack import _replies_from, click, clock, record, silent, sweep  # noqa: F401

from idle_reaper import aws
from idle_reaper.core import Action, State
from idle_reaper_tools import local
from idle_reaper_tools.demo import at

pytestmark = pytest.mark.integration

NIGHT = at(23)
STOP = at(23, 40)
MORNING = at(23) + timedelta(hours=8, minutes=5)  # 07:05 the next day


def idle(_t):
    return (1.0, 0.0)


@pytest.fixture
def night(aws, slack, clock):  # noqa: F811
    nights = {"name": "nights", "days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}
    nights |= {"start": "22:00", "end": "07:00", "quiet_hours": True}
    policy = local.team_policy_json(idle_minutes=60, warn_minutes=20, timezone="UTC", schedules=[nights])
    local.init_account(teams={"ml": policy})
    slack.users_by_email["bob@example.com"] = "U0BOB"
    ids = {
        name: local.launch(name, "g5.xlarge", team="ml", launch_time=at(8), owner="bob@example.com")
        for name in ("nb1", "nb2")
    }
    for instance_id in ids.values():
        local.write_metrics(instance_id, idle, at(11), MORNING + timedelta(hours=1))
    return ids


def stopped_at_night(ids, clock):  # noqa: F811
    for now in (NIGHT, STOP):
        clock["t"] = now
        report = sweep(now)
    assert {d.machine.name: d.action for d in report.decisions} == {"nb1": Action.STOP, "nb2": Action.STOP}
    assert all(record(i).quiet_stop_at == STOP for i in ids.values())


def test_one_summary_in_the_morning_with_start_again_not_sent_twice(night, slack, clock):  # noqa: F811
    stopped_at_night(night, clock)
    assert not slack.calls_to("chat.postMessage"), "nothing is posted during quiet hours"
    clock["t"] = at(23) + timedelta(hours=7, minutes=50)  # 06:50: still quiet
    sweep(clock["t"])
    assert not slack.calls_to("chat.postMessage")

    clock["t"] = MORNING
    sweep(MORNING)
    (post,) = slack.calls_to("chat.postMessage")
    assert post.params["channel"] == "D0BOB"
    blocks = post.params["blocks"]
    assert "During quiet hours, idle-reaper stopped 2 of your machines" in json.dumps(blocks)
    starts = [e["value"] for b in blocks if b["type"] == "actions" for e in b["elements"]]
    assert sorted(starts) == sorted(record(i).warning_ref for i in night.values())
    assert all(record(i).quiet_stop_at is None for i in night.values())

    sweep(MORNING)  # a re-run, and the next sweep
    sweep(MORNING + timedelta(minutes=15))
    assert len(slack.calls_to("chat.postMessage")) == 1

    answer = click("U0BOB", "start_again", record(night["nb1"]).warning_ref)
    assert silent(answer), answer["replies"]
    assert local.instance_states(list(night.values())) == {night["nb1"]: "running", night["nb2"]: "stopped"}
    edited = json.dumps(slack.messages[(post.params["channel"], post.params["_ts"])]["blocks"])
    assert "started" in edited and len(slack.calls_to("chat.postMessage")) == 1


def test_a_failed_summary_is_tried_again_and_a_started_machine_is_left_out(night, slack, clock):  # noqa: F811
    stopped_at_night(night, clock)
    slack.down = True
    clock["t"] = MORNING
    sweep(MORNING)
    assert all(record(i).quiet_stop_at == STOP for i in night.values()), "not delivered: still to report"
    slack.down = False
    # Meanwhile someone started nb2 (in the console): it is no longer news.
    aws.client("ec2").start_instances(InstanceIds=[night["nb2"]])
    nb2 = record(night["nb2"])
    store = aws.DynamoStateStore(aws.client("dynamodb"), aws.table_name())
    assert store.save(replace(nb2, version=nb2.version + 1, state=State.ACTIVE, last_action="started"))
    later = MORNING + timedelta(minutes=15)
    clock["t"] = later
    sweep(later)
    summaries = [c for c in slack.calls_to("chat.postMessage") if "During quiet hours" in c.params["text"]]
    assert len(summaries) == 1 and summaries[0].params.get("_ts"), "the retry delivered it, once"
    text = json.dumps(summaries[0].params["blocks"])
    assert night["nb1"] in text and night["nb2"] not in text and "stopped 1 of your machines" in text
    sweep(later + timedelta(minutes=15))
    assert len([c for c in slack.calls_to("chat.postMessage") if "During quiet hours" in c.params["text"]]) == 1


def test_the_state_table_replaces_a_lookup_only_over_what_was_read(aws: object) -> None:
    from idle_reaper import aws as aws_module  # the fixture's name hides the module

    local.init_account()
    store = aws_module.DynamoStateStore(aws_module.client("dynamodb"), aws_module.table_name())
    now = datetime(2026, 11, 21, 7, 5, tzinfo=UTC)
    later = now + timedelta(days=1)
    assert store.replace_lookup("quiet-stops", "a", later, expected=None, now=now)
    assert not store.replace_lookup("quiet-stops", "b", later, expected=None, now=now), "written first"
    assert not store.replace_lookup("quiet-stops", "b", later, expected="x", now=now)
    assert store.replace_lookup("quiet-stops", "b", later, expected="a", now=now)
    assert store.get_lookup("quiet-stops", now) == "b"
    assert not store.replace_lookup("quiet-stops", "c", later, expected="b", now=later), "expired: not 'b' any more"
    assert store.replace_lookup("quiet-stops", "c", later + timedelta(days=1), expected=None, now=later)
