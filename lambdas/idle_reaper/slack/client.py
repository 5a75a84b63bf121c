"""The Slack Web API client idle-reaper uses: its secrets (locally from the environment, in AWS from Secrets
Manager) and slack-sdk's WebClient with a retry handler that waits out a 429's Retry-After while the caller's
time budget allows."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from slack_sdk import WebClient
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler
from slack_sdk.http_retry.handler import RetryHandler
from slack_sdk.http_retry.request import HttpRequest
from slack_sdk.http_retry.response import HttpResponse
from slack_sdk.http_retry.state import RetryState

DEFAULT_API_URL = "https://slack.com/api/"


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
