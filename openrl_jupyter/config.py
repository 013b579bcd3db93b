"""What ``train`` was asked for: prompt sources (lists, files, DataFrames) and the checked
:class:`TrainConfig`, with defaults from the model's capability entry.

    config = make_config(session.defaults, reward="letters", prompts="prompts.jsonl", steps=60)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from openrl_common.checks import integer, number
from openrl_common.protocol import RL_LOSSES
from openrl_jupyter._exceptions import UsageError
from openrl_jupyter.env import envs
from openrl_jupyter.rewards import RewardVersion, pinned, registry
from openrl_jupyter.trackers import parse as parse_trackers

LOSSES = RL_LOSSES  # what a train step takes (openrl_common.protocol)


@dataclass
class TrainConfig:
    """What ``train`` was asked for, after defaults from the model's capability entry."""

    reward: str
    prompts: list[dict]
    steps: int
    group: int
    batch: int
    lr: float | None
    rank: int
    max_tokens: int
    temperature: float
    loss: str = "importance_sampling"
    name: str | None = None
    model: str | None = None
    normalize_std: bool = False
    seed: int | None = 0
    overlap: int = 0
    extra: dict = field(default_factory=dict)
    reward_fn: RewardVersion | None = None  # train(reward=<function>): pinned to this run
    # env runs (train(env=...)): ``reward`` names the environment, ``reward_fn`` pins a factory
    env: bool = False
    max_turns: int = 8
    max_episode_tokens: int = 2048
    step_timeout_s: float = 60.0
    log: tuple[str, ...] = ()  # experiment trackers (openrl_jupyter/trackers.py): wandb, mlflow, tensorboard


