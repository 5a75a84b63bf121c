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
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
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


# The warning's reference and the request's response_url are made by the fixture; the strategies and the known
# requests below carry these stand-ins (letters and digits: the same after form or JSON encoding), replaced in
# the body before it is signed.
REF, REPLY_URL = "R3F0STANDIN", "URL0STANDIN"
PATHS = ("/slack/interactions", "/slack/commands", "/", "/slack/other")
SIGNINGS = ("signed", "tampered", "no-signature", "bad-timestamp", "stale")


def form(fields: dict[str, str]) -> str:
    return urllib.parse.urlencode(fields)


def click(user: object, actions: object) -> str:
    payload = {"type": "block_actions", "user": user, "actions": actions, "response_url": REPLY_URL}
    return form({"payload": json.dumps(payload)})


def known(
    path: str, body: str, is_base64: bool = False, method: str = "POST", signing: str = "signed"
) -> dict[str, object]:
    return {
        "path": path,
        "request": (body, is_base64),
        "extra_headers": {},
        "signing": signing,
        "method": method,
        "bad_timestamp": "1e9",
    }


STRANGER = {"id": "U0STRANGER"}
# Every run: each way of getting the signature wrong, on a command that would be answered if it got through; and
# every kind of body the handler parses, signed (the random requests below reach each only now and then): not a
# form, a form without a JSON payload, a payload that is not an object or has the wrong types, a stranger's click
# on the real warning (keep, stop now, the overflow menu), a forged reference, an action that is not ours, a
# stranger's command, a command without its fields, base64 that is not UTF-8, a body that claims to be base64
# and is not, an unknown path and the wrong method.
STATUS = form({"user_id": "U0STRANGER", "text": "status", "response_url": REPLY_URL})
KNOWN_REQUESTS = [
    *(known("/slack/commands", STATUS, signing=signing) for signing in SIGNINGS[1:]),
    known("/slack/interactions", "not a form %%"),
    known("/slack/interactions", form({"payload": "{not json"})),
    known("/slack/interactions", form({"payload": json.dumps([1, "block_actions"])})),
    known("/slack/interactions", click(7, "keep_2h")),
    known("/slack/interactions", click(STRANGER, [{"action_id": "keep_2h", "value": REF}])),
    known("/slack/interactions", click(STRANGER, [{"action_id": "stop_now", "value": REF}])),
    known(
        "/slack/interactions",
        click(STRANGER, [{"action_id": "keep_other", "value": REF, "selected_option": {"value": f"{REF}|keep_4h"}}]),
    ),
    known("/slack/interactions", click(STRANGER, [{"action_id": "stop_now", "value": "forged"}])),
    known("/slack/interactions", click(STRANGER, [{"action_id": "dance", "value": REF}])),
    known("/slack/commands", form({"user_id": "U0STRANGER", "text": "keep notebook 2h", "response_url": REPLY_URL})),
    known("/slack/commands", form({"text": "status"})),
    known("/slack/interactions", base64.b64encode(b"payload=\xff\xfe").decode(), is_base64=True),
    known("/slack/interactions", "payload=not base64!", is_base64=True),
    known("/", form({"text": "status"})),
    known("/slack/interactions", click(STRANGER, []), method="GET"),
]


def known_requests(test: Any) -> Any:
    for request in reversed(KNOWN_REQUESTS):
        test = example(**request)(test)
    return test


# 300 random requests -> 100, weighted towards the ones that get past the signature check to a real route (signed 4
# in 8 instead of 1 in 5, a real route 4 in 6 instead of 2 in 4): 44 of the 100 reached the parsing and the work in
# each of two runs counted, where 22 and 52 of the 300 did. The four ways of getting the signature wrong, which all
# end at the same check, came 0 to 14 times each in a run of the 100 (about 30 to 70 in the 300), so the known requests
# above include each of them, and every kind of body, every run. Seeded bugs, 3 runs each: a request without a
# signature header let through (the 300 caught it 3/3, the 100 alone 2/3, the known unsigned command 3/3), a payload
# that is JSON but not an object passed on (3/3 before and after), and a stranger allowed to answer, which the 300
# never caught (only test_the_fuzzer_reaches_the_work did) and the known stranger's clicks now catch 3/3.
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(PATHS[:2] * 2 + PATHS[2:]),
    request=_bodies(REF, REPLY_URL),
    extra_headers=st.dictionaries(st.sampled_from(["x-slack-retry-num", "content-type", "x-a"]), _text),
    signing=st.sampled_from(SIGNINGS[:1] * 4 + SIGNINGS[1:]),
    method=st.sampled_from(["POST", "POST", "POST", "GET"]),
    bad_timestamp=_text,
)
@known_requests
def test_fuzzed_requests_get_deliberate_answers_and_change_nothing(
    fleet: dict[str, Any],
    slack: Any,
    path: str,
    request: tuple[str, bool],
    extra_headers: dict[str, str],
    signing: str,
    method: str,
    bad_timestamp: str,
) -> None:
    body, is_base64 = request
    body = body.replace(REF, fleet["ref"]).replace(REPLY_URL, slack.response_url("fuzz"))

    event = signed_request(path, "", SECRET, headers=extra_headers)
    event["requestContext"]["http"]["method"] = method
    event.update(body=body, isBase64Encoded=is_base64)
    ts = str(int(time.time()) - (600 if signing == "stale" else 0))
    event["headers"]["x-slack-request-timestamp"] = bad_timestamp if signing == "bad-timestamp" else ts
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
