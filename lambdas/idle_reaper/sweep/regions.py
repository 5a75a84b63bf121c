"""The daily count of running instances in regions without a stack (first listed region only).

Organization mode: the count is the hub's own account's. A member account's machines outside the organization's
regions cannot be counted: each member role may only look in its own region (infra/organization.py), so the
hub has no view of them; the lines and the alert say whose account they count, and the alert says so."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from idle_reaper.aws.accounts import OrganizationConfig
from idle_reaper.aws.regions import count_unwatched, home_region, last_unwatched, save_unwatched, watched_regions
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.sweep.adapters import Adapters, alert_once


def report_unwatched_regions(adapters: Adapters, ec2_in: Callable[[str], Any], here: str, now: datetime) -> list[str]:
    """Once a day, from the first region the stack lists: count running instances in regions with no
    stack, keep the count for `status`, tell the admins (weekly per region) when some of them are tagged
    for idle-reaper and so expect a reaper that is not there. Returns the lines for the sweep's summary;
    nothing on the other sweeps of the day. A side job: it never takes the sweep down. A count that fails
    (throttling, the table) is tried again the next hour, not every sweep; regions this account is denied
    are skipped and named in `status`."""
    if here != home_region(here):
        return []
    try:
        last = last_unwatched(adapters.store, now)
        if last is not None and last[0].date() == now.date():
            return []  # counted today
        if not adapters.store.claim_once(f"unwatched-regions#{now:%Y-%m-%dT%H}", now):
            return []  # this hour's attempt is made (or being made) by another sweep
        settings, _ = adapters.policies.load_settings()
        counts, denied = count_unwatched(ec2_in, watched_regions(here), settings.tags)
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
            if organization:
                text += (
                    " (Member accounts are not counted: the hub sees them only in the organization's regions, "
                    f"{', '.join(organization.regions)}.)"
                )
            alert_once(adapters, f"unwatched#{c.region}#{week}", text, settings, now)
    return lines
