"""A foreign adapter (a PEFT folder or checkpoint whose tensors do not fit the served model's LoRA
targets and rank) is refused with a 400 naming the tensor and the expected vs got shape, before any
of it reaches the device worker."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from openrl_service.storage.checkpoints import parse_tinker_path
from tests._support.raw import RawTinker
from tests.conftest import ALICE_KEY

V1 = "/openrl/v1"


@pytest.fixture
def live(make_server):
    return make_server()


def saved_checkpoint(live) -> tuple[str, dict]:
    """A weights checkpoint saved by a native run; returns its path and tensors."""
    with live.client(ALICE_KEY) as c:
        run = c.post(f"{V1}/runs", json={"name": "src", "seed": 0}).json()["run_id"]
        path = c.post(f"{V1}/runs/{run}/checkpoints", json={"name": "ck"}).json()["path"]
    folder = live.service.store.folder("alice", parse_tinker_path(path))
    return path, load_file(str(folder / "adapter_model.safetensors"))


def tamper(live, path: str, tensors: dict) -> None:
    folder = live.service.store.folder("alice", parse_tinker_path(path))
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def a_key(tensors: dict) -> str:
    return sorted(k for k in tensors if k.endswith("lora_A.weight"))[0]


def refusals(live, path: str) -> list[dict]:
    """What each way of loading ``path`` answers: create-from-state, load into a run, a sampler."""
    raw = RawTinker(live.client())
    sid = raw.session()
    out = []
    r = raw.post("load_weights", session_id=sid, model_seq_id=0, path=path, optimizer=False)
    out.append(r.json() if r.status_code != 200 else {"status": 200, **raw.result(r.json()["request_id"])})
    out[-1]["status"] = r.status_code
    model = raw.create_model(sid, 1)
    r = raw.post("load_weights", model_id=model, seq_id=1, path=path, optimizer=False)
    res = raw.result(r.json()["request_id"]) if r.status_code == 200 else r.json()
    out.append({**res, "status": 400 if res.get("category") == "user" else r.status_code})
    r = raw.post("create_sampling_session", session_id=sid, sampling_session_seq_id=0, model_path=path)
    out.append({**r.json(), "status": r.status_code})
    return out


def test_a_tensor_of_the_wrong_rank_is_refused_naming_it_and_both_shapes(live):
    path, tensors = saved_checkpoint(live)
    key = a_key(tensors)
    good = list(tensors[key].shape)
    tensors[key] = torch.zeros(4, good[1])  # rank 4 in a rank-8 checkpoint
    tamper(live, path, tensors)
    for answer in refusals(live, path):
        assert answer["status"] == 400 and answer["category"] == "user", answer
        assert key in answer["error"] and str(good) in answer["error"] and "[4, " in answer["error"], answer


def test_a_tensor_for_a_layer_the_model_lacks_is_refused(live):
    path, tensors = saved_checkpoint(live)
    tensors["base_model.model.model.layers.0.not_a_layer.lora_A.weight"] = torch.zeros(8, 4)
    tensors["base_model.model.model.layers.0.not_a_layer.lora_B.weight"] = torch.zeros(4, 8)
    tamper(live, path, tensors)
    for answer in refusals(live, path):
        assert answer["status"] == 400 and "not_a_layer" in answer["error"], answer


def test_a_missing_tensor_is_refused(live):
    path, tensors = saved_checkpoint(live)
    key = a_key(tensors)
    del tensors[key]
    tamper(live, path, tensors)
    for answer in refusals(live, path):
        assert answer["status"] == 400 and key in answer["error"] and "missing" in answer["error"], answer


def test_the_service_stays_up_and_a_good_checkpoint_still_loads(live):
    path, _ = saved_checkpoint(live)
    raw = RawTinker(live.client())
    r = raw.post("load_weights", session_id=raw.session(), model_seq_id=0, path=path, optimizer=True)
    assert r.status_code == 200 and "error" not in raw.result(r.json()["request_id"])
