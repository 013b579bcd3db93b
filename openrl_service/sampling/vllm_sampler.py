"""Sampling with vLLM: each adapter snapshot is one LoRA id, every job of a call in one vLLM batch.

The engine (``vllm.LLMEngine``) runs inside the service process, on the device worker thread that
calls :meth:`VLLMSampler.sample_many` (vLLM's in-process engine core and its uni-process executor:
no child process that could outlive the service). Prompts go to vLLM as token ids. Each adapter
version (an immutable snapshot, or a run's live adapter as of its latest optimizer step; see
``Adapter.version``) is written once as a PEFT folder under ``<data_dir>/vllm-adapters/`` and
registered as one LoRA id; it is reused while resident and dropped least-recently-used (or as soon
as a newer version of the same adapter appears, or the adapter object is gone): its LoRA id is
removed from vLLM and its folder deleted.

Tinker semantics follow the torch sampler exactly: per-request seed, ``n`` samples, temperature 0 =
greedy, top-k (-1 off) and top-p, stop token ids and stop strings with the stopping token kept last,
the model's EOS ignored unless it is a stop token, ``stop_reason`` "stop"/"length", sampled-token
logprobs of the raw model (``logprobs_mode="raw_logprobs"``), prompt logprobs with NaN at position 0
and top-k arrays of the same shapes. What this vLLM cannot do for a job (found at startup: LoRA on
``lm_head`` for this architecture, prompts longer than ``max_model_len``...) is sampled by the torch
sampler instead, and the output says so (``backend``, ``notice``): never a crash, never silently
different tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import random
import shutil
import typing
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from openrl_service.models.loading import BaseModel
from openrl_service.sampling.base import SampledSequence, SampleJob, SampleOutput
from openrl_service.sampling.torch_sampler import TOPK_EMPTY_LOGPROB, TorchSampler
from openrl_service.training.lora import Adapter, peft_adapter_config

log = logging.getLogger(__name__)

# vLLM 0.32's LoRAConfig.max_lora_rank choices (read from the installed vLLM when it has them).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
GIB = 1 << 30
GREEDY_BELOW = 1e-5  # vllm.sampling_params._SAMPLING_EPS


def vllm_lora_ranks() -> tuple[int, ...]:
    try:
        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(sorted(int(r) for r in typing.get_args(MaxLoRARanks)))
        return ranks or VLLM_LORA_RANKS
    except Exception:  # noqa: BLE001 - an older/newer layout: the 0.32 list
        return VLLM_LORA_RANKS


def vllm_max_lora_rank(max_rank: int, allowed: tuple[int, ...] = VLLM_LORA_RANKS) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds every rank the service allows."""
    fits = [r for r in allowed if r >= max_rank]
    if not fits:
        raise ValueError(
            f"OPENRL_MAX_RANK={max_rank} is above the largest LoRA rank this vLLM serves "
            f"({max(allowed)}; allowed max_lora_rank values {list(allowed)}): lower OPENRL_MAX_RANK "
            "or use --sampler torch"
        )
    return fits[0]


def check_gpu_budget(*, total_bytes: int, free_bytes: int, utilization: float, trainer_bytes: int) -> None:
    """Refuse (ValueError with the numbers) a GPU plan where vLLM's share and the trainer do not fit.

    vLLM takes ``utilization`` x total device memory (weights, activations, KV cache); the trainer
    keeps what it has loaded (counted in ``free_bytes`` already) and needs ``trainer_bytes`` more of
    headroom (activations, gradients, optimizer, adapter snapshots) that vLLM must leave free."""
    if not 0 < utilization < 1:
        raise ValueError(f"--vllm-gpu-memory-utilization must be between 0 and 1; got {utilization}")
    want = utilization * total_bytes
    if want + trainer_bytes > free_bytes:
        raise ValueError(
            f"GPU memory over-committed: vLLM would take {utilization:g} x {total_bytes / GIB:.1f} GiB = "
            f"{want / GIB:.1f} GiB and the trainer needs {trainer_bytes / GIB:.1f} GiB more, but only "
            f"{free_bytes / GIB:.1f} GiB are free after loading the model; lower "
            f"--vllm-gpu-memory-utilization to at most {max(0.0, (free_bytes - trainer_bytes) / total_bytes):.2f}"
        )


