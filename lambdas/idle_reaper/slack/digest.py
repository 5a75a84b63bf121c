"""Posting the weekly digest: its text with the chart, through Slack's external upload flow
(files.getUploadURLExternal, the bytes POSTed to the URL it returns, files.completeUploadExternal with the
channel: slack-sdk's files_upload_v2). An upload that fails is followed by the text alone, saying so."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from idle_reaper.notify import logger
from idle_reaper.slack.blocks import escape, fit

DIGEST_CHARS = 12000  # a digest's text (Slack's own limit is 40,000; an admins' digest of many teams is long)


@dataclass(frozen=True)
class DigestPosted:
    channel: str
    with_chart: bool
    chart_error: str = ""  # why the chart is missing


class DigestUndelivered(Exception):
    """Neither the chart nor the text reached the channel."""


def _why(exc: Exception) -> str:
    if isinstance(exc, SlackApiError):
        return str(exc.response.get("error") or "slack error")
    return type(exc).__name__


class DigestSender:
    def __init__(self, client: WebClient) -> None:
        self.client = client

    def send(self, channel: str, text: str, png: bytes | None, filename: str, missing_chart: str) -> DigestPosted:
        """Post `text` with the chart `png` as its comment; when the upload fails (or there is no chart), post
        the text alone followed by `missing_chart` (formatted with the reason). Raises DigestUndelivered when
        the text could not be posted either."""
        text = escape(text)  # team names and owners come from tags
        body = fit(text, DIGEST_CHARS, mrkdwn=True)
        error = "the chart could not be drawn"
        if png is not None:
            if channel.startswith("C"):
                # Sharing a file into a channel needs the bot in it (files.completeUploadExternal: not_in_channel,
                # "User/bot membership is required"): a public channel is joined (channels:join); a private one
                # needs an invite, and the text goes alone, saying why.
                with contextlib.suppress(SlackApiError, SlackClientError, OSError):
                    self.client.conversations_join(channel=channel)
            try:
                self.client.files_upload_v2(
                    channel=channel,
                    content=png,
                    filename=filename,
                    title=filename.removesuffix(".png"),
                    alt_txt="Recovered and still-wasted dollars per week, and what wasted most this week",
                    initial_comment=body,
                )
                return DigestPosted(channel, with_chart=True)
            except (SlackApiError, SlackClientError, OSError) as exc:
                error = f"the chart could not be uploaded ({_why(exc)})"
                logger.warning("digest chart upload failed", extra={"channel": channel, "error": _why(exc)})
        note = missing_chart.format(why=error)
        try:
            self.client.chat_postMessage(channel=channel, text=fit(f"{text}\n_{note}_", DIGEST_CHARS, mrkdwn=True))
        except (SlackApiError, SlackClientError, OSError) as exc:
            raise DigestUndelivered(f"{channel}: {_why(exc)}") from exc
        return DigestPosted(channel, with_chart=False, chart_error=error)
