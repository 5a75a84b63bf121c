"""Organization mode at run time (issue 30): which member accounts the hub watches, and credentials in each.

Accounts come from AWS Organizations, not from a list kept by hand: every ACTIVE account under the target OUs
(recursively), less the management account (a service-managed StackSet never deploys there). The hub's own
account is swept by the hub's stacks with their own roles in the hub's regions; when it sits in a target OU its
member stack is in every organization region, and it is a member account in those without a hub stack
(OrganizationConfig.regions_of), never in both. Why Organizations and not the StackSet's
ListStackInstances: an account whose member stack failed to deploy (an SCP, a region it has disabled) would
not be listed there and so would go unwatched in silence; from Organizations it is listed, its AssumeRole
fails, and that failure is reported with its reason. Organizations also names each account (the digest
groups by name) and says at once when one is suspended. The listing is cached (`DIRECTORY_TTL`): accounts
join and leave an OU rarely, and Organizations' API allows a few calls a second per organization.

Credentials: AssumeRole of the member role of each (account, region) (one role per region, each region's
member stack owns its own), reused while valid and renewed `REFRESH_MARGIN` before they expire, so a sweep
never works with credentials that run out in its middle. Clients with them come from the default boto3
session (a session per account would load every service model again). Every failure in one account (its role missing or
not trusting the hub, a service control policy, throttling, a suspended account, a disabled region) becomes
an `AccountFailure` with a reason a person can act on; nothing is raised past the account."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from idle_reaper.aws.clients import client, error_code, run_concurrently, wall_clock
from idle_reaper.aws.limits import LOOKUP_VALUE_MAX_BYTES, ORGANIZATIONS_RPS, Pace, Quota, paced_pages
from idle_reaper.aws.state import StateStore
from idle_reaper.organization import AccountId, RegionName, member_role_arn, role_suffix_for

DIRECTORY_TTL = timedelta(hours=1)
# DescribeAccount calls (why an account's role was refused: suspended, or gone) per DIRECTORY_TTL, at most.
STATUS_LOOKUPS = 20
ORGANIZATIONS_QUOTA = Quota(10.0, ORGANIZATIONS_RPS)
CREDENTIAL_SECONDS = 3600  # the most role chaining allows (a Lambda's role assuming another role)
# A sweep or shard runs at most 15 minutes: credentials handed out are good for at least that long.
REFRESH_MARGIN = timedelta(minutes=16)
STS_WORKERS = 16
ORGANIZATION_ENV = "IDLE_REAPER_ORGANIZATION"
THROTTLED = frozenset(
    {"Throttling", "ThrottlingException", "TooManyRequestsException", "RequestLimitExceeded", "SlowDown"}
)

# What a call into a member account answers, with credentials held from before, once the hub may not work there:
# an SCP or a changed role (AccessDenied, UnauthorizedOperation), and an account suspended or closed meanwhile
# (AuthFailure, OptInRequired, Blocked, or its credentials no longer recognized).
REFUSED = frozenset(
    {
        "AccessDenied",
        "AccessDeniedException",
        "UnauthorizedOperation",
        "AuthFailure",
        "OptInRequired",
        "Blocked",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
    }
)


class Reason(StrEnum):
    """Why the hub cannot work in one member account (and region)."""

    # AccessDenied on AssumeRole: no member stack there (also in a region not enabled in the account: its stack
    # instance fails there and leaves no role), or its trust is not ours
    ROLE_MISSING = "role-missing"
    DENIED_BY_SCP = "denied-by-scp"
    THROTTLED = "throttled"
    SUSPENDED = "suspended"  # suspended or closed since it was listed
    LEFT_ORGANIZATION = "left-organization"
    REGION_DISABLED = "region-disabled"
    ERROR = "error"  # anything else: the code and message say what


ADVICE = {
    Reason.ROLE_MISSING: "the member role is missing (the StackSet has no stack instance there yet, or it failed, "
    "as it does in a region not enabled in this account) or does not trust this hub's roles",
    Reason.DENIED_BY_SCP: "a service control policy denies the hub (allow sts:AssumeRole on the member role)",
    Reason.THROTTLED: "AWS throttled the call; the next sweep tries again",
    Reason.SUSPENDED: "the account is suspended or closed",
    Reason.LEFT_ORGANIZATION: "the account has left the organization",
    Reason.REGION_DISABLED: "the region is not enabled in this account",
    Reason.ERROR: "an unexpected error",
}


@dataclass(frozen=True)
class AccountFailure:
    account: str
    region: str | None
    reason: Reason
    detail: str  # the AWS error code and message, cut short

    def describe(self) -> str:
        where = f"account {self.account}" + (f" in {self.region}" if self.region else "")
        return f"{where}: {ADVICE[self.reason]} ({self.detail})"


@dataclass(frozen=True)
class MemberAccount:
    id: str
    name: str
    parents: tuple[str, ...]  # the OUs it sits in, nearest first, up to the target it was found under


@dataclass(frozen=True)
class Directory:
    """One listing: the accounts to sweep, those left out and why, and whether it is fresh."""

    accounts: tuple[MemberAccount, ...]
    skipped: tuple[AccountFailure, ...] = ()
    listed_at: datetime | None = None
    error: str | None = None  # the listing failed; `accounts` are the last good listing's (or none)

    def parents_of(self, account: str) -> tuple[str, ...]:
        """The OUs a listed account sits in, nearest first, as the sweep sees them; () when it is not listed."""
        return next((a.parents for a in self.accounts if a.id == account), ())


def _detail(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        message = str(exc.response.get("Error", {}).get("Message", ""))
        text = f"{error_code(exc)}: {message}" if message else error_code(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:299] + "…"


def _aws_error(exc: Exception) -> Exception:
    """AWS's own error behind `exc` (the sweep reports a failed listing as SweepCannotRun, raised from it)."""
    found: BaseException | None = exc
    while found is not None:
        if isinstance(found, ClientError):
            return found
        found = found.__cause__ or found.__context__
    return exc


