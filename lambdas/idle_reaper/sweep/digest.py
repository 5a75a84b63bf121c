"""The weekly digest, hour by hour: which destinations are due (core.digest.digest_due), each claimed once per
ISO week in the state table (claim_once: overlapping invocations and sweeps send it once), the figures from
the audit trail and records (core.digest.build_digest), the chart (slack.chart) and the post (slack.digest).

Organization mode (DigestAccounts): the member accounts' names come from the directory (Organizations), and an
exempt member machine's week is read in its own account and region through the member stack's read role
(cloudwatch:GetMetricData only, trusted by the digest alone), never with the hub's CloudWatch (the same
instance id there is another machine, or none); an account that cannot be reached leaves its exempt machines
"no data"."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from idle_reaper.aws.accounts import DIGEST_READS_KEY, AccountFailure, MemberAccess, MemberCheck, save_member_check
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.aws.policies import PolicyStore, policy_for
from idle_reaper.aws.state import StateStore
from idle_reaper.core.digest import (
    ADMINS,
    RECOVERY_HORIZON,
    TREND_WEEKS,
    Digest,
    Week,
    build_digest,
    claim_key,
    digest_due,
    running_now,
)
from idle_reaper.core.digest_text import HUB_ACCOUNT, digest_text
from idle_reaper.core.records import MachineRecord, State
from idle_reaper.core.sections import MACHINES, section_of
from idle_reaper.core.signals import Signals, has_no_gpu, idle_hours, is_gpu_type
from idle_reaper.notify import logger
from idle_reaper.policy import Settings, TeamPolicy, TeamPolicyRef
from idle_reaper.pricing import DEFAULT_PRICES
from idle_reaper.slack.digest import DigestSender, DigestUndelivered

MISSING_CHART = "This digest comes without its chart: {why}."


@dataclass(frozen=True)
class DigestOutcome:
    destination: str  # a team, or "admins"
    week: str
    channel: str | None  # None: nowhere to send it
    with_chart: bool = False
    redirected: bool = False  # a team without a channel: posted in the admin channel
    error: str = ""


@dataclass(frozen=True)
class DigestAccounts:
    """What the digest knows of member accounts (organization mode): their names, and CloudWatch in each
    (account, region) through a member role's credentials, None where it cannot be read there."""

    names: Mapping[str, str] = field(default_factory=dict)
    metrics_in: Callable[[str, str], MetricsReader | None] = lambda account, region: None
    # Each (account, region) `metrics_in` tried, and why it could not read there (None: it could): kept for the
    # doctor (DIGEST_READS_KEY) once the digest has read.
    tried: dict[tuple[str, str], AccountFailure | None] = field(default_factory=dict)

    @classmethod
    def of(cls, members: MemberAccess, now: datetime) -> DigestAccounts:
        """The weekly digest's function: the accounts' names from the directory (a failed listing keeps the last,
        or none: then ids), and each member account's CloudWatch through its read role (`members` made for the
        "digest" purpose: aws/accounts.py MemberSessions assumes the read role, never the member role)."""
        tried: dict[tuple[str, str], AccountFailure | None] = {}
        names = {a.id: a.name for a in members.directory.current().accounts}
        if (hub := members.config.hub_account) in names:  # its machines swept as a member's, where it has no stack
            names[hub] = f"{HUB_ACCOUNT} in {', '.join(members.config.hub_member_regions)}"
        return cls(names, member_metrics(members, now, tried), tried)


def member_metrics(
    members: MemberAccess, now: datetime, tried: dict[tuple[str, str], AccountFailure | None] | None = None
) -> Callable[[str, str], MetricsReader | None]:
    """CloudWatch in a member (account, region) through the role `members.sessions` assumes for its purpose (the
    digest's: the read role; credentials reused while valid); None where that role cannot be assumed (said in
    the log with its reason). Each attempt lands in `tried`."""

    def metrics_in(account: str, region: str) -> MetricsReader | None:
        held = members.sessions.credentials(account, region, started=now)
        if tried is not None:
            tried[(account, region)] = held if isinstance(held, AccountFailure) else None
        if isinstance(held, AccountFailure):
            logger.warning(
                "exempt machines of a member account not read for the digest",
                extra={
                    "account": account,
                    "region": region,
                    "role": members.sessions.role_arn(account, region),
                    "why": held.describe(),
                },
            )
            return None
        return MetricsReader(held.client("cloudwatch"))

    return metrics_in


@dataclass(frozen=True)
class _Due:
    destination: str
    team: str | None
    policy: TeamPolicy
    week: Week


