"""Slack nudges people can answer: the real slack-sdk client against the local Slack fake, signed
requests fed to the Lambda handler as Function URL events, the lifecycle in moto's DynamoDB."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import logging
import time
import urllib.parse
from datetime import timedelta

import pytest

from idle_reaper import aws
from idle_reaper.core import State
from idle_reaper.handlers import slack as slack_handler
from idle_reaper.slack.requests import ButtonWork, WorkEvent
from idle_reaper.slack.routing import Region
from idle_reaper.sweep import Adapters, run_sweep
from idle_reaper_tools import local
from idle_reaper_tools.demo import at
from idle_reaper_tools.fake_slack import FakeSlack, LambdaContextStub, signed_request

pytestmark = pytest.mark.integration

SECRET = "local-signing-secret"
T0 = at(14)


def signed_event(
    path: str, body: str, *, secret: str = SECRET, timestamp: int | None = None, headers: dict[str, str] | None = None
) -> dict:
    return signed_request(path, body, secret, timestamp=timestamp, headers=headers)


def Context() -> LambdaContextStub:
    return LambdaContextStub()


_FAKE: list[FakeSlack] = []
_request_numbers = itertools.count()


@pytest.fixture(autouse=True)
def _replies_from(slack_server):
    _FAKE[:] = [slack_server]


def answered(path: str, body: str, reply_to: str, **kw) -> dict:
    """The handler's answer to a signed request, with what the work later said through the response_url."""
    response = slack_handler.handler(signed_event(path, body, **kw), Context())
    return {**response, "replies": _FAKE[0].replies_to(reply_to)}


def click(user: str, action_id: str, value: str, **kw) -> dict:
    name = f"click-{next(_request_numbers)}"
    payload = {
        "type": "block_actions",
        "user": {"id": user},
        "actions": [{"action_id": action_id, "value": value}],
        "response_url": _FAKE[0].response_url(name),
    }
    return answered("/slack/interactions", urllib.parse.urlencode({"payload": json.dumps(payload)}), name, **kw)


def command(user: str, text: str) -> dict:
    name = f"command-{next(_request_numbers)}"
    form = {"command": "/idle-reaper", "text": text, "user_id": user, "response_url": _FAKE[0].response_url(name)}
    return answered("/slack/commands", urllib.parse.urlencode(form), name)


def ephemeral_text(response: dict) -> str:
    """The one ephemeral answer: in the acknowledgement itself, or posted to the response_url by the work."""
    assert response["statusCode"] == 200
    texts = [r["text"] for r in response["replies"] if r["response_type"] == "ephemeral"]
    if response["body"]:
        body = json.loads(response["body"])
        assert body["response_type"] == "ephemeral"
        texts.append(body["text"])
    assert len(texts) == 1, texts
    return texts[0]


def silent(response: dict) -> bool:
    """Acknowledged with an empty 200 and no ephemeral answer: the work updated the message itself."""
    return response["statusCode"] == 200 and response["body"] == "" and not response["replies"]


def idle(_t):
    return (1.0, 0.0)


@pytest.fixture
def notebook(aws, slack, clock):
    """An idle GPU notebook owned by bob (email tag), in team ml with a channel and a member."""
    policy = local.team_policy_json(
        idle_minutes=60, warn_minutes=20, slack_channel="C0MLTEAM", members=["U0MEMBER", "S0GROUP"]
    )
    local.init_account(teams={"ml": policy})
    aws_settings = json.loads(aws_settings_text())
    aws_settings["admins"] = ["U0ADMIN"]
    aws_client("ssm").put_parameter(
        Name="/idle-reaper/settings", Value=json.dumps(aws_settings), Type="String", Overwrite=True
    )
    slack.users_by_email["bob@example.com"] = "U0BOB"
    slack.usergroups["S0GROUP"] = ["U0GROUPIE"]
    instance_id = local.launch("notebook", "g5.xlarge", team="ml", launch_time=at(8), owner="bob@example.com")
    local.write_metrics(instance_id, idle, at(11), at(23))
    return instance_id


def aws_client(service):
    return aws.client(service)


