"""The shapes of what reaches the Slack endpoint, validated before anything acts on them: Slack's
interaction payload (block_actions), the slash command form, and the internal work event the endpoint
hands to its own asynchronous invocation. Pure: bytes in, a model or `Malformed` out."""

from __future__ import annotations

import base64
import binascii
import json
import os
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from idle_reaper.core.answers import KEEP_HOURS

BUTTON_ACTIONS = frozenset({*KEEP_HOURS, "keep_morning", "keep_other", "stop_now", "start_again", "keep_all"})
# Slack's own hosts for response_url; SLACK_API_URL's host is allowed too (GovSlack, the local fake).
SLACK_RESPONSE_HOSTS = ("hooks.slack.com", "hooks.slack-gov.com")
WORK_KEY = "idle_reaper_slack_work"
MAX_FIELD = 4000  # Slack's own fields are far shorter; anything longer is not from Slack


class Malformed(Exception):
    """A request idle-reaper cannot read: answered 400 with this short reason (never the body itself)."""


def response_url_allowed(url: str) -> bool:
    """Replies go to Slack only: its response_url hosts over https, or the configured Web API's host."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "https" and parsed.hostname in SLACK_RESPONSE_HOSTS:
        return True
    configured = urllib.parse.urlsplit(os.environ.get("SLACK_API_URL", ""))
    return bool(configured.hostname) and (parsed.scheme, parsed.netloc) == (configured.scheme, configured.netloc)


class _Shape(BaseModel):
    # strict: a number where Slack sends a string is malformed, not coerced; extra: Slack sends much more.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


def _slack_url(url: str) -> str:
    if not response_url_allowed(url):
        raise ValueError("response_url is not a Slack URL")
    return url


class SlackUser(_Shape):
    id: str = Field(min_length=1, max_length=64)


class SelectedOption(_Shape):
    value: str = Field(max_length=MAX_FIELD)


class ButtonAction(_Shape):
    action_id: str = Field(max_length=255)
    value: str | None = Field(default=None, max_length=MAX_FIELD)
    selected_option: SelectedOption | None = None  # the overflow menu's choice

    @property
    def chosen(self) -> str:
        return self.value or (self.selected_option.value if self.selected_option else "")


class BlockActions(_Shape):
    """A click on one of idle-reaper's buttons (Slack's block_actions interaction payload)."""

    type: Literal["block_actions"]
    user: SlackUser
    actions: list[ButtonAction] = Field(min_length=1, max_length=5)
    response_url: str = Field(max_length=MAX_FIELD)

    _check_url = field_validator("response_url")(_slack_url)


class SlashCommand(_Shape):
    """The slash command's form fields."""

    user_id: str = Field(min_length=1, max_length=64)
    command: str = Field(default="/idle-reaper", max_length=64)
    text: str = Field(default="", max_length=MAX_FIELD)
    response_url: str = Field(max_length=MAX_FIELD)

    _check_url = field_validator("response_url")(_slack_url)


class ButtonWork(_Shape):
    kind: Literal["button"] = "button"
    user: str
    action_id: str
    value: str
    response_url: str


class CommandWork(_Shape):
    kind: Literal["command"] = "command"
    user: str
    command: str
    text: str
    response_url: str


Work = Annotated[ButtonWork | CommandWork, Field(discriminator="kind")]


class WorkEvent(BaseModel):
    """What the endpoint sends its own asynchronous invocation. Only Lambda's Invoke API delivers it:
    a Function URL event always carries requestContext, so it is never read as one (see is_work_event)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    idle_reaper_slack_work: Work

    def to_event(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def is_work_event(event: dict[str, Any]) -> bool:
    return WORK_KEY in event and "requestContext" not in event and "body" not in event


# ---------------------------------------------------------------------------------------------
# Parsing raw Function URL bodies


def request_text(event: dict[str, Any]) -> str:
    """The Function URL body as the text Slack signed: base64-decoded when flagged, and UTF-8 or Malformed
    (the signature verifier would raise on anything else)."""
    body = event.get("body") or ""
    if not isinstance(body, str):
        raise Malformed("body must be text")
    if not event.get("isBase64Encoded"):
        raw = body.encode("utf-8", "surrogatepass")  # lone surrogates come out as bytes that are not UTF-8
    else:
        try:
            raw = base64.b64decode(body, validate=True)
        except (ValueError, binascii.Error):
            raise Malformed("body is not valid base64") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed("body is not UTF-8") from None


def form_fields(text: str) -> dict[str, str]:
    try:
        fields = urllib.parse.parse_qs(text, strict_parsing=True, keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise Malformed("body is not form-encoded") from None
    return {k: v[-1] for k, v in fields.items()}


def _reason(exc: ValidationError, what: str) -> str:
    """The first problem, by field path, without echoing the offending value."""
    error = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in error["loc"]) or what
    return f"{what} {where}: {error['msg']}"


def parse_click(text: str) -> BlockActions | None:
    """The click in an interaction request. None: a well-formed interaction that is not a button click."""
    form = form_fields(text)
    if "payload" not in form:
        raise Malformed("no payload field")
    try:
        payload = json.loads(form["payload"])
    except ValueError:  # JSONDecodeError, and recursion or number-size limits
        raise Malformed("payload is not JSON") from None
    except RecursionError:
        raise Malformed("payload is nested too deeply") from None
    if not isinstance(payload, dict):
        raise Malformed("payload is not a JSON object")
    if payload.get("type") != "block_actions" and isinstance(payload.get("type"), str):
        return None
    try:
        return BlockActions.model_validate(payload)
    except ValidationError as exc:
        raise Malformed(_reason(exc, "payload")) from None


def parse_command(text: str) -> SlashCommand:
    try:
        return SlashCommand.model_validate(form_fields(text))
    except ValidationError as exc:
        raise Malformed(_reason(exc, "command")) from None


def chosen_action(action_id: str, value: str) -> str | None:
    """The idle-reaper action a click asks for (the overflow menu's value carries "ref|keep_4h"), or None."""
    if action_id == "keep_other":
        action_id = value.partition("|")[2]
    return action_id if action_id in BUTTON_ACTIONS - {"keep_other"} else None


def button_work(click: BlockActions) -> ButtonWork:
    action = click.actions[0]
    return ButtonWork(
        user=click.user.id, action_id=action.action_id, value=action.chosen, response_url=click.response_url
    )


def command_work(form: SlashCommand) -> CommandWork:
    return CommandWork(user=form.user_id, command=form.command, text=form.text, response_url=form.response_url)
