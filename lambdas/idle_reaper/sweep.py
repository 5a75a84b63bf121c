"""One sweep: load policies -> discover machines -> fetch signals in batches -> decide (pure) ->
apply actions in batches -> record. Adapters are passed in, so the same sweep runs against AWS,
moto, or in-memory fakes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
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
    QUIET_REPORT_GIVE_UP,
    Action,
    Decision,
    Machine,
    MachineRecord,
    Signals,
    State,
    SweepSummary,
    assess,
    decide,
    human_signal_note,
    limit_terminations,
    owner_message_groups,
    parse_exemption,
    quiet_hours_reports,
)
from idle_reaper.notify import Delivery, LoggingNotifier, Notifier, OwnerNotifier, PermanentDeliveryFailure
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
    sweep_id: str = ""  # the owner of this sweep's claims in the state table
    teams_in_safe_mode: list[str] = field(default_factory=list)  # invalid or unreadable policy: nothing acted

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
    sweep_id: str | None = None,
) -> SweepReport:
    started = time.perf_counter()
    sweep_id = sweep_id or uuid.uuid4().hex
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
    safe_mode = {ref.team for ref in refs.values() if ref.policy is None}
    safe_mode.update(team for team, ref in team_refs.items() if ref.policy is None)
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
        d = _with_status_notes(d, signals.get(m.instance_id), now)
        decisions.append(replace(d, hourly_cost=hourly_price(m.instance_type, prices)))

    terminating = {d.machine.asg_name for d in decisions if d.action is Action.TERMINATE and d.applied}
    if terminating:
        try:
            capacity = adapters.fleet.group_capacity(name for name in terminating if name)
        except AwsError:
            capacity = {}  # unknown capacity: limit_terminations allows none
        decisions = limit_terminations(decisions, capacity)

    if not dry_run:
        decisions = _apply(adapters, decisions, records, settings, sweep_id, now)
        _report_quiet_hours(adapters, decisions, refs, settings, now)
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
        sweep_id=sweep_id,
        teams_in_safe_mode=sorted(safe_mode),
    )


def _alert_invalid_policies(adapters: Adapters, refs: list[TeamPolicyRef], settings: Settings, now: datetime) -> None:
    """Tell the admins about an invalid stored team policy once per bad parameter version, not every sweep."""
    for ref in refs:
        if ref.policy is not None or ref.version is None:
            continue
        text = (
            f"team {ref.team} is in safe mode (nothing is stopped or unprotected) because its policy is invalid: "
            f"{ref.error}. Fix it with `idle-reaper policy validate` and `idle-reaper policy put {ref.team} FILE`."
        )
        _alert_once(adapters, f"policy-alert#{ref.source}@v{ref.version}", text, settings, now)


def _alert_once(adapters: Adapters, key: str, text: str, settings: Settings, now: datetime) -> None:
    """Tell the admins once per `key`: a conditional write lets only the first sweep that sees it alert.
    An alert nobody received is released, so the next sweep tries again."""
    try:
        if not adapters.store.claim_once(key, now):
            return
    except Exception as exc:  # an alert must never stop the sweep; the log still says it
        logger.warning("could not record the admin alert", extra={"key": key, "error": str(exc)})
        return
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


def _apply(
    adapters: Adapters,
    decisions: list[Decision],
    previous: Mapping[str, MachineRecord],
    settings: Settings,
    sweep_id: str,
    now: datetime,
) -> list[Decision]:
    """Claim, act, tell, record. Before a machine is posted about or acted on, its record (the intent:
    warning, stopping, ...) is written together with this sweep's claim, conditionally on the version
    this sweep read and on no other sweep holding a live claim. So of two overlapping sweeps only one
    gets past this write, and the other does nothing to the machine until the outcome is recorded and
    the claim released. Machines nothing happens to are written under the same conditions, unclaimed.
    Per-machine failures are recorded on the decision, never raised."""
    store = adapters.store
    by_id: dict[str, Decision] = {}
    written: set[str] = set()
    claimed: set[str] = set()
    for d in decisions:
        d = _delivery_intent(d, previous.get(d.machine.instance_id), now)
        hold = _posts_or_acts(d)
        try:
            saved = store.save(d.record, sweep_id, hold=hold)
        except AwsError as exc:
            saved = False
            d = replace(d, error=f"state table write failed ({error_code(exc)}); nothing done")
        if not saved and d.error is None:
            d = replace(d, error="another sweep is handling this machine, or changed it first; nothing done")
        if saved:
            written.add(d.machine.instance_id)
            if hold:
                claimed.add(d.machine.instance_id)
        by_id[d.machine.instance_id] = d

    acting = [d for d in by_id.values() if d.machine.instance_id in claimed and d.action in MACHINE_ACTIONS]
    acting = [d for d in acting if d.applied]
    if acting:
        # Another sweep may have acted between our listing and our loading the records (its record then
        # looks current to us): look again, now that we hold the claims, and act only on what is unchanged.
        try:
            unchanged = adapters.fleet.still_as_listed([d.machine for d in acting], settings.tags)
        except AwsError:
            unchanged = set()  # cannot tell: act on none of them
        for d in acting:
            if d.machine.instance_id not in unchanged:
                by_id[d.machine.instance_id] = _stand_down(store, d, previous, sweep_id)
                claimed.discard(d.machine.instance_id)
        acting = [d for d in acting if d.machine.instance_id in unchanged]
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
    owner_posts = _post_owner_messages(
        adapters, [d for i, d in by_id.items() if i in claimed and not outcomes.get(i) and d.deliver_warning]
    )
    for d in by_id.values():
        instance_id = d.machine.instance_id
        if outcomes.get(instance_id):
            d = _record_failure(store, d, outcomes[instance_id] or "", sweep_id, now)
        elif instance_id in claimed:
            d = _notify(adapters, d, sweep_id, settings, now, owner_posts)
        if instance_id in written and d.record.delivery_error and d.record.warned_at:
            _alert_undeliverable(adapters, d, settings, now)
        if (d.action is not Action.NONE and d.error is None) or instance_id in outcomes:
            _audit(store, d, now)
        result.append(d)
    return result


def _stand_down(store: StateStore, d: Decision, previous: Mapping[str, MachineRecord], sweep_id: str) -> Decision:
    """Put back the record as it was before this sweep claimed the machine, and release the claim."""
    before = previous.get(d.machine.instance_id) or MachineRecord(d.machine.instance_id, d.machine.team)
    record = replace(before, version=d.record.version + 1)
    with contextlib.suppress(*AwsError):
        store.save(record, sweep_id)  # if this fails, the claim lapses after SWEEP_LEASE
    error = "the machine changed since this sweep listed it (another sweep or a person acted first); nothing done"
    return replace(d, record=record, error=error)


def _posts_or_acts(d: Decision) -> bool:
    """Whether applying `d` talks to people or changes the machine: then it must hold the claim."""
    acts = d.applied and d.action in MACHINE_ACTIONS
    return acts or d.deliver_warning or d.notify in ("resolved", "reaped")


def _delivery_intent(d: Decision, previous: MachineRecord | None, now: datetime) -> Decision:
    """Carry the warning's delivery state from sweep to sweep, and mark the intent to post before posting.

    A new warning (a new quiet stretch) starts clean. A mark left by a sweep that began posting and never
    recorded the outcome (the table failed, or the sweep died) means the owner may have the warning
    already: it is not posted again (told at most once), and because it is not known as delivered the
    stop waits as for an undelivered warning. A warning that cannot be delivered is not retried."""
    record = d.record
    same_warning = previous is not None and record.warned_at is not None and record.warned_at == previous.warned_at
    if not same_warning:
        if record.warning_post_started_at or record.delivery_error:
            record = replace(record, warning_post_started_at=None, delivery_error=None)
    elif d.deliver_warning and record.delivery_error is None and record.warning_post_started_at is not None:
        record = replace(
            record,
            warning_post_started_at=None,
            delivery_error=(
                f"delivery unknown: a sweep began posting this warning at {record.warning_post_started_at:%H:%M} "
                "UTC and could not record whether it was delivered"
            ),
        )
    if d.deliver_warning and record.delivery_error:
        reason = f"{d.reason}; not sent again: {record.delivery_error}"
        return replace(d, deliver_warning=False, reason=reason, record=replace(record, reason=reason))
    if d.deliver_warning:
        record = replace(record, warning_post_started_at=now)
    return replace(d, record=record)


def _alert_undeliverable(adapters: Adapters, d: Decision, settings: Settings, now: datetime) -> None:
    """Once per machine per warning: the admins learn that its owner cannot be (or may not have been) told."""
    record, m = d.record, d.machine
    assert record.warned_at is not None
    policy = d.policy.policy if d.policy else None
    held = ""
    if policy is not None:
        until = record.warned_at + timedelta(minutes=policy.undelivered_warning_max_minutes)
        held = f" It is not stopped before {until:%Y-%m-%d %H:%M} UTC (undelivered_warning_max_minutes) unless kept."
    text = (
        f"the idle warning for {m.name or m.instance_id} ({m.instance_id}, team {m.team}, owner {m.owner or 'none'}) "
        f"was not delivered and is not retried: {record.delivery_error}.{held} "
        "Fix the cause (the Owner tag, the team's slack_channel, the bot's membership); `idle-reaper status` shows it."
    )
    _alert_once(adapters, f"undeliverable#{m.instance_id}@{record.warned_at.isoformat()}", text, settings, now)


def _alert_partly_delivered(
    adapters: Adapters, d: Decision, undelivered: tuple[str, ...], settings: Settings, now: datetime
) -> None:
    """The warning reached someone (so it counts), but not every target: e.g. the owner's DM went out and
    the team channel refused it. Said once per machine per warning, so the channel gets fixed."""
    m, record = d.machine, d.record
    assert record.warned_at is not None
    text = (
        f"the idle warning for {m.name or m.instance_id} ({m.instance_id}, team {m.team}) was delivered, "
        f"but not to every target: {'; '.join(undelivered)}"
    )
    _alert_once(adapters, f"partly-undelivered#{m.instance_id}@{record.warned_at.isoformat()}", text, settings, now)


def _record_failure(store: StateStore, d: Decision, error: str, sweep_id: str, now: datetime) -> Decision:
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
    # If this write fails too, the decision still carries the error; the claim lapses after SWEEP_LEASE
    # and a later sweep re-reads the truth.
    with contextlib.suppress(*AwsError):
        store.save(record, sweep_id)
    return replace(d, error=reason, record=record, state=state)


def _notify(
    adapters: Adapters,
    d: Decision,
    sweep_id: str,
    settings: Settings,
    now: datetime,
    owner_posts: Mapping[str, Delivery | PermanentDeliveryFailure | None] | None = None,
) -> Decision:
    """Post what the decision calls for, then record the outcome and release the claim. The write is
    conditional: an answer a person gave meanwhile wins, and a late sweep never overwrites newer truth.
    A warning already posted in its owner's shared message (`owner_posts`) is recorded as that post went."""
    record, reason = d.record, d.reason
    delivery: Delivery | None = None
    try:
        if d.deliver_warning and owner_posts and d.machine.instance_id in owner_posts:
            delivery = _owner_post(owner_posts[d.machine.instance_id])
        elif d.deliver_warning:
            delivery = adapters.notifier.warn(d)
        elif d.notify == "resolved":
            adapters.notifier.resolved(d)
        elif d.notify == "reaped":
            delivery = adapters.notifier.reaped(d)
    except PermanentDeliveryFailure as exc:
        logger.warning("message cannot be delivered", extra={"instance_id": d.machine.instance_id, "why": exc.reason})
        if d.deliver_warning:
            reason = f"{reason}; the warning cannot be delivered: {exc.reason}"
            record = replace(record, delivery_error=exc.reason, reason=reason)
    except Exception as exc:  # a notifier must never break the sweep; the warning stays pending
        logger.warning("notification failed", extra={"instance_id": d.machine.instance_id, "error": str(exc)})
    if d.deliver_warning:
        record = replace(record, warning_post_started_at=None)  # the outcome is known: delivered or not
    if delivery is not None:
        stop_not_before = record.stop_not_before
        policy = d.policy.policy if d.policy else None
        if d.deliver_warning and policy is not None:
            # Delivered late: the owner still gets warn_minutes from now, and the message says so.
            stop_not_before = max(stop_not_before or now, now + timedelta(minutes=policy.warn_minutes))
        record = replace(
            record,
            stop_not_before=stop_not_before,
            warning_delivered_at=now if d.deliver_warning else record.warning_delivered_at,
            messages=delivery.messages or record.messages,
            warning_ref=delivery.ref,
            owner_slack_id=delivery.owner_slack_id or record.owner_slack_id,
            group_ref=delivery.group_ref if d.deliver_warning else record.group_ref,
        )
    if delivery is not None and delivery.undelivered and d.deliver_warning and record.warned_at:
        _alert_partly_delivered(adapters, d, delivery.undelivered, settings, now)
    record = replace(record, version=record.version + 1)
    d = replace(d, record=record, reason=reason)
    try:
        if not adapters.store.save(record, sweep_id):
            logger.warning("the machine changed while claimed (a person answered); outcome not recorded")
    except AwsError as exc:
        # The claim lapses after SWEEP_LEASE; a warning whose outcome is lost is not posted again.
        return replace(d, error=f"outcome not recorded: state table write failed ({error_code(exc)})")
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


