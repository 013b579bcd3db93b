"""The vLLM sampler's arithmetic and routing, without vLLM: rank choice, GPU budget, --sampler, fallback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from openrl_service.config import from_env
from openrl_service.sampling import factory
from openrl_service.sampling.base import SampledSequence, SampleJob, SampleOutput, SamplingParams
from openrl_service.sampling.vllm_sampler import (
    VLLM_LORA_RANKS,
    Capabilities,
    VLLMSampler,
    check_gpu_budget,
    vllm_max_lora_rank,
)
from openrl_service.training.lora import LoraSpec, new_adapter

GIB = 1 << 30


def test_max_lora_rank_is_the_smallest_vllm_rank_that_holds_openrl_max_rank():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 128, 300, 512)] == [1, 8, 8, 16, 128, 320, 512]
    with pytest.raises(ValueError, match=r"OPENRL_MAX_RANK=600 .* largest LoRA rank this vLLM serves \(512"):
        vllm_max_lora_rank(600, VLLM_LORA_RANKS)


def test_gpu_budget_refuses_an_over_commit_with_the_numbers():
    check_gpu_budget(total_bytes=80 * GIB, free_bytes=78 * GIB, utilization=0.5, trainer_bytes=20 * GIB)
    with pytest.raises(ValueError) as e:
        check_gpu_budget(total_bytes=80 * GIB, free_bytes=70 * GIB, utilization=0.8, trainer_bytes=10 * GIB)
    msg = str(e.value)
    assert "0.8 x 80.0 GiB = 64.0 GiB" in msg and "10.0 GiB more" in msg and "70.0 GiB are free" in msg
    assert "at most 0.75" in msg  # (70 - 10) / 80
    with pytest.raises(ValueError, match="between 0 and 1"):
        check_gpu_budget(total_bytes=GIB, free_bytes=GIB, utilization=1.5, trainer_bytes=0)


def test_sampler_choice(monkeypatch):
    monkeypatch.setattr(factory.torch.cuda, "is_available", lambda: False)
    assert factory.resolve_sampler("auto") == "torch"  # no CUDA: torch even where vllm is installed
    assert factory.resolve_sampler("torch") == "torch"
    monkeypatch.setattr(factory, "vllm_installed", lambda: False)
    with pytest.raises(ValueError, match="--sampler vllm: vLLM is not installed"):
        factory.resolve_sampler("vllm")
    monkeypatch.setattr(factory.torch.cuda, "is_available", lambda: True)
    assert factory.resolve_sampler("auto") == "torch"
    monkeypatch.setattr(factory, "vllm_installed", lambda: True)
    assert factory.resolve_sampler("auto") == "vllm"
    assert from_env({"OPENRL_SAMPLER": "Torch", "OPENRL_VLLM_MAX_LORAS": "8"}).vllm_max_loras == 8
    with pytest.raises(ValueError, match="OPENRL_SAMPLER must be one of auto, torch, vllm"):
        from_env({"OPENRL_SAMPLER": "fast"})


@pytest.mark.skipif(factory.vllm_installed(), reason="checks the error where vllm is absent (.venv)")
def test_serve_with_sampler_vllm_but_no_vllm_is_a_startup_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrl_service.cli",
            "serve",
            "--sampler",
            "vllm",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--sampler vllm: vLLM is not installed" in proc.stderr


class _Fallback:
    def sample_many(self, jobs):
        return [SampleOutput([SampledSequence([1], [-0.5], "length")]) for _ in jobs]


def test_what_vllm_cannot_do_goes_to_torch_with_a_notice(tmp_path):
    from openrl_service.models.loading import load_base_model

    base = load_base_model("tiny", data_dir=tmp_path)
    s = object.__new__(VLLMSampler)  # the routing rules only: no engine
    s.base, s.max_lora_rank, s.fallback = base, 8, _Fallback()
    s.caps = Capabilities("0.32.0", "Qwen2ForCausalLM", False, True, False, 64, 20)
    s._collect, s._loras, s.max_cpu_loras = (lambda: None), {}, 16
    unembed = new_adapter(LoraSpec(rank=8), base.targets, seed=0, device="cpu")
    body = new_adapter(LoraSpec(rank=8, train_unembed=False), base.targets, seed=0, device="cpu")

    def job(adapter, **kw):
        params = {"max_tokens": 4, **kw.pop("params", {})}
        return SampleJob([1, 2, 3], 1, SamplingParams(**params), adapter, **kw)

    assert "no LoRA on lm_head for Qwen2ForCausalLM" in s.unsupported(job(unembed))
    assert s.unsupported(job(body)) is None
    assert "prompt logprobs" in s.unsupported(job(body, prompt_logprobs=True))
    assert "max_model_len 64" in s.unsupported(job(body, params={"max_tokens": 62}))
    assert "max_tokens is 0" in s.unsupported(job(None, params={"max_tokens": 0}))
    assert "U+FFFD" in s.unsupported(job(None, params={"stop_strings": ("\ufffd",)}))
    assert "max_logprobs 20" in s.unsupported(job(None, topk_sample_logprobs=21))
    counting = factory.CountingSampler(s, "vllm")
    out = counting.sample(job(unembed))
    assert out.backend == "torch" and out.notice.startswith("sampled with the torch sampler: vLLM 0.32.0")
    assert counting.samples == {"torch": 1, "vllm": 0}
