"""What a sweep does for SageMaker endpoints beyond the machines' lifecycle: reads their invocations, says when they
could not be listed, and tells the person who brought one back that it is InService again, or that it failed.

"Bring it back" (slack/answers.py) calls CreateEndpoint and returns at once: an endpoint takes minutes to be
InService, longer than Slack's 3 seconds and the answer's own invocation. The person's name stays on the record
(core/endpoints.Restore.pending_by); the first sweep that finds the endpoint InService clears it in the record it
writes anyway and, once that write succeeded, edits the endpoint's message: "Back in service". Like every message
update it is best effort: a failed edit is logged, not retried (the endpoint is in service either way).

SageMaker may also take CreateEndpoint and then fail to create the endpoint (no capacity for its instance type, a
model that does not load): it reaches Failed, runs no instance, and discovery lists it apart (Fleet.endpoints_failed).
The first sweep that lists one whose record waits for a bring-back (pending_by) records it deleted again, told and
not pending (a conditional write: one sweep tells it), with why (its FailureReason); then deletes the failed endpoint,
so that "Try again" can create it afresh (SageMaker refuses CreateEndpoint for a name that exists); then edits its
message once: failed, why, and "Try again"."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from idle_reaper.aws.fleet import ActionOutcome
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.core.answers import bring_back_failed
from idle_reaper.core.digest import answer_entry
from idle_reaper.core.endpoints import Restore
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import Action, MachineRecord, machine_key
from idle_reaper.core.signals import Machine, Signals, parse_exemption
from idle_reaper.core.studio import AppRestore, pending_restore
from idle_reaper.notify import logger
from idle_reaper.policy import Settings, TeamPolicyRef
from idle_reaper.pricing import hourly_price
from idle_reaper.sweep.adapters import Adapters, tell_unlisted


@runtime_checkable
class BackInServiceNotifier(Protocol):
    """A notifier that can edit an endpoint's message when it is InService again."""

    def back_in_service(self, record: MachineRecord, by: str, since: datetime) -> bool:
        """True when every copy of the message was edited."""
        ...


@runtime_checkable
class NotBroughtBackNotifier(Protocol):
    """A notifier that can tell an endpoint brought back failed, with a "Try again" button."""

    def new_ref(self, key: str, now: datetime | None = None, ref: str | None = None) -> str:
        """A button reference that finds the machine."""
        ...

    def not_brought_back(self, record: MachineRecord, by: str, since: datetime, left: str | None) -> bool:
        """True when every copy of the message was edited. `left`: why the failed endpoint could not be deleted."""
        ...


def endpoint_signals(
    reader: MetricsReader,
    machines: Sequence[Machine],
    refs_of: Mapping[str, TeamPolicyRef],
    settings: Settings,
    now: datetime,
) -> dict[str, Signals]:
    """The invocations of the endpoints among `machines` that are read (not exempt, their team not in safe mode),
    each over its own window plus the largest hole allowed, in as few GetMetricData calls as their queries fill."""
    by_lookback: dict[int, dict[str, tuple[str, Sequence[str]]]] = {}
    for m in machines:
        policy = refs_of[m.instance_id].policy
        facts = m.facts.endpoint
        if facts is None or policy is None or parse_exemption(m.exempt_tag, now)[0]:
            continue
        lookback = policy.idle_minutes + policy.max_gap_minutes
        by_lookback.setdefault(lookback, {})[m.instance_id] = (facts.name, [v.name for v in facts.variants])
    signals: dict[str, Signals] = {}
    period = settings.metrics.period_seconds
    for lookback, endpoints in by_lookback.items():
        start = now - timedelta(minutes=lookback, seconds=period)
        signals.update(reader.fetch_invocations(endpoints, settings.metrics, start=start, end=now))
    return signals


def report_unlisted_endpoints(
    adapters: Adapters, settings: Settings, now: datetime, warnings: list[str], *, alert: bool
) -> None:
    """Endpoints that could not be listed are not swept this time: say so, and tell the admins once a day per
    error."""
    unlisted = adapters.fleet.endpoints_unlisted
    if not unlisted:
        return
    text = (
        f"idle-reaper could not list SageMaker endpoints ({unlisted}); none is swept (none deleted, no owner told) "
        "until it can. Check the sweep role's sagemaker:ListEndpoints, DescribeEndpoint, DescribeEndpointConfig, "
        "DescribeModel and ListTags, and application-autoscaling:DescribeScalableTargets."
    )
    tell_unlisted(adapters, "endpoints", unlisted, text, settings, now, warnings, alert=alert)


