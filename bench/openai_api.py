"""What the OpenAI-compatible endpoint costs next to Tinker sampling of the same checkpoint, and what
sampling costs while a training run shares the service.

Same service (`openrl-service serve`, the tiny model, on loopback), same checkpoint, same seeded requests:
``--samples`` completions of up to ``--tokens`` tokens for one prompt, through

- the Tinker SDK (``SamplingClient.sample``: protobuf, a future, long-poll), and
- the ``openai`` SDK (``completions.create(n=...)``: one JSON request held open),

alternating, ``--reps`` times each after a warm-up; then the same two while a Tinker SDK training loop
runs beside them (what packing interleaves). Not a test: it prints a ratio table.

    python bench/openai_api.py [--samples 8] [--tokens 64] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()

    import openai
    import tinker
    from tinker import types

    from openrl_jupyter.local import start_service

    svc = start_service(api_key="tml-bench-openai-0123456789")
    try:
        sc = tinker.ServiceClient(base_url=svc.url, api_key=svc.key)
        tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=1).result()
        path = tc.save_weights_for_sampler("bench").result().path
        sampler = sc.create_sampling_client(model_path=path)
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.key, max_retries=0)
        prompt = list(b"Once upon a time")

        def via_tinker(seed: int) -> int:
            out = sampler.sample(
                types.ModelInput.from_ints(prompt),
                a.samples,
                types.SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=seed),
            ).result()
            return sum(len(s.tokens) for s in out.sequences)

        def via_openai(seed: int) -> int:
            out = client.completions.create(
                model=path, prompt=prompt, n=a.samples, max_tokens=a.tokens, temperature=1.0, seed=seed
            )
            return out.usage.completion_tokens

        def measure() -> dict[str, tuple[float, float]]:
            times: dict[str, list[float]] = {"tinker": [], "openai": []}
            tokens: dict[str, int] = {"tinker": 0, "openai": 0}
            for fn in (via_tinker, via_openai):  # warm-up
                fn(0)
            for rep in range(a.reps):
                for name, fn in (("tinker", via_tinker), ("openai", via_openai)):
                    t0 = time.perf_counter()
                    tokens[name] += fn(rep + 1)
                    times[name].append(time.perf_counter() - t0)
            return {k: (statistics.median(v), tokens[k] / sum(v)) for k, v in times.items()}

        idle = measure()
        stop = threading.Event()
        steps = [0]

        def train() -> None:
            seq = list(b"Once upon a time there was a cat")
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
            )
            trainer = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=2).result()
            while not stop.is_set():
                trainer.forward_backward([datum] * 8, "cross_entropy").result()
                trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                steps[0] += 1

        worker = threading.Thread(target=train, daemon=True)
        worker.start()
        busy = measure()
        stop.set()
        worker.join(60)
        print(
            f"\n{a.samples} samples x up to {a.tokens} tokens per request, median of {a.reps} (openrl/tiny):\n"
        )
        print(
            "| while | Tinker SDK (ms) | OpenAI SDK (ms) | OpenAI / Tinker | tokens/s Tinker | tokens/s OpenAI |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for label, r in (("idle", idle), (f"a run trains beside ({steps[0]} steps)", busy)):
            (tt, tr), (ot, orate) = r["tinker"], r["openai"]
            print(f"| {label} | {tt * 1e3:.1f} | {ot * 1e3:.1f} | {ot / tt:.2f} | {tr:.0f} | {orate:.0f} |")
        sc.close("success").result()
    finally:
        svc.stop()


if __name__ == "__main__":
    main()
