"""Engine rules a user relies on: run isolation, seq_id ordering, retries, gaps, snapshots, checkpoints."""

import numpy as np
import pytest
import torch
from tinker import types

from tests._support.raw import RawTinker, sft_datum
from tests.conftest import TINY

PROMPTS = [[11, 12, 13, 14], [31, 32]]
COMPLETIONS = [[21, 22, 23], [41, 42, 43, 44]]


def data_for(offset: int):
    return [
        sft_datum([t + offset for t in p], [t + offset for t in c])
        for p, c in zip(PROMPTS, COMPLETIONS, strict=True)
    ]


def sdk_data(offset: int):
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(toks),
            loss_fn_inputs={k: v.tolist() for k, v in inputs.items()},
        )
        for toks, inputs in data_for(offset)
    ]


def adapter_tensors(server, model_id):
    run = server.service.runs[model_id]
    return {n: t.detach().clone() for n, t in run.state.adapter.named_parameters()}


# -- isolation -------------------------------------------------------------------------------------
STEPS = [("A", "fb"), ("A", "opt"), ("A", "fb"), ("A", "fb"), ("A", "opt")]
ORDERS = {
    "alternating": "ABABABABAB",
    "A first": "AAAAABBBBB",
    "B first": "BBBBBAAAAA",
    "nested": "ABBAABBAAB",
}


def run_schedule(sc, order: str):
    """Each run does fb, opt, fb, fb, opt (gradients accumulate across the two fb); ``order`` interleaves them."""
    clients = {
        r: sc.create_lora_training_client(base_model=TINY, rank=8, seed=s).result()
        for r, s in (("A", 1), ("B", 2))
    }
    cursor = {"A": 0, "B": 0}
    metrics = {"A": [], "B": []}
    for r in order:
        kind = STEPS[cursor[r]][1]
        cursor[r] += 1
        tc = clients[r]
        if kind == "fb":
            out = tc.forward_backward(sdk_data(0 if r == "A" else 100), "cross_entropy").result()
            metrics[r].append(
                (
                    "loss",
                    out.metrics["loss:sum"],
                    [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs],
                )
            )
        else:
            out = tc.optim_step(
                types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0, weight_decay=0.01)
            ).result()
            metrics[r].append(("opt", out.metrics))
    return clients, metrics


def test_interleaved_runs_are_bit_identical_to_solo_runs(server, service_client):
    solo_a, metrics_a = run_schedule(service_client, "AAAAA")
    solo_b, metrics_b = run_schedule(service_client, "BBBBB")
    ref = {
        "A": adapter_tensors(server, solo_a["A"].model_id),
        "B": adapter_tensors(server, solo_b["B"].model_id),
    }
    ref_metrics = {"A": metrics_a["A"], "B": metrics_b["B"]}
    for name, order in ORDERS.items():
        clients, metrics = run_schedule(service_client, order)
        for r in "AB":
            got = adapter_tensors(server, clients[r].model_id)
            assert got.keys() == ref[r].keys()
            for k in got:
                assert torch.equal(got[k], ref[r][k]), f"{name}: run {r} tensor {k} differs from its solo run"
            assert metrics[r] == ref_metrics[r], f"{name}: run {r} metrics differ (grad norms are per run)"


def test_grad_clipping_is_per_run(server, service_client):
    """B's optim_step with a tiny clip norm must neither scale nor count A's pending gradients."""
    a = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
    b = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=2).result()
    a.forward_backward(sdk_data(0), "cross_entropy").result()
    grads_before = {
        n: t.grad.clone() for n, t in server.service.runs[a.model_id].state.adapter.named_parameters()
    }
    b.forward_backward(sdk_data(100), "cross_entropy").result()
    b_norm = (
        b.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=1e-3))
        .result()
        .metrics["grad_norm:mean"]
    )
    after = dict(server.service.runs[a.model_id].state.adapter.named_parameters())
    for n, g in grads_before.items():
        assert torch.equal(after[n].grad, g)
    solo = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=2).result()
    solo.forward_backward(sdk_data(100), "cross_entropy").result()
    assert solo.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] == b_norm


