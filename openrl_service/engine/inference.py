"""Sampling by model name, for the OpenAI-compatible API (api/openai.py): a base model or any
checkpoint the caller may read, with no session or sampler to create first.

    Inference.resolve(tenant, "openrl/tiny")                          the base model
    Inference.resolve(tenant, "tinker://<run>/sampler_weights/<n>")   a checkpoint (any kind) on its base
    Inference.resolve(tenant, "<base>;tinker://…")                    the same, naming the base (hosted
                                                                      Tinker's form; the base must match)
    Inference.submit(tenant, target, jobs)                            one Op on the device worker

The work is the Tinker path's: the same sampler (torch or vLLM), an Op in the same engine, fused with
other runs' sampling and interleaved with training like any sample request. What is not the same: the
request is not journaled (an OpenAI client holds its connection open for the answer, so a restart
fails it and the client retries), and the checkpoint's adapter is loaded on the worker into a small
per-tenant cache (OPENRL_MAX_SAMPLER_SNAPSHOTS_PER_TENANT entries per tenant, OPENRL_MAX_SAMPLER_SNAPSHOTS
in all), keyed by the adapter file's digest so an overwritten checkpoint is never served stale.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from openrl_service.engine.futures import FutureRecord
from openrl_service.engine.ops import Op
from openrl_service.engine.state import ServedModel, spec_from_manifest
from openrl_service.errors import NotFound, UserError
from openrl_service.sampling.base import SampleJob, SampleOutput
from openrl_service.storage.checkpoints import CheckpointRef, parse_tinker_path, weight_files
from openrl_service.training.full import weights_from_checkpoint
from openrl_service.training.lora import Adapter

PEFT_SUFFIX = ":peft:"  # hosted Tinker names a base model with its context length: "<name>:peft:<ctx>"


def adapter_digest(manifest: dict) -> str:
    """The SHA-256 of a checkpoint's weights file (a LoRA's adapter, a full fine-tune's model), as its
    manifest records it."""
    return (manifest.get("files") or {}).get(weight_files(manifest)[0], "")


@dataclass(frozen=True)
class Target:
    """What a ``model`` string names: the served base model, the checkpoint on it (None: the bare
    base), the context length requests are held to, and the id replies echo."""

    model: ServedModel
    ref: CheckpointRef | None
    context_length: int
    id: str
    digest: str | None = None  # the checkpoint's adapter file digest (its cache key)


class Inference:
    def __init__(self, svc: Any):  # the TrainingService (typed loosely: it imports this module)
        self.svc = svc
        self._adapters: OrderedDict[tuple[str, str, str], Adapter] = OrderedDict()
        self._lock = threading.Lock()
        svc.tenant_forgetters.append(self.forget_tenant)

    # -- naming ---------------------------------------------------------------------------------
    def _base(self, name: str, field: str) -> tuple[ServedModel, int]:
        """A served base model by name, optionally with hosted Tinker's ``:peft:<context length>``."""
        base_name, ctx = name, None
        if PEFT_SUFFIX in name:
            base_name, _, raw = name.rpartition(PEFT_SUFFIX)
            if not raw.isdigit() or int(raw) < 1:
                raise UserError(
                    f"{field}: {name[:200]!r} ends in ':peft:' but not with a context length in tokens",
                    field=field,
                )
            ctx = int(raw)
        model = self.svc.models.get(base_name)
        if model is None:
            served = ", ".join(repr(n) for n in self.svc.models)
            raise NotFound(
                f"{field}: model {name[:200]!r} is not served here; this service serves {served} and the "
                "checkpoints you saved (tinker://… paths; GET /v1/models lists them)",
                field=field,
            )
        limit = model.base.context_length
        if ctx is not None and ctx > limit:
            raise UserError(
                f"{field}: context length {ctx} exceeds {model.name}'s {limit} tokens", field=field
            )
        return model, ctx or limit

    def resolve(self, tenant: str, name: object, field: str = "model") -> Target:
        """The target ``name`` names for ``tenant``: 400 for a malformed name, 404 for a model not
        served or a checkpoint the tenant does not hold (another tenant's included: it is not told
        apart from one that does not exist)."""
        self.svc.require_ready()
        if not isinstance(name, str) or not name:
            raise UserError(
                f"{field} must be a non-empty string (a base model or a tinker:// path)", field=field
            )
        if len(name) > 1024:
            raise UserError(f"{field}: at most 1024 characters; got {len(name)}", field=field)
        base_part, sep, path = name.partition(";")
        if not sep:
            base_part, path = ("", name) if name.startswith("tinker://") else (name, "")
        if not path:
            model, ctx = self._base(base_part, field)
            return Target(model, None, ctx, name)
        ref, manifest, model = self.checkpoint(tenant, path, field)
        ctx = model.base.context_length
        if base_part:
            named, ctx = self._base(base_part, field)
            if named is not model:
                raise UserError(
                    f"{field}: {ref.path} was trained on {model.name!r}, not {named.name!r}", field=field
                )
        return Target(model, ref, ctx, name, adapter_digest(manifest))

    def checkpoint(self, tenant: str, path: object, field: str) -> tuple[CheckpointRef, dict, ServedModel]:
        """(ref, manifest, served model) of a checkpoint ``tenant`` holds whose adapter fits a model served
        now: 400 for a malformed path or a foreign adapter file, 404 for a checkpoint the tenant does not
        hold (another tenant's is as absent as a missing one) or a base no longer served. The OpenAI API
        and exports (engine/export.py) both ask here."""
        ref = parse_tinker_path(path, field=field)
        try:
            manifest = self.svc.store.manifest(tenant, ref)
        except NotFound as e:
            raise NotFound(f"{field}: {e.message}", field=field) from None
        model = self.svc.models.get(manifest.get("base_model"))
        if model is None:
            raise NotFound(
                f"{field}: {ref.path} was trained on {manifest.get('base_model')!r}, which this service "
                "does not serve now",
                field=field,
            )
        self.svc.checks.check_adapter_file(tenant, ref, spec_from_manifest(manifest), field, base=model.base)
        return ref, manifest, model

    # -- adapters -------------------------------------------------------------------------------
    def cached(self, tenant: str, target: Target) -> bool:
        """The target's checkpoint is in the adapter cache (its files need no reading)."""
        with self._lock:
            return target.ref is not None and _key(tenant, target) in self._adapters

    def adapter(self, tenant: str, target: Target) -> Adapter | None:
        """On the worker: the checkpoint's adapter (cached), or None for the bare base model."""
        if target.ref is None:
            return None
        key = _key(tenant, target)
        with self._lock:
            hit = self._adapters.get(key)
            if hit is not None:
                self._adapters.move_to_end(key)
                return hit
        trainer = target.model.trainer
        trainer.make_room_for_snapshot(spec_from_manifest(self.svc.store.manifest(tenant, target.ref)))
        manifest, tensors, _ = self.svc.store.load(tenant, target.ref)
        spec = spec_from_manifest(manifest)
        adapter = trainer.take_in(
            weights_from_checkpoint(target.model.base, spec, tensors, trainable=False, consume=True)
        )
        del tensors
        # keyed by what was loaded: a checkpoint overwritten since resolve() is cached as its new self
        key = (tenant, target.ref.path, adapter_digest(manifest))
        with self._lock:
            for old in [k for k in self._adapters if k[:2] == key[:2]]:
                del self._adapters[old]  # an overwritten checkpoint: its old tensors go
            self._adapters[key] = adapter
            self._evict(tenant)
        return adapter

    def _evict(self, tenant: str) -> None:
        s = self.svc.settings
        mine = [k for k in self._adapters if k[0] == tenant]
        while len(mine) > max(1, s.max_sampler_snapshots_per_tenant):
            del self._adapters[mine.pop(0)]
        while len(self._adapters) > max(1, s.max_sampler_snapshots):
            self._adapters.popitem(last=False)
        # by bytes too: a full fine-tune's cached weights are a copy of the model
        while (
            len(self._adapters) > 1
            and sum(a.nbytes() for a in self._adapters.values()) > self.svc.snapshot_bytes_cap
        ):
            self._adapters.popitem(last=False)

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            for k in [k for k in self._adapters if k[0] == tenant]:
                del self._adapters[k]

    # -- work -----------------------------------------------------------------------------------
    def check(
        self, target: Target, prompt: list[int], num: int, job: SampleJob, prompt_field: str = "prompt"
    ) -> SampleJob:
        """One job validated as the Tinker path validates a sample (limits, vocabulary, context), held
        to the target's context length; ``max_tokens`` None becomes as many as fit."""
        base = target.model.base
        params = job.params
        if params.max_tokens is None:
            room = target.context_length - len(prompt)
            if room < 1:
                raise UserError(
                    f"the prompt ({len(prompt)} tokens) leaves no room in the context length "
                    f"{target.context_length}",
                    field=prompt_field,
                )
            params = dataclasses.replace(params, max_tokens=min(self.svc.limits.max_tokens, room))
        if len(prompt) + params.max_tokens > target.context_length:
            raise UserError(
                f"max_tokens: the prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the context length {target.context_length}",
                field="max_tokens",
            )
        params = self.svc.checks.check_sample(
            prompt,
            num,
            params,
            job.topk_prompt_logprobs,
            job.topk_sample_logprobs,
            base=base,
            prompt_logprobs=job.prompt_logprobs,
        )
        return dataclasses.replace(job, prompt=prompt, num_samples=num, params=self.svc.seeded(params))

    def check_size(self, jobs: list[SampleJob], field: str = "prompt") -> None:
        """One call's work held to OPENRL_MAX_REQUEST_TOKENS: Σ samples × (prompt + max_tokens)."""
        total = sum(j.num_samples * (len(j.prompt) + (j.params.max_tokens or 0)) for j in jobs)
        limit = self.svc.limits.max_request_tokens
        if total > limit:
            raise UserError(
                f"{field}: this call would decode up to {total} tokens (prompts x n x (prompt + max_tokens)); "
                f"at most {limit} per call (OPENRL_MAX_REQUEST_TOKENS): send fewer prompts, a smaller n "
                "or max_tokens",
                field=field,
            )

    def submit(self, tenant: str, target: Target, jobs: list[SampleJob]) -> FutureRecord:
        """Queue ``jobs`` (one per prompt) as one sampling op of the tenant on the target's sampler;
        the future's result is a list of SampleOutput, one per job. A full queue is a 429 (QueueFull)."""
        svc = self.svc
        model = target.model
        lane = f"oai:{tenant}:{target.ref.path if target.ref else model.name}"

        def resolved() -> list[SampleJob]:
            adapter = self.adapter(tenant, target)
            return [dataclasses.replace(j, adapter=adapter) for j in jobs]

        def work() -> list[SampleOutput]:
            outs = model.sampler.sample_many(resolved())
            svc._note_backend(lane, outs)
            return outs

        self.check_size(jobs)
        rec = svc.futures.new(tenant, "json")
        op = Op(
            kind="sample",
            lane=lane,
            fn=work,
            future=rec,
            run_id=target.ref.run_id if target.ref else lane,
            tokens=lambda outs: sum(o.tokens for o in outs),
            refuse_when_full=True,
            fuse=svc.sample_fusable(
                resolved, jobs, lambda outs: svc._note_backend(lane, outs), model=model.name
            ),
        )
        return svc._queue(op, None, None)


def _key(tenant: str, target: Target) -> tuple[str, str, str]:
    """A checkpoint target's place in the adapter cache, as resolved (its digest then)."""
    return (tenant, target.ref.path, target.digest or "")
