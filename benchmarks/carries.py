"""Waiting that carries (issue 45): every waiting constant chosen where it cannot see what judges it.

Candidates: the fixed window (no waiting), the time-of-day wait (core/time_of_day.py: its threshold and how
long it may hold) and history waiting (core/waiting.py: its threshold, the fleet's prior, how much the prior
counts, the confidence). Each is replayed with the real core; a figure counts only what happened inside the
part of the trace it scores (`idle-reaper replay --split time` scores a half of the days the same way).

Three honest splits, each in both directions, and a trace never tuned on:
- time: Bitbrains' first half of the days vs the second (machines swept over the whole trace);
- machines: Bitbrains' VMs in two sides, look-alike machines (hourly series correlated >= 0.7,
  tools/idle_reaper_tools/replay/split.py) always on one side;
- Azure (tests/data/azure-v1-100vms.csv.gz): judged only, whole and halves, with what each split chose.

On the tuning part the choice is: the highest recovery among settings with unwanted stops <= 10 % and
warnings without a stop <= 8 % and recovery >= 95 %; if none, the lowest sum of the two among those with
recovery >= 95 %. Recovery is against the ideal of the 90-minute window (a longer fixed window gives up what
it does not stop). Then each constant of the chosen setting is dropped in turn (ablation): a constant whose
gain on the tuning part is not there on the judged part is dropped.

    python benchmarks/carries.py [--json OUT.json] [--plot docs/pareto-carries.png]
    python benchmarks/carries.py --from OUT.json --plot docs/pareto-carries.png   # plot again, no replay
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from idle_reaper.core import waiting
from idle_reaper.core.waiting import HistoryRule
from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.replay import PolicySet, ReplayOptions, Trace, read_trace, replay
from idle_reaper_tools.replay.report import time_halves
from idle_reaper_tools.replay.split import machine_sides, subset

ROOT = Path(__file__).resolve().parent.parent
BITBRAINS = ROOT.parent / "shared" / "traces" / "bitbrains-rnd-2013-07-100vms.csv.gz"
AZURE = ROOT / "tests" / "data" / "azure-v1-100vms.csv.gz"
TARGETS = {"unwanted_stop_share": 0.10, "warnings_without_stop_share": 0.08, "recovery": 0.95, "false_stops": 0}

Setting = dict[str, Any]  # {"label", "policy": {field: value}, "rule": {HistoryRule field: value}}


def _setting(label: str, policy: dict[str, Any], rule: dict[str, Any] | None = None) -> Setting:
    return {"label": label, "policy": policy, "rule": rule or {}}


def candidates() -> list[Setting]:
    """Eleven settings: a replay of Bitbrains takes 10-50 s (two cores, shared), and each is replayed on every
    part below. The time-of-day wait's horizon stays 90 min (120 held more for less recovery, docs/replay.md)."""
    out = [
        _setting(f"fixed {m} min", {"idle_minutes": m, "adaptive_wait_max_minutes": 0, "history_wait_percent": 0})
        for m in (90, 240)
    ]
    for p, most in ((30, 180), (45, 120), (45, 180), (45, 240), (60, 180)):
        policy = {"time_of_day_wait_percent": p, "adaptive_wait_max_minutes": most, "history_wait_percent": 0}
        out.append(_setting(f"time of day {p} % up to {most}", policy))
    for p, rule in (
        (35, {}),
        (45, {}),
        (55, {}),
        (45, {"prior_percent": 20, "prior_stretches": 1.0, "confidence": 0.5}),
    ):
        policy = {"history_wait_percent": p, "adaptive_wait_max_minutes": 180}
        label = f"history {p} %" + (" prior 20 x1 z 0.5" if rule else "")
        out.append(_setting(label, policy, rule))
    return out


def ablations(chosen: Setting) -> list[Setting]:
    """The chosen setting with one constant dropped at a time (its neutral value)."""
    policy, rule = chosen["policy"], chosen["rule"]
    if policy.get("history_wait_percent"):
        drops = {
            "no fleet prior": {"prior_stretches": 0.0},
            "no confidence (the estimate alone)": {"confidence": 0.0},
            "no time of day (every stretch counts whole)": {"other_time_weight": 1.0},
            "no change detection": {"recent": 1000},
        }
        return [_setting(f"{chosen['label']}, {name}", policy, {**rule, **d}) for name, d in drops.items()]
    if policy.get("time_of_day_wait_percent"):
        return [
            _setting(f"{chosen['label']}, no profile (learned waiting)", {**policy, "time_of_day_wait_percent": 0}),
            _setting(f"{chosen['label']}, no wait at all", {**policy, "adaptive_wait_max_minutes": 0}),
        ]
    return []


