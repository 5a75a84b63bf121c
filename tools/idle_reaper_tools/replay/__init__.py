"""Trace replay: the real decision core over a utilization trace, with a simulated clock and in-memory state.

`idle-reaper replay TRACE.csv` answers "what would idle-reaper have done to this fleet, and what would it
have saved?" (docs/replay.md). In parts, each importing only the ones before it:

- trace.py      reading and validating a trace into per-machine series on the sweep's bucket grid
- policies.py   the policies the replay runs under (a policy file, per-team overrides)
- truth.py      what the trace itself says per bucket (busy, quiet, unknown) and the ideal
- simulate.py   every machine swept by core.assess + core.decide; the cloudwatch-cpu baseline
- report.py     replay(): the figures per reaper and team, as text and JSON
- plotting.py   the PNG (matplotlib, imported only when drawing)
- command.py    `idle-reaper replay` (its parser is in cli.py)
"""

from idle_reaper_tools.replay.command import (
    cmd_replay,
    non_negative_minutes,
    positive_minutes,
    snooze_rate,
    waiting_rule,
)
from idle_reaper_tools.replay.plotting import plot
from idle_reaper_tools.replay.policies import PolicySet, load_policies
from idle_reaper_tools.replay.report import Replay, Result, Totals, format_report, replay
from idle_reaper_tools.replay.simulate import (
    BASELINES,
    STATE_NAMES,
    MachineRun,
    ReplayOptions,
    StopEvent,
    fleet_timeline,
    simulate_fleet,
)
from idle_reaper_tools.replay.trace import Series, Trace, TraceError, parse_trace, read_trace
from idle_reaper_tools.replay.truth import Truth, classify, ideal_buckets

__all__ = [
    "BASELINES",
    "STATE_NAMES",
    "MachineRun",
    "PolicySet",
    "Replay",
    "ReplayOptions",
    "Result",
    "Series",
    "StopEvent",
    "Totals",
    "Trace",
    "TraceError",
    "Truth",
    "classify",
    "cmd_replay",
    "fleet_timeline",
    "format_report",
    "ideal_buckets",
    "load_policies",
    "non_negative_minutes",
    "parse_trace",
    "plot",
    "positive_minutes",
    "read_trace",
    "replay",
    "simulate_fleet",
    "snooze_rate",
    "waiting_rule",
]
