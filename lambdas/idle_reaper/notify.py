"""Who hears about a decision. The sweep talks to a Notifier; Slack is one implementation."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aws_lambda_powertools import Logger

from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MachineRecord

# The one logger of the package. stderr: the CLI prints its table or JSON on stdout; in Lambda both
# streams reach CloudWatch. Defined here because every entry point imports this module.
logger = Logger(service="idle-reaper", logger_handler=logging.StreamHandler(sys.stderr))


@dataclass(frozen=True)
class Delivery:
    """What a delivered message left behind, kept on the machine's record."""

    messages: tuple[str, ...] = ()  # "channel|ts" of every copy, so it can be updated in place
    ref: str | None = None  # the opaque reference its buttons carry
    owner_slack_id: str | None = None
    # Targets the message did not reach for a reason retrying will not fix (what an admin must do). The
    # warning still counts as delivered when another target got it: a person can read and answer it.
    undelivered: tuple[str, ...] = ()
    # The shared message's "Keep all" reference when the machine is listed with its owner's other machines.
    group_ref: str | None = None
    # Targets the message did not reach for a reason that may pass (a 429, Slack down) while another got it: each
    # sweep posts the same warning there (MachineRecord.warning_owed: core.records.owed_target says the format).
    owed: tuple[str, ...] = ()


