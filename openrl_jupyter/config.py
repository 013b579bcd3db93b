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
from openrl_common.protocol import DEFAULT_LIMITS, LIMIT_SETTINGS, RL_LOSSES
from openrl_jupyter._exceptions import UsageError
from openrl_jupyter.env import envs
from openrl_jupyter.knobs import Knobs, check_knobs, weights_of
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
    knobs: Knobs = field(default_factory=Knobs)  # kl_coef, schedules, epochs... (openrl_jupyter/knobs.py)
    # reward={"name": weight, ...}: (name, weight, the pinned function or None for a registered name)
    parts: tuple[tuple[str, float, RewardVersion | None], ...] = ()
    eval_prompts: list[dict] | None = None
    eval_metric: str | None = None  # a registered reward's name; None: the run's own reward
    eval_fn: RewardVersion | None = None  # eval_metric=<function>: pinned
    base_lr: float | None = None  # the model's default learning rate (lr schedules start from it)


def load_prompts(src: Any, *, where: str = "prompts") -> list[dict]:
    """A list of strings, or of dicts with "prompt" (other fields go to the reward as ``info``), a pandas
    DataFrame or a Hugging Face ``datasets.Dataset`` with a "prompt" column (its other columns: ``info``),
    a path to a .txt (one prompt per line) or .jsonl file, or a folder a Dataset was saved to
    (``Dataset.save_to_disk``)."""
    if isinstance(src, (str, os.PathLike)) and os.path.isdir(src):
        src = _saved_dataset(os.fspath(src), where)
    if isinstance(
        getattr(src, "column_names", None), dict
    ):  # a DatasetDict: which split is not ours to guess
        raise UsageError(
            f"{where}: a DatasetDict has the splits {sorted(src.column_names)}; pass one, e.g. ds['train']"
        )
    if hasattr(src, "column_names") and hasattr(src, "to_list"):  # a datasets.Dataset
        if "prompt" not in src.column_names:
            raise UsageError(f'{where}: a Dataset needs a "prompt" column; it has {list(src.column_names)}')
        src = src.to_list()
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


