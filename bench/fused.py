"""Cross-run batching on the tiny model: fused passes vs the same work run per run in turn.

Training: R runs × S sequences each (default 3 × 8, mixed lengths, cross_entropy / importance_sampling
/ ppo), one ``Trainer.forward_backward_fused`` + each run's optim_step, against each run's
``forward_backward`` + optim_step in turn. Sampling: one job per run (plus one base-model job) with
``num_samples`` each, one ``TorchSampler.sample_many`` against ``sample`` per job. Not a test: it
prints a ratio table (timings on shared CPUs are noisy; ratios are the signal).

    python bench/fused.py [--runs 3] [--seqs 8] [--tokens 64] [--samples 4] [--max-tokens 32] [--repeats 5]
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
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8, help="sequences per run and training step")
    p.add_argument("--tokens", type=int, default=64, help="longest sequence; lengths vary from half of it")
    p.add_argument("--samples", type=int, default=4, help="samples per sampling job")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from openrl_service.models.loading import load_base_model
    from openrl_service.sampling.base import SampleJob, SamplingParams
    from openrl_service.sampling.torch_sampler import TorchSampler
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.losses import check_loss
    from openrl_service.training.trainer import AdamParams, DatumArrays, Trainer

    with tempfile.TemporaryDirectory() as data_dir:
        base = load_base_model("tiny", data_dir=Path(data_dir))
    trainer = Trainer(base)
    sampler = TorchSampler(base)
    rng = np.random.default_rng(0)
    states = [trainer.new_state(LoraSpec(rank=8), seed=i) for i in range(args.runs)]
    losses = ["cross_entropy", "importance_sampling", "ppo"]

    def datum(n: int, loss: str) -> DatumArrays:
        inputs = {"target_tokens": rng.integers(0, 256, n)}
        if loss == "cross_entropy":
            inputs["weights"] = np.ones(n, np.float32)
        else:
            inputs["logprobs"] = rng.uniform(-7, -4, n).astype(np.float32)
            inputs["advantages"] = rng.normal(size=n).astype(np.float32)
        return DatumArrays(rng.integers(0, 256, n), inputs)

    calls = []
    for i in range(args.runs):
        loss = losses[i % len(losses)]
        lengths = rng.integers(args.tokens // 2, args.tokens + 1, args.seqs)
        calls.append(([datum(int(n), loss) for n in lengths], loss, check_loss(loss, {})))
    adam = AdamParams(learning_rate=1e-4)

    def train(fused: bool) -> float:
        t0 = time.perf_counter()
        if fused:
            trainer.forward_backward_fused([(st, *c) for st, c in zip(states, calls, strict=True)])
        else:
            for st, c in zip(states, calls, strict=True):
                trainer.forward_backward(st, *c, forward_only=False)
        for st in states:
            trainer.optim_step(st, adam)
        return time.perf_counter() - t0

    adapters = [st.adapter.snapshot() for st in states] + [None]
    jobs = [
        SampleJob(
            prompt=rng.integers(0, 256, int(rng.integers(8, 24))).tolist(),
            num_samples=args.samples,
            params=SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, stop_token_ids=()),
            adapter=a,
        )
        for i, a in enumerate(adapters)
    ]

    def sample(fused: bool) -> float:
        t0 = time.perf_counter()
        if fused:
            sampler.sample_many(jobs)
        else:
            for job in jobs:
                sampler.sample(job)
        return time.perf_counter() - t0

    train(True), train(False), sample(True), sample(False)  # warm-up
    rows = []
    for name, fn, work in (
        (
            f"train {args.runs} runs x {args.seqs} seqs",
            train,
            sum(len(d.tokens) for c in calls for d in c[0]),
        ),
        (f"sample {len(jobs)} jobs x {args.samples}", sample, len(jobs) * args.samples * args.max_tokens),
    ):
        per_run = statistics.median(fn(False) for _ in range(args.repeats))
        fused = statistics.median(fn(True) for _ in range(args.repeats))
        rows.append((name, work / per_run, work / fused, per_run / fused))

    print(f"openrl/tiny, LoRA r8, median of {args.repeats} (tokens/s; sampling counts max_tokens per sample)")
    print(f"{'workload':>28} {'per run':>10} {'fused':>10} {'speedup':>8}")
    for name, a, b, ratio in rows:
        print(f"{name:>28} {a:>10.0f} {b:>10.0f} {ratio:>7.2f}x")
    print(f"fused: train={rows[0][3]:.2f} sample={rows[1][3]:.2f}")


if __name__ == "__main__":
    main()
