"""Time-of-day-aware waiting: when is this machine usually used, and is that soon?

Pure, like the rest of the core. Each machine keeps a compact profile of the last PROFILE_DAYS UTC days:
one bit per hour ("some datapoint the sweep read was at or above a threshold, or showed a person's
input") and one bit per day ("the sweep read this machine's data that day"). It is filled from the
datapoints every sweep already fetches (Assessment.busy_hours, Assessment.seen_day): no extra AWS call.

The rule: a quiet machine is warned at the first moment (from the team's usual warning point, in
WAIT_STEP_MINUTES steps, up to adaptive_wait_max_minutes later) at which the estimated chance that it
is used within the horizon is below the policy's threshold, and has been since the step before. The
estimate reads this machine's own past days at the same time of day: yesterday, a week ago, and the
share of the last PROFILE_DAYS days of the same kind (weekday or weekend) on which it was used then.

Bad input never fails a sweep: a missing, truncated or corrupt profile is "no profile" (the caller then
uses today's learned waiting); a clock that jumps (days without data, a clock before the profile) starts
the profile again.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache

PROFILE_DAYS = 14  # days of hours kept per machine
HOURS = PROFILE_DAYS * 24
_HOUR_MASK = (1 << HOURS) - 1
_DAY_MASK = (1 << PROFILE_DAYS) - 1
_PREFIX = "t1"  # encoding version: "t1.<newest UTC day>.<busy hours, base64>.<days seen, base64>"
_HOUR_BYTES = HOURS // 8
_DAY_BYTES = (PROFILE_DAYS + 7) // 8
PROFILE_MAX_CHARS = 96  # the encoding is 70 ("t1." + 5 digits + "." + 56 + "." + 4); 96 leaves room for the day number
RESTART_AFTER_DAYS = 7  # no data for this many days (stopped, moved): the old days say little; start again
MIN_DAYS_SEEN = 3  # fewer days of data than this: no profile yet, today's learned waiting applies
WAIT_STEP_MINUTES = 15


@dataclass(frozen=True)
class Profile:
    """When one machine was busy: bit (day - newest_day + PROFILE_DAYS - 1) * 24 + hour of `busy` for each
    busy UTC hour, bit (day - newest_day + PROFILE_DAYS - 1) of `seen` for each day with data."""

    newest_day: int  # UTC days since the epoch
    busy: int = 0
    seen: int = 0

    @property
    def days_seen(self) -> int:
        return self.seen.bit_count()


def parse_profile(text: str) -> tuple[Profile | None, str]:
    """The profile a record holds, or None, with a note for the log when the text was unusable (never
    an exception: a corrupted item must not fail a sweep)."""
    if not text:
        return None, ""
    return _parse(text)


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[Profile | None, str]:
    shown = text if len(text) <= 40 else text[:39] + "…"
    bad = f"usage profile {shown!r} is unreadable; started again"
    if len(text) > PROFILE_MAX_CHARS:
        return None, f"usage profile of {len(text)} characters is oversized; started again"
    parts = text.split(".")
    if len(parts) != 4 or parts[0] != _PREFIX or not (parts[1].isascii() and parts[1].isdigit()):
        return None, bad
    try:
        busy = base64.b64decode(parts[2], validate=True)
        seen = base64.b64decode(parts[3], validate=True)
    except (binascii.Error, ValueError):
        return None, bad
    if len(busy) != _HOUR_BYTES or len(seen) != _DAY_BYTES:
        return None, bad
    return Profile(int(parts[1]), int.from_bytes(busy, "big"), int.from_bytes(seen, "big") & _DAY_MASK), ""


def format_profile(profile: Profile | None) -> str:
    """What parse_profile reads back ("" for no profile)."""
    if profile is None:
        return ""
    busy = base64.b64encode(profile.busy.to_bytes(_HOUR_BYTES, "big")).decode()
    seen = base64.b64encode(profile.seen.to_bytes(_DAY_BYTES, "big")).decode()
    return f"{_PREFIX}.{profile.newest_day}.{busy}.{seen}"


def observe(
    profile: Profile | None, day: int | None, busy_hours: Iterable[int], restart_after: int = RESTART_AFTER_DAYS
) -> Profile | None:
    """The profile with one sweep's datapoints: the UTC day (since the epoch) it read data on, and the
    UTC hours (since the epoch) of its busy ones. Marking is idempotent: reading a bucket again changes
    nothing, so sweeps may overlap or be skipped while their newest bucket is marked. After `restart_after`
    days without data (at PROFILE_DAYS: only what shifts out is forgotten) the profile starts again."""
    if day is None:
        return profile
    if profile is None or day - profile.newest_day >= restart_after or day < profile.newest_day - 1:
        # No profile yet, days without data, or a clock that went back: what the old days say no longer holds.
        profile = Profile(day)
    elif day > profile.newest_day:
        shift = day - profile.newest_day
        profile = Profile(day, (profile.busy >> (24 * shift)), profile.seen >> shift)
    oldest = profile.newest_day - PROFILE_DAYS + 1
    busy, seen = profile.busy, profile.seen
    if day >= oldest:
        seen |= 1 << (day - oldest)
    for hour in busy_hours:
        index = hour - oldest * 24
        if 0 <= index < HOURS:
            busy |= 1 << index
    if busy == profile.busy and seen == profile.seen:
        return profile
    return Profile(profile.newest_day, busy & _HOUR_MASK, seen & _DAY_MASK)


@lru_cache(maxsize=8192)  # pure in plain values: a record's text and this sweep's marks
def observe_text(
    text: str, day: int | None, busy_hours: tuple[int, ...], restart_after: int = RESTART_AFTER_DAYS
) -> tuple[str, str]:
    """observe() on a record's text: the new text, and a note when the old one was unusable."""
    profile, note = parse_profile(text)
    return format_profile(observe(profile, day, busy_hours, restart_after)), note


