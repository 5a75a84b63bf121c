"""One sweep: load policies -> discover machines -> fetch signals in batches -> decide (pure) ->
apply actions in batches -> record. Adapters are passed in, so the same sweep runs against AWS,
moto, or in-memory fakes."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper.aws import (
    DATAPOINTS_PER_CALL,
    METRIC_QUERIES_PER_CALL,
    AwsError,
    DynamoStateStore,
    Fleet,
    MetricsReader,
    PolicyStore,
    StateStore,
    client,
    error_code,
    policy_for,
    ssm_prefix,
    table_name,
)
from idle_reaper.core import (
    MACHINE_ACTIONS,
    Action,
    Decision,
    Machine,
    Signals,
    State,
    SweepSummary,
    assess,
    decide,
    limit_terminations,
    parse_exemption,
)
from idle_reaper.notify import LoggingNotifier, Notifier
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.policy import PolicyError, Settings, TeamPolicyRef
from idle_reaper.pricing import DEFAULT_PRICES, hourly_price


class SweepCannotRun(Exception):
    """The sweep could not run at all (invalid settings, no EC2 or state table access)."""


@dataclass
class SweepReport:
    now: datetime
    dry_run: bool
    decisions: list[Decision]
    settings_version: int | None
    metric_calls: int = 0
    duration_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def summary(self) -> SweepSummary:
        return SweepSummary.of(self.decisions)

    @property
    def errors(self) -> list[Decision]:
        return [d for d in self.decisions if d.error]


@dataclass
class Adapters:
    policies: PolicyStore
    fleet: Fleet
    metrics: MetricsReader
    store: StateStore
    notifier: Notifier

    @classmethod
    def from_environment(cls, notifier: Notifier | None = None, slack_budget_seconds: float = 60.0) -> Adapters:
        """Real AWS clients; Slack when a bot token is configured, else warnings are only logged."""
        store = DynamoStateStore(client("dynamodb"), table_name())
        if notifier is None:
            from idle_reaper.slack import SlackNotConfigured, SlackNotifier, load_secrets, make_client

            try:
                secrets = load_secrets()
                notifier = SlackNotifier(make_client(secrets.bot_token, slack_budget_seconds), store)
            except Exception as exc:  # not configured, or the secret cannot be read: warnings stay pending
                logger.warning(
                    "Slack unavailable: warnings stay pending, stops wait for undelivered_warning_max_minutes",
                    extra={"why": str(exc) if isinstance(exc, SlackNotConfigured) else type(exc).__name__},
                )
                notifier = LoggingNotifier(logger)
        return cls(
            policies=PolicyStore(client("ssm"), ssm_prefix()),
            fleet=Fleet(client("ec2"), client("autoscaling")),
            metrics=MetricsReader(client("cloudwatch")),
            store=store,
            notifier=notifier,
        )


def run_sweep(
    adapters: Adapters,
    *,
    now: datetime,
    dry_run: bool = False,
    prices: Mapping[str, float] = DEFAULT_PRICES,
    policy_overrides: Mapping[str, TeamPolicyRef] | None = None,
) -> SweepReport:
    started = time.perf_counter()
    now = now.astimezone(UTC)  # CloudWatch speaks UTC, and so do reasons and records
    try:
        settings, settings_version = adapters.policies.load_settings()
    except PolicyError as exc:
        raise SweepCannotRun(f"settings are invalid, nothing was changed: {exc}") from None
    except AwsError as exc:
        raise SweepCannotRun(f"cannot read settings ({error_code(exc)}): {exc}") from None
    dry_run = dry_run or settings.dry_run
    warnings: list[str] = []

    try:
        refs = adapters.policies.load_teams(settings)
        teams_readable = True
    except AwsError as exc:
        refs, teams_readable = {}, False
        warnings.append(f"cannot read team policies ({error_code(exc)}); every team is in safe mode")
    if not dry_run:
        _alert_invalid_policies(adapters, list(refs.values()), settings, now)
    refs.update(policy_overrides or {})
    for ref in refs.values():
        if ref.policy is None:
            warnings.append(f"invalid team policy, team in safe mode: {ref.error}")

    try:
        machines = adapters.fleet.discover(settings.tags)
        records = adapters.store.load([m.instance_id for m in machines])
    except AwsError as exc:
        raise SweepCannotRun(f"cannot list machines or read the state table ({error_code(exc)}): {exc}") from None

    def ref_for(team: str) -> TeamPolicyRef:
        if not teams_readable:
            return TeamPolicyRef(
                team=team,
                policy=None,
                source=f"{adapters.policies.prefix}/teams/{team}",
                version=None,
                error="team policies could not be read",
            )
        return policy_for(team, refs, settings)

    # Schedules apply by the team's local time at `now`; the label records which one was in force.
    team_refs = {m.team: ref_for(m.team).at(now) for m in machines}
    signals = _fetch_signals(adapters.metrics, machines, team_refs, settings, now)
    period = timedelta(seconds=settings.metrics.period_seconds)

    decisions = []
    for m in machines:
        ref = team_refs[m.team]
        assessment = None
        if ref.policy is not None and m.instance_id in signals:
            assessment = assess(
                m,
                signals[m.instance_id],
                ref.policy,
                now=now,
                period=period,
                gpu_families=settings.gpu_instance_families,
            )
        d = decide(m, ref, assessment, records.get(m.instance_id), now=now, dry_run=dry_run)
        decisions.append(replace(d, hourly_cost=hourly_price(m.instance_type, prices)))

    terminating = {d.machine.asg_name for d in decisions if d.action is Action.TERMINATE and d.applied}
    if terminating:
        try:
            capacity = adapters.fleet.group_capacity(name for name in terminating if name)
        except AwsError:
            capacity = {}  # unknown capacity: limit_terminations allows none
        decisions = limit_terminations(decisions, capacity)

    if not dry_run:
        decisions = _apply(adapters, decisions, now)
    for d in decisions:
        _log_decision(d, dry_run)
    return SweepReport(
        now=now,
        dry_run=dry_run,
        decisions=decisions,
        settings_version=settings_version,
        metric_calls=adapters.metrics.stats.calls,
        duration_ms=(time.perf_counter() - started) * 1000,
        warnings=warnings,
    )


def _alert_invalid_policies(adapters: Adapters, refs: list[TeamPolicyRef], settings: Settings, now: datetime) -> None:
    """Tell the admins about an invalid stored team policy once per bad parameter version, not every
    sweep: a conditional write in the state table lets only the first sweep that sees it alert."""
    for ref in refs:
        if ref.policy is not None or ref.version is None:
            continue
        key = f"policy-alert#{ref.source}@v{ref.version}"
        try:
            if not adapters.store.claim_once(key, now):
                continue
        except Exception as exc:  # an alert must never stop the sweep; the log still says it
            logger.warning("could not record the policy alert", extra={"key": key, "error": str(exc)})
            continue
        text = (
            f"team {ref.team} is in safe mode (nothing is stopped or unprotected) because its policy is invalid: "
            f"{ref.error}. Fix it with `idle-reaper policy validate` and `idle-reaper policy put {ref.team} FILE`."
        )
        try:
            adapters.notifier.admin_alert(text, settings.admins, settings.admin_channel)
        except Exception as exc:
            logger.warning("admin alert failed", extra={"key": key, "error": str(exc)})
            with contextlib.suppress(Exception):
                adapters.store.release_claim(key)  # the next sweep tries again


def _fetch_signals(
    reader: MetricsReader,
    machines: list[Machine],
    team_refs: Mapping[str, TeamPolicyRef],
    settings: Settings,
    now: datetime,
) -> dict[str, Signals]:
    """Pack machines into as few GetMetricData calls as possible. Every window short enough that 500
    queries fit under the datapoint limit shares one range (the longest of them), so the whole fleet
    usually takes ceil(metrics x machines / 500) calls. A longer window gets its own range, and so do
    teams with a network threshold, so neither makes every other machine fetch more. Exempt machines
    and teams in safe mode are not fetched at all."""
    period = settings.metrics.period_seconds
    shared_points = DATAPOINTS_PER_CALL // METRIC_QUERIES_PER_CALL
    groups: dict[tuple[int, bool], list[str]] = defaultdict(list)
    short_lookback = 0  # the longest window among those that share a range
    for m in machines:
        policy = team_refs[m.team].policy
        if policy is None or parse_exemption(m.exempt_tag, now)[0]:
            continue
        lookback = policy.idle_minutes + policy.max_gap_minutes
        network = policy.network_threshold_bytes_per_second is not None
        if lookback * 60 // period + 2 > shared_points:
            groups[(lookback, network)].append(m.instance_id)
        else:
            short_lookback = max(short_lookback, lookback)
            groups[(0, network)].append(m.instance_id)
    signals: dict[str, Signals] = {}
    for (lookback, network), ids in groups.items():
        start = now - timedelta(minutes=lookback or short_lookback, seconds=period)
        signals.update(reader.fetch(ids, settings.metrics, start=start, end=now, network=network))
    return signals


def _apply(adapters: Adapters, decisions: list[Decision], now: datetime) -> list[Decision]:
    """Write each record first (conditionally: an overlapping sweep cannot act twice), then act in
    batches, then notify. Per-machine failures are recorded on the decision, never raised."""
    store = adapters.store
    by_id: dict[str, Decision] = {}
    for d in decisions:
        try:
            saved = store.save(d.record)
        except AwsError as exc:
            saved = False
            d = replace(d, error=f"state table write failed ({error_code(exc)}); nothing done")
        if not saved and d.error is None:
            d = replace(d, error="another sweep changed this machine first; nothing done")
        by_id[d.machine.instance_id] = d

    acting = [d for d in by_id.values() if d.error is None and d.applied and d.action in MACHINE_ACTIONS]
    outcomes: dict[str, str | None] = {}
    for hibernate in (False, True):
        ids = [d.machine.instance_id for d in acting if d.action is (Action.HIBERNATE if hibernate else Action.STOP)]
        for o in adapters.fleet.stop(ids, hibernate=hibernate):
            outcomes[o.instance_id] = o.error
    groups: dict[tuple[str, bool], list[str]] = defaultdict(list)
    for d in acting:
        if d.action in (Action.PROTECT, Action.UNPROTECT):
            groups[(d.machine.asg_name or "", d.action is Action.PROTECT)].append(d.machine.instance_id)
    for (group, protected), ids in groups.items():
        for o in adapters.fleet.set_protection(group, ids, protected=protected):
            outcomes[o.instance_id] = o.error
    for d in acting:
        if d.action is Action.TERMINATE:
            outcomes[d.machine.instance_id] = adapters.fleet.terminate_in_group(d.machine.instance_id).error

    result: list[Decision] = []
    for d in by_id.values():
        instance_id = d.machine.instance_id
        if outcomes.get(instance_id):
            d = _record_failure(store, d, outcomes[instance_id] or "", now)
        if d.error is None:
            d = _notify(adapters, d, now)
        if (d.action is not Action.NONE and d.error is None) or instance_id in outcomes:
            _audit(store, d, now)
        result.append(d)
    return result


def _record_failure(store: StateStore, d: Decision, error: str, now: datetime) -> Decision:
    # A machine already stopped or gone is recorded, not retried; anything else stays warned so the
    # next sweep tries again.
    gone = any(code in error for code in ("InvalidInstanceID.NotFound", "IncorrectInstanceState"))
    state = State.REAPED if gone and d.action in (Action.STOP, Action.HIBERNATE) else d.record.state
    if not gone and d.action in (Action.STOP, Action.HIBERNATE, Action.UNPROTECT, Action.TERMINATE):
        state = State.WARNED
    reason = f"{d.action.value} failed: {error}"
    record = replace(
        d.record,
        version=d.record.version + 1,
        state=state,
        reason=reason,
        last_action=f"{d.action.value}_failed",
        last_action_at=now,
    )
    # If this write fails too, the decision still carries the error; the next sweep re-reads the truth.
    with contextlib.suppress(*AwsError):
        store.save(record)
    return replace(d, error=reason, record=record, state=state)


def _notify(adapters: Adapters, d: Decision, now: datetime) -> Decision:
    notifier = adapters.notifier
    try:
        delivery = None
        if d.deliver_warning:
            delivery = notifier.warn(d)
            if delivery is None:
                return d
        elif d.notify == "resolved":
            notifier.resolved(d)
        elif d.notify == "reaped":
            delivery = notifier.reaped(d)
        if delivery is not None:
            stop_not_before = d.record.stop_not_before
            policy = d.policy.policy if d.policy else None
            if d.deliver_warning and policy is not None:
                # Delivered late: the owner still gets warn_minutes from now, and the message says so.
                stop_not_before = max(stop_not_before or now, now + timedelta(minutes=policy.warn_minutes))
            record = replace(
                d.record,
                version=d.record.version + 1,
                stop_not_before=stop_not_before,
                warning_delivered_at=now if d.deliver_warning else d.record.warning_delivered_at,
                messages=delivery.messages or d.record.messages,
                warning_ref=delivery.ref,
                owner_slack_id=delivery.owner_slack_id or d.record.owner_slack_id,
            )
            if adapters.store.save(record):
                d = replace(d, record=record)
    except Exception as exc:  # a notifier must never break the sweep; the warning stays pending
        logger.warning("notification failed", extra={"instance_id": d.machine.instance_id, "error": str(exc)})
    return d


def _explain(d: Decision) -> dict[str, Any]:
    a = d.assessment
    return {
        "instance_id": d.machine.instance_id,
        "team": d.machine.team,
        "owner": d.machine.owner,
        "instance_type": d.machine.instance_type,
        "asg": d.machine.asg_name,
        "state": d.state.value,
        "signal": d.signal,
        "action": d.action_label,
        "reason": d.reason,
        "error": d.error,
        "policy": d.policy.label if d.policy else None,
        "window_minutes": d.policy.policy.idle_minutes if d.policy and d.policy.policy else None,
        "max_cpu": a.max_cpu if a else None,
        "max_gpu": a.max_gpu if a else None,
        "quiet_since": a.quiet_since.isoformat() if a and a.quiet_since else None,
        "idle_since": d.record.idle_since.isoformat() if d.record.idle_since else None,
        "warned_at": d.record.warned_at.isoformat() if d.record.warned_at else None,
        "snoozed_until": d.record.snoozed_until.isoformat() if d.record.snoozed_until else None,
        "snoozed_by": d.record.snoozed_by,
        "hourly_cost": d.hourly_cost,
    }


def _audit(store: StateStore, d: Decision, now: datetime) -> None:
    try:
        store.audit(d.machine.instance_id, now, _explain(d))
    except AwsError as exc:
        logger.warning("audit write failed", extra={"instance_id": d.machine.instance_id, "error": error_code(exc)})


def _log_decision(d: Decision, dry_run: bool) -> None:
    logger.info("decision", extra={**_explain(d), "dry_run": dry_run})


def decision_row(d: Decision) -> dict[str, Any]:
    """The stable per-machine JSON of `idle-reaper sweep --json`."""
    return _explain(d)