def aws_settings_text() -> str:
    return aws_client("ssm").get_parameter(Name="/idle-reaper/settings")["Parameter"]["Value"]


def sweep(now):
    # Slack's notifier tells the sweep's time (the demo's fixed day), not today's: its references last a week.
    return run_sweep(Adapters.from_environment(clock=lambda: now), now=now)


def record(instance_id):
    return aws.DynamoStateStore(aws_client("dynamodb"), aws.table_name()).load([instance_id])[instance_id]


def warning_ref(slack) -> str:
    post = slack.calls_to("chat.postMessage")[-1]
    actions = next(b for b in post.params["blocks"] if b["type"] == "actions")
    return actions["elements"][0]["value"]


def test_warning_goes_to_owner_and_channel_with_the_evidence_and_buttons(notebook, slack):
    report = sweep(T0)
    (d,) = report.decisions
    assert d.action_label == "warn"
    posts = slack.calls_to("chat.postMessage")
    assert sorted(p.params["channel"] for p in posts) == ["C0MLTEAM", "D0BOB"]
    blocks = posts[0].params["blocks"]
    text = json.dumps(blocks)
    assert "notebook" in text and notebook in text and "g5.xlarge" in text and "$1.01 per hour" in text
    # mrkdwn-escaped, as all text from outside is: Slack shows "max CPU 1.0% < 5.0%"
    assert "max CPU 1.0% &lt; 5.0%" in text and "max GPU 0.0% &lt; 5.0%" in text
    assert "<!date^" in text, "the stop time must be a Slack date token"
    actions = next(b for b in blocks if b["type"] == "actions")
    ids = [e["action_id"] for e in actions["elements"]]
    assert ids == ["keep_2h", "keep_morning", "stop_now", "keep_other"]
    overflow = actions["elements"][3]["options"]
    assert [o["text"]["text"] for o in overflow] == ["Keep 1 h", "Keep 4 h"]
    values = {e.get("value") for e in actions["elements"][:3]}
    assert len(values) == 1 and notebook not in values.pop(), "button values must be opaque references"
    stored = record(notebook)
    assert stored.warning_delivered_at == T0 and stored.owner_slack_id == "U0BOB"
    assert len(stored.messages) == 2


def test_owner_email_is_looked_up_once_and_cached(notebook, slack):
    sweep(T0)
    state = record(notebook)
    # A second warning later (after activity resets the stretch) must not look the email up again.
    from idle_reaper.slack import SlackNotifier, make_client

    store = aws.DynamoStateStore(aws_client("dynamodb"), aws.table_name())
    notifier = SlackNotifier(make_client("xoxb", 5), store, lambda: T0 + timedelta(hours=3))  # the same day
    assert notifier.resolve_owner("bob@example.com") == "U0BOB"
    assert len(slack.calls_to("users.lookupByEmail")) == 1
    assert state.owner_slack_id == "U0BOB"


def test_keep_2h_snoozes_once_and_updates_the_message(notebook, slack, clock):
    sweep(T0)
    ref = warning_ref(slack)
    response = click("U0BOB", "keep_2h", ref)
    assert silent(response)
    stored = record(notebook)
    assert stored.state is State.SNOOZED and stored.snoozed_until == T0 + timedelta(hours=2)
    assert stored.snoozed_by == "U0BOB" and stored.warned_at is None
    updates = slack.calls_to("chat.update")
    assert len(updates) == 2 and all("<@U0BOB> kept" in json.dumps(u.params["blocks"]) for u in updates)
    # Slack retries the same interaction, or bob double-clicks: nothing more happens.
    again = click("U0BOB", "keep_2h", ref, headers={"x-slack-retry-num": "1"})
    assert "no longer current" in ephemeral_text(again)
    assert record(notebook) == stored
    assert len(slack.calls_to("chat.update")) == 2


