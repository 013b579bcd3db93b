"""The repository tracks no symbolic links: a clean clone must build from files alone (a worktree's link
to another checkout's build output, committed by mistake, broke `make venv` on a fresh clone)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_tracked_symlinks():
    try:
        out = subprocess.run(
            ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:  # a source tree without git (an sdist)
        pytest.skip(f"not a git checkout: {e}")
    links = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith("120000 ")]
    assert links == [], f"tracked symbolic links: {links}"
