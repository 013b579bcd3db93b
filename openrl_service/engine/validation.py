"""Input checks of the engine's operations: every field is checked on the event loop, before any
work is queued, and a refusal names the field, the limit and its setting (ranges through
:mod:`openrl_service.checks`).

:class:`Checks`, one per :class:`~openrl_service.engine.service.TrainingService` (``svc.checks``),
built from its settings, checkpoint store and ``require_ready``. Checks against a model (context length, vocabulary,
LoRA targets) take the run's or sampler's ``base``; None means the default model.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from safetensors import safe_open

from openrl_service.checks import integer, number
from openrl_service.config import Limits, Settings
from openrl_service.errors import PayloadTooLarge, UserError
from openrl_service.models.loading import BaseModel
from openrl_service.sampling.base import SamplingParams
from openrl_service.sampling.budget import cost_of
from openrl_service.storage.checkpoints import CheckpointRef, CheckpointStore
from openrl_service.training.full import weights_class
from openrl_service.training.lora import LoraSpec
from openrl_service.training.losses import LOSSES
from openrl_service.training.trainer import DatumArrays


class Checks:
    """The checks of one service (they need its settings, limits, checkpoint store and, for those
    against a model, its default model): ``svc.checks``."""

    def __init__(
        self,
        settings: Settings,
        store: CheckpointStore,
        require_ready: Callable[[], BaseModel],
    ):
        self.settings = settings
        self.limits: Limits = settings.limits
        self.store = store
        self.require_ready = require_ready

    def expiry(self, ttl_seconds: Any, field_name: str = "ttl_seconds") -> float | None:
        """ttl_seconds (None: never) as an absolute expiry time; bounds as Tinker's: 1 hour to 10 years."""
        if ttl_seconds is None:
            return None
        lo = self.settings.min_ttl_s
        lo = int(lo) if float(lo).is_integer() else lo
        return time.time() + integer(
            ttl_seconds, field_name, lo, 10 * 365 * 24 * 3600, setting="OPENRL_MIN_TTL_S"
        )

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

    def lora_spec(
        self,
        rank: Any,
        train_attn: Any = True,
        train_mlp: Any = True,
        train_unembed: Any = True,
        *,
        where: str = "lora_config.",
        optimizer: str = "adamw",
    ) -> LoraSpec:
        """The LoRA layout asked for; each field named ``<where><name>`` when refused (the Tinker API
        nests them in lora_config, the notebook API does not)."""
        # rank 0: a full fine-tune (the run trains its own copy of the weights), as other
        # Tinker-compatible services read it
        rank = integer(rank, f"{where}rank", 0, self.limits.max_rank, setting="OPENRL_MAX_RANK")
        flags = {"train_attn": train_attn, "train_mlp": train_mlp, "train_unembed": train_unembed}
        for name, value in flags.items():
            if not isinstance(value, bool):  # truthiness would read "no" or [] as a choice
                raise UserError(
                    f"{where}{name} must be true or false; got {type(value).__name__} {repr(value)[:100]}",
                    field=f"{where}{name}",
                )
        spec = LoraSpec(rank=rank, optimizer=optimizer, **flags)
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise UserError(
                f"{where.rstrip('.') or 'the run'}: enable at least one of train_attn, train_mlp, train_unembed",
                field=where.rstrip(".") or "train_attn",
            )
        return spec

    def validate_datums(self, data: list[DatumArrays], loss_fn: str, base: BaseModel | None = None) -> None:
        base = base or self.require_ready()
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

    def sampling_params(self, raw: dict, base: BaseModel | None = None) -> SamplingParams:
        """Validate Tinker SamplingParams JSON; errors name the field and the limit."""
        base = base or self.require_ready()
        lim = self.limits
        raw = raw or {}
        max_tokens = raw.get("max_tokens")  # None: as many as fit (resolved against the prompt in sample)
        if max_tokens is not None:
            integer(max_tokens, "sampling_params.max_tokens", 1, lim.max_tokens, setting="OPENRL_MAX_TOKENS")
        temperature = raw.get("temperature", 1.0)
        temperature = number(1.0 if temperature is None else temperature, "sampling_params.temperature", 0)
        top_p = raw.get("top_p", 1.0)
        top_p = number(1.0 if top_p is None else top_p, "sampling_params.top_p", 0, 1, lo_open=True)
        top_k = raw.get("top_k", -1)
        top_k = -1 if top_k is None else top_k
        if top_k != -1 or not isinstance(top_k, int):
            integer(top_k, "sampling_params.top_k", 1, setting="or -1 for off")
        seed = raw.get("seed")
        if seed is not None:
            integer(seed, "sampling_params.seed")
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
                # the end of sequence still stops too (as in vLLM and the OpenAI API); token ids replace it
                stop_ids = tuple(base.eos_token_ids) if items else ()
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
        *,
        base: BaseModel | None = None,
        prompt_logprobs: bool = False,
    ) -> SamplingParams:
        """Validate one sample request against the limits and the model; returns the params with
        ``max_tokens`` resolved (when omitted: as many as fit the context, up to OPENRL_MAX_TOKENS)."""
        base = base or self.require_ready()
        lim = self.limits
        integer(num_samples, "num_samples", 1, lim.max_num_samples, setting="OPENRL_MAX_NUM_SAMPLES")
        for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample)):
            integer(k, name, 0, lim.max_topk, setting="OPENRL_MAX_TOPK")
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
        self.check_sample_fits(base, len(prompt), params.max_tokens, bool(prompt_logprobs or topk_prompt))
        return params

    @staticmethod
    def check_sample_fits(
        base: BaseModel, prompt_tokens: int, max_tokens: int, prompt_logprobs: bool
    ) -> None:
        """Refuse (413, with the numbers) a sample that alone would take more memory than a sampling batch
        may (OPENRL_SAMPLE_BATCH_BYTES): a call is split into batches, but one sample cannot be."""
        limit = base.sample_batch_bytes
        if not limit or not base.sampled_by_torch:
            return
        need = cost_of(base).bytes(
            prompts=1,
            width=prompt_tokens,
            rows=1,
            decode=max_tokens,
            logprob_tokens=prompt_tokens if prompt_logprobs else 0,
            padded=False,
        )
        if need > limit:
            raise PayloadTooLarge(
                f"prompt: one sample of a {prompt_tokens}-token prompt with max_tokens {max_tokens}"
                f"{' and prompt logprobs' if prompt_logprobs else ''} needs about {_mib(need)} MiB to sample on "
                f"{base.name}, more than the {_mib(limit)} MiB one sampling batch may take "
                "(OPENRL_SAMPLE_BATCH_BYTES): send a shorter prompt or a smaller max_tokens",
                field="prompt",
            )

    def check_adapter_file(
        self,
        tenant: str,
        ref: CheckpointRef,
        spec: LoraSpec,
        field_name: str = "path",
        *,
        base: BaseModel | None = None,
    ) -> None:
        """Refuse, before the worker sees it, a checkpoint whose adapter tensors are not ``spec``'s on
        the served model (a foreign PEFT folder, another rank, other layers): a 400 naming the tensor
        and the expected vs found shape. Reads only the safetensors header."""
        base = base or self.require_ready()
        kind = weights_class(spec)
        name = kind.CHECKPOINT_FILE
        file = self.store.folder(tenant, ref) / name
        try:
            with safe_open(str(file), "pt") as f:
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except Exception as e:  # noqa: BLE001 - any unreadable file is the caller's bad input
            raise UserError(
                f"{field_name}: {ref.path} has no readable {name} ({type(e).__name__})",
                field=field_name,
            ) from None
        kind.check_file(base, spec, shapes, field=field_name, model=base.name)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"