def test_a_click_while_the_sweep_is_still_posting_is_answered_try_again_then_applied(notebook, slack, clock):
    """The buttons' reference is on the record from the claim on: a click made before the sweep has recorded
    the outcome (it is still posting other owners' warnings, or its write failed) finds the machine, and is
    answered "try again" while the sweep holds it; once the sweep is done the same click is applied."""
    from idle_reaper.slack import SlackNotifier, make_client

    answers: list[str] = []

    class ClickDuringTheSweep(SlackNotifier):
        def warn(self, decision):
            delivery = super().warn(decision)
            answers.append(ephemeral_text(click("U0BOB", "keep_2h", warning_ref(slack))))
            return delivery

    store = aws.DynamoStateStore(aws_client("dynamodb"), aws.table_name())
    adapters = Adapters.from_environment(notifier=ClickDuringTheSweep(make_client("xoxb-local-fake", 5), store))
    run_sweep(adapters, now=T0)
    assert len(answers) == 1 and "Try again" in answers[0] and "no longer current" not in answers[0]
    assert record(notebook).state is State.WARNED
    assert silent(click("U0BOB", "keep_2h", warning_ref(slack)))
    assert record(notebook).state is State.SNOOZED and record(notebook).snoozed_by == "U0BOB"


@pytest.mark.parametrize("user", ["U0MEMBER", "U0GROUPIE", "U0ADMIN"])
def test_members_group_members_and_admins_may_answer(notebook, slack, user):
    sweep(T0)
    assert silent(click(user, "keep_4h", warning_ref(slack).split("|")[0]))
    assert record(notebook).snoozed_by == user


def test_overflow_choice_is_capped_and_applied(notebook, slack, clock):
    sweep(T0)
    ref = warning_ref(slack)
    payload = {
        "type": "block_actions",
        "user": {"id": "U0BOB"},
        "actions": [{"action_id": "keep_other", "selected_option": {"value": f"{ref}|keep_4h"}}],
        "response_url": slack.response_url("overflow"),
    }
    body = urllib.parse.urlencode({"payload": json.dumps(payload)})
    assert silent(answered("/slack/interactions", body, "overflow"))
    assert record(notebook).snoozed_until == T0 + timedelta(hours=4)


def test_a_team_in_safe_mode_is_answered_by_the_owner_and_admins_only(notebook, slack, clock):
    sweep(T0)
    ref = warning_ref(slack)
    aws_client("ssm").put_parameter(
        Name="/idle-reaper/teams/ml", Value='{"idle_minutes": 5}', Type="String", Overwrite=True
    )
    assert "can't change" in ephemeral_text(click("U0MEMBER", "keep_2h", ref))
    assert silent(click("U0BOB", "keep_2h", ref))
    assert record(notebook).snoozed_until == T0 + timedelta(hours=2)


def test_stranger_cannot_change_the_machine(notebook, slack):
    sweep(T0)
    before = record(notebook)
    text = ephemeral_text(click("U0STRANGER", "keep_2h", warning_ref(slack)))
    assert "can't change" in text
    assert record(notebook) == before and not slack.calls_to("chat.update")


def test_forged_reference_and_unknown_action_do_nothing(notebook, slack):
    sweep(T0)
    before = record(notebook)
    assert "no longer current" in ephemeral_text(click("U0BOB", "keep_2h", "forged-reference"))
    assert "no longer current" in ephemeral_text(click("U0BOB", "keep_2h", notebook))
    assert "not an idle-reaper action" in ephemeral_text(click("U0BOB", "keep_forever", warning_ref(slack)))
    assert record(notebook) == before


def test_stop_now_then_start_again(notebook, slack, clock):
    sweep(T0)
    assert silent(click("U0BOB", "stop_now", warning_ref(slack)))
    assert local.instance_states([notebook])[notebook] == "stopped"
    stopped = record(notebook)
    assert stopped.state is State.REAPED and stopped.last_action == "stop"
    update = slack.calls_to("chat.update")[-1].params
    start = next(b for b in update["blocks"] if b["type"] == "actions")["elements"][0]
    assert start["action_id"] == "start_again"
    clock["t"] = T0 + timedelta(hours=3)
    assert silent(click("U0BOB", "start_again", start["value"]))
    assert local.instance_states([notebook])[notebook] == "running"
    started = record(notebook)
    assert started.state is State.ACTIVE and started.warned_at is None
    assert "saved ~$3.02" in json.dumps(slack.calls_to("chat.update")[-1].params["blocks"])


