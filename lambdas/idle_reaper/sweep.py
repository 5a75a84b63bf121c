"""One sweep: load policies -> discover machines -> fetch signals in batches -> decide (pure) ->
apply actions in batches -> record. Adapters are passed in, so the same sweep runs against AWS,
moto, or in-memory fakes."""

from __future__ import annotations

import contextlib
import heapq
import json
import random
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from idle_reaper.aws import (
    ACTION_WORKERS,
    CALL_WIDE_ERRORS,
    DATAPOINTS_PER_CALL,
    DDB_WORKERS,
    GET_METRIC_DATA_SECONDS,
    GET_METRIC_DATA_TPS,
    METRIC_QUERIES_PER_CALL,
    METRIC_WORKERS,
    ActionOutcome,
    AuditEntry,
    AwsError,
    DynamoStateStore,
    Fleet,
    MetricsReader,
    PolicyStore,
    StateStore,
    client,
    count_unwatched,
    error_code,
    home_region,
    policy_for,
    run_concurrently,
    save_unwatched,
    ssm_prefix,
    table_name,
    watched_regions,
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
    TeamTotals,
    assess,
    decide,
    human_signal_note,
    kind_policy,
    limit_terminations,
    owner_key,
    owner_message_groups,
    parse_exemption,
    quiet_hours_reports,
)
from idle_reaper.machine_kinds import Lookups, MachineKind, classify, notice_sentence, stop_saves
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
        return [d for d in self.decisions if d.error and d.error != DEFERRED]

    @property
    def deferred(self) -> list[Decision]:
        """Machines this sweep ran out of time for: untouched, left to the next sweep."""
        return [d for d in self.decisions if d.error == DEFERRED]


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
    time_left: Callable[[], float] | None = None,
    instance_ids: Sequence[str] | None = None,
    listed: Sequence[Machine] | None = None,
) -> SweepReport:
    """One sweep: of the machines `instance_ids` alone, described afresh, when given (a shard); of the
    machines the planner `listed` moments ago, when given (a fleet that fits one invocation); else of all.

    `time_left` (seconds left in the invocation, e.g. from the Lambda context): once it falls under
    FINISH_RESERVE the sweep starts no new work (no claim, no post) and finishes what it began, so it never
    ends mid-action without a record; the machines it did not reach are left to the next sweep."""
    started = time.perf_counter()
    sweep_id = sweep_id or uuid.uuid4().hex
    now = now.astimezone(UTC)  # CloudWatch speaks UTC, and so do reasons and records
    settings, settings_version = _load_settings(adapters)
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
        if instance_ids is not None:
            machines = adapters.fleet.describe_ids(instance_ids, settings.tags)
        elif listed is not None:
            machines = list(listed)
        else:
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
    kinds = _machine_kinds(adapters, machines, settings, now, warnings, alert=not dry_run)
    # Each machine's own policy: its team's, with the window its kind gets (machine_kinds.Handling).
    refs_of = {m.instance_id: kind_policy(team_refs[m.team], kinds[m.instance_id], m) for m in machines}
    signals = _fetch_signals(adapters.metrics, machines, refs_of, settings, now)
    period = timedelta(seconds=settings.metrics.period_seconds)

    decisions = []
    for m in machines:
        ref = refs_of[m.instance_id]
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
        kind = kinds[m.instance_id]
        d = decide(m, ref, assessment, records.get(m.instance_id), now=now, dry_run=dry_run, kind=kind)
        d = _with_status_notes(d, signals.get(m.instance_id), now)
        price = hourly_price(m.instance_type, prices)
        decisions.append(replace(d, hourly_cost=price, saving=stop_saves(kind, price)))

    terminating = {d.machine.asg_name for d in decisions if d.action is Action.TERMINATE and d.applied}
    if terminating:
        try:
            capacity = adapters.fleet.group_capacity(name for name in terminating if name)
        except AwsError:
            capacity = {}  # unknown capacity: limit_terminations allows none
        decisions = limit_terminations(decisions, capacity)

    written: set[str] = set()
    if not dry_run:
        decisions, written = _apply(adapters, decisions, records, settings, sweep_id, now, time_left)
        _report_quiet_hours(adapters, decisions, refs, settings, now)
    # One log line per machine something happened to (an action, an error, a lifecycle change); the others'
    # explanation is their record (`idle-reaper status`), refreshed at least hourly. A dry run logs all.
    unchanged = 0
    for d in decisions:
        if dry_run or d.action is not Action.NONE or d.error or d.machine.instance_id in written:
            _log_decision(d, dry_run)
        else:
            unchanged += 1
    if unchanged:
        logger.info("machines with nothing new, not logged one by one", extra={"machines": unchanged})
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


def _machine_kinds(
    adapters: Adapters,
    machines: Sequence[Machine],
    settings: Settings,
    now: datetime,
    warnings: list[str],
    *,
    alert: bool,
) -> dict[str, MachineKind]:
    """What kind each machine is (machine_kinds.classify), from one batched look-up per kind of question. A
    look-up that failed leaves its machines unknown (never stopped, nothing said to their owners) for this
    sweep; the admins hear of it once a day per error, and the next sweep asks again."""
    try:
        lookups = adapters.fleet.kind_lookups(machines)
    except AwsError as exc:  # a look-up the adapter did not catch: every machine that needed one is unknown
        needed = {m.facts.spot_request_id or "" for m in machines if m.facts.needs_spot_request}
        needed |= {m.facts.reservation_id or "" for m in machines if m.facts.reservation_id}
        lookups = Lookups(failed=dict.fromkeys(needed - {""}, error_code(exc)))
    kinds = {m.instance_id: classify(m.facts, lookups, now) for m in machines}
    if lookups.failed:
        errors = sorted(set(lookups.failed.values()))
        unknown = sum(1 for k in kinds.values() if k.kind.value == "unknown")
        text = (
            f"idle-reaper could not read what kind of machine {unknown} machine(s) are (Spot requests or capacity "
            f"reservations: {', '.join(errors)}); they are not stopped and their owners are not told until it can. "
            "Check the sweep role's ec2:DescribeSpotInstanceRequests and ec2:DescribeCapacityReservations."
        )
        warnings.append(text)
        if alert:
            _alert_once(adapters, f"kind-lookup#{now:%Y-%m-%d}#{'+'.join(errors)}", text, settings, now)
    return kinds


