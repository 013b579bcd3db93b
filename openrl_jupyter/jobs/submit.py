"""Submitting a detached run or sweep: the payload, the proof, the service's job, a local worker."""

from __future__ import annotations

import socket
import sys
import uuid
from collections.abc import Mapping
from typing import Any

from openrl_jupyter._exceptions import OpenRLError, RequestError, UsageError
from openrl_jupyter.jobs.common import (
    DUMMY_COMPLETION,
    K8S_KEYS,
    NAME_RE,
    PAYLOAD_FORMAT,
    TERMINAL,
    WHERE,
)
from openrl_jupyter.jobs.handle import Job
from openrl_jupyter.jobs.payload import dumps, encode, reward_entry
from openrl_jupyter.jobs.proof import prove
from openrl_jupyter.rewards import registry


# -- submitting -----------------------------------------------------------------------------------------
def _flat_prompts(loaded: list[dict]) -> list[dict]:
    """Prompts as ``load_prompts`` takes them again (a dict per prompt, its info flattened)."""
    return [{"prompt": p["prompt"], **p["info"]} for p in loaded]


def submit(session: Any, kind: str, where: Any, *, reward: Any, prompts: Any, options: dict) -> Job:
    """Check, build, prove and submit a detached run (``kind="run"``) or sweep; start it when local."""
    from openrl_jupyter.config import load_prompts, make_config

    options = dict(options)
    if where not in WHERE:
        raise UsageError(f"detach must be one of {', '.join(WHERE)}; got {where!r}")
    k8s = options.pop("k8s", None) or {}
    if not isinstance(k8s, dict) or set(k8s) - set(K8S_KEYS):
        raise UsageError(f"k8s must be a dict with some of {', '.join(K8S_KEYS)}; got {k8s!r}")
    if k8s and where != "k8s":
        raise UsageError(f"k8s options ({', '.join(k8s)}) are for detach='k8s' only")
    k8s = {k: v for k, v in k8s.items() if v not in (None, [], "")}
    if where == "local" and session.local is not None and not session.local.detached:
        raise UsageError(
            "a detached local run cannot use this session's embedded service: it stops with this "
            "kernel (connect(local=True)), and the run with it. Connect with "
            "connect(local=True, detached=True) (%openrl connect --local --detached), a service that "
            "outlives the kernel, or to a running service by URL; then detach again"
        )
    name = options.pop("name", None) or f"{kind}-{uuid.uuid4().hex[:6]}"
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UsageError(f"name must be 1 to 64 letters, digits, '.', '_' or '-'; got {name!r}")
    old = session.detached.get(name)
    if (
        old is not None
        and old.entry.get("state") not in TERMINAL
        and old.refresh().get("state") not in TERMINAL
    ):
        raise UsageError(
            f"a detached {old.kind} named {name!r} is still {old.state}; stop it or pick another name"
        )
    if session.model is not None and options.get("model") is None:
        options["model"] = session.model
    loaded = load_prompts(prompts)
    if isinstance(options.get("eval_metric"), str):  # a named metric travels by value (its newest version)
        options["eval_metric"] = registry.latest(options["eval_metric"]).fn
    if options.get("eval_prompts") is not None:  # a Dataset or a path: the rows travel, not the source
        options["eval_prompts"] = _flat_prompts(load_prompts(options["eval_prompts"], where="eval_prompts"))
    env_label = None
    if options.get("env") is not None:  # an environment travels by value, as a pinned reward does
        from openrl_jupyter.env import envs

        env = options["env"]
        version = envs.latest(env) if isinstance(env, str) else None
        options["env"] = version.fn if version is not None else env
        env_label = version.name if version is not None else getattr(env, "__name__", "env")
    if kind == "run":
        config = make_config(
            session.checked_by(options.get("model")), reward=reward, prompts=_flat_prompts(loaded), **options
        )
        weights = None
        if isinstance(reward, Mapping):  # several rewards, weighted: each travels as one reward does
            rewards = [reward_entry(k) for k in reward]
            weights = [float(w) for w in reward.values()]
        else:
            rewards = [reward_entry(reward)] if reward is not None else []
        steps = config.steps
        options["name"] = name  # the run is named after its job
    else:
        from openrl_jupyter.sweep import Sweep

        weights = None

        opts = dict(options)
        grid = opts.pop("grid")
        checked = Sweep(session, reward=reward, prompts=_flat_prompts(loaded), grid=grid, name=name, **opts)
        listed = [reward] if reward is not None else list(grid.get("reward") or [])
        if isinstance(reward, Mapping):  # one weighted reward for every run
            listed, weights = list(reward), [float(w) for w in reward.values()]
        if env_label is not None and reward is None:
            listed = []
        for r in listed:
            if isinstance(r, str):
                registry.latest(r)  # unknown → a UsageError naming %%openrl reward
        rewards = [reward_entry(r) for r in listed]
        steps = checked.steps
        options["name"] = name
    probe = {"prompt": loaded[0]["prompt"], "info": loaded[0]["info"], "completion": DUMMY_COMPLETION}
    body = {
        "format": PAYLOAD_FORMAT,
        "type": "job",
        "kind": kind,
        "reward": reward if isinstance(reward, str) else None,
        "rewards": rewards,
        **({"reward_weights": weights} if weights else {}),
        "options": options,
        "prompts": _flat_prompts(loaded),
        "probe": probe,
    }
    what = f"the detached {kind} {name!r}"
    data = dumps(body, what)
    prove(data, body, what, where)
    import cloudpickle

    named = sorted({e["name"] for e in rewards if not e["pinned"]})
    meta = {
        "reward": (", ".join(e["name"] for e in rewards) or f"env {env_label}")[:200],
        "named_rewards": ",".join(named)[:200],
        "steps": steps,
        "model": options.get("model"),
        "prompts": len(loaded),
        "python": ".".join(map(str, sys.version_info[:3])),
        "cloudpickle": cloudpickle.__version__,
        "submitted_from": socket.gethostname(),
    }
    fields: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "where": where,
        **encode(data),
        "reward": named[0] if len(named) == 1 else None,
        "meta": {k: v for k, v in meta.items() if v is not None},
    }
    if where == "k8s":
        fields["k8s"] = k8s
    try:
        entry = session.client.create_job(**fields)
    except RequestError as exc:
        if exc.status != 409 or where == "k8s" and "--jobs-namespace" in str(exc):
            raise
        try:
            there = session.client.get_job(name)
        except OpenRLError:
            raise exc from None
        raise UsageError(
            f"a job named {name!r} is already on the service: {there.get('state')}, job id "
            f"{there.get('job_id')}, pid {there.get('pid') or 'none yet'}. If it is one you submitted "
            "(a reply lost on the way back included), attach to it (session.attach(name)), or end "
            "it with stop() or delete() (%openrl runs lists it); else pick another name"
        ) from None
    key = entry.pop("key", None)
    job = Job(session, entry, probe=probe, reward_names=named)
    session.detached[name] = job
    if where == "local":
        job._spawn(key)
    return job
