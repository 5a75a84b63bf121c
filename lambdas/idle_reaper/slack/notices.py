"""Stop notices on their way to Slack: the draft kept on a machine's record until Slack takes it, and the pace
that keeps their edits under Slack's Tier 3 for chat.update. Sent by SlackNotifier.send_notices from the sweep's
notice pass (sweep/notices.py)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

# chat.update is Tier 3 ("50+ per minute" for the workspace, https://docs.slack.dev/apis/web-api/rate-limits):
# the notices take 40, the Slack handler's answers (which edit the same messages) keep the rest.
NOTICE_EDITS_PER_MINUTE = 40.0

NoticeSent = Literal["sent", "retry", "gone"]
# What became of a stop notice, and the copies of a message of its own it was told in (for later edits).
Told = tuple[NoticeSent, tuple[str, ...]]


@dataclass(frozen=True)
class StopNotice:
    """A stop notice drafted when the machine was stopped, kept on its record (JSON) until Slack took it."""

    title: str
    detail: str  # mrkdwn, escaped
    ref: str | None  # the "Start it again" button's reference
    start: bool
    targets: tuple[str, ...]  # where to tell it when there is no message to edit
    at: datetime

    def to_json(self) -> str:
        return json.dumps(
            {
                "title": self.title,
                "detail": self.detail,
                "ref": self.ref,
                "start": self.start,
                "targets": list(self.targets),
                "at": self.at.isoformat(),
            }
        )

    @classmethod
    def parse(cls, raw: str | None) -> StopNotice | None:
        try:
            value: Any = json.loads(raw) if raw else {}
            return cls(
                str(value["title"]),
                str(value["detail"]),
                str(value["ref"]) if value.get("ref") else None,
                bool(value.get("start")),
                tuple(str(t) for t in value.get("targets") or ()),
                datetime.fromisoformat(str(value["at"])),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


class EditPace:
    """chat.update under Slack's Tier 3 ("50+ per minute", per workspace): a bucket of `per_minute` edits
    refilled evenly, with the Slack handler's answers left the rest; take() waits for room, never past
    `deadline` (time.monotonic())."""

    def __init__(self, per_minute: float, deadline: float, burst: int = 10) -> None:
        self.rate = per_minute / 60.0
        self.deadline = deadline
        self.burst = burst
        self.tokens = float(burst)
        self.at = time.monotonic()
        self._lock = threading.Lock()

    def in_time(self) -> bool:
        return time.monotonic() < self.deadline

    def take(self, n: int = 1) -> bool:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(float(max(self.burst, n)), self.tokens + (now - self.at) * self.rate)
            self.at = now
            wait = max(0.0, (n - self.tokens) / self.rate)
            if now + wait >= self.deadline:
                return False
            self.tokens -= n
        if wait > 0:
            time.sleep(wait)
        return True
