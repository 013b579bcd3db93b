"""Run one of the project's scripts (a benchmark's short mode, a check) as a user would, from the repo root."""

from __future__ import annotations

import json
import subprocess
import sys
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


def short_mode(script: str, out: Path, *, timeout_s: float) -> tuple[subprocess.CompletedProcess, dict]:
    """``python bench/<script> --short --out <out>`` as a user runs it: the process and the JSON
    results it wrote (their absence fails the test with the script's output)."""
    proc = run_script(
        [sys.executable, str(ROOT / "bench" / script), "--short", "--out", str(out)], timeout_s=timeout_s
    )
    assert out.exists(), failure(proc)
    return proc, json.loads(out.read_text())
