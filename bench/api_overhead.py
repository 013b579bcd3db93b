"""What the HTTP API costs: one RL step through the Tinker SDK over loopback HTTP + protobuf versus
the same step called on the engine in-process.

The step: snapshot the weights, sample 8 prompts × 8 completions of exactly ``--tokens`` tokens,
one importance-sampling forward/backward on the 64 sequences, one AdamW step. Not a test: it
prints a ratio table (the target is that the API adds ≤ 5 % at 64 sequences × 256 tokens).

    python bench/api_overhead.py [--tokens 256] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = [list(f"Prompt number {i}: ".encode()) for i in range(8)]
GROUP = 8


def rl_datums(prompt, seqs):
    """(tokens, inputs) per completion: sampler logprobs and a group-relative advantage."""
    rewards = [sum(97 <= t <= 122 for t in s["tokens"]) / len(s["tokens"]) for s in seqs]
    mean = sum(rewards) / len(rewards)
    out = []
    for s, r in zip(seqs, rewards, strict=True):
        full = prompt + list(s["tokens"])
        n = len(prompt) - 1
        out.append(
            (
                full[:-1],
                full[1:],
                [0.0] * n + list(s["logprobs"]),
                [0.0] * n + [r - mean + 0.01] * len(s["tokens"]),
            )
        )
    return out


def in_process(tokens: int, steps: int) -> list[float]:
    from openrl_service.config import Settings
    from openrl_service.engine.service import TrainingService
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import DatumArrays

    with tempfile.TemporaryDirectory() as data:
        svc = TrainingService(Settings(data_dir=Path(data)))
        svc.start()
        svc.wait_ready(300)
        wait = svc.futures.wait_sync
        sess = svc.create_session("bench")
        spec = svc.checks.lora_spec(8)
        rec = svc.create_model(
            "bench",
            session_id=sess.session_id,
            model_seq_id=0,
            base_model=None,
            spec=spec,
            seed=0,
            user_metadata=None,
            idem=None,
        )
        wait(rec)
        run_id = rec.result["model_id"]
        params = svc.checks.sampling_params({"max_tokens": tokens, "temperature": 1.0, "stop": []})
        seq = 1
        times = []
        for step in range(steps + 1):
            t0 = time.perf_counter()
            snap = svc.save_for_sampler("bench", run_id, seq, None, step, None, None)
            seq += 1
            wait(snap)
            sampler = snap.result["sampling_session_id"]
            recs = [
                svc.sample(
                    "bench",
                    sampler_id=sampler,
                    prompt=p,
                    num_samples=GROUP,
                    params=params,
                    prompt_logprobs=False,
                    topk_prompt_logprobs=0,
                    topk_sample_logprobs=0,
                    idem=None,
                )
                for p in PROMPTS
            ]
            data = []
            for p, r in zip(PROMPTS, recs, strict=True):
                wait(r)
                seqs = [{"tokens": s.tokens, "logprobs": s.logprobs} for s in r.result.sequences]
                for toks, tgt, q, adv in rl_datums(p, seqs):
                    data.append(
                        DatumArrays(
                            np.array(toks),
                            {
                                "target_tokens": np.array(tgt),
                                "logprobs": np.array(q, np.float32),
                                "advantages": np.array(adv, np.float32),
                            },
                        )
                    )
            fb = svc.forward_backward("bench", run_id, seq, data, "importance_sampling", {}, False, None)
            opt = svc.optim_step("bench", run_id, seq + 1, AdamParams(learning_rate=1e-4), None)
            seq += 2
            wait(fb)
            wait(opt)
            assert fb.error is None and opt.error is None, (fb.error, opt.error)
            if step:  # the first step warms up
                times.append(time.perf_counter() - t0)
        svc.stop()
    return times


def over_http(tokens: int, steps: int) -> list[float]:
    from openrl_jupyter.local import start_service

    service = start_service(auth=False, timeout_s=120)
    try:
        return sdk_steps(service.url, tokens, steps)
    finally:
        service.stop()


def sdk_steps(url: str, tokens: int, steps: int) -> list[float]:
    """Seconds per RL step through the Tinker SDK against ``url`` (the first, warm-up, left out)."""
    import tinker
    from tinker import types

    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0).result()
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0, stop=[])
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client().result()
        futs = [sampler.sample(types.ModelInput.from_ints(p), GROUP, params) for p in PROMPTS]
        datums = []
        for p, f in zip(PROMPTS, futs, strict=True):
            seqs = [{"tokens": s.tokens, "logprobs": s.logprobs} for s in f.result().sequences]
            for toks, tgt, q, adv in rl_datums(p, seqs):
                datums.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(toks),
                        loss_fn_inputs={"target_tokens": tgt, "logprobs": q, "advantages": adv},
                    )
                )
        fb = tc.forward_backward(datums, "importance_sampling")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        if step:
            times.append(time.perf_counter() - t0)
    sc.close("success").result()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    engine = statistics.median(in_process(args.tokens, args.steps))
    http = statistics.median(over_http(args.tokens, args.steps))
    print(
        f"one RL step, openrl/tiny, 64 sequences x {args.tokens} sampled tokens, median of {args.steps} (s/step)"
    )
    print(f"{'in-process engine':>18} {'SDK over HTTP':>14} {'API overhead':>13}")
    print(f"{engine:>18.3f} {http:>14.3f} {100 * (http / engine - 1):>12.1f}%")


if __name__ == "__main__":
    main()
