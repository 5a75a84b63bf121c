"""The replay's picture: the fleet's state over time, and recovered hours and dollars per team (a PNG).

matplotlib is optional (`pip install 'idle-reaper[plot]'`): it is imported only when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from idle_reaper_tools.replay.report import Replay, SweepPoint
from idle_reaper_tools.replay.simulate import STATE_NAMES

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot(r: Replay, path: str | Path) -> None:
    """A PNG: the fleet's state over time (stacked) and recovered hours and dollars per team."""
    draw(r).savefig(str(path), dpi=110)


def draw(r: Replay) -> Figure:
    """The figure: on top the fleet's state over time (needs a replay with options.timeline), below
    recovered hours and dollars saved per team (idle-reaper's bars, and the baseline's beside them)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 2])
    ax = fig.add_subplot(grid[0, :])
    colors = {
        "busy": "#2b8a3e",
        "idle": "#f2c94c",
        "warned": "#f2994a",
        "stopped": "#4c6ef5",
        "unknown": "#adb5bd",
    }
    if r.timeline is not None and r.timeline_start is not None:
        start = r.timeline_start
        count = len(r.timeline["busy"])
        xs = [i * r.trace.period_seconds / 86400 for i in range(count)]  # days since the start
        ax.stackplot(
            xs,
            *(r.timeline[name] for name in STATE_NAMES),
            labels=[name if name != "unknown" else "unknown / no data" for name in STATE_NAMES],
            colors=[colors[name] for name in STATE_NAMES],
            step="post",
            linewidth=0,
        )
        ax.set_xlim(xs[0], xs[-1])
        # A tick at each UTC midnight (each Monday on long traces), labelled with the weekday and date.
        midnight = start.replace(hour=0, minute=0, second=0, microsecond=0)
        days = [midnight + timedelta(days=d) for d in range(int(xs[-1]) + 2)]
        days = [d for d in days if start <= d <= start + timedelta(days=xs[-1])]
        if len(days) > 21:
            days = [d for d in days if d.weekday() == 0]
        ax.set_xticks(
            [(d - start).total_seconds() / 86400 for d in days], [f"{d:%a}\n{d:%b %d}" for d in days], fontsize=8
        )
        ax.set_xlabel("UTC")
    ax.set_ylabel("machines")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(
        f"Fleet state under idle-reaper, every {r.trace.period_seconds // 60} min: {Path(r.trace.source).name}"
    )
    ax.legend(loc="upper left", ncols=5, fontsize=9, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)

    teams = sorted(r.reaper.teams)
    results = [r.reaper, *([r.baseline] if r.baseline else [])]
    bar_colors = ["#4c6ef5", "#adb5bd"]
    width = 0.8 / len(results)
    for position, (metric, title) in enumerate(
        [("recovered_hours", "Recovered machine-hours per team"), ("dollars_saved", "Dollars saved per team")]
    ):
        bar_ax = fig.add_subplot(grid[1, position])
        for j, result in enumerate(results):
            values = [result.summary(result.teams[t]).get(metric) or 0.0 for t in teams]
            xs_bar = [i + (j - (len(results) - 1) / 2) * width for i in range(len(teams))]
            name = result.name if j == 0 else f"{result.name} alarm"
            bar_ax.bar(xs_bar, values, width=width, label=name, color=bar_colors[j % len(bar_colors)])
        bar_ax.set_xticks(range(len(teams)), teams, rotation=20 if len(teams) > 4 else 0)
        unknown = metric == "dollars_saved" and r.price_source is None
        bar_ax.set_title(title + (" (unknown: no price table)" if unknown else ""))
        unpriced = r.reaper.fleet.unpriced_hours
        if metric == "dollars_saved" and not r.reaper.fleet.dollars and unpriced:
            bar_ax.text(
                0.5,
                0.5,
                f"{unpriced:,.0f} recovered hours unpriced:\nno instance_type in the trace (see --instance-type)",
                ha="center",
                va="center",
                transform=bar_ax.transAxes,
            )
        bar_ax.grid(axis="y", alpha=0.3)
        if len(results) > 1:
            bar_ax.legend(fontsize=9)
    return fig


def plot_sweep(points: Sequence[SweepPoint], title: str, path: str | Path) -> None:
    """The Pareto PNG of a --sweep-policy run: recovery against unwanted stops, one labelled dot a setting."""
    draw_sweep(points, title).savefig(str(path), dpi=110)


def draw_sweep(points: Sequence[SweepPoint], title: str) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shown = [p for p in points if p.recovery_vs_base is not None and p.summary["unwanted_stop_share"] is not None]
    xs = [100 * (p.summary["unwanted_stop_share"] or 0.0) for p in shown]
    ys = [100 * (p.recovery_vs_base or 0.0) for p in shown]
    nudges = [100 * (p.summary["warnings_without_stop_share"] or 0.0) for p in shown]
    dots = ax.scatter(xs, ys, c=nudges, cmap="viridis_r", s=60, zorder=3)
    fig.colorbar(dots, ax=ax, label="warnings that led to no stop (%)")
    # Settings that land on the same dot (e.g. a bound the rule never reaches) share one label.
    labels: dict[tuple[float, float], list[str]] = {}
    for x, y, p in zip(xs, ys, shown, strict=True):
        labels.setdefault((round(x, 2), round(y, 2)), []).append(p.label)
    # Labels stay inside the axes (to the left of dots in the right half) and step below a close neighbour's.
    middle = (min(xs) + max(xs)) / 2 if xs else 0.0
    placed: list[tuple[float, float]] = []
    y_span = (max(ys) - min(ys)) if ys else 0.0
    x_span = (max(xs) - min(xs)) if xs else 0.0
    for (x, y), names in sorted(labels.items(), key=lambda item: -item[0][1]):
        crowded = any(abs(y - py) < 0.04 * y_span and abs(x - px) < 0.25 * x_span for px, py in placed)
        right = x > middle
        ax.annotate(
            " = ".join(names),
            (x, y),
            textcoords="offset points",
            xytext=(-6 if right else 6, -11 if crowded else 4),
            ha="right" if right else "left",
            fontsize=7,
        )
        placed.append((x, y))
    ax.set_xlabel("unwanted stops: activity within the hour, % of stops (lower is better)")
    ax.set_ylabel("recovered hours, % of the ideal of the first setting (higher is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig
