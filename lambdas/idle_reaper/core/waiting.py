"""When to warn a quiet machine later than usual: history waiting (what this machine did after its own past
quiet stretches like this one, with the fleet's prior and a confidence), learned waiting (the older rule on
the same history) or, once it has a usage profile, the time-of-day wait (core/time_of_day.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

from idle_reaper.core.records import NO_WEEKDAY, UNWANTED_WITHIN_MINUTES, Stretch
from idle_reaper.core.time_of_day import (
    MIN_DAYS_SEEN,
    PROFILE_DAYS,
    RESTART_AFTER_DAYS,
    parse_profile,
    time_of_day_wait,
    usable,
)
from idle_reaper.policy import TeamPolicy

LEARN_MIN_STRETCHES = 3  # fewer stretches of a length than this teach nothing about it
LEARN_SOON_SHARE = 0.4  # wait longer while more than this share of such stretches ended soon
LEARN_STEP_MINUTES = 15
LEARN_HOURS_AROUND = 1  # stretches that began within this many hours of the time of day count as alike
HISTORY_STEP_MINUTES = 15
CHANGED_BY = 0.5  # the recent share of stretches used soon differs from the older one by this much: changed


class WaitingRule(BaseModel):
    """Every constant of waiting besides the team policy's own fields (history_wait_percent,
    time_of_day_wait_percent, adaptive_wait_max_minutes): history waiting's, learned waiting's and how the
    time-of-day wait reads its profile. The sweep uses the defaults; the replay may set any of them
    (ReplayOptions.waiting, `idle-reaper replay --waiting`), so each is chosen on the tuning part of an honest
    split and judged on a part it never saw (benchmarks/carries.py; docs/replay.md, "Waiting that carries")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # History waiting.
    prior_percent: int = Field(30, ge=0, le=100, description="the fleet's prior: share of stretches used soon")
    prior_stretches: float = Field(2.0, ge=0, le=100, description="how many stretches the prior is worth")
    confidence: float = Field(1.0, ge=0, le=5, description="standard errors added to the estimate")
    other_time_weight: float = Field(0.25, ge=0, le=1, description="weight of a stretch at another time or day")
    recent: int = Field(4, ge=1, le=1000, description="newest stretches compared with the older ones")
    step_minutes: int = Field(HISTORY_STEP_MINUTES, ge=1, le=240, description="history waiting's step")
    changed_by: float = Field(CHANGED_BY, gt=0, le=1, description="a difference of shares this large: changed")
    # Learned waiting (a machine without a usable profile).
    learn_min_stretches: int = Field(LEARN_MIN_STRETCHES, ge=1, le=32)
    learn_soon_share: float = Field(LEARN_SOON_SHARE, ge=0, le=1)
    learn_step_minutes: int = Field(LEARN_STEP_MINUTES, ge=1, le=240)
    learn_hours_around: int = Field(LEARN_HOURS_AROUND, ge=0, le=12)
    # The time-of-day wait: how many of the profile's newest days it reads (the record keeps PROFILE_DAYS,
    # so the state per machine is the same whatever this is), how many days of data make it usable, and
    # after how many days without data (a machine stopped that long) it starts again.
    profile_days: int = Field(PROFILE_DAYS, ge=1, le=PROFILE_DAYS)
    min_days_seen: int = Field(MIN_DAYS_SEEN, ge=1, le=PROFILE_DAYS)
    restart_after_days: int = Field(RESTART_AFTER_DAYS, ge=1, le=PROFILE_DAYS)


DEFAULT_RULE = WaitingRule()


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


def _alike(hour: int, began: int, around: int = LEARN_HOURS_AROUND) -> bool:
    apart = abs(hour - began) % 24
    return min(apart, 24 - apart) <= around


def learned_wait(
    history: Sequence[Stretch], policy: TeamPolicy, began: datetime, rule: WaitingRule = DEFAULT_RULE
) -> LearnedWait:
    """Deterministic and explainable. The evidence: the past stretches that began at about the same time
    of day as this one (within rule.learn_hours_around hours, UTC: a lunch break is not a night), or, when
    fewer than rule.learn_min_stretches of those reached the warning point, all of the machine's stretches.
    Warned at W minutes of quiet, a stretch that then ends before the stop plus UNWANTED_WITHIN_MINUTES
    was a nudge (or a stop) for nothing. While more than rule.learn_soon_share of the stretches that reached
    W ended that soon, try W + rule.learn_step_minutes, up to the policy's adaptive_wait_max_minutes; with
    fewer than rule.learn_min_stretches reaching W nothing is known and the search stops there. When none
    ended soon and every one went on for hours, warn at the team's earliest."""
    most = policy.adaptive_wait_max_minutes or 0
    if not most or not history:
        return LearnedWait()
    hour = began.astimezone(UTC).hour
    usual, earliest = warn_point(policy), earliest_warn_minutes(policy)
    return _learned(tuple(history), hour, usual, policy.warn_minutes, most, earliest, rule)


