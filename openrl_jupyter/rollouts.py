"""One RL step's episodes: every prompt's ``group`` environments played to the end against the run's current
weights, a sampling call per turn for every episode still going (so the service batches them), the
environments' steps run concurrently in this kernel.

An episode ends when its environment says so, after ``max_turns`` turns, or when its next turn cannot
fit ``max_episode_tokens``; a turn cut at ``max_tokens`` is the environment's to judge (``extra``). An environment that raises, or whose call takes longer than ``step_timeout_s``, fails its episode:
shown as a failing reward is, left out of the update. Group-relative advantages are taken over the
episodes of one prompt (one initial state); the train step names each episode's turns
(openrl_common/episodes.py puts the environment's tokens at weight 0).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

from openrl_jupyter.advantages import group_advantages
from openrl_jupyter.env import EnvFromMessageEnv, MessageEnv, Renderer, envs, tokens_of
from openrl_jupyter.knobs import aggregated, zero_variance
from openrl_jupyter.rewards import RewardVersion, Scored
from openrl_jupyter.steps import PreparedStep

MAX_PROMPTS_PER_CALL = 64  # one sampling call's prompts (the service's OPENRL_MAX_DATUMS is larger)


@dataclass
class Limits:
    max_turns: int = 8
    max_episode_tokens: int = 2048
    step_timeout_s: float = 60.0


@dataclass
class Turn:
    observation: list[int]
    sample_id: str
    tokens: list[int]
    text: str
    reward: float
    metrics: dict


@dataclass
class Episode:
    """One environment's play: its turns, total reward, why it ended, or the error that ended it."""

    row: int  # which prompt (initial state) it started from
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = 0.0
    error: str | None = None
    trace: str | None = None
    stop: str = "completed"  # completed | max_turns | max_tokens | error | timeout
    env: Any = None
    observation: list[int] = field(default_factory=list)
    stop_condition: Any = None

    @property
    def transcript(self) -> str:
        """The model's turns, as the dashboard shows an episode's "completion"."""
        return "\n⏎ ".join(t.text for t in self.turns)

    def metrics(self) -> dict[str, float]:
        """Per-episode numbers: turns, reward, and each turn metric summed (tool_calls, tool_errors...)."""
        out: dict[str, float] = {"turns": float(len(self.turns))}
        for t in self.turns:
            for k, v in t.metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0.0) + float(v)
        return out


def _user_trace(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-6))


def _fail(ep: Episode, exc: BaseException, what: str) -> None:
    ep.reward, ep.stop = None, "timeout" if isinstance(exc, asyncio.TimeoutError) else "error"
    if isinstance(exc, asyncio.TimeoutError):
        ep.error = f"{what} took longer than step_timeout_s"
    else:
        ep.error = f"{what}: {type(exc).__name__}: {exc}"
        ep.trace = _user_trace(exc)


def _make(version: RewardVersion, prompt: Any, info: dict, session: Any, model: str | None) -> Any:
    env = version.fn(prompt, dict(info))
    if isinstance(env, MessageEnv):
        return EnvFromMessageEnv(env, Renderer(session, model))
    if not (hasattr(env, "initial_observation") and hasattr(env, "step")):
        raise TypeError(
            f"environment {version.name} v{version.version} returned {type(env).__name__}, not an Env or MessageEnv"
        )
    return env


