"""A large fleet's sweep: the planner splits it into shards, a worker sweeps each shard, the gather step sums up."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from idle_reaper.aws.accounts import (
    DIRECTORY_TTL,
    UNIT_SIZES_KEEP,
    UNIT_SIZES_KEPT,
    MemberAccess,
    UnitSize,
    UnitSizes,
    load_unit_sizes,
    save_member_sweep,
    save_unit_sizes,
)
from idle_reaper.aws.clients import DDB_WORKERS, AwsError, error_code, run_concurrently
from idle_reaper.core.records import State
from idle_reaper.core.reports import TeamTotals
from idle_reaper.core.signals import Machine
from idle_reaper.notify import SharedPacing
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.sweep.adapters import Adapters, SweepCannotRun, SweepReport, load_sweep_settings
from idle_reaper.sweep.doctor_daily import note_gpu_facts, report_gpu_facts
from idle_reaper.sweep.endpoints import tell_failed_bring_backs
from idle_reaper.sweep.members import (
    MAX_UNIT_PARTS,
    MEMBER_MANIFEST,
    MEMBER_UNITS_PER_SHARD,
    UnitOutcome,
    UnitResult,
    member_groups,
    member_manifest_of,
    member_manifests,
    member_sweep,
    parse_member_manifest,
    sweep_member_accounts,
    whole_units,
)
from idle_reaper.sweep.notices import send_sweep_notices
from idle_reaper.sweep.run import run_sweep
from idle_reaper.sweep.shards import OWNER_UNIT_MAX as OWNER_UNIT_MAX  # re-exported
from idle_reaper.sweep.shards import ShardManifest, manifest_machines, manifest_pages, plan_shards, read_manifest
from idle_reaper.sweep.shards import split_into_shards as split_into_shards  # re-exported

# ---------------------------------------------------------------------------------------------
# Fan-out: a planner lists the fleet once and splits it into shards; shard workers sweep them in parallel
# (Step Functions in AWS, threads locally); a gather step makes one summary of the shards' results.

# Machines per shard. benchmarks/sweep_latency.py measures a reaping sweep at about 1.5 ms of modelled wall
# per machine in one invocation (metric reads and state writes dominate), so a 10,000-machine shard takes
# ~15-20 s: well inside half of a worker's timeout. An Auto Scaling group of more machines is cut across shards
# (its parts share its termination headroom), and a manifest (~22 bytes an id, 220 KB at 10,000) that would pass
# DynamoDB's 400 KB item limit is kept in pages (sweep/shards.py).
SHARD_SIZE = 10_000
# A fleet of more than one shard is spread over the Map's idle lanes down to this many machines a shard: a shard
# worker has one vCPU and its time is mostly CPU (botocore's, a conditional write at a time), so 200,000 machines
# sweep in 30 shards of 6,667 side by side rather than 20 of 10,000.
MIN_SHARD_SIZE = 5_000
# Shards the state machine's Map sweeps at once: 30 x SHARD_SIZE is 300,000 machines in one wave. With one
# GetMetricData thread each (metric_workers) they keep 30 calls in flight, GetMetricData's quota of 50 a second
# at 0.6 s a call: the quota that binds at that size.
SHARDS_AT_ONCE = 30
# A member account-region whose last sweep saw more machines than this is swept in parts of about this many,
# each by its own worker (members.MAX_UNIT_PARTS at most): ceil(machines / UNIT_PART_SIZE) parts.
UNIT_PART_SIZE = SHARD_SIZE
# vCPUs of the sweep function, the planner (infra/stack.py gives it PLANNER_MEMORY_MB): its discovery lists the
# Availability Zones, and a full zone's parts by instance id, in child processes (aws.fleet.LISTING_PROCESSES), so
# botocore's parsing of 200,000 instances (70-180 s of CPU) runs on this many vCPUs at once, however the fleet
# spreads over the zones.
PLANNER_VCPUS = 6
PLANNER_MEMORY_MB = 10_240  # Lambda's largest function, the one with 6 vCPUs (1,769 MB a vCPU)
MANIFEST_TTL = timedelta(days=1)
FAILED_SHARDS_ALERT_AFTER = 3  # consecutive sweeps with a failed shard before the admins are told
_FAILED_SWEEPS_KEY = "fanout#consecutive-failed-sweeps"
LAST_SWEEP_KEY = "fanout#last-sweep"
LAST_SWEEP_KEEP = timedelta(days=30)
_WARNINGS_KEPT = 20  # per shard result: the first few say what went wrong; the log has them all


@dataclass(frozen=True)
class Plan:
    """One sweep's shards. Step Functions passes at most 256 KB between states and 200,000 instance ids do
    not fit: only the sweep id, its time and the shard indices travel; each worker reads its own manifest.
    Organization mode: the member shards' indices follow the machine shards' (0 .. shards-1)."""

    sweep_id: str
    now: datetime
    shards: int  # machine shards (the hub account's own machines)
    machines: int
    dry_run: bool
    # What the planner listed: swept from here in place; for a sweep handed to the fan-out, what the daily
    # doctor's planner part checks (handlers/sweep.py), so the fleet is listed once. Never part of the
    # execution's input.
    listed: tuple[Machine, ...] = field(default=(), repr=False, compare=False)
    member_shards: int = 0  # shards of member (account, region) units, indices shards .. all_shards-1
    member_units: int = 0

    @property
    def all_shards(self) -> int:
        return self.shards + self.member_shards

    @property
    def in_place(self) -> bool:
        """Whether the caller sweeps it in place (one machine shard, no member units): no manifest written."""
        return self.all_shards == 1

    def execution_input(self, *, doctor: bool = False) -> dict[str, Any]:
        """The state machine's input: the Map runs one worker per entry of `shards`. `doctor`: the planner
        claimed the day's doctor, whose GPU check the machine shards (0 .. machine_shards-1) and the gather
        step make (sweep/doctor_daily.py)."""
        return {
            "sweep_id": self.sweep_id,
            "now": self.now.isoformat(),
            "dry_run": self.dry_run,
            "shards": list(range(self.all_shards)),
            "concurrent_shards": min(self.all_shards, SHARDS_AT_ONCE),
            "doctor": doctor,
            "machine_shards": self.shards,
        }


class ShardTask(BaseModel):
    """A shard worker's event (one Map iteration)."""

    model_config = ConfigDict(extra="forbid")
    sweep_id: str = Field(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_-]+$")
    now: AwareDatetime
    dry_run: bool = False
    shard: int = Field(ge=0)
    concurrent_shards: int = Field(default=1, ge=1, le=1000)  # shards of this sweep running at once
    doctor: bool = False  # a machine shard keeps its GPU machines' facts for the day's doctor


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
    doctor: bool = False  # the GPU check of the day's doctor, of the machine shards' facts
    machine_shards: int = Field(default=0, ge=0)


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
    # Organization mode: the counts per account (the hub's own machines under the hub's account id), and each
    # member (account, region) unit's outcome.
    accounts: dict[str, TeamTotals] = Field(default_factory=dict)
    units: list[UnitResult] = Field(default_factory=list)

    @classmethod
    def of(cls, report: SweepReport, account: str | None = None) -> SweepTotals:
        """A sweep's totals; `account` (organization mode): the account its machines are in, counted apart."""
        undelivered = [d for d in report.decisions if d.state is State.WARNED and d.record.warning_delivered_at is None]
        teams = dict(report.summary.teams)
        return cls(
            machines=len(report.decisions),
            errors=len(report.errors),
            deferred=len(report.deferred),
            undelivered=len(undelivered),
            duration_ms=report.duration_ms,
            teams=teams,
            teams_in_safe_mode=report.teams_in_safe_mode,
            warnings=report.warnings[:_WARNINGS_KEPT],
            dry_run=report.dry_run,
            accounts={account: merge_totals(teams.values())} if account is not None else {},
        )

    @property
    def hourly_savings(self) -> float:
        return sum(t.hourly_savings for t in self.teams.values())


