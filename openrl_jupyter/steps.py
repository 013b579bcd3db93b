"""One RL step's data on the notebook side: the step sampled and scored (:class:`PreparedStep`), its
history row, and which of its fields are stored with the run on the service (``REPORTED``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from openrl_jupyter.rewards import RewardVersion, Scored

REPORTED = (  # stored with the run on the service: what an attached view (another kernel) draws
    "reward_mean",
    "reward_std",
    "reward_min",
    "reward_max",
    "reward_name",
    "reward_version",
    "failed",
    "n",
    "trained",
    "loss",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "kl",
    "clip_fraction",
    "grad_norm",
    "tokens",
    "elapsed_s",
    "turns",
    "tool_calls",
    "tool_errors",
    "kl_ref",
    "learning_rate",
    "updates",
    "skipped_groups",
    "eval_reward",
)
REPORTED_PREFIXES = ("rewards/",)  # reward={"name": weight}: each reward's mean


@dataclass
class PreparedStep:
    """A step sampled and scored, waiting for (or re-sending) its train_step."""

    step: int
    version: RewardVersion
    n: int  # samples drawn
    scored: Scored
    chosen: list[dict]  # {"sample_id", "advantage"} of the samples the update trains on
    off_policy: int
    next_prompts: list[dict] | None  # already being sampled (overlap)
    times: tuple[float, float, float]  # started, sampled, scored
    key: str  # the train_step's X-Idempotency-Key: the same for every send of this step
    extra: dict = field(default_factory=dict)  # an environment run's episode numbers (turns, tool_calls...)
    replies: list[dict] = field(default_factory=list)  # the updates answered so far (updates.py)


def reported(row: dict) -> dict:
    """What of a history row is stored with the run on the service."""
    return {
        k: v
        for k, v in row.items()
        if v is not None and (k in REPORTED or k.startswith(REPORTED_PREFIXES)) and k != "step"
    }


def step_row(pending: PreparedStep, trained: dict, started_at: float) -> dict:
    """The step's history row: reward statistics, the update's statistics, timings."""
    t0, t_sampled, t_scored = pending.times
    t_trained = time.time()
    scored, version = pending.scored, pending.version
    valid = [r for r in scored.rewards if r is not None]
    return {
        "step": pending.step,
        "reward_mean": statistics.fmean(valid),
        "reward_std": statistics.pstdev(valid) if len(valid) > 1 else 0.0,
        "reward_min": min(valid),
        "reward_max": max(valid),
        "reward_name": version.name,
        "reward_version": version.version,
        "failed": len(scored.rewards) - len(valid),
        "n": pending.n,
        "off_policy": pending.off_policy,
        "trained": len(pending.chosen),
        "loss": trained.get("loss"),
        "ratio_mean": trained.get("ratio_mean"),
        "ratio_min": trained.get("ratio_min"),
        "ratio_max": trained.get("ratio_max"),
        "kl": trained.get("kl"),
        "kl_ref": trained.get("kl_ref"),
        "learning_rate": trained.get("learning_rate"),
        "updates": trained.get("updates", 0),
        "clip_fraction": trained.get("clip_fraction"),
        "grad_norm": trained.get("grad_norm"),
        "tokens": trained.get("tokens", 0),
        "sample_s": t_sampled - t0,
        "score_s": t_scored - t_sampled,
        "train_s": t_trained - t_scored,
        "time": t_trained,
        "elapsed_s": t_trained - started_at,
        **pending.extra,
    }
