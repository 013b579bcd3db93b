"""The arithmetic of k8s/README.md's "Capacity" section: how many LoRA RL users one L4 or one H100 holds.

    .venv/bin/python k8s/capacity.py      # prints the section's tables (tests/k8s/test_capacity.py
                                          # checks that the README shows what this prints)

What is measured here (on the CPU, real torch, this repo's code): the bytes one trained adapter
parameter holds (the service's Adapter and its optimizer after a real step), and the adapter's size on
each model (the service's LoRA targets on a model built from the published config on the meta device:
counted, nothing downloaded). What is taken from the code: the memory accountant's plan and activation
estimate (openrl_service/memory.py) and vLLM's share of the GPU (components/gpu). What is assumed:
everything in ASSUMED below, and the GPUs' memory. Device time per step on a GPU was not measured here.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openrl_service import memory  # noqa: E402
from openrl_service.training import lora, trainer  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
RANKS = (8, 32)

# Published config.json dimensions (Hugging Face: Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen2.5-7B-Instruct):
# the models the gke-gpu-l4 and gke-gpu-h100 overlays serve.
MODELS = {
    "Qwen2.5-1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-7B": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # what CUDA reports as total (nvidia-smi), bytes
    model: str  # what the overlay serves on it
    overlay: str


GPUS = (
    Gpu("L4", 23034 * MIB, "Qwen2.5-1.5B", "gke-gpu-l4"),
    Gpu("H100 80GB", 81559 * MIB, "Qwen2.5-7B", "gke-gpu-h100"),
)

# Assumptions (not measured here), stated in the README beside the results.
ASSUMED = {
    "cuda_context": 1 * GIB,  # the CUDA context, cuBLAS workspaces and torch's allocator slack
    "group": 8,  # completions per prompt
    "prompts": 8,  # prompts per step
    "tokens": 512,  # prompt + completion tokens per sequence
    "active_share": 0.25,  # of the users with a notebook open, the share with a run stepping at a time
    "device_share": 0.25,  # f: of one run's step (sample, reward, train), the share the GPU works on it
}


def bytes_per_adapter_parameter() -> float:
    """Measured: a real adapter after one optimizer step of the service's AdamW: its weights,
    gradients and optimizer moments, in bytes per trained parameter (float32 everywhere)."""
    targets = [lora.TargetModule(f"model.layers.0.{n}", g, 64, 64) for n, g in (("q", "attn"), ("up", "mlp"))]
    adapter = lora.new_adapter(lora.LoraSpec(rank=8), targets, seed=0, device="cpu")
    params = list(adapter.parameters())
    sum((p * p).sum() for p in params).backward()
    opt = trainer.make_optimizer(adapter)
    for p in params:
        p.grad = torch.ones_like(p)  # B starts at zero, so the loss above gives it no gradient
    opt.step()
    count = sum(p.numel() for p in params)
    held = sum(p.numel() * p.element_size() for p in params)
    held += sum(p.grad.numel() * p.grad.element_size() for p in params)
    held += sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return held / count


@functools.cache
def meta_model(model: str):
    """The model built from its published config on the meta device: shapes only, no memory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**MODELS[model])
    with torch.device("meta"):
        return config, Qwen2ForCausalLM(config)


def adapter_parameters(model: str, rank: int) -> int:
    """Counted: the service's LoRA targets (attention, MLP and lm_head: LoraSpec's defaults) on it."""
    targets = lora.classify_linear_layers(meta_model(model)[1])
    return rank * sum(t.in_features + t.out_features for t in targets)


def base_parameters(model: str) -> int:
    return sum(p.numel() for p in meta_model(model)[1].parameters())


def vllm_share(overlay: str) -> float:
    """OPENRL_VLLM_GPU_MEMORY_UTILIZATION as the overlay sets it (components/gpu)."""
    sys.path.insert(0, str(ROOT / "k8s" / "images"))
    from images import rendered_container

    for e in rendered_container(overlay).get("env", []):
        if e["name"] == "OPENRL_VLLM_GPU_MEMORY_UTILIZATION":
            return float(e["value"])
    raise SystemExit(f"{overlay}: no OPENRL_VLLM_GPU_MEMORY_UTILIZATION")