def merge_totals(totals: Iterable[TeamTotals]) -> TeamTotals:
    """Counts summed (a flag: any of them)."""
    into = TeamTotals()
    for t in totals:
        for f in fields(TeamTotals):
            mine, theirs = getattr(into, f.name), getattr(t, f.name)
            setattr(into, f.name, (mine or theirs) if isinstance(mine, bool) else mine + theirs)
    return into


def _merge_by_key(parts: Iterable[dict[str, TeamTotals]]) -> dict[str, TeamTotals]:
    grouped: dict[str, list[TeamTotals]] = defaultdict(list)
    for part in parts:
        for key, t in part.items():
            grouped[key].append(t)
    return {key: merge_totals(ts) for key, ts in grouped.items()}


def sum_totals(parts: Sequence[SweepTotals], **extra: Any) -> dict[str, Any]:
    """Several sweeps' (or shards') totals as one: the fields of a SweepTotals, to build one of it or its kin.
    The duration is the longest part's (they ran side by side)."""
    return {
        "machines": sum(t.machines for t in parts),
        "errors": sum(t.errors for t in parts),
        "deferred": sum(t.deferred for t in parts),
        "undelivered": sum(t.undelivered for t in parts),
        "duration_ms": max((t.duration_ms for t in parts), default=0.0),
        "teams": _merge_by_key(t.teams for t in parts),
        "teams_in_safe_mode": sorted({team for t in parts for team in t.teams_in_safe_mode}),
        "warnings": [w for t in parts for w in t.warnings],
        "dry_run": any(t.dry_run for t in parts),
        "accounts": _merge_by_key(t.accounts for t in parts),
        "units": [u for t in parts for u in t.units],
        **extra,
    }


