"""Slack adapter: Block Kit messages, owner lookup, delivery with bounded 429 retries.

Thin by design: what a message says comes from the decision; what an answer does is decided in core.
The bot token and signing secret never reach a log line."""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler
from slack_sdk.http_retry.handler import RetryHandler
from slack_sdk.http_retry.request import HttpRequest
from slack_sdk.http_retry.response import HttpResponse
from slack_sdk.http_retry.state import RetryState
from slack_sdk.models.blocks import (
    ActionsBlock,
    Block,
    ButtonElement,
    ConfirmObject,
    ContextBlock,
    HeaderBlock,
    MarkdownTextObject,
    Option,
    OverflowMenuElement,
    SectionBlock,
)

from idle_reaper.aws import StateStore
from idle_reaper.core import KEEP_HOURS, Action, Decision, MachineRecord, keep_choices, next_morning
from idle_reaper.notify import Delivery
from idle_reaper.notify import logger as logger  # re-exported for the Slack handler
from idle_reaper.policy import TeamPolicy

DEFAULT_API_URL = "https://slack.com/api/"
_PAST = {Action.STOP: "stopped", Action.HIBERNATE: "hibernated"}
REF_TTL = timedelta(days=7)
OWNER_CACHE_TTL = timedelta(days=7)
SLACK_USER_ID = re.compile(r"^[UW][A-Z0-9]{2,}$")
EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


class SlackNotConfigured(Exception):
    pass


class SlackUndelivered(Exception):
    pass


@dataclass(frozen=True)
class SlackSecrets:
    bot_token: str
    signing_secret: str

    def __repr__(self) -> str:  # never print secrets, even by accident
        return "SlackSecrets(<redacted>)"


def load_secrets() -> SlackSecrets:
    """Locally from SLACK_BOT_TOKEN / SLACK_SIGNING_SECRET; in AWS from the Secrets Manager secret named by
    IDLE_REAPER_SLACK_SECRET (JSON with bot_token and signing_secret), cached for five minutes."""
    token, signing = os.environ.get("SLACK_BOT_TOKEN"), os.environ.get("SLACK_SIGNING_SECRET")
    if token and signing:
        return SlackSecrets(token, signing)
    secret_id = os.environ.get("IDLE_REAPER_SLACK_SECRET")
    if not secret_id:
        raise SlackNotConfigured("set IDLE_REAPER_SLACK_SECRET, or SLACK_BOT_TOKEN and SLACK_SIGNING_SECRET")
    from aws_lambda_powertools.utilities import parameters

    value = parameters.get_secret(secret_id, transform="json", max_age=300)
    if not isinstance(value, dict) or not value.get("bot_token") or not value.get("signing_secret"):
        raise SlackNotConfigured(f"secret {secret_id} must hold JSON with bot_token and signing_secret")
    return SlackSecrets(str(value["bot_token"]), str(value["signing_secret"]))


class BudgetedRateLimitRetryHandler(RateLimitErrorRetryHandler):
    """Honours Retry-After on 429, but only while the wait fits the caller's time budget (a Lambda
    must answer Slack within 3 s, and a sweep has its own timeout)."""

    def __init__(self, deadline: float, max_retry_count: int = 2) -> None:
        super().__init__(max_retry_count=max_retry_count)
        self.deadline = deadline  # time.monotonic() value

    def _can_retry(
        self,
        *,
        state: RetryState,
        request: HttpRequest,
        response: HttpResponse | None = None,
        error: Exception | None = None,
    ) -> bool:
        if response is None or response.status_code != 429:
            return False
        header = next((v for k, v in response.headers.items() if k.lower() == "retry-after"), ["1"])
        try:
            wait = float(header[0] if isinstance(header, list) else header)
        except ValueError:
            wait = 1.0
        return time.monotonic() + wait + 1 < self.deadline


