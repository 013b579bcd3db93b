"""The data a dashboard plots, kept apart from its widgets: each trace downsampled to a bounded number
of points (the recent half at full resolution, each older bucket's minimum and maximum), a run's
step rows deduplicated by step, and the telemetry ticks of the utilisation panel (a recent window).
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Sequence
from typing import Any, TypeVar

from openrl_jupyter.summary import missing

X = TypeVar("X")
UTIL_WINDOW = 900  # ticks (one a second): the utilisation panel shows the last 15 to 30 minutes


def downsample_indices(ys: Sequence[float | None], max_points: int) -> list[int]:
    """The indices ``downsample`` keeps, in order; shared so that stacked traces keep the same x."""
    if max_points < 2:
        raise ValueError(f"max_points must be ≥ 2 (the first and the last point); got {max_points}")
    n = len(ys)
    if n <= max_points:
        return list(range(n))
    recent = max_points // 2
    split = n - recent
    n_buckets = (max_points - recent - 1) // 2
    older = split - 1
    keep = [0]
    for b in range(n_buckets):
        lo, hi = 1 + b * older // n_buckets, 1 + (b + 1) * older // n_buckets
        lo_i = hi_i = -1
        for i in range(lo, hi):
            v = ys[i]
            if missing(v):
                continue
            if lo_i < 0 or v < ys[lo_i]:
                lo_i = i
            if hi_i < 0 or v > ys[hi_i]:
                hi_i = i
        if lo_i < 0:
            if lo < hi:
                keep.append(lo)
        elif lo_i == hi_i:
            keep.append(lo_i)
        else:
            keep.extend((min(lo_i, hi_i), max(lo_i, hi_i)))
    keep.extend(range(split, n))
    return keep


def downsample(
    xs: Sequence[X], ys: Sequence[float | None], max_points: int
) -> tuple[list[X], list[float | None]]:
    """At most ``max_points`` points of a line, for the browser.

    Short lines come back unchanged. Longer ones keep their last ``max_points // 2`` points as they
    are and split the older ones into buckets of which only the minimum and the maximum survive (in
    x order), so a spike in old history stays visible; the very first point is always kept. Missing
    values (None, NaN) never win a bucket; a bucket with nothing else keeps one, as a gap.
    """
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys must have the same length; got {len(xs)} and {len(ys)}")
    idx = downsample_indices(ys, max_points)
    if len(idx) == len(ys):
        return list(xs), list(ys)
    return [xs[i] for i in idx], [ys[i] for i in idx]


class Rows:
    """Rows keyed by an increasing number (the step), in order; a repeated key replaces its row."""

    def __init__(self) -> None:
        self.keys: list[float] = []
        self.rows: list[dict] = []

    def put(self, key: float, row: dict) -> None:
        if not self.keys or key > self.keys[-1]:
            self.keys.append(key)
            self.rows.append(row)
            return
        i = bisect.bisect_left(self.keys, key)
        if self.keys[i] == key:
            self.rows[i] = row
        else:
            self.keys.insert(i, key)
            self.rows.insert(i, row)

    def column(self, name: str) -> list[Any]:
        return [r.get(name) for r in self.rows]

    def last(self) -> dict:
        return self.rows[-1] if self.rows else {}


class Utilisation:
    """Telemetry ticks as columns: total utilisation, and each run's part of it (value × share).

    A tick no newer than the last one (a replay after the feed reconnects) is ignored.
    """

    def __init__(self) -> None:
        self.label: str | None = None
        self.value: float | None = None
        self.queue_depth: int | None = None
        self.fused_share: float | None = None
        self.devices: list[dict] = []  # each device of a group serving the model (rank, busy share)
        self.times: list[float] = []
        self.total: list[float] = []
        self.by_run: dict[str, list[float]] = {}

    def add(self, tick: dict) -> bool:
        t = tick.get("time")
        if not isinstance(t, (int, float)) or (self.times and t <= self.times[-1]):
            return False
        util = tick.get("utilisation") or {}
        value = float(util.get("value") or 0.0)
        shares = tick.get("runs") or {}
        self.label = util.get("label") or self.label
        self.value = value
        self.queue_depth = tick.get("queue_depth")
        self.fused_share = tick.get("fused_share")
        self.devices = [d for d in tick.get("devices") or [] if isinstance(d, dict)]
        for run_id in shares:
            self.by_run.setdefault(run_id, [0.0] * len(self.times))
        self.times.append(float(t))
        self.total.append(value)
        for run_id, column in self.by_run.items():
            column.append(value * float(shares.get(run_id) or 0.0))
        if len(self.times) > 2 * UTIL_WINDOW:  # keep a recent window, trimmed in batches
            del self.times[:-UTIL_WINDOW], self.total[:-UTIL_WINDOW]
            for column in self.by_run.values():
                del column[:-UTIL_WINDOW]
        return True


Line = tuple[str, Sequence[float], Sequence[float | None], str]  # label, xs, ys, colour
Panel = tuple[str, Sequence[Line], Sequence[tuple[float, str]]]  # title, lines, markers (x, label)
SVG_LEFT, SVG_RIGHT, SVG_TOP, SVG_BOTTOM = 46, 8, 16, 14  # margins of each panel, px


def svg_panels(panels: Sequence[Panel], *, width: int = 640, height: int = 110, max_points: int = 200) -> str:
    """A small static picture of line panels, one under the other: plain SVG (no script), a few KB.

    What a saved notebook shows where the live figure cannot be drawn (no kernel, no widgets). Each
    line is downsampled to ``max_points``; missing values break it; markers are dashed verticals
    with a label (a reward version change); each panel gives its y and x ranges.
    """
    total = height * len(panels)
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{total}' "
        f"viewBox='0 0 {width} {total}' font-family='sans-serif' font-size='10'>"
    ]
    for p, panel in enumerate(panels):
        parts.extend(_svg_panel(panel, p * height, width, height, max_points))
    parts.append("</svg>")
    return "".join(parts)


def _svg_panel(panel: Panel, top: int, width: int, height: int, max_points: int) -> list[str]:
    title, lines, markers = panel
    left, y0 = SVG_LEFT, top + SVG_TOP
    w, h = width - SVG_LEFT - SVG_RIGHT, height - SVG_TOP - SVG_BOTTOM
    legend = " · ".join(
        f"<tspan fill='{colour}'>{html.escape(label)}</tspan>" for label, _, _, colour in lines
    )
    parts = [
        f"<text x='{left}' y='{y0 - 4}'><tspan font-weight='bold'>{html.escape(title)}</tspan> {legend}</text>",
        f"<rect x='{left}' y='{y0}' width='{w}' height='{h}' fill='none' stroke='#d0d7de'/>",
    ]
    points = [(x, y) for _, xs, ys, _ in lines for x, y in zip(xs, ys, strict=True) if not missing(y)]
    if not points:
        return [*parts, f"<text x='{left + 6}' y='{y0 + h / 2}' fill='#57606a'>no data yet</text>"]
    x_lo, x_hi = min(x for x, _ in points), max(x for x, _ in points)
    y_lo, y_hi = min(y for _, y in points), max(y for _, y in points)
    x_scale, y_scale = w / ((x_hi - x_lo) or 1.0), h / ((y_hi - y_lo) or 1.0)
    for x, label in markers:
        mx = left + (x - x_lo) * x_scale
        parts.append(
            f"<line x1='{mx:.1f}' x2='{mx:.1f}' y1='{y0}' y2='{y0 + h}' stroke='#888' stroke-dasharray='3,3'/>"
            f"<text x='{mx + 2:.1f}' y='{y0 + 10}' fill='#57606a'>{html.escape(label)}</text>"
        )
    for _, xs, ys, colour in lines:
        xs, ys = downsample(xs, ys, max_points)
        run: list[str] = []
        for x, y in [*zip(xs, ys, strict=True), (None, None)]:
            if x is not None and not missing(y):
                run.append(f"{left + (x - x_lo) * x_scale:.1f},{y0 + h - (y - y_lo) * y_scale:.1f}")
            elif run:
                parts.append(
                    f"<polyline points='{' '.join(run)}' fill='none' stroke='{colour}' stroke-width='1.5'/>"
                )
                run = []
    parts += [
        f"<text x='{left - 4}' y='{y0 + 8}' text-anchor='end'>{y_hi:.3g}</text>",
        f"<text x='{left - 4}' y='{y0 + h}' text-anchor='end'>{y_lo:.3g}</text>",
        f"<text x='{left}' y='{y0 + h + 11}'>{x_lo:g}</text>",
        f"<text x='{left + w}' y='{y0 + h + 11}' text-anchor='end'>{x_hi:g}</text>",
    ]
    return parts