def member_totals(outcomes: Sequence[UnitOutcome]) -> SweepTotals:
    """The totals of member units swept (sweep_member_accounts' outcomes): summed, per account, each unit's
    outcome kept."""
    swept = [SweepTotals.of(o.report, o.account) for o in outcomes if o.report is not None]
    merged = SweepTotals(**sum_totals(swept))
    merged.units = [UnitResult.of(o) for o in outcomes if o.account != "-"]
    merged.warnings += [f"member {o.describe()}" for o in outcomes if o.error and not o.deferred][:_WARNINGS_KEPT]
    return merged


class Gathered(SweepTotals):
    """The shards of one sweep summed: one summary, one set of metrics, one savings figure."""

    sweep_id: str
    shards: int
    failed: dict[int, str] = Field(default_factory=dict)  # shard -> why (its machines untouched)
    unswept: int = 0  # the failed machine shards' machines: untouched, unknown this sweep


def manifest_key(sweep_id: str, index: int) -> str:
    return f"shard#{sweep_id}#{index}"


def manifest_page_key(sweep_id: str, index: int, page: int) -> str:
    """Page `page` (1 ..) of a shard's manifest too large for one item (sweep/shards.py manifest_pages)."""
    return f"shard-page#{sweep_id}#{index}#{page}"


def result_key(sweep_id: str, index: int) -> str:
    return f"shard-result#{sweep_id}#{index}"


