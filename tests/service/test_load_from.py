"""POST /openrl/v1/runs {load_from}: a notebook run that starts from a saved checkpoint's LoRA weights
(how the text-to-SQL recipe's RL run starts from its SFT checkpoint)."""

import pytest

from tests.conftest import ALICE_KEY, BOB_KEY

V1 = "/openrl/v1"
GREEDY = {"prompts": ["Name a colour"], "num_samples": 1, "temperature": 0.0, "max_tokens": 8, "stop": []}


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as c:
        yield c


def new_run(client, **body) -> dict:
    r = client.post(f"{V1}/runs", json={"seed": 0, **body})
    assert r.status_code == 201, r.text
    return r.json()


def logprobs(client, run_id: str) -> list[float]:
    r = client.post(f"{V1}/runs/{run_id}/sample", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["samples"][0]["logprobs"]


@pytest.fixture
def trained(alice):
    """A run after one large update, saved as a checkpoint: (run id, path)."""
    run_id = new_run(alice, name="load-from-src")["run_id"]
    body = {"prompts": ["Name a colour"], "num_samples": 8, "max_tokens": 8, "seed": 3, "stop": []}
    samples = alice.post(f"{V1}/runs/{run_id}/sample", json=body).json()["samples"]
    items = [
        {"sample_id": s["sample_id"], "advantage": 1.0 if i % 2 else -1.0} for i, s in enumerate(samples)
    ]
    r = alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items, "optimizer": {"lr": 0.05}})
    assert r.status_code == 200, r.text
    path = alice.post(f"{V1}/runs/{run_id}/checkpoints", json={"name": "src"}).json()["path"]
    yield run_id, path
    alice.delete(f"{V1}/runs/{run_id}")


def test_a_run_created_with_load_from_samples_like_the_checkpoint(alice, trained):
    src, path = trained
    loaded = new_run(alice, name="load-from-dst", load_from=path)
    fresh = new_run(alice, name="load-from-fresh")
    try:
        assert loaded["step"] == 0
        want = logprobs(alice, src)
        assert logprobs(alice, loaded["run_id"]) == pytest.approx(want, abs=1e-5)
        assert logprobs(alice, fresh["run_id"]) != pytest.approx(want, abs=1e-5)  # the update mattered
        # it trains on from there: its own steps count from 1
        body = {**GREEDY, "num_samples": 4, "temperature": 1.0, "seed": 1}
        samples = alice.post(f"{V1}/runs/{loaded['run_id']}/sample", json=body).json()["samples"]
        items = [
            {"sample_id": s["sample_id"], "advantage": float(i % 2) - 0.5} for i, s in enumerate(samples)
        ]
        step = alice.post(f"{V1}/runs/{loaded['run_id']}/train_step", json={"samples": items})
        assert step.status_code == 200 and step.json()["step"] == 1, step.text
    finally:
        for r in (loaded, fresh):
            alice.delete(f"{V1}/runs/{r['run_id']}")


def test_bad_load_from_is_refused_naming_the_field(server, alice, trained):
    _, path = trained
    before = {r["run_id"] for r in alice.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]}
    for body in (
        {"load_from": 3},
        {"load_from": ""},
        {"load_from": "not a path"},
        {"load_from": "tinker://nope/weights/missing"},
        {"load_from": path, "rank": 4},  # the checkpoint has rank 8
    ):
        r = alice.post(f"{V1}/runs", json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert r.json().get("field") == "load_from" or "load_from" in r.text, (body, r.text)
    with server.client(BOB_KEY) as bob:  # another tenant's checkpoint is not found
        r = bob.post(f"{V1}/runs", json={"load_from": path})
        assert 400 <= r.status_code < 500, r.text
    after = {r["run_id"] for r in alice.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]}
    assert after - before == set()  # the refused ones left no run behind, not even a Tinker-side one