def _fetch_signals(
    reader: MetricsReader,
    machines: list[Machine],
    refs_of: Mapping[str, TeamPolicyRef],
    settings: Settings,
    now: datetime,
) -> dict[str, Signals]:
    """Pack machines into as few GetMetricData calls as possible. Every window short enough that 500
    queries fit under the datapoint limit shares one range (the longest of them), so the whole fleet
    usually takes ceil(metrics x machines / 500) calls. A longer window gets its own range, and so do
    teams with a network threshold, so neither makes every other machine fetch more; the human-activity
    metric is fetched only for teams whose policy reads it. Exempt machines and teams in safe mode are not
    fetched at all."""
    period = settings.metrics.period_seconds
    shared_points = DATAPOINTS_PER_CALL // METRIC_QUERIES_PER_CALL
    groups: dict[tuple[int, bool, bool], list[str]] = defaultdict(list)
    short_lookback = 0  # the longest window among those that share a range
    for m in machines:
        policy = refs_of[m.instance_id].policy
        if policy is None or parse_exemption(m.exempt_tag, now)[0]:
            continue
        lookback = policy.idle_minutes + policy.max_gap_minutes
        network = policy.network_threshold_bytes_per_second is not None
        human = bool(policy.human_active_minutes)
        if lookback * 60 // period + 2 > shared_points:
            groups[(lookback, network, human)].append(m.instance_id)
        else:
            short_lookback = max(short_lookback, lookback)
            groups[(0, network, human)].append(m.instance_id)
    signals: dict[str, Signals] = {}
    for (lookback, network, human), ids in groups.items():
        start = now - timedelta(minutes=lookback or short_lookback, seconds=period)
        signals.update(reader.fetch(ids, settings.metrics, start=start, end=now, network=network, human=human))
    return signals


def _apply(
    adapters: Adapters,
    decisions: list[Decision],
    previous: Mapping[str, MachineRecord],
    settings: Settings,
    sweep_id: str,
    now: datetime,
    time_left: Callable[[], float] | None = None,
) -> tuple[list[Decision], set[str]]:
    """Claim, act, tell, record; returns the decisions and the machines whose record this sweep wrote.

    Before a machine is posted about or acted on, its record (the intent: warning, stopping, ...) is
    written together with this sweep's claim, conditionally on the version this sweep read and on no other
    sweep holding a live claim. So of two overlapping sweeps only one gets past this write, and the other
    does nothing to the machine until the outcome is recorded and the claim released. Machines nothing
    happens to are written under the same conditions, unclaimed, when their record changed (record_changed).
    Per-machine failures are recorded on the decision, never raised."""
    store = adapters.store

    def out_of_time() -> bool:
        return time_left is not None and time_left() < FINISH_RESERVE

    def claim(d: Decision) -> tuple[Decision, bool, bool]:
        """The decision, whether its record was written, whether this sweep now holds the machine."""
        if out_of_time():
            return replace(d, error=DEFERRED), False, False
        before = previous.get(d.machine.instance_id)
        d = _delivery_intent(d, before, now)
        hold = _posts_or_acts(d)
        if not hold and before is not None and not record_changed(before, d, now):
            return d, False, False  # nothing new to say: the stored record stays (see record_changed)
        try:
            saved = store.save(d.record, sweep_id, hold=hold)
        except AwsError as exc:
            saved = False
            d = replace(d, error=f"state table write failed ({error_code(exc)}); nothing done")
        if not saved and d.error is None:
            d = replace(d, error="another sweep is handling this machine, or changed it first; nothing done")
        return d, saved, saved and hold

    by_id: dict[str, Decision] = {d.machine.instance_id: d for d in decisions}  # keeps the listing's order
    written: set[str] = set()
    claimed: set[str] = set()
    # What posts or acts first, so a sweep short of time spends it on what matters.
    ordered = sorted(decisions, key=lambda d: not _posts_or_acts(d))
    for d, saved, held in run_concurrently(claim, ordered, DDB_WORKERS):
        by_id[d.machine.instance_id] = d
        if saved:
            written.add(d.machine.instance_id)
        if held:
            claimed.add(d.machine.instance_id)

    acting = [d for d in by_id.values() if d.machine.instance_id in claimed and d.action in MACHINE_ACTIONS]
    acting = [d for d in acting if d.applied]
    if acting:
        # Another sweep may have acted between our listing and our loading the records (its record then
        # looks current to us): look again, now that we hold the claims, and act only on what is unchanged.
        try:
            unchanged = adapters.fleet.still_as_listed([d.machine for d in acting], settings.tags)
        except AwsError:
            unchanged = set()  # cannot tell: act on none of them
        changed = [d for d in acting if d.machine.instance_id not in unchanged]
        for d in run_concurrently(lambda d: _stand_down(store, d, previous, sweep_id), changed, DDB_WORKERS):
            by_id[d.machine.instance_id] = d
            claimed.discard(d.machine.instance_id)
        acting = [d for d in acting if d.machine.instance_id in unchanged]
    outcomes = _act(adapters.fleet, acting)

    failed = [d for d in by_id.values() if outcomes.get(d.machine.instance_id)]
    for d in run_concurrently(
        lambda d: _record_failure(store, d, outcomes[d.machine.instance_id] or "", sweep_id, now), failed, DDB_WORKERS
    ):
        by_id[d.machine.instance_id] = d
    # Posting stays one at a time (Slack's own rate limits); the outcomes are then recorded concurrently.
    # Out of time, nothing more is posted: a machine acted on still has its outcome recorded (unposted),
    # one only to be warned or told goes back to its record from before this sweep, claim released.
    told, untold = [], []
    # One message per owner: posted at the first machine there is time for, then recorded per machine.
    to_post = [d for i, d in by_id.items() if i in claimed and not outcomes.get(i)]
    owner_posts: dict[str, Delivery | PermanentDeliveryFailure | None] | None = None
    for d in to_post:
        in_time = not out_of_time()
        if in_time and owner_posts is None:
            owner_posts = _post_owner_messages(adapters, [w for w in to_post if w.deliver_warning])
        if in_time or (owner_posts and d.machine.instance_id in owner_posts):  # out of time: already posted
            told.append(_post(adapters, d, settings, now, owner_posts))
        elif d.machine.instance_id in outcomes:
            told.append(replace(d, record=replace(d.record, version=d.record.version + 1)))
        else:
            untold.append(d)
    for d in run_concurrently(lambda d: _record_outcome(store, d, sweep_id), told, DDB_WORKERS):
        by_id[d.machine.instance_id] = d
    for d in run_concurrently(lambda d: _stand_down(store, d, previous, sweep_id, DEFERRED), untold, DDB_WORKERS):
        by_id[d.machine.instance_id] = d

    audits: list[AuditEntry] = []
    for d in by_id.values():
        instance_id = d.machine.instance_id
        if instance_id in written and d.record.delivery_error and d.record.warned_at:
            _alert_undeliverable(adapters, d, settings, now)
        if instance_id in written and d.action is Action.WARN and d.applied and d.handling and d.handling.tell_admins:
            _alert_kind_notice(adapters, d, settings, now)
        if (d.action is not Action.NONE and d.error is None) or instance_id in outcomes:
            audits.append(AuditEntry(instance_id, now, _explain(d)))
    _audit(store, audits)
    return list(by_id.values()), written


