"""One request cannot take the host's memory or hold up other tenants: a sampling call is split into
batches within OPENRL_SAMPLE_BATCH_BYTES (the samples are the ones one batch would draw), a sample that
cannot fit a batch alone is refused with a 413 naming the numbers on every route, text that cannot
fit the context is refused before it is encoded, and tokenisation runs off the event loop."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from openrl_service.sampling.base import SampleJob, SamplingParams
from openrl_service.sampling.budget import cost_of, plan
from tests.conftest import ALICE_KEY, TINY

V1 = "/openrl/v1"
BEARER = {"Authorization": f"Bearer {ALICE_KEY}"}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    from openrl_service.models.loading import load_base_model

    data = tmp_path_factory.mktemp("bounded")
    (data / "models").mkdir()
    import shutil

    shutil.copytree(tiny_model_dir, data / "models" / "openrl-tiny")
    return load_base_model("tiny", data_dir=data)


def jobs_of(prompt_logprobs: bool = False) -> list[SampleJob]:
    rng = np.random.default_rng(0)
    out = []
    for i, (length, n, temperature) in enumerate(
        [(40, 3, 0.0), (90, 7, 1.0), (12, 1, 1.0), (10, 2, 0.0), (64, 5, 0.7)]
    ):
        prompt = [int(t) for t in rng.integers(0, 256, length)]
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=100 + i)
        out.append(SampleJob(prompt, n, params, None, prompt_logprobs=prompt_logprobs and i == 1))
    return out


def test_a_call_bigger_than_a_batch_is_split_and_draws_the_same_samples(base):
    """With a budget a few samples wide, the call runs as many batches (whole jobs, and a job's samples
    across batches), each within the budget, and every sample is the one a single batch draws."""
    from openrl_service.sampling.torch_sampler import TorchSampler

    sampler = TorchSampler(base)
    jobs = jobs_of(prompt_logprobs=True)
    base.sample_batch_bytes = 1 << 40
    whole = sampler.sample_many(jobs)
    cost = cost_of(base)
    limit = cost.bytes(prompts=1, width=90, rows=2, decode=12, padded=False)  # about 2 rows of the longest
    batches = plan(jobs, cost, limit)
    assert len(batches) >= 6
    split_jobs = {p.job for b in batches for p in b if p.rows < jobs[p.job].num_samples}
    assert {1, 4} <= split_jobs  # the 7- and 5-sample jobs are split by samples
    assert any(len({p.job for p in b}) > 1 for b in batches)  # short jobs share a batch
    for batch in batches:
        picked = [jobs[p.job] for p in batch]
        widths = [len(j.prompt) for j in picked]
        assert (
            len(batch) == 1
            or cost.bytes(
                prompts=len(batch),
                width=max(widths),
                rows=sum(p.rows for p in batch),
                decode=12,
                logprob_tokens=len(batch) * max(widths)  # all logits kept when one job asks
                if any(p.first_row == 0 and jobs[p.job].prompt_logprobs for p in batch)
                else 0,
                padded=min(widths) != max(widths),
            )
            <= limit
        )
    calls = []
    generate = sampler._generate

    def counted(part):
        calls.append([j.num_samples for j in part])
        return generate(part)

    sampler._generate = counted
    try:
        base.sample_batch_bytes = limit
        split = sampler.sample_many(jobs)
    finally:
        base.sample_batch_bytes = None
    assert len(calls) == len(batches)
    for a, b in zip(whole, split, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)
        assert a.tokens == b.tokens
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        if a.prompt_logprobs is not None:
            assert np.allclose(a.prompt_logprobs[1:], b.prompt_logprobs[1:], atol=1e-5)


def test_one_v1_call_of_thousands_of_long_prompts_stays_within_its_memory_bound(tmp_path, tiny_model_dir):
    """2,048 prompts of 160 tokens in one /v1/completions call (in one batch they took 1.8 GiB) answer in
    full, and the service's peak memory grows within the stated bound: 1.5 x OPENRL_SAMPLE_BATCH_BYTES
    (the batches, and what the allocator keeps between them) + 150 bytes a prompt token (the call's own
    data: its parsed body, jobs and replies) + 32 MiB."""
    from tests._support.serve import finish, start, wait_ready

    budget = 128 << 20
    env = {"OPENRL_API_KEYS": f"alice:{ALICE_KEY}", "OPENRL_SAMPLE_BATCH_BYTES": str(budget)}
    data = tmp_path / "d"
    data.mkdir()
    served = start(data, tiny_model_dir, env=env)
    try:
        wait_ready(served)
        pid = served.proc.pid

        def status(key: str) -> int:
            line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(key))
            return int(line.split()[1]) * 1024

        with httpx.Client(base_url=served.url, headers=BEARER, timeout=600) as http:
            warm = http.post("/v1/completions", json={"model": TINY, "prompt": "hello", "max_tokens": 2})
            assert warm.status_code == 200, warm.text
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
            before = status("VmRSS:")
            prompts = [[(i * 7 + k) % 250 for k in range(160)] for i in range(2048)]
            r = http.post("/v1/completions", json={"model": TINY, "prompt": prompts, "max_tokens": 1})
            grown = status("VmHWM:") - before
            assert r.status_code == 200, r.text[:500]
            assert len(r.json()["choices"]) == 2048
            bound = budget * 3 // 2 + 150 * 2048 * 160 + (32 << 20)
            assert grown <= bound, f"grew {grown >> 20} MiB; the bound is {bound >> 20} MiB"
            assert http.get("/readyz").status_code == 200  # still serving
    finally:
        served.proc.terminate()
        finish(served)


def test_a_sample_that_cannot_fit_a_batch_alone_is_refused_with_413_on_every_route(server):
    """A batch can be split, one sample cannot: on /v1, /oai/api/v1, the Tinker SDK and the notebook API
    a sample whose estimate alone exceeds the budget is a 413 naming the numbers, nothing is queued, and
    a small request still answers."""
    base = server.service.default_model.base
    old = base.sample_batch_bytes
    base.sample_batch_bytes = cost_of(base).bytes(prompts=1, width=200, rows=1, decode=20, padded=False)
    long_text = "the cat sat on the mat. " * 40  # 960 byte tokens
    try:
        with server.client(ALICE_KEY) as http:
            for prefix in ("/v1", "/oai/api/v1"):
                r = http.post(
                    f"{prefix}/completions",
                    json={"model": TINY, "prompt": long_text, "max_tokens": 20},
                    headers=BEARER,
                )
                assert r.status_code == 413, r.text
                message = r.json()["error"]["message"]
                assert "OPENRL_SAMPLE_BATCH_BYTES" in message and "MiB" in message and "960-token" in message
                r = http.post(
                    f"{prefix}/chat/completions",
                    json={
                        "model": TINY,
                        "messages": [{"role": "user", "content": long_text}],
                        "max_tokens": 20,
                    },
                    headers=BEARER,
                )
                assert r.status_code == 413 and "OPENRL_SAMPLE_BATCH_BYTES" in r.json()["error"]["message"]
            run = http.post(f"{V1}/runs", json={"name": "bounded", "seed": 0}).json()["run_id"]
            try:
                r = http.post(
                    f"{V1}/runs/{run}/sample", json={"prompts": [long_text], "max_tokens": 20, "chat": False}
                )
                assert r.status_code == 413 and r.json()["field"] == "prompt", r.text
                small = http.post(f"{V1}/runs/{run}/sample", json={"prompts": ["hi"], "max_tokens": 4})
                assert small.status_code == 200, small.text
            finally:
                http.delete(f"{V1}/runs/{run}")
        sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
        sampler = sc.create_sampling_client(base_model=TINY)
        with pytest.raises(Exception, match="OPENRL_SAMPLE_BATCH_BYTES"):
            sampler.sample(
                types.ModelInput.from_ints(list(long_text.encode())),
                1,
                types.SamplingParams(max_tokens=20),
            ).result()
        ok = sampler.sample(
            types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=4)
        ).result()
        assert len(ok.sequences) == 2
        sc.close("success").result()
    finally:
        base.sample_batch_bytes = old


@pytest.fixture
def tokenizer_calls(server, monkeypatch):
    """Every call of the served tokenizer's encode and chat template: (name, on the event loop?)."""
    import asyncio

    tok = server.service.default_model.base.tokenizer
    calls = []

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    for name in ("encode", "apply_chat_template"):
        real = getattr(tok, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append((_name, on_loop(), threading.current_thread().name))
            return _real(*a, **kw)

        monkeypatch.setattr(tok, name, spy)
    return calls


def test_text_that_cannot_fit_the_context_is_refused_before_it_is_encoded(server, tokenizer_calls):
    """A 1 MB prompt to a model of 2,048 tokens: a 413 naming the characters and the limit, at once, on
    /v1 (completions, chat) and the notebook API, with the tokenizer never called."""
    huge = "a" * (1 << 20)
    with server.client(ALICE_KEY) as http:
        for path, body in (
            ("/v1/completions", {"model": TINY, "prompt": huge, "max_tokens": 1}),
            ("/v1/completions", {"model": TINY, "prompt": ["hi", huge], "max_tokens": 1}),
            ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": huge}]}),
        ):
            r = http.post(path, json=body, headers=BEARER)
            assert r.status_code == 413, r.text[:300]
            message = r.json()["error"]["message"]
            assert "1,048,5" in message and "characters" in message and "2,048 tokens" in message, message
        # many empty messages, or a huge role: the template would render them all
        for messages in (
            [{"role": "user", "content": ""}] * 5000,
            [{"role": "u" * (1 << 20), "content": "hi"}],
        ):
            r = http.post("/v1/chat/completions", json={"model": TINY, "messages": messages}, headers=BEARER)
            assert r.status_code == 413 and "cannot fit" in r.json()["error"]["message"], r.text[:300]
        run = http.post(f"{V1}/runs", json={"name": "huge", "seed": 0}).json()["run_id"]
        try:
            r = http.post(f"{V1}/runs/{run}/sample", json={"prompts": [huge], "max_tokens": 1})
            assert r.status_code == 413 and r.json()["field"] == "prompts[0]", r.text[:300]
            r = http.post(
                f"{V1}/runs/{run}/sample",
                json={"prompts": [[{"role": "user", "content": huge}]], "max_tokens": 1},
            )
            assert r.status_code == 413, r.text[:300]
        finally:
            http.delete(f"{V1}/runs/{run}")
    assert tokenizer_calls == []


def test_tokenisation_and_chat_templates_run_off_the_event_loop(server, tokenizer_calls):
    with server.client(ALICE_KEY) as http:
        r = http.post(
            "/v1/completions",
            json={"model": TINY, "prompt": ["once", "upon"], "max_tokens": 2},
            headers=BEARER,
        )
        assert r.status_code == 200, r.text
        r = http.post(
            "/v1/chat/completions",
            json={"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers=BEARER,
        )
        assert r.status_code == 200, r.text
        run = http.post(f"{V1}/runs", json={"name": "offloop", "seed": 0}).json()["run_id"]
        try:
            for chat in (True, False):
                r = http.post(
                    f"{V1}/runs/{run}/sample", json={"prompts": ["hi"], "max_tokens": 2, "chat": chat}
                )
                assert r.status_code == 200, r.text
        finally:
            http.delete(f"{V1}/runs/{run}")
    names = {name for name, _, _ in tokenizer_calls}
    assert names == {"encode", "apply_chat_template"}, tokenizer_calls
    assert not [c for c in tokenizer_calls if c[1]], f"called on the event loop: {tokenizer_calls}"
