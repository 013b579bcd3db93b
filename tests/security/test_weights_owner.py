"""Model weights are read by their owner only: a tenant's merged exports never carry a neighbour's full
fine-tune, although the neighbour's tensors sit in the shared model's slots during each of its ops, and
the base digest an export records is that of the base weights, the same after a restart."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import tinker
import torch
from safetensors.torch import load, load_file
from tinker import types

from openrl_service.models.loading import weights_digest
from tests.conftest import ALICE_KEY, BOB_KEY, TINY, start_server

TEXT = list(b"the cat sat on the mat. ")
EXPORTS = 25


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def checkpoint_folder(data_dir: Path, tinker_path: str) -> Path:
    run_id, _, rest = tinker_path.removeprefix("tinker://").partition("/")
    return next(data_dir.glob(f"tenants/*/runs/{run_id.replace(':', '~')}/{rest}"))


def merged(adapter_dir: Path, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a merged export of the adapter in ``adapter_dir`` must hold: W + s·B·A where the adapter
    has a pair, the base's own tensor everywhere else."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(adapter_dir / "adapter_model.safetensors").items():
        name, _, which = key[len("base_model.model.") : -len(".weight")].rpartition(".")
        pairs.setdefault(name, {})[which] = t
    out = {k: v.clone() for k, v in base.items()}
    for name, ab in pairs.items():
        w = out[f"{name}.weight"]
        out[f"{name}.weight"] = (w.float() + (ab["lora_B"].float() @ ab["lora_A"].float()) * scale).to(
            w.dtype
        )
    return out


def export(http: httpx.Client, tinker_path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    r = http.post("/api/v1/exports", json={"tinker_path": tinker_path, "merged": True})
    assert r.status_code == 200, r.text
    info = r.json()
    (weights,) = [f for f in info["files"] if f["name"] == "model.safetensors"]
    got = httpx.get(weights["url"], timeout=60)
    assert got.status_code == 200
    return info, load(got.content)


def test_merged_exports_never_carry_a_neighbours_full_fine_tune(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    live = start_server(tmp_path / "data", tiny_model_dir)
    alice = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    bob = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    # alice's checkpoints: untrained ones (every tensor must be the base's) and trained ones
    lora = alice.create_lora_training_client(base_model=TINY, rank=4, seed=1)
    paths = [lora.save_weights_for_sampler(f"untrained-{k}").result().path for k in range(5)]
    for k in range(EXPORTS - len(paths)):
        lora.forward_backward([datum(TEXT)], "cross_entropy").result()
        lora.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        paths.append(lora.save_weights_for_sampler(f"trained-{k}").result().path)
    # bob full-fine-tunes the whole time alice exports: his tensors are in the model's slots during
    # each of his ops
    full = bob.create_lora_training_client(base_model=TINY, rank=0, seed=2)
    done = threading.Event()
    steps = []

    def train() -> None:
        while not done.is_set():
            full.forward_backward([datum(TEXT)], "cross_entropy").result()
            full.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            steps.append(1)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    digests = set()
    try:
        with live.client(ALICE_KEY) as http:
            for i, path in enumerate(paths):
                # each export starts once bob has taken another step, so they interleave whatever the
                # machine's speed (his next op is under way while this one is built)
                deadline = time.monotonic() + 120
                while len(steps) <= i and time.monotonic() < deadline:
                    time.sleep(0.02)
                info, got = export(http, path)
                digests.add(info["base_weights_sha256"])
                expected = merged(checkpoint_folder(live.data_dir, path), base)
                if "lm_head.weight" not in got:  # an adapter that leaves a tied output layer alone
                    expected.pop("lm_head.weight", None)
                assert got.keys() == expected.keys(), path
                wrong = [k for k in got if not torch.equal(got[k], expected[k])]
                assert not wrong, f"{path}: {len(wrong)} of {len(got)} tensors are not alice's: {wrong[:5]}"
    finally:
        done.set()
        trainer.join(60)
    assert len(steps) >= EXPORTS  # bob trained throughout, and his run did move away from the base
    saved = full.save_state("end").result().path
    bob_weights = load_file(checkpoint_folder(live.data_dir, saved) / "model.safetensors")
    assert not torch.equal(bob_weights["model.norm.weight"], base["model.norm.weight"])
    assert digests == {weights_digest(base)}
    alice.close("success").result()
    bob.close("success").result()
    live.stop()

    again = start_server(tmp_path / "data", tiny_model_dir)
    try:
        with again.client(ALICE_KEY) as http:
            r = http.post("/api/v1/exports", json={"tinker_path": paths[-1], "merged": False})
            assert r.status_code == 200, r.text
            assert r.json()["base_weights_sha256"] == weights_digest(base)
    finally:
        again.stop()
