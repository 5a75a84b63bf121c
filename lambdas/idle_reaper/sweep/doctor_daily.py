"""The doctor's daily subset, in the sweep: on the day's first sweep, the cheap checks (teams in safe mode, GPU
machines without GPU metrics, the bot's channels, owners who are no Slack user), each new failure told to the
admins once, and again when a failure that cleared comes back.

A sweep swept in one invocation runs it all after its work, on what it read. A sweep handed to the fan-out runs
each check where its facts are, so that no invocation reads the whole fleet's metrics: the planner claims the day
before it starts the execution and runs the checks of what it listed (policies, Slack, owners); each machine
shard, which has just read its machines' metrics, puts its GPU machines' facts in an item of its own (the GPU
machines it did not read are read then, CPU and GPU alone, at its share of GetMetricData's quotas); the gather
step makes the GPU check of them and tells it. No part of it ever fails or delays the sweep's own work."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from idle_reaper.aws.clients import DDB_WORKERS, AwsError, deploy_prefix, run_concurrently
from idle_reaper.aws.doctor import gather_signals
from idle_reaper.aws.limits import LOOKUP_VALUE_MAX_BYTES
from idle_reaper.aws.policies import policy_for
from idle_reaper.aws.state import StateStore
from idle_reaper.aws.studio import StudioApps
from idle_reaper.core.doctor import (
    DAILY_CHECKS,
    Finding,
    PolicyFacts,
    check_gpu_metrics,
    check_people,
    check_policy,
    check_slack,
    finding_key,
    gpu_metrics_missing,
    listed,
    remember,
    unknown,
)
from idle_reaper.core.signals import Machine
from idle_reaper.core.studio import AppFacts, check_studio, swept
from idle_reaper.notify import logger
from idle_reaper.policy import Settings, TeamPolicyRef
from idle_reaper.slack.doctor import SlackReader, gather_people, gather_slack, slack_reader
from idle_reaper.slack.owners import OWNER_CACHE_TTL
from idle_reaper.sweep.adapters import Adapters, SweepRead, alert_once

T = TypeVar("T")

DAILY_MIN_SECONDS = 60.0  # run only with this much of the invocation left (else the next sweep tries)
DAILY_SLACK_SECONDS = 20.0  # Slack is not asked past this; what was not asked is unknown
FAILING_KEY = "doctor#failing"  # what the last daily run remembered (core.doctor.Remembered.failing)
FAILING_KEEP = timedelta(days=40)  # longer than a claim lives (aws.state.CLAIM_TTL_DAYS)
MEMORY_ATTEMPTS = 3  # writes of FAILING_KEY tried when another part of the day's run wrote it meanwhile
GPU_CHECK = "signals.gpu"
# A machine shard reads its GPU machines for the doctor only with this much of its time left, and stops waiting
# for them with SHARD_RESERVE_SECONDS left: what it could not read in time is unknown.
SHARD_GPU_SECONDS = 30.0
SHARD_RESERVE_SECONDS = 10.0
GPU_FACTS_KEEP = timedelta(days=1)  # as long as the shard manifests (sweep.fanout.MANIFEST_TTL)
GATHER_GPU_SECONDS = 15.0  # the gather step makes the GPU check only with this much of its time left


def within(deadline: float, call: Callable[[], T], late: T) -> T:
    """`call()`, or `late` when it is not done by `deadline` (time.monotonic()), even a call that hangs: a
    read not finished in time is unknown, never ok. What `call` raises is raised."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call).result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        return late
    finally:
        pool.shutdown(wait=False)  # a call still hanging finishes (read-only) unobserved


def cache_reader(store: StateStore, now: datetime) -> Callable[[str], str | None]:
    """The sweep's owner cache, read; an unreadable item is a miss."""

    def cached(key: str) -> str | None:
        try:
            return store.get_lookup(key, now)
        except AwsError:
            return None

    return cached


def _cache_writer(store: StateStore, now: datetime) -> Callable[[Mapping[str, str]], None]:
    """The daily check's resolved owners, into the sweep's owner cache (slack/owners.py: the same keys and
    lifetime), so the sweep does not resolve them again. A write that fails is only a later lookup."""

    def write(found: Mapping[str, str]) -> None:
        def put(item: tuple[str, str]) -> None:
            with contextlib.suppress(*AwsError):
                store.put_lookup(f"owner#{item[0]}", item[1], now + OWNER_CACHE_TTL)

        run_concurrently(put, sorted(found.items()), DDB_WORKERS)

    return write


