"""The daily count of running instances in regions without a stack (first listed region only)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime
from typing import Any

from idle_reaper.aws.clients import AwsError
from idle_reaper.aws.regions import count_unwatched, home_region, save_unwatched, watched_regions
from idle_reaper.notify import logger as logger  # re-exported: handlers and admin log through it
from idle_reaper.policy import PolicyError
from idle_reaper.sweep.adapters import Adapters, alert_once


def report_unwatched_regions(adapters: Adapters, ec2_in: Callable[[str], Any], here: str, now: datetime) -> list[str]:
    """Once a day, from the first region the stack lists: count running instances in regions with no
    stack, keep the count for `status`, tell the admins (weekly per region) when some of them are tagged
    for idle-reaper and so expect a reaper that is not there. Returns the lines for the sweep's summary;
    nothing on the other sweeps of the day. A failed count is tried again by the next sweep."""
    watched, claim = watched_regions(here), f"unwatched-regions#{now:%Y-%m-%d}"
    if here != home_region(here) or not adapters.store.claim_once(claim, now):
        return []
    try:
        settings, _ = adapters.policies.load_settings()
        counts = count_unwatched(ec2_in, watched, settings.tags)
        save_unwatched(adapters.store, counts, now)
    except (*AwsError, PolicyError) as exc:
        with contextlib.suppress(Exception):
            adapters.store.release_claim(claim)
        return [f"could not count instances in regions without a stack: {exc}"]
    lines = [
        f"{c.region} has no idle-reaper stack: {c.running} running instances, {c.opted_in} tagged for idle-reaper"
        for c in counts
    ]
    week = now.strftime("%G-W%V")
    for c in counts:
        if c.opted_in:
            text = (
                f"{c.opted_in} running instances in {c.region} are tagged for idle-reaper, but no idle-reaper stack "
                f"watches {c.region}: they are never looked at. Add the region to the app's `regions` and deploy."
            )
            alert_once(adapters, f"unwatched#{c.region}#{week}", text, settings, now)
    return lines