def classify(exc: Exception, account: str, region: str | None) -> AccountFailure:
    """What an error from a call into a member account means for that account."""
    code = error_code(exc)
    message = str(exc.response.get("Error", {}).get("Message", "")) if isinstance(exc, ClientError) else str(exc)
    if code in THROTTLED:
        reason = Reason.THROTTLED
    elif code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
        reason = Reason.DENIED_BY_SCP if "service control polic" in message.lower() else Reason.ROLE_MISSING
    elif code in ("RegionDisabledException", "OptInRequired") or (code == "AuthFailure" and region is not None):
        reason = Reason.REGION_DISABLED
    elif code == "AccountNotFoundException":
        reason = Reason.LEFT_ORGANIZATION
    else:
        reason = Reason.ERROR
    return AccountFailure(account, region, reason, _detail(exc))


class AccountDirectory:
    """The enrolled accounts: every ACTIVE account under the target OUs or roots, listed from Organizations
    and cached for `ttl`. A failed listing keeps the last good one (and says so); it never raises."""

    def __init__(
        self,
        organizations: Any,
        targets: Sequence[str],
        *,
        hub_account: str,
        hub_is_member: bool = False,
        ttl: timedelta = DIRECTORY_TTL,
        clock: Callable[[], datetime] = wall_clock,
    ) -> None:
        self.organizations = organizations
        self.targets = tuple(targets)
        self.hub_account = hub_account
        # Listed when found under a target (then it has organization regions without a hub stack to be swept in).
        self.hub_is_member = hub_is_member
        self.ttl = ttl
        self.clock = clock
        self._last: Directory | None = None
        self._lock = threading.Lock()
        self.calls = 0  # Organizations calls made, for tests and benchmarks
        # Organizations' calls, paced (its rate is one for the whole organization: aws/limits.py). Its burst is not
        # counted on: another process (a planner, the CLI, a member check) may just have spent it.
        self.pace = Pace(ORGANIZATIONS_QUOTA, full=False)
        # DescribeAccount's answers by account, kept for `ttl`; and how many were asked since `_asked_since`.
        self._status: dict[str, tuple[Reason | None, datetime]] = {}
        self._asked, self._asked_since = 0, datetime.min.replace(tzinfo=UTC)

    def current(self, *, stale_for: timedelta | None = None) -> Directory:
        """The listing, anew from Organizations once the last is `ttl` old (or failed). `stale_for`: a listing up to
        `ttl + stale_for` old (failed or not) is returned as it is, nothing asked: the sweep's planner does not
        wait for an hourly relisting (17 s at 1,000 accounts, the calls one after another); the member check after
        it (sweep/members.py check_member_accounts) relists."""
        with self._lock:
            now = self.clock()
            last = self._last
            if last is not None and last.listed_at:
                age = now - last.listed_at
                if (last.error is None and age < self.ttl) or (stale_for is not None and age < self.ttl + stale_for):
                    return last
            try:
                listing = self._list(now)
            except (ClientError, BotoCoreError) as exc:
                kept = last.accounts if last else ()
                failed = Directory(kept, last.skipped if last else (), last.listed_at if last else None, _detail(exc))
                self._last = failed
                return failed
            self._last = listing
            return listing

    def status_of(self, account: str) -> Reason | None:
        """Why an account that was listed may no longer be usable (asked only after a call into it failed):
        SUSPENDED, LEFT_ORGANIZATION, or None when it is still an ACTIVE member (or Organizations cannot say).
        Asked once per account per `ttl` (one answer serves all its regions) and STATUS_LOOKUPS times per `ttl` in
        all: a wide outage fails a thousand accounts at once against Organizations' one rate for the organization.
        Past that the failure is told as AWS answered it; the hourly listing still says who was suspended or left."""
        now = self.clock()
        with self._lock:
            known = self._status.get(account)
            if known is not None and now - known[1] < self.ttl:
                return known[0]
            if now - self._asked_since >= self.ttl:
                self._asked, self._asked_since = 0, now
            if self._asked >= STATUS_LOOKUPS:
                return None
            self._asked += 1
            self.calls += 1
        self.pace.take()
        try:
            found = self.organizations.describe_account(AccountId=account)["Account"]
        except ClientError as exc:
            reason = Reason.LEFT_ORGANIZATION if error_code(exc) == "AccountNotFoundException" else None
            if reason is None:
                return None  # throttled or refused: not an answer to keep
        except BotoCoreError:
            return None
        else:
            reason = None if _active(found) else Reason.SUSPENDED
        with self._lock:
            self._status[account] = (reason, now)
        return reason

    def _list(self, now: datetime) -> Directory:
        self.calls += 1
        self.pace.take()
        management = self.organizations.describe_organization()["Organization"]["MasterAccountId"]
        accounts: dict[str, MemberAccount] = {}
        skipped: list[AccountFailure] = []
        # Breadth first from each target: (parent, its OUs nearest first).
        pending: list[tuple[str, tuple[str, ...]]] = [(t, (t,) if t.startswith("ou-") else ()) for t in self.targets]
        seen: set[str] = set()
        while pending:
            parent, parents = pending.pop(0)
            if parent in seen:  # a target inside another target
                continue
            seen.add(parent)
            listed = self._pages(self.organizations.list_accounts_for_parent, "Accounts", ParentId=parent)
            for found in listed:
                if found["Id"] == management or found["Id"] in accounts:
                    continue
                if found["Id"] == self.hub_account and not self.hub_is_member:
                    continue
                if not _active(found):
                    skipped.append(AccountFailure(found["Id"], None, Reason.SUSPENDED, f"Status {found.get('Status')}"))
                    continue
                accounts[found["Id"]] = MemberAccount(found["Id"], str(found.get("Name", "")), parents)
            ous = self._pages(
                self.organizations.list_children, "Children", ParentId=parent, ChildType="ORGANIZATIONAL_UNIT"
            )
            for child in ous:
                pending.append((child["Id"], (child["Id"], *parents)))
        return Directory(tuple(sorted(accounts.values(), key=lambda a: a.id)), tuple(skipped), now)

    def _pages(self, call: Callable[..., Mapping[str, Any]], key: str, **kwargs: Any) -> Iterable[dict[str, Any]]:
        for page in paced_pages(self.pace, call, **kwargs):
            self.calls += 1
            yield from page[key]