def list_afresh(adapters: Adapters, listed: Sequence[Machine] | None = None) -> SweepRead:
    """For a sweep handed to the fan-out (whose shards read their own machines): the settings and team
    policies, and the machines the planner `listed` (listed again only when there are none)."""
    settings, _ = adapters.policies.load_settings()
    refs = adapters.policies.load_teams(settings)
    if listed is None:
        listed = adapters.fleet.discover(settings.tags, notebooks=False, endpoints=False)
    machines = list(listed)
    return SweepRead(settings, refs, machines, {})


@dataclass
class DailyDoctor:
    """One daily run (or, for a sweep handed to the fan-out, one part of it): its findings, the failures told,
    and what it cost."""

    findings: list[Finding]
    told: list[Finding]
    slack_calls: int
    metric_calls: int
    cache_reads: int
    seconds: float


# ---------------------------------------------------------------------------------------------
# The GPU check's facts: what a sweep (or a shard of one) read, reduced to what the check says


class GpuFacts(BaseModel):
    """The GPU check's facts of some machines (one machine shard's): the GPU machines that publish CPU but no GPU
    metrics, how many CloudWatch could not be read for, and why some could not be looked at (`unchecked`). Its ids
    are some of a shard's (at most SHARD_SIZE machines: 220 KB of ids), so it fits in one item."""

    model_config = ConfigDict(extra="forbid")

    no_gpu: list[str] = Field(default_factory=list)
    unread: int = 0
    unchecked: list[str] = Field(default_factory=list)


def gpu_facts(adapters: Adapters, read: SweepRead, now: datetime) -> GpuFacts:
    """The GPU machines a sweep read, by the sweep's own reads; those it did not read (busy and not due, exempt, of
    a team in safe mode) are read now for the last hour, CPU and GPU alone, in the sweep's batches."""
    refs, metrics = dict(read.refs or {}), adapters.metrics
    signals = gather_signals(metrics, read.machines, read.settings, refs, now, read=read.signals, gpu_only=True)
    return GpuFacts(no_gpu=gpu_metrics_missing(signals), unread=sum(1 for m in signals if not m.complete))


def gpu_findings(parts: Sequence[GpuFacts]) -> list[Finding]:
    """The GPU check of some parts' facts: the same finding as of their machines read in one place, and unknown
    beside it for what could not be read or looked at."""
    findings = [check_gpu_metrics((), missing=[i for p in parts for i in p.no_gpu])]
    unread = sum(p.unread for p in parts)
    if unread:
        findings.append(unknown(GPU_CHECK, f"CloudWatch could not be read for {unread} machine(s)"))
    unchecked = [why for p in parts for why in p.unchecked]
    if unchecked:
        findings.append(unknown(GPU_CHECK, f"some GPU machines were not looked at: {listed(unchecked)}"))
    return findings


def gpu_facts_key(sweep_id: str, shard: int) -> str:
    return f"doctor-gpu#{sweep_id}#{shard}"


