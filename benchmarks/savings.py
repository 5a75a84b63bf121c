"""What idle-reaper saves, and what the AWS-native alternative costs in broken work; and how fast replay is.

1. The shipped sample trace (testkit/sample-trace.csv.gz, see testkit/generate_trace.py) replayed through the
   real decision core, side by side with a CloudWatch alarm that stops an instance when CPU stays under
   the threshold for the idle window (no GPU, no warning): recovered hours, false stops, dollars.
2. Before and after the fewer-unwanted-stops work, side by side: "before" turns off the human-activity
   signal and learned waiting (human_active_minutes 0, adaptive_wait_max_minutes 0), "after" is the
   default policy. On the Bitbrains trace (../shared/traces, --clamp-utilization --skip-duplicates; the
   whole trace and each half of its days scored alone, as `replay --split time`) and on the sample trace
   with people (testkit/sample-trace-people.csv.gz).
3. Replay speed: a generated fleet of 1,000 machines over 7 days at 5-minute samples, from the CSV
   file to the report: the realistic fleet (no rows while an owner has a machine stopped) and the
   densest one (every machine reports every period: 2 million rows). The target is under a minute on
   2 cores; the script exits 1 when either is slower.

    python benchmarks/savings.py [--trace FILE] [--bitbrains FILE] [--machines 1000] [--days 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.replay import PolicySet, ReplayOptions, Trace, read_trace, replay
from idle_reaper_tools.replay.report import time_halves

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from testkit.generate_trace import generate  # (runs as a script: the repo root is not on the path)

SAMPLE = Path(__file__).resolve().parent.parent / "testkit" / "sample-trace.csv.gz"
PEOPLE = SAMPLE.with_name("sample-trace-people.csv.gz")
BITBRAINS = Path(__file__).resolve().parents[2] / "shared" / "traces" / "bitbrains-rnd-2013-07-100vms.csv.gz"
BEFORE = TeamPolicy(human_active_minutes=0, adaptive_wait_max_minutes=0)
BEFORE_AFTER_KEYS = (
    ("recovery_ratio", "recovery (of the ideal)", "{:.1%}"),
    ("stops", "stops", "{:,}"),
    ("false_stops", "false stops", "{:,}"),
    ("person_active_stops", "stops, a person active <= 30 min before", "{:,}"),
    ("unwanted_stop_share", "unwanted stops (back <= 60 min)", "{:.1%}"),
    ("warnings", "warnings", "{:,}"),
    ("warnings_without_stop_share", "warnings that led to no stop", "{:.1%}"),
    ("messages_per_owner_day", "messages per owner-day", "{:.2f}"),
)
TARGET_SECONDS = 60.0


def compare(path: Path) -> dict[str, Any]:
    trace = read_trace(path)
    result = replay(trace, ReplayOptions(), baseline="cloudwatch-cpu")
    return result.to_json()


def before_after(trace: Trace, judged: tuple[int, int] | None = None) -> dict[str, dict[str, Any]]:
    """The fleet figures under the old behaviour and under the default policy (scored on `judged` only:
    a half of the days, as `replay --split time`)."""
    return {
        name: replay(trace, ReplayOptions(policies=policies, judged=judged), prices=None).reaper.summary()
        for name, policies in (("before", PolicySet(default=BEFORE)), ("after", PolicySet()))
    }


def print_before_after(name: str, figures: dict[str, dict[str, Any]]) -> None:
    print(f"Before / after on {name}")
    for key, label, fmt in BEFORE_AFTER_KEYS:
        print(_row(label, figures["before"][key], figures["after"][key], fmt))
    print()


def timing(machines: int, days: int, always_on: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fleet.csv"
        started = time.perf_counter()
        rows = generate(path, machines, days, seed=11, always_on=always_on)
        generated = time.perf_counter() - started
        size = path.stat().st_size
        started = time.perf_counter()
        trace = read_trace(path)
        parsed = time.perf_counter() - started
        result = replay(trace, ReplayOptions())
        total = time.perf_counter() - started
    summary = result.reaper.summary()
    periods = sum(len(s) for s in trace.series)
    return {
        "fleet": "densest (always on)" if always_on else "realistic",
        "machines": machines,
        "days": days,
        "rows": rows,
        "file_mb": round(size / 1e6, 1),
        "machine_periods": periods,
        "core_calls": summary["core_calls"],
        "generate_seconds": round(generated, 2),
        "parse_seconds": round(parsed, 2),
        "replay_seconds": round(result.seconds, 2),
        "total_seconds": round(total, 2),
        "recovered_hours": summary["recovered_hours"],
        "false_stops": summary["false_stops"],
    }


def _row(label: str, a: Any, b: Any, fmt: str = "{:,.1f}") -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "unknown"
        return fmt.format(v) if isinstance(v, int | float) else str(v)

    return f"  {label:<40}{cell(a):>16}{cell(b):>24}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=SAMPLE, help="trace to compare on (default: the sample)")
    parser.add_argument("--bitbrains", type=Path, default=BITBRAINS, help="the Bitbrains trace (skipped if absent)")
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    report = compare(args.trace)
    base = report["baseline"]
    comparisons: dict[str, dict[str, dict[str, Any]]] = {}
    if args.bitbrains.exists():
        bitbrains = read_trace(args.bitbrains, clamp_utilization=True, skip_duplicates=True)
        comparisons[args.bitbrains.name] = before_after(bitbrains)
        # Judged on each half of the days, never on odd/even VMs: 59 of the 100 are look-alike groups.
        for label, span in time_halves(bitbrains):
            comparisons[f"{args.bitbrains.name}, {label}"] = before_after(bitbrains, span)
    comparisons[PEOPLE.name] = before_after(read_trace(PEOPLE))
    speeds = [timing(args.machines, args.days, always_on) for always_on in (False, True)]
    fast_enough = all(speed["total_seconds"] < TARGET_SECONDS for speed in speeds)
    if args.json:
        out = {"sample": report, "before_after": comparisons, "timing": speeds, "fast_enough": fast_enough}
        print(json.dumps(out, indent=2))
        return 0 if fast_enough else 1

    print(
        f"Savings on {args.trace.name}: {report['machines']} machines, {report['machine_days']:,.0f} machine-days, "
        f"default policy (idle 90 min, warn 30 min, CPU and GPU < 5 %)"
    )
    print(f"  {'':<40}{'idle-reaper':>16}{'CPU alarm (AWS-native)':>24}")
    print(_row("idle machine-hours in the trace", report["idle_hours"], base["idle_hours"]))
    print(_row("ideal recoverable hours", report["ideal_hours"], base["ideal_hours"]))
    print(_row("recovered hours", report["recovered_hours"], base["recovered_hours"]))
    print(_row("recovery ratio", report["recovery_ratio"], base["recovery_ratio"], "{:.1%}"))
    print(_row("stops", report["stops"], base["stops"], "{:,}"))
    print(_row("false stops (busy within the window)", report["false_stops"], base["false_stops"], "{:,}"))
    print(
        _row(
            "stops followed by activity <= 60 min",
            report["stops_followed_by_activity"],
            base["stops_followed_by_activity"],
            "{:,}",
        )
    )
    print(
        _row("warnings per machine-day", report["warnings_per_machine_day"], base["warnings_per_machine_day"], "{:.2f}")
    )
    print(_row("dollars saved", report["dollars_saved"], base["dollars_saved"], "${:,.0f}"))
    print()
    print("Dollars saved per team (idle-reaper / CPU alarm, false stops of the alarm):")
    for team, t in report["teams"].items():
        b = base["teams"][team]
        dollars = f"${t['dollars_saved']:>10,.0f}  ${b['dollars_saved']:>10,.0f}"
        print(f"  {team:<12}{dollars}  {b['false_stops']:>6,} false stops")
    print()
    print(f"  {'':<40}{'before':>16}{'after (default)':>24}")
    for name, figures in comparisons.items():
        print_before_after(name, figures)
    print(f"Replay speed: {args.machines:,} machines x {args.days} days at 5-min samples, CSV file to report")
    for speed in speeds:
        share = speed["core_calls"] / speed["machine_periods"] if speed["machine_periods"] else 0.0
        parse, run, total = speed["parse_seconds"], speed["replay_seconds"], speed["total_seconds"]
        print(f"  {speed['fleet']} fleet: {speed['rows']:,} rows ({speed['file_mb']} MB)")
        print(f"    parse {parse:.1f} s + replay {run:.1f} s = {total:.1f} s")
        print(
            f"    {speed['machine_periods']:,} machine-periods, {speed['core_calls']:,} assess+decide calls "
            f"({share:.0%}; the others: machine stopped, or the core's answer already determined)"
        )
    print(f"  target < {TARGET_SECONDS:.0f} s each: {'met' if fast_enough else 'MISSED'}")
    return 0 if fast_enough else 1


if __name__ == "__main__":
    raise SystemExit(main())
