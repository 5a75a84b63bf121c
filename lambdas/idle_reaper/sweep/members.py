"""Organization mode: each sweep makes sure the hub can work in every member account and region, and says so
when it cannot (issue 30); and sweeps each (account, region) in place through the member role's credentials,
as a machine of its own identity (records.machine_key), leaving excluded accounts untouched."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from idle_reaper.aws.accounts import (
    AccountFailure,
    LazyClient,
    MemberAccess,
    MemberAccount,
    MemberCheck,
    MemberCredentials,
    MemberSweep,
    Reason,
    UnitFailure,
    save_member_check,
)
from idle_reaper.aws.clients import run_concurrently
from idle_reaper.aws.endpoints import sagemaker_fleet
from idle_reaper.aws.metrics import MetricsReader
from idle_reaper.aws.policies import PolicyStore, StoredParameter
from idle_reaper.core.reports import machine_part
from idle_reaper.notify import logger as logger  # re-exported: handlers log through it
from idle_reaper.organization import (
    AccountId,
    OrganizationSettings,
    RegionName,
)
from idle_reaper.policy import PolicyError, Settings, TeamPolicy
from idle_reaper.sweep.adapters import Adapters, SweepCannotRun, SweepReport, alert_once
from idle_reaper.sweep.regions import report_member_unwatched
from idle_reaper.sweep.run import run_sweep


def account_alert_key(account: str, now: datetime) -> str:
    """The one claim per member account and day under which the admins hear of it, whichever path finds it first
    (the check's refused credentials, or a unit's failed sweep): at most once a day per account, as promised."""
    return f"member-account#{account}#{now:%Y-%m-%d}"


def check_member_accounts(adapters: Adapters, members: MemberAccess, now: datetime) -> list[str]:
    """List the enrolled accounts (cached an hour), hold credentials in each (account, region) (reused while
    valid), keep what failed for `status`, and tell the admins at most once a day per account that cannot be
    reached, with the reason. Returns the lines for the sweep's log. A side job: one account's failure never
    stops the others, and nothing here ever takes the sweep down."""
    try:
        listing = members.directory.current()
        pairs = [(a.id, r) for a, r in members.config.units(listing.accounts)]
        held = members.sessions.all_credentials(pairs, started=now)
        failures = [f for f in held.values() if isinstance(f, AccountFailure)]
        check = MemberCheck(
            checked_at=now,
            accounts=len(listing.accounts),
            units=len(pairs) - len(failures),
            failures=(*failures, *listing.skipped),
            listing_error=listing.error,
            listed_at=listing.listed_at,
            checked=tuple(a.id for a in listing.accounts),
        )
        settings, _ = adapters.policies.load_settings()
    except Exception as exc:  # contained: the sweep goes on, the next one checks again
        logger.warning("member accounts not checked", extra={"error": str(exc)})
        return [f"could not check the member accounts: {exc}; the next sweep tries again"]
    names = {a.id: a.name for a in listing.accounts}
    lines = [f"member accounts: {check.accounts} accounts, credentials in {check.units} of {len(pairs)} regions"]
    try:  # for `status` and the doctor; the admins are told below whether or not it could be kept
        kept = save_member_check(adapters.store, check, now)
        if kept.failures_more:
            lines.append(f"{kept.failures_more} failures not kept for `status` (its item's room): see the lines below")
    except Exception as exc:
        logger.warning("the member accounts' check could not be kept for status", extra={"error": str(exc)})
        lines.append(f"the member accounts' check could not be kept for `status` ({exc})")
    if listing.error:
        lines.append(f"the member accounts could not be listed ({listing.error}); using the last listing")
        alert_once(
            adapters,
            f"member-listing#{now:%Y-%m-%d}",
            f"idle-reaper could not list the organization's member accounts ({listing.error}); it works with the "
            "last listing it has. Check the hub's access to AWS Organizations.",
            settings,
            now,
        )
    by_account: dict[str, list[AccountFailure]] = defaultdict(list)
    for failure in failures:
        by_account[failure.account].append(failure)
    for account, found in sorted(by_account.items()):
        text = "; ".join(f.describe() for f in found)
        lines.append(text)
        reasons = sorted({f.reason.value for f in found})
        alert_once(
            adapters,
            account_alert_key(account, now),
            f"idle-reaper cannot work in member account {account} {names.get(account, '')!r} "
            f"({', '.join(reasons)}): {text}. Its machines are not looked at until this is fixed; the other "
            "accounts are not affected.",
            settings,
            now,
        )
    # Accounts listed as suspended are shown in `status`, not alerted: closing an account is a choice.
    lines += [f"account {s.account} left out: {s.detail}" for s in listing.skipped if s.reason is Reason.SUSPENDED]
    return lines


# ---------------------------------------------------------------------------------------------
# Sweeping the member accounts: each (account, region) a unit, through the member role's credentials

# Units swept at once: a slow or throttled account holds one worker, not the others. A unit waits on the network
# most of its time (a chain of SSM, listing, metric read and state table calls, ~1 s however few its machines):
# benchmarks/organization_sweep.py measured a member shard of 40 units of 50 machines at ~33 s with 4 at once and
# ~23 s with 8, where the CPU of the units' requests starts to bind; units of a machine or two gain up to 16.
MEMBER_SWEEP_WORKERS = 16
UNIT_RESERVE_SECONDS = 45.0  # no unit is started with less left in the invocation: the next sweep takes it


@dataclass(frozen=True)
class UnitOutcome:
    """What one (account, region) of the member sweep came to."""

    account: str
    region: str
    report: SweepReport | None = None  # None: not swept (excluded, no credentials, or it failed)
    excluded_machines: int | None = None  # an excluded account: its opted-in machines, counted, never touched
    error: str | None = None
    reached: bool = True  # False: no credentials there (check_member_accounts tells the admins of those)
    deferred: bool = False  # not started: the invocation ran short of time; the next sweep takes it
    name: str = ""  # the account's name in the organization
    part: tuple[int, int] | None = None  # (i, K): part i of the account-region's K (a large one, split)

    def describe(self) -> str:
        where = f"account {self.account} in {self.region}"
        if self.part is not None:
            where += f" (part {self.part[0] + 1} of {self.part[1]})"
        if self.error:
            return f"{where} not swept: {self.error}"
        if self.excluded_machines is not None:
            return f"{where} excluded: {self.excluded_machines} opted-in machine(s) counted, none touched"
        assert self.report is not None
        return f"{where}: {len(self.report.decisions)} machine(s) swept"


def load_organization_settings(adapters: Adapters) -> OrganizationSettings:
    """`{prefix}/organization` (absent: nothing excluded, no other defaults). Raises PolicyError naming the
    parameter and the field when it is invalid."""
    return adapters.policies.load_organization()


class ReadOnce(PolicyStore):
    """The hub's settings and team parameters as the member units of one invocation share them: read once, not
    once a unit. Per unit, 4,000 units a sweep would make 8,000 SSM calls or more (one more per 10 teams), past
    SSM's default 40 a second, and each unit would pay their latency and botocore's CPU. A failed read is not
    kept: the next unit reads again. Every unit of the invocation so also sees one version of the settings."""

    def __init__(self, hub: PolicyStore) -> None:
        super().__init__(hub.ssm, hub.prefix)
        self._hub = hub
        self._lock = threading.Lock()
        self._settings: tuple[Settings, int | None] | None = None
        self._teams: list[StoredParameter] | None = None

    def load_settings(self) -> tuple[Settings, int | None]:
        with self._lock:
            if self._settings is None:
                self._settings = self._hub.load_settings()
            return self._settings

    def stored_teams(self) -> list[StoredParameter]:
        with self._lock:
            if self._teams is None:
                self._teams = self._hub.stored_teams()
            return self._teams


class _AccountPolicies(PolicyStore):
    """The hub's policies as one member account gets them: the team policies as they are, and the account's
    own default policy (OrganizationSettings.default_for) for teams without one."""

    def __init__(self, hub: PolicyStore, default: TeamPolicy | None) -> None:
        super().__init__(hub.ssm, hub.prefix)
        self._hub = hub
        self.default = default

    def load_settings(self) -> tuple[Settings, int | None]:
        settings, version = self._hub.load_settings()
        if self.default is None:
            return settings, version
        return settings.model_copy(update={"default_policy": self.default}), version

    def stored_teams(self) -> list[StoredParameter]:
        return self._hub.stored_teams()


def member_adapters(hub: Adapters, credentials: MemberCredentials, default: TeamPolicy | None) -> Adapters:
    """The hub's adapters for one member (account, region): EC2, Auto Scaling, SageMaker and CloudWatch
    through the member role's credentials there, each client made when first used; policies, the state table
    and Slack are the hub's."""
    return replace(
        hub,
        policies=_AccountPolicies(hub.policies, default),
        fleet=sagemaker_fleet(
            LazyClient(lambda: credentials.client("ec2")),
            LazyClient(lambda: credentials.client("autoscaling")),
            LazyClient(lambda: credentials.client("sagemaker")),
            LazyClient(lambda: credentials.client("application-autoscaling")),
        ),
        metrics=MetricsReader(LazyClient(lambda: credentials.client("cloudwatch"))),
        studio=None,  # the daily Studio note is the hub's
    )


