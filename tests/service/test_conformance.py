"""The unmodified Tinker SDK drives the service through the reference conformance script."""

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ALICE_KEY, TINY

SCRIPT = Path(__file__).parents[1] / "_support" / "tinker_conformance.py"


def test_tinker_sdk_conformance_script_passes(server):
    env = {**os.environ, "TINKER_API_KEY": ALICE_KEY, "TINKER_TELEMETRY": "0"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), server.url, TINY], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "PASS"
    assert sum(line.startswith("ok  ") for line in lines) == 15
