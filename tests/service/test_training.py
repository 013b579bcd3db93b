"""Training works end to end through the unmodified Tinker SDK: SFT lowers the loss, RL raises the reward."""

import statistics
import sys
from pathlib import Path

from tinker import types

from tests.conftest import ALICE_KEY, TINY

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

CORPUS = ["The cat sat on the mat.", "Hello, world!", "openrl trains from notebooks.", "One, two, three."]


def sft_data():
    out = []
    for line in CORPUS:
        prompt, completion = list(b"> "), list(line.encode())
        seq = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
            )
        )
    return out


def test_sft_30_steps_halve_the_loss(service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=0).result()
    data = sft_data()
    losses = []
    for _ in range(30):
        fb = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fb.metrics["loss:sum"])
    final = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert final <= 0.5 * losses[0], (losses[0], final)
    # Per-datum logprobs come back shaped like the targets and sum to the reported loss.
    out = tc.forward(data, "cross_entropy").result()
    total = -sum(
        float((o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum())
        for o, d in zip(out.loss_fn_outputs, data, strict=True)
    )
    assert abs(total - out.metrics["loss:sum"]) < 1e-3 * max(1.0, abs(total))


def test_rl_with_tiny_defaults_raises_letter_reward(server, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", ALICE_KEY)
    from tinker_rl_letters import run

    means = run(server.url, steps=60, seed=0, log=lambda *_: None)
    first, last = statistics.fmean(means[:5]), statistics.fmean(means[-5:])
    assert last - first >= 0.3, means
