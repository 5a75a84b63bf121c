"""Slack's interactivity requests and slash command, from a Lambda Function URL. Wiring only.

A request is answered at once: the Slack signature is checked over the raw body before anything is
read, the payload's shape is validated (payloads.py), and the handler acknowledges (Slack gives up
after 3 s) and hands the validated work to itself through an asynchronous Lambda invocation. That
invocation does the work (routing.py, answers.py) and reports back through the payload's response_url
and chat.update. Outside Lambda the work runs inline, after the acknowledgement is computed.

Every request gets a deliberate answer: 4xx for a malformed or unsigned one, 200 with an explanation
for a click that cannot be applied. An internal failure emits the SlackRequestFailures metric. Logs say
what was rejected and why, never secrets, signatures or bodies."""

from __future__ import annotations

import functools
import json
import os
from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools import Metrics
from aws_lambda_powertools.event_handler import LambdaFunctionUrlResolver, Response
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import ValidationError
from slack_sdk.signature import SignatureVerifier
from slack_sdk.webhook import WebhookClient

from idle_reaper.aws.clients import client, ssm_prefix, table_name
from idle_reaper.aws.regions import current_region, watched_regions
from idle_reaper.notify import logger
from idle_reaper.slack.notifier import SlackNotConfigured, load_secrets, make_client
from idle_reaper.slack.requests import (
    ButtonWork,
    CommandWork,
    Malformed,
    WorkEvent,
    button_work,
    chosen_action,
    command_work,
    is_work_event,
    parse_click,
    parse_command,
    request_text,
    response_url_allowed,
)
from idle_reaper.slack.routing import Region, Router

app = LambdaFunctionUrlResolver()
metrics = Metrics(namespace="IdleReaper", service="idle-reaper")
FAILURE_METRIC = "SlackRequestFailures"
# The work runs after the acknowledgement, inside the function's 30 s timeout: a 429 retry may wait this long.
SLACK_BUDGET_SECONDS = 10.0
COULD_NOT_RECORD = "idle-reaper could not record that; try again."


def clock() -> datetime:
    return datetime.now(UTC)


def build_router(bot_token: str) -> Router:
    """This region first, then the other regions the stack lists (IDLE_REAPER_REGIONS); clients are lazy."""
    slack_client = make_client(bot_token, SLACK_BUDGET_SECONDS)
    regions = watched_regions(current_region())
    table, prefix = table_name(), ssm_prefix()
    connections = [functools.partial(regional_client, region=r) for r in regions]
    return Router([Region(connect, table, prefix, slack_client, clock) for connect in connections])


# boto3 clients take tens of milliseconds to build: one per service and region per container, on first use.
_clients: dict[tuple[str, str | None], Any] = {}


def regional_client(service: str, region: str | None = None) -> Any:
    if (service, region) not in _clients:
        _clients[service, region] = client(service, region)
    return _clients[service, region]


def reset_clients() -> None:
    """Forget the kept clients: the next ones are made afresh (tests: each against its own emulated account,
    with whatever answers it put in front of it)."""
    _clients.clear()


def lambda_client() -> Any:
    return regional_client("lambda")


def record_failure(what: str) -> None:
    """An internal error (ours, not the caller's): logged with its traceback, counted for the alarm."""
    logger.exception(what)
    metrics.add_metric(name=FAILURE_METRIC, unit=MetricUnit.Count, value=1)
    metrics.flush_metrics()


# ---------------------------------------------------------------------------------------------
# The work: in the asynchronous invocation (or inline outside Lambda)


def do_work(work: ButtonWork | CommandWork) -> None:
    try:
        reply = build_router(load_secrets().bot_token).run(work)
        text = reply.text if reply else None
    except Exception:
        record_failure("answering Slack failed")
        text = COULD_NOT_RECORD
    if text:
        send_reply(work.response_url, text)


def send_reply(response_url: str, text: str) -> None:
    """An ephemeral message to the person who clicked or typed, through the request's response_url."""
    if not response_url_allowed(response_url):  # checked on the way in too; never post anywhere else
        logger.warning("reply not sent: response_url is not Slack's")
        return
    try:
        sent = WebhookClient(response_url, timeout=5).send(text=text, response_type="ephemeral", replace_original=False)
    except Exception as exc:  # the work is done; only the explanation is lost
        logger.warning("reply not sent", extra={"error": type(exc).__name__})
        return
    if sent.status_code != 200:
        logger.warning("reply not sent", extra={"status": sent.status_code})