# -- ordering, retries, gaps -------------------------------------------------------------------------
def test_retry_of_same_seq_id_is_applied_once(server, raw):
    sid = raw.session()
    twice, once = raw.create_model(sid, 0, seed=5), raw.create_model(sid, 1, seed=5)
    first = raw.submit_fb(twice, 1, data_for(0))
    assert raw.submit_fb(twice, 1, data_for(0)) == first  # the retry gets the original request back
    raw.submit_fb(once, 1, data_for(0))
    g_twice = raw.result(raw.submit_optim(twice, 2))["metrics"]["grad_norm:mean"]
    g_once = raw.result(raw.submit_optim(once, 2))["metrics"]["grad_norm:mean"]
    assert g_twice == g_once
    a, b = adapter_tensors(server, twice), adapter_tensors(server, once)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_idempotency_key_dedupes_a_resubmitted_request(raw):
    sid = raw.session()
    m = raw.create_model(sid)
    first = raw.submit_fb(m, 1, data_for(0), **{"X-Idempotency-Key": "key-1"})
    assert raw.submit_fb(m, 1, data_for(0), **{"X-Idempotency-Key": "key-1"}) == first


def test_bad_request_takes_its_slot_and_the_next_one_runs(raw):
    sid = raw.session()
    m = raw.create_model(sid)
    ok1 = raw.submit_fb(m, 1, data_for(0))
    bad_tokens, inputs = data_for(0)[0]
    bad = raw.submit_fb(m, 2, [([*bad_tokens[:-1], 99999], inputs)])
    ok3 = raw.submit_optim(m, 3)
    assert "loss_fn_outputs" in raw.result(ok1)
    err = raw.result(bad)
    assert err["category"] == "user" and "data[0].model_input" in err["error"] and "99999" in err["error"]
    assert "grad_norm:mean" in raw.result(ok3)["metrics"]


def test_out_of_order_arrival_executes_in_seq_order(raw):
    sid = raw.session()
    m = raw.create_model(sid, seed=3)
    opt = raw.submit_optim(m, 2)  # arrives first but must wait for seq 1
    fb = raw.submit_fb(m, 1, data_for(0))
    assert raw.result(opt)["metrics"]["grad_norm:mean"] > 0  # it saw seq 1's gradients
    assert "loss_fn_outputs" in raw.result(fb)


def test_a_gap_times_out_naming_the_missing_seq_id(make_server):
    live = make_server(seq_gap_timeout_s=0.5)
    raw = RawTinker(live.client())
    sid = raw.session()
    m = raw.create_model(sid)
    raw.result(raw.submit_fb(m, 1, data_for(0)))
    waiting = raw.submit_optim(m, 3)  # seq 2 never comes
    err = raw.result(waiting)
    assert (
        err["category"] == "user"
        and "seq_id 2 never arrived" in err["error"]
        and "OPENRL_SEQ_GAP_TIMEOUT_S" in err["error"]
    )
    late = raw.result(raw.submit_fb(m, 2, data_for(0)))
    assert "arrived after" in late["error"]
    assert "grad_norm:mean" in raw.result(raw.submit_optim(m, 4))["metrics"]  # the run goes on


def test_a_far_ahead_seq_id_times_out_without_the_service_counting_to_it(make_server):
    """A gap of 10**12 seq_ids expires like any other (the fuzzer once made one take all memory)."""
    live = make_server(seq_gap_timeout_s=0.5)
    raw = RawTinker(live.client())
    m = raw.create_model(raw.session())
    far = 10**12
    err = raw.result(raw.submit_optim(m, far))
    assert "seq_id 1 never arrived" in err["error"]
    for seq in (1, far - 1):  # moved past: refused, never run
        assert "arrived after" in raw.result(raw.submit_optim(m, seq))["error"]
    assert raw.result(raw.submit_optim(m, far)) == err  # a retry: the original answer
    assert "grad_norm:mean" in raw.result(raw.submit_optim(m, far + 1))["metrics"]  # the run goes on


