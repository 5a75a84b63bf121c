"""Quiet hours are not lost, against moto and the local Slack fake: machines stopped at night without a
word get ONE summary to their owner at the first sweep after quiet hours end, with "Start it again" per
machine; a re-run sweep does not send it twice; a failed post is tried again at the next sweep."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from test_slack import _replies_from, click, record, silent, sweep  # noqa: F401

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
def night(aws, slack, clock):
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


def stopped_at_night(ids, clock):
    for now in (NIGHT, STOP):
        clock["t"] = now
        report = sweep(now)
    assert {d.machine.name: d.action for d in report.decisions} == {"nb1": Action.STOP, "nb2": Action.STOP}
    assert all(record(i).quiet_stop_at == STOP for i in ids.values())


def test_one_summary_in_the_morning_with_start_again_not_sent_twice(night, slack, clock):
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


def test_a_failed_summary_is_tried_again_and_a_started_machine_is_left_out(night, slack, clock):
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


def test_the_state_table_keeps_a_set_one_item_an_entry_and_removes_only_what_was_read(aws: object) -> None:
    """The quiet-hours index's items (StateStore.put_entries): each entry an item of its own in the set's partition,
    read back with a Query (expired ones left out, as DynamoDB's TTL deletes lazily), removed only while it holds
    the value read."""
    from idle_reaper import aws as aws_module  # the fixture's name hides the module

    local.init_account()
    store = aws_module.DynamoStateStore(aws_module.client("dynamodb"), aws_module.table_name())
    now = datetime(2026, 11, 21, 7, 5, tzinfo=UTC)
    assert store.put_entries("quiet-stops#hub", {"i-0a": "A", "i-0b": "B", "i-0c": "C"}, now + timedelta(days=7)) == {}
    assert store.put_entries("quiet-stops#hub", {"i-0old": "X"}, now - timedelta(minutes=1)) == {}
    assert store.put_entries("quiet-stops#123456789012/eu-west-1", {"i-0a": "M"}, now + timedelta(days=7)) == {}
    assert store.entries("quiet-stops#hub", now) == {"i-0a": "A", "i-0b": "B", "i-0c": "C"}
    assert store.remove_entries("quiet-stops#hub", {"i-0a": "A", "i-0b": "not what it holds"}) == ["i-0b"]
    assert store.entries("quiet-stops#hub", now) == {"i-0b": "B", "i-0c": "C"}
    assert store.entries("quiet-stops#123456789012/eu-west-1", now) == {"i-0a": "M"}, "another partition"
    assert store.entries("quiet-stops#nothing", now) == {}


def test_a_warning_recorded_in_quiet_hours_is_sent_when_they_end_and_the_stop_waits_for_it(
    aws,
    slack,
    clock,
):
    """Quiet hours 22:00-07:00; the warning point falls at 06:50 (recorded silently), the stop would have
    come at 07:10: no longer a quiet-hours stop, so nothing would ever have told the owner."""
    nights = {"name": "nights", "days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]}
    nights |= {"start": "22:00", "end": "07:00", "quiet_hours": True}
    policy = local.team_policy_json(idle_minutes=60, warn_minutes=20, timezone="UTC", schedules=[nights])
    local.init_account(teams={"ml": policy})
    slack.users_by_email["bob@example.com"] = "U0BOB"
    morning = at(23) + timedelta(hours=8)  # 07:00 the next day
    box = local.launch("nb", "g5.xlarge", team="ml", launch_time=at(8), owner="bob@example.com")
    quiet_from = morning - timedelta(minutes=50)  # 06:10
    local.write_metrics(
        box, lambda t: (60.0, 90.0) if t < quiet_from else (1.0, 0.0), at(20), morning + timedelta(hours=1)
    )

    def at_minutes(minutes: int):
        clock["t"] = morning + timedelta(minutes=minutes)
        (d,) = sweep(clock["t"]).decisions
        return d

    assert at_minutes(-30).state is State.IDLE
    held = at_minutes(-10)  # 06:50: the warning point, under quiet hours
    assert held.action is Action.WARN and "quiet hours" in held.reason
    assert not slack.calls_to("chat.postMessage") and record(box).warning_held
    sent = at_minutes(0)  # 07:00: quiet hours are over, the stop is still ahead
    assert sent.deliver_warning or record(box).warning_delivered_at == morning
    posts = [c for c in slack.calls_to("chat.postMessage") if "Idle machine" in c.params["text"]]
    assert [c.params["channel"] for c in posts] == ["D0BOB"]
    assert record(box).warning_delivered_at == morning and not record(box).warning_held
    assert at_minutes(10).action is Action.NONE, "not at 07:10: warn_minutes from the delivery at 07:00"
    assert local.instance_states([box])[box] == "running"
    stopped = at_minutes(20)
    assert stopped.action is Action.STOP
    updates = [c for c in slack.calls_to("chat.update") if c.params["text"].startswith("Stopped")]
    assert [u.params["channel"] for u in updates] == ["D0BOB"], "the stop is told in the warning's message"


def test_a_stop_with_no_message_to_edit_is_told_in_a_message_of_its_own_with_start_again(
    aws,
    slack,
    clock,
):
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    slack.users_by_email["bob@example.com"] = "U0BOB"
    box = local.launch("nb", "g5.xlarge", team="ml", launch_time=at(8), owner="bob@example.com")
    local.write_metrics(box, idle, at(11), at(23))
    slack.errors["chat.postMessage"] = "internal_error"  # Slack refuses every post for hours
    now = at(14)
    while True:
        clock["t"] = now
        (d,) = sweep(now).decisions
        if d.action is Action.STOP:
            break
        assert now < at(14) + timedelta(hours=5), d.reason
        now += timedelta(minutes=55)
        if now >= at(14) + timedelta(minutes=240):
            slack.errors.clear()  # Slack is back just before the stop
    assert "never delivered" in d.reason, "the documented Slack-unreachable exception, recorded as such"
    told = [c for c in slack.calls_to("chat.postMessage") if c.params["text"].startswith("Stopped")]
    assert [c.params["channel"] for c in told] == ["D0BOB"]
    blocks = json.dumps(told[0].params["blocks"])
    assert "start_again" in blocks and "saves" in blocks
    stored = record(box)
    assert stored.messages == (f"D0BOB|{told[0].params['_ts']}",), "later edits (Start it again) find it"
