"""The digest's chart says what its text says (issue 44, item 10): still wasted is kept idle by answers and exempt
and idle, in the week's bar and among the machines that wasted most; and what the runtime cites as its tests
exists."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from idle_reaper.core.digest import Digest, Week, build_digest
from idle_reaper.core.digest_text import digest_text
from idle_reaper.core.records import MachineRecord, State
from idle_reaper.slack import chart

ROOT = Path(__file__).resolve().parents[3]
W47 = Week(2026, 47)
END = datetime(2026, 11, 23, tzinfo=UTC)
PRICES = {"m5.large": 0.096, "g5.xlarge": 1.006}


def digest_with_an_exempt_idle_machine() -> Digest:
    lazy = MachineRecord("i-0lazy", "ml", State.EXEMPT, name="lazy", instance_type="m5.large", updated_at=END)
    kept_at = END - timedelta(days=2)
    keep = {
        "action": "keep",
        "team": "ml",
        "owner": "ada",
        "hourly_cost": 1.006,
        "hourly_waste": 1.006,
        "snoozed_until": (kept_at + timedelta(hours=2)).isoformat(),
    }
    return build_digest(
        [("i-0kept", kept_at, keep)],
        [lazy],
        W47,
        now=END,
        team="ml",
        prices=PRICES,
        exempt_idle={"i-0lazy": 166.0},
    )


def test_the_charts_waste_holds_the_exempt_and_idle_waste_its_text_states() -> None:
    d = digest_with_an_exempt_idle_machine()
    exempt = 166 * 0.096
    assert f"Still wasted, exempt and idle: ${exempt:,.2f} (166 h)" in digest_text(d)
    label, has_data, _, kept, exempt_shown = chart.chart_weeks(d)[-1]
    assert label == "2026-W47" and has_data
    assert kept == 2 * 1.006
    assert round(exempt_shown, 2) == round(exempt, 2)
    top = dict(chart.chart_top_waste(d))
    assert round(top["i-0lazy"], 2) == round(exempt, 2) and top["i-0kept"] == 2 * 1.006
    assert chart.render_chart(d).startswith(b"\x89PNG")


def test_every_test_file_the_code_cites_exists() -> None:
    """slack/chart.py cited tests/unit/slack/test_digest_chart.py before it existed."""
    cited = re.compile(r"tests/[\w/]+\.py")
    missing = [
        f"{path.relative_to(ROOT)} cites {name}"
        for folder in ("lambdas", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in cited.findall(path.read_text())
        if not (ROOT / name).exists()
    ]
    assert not missing, "\n".join(missing)


def test_an_idle_group_member_still_running_appears_in_the_digest() -> None:
    """Issue 44, item 10: a member released to its group (or found released) that the group has not scaled in
    still runs, and costs its price; the digest says so, where before it never appeared."""
    member = MachineRecord(
        "i-0member",
        "ml",
        State.REAPED,
        name="worker-3",
        instance_type="g5.xlarge",
        asg_name="workers",
        last_action="unprotect",
        updated_at=END - timedelta(minutes=10),
    )
    stopped = MachineRecord("i-0gone", "ml", State.REAPED, name="gone", instance_type="g5.xlarge", updated_at=END)
    release = {"action": "unprotect", "team": "ml", "owner": "ada", "hourly_savings": 1.006, "hourly_cost": 1.006}
    d = build_digest(
        [("i-0member", END - timedelta(days=1), release)], [member, stopped], W47, now=END, team="ml", prices=PRICES
    )
    assert d.recovered["releases"].count == 1 and d.recovered_dollars == 0.0  # the group kept it: nothing saved
    text = digest_text(d)
    assert "Idle in an Auto Scaling group, still running ($1.01/h): worker-3 ($1.01/h)" in text
    assert "gone" not in text
