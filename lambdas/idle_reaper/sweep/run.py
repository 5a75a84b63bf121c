"""One sweep: load policies -> discover machines -> fetch signals in batches -> decide (pure) ->
apply actions in batches -> record. Adapters are passed in, so the same sweep runs against AWS,
moto, or in-memory fakes."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from idle_reaper.aws.clients import DDB_WORKERS, AwsError, chunks, error_code, run_concurrently
from idle_reaper.aws.metrics import (
    DATAPOINTS_PER_CALL,
    METRIC_QUERIES_PER_CALL,
    MetricsReader,
)
from idle_reaper.aws.policies import policy_for
from idle_reaper.core.dollars import of_kind
from idle_reaper.core.kinds import (
    NOTEBOOK_GAPS,
    Lookups,
    MachineKind,
    classify,
    notebook_attach_how,
    notebook_gaps_note,
    notebook_no_data_note,
)
from idle_reaper.core.lifecycle import Decision, decide, kind_policy
from idle_reaper.core.reading import not_due, plan_next_read, unread
from idle_reaper.core.records import Action, MachineRecord, State
from idle_reaper.core.reports import (
    GroupPart,
    limit_terminations,
    machine_part,
    part_key,
    part_of,
)
from idle_reaper.core.signals import (
    Machine,
    Signals,
    assess,
    has_no_gpu,
    human_signal_note,
    is_gpu_type,
    parse_exemption,
)
from idle_reaper.core.studio import swept
from idle_reaper.core.under_used import with_peak
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.policy import Settings, TeamPolicyRef
from idle_reaper.pricing import DEFAULT_PRICES, hourly_price
from idle_reaper.sweep.adapters import (
    Adapters,
    SweepCannotRun,
    SweepRead,
    SweepReport,
    alert_invalid_policies,
    alert_once,
    load_sweep_settings,
    tell_unlisted,
)
from idle_reaper.sweep.delivery import apply_decisions, explain
from idle_reaper.sweep.endpoints import (
    endpoint_signals,
    mark_back_in_service,
    report_unlisted_endpoints,
    tell_back_in_service,
    tell_failed_bring_backs,
)
from idle_reaper.sweep.notices import send_pending_notices
from idle_reaper.sweep.quiet_hours import report_quiet_hours
from idle_reaper.sweep.studio import report_studio, report_unlisted_studio


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
    member: tuple[str, str] | None = None,
    message_scope: str | None = None,
    part: tuple[int, int] | None = None,
    send_notices: bool = True,
    quiet_summaries: bool = True,
    group_parts: Mapping[str, GroupPart] | None = None,
) -> SweepReport:
    """One sweep: of the machines `instance_ids` alone, described afresh, when given (a shard); of the
    machines the planner `listed` moments ago, when given (a fleet that fits one invocation); else of all.
    `member`: the (account, region) of a member account this sweep works in through `adapters` made with its
    credentials (organization mode; sweep/members.py); None: the hub's own account. `message_scope`
    (organization mode): the id every unit and shard of this sweep shares, so that an owner's warnings in
    several of them share one message (sweep/owner_messages.py); None: this sweep's own messages.
    `part` (i, K): of the machines listed, part i's alone (a member account-region swept by K workers: keep_part).
    `send_notices`: end with the stop notices' pass (sweep/notices.py; a shard or unit leaves it to the gather step).
    `quiet_summaries`: tell this account-region's quiet-hours stops (sweep/quiet_hours.py; one invocation a sweep).
    `group_parts`: the Auto Scaling groups a shard holds part of (a group cut across shards): their headroom shared.

    `time_left` (seconds left in the invocation, e.g. from the Lambda context): once it falls under
    FINISH_RESERVE the sweep starts no new work (no claim, no post) and finishes what it began, so it never
    ends mid-action without a record; the machines it did not reach are left to the next sweep."""
    started = time.perf_counter()
    sweep_id = sweep_id or uuid.uuid4().hex
    now = now.astimezone(UTC)  # CloudWatch speaks UTC, and so do reasons and records
    settings, settings_version = load_sweep_settings(adapters)
    dry_run = dry_run or settings.dry_run
    warnings: list[str] = []

    try:
        refs = adapters.policies.load_teams(settings)
        teams_readable = True
    except AwsError as exc:
        refs, teams_readable = {}, False
        warnings.append(f"cannot read team policies ({error_code(exc)}); every team is in safe mode")
    if not dry_run:
        alert_invalid_policies(adapters, list(refs.values()), settings, now)
    refs.update(policy_overrides or {})
    for ref in refs.values():
        if ref.policy is None:
            warnings.append(f"invalid team policy, team in safe mode: {ref.error}")

    def ref_for(team: str) -> TeamPolicyRef:
        if not teams_readable:
            return TeamPolicyRef(
                team=team,
                policy=None,
                source=f"{adapters.policies.prefix}/teams/{team}",
                version=None,
                error="team policies could not be read",
            )
        # Schedules apply by the team's local time at `now`; the label records which one was in force.
        return policy_for(team, refs, settings).at(now)

    def read(machines: list[Machine], records: dict[str, MachineRecord]) -> Reading:
        return _read(adapters, machines, records, ref_for, settings, now, warnings, dry_run=dry_run)

    if instance_ids is not None and len(instance_ids) > SHARD_CHUNK:
        reading = _read_in_chunks(adapters, settings, instance_ids, member, read)
    else:
        machines, records = _machines_and_records(adapters, settings, instance_ids, listed, member, part)
        if part is not None:
            machines = keep_part(adapters, machines, records, part, sweep_id, now, dry_run=dry_run)
        reading = read(machines, records)
    machines, records, team_refs, skipped = reading.machines, reading.records, reading.team_refs, reading.skipped
    kinds, refs_of, signals = reading.kinds, reading.refs_of, reading.signals
    safe_mode = {ref.team for ref in refs.values() if ref.policy is None}
    safe_mode.update(team for team, ref in team_refs.items() if ref.policy is None)

    decisions = []
    for m in machines:
        if m.instance_id in skipped:
            kept = unread(m, team_refs[m.team], records[m.instance_id], skipped[m.instance_id])
            decisions.append(replace(kept, hourly_cost=hourly_price(m.instance_type, prices)))
            continue
        ref = refs_of[m.instance_id]
        assessment = None
        if ref.policy is not None and m.instance_id in signals:
            assessment = assess(
                m,
                signals[m.instance_id],
                ref.policy,
                now=now,
                period=timedelta(seconds=settings.metrics.period_seconds),
                gpu_families=settings.gpu_instance_families,
            )
        kind = kinds[m.instance_id]
        d = decide(m, ref, assessment, records.get(m.instance_id), now=now, dry_run=dry_run, kind=kind)
        d = _with_week_peak(_with_status_notes(d, now), now, settings.gpu_instance_families)
        d = replace(d, record=plan_next_read(d, now))
        price = hourly_price(m.instance_type, prices)
        decisions.append(replace(d, hourly_cost=price, saving=of_kind(kind, price).saved_by(d.action.value)))

    decisions = _notebook_notes(adapters, decisions, signals, refs, settings, now, warnings, alert=not dry_run)
    decisions, back = mark_back_in_service(decisions, now)
    decisions = _within_group_sizes(adapters, decisions, group_parts)
    written: set[str] = set()
    if not dry_run:
        decisions, written = apply_decisions(
            adapters, decisions, records, settings, sweep_id, now, time_left, message_scope
        )
        tell_back_in_service(adapters, decisions, back, written)
        tell_failed_bring_backs(adapters, now, member, lister=instance_ids is None)  # a shard's: its planner's
        report_quiet_hours(adapters, decisions, refs, settings, now, member, quiet_summaries, time_left)
        if send_notices:  # a shard's and a member unit's wait for the sweep's one pass (the gather step's)
            send_pending_notices(adapters, settings, now, time_left)
    _log_decisions(decisions, written, dry_run)
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
        read=SweepRead(settings, refs if teams_readable else None, machines, signals),
    )


# A shard of more machines than this is described and read in chunks of this many, two at once (run_sweep).
SHARD_CHUNK = 1_000


@dataclass
class Reading:
    """What a sweep knows of its machines before it decides: each one described, its record, its team's policy
    in force, why it is not read this sweep (not due), its kind, its own policy and its datapoints."""

    machines: list[Machine]
    records: dict[str, MachineRecord]
    team_refs: dict[str, TeamPolicyRef]
    skipped: dict[str, str]
    kinds: dict[str, MachineKind]
    refs_of: dict[str, TeamPolicyRef]
    signals: dict[str, Signals]

    @classmethod
    def joined(cls, parts: Sequence[Reading]) -> Reading:
        whole = cls([], {}, {}, {}, {}, {}, {})
        for part in parts:
            whole.machines += part.machines
            whole.records.update(part.records)
            whole.team_refs.update(part.team_refs)
            whole.skipped.update(part.skipped)
            whole.kinds.update(part.kinds)
            whole.refs_of.update(part.refs_of)
            whole.signals.update(part.signals)
        return whole


def _read_in_chunks(
    adapters: Adapters,
    settings: Settings,
    instance_ids: Sequence[str],
    member: tuple[str, str] | None,
    read: Callable[[list[Machine], dict[str, MachineRecord]], Reading],
) -> Reading:
    """A large shard: its machines described and `read` a chunk at a time, two chunks at once, so that one chunk's
    GetMetricData calls wait on their quota while the next one's Describe* calls wait on theirs (at 200,000 machines
    each takes about a minute a shard; one after the other they took two)."""

    def chunk(ids: Sequence[str]) -> Reading:
        return read(*_machines_and_records(adapters, settings, ids, None, member))

    return Reading.joined(run_concurrently(chunk, list(chunks(instance_ids, SHARD_CHUNK)), 2))


def _read(
    adapters: Adapters,
    machines: list[Machine],
    records: dict[str, MachineRecord],
    ref_for: Callable[[str], TeamPolicyRef],
    settings: Settings,
    now: datetime,
    warnings: list[str],
    *,
    dry_run: bool,
) -> Reading:
    """The machines' policies, which are due, their kinds and the datapoints of those read. A Studio app is left out
    unless its team's policy sweeps it (core/studio.swept): the admins' daily note reports it."""
    team_refs = {m.team: ref_for(m.team) for m in machines}
    machines = [m for m in machines if m.facts.studio is None or swept(m.facts.studio, team_refs[m.team].policy)]
    skipped = _not_due(machines, team_refs, records, settings, now)
    to_read = [m for m in machines if m.instance_id not in skipped]
    # What kind each machine read is, and so its own policy: its team's, with the window its kind gets.
    kinds = _machine_kinds(adapters, to_read, settings, now, warnings, alert=not dry_run)
    refs_of = {m.instance_id: kind_policy(team_refs[m.team], kinds[m.instance_id], m) for m in to_read}
    signals = _fetch_signals(adapters.metrics, to_read, refs_of, settings, now)
    return Reading(machines, records, team_refs, skipped, kinds, refs_of, signals)


def _within_group_sizes(
    adapters: Adapters, decisions: list[Decision], parts: Mapping[str, GroupPart] | None
) -> list[Decision]:
    """The decisions, no group terminated below its MinSize (of a group cut across shards, this shard's share of
    its headroom: `parts`)."""
    terminating = {d.machine.asg_name for d in decisions if d.action is Action.TERMINATE and d.applied}
    if not terminating:
        return decisions
    try:
        capacity = adapters.fleet.group_capacity(name for name in terminating if name)
    except AwsError:
        capacity = {}  # unknown capacity: limit_terminations allows none
    return limit_terminations(decisions, capacity, parts)


def _machines_and_records(
    adapters: Adapters,
    settings: Settings,
    instance_ids: Sequence[str] | None,
    listed: Sequence[Machine] | None,
    member: tuple[str, str] | None,
    part: tuple[int, int] | None = None,
) -> tuple[list[Machine], dict[str, MachineRecord]]:
    """The machines this sweep works on (run_sweep says which; of a `part`, those its listing puts there), and
    their records by instance id."""
    try:
        if instance_ids is not None:
            machines = adapters.fleet.describe_ids(instance_ids, settings.tags)
        elif listed is not None:
            machines = list(listed)
        else:
            machines = adapters.fleet.discover(
                settings.tags,
                notebooks=settings.sagemaker_notebooks,
                endpoints=settings.sagemaker_endpoints,
                studio=settings.sagemaker_notebooks,
            )
        if member is not None:
            machines = [replace(m, account=member[0], region=member[1]) for m in machines]
        if part is not None:
            machines = [m for m in machines if machine_part(m, part[1]) == part[0]]
        # One sweep (or shard) works in one account and region, where instance ids are unique: below, records
        # are looked up by instance id; in the state table they are keyed by account, region and id.
        records = {r.instance_id: r for r in adapters.store.load([m.key for m in machines]).values()}
    except AwsError as exc:
        raise SweepCannotRun(f"cannot list machines or read the state table ({error_code(exc)}): {exc}") from None
    return machines, records


def keep_part(
    adapters: Adapters,
    machines: Sequence[Machine],
    records: Mapping[str, MachineRecord],
    part: tuple[int, int],
    sweep_id: str,
    now: datetime,
    *,
    dry_run: bool,
) -> list[Machine]:
    """The machines of part i of K: those whose part_key (group, else owner, else id) falls in part i as listed
    now (_machines_and_records keeps only those) AND as last recorded. Each part lists the account-region at its
    own moment; a machine that joined a group or changed owner between two parts' listings would fall in both by
    its listings alone. Its record settles it: only the part its record's key falls in may sweep it, and every
    record a part writes carries its own listing's key, so at most one part sweeps a machine in a sweep, whatever
    the order of the listings and writes. A machine whose key moved to this part is handed over (its record's
    group and owner rewritten, conditionally, nothing else) and swept from the next sweep; a machine without a
    record goes by its listing. A dry run writes nothing and skips the check (it acts on nothing)."""
    index, parts = part
    if dry_run:
        return list(machines)
    kept, handed = [], []
    for m in machines:
        r = records.get(m.instance_id)
        if r is None or part_of(part_key(r.instance_id, r.asg_name, r.owner), parts) == index:
            kept.append(m)
        else:
            # Only the part key's facts, and the Slack id that went with the old owner: a stale id would send the
            # new owner's warnings to the old one. updated_at stays: nothing of the lifecycle changed.
            slack_id = r.owner_slack_id if r.owner == m.owner else None
            handed.append(
                replace(r, asg_name=m.asg_name, owner=m.owner, owner_slack_id=slack_id, version=r.version + 1)
            )

    def hand_over(record: MachineRecord) -> bool:
        try:
            return adapters.store.save(record, sweep_id)
        except AwsError:
            return False  # tried again by the next sweep

    if handed:
        done = sum(run_concurrently(hand_over, handed, DDB_WORKERS))
        logger.info(
            "machines whose group or owner moved them to this part: swept by it from the next sweep",
            extra={"part": index, "parts": parts, "machines": len(handed), "handed_over": done},
        )
    return kept


def _not_due(
    machines: Sequence[Machine],
    team_refs: Mapping[str, TeamPolicyRef],
    records: Mapping[str, MachineRecord],
    settings: Settings,
    now: datetime,
) -> dict[str, str]:
    """The machines whose decision cannot change before their next-read time, and why: not read this sweep
    (core/reading.py)."""
    if not settings.read_when_due:
        return {}
    return {
        m.instance_id: why for m in machines if (why := not_due(m, team_refs[m.team], records.get(m.instance_id), now))
    }


def _machine_kinds(
    adapters: Adapters,
    machines: Sequence[Machine],
    settings: Settings,
    now: datetime,
    warnings: list[str],
    *,
    alert: bool,
) -> dict[str, MachineKind]:
    """What kind each machine is (kinds.classify), from one batched look-up per kind of question. A
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
            alert_once(adapters, f"kind-lookup#{now:%Y-%m-%d}#{'+'.join(errors)}", text, settings, now)
    return kinds


