"""What a sweep does for SageMaker endpoints beyond the machines' lifecycle: reads their invocations, says when they
could not be listed, and tells the person who brought one back that it is InService again.

"Bring it back" (slack/answers.py) calls CreateEndpoint and returns at once: an endpoint takes minutes to be
InService, longer than Slack's 3 seconds and the answer's own invocation. The person's name stays on the record
(core/endpoints.Restore.pending_by); the first sweep that finds the endpoint InService clears it in the record it
writes anyway and, once that write succeeded, edits the endpoint's message: "Back in service". Like every message
update it is best effort: a failed edit is logged, not retried (the endpoint is in service either way)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.core.lifecycle import Decision
from idle_reaper.core.records import MachineRecord
from idle_reaper.core.signals import Machine, Signals, parse_exemption
from idle_reaper.core.studio import pending_restore
from idle_reaper.notify import logger
from idle_reaper.policy import Settings, TeamPolicyRef
from idle_reaper.sweep.adapters import Adapters, alert_once


@runtime_checkable
class BackInServiceNotifier(Protocol):
    """A notifier that can edit an endpoint's message when it is InService again."""

    def back_in_service(self, record: MachineRecord, by: str, since: datetime) -> bool:
        """True when every copy of the message was edited."""
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
    warnings.append(text)
    if alert:
        alert_once(adapters, f"endpoints-unlisted#{now:%Y-%m-%d}#{unlisted.split(':', 1)[0]}", text, settings, now)


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
        try:
            since = datetime.fromisoformat(restore.pending_since or "")
        except ValueError:
            since = now
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
