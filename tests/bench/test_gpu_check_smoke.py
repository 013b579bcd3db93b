"""bench/gpu_check.sh --smoke: every section of the GPU check runs on the CPU and reports sane figures.

The script is meant for a lent GPU machine (a random-init Qwen2.5-0.5B-shaped bf16 model); ``--smoke``
runs the same code paths with a 2-layer hidden-64 Qwen2 on the CPU. Speed is never asserted (the
figures say nothing about performance); what is asserted is that each section ran and its numbers
are the kind a user reads: sampled token counts equal the workload, the torch sampler's logprobs agree
with the trainer's in float32, the adapter snapshot round-trips exactly (also through PEFT), packing
measured N = 1 and 2, and the tick thread ran in every long section.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time

import pytest

from tests._support.scripts import ROOT, failure, run_script
from tests.conftest import fake_pynvml

SECTIONS = ["env", "model", "load", "fused", "sampler", "agreement", "snapshot", "packing"]


@pytest.mark.skipif(shutil.which("bash") is None or sys.platform == "win32", reason="needs bash")
@pytest.mark.timeout(330)  # ~1 min on an idle 2-core machine; minutes on a crowded one
def test_gpu_check_smoke(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = run_script(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--smoke"], timeout_s=300, env=env)
    assert proc.returncode == 0, failure(proc, 4000)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "gpu_check.json",
        "gpu_check-packing.json",
        "gpu_check.log",
        "nvidia-smi.txt",
    }
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["mode"] == "smoke" and doc["device"] == "cpu" and doc["meaningful_as_performance"] is False
    sec = doc["sections"]
    assert list(sec) == SECTIONS
    assert {name: s["status"] for name, s in sec.items()} == dict.fromkeys(SECTIONS, "ok")
    r = {name: s["result"] for name, s in sec.items()}

    # env: the listing says what is importable
    assert r["env"]["modules"]["torch"] and r["env"]["project"]["openrl_service.app"] == "ok"
    # model and load: the random-init Qwen2 folder, loaded by the service's loader
    assert r["model"]["params"] > 100_000 and r["model"]["shape"]["vocab_size"] == 4096
    assert r["load"]["device"] == "cpu" and r["load"]["lora_targets"] > 0
    # fused vs per run: both timed, same work
    f = r["fused"]
    assert f["per_run_s"] > 0 and f["fused_s"] > 0 and f["tokens"] > 0 and f["runs"] == 3
    assert f["speedup"] == pytest.approx(f["per_run_s"] / f["fused_s"])
    # torch sampler: exactly prompts x samples x max_tokens (no stop token)
    s = r["sampler"]
    assert s["sampler"] == "torch sampler"
    assert s["generated_tokens"] == s["prompts"] * s["samples_per_prompt"] * s["max_tokens"] == 32
    assert s["tokens_per_s"] > 0
    # agreement: the same tokens, float32 on the CPU -> float rounding only (an off-by-one position
    # or another adapter would give differences of order 1)
    a = r["agreement"]
    assert a["tokens"] == s["generated_tokens"] and a["dtype"] == "float32"
    assert 0 <= a["mean_abs_delta"] <= a["max_abs_delta"] < 1e-3
    assert -20 < a["mean_sampler_logprob"] < 0
    # snapshot: saved and loaded as the service does, bit-exact; PEFT's loader gives the same logits
    snap = r["snapshot"]
    assert snap["how"].startswith("CheckpointStore")
    assert snap["roundtrip_max_abs_delta"] == 0 and snap["tensors"] > 0 and snap["adapter_bytes"] > 0
    assert snap["peft"]["max_abs_logit_delta_vs_service"] < 1e-4 < snap["peft"]["max_abs_logit"]
    # packing: N = 1 and 2 through a served copy of the model
    p = r["packing"]
    assert set(p["by_n"]) == {"1", "2"}
    for row in p["by_n"].values():
        assert 0 < row["duty"] <= 1.0 and row["speedup"] > 0 and row["bound"] >= 1.0
    assert p["by_n"]["1"]["speedup"] == pytest.approx(1.0) and p["by_n"]["2"]["bound"] <= 2.0
    assert json.loads((tmp_path / "gpu_check-packing.json").read_text())["params"]["device"] == "cpu"

    # ticks: no NVML on a CPU, so the labelled stand-in reader fed the tick path
    assert doc["nvml"]["source"] == "cpu stand-in" and "not NVML" in doc["nvml"]["label"]
    assert doc["nvml"]["ticks"] > 0 and sec["packing"]["ticks"]["ticks"] > 0

    # the table: one row per section, sampling figures labelled as the torch sampler's, none as vLLM
    out = proc.stdout
    assert all(f"\n{name:<10} ok" in out for name in SECTIONS), out[-3000:]
    assert "gpu_check: 8 sections: 8 ok, 0 skipped, 0 failed" in out
    assert "torch sampler: 2 prompts x 2 samples x 8 tokens = 32 tokens" in out
    assert "vllm" not in json.dumps(sec).lower() and "vllm" not in out.lower()
    assert (tmp_path / "gpu_check.log").read_text().count("gpu_check: 8 sections") == 1


def test_gpu_check_ticks_read_the_projects_nvml_reader(monkeypatch):
    """On a CUDA device the ticks come from telemetry.NvmlReader (NVML faked at the library boundary:
    73 % busy, 3 GiB used), summarised per time window; nothing is ticked outside the window."""
    fake_pynvml(monkeypatch)
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    ticker = gpu_check.make_ticker("cuda", smoke=False)
    t0 = time.time()
    deadline = time.monotonic() + 10
    while len(ticker.ticks) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    ticker.stop()
    t1 = time.time()
    assert ticker.source == "nvml" and ticker.label == "GPU utilisation (NVML)" and ticker.device == "FakeGPU"
    s = ticker.summary(t0 - 1, t1)
    assert s["ticks"] >= 3 and s["util_mean"] == pytest.approx(0.73) and s["util_max"] == pytest.approx(0.73)
    assert s["memory_used_max_bytes"] == 3 << 30
    assert ticker.summary(t1 + 1, t1 + 2)["ticks"] == 0
    assert gpu_check.make_ticker("cpu", smoke=False).source == "none"  # no stand-in outside --smoke
