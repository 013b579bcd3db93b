"""Run in .venv-vllm by test_vllm_qwen2.py: the vLLM sampler on a Qwen2-shaped tiny model (vLLM 0.32
declares no LoRA on a Qwen2's lm_head). Prints one JSON line of what each job got.

    python tests/vllm/qwen2_check.py DATA_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def build_qwen2(folder: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrl_service.models.tiny import VOCAB_SIZE, _build_tokenizer

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=258,
        pad_token_id=259,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    _build_tokenizer().save_pretrained(folder)


def main() -> None:
    import numpy as np
    import torch

    from openrl_service.config import Settings
    from openrl_service.models.loading import load_base_model
    from openrl_service.sampling.base import SampleJob, SamplingParams
    from openrl_service.sampling.factory import make_sampler
    from openrl_service.sampling.torch_sampler import TorchSampler
    from openrl_service.training.lora import LoraSpec, new_adapter

    data = Path(sys.argv[1])
    folder = data / "qwen2-tiny"
    build_qwen2(folder)
    torch.set_num_threads(1)
    settings = Settings(data_dir=data, sampler="vllm", vllm_kv_cache_gb=0.1, vllm_max_model_len=256)
    settings.limits.max_rank = 8
    base = load_base_model(str(folder), data_dir=data)
    unembed_default = base.defaults["train_unembed"]
    sampler = make_sampler(base, settings)
    torch_sampler = TorchSampler(base)
    gen = torch.Generator().manual_seed(1)
    adapters = {}
    for name, spec in (("lm_head", LoraSpec(rank=8)), ("body", LoraSpec(rank=8, train_unembed=False))):
        a = new_adapter(spec, base.targets, seed=3, device="cpu")
        with torch.no_grad():
            for _, b in a.weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
        adapters[name] = a
    prompt = list(b"<|im_start|>user\nhello there")
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    jobs = {
        "lm_head": SampleJob(prompt, 2, greedy, adapters["lm_head"]),
        "body": SampleJob(prompt, 2, greedy, adapters["body"], prompt_logprobs=True, topk_prompt_logprobs=3),
        "base": SampleJob(prompt, 1, greedy, None, prompt_logprobs=True),
    }
    outs = sampler.sample_many(list(jobs.values()))
    report = {"defaults_train_unembed": [unembed_default, base.defaults["train_unembed"]], "jobs": {}}
    for (name, job), out in zip(jobs.items(), outs, strict=True):
        ref = torch_sampler.sample(job)
        entry = {
            "backend": out.backend,
            "notice": out.notice,
            "rows": len(out.sequences),
            "greedy_equal": all(s.tokens == ref.sequences[0].tokens for s in out.sequences),
        }
        if job.prompt_logprobs:
            entry["prompt_logprob_max_delta"] = float(
                np.nanmax(np.abs(out.prompt_logprobs - ref.prompt_logprobs))
            )
            entry["prompt_logprob_first_is_nan"] = bool(np.isnan(out.prompt_logprobs[0]))
        if job.topk_prompt_logprobs:
            entry["topk_prompt_ids_equal"] = bool((out.topk_prompt_ids == ref.topk_prompt_ids).all())
            entry["topk_prompt_max_delta"] = float(
                np.abs(out.topk_prompt_logprobs - ref.topk_prompt_logprobs).max()
            )
        report["jobs"][name] = entry
    report["samples"] = sampler.samples
    sampler.close()
    print(json.dumps(report), flush=True)
    os._exit(0)  # vLLM is shut down; skip the interpreter teardown that can abort after it (rc 134)


if __name__ == "__main__":
    main()