class DeliveryUnknown(Exception):
    """Whether a warning reached its owner cannot be told now: the stop waits. `answered`: Slack answered, and
    refused to show it (a conversation the bot may not read, a DM it may not open): no stop until it is known,
    and the admins are told. Otherwise Slack could not be asked (down, or the answer to a post was lost): the
    stop waits as for an undelivered warning (undelivered_warning_max_minutes)."""

    def __init__(self, reason: str, *, answered: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answered = answered


class PermanentDeliveryFailure(Exception):
    """A message that cannot be delivered for a reason that will not go away on its own (a channel the
    bot is not in, an archived channel, a message Slack refuses to build): retrying every sweep would
    fail the same way in silence, so the sweep reports it to the admins instead."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# What posting a machine's warning came to: delivered; undeliverable for good; it may have been posted (its
# answer was lost: looked for before it is posted again); or None, not posted (retried next sweep).
PostOutcome = Delivery | PermanentDeliveryFailure | DeliveryUnknown | None


class Notifier(Protocol):
    def warn(self, decision: Decision) -> Delivery | None:
        """Deliver the warning for an idle machine. A Delivery when a person could now read it;
        None leaves it pending (retried next sweep, and the stop waits for it)."""
        ...

    def resolved(self, decision: Decision) -> None:
        """The machine is busy (or exempt) again: the earlier warning no longer stands."""
        ...

    def reaped(self, decision: Decision) -> Delivery | None:
        """The machine was stopped or released to its group (the message may offer to start it again)."""
        ...

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        """Tell the idle-reaper admins (DMs to `admins`, and `channel`) about a fault they must fix.
        Raises when nobody could be told, so the caller keeps the alert pending."""
        ...


@runtime_checkable
class DeliveryFinder(Protocol):
    """A notifier that can tell whether a warning whose outcome was lost reached its owner, and who an
    Owner tag names (the sweep groups and addresses warnings by the person, not by the tag's spelling)."""

    def find_warning(self, decision: Decision) -> Delivery | None:
        """The warning's delivery as Slack shows it; None when it was never posted. Raises DeliveryUnknown
        when that cannot be told now, PermanentDeliveryFailure when nobody can be warned."""
        ...

    def resolve_owner(self, owner: str | None) -> str | None:
        """The Slack user an Owner tag names (a user id, or an email Slack knows); None when none."""
        ...


@runtime_checkable
class OwnerResolver(Protocol):
    """A notifier that resolves many Owner tags at once (cheaper than one by one, within Slack's limits)."""

    def resolve_owners(self, owners: Sequence[str | None]) -> dict[str, str | None]:
        """Each tag (as given, "" for none) -> the Slack user it names; None when none."""
        ...


@runtime_checkable
class OwnerNotifier(Protocol):
    """A notifier that can list several of one owner's machines in one message (core.owner_message_groups)."""

    def warn_owner(self, decisions: Sequence[Decision], owner_id: str | None = None) -> list[PostOutcome]:
        """One message (split only past Slack's limits) warning about every machine of `decisions`; for
        each machine, in order, what `Notifier.warn` would return for it, a PermanentDeliveryFailure
        returned rather than raised. A message that failed leaves every machine it lists undelivered."""
        ...

    def quiet_summary(self, stopped: Sequence[MachineRecord]) -> list[Delivery] | None:
        """Tell one owner, once their quiet hours are over, which of their machines were stopped meanwhile,
        each with "Start it again" (Delivery.ref, and group_ref for later edits). None: not delivered, try
        again later; PermanentDeliveryFailure: nobody can be told."""
        ...


@runtime_checkable
class SharedOwnerNotifier(Protocol):
    """A notifier whose owner messages units of one sweep can share (organization mode: an owner's machines in
    several accounts and regions, each swept on its own, get one message)."""

    def warn_owner(
        self, decisions: Sequence[Decision], owner_id: str | None = None, *, lone_layout: bool = False
    ) -> list[PostOutcome]:
        """OwnerNotifier.warn_owner; `lone_layout`: a message of one machine looks like a warning of its own."""
        ...

    def join_owner_message(
        self, decisions: Sequence[Decision], owner_id: str | None, group_ref: str, messages: Sequence[str]
    ) -> list[PostOutcome] | None:
        """Add `decisions` to the message another unit posted (its "Keep all" reference and its copies); for
        each machine what warn_owner would return; None: not joined, post a message of its own."""
        ...


@runtime_checkable
class CopyNotifier(Protocol):
    """A notifier that posts the copies a delivered warning still owes (MachineRecord.warning_owed)."""

    def post_owed(self, decisions: Sequence[Decision], target: str, maybe_posted: bool) -> list[Delivery]:
        """The copy that the machines of one message (a machine's own warning, or the machines one shared message
        lists) owe to `target`, posted there; `maybe_posted`: looked for first (an earlier post may have gone out).
        For each machine, in order: Delivery.messages the copy (posted or found), Delivery.owed the entry still
        owed (a failure that may pass), Delivery.undelivered why it is given up (a permanent failure)."""
        ...


@runtime_checkable
class SharedPacing(Protocol):
    """A notifier whose posting rate is shared out between the invocations that post at once (a fanned-out sweep's
    shards), as MetricsReader.shared_by shares GetMetricData's quota."""

    def shared_by(self, workers: int) -> Notifier:
        """A notifier over the same client for one of `workers` posting to the workspace at once: its share."""
        ...


class LoggingNotifier:
    """Records notifications as structured log lines. A log line is not a warning a person could
    answer, so by default warnings stay pending (and the stop waits, up to the policy's
    undelivered_warning_max_minutes); `delivers=True` is for tests and local experiments."""

    def __init__(self, logger: Logger, delivers: bool = False) -> None:
        self.logger = logger
        self.delivers = delivers
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

    def warn(self, decision: Decision) -> Delivery | None:
        self._log("warning", decision)
        return Delivery() if self.delivers else None

    def warn_owner(self, decisions: Sequence[Decision], owner_id: str | None = None) -> list[PostOutcome]:
        """Like warn, once per message: `sent` gets one ("owner_warning", ids) entry per message."""
        self.sent.append(("owner_warning", ",".join(d.machine.instance_id for d in decisions)))
        for d in decisions:
            self._log("warning", d)
        return [Delivery() if self.delivers else None for _ in decisions]

    def quiet_summary(self, stopped: Sequence[MachineRecord]) -> list[Delivery] | None:
        self.sent.append(("quiet_summary", ",".join(r.instance_id for r in stopped)))
        self.logger.info("notification: quiet hours summary", extra={"instance_ids": [r.instance_id for r in stopped]})
        return [Delivery() for _ in stopped] if self.delivers else None

    def resolved(self, decision: Decision) -> None:
        self._log("resolved", decision)

    def reaped(self, decision: Decision) -> Delivery | None:
        self._log("reaped", decision)
        return None

    def admin_alert(self, text: str, admins: Sequence[str] = (), channel: str | None = None) -> None:
        self.sent.append(("admin_alert", text))
        self.logger.warning("admin alert", extra={"alert": text, "admins": list(admins)})
