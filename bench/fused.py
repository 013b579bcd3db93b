"""Cross-run batching on the tiny model: fused passes vs the same work run per run in turn.

Training: R runs × S sequences each (default 3 × 8, mixed lengths, cross_entropy / importance_sampling
/ ppo), one ``Trainer.forward_backward_fused`` + each run's optim_step, against each run's
``forward_backward`` + optim_step in turn. Sampling: one job per run (plus one base-model job) with
``num_samples`` each, one ``TorchSampler.sample_many`` against ``sample`` per job. Not a test: it
prints a ratio table (timings on shared CPUs are noisy; ratios are the signal).

    python bench/fused.py [--runs 3] [--seqs 8] [--tokens 64] [--samples 4] [--max-tokens 32] [--repeats 5]
                          [--model tiny|PATH] [--device cuda|cpu]

``--model`` takes what ``openrl-service serve --model`` takes (default the tiny model); token ids stay
below 256, so any vocabulary of at least 256 works. On CUDA every timing synchronises the device.

``FusedBench`` is the reusable part (``bench/packing.py`` reports its training ratio as ``fused``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

LOSSES = ("cross_entropy", "importance_sampling", "ppo")


class FusedBench:
    """A model (the tiny one by default), a trainer and a sampler, ``runs`` LoRA runs, one training
    call per run."""

    def __init__(
        self,
        runs: int = 3,
        seqs: int = 8,
        tokens: int = 64,
        seed: int = 0,
        model: str = "tiny",
        device: str | None = None,
    ):
        from openrl_service.models.loading import load_base_model
        from openrl_service.sampling.torch_sampler import TorchSampler
        from openrl_service.training.lora import LoraSpec
        from openrl_service.training.losses import check_loss
        from openrl_service.training.optim_params import AdamParams
        from openrl_service.training.trainer import Trainer

        with tempfile.TemporaryDirectory() as data_dir:
            self.base = load_base_model(model, data_dir=Path(data_dir), device=device)
        self.trainer = Trainer(self.base)
        self.sampler = TorchSampler(self.base)
        self.rng = np.random.default_rng(seed)
        self.states = [self.trainer.new_state(LoraSpec(rank=8), seed=i) for i in range(runs)]
        self.calls = []
        for i in range(runs):
            loss = LOSSES[i % len(LOSSES)]
            lengths = self.rng.integers(tokens // 2, tokens + 1, seqs)
            self.calls.append(([self._datum(int(n), loss) for n in lengths], loss, check_loss(loss, {})))
        self.adam = AdamParams(learning_rate=1e-4)
        self.jobs: list = []

    def _datum(self, n: int, loss: str):
        from openrl_service.training.trainer import DatumArrays

        rng = self.rng
        inputs = {"target_tokens": rng.integers(0, 256, n)}
        if loss == "cross_entropy":
            inputs["weights"] = np.ones(n, np.float32)
        else:
            inputs["logprobs"] = rng.uniform(-7, -4, n).astype(np.float32)
            inputs["advantages"] = rng.normal(size=n).astype(np.float32)
        return DatumArrays(rng.integers(0, 256, n), inputs)

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA runs asynchronously; a timing must include it)."""
        if self.base.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.base.device)

    @property
    def train_tokens(self) -> int:
        return sum(len(d.tokens) for c in self.calls for d in c[0])

    def train(self, fused: bool) -> float:
        """Seconds of one training step of every run: one fused pass, or each run's call in turn."""
        trainer, states, calls = self.trainer, self.states, self.calls
        self.sync()
        t0 = time.perf_counter()
        if fused:
            trainer.forward_backward_fused([(st, *c) for st, c in zip(states, calls, strict=True)])
        else:
            for st, c in zip(states, calls, strict=True):
                trainer.forward_backward(st, *c, forward_only=False)
        for st in states:
            trainer.optim_step(st, self.adam)
        self.sync()
        return time.perf_counter() - t0

    def make_jobs(self, samples: int, max_tokens: int) -> None:
        """One sampling job per run's current adapter plus one base-model job."""
        from openrl_service.sampling.base import SampleJob, SamplingParams

        rng = self.rng
        adapters = [st.adapter.snapshot() for st in self.states] + [None]
        self.jobs = [
            SampleJob(
                prompt=rng.integers(0, 256, int(rng.integers(8, 24))).tolist(),
                num_samples=samples,
                params=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, stop_token_ids=()),
                adapter=a,
            )
            for i, a in enumerate(adapters)
        ]

    def sample(self, fused: bool) -> float:
        self.sync()
        t0 = time.perf_counter()
        if fused:
            self.sampler.sample_many(self.jobs)
        else:
            for job in self.jobs:
                self.sampler.sample(job)
        self.sync()
        return time.perf_counter() - t0


def compare(fn, repeats: int) -> tuple[float, float]:
    """Median seconds per run in turn and fused, after one warm-up of each. The two are timed in
    alternation (ABBA...), so a machine whose speed drifts (shared CPUs) biases neither side."""
    fn(True), fn(False)
    per_run, fused = [], []
    for i in range(repeats):
        for f in (False, True) if i % 2 == 0 else (True, False):
            (fused if f else per_run).append(fn(f))
    return statistics.median(per_run), statistics.median(fused)


def measure_train(
    runs: int = 3,
    seqs: int = 8,
    tokens: int = 64,
    repeats: int = 5,
    model: str = "tiny",
    device: str | None = None,
) -> dict:
    """The fused training step's speed over the same datums run per run in turn (median seconds)."""
    bench = FusedBench(runs, seqs, tokens, model=model, device=device)
    per_run, fused = compare(bench.train, repeats)
    return {
        "runs": runs,
        "seqs": seqs,
        "max_seq_tokens": tokens,
        "repeats": repeats,
        "tokens": bench.train_tokens,
        "per_run_s": per_run,
        "fused_s": fused,
        "speedup": per_run / fused,
        "model": bench.base.name,
        "device": str(bench.base.device),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8, help="sequences per run and training step")
    p.add_argument("--tokens", type=int, default=64, help="longest sequence; lengths vary from half of it")
    p.add_argument("--samples", type=int, default=4, help="samples per sampling job")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="tiny", help="tiny, a Hugging Face model folder or a .gguf file")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best available)")
    args = p.parse_args()

    bench = FusedBench(args.runs, args.seqs, args.tokens, model=args.model, device=args.device)
    bench.make_jobs(args.samples, args.max_tokens)
    rows = []
    for name, fn, work in (
        (f"train {args.runs} runs x {args.seqs} seqs", bench.train, bench.train_tokens),
        (
            f"sample {len(bench.jobs)} jobs x {args.samples}",
            bench.sample,
            len(bench.jobs) * args.samples * args.max_tokens,
        ),
    ):
        per_run, fused = compare(fn, args.repeats)
        rows.append((name, work / per_run, work / fused, per_run / fused))

    print(
        f"{bench.base.name}, LoRA r8, median of {args.repeats} (tokens/s; sampling counts max_tokens per sample)"
    )
    print(f"{'workload':>28} {'per run':>10} {'fused':>10} {'speedup':>8}")
    for name, a, b, ratio in rows:
        print(f"{name:>28} {a:>10.0f} {b:>10.0f} {ratio:>7.2f}x")
    print(f"fused: train={rows[0][3]:.2f} sample={rows[1][3]:.2f}")


if __name__ == "__main__":
    main()