def _active(account: dict[str, Any]) -> bool:
    # `State` (2025) replaces `Status`; an account is usable only while ACTIVE in both.
    return bool(account.get("Status", "ACTIVE") == "ACTIVE" and account.get("State", "ACTIVE") == "ACTIVE")


@dataclass(frozen=True)
class MemberCredentials:
    """The member role's credentials in one account and region, and clients made with them."""

    account: str
    region: str
    access_key_id: str
    secret_access_key: str
    session_token: str
    expires: datetime

    def client(self, service: str, region: str | None = None) -> Any:
        """A client in this account and region (or `region`: the credentials are good in every region, as far
        as the role allows; the daily count of the account's other regions), made as `clients.client` makes the
        hub's (retries, endpoint, parser). Each costs about 50 ms of CPU: make the ones a unit needs, once."""
        return client(
            service,
            region or self.region,
            credentials={
                "aws_access_key_id": self.access_key_id,
                "aws_secret_access_key": self.secret_access_key,
                "aws_session_token": self.session_token,
            },
        )


class LazyClient:
    """A client made on its first use: a member unit makes only the clients its sweep calls (each costs 5-50 ms
    of CPU; one account-region with nothing due to read needs no CloudWatch client, one without Auto Scaling
    groups no Auto Scaling client, and notebooks off no SageMaker client)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._made: Any = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if self._made is None:
            with self._lock:
                if self._made is None:
                    self._made = self._make()
        return getattr(self._made, name)


_SESSION_NAME = re.compile(r"[^\w+=,.@-]")


def session_name(prefix: str, purpose: str, started: datetime) -> str:
    """What CloudTrail in the member account shows as the caller: the deploy, the function and the sweep."""
    name = _SESSION_NAME.sub("-", f"{prefix}-{purpose}-{started:%Y%m%dT%H%MZ}")
    return name[:64]


@dataclass
class MemberSessions:
    """Credentials in member accounts, one set per (account, region), reused while they last.

    `purpose` ("sweep", "answer", "digest") chooses the role (organization.ROLE_OF_PURPOSE: the member role
    for the sweep and an answer, the read-only role for the digest; an unknown purpose is refused) and, with the
    sweep's start, names the role session. `status_of` (the directory's) refines an AccessDenied: an account
    suspended or removed since it was listed is reported as such."""

    sts: Any
    prefix: str
    purpose: str
    partition: str = "aws"
    clock: Callable[[], datetime] = wall_clock
    status_of: Callable[[str], Reason | None] | None = None
    _held: dict[tuple[str, str], MemberCredentials] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    assume_calls: int = 0
    role_suffix: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.role_suffix = role_suffix_for(self.purpose)  # ValueError: no role for that purpose

    def role_arn(self, account: str, region: str) -> str:
        """The role this purpose assumes in one member account and region."""
        return member_role_arn(self.partition, account, self.prefix, region, self.role_suffix)

    def credentials(
        self, account: str, region: str, *, started: datetime | None = None
    ) -> MemberCredentials | AccountFailure:
        now = self.clock()
        with self._lock:
            held = self._held.get((account, region))
        if held is not None and held.expires - now > REFRESH_MARGIN:
            return held
        try:
            with self._lock:
                self.assume_calls += 1
            answer = self.sts.assume_role(
                RoleArn=self.role_arn(account, region),
                RoleSessionName=session_name(self.prefix, self.purpose, started or now),
                DurationSeconds=CREDENTIAL_SECONDS,
            )
        except Exception as exc:  # one account's fault never goes past it
            return self._failure(exc, account, region)
        given = answer["Credentials"]
        expires = given["Expiration"]
        if not isinstance(expires, datetime):  # botocore parses it; a fake may hand over text
            expires = datetime.fromisoformat(str(expires))
        fresh = MemberCredentials(
            account, region, given["AccessKeyId"], given["SecretAccessKey"], given["SessionToken"], expires
        )
        with self._lock:
            self._held[(account, region)] = fresh
        return fresh

    def all_credentials(
        self, pairs: Sequence[tuple[str, str]], *, started: datetime | None = None, workers: int = STS_WORKERS
    ) -> dict[tuple[str, str], MemberCredentials | AccountFailure]:
        """Credentials for many (account, region) pairs, AssumeRole calls on a bounded pool."""
        results = run_concurrently(lambda pair: self.credentials(*pair, started=started), pairs, workers)
        return dict(zip(pairs, results, strict=True))

    def forget(self, account: str, region: str) -> None:
        """Drop held credentials (a call with them was refused: the next use assumes the role again)."""
        with self._lock:
            self._held.pop((account, region), None)

    def refused(self, exc: Exception, account: str, region: str) -> AccountFailure | None:
        """A call made with this account's held credentials was refused: they are dropped (the next use assumes
        the role again), and when Organizations says the account was suspended or has left since it was listed,
        that is the failure, instead of AWS's bare refusal for as long as the credentials would have lasted. None:
        not a refusal, or the account is still an active member (the error is then the caller's to report)."""
        aws = _aws_error(exc)
        if error_code(aws) not in REFUSED:
            return None
        self.forget(account, region)
        gone = self.status_of(account) if self.status_of is not None else None
        return AccountFailure(account, region, gone, _detail(aws)) if gone is not None else None

    def _failure(self, exc: Exception, account: str, region: str) -> AccountFailure:
        failure = classify(exc, account, region)
        if failure.reason is Reason.ROLE_MISSING and self.status_of is not None:
            gone = self.status_of(account)
            if gone is not None:
                return AccountFailure(account, region, gone, failure.detail)
        return failure


@dataclass(frozen=True)
class OrganizationConfig:
    """What the hub stack tells its functions (IDLE_REAPER_ORGANIZATION, JSON): the deploy prefix (the
    member role's name), the target OUs or roots, the member regions, the hub's account and partition, and the
    hub's own regions (its stacks'; () from a hub deployed before they were told)."""

    prefix: str
    targets: tuple[str, ...]
    regions: tuple[str, ...]
    hub_account: str
    partition: str = "aws"
    hub_regions: tuple[str, ...] = ()

    @property
    def hub_member_regions(self) -> tuple[str, ...]:
        """The organization regions where the hub's own account, when it sits in a target OU, is swept as a member
        account: its member stack is there and no hub stack is. () when the hub's regions are not known."""
        if not self.hub_regions:
            return ()
        return tuple(r for r in self.regions if r not in self.hub_regions)

    def regions_of(self, account: str) -> tuple[str, ...]:
        """The regions in which an enrolled account is a member unit: every organization region, but for the hub's
        own account only those without a hub stack (its stacks sweep it in theirs; a machine is swept once)."""
        return self.hub_member_regions if account == self.hub_account else self.regions

    def units(self, accounts: Iterable[MemberAccount]) -> list[tuple[MemberAccount, str]]:
        """Every (account, region) unit of the listed accounts, an account's regions in organization order."""
        return [(a, r) for a in accounts for r in self.regions_of(a.id)]

    @classmethod
    def from_environment(cls) -> OrganizationConfig | None:
        """None in single-account mode (the variable is unset)."""
        text = os.environ.get(ORGANIZATION_ENV, "")
        return cls.from_json(text) if text else None

    @classmethod
    def of_function(cls, configuration: Mapping[str, Any]) -> OrganizationConfig | None:
        """A deployed function's (Lambda GetFunctionConfiguration's answer): None when it is not in organization
        mode. How the CLI learns the hub's organization from outside it."""
        text = configuration.get("Environment", {}).get("Variables", {}).get(ORGANIZATION_ENV)
        return cls.from_json(text) if text else None

    @classmethod
    def from_json(cls, text: str) -> OrganizationConfig:
        """The variable's value, as the hub stack writes it (the CLI reads it from the hub's function)."""
        data = json.loads(text)
        return cls(
            prefix=str(data["prefix"]),
            targets=tuple(data["targets"]),
            regions=tuple(data["regions"]),
            hub_account=str(data["hubAccount"]),
            partition=str(data.get("partition", "aws")),
            hub_regions=tuple(data.get("hubRegions", ())),
        )

    def directory(self, organizations: Any | None = None) -> AccountDirectory:
        return AccountDirectory(
            organizations or client("organizations"),
            self.targets,
            hub_account=self.hub_account,
            hub_is_member=bool(self.hub_member_regions),
        )

    def sessions(self, purpose: str, directory: AccountDirectory, sts: Any | None = None) -> MemberSessions:
        return MemberSessions(
            sts or client("sts"),
            prefix=self.prefix,
            purpose=purpose,
            partition=self.partition,
            status_of=directory.status_of,
        )


@dataclass(frozen=True)
class MemberAccess:
    """What a hub function works with in member accounts: where they are, who they are, credentials there.
    Kept for the life of the Lambda process, so a warm function reuses the listing and the credentials."""

    config: OrganizationConfig
    directory: AccountDirectory
    sessions: MemberSessions

    @classmethod
    def from_environment(cls, purpose: str) -> MemberAccess | None:
        """None in single-account mode."""
        config = OrganizationConfig.from_environment()
        if config is None:
            return None
        directory = config.directory()
        return cls(config, directory, config.sessions(purpose, directory))

    def hub_member_regions(self) -> tuple[str, ...]:
        """The regions where the hub's own account is swept as a member account now: those of
        OrganizationConfig.hub_member_regions when the listing holds it (it sits in a target OU), else none."""
        hub = self.config.hub_account
        return self.config.hub_member_regions if any(a.id == hub for a in self.directory.current().accounts) else ()


# The last check of the member accounts, for `status`: a lookup item of the hub's state table.
MEMBERS_KEY = "member-accounts"
# The weekly digest's last reads through the member stacks' read role (the accounts with exempt machines it
# tried, and those where the read role could not be assumed), for the doctor: the same shape, another item.
DIGEST_READS_KEY = "digest-reads"
MEMBERS_KEEP = timedelta(days=8)


@dataclass(frozen=True)
class MemberCheck:
    """One sweep's look at the member accounts: how many units it holds credentials for, and what failed."""

    checked_at: datetime
    accounts: int
    units: int  # (account, region) pairs with credentials
    failures: tuple[AccountFailure, ...]
    listing_error: str | None = None
    listed_at: datetime | None = None
    # The accounts it tried (each in every member region). None: a check stored before this was kept; then no
    # account is known to have been checked (the doctor says each is unknown, never healthy).
    checked: tuple[str, ...] | None = None
    # Failures past what one item holds (save_member_check): how many, and their accounts (why: the admins' alert).
    failures_more: int = 0
    failed_more: tuple[str, ...] = ()

    def failing_unkept(self, account: str, region: str) -> bool:
        """Whether this (account, region) may be one of the failures not kept: its account failed somewhere and
        its reason was not kept."""
        return account in self.failed_more and not any(
            f.account == account and f.region == region for f in self.failures
        )


def save_member_check(store: StateStore, check: MemberCheck, at: datetime, key: str = MEMBERS_KEY) -> MemberCheck:
    """Keep the check for `status` and the doctor in one item of the state table. The failures grow with the
    organization (about 370 bytes each: a wide outage fails every account-region at once), and DynamoDB's item
    holds 400 KB: as many as fit are kept with their reasons, the others counted, with their accounts named, so
    that no failure is taken for a healthy unit. Returns the check as kept."""
    failures = [
        {"account": f.account, "region": f.region, "reason": f.reason.value, "detail": f.detail} for f in check.failures
    ]
    value: dict[str, Any] = {
        "checked_at": check.checked_at.isoformat(),
        "accounts": check.accounts,
        "units": check.units,
        "failures": failures,
        "listing_error": check.listing_error,
        "listed_at": check.listed_at.isoformat() if check.listed_at else None,
        **({"checked": list(check.checked)} if check.checked is not None else {}),
    }
    text, kept = json.dumps(value), len(failures)
    while len(text.encode()) > LOOKUP_VALUE_MAX_BYTES and kept:  # drop about as many as are over, then check
        over = len(text.encode()) - LOOKUP_VALUE_MAX_BYTES
        kept = max(0, kept - 1 - -(-over * kept // max(1, len(json.dumps(failures[:kept]).encode()))))
        more = failures[kept:]
        more_accounts = sorted({str(f["account"]) for f in more} | set(check.failed_more))
        value.update(failures=failures[:kept], failures_more=len(more) + check.failures_more, failed_more=more_accounts)
        text = json.dumps(value)
    if len(text.encode()) > LOOKUP_VALUE_MAX_BYTES:
        # Even the accounts' names do not fit (tens of thousands): none is said to be checked, so none is healthy.
        value.pop("checked", None)
        text = json.dumps(value)
    store.put_lookup(key, text, at + MEMBERS_KEEP)
    return last_member_check_of(text)


def last_member_check(store: StateStore, now: datetime, key: str = MEMBERS_KEY) -> MemberCheck | None:
    """The last check a sweep stored (None: never, single-account mode, or over a week ago); with `key`
    DIGEST_READS_KEY, the weekly digest's last reads. Raises AwsError when it cannot be read, ValueError when
    what is stored is not a check (corrupt)."""
    raw = store.get_lookup(key, now)
    return None if raw is None else last_member_check_of(raw)


def last_member_check_of(raw: str) -> MemberCheck:
    """A check as save_member_check stored it. ValueError when it is not one (corrupt)."""
    try:
        value = json.loads(raw)
        failures = tuple(
            AccountFailure(f["account"], f["region"], Reason(f["reason"]), f["detail"]) for f in value["failures"]
        )
        listed_at, checked = value.get("listed_at"), value.get("checked")
        return MemberCheck(
            datetime.fromisoformat(value["checked_at"]),
            int(value["accounts"]),
            int(value["units"]),
            failures,
            value.get("listing_error"),
            datetime.fromisoformat(listed_at) if listed_at else None,
            None if checked is None else tuple(str(a) for a in checked),
            int(value.get("failures_more", 0)),
            tuple(str(a) for a in value.get("failed_more", ())),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"the stored member check is not readable ({type(exc).__name__}: {exc})"[:300]) from None


# The last sweep of the member accounts (organization mode), for `status`: a lookup item of the hub's state
# table, written by the gather step (or by the planner when it swept everything in place).
MEMBER_SWEEP_KEY = "member-sweep"


@dataclass(frozen=True)
class UnitFailure:
    """An (account, region) the last sweep could not sweep, and why."""

    account: str
    region: str
    name: str
    why: str


@dataclass(frozen=True)
class MemberSweep:
    """What the last sweep did in the member accounts: units swept, excluded accounts (their opted-in machines
    counted, never touched), units that failed and why; units it ran short of time for are only counted."""

    swept_at: datetime
    units: int
    swept: int
    machines: int
    excluded: tuple[tuple[str, str, int], ...]  # (account, name, opted-in machines)
    failed: tuple[UnitFailure, ...]
    failed_more: int = 0  # failed units beyond those kept
    deferred: int = 0
    in_parts: int = 0  # large account-regions swept in parts, by several workers (each counted once above)

    def lines(self) -> list[str]:
        """What `status` (the CLI, and `/idle-reaper status` for admins) says of it, plain text."""
        lines = [
            f"Member accounts, last sweep {self.swept_at:%Y-%m-%d %H:%M} UTC: {self.swept} of {self.units} "
            f"account-regions swept ({self.machines} machines)"
            + (f", {self.deferred} left to the next sweep (time ran short)" if self.deferred else "")
            + (f"; {self.in_parts} large one(s) swept in parts by several workers" if self.in_parts else "")
        ]
        for account, name, machines in self.excluded:
            label = f"{account} {name!r}" if name else account
            lines.append(f"  excluded, never touched: account {label}: {machines} opted-in machine(s)")
        for f in self.failed:
            label = f"{f.account} {f.name!r}" if f.name else f.account
            lines.append(f"  not swept: account {label} in {f.region}: {f.why}")
        if self.failed_more:
            lines.append(f"  and {self.failed_more} more account-regions not swept (see the shard workers' logs)")
        return lines


def save_member_sweep(store: StateStore, sweep: MemberSweep, at: datetime) -> None:
    value = {
        "swept_at": sweep.swept_at.isoformat(),
        "units": sweep.units,
        "swept": sweep.swept,
        "machines": sweep.machines,
        "excluded": [list(e) for e in sweep.excluded],
        "failed": [f.__dict__ for f in sweep.failed],
        "failed_more": sweep.failed_more,
        "deferred": sweep.deferred,
        "in_parts": sweep.in_parts,
    }
    store.put_lookup(MEMBER_SWEEP_KEY, json.dumps(value), at + MEMBERS_KEEP)


def last_member_sweep(store: StateStore, now: datetime) -> MemberSweep | None:
    """The last member sweep a sweep stored (None: never, single-account mode, or over a week ago)."""
    raw = store.get_lookup(MEMBER_SWEEP_KEY, now)
    if raw is None:
        return None
    value = json.loads(raw)
    return MemberSweep(
        swept_at=datetime.fromisoformat(value["swept_at"]),
        units=int(value["units"]),
        swept=int(value["swept"]),
        machines=int(value["machines"]),
        excluded=tuple((str(a), str(n), int(c)) for a, n, c in value["excluded"]),
        failed=tuple(UnitFailure(**f) for f in value["failed"]),
        failed_more=int(value.get("failed_more", 0)),
        deferred=int(value.get("deferred", 0)),
        in_parts=int(value.get("in_parts", 0)),
    )


# Member account-regions whose last sweep saw more machines than one worker should sweep, with their machines:
# the planner splits each in parts (fanout.plan_sweep). A lookup item of the hub's state table, rewritten by the
# gather step; a unit not seen for UNIT_SIZES_KEEP drops out, and at most UNIT_SIZES_KEPT are kept (the largest):
# about 70 bytes each, far under DynamoDB's 400 KB item.
UNIT_SIZES_KEY = "member-unit-sizes"
UNIT_SIZES_KEEP = timedelta(days=7)
UNIT_SIZES_KEPT = 500


class UnitSize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    account: AccountId
    region: RegionName
    machines: int = Field(ge=0)
    seen: AwareDatetime  # its last sweep that counted every machine


class UnitSizes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    units: list[UnitSize] = Field(default_factory=list, max_length=UNIT_SIZES_KEPT)

    def of(self, now: datetime) -> dict[tuple[str, str], int]:
        """(account, region) -> machines, of the units seen within UNIT_SIZES_KEEP of `now`."""
        return {(u.account, u.region): u.machines for u in self.units if u.seen > now - UNIT_SIZES_KEEP}


def load_unit_sizes(store: StateStore, now: datetime) -> UnitSizes:
    """The large member units remembered (empty: none). Raises AwsError when it cannot be read, ValueError
    (pydantic's ValidationError) when what is stored is not such a list (corrupt)."""
    raw = store.get_lookup(UNIT_SIZES_KEY, now)
    return UnitSizes() if raw is None else UnitSizes.model_validate_json(raw)


def save_unit_sizes(store: StateStore, sizes: UnitSizes, at: datetime) -> None:
    store.put_lookup(UNIT_SIZES_KEY, sizes.model_dump_json(), at + UNIT_SIZES_KEEP)