def run(trace: Trace, setting: Setting, span: tuple[int, int] | None, ideal: float | None) -> dict[str, Any]:
    policy = TeamPolicy.model_validate({**TeamPolicy().model_dump(), **setting["policy"]})
    waiting.RULE = HistoryRule(**setting["rule"])  # the replay's worker processes fork with it
    summary = replay(trace, ReplayOptions(policies=PolicySet(default=policy), judged=span), prices=None)
    s = summary.reaper.summary()
    out = {
        k: s[k]
        for k in (
            "recovered_hours",
            "ideal_hours",
            "stops",
            "false_stops",
            "unwanted_stop_share",
            "warnings",
            "warnings_without_stop_share",
        )
    }
    out["recovery"] = round(s["recovered_hours"] / ideal, 4) if ideal else s["recovery_ratio"]
    out["unwanted_stop_share"] = out["unwanted_stop_share"] or 0.0
    out["warnings_without_stop_share"] = out["warnings_without_stop_share"] or 0.0
    return out


def fmt(f: dict[str, Any]) -> str:
    return (
        f"recovery {f['recovery']:.1%}  stops {f['stops']:,}  unwanted {f['unwanted_stop_share']:.1%}  "
        f"warnings without stop {f['warnings_without_stop_share']:.1%}  false {f['false_stops']}"
    )


def meets(f: dict[str, Any]) -> bool:
    return (
        f["unwanted_stop_share"] <= TARGETS["unwanted_stop_share"]
        and f["warnings_without_stop_share"] <= TARGETS["warnings_without_stop_share"]
        and f["recovery"] >= TARGETS["recovery"]
    )


def choose(rows: list[tuple[Setting, dict[str, Any]]]) -> Setting:
    ok = [r for r in rows if meets(r[1]) and r[1]["false_stops"] == 0]
    if ok:
        return max(ok, key=lambda r: r[1]["recovery"])[0]
    near = [r for r in rows if r[1]["recovery"] >= TARGETS["recovery"]] or rows
    return min(near, key=lambda r: r[1]["unwanted_stop_share"] + r[1]["warnings_without_stop_share"])[0]


def against_targets(f: dict[str, Any]) -> list[str]:
    """Each target, met or missed by how much."""
    out = []
    for key, limit, word in (
        ("unwanted_stop_share", TARGETS["unwanted_stop_share"], "unwanted stops"),
        ("warnings_without_stop_share", TARGETS["warnings_without_stop_share"], "warnings without a stop"),
    ):
        v = f[key]
        out.append(f"{word} {v:.1%} <= {limit:.0%}: " + ("met" if v <= limit else f"missed by {v - limit:.1%}"))
    v = f["recovery"]
    out.append(f"recovery {v:.3f} >= 0.95: " + ("met" if v >= 0.95 else f"missed by {0.95 - v:.3f}"))
    out.append(f"false stops {f['false_stops']} = 0: " + ("met" if f["false_stops"] == 0 else "MISSED"))
    return out


CACHE: Path | None = None  # --cache: each replay's figures kept as a JSON line, so a run stopped goes on


def _cached() -> dict[str, dict[str, Any]]:
    if CACHE is None or not CACHE.exists():
        return {}
    return {(row := json.loads(line))["key"]: row["figures"] for line in CACHE.read_text().splitlines() if line}


class Part:
    """A part of a trace that figures are scored on: some machines, some days."""

    def __init__(self, name: str, trace: Trace, span: tuple[int, int] | None) -> None:
        self.name, self.trace, self.span = name, trace, span
        self.cache = _cached()
        self.ideal = 0.0
        self.ideal = self.figures(_setting("the 90-min window's ideal", {}), ideal=None)["ideal_hours"]

    def figures(self, setting: Setting, ideal: float | None = 0.0) -> dict[str, Any]:
        key = json.dumps([self.name, setting["policy"], setting["rule"]], sort_keys=True)
        if key not in self.cache:
            self.cache[key] = run(self.trace, setting, self.span, self.ideal if ideal is not None else None)
            print(f"  {self.name:<40} {setting['label']:<44} {fmt(self.cache[key])}", flush=True)
            if CACHE is not None:
                with CACHE.open("a") as f:
                    f.write(json.dumps({"key": key, "figures": self.cache[key]}) + "\n")
        return self.cache[key]


