"""Multi-turn episodes in the notebook API: token-id prompts (an environment's observation) and train steps
over an episode's turns, whose environment tokens train at weight 0 and whose model tokens carry the
episode's advantage (openrl_common/episodes.py builds the sequences for both halves)."""

from __future__ import annotations

import pytest

from openrl_common.episodes import episode_layout
from tests.conftest import ALICE_KEY, BOB_KEY

V1 = "/openrl/v1"


def test_an_episode_is_one_sequence_where_observations_extend_it_and_env_tokens_weigh_zero():
    ob1, ac1, lp1 = [1, 2, 3], [4, 5], [-0.5, -0.25]
    env = [6, 7, 8]  # a tool result the environment appended
    ob2, ac2, lp2 = ob1 + ac1 + env, [9], [-1.0]
    layout = episode_layout([(ob1, ac1, lp1), (ob2, ac2, lp2)], 2.0)
    (seq,) = layout.sequences
    assert seq.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert seq.advantages == [0, 0, 0, 2.0, 2.0, 0, 0, 0, 2.0]
    assert seq.logprobs == [0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0]
    assert (layout.action_tokens, layout.env_tokens) == (3, 3)
    # an observation that does not extend the sequence (the environment rewrote the history) starts another
    fresh = episode_layout([(ob1, ac1, lp1), ([1, 9, 9], [5], [-0.1])], -1.0)
    assert [s.tokens for s in fresh.sequences] == [[1, 2, 3, 4, 5], [1, 9, 9, 5]]
    assert fresh.sequences[1].advantages == [0, 0, 0, -1.0]
    with pytest.raises(ValueError, match="turn 0: 2 action tokens but 1 logprobs"):
        episode_layout([(ob1, ac1, [0.0])], 1.0)


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as c:
        yield c


def test_a_two_turn_episode_trains_its_model_tokens_only(server, alice):
    run = alice.post(f"{V1}/runs", json={"name": "episode", "seed": 0}).json()["run_id"]
    try:
        ob1 = list(b"<|user|>count: ")
        one = alice.post(
            f"{V1}/runs/{run}/sample",
            json={"prompts": [{"tokens": ob1}], "max_tokens": 6, "temperature": 1.0, "seed": 1},
        )
        assert one.status_code == 200, one.text
        s1 = one.json()["samples"][0]
        env = list(b"\n<tool_response>3</tool_response>\n")
        ob2 = ob1 + s1["tokens"] + env
        s2 = alice.post(
            f"{V1}/runs/{run}/sample",
            json={"prompts": [{"tokens": ob2}], "max_tokens": 5, "temperature": 1.0, "seed": 2},
        ).json()["samples"][0]
        step = alice.post(
            f"{V1}/runs/{run}/train_step",
            json={"samples": [{"episode": [s1["sample_id"], s2["sample_id"]], "advantage": 1.5}]},
        )
        assert step.status_code == 200, step.text
        got = step.json()
        assert got["action_tokens"] == len(s1["tokens"]) + len(s2["tokens"])
        assert got["env_tokens"] == len(env)
        # one sequence: the whole episode's tokens minus the first, as targets
        assert got["tokens"] == len(ob2) + len(s2["tokens"]) - 1

        # bad input names the field; another tenant's samples are not found
        bad = alice.post(
            f"{V1}/runs/{run}/train_step",
            json={"samples": [{"episode": [s1["sample_id"]], "sample_id": s1["sample_id"], "advantage": 1}]},
        )
        assert bad.status_code == 400 and "not both" in bad.text
        missing = alice.post(
            f"{V1}/runs/{run}/train_step",
            json={"samples": [{"episode": [s1["sample_id"], "smp-x"], "advantage": 1}]},
        )
        assert missing.status_code == 404 and "samples[0].episode[1]" in missing.text
        out_of_vocab = alice.post(f"{V1}/runs/{run}/sample", json={"prompts": [{"tokens": [10**6]}]})
        assert out_of_vocab.status_code == 400 and "prompts[0].tokens" in out_of_vocab.text
        with server.client(BOB_KEY) as bob:
            theirs = bob.post(f"{V1}/runs", json={"name": "b"}).json()["run_id"]
            stolen = bob.post(
                f"{V1}/runs/{theirs}/train_step",
                json={"samples": [{"episode": [s1["sample_id"]], "advantage": 1}]},
            )
            assert stolen.status_code == 404
            bob.delete(f"{V1}/runs/{theirs}")
    finally:
        alice.delete(f"{V1}/runs/{run}")