def make_client(token: str, budget_seconds: float) -> WebClient:
    base_url = os.environ.get("SLACK_API_URL", DEFAULT_API_URL)
    handlers: list[RetryHandler] = [BudgetedRateLimitRetryHandler(time.monotonic() + budget_seconds)]
    return WebClient(token=token, base_url=base_url.rstrip("/") + "/", timeout=10, retry_handlers=handlers)


def date_token(when: datetime, fmt: str = "{time} on {date_short_pretty}") -> str:
    """A Slack date token: every reader sees it in their own time zone."""
    ts = int(when.timestamp())
    return f"<!date^{ts}^{fmt}|{when.astimezone(UTC):%Y-%m-%d %H:%M} UTC>"


def _money(value: float | None) -> str:
    return f"${value:,.2f}" if value is not None else "unknown"


def machine_label(name: str | None, instance_id: str) -> str:
    return f"{name} ({instance_id})" if name else instance_id


# ---------------------------------------------------------------------------------------------
# Messages


def planned_stop(decision: Decision, now: datetime) -> datetime:
    """What the message announces; the lifecycle never stops before it (record.stop_not_before)."""
    policy = decision.policy.policy if decision.policy else None
    assessment = decision.assessment
    if policy is None or assessment is None or assessment.quiet_since is None:
        return decision.record.stop_not_before or now
    return max(
        now + timedelta(minutes=policy.warn_minutes),
        assessment.quiet_since + timedelta(minutes=policy.idle_minutes),
        decision.record.stop_not_before or now,
    )


def _choice_label(choice: str, policy: TeamPolicy, now: datetime) -> str:
    if choice == "keep_morning":
        morning = next_morning(policy, now)
        if morning - now > timedelta(hours=policy.max_snooze_hours):
            return f"Keep {policy.max_snooze_hours} h (max)"
        return "Keep until tomorrow morning"
    return f"Keep {KEEP_HOURS[choice]} h"


def warning_blocks(decision: Decision, ref: str, now: datetime) -> list[Block]:
    m, a = decision.machine, decision.assessment
    policy = decision.policy.policy if decision.policy and decision.policy.policy else TeamPolicy()
    stop_at = planned_stop(decision, now)
    verb = "released to its Auto Scaling group" if m.asg_name else "stopped"
    idle_minutes = a.quiet_minutes(now) if a else 0
    thresholds = f"CPU < {policy.cpu_threshold_percent:g}%"
    if a and a.uses_gpu:
        thresholds += f", GPU < {policy.gpu_threshold_percent:g}%"
    why = a.why_quiet if a else decision.reason
    morning_capped = next_morning(policy, now) - now > timedelta(hours=policy.max_snooze_hours)
    longest = f"keep_{policy.max_snooze_hours}h" if morning_capped else None  # already the morning button
    others = [c for c in keep_choices(policy) if c not in ("keep_2h", longest)]
    buttons: list[Any] = [
        ButtonElement(text="Keep 2 h", action_id="keep_2h", value=ref, style="primary"),
        ButtonElement(text=_choice_label("keep_morning", policy, now), action_id="keep_morning", value=ref),
        ButtonElement(
            text="Stop now",
            action_id="stop_now",
            value=ref,
            style="danger",
            confirm=ConfirmObject(title="Stop it now?", text=f"{machine_label(m.name, m.instance_id)} will be {verb}."),
        ),
    ]
    if others:
        buttons.append(
            OverflowMenuElement(
                action_id="keep_other",
                options=[Option(value=f"{ref}|{c}", text=_choice_label(c, policy, now)) for c in others],
            )
        )
    return [
        HeaderBlock(text=f"Idle machine: {machine_label(m.name, m.instance_id)}"[:150]),
        SectionBlock(
            text=MarkdownTextObject(text=f"It will be *{verb}* at {date_token(stop_at)} unless someone keeps it."),
            fields=[
                MarkdownTextObject(text=f"*Instance*\n`{m.instance_id}` · {m.instance_type}"),
                MarkdownTextObject(text=f"*Team*\n{m.team}"),
                MarkdownTextObject(text=f"*Cost*\n{_money(decision.hourly_cost)} per hour"),
                MarkdownTextObject(text=f"*Idle for*\n{idle_minutes:.0f} min"),
            ],
        ),
        SectionBlock(
            text=MarkdownTextObject(text=f"*Why it counts as idle:* {why} (busy means {thresholds.replace('<', '≥')})")
        ),
        ActionsBlock(block_id="idle_reaper_answer", elements=buttons),
        ContextBlock(
            elements=[
                MarkdownTextObject(
                    text=f"idle-reaper · policy {decision.policy.label if decision.policy else '?'} · "
                    f"keep at most {policy.max_snooze_hours} h, {policy.max_snoozes_per_day} times a day"
                )
            ]
        ),
    ]


