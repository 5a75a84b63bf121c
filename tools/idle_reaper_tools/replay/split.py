"""Splitting a trace's machines so that tuning cannot see its judge (issue 45).

Machines that look alike (clones of one image, members of one service) behave alike: a constant tuned on one
and judged on its twin has seen the answer. So machines are grouped by the similarity of their series, and a
group always stays on one side. Pure and deterministic: the same trace gives the same sides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from idle_reaper_tools.replay.trace import Series, Trace

ALIKE_CORRELATION = 0.7  # hourly series correlated at least this much (where both have data): look-alikes
MIN_SHARED_HOURS = 48  # fewer hours with data in common than this: never called alike


def hourly(series: Series, period_seconds: int) -> dict[int, float]:
    """The busiest CPU or GPU value of each UTC hour (since the epoch) with data."""
    out: dict[int, float] = {}
    for i in range(len(series)):
        values = [v for v in (series.cpu[i], series.gpu[i]) if v == v]
        if values:
            hour = (series.first_bucket + i) * period_seconds // 3600
            out[hour] = max(out.get(hour, 0.0), *values)
    return out


def correlation(a: dict[int, float], b: dict[int, float]) -> float:
    """Pearson's correlation over the hours both have; 0 when fewer than MIN_SHARED_HOURS, or when either is
    flat there (two flat series are alike only if equal: 1)."""
    shared = sorted(a.keys() & b.keys())
    if len(shared) < MIN_SHARED_HOURS:
        return 0.0
    xs, ys = [a[h] for h in shared], [b[h] for h in shared]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return 1.0 if xs == ys else 0.0
    return sxy / math.sqrt(sxx * syy)


def look_alike_groups(trace: Trace, threshold: float = ALIKE_CORRELATION) -> list[list[str]]:
    """The trace's machines in groups: two machines whose hourly series correlate at `threshold` or more are in
    one group, and so, transitively, are their look-alikes. Largest group first, then by first id."""
    ids = [s.instance_id for s in trace.series]
    per_hour = [hourly(s, trace.period_seconds) for s in trace.series]
    parent = list(range(len(ids)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            if root(i) != root(j) and correlation(per_hour[i], per_hour[j]) >= threshold:
                parent[root(j)] = root(i)
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(ids):
        groups.setdefault(root(i), []).append(name)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g[0]))


@dataclass(frozen=True)
class MachineSides:
    """Two sides of a trace's machines, no look-alike group cut across them."""

    groups: tuple[tuple[str, ...], ...]
    a: frozenset[str]
    b: frozenset[str]


def machine_sides(trace: Trace, threshold: float = ALIKE_CORRELATION) -> MachineSides:
    """The look-alike groups dealt to two sides, largest first, each to the side with fewer machines so far
    (ties: side a): about half the machines each, a group never split."""
    groups = look_alike_groups(trace, threshold)
    a: list[str] = []
    b: list[str] = []
    for group in groups:
        (a if len(a) <= len(b) else b).extend(group)
    return MachineSides(tuple(tuple(g) for g in groups), frozenset(a), frozenset(b))


def subset(trace: Trace, machines: Sequence[str] | frozenset[str]) -> Trace:
    """The trace with only these machines."""
    keep = set(machines)
    return replace(trace, series=[s for s in trace.series if s.instance_id in keep])