def _act(fleet: Fleet, acting: list[Decision]) -> dict[str, str | None]:
    """Carry out the machine actions: instance id -> error. Stops, hibernations, protection changes and
    terminations are different APIs with their own rate limits, so they run at once, each in batches
    (and groups) on its own bounded pool."""
    groups: dict[tuple[str, bool], list[str]] = defaultdict(list)
    for d in acting:
        if d.action in (Action.PROTECT, Action.UNPROTECT):
            groups[(d.machine.asg_name or "", d.action is Action.PROTECT)].append(d.machine.instance_id)

    def ids(action: Action) -> list[str]:
        return [d.machine.instance_id for d in acting if d.action is action]

    def protect(group: tuple[str, bool]) -> list[ActionOutcome]:
        return fleet.set_protection(group[0], groups[group], protected=group[1])

    def protect_all() -> list[ActionOutcome]:
        return [o for done in run_concurrently(protect, list(groups), ACTION_WORKERS) for o in done]

    kinds: list[Callable[[], list[ActionOutcome]]] = [
        lambda: fleet.stop(ids(Action.STOP), hibernate=False),
        lambda: fleet.stop(ids(Action.HIBERNATE), hibernate=True),
        protect_all,
        lambda: fleet.terminate_in_groups(ids(Action.TERMINATE)),
        lambda: fleet.terminate(ids(Action.TERMINATE_INSTANCE)),
    ]
    outcomes: dict[str, str | None] = {}
    for done in run_concurrently(lambda kind: kind(), kinds, len(kinds)):
        outcomes.update((o.instance_id, o.error) for o in done)
    return outcomes


# A record whose lifecycle did not change is not rewritten, except to keep what readers see fresh:
# `status` and explanations show data at most REFRESH_EVERY (plus one sweep) old. Each machine is refreshed
# by the first sweep after its own point in the hour (a hash of its id), so refreshes spread evenly over
# sweeps: at 5-minute sweeps, 1/12 of the fleet a sweep. A machine whose lifecycle depends on being watched
# (idle_since or a warning: core.decide counts them only if a sweep observed the machine within one idle
# window) is refreshed the same way every half idle window instead, when that is shorter.
REFRESH_EVERY = timedelta(hours=1)
WATCHED_REFRESH_SHARE = 2
# human_signal is for `status` only ("person active 12:03"): it changes every sweep a person types, so it
# is refreshed with the rest, not written on every change.
_BOOKKEEPING = frozenset({"version", "updated_at", "observed_at", "reason", "human_signal"})
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def record_changed(stored: MachineRecord, d: Decision, now: datetime) -> bool:
    """Whether `d.record` must be written over `stored`: its lifecycle changed (state, idle-since, warning,
    delivery, snooze, action, policy version, facts about the machine), or a refresh is due.

    The stored observed_at then lags the last observation by up to idle_minutes / 2 plus one sweep
    interval. A lag only ever makes core.decide see the machine as unwatched (a fresh warning, a later
    stop), never as watched when it was not: a stop never comes early. With sweeps at most half the
    shortest idle window apart (the default 5-minute schedule and 15-minute policies) it never happens."""
    new = d.record
    lifecycle = (f.name for f in fields(MachineRecord) if f.name not in _BOOKKEEPING)
    if any(getattr(stored, name) != getattr(new, name) for name in lifecycle):
        return True
    period, last_written = REFRESH_EVERY, stored.updated_at
    policy = d.policy.policy if d.policy else None
    watched = policy is not None and (new.idle_since is not None or new.warned_at is not None)
    if watched and policy is not None and new.observed_at is not None and new.observed_at != stored.observed_at:
        # Its lifecycle depends on being watched: keep the stored observation at most half a window old.
        period = min(period, timedelta(minutes=policy.idle_minutes) / WATCHED_REFRESH_SHARE)
        last_written = min(last_written, stored.observed_at) if last_written and stored.observed_at else None
    return last_written is None or last_written <= _last_refresh_point(new.instance_id, now, period)


