"""Regions: which ones this deploy watches, and the daily count of running instances where no stack watches."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import boto3
from botocore.exceptions import ClientError

from idle_reaper.aws.clients import error_code
from idle_reaper.aws.state import StateStore
from idle_reaper.core.digest_text import named_account
from idle_reaper.policy import (
    TagKeys,
)

# ---------------------------------------------------------------------------------------------
# Regions no stack watches


@dataclass(frozen=True)
class RegionCount:
    region: str
    running: int  # every running instance
    opted_in: int  # of those, carrying the team tag and the opt-in tag: what a stack there would sweep


def current_region() -> str:
    return boto3.session.Session().region_name or "us-east-1"


def listed_regions() -> list[str]:
    """The regions with an idle-reaper stack, as the CDK app lists them (IDLE_REAPER_REGIONS)."""
    return [r.strip() for r in os.environ.get("IDLE_REAPER_REGIONS", "").split(",") if r.strip()]


def watched_regions(home: str) -> list[str]:
    """The regions with an idle-reaper stack; `home` first, and at least."""
    return [home, *(r for r in listed_regions() if r != home)]


def home_region(here: str) -> str:
    """The first region the stack lists: the one that counts the regions without a stack, once for all."""
    return next(iter(listed_regions()), here)


# What a region answers when this account may not look there (a service control policy, a region not opted
# into): skipped and named, never a reason to fail the whole count or retry it every sweep.
DENIED = frozenset({"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "AuthFailure", "OptInRequired"})


def count_unwatched(
    ec2_in: Callable[[str], Any], watched: Sequence[str], tags: TagKeys
) -> tuple[list[RegionCount], list[str]]:
    """Running instances in every enabled region that no stack watches: without this, a team that
    launches in another region is never looked at, in silence. One DescribeRegions call, then one
    paginated DescribeInstances per unwatched region (1,000 a page, only the tags read). Returns the counts
    and the regions this account is denied (skipped); any other error fails the count."""
    regions = {r["RegionName"] for r in ec2_in(watched[0]).describe_regions()["Regions"]}  # enabled ones
    counts, denied = [], []
    for region in sorted(regions - set(watched)):
        running = opted_in = 0
        pages = (
            ec2_in(region)
            .get_paginator("describe_instances")
            .paginate(
                Filters=[{"Name": "instance-state-name", "Values": ["running"]}], PaginationConfig={"PageSize": 1000}
            )
        )
        try:
            for page in pages:
                for reservation in page["Reservations"]:
                    for inst in reservation["Instances"]:
                        tag = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                        running += 1
                        opted_in += bool(tag.get(tags.team, "").strip()) and (
                            tags.managed is None or tag.get(tags.managed) == "true"
                        )
        except ClientError as exc:
            if error_code(exc) not in DENIED:
                raise
            denied.append(region)
            continue
        if running:
            counts.append(RegionCount(region, running, opted_in))
    return counts, denied


UNWATCHED_KEY = "unwatched-regions"  # the last daily count, a lookup item in the home region's table
UNWATCHED_KEEP = timedelta(days=8)


def save_unwatched(store: StateStore, counts: Sequence[RegionCount], at: datetime, denied: Sequence[str] = ()) -> None:
    value = {"counted_at": at.isoformat(), "regions": [c.__dict__ for c in counts], "denied": list(denied)}
    store.put_lookup(UNWATCHED_KEY, json.dumps(value), at + UNWATCHED_KEEP)


def last_unwatched(store: StateStore, now: datetime) -> tuple[datetime, list[RegionCount], list[str]] | None:
    """The last daily count the sweep stored, and the regions it was denied (None: never counted, or over
    a week ago)."""
    raw = store.get_lookup(UNWATCHED_KEY, now)
    if raw is None:
        return None
    value = json.loads(raw)
    counts = [RegionCount(**c) for c in value["regions"]]
    return datetime.fromisoformat(value["counted_at"]), counts, [str(r) for r in value.get("denied", [])]


# ---------------------------------------------------------------------------------------------
# Organization mode: each member account's count (the regions outside the organization's `regions`)


@dataclass(frozen=True)
class AccountCount:
    """One member account's last daily count: its regions outside the organization's, and those it is denied."""

    account: str
    name: str
    counted_at: datetime
    regions: tuple[RegionCount, ...]
    denied: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return named_account(self.account, self.name)

    def lines(self) -> list[str]:
        """What `status` (the CLI, and `/idle-reaper status` for admins) says of it, plain text."""
        when = f"counted {self.counted_at:%Y-%m-%d %H:%M} UTC"
        lines = [
            f"  account {self.label}: {c.region}: {c.running} running, {c.opted_in} tagged for idle-reaper ({when})"
            for c in self.regions
        ]
        if self.denied:
            lines.append(
                f"  account {self.label}: not counted, the member role may not look there (a service control "
                f"policy?): {', '.join(self.denied)}"
            )
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "account": self.account,
            "name": self.name,
            "counted_at": self.counted_at.isoformat(),
            "regions": [c.__dict__ for c in self.regions],
            "denied": list(self.denied),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> AccountCount:
        return cls(
            account=str(value["account"]),
            name=str(value.get("name", "")),
            counted_at=datetime.fromisoformat(value["counted_at"]),
            regions=tuple(RegionCount(**c) for c in value["regions"]),
            denied=tuple(str(r) for r in value.get("denied", [])),
        )


def member_unwatched_key(account: str) -> str:
    return f"{UNWATCHED_KEY}#{account}"


# The accounts whose last count found something (running instances, or a region denied), for `status`: one item,
# so that `status` reads one item however many accounts there are; an account with nothing found is not in it.
MEMBERS_UNWATCHED_KEY = f"{UNWATCHED_KEY}#members"
MEMBERS_UNWATCHED_KEPT = 500  # accounts kept in that item (the most running instances first): far under 400 KB
_REPLACE_ATTEMPTS = 8


def save_member_unwatched(store: StateStore, count: AccountCount, at: datetime) -> None:
    """One member account's count: its own item (what says it was counted today), and its entry in the item
    `status` reads (added, replaced, or dropped when nothing was found), updated by compare-and-set because the
    member shards count at once; entries older than UNWATCHED_KEEP drop out."""
    store.put_lookup(member_unwatched_key(count.account), json.dumps(count.to_json()), at + UNWATCHED_KEEP)
    for _ in range(_REPLACE_ATTEMPTS):
        raw = store.get_lookup(MEMBERS_UNWATCHED_KEY, at)
        listed = _parse_members(raw)
        found = bool(count.regions or count.denied)
        if not found and all(c.account != count.account for c in listed):
            return  # nothing found, and it was not listed: nothing to change
        kept = [c for c in listed if c.account != count.account and at - c.counted_at < UNWATCHED_KEEP]
        if found:
            kept.append(count)
        kept.sort(key=lambda c: (-sum(r.running for r in c.regions), c.account))
        value = json.dumps([c.to_json() for c in kept[:MEMBERS_UNWATCHED_KEPT]])
        if store.replace_lookup(MEMBERS_UNWATCHED_KEY, value, at + UNWATCHED_KEEP, expected=raw, now=at):
            return
    raise RuntimeError(f"the member accounts' count item kept changing; account {count.account} not listed in it")


def last_member_counted(store: StateStore, account: str, now: datetime) -> datetime | None:
    """When this member account was last counted (None: never, or over a week ago)."""
    raw = store.get_lookup(member_unwatched_key(account), now)
    return None if raw is None else datetime.fromisoformat(json.loads(raw)["counted_at"])


def members_unwatched(store: StateStore, now: datetime) -> list[AccountCount]:
    """The member accounts whose last count (within a week) found running instances or a denied region."""
    return [
        c for c in _parse_members(store.get_lookup(MEMBERS_UNWATCHED_KEY, now)) if now - c.counted_at < UNWATCHED_KEEP
    ]


def members_unwatched_lines(counts: Sequence[AccountCount]) -> list[str]:
    """`status`'s lines for the member accounts' counts (nothing when no account has anything outside)."""
    if not counts:
        return []
    head = "Member accounts' regions outside the organization's `regions` (counted daily), never swept:"
    return [head, *(line for c in counts for line in c.lines())]


def _parse_members(raw: str | None) -> list[AccountCount]:
    return [] if raw is None else [AccountCount.from_json(v) for v in json.loads(raw)]
