"""The RL knobs of ``train`` past the basics, each checked at the cell, and what they compute.

    lr_at(u, total, lr=1e-3, schedule="cosine", warmup=5)   # the learning rate of optimizer update u
    minibatch_plan(12, epochs=2, minibatches=3, seed=0)       # which samples each update trains on
    aggregated(chosen, lengths, "sequence")                   # advantages weighted per sequence
    await score_weighted(parts, prompts, completions, ...)    # several rewards, weighted, one total

The defaults are those that work for GRPO-style training of small models (docs/knobs.md says why):
no KL term (kl_coef=0, as DAPO, Dr. GRPO and TRL's GRPO default), a constant learning rate with no
warmup (short runs, as tinker-cookbook's RL recipes), one optimizer pass per batch (on-policy),
token-level loss aggregation (every sampled token weighs the same, as DAPO and Dr. GRPO argue against
the length bias of per-sequence means), and groups whose samples all score the same are skipped and
replaced by fresh prompts once per step (DAPO's dynamic sampling: they carry no learning signal).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from openrl_common.checks import integer, number
from openrl_jupyter._exceptions import UsageError
from openrl_jupyter.rewards import RewardVersion, Scored, registry, score

LR_SCHEDULES = ("constant", "linear", "cosine")
LOSS_AGGS = ("token", "sequence")
MAX_EPOCHS = 16


@dataclass(frozen=True)
class Knobs:
    """The checked knobs (``make_config`` builds them; ``TrainConfig.knobs``)."""

    kl_coef: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    epochs: int = 1
    minibatches: int = 1
    loss_agg: str = "token"
    skip_zero_variance: bool = True
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    eval_every: int = 0
    save_every: int = 0

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.minibatches

    def sampling(self) -> dict[str, Any]:
        """The rollouts' extra sampling parameters."""
        out: dict[str, Any] = {}
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.stop:
            out["stop"] = list(self.stop)
        return out


def check_knobs(
    *,
    kl_coef: Any = 0.0,
    lr_schedule: Any = "constant",
    warmup_steps: Any = 0,
    epochs: Any = 1,
    minibatches: Any = 1,
    loss_agg: Any = "token",
    skip_zero_variance: Any = True,
    top_p: Any = None,
    top_k: Any = None,
    stop: Any = None,
    eval_every: Any = 0,
    save_every: Any = 0,
    steps: int,
    batch: int,
    group: int,
    max_stop: tuple[int, str] = (16, "the service's OPENRL_MAX_STOP_SEQUENCES"),
) -> Knobs:
    """Each knob checked, its error naming it and its limit (``max_stop``: the service's bound on stop
    strings, and the setting that raises it)."""
    kl_coef = number(kl_coef, "kl_coef", 0, 1e6, error=UsageError)
    if lr_schedule not in LR_SCHEDULES:
        raise UsageError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got {lr_schedule!r}")
    warmup_steps = integer(warmup_steps, "warmup_steps", 0, steps - 1 if steps > 1 else 0, error=UsageError)
    epochs = integer(epochs, "epochs", 1, MAX_EPOCHS, error=UsageError)
    minibatches = integer(
        minibatches,
        "minibatches",
        1,
        batch * group,
        setting="batch × group (one sample each)",
        error=UsageError,
    )
    if loss_agg not in LOSS_AGGS:
        raise UsageError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}; got {loss_agg!r}")
    if not isinstance(skip_zero_variance, bool):
        raise UsageError(f"skip_zero_variance must be True or False; got {skip_zero_variance!r}")
    if top_p is not None:
        top_p = number(top_p, "top_p", 0, 1, lo_open=True, error=UsageError)
    if top_k is not None:
        top_k = integer(top_k, "top_k", 1, 1_000_000, error=UsageError)
    stops: tuple[str, ...] = ()
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, Sequence) or not all(isinstance(s, str) and s for s in items):
            raise UsageError(f"stop must be a string or a list of non-empty strings; got {stop!r}")
        if len(items) > max_stop[0]:
            raise UsageError(f"stop takes at most {max_stop[0]} strings ({max_stop[1]}); got {len(items)}")
        stops = tuple(items)
    eval_every = integer(eval_every, "eval_every", 0, steps, error=UsageError)
    save_every = integer(save_every, "save_every", 0, steps, error=UsageError)
    return Knobs(
        kl_coef=float(kl_coef),
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps,
        epochs=epochs,
        minibatches=minibatches,
        loss_agg=loss_agg,
        skip_zero_variance=skip_zero_variance,
        top_p=None if top_p is None else float(top_p),
        top_k=top_k,
        stop=stops,
        eval_every=eval_every,
        save_every=save_every,
    )