def split_result(tune: Part, judge: list[Part], grid: list[Setting]) -> dict[str, Any]:
    rows = [(s, tune.figures(s)) for s in grid]
    chosen = choose(rows)
    tuned = tune.figures(chosen)
    out: dict[str, Any] = {
        "tuned_on": tune.name,
        "chosen": chosen,
        "tuned": tuned,
        "grid": [{"setting": s, "figures": f} for s, f in rows],
        "judged": {},
        "ablations": [],
    }
    for part in judge:
        out["judged"][part.name] = part.figures(chosen)
    main = judge[0]
    for dropped in ablations(chosen):
        t, j = tune.figures(dropped), main.figures(dropped)
        out["ablations"].append({"setting": dropped, "tuned": t, "judged": j})
    return out


def report(results: dict[str, Any]) -> None:
    print("\n== What each split chose, its tuning figures and its judged figures")
    for name, r in results["splits"].items():
        print(f"\n{name}: tuned on {r['tuned_on']}: chose {r['chosen']['label']}")
        print(f"  tuning figures : {fmt(r['tuned'])}")
        for part, f in r["judged"].items():
            print(f"  judged on {part}: {fmt(f)}")
            for line in against_targets(f):
                print(f"      {line}")
        for a in r["ablations"]:
            gain_t = _score(r["tuned"]) - _score(a["tuned"])
            gain_j = _score(next(iter(r["judged"].values()))) - _score(a["judged"])
            verdict = (
                "keep" if gain_j > 0 else ("only helps on the tuning part: drop" if gain_t > 0 else "no gain: drop")
            )
            print(
                f"  ablation {a['setting']['label']}: tuning {fmt(a['tuned'])}; judged {fmt(a['judged'])} -> {verdict}"
            )


