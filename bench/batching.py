"""Padded-batch vs per-datum forward/backward on the tiny model: trained tokens per second.

The seed system ran each datum as its own batch of one; this service pads a call's datums into
micro-batches. Not a test: it prints a ratio table (timings on shared CPUs are noisy; ratios are
the signal).

    python bench/batching.py [--datums 64] [--tokens 128 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datums", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 256])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from openrl_service.models.loading import load_base_model
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import DatumArrays, Trainer

    with tempfile.TemporaryDirectory() as data_dir:
        base = load_base_model("tiny", data_dir=Path(data_dir))
    trainer = Trainer(base)
    state = trainer.new_state(LoraSpec(rank=8), seed=0)
    rng = np.random.default_rng(0)

    def step(data, per_datum: bool) -> float:
        t0 = time.perf_counter()
        for chunk in [[d] for d in data] if per_datum else [data]:
            trainer.forward_backward(state, chunk, "cross_entropy", {}, forward_only=False)
        trainer.optim_step(state, AdamParams(learning_rate=1e-4))
        return time.perf_counter() - t0

    print(f"openrl/tiny, LoRA r8, {args.datums} datums, median of {args.repeats} (tokens/s)")
    print(f"{'tokens/datum':>12} {'per-datum':>12} {'padded batch':>14} {'speedup':>8}")
    for n in args.tokens:
        data = [
            DatumArrays(
                rng.integers(0, 256, n),
                {"target_tokens": rng.integers(0, 256, n), "weights": np.ones(n, np.float32)},
            )
            for _ in range(args.datums)
        ]
        step(data, False)  # warm-up
        single = statistics.median(step(data, True) for _ in range(args.repeats))
        batched = statistics.median(step(data, False) for _ in range(args.repeats))
        total = args.datums * n
        print(f"{n:>12} {total / single:>12.0f} {total / batched:>14.0f} {single / batched:>7.1f}x")


if __name__ == "__main__":
    main()