def lr_at(update: int, total: int, *, lr: float, schedule: str, warmup: int) -> float:
    """The learning rate of optimizer update ``update`` (0-based) of ``total``: a linear warmup over the
    first ``warmup`` updates, then constant, or a linear or cosine decay towards 0 at ``total`` (the
    last update's rate is the floor: lr / (total − warmup) for linear, about its square for cosine)."""
    if update < warmup:
        return lr * (update + 1) / (warmup + 1)
    if schedule == "constant":
        return lr
    span = max(1, total - warmup)
    progress = (update - warmup) / span
    if schedule == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def minibatch_plan(n: int, *, epochs: int, minibatches: int, seed: int) -> list[list[int]]:
    """Which of ``n`` chosen samples each optimizer update of a step trains on: every epoch shuffles them
    (seeded, so a re-sent step trains on the same ones) and splits them into ``minibatches`` parts (fewer
    when there are fewer samples)."""
    rng = random.Random(seed)
    parts = max(1, min(minibatches, n))
    plan = []
    for _ in range(epochs):
        order = list(range(n))
        if epochs > 1 or parts > 1:
            rng.shuffle(order)
        size, extra = divmod(n, parts)
        start = 0
        for p in range(parts):
            end = start + size + (1 if p < extra else 0)
            plan.append(sorted(order[start:end]))
            start = end
    return plan


def aggregated(chosen: list[dict], lengths: Sequence[int], mode: str) -> list[dict]:
    """``chosen`` with advantages for ``loss_agg``: "token" leaves them (the service sums over tokens, so
    each token weighs the same), "sequence" divides each by its sample's sampled tokens and multiplies by
    their mean over the batch (each sequence then weighs the same, whatever its length, at the token
    mode's scale, so the learning rate means the same)."""
    if mode == "token" or not chosen:
        return chosen
    mean = statistics.fmean(max(1, n) for n in lengths)
    return [
        {**c, "advantage": c["advantage"] * mean / max(1, n)} for c, n in zip(chosen, lengths, strict=True)
    ]


def zero_variance(rewards: Sequence[float | None], groups: Sequence[Sequence[int]]) -> list[int]:
    """The indices (into ``groups``) of the groups whose successful samples all scored the same."""
    out = []
    for g, idx in enumerate(groups):
        valid = [rewards[i] for i in idx if rewards[i] is not None]
        if len(valid) >= 2 and max(valid) == min(valid):
            out.append(g)
    return out


def weights_of(reward: Any) -> list[tuple[Any, float]] | None:
    """``reward={"name": weight, ...}`` (keys: registered names or functions) as checked pairs; None for
    a single reward."""
    if not isinstance(reward, Mapping):
        return None
    if not reward:
        raise UsageError('reward={} is empty: give {"name": weight, ...} with at least one reward')
    out = []
    for key, w in reward.items():
        if not (isinstance(key, str) or callable(key)):
            raise UsageError(f"reward's keys must be reward names or functions; got {key!r}")
        label = key if isinstance(key, str) else getattr(key, "__name__", "reward")
        out.append((key, float(number(w, f"reward[{label!r}] (its weight)", -1e6, 1e6, error=UsageError))))
    return out


async def score_weighted(
    parts: Sequence[tuple[str, float, Any]],
    prompts: Sequence[str],
    completions: Sequence[str],
    infos: Sequence[dict],
    *,
    groups: Sequence[Sequence[int]],
    pool: Any,
) -> tuple[Scored, dict[str, list[float | None]], RewardVersion]:
    """Several rewards on the same samples: the weighted total (None where any of them failed), each
    one's rewards by ``rewards/<name>`` (its history column is their mean), and the combination's
    version (its name joins theirs; its number grows whenever one of them is redefined)."""
    totals: list[float | None] = [0.0] * len(completions)
    errors: list[str | None] = [None] * len(completions)
    blame: list[tuple[RewardVersion, str | None] | None] = [None] * len(completions)  # who failed sample i
    stdout, columns, versions = "", {}, []
    for name, weight, fixed in parts:
        version = fixed or registry.latest(name)
        versions.append(version)
        one = await score(version, prompts, completions, infos, groups=groups, pool=pool)
        stdout += one.stdout
        columns[f"rewards/{name}"] = list(one.rewards)
        for i, r in enumerate(one.rewards):
            if r is None:
                totals[i] = None
                if errors[i] is None:
                    errors[i], blame[i] = one.errors[i], (version, one.traceback)
            elif totals[i] is not None:
                totals[i] += weight * r
    combined = RewardVersion(
        "+".join(p[0] for p in parts),
        sum(v.version for v in versions),
        versions[0].fn,
        versions[0].per_group,
        versions[0].is_async,
    )
    # a failure names the reward that failed the first failing sample (Scored.failure shows that sample)
    first = next((b for b in blame if b is not None), None)
    failing, trace = first if first is not None else (versions[0], None)
    return Scored(totals, errors, stdout, trace, failing), columns, combined


def column_means(columns: Mapping[str, Sequence[float | None]]) -> dict[str, float]:
    """Each reward's mean over the samples it scored."""
    out = {}
    for name, values in columns.items():
        valid = [v for v in values if v is not None]
        if valid:
            out[name] = statistics.fmean(valid)
    return out
