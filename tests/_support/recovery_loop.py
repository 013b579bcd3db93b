"""An SFT-then-RL loop through the unmodified Tinker SDK, for the crash-recovery tests.

    python tests/_support/recovery_loop.py URL OUT.json [--sft N] [--rl N] [--checkpoint-at K]

Everything is seeded (the LoRA init, every sampling call), so two runs of it against services with
fusion off train bit-identical adapters, whether or not the service was killed and restarted on
the way. It saves a ``weights`` checkpoint (``save_state``) after RL step ``--checkpoint-at`` and at
the end (``final``), and writes {"means", "sft_losses", "final_path", "model_id"} to OUT.json. The
SDK's own retries carry it through a restart (TINKER_API_KEY in the environment); it prints
``ready <model_id>`` once its training client exists.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tinker_rl_letters import PROMPTS, decode, letter_fraction, rl_datum  # noqa: E402


def sft_datum(text: str):
    from tinker import types

    ids = list(text.encode())
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("out", type=Path)
    p.add_argument("--sft", type=int, default=2)
    p.add_argument("--rl", type=int, default=4)
    p.add_argument("--checkpoint-at", type=int, default=1)
    args = p.parse_args()

    import tinker
    import tinker._client
    from tinker import types

    # The SDK gives a request 10 tries (~60 s of backoff capped at 10 s) and ServiceClient has no
    # option for more. The test kills the service five times, at times seconds apart while the
    # notebook Run drives the crash points, so one request may have to ride through several restarts:
    # the same retry loop, with more tries.
    tinker._client.AsyncTinker.__init__.__kwdefaults__["max_retries"] = 1_000
    service = tinker.ServiceClient(base_url=args.url)
    tc = service.create_lora_training_client(base_model="openrl/tiny", rank=4, seed=7).result()
    print(f"ready {tc.model_id}", flush=True)
    sft_losses = []
    for step in range(args.sft):
        data = [sft_datum(f"{p} letters only") for p in PROMPTS[:4]]
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sft_losses.append(out.metrics.get("loss:sum", 0.0))
        print(f"sft {step} loss {sft_losses[-1]:.4f}", flush=True)
    prompts = [list(p.encode()) for p in PROMPTS[:4]]
    means = []
    for step in range(args.rl):
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1_000 + step)
        futures = [sampler.sample(types.ModelInput.from_ints(p), 4, params) for p in prompts]
        datums, rewards = [], []
        for prompt, fut in zip(prompts, futures, strict=True):
            seqs = fut.result().sequences
            group = [letter_fraction(decode(s.tokens)) for s in seqs]
            rewards += group
            mean = statistics.fmean(group)
            datums += [
                rl_datum(prompt, s.tokens, s.logprobs, r - mean)
                for s, r in zip(seqs, group, strict=True)
                if r != mean and s.tokens
            ]
        if datums:
            tc.forward_backward(datums, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        means.append(statistics.fmean(rewards))
        print(f"rl {step} reward {means[-1]:.3f}", flush=True)
        if step == args.checkpoint_at:
            tc.save_state(f"rl-{step}").result()
    final = tc.save_state("final").result().path
    args.out.write_text(
        json.dumps({"means": means, "sft_losses": sft_losses, "final_path": final, "model_id": tc.model_id})
    )
    service.close("success").result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