def _with_status_notes(d: Decision, signals: Signals | None, now: datetime) -> Decision:
    """Keep on the record what the human-activity signal said, so `status` can show it without CloudWatch,
    and mark a stop made during quiet hours, so its owner hears of it when they end (_report_quiet_hours)."""
    record = replace(d.record, human_signal=human_signal_note(d.assessment, signals, now))
    policy = d.policy.policy if d.policy else None
    if policy is not None and policy.quiet_hours and d.applied and d.action in (Action.STOP, Action.HIBERNATE):
        record = replace(record, quiet_stop_at=now)
    return replace(d, record=record)


def _post_owner_messages(
    adapters: Adapters, warnings: list[Decision]
) -> dict[str, Delivery | PermanentDeliveryFailure | None]:
    """One message per owner: the warnings of this sweep that share an owner and targets
    (core.owner_message_groups) are posted together, before each machine's outcome is recorded by
    _notify as for a warning of its own. A lone warning, or a notifier that cannot group, posts as before.
    A message that fails leaves each machine it lists undelivered (pending, or its permanent fault)."""
    notifier = adapters.notifier
    if not isinstance(notifier, OwnerNotifier):
        return {}
    posts: dict[str, Delivery | PermanentDeliveryFailure | None] = {}
    for group in owner_message_groups(warnings):
        if len(group) < 2:
            continue
        ids = [d.machine.instance_id for d in group]
        try:
            outcomes = notifier.warn_owner(group)
        except Exception as exc:  # a notifier must never break the sweep; the warnings stay pending
            logger.warning("owner message failed", extra={"instance_ids": ids, "error": str(exc)})
            outcomes = [None] * len(group)
        posts.update(zip(ids, outcomes, strict=True))
    return posts