def _fetch_signals(
    reader: MetricsReader,
    machines: list[Machine],
    refs_of: Mapping[str, TeamPolicyRef],
    settings: Settings,
    now: datetime,
) -> dict[str, Signals]:
    """Pack machines into as few GetMetricData calls as possible. Every window short enough that 500
    queries fit under the datapoint limit is read together, each machine from its own window's start, packed
    shortest first so that a call's one range is that of its longest window, so the whole fleet usually takes
    ceil(metrics x machines / 500) calls and no machine is read much past its own window (a team of
    60 minutes beside one of 120 reads half the datapoints). A longer window gets its own range, and so do
    teams with a network threshold, so neither makes every other machine fetch more; the human-activity
    metric is fetched only for teams whose policy reads it, the GPU metric only for types that can have a GPU
    (core.signals.has_no_gpu). Exempt machines and teams in safe mode are not fetched at all."""
    period = settings.metrics.period_seconds
    shared_points = DATAPOINTS_PER_CALL // METRIC_QUERIES_PER_CALL
    groups: dict[tuple[int, bool, bool, bool], list[str]] = defaultdict(list)
    short_lookback = 0  # the longest window among those that share a range
    own_start: dict[str, datetime] = {}  # where each machine of that range begins its own window
    for m in machines:
        policy = refs_of[m.instance_id].policy
        if policy is None or parse_exemption(m.exempt_tag, now)[0] or m.is_endpoint:
            continue
        lookback = policy.idle_minutes + policy.max_gap_minutes
        network = policy.network_threshold_bytes_per_second is not None
        human = bool(policy.human_active_minutes)
        gpu = not has_no_gpu(m.instance_type, settings.gpu_instance_families)
        if lookback * 60 // period + 2 > shared_points:
            groups[(lookback, network, human, gpu)].append(m.instance_id)
        else:
            short_lookback = max(short_lookback, lookback)
            groups[(0, network, human, gpu)].append(m.instance_id)
            own_start[m.instance_id] = now - timedelta(minutes=lookback, seconds=period)
    # A Studio app's CPU and network are the agent's too, by InstanceId = its machine id (core/studio.py).
    notebooks = {m.instance_id for m in machines if m.is_notebook or m.is_studio_app}
    signals = endpoint_signals(reader, machines, refs_of, settings, now)  # their own metric (sweep/endpoints.py)
    for (lookback, network, human, gpu), ids in groups.items():
        start = now - timedelta(minutes=lookback or short_lookback, seconds=period)
        signals.update(
            reader.fetch(
                ids,
                settings.metrics,
                start=start,
                end=now,
                network=network,
                human=human,
                gpu=gpu,
                notebooks=notebooks,
                later_starts=None if lookback else own_start,
            )
        )
    return signals


