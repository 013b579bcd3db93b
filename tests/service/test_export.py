"""Exports leave the service as folders other tools load: `openrl-service export` (a PEFT adapter, or
--merged a Hugging Face model) round-trips to the service's own logprobs, from training and sampler
checkpoints; the Tinker SDK's `tinker checkpoint download` works too; another tenant's checkpoint is not
exported; the command needs no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
import torch
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY, TINY

SEQ = list(b"Once upon a time ab ab ab ab")
BIN = Path(sys.executable).parent
# PEFT warns that a LoRA on a tied lm_head may complicate *its* merging; the adapter is meant to change
# the output layer alone (as the service applies it), which the logprob comparisons check.
TIED_WARNING = "ignore:Model has `tie_word_embeddings=True`:UserWarning"


@pytest.fixture(scope="module")
def trained(server):
    """Alice's run trained a little (every layer group, the tied lm_head included), saved both ways."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)},
    )
    for _ in range(15):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler_path = tc.save_weights_for_sampler("exp").result().path
    state_path = tc.save_state("exp-state").result().path
    service_lps = (
        sc.create_sampling_client(model_path=sampler_path)
        .compute_logprobs(types.ModelInput.from_ints(SEQ))
        .result()
    )
    base_lps = (
        sc.create_sampling_client(base_model=TINY).compute_logprobs(types.ModelInput.from_ints(SEQ)).result()
    )
    yield {"sampler": sampler_path, "state": state_path, "lps": service_lps, "base_lps": base_lps}
    sc.close("success").result()


def export(server, path: str, dest: Path, *extra: str, key: str = ALICE_KEY) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": key}
    return subprocess.run(
        [str(BIN / "openrl-service"), "export", path, str(dest), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def hf_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]


def assert_close(mine: list[float], service: list[float | None], tol: float = 1e-4) -> None:
    assert service[0] is None and len(mine) == len(service) - 1
    worst = max(abs(a - b) for a, b in zip(mine, service[1:], strict=True))
    assert worst <= tol, f"max |Δ logprob| {worst:.2e} > {tol}"


@pytest.mark.filterwarnings(TIED_WARNING)
def test_peft_export_loads_in_peft_to_the_services_logprobs(server, trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    done = export(server, trained["sampler"], tmp_path / "adapter")
    assert done.returncode == 0, done.stderr
    assert "peft export" in done.stdout
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "openrl_export.json", "README.md"} <= files
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == TINY and "lm_head" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert_close(hf_logprobs(model, SEQ), trained["lps"])
    # the adapter changed something: the base model's logprobs are not these
    assert max(abs(a - b) for a, b in zip(trained["lps"][1:], trained["base_lps"][1:], strict=True)) > 1e-2


def test_merged_export_loads_in_transformers_to_the_services_logprobs(
    server, trained, tiny_model_dir, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = export(server, trained["sampler"], tmp_path / "merged", "--merged")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "merged"
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the adapter trains the tied lm_head: untied, exact
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_close(hf_logprobs(model, SEQ), trained["lps"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # the input embeddings stay the base's; only the output layer took the adapter
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("Once upon", add_special_tokens=False) == list(b"Once upon")
    assert tok.chat_template


def test_a_training_checkpoint_exports_the_same_adapter(server, trained, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    done = export(server, trained["state"], tmp_path / "from-state", "--merged")
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "from-state", dtype=torch.float32).eval()
    assert_close(hf_logprobs(model, SEQ), trained["lps"])
    info = json.loads((tmp_path / "from-state" / "openrl_export.json").read_text())
    assert info["tinker_path"] == trained["state"] and info["format"] == "merged"


def test_the_export_records_the_digest_of_the_exact_base_weights(server, trained, tiny_model_dir, tmp_path):
    """The digest is over the weights the service trained on: the tiny model's own files give it, and a
    changed weight would not."""
    from transformers import AutoModelForCausalLM

    from openrl_service.models.loading import weights_digest

    assert export(server, trained["sampler"], tmp_path / "a").returncode == 0
    info = json.loads((tmp_path / "a" / "openrl_export.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = base.state_dict()
    assert info["base_weights_sha256"] == weights_digest(state)
    state["model.norm.weight"] = state["model.norm.weight"] + 1e-3
    assert info["base_weights_sha256"] != weights_digest(state)
    assert info["base_model"] == TINY and info["base_dequantized_from_gguf"] is False


@pytest.mark.filterwarnings(TIED_WARNING)
def test_the_tinker_clis_checkpoint_download_works_against_the_service(
    server, trained, tiny_model_dir, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": ALICE_KEY}
    done = subprocess.run(
        [str(BIN / "tinker"), "checkpoint", "download", trained["state"], "--output", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    assert_close(hf_logprobs(model, SEQ), trained["lps"])


def test_another_tenants_checkpoint_is_not_exported(server, trained, tmp_path):
    done = export(server, trained["sampler"], tmp_path / "stolen", key=BOB_KEY)
    assert done.returncode == 1
    assert "404" in done.stderr and "not found" in done.stderr
    assert not (tmp_path / "stolen").exists()
    assert not [p for p in tmp_path.iterdir()]  # no partial folder left behind either


def test_bad_requests_name_the_field(server, trained, tmp_path):
    with server.client() as http:
        r = http.post("/api/v1/exports", json={"tinker_path": trained["sampler"], "merged": "yes"})
        assert r.status_code == 400 and r.json()["field"] == "merged"
        r = http.post("/api/v1/exports", json={"tinker_path": "not-a-path"})
        assert r.status_code == 400 and r.json()["field"] == "tinker_path"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    done = export(server, trained["sampler"], tmp_path / "full")
    assert done.returncode == 1 and "not empty" in done.stderr
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    done = subprocess.run(
        [str(BIN / "openrl-service"), "export", trained["sampler"], str(tmp_path / "x")],
        env={
            k: v
            for k, v in os.environ.items()
            if k not in ("TINKER_BASE_URL", "TINKER_API_KEY", "OPENRL_URL")
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "TINKER_BASE_URL" in done.stderr


def test_the_export_command_needs_no_torch(server, trained, tmp_path):
    """A hub user's image has no torch: the command must not import it (nor the base weights)."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from openrl_service.command import main\n"
        f"sys.exit(main(['export', {trained['sampler']!r}, {str(tmp_path / 'light')!r}]))"
    )
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": ALICE_KEY}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "light" / "adapter_model.safetensors").is_file()


def test_a_key_from_the_environment_goes_only_to_the_service_it_names(server, trained, tmp_path):
    """TINKER_API_KEY belongs to TINKER_BASE_URL: exporting from another --base-url does not send it."""
    env = {**os.environ, "TINKER_BASE_URL": "http://127.0.0.1:9", "TINKER_API_KEY": ALICE_KEY}
    env.pop("OPENRL_URL", None)
    done = subprocess.run(
        [
            str(BIN / "openrl-service"),
            "export",
            trained["sampler"],
            str(tmp_path / "x"),
            "--base-url",
            server.url,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "401" in done.stderr and "missing API key" in done.stderr
    assert not (tmp_path / "x").exists()
