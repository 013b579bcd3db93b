"""What a sweep decides before its runs start: the grid's points and run names, the rungs of
successive halving, and the score window every ranking uses (see ``openrl_jupyter.sweep``)."""

from __future__ import annotations

import itertools
import math
import numbers
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from openrl_jupyter._exceptions import UsageError

GRID_KEYS = (
    "lr",
    "rank",
    "loss",
    "group",
    "batch",
    "max_tokens",
    "temperature",
    "seed",
    "normalize_std",
    "overlap",
    "reward",
    "kl_coef",
    "loss_agg",
    "lr_schedule",
    "epochs",
    "minibatches",
    "warmup_steps",
    "top_p",
    "top_k",
)
MAX_POINTS = 64  # runs one sweep may start (the service's per-tenant run quota is the real limit)
_SHORT = {
    "lr": "lr",
    "rank": "r",
    "group": "g",
    "batch": "b",
    "max_tokens": "t",
    "temperature": "temp",
    "seed": "s",
    "kl_coef": "kl",
    "epochs": "ep",
    "minibatches": "mb",
    "warmup_steps": "wu",
    "top_p": "p",
    "top_k": "k",
}
_LOSS_SHORT = {"importance_sampling": "is", "ppo": "ppo"}


def _num(v: Any) -> str:
    """A compact number for a run name: 1e-4, 3e-5, 0.5, 8 (numpy numbers as their Python twins)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        v = int(v)
    elif isinstance(v, numbers.Real) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, float) and v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4):
        mantissa, exp = f"{v:e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exp)}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def reward_label(v: Any) -> str:
    if callable(v):
        name = getattr(v, "__name__", "") or "reward"
        return "lambda" if name == "<lambda>" else name
    return str(v)


def point_label(point: Mapping[str, Any]) -> str:
    """The suffix of a grid point's run name: ``lr1e-4-r8-ppo``."""
    parts = []
    for key, v in point.items():
        if key == "loss":
            parts.append(_LOSS_SHORT.get(v, str(v)))
        elif key == "reward":
            parts.append(reward_label(v))
        elif key == "normalize_std":
            parts.append("std" if v else "nostd")
        elif key == "overlap":
            parts.append(f"ov{int(v)}")
        elif key in ("loss_agg", "lr_schedule"):
            parts.append(str(v))
        else:
            parts.append(f"{_SHORT[key]}{_num(v)}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(parts))


def expand_grid(grid: Any) -> list[dict[str, Any]]:
    """Every combination of the grid's values (in the grid's order), after checking it."""
    if not isinstance(grid, Mapping) or not grid:
        raise UsageError(
            f"grid must be a non-empty dict of train options to lists of values "
            f"(keys: {', '.join(GRID_KEYS)}); got {grid!r}"
        )
    columns: dict[str, list] = {}
    for key, values in grid.items():
        if key not in GRID_KEYS:
            raise UsageError(
                f"grid key {key!r} is not a train option a sweep can vary; use one of {', '.join(GRID_KEYS)}"
            )
        if getattr(values, "ndim", None) == 1 and callable(getattr(values, "tolist", None)):
            values = list(values)  # a 1-D numpy array: its elements (numpy scalars; checked per run)
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise UsageError(
                f"grid[{key!r}] must be a list of values; got {type(values).__name__} {values!r}"
            )
        if not values:
            raise UsageError(f"grid[{key!r}] is empty: give at least one value")
        labels = [reward_label(v) if key == "reward" else repr(v) for v in values]
        if len(set(labels)) != len(labels):
            raise UsageError(f"grid[{key!r}] repeats a value: {list(values)!r}")
        columns[key] = list(values)
    n = math.prod(len(v) for v in columns.values())
    if n > MAX_POINTS:
        raise UsageError(f"the grid has {n} points; a sweep starts at most {MAX_POINTS} runs")
    keys = list(columns)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*columns.values())]


def survivors(n: int, keep: float) -> int:
    """How many of ``n`` ranked runs a rung keeps: the better ``keep`` share, rounded up, at least 1."""
    return max(1, math.ceil(n * keep - 1e-9))


