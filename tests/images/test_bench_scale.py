"""`bench/scale.py --short` against the service image (`make image-check`): three same-seed full fine-tunes
of openrl/scale-30m and two LoRA RL runs in the cpu overlay's container under a memory limit that holds
one full run, killed once half way through a spill and once half way through a journal snapshot. The
bench exits 0 only when nothing was OOM-killed, every step succeeded, every run took steps 1..N, each
kill was recovered, and the full runs' losses equal, bit for bit, those of a run never killed.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.images._containers import engine_or_skip, image_or_skip
from tests.k8s._k8s import ROOT

pytestmark = pytest.mark.timeout(420)
TIMEOUT_S = 330  # 1-2.5 min on a 2-core machine; the bench gives up on its own within ~5 min


def test_full_runs_take_turns_in_the_memory_limit_and_recover_exactly_from_kills(tmp_path):
    eng = engine_or_skip()
    image_or_skip(eng, "service-cpu")
    out = tmp_path / "scale.json"
    argv = [sys.executable, str(ROOT / "bench" / "scale.py"), "--short", "--out", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the bench removes its containers and data volume on its way out
        stdout, stderr = proc.communicate(timeout=60)
    print(stdout)
    logs = "".join(
        f"\n--- {p.name} (tail) ---\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-8000:]}\n{stderr[-3000:]}{logs}"
    assert out.exists()
