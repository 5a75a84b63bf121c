"""When to warn a quiet machine later than usual: learned waiting (its past quiet stretches say it is about
to be used again) or, once it has a usage profile, the time-of-day wait (core/time_of_day.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache

from idle_reaper.core.records import UNWANTED_WITHIN_MINUTES, Stretch
from idle_reaper.core.time_of_day import parse_profile, time_of_day_wait, usable
from idle_reaper.policy import TeamPolicy

LEARN_MIN_STRETCHES = 3  # fewer stretches of a length than this teach nothing about it
LEARN_SOON_SHARE = 0.4  # wait longer while more than this share of such stretches ended soon
LEARN_STEP_MINUTES = 15
LEARN_HOURS_AROUND = 1  # stretches that began within this many hours of the time of day count as alike


@dataclass(frozen=True)
class LearnedWait:
    """What a machine's history changes about its warning: minutes added to the usual warning point
    (negative: sooner), and why in words ("" when nothing was learned)."""

    extra_minutes: int = 0
    why: str = ""


def warn_point(policy: TeamPolicy) -> int:
    return policy.idle_minutes - policy.warn_minutes


def earliest_warn_minutes(policy: TeamPolicy) -> int:
    """The team's minimum: the learned wait never warns before this much quiet."""
    usual = warn_point(policy)
    earliest = policy.adaptive_earliest_warn_minutes
    return usual if earliest is None else min(usual, earliest)


def _alike(hour: int, began: int) -> bool:
    apart = abs(hour - began) % 24
    return min(apart, 24 - apart) <= LEARN_HOURS_AROUND


def learned_wait(history: Sequence[Stretch], policy: TeamPolicy, began: datetime) -> LearnedWait:
    """Deterministic and explainable. The evidence: the past stretches that began at about the same time
    of day as this one (within LEARN_HOURS_AROUND hours, UTC: a lunch break is not a night), or, when
    fewer than LEARN_MIN_STRETCHES of those reached the warning point, all of the machine's stretches.
    Warned at W minutes of quiet, a stretch that then ends before the stop plus UNWANTED_WITHIN_MINUTES
    was a nudge (or a stop) for nothing. While more than LEARN_SOON_SHARE of the stretches that reached W
    ended that soon, try W + LEARN_STEP_MINUTES, up to the policy's adaptive_wait_max_minutes; with fewer
    than LEARN_MIN_STRETCHES reaching W nothing is known and the search stops there. When none ended soon
    and every one went on for hours, warn at the team's earliest."""
    most = policy.adaptive_wait_max_minutes or 0
    if not most or not history:
        return LearnedWait()
    hour = began.astimezone(UTC).hour
    return _learned(tuple(history), hour, warn_point(policy), policy.warn_minutes, most, earliest_warn_minutes(policy))


@lru_cache(maxsize=4096)  # pure in plain values: a machine's sweeps within one stretch share the answer
def _learned(
    history: tuple[Stretch, ...], hour: int, usual: int, warn_minutes: int, most: int, earliest: int
) -> LearnedWait:
    """learned_wait in plain values."""
    alike = [m for h, m in history if _alike(h, hour)]
    scope = " begun about this time of day"
    if sum(m >= usual for m in alike) < LEARN_MIN_STRETCHES:
        alike, scope = [m for _, m in history], ""
    soon_span = warn_minutes + UNWANTED_WITHIN_MINUTES

    def tally(point: int) -> tuple[int, int]:
        reached = [m for m in alike if m >= point]
        return sum(m < point + soon_span for m in reached), len(reached)

    soon, reached = tally(usual)
    extra = 0
    while extra < most:
        soon_here, reached_here = tally(usual + extra)
        if reached_here < LEARN_MIN_STRETCHES or soon_here <= LEARN_SOON_SHARE * reached_here:
            break
        extra = min(most, extra + LEARN_STEP_MINUTES)
    if extra:
        return LearnedWait(
            extra,
            f"waits {extra} more min: {soon} of its last {reached} quiet stretches of {usual} min or more"
            f"{scope} ended within {soon_span} min",
        )
    hours = usual + 2 * soon_span
    long_ones = [m for m in alike if m >= earliest]
    if earliest < usual and len(long_ones) >= LEARN_MIN_STRETCHES and min(long_ones) >= hours:
        return LearnedWait(
            earliest - usual,
            f"warned {usual - earliest} min sooner: its last {len(long_ones)} quiet stretches of {earliest} min "
            f"or more{scope} all went on for {hours} min or more",
        )
    return LearnedWait()


def wait_for(
    history: Sequence[Stretch], profile_text: str, policy: TeamPolicy, began: datetime, quiet: float
) -> LearnedWait:
    """The time-of-day wait (core/time_of_day.py) when the policy turns it on and the machine has a usage
    profile; else (a new machine, a profile started again, an unreadable one) learned waiting. The wait
    is only worked out once the machine has been quiet for the usual warning point: before, it cannot
    change a decision (and a busy machine's quiet start moves every sweep)."""
    if policy.time_of_day_wait_percent:
        profile, _ = parse_profile(profile_text)
        if quiet < warn_point(policy) and usable(profile) and policy.adaptive_wait_max_minutes:
            return LearnedWait()
        wait = time_of_day_wait(
            profile,
            began,
            warn_point(policy),
            policy.adaptive_wait_max_minutes or 0,
            policy.time_of_day_wait_percent,
            policy.time_of_day_horizon_minutes,
        )
        if wait is not None:
            return LearnedWait(wait.extra_minutes, wait.why)
    return learned_wait(history, policy, began)