def _owner_post(outcome: Delivery | PermanentDeliveryFailure | None) -> Delivery | None:
    if isinstance(outcome, PermanentDeliveryFailure):
        raise outcome
    return outcome


QUIET_INDEX = "quiet-stops"  # lookup: JSON {team: [instance ids stopped during quiet hours, not yet reported]}
QUIET_INDEX_TTL = timedelta(days=7)


def _report_quiet_hours(
    adapters: Adapters, decisions: list[Decision], refs: Mapping[str, TeamPolicyRef], settings: Settings, now: datetime
) -> None:
    """Quiet hours are not lost: the machines this sweep stopped during their team's quiet hours join an
    index in the state table; at the first sweep after a team's quiet hours end, each owner gets ONE
    summary of what was stopped (core.quiet_hours_reports), with "Start it again" per machine. Sent once: a
    claim per summary (claim_once), released when the post fails so the next sweep tries again, for at
    most core.QUIET_REPORT_GIVE_UP. The index is updated conditionally (shards of one sweep and overlapping
    sweeps update it at once: none loses another's entries). Never fails the sweep."""
    notifier, store = adapters.notifier, adapters.store
    if not isinstance(notifier, OwnerNotifier):
        return
    stopped: dict[str, list[str]] = defaultdict(list)
    for d in decisions:
        if d.record.quiet_stop_at == now and d.error is None and d.record.state is State.REAPED:
            stopped[d.machine.team].append(d.machine.instance_id)

    def add_stopped(index: dict[str, list[str]]) -> dict[str, list[str]]:
        for team, ids in stopped.items():
            index.setdefault(team, []).extend(i for i in ids if i not in index.get(team, []))
        return index

    try:
        pending = _update_quiet_index(store, now, add_stopped)
        awake = {t for t in pending if (p := policy_for(t, refs, settings).at(now).policy) and not p.quiet_hours}
        if not awake:
            return
        due = [i for t in sorted(awake) for i in pending[t]]
        done = set(due) - set(_send_quiet_summaries(adapters, notifier, due, now))  # sent, or given up

        def remove_done(index: dict[str, list[str]]) -> dict[str, list[str]]:
            left = {team: [i for i in ids if i not in done] for team, ids in index.items()}
            return {team: ids for team, ids in left.items() if ids}

        if done:
            _update_quiet_index(store, now, remove_done)
    except Exception as exc:  # the summary must never fail the sweep; the index stays for the next one
        logger.warning("quiet hours summary failed", extra={"error": str(exc)})


