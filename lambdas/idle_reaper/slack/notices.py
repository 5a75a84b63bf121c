"""Stop notices on their way to Slack: the draft kept on a machine's record until Slack takes it, and the pace
that keeps their edits under Slack's Tier 3 for chat.update. Sent by SlackNotifier.send_notices from the sweep's
notice pass (sweep/notices.py)."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
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
    """chat.update under Slack's Tier 3 ("50+ per minute", per workspace): at most `per_minute` edits in any 60 s,
    the first minute's burst included (a bucket of `burst` refilled at `per_minute` alone would let burst + per_minute
    through in its first minute: 49 of Slack's 50), spread out by the bucket, so the Slack handler's answers keep the
    rest at every moment; take() waits for room, never past `deadline` (time.monotonic()). A notice pass takes its
    turns one after another: the edits of a turn are made (the lines noted, the listing read, each copy edited) before
    the next turn is asked for, so they count in the window from then, however long they took."""

    def __init__(self, per_minute: float, deadline: float, burst: int = 10) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60.0
        self.deadline = deadline
        self.burst = burst
        self.tokens = float(burst)
        self.at = time.monotonic()
        self.taken: deque[float] = deque()  # when each edit of the last 60 s was made, at the latest
        self._last = 0  # edits of the latest turn (made by now: see the docstring)
        self._lock = threading.Lock()

    def in_time(self) -> bool:
        return time.monotonic() < self.deadline

    def take(self, n: int = 1) -> bool:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(float(max(self.burst, n)), self.tokens + (now - self.at) * self.rate)
            self.at = now
            go = now + max(0.0, (n - self.tokens) / self.rate)
            for i in range(max(0, len(self.taken) - self._last), len(self.taken)):
                self.taken[i] = max(self.taken[i], now)
            # The window: the edits of the 60 s before the moment these go must leave room for them.
            gone = sum(1 for t in self.taken if t <= go - 60)
            over = len(self.taken) - gone + n - int(self.per_minute)
            if over > 0 and len(self.taken) > gone:
                go = max(go, self.taken[gone + min(over, len(self.taken) - gone) - 1] + 60)
            if go >= self.deadline:
                return False  # nothing taken, nothing forgotten
            while self.taken and self.taken[0] <= go - 60:
                self.taken.popleft()
            self.tokens -= n
            self.taken.extend([go] * n)
            self._last = n
            wait = go - now
        if wait > 0:
            time.sleep(wait)
        return True
