"""A call's datums run as padded micro-batches, never one datum at a time, and splitting changes nothing."""

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, TINY


def varied_data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(5, 60))
        seq = rng.integers(0, 256, size=length).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": rng.uniform(0, 1, length - 1).tolist()},
            )
        )
    return out


def train_once(url, data):
    sc = tinker.ServiceClient(base_url=url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    fb = tc.forward_backward(data, "cross_entropy").result()
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sc.close("success").result()
    return fb, opt


def test_datums_run_as_one_padded_batch(make_server):
    live = make_server()
    batches = []
    live.service.base.model.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    data = varied_data()
    train_once(live.url, data)
    longest = max(d.model_input.length for d in data)
    assert batches == [(8, longest)]


def test_micro_batching_gives_the_same_result(make_server, server):
    data = varied_data(seed=1)
    whole_fb, whole_opt = train_once(server.url, data)
    small = make_server(microbatch_tokens=64)  # forces several micro-batches per call
    split_fb, split_opt = train_once(small.url, data)
    assert split_fb.metrics["loss:sum"] == pytest.approx(whole_fb.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(split_fb.loss_fn_outputs, whole_fb.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)
    assert split_opt.metrics["grad_norm:mean"] == pytest.approx(whole_opt.metrics["grad_norm:mean"], rel=1e-5)
