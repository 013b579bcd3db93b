"""bench/packing.py's NVML sampling and its table column, with a fake pynvml (no GPU needed)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def packing():
    spec = importlib.util.spec_from_file_location("bench_packing", ROOT / "bench" / "packing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_pynvml(util: int = 40, used: int = 2 << 30) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    state = {"util": util, "init": 0, "shutdown": 0}
    m.state = state
    m.nvmlInit = lambda: state.__setitem__("init", state["init"] + 1)
    m.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    m.nvmlDeviceGetName = lambda h: "Fake H200"
    m.nvmlSystemGetDriverVersion = lambda: "999.1"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used, total=8 * used)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=state["util"], memory=0)
    return m


def test_no_gpu_means_no_sampler(packing, monkeypatch):
    assert packing.nvml_for("cpu") is None and packing.nvml_for(None) is None
    broken = types.ModuleType("pynvml")

    def no_driver():
        raise RuntimeError("NVML Shared Library Not Found")

    broken.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert packing.nvml_for("cuda") is None
    sampler = packing.NvmlSampler(0)
    assert not sampler.available
    sampler.start()
    assert sampler.stop() == []


def test_sampler_window_and_phase(packing, monkeypatch):
    # The fake's utilisation follows the number of reads, not the clock: reads 0-4 see 40 %, reads
    # 5-9 see 90 %, later ones 10 %. The window is stamped at the switches, so it holds exactly the
    # five 90 % reads however fast or slow the sampler thread runs on a loaded machine.
    fake = fake_pynvml(util=40)
    reads = {"n": 0}
    marks: dict[str, float] = {}
    enough = threading.Event()

    def utilisation(handle):
        n = reads["n"]
        reads["n"] += 1
        if n == 5:
            marks["lo"] = time.time()
        if n == 10:
            marks["hi"] = time.time()
        if n >= 15:
            enough.set()
        return types.SimpleNamespace(gpu=40 if n < 5 else 90 if n < 10 else 10, memory=0)

    fake.nvmlDeviceGetUtilizationRates = utilisation
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = packing.nvml_for("cuda:0")
    assert sampler is not None and sampler.info["name"] == "Fake H200"
    sampler.period_s = 0.001
    sampler.start()
    assert enough.wait(60), "the sampler thread stopped reading"  # a hang guard, not a speed check
    samples = sampler.stop()
    summary = sampler.summary(samples, [(marks["lo"], marks["hi"])])
    sampler.close()
    assert fake.state["shutdown"] == 1
    assert summary["label"] == "GPU util (NVML)"
    assert summary["window"]["samples"] == 5
    assert summary["window"]["util_max"] == pytest.approx(0.9)
    assert summary["window"]["util_mean"] == pytest.approx(0.9)
    assert summary["phase"]["samples"] == len(samples) >= 16
    assert summary["phase"]["util_mean"] < summary["window"]["util_mean"]
    assert summary["window"]["memory_used_max_bytes"] == 2 << 30


def row(packing, n: int, gpu: dict | None) -> dict:
    r = {
        "n": n,
        "sequential": False,
        "duty": 0.5,
        "steps_per_s": 1.0 * n,
        "speedup": float(n),
        "tokens_per_s": 100.0 * n,
        "tokens_speedup": float(n),
        "bound": float(n),
        "slowdown": 1.0,
        "fairness": 1.0,
        "device_s_per_step": 0.2,
        "engine_efficiency": 1.0,
        "fused_fraction": 0.0,
        "window_s": 3.0,
        "batching_gain": False,
        "fused_calls": 0,
        "cores_busy": None,
        "runs": [],
    }
    if gpu is not None:
        r["gpu_util_nvml"] = gpu
    return r


def test_table_column_only_with_nvml(packing, capsys):
    args = argparse.Namespace(reward_s=0.5, prompts=8, group=4, max_tokens=32, steps=6)
    calib = {"device_s": 0.25}
    packing.print_table([row(packing, 1, None)], args, calib, 0.5, 0.33)
    plain = capsys.readouterr().out
    assert "GPU" not in plain and "concurrent RL runs on openrl/tiny," in plain

    gpu = {"label": "GPU util (NVML)", "window": {"samples": 30, "util_mean": 0.42, "util_max": 0.97}}
    packing.print_table([row(packing, 1, gpu)], args, calib, 0.5, 0.33, model="qwen2-0.5b-random")
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("runs"))
    assert "GPU util (NVML)" in head and "duty" in head
    assert "42% / 97%" in out
    assert "not the engine busy fraction" in out
    assert "concurrent RL runs on qwen2-0.5b-random," in out
