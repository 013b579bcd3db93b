"""Connections to openrl services: ``connect()``, named sessions, and the embedded local service.

Where the URL and key come from: :mod:`openrl_jupyter.credentials` (arguments > ``OPENRL_URL`` /
``OPENRL_TOKEN`` > configuration > ``TINKER_BASE_URL`` / ``TINKER_API_KEY`` > the JupyterHub server's
own token, each with its conditions), or a clear error saying how to connect. The service resolves a
hub token to the tenant ``hub:<user>``. ``Session.mint_key()`` turns it into a ``tml-`` key
for the Tinker SDK (exported as ``TINKER_API_KEY``). ``local=True`` starts an embedded ``openrl-service`` child on a
free loopback port (``local.start_service``) with a fresh key passed through its environment (never
its command line); it exits when this process exits or dies, because it watches a pipe this process
holds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openrl_common.datadirs import local_data_dir, read_private
from openrl_jupyter import credentials
from openrl_jupyter._exceptions import OpenRLError, ServiceUnavailable, UsageError
from openrl_jupyter.chat_reply import ChatReply
from openrl_jupyter.client import AsyncClient, Client, preflight
from openrl_jupyter.hub import keep_alive
from openrl_jupyter.local import (
    EXIT_DATA_DIR_IN_USE,
    READY_TIMEOUT_S,
    LocalService,
    advertise,
    running_on,
    start_service,
    wait_ready,
)

if TYPE_CHECKING:
    from openrl_jupyter import evals
    from openrl_jupyter.feed import EventFeed
    from openrl_jupyter.jobs import Attached, Job
    from openrl_jupyter.run import Run
    from openrl_jupyter.sweep import Sweep

DEFAULT_NAME = "default"


@dataclass
class Session:
    """A named connection: a client plus, for ``local=True``, the service it started.

    ``train(...)`` starts a background RL run on it; ``runs`` holds this kernel's runs by name.
    ``model`` is the base model its runs use (picked with ``connect(model=...)``; default: the
    service's first); ``served`` maps every model the service serves to its capability defaults.
    """

    name: str
    url: str
    client: Client = field(repr=False)
    local: LocalService | None = field(default=None, repr=False)
    model: str | None = None
    defaults: dict = field(default_factory=dict, repr=False)
    runs: dict[str, Run] = field(default_factory=dict, repr=False)
    _token: str | None = field(default=None, repr=False)
    _aclient: AsyncClient | None = field(default=None, repr=False)
    _feed: EventFeed | None = field(default=None, repr=False)
    served: dict[str, dict] = field(default_factory=dict, repr=False)
    credential: str = (
        "none"  # where the key came from: argument, OPENRL_TOKEN, config, TINKER_API_KEY, hub, local, none
    )
    # put in the user_metadata of every run this session creates ({"openrl.job": id} in a job's worker)
    labels: dict = field(default_factory=dict, repr=False)
    detached: dict[str, Job] = field(default_factory=dict, repr=False)  # this kernel's jobs by name
    contexts: dict[str, int | None] = field(default_factory=dict, repr=False)  # each model's context length
    limits: dict[str, dict] = field(default_factory=dict, repr=False)  # each model's limits (capabilities)

    def checked_by(self, model: str | None) -> dict:
        """What ``train`` options for ``model`` (a served name, or a tiny model's short one) are checked
        against (``config.make_config``): its capability defaults, its context length and the service's
        limits."""
        if model is not None:
            model = served_name(model, self.served or {self.model: self.defaults}) or model
        defaults = self.served.get(model, self.defaults) if model is not None else self.defaults
        out = dict(defaults)
        if model in self.contexts:
            out["max_context_length"] = self.contexts[model]
        if model in self.limits:
            out["limits"] = self.limits[model]
        return out

    def __repr__(self) -> str:  # never the key
        kind = "embedded" if self.local else "remote"
        return f"<openrl Session {self.name!r} {kind} {self.url} model={self.model!r}>"

    def train(
        self,
        *,
        prompts: Any,
        reward: Any = None,
        env: Any = None,
        model: str | None = None,
        steps: int = 60,
        group: int | None = None,
        batch: int | None = None,
        lr: float | None = None,
        rank: int | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: str | list[str] | None = None,
        loss: str = "importance_sampling",
        loss_agg: str = "token",
        kl_coef: float = 0.0,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        epochs: int = 1,
        minibatches: int = 1,
        normalize_std: bool = False,
        skip_zero_variance: bool = True,
        eval_every: int = 0,
        eval_prompts: Any = None,
        eval_metric: Any = None,
        save_every: int = 0,
        seed: int | None = 0,
        overlap: int = 0,
        load_from: str | None = None,
        name: str | None = None,
        log: str | list[str] | None = None,
        max_turns: int | None = None,
        max_episode_tokens: int | None = None,
        step_timeout_s: float | None = None,
        user_metadata: dict | None = None,
        detach: str | None = None,
        k8s: dict | None = None,
    ) -> Run | Job:
        """Start a background RL run and return it at once (see ``openrl_jupyter.run``); every option
        is checked here, in the cell, against the service's limits. docs/knobs.md says what each knob
        does, its default and when to use it.

        ``reward``: a registered reward's name (its newest version applies at each step), a function
        (pinned to this run alone), or several, weighted: ``{"correct": 1.0, "format": 0.2}`` (each
        logged as its own ``rewards/<name>`` column beside the weighted total ``reward_mean``).
        ``env``: instead, a registered environment's name (``%%openrl env``) or a factory ``(prompt,
        info) -> Env | MessageEnv`` (multi-turn episodes, openrl_jupyter/rollouts.py), with
        ``max_turns`` (8), ``max_episode_tokens`` (the model's context) and ``step_timeout_s`` (60).
        ``prompts`` (and ``eval_prompts``): a list, a .txt/.jsonl path, a DataFrame, a
        ``datasets.Dataset`` or a folder one was saved to; columns besides "prompt" reach rewards as
        ``info``. Unset group, batch, lr, rank, max_tokens and temperature come from the model's
        capability entry.

        The update: ``loss`` and ``loss_agg`` ("token" | "sequence"), ``kl_coef`` (KL to the run's
        starting weights, column ``kl_ref``), ``lr_schedule`` ("constant" | "linear" | "cosine") with
        ``warmup_steps``, ``epochs`` × ``minibatches`` optimizer updates per batch, ``normalize_std``,
        ``skip_zero_variance`` (replace groups that all scored the same). Rollouts: ``temperature``,
        ``top_p``, ``top_k``, ``stop``. ``eval_every`` steps the run samples ``eval_prompts`` greedily
        and scores them with ``eval_metric`` (default: its reward), keeping the best weights as the
        checkpoint ``<name>-best``; ``save_every`` saves ``<name>-stepN``.

        ``detach="local"`` (a process of its own that outlives this kernel) or ``"k8s"`` (a
        Kubernetes Job the service submits, ``k8s``: image, volumes, cpu, memory): the run goes on after
        the notebook closes; returns a :class:`~openrl_jupyter.jobs.Job` (see ``openrl_jupyter.jobs``).
        """
        options = {
            k: v for k, v in locals().items() if k not in ("self", "prompts", "reward", "env", "detach")
        }
        if options["k8s"] is None:
            del options["k8s"]
        from openrl_jupyter.config import make_config
        from openrl_jupyter.run import Run

        if detach is not None:
            from openrl_jupyter.jobs import submit

            if env is not None:
                options["env"] = env
            return submit(self, "run", detach, reward=reward, prompts=prompts, options=options)
        if "k8s" in options:
            raise UsageError("k8s options are for detach='k8s' only")
        if self.labels or options.get("user_metadata"):
            options["user_metadata"] = {**self.labels, **(options.get("user_metadata") or {})}
        model = self.model
        if options.get("model") is not None and self.model is not None:
            model = served_name(options["model"], self.served or {self.model: self.defaults})
            if model is None:
                served = ", ".join(repr(m) for m in self.served or [self.model])
                raise UsageError(
                    f"model {options['model']!r} is not served by {self.url} (it serves {served})"
                )
        config = make_config(self.checked_by(model), reward=reward, env=env, prompts=prompts, **options)
        config.model = model
        name = config.name
        if name is not None:
            old = self.runs.get(name)
            if old is not None and not old.done:
                raise UsageError(f"a run named {name!r} is still {old.state}; stop it or pick another --name")
        run = Run(self, config).start()
        self.runs[run.name] = run
        note = keep_alive(_stepping)  # in a hub server: report activity while runs step
        if note is not None:
            print(note, flush=True)
            run._log(note)
        return run

    def sweep(
        self, *, prompts: Any, grid: Any, reward: Any = None, detach: str | bool | None = None, **options: Any
    ) -> Sweep | Job:
        """Start one run per point of ``grid`` at once, with successive halving; returns the
        :class:`~openrl_jupyter.sweep.Sweep` (see ``openrl_jupyter.sweep``).

        Options: steps, budget, rungs, keep, metric, mode, name, save_best, and any ``train``
        option shared by every run (group, batch, max_tokens, ...). ``rungs``: None (as many as halve
        the runs to one, each twice as far in as the one before, none before steps/8 — at least step
        2, at most 10 — nor within 2 steps of another), a count of those, or a list of steps.
        ``detach="local"`` (or True) / ``"k8s"``: the sweep runs in a job that outlives this kernel;
        returns its Job."""
        from openrl_jupyter.sweep import Sweep

        if detach:
            from openrl_jupyter.jobs import submit

            where = "local" if detach is True else detach
            options.update(grid=grid)
            return submit(self, "sweep", where, reward=reward, prompts=prompts, options=options)
        return Sweep(self, reward=reward, prompts=prompts, grid=grid, **options).start()

    # -- detached runs (jobs) -------------------------------------------------------------------------
    def attach(self, name: str) -> Attached:
        """A detached run (or sweep) by job name (or any run of this key by run name): its whole
        history from the service and a dashboard that follows it while it runs."""
        from openrl_jupyter.jobs import attach

        return attach(self, name)

    def jobs(self) -> list[dict]:
        """This key's detached runs and sweeps (the service's job entries), newest last."""
        return list(self.client.list_jobs() or [])

    # -- Tinker keys minted for the hub user ----------------------------------------------------------
    def mint_key(self, name: str | None = None, *, export: bool = True) -> MintedKey:
        """A new ``tml-`` key of this session's hub user (the session must use a JupyterHub token),
        exported in this process as ``TINKER_API_KEY`` and ``TINKER_BASE_URL`` (so
        ``tinker.ServiceClient()`` picks them up). The key is never printed: its repr is masked."""
        if name is not None and (not isinstance(name, str) or len(name) > 200):
            raise UsageError(f"key name must be a string of at most 200 characters; got {name!r}")
        body = {"name": name} if name else {}
        reply = self.client.request("POST", KEYS_PATH, json=body)
        global _exported_key_id
        key = MintedKey.from_reply(reply)
        if export:
            _exported_key_id = key.id
            os.environ["TINKER_API_KEY"] = str(key.key)
            os.environ["TINKER_BASE_URL"] = self.url
        return key

    def list_keys(self) -> list[dict]:
        """The keys minted for this session's hub user: id, name, created, prefix (never a secret)."""
        return list((self.client.request("GET", KEYS_PATH) or {}).get("keys") or [])

    def revoke_key(self, key_id: str) -> None:
        """Revoke a minted key (it is refused from then on); unexports it if it is TINKER_API_KEY's."""
        if not isinstance(key_id, str) or not key_id or "/" in key_id:
            raise UsageError(f"key id must be an id from list_keys(); got {key_id!r}")
        self.client.request("DELETE", f"{KEYS_PATH}/{key_id}")
        if _exported_key_id == key_id:
            os.environ.pop("TINKER_API_KEY", None)

    def active_runs(self) -> list[Run]:
        return [r for r in self.runs.values() if not r.done]

    def get_run(self, name: str | None = None) -> Run:
        """This kernel's run by name, or the only (or latest) one."""
        if not self.runs:
            raise UsageError("no runs yet in this session: start one with %openrl train (or session.train)")
        if name is None:
            return list(self.runs.values())[-1]
        if name not in self.runs:
            raise UsageError(f"no run named {name!r}; runs: {', '.join(self.runs)}")
        return self.runs[name]

    def chat(
        self,
        model: str,
        message: str,
        *,
        history: list[dict] | None = None,
        system: str | None = None,
        **params: Any,
    ) -> str:
        """One chat turn with ``model`` through the service's OpenAI-compatible API: a base model, a
        ``tinker://`` checkpoint (``run.save()`` gives one) or a run of this kernel by name (its current
        weights, saved first). ``history`` (a list of {role, content}) is extended with the turn;
        ``params`` are OpenAI's (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``).
        The reply is a str with ``finish_reason`` and ``completion_tokens`` (``chat_reply.ChatReply``)."""
        messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
        messages.append({"role": "user", "content": message})
        reply = self.client.request(
            "POST",
            "/v1/chat/completions",
            json={"model": self.model_ref(model), "messages": messages, **params},
        )
        choice = reply["choices"][0]
        text = ChatReply(
            choice["message"]["content"] or "",
            finish_reason=choice.get("finish_reason"),
            completion_tokens=(reply.get("usage") or {}).get("completion_tokens"),
        )
        if history is not None:
            history += [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
        return text

    def sft(self, examples: Any, **options: Any) -> Any:
        """A supervised warm start before RL (``openrl_jupyter.sft.sft``; options ``steps``, ``batch``,
        ``learning_rate``, ``rank``, ``seed``, ``name``): a WarmStart whose ``checkpoint`` a run loads."""
        from openrl_jupyter.sft import sft

        return sft(self, examples, **options)

    def evaluate(
        self,
        *,
        env: Any,
        prompts: Any,
        checkpoint: str | None = None,
        greedy: bool = True,
        group: int = 1,
        max_tokens: int | None = None,
        max_turns: int = 8,
        max_episode_tokens: int | None = None,
        step_timeout_s: float = 60.0,
        seed: int = 0,
        rank: int | None = None,
    ) -> evals.Evaluation:
        """Score ``checkpoint`` (a tinker:// training checkpoint; None: the base model) on ``prompts``
        (held-out rows) with environment ``env`` (a registered name or a factory): ``group`` episodes
        per row, greedy unless ``greedy=False``; ``rank``: the checkpoint's LoRA rank (default: the
        model's). Nothing is trained; the temporary run is deleted."""
        from openrl_jupyter.evals import evaluate

        return evaluate(
            self,
            env=env,
            prompts=prompts,
            checkpoint=checkpoint,
            greedy=greedy,
            group=group,
            max_tokens=max_tokens,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
            step_timeout_s=step_timeout_s,
            seed=seed,
            rank=rank,
        )

    def model_ref(self, model: str) -> str:
        """What the OpenAI-compatible API calls ``model``: a run of this kernel by name becomes a
        checkpoint of its current weights; anything else (a base model, a tinker:// path) is as given."""
        if model in self.runs:
            return self.runs[model].save(overwrite=True)
        return model

    def export(
        self, model: str, dest: str | os.PathLike, *, merged: bool = False, overwrite: bool = False
    ) -> dict:
        """Download ``model`` (a tinker:// checkpoint, or a run of this kernel by name: its current
        weights) into the folder ``dest`` as a PEFT adapter, or with ``merged=True`` as a Hugging Face
        model folder (``AutoModelForCausalLM.from_pretrained(dest)``). The service builds it; this
        needs neither torch nor the base weights. Returns what was exported (format, base model, the
        SHA-256 of the base weights, files)."""
        from openrl_common.export import ExportError, download_export

        path = self.model_ref(model)
        if not path.startswith("tinker://"):
            raise UsageError(f"export takes a tinker:// checkpoint or a run of this kernel; got {model!r}")
        if not overwrite:
            refuse_full_folder(dest, "overwrite=True")
        try:
            return download_export(
                path, dest, merged=merged, base_url=self.url, api_key=self._token or "", overwrite=overwrite
            )
        except ExportError as e:
            raise UsageError(str(e)) from None

    def async_client(self) -> AsyncClient:
        """The session's AsyncClient, bound to the runner loop (use it only there)."""
        if self._aclient is None:
            self._aclient = AsyncClient(
                self.url,
                token=self._token,
                retries=self.client.retries,
                guard=self.local.check if self.local is not None else None,
            )
        return self._aclient

    def feed(self) -> EventFeed:
        """The service's event stream (ticks and run events) shared by this session's dashboards."""
        if self._feed is None:
            from openrl_jupyter.feed import EventFeed

            self._feed = EventFeed(self.async_client)
        return self._feed

    def close(self) -> None:
        for run in self.runs.values():
            if not run.done:
                run.stop()
        for run in self.runs.values():
            # a run that failed or paused on an error is done with: closing says nothing of how it ended
            with contextlib.suppress(TimeoutError, OpenRLError):
                run.wait(timeout=30)
        if self._feed is not None:
            self._feed.close()
        if self._aclient is not None:
            from openrl_jupyter.runner import get_runner

            with contextlib.suppress(Exception):
                get_runner().submit(self._aclient.aclose()).result(5)
            self._aclient = None
        self.client.close()
        for job in self.detached.values():
            job.close()
        if self.local is not None and self.local.owned and not self.local.detached:
            self.local.stop()  # a detached one goes on (its jobs need it); a joined one is its owner's


_sessions: dict[str, Session] = {}
KEYS_PATH = "/api/v1/keys"
_exported_key_id: str | None = None


class Secret(str):
    """A key: a str everywhere it is used, masked wherever it is shown (reprs, verbose tracebacks)."""

    def __repr__(self) -> str:
        return "'tml-…(hidden)'"


@dataclass(frozen=True)
class MintedKey:
    """A key minted by the service for a hub user; ``key`` is masked in every repr."""

    id: str
    tenant: str
    name: str | None
    created: float | None
    key: Secret = field(repr=False)

    @classmethod
    def from_reply(cls, reply: Any) -> MintedKey:
        if not isinstance(reply, dict) or not str(reply.get("key", "")).startswith("tml-"):
            keys = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise OpenRLError(f"the service minted no tml- key (its reply has {keys})")
        return cls(
            str(reply["id"]),
            str(reply.get("tenant", "")),
            reply.get("name"),
            reply.get("created"),
            Secret(reply["key"]),
        )


def _stepping() -> bool:
    """Whether any run of this kernel is stepping (what keeps a hub server alive)."""
    from openrl_jupyter.run import RunState

    busy = {RunState.STARTING, RunState.RUNNING, RunState.PAUSING, RunState.STOPPING}
    return any(r.state in busy for s in list(_sessions.values()) for r in list(s.runs.values()))


def start_local(
    model: str = "openrl/tiny",
    *,
    data_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    timeout_s: float = READY_TIMEOUT_S,
    detached: bool = False,
    check_model: bool = False,
) -> tuple[LocalService, str]:
    """The user's embedded service of ``model`` and its key, once it answers /readyz: the one already
    running on its data folder (``local_data_dir(model)``: another kernel's, or a detached one),
    joined, else a new one started there. Its key is the folder's ``api-key``, the same after a restart.

    ``detached``: one that outlives this process (for detached runs); a running one that stops with
    another kernel is refused then (it cannot be made to outlive it)."""
    data_dir = os.fspath(data_dir or local_data_dir(model))
    for attempt in range(3):
        found = running_on(data_dir)
        if found is not None:
            try:
                joined = _join(found, model, detached=detached, check_model=check_model, timeout_s=timeout_s)
            except ServiceUnavailable:  # it was on its way out (its kernel just ended): start another
                if found.process.poll() is None or attempt == 2:
                    raise
                continue
            return joined, Secret(found.key)
        if not all(_installed(m) for m in ("openrl_service", "torch", "fastapi", "transformers")):
            raise UsageError(
                "connect(local=True) needs the service installed in this environment: "
                'pip install -e ".[service]" from a clone (or connect to a running service by URL)'
            )
        try:
            local = start_service(
                model=model, data_dir=data_dir, timeout_s=timeout_s, progress=progress, detached=detached
            )
        except ServiceUnavailable as exc:  # another kernel started one on the folder meanwhile: join it
            if getattr(exc, "exit_code", None) == EXIT_DATA_DIR_IN_USE and attempt < 2:
                continue
            raise
        if not local.key:
            local.stop()
            raise OpenRLError(f"the embedded service wrote no key to {os.path.join(data_dir, 'api-key')}")
        advertise(local)  # the Jupyter server's OpenRL panel finds it there (removed when it stops)
        return local, Secret(local.key)
    raise AssertionError("unreachable")  # pragma: no cover


def _join(
    found: LocalService, model: str, *, detached: bool, check_model: bool, timeout_s: float
) -> LocalService:
    """Check a running embedded service before a kernel joins it."""
    pid, folder = found.process.pid, found.data_dir
    if detached and not found.detached:
        raise UsageError(
            f"the embedded service of another kernel (pid {pid}, {found.url}) holds {folder} and stops "
            f"with that kernel, so it cannot serve detached runs: stop it (openrl-service stop --data-dir "
            f"{folder}, or %openrl disconnect --stop-service in that kernel) and connect --local --detached again"
        )
    wait_ready(found, model, timeout_s)  # it proves it is the folder's service before the key goes
    found.key = found.key or read_private(os.path.join(folder, "api-key"))  # a just-started serve's
    if not found.key:
        raise UsageError(
            f"the service holding {folder} (pid {pid}, {found.url}) was started with keys of its own: "
            f"connect to it by URL with its key, or stop it (openrl-service stop --data-dir {folder})"
        )
    if check_model:  # a model asked for by name: the running one must serve it
        _check_detached_model(found, model)
    return found


def connect(
    url: str | None = None,
    *,
    token: str | None = None,
    name: str | None = None,
    local: bool = False,
    model: str | None = None,
    config: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    detached: bool = False,
) -> Session:
    """Connect to a service (or start an embedded one with ``local=True``) and remember it by name.

    ``model``: the base model this session's runs use, one the service serves (default: its first);
    with ``local=True``, the model the embedded service serves (default openrl/tiny).
    ``local=True, detached=True``: an embedded service that outlives this kernel (a persistent data
    folder, its own process session), so detached local runs can use it; a later kernel's
    ``connect(local=True, detached=True)`` finds the running one again."""
    name = name or DEFAULT_NAME
    config = config or {}
    credential = "none"
    old = _sessions.get(name)
    if old is not None and old.active_runs():
        busy = ", ".join(r.name for r in old.active_runs())
        raise UsageError(
            f"session {name!r} has active runs ({busy}); stop them (run.stop()) or connect with another name"
        )
    local_service = None
    if detached and not local:
        raise UsageError("detached=True is for an embedded service: connect(local=True, detached=True)")
    if local:
        if url:
            raise UsageError("give either a URL or local=True, not both")
        local_service, token = start_local(
            model or "openrl/tiny", progress=progress, detached=detached, check_model=model is not None
        )
        url = local_service.url
        credential = "local"
    else:
        found = credentials.find(url, token, config_url=config.get("url"), config_token=config.get("token"))
        url, token, credential = found.url, found.token, found.key_from
        credential = "argument" if credential == "given" else credential
        if url and not url.startswith(("http://", "https://")):
            raise UsageError(f"the service URL must start with http:// or https://; got {url!r}")
        if not url:
            raise UsageError(
                "no openrl service to connect to: pass a URL, set OPENRL_URL (and OPENRL_TOKEN) or "
                "TINKER_BASE_URL (and TINKER_API_KEY), or use local=True to start one here"
            )
    if local_service is None:
        preflight(url)  # seconds, not the client's minutes of retries, to say a URL is wrong
    token = Secret(token) if token else None
    # an embedded service is sent the key only while its process lives and, after a connection failure,
    # once it has proved again that it is that service (another account may take a port it let go)
    client = Client(url, token=token, guard=local_service.check if local_service is not None else None)
    try:
        models = client.capabilities()
        served = {m["model_name"]: dict(m.get("defaults") or {}) for m in models}
        # the service's bounds per model, which options are checked against in the cell (config.Limits)
        limits = {m["model_name"]: dict(m["limits"]) for m in models if isinstance(m.get("limits"), dict)}
        contexts = {m["model_name"]: m.get("max_context_length") for m in models}
        chosen = next(iter(served), None)  # the service's default model
        if model is not None and not local and served:
            chosen = served_name(model, served)
            if chosen is None:
                raise UsageError(
                    f"model {model!r} is not served by {url}; it serves {', '.join(repr(m) for m in served)}"
                )
    except OpenRLError:
        client.close()
        if local_service is not None and local_service.owned and not local_service.detached:
            local_service.stop()
        raise
    old = _sessions.pop(name, None)
    if old is not None:
        old.close()
    session = Session(
        name,
        url,
        client,
        local_service,
        chosen,
        served.get(chosen, {}) if chosen is not None else {},
        _token=token,
        served=served,
        credential=credential,
        contexts=contexts,
        limits=limits,
    )
    _sessions[name] = session
    return session


def _check_detached_model(found: LocalService, model: str) -> None:
    """Refuse a running detached embedded service that serves another model than ``model``."""
    with Client(found.url, token=found.key, retries=1) as client:
        try:
            served = [m["model_name"] for m in client.capabilities()]
        except OpenRLError:
            return  # it does not answer: connect() says so next
    if served and served_name(model, dict.fromkeys(served)) is None:
        kind = "a detached embedded service" if found.detached else "another kernel's embedded service"
        raise UsageError(
            f"{kind} is already running (pid {found.process.pid}, {found.url}) "
            f"and serves {', '.join(repr(m) for m in served)}, not {model!r}: connect with that model "
            f"(or none), or stop it first (openrl-service stop --data-dir {found.data_dir}) and connect again"
        )


def refuse_full_folder(dest: str | os.PathLike, flag: str) -> None:
    """A UsageError naming ``flag`` (what allows it) when the export folder ``dest`` holds something."""
    path = Path(dest)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "is not empty" if path.is_dir() else "is a file"
        raise UsageError(f"{path} exists and {what}: add {flag} to replace it, or choose another folder")


def served_name(model: str, served: Mapping[str, Any]) -> str | None:
    """The served model's name that ``model`` names (its full name, or a tiny model's short one:
    "tiny" for "openrl/tiny"); None when none does."""
    if model in served:
        return model
    return f"openrl/{model}" if f"openrl/{model}" in served else None


def get_session(name: str | None = None) -> Session:
    """The named session, or the only one; a UsageError says how to connect otherwise."""
    if name is not None:
        if name not in _sessions:
            raise UsageError(f"no session named {name!r}; connected: {', '.join(_sessions) or 'none'}")
        return _sessions[name]
    if len(_sessions) == 1:
        return next(iter(_sessions.values()))
    if DEFAULT_NAME in _sessions:
        return _sessions[DEFAULT_NAME]
    if not _sessions:
        raise UsageError("not connected: call openrl_jupyter.connect(URL) or connect(local=True) first")
    raise UsageError(f"several sessions are open ({', '.join(_sessions)}); name one")


def sessions() -> dict[str, Session]:
    return dict(_sessions)


def disconnect(name: str | None = None) -> list[str]:
    """Close a session: its active runs stop after their current step (returns their names) and an
    embedded service stops."""
    session = get_session(name)
    stopped = [r.name for r in session.active_runs()]
    _sessions.pop(session.name, None)
    session.close()
    return stopped


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ValueError, ImportError):  # e.g. a module blocked with sys.modules[name] = None
        return False
