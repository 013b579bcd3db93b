"""The sampling vocabulary: what a sample request asks for and what comes back.

A :class:`Sampler` turns one :class:`SampleJob` (a prompt, how many samples, the sampling
parameters and which adapter snapshot) into a :class:`SampleOutput`; ``sample_many`` does several
jobs with different adapters (cross-run batching) in one batched generate. The torch backend lives in
``torch_sampler.py``, the vLLM one in ``vllm_sampler.py`` (it hands what vLLM cannot do to torch);
``factory.make_sampler`` picks one (``--sampler auto|torch|vllm``) and counts samples per backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from openrl_service.training.lora import Adapter


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None only until the service resolves it against the prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass
class SampleJob:
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    adapter: Adapter | None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    first_row: int = 0  # its samples are rows first_row.. of a bigger job (a split call): their seeds
    # called on the sampling thread with (row, token) as each token is chosen, for streamed replies;
    # a backend that decodes a batch at once (vLLM's offline engine) never calls it
    on_token: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # raw model logprobs of the sampled tokens (before temperature/top-k/top-p)
    stop_reason: str  # "stop" | "length"
    topk_ids: np.ndarray | None = None  # [len(tokens), k] int32
    topk_logprobs: np.ndarray | None = None  # [len(tokens), k] float32


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None  # [len(prompt)] float32, NaN at position 0
    topk_prompt_ids: np.ndarray | None = None
    topk_prompt_logprobs: np.ndarray | None = None
    tokens: int = field(default=0)  # prompt + generated tokens processed
    backend: str = "torch"  # which sampler produced the tokens: "torch" | "vllm"
    notice: str | None = None  # why a vLLM service sampled this job with torch (one line), if it did


class Sampler(Protocol):
    def sample(self, job: SampleJob) -> SampleOutput: ...

    def sample_many(self, jobs: list[SampleJob]) -> list[SampleOutput]:
        """Several jobs (e.g. different runs' adapters) in one batched generate, one output per job;
        each job's result must equal ``sample(job)`` (greedy tokens exactly, seeded rows per seed)."""
        ...
