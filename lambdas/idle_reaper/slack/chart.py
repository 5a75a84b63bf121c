"""The weekly digest's chart: recovered vs still-wasted dollars per week (8 weeks), and the machines that
wasted most this week, as a PNG. Pillow is imported here, inside `render_chart`, and nowhere else: no sweep
or Slack click pays for it (tests/unit/slack/test_digest_chart.py holds that)."""

from __future__ import annotations

import io
from typing import Any

from idle_reaper.core.digest import Digest

WIDTH, HEIGHT = 960, 420
RECOVERED = (46, 160, 67)
WASTED = (207, 34, 46)
NO_DATA = (200, 200, 200)
INK = (36, 41, 47)
FAINT = (110, 119, 129)


def render_chart(d: Digest, names: dict[str, str] | None = None) -> bytes:
    """The PNG bytes of the digest's chart. `names`: instance id -> a readable name, for the top machines."""
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


def _weeks(draw: Any, d: Digest, box: tuple[int, int, int, int], font: Any) -> None:
    left, top, right, bottom = box
    axis = bottom - 20
    peak = max([max(t.recovered, t.wasted) for t in d.trend] + [1.0])
    slot = (right - left) / max(1, len(d.trend))
    draw.line((left, axis, right, axis), fill=FAINT)
    for i, t in enumerate(d.trend):
        x = left + i * slot
        label = t.week.label[-3:]
        draw.text((x + slot / 2 - 12, axis + 4), label, fill=INK if t.week == d.week else FAINT, font=font)
        if not t.has_data:
            draw.text((x + slot / 2 - 20, axis - 18), "no data", fill=NO_DATA, font=font)
            continue
        bar = slot * 0.35
        for j, (value, colour) in enumerate(((t.recovered, RECOVERED), (t.wasted, WASTED))):
            height = (axis - top - 20) * value / peak
            x0 = x + slot * 0.12 + j * (bar + 2)
            draw.rectangle((x0, axis - height, x0 + bar, axis), fill=colour)
        draw.text(
            (x + slot * 0.1, axis - (axis - top - 20) * t.recovered / peak - 16),
            f"${t.recovered:,.0f}",
            fill=INK,
            font=font,
        )
    draw.rectangle((left, bottom - 2, left + 10, bottom + 8), fill=RECOVERED)
    draw.text((left + 14, bottom - 4), "recovered by stops", fill=INK, font=font)
    draw.rectangle((left + 170, bottom - 2, left + 180, bottom + 8), fill=WASTED)
    draw.text((left + 184, bottom - 4), "still wasted (kept idle)", fill=INK, font=font)


def _top_machines(
    draw: Any, d: Digest, names: dict[str, str], box: tuple[int, int, int, int], font: Any, small: Any
) -> None:
    left, top, right, _ = box
    draw.text((left, top), f"Top machines by waste, {d.week.label}", fill=INK, font=font)
    if not d.top_waste:
        draw.text((left, top + 30), "nothing was kept idle this week", fill=FAINT, font=small)
        return
    peak = d.top_waste[0][1] or 1.0
    for i, (instance_id, dollars) in enumerate(d.top_waste):
        y = top + 30 + i * 56
        draw.text((left, y), names.get(instance_id, instance_id)[:40], fill=INK, font=small)
        width = (right - left - 80) * dollars / peak
        draw.rectangle((left, y + 18, left + max(2.0, width), y + 36), fill=WASTED)
        draw.text((left + max(2.0, width) + 6, y + 20), f"${dollars:,.2f}", fill=INK, font=small)