def sweep_member_accounts(
    adapters: Adapters,
    members: MemberAccess,
    now: datetime,
    *,
    dry_run: bool = False,
    time_left: Callable[[], float] | None = None,
    workers: int = MEMBER_SWEEP_WORKERS,
    make_adapters: Callable[[Adapters, MemberCredentials, TeamPolicy | None], Adapters] = member_adapters,
    units: Sequence[tuple[MemberAccount, str]] | None = None,
    message_scope: str | None = None,
    regions_ec2: Callable[[MemberCredentials], Callable[[str], Any]] | None = None,
    part: tuple[int, int] | None = None,
) -> list[UnitOutcome]:
    """Sweep every enrolled (account, region) in place, or only `units` (a member shard's manifest), each
    through its own credentials (reused while valid, aws/accounts.py). An account or OU that
    `{prefix}/organization` excludes is never acted on: its opted-in machines are only counted. One unit's
    failure (no credentials, AccessDenied, throttling, an error in its sweep) is its outcome and never stops
    the others; the reasons are reported by check_member_accounts.
    Invalid organization settings sweep no member account (less, never more) and are said once a day.
    `message_scope`: the sweep's id, shared with its other shards and the hub's own machines, so that an owner
    gets one message across every account and region (sweep/owner_messages.py); new when not given.
    After the units, with time to spare and not in a dry run: the daily count of each account swept in the first
    organization region, in its regions outside the organization's (sweep/regions.py report_member_unwatched),
    through `regions_ec2` (an EC2 client per region with the unit's credentials; member_ec2 with the real
    adapters, and off unless given with others: fakes bring their own).
    `part` (i, K): `units` is one account-region too large for one worker, and this is part i of its K
    (run_sweep's keep_part says which machines); the daily count is part 0's alone."""
    message_scope = message_scope or uuid.uuid4().hex
    adapters = replace(adapters, policies=ReadOnce(adapters.policies))  # shared by every unit swept here
    try:
        base, _ = adapters.policies.load_settings()
        org = load_organization_settings(adapters)
    except PolicyError as exc:
        if "organization" in str(exc):
            with contextlib.suppress(Exception):
                alert_once(
                    adapters,
                    f"organization-settings#{now:%Y-%m-%d}",
                    f"idle-reaper sweeps no member account while its organization settings are invalid: {exc}",
                    adapters.policies.load_settings()[0],
                    now,
                )
        return _none_swept(units, f"settings invalid, no member account swept: {exc}", part)
    except Exception as exc:  # contained: the hub's own sweep is done; the next sweep tries again
        return _none_swept(units, f"no member account swept: {type(exc).__name__}: {exc}"[:300], part)
    if units is None:
        listing = members.directory.current()
        units = members.config.units(listing.accounts)

    def sweep_unit(unit: tuple[MemberAccount, str]) -> UnitOutcome:
        account, region = unit
        if time_left is not None and time_left() < UNIT_RESERVE_SECONDS:
            return UnitOutcome(
                account.id, region, error="not reached in this invocation's time", reached=False, deferred=True
            )
        held = members.sessions.credentials(account.id, region, started=now)
        if isinstance(held, AccountFailure):
            return UnitOutcome(account.id, region, error=held.describe(), reached=False)
        default = org.default_for(account.id, account.parents, base.default_policy)
        unit_adapters = make_adapters(adapters, held, default if default is not base.default_policy else None)
        if part is not None:  # its K parts share the account-region's GetMetricData and EC2 Describe* quotas
            metrics, fleet = unit_adapters.metrics.shared_by(part[1]), unit_adapters.fleet.shared_by(part[1])
            unit_adapters = replace(unit_adapters, metrics=metrics, fleet=fleet)
        try:
            if org.excludes(account.id, account.parents):
                found = unit_adapters.fleet.discover(
                    base.tags,
                    notebooks=base.sagemaker_notebooks,
                    endpoints=base.sagemaker_endpoints,
                    studio=base.sagemaker_notebooks,
                )
                if part is not None:  # each part counts its own
                    found = [m for m in found if machine_part(m, part[1]) == part[0]]
                return UnitOutcome(account.id, region, excluded_machines=len(found))
            report = run_sweep(
                unit_adapters,
                now=now,
                dry_run=dry_run,
                member=(account.id, region),
                time_left=time_left,
                message_scope=message_scope,
                part=part,
                send_notices=False,  # the hub's pass sends them (the sweep's own, or its gather step's)
                quiet_summaries=part is None or part[0] == 0,  # one invocation tells an account-region's
            )
        except Exception as exc:  # contained: one account's fault never reaches the others
            gone = members.sessions.refused(exc, account.id, region)  # suspended or left since it was listed?
            if gone is not None:
                return UnitOutcome(account.id, region, error=gone.describe())
            return UnitOutcome(account.id, region, error=f"{type(exc).__name__}: {exc}"[:300])
        return UnitOutcome(account.id, region, report=report)

    names = {a.id: a.name for a, _ in units}
    outcomes = [
        replace(o, name=names.get(o.account, ""), part=part) for o in run_concurrently(sweep_unit, units, workers)
    ]
    for o in outcomes:
        if o.error and o.reached:  # reached, but its sweep failed: the admins hear once a day per account
            with contextlib.suppress(Exception):
                alert_once(
                    adapters,
                    account_alert_key(o.account, now),
                    f"idle-reaper could not sweep member account {o.account} {names.get(o.account, '')!r} in "
                    f"{o.region}: {o.error}. Its machines there are not looked at (none stopped, no owner told) until "
                    "this is fixed; the other accounts are not affected.",
                    base,
                    now,
                )
    if regions_ec2 is None and make_adapters is member_adapters:
        regions_ec2 = member_ec2
    if regions_ec2 is not None and not dry_run and (part is None or part[0] == 0):
        count_member_regions(members, units, outcomes, now, adapters, regions_ec2, time_left)
    return outcomes