def _cost(price: float | None) -> str:
    return f"${price:,.2f}/h" if price is not None else "price unknown"


def _notebook_notes(
    adapters: Adapters,
    decisions: list[Decision],
    signals: Mapping[str, Signals],
    refs: Mapping[str, TeamPolicyRef],
    settings: Settings,
    now: datetime,
    warnings: list[str],
    *,
    alert: bool,
) -> list[Decision]:
    """What a sweep says of SageMaker beyond its decisions: that notebook instances, endpoints or Studio apps could not
    be listed, which notebooks publish no data or only part of it (their reasons say so when it leaves them unknown;
    the admins hear once a day), and the day's Studio note."""
    _report_unlisted_notebooks(adapters, settings, now, warnings, alert=alert)
    report_unlisted_endpoints(adapters, settings, now, warnings, alert=alert)
    report_unlisted_studio(adapters, settings, now, warnings, alert=alert)  # once a sweep, not once a chunk read
    gaps = {
        d.machine.instance_id: _notebook_gaps(d, found, settings)
        for d in decisions
        if d.machine.is_notebook and (found := signals.get(d.machine.instance_id)) is not None
    }
    decisions = [
        _notebook_data_note(d, gaps.get(d.machine.instance_id, []), adapters.notebook_config) for d in decisions
    ]
    if alert:
        _note_unwatched_notebooks(adapters, decisions, gaps, settings, now)
        report_studio(adapters, refs, settings, now)
    return decisions


