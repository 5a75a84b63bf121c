"""What the replay tests share: the hand-made traces' directory, a short policy, trace builders.

Most traces in the replay tests use a short policy so they stay small: idle window 30 min (6 buckets of
5 min), the warning 10 min before the stop (at 20 min of quiet), max gap 15 min. Bucket i starts at
T0 + 5i min; the sweep at the start of bucket k sees buckets < k.
"""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from idle_reaper.policy import TeamPolicy
from idle_reaper_tools.cli import main
from idle_reaper_tools.replay import PolicySet, Trace, parse_trace
from testkit.generate_trace import fleet, write_trace

DATA = Path(__file__).resolve().parents[2] / "data"
SAMPLE = Path(__file__).resolve().parents[3] / "testkit" / "sample-trace.csv.gz"
T0 = datetime(2026, 1, 5, tzinfo=UTC)
SHORT = {"idle_minutes": 30, "warn_minutes": 10}
SHORT_POLICY = PolicySet(default=TeamPolicy(**SHORT))  # type: ignore[arg-type]


def ts(i: int) -> str:
    return (T0 + timedelta(minutes=5 * i)).strftime("%Y-%m-%dT%H:%M:%SZ")


def csv_rows(instance: str, cpu: list[float | None], tail: str = "") -> list[str]:
    """One row per bucket from T0; None: no row (a gap)."""
    return [f"{ts(i)},{instance},{v:g}{tail}" for i, v in enumerate(cpu) if v is not None]


def trace(text_rows: list[str], header: str = "timestamp,instance_id,cpu") -> Trace:
    return parse_trace(io.StringIO("\n".join([header, *text_rows]) + "\n"), "test.csv")


def small_fleet_text(machines: int = 12, days: int = 3) -> str:
    out = io.StringIO()
    write_trace(fleet(machines, days, seed=3), T0, out)
    return out.getvalue()


def write_short_policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(SHORT))
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["replay", *argv, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out