def member_ec2(credentials: MemberCredentials) -> Callable[[str], Any]:
    """EC2 clients in any region with one member unit's credentials (the member role may list instances
    everywhere for the daily count, infra/organization.py)."""
    return lambda region: credentials.client("ec2", region)


def count_member_regions(
    members: MemberAccess,
    units: Sequence[tuple[MemberAccount, str]],
    outcomes: Sequence[UnitOutcome],
    now: datetime,
    adapters: Adapters,
    regions_ec2: Callable[[MemberCredentials], Callable[[str], Any]],
    time_left: Callable[[], float] | None,
) -> None:
    """The accounts swept in the first organization region (not excluded, reached) are counted in their other
    regions, once a day each, through the credentials that unit holds. Never raises: the units are swept.
    The hub's own account, a member where it has no stack, is counted by the hub's daily count (sweep/regions.py
    report_unwatched_regions), which knows its regions."""
    try:
        first, hub = members.config.regions[0], members.config.hub_account
        accounts = [
            a for (a, r), o in zip(units, outcomes, strict=True) if r == first and o.report is not None and a.id != hub
        ]

        def ec2_of(account: str) -> Callable[[str], Any]:
            held = members.sessions.credentials(account, first, started=now)
            if isinstance(held, AccountFailure):
                raise RuntimeError(held.describe())
            return regions_ec2(held)

        for line in report_member_unwatched(
            adapters, accounts, ec2_of, members.config.regions, now, time_left=time_left
        ):
            logger.warning(line)
    except Exception as exc:  # contained, as every side job
        logger.warning("member accounts' regions not counted", extra={"error": str(exc)})