def trainer_reserve_bytes(base: BaseModel, adapter_bytes: int) -> int:
    """Headroom the trainer needs beside vLLM: activations and gradients (about the weights again, a
    rough bound for LoRA training at the micro-batch size) plus the adapter snapshots budget."""
    weights = sum(p.numel() * p.element_size() for p in base.model.parameters())
    return weights + adapter_bytes


def model_folder(base: BaseModel) -> Path:
    """The Hugging Face folder vLLM loads: the one the service loaded the base model from."""
    if base.folder is not None and (Path(base.folder) / "config.json").is_file():
        return Path(base.folder)
    raise ValueError(
        f"vLLM serves Hugging Face model folders; {base.source!r} is not one (a GGUF file? convert it to a "
        "folder, or use --sampler torch)"
    )


@dataclass
class Capabilities:
    """What the installed vLLM does for this model, found at startup."""

    version: str
    arch: str
    lora_lm_head: bool  # the architecture's LoRA covers lm_head (embedding_modules)
    raw_logprobs: bool  # EngineArgs has logprobs_mode (sampled logprobs before temperature/top-k/p)
    prompt_logprobs: bool  # prompt logprobs work with LoRA enabled (not with an lm_head LoRA layer)
    max_model_len: int
    max_logprobs: int

    def describe(self) -> dict:
        return dict(self.__dict__)


def detect_capabilities(arch: str, max_model_len: int, max_logprobs: int) -> Capabilities:
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry

    lm_head = False
    try:
        cls = ModelRegistry._try_load_model_cls(arch)
        lm_head = cls is not None and "lm_head" in (getattr(cls, "embedding_modules", None) or {})
    except Exception:  # noqa: BLE001 - unknown: treat as unsupported (torch samples those adapters)
        lm_head = False
    fields = getattr(EngineArgs, "__dataclass_fields__", {})
    return Capabilities(
        version=getattr(vllm, "__version__", "?"),
        arch=arch,
        lora_lm_head=lm_head,
        raw_logprobs="logprobs_mode" in fields,
        prompt_logprobs=not lm_head,
        max_model_len=max_model_len,
        max_logprobs=max_logprobs,
    )


class _StatsLogger:
    """A vLLM stat logger keeping the peaks of vLLM's own scheduler statistics: the most requests and
    the most distinct LoRA adapters running in one engine step (multi-LoRA batching, as vLLM saw it)."""

    peaks = {"running_reqs": 0, "running_loras": 0, "steps": 0}

    def __init__(self, vllm_config, engine_index: int = 0):
        pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is None:
            return
        p = type(self).peaks
        p["steps"] += 1
        p["running_reqs"] = max(p["running_reqs"], int(scheduler_stats.num_running_reqs))
        loras = [k for k, n in (scheduler_stats.running_lora_adapters or {}).items() if n]
        p["running_loras"] = max(p["running_loras"], len(loras))

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


@dataclass
class _Lora:
    int_id: int
    name: str
    folder: Path
    uid: int