def test_snoozes_per_day_are_capped(notebook, slack, clock):
    policy = json.loads(local.team_policy_json(idle_minutes=60, warn_minutes=20, max_snoozes_per_day=1))
    aws_client("ssm").put_parameter(
        Name="/idle-reaper/teams/ml", Value=json.dumps(policy), Type="String", Overwrite=True
    )
    slack.users_by_email["bob@example.com"] = "U0BOB"
    sweep(T0)
    assert silent(click("U0BOB", "keep_1h", warning_ref(slack)))
    assert record(notebook).snoozes_today == 1
    assert "already kept 1 times today" in ephemeral_text(command("U0BOB", f"keep {notebook} 30m"))


def test_slash_command_status_keep_and_help(notebook, slack, clock):
    sweep(T0)
    status = ephemeral_text(command("U0BOB", "status"))
    assert "notebook" in status and "warned" in status
    kept = ephemeral_text(command("U0BOB", "keep notebook 90m"))
    assert kept.startswith("Kept notebook") and record(notebook).snoozed_until == T0 + timedelta(minutes=90)
    assert "Not a duration" in ephemeral_text(command("U0BOB", "keep notebook forever"))
    assert "No machine, endpoint or Studio app named `nosuchbox` among yours" in ephemeral_text(
        command("U0BOB", "keep nosuchbox 1h")
    )
    assert "can't change" in ephemeral_text(command("U0STRANGER", f"keep {notebook} 1h"))
    assert "/idle-reaper status" in ephemeral_text(command("U0BOB", "help"))
    assert "Unknown command" in ephemeral_text(command("U0BOB", "dance"))


def test_bad_requests_get_4xx_and_change_nothing(notebook, slack):
    sweep(T0)
    before = record(notebook)
    ref = warning_ref(slack)
    body = urllib.parse.urlencode(
        {
            "payload": json.dumps(
                {"type": "block_actions", "user": {"id": "U0BOB"}, "actions": [{"action_id": "keep_2h", "value": ref}]}
            )
        }
    )
    assert (
        slack_handler.handler(signed_event("/slack/interactions", body, secret="wrong"), Context())["statusCode"] == 401
    )
    stale = int(time.time()) - 6 * 60
    assert (
        slack_handler.handler(signed_event("/slack/interactions", body, timestamp=stale), Context())["statusCode"]
        == 401
    )
    unsigned = signed_event("/slack/interactions", body)
    del unsigned["headers"]["x-slack-signature"]
    assert slack_handler.handler(unsigned, Context())["statusCode"] == 401
    assert slack_handler.handler(signed_event("/slack/interactions", "%%%not form"), Context())["statusCode"] == 400
    not_json = urllib.parse.urlencode({"payload": "{not json"})
    assert slack_handler.handler(signed_event("/slack/interactions", not_json), Context())["statusCode"] == 400
    assert record(notebook) == before


def test_rate_limited_slack_is_retried_after_retry_after(notebook, slack):
    slack.rate_limit_next, slack.retry_after = 1, 1
    sweep(T0)
    assert record(notebook).warning_delivered_at == T0
    # The first call (the owner lookup) got a 429 and was retried after Retry-After.
    lookups = [c for c in slack.calls if c.method == "users.lookupByEmail"]
    assert [c.limited for c in lookups] == [True, False]
    assert len(slack.calls_to("users.lookupByEmail")) == 1 and len(slack.calls_to("chat.postMessage")) == 2


def test_retry_after_beyond_the_time_budget_is_not_waited_for(notebook, slack):
    # Rate limited with a Retry-After past the budget: the owner look-up at the claim and again at the post.
    slack.rate_limit_next, slack.retry_after = 2, 600
    started = time.monotonic()
    sweep(T0)
    assert time.monotonic() - started < 30
    assert record(notebook).warning_delivered_at is None, "undelivered: stays pending for the next sweep"


