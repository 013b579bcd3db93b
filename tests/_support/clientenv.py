"""Client processes that reach the service the way a user's would: HF_ENDPOINT, HF_TOKEN, an empty HF_HOME.

``huggingface_hub`` reads HF_ENDPOINT once, at import, and the test process has long imported it (in
offline mode), so every check of the tokenizer mirror runs in a fresh interpreter: this venv's
(huggingface_hub 2.x, transformers 5.2x) or the cookbook venv's (huggingface_hub 1.x, transformers
<= 5.5.4, tinker-cookbook 0.5.8; ``make cookbook-venv``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK_PYTHON = Path(os.environ.get("OPENRL_COOKBOOK_PYTHON") or ROOT / ".venv-cookbook" / "bin" / "python")

# Variables of the test process that must not leak into a client: offline switches, caches, SDK targets.
_DROP = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_TOKEN_PATH",
    "HF_ENDPOINT",
    "HF_TOKEN",
    "TINKER_BASE_URL",
    "TINKER_API_KEY",
    "VIRTUAL_ENV",
    "PYTHONPATH",
)


def cookbook_python() -> str:
    if not COOKBOOK_PYTHON.is_file():
        pytest.skip(f"{COOKBOOK_PYTHON} is missing: run `make cookbook-venv` (make test does)")
    return str(COOKBOOK_PYTHON)


def client_env(url: str, key: str | None, hf_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's client process pointed at the service at ``url``."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    hf_home.mkdir(parents=True, exist_ok=True)
    env.update(
        HF_ENDPOINT=url,
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TINKER_TELEMETRY="0",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
    )
    if key is not None:
        env.update(HF_TOKEN=key, TINKER_API_KEY=key)
    env.update(extra)
    return env


def run_client(
    python: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [python, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-20000:] + "\n" + proc.stderr[-20000:])
    return proc