@lru_cache(maxsize=4096)  # pure in plain values: a machine's sweeps within one stretch share the answer
def _learned(
    history: tuple[Stretch, ...], hour: int, usual: int, warn_minutes: int, most: int, earliest: int, rule: WaitingRule
) -> LearnedWait:
    """learned_wait in plain values."""
    least = rule.learn_min_stretches
    alike = [s[1] for s in history if _alike(s[0], hour, rule.learn_hours_around)]
    scope = " begun about this time of day"
    if sum(m >= usual for m in alike) < least:
        alike, scope = [s[1] for s in history], ""
    soon_span = warn_minutes + UNWANTED_WITHIN_MINUTES

    def tally(point: int) -> tuple[int, int]:
        reached = [m for m in alike if m >= point]
        return sum(m < point + soon_span for m in reached), len(reached)

    soon, reached = tally(usual)
    extra = 0
    while extra < most:
        soon_here, reached_here = tally(usual + extra)
        if reached_here < least or soon_here <= rule.learn_soon_share * reached_here:
            break
        extra = min(most, extra + rule.learn_step_minutes)
    if extra:
        return LearnedWait(
            extra,
            f"waits {extra} more min: {soon} of its last {reached} quiet stretches of {usual} min or more"
            f"{scope} ended within {soon_span} min",
        )
    hours = usual + 2 * soon_span
    long_ones = [m for m in alike if m >= earliest]
    if earliest < usual and len(long_ones) >= least and min(long_ones) >= hours:
        return LearnedWait(
            earliest - usual,
            f"warned {usual - earliest} min sooner: its last {len(long_ones)} quiet stretches of {earliest} min "
            f"or more{scope} all went on for {hours} min or more",
        )
    return LearnedWait()


@dataclass(frozen=True)
class _Evidence:
    """What the history says at one warning point: the estimated chance of use soon, its upper bound, and
    the counts behind it (alike: begun within an hour of this time of day, on the same kind of day)."""

    chance: float
    high: float
    soon: int  # of `reached` like stretches (full weight), how many were used again soon
    reached: int
    other_soon: int  # the same for stretches at other times (counted other_time_weight)
    other_reached: int
    changed: tuple[int, int, int, int] | None  # (recent soon, recent, older soon, older) when the pattern changed
    thin: bool  # fewer than two stretches of full weight: the prior weighs as much as the machine's own past


def _evidence(
    history: tuple[Stretch, ...], weights: tuple[float, ...], point: int, span: int, rule: WaitingRule
) -> _Evidence:
    reached = [(w, point <= m < point + span) for (_, m, _), w in zip(history, weights, strict=True) if m >= point]
    changed = None
    alike = [soon for w, soon in reached if w >= 1]
    if len(alike) >= 2 * rule.recent:  # enough like stretches to tell the newest from the ones before
        recent, older = alike[-rule.recent :], alike[: -rule.recent]
        if abs(sum(recent) / len(recent) - sum(older) / len(older)) >= rule.changed_by:
            changed = (sum(recent), len(recent), sum(older), len(older))
            reached = [(1.0, soon) for soon in recent]
    n = sum(w for w, _ in reached)
    k = sum(w for w, s in reached if s)
    a, p0 = rule.prior_stretches, rule.prior_percent / 100
    chance = (k + a * p0) / (n + a) if n + a > 0 else p0
    high = chance + rule.confidence * math.sqrt(chance * (1 - chance) / (n + a)) if n + a > 0 else 1.0
    full = [(w, s) for w, s in reached if w >= 1]
    other = [(w, s) for w, s in reached if w < 1]
    return _Evidence(
        chance,
        high,
        sum(s for _, s in full),
        len(full),
        sum(s for _, s in other),
        len(other),
        changed,
        sum(w for w, _ in full) < 2,
    )


def history_wait(
    history: Sequence[Stretch], policy: TeamPolicy, began: datetime, rule: WaitingRule = DEFAULT_RULE
) -> LearnedWait:
    """History waiting, deterministic and explained. At each warning point from the team's usual one (in
    rule.step_minutes steps, at most adaptive_wait_max_minutes later), the chance that this machine is
    used again soon (within warn_minutes + UNWANTED_WITHIN_MINUTES: before its stop, or within the hour
    after it) is estimated from its own past quiet stretches that lasted that long: those begun within an
    hour of this time of day on the same kind of day (weekday, weekend) count whole, the others
    other_time_weight; the fleet's prior counts prior_stretches more. When its newest `recent` stretches went
    otherwise than the ones before, only they count. The warning waits while the estimate plus `confidence`
    standard errors is history_wait_percent % or more: a thin or changed history widens the wait."""
    percent = policy.history_wait_percent or 0
    most = policy.adaptive_wait_max_minutes or 0
    if not percent or not most:
        return LearnedWait()
    at = began.astimezone(UTC)
    return _history_wait(
        tuple(history), at.hour, at.weekday(), warn_point(policy), policy.warn_minutes, most, percent, rule
    )


