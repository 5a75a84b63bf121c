"""Scheduled Lambda (hourly): the weekly digest to each team and to the admins, when due. Wiring only.

Its own function, so the chart's Pillow import never touches the sweep's or the Slack endpoint's cold start.
Without Slack credentials nothing is sent and the claims are released (sent once Slack is configured)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from idle_reaper.aws.accounts import MemberAccess
from idle_reaper.aws.clients import client, ssm_prefix, table_name
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.aws.policies import PolicyStore
from idle_reaper.aws.state import DynamoStateStore
from idle_reaper.notify import logger
from idle_reaper.slack.digest import DigestSender
from idle_reaper.slack.notifier import load_secrets, make_client
from idle_reaper.sweep.digest import DigestAccounts, send_due_digests

SLACK_BUDGET_SECONDS = 60.0


@logger.inject_lambda_context(log_event=False)
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    now = datetime.now(UTC)
    store = DynamoStateStore(client("dynamodb"), table_name())
    sender: DigestSender | None
    try:
        sender = DigestSender(make_client(load_secrets().bot_token, SLACK_BUDGET_SECONDS))
    except Exception as exc:  # not configured, or the secret cannot be read
        logger.warning("Slack unavailable: no weekly digest is sent", extra={"why": type(exc).__name__})
        sender = None
    policies = PolicyStore(client("ssm"), ssm_prefix())
    # Organization mode: the accounts' names, and their exempt machines read through the read role.
    members = MemberAccess.from_environment("digest")
    outcomes = send_due_digests(
        store,
        policies,
        sender,
        now,
        metrics=MetricsReader(client("cloudwatch")),
        accounts=(lambda: DigestAccounts.of(members, now)) if members is not None else None,
    )
    return {"digests": [o.__dict__ for o in outcomes]}