def status_blocks(title: str, detail: str, *, ref: str | None = None, start_button: bool = False) -> list[Block]:
    blocks: list[Block] = [SectionBlock(text=MarkdownTextObject(text=f"*{title}*\n{detail}"))]
    if start_button and ref:
        blocks.append(
            ActionsBlock(
                block_id="idle_reaper_start",
                elements=[ButtonElement(text="Start it again", action_id="start_again", value=ref)],
            )
        )
    return blocks


def blocks_json(blocks: Sequence[Block]) -> list[dict[str, Any]]:
    return [b.to_dict() for b in blocks]


def blocks_text(blocks: Sequence[dict[str, Any]]) -> str:
    """A plain rendering of Block Kit JSON, for the demo's timeline and for tests."""
    lines: list[str] = []
    for block in blocks:
        if block["type"] == "header":
            lines.append(block["text"]["text"])
        elif block["type"] == "section":
            if "text" in block:
                lines.append(block["text"]["text"])
            lines += [f["text"].replace("\n", ": ") for f in block.get("fields", [])]
        elif block["type"] == "actions":
            labels = []
            for element in block["elements"]:
                if element["type"] == "button":
                    labels.append(f"[{element['text']['text']}]")
                elif element["type"] == "overflow":
                    labels.append("[... " + ", ".join(o["text"]["text"] for o in element["options"]) + "]")
            lines.append(" ".join(labels))
        elif block["type"] == "context":
            lines.append(" ".join(e.get("text", "") for e in block["elements"]))
    return "\n".join(re.sub(r"<!date\^\d+\^[^|]*\|([^>]*)>", r"\1", line) for line in lines)


# ---------------------------------------------------------------------------------------------
# Delivery