def shard_count(machines: int, shard_size: int, shards_at_once: int) -> int:
    """Machine shards for `machines`: at most `shard_size` machines each; a fleet of more than one shard is
    spread over up to `shards_at_once` lanes, down to MIN_SHARD_SIZE machines a shard (never fewer shards than
    `shard_size` needs)."""
    needed = max(1, -(-machines // shard_size))
    if needed == 1:
        return 1
    return max(needed, min(shards_at_once, machines // MIN_SHARD_SIZE))


def plan_sweep(
    adapters: Adapters,
    *,
    now: datetime,
    dry_run: bool = False,
    sweep_id: str | None = None,
    shard_size: int = SHARD_SIZE,
    in_place: bool = False,
    members: MemberAccess | None = None,
    units_per_shard: int = MEMBER_UNITS_PER_SHARD,
    shards_at_once: int = SHARDS_AT_ONCE,
) -> Plan:
    """List the fleet once and write one manifest (its instance ids) per shard to the state table.
    `in_place`: a fleet that fits one shard is swept by the caller from `Plan.listed`, no manifest written.
    `Plan.listed` holds the machines listed either way (the shard workers read their manifests, not it).
    `members` (organization mode): the enrolled accounts (the directory's cached listing) in member shards of
    (account, region) units after the machine shards; with any, the plan is never in place (the hub's own
    machines are shard 0 however few), so one gather step sums every account. Member shards hold at most
    `units_per_shard` units, fewer when that leaves some of the Map's `shards_at_once` lanes idle: a small
    organization is spread over every lane, as its units wait on the network, not the CPU."""
    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    sweep_id = sweep_id or uuid.uuid4().hex
    now = now.astimezone(UTC)
    settings, _ = load_sweep_settings(adapters)
    try:
        machines = adapters.fleet.discover(
            settings.tags,
            notebooks=settings.sagemaker_notebooks,
            endpoints=settings.sagemaker_endpoints,
            studio=settings.sagemaker_notebooks,
        )
    except AwsError as exc:
        raise SweepCannotRun(f"cannot list machines ({error_code(exc)}): {exc}") from None
    shards = shard_count(len(machines), shard_size, shards_at_once)
    groups, member = [], []
    if members is not None:  # the listing is cached; a failed one keeps the last good listing
        # An hour-old listing is still used: the member check after StartExecution relists, off the sweep's path.
        accounts, config = members.directory.current(stale_for=DIRECTORY_TTL).accounts, members.config
        lanes, units = max(1, shards_at_once - shards), len(config.units(accounts))
        per_group = min(units_per_shard, max(len(config.regions), -(-units // lanes)))
        groups = member_groups(accounts, config.regions_of, per_group)
        member = member_manifests(groups, unit_parts(adapters, now, min(shards_at_once, MAX_UNIT_PARTS)))
    plan = Plan(
        sweep_id,
        now,
        shards,
        len(machines),
        dry_run or settings.dry_run,
        tuple(machines),
        member_shards=len(member),
        member_units=sum(len(g) for g in groups),
    )
    if in_place and plan.in_place:
        return plan
    # A group of more than a shard's machines is cut across shards, and every manifest kept in items DynamoDB
    # holds (sweep/shards.py): one of 17,000 machines or more would pass its 400 KB and fail the whole sweep.
    items: list[tuple[str, str]] = []
    for index, shard in enumerate(plan_shards(machines, shards, group_max=shard_size, turn=sweep_id)):
        pages = manifest_pages(shard)
        items += [(manifest_key(sweep_id, index), pages[0])]
        items += [(manifest_page_key(sweep_id, index, n), page) for n, page in enumerate(pages[1:], 1)]
    items += [
        (manifest_key(sweep_id, index), json.dumps(m.model_dump(mode="json", exclude_none=True)))
        for index, m in enumerate(member, shards)
    ]
    expires = now + MANIFEST_TTL

    def write(item: tuple[str, str]) -> None:
        adapters.store.put_lookup(item[0], item[1], expires)

    try:
        run_concurrently(write, items, DDB_WORKERS)
    except AwsError as exc:
        raise SweepCannotRun(f"cannot write the shard manifests ({error_code(exc)}): {exc}") from None
    if not plan.dry_run:  # the shards are handed what is running: the endpoints brought back that failed, here
        tell_failed_bring_backs(adapters, now)
    logger.info(
        "sweep planned",
        extra={
            "sweep_id": sweep_id,
            "shards": shards,
            "machines": len(machines),
            "member_shards": plan.member_shards,
            "member_units": plan.member_units,
        },
    )
    return plan


def unit_parts(adapters: Adapters, now: datetime, most: int) -> dict[tuple[str, str], int]:
    """The member account-regions to sweep in parts, and in how many: those the last sweeps saw with more than
    UNIT_PART_SIZE machines (note_unit_sizes), ceil(machines / UNIT_PART_SIZE) parts, at most `most`. One read;
    a failed or corrupt one splits nothing (logged): the plan goes on, each unit one shard as before."""
    try:
        sizes = load_unit_sizes(adapters.store, now).of(now)
    except (*AwsError, ValueError) as exc:
        why = error_code(exc) if isinstance(exc, AwsError) else f"{type(exc).__name__}: {exc}"[:300]
        logger.warning("large member units not split: their sizes could not be read", extra={"error": why})
        return {}
    return {unit: min(most, -(-n // UNIT_PART_SIZE)) for unit, n in sizes.items() if n > UNIT_PART_SIZE}


def note_unit_sizes(adapters: Adapters, units: Sequence[UnitResult], now: datetime) -> None:
    """Remember the member account-regions this sweep saw with more than UNIT_PART_SIZE machines, so that the
    next plan splits them; one that fell to UNIT_PART_SIZE or fewer is forgotten (swept whole again), one not
    counted whole this time (a part failed or left for later) keeps what was known. Never raises."""
    try:
        try:
            before = load_unit_sizes(adapters.store, now).units
        except ValueError:  # corrupt: rewritten from this sweep
            before = []
        kept = {(u.account, u.region): u for u in before}
        for u in whole_units(units):
            if u.swept is None or u.error:
                if u.swept is not None and (known := kept.get((u.account, u.region))):  # still seen, in parts
                    kept[(u.account, u.region)] = known.model_copy(update={"seen": now})
                continue
            if u.swept > UNIT_PART_SIZE:
                kept[(u.account, u.region)] = UnitSize(account=u.account, region=u.region, machines=u.swept, seen=now)
            else:
                kept.pop((u.account, u.region), None)
        fresh = sorted((u for u in kept.values() if u.seen > now - UNIT_SIZES_KEEP), key=lambda u: -u.machines)
        if fresh or before:
            save_unit_sizes(adapters.store, UnitSizes(units=fresh[:UNIT_SIZES_KEPT]), now)
    except (*AwsError, ValueError) as exc:
        logger.warning("could not remember the large member units", extra={"error": str(exc)[:300]})


def run_shard(
    adapters: Adapters,
    task: ShardTask,
    *,
    time_left: Callable[[], float] | None = None,
    members: MemberAccess | None = None,
    sweep_members: Callable[..., list[UnitOutcome]] = sweep_member_accounts,
) -> tuple[SweepReport, SweepTotals]:
    """Sweep one shard of a plan and record its totals for the gather step. A missing or malformed manifest
    (expired, the plan failed) sweeps nothing and fails the shard. A member shard's (account, region) units
    are swept through `members`' credentials, several at once, time-aware: one unit's failure is its outcome,
    never the shard's. `members` also names the hub's account, under which a machine shard's counts go."""
    sweep_id, index = task.sweep_id, task.shard
    try:
        manifest = adapters.store.get_lookup(manifest_key(sweep_id, index), task.now)
    except AwsError as exc:
        raise SweepCannotRun(f"cannot read shard {index}'s manifest ({error_code(exc)}): {exc}") from None
    if manifest is None:
        raise SweepCannotRun(f"shard {index} of sweep {sweep_id} has no manifest; nothing was changed")
    where = f"shard {index}'s manifest of sweep {sweep_id}"
    if task.concurrent_shards > 1 and isinstance(adapters.notifier, SharedPacing):
        # The shards of one sweep post to one Slack workspace: each keeps its share of Slack's posting rates.
        adapters = replace(adapters, notifier=adapters.notifier.shared_by(task.concurrent_shards))
    try:
        value = json.loads(manifest)
    except ValueError:
        raise SweepCannotRun(f"{where} is not JSON; nothing was changed") from None
    of_members = isinstance(value, dict) and MEMBER_MANIFEST in value
    if of_members:
        parsed = parse_member_manifest(value, where)
        units = parsed.units()
        if members is None:
            raise SweepCannotRun(f"{where} names member accounts, but this hub is not in organization mode")
        outcomes = sweep_members(
            adapters,
            members,
            task.now,
            dry_run=task.dry_run,
            time_left=time_left,
            units=units,
            message_scope=sweep_id,  # an owner's machines across every shard of this sweep: one message
            part=parsed.part,
        )
        report = SweepReport(
            now=task.now,
            dry_run=task.dry_run,
            decisions=[d for o in outcomes if o.report is not None for d in o.report.decisions],
            settings_version=next((o.report.settings_version for o in outcomes if o.report is not None), None),
            sweep_id=f"{sweep_id}-{index}",
        )
        totals = member_totals(outcomes)
        totals.dry_run = task.dry_run or totals.dry_run
    else:
        shard = _machine_manifest(adapters, task, value, where)
        if task.concurrent_shards > 1:  # the shards of one sweep share the account-region's quotas
            n = task.concurrent_shards
            # Their Describe* calls share EC2's bucket, which the planner's listing may just have emptied.
            fleet = adapters.fleet.shared_by(n, after_listing=True)
            adapters = replace(adapters, metrics=adapters.metrics.shared_by(n), fleet=fleet)
        report = run_sweep(
            adapters,
            now=task.now,
            dry_run=task.dry_run,
            sweep_id=f"{sweep_id}-{index}",
            time_left=time_left,
            instance_ids=shard.ids,
            # Organization mode: shared with the members; a group cut across shards: its owner's one message.
            message_scope=sweep_id if members is not None or shard.groups else None,
            send_notices=False,  # the gather step sends the sweep's stop notices, once
            quiet_summaries=index == 0,  # the hub's quiet-hours summaries: its first shard reads them, once
            group_parts=shard.groups,
        )
        totals = SweepTotals.of(report, members.config.hub_account if members is not None else None)
    try:
        adapters.store.put_lookup(result_key(sweep_id, index), totals.model_dump_json(), task.now + MANIFEST_TTL)
    except AwsError as exc:  # what it did is recorded per machine; only the summary is lost
        raise SweepCannotRun(f"shard {index} swept, but its totals were not recorded ({error_code(exc)})") from None
    if task.doctor and not of_members:  # the day's doctor: this machine shard's GPU machines (never raises)
        note_gpu_facts(adapters, report.read, task.now, (sweep_id, index), time_left)
    return report, totals


def _machine_manifest(adapters: Adapters, task: ShardTask, value: Any, where: str) -> ShardManifest:
    """A machine shard's manifest, its further pages read (SweepCannotRun when any cannot be: nothing is swept)."""

    def page(n: int) -> str | None:
        try:
            return adapters.store.get_lookup(manifest_page_key(task.sweep_id, task.shard, n), task.now)
        except AwsError as exc:
            raise SweepCannotRun(f"cannot read {where}, page {n + 1} ({error_code(exc)}): {exc}") from None

    return read_manifest(value, page, where)


def gather_sweep(adapters: Adapters, task: GatherTask, time_left: Callable[[], float] | None = None) -> Gathered:
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
    # A failed member shard's units are each a failed unit (its manifest says which): `status` names them. A failed
    # machine shard's machines (a worker that could not describe them, or timed out) are unknown this sweep: counted.
    units, unswept = _contents_of_failed_shards(adapters, task, failed)
    shard_warnings = [
        f"shard {i} failed, its {_machines(unswept.get(i))} untouched and unknown until the next sweep: {why}"
        for i, why in failed.items()
    ]
    parts = sum_totals(done, sweep_id=task.sweep_id, shards=len(shards), failed=failed)
    gathered = Gathered(**{**parts, "warnings": parts["warnings"] + shard_warnings, "unswept": sum(unswept.values())})
    gathered.dry_run = task.dry_run or gathered.dry_run
    gathered.units += units
    for warning in shard_warnings:
        logger.warning(warning, extra={"sweep_id": task.sweep_id})
    if not gathered.dry_run:
        note_failed_shards(adapters, len(failed), task.now)
        note_last_sweep(adapters, gathered, task.now)
        if gathered.units:
            note_member_sweep(adapters, gathered.units, task.now)
            note_unit_sizes(adapters, gathered.units, task.now)
        send_sweep_notices(adapters, task.now, time_left)  # the shards queued them: one pace for the workspace
    if task.doctor:  # the day's GPU check, of the machine shards' facts (never raises)
        report_gpu_facts(
            adapters,
            task.sweep_id,
            task.now,
            task.machine_shards,
            failed,
            dry_run=gathered.dry_run,
            time_left=time_left,
        )
    return gathered


def _machines(n: int | None) -> str:
    return "machines are" if n is None else f"{n:,} machine{'s are' if n != 1 else ' is'}"


def _contents_of_failed_shards(
    adapters: Adapters, task: GatherTask, failed: dict[int, str]
) -> tuple[list[UnitResult], dict[int, int]]:
    """What the failed shards held, from their manifests: each member shard's units, failed; each machine shard's
    count of machines (a manifest that cannot be read counts none: its warning says so without a number)."""

    def contents(index: int) -> list[UnitResult] | int:
        try:
            stored = adapters.store.get_lookup(manifest_key(task.sweep_id, index), task.now)
        except AwsError:
            return []
        found = member_manifest_of(stored) if stored else None
        if found is None:
            try:
                return manifest_machines(json.loads(stored)) or 0 if stored else []
            except ValueError:
                return []
        why = f"its shard ({index}) failed: {failed[index]}"
        part, parts = found.part or (None, None)
        return [
            UnitResult(account=a.id, region=r, name=a.name, error=why, part=part, parts=parts) for a, r in found.units()
        ]

    indices = sorted(failed)
    found = run_concurrently(contents, indices, DDB_WORKERS)
    units = [u for held in found if isinstance(held, list) for u in held]
    return units, {i: held for i, held in zip(indices, found, strict=True) if isinstance(held, int)}


def note_member_sweep(adapters: Adapters, units: Sequence[UnitResult], now: datetime) -> None:
    """Organization mode: what the sweep did in the member accounts, kept for `status` (never raises)."""
    try:
        save_member_sweep(adapters.store, member_sweep(units, now), now)
    except AwsError as exc:
        logger.warning("could not record the member accounts' sweep", extra={"error": error_code(exc)})


def note_last_sweep(adapters: Adapters, gathered: Gathered, now: datetime) -> None:
    """When the last sweep ended and how (one small item, rewritten each sweep): `idle-reaper doctor` reads
    it to tell a schedule that stopped, or sweeps that fail, from a reaper that works."""
    value = {"at": now.astimezone(UTC).isoformat(), "failed_shards": len(gathered.failed), "errors": gathered.errors}
    try:
        adapters.store.put_lookup(LAST_SWEEP_KEY, json.dumps(value), now + LAST_SWEEP_KEEP)
    except AwsError as exc:
        logger.warning("could not record the last sweep", extra={"error": error_code(exc)})


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
