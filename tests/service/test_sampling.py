"""Sampling parameters behave as the Tinker SDK documents them, on the torch backend."""

import json

import numpy as np
import pytest
import torch
from tinker import types

from tests.conftest import TINY

PROMPT = types.ModelInput.from_ints(list(b"Once upon a time"))


@pytest.fixture(scope="module")
def trained(server):
    """A sampler on weights nudged towards 'ab ab ab ...', so stop strings and tokens actually occur."""
    import tinker

    from tests.conftest import ALICE_KEY

    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=21).result()
    target = list(b"ab ab ab ab ab ab ab ab ab ab")
    seq = list(b"Once upon a time") + target
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * 15 + [1.0] * len(target)},
    )
    for _ in range(40):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    yield sc, tc, sampler
    sc.close("success").result()


def sample(sampler, n=1, **params):
    return sampler.sample(PROMPT, n, types.SamplingParams(**params)).result()


def test_greedy_is_deterministic_and_learned(trained):
    _, _, sampler = trained
    a = sample(sampler, 2, max_tokens=9, temperature=0.0)
    assert a.sequences[0].tokens == a.sequences[1].tokens == list(b"ab ab ab ")
    assert all(s.stop_reason == "length" for s in a.sequences)


def test_stop_string_ends_sample_with_the_stop_text_last(trained):
    _, _, sampler = trained
    s = sample(sampler, max_tokens=20, temperature=0.0, stop=["b a"]).sequences[0]
    assert s.stop_reason == "stop"
    assert bytes(s.tokens) == b"ab a"
    assert len(s.logprobs) == len(s.tokens)


def test_stop_token_is_included_and_last(trained):
    _, _, sampler = trained
    space = ord(" ")
    s = sample(sampler, max_tokens=20, temperature=0.0, stop=[space]).sequences[0]
    assert s.stop_reason == "stop" and s.tokens == [ord("a"), ord("b"), space]


def test_max_tokens_gives_length_stop_reason(trained):
    _, _, sampler = trained
    s = sample(sampler, max_tokens=3, temperature=1.0, seed=1, stop=[]).sequences[0]
    assert s.stop_reason == "length" and len(s.tokens) == 3


def test_seed_reproducible_whatever_shares_the_batch(trained):
    _, _, sampler = trained
    one = sample(sampler, 1, max_tokens=12, temperature=1.5, seed=42)
    four = sample(sampler, 4, max_tokens=12, temperature=1.5, seed=42)
    assert four.sequences[0].tokens == one.sequences[0].tokens
    assert len({tuple(s.tokens) for s in four.sequences}) > 1  # rows differ from each other
    again = sample(sampler, 4, max_tokens=12, temperature=1.5, seed=42)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in four.sequences]


def test_top_k_1_and_tiny_top_p_equal_greedy(trained):
    _, _, sampler = trained
    greedy = sample(sampler, max_tokens=10, temperature=0.0).sequences[0].tokens
    assert sample(sampler, 3, max_tokens=10, temperature=1.0, top_k=1, seed=3).sequences[2].tokens == greedy
    assert (
        sample(sampler, 3, max_tokens=10, temperature=1.0, top_p=1e-6, seed=3).sequences[1].tokens == greedy
    )


def test_logprobs_are_raw_model_logprobs_whatever_the_temperature(trained):
    _, _, sampler = trained
    hot = sample(sampler, max_tokens=6, temperature=5.0, seed=7, stop=[]).sequences[0]
    prompt_then = types.ModelInput.from_ints(PROMPT.to_ints() + hot.tokens)
    lps = sampler.compute_logprobs(prompt_then).result()
    np.testing.assert_allclose(lps[-len(hot.tokens) :], hot.logprobs, atol=1e-4)


def test_prompt_and_topk_logprobs(trained):
    _, _, sampler = trained
    res = sampler.sample(
        PROMPT,
        1,
        types.SamplingParams(max_tokens=4, temperature=0.0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
    ).result()
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == PROMPT.length
    assert all(lp is not None and lp < 0 for lp in res.prompt_logprobs[1:])
    topk = res.topk_prompt_logprobs
    assert topk[0] is None or topk[0] == [] or all(lp <= -99999 for _, lp in topk[0])
    # The top-1 candidate's logprob bounds the actual token's.
    for pos in range(1, PROMPT.length):
        assert topk[pos][0][1] >= res.prompt_logprobs[pos] - 1e-5
    seq = res.sequences[0]
    greedy_top = [row[0] for row in seq.topk_logprobs]
    assert [tok for tok, _ in greedy_top] == seq.tokens  # greedy picks the top candidate


# PEFT notes that lm_head is tied to the embeddings; the adapter only adds a delta on the output side.
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_saved_sampler_weights_load_in_peft_with_the_same_logits(server, trained, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from openrl_service.storage.checkpoints import parse_tinker_path

    _, tc, sampler = trained
    path = tc.save_weights_for_sampler("peft-check").result().path
    folder = server.service.store.folder("alice", parse_tinker_path(path))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and "lm_head" in config["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, folder).eval()
    tokens = PROMPT.to_ints() + list(b"ab ab")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    peft_lp = (
        torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)
    )
    ours = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    np.testing.assert_allclose(peft_lp.numpy(), ours, atol=1e-4)


def test_batched_draw_picks_what_per_row_multinomial_picks():
    """Seeded samples keep their tokens: the sampler's batched draw equals torch.multinomial per row."""
    from openrl_service.sampling.torch_sampler import _draw

    probs = torch.softmax(torch.randn(6, 260, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    ours = [torch.Generator().manual_seed(100 + j) for j in range(6)]
    torchs = [torch.Generator().manual_seed(100 + j) for j in range(6)]
    for _ in range(50):
        want = torch.cat([torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(torchs)])
        assert torch.equal(_draw(probs, ours), want)
