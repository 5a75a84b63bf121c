"""Slack's interactivity requests and slash command, from a Lambda Function URL. Wiring only.

The Slack signature is the authentication: it is checked over the raw body before anything is read.
Client mistakes get a 4xx (or an ephemeral message where Slack expects 200), never a 5xx or a stack
trace; every effect happens at most once (single-use references and conditional writes)."""

from __future__ import annotations

import base64
import json
import os
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools.event_handler import LambdaFunctionUrlResolver, Response
from aws_lambda_powertools.utilities.typing import LambdaContext
from slack_sdk.signature import SignatureVerifier

from idle_reaper.answers import Answers, RegionalAnswers, Reply
from idle_reaper.aws import DynamoStateStore, Fleet, PolicyStore, client, ssm_prefix, table_name
from idle_reaper.slack import SlackNotConfigured, SlackNotifier, load_secrets, logger, make_client

app = LambdaFunctionUrlResolver()
# Slack waits 3 s for an answer; a 429 retry must fit well inside that.
SLACK_BUDGET_SECONDS = 2.0


def clock() -> datetime:
    return datetime.now(UTC)


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _plain(status: int, text: str) -> dict[str, Any]:
    return {"statusCode": status, "headers": {"Content-Type": "text/plain"}, "body": text}


def _raw_body(event: dict[str, Any]) -> bytes:
    body = event.get("body") or ""
    if not isinstance(body, str):
        raise BadRequest(400, "body must be text")
    if event.get("isBase64Encoded"):
        try:
            return base64.b64decode(body, validate=True)
        except ValueError:
            raise BadRequest(400, "body is not valid base64") from None
    return body.encode()


def _form(raw: bytes) -> dict[str, str]:
    try:
        fields = urllib.parse.parse_qs(raw.decode("utf-8"), strict_parsing=True, keep_blank_values=True)
    except (UnicodeDecodeError, ValueError):
        raise BadRequest(400, "body is not form-encoded") from None
    return {k: v[-1] for k, v in fields.items()}


def _answers(bot_token: str) -> RegionalAnswers:
    """This region first, then the other regions the stack lists (IDLE_REAPER_REGIONS)."""
    slack_client = make_client(bot_token, SLACK_BUDGET_SECONDS)
    local = client("dynamodb").meta.region_name
    listed = [r.strip() for r in os.environ.get("IDLE_REAPER_REGIONS", "").split(",") if r.strip()]
    regions = [local, *(r for r in listed if r != local)]

    def in_region(region: str) -> Answers:
        store = DynamoStateStore(client("dynamodb", region), table_name())
        return Answers(
            store=store,
            policies=PolicyStore(client("ssm", region), ssm_prefix()),
            fleet=Fleet(client("ec2", region), client("autoscaling", region)),
            slack=SlackNotifier(slack_client, store, clock),
            clock=clock,
        )

    return RegionalAnswers([in_region(r) for r in regions])


def _reply(reply: Reply | None) -> Response[str]:
    if reply is None:
        return Response(200, "text/plain", "")
    body = json.dumps({"response_type": "ephemeral", "replace_original": False, "text": reply.text})
    return Response(200, "application/json", body)


@app.post("/slack/interactions")
def interactions() -> Response[str]:
    form = _form(_raw_body(app.current_event.raw_event))
    if "payload" not in form:
        raise BadRequest(400, "no payload field")
    try:
        payload = json.loads(form["payload"])
    except json.JSONDecodeError:
        raise BadRequest(400, "payload is not JSON") from None
    if not isinstance(payload, dict) or payload.get("type") != "block_actions":
        return _reply(Reply("idle-reaper only understands its own buttons."))
    user = (payload.get("user") or {}).get("id") if isinstance(payload.get("user"), dict) else None
    actions = payload.get("actions")
    if not isinstance(user, str) or not isinstance(actions, list) or not actions or not isinstance(actions[0], dict):
        raise BadRequest(400, "payload has no user or action")
    action = actions[0]
    value = action.get("value") or (action.get("selected_option") or {}).get("value") or ""
    if not isinstance(value, str) or not isinstance(action.get("action_id"), str):
        raise BadRequest(400, "action has no id or value")
    return _reply(_answers(app.context["secrets"].bot_token).button(user, action["action_id"], value))


@app.post("/slack/commands")
def commands() -> Response[str]:
    form = _form(_raw_body(app.current_event.raw_event))
    user, command = form.get("user_id"), form.get("command", "/idle-reaper")
    if not user:
        raise BadRequest(400, "no user_id")
    return _reply(_answers(app.context["secrets"].bot_token).command(user, command, form.get("text", "")))


@app.exception_handler(BadRequest)  # type: ignore[untyped-decorator]
def bad_request(exc: BadRequest) -> Response[str]:
    logger.info("rejected Slack request", extra={"status": exc.status, "why": str(exc)})
    return Response(exc.status, "text/plain", str(exc))


@logger.inject_lambda_context(log_event=False)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    try:
        secrets = load_secrets()
    except SlackNotConfigured as exc:
        logger.error("Slack is not configured", extra={"why": str(exc)})
        return _plain(503, "idle-reaper's Slack secret is not configured")
    headers = {str(k).lower(): str(v) for k, v in (event.get("headers") or {}).items()}
    try:
        raw = _raw_body(event)
    except BadRequest as exc:
        return _plain(exc.status, str(exc))
    verifier = SignatureVerifier(secrets.signing_secret)
    timestamp = headers.get("x-slack-request-timestamp", "")
    # The verifier int()s the timestamp: anything but digits is simply not a valid signature.
    if not timestamp.isdigit() or not verifier.is_valid(raw, timestamp, headers.get("x-slack-signature")):
        logger.info("rejected Slack request: bad or stale signature")
        return _plain(401, "invalid signature")
    app.append_context(secrets=secrets)  # type: ignore[no-untyped-call]
    try:
        return app.resolve(event, context)
    except Exception:
        # Our fault, not the caller's (the state table or Slack failed): say so without details.
        logger.exception("answering Slack failed")
        body = json.dumps({"response_type": "ephemeral", "text": "idle-reaper could not record that; try again."})
        return {"statusCode": 200, "headers": {"Content-Type": "application/json"}, "body": body}
    finally:
        app.clear_context()  # type: ignore[no-untyped-call]
