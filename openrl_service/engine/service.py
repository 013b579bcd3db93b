"""The engine's operations: what both HTTP façades (Tinker, native) call.

Each public method runs on the event loop: it checks ownership and input cheaply, then queues the
tensor work as an :class:`~openrl_service.engine.scheduler.Op` for the device worker and returns the
future. Sessions, runs and samplers all belong to a tenant; another tenant gets "not found".

Vocabulary:
    SessionRecord  a client connection (Tinker ServiceClient); owns runs and samplers
    RunState       one LoRA training run: adapter + optimizer + gradients, ordered by seq_id
    Sampler  an immutable adapter snapshot (or the bare base model) that can be sampled

Sharing the device: a forward/backward whose datums need several padded micro-batches runs as a
chunked op (one micro-batch per scheduler turn, other runs' ops in between), so a big batch holds
the device for about one micro-batch at a time. The chunks are the trainer's own micro-batches, so
the result, the loss sum and the gradient are bit-identical to running the call in one go, and the
call stays atomic: if a later chunk fails (or the run is closed), the run's gradients are exactly as
they were before the call. Sampling requests over a queue limit are refused (429, see
:mod:`~openrl_service.engine.scheduler`); training requests are always queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import torch
from safetensors import safe_open

from openrl_service.config import Settings
from openrl_service.engine.futures import FutureRecord, FutureStore
from openrl_service.engine.scheduler import Engine, Fusable, Op
from openrl_service.errors import NotFound, NotReady, UserError
from openrl_service.models.loading import BaseModel, load_base_model
from openrl_service.sampling.base import SampleJob, SampleOutput, SamplingParams
from openrl_service.sampling.torch_sampler import TorchSampler
from openrl_service.storage.checkpoints import CheckpointRef, CheckpointStore, check_name, parse_tinker_path
from openrl_service.telemetry import OpRecorder
from openrl_service.training.lora import (
    Adapter,
    LoraSpec,
    adapter_from_peft,
    check_peft_shapes,
    peft_adapter_config,
)
from openrl_service.training.losses import LOSSES, check_loss
from openrl_service.training.trainer import (
    AdamParams,
    DatumArrays,
    ForwardResult,
    FusedItem,
    Trainer,
    TrainState,
    accumulating_grads,
    make_optimizer,
    merge_stats,
)

log = logging.getLogger(__name__)


@dataclass
class SessionRecord:
    session_id: str
    tenant: str
    created_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: bool = False
    finished_at: float | None = None
    tags: list[str] = field(default_factory=list)
    user_metadata: dict = field(default_factory=dict)
    display_name: str | None = None
    project_id: str | None = None
    run_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)
    finish_reason: str | None = None  # success | errored | interrupted | idle

    def record(self) -> dict:
        """What is kept on disk: enough to list, get and search the session after it ends."""
        status = (
            {"type": "client_finished", "reason": {"type": self.finish_reason or "success"}}
            if self.finished
            else {"type": "active"}
        )
        return {
            "session_id": self.session_id,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "display_name": self.display_name,
            "project_id": self.project_id,
            "user_metadata": self.user_metadata,
            "tags": self.tags,
            "status": status,
            "training_run_ids": list(self.run_ids),
            "sampler_ids": list(self.sampler_ids),
        }


@dataclass
class RunState:
    run_id: str
    tenant: str
    session_id: str
    spec: LoraSpec
    seed: int
    base_model: str
    user_metadata: dict = field(default_factory=dict)
    state: TrainState | None = None
    created_at: float = field(default_factory=time.time)
    last_request_time: float = field(default_factory=time.time)


@dataclass
class SamplerEntry:
    sampler_id: str
    tenant: str
    session_id: str | None
    base_model: str
    adapter: Adapter | None
    model_path: str | None = None
    source_run: str | None = None
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)


def spec_from_manifest(manifest: dict) -> LoraSpec:
    lora = manifest["lora"]
    return LoraSpec(
        rank=lora["rank"],
        train_attn=lora["train_attn"],
        train_mlp=lora["train_mlp"],
        train_unembed=lora["train_unembed"],
        alpha=lora.get("alpha", LoraSpec(1).alpha),
    )


class TrainingService:
    def __init__(self, settings: Settings, *, base: BaseModel | None = None):
        self.settings = settings
        self.limits = settings.limits
        self.store = CheckpointStore(settings.data_dir)
        self.futures = FutureStore(ttl_s=settings.future_ttl_s)
        self.recorder = OpRecorder()
        self.engine = Engine(
            futures=self.futures,
            seq_gap_timeout_s=settings.seq_gap_timeout_s,
            recorder=self.recorder,
            max_queued_per_lane=settings.limits.max_queued_per_run,
            max_queued_total=settings.limits.max_queued_total,
            retry_after_s=settings.backpressure_retry_after_s,
            fusion=settings.fusion,
            fusion_max_tokens=settings.fusion_max_tokens or settings.microbatch_tokens,
            fusers={
                "train": lambda items: self.trainer.forward_backward_fused(items),
                "sample": self._fused_sample,
            },
        )
        self.base: BaseModel | None = base
        self.trainer: Trainer | None = None
        self.sampler: TorchSampler | None = None
        self.sessions: dict[str, SessionRecord] = {}
        self.runs: dict[str, RunState] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        self._evicted: dict[str, str] = {}  # sampler id -> tenant, to explain a 404
        self._ended: dict[str, str] = {}  # forgotten finished session id -> tenant, to answer 410
        self._lock = threading.Lock()
        # Called as fn(tenant, session_id, run_ids) when a session finishes (by its client or the idle
        # reaper), so layers above the engine (the notebook API) drop what they keep for its runs.
        self.session_listeners: list[Callable[[str, str, list[str]], None]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start(setup=self._setup)

    def _setup(self) -> None:
        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        if self.base is None:
            self.base = load_base_model(s.model, data_dir=s.data_dir, name=s.model_name, device=s.device)
        self.trainer = Trainer(self.base, microbatch_tokens=s.microbatch_tokens)
        self.sampler = TorchSampler(self.base)

    def stop(self) -> None:
        self.engine.stop()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self.engine.ready.wait(timeout_s)

    def require_ready(self) -> BaseModel:
        if self.engine.setup_error is not None:
            raise NotReady(f"the model failed to load: {self.engine.setup_error}")
        if not self.engine.ready.is_set() or self.base is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.base

    def capabilities(self) -> list[dict]:
        return [self.require_ready().capability()]

    # -- sessions -------------------------------------------------------------------------------
    def expiry(self, ttl_seconds: Any, field_name: str = "ttl_seconds") -> float | None:
        """ttl_seconds (None: never) as an absolute expiry time; bounds as Tinker's: 1 hour to 10 years."""
        if ttl_seconds is None:
            return None
        lo, hi = self.settings.min_ttl_s, 10 * 365 * 24 * 3600
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not lo <= ttl_seconds <= hi:
            raise UserError(
                f"{field_name} must be null or an integer in [{lo:g}, {hi}] seconds (OPENRL_MIN_TTL_S); "
                f"got {ttl_seconds!r}",
                field=field_name,
            )
        return time.time() + ttl_seconds

    def check_metadata(self, value: Any, field_name: str = "user_metadata") -> dict:
        """user_metadata must be a JSON object of at most ``max_metadata_bytes``."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise UserError(
                f"{field_name} must be a JSON object; got {type(value).__name__}", field=field_name
            )
        size = len(orjson.dumps(value))
        if size > self.limits.max_metadata_bytes:
            raise UserError(
                f"{field_name} is {size} bytes as JSON; at most {self.limits.max_metadata_bytes} "
                "(OPENRL_MAX_METADATA_BYTES)",
                field=field_name,
            )
        return dict(value)

    def create_session(
        self, tenant: str, *, tags=None, user_metadata=None, display_name=None, project_id=None
    ) -> SessionRecord:
        if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
            raise UserError("tags must be a list of strings", field="tags")
        for name, value in (("display_name", display_name), ("project_id", project_id)):
            if value is not None and (not isinstance(value, str) or len(value) > 256):
                raise UserError(f"{name} must be a string of at most 256 characters", field=name)
        self.check_metadata({"tags": tags or []}, "tags")
        sess = SessionRecord(
            session_id=f"s{uuid.uuid4().hex[:16]}",
            tenant=tenant,
            tags=list(tags or []),
            user_metadata=self.check_metadata(user_metadata),
            display_name=display_name,
            project_id=project_id,
        )
        with self._lock:
            self.sessions[sess.session_id] = sess
        self.store.write_session(tenant, sess.record())
        return sess

    def session(self, tenant: str, session_id: str, *, live: bool = True) -> SessionRecord:
        sess = self.sessions.get(session_id)
        if sess is None or sess.tenant != tenant:
            raise NotFound(f"unknown session_id {session_id!r}", field="session_id")
        if live and sess.finished:
            raise UserError(
                f"session {session_id} is finished; start a new ServiceClient", field="session_id"
            )
        return sess

    def heartbeat(self, tenant: str, session_id: str) -> bool:
        """False once the session is finished (the SDK stops heartbeating on 410)."""
        if self._ended.get(session_id) == tenant:
            return False
        sess = self.session(tenant, session_id, live=False)
        sess.last_heartbeat = time.time()
        return not sess.finished

    def finish_session(self, tenant: str, session_id: str, reason: str = "success") -> None:
        """Mark finished and free its runs and samplers from device memory; checkpoints stay."""
        sess = self.session(tenant, session_id, live=False)
        if not sess.finished:
            sess.finish_reason = reason if reason in ("success", "errored", "interrupted") else "success"
        sess.finished = True
        sess.finished_at = time.time()
        self.store.write_session(tenant, sess.record())
        with self._lock:
            run_ids = [r for r in sess.run_ids if r in self.runs]
            for rid in run_ids:
                self.runs.pop(rid, None)
            for sid in sess.sampler_ids:
                self.samplers.pop(sid, None)
        for rid in run_ids:
            self.engine.close_lane(f"run:{rid}")
        for listener in self.session_listeners:
            listener(tenant, session_id, list(sess.run_ids))

    def reap_idle_sessions(self, now: float | None = None) -> list[str]:
        """Finish live sessions with no heartbeat or request for ``session_idle_timeout_s`` (a client
        that died), and forget sessions finished longer ago than that. Returns the sessions finished."""
        now = time.time() if now is None else now
        timeout = self.settings.session_idle_timeout_s
        idle = []
        for sess in list(self.sessions.values()):
            if sess.finished:
                if now - (sess.finished_at or now) > timeout:
                    with self._lock:
                        self.sessions.pop(sess.session_id, None)
                        self._ended[sess.session_id] = sess.tenant
                        while len(self._ended) > 100_000:
                            self._ended.pop(next(iter(self._ended)))
                continue
            runs = [self.runs[r].last_request_time for r in sess.run_ids if r in self.runs]
            if now - max([sess.last_heartbeat, *runs]) > timeout:
                idle.append(sess)
        for sess in idle:
            log.info(
                "finishing idle session %s (no heartbeat for %.0f s)",
                sess.session_id,
                now - sess.last_heartbeat,
            )
            self.finish_session(sess.tenant, sess.session_id, reason="interrupted")
        return [s.session_id for s in idle]

    # -- runs -----------------------------------------------------------------------------------
    def run(self, tenant: str, model_id: str) -> RunState:
        run = self.runs.get(model_id)
        if run is None or run.tenant != tenant:
            raise NotFound(f"unknown model_id {model_id!r}", field="model_id")
        return run

    def _check_base_model(self, name: str | None, field_name: str = "base_model") -> str:
        base = self.require_ready()
        if name is not None and name != base.name:
            raise NotFound(
                f"{field_name}: model {name!r} is not served here; this service serves {base.name!r}",
                field=field_name,
            )
        return base.name

    def _check_run_quota(self, tenant: str) -> None:
        n = sum(1 for r in self.runs.values() if r.tenant == tenant)
        if n >= self.limits.max_runs_per_tenant:
            raise UserError(
                f"a tenant may hold at most {self.limits.max_runs_per_tenant} live runs (OPENRL_MAX_RUNS_PER_TENANT); "
                f"finish a session to free its runs",
                field="model_id",
            )

    def lora_spec(
        self, rank: Any, train_attn: Any = True, train_mlp: Any = True, train_unembed: Any = True
    ) -> LoraSpec:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.limits.max_rank:
            raise UserError(
                f"lora_config.rank must be an integer in [1, {self.limits.max_rank}] (OPENRL_MAX_RANK); got {rank!r}",
                field="lora_config.rank",
            )
        spec = LoraSpec(
            rank=rank,
            train_attn=bool(train_attn),
            train_mlp=bool(train_mlp),
            train_unembed=bool(train_unembed),
        )
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise UserError(
                "lora_config: enable at least one of train_attn, train_mlp, train_unembed",
                field="lora_config",
            )
        return spec

    def _register_run(
        self,
        tenant: str,
        session: SessionRecord,
        model_seq_id: int,
        spec: LoraSpec,
        seed: int,
        user_metadata: dict | None,
    ) -> RunState:
        if isinstance(model_seq_id, bool) or not isinstance(model_seq_id, int) or model_seq_id < 0:
            raise UserError(
                f"model_seq_id must be a non-negative integer; got {model_seq_id!r}", field="model_seq_id"
            )
        run_id = f"{session.session_id}:train:{model_seq_id}"
        base = self.require_ready()
        with self._lock:
            existing = self.runs.get(run_id)
            if existing is not None:
                return existing
            self._check_run_quota(tenant)
            run = RunState(
                run_id=run_id,
                tenant=tenant,
                session_id=session.session_id,
                spec=spec,
                seed=seed,
                base_model=base.name,
                user_metadata=dict(user_metadata or {}),
            )
            self.runs[run_id] = run
            session.run_ids.append(run_id)
        self.engine.open_ordered_lane(run_id, next_seq=0)
        return run

    def _write_run_meta(self, run: RunState, **extra) -> None:
        self.store.write_run_meta(
            run.tenant,
            run.run_id,
            {
                "run_id": run.run_id,
                "tenant": run.tenant,
                "session_id": run.session_id,
                "base_model": run.base_model,
                "lora": run.spec.to_json(),
                "seed": run.seed,
                "created_at": run.created_at,
                "user_metadata": run.user_metadata,
                "project_id": getattr(self.sessions.get(run.session_id), "project_id", None),
                **extra,
            },
        )
        sess = self.sessions.get(run.session_id)
        if sess is not None:
            self.store.write_session(run.tenant, sess.record())

    def create_model(
        self,
        tenant: str,
        *,
        session_id: str,
        model_seq_id: int,
        base_model: str | None,
        spec: LoraSpec,
        seed: int | None,
        user_metadata: dict | None,
        idem: str | None,
    ) -> FutureRecord:
        sess = self.session(tenant, session_id)
        self._check_base_model(base_model)
        user_metadata = self.check_metadata(user_metadata)
        seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        run = self._register_run(tenant, sess, model_seq_id, spec, seed, user_metadata)

        def work():
            run.state = self.trainer.new_state(spec, seed)
            self._write_run_meta(run)
            return {"model_id": run.run_id}

        return self._submit_run(run, 0, "create_model", work, idem, model_id=run.run_id)

    def create_from_state(
        self,
        tenant: str,
        *,
        session_id: str,
        model_seq_id: int,
        path: str,
        optimizer: bool,
        base_model: str | None,
        user_metadata: dict | None,
        idem: str | None,
    ) -> FutureRecord:
        sess = self.session(tenant, session_id)
        user_metadata = self.check_metadata(user_metadata)
        ref = parse_tinker_path(path)
        if ref.kind != "weights":
            raise UserError(
                f"path: a training client starts from a 'weights' checkpoint (save_state); got {ref.kind}",
                field="path",
            )
        manifest = self.store.manifest(tenant, ref)  # NotFound for foreign or absent checkpoints
        self._check_base_model(manifest.get("base_model"), "path")
        if base_model is not None:
            self._check_base_model(base_model)
        spec = spec_from_manifest(manifest)
        self.check_adapter_file(tenant, ref, spec)
        run = self._register_run(
            tenant, sess, model_seq_id, spec, int(manifest.get("seed", 0)), user_metadata
        )

        def work():
            _, tensors, opt = self.store.load(tenant, ref, with_optimizer=optimizer)
            adapter = adapter_from_peft(spec, tensors, device=self.base.device, trainable=True)
            state = self.trainer.state_for(adapter)
            if opt is not None:
                Trainer.load_optimizer_tensors(state, opt)
            run.state = state
            self._write_run_meta(run, source_checkpoint=ref.path)
            return {"model_id": run.run_id, "path": ref.path}

        return self._submit_run(run, 0, "load_weights", work, idem, model_id=run.run_id)

    def check_adapter_file(
        self, tenant: str, ref: CheckpointRef, spec: LoraSpec, field_name: str = "path"
    ) -> None:
        """Refuse, before the worker sees it, a checkpoint whose adapter tensors are not ``spec``'s on
        the served model (a foreign PEFT folder, another rank, other layers): a 400 naming the tensor
        and the expected vs found shape. Reads only the safetensors header."""
        base = self.require_ready()
        file = self.store.folder(tenant, ref) / "adapter_model.safetensors"
        try:
            with safe_open(str(file), "pt") as f:
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except Exception as e:  # noqa: BLE001 - any unreadable file is the caller's bad input
            raise UserError(
                f"{field_name}: {ref.path} has no readable adapter_model.safetensors ({type(e).__name__})",
                field=field_name,
            ) from None
        check_peft_shapes(spec, base.targets, shapes, model=base.name, field=field_name)

    def get_info(self, tenant: str, model_id: str) -> dict:
        run = self.run(tenant, model_id)
        base = self.require_ready()
        return {
            "type": "get_info",
            "model_id": run.run_id,
            "model_data": {"arch": base.arch, "model_name": base.name, "tokenizer_id": base.name},
            "is_lora": True,
            "lora_rank": run.spec.rank,
            "model_name": base.name,
        }

    def _submit_run(
        self,
        run: RunState,
        seq_id: Any,
        kind: str,
        work: Callable[[], Any] | None,
        idem: str | None,
        *,
        error: UserError | None = None,
        tokens: Callable[[Any], int] | None = None,
        fuse: Fusable | None = None,
        **extra,
    ) -> FutureRecord:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 0:
            raise UserError(f"seq_id must be a non-negative integer; got {seq_id!r}", field="seq_id")
        prior = self.engine.idempotent(run.tenant, idem)
        if prior is not None:
            return prior
        run.last_request_time = time.time()
        rec = self.futures.new(run.tenant, kind, **extra)
        op = Op(
            kind=kind,
            lane=f"run:{run.run_id}",
            fn=work,
            future=rec,
            run_id=run.run_id,
            seq_id=seq_id,
            error=error,
            tokens=tokens,
            fuse=fuse if error is None else None,
        )
        fut, _ = self.engine.submit(op, idem_key=idem)
        return fut

    def run_op(
        self,
        tenant: str,
        model_id: str,
        seq_id: Any,
        kind: str,
        prepare: Callable[[RunState], Callable[[], Any]],
        idem: str | None,
        tokens: Callable[[Any], int] | None = None,
    ) -> FutureRecord:
        """Queue a seq-ordered op on a run. ``prepare`` validates and returns the work, or (work, a
        :class:`Fusable`) when the op may join a fused call; if it raises a UserError the request still
        takes its seq slot and completes as that error."""
        run = self.run(tenant, model_id)
        self.require_ready()
        fuse = None
        try:
            work, error = prepare(run), None
            if isinstance(work, tuple):
                work, fuse = work
        except UserError as e:
            work, error = None, e
        return self._submit_run(run, seq_id, kind, work, idem, error=error, tokens=tokens, fuse=fuse)

    def _state(self, run: RunState) -> TrainState:
        if run.state is None:
            raise UserError(f"model {run.run_id} failed to initialise; create a new one", field="model_id")
        return run.state

    # -- training ops ---------------------------------------------------------------------------
    def validate_datums(self, data: list[DatumArrays], loss_fn: str) -> None:
        base = self.require_ready()
        lim = self.limits
        if not data:
            raise UserError("data: at least one datum is required", field="data")
        if len(data) > lim.max_datums:
            raise UserError(
                f"data: at most {lim.max_datums} datums per call (OPENRL_MAX_DATUMS); got {len(data)}",
                field="data",
            )
        spec = LOSSES[loss_fn]
        trailing = None
        for i, d in enumerate(data):
            n = len(d.tokens)
            where = f"data[{i}]"
            if n == 0:
                raise UserError(f"{where}.model_input is empty", field=f"{where}.model_input")
            if n > base.context_length:
                raise UserError(
                    f"{where}.model_input has {n} tokens; the model's context length is {base.context_length}",
                    field=f"{where}.model_input",
                )
            lo, hi = int(d.tokens.min()), int(d.tokens.max())
            if lo < 0 or hi >= base.vocab_size:
                bad = lo if lo < 0 else hi
                raise UserError(
                    f"{where}.model_input: token id {bad} is outside the vocabulary [0, {base.vocab_size})",
                    field=f"{where}.model_input",
                )
            missing = [k for k in spec.required if k not in d.inputs]
            if missing:
                raise UserError(
                    f"{where}.loss_fn_inputs: {loss_fn} needs {', '.join(missing)}",
                    field=f"{where}.loss_fn_inputs.{missing[0]}",
                )
            unknown = sorted(set(d.inputs) - set(spec.required) - set(spec.optional))
            if unknown:
                raise UserError(
                    f"{where}.loss_fn_inputs: unexpected key(s) {', '.join(unknown)} for {loss_fn} "
                    f"(accepted: {', '.join(spec.required + spec.optional)})",
                    field=f"{where}.loss_fn_inputs.{unknown[0]}",
                )
            tt = d.inputs["target_tokens"]
            if tt.shape[0] != n or tt.ndim not in (1, 2):
                raise UserError(
                    f"{where}.loss_fn_inputs.target_tokens has shape {list(tt.shape)}; expected [{n}] or [{n}, K] "
                    f"to match model_input length {n}",
                    field=f"{where}.loss_fn_inputs.target_tokens",
                )
            if tt.ndim == 2 and loss_fn != "cross_entropy":
                raise UserError(
                    f"{where}.loss_fn_inputs.target_tokens: [N, K] targets are only allowed with cross_entropy",
                    field=f"{where}.loss_fn_inputs.target_tokens",
                )
            if trailing is None:
                trailing = tt.shape[1:]
            elif tt.shape[1:] != trailing:
                raise UserError(
                    f"{where}.loss_fn_inputs.target_tokens: every datum in one call must have the same K",
                    field=f"{where}.loss_fn_inputs.target_tokens",
                )
            if tt.size and (int(tt.min()) < 0 or int(tt.max()) >= base.vocab_size):
                raise UserError(
                    f"{where}.loss_fn_inputs.target_tokens: token ids must be in [0, {base.vocab_size})",
                    field=f"{where}.loss_fn_inputs.target_tokens",
                )
            for k, arr in d.inputs.items():
                if k == "target_tokens":
                    continue
                if arr.shape != tt.shape:
                    raise UserError(
                        f"{where}.loss_fn_inputs.{k} has shape {list(arr.shape)}; it must match target_tokens "
                        f"{list(tt.shape)}",
                        field=f"{where}.loss_fn_inputs.{k}",
                    )
                if not np.isfinite(arr).all():
                    raise UserError(
                        f"{where}.loss_fn_inputs.{k} contains NaN or inf", field=f"{where}.loss_fn_inputs.{k}"
                    )

    def forward_backward(
        self,
        tenant: str,
        model_id: str,
        seq_id: Any,
        data: list[DatumArrays] | UserError,
        loss_fn: str,
        loss_fn_config: dict,
        forward_only: bool,
        idem: str | None,
    ) -> FutureRecord:
        def prepare(run: RunState):
            if isinstance(data, UserError):
                raise data
            config = check_loss(loss_fn, loss_fn_config)
            self.validate_datums(data, loss_fn)
            work = lambda: self._forward_backward(self._state(run), data, loss_fn, config, forward_only)  # noqa: E731
            return work, self.train_fusable(run, data, loss_fn, config, forward_only)

        return self.run_op(
            tenant,
            model_id,
            seq_id,
            "forward" if forward_only else "forward_backward",
            prepare,
            idem,
            tokens=lambda r: r.tokens,
        )

    def train_fusable(
        self,
        run: RunState,
        data: list[DatumArrays],
        loss_fn: str,
        config: dict,
        forward_only: bool,
        finish: Callable[[ForwardResult], Any] | None = None,
    ) -> Fusable | None:
        """How a (forward_)backward joins a fused pass; None with fusion off or when the call needs
        more than one micro-batch (it then runs alone, one micro-batch per turn)."""
        if not self.settings.fusion:
            return None
        lengths = [len(d.tokens) for d in data]
        if len(self.trainer._microbatches(lengths)) > 1:
            return None
        return Fusable(
            key="train",
            size=len(data) * max(lengths),
            rows=len(data),
            width=max(lengths),
            limit=self.trainer.microbatch_tokens,  # the trainer's own cap (fp32 logits ≤ 2 GiB) included
            prepare=lambda: FusedItem(self._state(run), data, loss_fn, config, forward_only),
            finish=finish or (lambda result: result),
        )

    def sample_run(
        self, tenant: str, model_id: str, seq_id: Any, jobs: list[SampleJob], idem: str | None
    ) -> FutureRecord:
        """Sample from a training run's current weights, in its lane (a sample sees every train step
        submitted before it): the notebook API's sampling. The jobs decode as one batch; with fusion
        on, other runs' ready sampling joins it."""

        def prepare(run: RunState):
            def resolved() -> list[SampleJob]:  # on the worker: the adapter as of this seq_id
                adapter = self._state(run).adapter
                return [dataclasses.replace(j, adapter=adapter) for j in jobs]

            return lambda: self.sampler.sample_many(resolved()), self.sample_fusable(
                resolved, jobs, lambda outs: outs
            )

        return self.run_op(
            tenant, model_id, seq_id, "sample", prepare, idem, tokens=lambda outs: sum(o.tokens for o in outs)
        )

    def sample_fusable(
        self, jobs: Callable[[], list[SampleJob]], sizes: list[SampleJob], finish
    ) -> Fusable | None:
        """How a sampling op joins a fused generate; ``jobs()`` resolves the adapters on the worker.

        None (it runs alone) with fusion off or when a job asks for prompt logprobs (a full-prompt
        pass the others would wait on). Otherwise its rows are its samples, each padded to the longest
        prompt + decode of the call, and ``decode`` its longest decode (members stay within 2x)."""
        if not self.settings.fusion:
            return None
        if any(j.prompt_logprobs or j.topk_prompt_logprobs for j in sizes):
            return None
        rows = sum(j.num_samples for j in sizes)
        width = max(len(j.prompt) + (j.params.max_tokens or 0) for j in sizes)
        return Fusable(
            key="sample",
            size=rows * width,
            rows=rows,
            width=width,
            decode=max(j.params.max_tokens or 0 for j in sizes),
            prepare=jobs,
            finish=finish,
        )

    def _fused_sample(self, parts: list[list[SampleJob]]) -> list[list[SampleOutput]]:
        """Every member's jobs in one ``sample_many``, ordered so each adapter's rows are one block."""
        jobs = [j for part in parts for j in part]
        first: dict[int, int] = {}
        for j in jobs:
            first.setdefault(id(j.adapter), len(first))
        order = sorted(range(len(jobs)), key=lambda i: first[id(jobs[i].adapter)])
        outs = self.sampler.sample_many([jobs[i] for i in order])
        by_job: list[SampleOutput | None] = [None] * len(jobs)
        for out, i in zip(outs, order, strict=True):
            by_job[i] = out
        split, k = [], 0
        for part in parts:
            split.append(by_job[k : k + len(part)])
            k += len(part)
        return split

    def _forward_backward(
        self,
        state: TrainState,
        data: list[DatumArrays],
        loss_fn: str,
        config: dict,
        forward_only: bool,
    ) -> ForwardResult | Generator[int, None, ForwardResult]:
        """One micro-batch: run it now. Several: a generator the scheduler steps one micro-batch per turn."""
        plan = self.trainer._microbatches([len(d.tokens) for d in data])
        if len(plan) <= 1:
            return self.trainer.forward_backward(state, data, loss_fn, config, forward_only=forward_only)
        return self._chunked_forward_backward(state, data, plan, loss_fn, config, forward_only)

    def _chunked_forward_backward(
        self,
        state: TrainState,
        data: list[DatumArrays],
        plan: list[list[int]],
        loss_fn: str,
        config: dict,
        forward_only: bool,
    ) -> Generator[int, None, ForwardResult]:
        """The trainer's micro-batches as separate trainer calls, yielding each one's tokens between them.

        Each chunk is exactly one of the trainer's own micro-batches (same rows, same order, same
        padding), and loss, tokens and statistics are accumulated in the trainer's order, so the result
        and the gradient equal one uninterrupted call bit for bit. The run's earlier gradient is set
        aside for the call and added back at the end, as the trainer does for one call; if any chunk
        fails or the op is closed between chunks, it is restored as it was.
        """
        outputs: list[np.ndarray | None] = [None] * len(data)
        total, ntok, stats = 0.0, 0, {}
        with contextlib.nullcontext() if forward_only else accumulating_grads([state]):
            for k, idx in enumerate(plan):
                part = self.trainer.forward_backward(
                    state, [data[i] for i in idx], loss_fn, config, forward_only=forward_only
                )
                for i, lp in zip(idx, part.logprobs, strict=True):
                    outputs[i] = lp
                total += part.loss
                ntok += part.tokens
                merge_stats(stats, part.stats)
                if k < len(plan) - 1:
                    yield part.tokens  # other lanes may run here
        return ForwardResult(outputs, total, ntok, stats or None)  # type: ignore[arg-type]

    def optim_step(
        self, tenant: str, model_id: str, seq_id: Any, adam: AdamParams | UserError, idem: str | None
    ) -> FutureRecord:
        def prepare(run: RunState):
            if isinstance(adam, UserError):
                raise adam
            return lambda: {"metrics": self.trainer.optim_step(self._state(run), adam)}

        return self.run_op(tenant, model_id, seq_id, "optim_step", prepare, idem)

    def _manifest(self, run: RunState) -> dict:
        st = run.state
        return {
            "base_model": run.base_model,
            "lora": run.spec.to_json(),
            "seed": run.seed,
            "steps": st.steps if st else 0,
        }

    def save_state(
        self,
        tenant: str,
        model_id: str,
        seq_id: Any,
        name: Any,
        overwrite: bool,
        user_metadata: dict | None,
        idem: str | None,
        ttl_seconds: Any = None,
    ) -> FutureRecord:
        def prepare(run: RunState):
            ref = CheckpointRef(run.run_id, "weights", check_name(name))
            meta = self.check_metadata(user_metadata)
            expires_at = self.expiry(ttl_seconds)

            def work():
                st = self._state(run)
                self.store.save(
                    run.tenant,
                    ref,
                    adapter=st.adapter.peft_state_dict(),
                    adapter_config=peft_adapter_config(run.spec, self.base.targets, run.base_model),
                    optimizer=Trainer.optimizer_tensors(st),
                    manifest={**self._manifest(run), "user_metadata": meta, "expires_at": expires_at},
                    overwrite=overwrite,
                )
                return {"path": ref.path}

            return work

        return self.run_op(tenant, model_id, seq_id, "save_weights", prepare, idem)

    def load_state(
        self, tenant: str, model_id: str, seq_id: Any, path: Any, optimizer: bool, idem: str | None
    ) -> FutureRecord:
        def prepare(run: RunState):
            ref = parse_tinker_path(path)
            manifest = self.store.manifest(run.tenant, ref)
            if manifest.get("base_model") != run.base_model:
                raise UserError(
                    f"path: {ref.path} was trained on {manifest.get('base_model')!r}, "
                    f"this run uses {run.base_model!r}",
                    field="path",
                )
            if manifest["lora"]["rank"] != run.spec.rank:
                raise UserError(
                    f"path: {ref.path} has LoRA rank {manifest['lora']['rank']}, "
                    f"this run has rank {run.spec.rank}",
                    field="path",
                )
            self.check_adapter_file(run.tenant, ref, run.spec)  # same layers, same shapes

            def work():
                manifest, tensors, opt = self.store.load(run.tenant, ref, with_optimizer=optimizer)
                st = self._state(run)
                loaded = adapter_from_peft(run.spec, tensors, device=self.base.device, trainable=False)
                with torch.no_grad():
                    for n, (a, b) in st.adapter.weights.items():
                        a.copy_(loaded.weights[n][0])
                        b.copy_(loaded.weights[n][1])
                        a.grad = None
                        b.grad = None
                if opt is not None:
                    Trainer.load_optimizer_tensors(st, opt)
                else:
                    st.optimizer = make_optimizer(st.adapter)
                    st.steps = int(manifest.get("steps", 0))
                st.pending_backward = 0
                return {"path": ref.path}

            return work

        return self.run_op(tenant, model_id, seq_id, "load_weights", prepare, idem)

    def save_for_sampler(
        self,
        tenant: str,
        model_id: str,
        seq_id: Any,
        name: Any,
        sampling_session_seq_id: Any,
        user_metadata: dict | None,
        idem: str | None,
        ttl_seconds: Any = None,
    ) -> FutureRecord:
        def prepare(run: RunState):
            if name is None:
                if isinstance(sampling_session_seq_id, bool) or not isinstance(sampling_session_seq_id, int):
                    raise UserError(
                        "save_weights_for_sampler needs a path (name) or a sampling_session_seq_id",
                        field="sampling_session_seq_id",
                    )
                sampler_id = f"{run.session_id}:sample:{sampling_session_seq_id}"

                def ephemeral():
                    snap = self._state(run).adapter.snapshot()
                    self._add_sampler(
                        SamplerEntry(
                            sampler_id,
                            run.tenant,
                            run.session_id,
                            run.base_model,
                            snap,
                            source_run=run.run_id,
                        )
                    )
                    return {"sampling_session_id": sampler_id}

                return ephemeral
            return self._export(run, "sampler_weights", name, user_metadata, ttl_seconds)

        return self.run_op(tenant, model_id, seq_id, "save_weights_for_sampler", prepare, idem)

    def save_external(
        self,
        tenant: str,
        model_id: str,
        seq_id: Any,
        name: Any,
        ttl_seconds: Any,
        recipients: Any,
        idem: str | None,
    ) -> FutureRecord:
        """save_weights_external: the adapter as a PEFT folder to download (external_weights checkpoint)."""

        def prepare(run: RunState):
            if recipients:
                raise UserError(
                    "age_encryption_recipients: encrypted exports are not supported by this service; "
                    "download over HTTPS from a trusted network instead",
                    field="age_encryption_recipients",
                )
            return self._export(run, "external_weights", name, None, ttl_seconds)

        return self.run_op(tenant, model_id, seq_id, "save_weights_external", prepare, idem)

    def _export(
        self, run: RunState, kind: str, name: Any, user_metadata: Any, ttl_seconds: Any
    ) -> Callable[[], dict]:
        """Adapter-only checkpoint work (sampler or external weights); validated now, written on the worker."""
        ref = CheckpointRef(run.run_id, kind, check_name(name))
        meta = self.check_metadata(user_metadata)
        expires_at = self.expiry(ttl_seconds)

        def work() -> dict:
            st = self._state(run)
            folder = self.store.save(
                run.tenant,
                ref,
                adapter=st.adapter.peft_state_dict(),
                adapter_config=peft_adapter_config(run.spec, self.base.targets, run.base_model),
                optimizer=None,
                manifest={**self._manifest(run), "user_metadata": meta, "expires_at": expires_at},
                overwrite=True,
            )
            return {"path": ref.path, "size_bytes": sum(p.stat().st_size for p in folder.iterdir())}

        return work

    # -- samplers -------------------------------------------------------------------------------
    def _add_sampler(self, entry: SamplerEntry) -> None:
        """Register a sampler (not for a finished session: its owner is gone) and keep the budget."""
        with self._lock:
            sess = self.sessions.get(entry.session_id or "")
            if sess is not None and sess.finished:
                return
            self.samplers[entry.sampler_id] = entry
            if sess is not None:
                sess.sampler_ids.append(entry.sampler_id)
            self._enforce_snapshot_budget(keep=entry)

    def _enforce_snapshot_budget(self, keep: SamplerEntry) -> None:
        """Least-recently-used adapters go first. A checkpoint-backed sampler only drops its tensors
        (they reload from disk on its next request); an ephemeral snapshot is forgotten. Caller holds
        the lock."""
        s = self.settings
        loaded = sorted(
            (x for x in self.samplers.values() if x.adapter is not None and x is not keep),
            key=lambda x: x.last_used,
        )
        count = len(loaded) + (keep.adapter is not None)
        total = sum(x.adapter.nbytes() for x in loaded) + (keep.adapter.nbytes() if keep.adapter else 0)
        while loaded and (count > s.max_sampler_snapshots or total > s.max_sampler_snapshot_bytes):
            old = loaded.pop(0)
            count -= 1
            total -= old.adapter.nbytes()
            if old.model_path is not None:
                old.adapter = None
                continue
            del self.samplers[old.sampler_id]
            self._evicted[old.sampler_id] = old.tenant
            while len(self._evicted) > 100_000:
                self._evicted.pop(next(iter(self._evicted)))
            log.info("evicted sampler %s (snapshot budget)", old.sampler_id)

    def _sampler_adapter(self, entry: SamplerEntry) -> Adapter | None:
        """On the worker: the entry's adapter, reloaded from its checkpoint if the budget dropped it."""
        adapter = entry.adapter
        if adapter is None and entry.model_path is not None:
            ref = parse_tinker_path(entry.model_path)
            manifest, tensors, _ = self.store.load(entry.tenant, ref)
            adapter = adapter_from_peft(
                spec_from_manifest(manifest), tensors, device=self.base.device, trainable=False
            )
            with self._lock:
                entry.adapter = adapter
                self._enforce_snapshot_budget(keep=entry)
        return adapter

    def sampler_entry(self, tenant: str, sampler_id: str) -> SamplerEntry:
        entry = self.samplers.get(sampler_id)
        if entry is None and self._evicted.get(sampler_id) == tenant:
            raise NotFound(
                f"sampler {sampler_id} was evicted: the service keeps the {self.settings.max_sampler_snapshots} "
                "most recently used snapshots (OPENRL_MAX_SAMPLER_SNAPSHOTS) within "
                "OPENRL_MAX_SAMPLER_SNAPSHOT_BYTES; save weights for a new sampling client",
                field="sampling_session_id",
            )
        if entry is None or entry.tenant != tenant:
            raise NotFound(f"unknown sampling_session_id {sampler_id!r}", field="sampling_session_id")
        return entry

    def create_sampler(
        self, tenant: str, *, session_id: str, seq_id: Any, base_model: str | None, model_path: str | None
    ) -> str:
        """A sampler on the base model or on a saved checkpoint; returns its id at once (the checkpoint's
        tensors load on the worker with its first sample request)."""
        sess = self.session(tenant, session_id)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 0:
            raise UserError(
                f"sampling_session_seq_id must be a non-negative integer; got {seq_id!r}",
                field="sampling_session_seq_id",
            )
        sampler_id = f"{sess.session_id}:sample:{seq_id}"
        existing = self.samplers.get(sampler_id)
        if existing is not None and existing.tenant == tenant:
            return sampler_id  # a retry
        if model_path is None:
            name = self._check_base_model(base_model)
            self._add_sampler(SamplerEntry(sampler_id, tenant, sess.session_id, name, None))
            return sampler_id
        ref = parse_tinker_path(model_path, field="model_path")
        manifest = self.store.manifest(tenant, ref)
        name = self._check_base_model(manifest.get("base_model"), "model_path")
        self.check_adapter_file(tenant, ref, spec_from_manifest(manifest), "model_path")
        if base_model is not None:
            self._check_base_model(base_model)
        self._add_sampler(
            SamplerEntry(
                sampler_id, tenant, sess.session_id, name, None, model_path=ref.path, source_run=ref.run_id
            )
        )
        return sampler_id

    def sampling_params(self, raw: dict) -> SamplingParams:
        """Validate Tinker SamplingParams JSON; errors name the field and the limit."""
        base = self.require_ready()
        lim = self.limits
        raw = raw or {}
        max_tokens = raw.get("max_tokens")  # None: as many as fit (resolved against the prompt in sample)
        if max_tokens is not None and (
            isinstance(max_tokens, bool)
            or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= lim.max_tokens
        ):
            raise UserError(
                f"sampling_params.max_tokens must be an integer in [1, {lim.max_tokens}] "
                f"(OPENRL_MAX_TOKENS); got {max_tokens!r}",
                field="sampling_params.max_tokens",
            )
        temperature = raw.get("temperature", 1.0)
        temperature = 1.0 if temperature is None else temperature
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise UserError(
                f"sampling_params.temperature must be a finite number >= 0; got {temperature!r}",
                field="sampling_params.temperature",
            )
        top_p = raw.get("top_p", 1.0)
        top_p = 1.0 if top_p is None else top_p
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise UserError(
                f"sampling_params.top_p must be in (0, 1]; got {top_p!r}", field="sampling_params.top_p"
            )
        top_k = raw.get("top_k", -1)
        top_k = -1 if top_k is None else top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k != -1 and top_k < 1):
            raise UserError(
                f"sampling_params.top_k must be -1 (off) or a positive integer; got {top_k!r}",
                field="sampling_params.top_k",
            )
        seed = raw.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise UserError(
                f"sampling_params.seed must be an integer; got {seed!r}", field="sampling_params.seed"
            )
        stop = raw.get("stop", None)
        stop_ids: tuple[int, ...] = ()
        stop_strs: tuple[str, ...] = ()
        if stop is None:
            stop_ids = tuple(base.eos_token_ids)
        else:
            items = [stop] if isinstance(stop, str) else stop
            if not isinstance(items, list):
                raise UserError(
                    "sampling_params.stop must be a string, a list of strings or a list of token ids",
                    field="sampling_params.stop",
                )
            if len(items) > lim.max_stop_sequences:
                raise UserError(
                    f"sampling_params.stop: at most {lim.max_stop_sequences} entries "
                    f"(OPENRL_MAX_STOP_SEQUENCES); got {len(items)}",
                    field="sampling_params.stop",
                )
            if all(isinstance(x, str) for x in items):
                if any(not x for x in items):
                    raise UserError(
                        "sampling_params.stop: stop strings must be non-empty", field="sampling_params.stop"
                    )
                stop_strs = tuple(items)
            elif all(isinstance(x, int) and not isinstance(x, bool) for x in items):
                if any(not 0 <= x < base.vocab_size for x in items):
                    raise UserError(
                        f"sampling_params.stop: token ids must be in [0, {base.vocab_size})",
                        field="sampling_params.stop",
                    )
                stop_ids = tuple(items)
            else:
                raise UserError(
                    "sampling_params.stop must not mix strings and token ids", field="sampling_params.stop"
                )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=seed,
            stop_token_ids=stop_ids,
            stop_strings=stop_strs,
        )

    def check_sample(
        self,
        prompt: list[int],
        num_samples: Any,
        params: SamplingParams,
        topk_prompt: Any = 0,
        topk_sample: Any = 0,
    ) -> SamplingParams:
        """Validate one sample request against the limits and the model; returns the params with
        ``max_tokens`` resolved (when omitted: as many as fit the context, up to OPENRL_MAX_TOKENS)."""
        base = self.require_ready()
        lim = self.limits
        if (
            isinstance(num_samples, bool)
            or not isinstance(num_samples, int)
            or not 1 <= num_samples <= lim.max_num_samples
        ):
            raise UserError(
                f"num_samples must be an integer in [1, {lim.max_num_samples}] (OPENRL_MAX_NUM_SAMPLES); "
                f"got {num_samples!r}",
                field="num_samples",
            )
        for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample)):
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= lim.max_topk:
                raise UserError(
                    f"{name} must be an integer in [0, {lim.max_topk}] (OPENRL_MAX_TOPK); got {k!r}",
                    field=name,
                )
        if not prompt:
            raise UserError("prompt is empty", field="prompt")
        if params.max_tokens is None:
            params = dataclasses.replace(
                params, max_tokens=max(1, min(lim.max_tokens, base.context_length - len(prompt)))
            )
        if len(prompt) + params.max_tokens > base.context_length:
            raise UserError(
                f"prompt ({len(prompt)} tokens) + sampling_params.max_tokens ({params.max_tokens}) exceeds "
                f"the model's context length {base.context_length}",
                field="sampling_params.max_tokens",
            )
        if min(prompt) < 0 or max(prompt) >= base.vocab_size:
            raise UserError(f"prompt: token ids must be in [0, {base.vocab_size})", field="prompt")
        return params

    def sample(
        self,
        tenant: str,
        *,
        sampler_id: str,
        prompt: list[int],
        num_samples: Any,
        params: SamplingParams,
        prompt_logprobs: bool,
        topk_prompt_logprobs: Any,
        topk_sample_logprobs: Any,
        idem: str | None,
    ) -> FutureRecord:
        prior = self.engine.idempotent(tenant, idem)
        if prior is not None:
            return prior
        entry = self.sampler_entry(tenant, sampler_id)
        params = self.check_sample(prompt, num_samples, params, topk_prompt_logprobs, topk_sample_logprobs)
        job = SampleJob(
            prompt=prompt,
            num_samples=num_samples,
            params=params,
            adapter=None,  # resolved on the worker: a checkpoint-backed sampler may need to reload
            prompt_logprobs=bool(prompt_logprobs),
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
        )
        entry.last_used = time.time()
        rec = self.futures.new(tenant, "sample")
        rec.extra["sample_sequence_ids"] = [f"{rec.request_id}:{i}" for i in range(num_samples)]
        op = Op(
            kind="sample",
            lane=f"sampler:{sampler_id}",
            fn=lambda: self.sampler.sample(dataclasses.replace(job, adapter=self._sampler_adapter(entry))),
            future=rec,
            run_id=entry.source_run or sampler_id,
            tokens=lambda out: out.tokens,
            refuse_when_full=True,  # 429 + Retry-After: the Tinker SDK backs off and resubmits
            fuse=self.sample_fusable(
                lambda: [dataclasses.replace(job, adapter=self._sampler_adapter(entry))],
                [job],
                lambda outs: outs[0],
            ),
        )
        fut, _ = self.engine.submit(op, idem_key=idem)
        return fut

    # -- results --------------------------------------------------------------------------------
    @staticmethod
    def result_kind(result: Any) -> str:
        if isinstance(result, ForwardResult):
            return "forward_backward"
        if isinstance(result, SampleOutput):
            return "sample"
        return "json"
