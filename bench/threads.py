"""The device worker's torch thread count: SFT and RL throughput of a service per OPENRL_TORCH_THREADS.

For each thread count (``--threads``, default 1 and 2), in turn within each of ``--rounds`` rounds (so
a drifting load hits each alike): ``openrl-service serve`` on loopback with OPENRL_TORCH_THREADS set,
driven by the unmodified Tinker SDK — ``--sft-steps`` SFT steps (forward/backward on 32 × 128 tokens
+ one AdamW step, LoRA rank 8) and ``--rl-steps`` RL steps (bench/api_overhead.py's: snapshot, 8 × 8
completions of ``--rl-tokens`` tokens, importance-sampling forward/backward, AdamW), the first step of
each left out. Prints tokens/s of SFT and s/step of RL per thread count, medians over rounds. Not a
test: it prints a ratio table; compare on an idle machine.

    python bench/threads.py [--rounds 2] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from api_overhead import sdk_steps  # noqa: E402

from openrl_jupyter.local import start_service  # noqa: E402

BATCH, TOKENS = 32, 128


def sft_tokens_per_s(url: str, steps: int) -> list[float]:
    import tinker
    from tinker import types

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (BATCH, TOKENS + 1))
    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[i, :-1].tolist()),
            loss_fn_inputs={"target_tokens": ids[i, 1:].tolist()},
        )
        for i in range(BATCH)
    ]
    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0).result()
    out = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        fb = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        if step:
            out.append(BATCH * TOKENS / (time.perf_counter() - t0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sft-steps", type=int, default=8)
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument("--rl-tokens", type=int, default=256)
    args = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    sft: dict[int, list[float]] = {n: [] for n in args.threads}
    rl: dict[int, list[float]] = {n: [] for n in args.threads}
    for _ in range(args.rounds):
        for n in args.threads:
            with tempfile.TemporaryDirectory() as data:
                service = start_service(
                    data_dir=data, auth=False, env={"OPENRL_TORCH_THREADS": str(n)}, timeout_s=300
                )
                try:
                    sft[n].append(statistics.median(sft_tokens_per_s(service.url, args.sft_steps)))
                    rl[n].append(statistics.median(sdk_steps(service.url, args.rl_tokens, args.rl_steps)))
                finally:
                    service.stop()
    base = args.threads[0]
    print(
        f"openrl/tiny, LoRA rank 8, SDK over HTTP, {os.cpu_count()} cores; per round: "
        + ", ".join(
            f"{n} thread(s) SFT {' / '.join(f'{x:,.0f}' for x in sft[n])} tok/s" for n in args.threads
        )
    )
    print(f"{'threads':>8} {'SFT tok/s':>10} {'vs ' + str(base):>7} {'RL s/step':>10} {'vs ' + str(base):>7}")
    for n in args.threads:
        s, r = statistics.median(sft[n]), statistics.median(rl[n])
        s0, r0 = statistics.median(sft[base]), statistics.median(rl[base])
        print(f"{n:>8} {s:>10,.0f} {s / s0:>6.2f}x {r:>10.3f} {r0 / r:>6.2f}x")


if __name__ == "__main__":
    main()