@lru_cache(maxsize=4096)  # pure in plain values: a machine's sweeps within one stretch share the answer
def _history_wait(
    history: tuple[Stretch, ...],
    hour: int,
    weekday: int,
    usual: int,
    warn_minutes: int,
    most: int,
    percent: int,
    rule: WaitingRule,
) -> LearnedWait:
    weekend = weekday >= 5
    weights = tuple(
        (1.0 if _alike(h, hour) else rule.other_time_weight)
        * (1.0 if d == NO_WEEKDAY or (d >= 5) == weekend else rule.other_time_weight)
        for h, _, d in history
    )
    span = warn_minutes + UNWANTED_WITHIN_MINUTES
    limit = percent / 100
    extra = 0
    first = _evidence(history, weights, usual, span, rule)
    evidence = first
    while evidence.high >= limit and extra < most:
        extra = min(most, extra + rule.step_minutes)
        evidence = _evidence(history, weights, usual + extra, span, rule)
    return LearnedWait(extra, _explain(first, evidence, usual, extra, span, limit, weekend, rule))


def _explain(
    first: _Evidence,
    last: _Evidence,
    usual: int,
    extra: int,
    span: int,
    limit: float,
    weekend: bool,
    rule: WaitingRule,
) -> str:
    """The reason a warning shows: what the machine did after its past quiet stretches like this one."""
    days = "weekend days" if weekend else "weekdays"
    if first.reached:
        said = (
            f"this machine was used again within {span} min after {first.soon} of its last {first.reached} "
            f"quiet stretches of {usual} min or more begun about this hour on {days}"
        )
    else:
        said = f"this machine has no past quiet stretch of {usual} min or more begun about this hour on {days}"
    if first.other_reached:
        said += f" ({first.other_soon} of {first.other_reached} at other times, counted less)"
    if first.changed:
        r_soon, recent, o_soon, older = first.changed
        said += f"; its last {recent} went otherwise ({r_soon} of {recent} used soon, {o_soon} of {older} before): "
        said += "only they count"
    if first.thin:
        said += f"; few to go by: the fleet's {rule.prior_percent}% counts as {rule.prior_stretches:g} more"
    chance = f"chance of use soon {first.chance:.0%}, up to {first.high:.0%} with its uncertainty"
    if not extra:
        return f"{said}; {chance}, under {limit:.0%}: warned at the usual {usual} min"
    held = "the most it may wait" if last.high >= limit else f"{last.high:.0%} by then"
    return f"{said}; {chance}, {limit:.0%} or more: waits {extra} more min ({held})"


def wait_for(
    history: Sequence[Stretch],
    profile_text: str,
    policy: TeamPolicy,
    began: datetime,
    quiet: float,
    rule: WaitingRule = DEFAULT_RULE,
) -> LearnedWait:
    """The time-of-day wait (core/time_of_day.py) when the policy turns it on and the machine has a usage
    profile; else (a new machine, a profile started again, an unreadable one) learned waiting. The wait
    is only worked out once the machine has been quiet for the usual warning point: before, it cannot
    change a decision (and a busy machine's quiet start moves every sweep). History waiting, when the
    policy turns it on (history_wait_percent), comes before both."""
    if policy.history_wait_percent:
        return history_wait(history, policy, began, rule) if quiet >= warn_point(policy) else LearnedWait()
    if policy.time_of_day_wait_percent:
        profile, _ = parse_profile(profile_text)
        if quiet < warn_point(policy) and usable(profile, rule.min_days_seen) and policy.adaptive_wait_max_minutes:
            return LearnedWait()
        wait = time_of_day_wait(
            profile,
            began,
            warn_point(policy),
            policy.adaptive_wait_max_minutes or 0,
            policy.time_of_day_wait_percent,
            policy.time_of_day_horizon_minutes,
            days=rule.profile_days,
            min_days=rule.min_days_seen,
        )
        if wait is not None:
            return LearnedWait(wait.extra_minutes, wait.why)
    return learned_wait(history, policy, began, rule)


def fleet_prior(minutes: Iterable[float], usual: int, span: int) -> int | None:
    """The fleet's prior learned from the fleet: of the quiet stretches (their lengths in minutes, pooled
    over machines) that reached the usual warning point, the share in percent that ended within `span`
    minutes after it (used again soon). None when none reached it (keep the constant)."""
    reached = [m for m in minutes if m >= usual]
    if not reached:
        return None
    return round(100 * sum(m < usual + span for m in reached) / len(reached))
