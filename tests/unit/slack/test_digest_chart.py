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
from idle_reaper.core.sections import named
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


def test_what_wasted_most_names_an_endpoint_and_a_studio_app_by_their_kind_and_their_deletions_count_apart() -> None:
    """Issue 46: the chart called every resource by its name alone under "Top machines"; an endpoint and a Studio
    app are named by their noun. A Studio app deleted for 3 hours saved its instance's price times 3 (the one
    rule), in its own section and as a deletion, not a stop."""
    app = "studio:d-1:lab-space:JupyterLab:default"
    kept_at = END - timedelta(days=1)

    def keep(hourly: float) -> dict[str, object]:
        until = (kept_at + timedelta(hours=4)).isoformat()
        return {"action": "keep", "team": "ml", "owner": "ada", "hourly_cost": hourly, "hourly_waste": hourly,
                "snoozed_until": until}  # fmt: skip

    deletion = {"action": "stop", "team": "ml", "owner": "ada", "hourly_savings": 0.7364, "hourly_cost": 0.7364}
    entries = [
        ("endpoint:demo-llm", kept_at, keep(1.4728)),
        ("i-0box", kept_at, keep(0.096)),
        (app, END - timedelta(hours=3), deletion),
    ]
    records = [
        MachineRecord("endpoint:demo-llm", "ml", State.ACTIVE, name="demo-llm", instance_type="ml.g4dn.xlarge x2"),
        MachineRecord("i-0box", "ml", State.ACTIVE, name="box", instance_type="m5.large"),
        MachineRecord(app, "ml", State.REAPED, name="lab-space", instance_type="ml.g4dn.xlarge", last_action="stop"),
    ]
    d = build_digest(entries, records, W47, now=END, team="ml", prices={"ml.g4dn.xlarge": 0.7364, "m5.large": 0.096})
    names = {r.key: r.name or r.instance_id for r in records}
    assert chart.top_waste_labels(d, names) == [("endpoint demo-llm", 4 * 1.4728), ("box", 4 * 0.096)]
    assert chart.top_waste_labels(d, {}) == [("endpoint demo-llm", 4 * 1.4728), ("i-0box", 4 * 0.096)]
    assert (named(app, None), named(f"111111111111/eu-west-1/{app}", "lab")) == (
        "Studio app lab-space",
        "Studio app lab",
    )
    [apps] = [s for s in d.sections if s.label == "Studio apps"]
    assert [(r.name, r.saved_hours, round(r.saved_dollars, 2)) for r in apps.resources] == [("lab-space", 3.0, 2.21)]
    assert (d.recovered["deletions"].count, "stops" in d.recovered) == (1, False)
    text = digest_text(d)
    assert "1 deletions (3.0 h, $2.21); of it, Studio apps $2.21" in text
    assert (
        "Studio apps (1): deleted ones saved $2.21 (3.0 h this week). lab-space (ml, ml.g4dn.xlarge, $0.74/h)" in text
    )
    assert chart.render_chart(d, names).startswith(b"\x89PNG")