def note_gpu_facts(
    adapters: Adapters,
    read: SweepRead | None,
    now: datetime,
    where: tuple[str, int],
    time_left: Callable[[], float] | None = None,
) -> GpuFacts:
    """A machine shard's part of the day's GPU check, asked for by the planner (ShardTask.doctor) and kept for the
    gather step (`where`: the sweep and the shard). After the shard's own work and its result are recorded; its
    reads are the shard's, at the shard's share of GetMetricData's quotas (`adapters.metrics`). Never raises: a
    shard that cannot look, in time or at all, says why, and the check is unknown for its machines."""
    sweep_id, shard = where
    late = GpuFacts(unchecked=[f"shard {shard}'s (out of time)"])
    started, calls = time.monotonic(), adapters.metrics.stats.calls
    try:
        if read is None:
            facts = GpuFacts(unchecked=[f"shard {shard}'s (its machines were not read)"])
        elif time_left is None:  # run locally: no deadline
            facts = gpu_facts(adapters, read, now)
        elif (left := time_left()) < SHARD_GPU_SECONDS:
            facts = late
        else:
            deadline = time.monotonic() + left - SHARD_RESERVE_SECONDS
            facts = within(deadline, lambda: gpu_facts(adapters, read, now), late)
    except Exception as exc:  # the shard's sweep is done; its part of the check is unknown
        facts = GpuFacts(unchecked=[f"shard {shard}'s ({type(exc).__name__}: {exc})"[:300]])
    if len(facts.model_dump_json()) > LOOKUP_VALUE_MAX_BYTES:  # never at SHARD_SIZE (10,000 ids: 220 KB); said so
        facts = GpuFacts(unchecked=[f"shard {shard}'s ({len(facts.no_gpu)} without GPU metrics, too many to keep)"])
    try:
        adapters.store.put_lookup(gpu_facts_key(sweep_id, shard), facts.model_dump_json(), now + GPU_FACTS_KEEP)
    except Exception as exc:
        logger.warning("the doctor's GPU facts of this shard were not kept", extra={"error": f"{exc}"[:300]})
    logger.info(
        "daily doctor: this shard's GPU machines",
        extra={
            "without_gpu_metrics": len(facts.no_gpu),
            "unread": facts.unread,
            "unchecked": facts.unchecked,
            "metric_calls": adapters.metrics.stats.calls - calls,
            "seconds": round(time.monotonic() - started, 3),
        },
    )
    return facts


def report_gpu_facts(
    adapters: Adapters,
    sweep_id: str,
    now: datetime,
    machine_shards: int,
    failed: Mapping[int, str],
    *,
    dry_run: bool,
    time_left: Callable[[], float] | None = None,
) -> DailyDoctor | None:
    """The gather step of the sweep the planner claimed the day's doctor for: the GPU check of its machine shards'
    facts (a failed shard's machines, or a shard whose facts are missing, are unknown), told as the daily subset
    tells. Never raises: a fault is logged; the summary of the sweep does not wait on it, nor does it start with
    less than GATHER_GPU_SECONDS of the step's time left (logged: the day's GPU check is then not made)."""
    started = time.monotonic()
    if time_left is not None and time_left() < GATHER_GPU_SECONDS:
        logger.warning("daily doctor: the GPU check was not made, the gather step is out of time")
        return None

    def read(shard: int) -> GpuFacts:
        if shard in failed:
            return GpuFacts(unchecked=[f"shard {shard}'s (it failed: {failed[shard]})"[:300]])
        try:
            stored = adapters.store.get_lookup(gpu_facts_key(sweep_id, shard), now)
            return GpuFacts.model_validate_json(stored) if stored else GpuFacts(unchecked=[f"shard {shard}'s (none)"])
        except Exception as exc:
            return GpuFacts(unchecked=[f"shard {shard}'s (not read: {type(exc).__name__})"])

    try:
        findings = gpu_findings(run_concurrently(read, list(range(machine_shards)), DDB_WORKERS))
        settings, _ = adapters.policies.load_settings()
        told = [] if dry_run or settings.dry_run else tell_new_failures(adapters, findings, settings, now)
    except Exception as exc:
        logger.warning("daily doctor failed", extra={"error": f"{type(exc).__name__}: {exc}"})
        return None
    return _logged(DailyDoctor(findings, told, 0, 0, 0, round(time.monotonic() - started, 3)))


# ---------------------------------------------------------------------------------------------
# The checks, the claim of the day, and what is told


