"""The data a dashboard plots, kept apart from its widgets: each trace downsampled to a bounded number
of points (the recent half at full resolution, each older bucket's minimum and maximum), a run's
step rows deduplicated by step, and the telemetry ticks of the utilisation panel (a recent window).
"""

from __future__ import annotations

import bisect
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