class SlackNotifier:
    """Posts warnings to the owner (DM) and/or the team channel, and updates them in place later."""

    def __init__(self, client: WebClient, store: StateStore, clock: Any = None) -> None:
        self.client = client
        self.store = store
        self.clock = clock or (lambda: datetime.now(UTC))
        self.logger = logger

    # Owner lookup: the Owner tag holds a Slack user id or an email (resolved once, cached in the table).
    def resolve_owner(self, owner: str | None) -> str | None:
        if not owner:
            return None
        if SLACK_USER_ID.match(owner):
            return owner
        if not EMAIL.match(owner):
            return None
        now = self.clock()
        cached = self.store.get_lookup(f"owner#{owner.lower()}", now)
        if cached:
            return cached
        try:
            user_id = str(self.client.users_lookupByEmail(email=owner)["user"]["id"])
        except SlackApiError as exc:
            if exc.response.get("error") == "users_not_found":
                return None
            raise
        self.store.put_lookup(f"owner#{owner.lower()}", user_id, now + OWNER_CACHE_TTL)
        return user_id

    def new_ref(self, instance_id: str, now: datetime | None = None) -> str:
        ref = secrets.token_urlsafe(18)
        self.store.put_lookup(f"ref#{ref}", instance_id, (now or self.clock()) + REF_TTL)
        return ref

    def warn(self, decision: Decision) -> Delivery | None:
        m = decision.machine
        policy = decision.policy.policy if decision.policy else None
        now = decision.record.updated_at or self.clock()  # the sweep's (possibly simulated) clock
        try:
            owner_id = self.resolve_owner(m.owner) if policy is None or policy.notify != "channel" else None
            targets: list[str] = []
            if owner_id and (policy is None or policy.notify in ("owner", "both")):
                targets.append(str(self.client.conversations_open(users=owner_id)["channel"]["id"]))
            if policy and policy.slack_channel and policy.notify in ("channel", "both"):
                targets.append(policy.slack_channel)
            if not targets:
                self.logger.warning(
                    "warning has nobody to go to", extra={"instance_id": m.instance_id, "owner": m.owner}
                )
                return None
            ref = self.new_ref(m.instance_id, now)
            blocks = blocks_json(warning_blocks(decision, ref, now))
            text = f"Idle machine {machine_label(m.name, m.instance_id)} will be stopped unless someone keeps it"
            messages = []
            for channel in targets:
                out = self.client.chat_postMessage(channel=channel, text=text, blocks=blocks)
                messages.append(f"{out['channel']}|{out['ts']}")
        except (SlackApiError, SlackClientError, OSError) as exc:
            self._failed("warning", m.instance_id, exc)
            return None
        return Delivery(messages=tuple(messages), ref=ref, owner_slack_id=owner_id)

    def resolved(self, decision: Decision) -> None:
        detail = f"Busy again ({decision.reason}). Nothing will happen to it."
        self.update(decision.record, "Warning withdrawn", detail)

    def reaped(self, decision: Decision) -> Delivery | None:
        record, m = decision.record, decision.machine
        now = record.updated_at or self.clock()
        if decision.action in (Action.STOP, Action.HIBERNATE):
            ref = self.new_ref(m.instance_id, now)
            detail = (
                f"{machine_label(m.name, m.instance_id)} was {_PAST[decision.action]} at {date_token(now)}"
                + f"; it saves ~{_money(decision.hourly_cost)} per hour while stopped. {decision.reason}"
            )
            self.update(record, "Stopped", detail, ref=ref, start_button=True)
            return Delivery(ref=ref)
        self.update(record, "Released to its group", f"{decision.reason} ({date_token(now)})")
        return None

    def update(
        self, record: MachineRecord, title: str, detail: str, *, ref: str | None = None, start_button: bool = False
    ) -> bool:
        """Rewrite every copy of the machine's message in place. True if all copies were updated."""
        blocks = blocks_json(status_blocks(title, detail, ref=ref, start_button=start_button))
        ok = True
        for message in record.messages:
            channel, _, ts = message.partition("|")
            try:
                self.client.chat_update(channel=channel, ts=ts, text=f"{title}: {detail}"[:3000], blocks=blocks)
            except (SlackApiError, SlackClientError, OSError) as exc:
                self._failed("update", record.instance_id, exc)
                ok = False
        return ok

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        """DM every admin and post to the admin channel. Raises when nobody received it, so the caller
        keeps the alert pending."""
        delivered = 0
        targets = [("admin", admin) for admin in admins] + ([("channel", channel)] if channel else [])
        for kind, target in targets:
            try:
                where = self.client.conversations_open(users=target)["channel"]["id"] if kind == "admin" else target
                self.client.chat_postMessage(channel=where, text=f"idle-reaper admin alert: {text}")
                delivered += 1
            except (SlackApiError, SlackClientError, OSError) as exc:
                self._failed("admin alert", target, exc)
        if targets and not delivered:
            raise SlackUndelivered(f"no admin received the alert ({len(targets)} tried)")

    def _failed(self, what: str, subject: str, exc: Exception) -> None:
        error = exc.response.get("error") if isinstance(exc, SlackApiError) else type(exc).__name__
        # WARNING, not ERROR: Slack being down is expected now and then; the warning stays pending.
        self.logger.warning(f"slack {what} failed", extra={"subject": subject, "error": error})