def _notebook_gaps(d: Decision, signals: Signals, settings: Settings) -> list[str]:
    """What a notebook instance leaves out of what its policy reads: "CPU" (nothing arrives at all), else
    keys of NOTEBOOK_GAPS."""
    if not signals.cpu:
        return ["CPU"]
    policy = d.policy.policy if d.policy else None
    gaps = []
    if not signals.gpu and is_gpu_type(d.machine.instance_type, settings.gpu_instance_families):
        gaps.append("GPU")
    if policy and policy.network_threshold_bytes_per_second is not None and not signals.network_in:
        gaps.append("network")
    if d.assessment is not None and d.assessment.human_signal == "missing":
        gaps.append("activity")
    return gaps


def _notebook_data_note(d: Decision, gaps: Sequence[str], ours: str) -> Decision:
    """A notebook instance left unknown by missing data (no CPU: the lifecycle configuration is not attached or
    does not publish; no GPU or network data): its reason, and so `status`, says what it costs and what to do
    (`ours`: the stack's own lifecycle configuration).
    A missing activity collector changes no decision: `status` says it in its human-signal column, the owner's
    messages never carry it."""
    if "CPU" in gaps:
        note = notebook_no_data_note(d.hourly_cost, d.machine.facts.notebook_config, ours)
    elif d.signal == "unknown" and (unknown_by := [g for g in gaps if g != "activity"]):
        note = notebook_gaps_note(unknown_by)
    else:
        return d
    reason = f"{d.reason}; {note}"
    return replace(d, reason=reason, record=replace(d.record, reason=reason))


