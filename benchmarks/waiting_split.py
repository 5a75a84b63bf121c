"""Time-of-day waiting, chosen and judged on an honest split (docs/replay.md, "Time-of-day waiting").

1. Tuning (--tune): every setting of the grid below replayed with `--split time`: each half of the days
   scored alone (machines are still swept over the whole trace). A setting is chosen on one half (the
   highest recovery among those with unwanted stops <= 10 % and warnings that led to no stop <= 8 %; if
   none, the lowest sum of the two among those with recovery >= 95 %) and judged on the other half.
   Never odd/even VMs: 59 of Bitbrains' 100 VMs are look-alike groups.
2. The Pareto points (--pareto): the fixed window, today's learned waiting and the time-of-day wait,
   each at several settings, on the whole trace; on Bitbrains and on the sample trace with people.
   With --plot OUT.png the curve (unwanted stops and warnings for nothing against recovery).

    python benchmarks/waiting_split.py --tune [--json OUT]
    python benchmarks/waiting_split.py --pareto [--plot docs/pareto-waiting.png] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.replay import PolicySet, ReplayOptions, Trace, read_trace, replay
from idle_reaper_tools.replay.report import time_halves
from idle_reaper_tools.replay.simulate import STOPPED, simulate_fleet
from idle_reaper_tools.replay.truth import classify

ROOT = Path(__file__).resolve().parent.parent
PEOPLE = ROOT / "testkit" / "sample-trace-people.csv.gz"
BITBRAINS = ROOT.parent / "shared" / "traces" / "bitbrains-rnd-2013-07-100vms.csv.gz"
KEYS = (
    "recovered_hours",
    "ideal_hours",
    "recovery_ratio",
    "stops",
    "false_stops",
    "unwanted_stop_share",
    "warnings",
    "warnings_without_stop_share",
)
GRID = {
    "time_of_day_wait_percent": (20, 30, 45, 60, 75),
    "time_of_day_horizon_minutes": (90, 120),
    "adaptive_wait_max_minutes": (120, 180, 240),
}
FIXED = [{"idle_minutes": m, "adaptive_wait_max_minutes": 0} for m in (90, 120, 150, 180, 240, 360)]
LEARNED = [{"time_of_day_wait_percent": 0, "adaptive_wait_max_minutes": m} for m in (60, 120, 240)]
TIME_OF_DAY = [
    {"time_of_day_wait_percent": p, "adaptive_wait_max_minutes": m} for p in (30, 45, 60) for m in (60, 120, 180, 240)
]


def figures(trace: Trace, fields: dict[str, Any], judged: tuple[int, int] | None = None) -> dict[str, Any]:
    policy = TeamPolicy.model_validate({**TeamPolicy().model_dump(), **fields})
    summary = replay(trace, ReplayOptions(policies=PolicySet(default=policy), judged=judged), prices=None)
    return {k: summary.reaper.summary()[k] for k in KEYS}


def acceptable(f: dict[str, Any]) -> bool:
    return (f["unwanted_stop_share"] or 0) <= 0.10 and (f["warnings_without_stop_share"] or 0) <= 0.08


def choose(rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The setting a tuner would pick from these figures (see the module's docstring)."""
    ok = [(s, f) for s, f in rows if acceptable(f) and (f["recovery_ratio"] or 0) >= 0.95]
    if ok:
        return max(ok, key=lambda r: r[1]["recovery_ratio"] or 0)[0]
    near = [(s, f) for s, f in rows if (f["recovery_ratio"] or 0) >= 0.95] or rows
    return min(near, key=lambda r: (r[1]["unwanted_stop_share"] or 0) + (r[1]["warnings_without_stop_share"] or 0))[0]


def tune(trace: Trace, grid: dict[str, tuple[int, ...]] = GRID) -> dict[str, Any]:
    settings = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    halves = time_halves(trace)
    table = {label: [(s, figures(trace, s, span)) for s in settings] for label, span in halves}
    out: dict[str, Any] = {"grid": [], "choices": []}
    for s, *per_half in zip(settings, *(table[label] for label, _ in halves), strict=True):
        out["grid"].append({"setting": s, **{label: f for (label, _), (_, f) in zip(halves, per_half, strict=True)}})
        print(json.dumps(s), *(f"{label[:6]}: {fmt(f)}" for (label, _), (_, f) in zip(halves, per_half, strict=True)))
    for (tuned, _), (judged, _) in (halves, halves[::-1]):
        chosen = choose(table[tuned])
        result = next(f for s, f in table[judged] if s == chosen)
        out["choices"].append({"tuned_on": tuned, "judged_on": judged, "setting": chosen, "judged": result})
        print(f"tuned on {tuned}: {json.dumps(chosen)} -> judged on {judged}: {fmt(result)}")
    return out