def test_revoked_token_leaves_the_warning_pending_and_holds_the_stop(notebook, slack):
    slack.auth_revoked = True
    sweep(T0)
    pending = record(notebook)
    assert pending.warned_at == T0 and pending.warning_delivered_at is None
    d = next(iter(sweep(T0 + timedelta(minutes=60)).decisions))
    assert d.action_label == "none" and "not delivered" in d.reason
    assert local.instance_states([notebook])[notebook] == "running"
    for minutes in range(90, 240, 30):  # sweeps keep watching (a warning lapses if nobody watches)
        assert sweep(T0 + timedelta(minutes=minutes)).decisions[0].action_label == "none"
    # Past undelivered_warning_max_minutes (240) the stop proceeds, and the record says why.
    d = next(iter(sweep(T0 + timedelta(minutes=240)).decisions))
    assert d.action_label == "stop" and "never delivered" in d.reason
    assert local.instance_states([notebook])[notebook] == "stopped"


def test_slack_down_then_back_delivers_on_the_next_sweep(notebook, slack):
    slack.down = True
    sweep(T0)
    assert record(notebook).warning_delivered_at is None
    slack.down = False
    sweep(T0 + timedelta(minutes=5))
    assert record(notebook).warning_delivered_at == T0 + timedelta(minutes=5)
    # The owner gets the full warn_minutes from delivery: no stop at T0+20.
    d = next(iter(sweep(T0 + timedelta(minutes=20)).decisions))
    assert d.action_label == "none"
    d = next(iter(sweep(T0 + timedelta(minutes=25)).decisions))
    assert d.action_label == "stop"


def test_keep_2h_then_rewarned_then_stopped_end_to_end(notebook, slack, clock):
    """warn -> owner clicks Keep 2 h -> the next sweeps do not stop it -> warned again after 2 h ->
    no answer -> stopped -> message updated."""
    assert sweep(T0).decisions[0].action_label == "warn"
    click("U0BOB", "keep_2h", warning_ref(slack))
    for minutes in range(5, 120, 15):
        d = sweep(T0 + timedelta(minutes=minutes)).decisions[0]
        assert d.state is State.SNOOZED and d.action_label == "none"
    d = sweep(T0 + timedelta(hours=2)).decisions[0]
    assert d.action_label == "warn"
    second_warning = {f"{c.params['channel']}|{c.params['_ts']}" for c in slack.calls_to("chat.postMessage")[-2:]}
    d = sweep(T0 + timedelta(hours=2, minutes=10)).decisions[0]
    assert d.action_label == "none" and d.state is State.WARNED
    d = sweep(T0 + timedelta(hours=2, minutes=20)).decisions[0]
    assert d.action_label == "stop"
    assert local.instance_states([notebook])[notebook] == "stopped"
    stopped = record(notebook)
    assert set(stopped.messages) == second_warning, "the second warning's messages are the ones updated"
    for message in stopped.messages:
        final = json.dumps(slack.messages[tuple(message.split("|"))]["blocks"])
        assert "Stopped" in final and "start_again" in final


def test_secrets_signatures_and_bodies_never_reach_the_logs(notebook, slack, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger=slack_handler.logger.name)
    sweep(T0)
    payload = {"type": "block_actions", "user": "U0BOB", "actions": "keep_2h", "response_url": "sensitive-url"}
    malformed = signed_event("/slack/interactions", urllib.parse.urlencode({"payload": json.dumps(payload)}))
    forged = signed_event("/slack/interactions", "payload=forged-body-text", secret="guessed-secret")
    assert slack_handler.handler(malformed, Context())["statusCode"] == 400
    assert slack_handler.handler(forged, Context())["statusCode"] == 401
    assert silent(click("U0BOB", "keep_2h", warning_ref(slack)))
    monkeypatch.setattr(Region, "record_of_ref", explode)  # an internal error is logged with its traceback
    assert "could not record" in ephemeral_text(click("U0BOB", "keep_2h", "some-ref"))
    assert "rejected Slack request" in caplog.text and "answering Slack failed" in caplog.text
    for secret in ("xoxb-local-fake", SECRET, "guessed-secret"):
        assert secret not in caplog.text
    for event in (malformed, forged):
        assert event["headers"]["x-slack-signature"] not in caplog.text
    assert "sensitive-url" not in caplog.text and "forged-body-text" not in caplog.text


