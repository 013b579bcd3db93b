"""The OpenAI-compatible API, driven by the `openai` SDK (sync, async, streaming) against a real service:
base models and checkpoints, greedy tokens equal to Tinker SDK sampling of the same weights, tenancy,
OpenAI's error shape, and hosted Tinker's path and model naming."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY, TINY

PROMPT = list(b"Once upon a time")
TARGET = list(b" ab ab ab ab ab ab ab ab ab")


@pytest.fixture(scope="module")
def ckpt(server):
    """A sampler checkpoint of alice's trained towards ' ab ab ...' (so greedy output differs from
    the base model's), and a Tinker sampling client on it."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=5).result()
    seq = PROMPT + TARGET
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * len(TARGET)},
    )
    for _ in range(30):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    path = tc.save_weights_for_sampler("oai").result().path
    sampler = sc.create_sampling_client(model_path=path)
    yield path, sampler, sc
    sc.close("success").result()


def oai(server, key=ALICE_KEY, prefix="/v1", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + prefix, api_key=key, max_retries=0, **kw)


def tinker_greedy(sampler, prompt: list[int], max_tokens: int) -> list[int]:
    out = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ).result()
    return list(out.sequences[0].tokens)


def text_of(tokens: list[int]) -> str:
    """The tiny model's tokens are bytes; ids >= 256 are specials (dropped from text)."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", "replace")


def test_models_lists_the_base_and_only_the_callers_checkpoints(server, ckpt):
    path, _, _ = ckpt
    mine = {m.id for m in oai(server).models.list()}
    assert TINY in mine and path in mine
    theirs = {m.id for m in oai(server, BOB_KEY).models.list()}
    assert TINY in theirs and path not in theirs
    assert oai(server).models.retrieve(path).id == path


def test_completion_greedy_tokens_equal_tinker_sampling_on_base_and_checkpoint(server, ckpt):
    path, sampler, sc = ckpt
    base_sampler = sc.create_sampling_client(base_model=TINY)
    client = oai(server)
    for model, tinker_sampler in ((TINY, base_sampler), (path, sampler)):
        want = tinker_greedy(tinker_sampler, PROMPT, 12)
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == text_of(want), model
        assert got.model == model
        assert got.usage.prompt_tokens == len(PROMPT) and got.usage.completion_tokens == len(want)
        # a string prompt encodes to the same tokens (the tiny tokenizer is bytes)
        again = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=12, temperature=0
        )
        assert again.choices[0].text == got.choices[0].text
    trained = (
        client.completions.create(model=path, prompt=PROMPT, max_tokens=9, temperature=0).choices[0].text
    )
    base = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=9, temperature=0).choices[0].text
    assert trained == " ab ab ab" and base != trained  # the checkpoint is served, not the base


def test_chat_applies_the_template_and_equals_tinker_sampling_of_the_templated_prompt(server, ckpt):
    path, sampler, _ = ckpt
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = []  # the tiny model's template spelled out: <|im_start|> is id 257, <|im_end|> 258
    for m in messages:
        prompt += [257] + list(f"{m['role']}\n{m['content']}".encode()) + [258] + list(b"\n")
    prompt += [257] + list(b"assistant\n")
    want = tinker_greedy(sampler, prompt, 10)
    got = oai(server).chat.completions.create(model=path, messages=messages, max_tokens=10, temperature=0)
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == text_of(want)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.object == "chat.completion"


def test_streaming_equals_non_streaming_sync_and_async(server, ckpt):
    path, _, _ = ckpt
    client = oai(server)
    args = {"model": path, "max_tokens": 10, "temperature": 0, "n": 2, "seed": 3}
    whole = client.completions.create(prompt="Once upon a time", **args)
    parts: dict[int, str] = {}
    finish = {}
    usage = None
    for chunk in client.completions.create(
        prompt="Once upon a time", stream=True, stream_options={"include_usage": True}, **args
    ):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert parts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens

    chat_args = {
        "model": path,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    whole_chat = client.chat.completions.create(**chat_args).choices[0].message.content

    async def streamed() -> str:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=ALICE_KEY, max_retries=0)
        text = ""
        async for chunk in await aclient.chat.completions.create(stream=True, **chat_args):
            for c in chunk.choices:
                text += c.delta.content or ""
        again = await aclient.chat.completions.create(**chat_args)
        await aclient.close()
        assert again.choices[0].message.content == whole_chat
        return text

    assert asyncio.run(streamed()) == whole_chat


def test_sampling_with_a_seed_is_reproducible_and_n_gives_n_choices(server, ckpt):
    path, _, _ = ckpt
    client = oai(server)
    a = client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11)
    b = client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    two = client.completions.create(model=TINY, prompt=["ab", "cd"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]


def test_stop_sequences_end_the_text_before_them(server, ckpt):
    path, _, _ = ckpt
    got = oai(server).completions.create(
        model=path, prompt=PROMPT, max_tokens=20, temperature=0, stop=["b a"]
    )
    assert got.choices[0].text == " a" and got.choices[0].finish_reason == "stop"
    chat = oai(server).chat.completions.create(
        model=path, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_logprobs_are_the_samplers(server, ckpt):
    path, sampler, _ = ckpt
    want = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6, temperature=0.0)
    ).result()
    got = oai(server).completions.create(model=path, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.top_logprobs) == 6
    for mine, theirs in zip(lp.token_logprobs, want.sequences[0].logprobs, strict=True):
        assert abs(mine - theirs) < 1e-4
    for chosen, lp_chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp_chosen, abs=1e-5)  # greedy: the best
        assert chosen in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chat = oai(server).chat.completions.create(
        model=path,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_echo_returns_prompt_logprobs_as_lm_eval_reads_them(server, ckpt):
    path, sampler, _ = ckpt
    want = sampler.sample(
        types.ModelInput.from_ints(PROMPT + TARGET[:4]),
        1,
        types.SamplingParams(max_tokens=1, temperature=0.0),
        include_prompt_logprobs=True,
    ).result()
    got = oai(server).completions.create(
        model=path, prompt=PROMPT + TARGET[:4], max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = got.choices[0].logprobs
    assert got.choices[0].text.startswith("Once upon a time ab ")
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(PROMPT) + 4 + 1
    for mine, theirs in zip(lp.token_logprobs[1:-1], want.prompt_logprobs[1:], strict=True):
        assert abs(mine - theirs) < 1e-4
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])


def test_another_tenants_checkpoint_is_a_404_in_openais_shape(server, ckpt):
    path, _, _ = ckpt
    bob = oai(server, BOB_KEY)
    for call in (
        lambda: bob.completions.create(model=path, prompt="x", max_tokens=2),
        lambda: bob.chat.completions.create(model=path, messages=[{"role": "user", "content": "x"}]),
        lambda: bob.models.retrieve(path),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "model_not_found" and e.value.param == "model"
        assert "not found" in e.value.message
    # not told apart from a checkpoint that does not exist
    with pytest.raises(openai.NotFoundError) as missing:
        oai(server).completions.create(model=path.replace("/oai", "/nope"), prompt="x")
    assert missing.value.code == "model_not_found"


def test_bad_input_is_a_400_naming_the_field_and_the_service_stays_up(server, ckpt):
    path, _, _ = ckpt
    client = oai(server)
    cases = [
        ({"temperature": 5}, "temperature"),
        ({"n": 10_000}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"logprobs": 99}, "logprobs"),
        ({"prompt": [10**7]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"model": "no/such-model"}, "model"),
        ({"model": f"{TINY}:peft:99999999"}, "model"),
        ({"model": "tinker://bad path"}, "model"),
    ]
    for extra, field in cases:
        args = {"model": path, "prompt": "Once", "max_tokens": 4, **extra}
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(**args)
        assert e.value.status_code in (400, 404), extra
        assert e.value.param == field, (extra, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:  # prompts x n x tokens past OPENRL_MAX_REQUEST_TOKENS
        client.completions.create(model=path, prompt=["Once"] * 4000, n=128, max_tokens=64)
    assert e.value.param == "prompt" and "OPENRL_MAX_REQUEST_TOKENS" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=path, messages=[{"role": "user", "content": [{"type": "image_url"}]}]
        )
    assert e.value.param == "messages[0].content"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=path, messages=[], max_tokens=2)
    assert e.value.param == "messages"
    with pytest.raises(openai.AuthenticationError) as e:
        oai(server, "tml-wrong-key").models.list()
    assert e.value.body["type"] == "authentication_error"
    # a body that is not JSON, and the service afterwards
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{",
        headers={"Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.get(server.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {ALICE_KEY}"})
    assert r.status_code == 404 and "error" in r.json() and isinstance(r.json()["error"], dict)
    assert (
        client.completions.create(model=path, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
        == " ab"
    )


def test_hosted_tinkers_path_and_model_names(server, ckpt):
    """Code written for hosted Tinker: base_url <service>/oai/api/v1, model = a checkpoint path, a base
    model id with its context length, or '<base>;<checkpoint>'."""
    path, _, _ = ckpt
    client = oai(server, prefix="/oai/api/v1")
    plain = client.completions.create(model=path, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    assert plain == " ab ab"
    named = client.completions.create(model=f"{TINY};{path}", prompt=PROMPT, max_tokens=6, temperature=0)
    assert named.choices[0].text == plain
    ctx = server.service.models[TINY].base.context_length
    base = client.completions.create(model=f"{TINY}:peft:{ctx}", prompt=PROMPT, max_tokens=6, temperature=0)
    assert (
        base.choices[0].text
        == oai(server)
        .completions.create(model=TINY, prompt=PROMPT, max_tokens=6, temperature=0)
        .choices[0]
        .text
    )
    with pytest.raises(openai.BadRequestError) as e:  # a context shorter than prompt + max_tokens
        client.completions.create(model=f"{TINY}:peft:8", prompt=PROMPT, max_tokens=6)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):  # a base this service does not serve
        client.completions.create(model=f"openrl/tiny-wide;{path}", prompt=PROMPT, max_tokens=2)


def test_an_overwritten_checkpoint_is_served_anew(server):
    """The served adapter follows the checkpoint: saving under the same name changes the answer."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=9).result()
    client = oai(server)
    path = tc.save_weights_for_sampler("again").result().path
    before = client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    seq = PROMPT + list(b" zz zz zz zz")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * 12},
    )
    for _ in range(30):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert tc.save_weights_for_sampler("again").result().path == path
    after = client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert after != before and after.count("z") >= 4  # trained towards "zz"
    sc.close("success").result()