def mark_back_in_service(
    decisions: Sequence[Decision], now: datetime
) -> tuple[list[Decision], dict[str, tuple[str, datetime]]]:
    """The decisions, each endpoint (Studio app) brought back (started again) and now InService with its bring-back
    cleared from its record, and who brought each back and since when (`now` if its record cannot say), by machine
    key (told once the record is written)."""
    out: list[Decision] = []
    back: dict[str, tuple[str, datetime]] = {}
    for d in decisions:
        restore = pending_restore(d.machine.facts.endpoint, d.machine.facts.studio, d.record.endpoint)
        if restore is None or not restore.pending_by:
            out.append(d)
            continue
        since = _time(restore.pending_since) or now
        cleared = replace(restore, pending_by=None, pending_since=None).to_json()
        out.append(replace(d, record=replace(d.record, endpoint=cleared)))
        back[d.machine.key] = (restore.pending_by, since)
    return out, back


def tell_back_in_service(
    adapters: Adapters,
    decisions: Sequence[Decision],
    back: Mapping[str, tuple[str, datetime]],
    written: set[str],
) -> None:
    """Edit the message of each endpoint brought back whose cleared record this sweep wrote."""
    notifier = adapters.notifier
    for d in decisions:
        told = back.get(d.machine.key)
        if told is None or d.machine.instance_id not in written:
            continue
        if not isinstance(notifier, BackInServiceNotifier):
            logger.info("endpoint back in service", extra={"endpoint": d.machine.instance_id, "by": told[0]})
            continue
        try:
            if not notifier.back_in_service(d.record, *told):
                logger.warning("back-in-service message not edited", extra={"endpoint": d.machine.instance_id})
        except Exception as exc:  # a message must never stop the sweep
            logger.warning("back-in-service message failed", extra={"error": str(exc)})


class FailedLister(Protocol):
    """What telling a failed bring-back needs of a SageMaker kind's adapter (aws/endpoints.py, aws/studio.py)."""

    def failure_reason(self, machine_id: str) -> str: ...

    def delete(self, machine_ids: Sequence[str]) -> list[ActionOutcome]: ...


def tell_failed_bring_backs(
    adapters: Adapters, now: datetime, member: tuple[str, str] | None = None, *, lister: bool = True
) -> int:
    """Each endpoint brought back (Studio app started again) that discovery listed Failed: recorded deleted again
    with SageMaker's reason, the failed one deleted, its message edited once with "Try again" (the module's
    docstring). How many were told; one that cannot be (its reason unread, its record not written) is tried again
    at the next sweep. `lister` False: a shard's sweep, which listed nothing (its planner tells them,
    sweep/fanout.py)."""
    fleet = adapters.fleet
    if not lister:
        return 0
    kinds: list[tuple[Sequence[str], FailedLister | None, Callable[[str | None], Restore | AppRestore | None]]] = [
        (fleet.endpoints_failed, fleet.endpoints, Restore.parse),
        (fleet.studio_failed, fleet.studio, AppRestore.parse),
    ]
    return sum(
        _tell_failed(adapters, failed, kind, parse, now, member) for failed, kind, parse in kinds if failed and kind
    )


def _tell_failed(
    adapters: Adapters,
    failed: Sequence[str],
    kind: FailedLister,
    parse: Callable[[str | None], Restore | AppRestore | None],
    now: datetime,
    member: tuple[str, str] | None,
) -> int:
    try:
        records = adapters.store.load([machine_key(i, *member) if member else i for i in failed])
    except Exception as exc:  # told at the next sweep
        logger.warning("failed bring-backs not read", extra={"error": type(exc).__name__})
        return 0
    told, teller = 0, adapters.notifier if isinstance(adapters.notifier, NotBroughtBackNotifier) else None
    for record in records.values():
        restore = parse(record.endpoint)
        if restore is None or not restore.pending_by:
            continue  # not one a person brought back: a Failed one costs nothing, and is not ours to touch
        try:
            why = kind.failure_reason(record.instance_id)
            ref = teller.new_ref(record.key, now) if teller is not None else None
            again = bring_back_failed(record, restore, why, now, ref)
            if not adapters.store.save(again):
                continue  # another sweep (or a person) got there first
        except Exception as exc:  # never stops the sweep; tried again at the next one
            logger.warning("failed bring-back not recorded", extra={"machine": record.instance_id, "error": str(exc)})
            continue
        told += 1
        price = hourly_price(record.instance_type or "")
        entry = answer_entry(again, Action.STOP.value, "", price)  # deleted again: it saves from now on
        with contextlib.suppress(Exception):
            adapters.store.audit(again.key, now, entry)
        left = kind.delete([record.instance_id])[0].error
        since = _time(restore.pending_since) or now
        if teller is None:
            logger.info("not brought back", extra={"machine": record.instance_id, "why": why})
            continue
        try:
            if not teller.not_brought_back(again, restore.pending_by, since, left):
                logger.warning("not-brought-back message not edited", extra={"machine": record.instance_id})
        except Exception as exc:  # a message must never stop the sweep
            logger.warning("not-brought-back message failed", extra={"error": str(exc)})
    return told


def _time(text: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(text or "")
    except ValueError:
        return None
