#!/usr/bin/env bash
# bench/gpu_check.sh: the GPU check (bench/gpu_check.py) under a hard timeout, in < 5 minutes.
#
# What it measures, on a random-init Qwen2.5-0.5B-shaped bf16 model built from a config (no
# download) with the project's own torch code paths: the fused vs per-run training step (Trainer),
# torch sampler tokens/s (TorchSampler, 8 prompts x 8 samples x 64 tokens), torch sampler vs trainer
# logprob agreement (mean / max |delta|), adapter snapshot save + load (as the service, then PEFT),
# packing of N = 1..3 concurrent RL runs on a served copy (bench/packing.py: engine duty, speedup vs
# the bound), and NVML ticks (telemetry.NvmlReader) per section. Sections have their own time
# budgets and fail independently; bench/gpu_check.py's docstring has the details.
#
# On a lent GPU machine (the `device` tool's run, from the repository root; `make gpu-check` does
# the same where make and a GPU are):
#
#     run(command="bash bench/gpu_check.sh", timeout_s=320)
#
# That machine has torch, transformers, peft and nvidia-ml-py but not fastapi/uvicorn/orjson/...:
# the packing section is then skipped with a line naming what is missing, and the rest runs. To
# measure packing too, first fetch those wheels HERE (`bench/gpu_wheels.sh`, or this script with
# --fetch; needs the internet, ~9 MiB into the ignored .whl/) and add carry=[".whl"] to the run:
# this script installs them into /tmp/site before the check.
#
# Several GPUs (one machine with N of them; the machines lent here have one at most, so this has not run
# here): `bench/gpu_check.sh --gpus N` runs bench/devices.py: `serve` at world size 1 against
# `--world-size N --devices cuda:0..N-1` (NCCL), s/step, the memory a full run adds per rank and the
# largest loss difference, then (vLLM installed) greedy samples of one adapter at vLLM TP 1 against
# TP N. It needs the service's own dependencies (fastapi, uvicorn, tinker...): the repo's venv.
#
# Here, without a GPU: `bench/gpu_check.sh --smoke` runs every section on the CPU with tiny sizes
# (.venv's python, a 2-layer hidden-64 Qwen2); its figures say nothing about performance.
#
# Output: the table on stdout; in $OUT (the device tool copies it back), else bench/results/:
# gpu_check.json (written after each section), gpu_check-packing.json (bench/packing.py's JSON),
# gpu_check.log (everything printed) and nvidia-smi.txt (before and after).
#
# Environment: PYTHON (default python3; .venv/bin/python for --smoke), GPU_CHECK_TIMEOUT_S (the hard
# limit, default 270; smoke 260), GPU_CHECK_WHEELS (default .whl). Other options go to gpu_check.py
# (e.g. --vocab 32768, --only sampler agreement, --packing-args "--runs 1 2 3 --steps 4").
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

MODE=gpu
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) MODE=smoke ;;
        --gpus)  # several GPUs: bench/devices.py (world size 1 vs N with NCCL, vLLM TP 1 vs TP N)
            shift
            exec timeout "${GPU_CHECK_TIMEOUT_S:-1200}" "${PYTHON:-python3}" "$ROOT/bench/devices.py" --gpus "$1" \
                --json "${OUT:-$ROOT/bench/results}/devices.json"
            ;;
        --fetch) exec bash "$ROOT/bench/gpu_wheels.sh" ;;
        -h | --help)
            sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *) ARGS+=("$1") ;;
    esac
    shift
done

if [ "$MODE" = smoke ]; then
    PY="${PYTHON:-$ROOT/.venv/bin/python}"
    TOTAL_S="${GPU_CHECK_TIMEOUT_S:-260}"
    ARGS=(--smoke "${ARGS[@]}")
else
    PY="${PYTHON:-python3}"
    TOTAL_S="${GPU_CHECK_TIMEOUT_S:-270}"
fi
OUTDIR="${OUT:-$ROOT/bench/results}"
mkdir -p "$OUTDIR" || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

smi() {
    if command -v nvidia-smi >/dev/null; then
        {
            echo "# $1"
            nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,clocks.sm,power.draw --format=csv
        } 2>&1 | tee -a "$OUTDIR/nvidia-smi.txt"
    else
        echo "# $1: no nvidia-smi on this machine" | tee -a "$OUTDIR/nvidia-smi.txt"
    fi
}

main() {
    echo "== gpu_check.sh ($MODE) on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ); hard limit $TOTAL_S s; python $PY"
    : >"$OUTDIR/nvidia-smi.txt"
    local whl="${GPU_CHECK_WHEELS:-.whl}" wheels
    wheels="$(ls "$whl"/*.whl 2>/dev/null | wc -l)"
    if [ "$MODE" = gpu ] && [ "$wheels" -gt 0 ]; then
        echo "== installing $wheels carried wheels from $whl/ into /tmp/site"
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$whl"/*.whl; then
            export PYTHONPATH="/tmp/site:$PYTHONPATH"
        else
            echo "gpu_check.sh: installing the carried wheels failed; the sections that need them skip"
        fi
    elif [ "$MODE" = gpu ]; then
        echo "== no carried wheels ($whl/ is empty or absent): the packing section needs fastapi/uvicorn/..."
    fi
    smi "before the check"
    local left=$((TOTAL_S - SECONDS))
    echo "== bench/gpu_check.py ${ARGS[*]} (hard limit $left s)"
    timeout --signal=TERM --kill-after=15 "$left" "$PY" bench/gpu_check.py --deadline-s $((left - 20)) \
        --out "$OUTDIR" "${ARGS[@]}"
    local rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "gpu_check.sh: the python part ran past $left s and was stopped; $OUTDIR/gpu_check.json holds the sections it finished"
    fi
    smi "after the check"
    echo "== gpu_check.sh: exit $rc after $SECONDS s"
    return "$rc"
}

main 2>&1 | tee "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
