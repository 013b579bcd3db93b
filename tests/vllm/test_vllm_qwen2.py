"""What vLLM 0.32 cannot serve (LoRA on a Qwen2's lm_head) is sampled by torch with a notice; what it
can (body-only adapters, prompt logprobs without an lm_head LoRA layer) matches the torch sampler."""

from __future__ import annotations

import json
import os
import subprocess

from tests.vllm.test_vllm_service import ROOT, VLLM_PYTHON, pytestmark  # noqa: F401 - the same skip


def test_qwen2_lm_head_adapters_fall_back_and_the_rest_matches_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENRL_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm" / "qwen2_check.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # (vLLM logs to stdout; the report is the one JSON line)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(lines[-1])
    jobs = report["jobs"]
    # the capability entry's defaults stop training the unembedding vLLM cannot serve
    assert report["defaults_train_unembed"] == [True, False]
    assert jobs["lm_head"]["backend"] == "torch"
    assert "no LoRA on lm_head for Qwen2ForCausalLM" in jobs["lm_head"]["notice"]
    for name in ("body", "base"):
        assert jobs[name]["backend"] == "vllm" and jobs[name]["notice"] is None, jobs[name]
        assert jobs[name]["prompt_logprob_first_is_nan"]
        assert jobs[name]["prompt_logprob_max_delta"] <= 1e-3, jobs[name]
    assert jobs["body"]["topk_prompt_ids_equal"] and jobs["body"]["topk_prompt_max_delta"] <= 1e-3
    assert all(j["greedy_equal"] for j in jobs.values()), jobs
    assert jobs["lm_head"]["rows"] == jobs["body"]["rows"] == 2  # greedy n=2: two identical rows
    assert report["samples"] == {"torch": 2, "vllm": 3}
