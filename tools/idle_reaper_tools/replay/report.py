"""The report: a replay's figures per reaper (fleet and per team), as text and as JSON.

replay() runs the simulation over a trace and adds up what happened to each machine; format_report()
and Replay.to_json() present it. What each figure means is in docs/replay.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from idle_reaper.policy import parse_team_policy
from idle_reaper.pricing import DEFAULT_PRICES
from idle_reaper_tools.replay.policies import PolicySet
from idle_reaper_tools.replay.simulate import MachineRun, ReplayOptions, StopEvent, fleet_timeline, simulate_fleet
from idle_reaper_tools.replay.trace import Trace

DEFAULT_OPTIONS = ReplayOptions()


@dataclass
class Totals:
    """One reaper's results over the fleet (or one team)."""

    machines: int = 0
    buckets: int = 0
    quiet: int = 0
    ideal: int = 0
    recovered: int = 0
    stopped: int = 0
    stops: int = 0
    false_stops: int = 0
    person_active_stops: int = 0
    wanted: int = 0
    warnings: int = 0
    silent_warnings: int = 0
    warnings_without_stop: int = 0
    messages: int = 0  # warning messages: one per owner per sweep however many of their machines it warns
    owner_days: float = 0.0
    snoozes: int = 0
    core_calls: int = 0
    dollars: float | None = 0.0
    ideal_dollars: float | None = 0.0
    unpriced_hours: float | None = 0.0

    def add(self, run: MachineRun, hours: float, price: float | None, priced: bool, wanted_minutes: float) -> None:
        self.machines += 1
        self.buckets += run.buckets
        self.quiet += run.quiet
        self.ideal += run.ideal
        self.recovered += run.recovered
        self.stopped += run.stopped
        self.stops += len(run.stops)
        self.false_stops += sum(s.false_stop for s in run.stops)
        self.person_active_stops += sum(s.person_active for s in run.stops)
        self.wanted += sum(
            s.resumed_after_minutes is not None and s.resumed_after_minutes <= wanted_minutes for s in run.stops
        )
        self.warnings += run.warnings
        self.silent_warnings += run.silent_warnings
        self.warnings_without_stop += run.warnings_without_stop
        self.snoozes += run.snoozes
        self.core_calls += run.core_calls
        if not priced:
            self.dollars = self.ideal_dollars = self.unpriced_hours = None
        elif self.dollars is not None and self.ideal_dollars is not None and self.unpriced_hours is not None:
            if price is None:
                self.unpriced_hours += run.recovered * hours
            else:
                self.dollars += run.recovered * hours * price
                self.ideal_dollars += run.ideal * hours * price


@dataclass
class Result:
    """One reaper's outcome: fleet totals, per-team totals, every stop."""

    name: str
    hours_per_bucket: float
    fleet: Totals = field(default_factory=Totals)
    teams: dict[str, Totals] = field(default_factory=dict)
    stops: list[StopEvent] = field(default_factory=list)

    def hours(self, buckets: int) -> float:
        return buckets * self.hours_per_bucket

    def summary(self, t: Totals | None = None) -> dict[str, Any]:
        t = self.fleet if t is None else t
        machine_days = self.hours(t.buckets) / 24
        ideal = self.hours(t.ideal)
        recovered = self.hours(t.recovered)
        return {
            "machines": t.machines,
            "machine_days": round(machine_days, 3),
            "idle_hours": round(self.hours(t.quiet), 3),
            "ideal_hours": round(ideal, 3),
            "recovered_hours": round(recovered, 3),
            "recovery_ratio": round(recovered / ideal, 4) if ideal else None,
            "stopped_hours": round(self.hours(t.stopped), 3),
            "stops": t.stops,
            "false_stops": t.false_stops,
            "person_active_stops": t.person_active_stops,
            "stops_followed_by_activity": t.wanted,
            "unwanted_stop_share": round(t.wanted / t.stops, 4) if t.stops else None,
            "warnings": t.warnings,
            "warnings_without_stop": t.warnings_without_stop,
            "warnings_without_stop_share": (
                round(t.warnings_without_stop / (t.warnings + t.silent_warnings), 4)
                if t.warnings + t.silent_warnings
                else None
            ),
            "messages": t.messages,
            "owner_days": round(t.owner_days, 3),
            "messages_per_owner_day": round(t.messages / t.owner_days, 4) if t.owner_days else None,
            "warnings_per_machine_day": round(t.warnings / machine_days, 4) if machine_days else 0.0,
            "silent_warnings": t.silent_warnings,
            "snoozes": t.snoozes,
            "dollars_saved": None if t.dollars is None else round(t.dollars, 2),
            "ideal_dollars": None if t.ideal_dollars is None else round(t.ideal_dollars, 2),
            "unpriced_hours": None if t.unpriced_hours is None else round(t.unpriced_hours, 3),
            "core_calls": t.core_calls,
        }


