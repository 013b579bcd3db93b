"""Run one of the project's scripts (a benchmark's short mode, a check) as a user would, from the repo root."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(argv: list[str], *, timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``argv`` run in the repository root with captured text output; its stdout is printed so a
    failing test's log shows the script's tables."""
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(proc.stdout)
    return proc


def failure(proc: subprocess.CompletedProcess, chars: int = 3000) -> str:
    """The tail of a script's output, for an assertion message."""
    return f"exit {proc.returncode}\n{proc.stdout[-chars:]}\n{proc.stderr[-chars:]}"