def _saved_dataset(path: str, where: str) -> Any:
    """A Dataset saved with ``save_to_disk`` (one split), loaded with ``datasets`` (imported here only)."""
    if not os.path.isfile(os.path.join(path, "dataset_info.json")) and not os.path.isfile(
        os.path.join(path, "dataset_dict.json")
    ):
        raise UsageError(f"{where}: {path!r} is a folder but not a saved dataset (no dataset_info.json)")
    try:
        import datasets
    except ImportError:
        raise UsageError(
            f"{where}: loading the saved dataset {path!r} needs datasets: pip install datasets"
        ) from None
    return datasets.load_from_disk(path)


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
    eval_prompts: Any = None,
    eval_metric: str | Callable | None = None,
    **knobs: Any,
) -> TrainConfig:
    """Check the arguments of ``train`` (each error names the argument, its limit and the setting that
    raises it; the service's limits come from its capabilities, ``defaults["limits"]``); ``knobs``: the
    RL knobs ``knobs.check_knobs`` takes (kl_coef, lr_schedule, epochs...)."""
    fixed: RewardVersion | None = None
    parts: list[tuple[str, float, RewardVersion | None]] = []
    weighted = weights_of(reward)
    if weighted is not None:
        if env is not None:
            raise UsageError("give reward or env, not both: an environment's steps give the rewards")
        for key, w in weighted:
            if callable(key):
                version = pinned(key)
                parts.append((version.name, w, version))
            else:
                registry.latest(key)  # unknown → a UsageError naming %%openrl reward
                parts.append((key, w, None))
        names = [p[0] for p in parts]
        if len(set(names)) != len(names):
            raise UsageError(f"reward's rewards need distinct names (their columns); got {names}")
        reward = "+".join(names)
    elif env is not None:
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
    limits = Limits.of(defaults)
    steps = integer(steps, "steps", 1, 1_000_000, error=UsageError)
    group = limits.check("group", _or(group, defaults, "group_size", 8), 1, "max_num_samples")
    batch = limits.check("batch", _or(batch, defaults, "batch_size", 8), 1, "max_prompts")
    limits.check("batch × group", batch * group, 1, "max_datums")
    # rank 0: a full fine-tune (the run trains its own copy of every weight)
    rank = limits.check("rank", _or(rank, defaults, "lora_rank", 8), 0, "max_rank")
    max_tokens = limits.check("max_tokens", _or(max_tokens, defaults, "max_tokens", 64), 1, "max_tokens")
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
    limited = {"max_stop": (limits.values["max_stop_sequences"], limits.settings["max_stop_sequences"])}
    checked = check_knobs(steps=steps, batch=batch, group=group, **limited, **knobs)
    if env is not None and checked.stop:
        raise UsageError(
            "stop is for reward runs: an environment ends each turn at the stop condition it returns"
        )
    evals, metric, metric_fn = _eval_options(checked, eval_prompts, eval_metric, env is not None)
    if evals is not None:
        limits.check("len(eval_prompts)", len(evals), 1, "max_prompts")
    return TrainConfig(
        knobs=checked,
        parts=tuple(parts),
        eval_prompts=evals,
        eval_metric=metric,
        eval_fn=metric_fn,
        base_lr=float(defaults["learning_rate"]) if defaults.get("learning_rate") else None,
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


def _eval_options(
    knobs: Knobs, prompts: Any, metric: Any, env: bool
) -> tuple[list[dict] | None, str | None, RewardVersion | None]:
    """eval_prompts (needed by eval_every; without it, one evaluation after the last step) and
    eval_metric (a reward's name or a function; it needs eval_prompts)."""
    if knobs.eval_every and prompts is None:
        raise UsageError("eval_every needs eval_prompts: the held-out prompts each evaluation samples")
    if metric is not None and prompts is None:
        raise UsageError("eval_metric needs eval_prompts: the held-out prompts it scores")
    loaded = load_prompts(prompts, where="eval_prompts") if prompts is not None else None
    if metric is None:
        return loaded, None, None
    if env:
        raise UsageError("eval_metric is for reward runs; an environment run is evaluated by its environment")
    if callable(metric):
        fn = pinned(metric)
        return loaded, fn.name, fn
    if not isinstance(metric, str):
        raise UsageError(f"eval_metric must be a registered reward's name or a function; got {metric!r}")
    registry.latest(metric)
    return loaded, metric, None


@dataclass(frozen=True)
class Limits:
    """The service's bounds (its capability entry's ``limits``), or the service's defaults when it does
    not say: the client refuses what the service would refuse, with the same numbers."""

    values: dict
    settings: dict

    @classmethod
    def of(cls, defaults: dict) -> Limits:
        given = defaults.get("limits") if isinstance(defaults.get("limits"), dict) else {}
        values = {k: int(given.get(k) or v) for k, v in DEFAULT_LIMITS.items()}
        named = {**LIMIT_SETTINGS, **{k: str(v) for k, v in (given.get("settings") or {}).items()}}
        settings = {k: f"the service's {v}" for k, v in named.items()}
        context = defaults.get("max_context_length")
        if context and int(context) <= values["max_tokens"]:
            values["max_tokens"] = int(context)
            settings["max_tokens"] = (
                f"the smaller of the model's context length and the service's {named['max_tokens']}"
            )
        return cls(values, settings)

    def check(self, name: str, value: Any, lo: int, key: str) -> int:
        return integer(value, name, lo, self.values[key], setting=self.settings[key], error=UsageError)


def _or(value: Any, defaults: dict, key: str, fallback: Any) -> Any:
    """The argument if given, else the model's capability default, else ours."""
    return value if value is not None else defaults.get(key, fallback)