async def play(
    *,
    client: Any,
    session: Any,
    run_id: str,
    model: str | None,
    version: RewardVersion,
    prompts: list[dict],
    group: int,
    sampling: dict,
    limits: Limits,
) -> list[Episode]:
    """Every prompt's ``group`` episodes, played to their end; ``sampling``: max_tokens, temperature, seed."""
    episodes = [Episode(row=i) for i, _ in enumerate(prompts) for _ in range(group)]
    timeout = limits.step_timeout_s

    async def start(ep: Episode) -> None:
        try:
            ep.env = _make(
                version, prompts[ep.row]["prompt"], prompts[ep.row].get("info") or {}, session, model
            )
            ob, stop = await asyncio.wait_for(ep.env.initial_observation(), timeout)
            ep.observation, ep.stop_condition = tokens_of(ob), stop
        except Exception as e:  # noqa: BLE001 - the user's environment: its episode fails
            _fail(ep, e, "initial_observation")

    await asyncio.gather(*(start(ep) for ep in episodes))
    active = [ep for ep in episodes if ep.error is None]
    wave = 0
    while active:
        wave += 1
        going = []
        for ep in active:
            if len(ep.turns) >= limits.max_turns:
                ep.stop = "max_turns"
            elif len(ep.observation) + 1 > limits.max_episode_tokens or not ep.observation:
                ep.stop = "max_tokens"
            else:
                going.append(ep)
        if not going:
            break
        await _sample_turns(client, run_id, going, sampling, limits, wave)
        results = await asyncio.gather(*(_step(ep, timeout) for ep in going))
        active = [ep for ep, more in zip(going, results, strict=True) if more]
    for ep in episodes:
        if ep.error is None:
            ep.reward = sum(t.reward for t in ep.turns)
    return episodes


async def _sample_turns(
    client: Any, run_id: str, going: list[Episode], sampling: dict, limits: Limits, wave: int
) -> None:
    """One sampling call per stop condition (and chunk) for every episode's next turn."""
    by_stop: dict[tuple, list[Episode]] = {}
    for ep in going:
        by_stop.setdefault(tuple(ep.stop_condition or ()), []).append(ep)
    calls = []
    for stop, eps in by_stop.items():
        for k in range(0, len(eps), MAX_PROMPTS_PER_CALL):
            chunk = eps[k : k + MAX_PROMPTS_PER_CALL]
            room = min(limits.max_episode_tokens - len(ep.observation) for ep in chunk)
            params: dict[str, Any] = {
                "num_samples": 1,
                "max_tokens": max(1, min(sampling["max_tokens"], room)),
                "temperature": sampling["temperature"],
                **{k: sampling[k] for k in ("top_p", "top_k") if sampling.get(k) is not None},
            }
            if stop:
                params["stop"] = list(stop)
            if sampling.get("seed") is not None:
                params["seed"] = (sampling["seed"] + 7_919 * wave + k) % 2**31
            calls.append(
                (chunk, client.sample(run_id, [{"tokens": ep.observation} for ep in chunk], **params))
            )
    for chunk, pending in calls:
        out = await pending
        for ep, s in zip(chunk, out["samples"], strict=True):
            ep.turns.append(Turn(ep.observation, s["sample_id"], list(s["tokens"]), s["text"], 0.0, {}))
            ep.stop = "max_tokens" if s.get("stop_reason") == "length" else "completed"


async def _step(ep: Episode, timeout: float) -> bool:
    """The environment's answer to the episode's newest turn; whether the episode goes on. A turn cut
    at ``max_tokens`` reaches the environment with ``extra={"stop_reason": "length"}``: it decides."""
    turn = ep.turns[-1]
    extra = {"stop_reason": "length" if ep.stop == "max_tokens" else "stop"}
    try:
        result = await asyncio.wait_for(ep.env.step(turn.tokens, extra=extra), timeout)
        turn.reward = float(result.reward)
        turn.metrics = dict(result.metrics or {})
        ep.stop = "completed"
        if result.episode_done:
            return False
        ep.observation, ep.stop_condition = tokens_of(result.next_observation), result.next_stop_condition
        return True
    except Exception as e:  # noqa: BLE001 - the user's environment: its episode fails
        _fail(ep, e, "step")
        return False


def scored(episodes: list[Episode], version: RewardVersion) -> Scored:
    """The episodes' rewards as a step's scores (None where an episode failed)."""
    first = next((ep for ep in episodes if ep.error is not None), None)
    return Scored(
        rewards=[ep.reward for ep in episodes],
        errors=[ep.error for ep in episodes],
        traceback=first.trace if first is not None else None,
        version=version,
    )


