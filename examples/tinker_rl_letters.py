"""A minimal GRPO-style RL loop through the unmodified Tinker SDK: teach a model to answer in letters.

The reward is the fraction of letters in the completion. Each step samples a group of completions
per prompt from the current weights, scores them here on the client, turns rewards into
group-relative advantages and sends one importance-sampling forward/backward plus an AdamW step.

    python examples/tinker_rl_letters.py --base-url http://127.0.0.1:8000 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

PROMPTS = [
    "Name a colour:",
    "Say hello:",
    "Write a word:",
    "Your favourite animal:",
    "A city you like:",
    "Describe the sky:",
    "One fruit, please:",
    "Greet the reader:",
]


def letter_fraction(text: str) -> float:
    """The reward: how much of the completion is letters (0 for an empty one)."""
    return sum(c.isalpha() for c in text) / max(1, len(text))


def decode(tokens: list[int]) -> str:
    """openrl/tiny's token ids are byte values below 256; specials (stop tokens) carry no text."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def rl_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float):
    """One importance-sampling datum: the prompt carries no loss; every completion token carries its
    sampler logprob and the completion's advantage."""
    from tinker import types

    full = prompt + list(tokens)
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt + list(logprobs),
            "advantages": [0.0] * n_prompt + [advantage] * len(tokens),
        },
    )


def run(
    base_url: str,
    *,
    steps: int,
    group: int = 8,
    batch: int = 8,
    lr: float | None = None,
    rank: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    log=print,
) -> list[float]:
    """Train for ``steps`` steps; returns the mean reward of each step."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url)
    rest = tinker.RestClient(base_url=base_url)
    model = rest.get_server_capabilities().result().supported_models[0]
    defaults = getattr(model, "defaults", None) or (model.model_extra or {}).get("defaults", {})
    rank = rank or defaults.get("lora_rank", 8)
    lr = lr or defaults.get("learning_rate", 1e-3)
    max_tokens = max_tokens or defaults.get("max_tokens", 16)
    tc = service.create_lora_training_client(base_model=model.model_name, rank=rank, seed=seed).result()
    prompts = [list(p.encode()) for p in PROMPTS[:batch]]
    means = []
    for step in range(steps):
        t0 = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=seed * 100_003 + step * 1_009
        )
        futures = [sampler.sample(types.ModelInput.from_ints(p), group, params) for p in prompts]
        datums, rewards = [], []
        for prompt, fut in zip(prompts, futures, strict=True):
            seqs = fut.result().sequences
            group_rewards = [letter_fraction(decode(s.tokens)) for s in seqs]
            rewards += group_rewards
            mean = statistics.fmean(group_rewards)
            for s, r in zip(seqs, group_rewards, strict=True):
                adv = r - mean
                if adv == 0 or not s.tokens:
                    continue
                datums.append(rl_datum(prompt, s.tokens, s.logprobs, adv))
        if datums:
            tc.forward_backward(datums, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        means.append(statistics.fmean(rewards))
        log(f"step {step:3d}  reward {means[-1]:.3f}  ({time.perf_counter() - t0:.2f} s)")
    service.close("success").result()
    return means


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    means = run(args.base_url, steps=args.steps, seed=args.seed)
    k = min(5, len(means))
    a, b = statistics.fmean(means[:k]), statistics.fmean(means[-k:])
    print(f"mean reward {a:.2f} -> {b:.2f} over {len(means)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
