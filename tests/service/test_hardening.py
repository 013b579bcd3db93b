"""Failure paths found in review: partial gradients, huge declared shapes, snapshot budgets, origins."""

import time

import numpy as np
import pytest

from openrl_service.config import Limits
from tests._support.raw import RawTinker, fb_body, sft_datum

PROTO = {"Content-Type": "application/x-protobuf"}


def varied(n=3):
    return [sft_datum(list(range(10, 10 + 20 * (i + 1))), [97, 98, 99]) for i in range(n)]


def test_a_failed_forward_backward_leaves_no_partial_gradient(make_server, monkeypatch):
    """If a later micro-batch fails (on a GPU: out of memory), the earlier ones' gradients are rolled back."""
    from openrl_service.training import trainer

    live = make_server(microbatch_tokens=64)  # three datums -> three micro-batches
    raw = RawTinker(live.client())
    sid = raw.session()
    failing, clean = raw.create_model(sid, 0, seed=9), raw.create_model(sid, 1, seed=9)
    real = trainer.compute_loss
    calls = {"n": 0}

    def second_call_fails(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "compute_loss", second_call_fails)
    err = raw.result(raw.submit_fb(failing, 1, varied()))
    assert err["category"] == "server" and "incident" in err["error"]
    monkeypatch.setattr(trainer, "compute_loss", real)
    raw.result(raw.submit_fb(failing, 2, [sft_datum([11, 12, 13], [21, 22])]))
    raw.result(raw.submit_fb(clean, 1, [sft_datum([11, 12, 13], [21, 22])]))
    g_failing = raw.result(raw.submit_optim(failing, 3))["metrics"]["grad_norm:mean"]
    g_clean = raw.result(raw.submit_optim(clean, 2))["metrics"]["grad_norm:mean"]
    assert g_failing == g_clean  # only the successful call's gradient was applied


def test_nk_targets_over_the_k_limit_name_it(server, raw):
    m = raw.create_model(raw.session())
    targets = np.zeros((4, 65), dtype=np.int64)
    r = server.client().post(
        "/api/v1/forward_backward",
        headers=PROTO,
        content=fb_body(m, 1, [([1, 2, 3, 4], {"target_tokens": targets})]),
    )
    err = raw.result(r.json()["request_id"])
    assert "OPENRL_MAX_TARGET_K" in err["error"] and "target_tokens" in err["error"]


def test_request_token_budget_names_the_limit(make_server):
    live = make_server(limits=Limits(max_request_tokens=100))
    raw = RawTinker(live.client())
    m = raw.create_model(raw.session())
    r = live.client().post("/api/v1/forward_backward", headers=PROTO, content=fb_body(m, 1, varied()))
    err = raw.result(r.json()["request_id"])
    assert err["error"].startswith("data:") and "OPENRL_MAX_REQUEST_TOKENS" in err["error"]
    assert "loss_fn_outputs" in raw.result(raw.submit_fb(m, 2, [sft_datum([11, 12], [13])]))


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("create_session", {"tags": 5}, "tags"),
        ("create_session", {"user_metadata": [1]}, "user_metadata"),
        ("create_session", {"user_metadata": {"x": "y" * 70_000}}, "OPENRL_MAX_METADATA_BYTES"),
    ],
)
def test_session_fields_are_type_checked(server, route, body, field):
    r = server.client().post(f"/api/v1/{route}", json=body)
    assert r.status_code == 400 and field in r.json()["error"]


def test_checkpoint_samplers_reload_after_eviction_and_recently_used_ones_stay(make_server):
    live = make_server(max_sampler_snapshots=2)
    raw = RawTinker(live.client())
    sid = raw.session()
    m = raw.create_model(sid)
    raw.result(raw.submit_fb(m, 1, [sft_datum([11, 12, 13], [21, 22])]))
    raw.result(raw.submit_optim(m, 2, lr=1e-2))
    path = raw.result(
        raw.post("save_weights_for_sampler", model_id=m, seq_id=3, path="s").json()["request_id"]
    )["path"]
    from_path = raw.post(
        "create_sampling_session", session_id=sid, sampling_session_seq_id=100, model_path=path
    )
    sampler = from_path.json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [11, 12, 13]}]}

    def greedy(sampler_id):
        r = raw.post(
            "asample",
            sampling_session_id=sampler_id,
            num_samples=1,
            prompt=prompt,
            sampling_params={"max_tokens": 6, "temperature": 0.0},
        )
        assert r.status_code == 200, r.text
        seq = raw.result(r.json()["request_id"])["sequences"][0]
        return seq["tokens"], seq["logprobs"]

    first = greedy(sampler)
    ephemeral = []
    for seq in (4, 5, 6):  # three new snapshots: over the budget of two
        r = raw.post("save_weights_for_sampler", model_id=m, seq_id=seq, sampling_session_seq_id=seq)
        ephemeral.append(raw.result(r.json()["request_id"])["sampling_session_id"])
        greedy(ephemeral[-1])
    assert live.service.samplers[sampler].adapter is None  # its tensors were dropped...
    assert greedy(sampler) == first  # ...and reload from the checkpoint on the next request
    assert (
        "evicted"
        in raw.post("asample", sampling_session_id=ephemeral[0], num_samples=1, prompt=prompt).json()["error"]
    )


def test_default_max_tokens_fits_a_long_prompt(server, raw):
    sid = raw.session()
    sampler = raw.post(
        "create_sampling_session", session_id=sid, sampling_session_seq_id=0, base_model="openrl/tiny"
    ).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [97] * 2040}]}
    r = raw.post(
        "asample",
        sampling_session_id=sampler,
        num_samples=1,
        prompt=prompt,
        sampling_params={"temperature": 1.0, "stop": []},
    )
    assert r.status_code == 200, r.text
    assert len(raw.result(r.json()["request_id"])["sequences"][0]["tokens"]) == 8  # up to the context length


def test_another_local_port_is_a_foreign_origin(server):
    port = int(server.url.rsplit(":", 1)[1])
    c = server.client()
    assert (
        c.post("/api/v1/create_session", json={}, headers={"Origin": f"http://127.0.0.1:{port}"}).status_code
        == 200
    )
    assert (
        c.post(
            "/api/v1/create_session", json={}, headers={"Origin": f"http://localhost:{port + 1}"}
        ).status_code
        == 403
    )


def test_json_routes_refuse_other_content_types(server):
    r = server.client().post("/api/v1/create_session", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]


def test_overlong_run_ids_are_not_found(server):
    r = server.client().get("/api/v1/training_runs/" + "a:" * 200)
    assert r.status_code == 404


def test_forgotten_finished_sessions_still_answer_410(make_server):
    live = make_server(session_idle_timeout_s=1)
    raw = RawTinker(live.client())
    sid = raw.session()
    raw.post(f"sessions/{sid}/finish")
    live.service.reap_idle_sessions(now=time.time() + 10)
    assert sid not in live.service.sessions
    assert raw.post("session_heartbeat", session_id=sid).status_code == 410