def send_due_digests(
    store: StateStore,
    policies: PolicyStore,
    sender: DigestSender | None,
    now: datetime,
    *,
    render: Callable[[Digest, dict[str, str]], bytes] | None = None,
    prices: Mapping[str, float] = DEFAULT_PRICES,
    metrics: MetricsReader | None = None,
    accounts: Callable[[], DigestAccounts] | None = None,
) -> list[DigestOutcome]:
    """Send every digest due at `now` that nobody sent yet. Teams with a policy parameter are due at their own
    digest time; the admins, and teams on the default policy, at the default policy's. A digest that cannot be
    posted releases its claim, so the next hourly call tries again."""
    settings, _ = policies.load_settings()
    refs = policies.load_teams(settings)
    due = [_Due(ADMINS, None, settings.default_policy, w)] if (w := digest_due(settings.default_policy, now)) else []
    for team in sorted(refs):
        policy = refs[team].policy or settings.default_policy  # a team in safe mode still hears how it went
        if week := digest_due(policy, now):
            due.append(_Due(team, team, policy, week))
    return _send(store, sender, settings, refs, due, now, render, prices, metrics, accounts)


def send_week_digests(
    store: StateStore,
    policies: PolicyStore,
    sender: DigestSender | None,
    week: Week,
    now: datetime,
    *,
    render: Callable[[Digest, dict[str, str]], bytes] | None = None,
    prices: Mapping[str, float] = DEFAULT_PRICES,
    metrics: MetricsReader | None = None,
    accounts: Callable[[], DigestAccounts] | None = None,
) -> list[DigestOutcome]:
    """Every destination's digest of `week` as of `now`, whatever the digest time (the demo's simulated day),
    claimed once like the hourly ones."""
    settings, _ = policies.load_settings()
    refs = policies.load_teams(settings)
    due = [_Due(ADMINS, None, settings.default_policy, week)]
    due += [_Due(team, team, refs[team].policy or settings.default_policy, week) for team in sorted(refs)]
    return _send(store, sender, settings, refs, due, now, render, prices, metrics, accounts)


def _send(
    store: StateStore,
    sender: DigestSender | None,
    settings: Settings,
    refs: Mapping[str, TeamPolicyRef],
    due: list[_Due],
    now: datetime,
    render: Callable[[Digest, dict[str, str]], bytes] | None,
    prices: Mapping[str, float],
    metrics: MetricsReader | None = None,
    accounts: Callable[[], DigestAccounts] | None = None,
) -> list[DigestOutcome]:
    claimed = [d for d in due if store.claim_once(claim_key(d.destination, d.week), now)]
    if not claimed:
        return []
    start = min(d.week.previous(TREND_WEEKS - 1).span(d.policy.timezone)[0] for d in claimed) - RECOVERY_HORIZON
    try:
        records, audits = store.records_and_audit(start, now)
    except Exception:
        _release(store, claimed)
        raise
    entries = [(a.instance_id, a.at, a.entry) for a in audits]
    if any(d.destination == ADMINS for d in claimed):
        # Teams without a parameter of their own follow the default policy: due with the admins.
        admins_week = next(d.week for d in claimed if d.destination == ADMINS)
        seen = {r.team for r in records} | {str(e.get("team") or "") for _, _, e in entries}
        for team in sorted(seen - set(refs) - {"", ADMINS}):
            if store.claim_once(claim_key(team, admins_week), now):
                policy = policy_for(team, refs, settings).policy or settings.default_policy
                claimed.append(_Due(team, team, policy, admins_week))
    names = {r.key: r.name or r.instance_id for r in records}  # audit entries name machines by key
    weeks = [d.week.span(d.policy.timezone) for d in claimed]
    known = accounts() if accounts is not None else DigestAccounts()  # only once a digest is claimed
    exempt = _read_exempt(metrics, known, records, settings, min(lo for lo, _ in weeks), now)
    _remember_reads(store, known.tried, now)
    return [
        _send_one(store, sender, d, entries, records, names, settings, now, render, prices, exempt, refs, known)
        for d in claimed
    ]