def _none_swept(
    units: Sequence[tuple[MemberAccount, str]] | None, why: str, part: tuple[int, int] | None = None
) -> list[UnitOutcome]:
    """Nothing swept: each of a shard's units (of a part: as that part) says why; the in-place sweep of every
    unit says it once."""
    if units is None:
        return [UnitOutcome("-", "-", error=why)]
    return [UnitOutcome(a.id, r, error=why, name=a.name, part=part) for a, r in units]


# ---------------------------------------------------------------------------------------------
# Member units as fan-out units: the planner writes manifests of (account, region) units beside the machine
# shards; a shard worker sweeps its manifest's units; the gather step sums them and keeps their outcomes.

# Units per member shard, at most. A unit of the size (50 machines) takes ~1-3 s of modelled wall
# (AssumeRole, its clients, one listing, one or two metric reads, the state table) and ~0.3 s of CPU
# (benchmarks/organization_sweep.py), so 64 units, 16 at once (MEMBER_SWEEP_WORKERS), take ~30 s: an eighth of
# the worker's timeout, and a manifest of a few KB. A unit far larger (an account-region with thousands of
# machines) is what UNIT_RESERVE_SECONDS is for: the units not started in time are left to the next sweep, counted.
MEMBER_UNITS_PER_SHARD = 64
MEMBER_MANIFEST = "members"  # the key of a member shard's manifest (a machine shard's is a list of ids)
# Parts of one account-region at most (a large one is swept by several workers, each a part: keep_part in
# sweep/run.py): the Map's lanes (fanout.SHARDS_AT_ONCE), so its parts run side by side.
MAX_UNIT_PARTS = 30