def earliest_rung(steps: int) -> int:
    """The first step a planned rung may fall on: an eighth of the steps (rounded up; step 10 at most,
    as a mean over 10 steps ranks well enough) and never step 1, so no run is dropped on one noisy step."""
    return max(2, min(10, math.ceil(steps / 8)))


def rung_ladder(steps: int) -> list[int]:
    """Every rung that fits ``steps``, increasing: steps/2, steps/4, ... (halved, rounded up), down to
    :func:`earliest_rung`, each at least two steps after the one before."""
    ladder, at = [], steps // 2
    while at >= earliest_rung(steps) and (not ladder or ladder[-1] - at >= 2):
        ladder.append(at)
        at = (at + 1) // 2
    return ladder[::-1]


def plan_rungs(rungs: Any, steps: int, n: int, keep: float) -> list[int]:
    """The step numbers of the rungs: successive halving's, each rung twice as far in as the one before
    (..., steps/4, steps/2), so each rung ranks the runs over as many steps as all the rungs before it.

    ``rungs=None``: as many as bring ``n`` runs down to one at ``keep``, but none before
    :func:`earliest_rung` (steps/8, at least 2 and at most 10) nor within two steps of another: on a
    short sweep the rungs that would come earlier are left out, fewer runs are dropped, and the
    survivors are ranked at the end. A count k: the last k of that ladder (a UsageError when fewer
    fit). A list: those steps, as given."""
    ladder = rung_ladder(steps)
    if rungs is None:
        count, left = 0, n
        while left > 1:
            left = survivors(left, keep)
            count += 1
        return ladder[len(ladder) - min(count, len(ladder)) :]
    if isinstance(rungs, bool):
        raise UsageError(f"rungs must be a count or a list of step numbers; got {rungs!r}")
    if isinstance(rungs, int):
        if not 0 <= rungs <= 16:
            raise UsageError(f"rungs must be a count from 0 to 16 (or a list of steps); got {rungs}")
        if rungs > len(ladder):
            raise UsageError(
                f"rungs={rungs} does not fit {steps} steps: at most {len(ladder)} rung(s) fit "
                f"({_plural(ladder)}), as a rung comes no earlier than step {earliest_rung(steps)} "
                "(an eighth of the steps, from 2 to 10) and two steps after the one before; give fewer "
                "rungs, more steps, or the rungs' steps as a list"
            )
        return ladder[len(ladder) - rungs :]
    if isinstance(rungs, (str, bytes)) or not isinstance(rungs, Sequence):
        raise UsageError(f"rungs must be a count or a list of step numbers; got {rungs!r}")
    at = list(rungs)
    for s in at:
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s < steps:
            raise UsageError(f"rungs must be steps from 1 to steps-1 ({steps - 1}); got {s!r}")
    if at != sorted(set(at)):
        raise UsageError(f"rungs must be increasing step numbers; got {at!r}")
    return at


def _plural(ladder: list[int]) -> str:
    return "steps " + ", ".join(map(str, ladder)) if ladder else "none"


class Score(NamedTuple):
    """A run's score: the mean of the sweep's metric over its rows from step ``first`` to ``last``."""

    value: float | None  # None: no row in the window has the metric
    first: int | None  # the first and last step averaged (None with value)
    last: int | None

    @property
    def steps(self) -> str:
        """The steps averaged, as the repr and ``to_pandas()['score_steps']`` write them: "21-40", "7"."""
        if self.first is None:
            return ""
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


def window_mean(history: Sequence[Mapping[str, Any]], metric: str, since: int, upto: int | None) -> Score:
    """The mean of ``metric`` over the history rows with ``since < step <= upto`` (None: no end), and
    the steps it covers: the one place a sweep's score is computed."""
    end = math.inf if upto is None else upto
    rows = [
        r
        for r in history
        if since < r["step"] <= end
        and isinstance(r.get(metric), (int, float))
        and not isinstance(r.get(metric), bool)
    ]
    if not rows:
        return Score(None, None, None)
    return Score(statistics.fmean(r[metric] for r in rows), rows[0]["step"], rows[-1]["step"])
