#!/usr/bin/env bash
# Fetch, HERE (a machine with pip and the internet), the cp312 manylinux x86_64 wheels that the GPU
# machine's image lacks for `openrl-service serve` + bench/packing.py, into .whl/ (ignored through
# .git/info/exclude; the `device` tool's `run` carries it with carry [".whl"]).
#
#     bench/gpu_wheels.sh            # then: bench/gpu_check.sh's header says how to run it there
#
# The device image (/work/.library/device/KINDS.md, "Python packages already there") has python3 =
# 3.12 with torch, transformers, peft, safetensors, tokenizers, numpy, protobuf, prometheus-client,
# nvidia-ml-py, httpx, httpcore, h11, click, idna, certifi. Missing there: fastapi and its needs
# (starlette, pydantic, pydantic-core, annotated-types, typing-inspection, opentelemetry-api),
# uvicorn, orjson, zstandard, platformdirs, httpx-sse, tenacity, pydantic-settings (+ python-dotenv). Also carried, because the pydantic-core /
# anyio versions below need newer ones than an older image may hold: typing-extensions, anyio,
# annotated-doc (pure Python, small). The notebook side's ipython/ipywidgets/anywidget/plotly are NOT
# needed: `openrl_jupyter.client` imports without them (magics/dashboard import them lazily).
#
# Versions: those installed in this checkout's .venv (what the tests run), so there is exactly one
# version of each. The project itself is not a wheel: the working tree travels and PYTHONPATH=<repo>.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV_PY="${VENV_PY:-$ROOT/.venv/bin/python}"
PIP_PY="${PIP_PY:-python3}"

PACKAGES=(
    fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection
    typing-extensions opentelemetry-api anyio uvicorn orjson zstandard platformdirs httpx-sse tenacity
    pydantic-settings python-dotenv
)

exclude="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)" # a worktree too
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

rm -rf .whl
mkdir -p .whl
specs=()
for name in "${PACKAGES[@]}"; do
    version="$("$VENV_PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")"
    specs+=("$name==$version")
done
echo "gpu_wheels: ${specs[*]}"

# The device README's command form; manylinux_2_N for N it does not list is added below only if a
# wheel is not found with these.
PLATFORMS=(
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)
for spec in "${specs[@]}"; do
    if ! "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d .whl "$spec"; then
        echo "gpu_wheels: retrying $spec with more manylinux_2_N tags" >&2
        more=()
        for n in 24 31 34 35 39; do more+=(--platform "manylinux_2_${n}_x86_64"); done
        "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${PLATFORMS[@]}" "${more[@]}" -d .whl "$spec"
    fi
done

# One wheel per package, none for another Python.
count="$(ls .whl/*.whl | wc -l)"
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
    echo "gpu_wheels: expected ${#PACKAGES[@]} wheels, got $count:" >&2
    ls .whl >&2
    exit 1
fi
if ls .whl/*.whl | grep -E -- '-cp3(1[013]|[0-9])-cp3' >/dev/null; then
    echo "gpu_wheels: a wheel for another CPython:" >&2
    ls .whl | grep -E -- '-cp3(1[013]|[0-9])-cp3' >&2
    exit 1
fi
ls -l .whl | awk 'NR > 1 {printf "  %8.0f KiB  %s\n", $5 / 1024, $9}'
echo "gpu_wheels: $count wheels, $(du -sh .whl | cut -f1) in .whl/"
