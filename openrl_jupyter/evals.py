"""Evaluation: a checkpoint scored on held-out prompts (``Session.evaluate``), and a training run's
periodic evaluation (``train(eval_every=N, eval_prompts=..., eval_metric=...)``).

Every ``eval_every`` steps and after the last (only after the last when ``eval_every`` is 0), the run
samples each of ``eval_prompts`` once, greedily, from its current weights, and scores them with
``eval_metric`` (a reward's name or function; default the run's own reward, weighted as in training); an
environment run plays one greedy episode per prompt. The mean (a sample that failed to score counts 0)
is the step's ``eval_reward`` column. A better mean than every earlier one saves the weights as the
checkpoint ``<run>-best`` (``run.best``: step, eval_reward, path). ``save_every`` saves ``<run>-stepN``
every N steps (``run.checkpoints``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from openrl_jupyter._exceptions import OpenRLError
from openrl_jupyter.rewards import registry, score


def evaluate(
    session: Any,
    *,
    env: Any,
    prompts: Any,
    checkpoint: str | None,
    greedy: bool,
    group: int,
    max_tokens: int | None,
    max_turns: int,
    max_episode_tokens: int | None,
    step_timeout_s: float,
    seed: int,
    rank: int | None,
) -> Evaluation:
    """``Session.evaluate``: a temporary run on ``checkpoint`` plays ``group`` episodes per row."""
    from openrl_jupyter import rollouts
    from openrl_jupyter.config import load_prompts, make_config
    from openrl_jupyter.runner import get_runner

    cfg = make_config(
        session.checked_by(session.model),
        env=env,
        prompts=prompts,
        group=max(2, group),  # (checked as a training group; evaluation plays ``group``)
        max_tokens=max_tokens,
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        step_timeout_s=step_timeout_s,
    )
    from openrl_jupyter.env import envs

    version = cfg.reward_fn or envs.latest(cfg.reward)
    rows = load_prompts(prompts)
    fields: dict[str, Any] = {"name": f"eval-{version.name}", "seed": seed}
    if rank is not None:
        fields["rank"] = rank
    if checkpoint is not None:
        fields["load_from"] = checkpoint
    if session.model is not None:
        fields["base_model"] = session.model
    created = session.client.create_run(**fields)

    async def play() -> list:
        return await rollouts.play(
            client=session.async_client(),
            session=session,
            run_id=created["run_id"],
            model=session.model,
            version=version,
            prompts=rows,
            group=group,
            sampling={"max_tokens": cfg.max_tokens, "temperature": 0.0 if greedy else 1.0, "seed": seed},
            limits=rollouts.Limits(cfg.max_turns, cfg.max_episode_tokens, cfg.step_timeout_s),
        )

    try:
        episodes = get_runner().submit(play()).result()
    finally:
        session.client.delete_run(created["run_id"])
    return Evaluation(checkpoint=checkpoint, env=version.name, episodes=episodes, prompts=rows)


async def periodic(run: Any, client: Any, step: int) -> dict:
    """After step ``step`` of ``run``: its evaluation and checkpoints when they are due, as history
    columns (``eval_reward``, ``eval_n``, ``eval_failed``, ``saved``); {} when none is due. A save or an
    evaluation that fails is logged and the run goes on."""
    knobs, cfg = run.config.knobs, run.config
    out: dict[str, Any] = {}
    last = step == cfg.steps
    if knobs.save_every and (step % knobs.save_every == 0 or last):
        name = f"{run.name}-step{step}"
        try:
            path = await client.save(run.run_id, name, overwrite=True)
            run.checkpoints.append(path)
            out["saved"] = path
        except OpenRLError as exc:
            run._log(f"step {step}: could not save {name} ({exc})")
    due = (knobs.eval_every and step % knobs.eval_every == 0) or last
    if not (cfg.eval_prompts and due):
        return out
    try:
        rewards = await _eval_rewards(run, client, step)
    except OpenRLError as exc:
        run._log(f"step {step}: the evaluation failed ({exc})")
        return out
    valid = [r for r in rewards if r is not None]
    out["eval_n"] = len(rewards)
    out["eval_failed"] = len(rewards) - len(valid)
    if not valid:
        run._log(f"step {step}: every evaluation sample failed in {cfg.eval_metric or cfg.reward}")
        return out
    # a sample whose scoring failed counts 0, as in Session.evaluate (eval_failed says how many)
    mean = out["eval_reward"] = statistics.fmean(r if r is not None else 0.0 for r in rewards)
    if run.best is None or mean > run.best["eval_reward"]:
        try:
            path = await client.save(run.run_id, f"{run.name}-best", overwrite=True)
            run.best = {"step": step, "eval_reward": mean, "path": path}
            out["best"] = path
        except OpenRLError as exc:
            run._log(f"step {step}: could not save {run.name}-best ({exc})")
    return out


async def _eval_rewards(run: Any, client: Any, step: int) -> list[float | None]:
    """Each eval prompt's score: one greedy sample (or episode) from the run's current weights."""
    from openrl_jupyter.knobs import score_weighted

    cfg = run.config
    rows = cfg.eval_prompts or []
    sampling = {"max_tokens": cfg.max_tokens, "temperature": 0.0, **cfg.knobs.sampling()}
    if cfg.env:
        from openrl_jupyter import rollouts
        from openrl_jupyter.env import envs

        episodes = await rollouts.play(
            client=client,
            session=run.session,
            run_id=run.run_id,
            model=cfg.model or run.session.model,
            version=cfg.reward_fn or envs.latest(cfg.reward),
            prompts=rows,
            group=1,
            sampling=sampling,
            limits=rollouts.Limits(cfg.max_turns, cfg.max_episode_tokens, cfg.step_timeout_s),
        )
        return [None if ep.error is not None else ep.reward for ep in episodes]
    out = await client.sample(run.run_id, [p["prompt"] for p in rows], num_samples=1, **sampling)
    samples = out["samples"]
    texts = [rows[s["prompt_index"]]["prompt"] for s in samples]
    infos = [dict(rows[s["prompt_index"]]["info"]) for s in samples]
    completions = [s["text"] for s in samples]
    groups = [[i] for i in range(len(samples))]
    pool = run._runner.pool
    if cfg.eval_metric is not None:
        version = cfg.eval_fn or registry.latest(cfg.eval_metric)
        return (await score(version, texts, completions, infos, groups=groups, pool=pool)).rewards
    if cfg.parts:
        return (await score_weighted(cfg.parts, texts, completions, infos, groups=groups, pool=pool))[
            0
        ].rewards
    version = cfg.reward_fn or registry.latest(cfg.reward)
    return (await score(version, texts, completions, infos, groups=groups, pool=pool)).rewards


@dataclass
class Evaluation:
    """What :meth:`Session.evaluate` found: every episode, and their mean reward (failed ones count 0)."""

    checkpoint: str | None
    env: str
    episodes: list
    prompts: list

    @property
    def reward(self) -> float:
        return sum(ep.reward or 0.0 for ep in self.episodes) / max(1, len(self.episodes))

    @property
    def failed(self) -> int:
        return sum(ep.error is not None for ep in self.episodes)

    def to_pandas(self):
        """One row per episode: prompt, reward, turns, tool calls, why it ended, error."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "prompt": self.prompts[ep.row]["prompt"],
                    "reward": ep.reward,
                    "stop": ep.stop,
                    "error": ep.error,
                    **ep.metrics(),
                }
                for ep in self.episodes
            ]
        )

    def __repr__(self) -> str:
        where = self.checkpoint or "the base model"
        return (
            f"<openrl Evaluation of {where} on {self.env}: mean reward {self.reward:.3f} over "
            f"{len(self.episodes)} episodes, {self.failed} failed>"
        )