@dataclass(frozen=True)
class UsageMarks:
    """What one sweep's datapoints tell the profile: the UTC hours (since the epoch) of the busy ones, and
    the UTC day (since the epoch) of the newest one (None: no data)."""

    busy_hours: tuple[int, ...] = ()
    seen_day: int | None = None


@dataclass(frozen=True)
class Wait:
    """How much later than usual the machine is warned, and why in words ("" when it is not held)."""

    extra_minutes: int = 0
    why: str = ""


def _used_between(profile: Profile, start: datetime, minutes: int, days_back: int) -> bool | None:
    """Whether the machine was busy in [start, start + minutes) shifted `days_back` days back (hour
    resolution); None when that day is outside the profile or had no data."""
    stamp = int(start.timestamp()) - days_back * 86400
    day = stamp // 86400
    oldest = profile.newest_day - PROFILE_DAYS + 1
    if day < oldest or day > profile.newest_day or not profile.seen >> (day - oldest) & 1:
        return None
    first = (day - oldest) * 24 + (stamp % 86400) // 3600
    last = min(HOURS - 1, first + ((stamp % 3600) + minutes * 60 - 1) // 3600)
    span = last - first + 1
    return bool(profile.busy >> first & ((1 << span) - 1))


def _weekend(day: int) -> bool:
    return (day + 3) % 7 >= 5  # 1970-01-01 was a Thursday


def chance_used(profile: Profile, at: datetime, horizon: int, days: int = PROFILE_DAYS) -> tuple[float, int, int]:
    """The estimated chance the machine is used within `horizon` minutes of `at`: the mean of yesterday,
    a week ago and the share of the same kind of day (weekday, weekend) in the profile's newest `days` days
    (at most PROFILE_DAYS: what the record keeps), each when known.
    Also those days: used, and known (for the explanation). Read on every sweep of a quiet machine past
    its usual warning point, so in plain integer arithmetic (what _used_between does, day by day)."""
    stamp = int(at.timestamp())
    today, oldest = stamp // 86400, profile.newest_day - PROFILE_DAYS + 1
    hour = (stamp % 86400) // 3600
    span = ((stamp % 3600) + horizon * 60 - 1) // 3600 + 1
    kind = _weekend(today)
    yesterday = week = None
    used_same = known_same = 0
    for back in range(1, min(days, PROFILE_DAYS) + 1):
        day = today - back
        if day < oldest or day > profile.newest_day or not profile.seen >> (day - oldest) & 1:
            continue
        first = (day - oldest) * 24 + hour
        used = bool(profile.busy >> first & ((1 << min(span, HOURS - first)) - 1))
        if back == 1:
            yesterday = used
        elif back == 7:
            week = used
        if _weekend(day) == kind:
            known_same += 1
            used_same += used
    terms = [float(v) for v in (yesterday, week) if v is not None]
    if known_same:
        terms.append(used_same / known_same)
    if not terms:
        return 0.0, 0, 0
    return sum(terms) / len(terms), used_same, known_same


def usable(profile: Profile | None, min_days: int = MIN_DAYS_SEEN) -> bool:
    """Whether the profile holds `min_days` days of data or more to go by (else the caller uses today's
    learned waiting)."""
    return profile is not None and profile.days_seen >= min_days


def time_of_day_wait(
    profile: Profile | None,
    began: datetime,
    usual: int,
    most: int,
    percent: int,
    horizon: int,
    *,
    days: int = PROFILE_DAYS,
    min_days: int = MIN_DAYS_SEEN,
) -> Wait | None:
    """The wait for a quiet stretch that began at `began`: None when there is no usable profile (fewer than
    `min_days` days of data: the caller uses today's learned waiting). The warning point moves from `usual`
    minutes of quiet in WAIT_STEP_MINUTES steps, at most `most` minutes, while the chance of use within
    `horizon` minutes (read from the profile's newest `days` days) is `percent` % or more at that point or
    at the step before it."""
    if not usable(profile, min_days) or most <= 0 or percent <= 0:
        return None
    assert profile is not None
    return _wait(profile, began, usual, most, percent, horizon, days)


@lru_cache(maxsize=4096)  # a machine's sweeps within one quiet stretch share the answer
def _wait(profile: Profile, began: datetime, usual: int, most: int, percent: int, horizon: int, days: int) -> Wait:
    limit = percent / 100
    extra = 0
    first_held: datetime | None = None  # the first moment the chance held the warning
    low_before = False
    while True:
        at = began + timedelta(minutes=usual + extra)
        low = chance_used(profile, at, horizon, days)[0] < limit
        if low and (low_before or extra == 0):
            break  # low, and low at the step before (or already at the usual point): warn here
        if not low and first_held is None:
            first_held = at
        low_before = low
        if extra >= most:
            break
        extra = min(most, extra + WAIT_STEP_MINUTES)
    if extra == 0 or first_held is None:
        return Wait()
    hour, used, known = _usual_hour(profile, first_held, horizon, days)
    kind = "weekend days" if _weekend(int(first_held.timestamp()) // 86400) else "weekdays"
    until = began + timedelta(minutes=usual + extra)
    return Wait(
        extra,
        f"usually busy around {hour:02d}:00 UTC on {kind} ({used} of its last {known}); "
        f"waiting until {until:%H:%M} UTC to warn",
    )


def _usual_hour(profile: Profile, at: datetime, horizon: int, days: int) -> tuple[int, int, int]:
    """The hour of day within [at, at + horizon) this machine was busy at most often on past days of the
    same kind: that hour, on how many of them, of how many known (for the explanation)."""
    kind = _weekend(int(at.timestamp()) // 86400)
    start = at.replace(minute=0, second=0, microsecond=0)
    best = (int(start.hour), 0, 0)
    for step in range((int(at.timestamp()) % 3600 + horizon * 60 - 1) // 3600 + 1):
        moment = start + timedelta(hours=step)
        alike = [
            used
            for back in range(1, min(days, PROFILE_DAYS) + 1)
            if _weekend(int(moment.timestamp()) // 86400 - back) == kind
            and (used := _used_between(profile, moment, 60, back)) is not None
        ]
        if sum(alike) > best[1]:
            best = (moment.hour, sum(alike), len(alike))
    return best


def epoch_hours(times: Iterable[datetime]) -> tuple[int, ...]:
    """The distinct UTC hours since the epoch of these datapoints, oldest first (what observe() marks).
    Read on every sweep: a datapoint in the same clock hour and day as the one before it (the usual case,
    points come in time order) costs no timestamp."""
    hours: set[int] = set()
    last_hour = last_day = -1
    for t in times:
        if t.hour != last_hour or t.day != last_day:
            hours.add(int(t.timestamp()) // 3600)
            last_hour, last_day = t.hour, t.day
    return tuple(sorted(hours))


def epoch_day(at: datetime) -> int:
    return int(at.timestamp()) // 86400