def explode(*args, **kwargs):
    raise RuntimeError("the state table is unreachable")


def emitted_metrics(out: str) -> list[str]:
    """The metric names in the EMF blobs Powertools printed to stdout."""
    blobs = [json.loads(line) for line in out.splitlines() if line.startswith("{") and "_aws" in line]
    return [m["Name"] for b in blobs for d in b["_aws"]["CloudWatchMetrics"] for m in d["Metrics"]]


class CapturingLambda:
    """Lambda's Invoke API as the handler calls it: records the asynchronous invocations."""

    def __init__(self, fail: bool = False) -> None:
        self.invocations: list[dict] = []
        self.fail = fail

    def invoke(self, **kwargs) -> dict:
        if self.fail:
            raise aws_error("TooManyRequestsException")
        self.invocations.append(kwargs)
        return {"StatusCode": 202}


def aws_error(code: str):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}}, "Invoke")


@pytest.fixture
def in_lambda(monkeypatch):
    fake = CapturingLambda()
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "idle-reaper-slack")
    monkeypatch.setattr(slack_handler, "lambda_client", lambda: fake)
    return fake


def test_in_lambda_a_click_is_acknowledged_at_once_and_worked_on_in_the_async_invocation(
    notebook, slack, clock, in_lambda
):
    sweep(T0)
    before, updates = record(notebook), len(slack.calls_to("chat.update"))
    assert silent(click("U0BOB", "keep_2h", warning_ref(slack)))
    assert record(notebook) == before and len(slack.calls_to("chat.update")) == updates, "nothing done before the ack"
    (invocation,) = in_lambda.invocations
    assert invocation["FunctionName"] == "idle-reaper-slack" and invocation["InvocationType"] == "Event"
    event = json.loads(invocation["Payload"])
    assert "requestContext" not in event and "body" not in event
    # Lambda delivers the payload to the same handler:
    assert slack_handler.handler(event, Context()) == {"done": True}
    kept = record(notebook)
    assert kept.state is State.SNOOZED and kept.snoozed_by == "U0BOB"
    assert len(slack.calls_to("chat.update")) == updates + 2
    # A refusal is reported through the response_url of the request it answers.
    assert silent(command("U0STRANGER", f"keep {notebook} 1h"))
    event = json.loads(in_lambda.invocations[-1]["Payload"])
    slack_handler.handler(event, Context())
    (reply,) = slack.replies_to(event["idle_reaper_slack_work"]["response_url"].rsplit("/", 1)[-1])
    assert "can't change" in reply["text"] and reply["response_type"] == "ephemeral"
    assert record(notebook) == kept


def test_a_failed_handoff_or_failed_work_says_so_and_emits_the_failure_metric(
    notebook, slack, clock, in_lambda, monkeypatch, capsys
):
    sweep(T0)
    before = record(notebook)
    capsys.readouterr()
    in_lambda.fail = True
    assert "could not record" in ephemeral_text(click("U0BOB", "keep_2h", warning_ref(slack)))
    assert emitted_metrics(capsys.readouterr().out) == ["SlackRequestFailures"]
    in_lambda.fail = False
    assert silent(click("U0BOB", "keep_2h", warning_ref(slack)))
    monkeypatch.setattr(Region, "record_of_ref", explode)
    assert emitted_metrics(capsys.readouterr().out) == []
    event = json.loads(in_lambda.invocations[-1]["Payload"])
    assert slack_handler.handler(event, Context()) == {"done": True}, "an async failure is not retried by Lambda"
    (reply,) = slack.replies_to(event["idle_reaper_slack_work"]["response_url"].rsplit("/", 1)[-1])
    assert "could not record" in reply["text"]
    assert emitted_metrics(capsys.readouterr().out) == ["SlackRequestFailures"]
    assert slack_handler.handler({"idle_reaper_slack_work": {"kind": "dance"}}, Context()) == {"done": False}
    assert emitted_metrics(capsys.readouterr().out) == ["SlackRequestFailures"]
    assert record(notebook) == before