def _score(f: dict[str, Any]) -> float:
    """One number for an ablation's verdict: recovery less the two shares' excess over their targets."""
    excess = max(0.0, f["unwanted_stop_share"] - 0.10) + max(0.0, f["warnings_without_stop_share"] - 0.08)
    return f["recovery"] - 2 * excess - max(0.0, 0.95 - f["recovery"])


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = results["splits"]["time, first half -> second half"]
    azure = results["azure_curve"]
    columns = [
        ("Bitbrains, first half of the days (tuned on)", r["grid"]),
        ("Bitbrains, second half (judged)", results["second_half_curve"]),
        ("Azure, 100 VMs (never tuned on)", azure),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9), squeeze=False)
    markers = {"fixed": "s", "time": "o", "history": "^"}
    chosen = json.dumps([r["chosen"]["policy"], r["chosen"]["rule"]], sort_keys=True)
    for col, (title, rows) in enumerate(columns):
        for row, (key, label) in enumerate(
            (
                ("unwanted_stop_share", "unwanted stops (share of stops)"),
                ("warnings_without_stop_share", "warnings without a stop"),
            )
        ):
            ax = axes[row][col]
            for kind, marker in markers.items():
                pts = [x for x in rows if x["setting"]["label"].startswith(kind)]
                ax.scatter(
                    [x["figures"]["recovery"] for x in pts],
                    [x["figures"][key] for x in pts],
                    marker=marker,
                    label={"fixed": "fixed window", "time": "time-of-day wait", "history": "history waiting"}[kind],
                    alpha=0.8,
                )
            for x in rows:
                if json.dumps([x["setting"]["policy"], x["setting"]["rule"]], sort_keys=True) == chosen:
                    ax.scatter(
                        [x["figures"]["recovery"]], [x["figures"][key]], s=220, facecolors="none", edgecolors="red"
                    )
            ax.axhline(0.10 if row == 0 else 0.08, color="grey", linestyle="--", linewidth=0.8)
            ax.axvline(0.95, color="grey", linestyle=":", linewidth=0.8)
            ax.set_xlabel("recovery (of the 90-min window's ideal)")
            ax.set_ylabel(label)
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.suptitle(
        "Tuned and judged: every setting; red circle: the one chosen on the first half; dashed: targets", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def shallow_quiet(trace: Trace) -> list[dict[str, Any]]:
    """Why a trace's quiet stretches end soon: of the quiet stretches that reached 90 min (the default
    window), the share that ended within the next 90 min (a warning for nothing or an unwanted stop under any
    wait that warns then), by the highest CPU of their first hour. No replay: the trace's own quiet."""
    from idle_reaper_tools.replay.truth import classify

    policy = TeamPolicy()
    per_hour = 3600 // trace.period_seconds
    bands = ((0.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 4.5), (4.5, 5.0))
    counts = {band: [0, 0] for band in bands}
    for series in trace.series:
        quiet = classify(series, policy, trace.period_seconds, ()).quiet
        start = None
        for i in range(len(quiet) + 1):
            if i < len(quiet) and quiet[i]:
                start = i if start is None else start
                continue
            if start is not None and (i - start) >= 18 and i < len(quiet):
                first = [v for v in series.cpu[start : start + per_hour] if v == v]
                peak = max(first, default=0.0)
                band = next((b for b in bands if b[0] <= peak < b[1]), bands[-1])
                counts[band][0] += (i - start) < 36
                counts[band][1] += 1
            start = None
    return [
        {"cpu_peak_first_hour": f"{lo:g}-{hi:g} %", "ended_soon": s, "reached_90_min": n}
        for (lo, hi), (s, n) in counts.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--from", dest="source", type=Path, help="report and plot a saved --json, no replay")
    parser.add_argument("--why", action="store_true", help="only the quiet stretches' table (shallow_quiet), no replay")
    parser.add_argument("--cache", type=Path, help="keep each replay's figures here (JSON lines) and reuse them")
    args = parser.parse_args(argv)
    global CACHE
    CACHE = args.cache
    if args.why:
        for name, path in (("Bitbrains", BITBRAINS), ("Azure", AZURE)):
            kw = {"clamp_utilization": True, "skip_duplicates": True} if path == BITBRAINS else {}
            for row in shallow_quiet(read_trace(path, **kw)):
                soon, n = row["ended_soon"], row["reached_90_min"]
                share = f"{soon / n:.0%}" if n else "-"
                print(f"{name:<10} CPU peak {row['cpu_peak_first_hour']:<9} {soon:>4} of {n:>4} ended soon ({share})")
        return 0
    if args.source:
        results = json.loads(args.source.read_text())
    else:
        if not BITBRAINS.exists():
            print(f"{BITBRAINS} not found", file=sys.stderr)
            return 2
        started = time.perf_counter()
        results = measure()
        results["seconds"] = round(time.perf_counter() - started)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    report(results)
    if args.plot:
        plot(results, args.plot)
    return 0


def measure() -> dict[str, Any]:
    bb = read_trace(BITBRAINS, clamp_utilization=True, skip_duplicates=True)
    az = read_trace(AZURE)
    sides = machine_sides(bb)
    print(f"look-alike groups: {[len(g) for g in sides.groups if len(g) > 1]}; sides {len(sides.a)} / {len(sides.b)}")
    (_, first), (_, second) = time_halves(bb)
    (_, az_first), (_, az_second) = time_halves(az)
    a, b = subset(bb, sides.a), subset(bb, sides.b)
    parts = {
        "bb first": Part("Bitbrains first half", bb, first),
        "bb second": Part("Bitbrains second half", bb, second),
        "side a": Part("Bitbrains side a", a, None),
        "side b": Part("Bitbrains side b", b, None),
        "az": Part("Azure, whole", az, None),
        "az first": Part("Azure, first half", az, az_first),
        "az second": Part("Azure, second half", az, az_second),
    }
    azure = [parts["az"], parts["az first"], parts["az second"]]
    grid = candidates()
    splits = {
        "time, first half -> second half": split_result(parts["bb first"], [parts["bb second"], *azure], grid),
        "time, second half -> first half": split_result(parts["bb second"], [parts["bb first"], *azure], grid),
        "machines, side a -> side b": split_result(parts["side a"], [parts["side b"], *azure], grid),
        "machines, side b -> side a": split_result(parts["side b"], [parts["side a"], *azure], grid),
    }
    return {
        "look_alike_groups": [list(g) for g in sides.groups if len(g) > 1],
        "sides": {"a": sorted(sides.a), "b": sorted(sides.b)},
        "splits": splits,
        "second_half_curve": [{"setting": s, "figures": parts["bb second"].figures(s)} for s in grid],
        "azure_curve": [{"setting": s, "figures": parts["az"].figures(s)} for s in grid],
        "rule_fields": [f.name for f in dataclass_fields(HistoryRule)],
    }


if __name__ == "__main__":
    sys.exit(main())
