"""The weekly digest's chart: recovered vs still-wasted dollars per week (8 weeks), and the machines (endpoints,
Studio apps: each named by its kind's noun, core/sections.named) that wasted most this week, as a PNG. Still
wasted is what the text says: kept idle by answers, and, for the digest's week (the only one read), exempt and
idle. Pillow is imported here, inside `render_chart`, and nowhere else: no sweep or Slack click pays for it
(tests/infra/test_asset_imports.py holds that; tests/unit/slack/test_digest_chart.py holds the chart's figures
to the text's)."""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

from idle_reaper.core.digest import TOP_MACHINES, Digest
from idle_reaper.core.sections import named

WIDTH, HEIGHT = 960, 420
RECOVERED = (46, 160, 67)
WASTED = (207, 34, 46)
EXEMPT = (240, 140, 120)  # still wasted, exempt and idle: stacked on the kept-idle bar
NO_DATA = (200, 200, 200)
INK = (36, 41, 47)
FAINT = (110, 119, 129)


def render_chart(d: Digest, names: dict[str, str] | None = None) -> bytes:
    """The PNG bytes of the digest's chart. `names`: machine key -> a readable name, for those that wasted most."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    font: Any = ImageFont.load_default(size=14)
    small: Any = ImageFont.load_default(size=12)
    who = f"team {d.team}" if d.team else "all teams"
    draw.text((20, 12), f"idle-reaper, {who}: saved vs still wasted, by week (USD)", fill=INK, font=font)
    _weeks(draw, d, (20, 50, 560, HEIGHT - 40), small)
    _top_machines(draw, d, names or {}, (600, 50, WIDTH - 20, HEIGHT - 40), font, small)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def chart_weeks(d: Digest) -> list[tuple[str, bool, float, float, float]]:
    """Per week of the trend: its label, whether it has data, recovered, kept idle and exempt-and-idle dollars
    (exempt machines are read for the digest's week alone)."""
    return [
        (t.week.label, t.has_data, t.recovered, t.wasted, d.exempt_idle_dollars if t.week == d.week else 0.0)
        for t in d.trend
    ]


def top_waste_labels(d: Digest, names: dict[str, str]) -> list[tuple[str, float]]:
    """What wasted most, as the chart names it: a machine by its name, an endpoint or a Studio app by its noun and
    name ("endpoint demo-llm"), each cut to what its row holds."""
    return [(named(key, names.get(key))[:40], dollars) for key, dollars in chart_top_waste(d)]


def chart_top_waste(d: Digest, most: int = TOP_MACHINES) -> list[tuple[str, float]]:
    """The machines that wasted most this week, kept idle by answers or exempt and idle (by machine key)."""
    waste: dict[str, float] = defaultdict(float)
    for key, kept in d.top_waste:
        waste[key] += kept
    for a in d.exempt_idle:
        if a.idle_dollars > 0:
            waste[a.key or a.instance_id] += a.idle_dollars
    return sorted(waste.items(), key=lambda p: (-p[1], p[0]))[:most]


def _weeks(draw: Any, d: Digest, box: tuple[int, int, int, int], font: Any) -> None:
    left, top, right, bottom = box
    axis = bottom - 20
    weeks = chart_weeks(d)
    peak = max([max(recovered, kept + exempt) for _, _, recovered, kept, exempt in weeks] + [1.0])
    slot = (right - left) / max(1, len(d.trend))
    draw.line((left, axis, right, axis), fill=FAINT)
    scale = (axis - top - 20) / peak
    for i, (label, has_data, recovered, kept, exempt) in enumerate(weeks):
        x = left + i * slot
        draw.text((x + slot / 2 - 12, axis + 4), label[-3:], fill=INK if label == d.week.label else FAINT, font=font)
        if not has_data and not exempt:
            draw.text((x + slot / 2 - 20, axis - 18), "no data", fill=NO_DATA, font=font)
            continue
        bar = slot * 0.35
        x0, x1 = x + slot * 0.12, x + slot * 0.12 + bar + 2
        draw.rectangle((x0, axis - recovered * scale, x0 + bar, axis), fill=RECOVERED)
        draw.rectangle((x1, axis - kept * scale, x1 + bar, axis), fill=WASTED)
        if exempt:
            draw.rectangle((x1, axis - (kept + exempt) * scale, x1 + bar, axis - kept * scale), fill=EXEMPT)
        draw.text((x + slot * 0.1, axis - recovered * scale - 16), f"${recovered:,.0f}", fill=INK, font=font)
    draw.rectangle((left, bottom - 2, left + 10, bottom + 8), fill=RECOVERED)
    draw.text((left + 14, bottom - 4), "recovered by stops", fill=INK, font=font)
    draw.rectangle((left + 170, bottom - 2, left + 180, bottom + 8), fill=WASTED)
    draw.text((left + 184, bottom - 4), "still wasted: kept idle", fill=INK, font=font)
    draw.rectangle((left + 350, bottom - 2, left + 360, bottom + 8), fill=EXEMPT)
    draw.text((left + 364, bottom - 4), "exempt and idle", fill=INK, font=font)


def _top_machines(
    draw: Any, d: Digest, names: dict[str, str], box: tuple[int, int, int, int], font: Any, small: Any
) -> None:
    left, top, right, _ = box
    draw.text((left, top), f"Wasted most, {d.week.label}", fill=INK, font=font)
    top_waste = top_waste_labels(d, names)
    if not top_waste:
        draw.text((left, top + 30), "nothing was kept idle, nor exempt and idle, this week", fill=FAINT, font=small)
        return
    peak = top_waste[0][1] or 1.0
    for i, (label, dollars) in enumerate(top_waste):
        y = top + 30 + i * 56
        draw.text((left, y), label, fill=INK, font=small)
        width = (right - left - 80) * dollars / peak
        draw.rectangle((left, y + 18, left + max(2.0, width), y + 36), fill=WASTED)
        draw.text((left + max(2.0, width) + 6, y + 20), f"${dollars:,.2f}", fill=INK, font=small)
