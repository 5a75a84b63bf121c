"""Who hears about a decision. The sweep talks to a Notifier; Slack is one implementation."""

from __future__ import annotations

from typing import Protocol

from aws_lambda_powertools import Logger

from idle_reaper.core import Decision


class Notifier(Protocol):
    def warn(self, decision: Decision) -> bool:
        """Deliver the warning for an idle machine. True when a person could now read it;
        False leaves it pending (retried next sweep, and the stop waits for it)."""
        ...

    def resolved(self, decision: Decision) -> None:
        """The machine is busy (or exempt) again: the earlier warning no longer stands."""
        ...

    def reaped(self, decision: Decision) -> None:
        """The machine was stopped or released to its group."""
        ...


class LoggingNotifier:
    """Records notifications as structured log lines; delivery always succeeds."""

    def __init__(self, logger: Logger) -> None:
        self.logger = logger
        self.sent: list[tuple[str, str]] = []

    def _log(self, kind: str, decision: Decision) -> None:
        self.sent.append((kind, decision.machine.instance_id))
        self.logger.info(
            f"notification: {kind}",
            extra={
                "instance_id": decision.machine.instance_id,
                "owner": decision.machine.owner,
                "team": decision.machine.team,
                "reason": decision.reason,
            },
        )

    def warn(self, decision: Decision) -> bool:
        self._log("warning", decision)
        return True

    def resolved(self, decision: Decision) -> None:
        self._log("resolved", decision)

    def reaped(self, decision: Decision) -> None:
        self._log("reaped", decision)
