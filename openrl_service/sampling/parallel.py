"""vLLM's tensor parallelism for a model served by a group: where its workers run, checked at startup.

``--vllm-tp N`` (OPENRL_VLLM_TP) makes vLLM shard the sampled model over N GPUs
(``tensor_parallel_size``, its multiprocessing executor: one worker process per GPU). Where:

- **colocated** (no ``--sampler-devices``): on the first N of the training group's devices, sharing
  their memory with the trainer (``--vllm-gpu-memory-utilization`` is vLLM's fraction of each);
- **separate** (``--sampler-devices cuda:4,cuda:5``): on GPUs of their own, which the training group's
  ``--devices`` must not name; vLLM's workers are shown only those (CUDA_VISIBLE_DEVICES of the
  processes it starts). A multi-tenant service should prefer this: sampling never waits on training
  memory.

Refused with the flag named: a TP on the CPU (vLLM's CPU backend runs one worker), a TP with the torch
sampler, sampler devices that are not as many as the TP or overlap the group's.

Multi-LoRA at TP > 1 has had correctness bugs in vLLM (adapters sliced wrongly across ranks): the
service logs a warning at startup, and ``bench/gpu_check.sh --gpus N`` compares greedy samples of the
same adapters at TP 1 and TP N before a deployment relies on it.
"""

from __future__ import annotations

import logging

log = logging.getLogger("openrl.sampling")


def check_parallel(settings, *, sampler: str, training_devices: list[str], cuda: bool) -> None:
    """Refuse (ValueError naming the flag) a vLLM parallel layout that cannot work."""
    tp = settings.vllm_tp
    apart = list(settings.sampler_devices)
    if not 1 <= tp <= 64:
        raise ValueError(f"--vllm-tp (OPENRL_VLLM_TP) must be between 1 and 64; got {tp}")
    if tp > 1 and sampler != "vllm":
        raise ValueError(
            f"--vllm-tp {tp} shards vLLM's model over {tp} GPUs, but the sampler is {sampler} "
            "(--sampler vllm on a GPU machine with vLLM installed)"
        )
    if tp > 1 and not cuda:
        raise ValueError(
            f"--vllm-tp {tp}: vLLM's tensor parallelism needs CUDA GPUs; on the CPU vLLM runs one worker "
            "(--vllm-tp 1)"
        )
    if apart:
        if sampler != "vllm":
            raise ValueError(
                "--sampler-devices (OPENRL_SAMPLER_DEVICES) places vLLM's workers: use --sampler vllm"
            )
        if len(apart) != tp:
            raise ValueError(
                f"--sampler-devices names {len(apart)} GPUs; --vllm-tp is {tp}: one GPU per vLLM worker"
            )
        for d in apart:
            if not d.startswith("cuda:") or not d.removeprefix("cuda:").isdigit():
                raise ValueError(f"--sampler-devices: {d!r} is not a GPU (cuda:N)")
        shared = sorted(set(apart) & set(training_devices))
        if shared:
            raise ValueError(
                f"--sampler-devices {','.join(apart)} overlaps the training group's devices "
                f"({', '.join(shared)}); leave --sampler-devices empty to colocate vLLM with training"
            )


def vllm_parallel_args(settings) -> tuple[dict, dict]:
    """(EngineArgs fields, environment for vLLM's worker processes) for the layout above."""
    tp = settings.vllm_tp
    if tp <= 1 and not settings.sampler_devices:
        return {}, {}
    args = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    env = {}
    if settings.sampler_devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.removeprefix("cuda:") for d in settings.sampler_devices)
    if tp > 1:
        log.warning(
            "vLLM samples with tensor_parallel_size %d: multi-LoRA at TP > 1 has had correctness bugs in "
            "vLLM; bench/gpu_check.sh --gpus %d compares its greedy samples with TP 1",
            tp,
            tp,
        )
    return args, env


def check_layout(settings, sampler: str) -> None:
    """--vllm-tp / --sampler-devices against the sampler (resolved) and the group's devices, at start."""
    import torch

    from openrl_service.group.launch import layout

    training = layout(settings).devices if settings.world_size > 1 else [settings.device or "cuda:0"]
    check_parallel(settings, sampler=sampler, training_devices=training, cuda=torch.cuda.is_available())