class VLLMSampler:
    """The Sampler protocol on vLLM; jobs it cannot serve exactly go to ``fallback`` (torch)."""

    backend = "vllm"

    def __init__(
        self,
        base: BaseModel,
        *,
        data_dir: Path,
        max_rank: int,
        max_topk: int,
        max_loras: int = 4,
        max_cpu_loras: int = 16,
        max_model_len: int | None = None,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        trainer_bytes: int = 0,
        fallback: TorchSampler | None = None,
        parallel: dict | None = None,
        worker_env: dict | None = None,
    ):
        """``parallel``: EngineArgs of its tensor parallelism, ``worker_env`` its worker processes'
        environment (sampling/parallel.py)."""
        # before vLLM is first imported: its engine core in this process (it dies with us), quiet logs
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.base = base
        self.fallback = fallback or TorchSampler(base)
        self.folder = model_folder(base)
        # one folder per served model: several models' samplers never delete each other's adapters
        self.adapter_dir = Path(data_dir) / "vllm-adapters" / base.name.replace("/", "-")
        shutil.rmtree(self.adapter_dir, ignore_errors=True)  # folders of a previous process
        self.adapter_dir.mkdir(parents=True, exist_ok=True)
        self.max_lora_rank = vllm_max_lora_rank(max_rank, vllm_lora_ranks())
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        max_len = min(int(max_model_len or base.context_length), base.context_length)
        self.caps = detect_capabilities(base.arch, max_len, max(1, max_topk))
        if not self.caps.raw_logprobs:
            raise ValueError(
                f"vLLM {self.caps.version} has no logprobs_mode: its sampled-token logprobs would not be "
                "the raw model's; install vllm==0.32.0 or use --sampler torch"
            )
        if not self.caps.lora_lm_head and base.defaults.get("train_unembed"):
            # the capability entry's defaults then train what vLLM serves (an lm_head adapter still
            # works: the torch sampler samples it, with a notice)
            base.defaults["train_unembed"] = False
        dtype = str(base.dtype).removeprefix("torch.")
        on_gpu = base.device.type == "cuda"
        if not on_gpu and self.max_lora_rank > 16:
            # vLLM computes every LoRA at max_lora_rank; on CPU its LoRA ops dominate a step
            # (SmolLM2-135M at 128: no sample back in 8 min on 2 cores; at 8: ~3 min under load)
            log.warning(
                "vLLM on CPU computes every LoRA at rank %d (OPENRL_MAX_RANK=%d): set OPENRL_MAX_RANK "
                "to the largest rank you train (e.g. 8) or sampling will be slow",
                self.max_lora_rank,
                max_rank,
            )
        args = dict(
            model=str(self.folder),
            tokenizer=str(self.folder),
            dtype=dtype,
            seed=0,
            enable_lora=True,
            max_lora_rank=self.max_lora_rank,
            max_loras=max_loras,
            max_cpu_loras=self.max_cpu_loras,
            max_model_len=max_len,
            max_logprobs=self.caps.max_logprobs,
            logprobs_mode="raw_logprobs",
            distributed_executor_backend="uni",
            disable_log_stats=False,
            enforce_eager=not on_gpu,
        )
        if on_gpu:
            free, total = torch.cuda.mem_get_info(base.device)
            check_gpu_budget(
                total_bytes=total,
                free_bytes=free,
                utilization=gpu_memory_utilization,
                trainer_bytes=trainer_bytes,
            )
            args["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            args["kv_cache_memory_bytes"] = int(kv_cache_gb * GIB)
            # No chunked prefill on CPU: vLLM 0.32 rewinds a seeded request's generator after a partial
            # prefill (gen.set_offset), which a CPU generator refuses - the engine step dies. Every
            # request here is seeded, so a batch whose prompts exceed one step's token budget would crash;
            # whole prompts per step (the budget at least one full-length request) avoid it.
            args["enable_chunked_prefill"] = False
            args["max_num_batched_tokens"] = max(max_len, 8192)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gb))))
        args.update(parallel or {})
        self.engine = _start_engine(args, worker_env or {})
        self.tokenizer = self.engine.get_tokenizer()
        self._loras: OrderedDict[tuple[int, int], _Lora] = OrderedDict()  # (uid, version) -> LoRA, LRU
        self._uids = itertools.count(1)
        self._int_ids = itertools.count(1)
        self._requests = itertools.count(1)
        self._dead: list[int] = []  # uids of adapters garbage-collected since the last call
        self.lora_loads = 0
        log.info(
            "vLLM %s sampler on %s: max_lora_rank %d, max_loras %d, max_cpu_loras %d, max_model_len %d, "
            "LoRA on lm_head: %s",
            self.caps.version,
            base.arch,
            self.max_lora_rank,
            max_loras,
            self.max_cpu_loras,
            max_len,
            self.caps.lora_lm_head,
        )

    # -- the Sampler protocol ---------------------------------------------------------------------
    def sample(self, job: SampleJob) -> SampleOutput:
        return self.sample_many([job])[0]

    def sample_many(self, jobs: list[SampleJob]) -> list[SampleOutput]:
        """All jobs vLLM can serve go to its scheduler together (one batch, any mix of adapters); the
        rest are sampled by torch, each output saying which backend ran it and why."""
        self._collect()
        outs: list[SampleOutput | None] = [None] * len(jobs)
        torch_jobs: list[tuple[int, str]] = []
        pending: dict[str, int] = {}
        for i, job in enumerate(jobs):
            why = self.unsupported(job)
            lora = None
            if why is None and job.adapter is not None:
                try:
                    lora = self._lora(job.adapter)
                except Exception as e:  # noqa: BLE001 - vLLM refused the adapter: torch samples it
                    why = f"vLLM could not load this adapter ({type(e).__name__}: {str(e)[:160]})"
            if why is not None:
                torch_jobs.append((i, why))
                continue
            rid = f"r{next(self._requests)}"
            try:
                self.engine.add_request(
                    rid, {"prompt_token_ids": list(job.prompt)}, self._params(job), lora_request=lora
                )
            except Exception as e:  # noqa: BLE001 - vLLM refused the parameters: torch samples the job
                torch_jobs.append((i, f"vLLM refused the request ({type(e).__name__}: {str(e)[:160]})"))
                continue
            pending[rid] = i
        try:
            while pending and self.engine.has_unfinished_requests():
                for ro in self.engine.step():
                    if ro.finished and ro.request_id in pending:
                        i = pending.pop(ro.request_id)
                        outs[i] = self._output(jobs[i], ro)
        except BaseException:
            for rid in pending:
                self.engine.abort_request([rid])
            raise
        if pending:
            raise RuntimeError(f"vLLM finished without results for {len(pending)} request(s)")
        # least recently used first; only now, so that no folder this call's requests read goes away
        while len(self._loras) > self.max_cpu_loras:
            self._drop(next(iter(self._loras)))
        if torch_jobs:
            done = self.fallback.sample_many([jobs[i] for i, _ in torch_jobs])
            for (i, why), out in zip(torch_jobs, done, strict=True):
                out.backend = "torch"
                out.notice = f"sampled with the torch sampler: {why}"
                outs[i] = out
        return outs  # type: ignore[return-value]

    def unsupported(self, job: SampleJob) -> str | None:
        """Why vLLM cannot sample ``job`` exactly as the torch sampler would, or None."""
        caps = self.caps
        a = job.adapter
        if a is not None and not a.vllm_serves:
            # vLLM holds one set of base weights and serves LoRA adapters on it: a full fine-tune's
            # own weights are sampled by torch (loading them into vLLM would replace the base for
            # every other run); the notice says so
            return "a full fine-tune's weights are sampled with torch (vLLM here serves LoRA adapters)"
        if a is not None:
            lm_head = any(t.group == "unembed" and t.name in a.weights for t in self.base.targets)
            if lm_head and not caps.lora_lm_head:
                return (
                    f"vLLM {caps.version} serves no LoRA on lm_head for {caps.arch} "
                    "(this adapter trains the unembedding)"
                )
            if a.spec.rank > self.max_lora_rank:
                return f"LoRA rank {a.spec.rank} is above vLLM's max_lora_rank {self.max_lora_rank}"
        if (job.prompt_logprobs or job.topk_prompt_logprobs) and not caps.prompt_logprobs:
            # vLLM 0.32 applies its lm_head LoRA layer to prompt positions with one index per request
            # (punica add_lora_logits): with several requests in a step the shapes disagree and the
            # engine step fails, for every request whether its adapter has lm_head weights or none
            return (
                f"vLLM {caps.version} computes no prompt logprobs with LoRA enabled on lm_head ({caps.arch})"
            )
        p = job.params
        if any("\ufffd" in s for s in p.stop_strings):
            # vLLM's detokenizer holds back an incomplete UTF-8 sequence; torch decodes it as U+FFFD
            return "a stop string with U+FFFD (an incomplete UTF-8 sequence)"
        if not p.max_tokens:
            return "max_tokens is 0 (vLLM generates at least one token)"
        if len(job.prompt) + p.max_tokens > caps.max_model_len:
            return (
                f"prompt ({len(job.prompt)}) + max_tokens ({p.max_tokens}) exceed vLLM's max_model_len "
                f"{caps.max_model_len} (--vllm-max-model-len)"
            )
        if max(job.topk_prompt_logprobs, job.topk_sample_logprobs) > caps.max_logprobs:
            return f"top-k logprobs above vLLM's max_logprobs {caps.max_logprobs}"
        return None

    # -- requests and results ------------------------------------------------------------------------
    def _params(self, job: SampleJob):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = job.params
        # vLLM samples greedily below 1e-5 (and then refuses n > 1); torch's limit is the same argmax
        greedy = p.temperature < GREEDY_BELOW
        want_prompt = job.prompt_logprobs or job.topk_prompt_logprobs
        return SamplingParams(
            n=1 if greedy else job.num_samples,  # vLLM refuses n > 1 when greedy; rows are copies
            temperature=0.0 if greedy else float(p.temperature),
            top_p=float(p.top_p),
            top_k=int(p.top_k) if p.top_k and p.top_k > 0 else 0,
            seed=p.seed,
            max_tokens=int(p.max_tokens),
            stop=list(p.stop_strings) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            ignore_eos=True,  # as the torch sampler: only the request's stop tokens end a sample
            include_stop_str_in_output=True,
            logprobs=int(job.topk_sample_logprobs),
            prompt_logprobs=int(job.topk_prompt_logprobs) if want_prompt else None,
            detokenize=bool(p.stop_strings),
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _output(self, job: SampleJob, ro) -> SampleOutput:
        out = SampleOutput(sequences=[], backend="vllm")
        k = job.topk_sample_logprobs
        for c in sorted(ro.outputs, key=lambda c: c.index):
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a sample with finish_reason {c.finish_reason!r}")
            toks = list(c.token_ids)
            steps = c.logprobs or []
            seq = SampledSequence(
                tokens=toks,
                logprobs=[float(steps[i][t].logprob) for i, t in enumerate(toks)],
                stop_reason="stop" if c.finish_reason == "stop" else "length",
            )
            if k:
                seq.topk_ids, seq.topk_logprobs = _topk_arrays(steps[: len(toks)], k)
            out.sequences.append(seq)
        while 0 < len(out.sequences) < job.num_samples:  # greedy: every row is the same sequence
            first = out.sequences[0]
            out.sequences.append(
                dataclasses.replace(first, tokens=list(first.tokens), logprobs=list(first.logprobs))
            )
        n = len(job.prompt)
        if job.prompt_logprobs or job.topk_prompt_logprobs:
            rows = ro.prompt_logprobs or [None] * n
            if job.prompt_logprobs:
                pl = np.full((n,), np.nan, dtype=np.float32)
                for i in range(1, n):
                    pl[i] = rows[i][job.prompt[i]].logprob
                out.prompt_logprobs = pl
            if job.topk_prompt_logprobs:
                ids, vals = _topk_arrays(rows[1:], job.topk_prompt_logprobs)
                kk = job.topk_prompt_logprobs
                out.topk_prompt_ids = np.concatenate([np.zeros((1, kk), np.int32), ids])
                out.topk_prompt_logprobs = np.concatenate(
                    [np.full((1, kk), TOPK_EMPTY_LOGPROB, np.float32), vals]
                )
        out.tokens = n + sum(len(s.tokens) for s in out.sequences)
        return out

    # -- adapters as LoRA ids -------------------------------------------------------------------------
    def _lora(self, adapter: Adapter):
        """The LoRA request for ``adapter`` as it is now: its PEFT folder is written once per version."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        uid = adapter.__dict__.get("_vllm_uid")
        if uid is None:
            uid = adapter.__dict__["_vllm_uid"] = next(self._uids)
            weakref.finalize(adapter, self._dead.append, uid)
        key = (uid, adapter.version)
        lora = self._loras.get(key)
        if lora is None:
            for old in [k for k in self._loras if k[0] == uid]:  # an older version: never asked again
                self._drop(old)
            int_id = next(self._int_ids)
            folder = self.adapter_dir / str(int_id)
            folder.mkdir(parents=True)
            save_file(adapter.peft_state_dict(), str(folder / "adapter_model.safetensors"))
            config = peft_adapter_config(adapter.spec, self.base.targets, self.base.name)
            (folder / "adapter_config.json").write_text(_json(config))
            lora = _Lora(int_id, f"a{uid}v{key[1]}", folder, uid)
            self._loras[key] = lora
            self.lora_loads += 1
        self._loras.move_to_end(key)
        return LoRARequest(lora.name, lora.int_id, str(lora.folder))

    def _drop(self, key: tuple[int, int]) -> None:
        lora = self._loras.pop(key)
        try:
            self.engine.remove_lora(lora.int_id)
        except Exception:  # noqa: BLE001 - never loaded (or already evicted) by vLLM
            pass
        shutil.rmtree(lora.folder, ignore_errors=True)

    def _collect(self) -> None:
        """Drop the LoRA ids and folders of adapters that no longer exist (on the worker thread)."""
        while self._dead:
            uid = self._dead.pop()
            for key in [k for k in self._loras if k[0] == uid]:
                self._drop(key)

    def adapter_folders(self) -> int:
        return sum(1 for _ in self.adapter_dir.iterdir())

    def stats(self) -> dict:
        return {
            "vllm_max_running_loras": _StatsLogger.peaks["running_loras"],
            "vllm_max_running_requests": _StatsLogger.peaks["running_reqs"],
            "vllm_lora_loads": self.lora_loads,
            "vllm_resident_adapters": len(self._loras),
        }

    def close(self) -> None:
        """Shut the engine down (explicitly: vLLM's own teardown at interpreter exit can abort)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            log.exception("vLLM shutdown")
        shutil.rmtree(self.adapter_dir, ignore_errors=True)


def _topk_arrays(steps, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[len(steps), k] ids and logprobs from vLLM's per-position {token: Logprob(rank=...)} dicts."""
    ids = np.zeros((len(steps), k), dtype=np.int32)
    vals = np.full((len(steps), k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
    for i, d in enumerate(steps):
        for tok, lp in (d or {}).items():
            r = lp.rank
            if r is not None and 1 <= r <= k:
                ids[i, r - 1] = tok
                vals[i, r - 1] = lp.logprob
    return ids, vals


def _json(obj) -> str:
    import json

    return json.dumps(obj, indent=2, sort_keys=True)


def _start_engine(args: dict, worker_env: dict | None = None):
    """vLLM's engine in this process, leaving the trainer's torch threads and the RNGs as they were
    (``worker_env``: set while it starts, for the worker processes a parallel engine spawns)."""
    saved = {k: os.environ.get(k) for k in worker_env or {}}
    os.environ.update(worker_env or {})
    try:
        return _start(args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start(args: dict):
    threads = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # else vLLM drops torch to 1 thread
    set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=[_StatsLogger])
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_num_threads = set_threads
    set_threads(threads)
    return engine
