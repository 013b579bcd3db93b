"""Group-relative advantages: how a step's rewards become the weights of its update."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float | None], *, normalize_std: bool = False) -> list[float]:
    """reward − mean of the group's successful samples (÷ their std if asked); 0 for failed ones."""
    valid = [r for r in rewards if r is not None]
    if len(valid) < 2:
        return [0.0] * len(rewards)
    mean = statistics.fmean(valid)
    std = statistics.pstdev(valid)
    out = []
    for r in rewards:
        if r is None:
            out.append(0.0)
            continue
        a = r - mean
        if normalize_std:
            a = a / (std + 1e-6) if std > 0 else 0.0
        out.append(a)
    return out