def dispatch(work: ButtonWork | CommandWork) -> None:
    """Hand the work to this function's asynchronous invocation in Lambda, or run it here elsewhere."""
    function = os.environ.get("AWS_LAMBDA_FUNCTION_NAME")
    if not function:
        do_work(work)
        return
    event = WorkEvent(idle_reaper_slack_work=work).to_event()
    lambda_client().invoke(FunctionName=function, InvocationType="Event", Payload=json.dumps(event).encode())


def _run_work_event(event: dict[str, Any]) -> dict[str, Any]:
    try:
        work = WorkEvent.model_validate(event).idle_reaper_slack_work
    except ValidationError:
        record_failure("malformed internal Slack work event")
        return {"done": False}
    do_work(work)
    return {"done": True}


# ---------------------------------------------------------------------------------------------
# The acknowledgement


class Rejected(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _plain(status: int, text: str) -> dict[str, Any]:
    return {"statusCode": status, "headers": {"Content-Type": "text/plain"}, "body": text}


def _ephemeral(text: str) -> Response[str]:
    body = json.dumps({"response_type": "ephemeral", "replace_original": False, "text": text})
    return Response(200, "application/json", body)


def _acknowledge(work: ButtonWork | CommandWork) -> Response[str]:
    try:
        dispatch(work)
    except Exception:
        record_failure("handing Slack work to the async invocation failed")
        return _ephemeral(COULD_NOT_RECORD)
    return Response(200, "text/plain", "")


@app.post("/slack/interactions")
def interactions() -> Response[str]:
    click = parse_click(app.context["text"])
    if click is None:
        return _ephemeral("idle-reaper only understands its own buttons.")
    work = button_work(click)
    if chosen_action(work.action_id, work.value) is None:
        return _ephemeral("That is not an idle-reaper action; nothing was changed.")
    return _acknowledge(work)


@app.post("/slack/commands")
def commands() -> Response[str]:
    return _acknowledge(command_work(parse_command(app.context["text"])))


def _log_rejection(status: int, why: str) -> None:
    logger.info("rejected Slack request", extra={"status": status, "why": why})


@app.exception_handler(Malformed)  # type: ignore[untyped-decorator]
def malformed(exc: Malformed) -> Response[str]:
    _log_rejection(400, str(exc))
    return Response(400, "text/plain", str(exc))


def _answer_request(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    try:
        secrets = load_secrets()
    except SlackNotConfigured as exc:
        logger.error("Slack is not configured", extra={"why": str(exc)})
        return _plain(503, "idle-reaper's Slack secret is not configured")
    raw_headers = event.get("headers") or {}
    headers = {str(k).lower(): str(v) for k, v in raw_headers.items()} if isinstance(raw_headers, dict) else {}
    text = request_text(event)
    timestamp = headers.get("x-slack-request-timestamp", "")
    # The verifier int()s the timestamp: anything but ASCII digits is simply not a valid signature.
    valid = timestamp.isascii() and timestamp.isdigit() and len(timestamp) < 16
    if not valid or not SignatureVerifier(secrets.signing_secret).is_valid(
        text, timestamp, headers.get("x-slack-signature")
    ):
        raise Rejected(401, "invalid signature")
    app.append_context(text=text)  # type: ignore[no-untyped-call]
    try:
        return app.resolve(event, context)
    except Exception:  # a signed request from Slack: explain in Slack rather than answer 500
        record_failure("answering Slack failed")
        body = json.dumps({"response_type": "ephemeral", "text": COULD_NOT_RECORD})
        return {"statusCode": 200, "headers": {"Content-Type": "application/json"}, "body": body}
    finally:
        app.clear_context()  # type: ignore[no-untyped-call]


@logger.inject_lambda_context(log_event=False)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    try:
        if isinstance(event, dict) and is_work_event(event):  # only Lambda's Invoke API sends these
            return _run_work_event(event)
        return _answer_request(event, context)
    except (Malformed, Rejected) as exc:
        status = exc.status if isinstance(exc, Rejected) else 400
        _log_rejection(status, str(exc))
        return _plain(status, str(exc))
    except Exception:
        record_failure("the Slack handler failed")
        return _plain(500, "idle-reaper failed; try again")