def daily_subset(
    adapters: Adapters, read: SweepRead, now: datetime, reader: SlackReader | None, *, gpu: bool = True
) -> tuple[list[Finding], int]:
    """The cheap checks, on what the sweep read: teams in safe mode, GPU machines without GPU metrics (the
    sweep's own reads; only the GPU machines it did not read this time are read, CPU and GPU alone; `gpu` False:
    not here, the fan-out's shards read them), the bot's membership of the team channels, unresolved owners (the
    sweep's owner cache first, and what is resolved is written to it). A check's fault makes it unknown.
    Returns the findings and the owner-cache reads made."""
    findings: list[Finding] = []
    refs = dict(read.refs or {})
    if read.refs is None:
        findings.append(unknown("policy.teams", "the team policies could not be read"))
    else:
        findings += [f for f in check_policy(PolicyFacts("", (), refs, None)) if f.check == "policy.teams"]
    try:
        findings += gpu_findings([gpu_facts(adapters, read, now)]) if gpu else []
    except Exception as exc:  # a check's fault is its unknown
        findings.append(unknown(GPU_CHECK, f"{type(exc).__name__}: {exc}"))
    try:
        findings += studio_daily(adapters, read)
    except Exception as exc:
        findings.append(unknown("studio.tags", f"{type(exc).__name__}: {exc}"))
    lookups = 0
    try:
        slack = gather_slack(reader, True, read.settings, refs, users=False)
        findings += [f for f in check_slack(slack) if f.check == "slack.channels"] or [
            unknown("slack.channels", slack.auth_error or "Slack is not reachable")
        ]
    except Exception as exc:
        findings.append(unknown("slack.channels", f"{type(exc).__name__}: {exc}"))
        slack = None
    if reader is None or slack is None or not slack.reachable:
        findings.append(unknown("people.owners", "Slack is not reachable with the bot token"))
    else:
        cache = cache_reader(adapters.store, now)

        def cached(key: str) -> str | None:
            nonlocal lookups
            lookups += 1
            return cache(key)

        try:
            owned, contacts = gather_people(reader, read.machines, refs, cached, _cache_writer(adapters.store, now))
            findings += [f for f in check_people(owned, contacts) if f.check == "people.owners"]
        except Exception as exc:
            findings.append(unknown("people.owners", f"{type(exc).__name__}: {exc}"))
    return [f for f in findings if f.check in DAILY_CHECKS], lookups


def swept_apps(machines: Sequence[Machine], refs: Mapping[str, TeamPolicyRef], settings: Settings) -> list[AppFacts]:
    """The Studio apps among `machines` that their team's policy sweeps (`studio_apps: delete`): what the doctor's
    Studio checks look at, by hand (sweep/doctor.py) and daily."""
    return [
        m.facts.studio
        for m in machines
        if m.facts.studio is not None and swept(m.facts.studio, policy_for(m.team, refs, settings).policy)
    ]


def domains_of(studio: StudioApps, apps: Sequence[AppFacts]) -> dict[str, dict[str, Any]]:
    """DescribeDomain of each domain `apps` run in, once a domain."""
    return {d: studio.domain(d) for d in sorted({a.domain_id for a in apps})}


def studio_daily(adapters: Adapters, read: SweepRead) -> list[Finding]:
    """The doctor's Studio checks (core/studio.check_studio) on the apps this sweep listed and read: a domain whose
    tag propagation is off or that runs none of our lifecycle configurations, apps read without CPU data. One
    DescribeDomain a domain of swept apps; nothing where no app is swept (the admins hear only of failures)."""
    studio = adapters.fleet.studio
    apps = swept_apps(read.machines, read.refs or {}, read.settings)
    if studio is None or not apps:
        return []
    dark = [a.machine_id for a in apps if a.machine_id in read.signals and not read.signals[a.machine_id].cpu]
    return check_studio(apps, domains_of(studio, apps), dark, deploy_prefix())


def _told_before(adapters: Adapters, now: datetime) -> tuple[dict[str, list[str]], str | None] | None:
    """What the last runs remembered, and the stored value it was read from (None: nothing stored); None when
    it could not be read."""
    try:
        stored = adapters.store.get_lookup(FAILING_KEY, now)
        value = json.loads(stored) if stored else {}
    except Exception as exc:  # nothing remembered: no claim is released, none is lost
        logger.warning("daily doctor: what was told before could not be read", extra={"error": str(exc)})
        return None
    if not isinstance(value, dict):
        return {}, stored
    return {str(k): [str(key) for key in v] for k, v in value.items()}, stored