def member_groups(
    accounts: Sequence[MemberAccount],
    regions_of: Callable[[str], Sequence[str]],
    per_group: int = MEMBER_UNITS_PER_SHARD,
) -> list[list[tuple[MemberAccount, str]]]:
    """The (account, region) units in groups of at most `per_group`: accounts by id (so the groups are the
    same from one sweep to the next while the organization is), an account's regions (`regions_of` its id:
    OrganizationConfig.regions_of) always in one group (an account with more regions than `per_group` has a
    group of its own; one with none has no unit)."""
    if per_group < 1:
        raise ValueError("per_group must be at least 1")
    groups: list[list[tuple[MemberAccount, str]]] = []
    current: list[tuple[MemberAccount, str]] = []
    for account in sorted(accounts, key=lambda a: a.id):
        units = [(account, r) for r in sorted(set(regions_of(account.id)))]
        if not units:
            continue
        if current and len(current) + len(units) > per_group:
            groups.append(current)
            current = []
        current.extend(units)
    if current:
        groups.append(current)
    return groups


class _ManifestAccount(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: AccountId
    name: str = Field(default="", max_length=200)
    parents: list[str] = Field(default_factory=list, max_length=20)
    regions: list[RegionName] = Field(min_length=1, max_length=40)
    # A large account-region swept in parts: this manifest's is part `part` of `parts` (both, or neither).
    part: int | None = Field(default=None, ge=0, lt=MAX_UNIT_PARTS)
    parts: int | None = Field(default=None, ge=2, le=MAX_UNIT_PARTS)

    @model_validator(mode="after")
    def _a_part_of_one_region(self) -> _ManifestAccount:
        if (self.part is None) != (self.parts is None):
            raise ValueError("part and parts are given together")
        if self.part is not None and self.parts is not None:
            if self.part >= self.parts:
                raise ValueError(f"part {self.part} is not one of {self.parts} parts (0 to {self.parts - 1})")
            if len(self.regions) != 1:
                raise ValueError("a part is of one account-region: one region")
        return self


class MemberManifest(BaseModel):
    """A member shard's manifest: its accounts (with the name and OUs the planner listed, so a worker needs
    no listing of its own) and, for each, the regions to sweep; or one part of one large account-region."""

    model_config = ConfigDict(extra="forbid")
    members: list[_ManifestAccount] = Field(min_length=1, max_length=1000)

    @model_validator(mode="after")
    def _a_part_alone(self) -> MemberManifest:
        if len(self.members) > 1 and any(m.parts is not None for m in self.members):
            raise ValueError("a part of an account-region is a manifest of its own")
        return self

    @classmethod
    def of(cls, units: Sequence[tuple[MemberAccount, str]], part: tuple[int, int] | None = None) -> MemberManifest:
        regions: dict[str, list[str]] = defaultdict(list)
        accounts: dict[str, MemberAccount] = {}
        for account, region in units:
            accounts.setdefault(account.id, account)
            regions[account.id].append(region)
        index, parts = part or (None, None)
        return cls(
            members=[
                _ManifestAccount(
                    id=a.id, name=a.name, parents=list(a.parents), regions=regions[a.id], part=index, parts=parts
                )
                for a in accounts.values()
            ]
        )

    def units(self) -> list[tuple[MemberAccount, str]]:
        return [(MemberAccount(m.id, m.name, tuple(m.parents)), r) for m in self.members for r in m.regions]

    @property
    def part(self) -> tuple[int, int] | None:
        """(i, K): the manifest is part i of its one account-region's K; None: whole units."""
        first = self.members[0]
        return (first.part, first.parts) if first.part is not None and first.parts is not None else None


def member_manifests(
    groups: Sequence[Sequence[tuple[MemberAccount, str]]], parts: Mapping[tuple[str, str], int]
) -> list[MemberManifest]:
    """The member shards' manifests: each group (member_groups) one, but an account-region `parts` splits in K
    (K >= 2) leaves its group for K manifests of its own, one a part, so that its parts run on K workers."""
    manifests = []
    for group in groups:
        if whole := [u for u in group if parts.get((u[0].id, u[1]), 1) < 2]:
            manifests.append(MemberManifest.of(whole))
        for unit in group:
            if (k := parts.get((unit[0].id, unit[1]), 1)) >= 2:
                manifests += [MemberManifest.of([unit], part=(i, k)) for i in range(k)]
    return manifests


def parse_member_manifest(value: object, where: str) -> MemberManifest:
    """A member manifest as stored (its JSON parsed); a malformed one raises SweepCannotRun naming `where`."""
    try:
        return MemberManifest.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors()[:5])
        raise SweepCannotRun(f"{where} is not a valid member manifest ({problems}); nothing was changed") from None