def report() -> str:
    per_param_measured = bytes_per_adapter_parameter()
    # On a GPU the service also keeps the gradient a call set aside (trainer.accumulating_grads) and
    # bfloat16 casts of the weights (one for the pass, one for sampling): training/full.py footprint's
    # accounting, applied to an adapter.
    per_param = per_param_measured + 4 + 2 * 2
    lines = [
        f"Measured: {per_param_measured:.1f} bytes per adapter parameter (float32 weights, gradients and "
        f"AdamW's two moments after a real step of the service's optimizer). On a GPU add the set-aside "
        f"gradient (4) and two bfloat16 casts (2 × 2): {per_param:.0f} bytes.",
        "",
        "| model | parameters | LoRA rank | adapter parameters (counted) | one run's adapter on the GPU |",
        "|---|---:|---:|---:|---:|",
    ]
    run_bytes = {}
    for model in MODELS:
        n = base_parameters(model)
        for rank in RANKS:
            a = adapter_parameters(model, rank)
            run_bytes[model, rank] = a * per_param
            lines.append(
                f"| {model} | {n / 1e9:.2f} B | {rank} | {a / 1e6:.1f} M | {a * per_param / MIB:,.0f} MiB |"
            )
    lines += [
        "",
        "| GPU (overlay, model) | memory | vLLM's share | trainer's base weights (bf16) | CUDA context | "
        "room | accountant's reserves | left for adapters | live runs, r8 / r32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    live = {}
    micro = []
    for gpu in GPUS:
        share = vllm_share(gpu.overlay)
        n = base_parameters(gpu.model)
        weights = 2 * n  # bfloat16 on CUDA (models/loading.py)
        room = int(gpu.memory * (1 - share) - weights - ASSUMED["cuda_context"])
        config = meta_model(gpu.model)[0]
        p = memory.plan(
            "cuda:0",
            room,
            "assumed",
            sampling=0,  # vLLM samples: its KV cache is inside its share
            sampler_snapshots=4 << 30,  # OPENRL_MAX_SAMPLER_SNAPSHOT_BYTES
            largest_tensor=2 * config.vocab_size * config.hidden_size,  # the embedding, bf16
            full_runs=None,
            host_share=0,
        )
        live[gpu] = [int(p.full_runs // run_bytes[gpu.model, r]) for r in RANKS]
        lines.append(
            f"| {gpu.name} ({gpu.overlay}, {gpu.model}) | {gpu.memory / GIB:.1f} GiB | "
            f"{share:.0%}: {gpu.memory * share / GIB:.1f} GiB | {weights / GIB:.1f} GiB | "
            f"{ASSUMED['cuda_context'] / GIB:.1f} GiB | {room / GIB:.1f} GiB | "
            f"{sum(p.parts.values()) / GIB:.1f} GiB | {p.full_runs / GIB:.1f} GiB | "
            f"{live[gpu][0]} / {live[gpu][1]} |"
        )
        per_token = memory.train_token_bytes(config, 2)
        tokens = ASSUMED["group"] * ASSUMED["prompts"] * ASSUMED["tokens"]
        fit = p.parts["activations"] // per_token
        micro.append(
            f"{gpu.name}: {per_token / MIB:.1f} MiB of activations per trained token (memory.train_token_bytes; "
            f"the 152k-word vocabulary's logits are {12 * config.vocab_size * 1.5 / MIB:.1f} MiB of it), "
            f"{p.parts['activations'] / GIB:.2f} GiB reserved: {fit} tokens per micro-batch, "
            f"{-(-tokens // fit)} micro-batches for a step of {tokens:,} tokens"
        )
    stepping = round(1 / ASSUMED["device_share"])
    by_time = round(stepping / ASSUMED["active_share"])
    lines += ["", *micro, ""]
    lines += [
        f"Time: runs stepping at once without slowing each other much ≈ 1 / f = "
        f"1 / {ASSUMED['device_share']} = {stepping}; users ≈ {stepping} / "
        f"{ASSUMED['active_share']} (the share of users stepping at a time) = {by_time}.",
        "",
        "| GPU, model | users, LoRA r8 | users, LoRA r32 |",
        "|---|---:|---:|",
    ]
    for gpu in GPUS:
        r8, r32 = (min(by_time, n) for n in live[gpu])
        lines.append(f"| {gpu.name}, {gpu.model} | {r8} | {r32} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
