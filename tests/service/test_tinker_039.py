"""Tinker 0.39's additions, over HTTP with the documented shapes (the 0.39 SDK is not installable here):
an external weights upload (start → PUT each file to its signed URL → finish) brings a PEFT adapter trained
elsewhere in as a checkpoint that samples and trains like one made here; ``search_checkpoints`` filters and
pages the caller's checkpoints; ``Checkpoint.base_model`` is in every checkpoint listing."""

from __future__ import annotations

import json

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY, TINY

PROMPT = list(b"Once upon a time")
V1 = "/openrl/v1"


def http(server, key=ALICE_KEY) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=120)


@pytest.fixture(scope="module")
def elsewhere(server):
    """A PEFT adapter "trained elsewhere": a run's save_weights_external, downloaded as its files."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=7).result()
    seq = PROMPT + list(b" xy xy xy xy xy")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * 15 + [1.0] * (len(seq) - 16)},
    )
    for _ in range(25):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    path = tc.save_weights_external("to-upload").result().path
    urls = sc.create_rest_client().get_external_weights_urls(path).result().urls
    files = {
        name: httpx.get(url, timeout=60).content
        for name, url in urls.items()
        if not name.startswith("manifest")
    }
    sampler = tc.save_weights_for_sampler("original").result().path
    yield files, sampler
    sc.close("success").result()


def greedy(server, model: str) -> str:
    reply = http(server).post(
        "/v1/completions",
        json={"model": model, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def upload(server, files: dict[str, bytes], *, rank=4, key=ALICE_KEY) -> httpx.Response:
    c = http(server, key)
    started = c.post(
        "/api/v1/external_weights_upload_start",
        json={
            "base_model": TINY,
            "lora_config": {"rank": rank, "train_unembed": True, "train_mlp": True, "train_attn": True},
        },
    )
    assert started.status_code == 200, started.text
    body = started.json()
    assert set(body) == {"upload_id", "urls", "expires"} and body["expires"].endswith("Z")
    assert set(body["urls"]) == {"adapter_model.safetensors", "adapter_config.json"}
    for name, url in body["urls"].items():
        put = httpx.put(url, content=files[name], timeout=60)  # no key: the signed URL is the capability
        assert put.status_code == 200, put.text
    return c.post("/api/v1/external_weights_upload_finish", json={"upload_id": body["upload_id"]})


def test_an_uploaded_adapter_samples_and_trains_like_the_original(server, elsewhere):
    files, original = elsewhere
    done = upload(server, files)
    assert done.status_code == 200, done.text
    path = done.json()["tinker_path"]
    assert path.startswith("tinker://upload-") and "/external_weights/" in path
    assert greedy(server, path) == greedy(server, original) != greedy(server, TINY)
    c = http(server)
    # listed with its base model (Checkpoint.base_model) and its run
    run_id = path.removeprefix("tinker://").split("/")[0]
    (ck,) = c.get(f"/api/v1/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    assert ck["checkpoint_type"] == "external" and ck["base_model"] == TINY
    # a notebook run starts from it and trains on
    run = c.post(f"{V1}/runs", json={"name": "from-upload", "rank": 4, "load_from": path, "seed": 0})
    assert run.status_code == 201, run.text
    rid = run.json()["run_id"]
    out = c.post(
        f"{V1}/runs/{rid}/sample", json={"prompts": [{"tokens": PROMPT}], "max_tokens": 10, "temperature": 0}
    )
    assert bytes(t for t in out.json()["samples"][0]["tokens"] if t < 256).decode() == greedy(
        server, original
    )
    smp = out.json()["samples"][0]["sample_id"]
    step = c.post(f"{V1}/runs/{rid}/train_step", json={"samples": [{"sample_id": smp, "advantage": 1.0}]})
    assert step.status_code == 200 and step.json()["step"] == 1
    c.delete(f"{V1}/runs/{rid}")


def test_a_wrong_or_incomplete_upload_is_refused_naming_what_is_wrong(server, elsewhere):
    files, _ = elsewhere
    wrong_rank = upload(server, files, rank=8)
    assert wrong_rank.status_code == 400 and "adapter_config.json: r is 4" in wrong_rank.text
    bad_config = upload(server, {**files, "adapter_config.json": json.dumps({"r": 4}).encode() + b"x"})
    assert bad_config.status_code == 400 and "adapter_config.json is not JSON" in bad_config.text
    c = http(server)
    started = c.post(
        "/api/v1/external_weights_upload_start", json={"base_model": TINY, "lora_config": {"rank": 4}}
    ).json()
    half = c.post("/api/v1/external_weights_upload_finish", json={"upload_id": started["upload_id"]})
    assert half.status_code == 400 and "not uploaded yet" in half.text
    # more bytes than a rank-4 adapter of this model can be: refused before they are all read
    too_big = httpx.put(started["urls"]["adapter_model.safetensors"], content=b"0" * (8 << 20), timeout=60)
    assert too_big.status_code == 413 and "adapter_model.safetensors" in too_big.text
    # a tampered signed URL, and a download link used to upload, are unknown links
    url = started["urls"]["adapter_config.json"]
    assert httpx.put(url[:-4] + "0000", content=b"{}", timeout=30).status_code == 404
    for body, field in (
        ({"base_model": "nope", "lora_config": {"rank": 4}}, "base_model"),
        ({"base_model": TINY, "lora_config": {"rank": 0}}, "lora_config.rank"),
        ({"base_model": TINY, "lora_config": {"rank": 4, "train_mlp": "yes"}}, "lora_config.train_mlp"),
    ):
        r = c.post("/api/v1/external_weights_upload_start", json=body)
        assert r.status_code in (400, 404) and field in r.text, r.text
    # another tenant cannot finish (or learn of) alice's upload
    with http(server, BOB_KEY) as bob:
        assert (
            bob.post(
                "/api/v1/external_weights_upload_finish", json={"upload_id": started["upload_id"]}
            ).status_code
            == 404
        )
    assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200


def test_search_checkpoints_filters_and_pages_newest_first(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    saved = [tc.save_state(f"s{i}").result().path for i in range(3)]
    tc.save_weights_for_sampler("sampled").result()
    c = http(server)
    got = c.post(
        "/api/v1/checkpoints/search", json={"checkpoint_type": "training", "base_models": [TINY], "limit": 2}
    )
    assert got.status_code == 200, got.text
    page = got.json()
    assert len(page["checkpoints"]) == 2 and page["next_cursor"] is not None
    assert set(page["next_cursor"]) == {"last_created_at", "last_checkpoint_uuid"}
    seen = [ck["tinker_path"] for ck in page["checkpoints"]]
    times = [ck["time"] for ck in page["checkpoints"]]
    while page["next_cursor"] is not None:
        page = c.post(
            "/api/v1/checkpoints/search",
            json={
                "checkpoint_type": "training",
                "base_models": [TINY],
                "limit": 2,
                "cursor": page["next_cursor"],
            },
        ).json()
        seen += [ck["tinker_path"] for ck in page["checkpoints"]]
        times += [ck["time"] for ck in page["checkpoints"]]
    assert set(saved) <= set(seen) and len(seen) == len(set(seen)) and times == sorted(times, reverse=True)
    sampled = c.post("/api/v1/checkpoints/search", json={"checkpoint_type": "sampler", "limit": 200}).json()
    assert sampled["checkpoints"] and {ck["checkpoint_type"] for ck in sampled["checkpoints"]} == {"sampler"}
    none = c.post("/api/v1/checkpoints/search", json={"base_models": []}).json()
    assert none["checkpoints"] == [] and none["next_cursor"] is None
    assert (
        c.post("/api/v1/checkpoints/search", json={"owner": {"type": "user", "owner_urns": ["x"]}}).json()[
            "checkpoints"
        ]
        == []
    )
    bad = c.post("/api/v1/checkpoints/search", json={"checkpoint_type": "weights"})
    assert bad.status_code == 400 and "checkpoint_type" in bad.text
    assert c.post("/api/v1/checkpoints/search", json={"limit": 500}).status_code == 400
    with http(server, BOB_KEY) as bob:
        theirs = bob.post("/api/v1/checkpoints/search", json={"limit": 200}).json()["checkpoints"]
        assert not {ck["tinker_path"] for ck in theirs} & set(saved)
    sc.close("success").result()