def _read_exempt(
    metrics: MetricsReader | None,
    accounts: DigestAccounts,
    records: list[MachineRecord],
    settings: Settings,
    start: datetime,
    now: datetime,
) -> dict[str, Signals]:
    """The week's CPU (and GPU) of the machines exempt now, by machine key: the sweep never reads them, so
    whether they sat idle is read here, once a week, for the digest only. The hub's machines with `metrics`, a
    member account's in that account and region (`accounts.metrics_in`), never one with another's. A read that
    fails, or an account that cannot be reached, leaves them "no data"."""
    where: dict[tuple[str | None, str | None], list[MachineRecord]] = defaultdict(list)
    for r in records:
        if r.state is State.EXEMPT and running_now(r, now) and section_of(r.key) == MACHINES:  # CPU and GPU
            where[(r.account, r.region)].append(r)
    signals: dict[str, Signals] = {}
    families = settings.gpu_instance_families
    for (account, region), exempt in sorted(where.items(), key=lambda w: (w[0][0] or "", w[0][1] or "")):
        reader = metrics
        if account is not None or region is not None:
            try:
                reader = accounts.metrics_in(account or "", region or "")
            except Exception as exc:  # contained: that account's exempt machines are "no data"
                logger.warning("member account not reached for the digest", extra={"error": type(exc).__name__})
                reader = None
        if reader is None:
            continue
        for gpu in (True, False):
            chosen = [r for r in exempt if has_no_gpu(r.instance_type or "", families) != gpu]
            if not chosen:
                continue
            try:
                read = reader.fetch(
                    [r.instance_id for r in chosen], settings.metrics, start=start, end=now, human=False, gpu=gpu
                )
            except Exception as exc:  # the digest goes out without these figures, and says "no data"
                logger.warning("exempt machines not read for the digest", extra={"error": type(exc).__name__})
                continue
            signals.update({r.key: read[r.instance_id] for r in chosen if r.instance_id in read})
    return signals


def _remember_reads(store: StateStore, tried: Mapping[tuple[str, str], AccountFailure | None], now: datetime) -> None:
    """What the digest could read in member accounts, for `idle-reaper doctor` (a read role missing in an account
    shows there); never keeps the digest from going out."""
    if not tried:
        return
    failures = tuple(f for _, f in sorted(tried.items()) if f is not None)
    accounts = tuple(sorted({account for account, _ in tried}))
    check = MemberCheck(now, len(accounts), len(tried) - len(failures), failures, checked=accounts)
    try:
        save_member_check(store, check, now, key=DIGEST_READS_KEY)
    except Exception as exc:  # the doctor then sees last week's, or none
        logger.warning("the digest's member reads not kept for the doctor", extra={"error": type(exc).__name__})


def _send_one(
    store: StateStore,
    sender: DigestSender | None,
    due: _Due,
    entries: list[tuple[str, datetime, Mapping[str, object]]],
    records: list[MachineRecord],
    names: dict[str, str],
    settings: Settings,
    now: datetime,
    render: Callable[[Digest, dict[str, str]], bytes] | None,
    prices: Mapping[str, float],
    exempt: Mapping[str, Signals],
    refs: Mapping[str, TeamPolicyRef],
    accounts: DigestAccounts,
) -> DigestOutcome:
    lo, hi = due.week.span(due.policy.timezone)
    families = settings.gpu_instance_families
    exempt_idle = {
        r.key: idle_hours(
            exempt[r.key],
            policy_for(r.team, refs, settings).policy or settings.default_policy,
            lo,
            min(hi, now),
            gpu=is_gpu_type(r.instance_type or "", families),
        )
        for r in records
        if r.key in exempt
    }
    digest = build_digest(
        entries,
        records,
        due.week,
        now=now,
        team=due.team,
        zone=due.policy.timezone,
        policy=due.policy,
        prices=prices,
        exempt_idle=exempt_idle,
        account_names=accounts.names,
    )
    channel = due.policy.slack_channel if due.team else None
    redirected = due.team is not None and channel is None
    channel = channel or settings.admin_channel
    label = due.week.label
    if channel is None or sender is None:
        why = "no channel: set the team's slack_channel or settings.admin_channel" if channel is None else "no Slack"
        logger.warning("weekly digest not sent", extra={"destination": due.destination, "week": label, "why": why})
        if sender is None:
            _release(store, [due])  # sent once Slack is configured
        return DigestOutcome(due.destination, label, channel, error=why)
    png = None
    try:
        png = (render or _render)(digest, names)
    except Exception as exc:  # a chart that cannot be drawn never keeps the figures from being sent
        logger.warning("digest chart failed", extra={"destination": due.destination, "error": type(exc).__name__})
    text = digest_text(digest, redirected=redirected)
    filename = f"idle-reaper-{due.destination}-{label}.png"
    try:
        posted = sender.send(channel, text, png, filename, MISSING_CHART)
    except DigestUndelivered as exc:
        logger.warning("weekly digest undelivered", extra={"destination": due.destination, "error": str(exc)})
        _release(store, [due])
        return DigestOutcome(due.destination, label, channel, redirected=redirected, error=str(exc))
    logger.info("weekly digest sent", extra={"destination": due.destination, "week": label, "chart": posted.with_chart})
    return DigestOutcome(due.destination, label, channel, posted.with_chart, redirected, posted.chart_error)


def _render(digest: Digest, names: dict[str, str]) -> bytes:
    from idle_reaper.slack.chart import render_chart  # Pillow: only here

    return render_chart(digest, names)


def _release(store: StateStore, dues: list[_Due]) -> None:
    for d in dues:
        with contextlib.suppress(Exception):
            store.release_claim(claim_key(d.destination, d.week))
