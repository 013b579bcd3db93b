"""Sampling throughput: the torch sampler vs vLLM on one model, one adapter and three runs' adapters mixed.

    .venv-vllm/bin/python bench/sampling.py                # SmolLM2-135M-Instruct (make bench-sampling)
    .venv-vllm/bin/python bench/sampling.py --model tiny   # the tiny model, for a quick look

In-process, no service: the base model loaded as the service loads it, LoRA adapters as the trainer
makes them (rank 8, every linear layer; their B matrices filled with small random values so each
adapter changes the tokens), then ``sample_many`` of the service's own samplers: ``TorchSampler`` and
``VLLMSampler`` (vLLM's engine in this process, ``--sampler vllm``'s settings). Each call is
``--prompts`` chat prompts × ``--samples`` samples × ``--tokens`` tokens (no stop: every row decodes
the full length), seeded, temperature 1. Adapter load time is what a new snapshot adds to a vLLM call
(its PEFT folder written and loaded into a LoRA slot): a 1-token call with a new adapter version minus
the same call with a resident one. Prints a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU does in two sentences.",
    "Give me three tips for learning a language.",
    "What is the capital of France and why is it famous?",
    "Describe a cat to someone who has never seen one.",
    "List some fruits that are red.",
    "How do I boil an egg?",
    "Tell me a fun fact about space.",
]


def build(args):
    import torch

    from openrl_service.config import Settings
    from openrl_service.models.loading import load_base_model
    from openrl_service.sampling.factory import make_sampler
    from openrl_service.sampling.torch_sampler import TorchSampler
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir = Path(args.data_dir)
    t0 = time.perf_counter()
    base = load_base_model(args.model, data_dir=data_dir)
    load_s = time.perf_counter() - t0
    trainer = Trainer(base)
    adapters = []
    for seed in range(3):
        adapter = trainer.new_state(LoraSpec(rank=8), seed=seed).adapter
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1000 + seed)
            for name, p in adapter.named_parameters():
                if "lora_B" in name or p.abs().max() == 0:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        adapters.append(adapter)
    settings = Settings(data_dir=data_dir, sampler="vllm")
    settings.limits.max_rank = 8  # vLLM computes every LoRA at its max rank: keep it at the ranks used
    settings.vllm_max_model_len = args.max_model_len
    t0 = time.perf_counter()
    vllm = make_sampler(base, settings)
    vllm_start_s = time.perf_counter() - t0
    torch.set_num_threads(args.threads or torch.get_num_threads())
    return base, adapters, TorchSampler(base), vllm, load_s, vllm_start_s


def jobs_for(base, adapters, args, seed: int):
    from openrl_service.sampling.base import SampleJob, SamplingParams

    tok = base.tokenizer
    jobs = []
    for i, text in enumerate(PROMPTS[: args.prompts]):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=seed * 101 + i)
        jobs.append(SampleJob(list(prompt), args.samples, params, adapters[i % len(adapters)]))
    return jobs


def timed(sampler, jobs) -> tuple[float, int, set[str]]:
    t0 = time.perf_counter()
    outs = sampler.sample_many(jobs)
    wall = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for o in outs for s in o.sequences)
    return wall, tokens, {getattr(o, "backend", "torch") for o in outs}


def throughput(sampler, base, adapters, args, repeats: int) -> dict:
    timed(sampler, jobs_for(base, adapters, args, seed=0))  # warm-up: adapters loaded, kernels ready
    walls, tokens, backends = [], 0, set()
    for r in range(repeats):
        wall, tokens, b = timed(sampler, jobs_for(base, adapters, args, seed=r + 1))
        walls.append(wall)
        backends |= b
    wall = statistics.median(walls)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "backends": sorted(backends)}


def vllm_adapter_load_s(vllm, base, adapters, args, repeats: int = 5) -> float:
    """A 1-token call with a new adapter version minus the same call with a resident adapter."""
    import torch

    one = argparse.Namespace(**{**vars(args), "prompts": 1, "samples": 1, "tokens": 1})
    adapter = adapters[0]
    fresh, resident = [], []
    for _ in range(repeats):
        with torch.no_grad():
            next(iter(adapter.parameters())).add_(1e-6)  # a new version: a new snapshot for vLLM
        fresh.append(timed(vllm, jobs_for(base, [adapter], one, seed=0))[0])
        resident.append(timed(vllm, jobs_for(base, [adapter], one, seed=0))[0])
    return max(0.0, statistics.median(fresh) - statistics.median(resident))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a --model spec: smollm2 (default), tiny, a folder")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case (median)")
    p.add_argument("--torch-repeats", type=int, default=2, help="the torch sampler is slow on a real model")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OPENRL_TORCH_THREADS", "0") or 0))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--data-dir", default=os.environ.get("OPENRL_DATA_DIR") or str(ROOT / "build" / "bench-data")
    )
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()

    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench-sampling needs vLLM: run it with .venv-vllm/bin/python (make bench-sampling)")
        return 2
    base, adapters, torch_sampler, vllm, load_s, vllm_start_s = build(args)
    shape = f"{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens"
    print(f"bench-sampling: {base.name} ({base.arch}, {base.dtype}, {base.device}), {shape}")
    print(f"  model load {load_s:.1f} s, vLLM engine start {vllm_start_s:.1f} s")
    rows = {}
    for case, ads in (("one adapter", adapters[:1]), ("three runs' adapters mixed", adapters)):
        v = throughput(vllm, base, ads, args, args.repeats)
        t = throughput(torch_sampler, base, ads, args, args.torch_repeats)
        rows[case] = {"torch": t, "vllm": v, "speedup": v["tokens_per_s"] / t["tokens_per_s"]}
        print(
            f"  {case:<28} torch {t['tokens_per_s']:8.1f} tok/s ({t['wall_s']:6.2f} s)   "
            f"vLLM {v['tokens_per_s']:8.1f} tok/s ({v['wall_s']:6.2f} s, served by {'/'.join(v['backends'])})"
            f"   vLLM/torch {rows[case]['speedup']:.1f}x"
        )
    load = vllm_adapter_load_s(vllm, base, adapters, args)
    print(f"  vLLM adapter load for a new snapshot: {load * 1000:.0f} ms")
    vllm.close()
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": base.name,
                    "shape": shape,
                    "model_load_s": load_s,
                    "vllm_start_s": vllm_start_s,
                    "cases": rows,
                    "vllm_adapter_load_s": load,
                    "date": time.strftime("%Y-%m-%d"),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
