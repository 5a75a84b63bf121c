"""Under-used machines, for the weekly digest: busy by the rules, but never near their capacity all week.

Each sweep keeps a machine's busiest GPU (CPU for CPU-only types) of its busy reads, per ISO week, on its record
(`with_peak`); the digest names the machines that stayed low all week with the next smaller type of their family
(`under_used`). A suggestion for people: the reaper never changes a machine's type. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING

from idle_reaper.core.records import MachineRecord

if TYPE_CHECKING:
    from idle_reaper.core.digest import Week


UNDER_USED_PERCENT = 30.0  # the busiest GPU (or CPU) never reached this in a week of busy reads
UNDER_USED_READS = 24  # at least this many busy reads recorded that week (about a day of hourly reads)
SIZES = (
    "nano",
    "micro",
    "small",
    "medium",
    "large",
    "xlarge",
    *(f"{n}xlarge" for n in (2, 3, 4, 6, 8, 9, 12, 16, 18, 24, 32, 48)),
)


def _peaks(text: str) -> dict[str, tuple[float, int]]:
    out: dict[str, tuple[float, int]] = {}
    for part in text.split(","):
        week, _, rest = part.partition(":")
        peak, _, reads = rest.partition(":")
        try:
            out[week] = (float(peak), int(reads))
        except ValueError:
            continue  # a corrupt entry is dropped, never a failed sweep
    return out


def with_peak(record: MachineRecord, now: datetime, busiest: float | None) -> MachineRecord:
    """The record with one more busy read: its busiest GPU (or CPU) `busiest` counted in this week's peak."""
    from idle_reaper.core.digest import week_of  # the digest's weeks (it imports this module)

    if busiest is None or busiest != busiest:
        return record
    week = week_of(now).label
    peaks = _peaks(record.week_peaks)
    peak, reads = peaks.get(week, (0.0, 0))
    peaks[week] = (max(peak, round(busiest, 1)), reads + 1)
    kept = sorted(peaks.items())[-2:]
    return replace(record, week_peaks=",".join(f"{w}:{p:g}:{n}" for w, (p, n) in kept))


def next_smaller(instance_type: str, prices: Mapping[str, float]) -> str | None:
    """The next smaller size of the same family that has a price (so its saving can be said)."""
    family, _, size = instance_type.partition(".")
    if size not in SIZES:
        return None
    smaller = [f"{family}.{s}" for s in SIZES[: SIZES.index(size)] if f"{family}.{s}" in prices]
    return smaller[-1] if smaller else None


@dataclass(frozen=True)
class UnderUsed:
    instance_id: str
    name: str
    instance_type: str
    peak: float
    smaller: str
    saves_hourly: float
    account: str | None = None


def under_used(
    records: Iterable[MachineRecord], week: Week, team: str | None, prices: Mapping[str, float]
) -> list[UnderUsed]:
    """Machines busy by the rules all `week` whose busiest GPU (CPU for CPU-only types) stayed under
    UNDER_USED_PERCENT, with the next smaller type of their family and what it would save an hour. A
    suggestion for people: the reaper never changes a machine's type."""
    out = []
    for r in records:
        peak, reads = _peaks(r.week_peaks).get(week.label, (100.0, 0))
        if (team is not None and r.team != team) or reads < UNDER_USED_READS or peak >= UNDER_USED_PERCENT:
            continue
        smaller = next_smaller(r.instance_type or "", prices)
        price = prices.get(r.instance_type or "")
        if smaller is None or price is None or prices[smaller] >= price:
            continue
        out.append(
            UnderUsed(
                r.instance_id,
                r.name or r.instance_id,
                r.instance_type or "",
                peak,
                smaller,
                price - prices[smaller],
                r.account,
            )
        )
    return sorted(out, key=lambda u: (-u.saves_hourly, u.name))