class UnitResult(BaseModel):
    """One (account, region) unit's outcome as a shard records it for the gather step and `status`."""

    account: str
    region: str
    name: str = ""
    swept: int | None = None  # machines swept (None: not swept)
    excluded_machines: int | None = None  # an excluded account: opted-in machines counted, none touched
    error: str | None = None
    deferred: bool = False  # not started in time: the next sweep takes it
    part: int | None = None  # a large account-region's part (0 .. parts-1) this is the outcome of
    parts: int | None = None

    @classmethod
    def of(cls, outcome: UnitOutcome) -> UnitResult:
        part, parts = outcome.part or (None, None)
        return cls(
            account=outcome.account,
            region=outcome.region,
            name=outcome.name,
            swept=len(outcome.report.decisions) if outcome.report is not None else None,
            excluded_machines=outcome.excluded_machines,
            error=outcome.error,
            deferred=outcome.deferred,
            part=part,
            parts=parts,
        )


def whole_units(results: Sequence[UnitResult]) -> list[UnitResult]:
    """Each (account, region) once: the parts of a split one as one outcome. Its machines are the parts'
    sum; it failed if a part failed (which, and why), else it is left to the next sweep if a part was
    (its `swept` then counts the parts that were). A part's deferral is never the account's failure."""
    by_unit: dict[tuple[str, str], list[UnitResult]] = defaultdict(list)
    for r in results:
        by_unit[(r.account, r.region)].append(r)
    whole = []
    for found in by_unit.values():
        if len(found) == 1 and found[0].parts is None:
            whole.append(found[0])
            continue
        found.sort(key=lambda r: r.part or 0)
        parts = max((r.parts or 1) for r in found)
        failed = [r for r in found if r.error and not r.deferred]
        swept = [r.swept for r in found if r.swept is not None]
        excluded = [r.excluded_machines for r in found if r.excluded_machines is not None]
        error = "; ".join(f"part {(r.part or 0) + 1} of {parts}: {r.error}" for r in failed) or None
        late = [r for r in found if r.deferred]
        if error is None and late:
            error = f"part(s) {', '.join(str((r.part or 0) + 1) for r in late)} of {parts} not reached in time"
        whole.append(
            found[0].model_copy(
                update={
                    "swept": sum(swept) if swept else None,
                    "excluded_machines": sum(excluded) if excluded else None,
                    "error": error,
                    "deferred": not failed and bool(late),
                    "part": None,
                }
            )
        )
    return whole