def test_requests_fuse_with_other_sampling_and_answer_as_alone(server, ckpt):
    """The endpoint's requests are sampling ops of the engine like any other: queued behind the worker,
    a base-model request and a checkpoint request share one fused call, and each answers what it
    answers alone (greedy)."""
    import threading
    import time

    from tests.service.test_scheduling import held_worker, wait_for

    path, _, _ = ckpt
    svc, client = server.service, oai(server)
    args = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    alone = {m: client.completions.create(model=m, **args).choices[0].text for m in (TINY, path)}
    together: dict[str, str] = {}

    def ask(model: str) -> None:
        together[model] = client.completions.create(model=model, **args).choices[0].text

    t0 = time.time()
    queued = svc.engine.runnable
    with held_worker(svc.engine, svc.futures):
        before = queued()
        threads = [threading.Thread(target=ask, args=(m,)) for m in (TINY, path)]
        for t in threads:
            t.start()
        wait_for(lambda: queued() >= before + 2)
    for t in threads:
        t.join(60)
    assert together == alone
    records = svc.recorder.wait_for(lambda recs: len([r for r in recs if r.kind == "sample"]) >= 2, since=t0)
    fused = [r for r in records if r.kind == "sample"]
    assert len({r.fused_id for r in fused}) == 1 and fused[0].fused_id is not None, fused
