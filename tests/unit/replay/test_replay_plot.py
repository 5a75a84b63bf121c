"""The plot: what the PNG shows (the fleet's state over time, recovered hours and dollars per team, the
baseline beside idle-reaper), and matplotlib stays out of every replay that draws nothing."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from replay_support import DATA, SHORT_POLICY, csv_rows, trace

from idle_reaper_tools.cli import main
from idle_reaper_tools.replay import ReplayOptions, read_trace, replay
from idle_reaper_tools.replay.plotting import draw

pytest.importorskip("matplotlib")  # the dev group has it; a user's install may not (the `plot` extra)


def test_plot_and_gzip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gz = tmp_path / "trace.csv.gz"
    gz.write_bytes(gzip.compress((DATA / "replay-gpu-training.csv").read_bytes()))
    png = tmp_path / "out.png"
    assert main(["replay", str(gz), "--plot", str(png), "--baseline", "cloudwatch-cpu"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().err
    width, height = struct.unpack(">II", png.read_bytes()[16:24])  # the IHDR chunk
    assert (width, height) == (1430, 935)  # 13 x 8.5 in at 110 dpi


def test_the_figure_shows_the_fleet_state_and_both_reapers_per_team() -> None:
    result = replay(
        read_trace(DATA / "replay-gpu-training.csv"),
        ReplayOptions(policies=SHORT_POLICY, timeline=True),
        baseline="cloudwatch-cpu",
    )
    state, hours, dollars = draw(result).axes
    assert state.get_title().endswith("every 5 min: replay-gpu-training.csv")
    legend = state.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["busy", "idle", "warned", "stopped", "unknown / no data"]
    # The stack's top edge is the machines present: one, for the whole 4 hours.
    assert max(y for path in state.collections[-1].get_paths() for _, y in path.vertices) == 1
    assert state.get_xlim() == (0.0, 47 * 300 / 86400)
    assert [t.get_text() for t in state.get_xticklabels()] == ["Mon\nJan 05"]
    # Per team: idle-reaper's bar, then the alarm's (the hand-worked figures of test_replay_simulate).
    for ax, expected in ((hours, [1.5, 2.0]), (dollars, [1.51, 2.01])):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["training"]
        heights = [bar.get_height() for container in ax.containers for bar in container]
        assert heights == pytest.approx(expected, abs=0.01)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["idle-reaper", "cloudwatch-cpu alarm"]
    assert hours.get_title() == "Recovered machine-hours per team"
    assert dollars.get_title() == "Dollars saved per team"


def test_the_states_are_stacked_machine_by_machine() -> None:
    # Two machines, the second from 1 h in: the stack's top reaches 2 (drawn side by side, it would be 1).
    t = trace([*csv_rows("i-a", [50.0] * 6 + [1.0] * 30), *csv_rows("i-b", [None] * 12 + [50.0] * 6 + [1.0] * 18)])
    state = draw(replay(t, ReplayOptions(policies=SHORT_POLICY, timeline=True))).axes[0]
    assert max(y for path in state.collections[-1].get_paths() for _, y in path.vertices) == 2


def test_unknown_prices_and_unpriced_hours_are_said_not_drawn_as_zero() -> None:
    # No instance type: the 2 h recovered (stopped at bucket 12, back at 36) have no price.
    t = trace(csv_rows("i-bare", [50.0] * 6 + [1.0] * 30 + [50.0] * 6))
    options = ReplayOptions(policies=SHORT_POLICY, timeline=True)
    no_table = draw(replay(t, options, prices=None)).axes[2]
    assert no_table.get_title() == "Dollars saved per team (unknown: no price table)"
    unpriced = draw(replay(t, options)).axes[2]
    assert [text.get_text().split(":")[0] for text in unpriced.texts] == ["2 recovered hours unpriced"]


def test_matplotlib_is_imported_only_for_a_plot() -> None:
    code = (
        "import sys\n"
        "from idle_reaper_tools.cli import main\n"
        f"assert main(['replay', {str(DATA / 'replay-cpu-box.csv')!r}, '--json']) == 0\n"
        f"assert main(['replay', {str(DATA / 'replay-cpu-box.csv')!r}]) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