MEMBER_FAILURES_KEPT = 200  # failed units kept in the summary item (the rest counted): it stays far under 400 KB


def member_sweep(results: Sequence[UnitResult], now: datetime) -> MemberSweep:
    """One sweep's member units as `status` shows them: how many were swept, the excluded accounts with their
    opted-in machines (never touched), and the units that failed and why (those not reached in time apart)."""
    excluded: dict[str, int] = defaultdict(int)
    names: dict[str, str] = {}
    failed: list[UnitFailure] = []
    results = whole_units(results)
    for r in sorted(results, key=lambda r: (r.account, r.region)):
        names.setdefault(r.account, r.name)
        if r.excluded_machines is not None:
            excluded[r.account] += r.excluded_machines
        elif r.error and not r.deferred:
            failed.append(UnitFailure(r.account, r.region, r.name, r.error[:300]))
    return MemberSweep(
        swept_at=now,
        units=len(results),
        swept=sum(r.swept is not None and not r.error for r in results),
        machines=sum(r.swept or 0 for r in results),
        excluded=tuple((a, names[a], n) for a, n in sorted(excluded.items())),
        failed=tuple(failed[:MEMBER_FAILURES_KEPT]),
        failed_more=max(0, len(failed) - MEMBER_FAILURES_KEPT),
        deferred=sum(r.deferred for r in results),
        in_parts=sum(r.parts is not None for r in results),
    )


def member_manifest_of(text: str) -> MemberManifest | None:
    """A stored member manifest (None: a machine shard's, or unreadable)."""
    try:
        value = json.loads(text)
        if isinstance(value, dict) and MEMBER_MANIFEST in value:
            return parse_member_manifest(value, "manifest")
    except (ValueError, SweepCannotRun):
        return None
    return None
