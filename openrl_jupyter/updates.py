"""A step's update: its chosen samples sent as ``epochs`` × ``minibatches`` train steps, each at the
learning rate the schedule gives it (``knobs.lr_at``), each with the step's ``kl_coef`` and loss.

Every train step of a step carries its own idempotency key (the step's key, then ``<key>-1``,
``<key>-2``...), and the updates already answered are kept with the prepared step: a step whose reply was
lost re-sends only what is left, each with the same key, so the service applies each update once. Each
update's importance ratio is against the sampler's logprobs (the service keeps them with the samples),
so the second epoch's ratio shows how far the first moved the policy (and ppo clips it).
"""

from __future__ import annotations

import statistics
from typing import Any

from openrl_jupyter._exceptions import RequestError
from openrl_jupyter.knobs import lr_at, minibatch_plan
from openrl_jupyter.steps import PreparedStep

DEFAULT_LR = 1e-4  # a service that does not say its model's learning rate uses this


def learning_rate(config: Any, step: int, update: int) -> float | None:
    """The learning rate of update ``update`` (0-based) of step ``step`` (1-based); None: the service's
    default (a constant schedule with no lr given)."""
    knobs = config.knobs
    if config.lr is None and knobs.lr_schedule == "constant" and not knobs.warmup_steps:
        return None
    per_step = knobs.updates_per_step
    return lr_at(
        (step - 1) * per_step + update,
        config.steps * per_step,
        lr=config.lr if config.lr is not None else (config.base_lr or DEFAULT_LR),
        schedule=knobs.lr_schedule,
        warmup=knobs.warmup_steps * per_step,
    )


async def train(run: Any, client: Any, pending: PreparedStep) -> dict:
    """The step's updates (none when no sample carries an advantage), merged into one reply. A refusal
    (4xx) of its first update drops the prepared step, so a retry samples afresh; a refusal of a later
    one ends the step with the updates already applied (said in the log: they are not applied twice);
    a lost or failed reply keeps the step (with the updates already answered) for re-sending."""
    if not pending.chosen:
        return {}
    cfg = run.config
    knobs = cfg.knobs
    plan = minibatch_plan(
        len(pending.chosen),
        epochs=knobs.epochs,
        minibatches=knobs.minibatches,
        seed=(cfg.seed or 0) * 7_919 + pending.step,
    )
    while len(pending.replies) < len(plan):
        u = len(pending.replies)
        lr = learning_rate(cfg, pending.step, u)
        extra = {"kl_coef": knobs.kl_coef} if knobs.kl_coef else {}
        try:
            reply = await client.train_step(
                run.run_id,
                [pending.chosen[i] for i in plan[u]],
                loss=cfg.loss,
                optimizer={"learning_rate": lr} if lr is not None else {},
                idempotency_key=pending.key if u == 0 else f"{pending.key}-{u}",
                **extra,
            )
        except RequestError as exc:
            if not pending.replies:
                run._pending = None
                raise
            run._log(
                f"step {pending.step}: update {u + 1} of {len(plan)} was refused ({exc}); the step keeps "
                f"the {u} applied"
            )
            break
        pending.replies.append(reply)
    return merged(pending.replies)


def merged(replies: list[dict]) -> dict:
    """One step's update statistics from its updates' replies: means of the per-update numbers, the
    extremes of the ratio, the sum of the tokens, the last learning rate, and how many updates."""
    if len(replies) == 1:
        return {**replies[0], "updates": 1}

    def mean(key: str) -> float | None:
        values = [r[key] for r in replies if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    def pick(key: str, fn) -> float | None:
        values = [r[key] for r in replies if r.get(key) is not None]
        return fn(values) if values else None

    out = {k: mean(k) for k in ("loss", "ratio_mean", "kl", "kl_ref", "clip_fraction", "grad_norm")}
    out.update(
        ratio_min=pick("ratio_min", min),
        ratio_max=pick("ratio_max", max),
        tokens=sum(int(r.get("tokens") or 0) for r in replies),
        learning_rate=replies[-1].get("learning_rate"),
        updates=len(replies),
    )
    return out
