"""bench/gpu_check.sh --cpu-smoke: the GPU check's plumbing end to end on the CPU.

A random-init 2-layer Qwen2 folder (the tiny model's byte tokenizer, a larger vocabulary), the service
serving it (``bench/packing.py --model ... --device cpu``), N = 1 and 2, the JSON and the log in $OUT.
No GPU here, so no "GPU util (NVML)" column; speed is not asserted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest

from tests._support.scripts import ROOT, failure, run_script

LINE = re.compile(
    r"^packing: runs=\d+ duty=\d+\.\d\d speedup=\d+\.\d\d bound=\d+\.\d\d slowdown=\d+\.\d\d "
    r"fairness=\d+\.\d\d fused=\d+\.\d$",
    re.MULTILINE,
)


@pytest.mark.skipif(shutil.which("bash") is None or sys.platform == "win32", reason="needs bash")
@pytest.mark.timeout(300)  # ~1 min on an idle 2-core machine
def test_gpu_check_cpu_smoke(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("GPU_CHECK_PACKING_ARGS", None)
    proc = run_script(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu-smoke"], timeout_s=280, env=env)
    assert proc.returncode == 0, failure(proc, 4000)
    assert LINE.search(proc.stdout), proc.stdout[-2000:]
    assert "gpu_check: done in" in proc.stdout

    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"gpu_check.log", "packing.json", "nvidia-smi.txt", "model.json", "versions.txt"}
    assert LINE.search((tmp_path / "gpu_check.log").read_text())

    model = json.loads((tmp_path / "model.json").read_text())
    assert model["size"] == "smoke" and model["config"]["vocab_size"] == 4096

    result = json.loads((tmp_path / "packing.json").read_text())
    assert set(result["by_n"]) == {"1", "2"}
    assert result["service"]["readyz"]["device"] == "cpu"
    assert result["service"]["readyz"]["model"] == "qwen2-smoke-random"
    assert result["params"]["model"].endswith("qwen2-smoke-random")
    assert result["fused"]["device"] == "cpu" and result["fused"]["model"] == "qwen2-smoke-random"
    assert all("gpu_util_nvml" not in row for row in result["by_n"].values())  # no GPU here
    assert len(result["sequential"]["runs"]) == 2