QUIET_INDEX_ATTEMPTS = 5


def _update_quiet_index(
    store: StateStore, now: datetime, change: Callable[[dict[str, list[str]]], dict[str, list[str]]]
) -> dict[str, list[str]]:
    """Read, change and write back the quiet-stops index, conditionally on what was read; again when another
    sweep wrote it first. Returns the index as written (or as read, when the change changes nothing)."""
    for _ in range(QUIET_INDEX_ATTEMPTS):
        raw = store.get_lookup(QUIET_INDEX, now)
        before = _quiet_index(raw)
        after = change({team: list(ids) for team, ids in before.items()})
        if after == before:
            return before
        if store.replace_lookup(
            QUIET_INDEX, json.dumps(after, sort_keys=True), now + QUIET_INDEX_TTL, expected=raw, now=now
        ):
            return after
    raise RuntimeError(f"the quiet hours index changed under this sweep {QUIET_INDEX_ATTEMPTS} times in a row")


def _quiet_index(raw: str | None) -> dict[str, list[str]]:
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        logger.warning("quiet hours index unreadable; reset", extra={"value": (raw or "")[:200]})
        return {}
    return {str(team): [str(i) for i in ids] for team, ids in data.items()}


def _send_quiet_summaries(adapters: Adapters, notifier: OwnerNotifier, ids: list[str], now: datetime) -> list[str]:
    """One summary per owner of the stopped machines `ids`; returns the ids to try again next sweep."""
    store = adapters.store
    retry: list[str] = []
    for group in quiet_hours_reports(store.load(ids).values()):
        oldest = min(r.quiet_stop_at or now for r in group)
        listed = ",".join(f"{r.instance_id}@{(r.quiet_stop_at or now).isoformat()}" for r in group)
        key = f"quiet-summary#{hashlib.sha256(listed.encode()).hexdigest()[:32]}"
        if not store.claim_once(key, now):
            continue  # this summary was sent already (a re-run sweep)
        try:
            deliveries = notifier.quiet_summary(group)
        except PermanentDeliveryFailure as exc:
            logger.warning("quiet hours summary cannot be delivered", extra={"why": exc.reason})
            continue
        except Exception as exc:
            logger.warning("quiet hours summary failed", extra={"error": str(exc)})
            deliveries = None
        if deliveries is None:
            store.release_claim(key)
            if now - oldest < QUIET_REPORT_GIVE_UP:
                retry += [r.instance_id for r in group]
            else:
                logger.warning("quiet hours summary given up", extra={"instance_ids": [r.instance_id for r in group]})
            continue
        for r, delivery in zip(group, deliveries, strict=True):
            told = replace(
                r,
                version=r.version + 1,
                quiet_stop_at=None,
                warning_ref=delivery.ref or r.warning_ref,
                group_ref=delivery.group_ref,
                messages=delivery.messages or r.messages,
                owner_slack_id=delivery.owner_slack_id or r.owner_slack_id,
            )
            with contextlib.suppress(*AwsError):
                if not store.save(told):
                    logger.warning(
                        "machine changed while its quiet hours summary was sent", extra={"id": r.instance_id}
                    )
    return retry
