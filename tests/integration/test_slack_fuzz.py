"""Fuzzing the Slack handler in-process: a few hundred signed and unsigned requests with random bodies,
random JSON shapes with the wrong types, random base64 and non-UTF-8 bytes, and random headers. Every
answer is a deliberate status, never an exception or a 5xx, and nothing an unsigned, malformed or
unauthorized request sends changes the state table, EC2 or the Slack message."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idle_reaper.aws import DynamoStateStore, client, table_name
from idle_reaper.handlers import slack as slack_handler
from idle_reaper.sweep import Adapters, run_sweep
from idle_reaper_tools import local
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import LambdaContextStub, signed_request

pytestmark = pytest.mark.integration

SECRET = "local-signing-secret"
T0 = at(14)
DELIBERATE = {200, 400, 401, 404, 405}

_text = st.one_of(st.text(max_size=80), st.binary(max_size=80).map(lambda b: b.decode("latin-1")))
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


def _either(valid: st.SearchStrategy, *, wrong: st.SearchStrategy = _json) -> st.SearchStrategy:
    """Mostly the right shape, sometimes any JSON value at all (the wrong type)."""
    return st.one_of(valid, valid, wrong)


def _bodies(ref: str, response_url: str) -> st.SearchStrategy[tuple[str, bool]]:
    """(body, isBase64Encoded)."""
    actions = st.sampled_from(["keep_2h", "keep_morning", "stop_now", "start_again", "keep_other", "dance"])
    value = st.sampled_from([ref, f"{ref}|keep_4h", f"{ref}|stop_now", "forged"]) | _text
    action = st.fixed_dictionaries(
        {"action_id": _either(actions), "value": _either(value)},
        optional={"selected_option": _either(st.fixed_dictionaries({"value": _either(value)}))},
    )
    click = st.fixed_dictionaries(
        {
            "type": _either(st.just("block_actions")),
            "user": _either(st.fixed_dictionaries({"id": _either(st.sampled_from(["U0STRANGER", "W0X"]) | _text)})),
            "actions": _either(st.lists(_either(action), max_size=2)),
            "response_url": _either(st.sampled_from([response_url, "https://evil.example/x"])),
        }
    )
    command = st.fixed_dictionaries(
        {
            "user_id": st.sampled_from(["U0STRANGER", ""]) | _text,
            "text": st.sampled_from(["status", "help", "keep notebook 2h", "keep i-0 1h", "keep"]) | _text,
            "response_url": st.sampled_from([response_url, "ftp://x"]) | _text,
        },
        optional={"command": _text},
    )
    form = lambda fields: urllib.parse.urlencode(fields)  # noqa: E731
    text_bodies = st.one_of(
        _text,
        _text.map(lambda s: form({"payload": s})),
        _json.map(lambda j: form({"payload": json.dumps(j)})),
        click.map(lambda p: form({"payload": json.dumps(p)})),
        command.map(form),
    )
    raw_bodies = st.one_of(st.binary(max_size=120), st.text(max_size=60).map(str.encode)).map(
        lambda b: base64.b64encode(b).decode()
    )
    return st.one_of(
        text_bodies.map(lambda b: (b, False)),
        raw_bodies.map(lambda b: (b, True)),
        _text.map(lambda b: (b, True)),  # claims base64, is not
    )


def _sign(event: dict, ts: str) -> None:
    body = event["body"]
    raw = base64.b64decode(body) if event["isBase64Encoded"] and _is_b64(body) else body.encode("utf-8", "replace")
    signature = hmac.new(SECRET.encode(), f"v0:{ts}:".encode() + raw, hashlib.sha256).hexdigest()
    event["headers"]["x-slack-signature"] = "v0=" + signature


def _is_b64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except ValueError:
        return False
    return True


@pytest.fixture
def fleet(aws, slack, caplog, clock):  # clock: the handler answers at the sweep's 14:00 of the demo day
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    instance_id = local.launch("notebook", "g5.xlarge", team="ml", launch_time=at(8), owner="U0BOB")
    local.write_metrics(instance_id, lambda _t: (1.0, 0.0), at(11), at(23))
    (decision,) = run_sweep(Adapters.from_environment(clock=lambda: T0), now=T0).decisions
    assert decision.action_label == "warn"
    post = slack.calls_to("chat.postMessage")[-1]
    ref = next(b for b in post.params["blocks"] if b["type"] == "actions")["elements"][0]["value"]
    store = DynamoStateStore(client("dynamodb"), table_name())
    caplog.set_level(logging.INFO, logger=slack_handler.logger.name)
    ec2 = client("ec2")
    return {
        "id": instance_id,
        "ref": ref,
        "store": store,
        "before": store.load([instance_id]),
        "logs": caplog,
        "ec2_state": lambda: ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0][
            "State"
        ]["Name"],
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_requests_get_deliberate_answers_and_change_nothing(fleet, slack, data):
    path = data.draw(st.sampled_from(["/slack/interactions", "/slack/commands", "/", "/slack/other"]), "path")
    body, is_base64 = data.draw(_bodies(fleet["ref"], slack.response_url("fuzz")), "body")
    extra_headers = data.draw(st.dictionaries(st.sampled_from(["x-slack-retry-num", "content-type", "x-a"]), _text))
    signing = data.draw(st.sampled_from(["signed", "tampered", "no-signature", "bad-timestamp", "stale"]), "signing")
    method = data.draw(st.sampled_from(["POST", "POST", "POST", "GET"]), "method")

    event = signed_request(path, "", SECRET, headers=extra_headers)
    event["requestContext"]["http"]["method"] = method
    event.update(body=body, isBase64Encoded=is_base64)
    ts = str(int(time.time()) - (600 if signing == "stale" else 0))
    event["headers"]["x-slack-request-timestamp"] = data.draw(_text, "ts") if signing == "bad-timestamp" else ts
    _sign(event, ts)
    if signing == "tampered":
        event["body"] = body + "x"
    elif signing == "no-signature":
        del event["headers"]["x-slack-signature"]
    replies_before = len(slack.replies)

    response = slack_handler.handler(event, LambdaContextStub())

    assert response["statusCode"] in DELIBERATE, response
    if response["statusCode"] == 200 and response.get("body"):
        assert json.loads(response["body"])["response_type"] == "ephemeral"
    if signing != "signed":
        assert response["statusCode"] in (400, 401) and len(slack.replies) == replies_before
    assert fleet["store"].load([fleet["id"]]) == fleet["before"]
    assert fleet["ec2_state"]() == "running"
    assert not slack.calls_to("chat.update")
    assert not [r for r in fleet["logs"].records if r.levelno >= logging.ERROR]


def test_the_fuzzer_reaches_the_work(fleet, slack):
    """The fuzz above is only worth something if well-formed requests reach the work: one that does."""
    payload = {
        "type": "block_actions",
        "user": {"id": "U0STRANGER"},
        "actions": [{"action_id": "stop_now", "value": fleet["ref"]}],
        "response_url": slack.response_url("reach"),
    }
    event = signed_request("/slack/interactions", urllib.parse.urlencode({"payload": json.dumps(payload)}), SECRET)
    assert slack_handler.handler(event, LambdaContextStub())["statusCode"] == 200
    (reply,) = slack.replies_to("reach")
    assert "can't change" in reply["text"]
    assert fleet["store"].load([fleet["id"]]) == fleet["before"]