def test_a_function_url_request_is_never_taken_for_internal_work(notebook, slack, clock, in_lambda):
    sweep(T0)
    before = record(notebook)
    ref, url = warning_ref(slack), slack.response_url("w")
    work = ButtonWork(user="U0BOB", action_id="stop_now", value=ref, response_url=url)
    internal = WorkEvent(idle_reaper_slack_work=work).to_event()
    as_body = signed_event("/slack/interactions", json.dumps(internal))
    assert slack_handler.handler(as_body, Context())["statusCode"] == 400
    merged = {**signed_event("/slack/interactions", ""), **internal}  # the key smuggled into a URL event
    assert slack_handler.handler(merged, Context())["statusCode"] == 400
    del merged["headers"]["x-slack-signature"]
    assert slack_handler.handler(merged, Context())["statusCode"] == 401
    assert not in_lambda.invocations and not slack.replies_to("w")
    assert record(notebook) == before and local.instance_states([notebook])[notebook] == "running"


def test_a_signed_body_that_is_not_utf8_or_has_wrong_json_types_is_a_400(notebook, slack):
    sweep(T0)
    before = record(notebook)
    raw = b"payload=\xff\xfe\x00"
    event = signed_event("/slack/interactions", "")
    ts = event["headers"]["x-slack-request-timestamp"]
    signature = hmac.new(SECRET.encode(), f"v0:{ts}:".encode() + raw, hashlib.sha256).hexdigest()
    event.update(body=base64.b64encode(raw).decode(), isBase64Encoded=True)
    event["headers"]["x-slack-signature"] = "v0=" + signature
    assert slack_handler.handler(event, Context()) == {
        "statusCode": 400,
        "headers": {"Content-Type": "text/plain"},
        "body": "body is not UTF-8",
    }
    wrong_types = {"type": "block_actions", "user": "U0BOB", "actions": [{"action_id": "keep_2h"}], "response_url": 1}
    body = urllib.parse.urlencode({"payload": json.dumps({**wrong_types, "actions": ["keep_2h"]})})
    response = slack_handler.handler(signed_event("/slack/interactions", body), Context())
    assert response["statusCode"] == 400 and response["body"].startswith("payload user")
    assert record(notebook) == before and not slack.calls_to("chat.update")


def test_status_and_keep_find_the_callers_machines_by_index_and_others_by_instance_id(
    notebook, slack, clock, monkeypatch
):
    sweep(T0)
    monkeypatch.setattr(aws.DynamoStateStore, "all_records", explode)  # no scan on the Slack path
    assert "notebook" in ephemeral_text(command("U0BOB", "status"))
    assert "You own no machines" in ephemeral_text(command("U0MEMBER", "status"))
    # A team member may keep bob's machine, by its instance id (names are looked up among one's own).
    assert "among yours" in ephemeral_text(command("U0MEMBER", "keep notebook 1h"))
    assert record(notebook).snoozed_by is None
    assert ephemeral_text(command("U0MEMBER", f"keep {notebook} 1h")).startswith("Kept notebook")
    assert record(notebook).snoozed_by == "U0MEMBER"
    assert "among yours" in ephemeral_text(command("U0MEMBER", "keep i-0000000000000dead 1h"))


def test_clients_are_built_only_for_the_regions_consulted(notebook, slack, clock, monkeypatch):
    monkeypatch.setenv("IDLE_REAPER_REGIONS", "us-east-1,eu-west-1,ap-southeast-2")
    sweep(T0)
    built = []
    real = slack_handler.client

    def counting(service, region=None):
        built.append(region)
        return real(service, region)

    monkeypatch.setattr(slack_handler, "client", counting)
    assert silent(click("U0BOB", "keep_2h", warning_ref(slack)))
    assert set(built) == {"us-east-1"}, "the reference was found in the local region: no other region's clients"


