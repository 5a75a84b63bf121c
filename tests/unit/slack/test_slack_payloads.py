"""The Slack endpoint's payload shapes: what is malformed (a 400 with a short reason), what is a
well-formed request idle-reaper answers, and what may pass for the internal work event."""

from __future__ import annotations

import base64
import json
import urllib.parse

import pytest

from idle_reaper.slack.requests import (
    ButtonWork,
    Malformed,
    WorkEvent,
    button_work,
    chosen_action,
    is_work_event,
    parse_click,
    parse_command,
    request_text,
)

HOOK = "https://hooks.slack.com/actions/T0/1/abc"


def interaction(payload: object) -> str:
    return urllib.parse.urlencode({"payload": json.dumps(payload)})


def click_payload(**changes: object) -> dict:
    payload = {
        "type": "block_actions",
        "user": {"id": "U0BOB", "name": "bob"},
        "actions": [{"action_id": "keep_2h", "value": "ref123", "block_id": "b"}],
        "response_url": HOOK,
        "container": {"type": "message", "channel_id": "C0", "message_ts": "1.2"},
    }
    return {**payload, **changes}


def test_a_well_formed_click_becomes_button_work():
    work = button_work(parse_click(interaction(click_payload())))
    assert work == ButtonWork(user="U0BOB", action_id="keep_2h", value="ref123", response_url=HOOK)


def test_the_overflow_menu_choice_is_the_value():
    actions = [{"action_id": "keep_other", "selected_option": {"value": "ref123|keep_4h"}}]
    work = button_work(parse_click(interaction(click_payload(actions=actions))))
    assert work.value == "ref123|keep_4h" and chosen_action(work.action_id, work.value) == "keep_4h"


@pytest.mark.parametrize(
    ("action_id", "value", "chosen"),
    [
        ("stop_now", "r", "stop_now"),
        ("keep_morning", "r", "keep_morning"),
        ("keep_other", "r|keep_1h", "keep_1h"),
        ("keep_other", "r|keep_forever", None),
        ("keep_other", "r|keep_other", None),
        ("keep_forever", "r", None),
    ],
)
def test_chosen_action_knows_only_idle_reapers_actions(action_id, value, chosen):
    assert chosen_action(action_id, value) == chosen


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"user": "U0BOB"}, "payload user"),  # the fuzzed shape that once reached the click code
        ({"user": {"id": 42}}, "payload user.id"),
        ({"actions": ["keep_2h"]}, "payload actions.0"),
        ({"actions": []}, "payload actions"),
        ({"actions": [{"action_id": ["keep_2h"], "value": "r"}]}, "payload actions.0.action_id"),
        ({"actions": [{"action_id": "keep_2h", "value": 7}]}, "payload actions.0.value"),
        ({"actions": [{"action_id": "keep_other", "selected_option": "r|keep_4h"}]}, "selected_option"),
        ({"response_url": None}, "payload response_url"),
        ({"response_url": "https://attacker.example/hook"}, "not a Slack URL"),
        ({"response_url": "http://hooks.slack.com/actions/x"}, "not a Slack URL"),
        ({"type": 3}, "payload type"),
    ],
)
def test_wrong_json_types_are_malformed_with_a_short_reason(changes, reason):
    with pytest.raises(Malformed) as caught:
        parse_click(interaction(click_payload(**changes)))
    assert reason in str(caught.value)
    assert "attacker" not in str(caught.value), "the reason names the field, never echoes the value"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("", "no payload field"),
        ("%%%", "not form-encoded"),
        ("payload=%7Bnot+json", "not JSON"),
        (interaction([1, 2]), "not a JSON object"),
        ("payload=" + "%5B" * 100_000, "nested too deeply"),
        ("payload=%FF%FE", "not form-encoded"),  # percent-encoded bytes that are not UTF-8
    ],
)
def test_unreadable_bodies_are_malformed(body, reason):
    with pytest.raises(Malformed, match=reason):
        parse_click(body)


def test_other_interactions_are_well_formed_but_not_clicks():
    assert parse_click(interaction({"type": "view_submission", "user": "whatever"})) is None


def test_a_slash_command_needs_a_user_and_a_slack_response_url():
    form = {"command": "/idle-reaper", "text": "status", "user_id": "U0BOB", "response_url": HOOK}
    assert parse_command(urllib.parse.urlencode(form)).text == "status"
    with pytest.raises(Malformed, match="user_id"):
        parse_command(urllib.parse.urlencode({**form, "user_id": ""}))
    with pytest.raises(Malformed, match="response_url"):
        parse_command(urllib.parse.urlencode({k: v for k, v in form.items() if k != "response_url"}))


def test_body_text_decodes_base64_and_refuses_non_utf8():
    assert request_text({"body": base64.b64encode(b"a=b").decode(), "isBase64Encoded": True}) == "a=b"
    with pytest.raises(Malformed, match="not UTF-8"):
        request_text({"body": base64.b64encode(b"payload=\xff\xfe").decode(), "isBase64Encoded": True})
    with pytest.raises(Malformed, match="not valid base64"):
        request_text({"body": "***", "isBase64Encoded": True})
    with pytest.raises(Malformed, match="not UTF-8"):
        request_text({"body": "a=\ud800"})  # a lone surrogate from a JSON event
    with pytest.raises(Malformed, match="must be text"):
        request_text({"body": {"a": "b"}})


def test_only_an_invoke_event_is_internal_work():
    work = WorkEvent(idle_reaper_slack_work=ButtonWork(user="U", action_id="stop_now", value="r", response_url=HOOK))
    event = work.to_event()
    assert is_work_event(event) and WorkEvent.model_validate(event) == work
    # Every Function URL event carries requestContext (and a body): never internal, whatever else it holds.
    assert not is_work_event({**event, "requestContext": {"http": {"method": "POST"}}})
    assert not is_work_event({**event, "body": ""})
    with pytest.raises(ValueError):
        WorkEvent.model_validate({**event, "headers": {}})
