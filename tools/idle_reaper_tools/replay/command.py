"""`idle-reaper replay`: the command's argument types and its wiring (the parser is in cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from idle_reaper.core.waiting import WaitingRule
from idle_reaper.policy import PolicyError
from idle_reaper.pricing import DEFAULT_PRICES, load_price_table
from idle_reaper_tools.replay.plotting import plot, plot_sweep
from idle_reaper_tools.replay.policies import load_policies
from idle_reaper_tools.replay.report import format_report, format_sweep, replay, sweep_policies, time_halves
from idle_reaper_tools.replay.simulate import ReplayOptions
from idle_reaper_tools.replay.split import machine_sides, subset
from idle_reaper_tools.replay.trace import Trace, TraceError, read_trace


def snooze_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction from 0 to 1, got {text}")
    return value


def _whole_minutes(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of minutes: {text!r}") from None


def positive_minutes(text: str) -> int:
    value = _whole_minutes(text)
    if not 1 <= value <= 60:
        raise argparse.ArgumentTypeError(f"from 1 to 60 minutes, got {value}")
    return value


def non_negative_minutes(text: str) -> int:
    value = _whole_minutes(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"0 or more minutes, got {value}")
    return value


def waiting_rule(text: str) -> WaitingRule:
    """--waiting: a JSON object of WaitingRule fields (core/waiting.py), the rest left at the sweep's own."""
    try:
        return WaitingRule.model_validate_json(text)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'JSON'}: {e['msg']}" for e in exc.errors())
        raise argparse.ArgumentTypeError(f"invalid waiting rule: {errors}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"idle-reaper replay: {message}", file=sys.stderr)
        return 2

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail("--plot needs matplotlib: pip install 'idle-reaper[plot]'")
    try:
        policies = load_policies(args.policy)
    except PolicyError as exc:
        return fail(f"invalid policy: {exc}")
    prices: dict[str, float] | None = DEFAULT_PRICES
    price_source: str | None = "built-in on-demand prices (us-east-1, Linux)"
    if args.price_table:
        try:
            prices = load_price_table(args.price_table)
            price_source = str(args.price_table)
        except ValueError as exc:
            prices = None
            print(f"idle-reaper replay: {exc}; savings are reported as unknown", file=sys.stderr)
    try:
        trace = read_trace(
            args.trace,
            args.period_minutes,
            clamp_utilization=args.clamp_utilization,
            skip_duplicates=args.skip_duplicates,
        )
    except TraceError as exc:
        return fail(str(exc))
    if policies.default.network_threshold_bytes_per_second is not None and not trace.has_network:
        print(
            "idle-reaper replay: the policy judges network but the trace has no network column; "
            "every machine will be unknown",
            file=sys.stderr,
        )
    options = ReplayOptions(
        policies=policies,
        still_wanted_minutes=args.still_wanted_minutes,
        snooze_rate=args.snooze_rate,
        seed=args.seed,
        default_instance_type=args.instance_type,
        timeline=bool(args.plot),
        waiting=args.waiting,
    )
    if args.split:
        return _split(args, trace, options, fail, prices, price_source)
    if args.sweep_policy:
        return _sweep(args, trace, options, fail)
    result = replay(trace, options, prices=prices, price_source=price_source, baseline=args.baseline)
    try:
        print(json.dumps(result.to_json(), indent=2) if args.json else format_report(result), flush=True)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.plot:
        plot(result, args.plot)
        print(f"idle-reaper replay: plot written to {args.plot}", file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace, trace: Trace, options: ReplayOptions, fail: Callable[[str], int]) -> int:
    """--sweep-policy: the replay under each setting, a table (or JSON) and, with --plot, the Pareto PNG."""
    try:
        points = sweep_policies(trace, options, args.sweep_policy)
    except PolicyError as exc:
        return fail(f"invalid --sweep-policy: {exc}")
    if args.json:
        rows = [{"setting": p.label, "recovery_vs_first": p.recovery_vs_base, **p.summary} for p in points]
        print(json.dumps({"trace": trace.source, "settings": rows}, indent=2))
    else:
        print(format_sweep(points, args.still_wanted_minutes))
    if args.plot:
        plot_sweep(points, f"Policy settings on {Path(trace.source).name}", args.plot)
        print(f"idle-reaper replay: plot written to {args.plot}", file=sys.stderr)
    return 0


def _split(
    args: argparse.Namespace,
    trace: Trace,
    options: ReplayOptions,
    fail: Callable[[str], int],
    prices: dict[str, float] | None,
    price_source: str | None,
) -> int:
    """--split time: the report (or the --sweep-policy table) once per half of the days, each half scored
    alone while every machine is swept over the whole trace, as in production. --split machines: once per
    side of the machines, look-alike machines always on one side (replay/split.py)."""
    halves: list[dict[str, object]] = []
    parts: list[tuple[str, Trace, tuple[int, int] | None]]
    if args.split == "machines":
        sides = machine_sides(trace)
        parts = [
            (f"side {name} judged ({len(ids)} machines; look-alikes kept on one side)", subset(trace, ids), None)
            for name, ids in (("a", sides.a), ("b", sides.b))
        ]
    else:
        parts = [(label, trace, span) for label, span in time_halves(trace)]
    for label, part, span in parts:
        judged = replace(options, judged=span, timeline=False)
        if args.sweep_policy:
            try:
                points = sweep_policies(part, judged, args.sweep_policy)
            except PolicyError as exc:
                return fail(f"invalid --sweep-policy: {exc}")
            rows = [{"setting": p.label, "recovery_vs_first": p.recovery_vs_base, **p.summary} for p in points]
            halves.append({"judged": label, "settings": rows})
            text = format_sweep(points, args.still_wanted_minutes)
        else:
            result = replay(part, judged, prices=prices, price_source=price_source, baseline=args.baseline)
            halves.append({"judged": label, **result.to_json()})
            text = format_report(result)
        if not args.json:
            print(f"== {label}\n{text}\n", flush=True)
    if args.json:
        print(json.dumps({"trace": trace.source, "split": args.split, "halves": halves}, indent=2))
    if args.plot:
        print("idle-reaper replay: --plot is not drawn with --split", file=sys.stderr)
    return 0