def _last_refresh_point(instance_id: str, now: datetime, every: timedelta) -> datetime:
    """The machine's latest refresh point at or before `now`: one each `every`, at the machine's own phase,
    so a fleet's refreshes spread evenly over the sweeps in between."""
    period = int(every.total_seconds())
    phase = zlib.crc32(instance_id.encode()) % period
    since = int((now - _EPOCH).total_seconds()) - phase
    return _EPOCH + timedelta(seconds=since // period * period + phase)


CHANGED_SINCE_LISTED = (
    "the machine changed since this sweep listed it (another sweep or a person acted first); nothing done"
)
DEFERRED = "deferred: this sweep ran short of time before reaching it; nothing done, the next sweep takes it"
# Seconds a time-aware sweep keeps for finishing what it began (acting on claimed machines, recording).
FINISH_RESERVE = 30.0


def _stand_down(
    store: StateStore,
    d: Decision,
    previous: Mapping[str, MachineRecord],
    sweep_id: str,
    error: str = CHANGED_SINCE_LISTED,
) -> Decision:
    """Put back the record as it was before this sweep claimed the machine, and release the claim."""
    before = previous.get(d.machine.instance_id) or MachineRecord(d.machine.instance_id, d.machine.team)
    record = replace(before, version=d.record.version + 1)
    with contextlib.suppress(*AwsError):
        store.save(record, sweep_id)  # if this fails, the claim lapses after SWEEP_LEASE
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


def _alert_kind_notice(adapters: Adapters, d: Decision, settings: Settings, now: datetime) -> None:
    """Once per machine per quiet stretch: the admins learn of an idle machine the reaper does not stop because
    its fleet would replace it or a reservation bills it either way (their decision: shrink or release)."""
    m, how = d.machine, d.handling
    assert how is not None and d.record.warned_at is not None
    cost = f"; it costs about ${d.hourly_cost:,.2f} an hour at the on-demand rate" if d.hourly_cost is not None else ""
    text = (
        f"idle: {m.name or m.instance_id} ({m.instance_id}, {m.instance_type}, team {m.team}, owner "
        f"{m.owner or 'none'}). {notice_sentence(d.kind, how, m.instance_type).rstrip('.')}{cost}. Its owner was told "
        "too."
    )
    _alert_once(adapters, f"kind-notice#{m.instance_id}@{d.record.warned_at.isoformat()}", text, settings, now)


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


# Errors a later call may not meet (throttling, an outage, the network); every other refusal is EC2's answer
# about this machine, and asking again would get the same one.
TRANSIENT_ERRORS = CALL_WIDE_ERRORS | {
    "InternalServerError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
}


def _record_failure(store: StateStore, d: Decision, error: str, sweep_id: str, now: datetime) -> Decision:
    # A machine already stopped or gone is recorded, not retried. One EC2 refuses for a reason a retry does not
    # change (UnsupportedOperation: a one-time Spot or instance-store machine it could not be told from) stays
    # warned and is not asked again this quiet stretch. Anything else (throttling, an outage) stays warned so
    # the next sweep tries again.
    code = error.split(":", 1)[0]
    gone = code in ("InvalidInstanceID.NotFound", "IncorrectInstanceState")
    refused = not gone and code not in TRANSIENT_ERRORS
    state = State.REAPED if gone and d.action in (Action.STOP, Action.HIBERNATE) else d.record.state
    if not gone and d.action in (
        Action.STOP,
        Action.HIBERNATE,
        Action.UNPROTECT,
        Action.TERMINATE,
        Action.TERMINATE_INSTANCE,
    ):
        state = State.WARNED
    reason = f"{d.action.value} failed: {error}"
    if refused and state is State.WARNED:
        reason += "; not tried again until the machine is busy again"
    record = replace(
        d.record,
        version=d.record.version + 1,
        state=state,
        reason=reason,
        last_action=f"{d.action.value}_failed",
        last_action_at=now,
        action_refused_at=now if refused and state is State.WARNED else d.record.action_refused_at,
    )
    # If this write fails too, the decision still carries the error; the claim lapses after SWEEP_LEASE
    # and a later sweep re-reads the truth.
    with contextlib.suppress(*AwsError):
        store.save(record, sweep_id)
    return replace(d, error=reason, record=record, state=state)


def _post(
    adapters: Adapters,
    d: Decision,
    settings: Settings,
    now: datetime,
    owner_posts: Mapping[str, Delivery | PermanentDeliveryFailure | None] | None = None,
) -> Decision:
    """Post what the decision calls for; the decision's record then carries the outcome (not yet written).
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
    return replace(d, record=replace(record, version=record.version + 1), reason=reason)


def _record_outcome(store: StateStore, d: Decision, sweep_id: str) -> Decision:
    """Record what was posted and release the claim. The write is conditional: an answer a person gave
    meanwhile wins, and a late sweep never overwrites newer truth."""
    record = d.record
    try:
        if not store.save(record, sweep_id):
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
        # What a stop saves an hour (0 for reserved capacity; for Spot the most it can be), and the kind why.
        "hourly_savings": d.saving.hourly if d.saving else d.hourly_cost,
        "savings_upper_bound": bool(d.saving and d.saving.upper_bound),
        "kind": d.kind.kind.value,
        "kind_note": d.record.kind_note or None,
    }


def _audit(store: StateStore, entries: list[AuditEntry]) -> None:
    try:
        failed = store.audit_many(entries)
    except AwsError as exc:
        failed = [a.instance_id for a in entries]
        logger.warning("audit write failed", extra={"error": error_code(exc)})
    for instance_id in failed:
        logger.warning("audit write failed", extra={"instance_id": instance_id})


def _log_decision(d: Decision, dry_run: bool) -> None:
    logger.info("decision", extra={**_explain(d), "dry_run": dry_run})


def decision_row(d: Decision) -> dict[str, Any]:
    """The stable per-machine JSON of `idle-reaper sweep --json`."""
    return _explain(d)


def report_unwatched_regions(adapters: Adapters, ec2_in: Callable[[str], Any], here: str, now: datetime) -> list[str]:
    """Once a day, from the first region the stack lists: count running instances in regions with no
    stack, keep the count for `status`, tell the admins (weekly per region) when some of them are tagged
    for idle-reaper and so expect a reaper that is not there. Returns the lines for the sweep's summary;
    nothing on the other sweeps of the day. A failed count is tried again by the next sweep."""
    watched, claim = watched_regions(here), f"unwatched-regions#{now:%Y-%m-%d}"
    if here != home_region(here) or not adapters.store.claim_once(claim, now):
        return []
    try:
        settings, _ = adapters.policies.load_settings()
        counts = count_unwatched(ec2_in, watched, settings.tags)
        save_unwatched(adapters.store, counts, now)
    except (*AwsError, PolicyError) as exc:
        with contextlib.suppress(Exception):
            adapters.store.release_claim(claim)
        return [f"could not count instances in regions without a stack: {exc}"]
    lines = [
        f"{c.region} has no idle-reaper stack: {c.running} running instances, {c.opted_in} tagged for idle-reaper"
        for c in counts
    ]
    week = now.strftime("%G-W%V")
    for c in counts:
        if c.opted_in:
            text = (
                f"{c.opted_in} running instances in {c.region} are tagged for idle-reaper, but no idle-reaper stack "
                f"watches {c.region}: they are never looked at. Add the region to the app's `regions` and deploy."
            )
            _alert_once(adapters, f"unwatched#{c.region}#{week}", text, settings, now)
    return lines


# ---------------------------------------------------------------------------------------------
# Fan-out: a planner lists the fleet once and splits it into shards; shard workers sweep them in parallel
# (Step Functions in AWS, threads locally); a gather step makes one summary of the shards' results.

# Machines per shard. benchmarks/sweep_latency.py measures a reaping sweep at about 1.5 ms of modelled wall
# per machine in one invocation (metric reads and state writes dominate), so a 10,000-machine shard takes
# ~15-20 s: well inside half of a worker's timeout, and its manifest (~22 bytes an id) inside DynamoDB's
# 400 KB item limit.
SHARD_SIZE = 10_000
# Shards the state machine's Map sweeps at once: 20 x SHARD_SIZE is 200,000 machines in one wave. Together
# they keep GetMetricData under its quota (metric_workers), the one that binds at that size.
SHARDS_AT_ONCE = 20
MANIFEST_TTL = timedelta(days=1)
FAILED_SHARDS_ALERT_AFTER = 3  # consecutive sweeps with a failed shard before the admins are told
_FAILED_SWEEPS_KEY = "fanout#consecutive-failed-sweeps"
_WARNINGS_KEPT = 20  # per shard result: the first few say what went wrong; the log has them all


@dataclass(frozen=True)
class Plan:
    """One sweep's shards. Step Functions passes at most 256 KB between states and 200,000 instance ids do
    not fit: only the sweep id, its time and the shard indices travel; each worker reads its own manifest."""

    sweep_id: str
    now: datetime
    shards: int
    machines: int
    dry_run: bool
    listed: tuple[Machine, ...] = field(default=(), repr=False, compare=False)  # for a sweep in place

    def execution_input(self) -> dict[str, Any]:
        """The state machine's input: the Map runs one worker per entry of `shards`."""
        return {
            "sweep_id": self.sweep_id,
            "now": self.now.isoformat(),
            "dry_run": self.dry_run,
            "shards": list(range(self.shards)),
            "concurrent_shards": min(self.shards, SHARDS_AT_ONCE),
        }


class ShardTask(BaseModel):
    """A shard worker's event (one Map iteration)."""

    model_config = ConfigDict(extra="forbid")
    sweep_id: str = Field(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_-]+$")
    now: AwareDatetime
    dry_run: bool = False
    shard: int = Field(ge=0)
    concurrent_shards: int = Field(default=1, ge=1, le=1000)  # shards of this sweep running at once


class ShardDone(BaseModel):
    """One Map iteration's output: the shard, and its error when the worker failed (caught by the Map)."""

    shard: int = Field(ge=0)
    error: str | None = None


class GatherTask(BaseModel):
    """The gather step's event: the plan, and what the Map made of each shard."""

    sweep_id: str = Field(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_-]+$")
    now: AwareDatetime
    dry_run: bool = False
    shards: list[int]
    results: list[ShardDone] = Field(default_factory=list)


class SweepTotals(BaseModel):
    """What a sweep (or a shard of one) did, in numbers: what metrics and the gather step need."""

    machines: int = 0
    errors: int = 0
    deferred: int = 0
    undelivered: int = 0  # warnings nobody has received yet: their stops are held
    duration_ms: float = 0.0
    teams: dict[str, TeamTotals] = Field(default_factory=dict)
    teams_in_safe_mode: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    dry_run: bool = False

    @classmethod
    def of(cls, report: SweepReport) -> SweepTotals:
        undelivered = [d for d in report.decisions if d.state is State.WARNED and d.record.warning_delivered_at is None]
        return cls(
            machines=len(report.decisions),
            errors=len(report.errors),
            deferred=len(report.deferred),
            undelivered=len(undelivered),
            duration_ms=report.duration_ms,
            teams=dict(report.summary.teams),
            teams_in_safe_mode=report.teams_in_safe_mode,
            warnings=report.warnings[:_WARNINGS_KEPT],
            dry_run=report.dry_run,
        )

    @property
    def hourly_savings(self) -> float:
        return sum(t.hourly_savings for t in self.teams.values())


class Gathered(SweepTotals):
    """The shards of one sweep summed: one summary, one set of metrics, one savings figure."""

    sweep_id: str
    shards: int
    failed: dict[int, str] = Field(default_factory=dict)  # shard -> why (its machines untouched)


def manifest_key(sweep_id: str, index: int) -> str:
    return f"shard#{sweep_id}#{index}"


def result_key(sweep_id: str, index: int) -> str:
    return f"shard-result#{sweep_id}#{index}"


OWNER_UNIT_MAX = 100  # an owner's standalone machines kept in one shard, at most


def split_into_shards(machines: Sequence[Machine], shards: int) -> list[list[str]]:
    """Instance ids per shard: every machine in exactly one, an Auto Scaling group's members always together
    (its termination limit is counted in one place), an owner's other machines together (up to
    OWNER_UNIT_MAX), the shards as even as these units allow (the largest unit first, each to the shard with
    the fewest machines so far)."""
    units: dict[str, list[str]] = defaultdict(list)
    by_owner: dict[str, list[str]] = defaultdict(list)
    for m in machines:
        if m.asg_name:
            units[f"asg:{m.asg_name}"].append(m.instance_id)
        elif owner := owner_key(m.owner):
            by_owner[owner].append(m.instance_id)
        else:
            units[m.instance_id].append(m.instance_id)
    # An owner's standalone machines share a shard, so one sweep's warnings to them share one message
    # (sweep._post_owner_messages); an owner with very many is split in bounded chunks, to keep shards even.
    for owner, ids in by_owner.items():
        ids.sort()
        for start in range(0, len(ids), OWNER_UNIT_MAX):
            units[f"owner:{owner}#{start}"] = ids[start : start + OWNER_UNIT_MAX]
    loads = [(0, index) for index in range(shards)]
    manifests: list[list[str]] = [[] for _ in range(shards)]
    for _, ids in sorted(units.items(), key=lambda unit: (-len(unit[1]), unit[0])):
        size, index = heapq.heappop(loads)
        manifests[index].extend(ids)
        heapq.heappush(loads, (size + len(ids), index))
    return manifests


def plan_sweep(
    adapters: Adapters,
    *,
    now: datetime,
    dry_run: bool = False,
    sweep_id: str | None = None,
    shard_size: int = SHARD_SIZE,
    in_place: bool = False,
) -> Plan:
    """List the fleet once and write one manifest (its instance ids) per shard to the state table.
    `in_place`: a fleet that fits one shard is swept by the caller from `Plan.listed`, no manifest written."""
    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    sweep_id = sweep_id or uuid.uuid4().hex
    now = now.astimezone(UTC)
    settings, _ = _load_settings(adapters)
    try:
        machines = adapters.fleet.discover(settings.tags)
    except AwsError as exc:
        raise SweepCannotRun(f"cannot list machines ({error_code(exc)}): {exc}") from None
    shards = max(1, -(-len(machines) // shard_size))
    plan = Plan(sweep_id, now, shards, len(machines), dry_run or settings.dry_run, tuple(machines))
    if in_place and shards == 1:
        return plan
    manifests = split_into_shards(machines, shards)
    expires = now + MANIFEST_TTL

    def write(index: int) -> None:
        adapters.store.put_lookup(manifest_key(sweep_id, index), json.dumps(manifests[index]), expires)

    try:
        run_concurrently(write, list(range(shards)), DDB_WORKERS)
    except AwsError as exc:
        raise SweepCannotRun(f"cannot write the shard manifests ({error_code(exc)}): {exc}") from None
    logger.info("sweep planned", extra={"sweep_id": sweep_id, "shards": shards, "machines": len(machines)})
    return replace(plan, listed=())


def metric_workers(concurrent_shards: int) -> int:
    """GetMetricData threads of one shard worker, so that the shards running at once together stay under
    the account's GetMetricData quota (about GET_METRIC_DATA_TPS x GET_METRIC_DATA_SECONDS calls in flight)."""
    in_flight = int(GET_METRIC_DATA_TPS * GET_METRIC_DATA_SECONDS)
    return max(1, min(METRIC_WORKERS, in_flight // concurrent_shards))


def _load_settings(adapters: Adapters) -> tuple[Settings, int | None]:
    try:
        return adapters.policies.load_settings()
    except PolicyError as exc:
        raise SweepCannotRun(f"settings are invalid, nothing was changed: {exc}") from None
    except AwsError as exc:
        raise SweepCannotRun(f"cannot read settings ({error_code(exc)}): {exc}") from None


def run_shard(
    adapters: Adapters, task: ShardTask, *, time_left: Callable[[], float] | None = None
) -> tuple[SweepReport, SweepTotals]:
    """Sweep one shard of a plan and record its totals for the gather step. A missing manifest (expired,
    or the plan failed) sweeps nothing and fails the shard."""
    sweep_id, index = task.sweep_id, task.shard
    try:
        manifest = adapters.store.get_lookup(manifest_key(sweep_id, index), task.now)
    except AwsError as exc:
        raise SweepCannotRun(f"cannot read shard {index}'s manifest ({error_code(exc)}): {exc}") from None
    if manifest is None:
        raise SweepCannotRun(f"shard {index} of sweep {sweep_id} has no manifest; nothing was changed")
    ids = [str(i) for i in json.loads(manifest)]
    workers = metric_workers(task.concurrent_shards)
    if workers != adapters.metrics.workers:
        adapters = replace(adapters, metrics=MetricsReader(adapters.metrics.cloudwatch, workers=workers))
    report = run_sweep(
        adapters,
        now=task.now,
        dry_run=task.dry_run,
        sweep_id=f"{sweep_id}-{index}",
        time_left=time_left,
        instance_ids=ids,
    )
    totals = SweepTotals.of(report)
    try:
        adapters.store.put_lookup(result_key(sweep_id, index), totals.model_dump_json(), task.now + MANIFEST_TTL)
    except AwsError as exc:  # what it did is recorded per machine; only the summary is lost
        raise SweepCannotRun(f"shard {index} swept, but its totals were not recorded ({error_code(exc)})") from None
    return report, totals


def gather_sweep(adapters: Adapters, task: GatherTask) -> Gathered:
    """One summary of a sweep's shards. A shard without a recorded result failed (its worker crashed, timed
    out or was throttled throughout): it is reported, counted towards the admin alert, and its machines
    wait for the next sweep, which plans them again."""
    errors = {r.shard: r.error for r in task.results if r.error}

    def read(index: int) -> SweepTotals | str:
        if index in errors:
            return errors[index] or "failed"
        try:
            stored = adapters.store.get_lookup(result_key(task.sweep_id, index), task.now)
        except AwsError as exc:
            return f"its result could not be read ({error_code(exc)})"
        return SweepTotals.model_validate_json(stored) if stored else "no result recorded"

    shards = sorted(set(task.shards))
    done: list[SweepTotals] = []
    failed: dict[int, str] = {}
    for index, result in zip(shards, run_concurrently(read, shards, DDB_WORKERS), strict=True):
        if isinstance(result, str):
            failed[index] = result
        else:
            done.append(result)
    teams: dict[str, TeamTotals] = defaultdict(TeamTotals)
    for totals in done:
        for team, t in totals.teams.items():
            into = teams[team]
            for f in fields(TeamTotals):
                mine, theirs = getattr(into, f.name), getattr(t, f.name)
                setattr(into, f.name, (mine or theirs) if isinstance(mine, bool) else mine + theirs)
    shard_warnings = [
        f"shard {i} failed, its machines are untouched until the next sweep: {why}" for i, why in failed.items()
    ]
    gathered = Gathered(
        sweep_id=task.sweep_id,
        shards=len(shards),
        failed=failed,
        machines=sum(t.machines for t in done),
        errors=sum(t.errors for t in done),
        deferred=sum(t.deferred for t in done),
        undelivered=sum(t.undelivered for t in done),
        duration_ms=max((t.duration_ms for t in done), default=0.0),
        teams=dict(teams),
        teams_in_safe_mode=sorted({team for t in done for team in t.teams_in_safe_mode}),
        warnings=[w for t in done for w in t.warnings] + shard_warnings,
        dry_run=task.dry_run or any(t.dry_run for t in done),
    )
    for warning in shard_warnings:
        logger.warning(warning, extra={"sweep_id": task.sweep_id})
    if not gathered.dry_run:
        note_failed_shards(adapters, len(failed), task.now)
    return gathered


def note_failed_shards(adapters: Adapters, failed: int, now: datetime) -> int:
    """Count consecutive sweeps with a failed shard (in the state table); tell the admins when the count
    reaches FAILED_SHARDS_ALERT_AFTER (once per run of failures). Returns the count."""
    try:
        count = int(adapters.store.get_lookup(_FAILED_SWEEPS_KEY, now) or 0) + 1 if failed else 0
        adapters.store.put_lookup(_FAILED_SWEEPS_KEY, str(count), now + MANIFEST_TTL)
    except AwsError as exc:
        logger.warning("could not count the sweeps with a failed shard", extra={"error": error_code(exc)})
        return 0
    if count == FAILED_SHARDS_ALERT_AFTER:
        text = (
            f"{count} sweeps in a row had a failed shard ({failed} in the last): their machines were left "
            "untouched and are retried every sweep. See the ShardsFailed metric and the shard worker's logs."
        )
        try:
            settings, _ = adapters.policies.load_settings()
            adapters.notifier.admin_alert(text, settings.admins, settings.admin_channel)
        except Exception as exc:  # an alert must never break the gather step; the log still says it
            logger.warning("admin alert failed", extra={"error": str(exc), "alert": text})
    return count


@dataclass
class ShardedReport:
    """A sharded sweep run locally: each shard's report (the CLI's rows) and the gathered summary."""

    plan: Plan
    reports: list[SweepReport]
    gathered: Gathered

    def merged(self) -> SweepReport:
        """The shards' decisions as one report, in the shape of a single sweep's."""
        return SweepReport(
            now=self.plan.now,
            dry_run=self.gathered.dry_run,
            decisions=[d for r in self.reports for d in r.decisions],
            settings_version=self.reports[0].settings_version if self.reports else None,
            metric_calls=sum(r.metric_calls for r in self.reports),
            duration_ms=self.gathered.duration_ms,
            warnings=self.gathered.warnings,
            sweep_id=self.plan.sweep_id,
            teams_in_safe_mode=self.gathered.teams_in_safe_mode,
        )


def run_sharded(
    adapters: Adapters,
    *,
    now: datetime,
    dry_run: bool = False,
    shard_size: int = SHARD_SIZE,
    workers: int = 4,
    sweep_id: str | None = None,
) -> ShardedReport:
    """The fan-out run locally: the planner, the shard workers on threads, the gather step. The same
    functions the state machine runs; what the CLI and the demo run."""
    plan = plan_sweep(adapters, now=now, dry_run=dry_run, sweep_id=sweep_id, shard_size=shard_size)

    concurrent = min(plan.shards, workers)

    def work(index: int) -> SweepReport | str:
        task = ShardTask(
            sweep_id=plan.sweep_id, now=plan.now, dry_run=plan.dry_run, shard=index, concurrent_shards=concurrent
        )
        try:
            return run_shard(adapters, task)[0]
        except Exception as exc:  # a failed shard is reported; the others go on
            logger.warning("shard failed", extra={"shard": index, "error": str(exc)})
            return f"{type(exc).__name__}: {exc}"

    results = run_concurrently(work, list(range(plan.shards)), workers)
    task = GatherTask(
        sweep_id=plan.sweep_id,
        now=plan.now,
        dry_run=plan.dry_run,
        shards=list(range(plan.shards)),
        results=[ShardDone(shard=i, error=r if isinstance(r, str) else None) for i, r in enumerate(results)],
    )
    reports = [r for r in results if isinstance(r, SweepReport)]
    return ShardedReport(plan, reports, gather_sweep(adapters, task))


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
    _post as for a warning of its own. A lone warning, or a notifier that cannot group, posts as before.
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
    summary of what was stopped (core.quiet_hours_reports), with "Start it again" per machine. Every shard
    of a sweep runs this: each stop is claimed once (claim_once per machine and stop), so no stop is told
    twice; a post that fails releases its claims and the next sweep tries again, for at most
    core.QUIET_REPORT_GIVE_UP. The index is updated conditionally (shards of one sweep and overlapping
    sweeps update it at once: none loses another's entries); stops that cannot be added are reported to the
    admins. Never fails the sweep."""
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
    except Exception as exc:
        lost = sorted(i for ids in stopped.values() for i in ids)
        logger.warning("quiet hours index not updated", extra={"error": str(exc), "instance_ids": lost})
        if lost:
            text = (
                f"{len(lost)} machines stopped during quiet hours will not be in their owners' morning summary "
                f"(the state table refused the update: {exc}): {', '.join(lost[:20])}"
            )
            _alert_once(adapters, f"quiet-index#{now.isoformat()}", text, settings, now)
        return
    try:
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


QUIET_INDEX_ATTEMPTS = 6


def _update_quiet_index(
    store: StateStore, now: datetime, change: Callable[[dict[str, list[str]]], dict[str, list[str]]]
) -> dict[str, list[str]]:
    """Read, change and write back the quiet-stops index, conditionally on what was read; again when another
    sweep wrote it first. Returns the index as written (or as read, when the change changes nothing)."""
    failure = "it changed under this sweep every time"
    for attempt in range(QUIET_INDEX_ATTEMPTS):
        if attempt:  # shards of one sweep write it at once: back off, jittered, before reading again
            time.sleep(random.uniform(0, 0.02 * 2**attempt))
        try:
            raw = store.get_lookup(QUIET_INDEX, now)
            before = _quiet_index(raw)
            after = change({team: list(ids) for team, ids in before.items()})
            if after == before:
                return before
            if store.replace_lookup(
                QUIET_INDEX, json.dumps(after, sort_keys=True), now + QUIET_INDEX_TTL, expected=raw, now=now
            ):
                return after
        except AwsError as exc:  # a throttle or a transient fault: try again
            failure = f"{error_code(exc)}: {exc}"
    raise RuntimeError(f"quiet hours index not written in {QUIET_INDEX_ATTEMPTS} attempts ({failure})")


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
    for stopped in quiet_hours_reports(store.load(ids).values()):
        oldest = min(r.quiet_stop_at or now for r in stopped)
        keys = {r.instance_id: f"quiet-summary#{r.instance_id}@{(r.quiet_stop_at or now).isoformat()}" for r in stopped}
        group = [r for r in stopped if store.claim_once(keys[r.instance_id], now)]
        # A stop claimed elsewhere is being told by another shard or sweep (or was): kept in the index until
        # its record says it was told, in case that post fails.
        claimed = {r.instance_id for r in group}
        held = [r.instance_id for r in stopped if r.instance_id not in claimed]
        if held and now - oldest < QUIET_REPORT_GIVE_UP:
            retry += held
        if not group:
            continue
        try:
            deliveries = notifier.quiet_summary(group)
        except PermanentDeliveryFailure as exc:
            logger.warning("quiet hours summary cannot be delivered", extra={"why": exc.reason})
            continue
        except Exception as exc:
            logger.warning("quiet hours summary failed", extra={"error": str(exc)})
            deliveries = None
        if deliveries is None:
            for r in group:
                store.release_claim(keys[r.instance_id])
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