def _report_unlisted_notebooks(
    adapters: Adapters, settings: Settings, now: datetime, warnings: list[str], *, alert: bool
) -> None:
    """Notebook instances that could not be listed are not swept this time: say so, and tell the admins
    once a day per error."""
    unlisted = adapters.fleet.notebooks_unlisted
    if not unlisted:
        return
    text = (
        f"idle-reaper could not list SageMaker notebook instances ({unlisted}); none is swept (none stopped, no "
        "owner told) until it can. Check the sweep role's sagemaker:ListNotebookInstances and sagemaker:ListTags."
    )
    tell_unlisted(adapters, "notebooks", unlisted, text, settings, now, warnings, alert=alert)


def _note_unwatched_notebooks(
    adapters: Adapters,
    decisions: Sequence[Decision],
    gaps: Mapping[str, Sequence[str]],
    settings: Settings,
    now: datetime,
) -> None:
    """The admins' daily note: the notebook instances without data (their hourly cost, what is attached to each
    that is not this deployment's configuration, and how to attach it), then those missing part of their data."""

    def line(d: Decision, more: str = "") -> str:
        return (
            f"{d.machine.instance_id} ({d.machine.instance_type}, team {d.machine.team}, {_cost(d.hourly_cost)}"
            + (f", lifecycle configuration {config}" if (config := d.machine.facts.notebook_config) else "")
            + more
            + ")"
        )

    notebooks = [d for d in decisions if gaps.get(d.machine.instance_id)]
    unwatched = [line(d) for d in notebooks if "CPU" in gaps[d.machine.instance_id]]
    partial = [
        line(d, f": {', '.join(gaps[d.machine.instance_id])} missing")
        for d in notebooks
        if "CPU" not in gaps[d.machine.instance_id]
    ]
    seen = {g for d in notebooks for g in gaps[d.machine.instance_id]}
    parts = []
    if unwatched:
        parts.append(
            f"idle-reaper sees no CPU data from {len(unwatched)} SageMaker notebook instance(s): "
            f"{', '.join(unwatched)}. They are unknown and never stopped. To have them watched, "
            f"{notebook_attach_how(adapters.notebook_config)}."
        )
    if partial:
        parts.append(
            f"{len(partial)} SageMaker notebook instance(s) publish only part of their data: {', '.join(partial)}. "
            "Without GPU or network data they are unknown and never stopped; without the activity collector a "
            f"person at the keyboard goes unseen. {notebook_gaps_note([g for g in NOTEBOOK_GAPS if g in seen])}."
        )
    if parts:
        alert_once(adapters, f"notebooks-no-data#{now:%Y-%m-%d}", " ".join(parts), settings, now)


