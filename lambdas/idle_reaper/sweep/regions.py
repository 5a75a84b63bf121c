"""The daily count of running instances in regions without a stack.

The hub's own account (or a single account) is counted from the first listed region's sweep. In organization
mode each member account is counted too, once a day, through its member role in the first organization region
(the unit there already holds its credentials): its enabled regions outside the organization's `regions`
(report_member_unwatched)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from idle_reaper.aws.accounts import MemberAccount, OrganizationConfig
from idle_reaper.aws.clients import run_concurrently
from idle_reaper.aws.regions import (
    AccountCount,
    count_unwatched,
    home_region,
    last_member_counted,
    last_unwatched,
    save_member_unwatched,
    save_unwatched,
    watched_regions,
)
from idle_reaper.core.digest_text import named_account
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.sweep.adapters import Adapters, alert_once


def _count_due(adapters: Adapters, last: datetime | None, claim: str, now: datetime) -> bool:
    """Whether a daily count is to be made now: not yet counted today (`last`), and this hour's attempt claimed
    here (a failed count is tried again the next hour, not every sweep; another sweep may hold this hour's)."""
    if last is not None and last.date() == now.date():
        return False
    return adapters.store.claim_once(f"{claim}#{now:%Y-%m-%dT%H}", now)


def report_unwatched_regions(
    adapters: Adapters, ec2_in: Callable[[str], Any], here: str, now: datetime, *, also_watched: Sequence[str] = ()
) -> list[str]:
    """Once a day, from the first region the stack lists: count running instances in regions with no
    stack, keep the count for `status`, tell the admins (weekly per region) when some of them are tagged
    for idle-reaper and so expect a reaper that is not there. Returns the lines for the sweep's summary;
    nothing on the other sweeps of the day. A side job: it never takes the sweep down. A count that fails
    (throttling, the table) is tried again the next hour, not every sweep; regions this account is denied
    are skipped and named in `status`. `also_watched`: regions without a hub stack where the hub's account is
    swept all the same (organization mode: as a member account, its member stack there)."""
    if here != home_region(here):
        return []
    try:
        last = last_unwatched(adapters.store, now)
        if not _count_due(adapters, last[0] if last is not None else None, "unwatched-regions", now):
            return []
        settings, _ = adapters.policies.load_settings()
        watched = list(dict.fromkeys([*watched_regions(here), *also_watched]))  # `here` first, each once
        counts, denied = count_unwatched(ec2_in, watched, settings.tags)
        save_unwatched(adapters.store, counts, now, denied)
    except Exception as exc:  # contained: the sweep goes on, the next hour tries again
        logger.warning("regions without a stack not counted", extra={"error": str(exc)})
        return [f"could not count instances in regions without a stack: {exc}; tried again next hour"]
    organization = OrganizationConfig.from_environment()
    whose = f" in the hub's account {organization.hub_account}" if organization else ""
    lines = [
        f"{c.region} has no idle-reaper stack{whose}: {c.running} running instances, {c.opted_in} tagged for "
        "idle-reaper"
        for c in counts
    ]
    if denied:
        lines.append(f"not counted, this account may not look there: {', '.join(denied)}")
    week = now.strftime("%G-W%V")
    for c in counts:
        if c.opted_in:
            text = (
                f"{c.opted_in} running instances in {c.region}{whose} are tagged for idle-reaper, but no idle-reaper "
                f"stack watches {c.region}: they are never looked at. Add the region to the app's `regions` and deploy."
            )
            alert_once(adapters, f"unwatched#{c.region}#{week}", text, settings, now)
    return lines


# A member account's count runs only with this much time left in the invocation (like the hub's,
# handlers/sweep.py UNWATCHED_COUNT_SECONDS): it is a side job, after the units' sweeps, never in their way.
MEMBER_COUNT_SECONDS = 60.0
MEMBER_COUNT_WORKERS = 8


def report_member_unwatched(
    adapters: Adapters,
    accounts: Sequence[MemberAccount],
    ec2_of: Callable[[str], Callable[[str], Any]],
    watched: Sequence[str],
    now: datetime,
    *,
    time_left: Callable[[], float] | None = None,
    workers: int = MEMBER_COUNT_WORKERS,
) -> list[str]:
    """Organization mode, once a day per member account: running instances (and those tagged for idle-reaper)
    in its enabled regions outside the organization's `regions` (`watched`, the first where DescribeRegions is
    asked), through `ec2_of(account)`: an EC2 client per region with the member role's credentials of the first
    organization region. Kept per account for `status`; the admins are told once a week per (account, region)
    where some are tagged for idle-reaper. Regions the account is denied (an SCP) are named, not counted.
    A side job like the hub's count: claimed once an hour per account (so a failure is tried again the next
    hour, not every sweep) and done for the day once it succeeds; skipped when time runs short; one account's
    failure is a line of the log, never anything else's. Returns the lines for the log."""
    try:
        settings, _ = adapters.policies.load_settings()
    except Exception as exc:  # contained: the next sweep tries again
        return [f"member accounts' regions not counted: {exc}"]
    week = now.strftime("%G-W%V")

    def count(account: MemberAccount) -> list[str]:
        label = named_account(account.id, account.name)
        if time_left is not None and time_left() < MEMBER_COUNT_SECONDS:
            return []  # the next sweep counts it
        try:
            last = last_member_counted(adapters.store, account.id, now)
            if not _count_due(adapters, last, f"unwatched-regions#{account.id}", now):
                return []
            counts, denied = count_unwatched(ec2_of(account.id), watched, settings.tags)
            found = AccountCount(account.id, account.name, now, tuple(counts), tuple(denied))
            save_member_unwatched(adapters.store, found, now)
        except Exception as exc:  # contained: the units are swept; the next hour tries again
            return [
                f"could not count member account {label}'s regions outside the organization's: {exc}; tried again "
                "next hour"
            ]
        lines = [
            f"{c.region} of member account {label} has no idle-reaper member stack: {c.running} running instances, "
            f"{c.opted_in} tagged for idle-reaper"
            for c in found.regions
        ]
        if found.denied:
            lines.append(
                f"member account {label}: not counted, the member role may not look there: {', '.join(found.denied)}"
            )
        for c in found.regions:
            if c.opted_in:
                alert_once(
                    adapters,
                    f"unwatched#{account.id}#{c.region}#{week}",
                    f"{c.opted_in} running instances in {c.region} of member account {label} are tagged for "
                    f"idle-reaper, but idle-reaper watches member accounts only in the organization's regions "
                    f"({', '.join(watched)}): they are never looked at. Add {c.region} to the `organization` block's "
                    "`regions` and deploy.",
                    settings,
                    now,
                )
        return lines

    return [line for lines in run_concurrently(count, accounts, workers) for line in lines]