def test_invalid_policy_alerts_admins_once_per_version_and_retries_when_slack_is_down(notebook, slack):
    aws_client("ssm").put_parameter(
        Name="/idle-reaper/teams/ml", Value='{"idle_minutes": 5}', Type="String", Overwrite=True
    )
    slack.down = True
    sweep(T0)
    assert not [c for c in slack.calls_to("chat.postMessage") if "admin alert" in c.params.get("text", "")]
    slack.down = False
    sweep(T0 + timedelta(minutes=5))
    sweep(T0 + timedelta(minutes=10))
    alerts = [c for c in slack.calls_to("chat.postMessage") if "admin alert" in c.params.get("text", "")]
    assert len(alerts) == 1 and alerts[0].params["channel"] == "D0ADMIN"
    assert "/idle-reaper/teams/ml" in alerts[0].params["text"] and "idle_minutes" in alerts[0].params["text"]
    assert local.instance_states([notebook])[notebook] == "running"


def test_admin_alerts_also_reach_the_admin_channel_when_one_is_set(notebook, slack):
    settings = json.loads(aws_settings_text())
    settings["admin_channel"] = "C0ADMINS"
    aws_client("ssm").put_parameter(
        Name="/idle-reaper/settings", Value=json.dumps(settings), Type="String", Overwrite=True
    )
    aws_client("ssm").put_parameter(
        Name="/idle-reaper/teams/ml", Value='{"idle_minutes": 5}', Type="String", Overwrite=True
    )
    sweep(T0)
    alerts = [c for c in slack.calls_to("chat.postMessage") if "admin alert" in c.params.get("text", "")]
    assert sorted(c.params["channel"] for c in alerts) == ["C0ADMINS", "D0ADMIN"]


def test_one_slack_app_answers_for_machines_in_another_region(aws, slack, clock, monkeypatch):
    """eu-west-1's sweep posts with the shared app; the click reaches us-east-1's handler, which finds
    the reference in eu-west-1's table and acts there."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    local.init_account(teams={"ml": local.team_policy_json(idle_minutes=60, warn_minutes=20)})
    slack.users_by_email["bob@example.com"] = "U0BOB"
    far = local.launch("far-notebook", "m5.large", team="ml", launch_time=at(8), owner="bob@example.com")
    local.write_metrics(far, idle, at(11), at(23))
    assert sweep(T0).decisions[0].action_label == "warn"
    ref = warning_ref(slack)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    local.init_account()  # the handler's own region has its table too, without this machine
    assert "no longer current" in ephemeral_text(click("U0BOB", "stop_now", ref))  # not routed yet
    monkeypatch.setenv("IDLE_REAPER_REGIONS", "us-east-1,eu-west-1")
    assert silent(click("U0BOB", "stop_now", ref))
    states = aws_client_in("ec2", "eu-west-1").describe_instances(InstanceIds=[far])
    assert states["Reservations"][0]["Instances"][0]["State"]["Name"] == "stopped"
    assert "far-notebook" in ephemeral_text(command("U0BOB", "status"))


def aws_client_in(service, region):
    return aws.client(service, region)


def test_handler_works_in_a_fresh_process_and_rejects_a_malformed_timestamp():
    """Lambda imports only the handler module: it must not depend on anything else being imported."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from idle_reaper.handlers import slack as h\n"
        "from idle_reaper_tools.fake_slack import LambdaContextStub\n"
        "assert 'idle_reaper.sweep' not in sys.modules\n"
        "for ts in ('abc', '', '1e9'):\n"
        "    http = {'method': 'POST', 'path': '/slack/commands'}\n"
        "    ev = {'headers': {'x-slack-request-timestamp': ts, 'x-slack-signature': 'v0=00'}, 'body': 'a=b',\n"
        "          'rawPath': '/slack/commands', 'requestContext': {'http': http}}\n"
        "    print(h.handler(ev, LambdaContextStub())['statusCode'])\n"
    )
    env = {**__import__("os").environ, "SLACK_BOT_TOKEN": "xoxb-x", "SLACK_SIGNING_SECRET": "s"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["401", "401", "401"]