def tell_new_failures(
    adapters: Adapters, findings: Sequence[Finding], settings: Settings, now: datetime
) -> list[Finding]:
    """Each failure is told once (a claim keyed on its check and subjects); a failure that has cleared
    releases its claim, so if it comes back it is told again. Returns the failures told now. What is told is
    remembered in one item, written only if nobody wrote it since it was read (a sweep handed to the fan-out
    tells its checks from two invocations, maybe at once: each keeps the other's), else read again; what could
    not be read is not written over."""
    told: list[Finding] = []
    for _ in range(MEMORY_ATTEMPTS):
        before = _told_before(adapters, now)
        remembered = remember(before[0] if before is not None else {}, findings)
        for key in remembered.cleared:
            try:
                adapters.store.release_claim(f"doctor#{key}")
            except Exception as exc:
                logger.warning("daily doctor: a cleared failure's claim was not released", extra={"error": str(exc)})
        message = "idle-reaper doctor (the sweep's daily check) found a new problem: {}. Fix: {}"
        told += [
            f
            for f in findings
            if f.status == "fail"
            and f not in told
            and alert_once(adapters, f"doctor#{finding_key(f)}", message.format(f.message, f.fix), settings, now)
        ]
        if before is None:
            return told
        value, expires = json.dumps(dict(remembered.failing)), now + FAILING_KEEP
        try:
            if adapters.store.replace_lookup(FAILING_KEY, value, expires, expected=before[1], now=now):
                return told
        except Exception as exc:
            logger.warning("daily doctor: what was told could not be recorded", extra={"error": str(exc)})
            return told
    logger.warning("daily doctor: what was told could not be recorded (written by another part meanwhile)")
    return told


def daily_claim_key(now: datetime) -> str:
    return f"doctor#day#{now:%Y-%m-%d}"


def claim_daily_doctor(adapters: Adapters, now: datetime, time_left: Callable[[], float]) -> bool:
    """The day's doctor, claimed by the day's first sweep with DAILY_MIN_SECONDS left (a conditional write).
    False: claimed already, too little time (the next sweep tries), or the claim failed (logged)."""
    if time_left() < DAILY_MIN_SECONDS:
        return False
    try:
        return adapters.store.claim_once(daily_claim_key(now), now)
    except Exception as exc:
        logger.warning("daily doctor failed", extra={"error": f"{type(exc).__name__}: {exc}"})
        return False


def run_daily_doctor(
    adapters: Adapters,
    now: datetime,
    read: SweepRead | None,
    time_left: Callable[[], float],
    listed: Sequence[Machine] | None = None,
    *,
    claimed: bool = False,
    gpu: bool = True,
) -> DailyDoctor | None:
    """The daily subset, on the day's first sweep with DAILY_MIN_SECONDS left (claimed once a day; `claimed`:
    by the caller already), after the sweep's own work. It never raises: a fault is logged, and a check it
    touches is unknown. Nothing is told in a dry run. `read`: what the sweep read; else `listed`, what the
    fan-out's planner listed; with neither, the fleet is listed again. `gpu` False: the GPU check is left to the
    fan-out's shards and gather step (report_gpu_facts)."""
    if not claimed and not claim_daily_doctor(adapters, now, time_left):
        return None
    started = time.monotonic()
    metric_calls = adapters.metrics.stats.calls
    try:
        read = read or list_afresh(adapters, listed)
        slack, _ = slack_reader(DAILY_SLACK_SECONDS, started + DAILY_SLACK_SECONDS)
        findings, lookups = daily_subset(adapters, read, now, slack, gpu=gpu)
        told = [] if read.settings.dry_run else tell_new_failures(adapters, findings, read.settings, now)
    except Exception as exc:  # the sweep goes on; tomorrow's first sweep checks again
        logger.warning("daily doctor failed", extra={"error": f"{type(exc).__name__}: {exc}"})
        return None
    return _logged(
        DailyDoctor(
            findings=findings,
            told=told,
            slack_calls=slack.calls if slack else 0,
            metric_calls=adapters.metrics.stats.calls - metric_calls,
            cache_reads=lookups,
            seconds=round(time.monotonic() - started, 3),
        )
    )


def _logged(done: DailyDoctor) -> DailyDoctor:
    for f in done.findings:
        if f.status != "ok":
            logger.warning("daily doctor: " + f.line(), extra={"check": f.check, "status": f.status})
    logger.info(
        "daily doctor",
        extra={
            "checks": sorted({f.check for f in done.findings}),
            "told": [f.check for f in done.told],
            "slack_calls": done.slack_calls,
            "metric_calls": done.metric_calls,
            "owner_cache_reads": done.cache_reads,
            "seconds": done.seconds,
        },
    )
    return done