def unstopped(trace: Trace, fields: dict[str, Any]) -> dict[str, int]:
    """Quiet stretches (covered, below every threshold) that outlast the longest any wait may hold a stop
    (idle_minutes + adaptive_wait_max_minutes, plus a period for the sweep) while the replayed machine is
    never stopped in them: what a wait beyond what a sweep observes would leave. Should be 0."""
    policy = TeamPolicy.model_validate({**TeamPolicy().model_dump(), **fields})
    options = ReplayOptions(policies=PolicySet(default=policy), timeline=True)
    bound = (policy.idle_minutes + (policy.adaptive_wait_max_minutes or 0)) * 60 // trace.period_seconds + 2
    long_ones = left = 0
    for series, (run, _) in zip(trace.series, simulate_fleet(trace, options, workers=None), strict=True):
        quiet = classify(series, policy, trace.period_seconds, options.policies.gpu_families).quiet
        timeline = run.timeline or bytearray()
        start = None
        for i in range(len(quiet) + 1):
            if i < len(quiet) and quiet[i]:
                start = i if start is None else start
                continue
            if start is not None and i - start > bound:
                long_ones += 1
                left += STOPPED not in timeline[start:i]
            start = None
    return {"stretches_longer_than_the_bound": long_ones, "left_unstopped": left}


def fmt(f: dict[str, Any]) -> str:
    return (
        f"recovery {f['recovery_ratio']:.1%} stops {f['stops']} unwanted {f['unwanted_stop_share']:.1%} "
        f"warnings without stop {f['warnings_without_stop_share']:.1%} false {f['false_stops']}"
    )


def pareto(traces: dict[str, Trace]) -> dict[str, Any]:
    rules = {"fixed window": FIXED, "learned waiting (today)": LEARNED, "time-of-day wait": TIME_OF_DAY}
    out: dict[str, Any] = {}
    for name, trace in traces.items():
        out[name] = {}
        base_ideal = figures(trace, {})["ideal_hours"]  # recovery of every setting against the 90-min window's ideal
        for rule, settings in rules.items():
            out[name][rule] = []
            for s in settings:
                f = figures(trace, s)
                f["recovery_ratio"] = round(f["recovered_hours"] / base_ideal, 4)
                out[name][rule].append({"setting": s, **f})
                print(name, rule, json.dumps(s), fmt(f), flush=True)
    return out


def plot(points: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(points), figsize=(6 * len(points), 8), squeeze=False)
    markers = {"fixed window": "s", "learned waiting (today)": "^", "time-of-day wait": "o"}
    for col, (name, rules) in enumerate(points.items()):
        for row, (key, label) in enumerate(
            (
                ("unwanted_stop_share", "unwanted stops (share of stops)"),
                ("warnings_without_stop_share", "warnings that led to no stop"),
            )
        ):
            ax = axes[row][col]
            for rule, rows in rules.items():
                xs = [r["recovery_ratio"] for r in rows]
                ys = [r[key] for r in rows]
                ax.scatter(xs, ys, marker=markers[rule], label=rule)
            ax.set_xlabel("recovery (of the ideal of the 90-min window)")
            ax.set_ylabel(label)
            ax.set_title(f"{name}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--pareto", action="store_true")
    parser.add_argument("--unstopped", action="store_true", help="count long quiet stretches never stopped")
    parser.add_argument("--bitbrains", type=Path, default=BITBRAINS)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--grid", type=json.loads, help="a JSON object of field: [values] instead of the grid above")
    args = parser.parse_args(argv)
    if not args.bitbrains.exists():
        print(f"{args.bitbrains} not found", file=sys.stderr)
        return 2
    bitbrains = read_trace(args.bitbrains, clamp_utilization=True, skip_duplicates=True)
    out: dict[str, Any] = {}
    if args.tune:
        out["tune"] = tune(bitbrains, {k: tuple(v) for k, v in args.grid.items()} if args.grid else GRID)
    if args.pareto:
        out["pareto"] = pareto({"Bitbrains": bitbrains, "sample with people": read_trace(PEOPLE)})
        if args.plot:
            plot(out["pareto"], args.plot)
    if args.unstopped:
        out["unstopped"] = {
            name: unstopped(bitbrains, fields)
            for name, fields in (
                ("default policy", {}),
                ("learned waiting, up to 240 min", {"time_of_day_wait_percent": 0, "adaptive_wait_max_minutes": 240}),
            )
        }
        print(json.dumps(out["unstopped"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