@dataclass
class Replay:
    trace: Trace
    options: ReplayOptions
    price_source: str | None  # None: no usable price table, savings unknown
    reaper: Result
    baseline: Result | None
    seconds: float
    timeline: dict[str, list[int]] | None = None  # state name -> machines in that state per bucket
    timeline_start: datetime | None = None
    audit: list[tuple[str, datetime, dict[str, Any]]] = field(default_factory=list)  # options.audit_prices

    def to_json(self) -> dict[str, Any]:
        p = self.options.policies
        out: dict[str, Any] = {
            "trace": self.trace.source,
            "period_minutes": self.trace.period_seconds // 60,
            "policy": {"source": p.source, "default": p.default.model_dump(mode="json")}
            | ({"teams": {t: v.model_dump(mode="json") for t, v in p.teams.items()}} if p.teams else {}),
            "price_table": self.price_source,
            "still_wanted_minutes": self.options.still_wanted_minutes,
            "snooze_rate": self.options.snooze_rate,
            **self.reaper.summary(),
            "teams": {team: self.reaper.summary(t) for team, t in sorted(self.reaper.teams.items())},
            "replay_seconds": round(self.seconds, 3),
        }
        if self.baseline is not None:
            out["baseline"] = {
                "name": self.baseline.name,
                **self.baseline.summary(),
                "teams": {team: self.baseline.summary(t) for team, t in sorted(self.baseline.teams.items())},
            }
        return out