# -- futures -----------------------------------------------------------------------------------------
def test_long_poll_answers_try_again_then_results_expire_with_410(make_server):
    # A TTL far longer than the test: results expire only when the test sweeps with a later clock.
    live = make_server(long_poll_s=0.2, future_ttl_s=600, seq_gap_timeout_s=30)
    raw = RawTinker(live.client())
    sid = raw.session()
    m = raw.create_model(sid)
    waiting = raw.submit_optim(m, 2)  # blocked behind the missing seq 1
    r = raw.post("retrieve_future", request_id=waiting)
    assert r.status_code == 200 and r.json() == {
        "type": "try_again",
        "request_id": waiting,
        "queue_state": "active",
    }
    done = raw.submit_fb(m, 1, data_for(0))
    assert "loss_fn_outputs" in raw.result(done)
    assert "loss_fn_outputs" in raw.result(done)  # a result can be fetched more than once
    live.service.engine.forget(live.service.futures.sweep(now=__import__("time").time() + 601))
    r = raw.post("retrieve_future", request_id=done)
    assert r.status_code == 410 and "OPENRL_FUTURE_TTL_S" in r.json()["error"]


# -- sampling snapshots and logprobs -------------------------------------------------------------------
def test_sampler_snapshot_is_immutable(service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=4).result()
    prompt = types.ModelInput.from_ints([11, 12, 13, 14])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    before = tc.save_weights_and_get_sampling_client().result()
    first = before.sample(prompt, 1, greedy).result().sequences[0]
    first_lp = before.compute_logprobs(prompt).result()
    for _ in range(3):
        tc.forward_backward(sdk_data(0), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    again = before.sample(prompt, 1, greedy).result().sequences[0]
    assert again.tokens == first.tokens and again.logprobs == first.logprobs
    assert before.compute_logprobs(prompt).result() == first_lp
    after = tc.save_weights_and_get_sampling_client().result()
    assert after.compute_logprobs(prompt).result() != first_lp  # the new snapshot sees the new weights


def test_sampler_logprobs_match_the_trainer(service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=6).result()
    for _ in range(2):
        tc.forward_backward(sdk_data(0), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [11, 12, 13, 14]
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=12, seed=1)
    ).result()
    diffs = []
    datums = []
    for s in res.sequences:
        full = prompt + list(s.tokens)
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]}
            )
        )
    out = tc.forward(datums, "cross_entropy").result()
    for s, o in zip(res.sequences, out.loss_fn_outputs, strict=True):
        trainer_lp = o["logprobs"].to_numpy()[len(prompt) - 1 :]
        diffs.extend(np.abs(trainer_lp - np.array(s.logprobs)).tolist())
    assert np.mean(diffs) <= 1e-4


# -- checkpoints ------------------------------------------------------------------------------------
def train_steps(tc, n, offset=0):
    losses = []
    for _ in range(n):
        losses.append(tc.forward_backward(sdk_data(offset), "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return losses


def test_checkpoint_round_trip_with_optimizer_continues_exactly(server, service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=7).result()
    train_steps(tc, 3)
    mid = tc.save_state("mid").result().path
    uninterrupted = train_steps(tc, 3)
    resumed = service_client.create_training_client_from_state_with_optimizer(mid).result()
    assert resumed.get_info().lora_rank == 8
    continued = train_steps(resumed, 3)
    assert continued == pytest.approx(uninterrupted, rel=1e-5)
    a, b = adapter_tensors(server, tc.model_id), adapter_tensors(server, resumed.model_id)
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
    # Without the optimizer state, Adam restarts from zero moments: the trajectory differs.
    fresh = service_client.create_training_client_from_state(mid).result()
    assert train_steps(fresh, 3) != pytest.approx(uninterrupted, rel=1e-5)
