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
