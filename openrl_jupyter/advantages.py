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


def chosen_samples(
    samples: list[dict], rewards: Sequence[float | None], groups, normalize_std: bool = False
) -> list[dict]:
    """The samples worth training on (``{"sample_id", "advantage"}``), each with its group-relative
    advantage: ``groups`` are lists of indices into ``samples``; a zero advantage or an empty
    completion trains nothing and is left out."""
    advantages: list[float] = [0.0] * len(samples)
    for idx in groups:
        group = [rewards[i] for i in idx]
        for i, a in zip(idx, group_advantages(group, normalize_std=normalize_std), strict=True):
            advantages[i] = a
    return [
        {"sample_id": s["sample_id"], "advantage": a}
        for s, a in zip(samples, advantages, strict=True)
        if a != 0.0 and s["tokens"]
    ]
