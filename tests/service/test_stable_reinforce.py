"""StableReinforce and inflight sampling clients through the unmodified Tinker SDK: a ``record_stability_info=True`` sampling client's
sequences are recorded under their ``sequence_id``, a ``stable_reinforce`` step names them by datum
provenance, and the loss is computed with the logprobs recorded at sampling time, whatever the client
sends; a span that does not match what was sampled, a sequence of another session and a datum without
provenance are refused naming the field."""

from __future__ import annotations

import math

import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY
from tests.service.test_full_finetune import solo  # noqa: F401 - the module's service

PROMPT = list(b"Say ab: ")


def rl_datum(
    prompt: list[int],
    seq,
    advantage: float,
    logprobs: list[float] | None = None,
    tokens: list[int] | None = None,
) -> types.Datum:
    """The cookbook's layout: model input prompt + sampled[:-1], targets prompt[1:] + sampled."""
    tokens = list(seq.tokens) if tokens is None else tokens
    n, p = len(tokens), len(prompt)
    sid = seq.sequence_id
    d = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": prompt[1:] + tokens,
            "logprobs": [0.0] * (p - 1) + (logprobs if logprobs is not None else seq.logprobs),
            "advantages": [0.0] * (p - 1) + [advantage] * n,
        },
    )
    return d.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=p),
            types.SampledProvenanceSpan(sequence_id=sid, length=n - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=p - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n),
        ],
    )


@pytest.fixture
def sc(solo):  # noqa: F811
    client = tinker.ServiceClient(base_url=solo.url, api_key=ALICE_KEY)
    yield client
    client.close("success").result()


def sampled(tc, n: int = 4):
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), n, params).result().sequences


def test_stable_reinforce_trains_on_recorded_sequences_with_the_recorded_logprobs(sc):
    tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0)
    seqs = sampled(tc)
    assert len({s.sequence_id for s in seqs}) == len(seqs)
    advs = [1.0, -1.0, 0.5, -0.5]
    honest = [rl_datum(PROMPT, s, a) for s, a in zip(seqs, advs, strict=True)]
    # the client's logprobs are not what the loss uses: garbage ones give the same result
    garbage = [rl_datum(PROMPT, s, a, [-9.0] * len(s.tokens)) for s, a in zip(seqs, advs, strict=True)]
    out = tc.forward(honest, "stable_reinforce").result()
    assert tc.forward(garbage, "stable_reinforce").result().metrics["loss:sum"] == out.metrics["loss:sum"]
    # the value: −Σ sg(min(r, 2))·lp·A over sampled tokens, r = exp(lp − q_recorded)
    want = 0.0
    for s, a, o in zip(seqs, advs, out.loss_fn_outputs, strict=True):
        lp = o["logprobs"].tolist()[len(PROMPT) - 1 :]
        for lp_t, q_t in zip(lp, s.logprobs, strict=True):
            want -= min(math.exp(lp_t - q_t), 2.0) * lp_t * a
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
    # a step on it moves the policy: the rewarded sequence becomes likelier
    before = out.loss_fn_outputs[0]["logprobs"].tolist()
    tc.forward_backward(honest, "stable_reinforce", {"kl_coeff": 0.01}).result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = tc.forward(honest, "stable_reinforce").result().loss_fn_outputs[0]["logprobs"].tolist()
    k = len(PROMPT) - 1
    assert sum(after[k:]) > sum(before[k:])


def test_stable_reinforce_refuses_what_was_not_recorded_naming_the_field(sc):
    tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0)
    seqs = sampled(tc, 2)
    good = rl_datum(PROMPT, seqs[0], 1.0)

    def refused(data, match: str):
        with pytest.raises(Exception) as e:  # noqa: PT011 - the message is checked below
            tc.forward(data, "stable_reinforce").result()
        assert match in str(e.value), str(e.value)

    # a sampled token changed
    tokens = list(seqs[0].tokens)
    tokens[-1] = (tokens[-1] + 1) % 256
    refused([rl_datum(PROMPT, seqs[0], 1.0, tokens=tokens)], "data[0].loss_fn_input_spans[1]: target_tokens")
    # no provenance
    bare = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)
    refused([bare], "data[0].loss_fn_input_spans: stable_reinforce needs the datum's provenance")
    # a sequence sampled without record_stability_info
    plain = (
        tc.save_weights_and_get_sampling_client()
        .sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=4, seed=1))
        .result()
        .sequences[0]
    )
    refused([rl_datum(PROMPT, plain, 1.0)], "names no recorded sequence of this session")
    # an advantage on a prompt token
    d = rl_datum(PROMPT, seqs[1], 1.0)
    adv = list(d.loss_fn_inputs["advantages"].tolist())
    adv[0] = 1.0
    d2 = types.Datum(
        model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "advantages": adv}
    ).with_provenance(model_input=d.model_input_spans, loss_fn_inputs=d.loss_fn_input_spans)
    refused([d2], "advantages on sampled tokens only")
    # the run is unharmed: the honest datum still trains
    assert tc.forward_backward([good], "stable_reinforce").result().metrics["loss:sum"] != 0


def test_inflight_sampling_clients_share_the_runs_weights_and_later_saves_update_them(sc):
    tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0)
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    prompt = types.ModelInput.from_ints(PROMPT)

    def text(sampler) -> list[int]:
        return sampler.sample(prompt, 1, greedy).result().sequences[0].tokens

    snapshot = tc.save_weights_and_get_sampling_client()
    first = tc.save_weights_and_get_sampling_client(kind="inflight")
    start = text(first)
    assert start == text(snapshot)
    target = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + list(b"xyzxyzx")),
        loss_fn_inputs={"target_tokens": PROMPT[1:] + list(b"xyzxyzxy"), "weights": [0.0] * 7 + [1.0] * 8},
    )
    for _ in range(8):
        tc.forward_backward([target], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert text(first) == start  # nothing published yet: still the weights saved at its creation
    second = tc.save_weights_and_get_sampling_client(kind="inflight")  # publishes the new weights
    moved = text(second)
    assert moved != start
    assert text(first) == moved  # the earlier inflight client moved to the newer weights
    assert text(snapshot) == start  # a snapshot client keeps its weights


@pytest.mark.parametrize("key", [ALICE_KEY, BOB_KEY], ids=["another-session", "another-tenant"])
def test_a_sequence_sampled_in_another_session_or_tenant_is_refused(solo, key):  # noqa: F811
    """Provenance works within one session: neither another session of the same tenant nor another
    tenant can name the sequences a session recorded."""
    first = tinker.ServiceClient(base_url=solo.url, api_key=ALICE_KEY)
    second = tinker.ServiceClient(base_url=solo.url, api_key=key)
    try:
        seq = sampled(first.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0), 1)[0]
        tc = second.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0)
        with pytest.raises(Exception, match="names no recorded sequence of this session"):
            tc.forward([rl_datum(PROMPT, seq, 1.0)], "stable_reinforce").result()
    finally:
        first.close("success").result()
        second.close("success").result()