def count_messages(runs: Iterable[MachineRun], period_seconds: int) -> tuple[int, float]:
    """Warning messages and owner-days: one message per owner per sweep, however many of the owner's
    machines that sweep warns; an owner-day is a UTC day on which any of the owner's machines is in the
    trace. A machine without an owner is its own owner."""
    sweeps: dict[str, set[int]] = {}
    days: dict[str, set[int]] = {}
    per_day = 86400 // period_seconds if 86400 % period_seconds == 0 else 86400 / period_seconds
    for run in runs:
        sweeps.setdefault(run.owner, set()).update(run.warning_buckets)
        first, last = run.first_bucket, run.first_bucket + run.buckets - 1
        days.setdefault(run.owner, set()).update(range(int(first // per_day), int(last // per_day) + 1))
    return sum(len(s) for s in sweeps.values()), float(sum(len(d) for d in days.values()))


def replay(
    trace: Trace,
    options: ReplayOptions = DEFAULT_OPTIONS,
    *,
    prices: Mapping[str, float] | None = DEFAULT_PRICES,
    price_source: str | None = "built-in",
    baseline: str | None = None,
    workers: int | None = None,
) -> Replay:
    """Replay every machine of the trace under idle-reaper (and a baseline). prices=None: savings unknown.
    workers: processes to use (default: one per CPU for a large fleet, else this process only)."""
    started = time.perf_counter()
    pairs = simulate_fleet(trace, options, baseline, workers)
    hours = trace.period_seconds / 3600
    wanted = options.still_wanted_minutes
    reaper = Result("idle-reaper", hours)
    alarm = Result(baseline, hours) if baseline else None
    for reaper_run, alarm_run in pairs:
        price = prices.get(reaper_run.instance_type) if prices is not None else None
        for result, run in ((reaper, reaper_run), (alarm, alarm_run)):
            if result is None or run is None:
                continue
            for totals in (result.fleet, result.teams.setdefault(run.team, Totals())):
                totals.add(run, hours, price, prices is not None, wanted)
            result.stops.extend(run.stops)
    for result, runs in ((reaper, [r for r, _ in pairs]), (alarm, [a for _, a in pairs if a is not None])):
        if result is None:
            continue
        groups: dict[str, list[MachineRun]] = {}
        for run in runs:
            groups.setdefault(run.team, []).append(run)
        for totals, members in [(result.fleet, runs), *((result.teams[t], g) for t, g in groups.items())]:
            totals.messages, totals.owner_days = count_messages(members, trace.period_seconds)
    out = Replay(trace, options, price_source if prices is not None else None, reaper, alarm, 0.0)
    out.audit = [entry for run, _ in pairs for entry in run.audit]
    if options.timeline and pairs:
        out.timeline_start, out.timeline = fleet_timeline([r for r, _ in pairs], trace.period_seconds)
    out.seconds = time.perf_counter() - started
    return out


def money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:,.2f}"


def _num(value: Any, fmt: str = "{:,.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def format_report(r: Replay, max_events: int = 8) -> str:
    trace = r.trace
    reaper = r.reaper.summary()
    columns = [("idle-reaper", reaper)]
    if r.baseline is not None:
        columns.append((f"{r.baseline.name} alarm", r.baseline.summary()))
    wanted = r.options.still_wanted_minutes
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("idle machine-hours in the trace", lambda s: _num(s["idle_hours"])),
        ("ideal recoverable hours", lambda s: _num(s["ideal_hours"])),
        ("recovered hours", lambda s: _num(s["recovered_hours"])),
        ("recovery ratio", lambda s: _num(s["recovery_ratio"], "{:.1%}")),
        ("stops", lambda s: f"{s['stops']:,}"),
        ("false stops (busy within the window)", lambda s: f"{s['false_stops']:,}"),
        (
            f"stops with a person active <= {r.options.person_minutes} min before",
            lambda s: f"{s['person_active_stops']:,}",
        ),
        (f"stops followed by activity <= {wanted} min", lambda s: f"{s['stops_followed_by_activity']:,}"),
        ("  as a share of stops (unwanted stops)", lambda s: _num(s["unwanted_stop_share"], "{:.1%}")),
        ("warnings", lambda s: f"{s['warnings'] + s['silent_warnings']:,}"),
        ("warnings that led to no stop", lambda s: f"{s['warnings_without_stop']:,}"),
        ("  as a share of warnings", lambda s: _num(s["warnings_without_stop_share"], "{:.1%}")),
        ("warnings per machine-day", lambda s: _num(s["warnings_per_machine_day"], "{:.2f}")),
        ("messages per owner-day", lambda s: _num(s["messages_per_owner_day"], "{:.2f}")),
        (f"snoozes (assumed rate {r.options.snooze_rate:.0%})", lambda s: f"{s['snoozes']:,}"),
        ("dollars saved", lambda s: money(s["dollars_saved"])),
        ("unpriced recovered hours", lambda s: _num(s["unpriced_hours"])),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [max(len(name), 12) for name, _ in columns]
    lines = [
        f"replay of {trace.source}: {reaper['machines']} machines, {reaper['machine_days']:,.1f} machine-days, "
        f"a sweep every {trace.period_seconds // 60} min ({r.seconds:.1f} s)",
        f"policy ({r.options.policies.source}): {r.options.policies.describe()}",
    ]
    if trace.notes:
        lines.append(f"input: {'; '.join(trace.notes)}")
    for team in sorted(r.options.policies.teams):
        lines.append(f"  team {team}: {r.options.policies.describe(team)}")
    lines.append(f"prices: {r.price_source or 'unknown (no usable price table)'}")
    lines.append("")
    lines.append(" " * label_w + "  " + "  ".join(n.rjust(w) for (n, _), w in zip(columns, col_w, strict=True)))
    for label, fmt in rows:
        cells = "  ".join(fmt(s).rjust(w) for (_, s), w in zip(columns, col_w, strict=True))
        lines.append(f"{label.ljust(label_w)}  {cells}")

    lines.append("")
    team_header = ("TEAM", "MACHINES", "IDLE H", "RECOVERED H", "DOLLARS", "WARNINGS", "STOPS", "FALSE")
    team_rows = []
    for name, totals in sorted(r.reaper.teams.items()):
        s = r.reaper.summary(totals)
        team_rows.append(
            (
                name,
                str(s["machines"]),
                _num(s["idle_hours"]),
                _num(s["recovered_hours"]),
                money(s["dollars_saved"]),
                str(s["warnings"]),
                str(s["stops"]),
                str(s["false_stops"]),
            )
        )
    widths = [max(len(row[i]) for row in [team_header, *team_rows]) for i in range(len(team_header))]
    lines.append("idle-reaper per team:")
    for row in [team_header, *team_rows]:
        lines.append(
            "  "
            + "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        )

    for result in [r.reaper, *([r.baseline] if r.baseline else [])]:
        notable = [e for e in result.stops if e.false_stop] + [
            e
            for e in result.stops
            if not e.false_stop and e.resumed_after_minutes is not None and e.resumed_after_minutes <= wanted
        ]
        if notable:
            lines.append("")
            lines.append(f"{result.name}: false stops and stops followed by activity (first {max_events}):")
            for e in notable[:max_events]:
                tag = "FALSE STOP" if e.false_stop else "wanted back"
                back = "" if e.resumed_after_minutes is None else f", activity {e.resumed_after_minutes:.0f} min later"
                lines.append(f"  {e.at:%Y-%m-%d %H:%M} {e.instance_id} {tag}{back}: {e.reason[:110]}")
    return "\n".join(lines)


@dataclass(frozen=True)
class SweepPoint:
    """One policy setting of a --sweep-policy run: its label and its fleet figures."""

    label: str
    summary: dict[str, Any]
    recovery_vs_base: float | None  # recovered hours / the ideal under the first setting's window


def time_halves(trace: Trace) -> list[tuple[str, tuple[int, int]]]:
    """The trace's days cut in two at the UTC midnight nearest its middle (--split time): a label and the
    absolute buckets [first, end) of each half."""
    first = min((s.first_bucket for s in trace.series), default=0)
    end = max((s.first_bucket + len(s) for s in trace.series), default=0)
    per_day = 86400 // trace.period_seconds
    middle = round((first + end) / 2 / per_day) * per_day
    middle = min(max(middle, first), end)
    spans = [(first, middle), (middle, end)]

    def day(bucket: int) -> str:
        return datetime.fromtimestamp(bucket * trace.period_seconds, UTC).strftime("%Y-%m-%d")

    return [
        (f"{name} half judged ({day(lo)} to {day(hi)})", (lo, hi))
        for name, (lo, hi) in zip(("first", "second"), spans, strict=True)
    ]


def sweep_policies(trace: Trace, options: ReplayOptions, overrides: Sequence[str]) -> list[SweepPoint]:
    """The replay under the given policy, then under each override (a JSON object of team-policy fields
    merged over it, as an SSM team parameter is), for a Pareto plot: recovery against unwanted stops.
    Recovery is measured against the ideal of the unchanged policy, so settings with longer waits show
    what they give up. Raises PolicyError naming the bad override."""
    base = options.policies
    settings: list[tuple[str, PolicySet]] = [("as given", base)]
    for i, text in enumerate(overrides):
        name = f"--sweep-policy #{i + 1}"
        default = parse_team_policy(name, text, base.default)
        teams = {t: parse_team_policy(f"{name} teams.{t}", text, p) for t, p in base.teams.items()}
        settings.append((" ".join(text.split()), replace(base, default=default, teams=teams)))
    points: list[SweepPoint] = []
    base_ideal: float | None = None
    for label, policies in settings:
        summary = replay(trace, replace(options, policies=policies, timeline=False), prices=None).reaper.summary()
        if base_ideal is None:
            base_ideal = summary["ideal_hours"]
        ratio = round(summary["recovered_hours"] / base_ideal, 4) if base_ideal else None
        points.append(SweepPoint(label, summary, ratio))
    return points


def format_sweep(points: Sequence[SweepPoint], unwanted_within: int) -> str:
    header = (
        "setting",
        "recovered h",
        "recovery",
        "stops",
        f"unwanted (<= {unwanted_within} min)",
        "warnings without stop",
        "false stops",
    )
    rows = [
        (
            p.label,
            _num(p.summary["recovered_hours"]),
            _num(p.recovery_vs_base, "{:.1%}"),
            f"{p.summary['stops']:,}",
            _num(p.summary["unwanted_stop_share"], "{:.1%}"),
            _num(p.summary["warnings_without_stop_share"], "{:.1%}"),
            f"{p.summary['false_stops']:,}",
        )
        for p in points
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["recovery is against the ideal of the first setting (the policy as given)"]
    for row in [header, *rows]:
        lines.append(
            "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        )
    return "\n".join(lines)
