"""The doctor, wired: every read-only check of one region (`idle-reaper doctor`, `/idle-reaper doctor`), of
every member account and region, and the alarm relay's own failures, told by the sweep. The cheap subset the
sweep runs once a day is sweep/doctor_daily.py.

The core decides (core/doctor.py); the gatherers fetch (aws/doctor.py, slack/doctor.py). A fact that could
not be gathered, in time or at all, is "could not check" (unknown), never ok."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from idle_reaper.aws.accounts import (
    ADVICE,
    DIGEST_READS_KEY,
    AccountFailure,
    Directory,
    MemberAccess,
    MemberAccount,
    MemberCheck,
    MemberCredentials,
    Reason,
    classify,
    last_member_check,
)
from idle_reaper.aws.clients import AwsError, deploy_prefix, error_code
from idle_reaper.aws.deploy import (
    DEPLOY_CHECKS,
    OUT_OF_TIME,
    STACK_ENV,
    default_stack_name,
    deploy_findings,
    describe_stack,
)
from idle_reaper.aws.doctor import gather_group_tags, gather_policy, gather_signals
from idle_reaper.aws.fleet import Fleet
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.aws.policies import PolicyStore
from idle_reaper.aws.state import StateStore
from idle_reaper.core.deploy_checks import AssociationFacts, Unreadable
from idle_reaper.core.doctor import (
    SIGNAL_WINDOW_MINUTES,
    Finding,
    LastSweep,
    MemberUnitFacts,
    PolicyFacts,
    check_groups,
    check_last_sweep,
    check_members,
    check_people,
    check_policy,
    check_signals,
    check_slack,
    unknown,
)
from idle_reaper.core.signals import Machine
from idle_reaper.core.studio import check_studio
from idle_reaper.notify import logger
from idle_reaper.organization import OrganizationSettings
from idle_reaper.policy import PolicyError, Settings, TeamPolicyRef
from idle_reaper.slack.doctor import SlackReader, gather_people, gather_slack
from idle_reaper.sweep.adapters import Adapters, alert_once
from idle_reaper.sweep.doctor_daily import cache_reader, domains_of, swept_apps, within
from idle_reaper.sweep.fanout import LAST_SWEEP_KEY

# The fleet and its metrics are read only with this much time left; the rest is said to be unknown.
AWS_STAGE_SECONDS = 5.0


@dataclass
class Account:
    """What the doctor reads in one region."""

    policies: PolicyStore
    fleet: Fleet
    metrics: MetricsReader
    store: StateStore


def _time_left(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - time.monotonic()


def gather_last_sweep(store: StateStore, now: datetime) -> LastSweep | Literal["unreadable"] | None:
    try:
        stored = store.get_lookup(LAST_SWEEP_KEY, now)
    except AwsError:
        return "unreadable"
    if not stored:
        return None
    value = json.loads(stored)
    return LastSweep(datetime.fromisoformat(value["at"]), int(value["failed_shards"]), int(value["errors"]))


def stack_checks(
    connect: Callable[[str], Any], region: str, deadline: float
) -> tuple[list[Finding], AssociationFacts | Unreadable | None]:
    """The deploy checks of the stack this runs in (IDLE_REAPER_STACK; else the stack of the table's prefix)
    for `/idle-reaper doctor`, with its agent association's facts. Bounded by `deadline` (time.monotonic()):
    what is not finished by then, even a call that hangs, is unknown, never ok."""
    name = os.environ.get(STACK_ENV) or default_stack_name()
    clients = {service: connect(service) for service in ("cloudformation", "events", "sns", "lambda", "ssm")}

    def run() -> tuple[list[Finding], AssociationFacts | Unreadable | None]:
        try:
            stack = describe_stack(clients["cloudformation"], name)
            return deploy_findings(clients.__getitem__, region, name, stack, deadline)
        except Exception as exc:  # a check's fault is its unknown (CannotRun: credentials refused)
            return [unknown(c, f"{type(exc).__name__}: {exc}") for c in DEPLOY_CHECKS], None

    late: tuple[list[Finding], AssociationFacts | Unreadable | None] = (
        [unknown(c, OUT_OF_TIME) for c in DEPLOY_CHECKS],
        None,
    )
    return within(deadline, run, late)


def run_checks(
    account: Account,
    reader: SlackReader | None,
    *,
    signing_secret: bool,
    now: datetime,
    sweep_minutes: int,
    deadline: float | None = None,
) -> list[Finding]:
    """Every check of one region, in this order: policy, the last sweep, Auto Scaling groups, signals, Slack,
    people. `deadline` (time.monotonic()): the fleet and its metrics are not read with less than
    AWS_STAGE_SECONDS left, and Slack is not asked past it; what was not reached is unknown."""
    settings, policy_facts, refs = gather_policy(account.policies)
    machines: list[Machine] | None = None
    why_no_machines = OUT_OF_TIME
    if _time_left(deadline) > AWS_STAGE_SECONDS:
        try:
            machines = account.fleet.discover(settings.tags, notebooks=False, endpoints=False)
        except AwsError as exc:
            why_no_machines = f"the opted-in machines could not be listed ({error_code(exc)})"
    findings = check_policy(
        PolicyFacts(
            policy_facts.settings_parameter,
            policy_facts.settings_problems,
            refs,
            None if machines is None else [m.team for m in machines],
        )
    )
    findings.append(check_last_sweep(gather_last_sweep(account.store, now), now, sweep_minutes))
    opt_in = settings.tags.managed
    members: dict[str, int] | None = None
    tagged: set[str] | None = set()
    if machines is not None:
        members = {}
        for m in machines:
            if m.asg_name:
                members[m.asg_name] = members.get(m.asg_name, 0) + 1
        if opt_in and members:
            tagged = gather_group_tags(account.fleet.autoscaling, set(members), opt_in)
    findings.append(check_groups(None if tagged is None else members, tagged or set(), opt_in))
    period = settings.metrics.period_seconds // 60
    if machines is None:
        findings.append(unknown("signals", why_no_machines))
    elif _time_left(deadline) <= AWS_STAGE_SECONDS:
        findings.append(unknown("signals", OUT_OF_TIME))
    else:
        signals = gather_signals(account.metrics, machines, settings, refs, now)
        findings += check_signals(signals, now - timedelta(minutes=SIGNAL_WINDOW_MINUTES), now, period)
    if _time_left(deadline) > AWS_STAGE_SECONDS:
        findings += studio_findings(account.fleet, account.metrics, settings, refs, now)
    slack = gather_slack(reader, signing_secret, settings, refs)
    findings += check_slack(slack)
    if reader is None or not slack.reachable:
        findings.append(unknown("people.owners", "Slack is not reachable with the bot token"))
    elif machines is None:
        findings.append(unknown("people.owners", why_no_machines))
    else:
        owned, contacts = gather_people(reader, machines, refs, cache_reader(account.store, now))
        findings += check_people(owned, contacts)
    return findings


def studio_findings(
    fleet: Fleet, metrics: MetricsReader, settings: Settings, refs: Mapping[str, TeamPolicyRef], now: datetime
) -> list[Finding]:
    """The Studio apps the sweep acts on (core/studio.check_studio): their domains' tag propagation and lifecycle
    configurations, and their last hour of CPU. Nothing where Studio is not read (no adapter, or SageMaker off)."""
    if fleet.studio is None or not settings.sagemaker_notebooks:
        return []
    try:
        apps = swept_apps(fleet.studio.discover(settings.tags), refs, settings)
        domains = domains_of(fleet.studio, apps)
    except AwsError as exc:
        return [unknown("studio", f"Studio apps could not be listed ({error_code(exc)})")]
    ids = [a.machine_id for a in apps]
    without: list[str] | None = []
    if ids:
        start = now - timedelta(minutes=SIGNAL_WINDOW_MINUTES)
        try:
            read = metrics.fetch(ids, settings.metrics, start=start, end=now, human=False, gpu=False, notebooks=ids)
            without = [i for i in ids if i not in read or not read[i].cpu]
        except AwsError:
            without = None
    return check_studio(apps, domains, without, deploy_prefix())


# ---------------------------------------------------------------------------------------------
# Organization mode: every member account and region

MEMBER_WORKERS = 8  # (account, region) units looked at once: a slow account holds one worker, not the others
MEMBER_UNIT_SECONDS = 3.0  # a unit is not started with less time than this left: it is unknown, never ok


@dataclass(frozen=True)
class MembersRead:
    """What the doctor read of the member accounts: one fact per enrolled (account, region)."""

    units: list[MemberUnitFacts]
    listing_error: str | None
    skipped: list[str]  # accounts the listing left out (suspended or closed)


def member_reads(held: MemberCredentials) -> tuple[Fleet, MetricsReader]:
    """The opted-in machines and their metrics in one member (account, region), through its member role."""
    return Fleet(held.client("ec2"), held.client("autoscaling")), MetricsReader(held.client("cloudwatch"))


def organization_settings(policies: PolicyStore) -> OrganizationSettings | None:
    """`{prefix}/organization` (absent: nothing excluded); None when it cannot be read or is invalid (the doctor
    then reads every member account's machines: the sweep touches none of them meanwhile, and says so)."""
    try:
        return policies.load_organization()
    except (PolicyError, *AwsError):
        return None


def gather_members(
    members: MemberAccess,
    settings: Settings,
    refs: Mapping[str, TeamPolicyRef],
    now: datetime,
    deadline: float,
    *,
    organization: OrganizationSettings | None = None,
    workers: int = MEMBER_WORKERS,
    reads_in: Callable[[MemberCredentials], tuple[Fleet, MetricsReader]] = member_reads,
) -> MembersRead:
    """Every enrolled (account, region): whether the member role can be assumed (credentials reused while
    valid; a refusal classified: accounts.classify), and whether its GPU machines published GPU metrics in the
    last hour (their CPU and GPU alone, as the sweep's daily check reads). An excluded account's role is
    checked, its machines are not read. `workers` units at once; what is not done by `deadline`
    (time.monotonic()), even a call that hangs, is unknown."""
    listing = members.directory.current()
    units = members.config.units(listing.accounts)

    def one(unit: tuple[MemberAccount, str]) -> MemberUnitFacts:
        account, region = unit
        facts = MemberUnitFacts(account.id, account.name, region)
        if _time_left(deadline) < MEMBER_UNIT_SECONDS:
            return replace(facts, reached=False)
        held = members.sessions.credentials(account.id, region, started=now)
        if isinstance(held, AccountFailure):
            return replace(facts, role_reason=held.reason.value, role_detail=f"{ADVICE[held.reason]} ({held.detail})")
        if organization is not None and organization.excludes(account.id, account.parents):
            return replace(facts, excluded=True)
        try:
            fleet, metrics = reads_in(held)
            machines = fleet.discover(settings.tags, notebooks=False, endpoints=False)
            return replace(facts, gpu=gather_signals(metrics, machines, settings, refs, now, gpu_only=True))
        except Exception as exc:  # one account's fault is its own finding
            gone = members.sessions.refused(exc, account.id, region)  # suspended or left since it was listed
            if gone is not None:
                return replace(
                    facts, role_reason=gone.reason.value, role_detail=f"{ADVICE[gone.reason]} ({gone.detail})"
                )
            failure = classify(exc, account.id, region)
            if failure.reason in (Reason.ROLE_MISSING, Reason.DENIED_BY_SCP):  # assumed, then refused a read
                detail = f"the member role was assumed, but may not list the machines or read them ({failure.detail})"
                return replace(facts, role_reason=Reason.ERROR.value, role_detail=detail)
            return replace(facts, unreadable=failure.detail)

    pool = ThreadPoolExecutor(max(1, min(workers, len(units) or 1)))
    try:
        futures = [pool.submit(one, unit) for unit in units]
        wait(futures, timeout=max(0.0, _time_left(deadline)))
        found = [_unit_result(f, MemberUnitFacts(a.id, a.name, r)) for f, (a, r) in zip(futures, units, strict=True)]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a call still hanging finishes (read-only) unobserved
    skipped = [s.account for s in listing.skipped if s.reason is Reason.SUSPENDED]
    return MembersRead(found, listing.error, skipped)


def _unit_result(future: Future[MemberUnitFacts], facts: MemberUnitFacts) -> MemberUnitFacts:
    """One unit's facts; not done in time: not reached; its check raised: that unit alone is unknown, with why."""
    if not future.done() or future.cancelled():
        return replace(facts, reached=False)
    failed = future.exception()
    if failed is not None:
        return replace(facts, unreadable=f"its check failed ({type(failed).__name__}: {failed})"[:300])
    return future.result()


def member_findings(
    members: MemberAccess,
    policies: PolicyStore,
    now: datetime,
    deadline: float,
    *,
    reads_in: Callable[[MemberCredentials], tuple[Fleet, MetricsReader]] = member_reads,
    workers: int = MEMBER_WORKERS,
    store: StateStore | None = None,
) -> list[Finding]:
    """`/idle-reaper doctor` in organization mode (the Slack endpoint's role, one the member role trusts): every
    member account and region, bounded by `deadline`, and (from `store`) where the weekly digest could not
    assume its read role; never raises."""
    try:
        settings, _ = policies.load_settings()
        refs = policies.load_teams(settings)
        read = gather_members(
            members,
            settings,
            refs,
            now,
            deadline,
            organization=organization_settings(policies),
            reads_in=reads_in,
            workers=workers,
        )
    except Exception as exc:  # the settings unreadable or invalid (policy.settings says which): unknown
        return [unknown("members", f"{type(exc).__name__}: {exc}"[:300])]
    units = with_digest_reads(read.units, digest_reads(store, now)) if store is not None else read.units
    return check_members(units, listing_error=read.listing_error, skipped=read.skipped)


def digest_reads(store: StateStore, now: datetime) -> MemberCheck | None:
    """The weekly digest's last reads in member accounts (aws/accounts.py DIGEST_READS_KEY); None when it has
    not read any in the last week, or they cannot be read (the rest of the doctor's answer does not wait on
    them: the digest's figures are a report, not a safety)."""
    try:
        return last_member_check(store, now, key=DIGEST_READS_KEY)
    except Exception as exc:
        logger.warning("the digest's member reads not read for the doctor", extra={"error": type(exc).__name__})
        return None


def with_digest_reads(units: Sequence[MemberUnitFacts], reads: MemberCheck | None) -> list[MemberUnitFacts]:
    """Each (account, region) where the digest's last run could not assume the member stack's read role (its
    exempt machines were "no data" there) says so, with AWS's reason and the day."""
    failures = {(f.account, f.region): f for f in (reads.failures if reads else ())}
    out = []
    for unit in units:
        failure = failures.get((unit.account, unit.region))
        if failure is not None and reads is not None:
            why = f"{failure.reason.value} ({failure.detail}; the digest of {reads.checked_at:%Y-%m-%d %H:%M} UTC)"
            unit = replace(unit, read_role=why)
        out.append(unit)
    return out


# What `idle-reaper doctor` says of member accounts' GPU metrics: the CLI runs with a person's credentials, which
# the member role does not trust (only the hub's sweep and Slack endpoint roles), so it cannot read them there.
CLI_GPU_UNREAD = "a member account's metrics can be read by the hub's roles only, not with these credentials"


NOT_IN_CHECK = "not in the sweep's last check"


def members_as_last_checked(
    check: MemberCheck | str | None,
    listing: Directory,
    regions_of: Callable[[str], Sequence[str]],
    now: datetime,
    fresh: timedelta,
    stacks: Mapping[tuple[str, str], str] | None = None,
    digest: MemberCheck | None = None,
) -> MembersRead:
    """`idle-reaper doctor` in organization mode: each enrolled (account, region) as the sweep's last check of
    the member accounts saw it (aws/accounts.py MemberCheck: the hub's own AssumeRole, with its reason), and
    the member stack's instance status (`stacks`: "" current, else what is wrong; a unit not in it has no
    stack instance; None: not read), and where the weekly digest's last run (`digest`) could not assume the
    read role. Known only for what that check tried: an account it did not (one that
    joined since, or any account of a check stored without its accounts) is unknown, as are all of them when
    the check is older than `fresh`, absent, or unreadable (`check` a string: why)."""
    unreadable = check if isinstance(check, str) else None
    last = check if isinstance(check, MemberCheck) else None
    failures = {(f.account, f.region): f for f in (last.failures if last else ())}
    stale = None
    if unreadable is not None:
        stale = f"the sweep's last check of the member accounts could not be read ({unreadable})"
    elif last is None:
        stale = "the sweep has not checked the member accounts (none in the last week)"
    elif now - last.checked_at > fresh:
        stale = f"the sweep last checked the member accounts at {last.checked_at:%Y-%m-%d %H:%M} UTC"
    checked = set(last.checked) if last and last.checked is not None else set()
    units = []
    for account in listing.accounts:
        for region in regions_of(account.id):
            facts = MemberUnitFacts(account.id, account.name, region)
            if stacks is not None:
                facts = replace(facts, stack=stacks.get((account.id, region), "missing (no stack instance)") or None)
            failure = failures.get((account.id, region))
            if failure is not None:
                detail = f"{ADVICE[failure.reason]} ({failure.detail}; as the last sweep saw it)"
                facts = replace(facts, role_reason=failure.reason.value, role_detail=detail)
            elif last is not None and last.failing_unkept(account.id, region):
                why = f"its account failed in the sweep's last check (one of {last.failures_more} failures not kept)"
                facts = replace(facts, unreadable=why)
            elif stale:
                facts = replace(facts, unreadable=stale)
            elif account.id not in checked:
                facts = replace(facts, unreadable=NOT_IN_CHECK)
            units.append(facts)
    skipped = [s.account for s in listing.skipped if s.reason is Reason.SUSPENDED]
    return MembersRead(with_digest_reads(units, digest), listing.error, skipped)


# ---------------------------------------------------------------------------------------------
# The alarm relay's own failures


def report_failing_relay(adapters: Adapters, connect: Callable[[], Any], alarm: str | None, now: datetime) -> bool:
    """The alarms reach the admins through the Slack relay; the alarm on the relay's own errors cannot go
    through it, and a deploy without an alarm e-mail has nobody else on its topic. So each sweep looks at that
    alarm (one DescribeAlarms call) and, while it is in ALARM, tells the admins through the sweep's own Slack
    delivery, once a day. True when it told them. Never raises: the sweep is done by then."""
    if not alarm:
        return False
    try:
        cloudwatch = connect()  # a CloudWatch client, made only when there is an alarm to read
        found = cloudwatch.describe_alarms(AlarmNames=[alarm], AlarmTypes=["MetricAlarm"])["MetricAlarms"]
        if not found or found[0].get("StateValue") != "ALARM":
            return False
        settings, _ = adapters.policies.load_settings()
    except Exception as exc:
        logger.warning("the alarm relay's alarm could not be read", extra={"error": f"{type(exc).__name__}: {exc}"})
        return False
    since = found[0].get("StateUpdatedTimestamp")
    text = (
        f"idle-reaper's alarm relay is failing (alarm {alarm} in ALARM"
        + (f" since {since:%Y-%m-%d %H:%M} UTC" if isinstance(since, datetime) else "")
        + "): CloudWatch alarms about the reaper are not reaching Slack. Check the relay function's logs (its "
        "Slack credentials, the admin channel); deploy with -c alarmEmail=ADDRESS to have alarms e-mailed too."
    )
    return alert_once(adapters, f"alarm-relay-failing#{now:%Y-%m-%d}", text, settings, now)
