"""A single-turn step before its update (``Run._prepare`` for ``train(reward=...)``): ``group`` samples of
each prompt drawn from the run's current weights, scored with its reward (or its rewards, weighted), groups
that all scored the same replaced by fresh prompts once when others did not (``skip_zero_variance``,
``refills``), then group-relative advantages, weighted per ``loss_agg``. An environment run's steps are ``rollouts.prepare_step``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from openrl_jupyter.advantages import chosen_samples
from openrl_jupyter.knobs import aggregated, column_means, score_weighted, zero_variance
from openrl_jupyter.rewards import RewardVersion, Scored, registry, score
from openrl_jupyter.steps import PreparedStep


async def samples_step(run: Any, client: Any, step: int, prompts: list[dict]) -> PreparedStep:
    """Sample, score and compute advantages: everything of a step before its update."""
    t0 = time.time()
    cfg = run.config
    out, prompts, off_policy = await run._draw(client, step, prompts)
    next_prompts = run._prefetch_next(client, step)
    t_sampled = time.time()
    samples = out["samples"]
    version, scored, columns = await score_samples(run, step, prompts, samples)
    skipped = len(zero_variance(scored.rewards, groups_of(samples)))
    if refills(cfg, skipped, len(prompts)):  # as many fresh prompts, once (DAPO's dynamic sampling)
        more_prompts = run._next_prompts(skipped)
        more = (await run._sample(client, step, more_prompts, salt=1))["samples"]
        more = [{**s, "prompt_index": s["prompt_index"] + len(prompts)} for s in more]
        prompts, samples = prompts + more_prompts, samples + more
        _, extra, more_columns = await score_samples(
            run, step, prompts, samples, start=len(samples) - len(more), can_pause=False
        )
        scored = Scored(
            scored.rewards + extra.rewards,
            scored.errors + extra.errors,
            scored.stdout + extra.stdout,
            scored.traceback or extra.traceback,
            scored.version,
        )
        columns = {k: v + more_columns.get(k, []) for k, v in columns.items()}
        skipped += len(zero_variance(scored.rewards, groups_of(samples)[-len(more_prompts) :]))
    chosen = chosen_samples(samples, scored.rewards, groups_of(samples), cfg.normalize_std)
    lengths = {s["sample_id"]: len(s["tokens"]) for s in samples}
    return PreparedStep(
        step=step,
        version=version,
        n=len(samples),
        scored=scored,
        chosen=aggregated(chosen, [lengths[c["sample_id"]] for c in chosen], cfg.knobs.loss_agg),
        off_policy=off_policy,
        next_prompts=next_prompts,
        times=(t0, t_sampled, time.time()),
        key=uuid.uuid4().hex,
        extra={"skipped_groups": skipped, **column_means(columns)},
    )


async def score_samples(
    run: Any, step: int, prompts: list[dict], samples: list[dict], start: int = 0, can_pause: bool = True
) -> tuple[RewardVersion, Scored, dict[str, list]]:
    """Score ``samples[start:]`` in the runner's pool with the run's reward (the newest version of a
    named one), or its rewards weighted (and each one's rewards, by column); then keep and show
    them (``_shown``)."""
    samples = samples[start:]
    groups = groups_of(samples)
    texts = [prompts[s["prompt_index"]]["prompt"] for s in samples]
    infos = [dict(prompts[s["prompt_index"]]["info"]) for s in samples]
    completions = [s["text"] for s in samples]
    pool = run._runner.pool
    columns: dict[str, list] = {}
    if run.config.parts:
        scored, columns, version = await score_weighted(
            run.config.parts, texts, completions, infos, groups=groups, pool=pool
        )
    else:
        version = run.config.reward_fn or registry.latest(run.config.reward)
        scored = await score(version, texts, completions, infos, groups=groups, pool=pool)
    if scored.stdout:
        run._log(scored.stdout.rstrip("\n"))
    shown = run._shown(scored, scored.version or version, step, texts, completions, can_pause)
    return version, shown, columns


def refills(cfg: Any, flat: int, groups: int) -> bool:
    """Whether a step whose draw had ``flat`` of ``groups`` groups scoring all the same draws as many
    fresh prompts: with ``skip_zero_variance``, when some group of the draw did spread (where every group
    is flat, as early on with a sparse reward, fresh prompts would most likely be flat too)."""
    return bool(cfg.knobs.skip_zero_variance and 0 < flat < groups)


def groups_of(samples: list[dict]) -> list[list[int]]:
    """The indices of each prompt's samples, in the order the prompts come."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s["prompt_index"], []).append(i)
    return list(groups.values())