def _log_decision(d: Decision, dry_run: bool) -> None:
    logger.info("decision", extra={**explain(d), "dry_run": dry_run})


def _log_decisions(decisions: Sequence[Decision], written: set[str], dry_run: bool) -> None:
    """One log line per machine something happened to (an action, an error, a lifecycle change); the others'
    explanation is their record (`idle-reaper status`), refreshed at least hourly. A dry run logs all."""
    unchanged = 0
    for d in decisions:
        if dry_run or d.action is not Action.NONE or d.error or d.machine.instance_id in written:
            _log_decision(d, dry_run)
        else:
            unchanged += 1
    if unchanged:
        logger.info("machines with nothing new, not logged one by one", extra={"machines": unchanged})


def decision_row(d: Decision) -> dict[str, Any]:
    """The stable per-machine JSON of `idle-reaper sweep --json`."""
    return explain(d)


def _with_week_peak(d: Decision, now: datetime, gpu_families: Sequence[str]) -> Decision:
    """A busy machine's busiest GPU (CPU for CPU-only types) this week, for the digest's under-used machines."""
    a = d.assessment
    if a is None or d.state is not State.ACTIVE or a.signal != "busy":
        return d
    gpu = is_gpu_type(d.machine.instance_type, gpu_families) and a.max_gpu is not None
    busiest = a.max_gpu if gpu else a.max_cpu
    return replace(d, record=with_peak(d.record, now, busiest))


def _with_status_notes(d: Decision, now: datetime) -> Decision:
    """Keep on the record what the human-activity signal said, so `status` can show it without CloudWatch,
    and mark a stop made during quiet hours, so its owner hears of it when they end (report_quiet_hours)."""
    record = replace(d.record, human_signal=human_signal_note(d.assessment))
    policy = d.policy.policy if d.policy else None
    if policy is not None and policy.quiet_hours and d.applied and d.action in (Action.STOP, Action.HIBERNATE):
        record = replace(record, quiet_stop_at=now)
    return replace(d, record=record)