def chosen_episodes(episodes: list[Episode], normalize_std: bool) -> list[dict]:
    """``{"episode": [sample ids], "advantage"}`` per episode worth training on: its reward against
    the mean of its prompt's episodes (÷ their std if asked); failed and zero-advantage ones left out."""
    rows: dict[int, list[Episode]] = {}
    for ep in episodes:
        rows.setdefault(ep.row, []).append(ep)
    chosen = []
    for eps in rows.values():
        for ep, adv in zip(
            eps, group_advantages([e.reward for e in eps], normalize_std=normalize_std), strict=True
        ):
            if adv != 0.0 and ep.error is None and any(t.tokens for t in ep.turns):
                chosen.append({"episode": [t.sample_id for t in ep.turns], "advantage": adv})
    return chosen


def step_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The step's episode numbers (means over episodes that ran): turns, tool_calls, tool_errors, and
    each other metric an environment reported, as ``env_<name>``."""
    ran = [ep.metrics() for ep in episodes if ep.error is None]
    if not ran:
        return {}
    keys = sorted({k for m in ran for k in m})
    out = {}
    for k in keys:
        name = k if k in ("turns", "tool_calls", "tool_errors") else f"env_{k}"
        out[name] = statistics.fmean(m.get(k, 0.0) for m in ran)
    out.setdefault("tool_calls", 0.0)
    out.setdefault("tool_errors", 0.0)
    return out


async def prepare_step(run: Any, client: Any, step: int, prompts: list[dict]) -> PreparedStep:
    """An environment run's step before its update (``Run._prepare`` for ``train(env=...)``): every
    prompt's episodes played, shown as a step's samples are, then their advantages."""
    from openrl_jupyter.prepare import refills

    cfg = run.config
    t0 = time.time()
    version: RewardVersion = cfg.reward_fn or envs.latest(cfg.reward)
    seed = None if cfg.seed is None else (cfg.seed * 100_003 + step * 1_009) % 2**31

    async def played(rows: list[dict], salt: int) -> list[Episode]:
        return await play(
            client=client,
            session=run.session,
            run_id=run.run_id,
            model=cfg.model or run.session.model,
            version=version,
            prompts=rows,
            group=cfg.group,
            sampling={
                "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature,
                "seed": None if seed is None else (seed + salt * 7) % 2**31,
                **cfg.knobs.sampling(),
            },
            limits=Limits(cfg.max_turns, cfg.max_episode_tokens, cfg.step_timeout_s),
        )

    episodes = await played(prompts, 0)
    skipped = _flat_groups(episodes)
    if refills(cfg, skipped, len(prompts)):  # as many fresh prompts, once (as a reward run does)
        more_prompts = run._next_prompts(skipped)
        more = await played(more_prompts, 1)
        for ep in more:
            ep.row += len(prompts)
        prompts, episodes = prompts + more_prompts, episodes + more
        skipped += _flat_groups(more)
    t_played = time.time()
    texts = [prompts[ep.row]["prompt"] for ep in episodes]
    shown = run._shown(scored(episodes, version), version, step, texts, [ep.transcript for ep in episodes])
    with run._lock:
        run._episodes = episodes
    chosen = chosen_episodes(episodes, cfg.normalize_std)
    tokens = {ep.turns[0].sample_id: sum(len(t.tokens) for t in ep.turns) for ep in episodes if ep.turns}
    return PreparedStep(
        step=step,
        version=version,
        n=len(episodes),
        scored=shown,
        chosen=aggregated(chosen, [tokens[c["episode"][0]] for c in chosen], cfg.knobs.loss_agg),
        off_policy=0,
        next_prompts=None,
        times=(t0, t_played, time.time()),
        key=uuid.uuid4().hex,
        extra={"skipped_groups": skipped, **step_metrics(episodes)},
    )


def _flat_groups(episodes: list[Episode]) -> int:
    """How many rows' episodes (those that did not fail, at least two) all scored the same
    (``knobs.zero_variance``, as a reward run's groups are counted)."""
    rows: dict[int, list[int]] = {}
    for i, ep in enumerate(episodes):
        rows.setdefault(ep.row, []).append(i)
    rewards = [ep.reward if ep.error is None else None for ep in episodes]
    return len(zero_variance(rewards, list(rows.values())))
