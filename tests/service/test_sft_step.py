"""A supervised step on the notebook API (POST /openrl/v1/runs/{id}/sft_step): prompt/completion pairs
rendered as /sample renders prompts, cross-entropy on the completion, AdamW; a warm start before RL."""

import pytest

from tests.conftest import ALICE_KEY, BOB_KEY

V1 = "/openrl/v1"
FACTS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
GREEDY = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as c:
        yield c


def new_run(client, **body) -> str:
    r = client.post(f"{V1}/runs", json={"seed": 0, **body})
    assert r.status_code == 201, r.text
    return r.json()["run_id"]


def sft(client, run_id: str, examples: list[dict], key: str | None = None, **body):
    headers = {"X-Idempotency-Key": key} if key else {}
    return client.post(f"{V1}/runs/{run_id}/sft_step", json={"examples": examples, **body}, headers=headers)


def test_sft_steps_teach_the_completions_that_sample_then_answers(alice):
    """A few steps on four facts lower the loss per token, and greedy samples of the same prompts
    (rendered by /sample's chat template) then answer them: what a warm start before RL is for."""
    run_id = new_run(alice)
    losses = []
    for _ in range(80):
        r = sft(alice, run_id, FACTS, optimizer={"learning_rate": 3e-3})
        assert r.status_code == 200, r.text
        losses.append(r.json()["loss"])
    reply = r.json()
    assert reply["tokens"] == sum(len(f["completion"]) + 1 for f in FACTS)  # each answer + end of turn
    assert reply["step"] == 80 and reply["learning_rate"] == 3e-3
    assert losses[-1] < 0.1 < 2 < losses[0], losses
    r = alice.post(f"{V1}/runs/{run_id}/sample", json={"prompts": [f["prompt"] for f in FACTS], **GREEDY})
    assert r.status_code == 200, r.text
    got = [s["text"] for s in r.json()["samples"]]
    assert got == [f["completion"] for f in FACTS]


def test_a_resent_sft_step_is_applied_once(alice):
    run_id = new_run(alice)
    first = sft(alice, run_id, FACTS, key="warm-1")
    again = sft(alice, run_id, FACTS, key="warm-1")
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()
    assert sft(alice, run_id, FACTS).json()["step"] == 2


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"examples": []}, "examples", "at least 1"),
        ({"examples": [{"prompt": "2+2="}]}, "examples[0].completion", "required"),
        ({"examples": [{"prompt": "", "completion": "4"}]}, "examples[0].prompt", ""),
        ({"examples": [{"prompt": "x" * 50_000, "completion": "4"}]}, "examples[0]", "context"),
        ({"examples": FACTS, "optimizer": {"learning_rate": -1}}, "optimizer.learning_rate", ""),
    ],
)
def test_bad_examples_are_refused_by_name_and_nothing_is_trained(alice, body, field, words):
    run_id = new_run(alice)
    r = alice.post(f"{V1}/runs/{run_id}/sft_step", json=body)
    assert r.status_code in (400, 413, 422), r.text
    text = r.text
    assert field in text and words in text, text
    assert sft(alice, run_id, FACTS).json()["step"] == 1  # the refusal left the run as it was


def test_another_tenant_cannot_train_a_run(server, alice):
    run_id = new_run(alice)
    with server.client(BOB_KEY) as bob:
        r = sft(bob, run_id, FACTS)
    assert r.status_code == 404, r.text