def load_prompts(src: Any, *, where: str = "prompts") -> list[dict]:
    """A list of strings, or of dicts with "prompt" (other fields go to the reward as ``info``),
    or a path to a .txt (one prompt per line) or .jsonl file."""
    if isinstance(src, (str, os.PathLike)) and str(src).endswith((".txt", ".jsonl")):
        path = os.fspath(src)
        if not os.path.isfile(path):
            raise UsageError(f"{where}: no such file {path!r}")
        with open(path, encoding="utf-8") as f:
            if path.endswith(".txt"):
                items: list = [line.rstrip("\n") for line in f if line.strip()]
            else:
                items = []
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            items.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise UsageError(f"{where}: {path} line {n} is not JSON ({e.msg})") from None
    elif isinstance(src, str):
        raise UsageError(f"{where} must be a list of prompts or a .txt/.jsonl path; got the string {src!r}")
    elif hasattr(src, "to_dict") and hasattr(src, "columns"):  # a pandas DataFrame
        if "prompt" not in src.columns:
            raise UsageError(f'{where}: a DataFrame needs a "prompt" column; it has {list(src.columns)}')
        items = src.to_dict("records")
    elif isinstance(src, Mapping):
        raise UsageError(
            f"{where} must be a list of prompts, not a {type(src).__name__} (its keys are not prompts)"
        )
    elif isinstance(src, Sequence) or hasattr(src, "__iter__"):
        items = list(src)
    else:
        raise UsageError(f"{where} must be a list of prompts or a .txt/.jsonl path; got {type(src).__name__}")
    if not items:
        raise UsageError(f"{where} is empty: give at least one prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item.strip():
                raise UsageError(f"{where}[{i}] is an empty prompt")
            out.append({"prompt": item, "info": {}})
        elif isinstance(item, dict):
            p = item.get("prompt")
            if not isinstance(p, str) or not p.strip():
                raise UsageError(f'{where}[{i}] needs a non-empty "prompt" string; got keys {sorted(item)}')
            out.append({"prompt": p, "info": {k: v for k, v in item.items() if k != "prompt"}})
        else:
            raise UsageError(
                f"{where}[{i}] must be a string or a dict with a prompt; got {type(item).__name__}"
            )
    return out


def make_config(
    defaults: dict,
    *,
    reward: str | Callable | None = None,
    prompts: Any,
    env: str | Callable | None = None,
    max_turns: int | None = None,
    max_episode_tokens: int | None = None,
    step_timeout_s: float | None = None,
    model: str | None = None,
    steps: int = 60,
    group: int | None = None,
    batch: int | None = None,
    lr: float | None = None,
    rank: int | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    loss: str = "importance_sampling",
    name: str | None = None,
    normalize_std: bool = False,
    seed: int | None = 0,
    overlap: int = 0,
    user_metadata: Mapping[str, Any] | None = None,
    load_from: str | None = None,
    log: str | Sequence[str] | None = None,
) -> TrainConfig:
    """Check the arguments of ``train`` (each error names the argument and its limit)."""
    fixed: RewardVersion | None = None
    if env is not None:
        if reward is not None:
            raise UsageError("give reward or env, not both: an environment's steps give the rewards")
        if callable(env):
            label = getattr(env, "__name__", "") or "env"
            fixed = RewardVersion(
                "lambda" if label == "<lambda>" else label, 1, env, False, False, "environment"
            )
            reward = fixed.name
        elif isinstance(env, str):
            envs.latest(env)  # unknown → a UsageError naming %%openrl env
            reward = env
        else:
            raise UsageError(
                f"env must be a registered environment's name or a factory (prompt, info); got {env!r}"
            )
    elif reward is None:
        raise UsageError("train needs reward= (a reward's name or a function) or env= (an environment)")
    elif callable(reward):
        fixed = pinned(reward)  # this run's own: the registry's named rewards stay as they are
        reward = fixed.name
    elif not isinstance(reward, str):
        raise UsageError(f"reward must be a registered reward's name or a function; got {reward!r}")
    else:
        registry.latest(reward)  # unknown → a UsageError naming %%openrl reward
    loaded = load_prompts(prompts)
    steps = integer(steps, "steps", 1, 1_000_000, error=UsageError)
    group = integer(_or(group, defaults, "group_size", 8), "group", 1, 256, error=UsageError)
    batch = integer(_or(batch, defaults, "batch_size", 8), "batch", 1, 1024, error=UsageError)
    # rank 0: a full fine-tune (the run trains its own copy of every weight)
    rank = integer(_or(rank, defaults, "lora_rank", 8), "rank", 0, 512, error=UsageError)
    max_tokens = integer(
        _or(max_tokens, defaults, "max_tokens", 64), "max_tokens", 1, 1_000_000, error=UsageError
    )
    if lr is not None:
        number(lr, "lr", 0, 1, lo_open=True, error=UsageError)
    if seed is not None:  # a plain int (a numpy one seeds neither random.Random nor JSON)
        seed = integer(seed, "seed", error=UsageError)
    temperature = number(
        _or(temperature, defaults, "temperature", 1.0), "temperature", 0, 10, error=UsageError
    )
    if loss not in LOSSES:
        raise UsageError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r}")
    if overlap not in (0, 1) or isinstance(overlap, bool):
        raise UsageError(
            f"overlap must be 0 (on-policy) or 1 (sample the next step while scoring); got {overlap!r}"
        )
    if group < 2:
        raise UsageError("group must be at least 2: advantages compare samples of the same prompt")
    context = int(defaults.get("max_context_length") or 2048)
    max_turns = integer(8 if max_turns is None else max_turns, "max_turns", 1, 256, error=UsageError)
    max_episode_tokens = integer(
        context if max_episode_tokens is None else max_episode_tokens,
        "max_episode_tokens",
        2,
        context,
        setting="the model's context",
        error=UsageError,
    )
    step_timeout_s = number(
        60.0 if step_timeout_s is None else step_timeout_s,
        "step_timeout_s",
        0,
        86_400,
        lo_open=True,
        error=UsageError,
    )
    extra: dict = {}
    if user_metadata:
        if not isinstance(user_metadata, Mapping) or not all(isinstance(k, str) for k in user_metadata):
            raise UsageError(f"user_metadata must be a dict with string keys; got {user_metadata!r}")
        extra["user_metadata"] = dict(user_metadata)  # labels: "openrl.job", "openrl.sweep"...
    if load_from is not None:
        if not (isinstance(load_from, str) and load_from.startswith("tinker://")):
            raise UsageError(f"load_from must be a tinker:// checkpoint path; got {load_from!r}")
        extra["load_from"] = load_from
    return TrainConfig(
        log=parse_trackers(log),
        reward=reward,
        reward_fn=fixed,
        env=env is not None,
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        step_timeout_s=float(step_timeout_s),
        prompts=loaded,
        steps=steps,
        group=group,
        batch=batch,
        lr=float(lr) if lr is not None else None,
        rank=rank,
        max_tokens=max_tokens,
        temperature=temperature,
        loss=loss,
        name=name,
        model=model,
        normalize_std=normalize_std,
        seed=seed,
        overlap=overlap,
        extra=extra,
    )


def _or(value: Any, defaults: dict, key: str, fallback: Any) -> Any:
    """The argument if given, else the model's capability default, else ours."""
    return value if value is not None else defaults.get(key, fallback)
