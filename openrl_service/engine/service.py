"""The engine's operations: what both HTTP façades (Tinker, native) call — training, sampling and
checkpoints of runs.

Each public method runs on the event loop: it checks ownership and input cheaply, then queues the
tensor work as an :class:`~openrl_service.engine.ops.Op` for the device worker and returns the
future. Who owns what (sessions, runs, samplers) lives in :mod:`~openrl_service.engine.registry`, the
input checks in :mod:`~openrl_service.engine.validation`; both are mixed into ``TrainingService``.

Sharing the device: a forward/backward whose datums need several padded micro-batches runs as a
chunked op (one micro-batch per scheduler turn, other runs' ops in between), so a big batch holds
the device for about one micro-batch at a time. The chunks are the trainer's own micro-batches, so
the result, the loss sum and the gradient are bit-identical to running the call in one go, and the
call stays atomic: if a later chunk fails (or the run is closed), the run's gradients are exactly as
they were before the call. Sampling requests over a queue limit are refused (429, see
:mod:`~openrl_service.engine.scheduler`); training requests are always queued.

Several base models: each served model (``--model`` repeated, ``OPENRL_MODELS``) has its own
trainer, sampler and device (:class:`~openrl_service.engine.registry.ServedModel`, all made on the
worker at startup after the memory budget check). A run or sampler names its model
(``base_model``), and every op uses that model's trainer, sampler, device and tokenizer; fused calls
join only ops of one model (the fusion key names it). The first model is the default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import random
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch

from openrl_service import crashpoints, memory
from openrl_service.checks import integer
from openrl_service.config import Settings, check_device_quota
from openrl_service.engine.durability import Durability
from openrl_service.engine.export import Exports
from openrl_service.engine.futures import FutureRecord, FutureStore
from openrl_service.engine.inference import Inference
from openrl_service.engine.ops import Fusable, Op
from openrl_service.engine.owner import AddSampler, SamplerWeights
from openrl_service.engine.registry import Registry
from openrl_service.engine.scheduler import Engine
from openrl_service.engine.stability import StabilityRecords
from openrl_service.engine.state import RunState, SamplerEntry, ServedModel, spec_from_manifest
from openrl_service.engine.usage import DeviceUsage
from openrl_service.engine.validation import Checks
from openrl_service.errors import ApiError, NotReady, UserError
from openrl_service.group.trainer import GroupTrainer
from openrl_service.models.loading import (
    BaseModel,
    check_memory_budget,
    estimate_need,
    free_bytes,
    load_base_model,
)
from openrl_service.sampling.base import SampleJob, SampleOutput, SamplingParams
from openrl_service.sampling.budget import default_batch_bytes
from openrl_service.sampling.factory import CountingSampler, make_sampler
from openrl_service.storage.checkpoints import CheckpointRef, CheckpointStore, check_name, parse_tinker_path
from openrl_service.storage.layout import migrate_tenant_folders
from openrl_service.telemetry import OpRecorder
from openrl_service.training.full import (
    Residency,
    weights_from_checkpoint,
)
from openrl_service.training.lora import Adapter, LoraSpec
from openrl_service.training.losses import check_loss
from openrl_service.training.optim_params import AdamParams, optimizer_kind
from openrl_service.training.trainer import (
    DatumArrays,
    ForwardResult,
    FusedItem,
    Trainer,
    TrainState,
    accumulating_grads,
    merge_stats,
)

log = logging.getLogger(__name__)


def _full(job: SampleJob) -> bool:
    return job.adapter is not None and not job.adapter.shares_batch


def true_or_false(value: Any, field_name: str) -> None:
    """An op's flag must be a JSON boolean: "false" is not false (its slot fails with this)."""
    if not isinstance(value, bool):
        raise UserError(f"{field_name} must be true or false; got {repr(value)[:100]}", field=field_name)


