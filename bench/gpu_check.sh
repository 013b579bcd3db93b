#!/usr/bin/env bash
# bench/gpu_check.sh: the packing benchmark (bench/packing.py) on a lent GPU machine, in < 5 minutes.
#
# Usage. 1) HERE, once per session (needs the internet; ~9 MiB): fetch the cp312 wheels the device
# image lacks (fastapi, starlette, pydantic(-core), uvicorn, orjson, zstandard, httpx-sse, ...) into
# .whl/ (ignored through .git/info/exclude):
#
#     bench/gpu_wheels.sh                      # or: bench/gpu_check.sh --fetch
#
# 2) On the GPU machine, through the `device` tool (a task that is lent one; `status` says):
#
#     run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=330)
#
# The script keeps its own deadline (GPU_CHECK_DEADLINE_S, default 285 s: a rerun fits in the 15
# device-minutes, start included); what it writes to $OUT comes back (<= 8 files): gpu_check.log
# (everything printed), packing.json (bench/packing.py's JSON, with "GPU util (NVML)" per phase),
# nvidia-smi.txt (before and after), model.json (the random model's config and build time),
# versions.txt. Without $OUT they go to bench/results/gpu_check/.
#
# 3) Here, without a GPU (the plumbing only; ~1 min on 2 cores): `bench/gpu_check.sh --cpu-smoke`
# uses .venv's python, device cpu, a 2-layer hidden-64 Qwen2 and N = 1, 2 with 2 steps; no wheels.
#
# What it does: installs the carried wheels into /tmp/site (the device README's command), puts the
# working tree on PYTHONPATH (the project is not installed there), checks the imports and CUDA,
# prints nvidia-smi facts, builds a random-init Qwen2-style model folder on the GPU in bf16
# (GPU_CHECK_SIZE=0.5b: Qwen2.5-0.5B's shape, hidden 896, 24 layers, 14 heads, 2 KV heads,
# intermediate 4864, vocab 151936, tied embeddings; or 1.5b) with the tiny model's byte-level
# tokenizer (ids 0-255 are bytes, 4 specials; the model's larger vocabulary only means most sampled
# ids decode to no text, so rewards are ~0: throughput, not learning), then runs
# `bench/packing.py --model <folder> --device cuda` (N = 1, 2, 3 and 3 one after another, the fused
# measure on the same model) and prints its table and final `packing: ...` line.
#
# Environment: PYTHON (default python3; .venv/bin/python for --cpu-smoke), GPU_CHECK_SIZE (0.5b |
# 1.5b), GPU_CHECK_VOCAB (default 151936), GPU_CHECK_DEADLINE_S (285), GPU_CHECK_PACKING_ARGS
# (replaces the packing options below, e.g. "--runs 1 2 3 --steps 4 --seq-runs 0"); for trying the
# device path without a GPU: GPU_CHECK_DEVICE (default cuda), GPU_CHECK_WHEELS (default .whl).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

MODE=device
case "${1:-}" in
    "") ;;
    --cpu-smoke) MODE=cpu-smoke ;;
    --fetch) exec bash "$ROOT/bench/gpu_wheels.sh" ;;
    -h | --help)
        sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "usage: bench/gpu_check.sh [--cpu-smoke | --fetch | --help]" >&2
        exit 2
        ;;
esac

DEADLINE_S="${GPU_CHECK_DEADLINE_S:-285}"
if [ "$MODE" = cpu-smoke ]; then
    PY="${PYTHON:-$ROOT/.venv/bin/python}"
    DEVICE=cpu
    SIZE=smoke
    OUTDIR="${OUT:-$ROOT/bench/results/gpu_check-smoke}"
    PACKING_ARGS="${GPU_CHECK_PACKING_ARGS:---runs 1 2 --steps 2 --ramp 0 --calib-steps 2 --seq-runs 2 --prompts 2 --group 2 --max-tokens 8 --fused-repeats 1}"
else
    PY="${PYTHON:-python3}"
    DEVICE="${GPU_CHECK_DEVICE:-cuda}"
    SIZE="${GPU_CHECK_SIZE:-0.5b}"
    OUTDIR="${OUT:-$ROOT/bench/results/gpu_check}"
    PACKING_ARGS="${GPU_CHECK_PACKING_ARGS:---runs 1 2 3 --steps 6 --calib-steps 3 --seq-runs 3 --fused-repeats 3}"