class TrainingService(Registry):
    """The engine's operations; sessions/runs/samplers from Registry, input checks in ``checks``."""

    def __init__(self, settings: Settings, *, base: BaseModel | None = None):
        self.settings = settings
        self.limits = settings.limits
        check_device_quota(settings.limits)  # Settings made in Python are checked as the environment's are
        migrate_tenant_folders(settings.data_dir)  # before anything reads a tenant's folder
        self.store = CheckpointStore(settings.data_dir, settings.limits)
        self.checks = Checks(settings, self.store, self.require_ready)
        self.futures = FutureStore(ttl_s=settings.future_ttl_s, max_bytes=settings.max_result_bytes)
        self.recorder = OpRecorder()
        self.device_time = DeviceUsage(settings.limits)  # each tenant's device-seconds, and their quota
        self.engine = Engine(
            futures=self.futures,
            seq_gap_timeout_s=settings.seq_gap_timeout_s,
            recorder=self.recorder,
            max_queued_per_lane=settings.limits.max_queued_per_run,
            max_queued_total=settings.limits.max_queued_total,
            retry_after_s=settings.backpressure_retry_after_s,
            fusion=settings.fusion,
            fusion_max_tokens=settings.fusion_max_tokens or settings.microbatch_tokens,
            fusers={},  # "train:<model>" and "sample:<model>", one pair per model, set as they load
            usage=self.device_time,
        )
        self.group = None  # the torch.distributed group at world size > 1 (group/comm.py)
        self._preloaded = base  # a model loaded by the caller: served as the first (default) one
        self.models: dict[str, ServedModel] = {}  # name -> model, the default first; set by _setup
        self.sample_notices: dict[str, str] = {}  # run or sampler id -> why torch sampled its last job
        # sampler id -> the accepted save_weights_for_sampler that creates it, until it has run: a sample
        # for it waits (after a restart the replayed save may still be queued when the client samples)
        self.pending_samplers: dict[str, FutureRecord] = {}
        # Run control (set by the notebook API's /runs/{id}/control): a paused or stopped Tinker-SDK
        # run's ops complete as this error (in their seq slot, so a resume continues in order), and
        # the last forward_backward loss of each run, for the runs list.
        self.refused_runs: dict[str, UserError] = {}
        self.last_loss: dict[str, float] = {}
        self.durability = Durability(self)  # before the registry: its owner journals through it
        self._init_registry()
        self.inference = Inference(self)  # sampling by model name (the OpenAI-compatible API)
        self.exports = Exports(self)  # checkpoints as PEFT or merged Hugging Face folders
        self.stability = StabilityRecords(  # stable_reinforce
            settings.max_stability_records, settings.max_stability_bytes
        )
        self.tenant_forgetters.append(self.stability.forget)
        self.tenant_forgetters.append(self.device_time.forget)
        self.session_listeners.append(
            lambda tenant, session_id, _runs: self.stability.forget(tenant, session_id)
        )
        self.durability.record_replayers["forget_tenant"] = self._replay_forget_tenant
        self.futures.on_complete = self.durability.completed

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start(setup=self._setup)

    def _setup(self) -> None:
        """On the worker: check the memory budget, then load every model and make its trainer and
        sampler (a failure is reported by /readyz and the log)."""
        s = self.settings
        if s.torch_threads:  # else torch's default: the cores, or OMP_NUM_THREADS (bench/RESULTS.md, Threads)
            torch.set_num_threads(s.torch_threads)
        entries = s.model_entries()
        group = self._join_group()
        if group is not None:  # every model on this rank's device
            entries = [dataclasses.replace(e, device=str(group.device)) for e in entries]
        preloaded = [self._preloaded] if self._preloaded is not None else []
        entries = entries[len(preloaded) :]
        needs = [estimate_need(e.spec, name=e.name, data_dir=s.data_dir, device=e.device) for e in entries]
        check_memory_budget(needs, s.memory_budget_bytes)
        bases = preloaded + [
            load_base_model(e.spec, data_dir=s.data_dir, name=e.name, device=e.device) for e in entries
        ]
        models: dict[str, ServedModel] = {}
        for base in bases:
            if base.name in models:
                raise ValueError(
                    f"two models are named {base.name!r} ({models[base.name].base.source} and {base.source}); "
                    "name them apart with NAME=SPEC"
                )
            if group is None:
                trainer = Trainer(
                    base, microbatch_tokens=s.microbatch_tokens, residency=self._residency(base)
                )
            else:
                trainer = GroupTrainer(
                    base, group=group, microbatch_tokens=s.microbatch_tokens, residency=self._residency(base)
                )
            sampler = self._make_sampler(base)
            base.sampled_by_torch = sampler.backend == "torch"
            models[base.name] = ServedModel(base, trainer, sampler)
            self.engine.fusers[f"train:{base.name}"] = trainer.forward_backward_fused
            self.engine.fusers[f"sample:{base.name}"] = functools.partial(self._fused_sample, base.name)
        self._plan_memory(models)
        if group is not None:  # the other ranks load the same models (after this one made their files)
            wire = [
                {"name": n, "spec": e.spec, "microbatch_tokens": m.trainer.microbatch_tokens}
                for (n, m), e in zip(models.items(), s.model_entries(), strict=True)
            ]
            group.form(wire)
            group.formed()
            group.ping_when_idle(max(1.0, s.group_timeout_s / 4))
        self.models = models

    def _join_group(self):
        """At world size > 1, rank 0 joins its group here, on the worker (/readyz says starting until
        every rank has joined and loaded the models); None on one device."""
        s = self.settings
        if s.world_size <= 1:
            return None
        from openrl_service.group.comm import Group, env_rank

        if env_rank() != 0:
            raise ValueError(
                f"world size {s.world_size} (OPENRL_WORLD_SIZE): the group's ranks are started by "
                "`openrl-service serve --world-size N`"
            )
        group = self.group = Group.from_env(timeout_s=s.group_timeout_s)  # formed once the models load
        # an op's device time: its wall time here plus what the other ranks spent on it (engine/usage.py)
        self.device_time.others_busy_s = lambda: sum(
            stats.get("busy_s", 0.0) for rank, stats in list(group.rank_stats.items()) if rank
        )
        return group

    def _plan_memory(self, models: dict[str, ServedModel]) -> None:
        """The memory accountant (openrl_service/memory.py), once every model and sampler is up (vLLM's
        KV cache taken): each device's room, shared by the models on it, less what each one reserves;
        the rest is its full runs' share."""
        s = self.settings
        on: dict[str, list[ServedModel]] = {}
        for m in models.values():
            on.setdefault(str(m.base.device), []).append(m)
        host_free, host_source = memory.host_room(free_bytes(torch.device("cpu")))
        snapshot_caps = []
        for device, group in on.items():
            dev = group[0].base.device
            room, source = (host_free, host_source) if dev.type == "cpu" else (free_bytes(dev), "free")
            share = None if room is None else room // len(group)
            for m in group:
                base = m.base
                # a vLLM sampler schedules its own memory: only what the torch sampler serves is
                # held to this at a request's checks
                base.sample_batch_bytes = s.limits.sample_batch_bytes or default_batch_bytes(dev.type, share)
                host = s.full_host_budget_bytes
                if host is None:
                    host = host_free // 2 if host_free is not None and dev.type != "cpu" else 0
                p = memory.plan(
                    device,
                    share,
                    source + (f", shared by {len(group)} models" if len(group) > 1 else ""),
                    sampling=base.sample_batch_bytes,
                    sampler_snapshots=s.max_sampler_snapshot_bytes // len(models),
                    largest_tensor=max(t.numel() * 4 for t in base.router.base_weights.values()),
                    full_runs=s.full_run_budget_bytes,
                    host_share=host,
                )
                m.trainer.plan_memory(p)
                snapshot_caps.append(p.parts.get("sampler_snapshots", s.max_sampler_snapshot_bytes))
                log.info("memory plan for %s on %s", base.name, p.describe())
        self.snapshot_bytes_cap = min(s.max_sampler_snapshot_bytes, sum(snapshot_caps))

    def _residency(self, base: BaseModel) -> Residency:
        """Full runs' turns on ``base``'s device; their share is set by the memory plan (_plan_memory)
        once the samplers are up. Spill files a killed process left are removed: the journal holds
        their state."""
        s = self.settings
        spill = s.data_dir / "spill"
        for pattern in ("*.safetensors", "*.safetensors.tmp"):  # a killed process's, whole or half
            for stale in spill.glob(pattern):  # written: the journal holds their state
                stale.unlink(missing_ok=True)
        residency = Residency(base.device, budget_bytes=None, host_bytes=0, spill_dir=spill)
        residency.busy = lambda w: self.engine.lane_depth(getattr(w, "lane", "")) > 0
        return residency

    def _make_sampler(self, base: BaseModel) -> CountingSampler:
        """The sampler of one served model (the one place a sampler is made): --sampler picks it."""
        return make_sampler(base, self.settings)

    # The default (first) model's parts, for code that serves one model (telemetry, tests).
    @property
    def default_model(self) -> ServedModel | None:
        return next(iter(self.models.values()), None)

    @property
    def base(self) -> BaseModel | None:
        first = self.default_model
        return first.base if first is not None else self._preloaded

    @property
    def trainer(self) -> Trainer | None:
        first = self.default_model
        return first.trainer if first is not None else None

    @property
    def sampler(self) -> CountingSampler | None:
        first = self.default_model
        return first.sampler if first is not None else None

    def stop(self) -> None:
        self.engine.stop()
        if self.group is not None and not self.engine.alive:
            self.group.close()  # the other ranks stop
        if not self.engine.alive:
            for m in self.models.values():
                m.sampler.close()  # vLLM's engine, shut down explicitly

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self.engine.ready.wait(timeout_s)

    def require_ready(self) -> BaseModel:
        """The default model, once every model is loaded (else NotReady)."""
        if self.engine.setup_error is not None:
            raise NotReady(f"the model failed to load: {self.engine.setup_error}")
        if not self.engine.ready.is_set() or not self.models:
            raise NotReady("the model is still loading; retry shortly")
        return self.default_model.base

    def capabilities(self) -> list[dict]:
        self.require_ready()
        return [m.base.capability(self.limits) for m in self.models.values()]

    # -- run ops --------------------------------------------------------------------------------
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
        self.admit(tenant)  # now: once the run is registered below, its first op must be queued
        base_model = self._check_base_model(base_model)  # journaled resolved: a replay uses this model
        self.models[base_model].trainer.admit(spec)  # a full run too big for the device: refused now
        user_metadata = self.checks.check_metadata(user_metadata)
        seed = integer(seed, "seed") if seed is not None else random.SystemRandom().randrange(2**31)
        call = self.durability.call(
            "create_model",
            tenant=tenant,
            session_id=session_id,
            model_seq_id=model_seq_id,
            base_model=base_model,
            spec=spec,
            seed=seed,
            user_metadata=user_metadata,
            idem=idem,
        )  # with the seed drawn: a replay makes the same weights
        run = self._register_run(tenant, sess, model_seq_id, spec, seed, user_metadata, base_model)
        trainer = self.models[base_model].trainer

        def work():
            self._adopt(run, trainer.new_state(spec, seed))
            self._write_run_meta(run)
            return {"model_id": run.run_id}

        return self._submit_run(
            run, 0, "create_model", work, idem, call=call, admitted=True, model_id=run.run_id
        )

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
        optimizer_config: dict | None = None,
    ) -> FutureRecord:
        call = self.durability.call(
            "create_from_state",
            tenant=tenant,
            session_id=session_id,
            model_seq_id=model_seq_id,
            path=path,
            optimizer=optimizer,
            optimizer_config=optimizer_config,
            base_model=base_model,
            user_metadata=user_metadata,
            idem=idem,
        )
        sess = self.session(tenant, session_id)
        self.admit(tenant)  # now: once the run is registered below, its first op must be queued
        user_metadata = self.checks.check_metadata(user_metadata)
        ref = parse_tinker_path(path)
        if ref.kind != "weights":
            raise UserError(
                f"path: a training client starts from a 'weights' checkpoint (save_state); got {ref.kind}",
                field="path",
            )
        manifest = self.store.manifest(tenant, ref)  # NotFound for foreign or absent checkpoints
        model = self.served(manifest.get("base_model"), "path")
        if base_model is not None and self._check_base_model(base_model) != model.name:
            raise UserError(
                f"base_model: {ref.path} was trained on {model.name!r}, not {base_model!r}",
                field="base_model",
            )
        spec = spec_from_manifest(manifest)
        if optimizer_config is not None:
            kind = optimizer_kind(optimizer_config)
            if optimizer and kind != spec.optimizer:
                raise UserError(
                    f"optimizer_config: {ref.path} holds {spec.optimizer} optimizer state, which a "
                    f"{kind} run cannot restore; load it without the optimizer to switch",
                    field="optimizer_config",
                )
            spec = dataclasses.replace(spec, optimizer=kind)  # a weights-only load picks its optimizer
        model.trainer.admit(spec)
        self.checks.check_adapter_file(tenant, ref, spec, base=model.base)
        run = self._register_run(
            tenant, sess, model_seq_id, spec, int(manifest.get("seed", 0)), user_metadata, model.name
        )

        def work():
            model.trainer.make_room_for(spec)  # before the checkpoint's tensors are read
            _, tensors, opt = self.store.load(tenant, ref, with_optimizer=optimizer)
            adapter = weights_from_checkpoint(model.base, spec, tensors, trainable=True, consume=True)
            del tensors  # taken by the weights: one copy of a full run's weights, not two
            state = model.trainer.state_from(adapter, opt)
            self._adopt(run, state)
            self._write_run_meta(run, source_checkpoint=ref.path)
            return {"model_id": run.run_id, "path": ref.path}

        return self._submit_run(
            run, 0, "load_weights", work, idem, call=call, admitted=True, model_id=run.run_id
        )

    def verify_checkpoint(self, tenant: str, path: object, *, optimizer: bool = False) -> None:
        """Off the device worker, before a load is queued (a request's thread): hash the checkpoint's
        tensor files against its manifest (``CheckpointStore.verify``), so the load on the worker reads
        them without hashing: a full run's checkpoint is the model's size, seconds of hashing every
        other tenant's ops would wait for. Best effort: what is wrong with the path or the files is
        left to the load, which reports it in its op's slot as always."""
        try:
            self.store.verify(tenant, parse_tinker_path(path), with_optimizer=optimizer)
        except (ApiError, OSError, ValueError) as e:
            log.debug("checkpoint %r not verified ahead of its load: %s", path, e)

    def _adopt(self, run: RunState, state) -> None:
        """Give a new run its state, made on the worker; if its session finished meanwhile (the finish
        found no state to free), a full run's device share and spill file go now, not at restart."""
        run.state = state
        state.adapter.lane = f"run:{run.run_id}"  # its residency keeps it while its next op waits
        if self.runs.get(run.run_id) is not run:
            state.adapter.leave()

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
        call: tuple | None = None,
        admitted: bool = False,
        **extra,
    ) -> FutureRecord:
        integer(seq_id, "seq_id", 0)
        prior = self.engine.idempotent(run.tenant, idem)
        if prior is not None:
            return prior
        run.last_request_time = time.time()
        rec = self.futures.new(run.tenant, kind, request_id=call[1] if call else None, **extra)
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
            admitted=admitted,
        )
        return self._queue(op, idem, call)

    def admit(self, tenant: str) -> None:
        """Refuse a tenant's new device work at its device-time quota (429, engine/usage.py); the ops
        of a request admitted already (a notebook-API intent) or replayed from the journal run."""
        if not self.durability.admitted:
            self.device_time.check(tenant)

    def _queue(self, op: Op, idem: str | None, call: tuple | None) -> FutureRecord:
        """Submit ``op``, journaling its call once it is known to be new (and within its tenant's
        device time: a retry of an accepted request is never refused); a retry gets the original
        future (and the one made for it is dropped). An op that is only an error runs nothing."""

        def accept() -> None:
            if op.error is None and not op.admitted:
                self.admit(op.future.tenant)
            self.durability.accept(call)

        try:
            fut, retry = self.engine.submit(op, idem_key=idem, on_accept=accept)
        except BaseException:
            self.futures.discard(op.future)
            raise
        if retry:
            self.futures.discard(op.future)
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
        call: tuple | None = None,
    ) -> FutureRecord:
        """Queue a seq-ordered op on a run. ``prepare`` validates and returns the work, or (work, a
        :class:`Fusable`) when the op may join a fused call; if it raises a UserError the request still
        takes its seq slot and completes as that error."""
        run = self.run(tenant, model_id)
        self.require_ready()
        fuse = None
        try:
            refused = self.refused_runs.get(run.run_id)
            if refused is not None:
                raise refused
            work, error = prepare(run), None
            if isinstance(work, tuple):
                work, fuse = work
        except UserError as e:
            work, error = None, e
        return self._submit_run(
            run, seq_id, kind, work, idem, error=error, tokens=tokens, fuse=fuse, call=call
        )

    def _state(self, run: RunState) -> TrainState:
        if run.state is None:
            raise UserError(f"model {run.run_id} failed to initialise; create a new one", field="model_id")
        return run.state

    # -- training ops ---------------------------------------------------------------------------
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
        call = self.durability.call(
            "forward_backward",
            tenant=tenant,
            model_id=model_id,
            seq_id=seq_id,
            data=data,
            loss_fn=loss_fn,
            loss_fn_config=loss_fn_config,
            forward_only=forward_only,
            idem=idem,
        )

        def prepare(run: RunState):
            if isinstance(data, UserError):
                raise data
            config = check_loss(loss_fn, loss_fn_config)
            self.checks.validate_datums(data, loss_fn, self.model_of(run).base)
            if config.get("kl_ref_coef") and not all("ref_logprobs" in d.inputs for d in data):
                raise UserError(
                    "loss_fn_config.kl_ref_coef needs loss_fn_inputs.ref_logprobs (the reference policy's "
                    "logprobs of the targets) in every datum",
                    field="loss_fn_config.kl_ref_coef",
                )

            def noted(result: ForwardResult) -> ForwardResult:
                if not forward_only:
                    self.last_loss[run.run_id] = float(result.loss)
                return result

            def work():
                out = self._forward_backward(
                    self._state(run), data, loss_fn, config, forward_only, self.model_of(run).trainer
                )
                crashpoints.hit("forward_backward")
                if isinstance(out, ForwardResult):
                    return noted(out)

                def chunks():
                    return noted((yield from out))

                return chunks()

            return work, self.train_fusable(run, data, loss_fn, config, forward_only, finish=noted)

        return self.run_op(
            tenant,
            model_id,
            seq_id,
            "forward" if forward_only else "forward_backward",
            prepare,
            idem,
            tokens=lambda r: r.tokens,
            call=call,
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
        if not self.settings.fusion or run.spec.full:  # a full run's weights cannot share a pass
            return None
        trainer = self.model_of(run).trainer
        lengths = [len(d.tokens) for d in data]
        if len(trainer._microbatches(lengths)) > 1:
            return None
        return Fusable(
            key=f"train:{run.base_model}",  # fused passes join runs of one base model only
            size=len(data) * max(lengths),
            rows=len(data),
            width=max(lengths),
            limit=trainer.microbatch_tokens,  # the trainer's own cap (fp32 logits ≤ 2 GiB) included
            prepare=lambda: FusedItem(self._state(run), data, loss_fn, config, forward_only),
            finish=finish or (lambda result: result),
        )

    def _forward_backward(
        self,
        state: TrainState,
        data: list[DatumArrays],
        loss_fn: str,
        config: dict,
        forward_only: bool,
        trainer: Trainer | None = None,
    ) -> ForwardResult | Generator[int, None, ForwardResult]:
        """One micro-batch: run it now. Several: a generator the scheduler steps one micro-batch per turn.
        ``trainer``: the run's model's (None: the default model's)."""
        trainer = trainer or self.trainer
        plan = trainer._microbatches([len(d.tokens) for d in data])
        if len(plan) <= 1:
            return trainer.forward_backward(state, data, loss_fn, config, forward_only=forward_only)
        return self._chunked_forward_backward(trainer, state, data, plan, loss_fn, config, forward_only)

    def _chunked_forward_backward(
        self,
        trainer: Trainer,
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
                part = trainer.forward_backward(
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
        call = self.durability.call(
            "optim_step", tenant=tenant, model_id=model_id, seq_id=seq_id, adam=adam, idem=idem
        )

        def prepare(run: RunState):
            if isinstance(adam, UserError):
                raise adam

            def work():
                crashpoints.hit("before_optim_step")
                return {"metrics": self.model_of(run).trainer.optim_step(self._state(run), adam)}

            return work

        return self.run_op(tenant, model_id, seq_id, "optim_step", prepare, idem, call=call)

    # -- checkpoints ----------------------------------------------------------------------------
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
        writer: str | None = None,
    ) -> FutureRecord:
        """save_state. ``writer``: the id recorded in the manifest as the request that wrote it (the
        notebook API passes its request's; Tinker calls use their request_id), so a replay after a
        crash recognises a checkpoint it wrote itself."""
        call = self.durability.call(
            "save_state",
            tenant=tenant,
            model_id=model_id,
            seq_id=seq_id,
            name=name,
            overwrite=overwrite,
            user_metadata=user_metadata,
            idem=idem,
            ttl_seconds=ttl_seconds,
            writer=writer,
        )
        request_id = call[1] if call else writer

        def prepare(run: RunState):
            ref = CheckpointRef(run.run_id, "weights", check_name(name))
            true_or_false(overwrite, "overwrite")
            meta = self.checks.check_metadata(user_metadata)
            expires_at = self.checks.expiry(ttl_seconds)

            def work():
                st = self._state(run)
                if request_id and not overwrite and self._saved_by(run.tenant, ref, request_id):
                    return {"path": ref.path}  # a replay: this very request wrote it before the crash
                st.adapter.ensure_resident()
                tensors, config = st.adapter.checkpoint_payload(self.model_of(run).base, run.base_model)
                self.store.save(
                    run.tenant,
                    ref,
                    adapter=tensors,
                    adapter_config=config,
                    optimizer=Trainer.optimizer_tensors(st),
                    manifest={
                        **self._manifest(run),
                        "user_metadata": meta,
                        "expires_at": expires_at,
                        "request_id": request_id,
                    },
                    overwrite=overwrite,
                )
                return {"path": ref.path}

            return work

        return self.run_op(tenant, model_id, seq_id, "save_weights", prepare, idem, call=call)

    def _saved_by(self, tenant: str, ref: CheckpointRef, request_id: str) -> bool:
        """True when the checkpoint at ``ref`` exists and was written by request ``request_id``."""
        try:
            return self.store.manifest(tenant, ref).get("request_id") == request_id
        except UserError:
            return False

    def load_state(
        self, tenant: str, model_id: str, seq_id: Any, path: Any, optimizer: bool, idem: str | None
    ) -> FutureRecord:
        call = self.durability.call(
            "load_state",
            tenant=tenant,
            model_id=model_id,
            seq_id=seq_id,
            path=path,
            optimizer=optimizer,
            idem=idem,
        )

        def prepare(run: RunState):
            ref = parse_tinker_path(path)
            true_or_false(optimizer, "optimizer")
            manifest = self.store.manifest(run.tenant, ref)
            if manifest.get("base_model") != run.base_model:
                raise UserError(
                    f"path: {ref.path} was trained on {manifest.get('base_model')!r}, "
                    f"this run uses {run.base_model!r}",
                    field="path",
                )
            if manifest["lora"]["rank"] != run.spec.rank:

                def kind(rank: int) -> str:
                    return "is a full fine-tune" if rank == 0 else f"has LoRA rank {rank}"

                raise UserError(
                    f"path: {ref.path} {kind(manifest['lora']['rank'])}, this run {kind(run.spec.rank)}",
                    field="path",
                )
            held = spec_from_manifest(manifest).optimizer
            if optimizer and held != run.spec.optimizer:  # refused before the weights are touched
                raise UserError(
                    f"path: {ref.path} holds {held} optimizer state; this run uses {run.spec.optimizer} "
                    "(load it without the optimizer, or into a run created with the same optimizer)",
                    field="path",
                )
            base = self.model_of(run).base
            self.checks.check_adapter_file(run.tenant, ref, run.spec, base=base)  # same layers, same shapes

            def work():
                st = self._state(run)
                st.adapter.ensure_resident()  # before the checkpoint's tensors are read
                manifest, tensors, opt = self.store.load(run.tenant, ref, with_optimizer=optimizer)
                loaded = weights_from_checkpoint(base, run.spec, tensors, trainable=False, consume=True)
                del tensors
                self.model_of(run).trainer.load_into(st, loaded, opt, int(manifest.get("steps", 0)))
                return {"path": ref.path}

            return work

        return self.run_op(tenant, model_id, seq_id, "load_weights", prepare, idem, call=call)

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
        kind: Any = None,
    ) -> FutureRecord:
        """A sampler of the run's weights now: named (a sampler_weights checkpoint) or a new sampling
        session (``sampling_session_seq_id``): a snapshot (fixed weights), or with ``kind="inflight"``
        the run's one shared set of inflight weights, which each later inflight save updates for every
        inflight client of the run (the SDK's contract: the weights saved at its creation or newer)."""
        call = self.durability.call(
            "save_for_sampler",
            tenant=tenant,
            model_id=model_id,
            seq_id=seq_id,
            name=name,
            sampling_session_seq_id=sampling_session_seq_id,
            user_metadata=user_metadata,
            idem=idem,
            ttl_seconds=ttl_seconds,
            kind=kind,
        )

        def prepare(run: RunState):
            if kind not in (None, "snapshot", "inflight"):
                raise UserError(f"kind must be 'snapshot' or 'inflight'; got {kind!r}", field="kind")
            if kind == "inflight" and name is not None:
                raise UserError(
                    "kind: an inflight save takes no path (it updates the run's inflight weights)",
                    field="kind",
                )
            if name is None:
                if (
                    isinstance(sampling_session_seq_id, bool)
                    or not isinstance(sampling_session_seq_id, int)
                    or sampling_session_seq_id < 0
                ):
                    raise UserError(
                        "save_weights_for_sampler needs a path (name) or a sampling_session_seq_id (an "
                        f"integer >= 0); got {sampling_session_seq_id!r}",
                        field="sampling_session_seq_id",
                    )
                sampler_id = f"{run.session_id}:sample:{sampling_session_seq_id}"

                def ephemeral():
                    snap = self._state(run).adapter.snapshot()
                    inflight = run.run_id if kind == "inflight" else None
                    self.owner.apply(
                        AddSampler(
                            sampler_id,
                            run.tenant,
                            run.session_id,
                            run.base_model,
                            source_run=run.run_id,
                            inflight_of=inflight,
                            weights=snap,
                        )
                    )
                    if inflight is not None:  # every inflight client of the run moves to these weights
                        self.owner.apply(SamplerWeights(inflight_of=inflight, weights=snap))
                    return {"sampling_session_id": sampler_id}

                return ephemeral
            return self._export(run, "sampler_weights", name, user_metadata, ttl_seconds)

        rec = self.run_op(tenant, model_id, seq_id, "save_weights_for_sampler", prepare, idem, call=call)
        run = self.runs.get(model_id) if isinstance(model_id, str) else None
        if name is None and run is not None and run.tenant == tenant and not rec.done:
            for sid in [k for k, r in self.pending_samplers.items() if r.done]:  # those that ran
                del self.pending_samplers[sid]
            self.pending_samplers[f"{run.session_id}:sample:{sampling_session_seq_id}"] = rec
        return rec

    async def sampler_ready(self, tenant: str, sampler_id: str, timeout_s: float = 120.0) -> None:
        """Wait (at most ``timeout_s``) while an accepted save_weights_for_sampler that creates
        ``sampler_id`` has not run yet; then sampler_entry answers, a 404 if that save failed."""
        rec = self.pending_samplers.get(sampler_id)
        if rec is None or rec.tenant != tenant:
            return
        if sampler_id not in self.samplers:
            await self.futures.wait(rec, timeout_s)  # the save's own completion event, no polling
        if rec.done:
            self.pending_samplers.pop(sampler_id, None)

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
        call = self.durability.call(
            "save_external",
            tenant=tenant,
            model_id=model_id,
            seq_id=seq_id,
            name=name,
            ttl_seconds=ttl_seconds,
            recipients=recipients,
            idem=idem,
        )

        def prepare(run: RunState):
            if recipients:
                raise UserError(
                    "age_encryption_recipients: encrypted exports are not supported by this service; "
                    "download over HTTPS from a trusted network instead",
                    field="age_encryption_recipients",
                )
            return self._export(run, "external_weights", name, None, ttl_seconds)

        return self.run_op(tenant, model_id, seq_id, "save_weights_external", prepare, idem, call=call)

    def _export(
        self, run: RunState, kind: str, name: Any, user_metadata: Any, ttl_seconds: Any
    ) -> Callable[[], dict]:
        """Adapter-only checkpoint work (sampler or external weights); validated now, written on the worker."""
        ref = CheckpointRef(run.run_id, kind, check_name(name))
        meta = self.checks.check_metadata(user_metadata)
        expires_at = self.checks.expiry(ttl_seconds)

        def work() -> dict:
            st = self._state(run)
            tensors, config = st.adapter.checkpoint_payload(self.model_of(run).base, run.base_model)
            folder = self.store.save(
                run.tenant,
                ref,
                adapter=tensors,
                adapter_config=config,
                optimizer=None,
                manifest={**self._manifest(run), "user_metadata": meta, "expires_at": expires_at},
                overwrite=True,
            )
            return {"path": ref.path, "size_bytes": sum(p.stat().st_size for p in folder.iterdir())}

        return work

    # -- sampling -------------------------------------------------------------------------------
    def sample_run(
        self, tenant: str, model_id: str, seq_id: Any, jobs: list[SampleJob], idem: str | None
    ) -> FutureRecord:
        """Sample from a training run's current weights, in its lane (a sample sees every train step
        submitted before it): the notebook API's sampling. The jobs decode as one batch; with fusion
        on, other runs' ready sampling joins it. Jobs without a seed get one drawn now (journaled, so
        a replay draws the same tokens)."""
        jobs = [
            j if j.params.seed is not None else dataclasses.replace(j, params=self.seeded(j.params))
            for j in jobs
        ]
        call = self.durability.call(
            "sample_run", tenant=tenant, model_id=model_id, seq_id=seq_id, jobs=jobs, idem=idem
        )

        def prepare(run: RunState):
            def resolved() -> list[SampleJob]:  # on the worker: the adapter as of this seq_id
                adapter = self._state(run).adapter
                return [dataclasses.replace(j, adapter=adapter) for j in jobs]

            sampler = self.model_of(run).sampler

            def work():
                outs = sampler.sample_many(resolved())
                crashpoints.hit("sample")
                self._note_backend(run.run_id, outs)
                return outs

            return work, self.sample_fusable(
                resolved, jobs, lambda outs: self._note_backend(run.run_id, outs), model=run.base_model
            )

        return self.run_op(
            tenant,
            model_id,
            seq_id,
            "sample",
            prepare,
            idem,
            tokens=lambda outs: sum(o.tokens for o in outs),
            call=call,
        )

    @staticmethod
    def seeded(params: SamplingParams) -> SamplingParams:
        """``params`` with a seed: an unseeded request draws one here, once, where it is journaled."""
        if params.seed is not None:
            return params
        return dataclasses.replace(params, seed=random.SystemRandom().randrange(2**62))

    def sample_fusable(
        self, jobs: Callable[[], list[SampleJob]], sizes: list[SampleJob], finish, *, model: str | None = None
    ) -> Fusable | None:
        """How a sampling op joins a fused generate of its base model ``model`` (the fusion key names
        it; None: key "sample"); ``jobs()`` resolves the adapters on the worker.

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
            key="sample" if model is None else f"sample:{model}",
            size=rows * width,
            rows=rows,
            width=width,
            decode=max(j.params.max_tokens or 0 for j in sizes),
            prepare=jobs,
            finish=finish,
        )

    def _fused_sample(self, model: str, parts: list[list[SampleJob]]) -> list[list[SampleOutput]]:
        """Every member's jobs (all on the base model ``model``) in one ``sample_many``, ordered so
        each adapter's rows are one block."""
        jobs = [j for part in parts for j in part]
        first: dict[int, int] = {}
        for j in jobs:
            first.setdefault(id(j.adapter), len(first))
        order = sorted(range(len(jobs)), key=lambda i: first[id(jobs[i].adapter)])
        sampler = self.models[model].sampler
        # a full fine-tune's weights replace the model's own, so its jobs decode as their own batch
        batches: list[list[int]] = []
        for i in order:
            last = batches[-1] if batches else None
            if last is not None and (
                jobs[last[0]].adapter is jobs[i].adapter or not (_full(jobs[last[0]]) or _full(jobs[i]))
            ):
                last.append(i)
            else:
                batches.append([i])
        outs = [out for batch in batches for out in sampler.sample_many([jobs[i] for i in batch])]
        by_job: list[SampleOutput | None] = [None] * len(jobs)
        for out, i in zip(outs, order, strict=True):
            by_job[i] = out
        split, k = [], 0
        for part in parts:
            split.append(by_job[k : k + len(part)])
            k += len(part)
        return split

    def _note_backend(self, key: str, outs: list[SampleOutput]) -> list[SampleOutput]:
        """Remember the latest fallback notice (vLLM handed a job to torch) of a run or sampler: its info."""
        for out in outs:
            if out.notice:
                self.sample_notices.pop(key, None)
                self.sample_notices[key] = out.notice
                while len(self.sample_notices) > 10_000:  # bounded: the oldest notices go first
                    del self.sample_notices[next(iter(self.sample_notices))]
        return outs

    def _sampler_adapter(self, entry: SamplerEntry) -> Adapter | None:
        """On the worker: the entry's adapter, reloaded from its checkpoint if the budget dropped it."""
        adapter = entry.adapter
        if adapter is None and entry.model_path is not None:
            ref = parse_tinker_path(entry.model_path)
            trainer = self.model_of(entry).trainer
            trainer.make_room_for_snapshot(spec_from_manifest(self.store.manifest(entry.tenant, ref)))
            manifest, tensors, _ = self.store.load(entry.tenant, ref)
            adapter = trainer.take_in(
                weights_from_checkpoint(
                    trainer.base, spec_from_manifest(manifest), tensors, trainable=False, consume=True
                )
            )
            del tensors
            self.owner.apply(SamplerWeights(sampler_id=entry.sampler_id, weights=adapter))
        return adapter

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
        record_stability_info: bool = False,
    ) -> FutureRecord:
        prior = self.engine.idempotent(tenant, idem)
        if prior is not None:
            return prior
        entry = self.sampler_entry(tenant, sampler_id)
        model = self.model_of(entry)
        params = self.seeded(
            self.checks.check_sample(
                prompt,
                num_samples,
                params,
                topk_prompt_logprobs,
                topk_sample_logprobs,
                base=model.base,
                prompt_logprobs=bool(prompt_logprobs),
            )
        )
        call = self.durability.call(
            "sample",
            tenant=tenant,
            sampler_id=sampler_id,
            prompt=prompt,
            num_samples=num_samples,
            params=params,
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            idem=idem,
            record_stability_info=record_stability_info,
        )
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
        refused = self.refused_runs.get(entry.source_run) if entry.source_run else None
        rec = self.futures.new(tenant, "sample", request_id=call[1] if call else None)
        ids = rec.extra["sample_sequence_ids"] = [f"{rec.request_id}:{i}" for i in range(num_samples)]

        def noted(out: SampleOutput) -> SampleOutput:
            self._note_backend(sampler_id, [out])
            if record_stability_info:  # for stable_reinforce: by sequence id, in the sampler's session
                self.stability.record(tenant, entry.session_id or "", ids, prompt, out.sequences)
            return out

        def work():
            out = model.sampler.sample(dataclasses.replace(job, adapter=self._sampler_adapter(entry)))
            crashpoints.hit("sample")
            return noted(out)

        op = Op(
            kind="sample",
            lane=f"sampler:{sampler_id}",
            fn=work,
            future=rec,
            run_id=entry.source_run or sampler_id,
            tokens=lambda out: out.tokens,
            refuse_when_full=True,  # 429 + Retry-After: the Tinker SDK backs off and resubmits
            fuse=None
            if refused is not None
            else self.sample_fusable(
                lambda: [dataclasses.replace(job, adapter=self._sampler_adapter(entry))],
                [job],
                lambda outs: noted(outs[0]),
                model=model.name,
            ),
            error=refused,  # the weights' run was stopped from the panel: the sample fails with why
        )
        if refused is not None:
            op.fn = None
        return self._queue(op, idem, call)

    # -- results --------------------------------------------------------------------------------
    @staticmethod
    def result_kind(result: Any) -> str:
        if isinstance(result, ForwardResult):
            return "forward_backward"
        if isinstance(result, SampleOutput):
            return "sample"
        return "json"