fi
mkdir -p "$OUTDIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

stage() { echo "== [$((SECONDS))s] $*"; }
fail() {
    echo "gpu_check: FAILED after $((SECONDS)) s: $*"
    exit 1
}

main() {
    stage "gpu_check ($MODE) on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ); deadline ${DEADLINE_S} s"

    # -- 1. the carried wheels ----------------------------------------------------------------
    local whl="${GPU_CHECK_WHEELS:-.whl}" wheels
    wheels="$(ls "$whl"/*.whl 2>/dev/null | wc -l)"
    if [ "$MODE" = cpu-smoke ]; then
        stage "wheels: install skipped (cpu-smoke: $PY has the packages); $whl/ holds $wheels wheels"
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    else
        if [ "$wheels" -gt 0 ]; then
            stage "wheels: installing $wheels from $whl/ into /tmp/site"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site "$whl"/*.whl || fail "pip install of the carried wheels"
            export PYTHONPATH="/tmp/site:$ROOT"
        else
            echo "gpu_check: no .whl/ here: run bench/gpu_wheels.sh on the dev machine and carry [\".whl\"]"
            export PYTHONPATH="$ROOT"
        fi
    fi

    # -- 2. imports, versions, CUDA -------------------------------------------------------------
    stage "imports ($PY)"
    "$PY" - "$DEVICE" >"$OUTDIR/versions.txt" <<'PYEOF' || { cat "$OUTDIR/versions.txt"; fail "imports"; }
import importlib, importlib.metadata as md, os, platform, sys
print(f"python {platform.python_version()} ({sys.executable})")
for mod, dist in [("torch", "torch"), ("transformers", "transformers"), ("peft", "peft"),
                  ("tokenizers", "tokenizers"), ("safetensors", "safetensors"), ("numpy", "numpy"),
                  ("fastapi", "fastapi"), ("starlette", "starlette"), ("pydantic", "pydantic"),
                  ("uvicorn", "uvicorn"), ("orjson", "orjson"), ("zstandard", "zstandard"),
                  ("httpx", "httpx"), ("httpx_sse", "httpx-sse"), ("platformdirs", "platformdirs"),
                  ("prometheus_client", "prometheus-client"), ("google.protobuf", "protobuf"),
                  ("pynvml", "nvidia-ml-py")]:
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # peft and pynvml are optional for the bench; the rest is not
        print(f"{dist}: MISSING ({type(e).__name__}: {e})")
        if mod not in ("peft", "pynvml"):
            sys.exit(1)
        continue
    try:
        v = md.version(dist)
    except md.PackageNotFoundError:
        v = getattr(m, "__version__", "?")
    f = m.__file__ or "?"
    print(f"{dist} {v} ({os.path.dirname(os.path.dirname(f)) if f.endswith('__init__.py') else f})")
import openrl_service.app  # noqa: F401 - the service's whole import graph
import openrl_jupyter.client  # noqa: F401 - what the bench clients use
import torch
print(f"torch.cuda: available={torch.cuda.is_available()} cuda={torch.version.cuda}"
      + (f" device={torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    print("CUDA is not available to torch")
    sys.exit(1)
PYEOF
    cat "$OUTDIR/versions.txt"

    # -- 3. nvidia-smi facts --------------------------------------------------------------------
    local q="name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,clocks.sm,clocks.max.sm,power.draw,power.limit"
    if command -v nvidia-smi >/dev/null; then
        stage "nvidia-smi"
        {
            echo "# before the bench"
            nvidia-smi --query-gpu="$q" --format=csv
            nvidia-smi -L
        } | tee "$OUTDIR/nvidia-smi.txt"
    else
        stage "nvidia-smi: not found ($MODE)"
        echo "no nvidia-smi ($MODE)" >"$OUTDIR/nvidia-smi.txt"
    fi

    # -- 4. the random-init model folder ------------------------------------------------------
    local model_dir="$WORK/qwen2-$SIZE-random"
    stage "model: random-init Qwen2 ($SIZE) on $DEVICE -> $model_dir"
    "$PY" - "$model_dir" "$SIZE" "$DEVICE" "${GPU_CHECK_VOCAB:-}" "$OUTDIR/model.json" <<'PYEOF' || fail "model build"
import json, os, sys, time
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

transformers.utils.logging.disable_progress_bar()

from openrl_service.models.tiny import SPECIAL_TOKENS, build_tiny_model

out, size, device, vocab, info_path = sys.argv[1:6]
SHAPES = {  # Qwen2.5-0.5B and -1.5B; "smoke" for the CPU plumbing check
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=4096),
}
shape = dict(SHAPES[size])
if vocab:
    shape["vocab_size"] = int(vocab)
t0 = time.time()
# The tiny model's folder gives the byte-level tokenizer (ids 0-255 = bytes, then 4 specials);
# its config and weights are replaced below.
build_tiny_model(out)
for name in ("config.json", "generation_config.json", "model.safetensors"):
    Path(out, name).unlink(missing_ok=True)
endoftext, _im_start, im_end, pad = range(256, 256 + len(SPECIAL_TOKENS))
assert shape["vocab_size"] >= 256 + len(SPECIAL_TOKENS)
config = Qwen2Config(
    **shape, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0,
    rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=im_end, pad_token_id=pad,
)
config.architectures = ["Qwen2ForCausalLM"]
dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
torch.manual_seed(0)
with torch.device(device):
    model = Qwen2ForCausalLM(config).to(dtype)  # initialised where it lives: seconds on a GPU
model.generation_config = GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=pad)
t1 = time.time()
model.save_pretrained(out, safe_serialization=True)
if device.startswith("cuda"):
    torch.cuda.synchronize()
t2 = time.time()
params = sum(p.numel() for p in model.parameters())
files = {p.name: p.stat().st_size for p in sorted(Path(out).iterdir())}
info = {"size": size, "device": device, "dtype": str(dtype), "params": params, "shape": shape,
        "init_s": round(t1 - t0, 2), "save_s": round(t2 - t1, 2), "files": files,
        "config": json.loads(Path(out, "config.json").read_text())}
Path(info_path).write_text(json.dumps(info, indent=1))
print(f"model: {params / 1e6:.1f} M parameters ({dtype}), init {t1 - t0:.1f} s, save {t2 - t1:.1f} s, "
      f"{sum(files.values()) / 2**20:.0f} MiB in {out}")
PYEOF

    # -- 5. the packing bench --------------------------------------------------------------------
    local remain=$((DEADLINE_S - SECONDS - 5))
    [ "$remain" -gt 30 ] || fail "only $remain s left for the bench"
    stage "bench: packing.py --model $model_dir --device $DEVICE $PACKING_ARGS (limit $remain s)"
    # shellcheck disable=SC2086 # PACKING_ARGS is a list of options
    timeout --signal=TERM --kill-after=20 "$remain" "$PY" bench/packing.py --model "$model_dir" \
        --device "$DEVICE" $PACKING_ARGS --out "$OUTDIR/packing.json"
    local rc=$?
    if command -v nvidia-smi >/dev/null; then
        { echo "# after the bench"; nvidia-smi --query-gpu="$q" --format=csv; } | tee -a "$OUTDIR/nvidia-smi.txt"
    fi
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        fail "bench/packing.py ran past $remain s (the phases it finished are printed above)"
    fi
    [ "$rc" -eq 0 ] || fail "bench/packing.py exited $rc"
    "$PY" - "$OUTDIR/packing.json" <<'PYEOF' || fail "packing.json"
import json, sys
r = json.load(open(sys.argv[1]))
gpu = r["machine"].get("gpu")
print(f"gpu_check: {r['service']['readyz'].get('model')} on {r['service']['readyz'].get('device')}"
      + (f" ({gpu.get('name') or gpu.get('torch_name')})" if gpu else "")
      + f", fusion {r['service']['fusion']}, N = {sorted(int(n) for n in r['by_n'])}, "
      f"fused {r['fused']['speedup']:.2f}x on {r['fused'].get('device')}")
for n, row in sorted(r["by_n"].items(), key=lambda kv: int(kv[0])):
    g = row.get("gpu_util_nvml")
    w = g["window"] if g else None
    print(f"  N={n}: duty {row['duty']:.2f} speedup {row['speedup']:.2f}x"
          + (f", GPU util (NVML) {w['util_mean']:.0%} mean / {w['util_max']:.0%} max, "
             f"{w['memory_used_max_bytes'] / 2**30:.1f} GiB used" if w and w["samples"] else ""))
PYEOF
    stage "gpu_check: done in $((SECONDS)) s (deadline $DEADLINE_S s); files in $OUTDIR: $(ls "$OUTDIR" | tr '\n' ' ')"
}

main 2>&1 | tee "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
