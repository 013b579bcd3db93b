"""A train step's KL to the run's starting weights (POST /openrl/v1/runs/{id}/train_step {kl_coef}),
the loss term behind it (training/losses.py, kl_ref_coef over ref_logprobs), and the limits the
capability entries publish (GET /api/v1/get_server_capabilities)."""

import math

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from openrl_service.config import Limits
from openrl_service.errors import UserError
from openrl_service.training.losses import LOSSES, check_loss, compute_loss, ratio_stats
from tests.conftest import ALICE_KEY, TINY, start_server

V1 = "/openrl/v1"
PROMPT = {"prompts": ["Name a colour"], "max_tokens": 8, "stop": []}
BIG_LR = {"learning_rate": 1e-2}
FROZEN = {"learning_rate": 0.0}  # a step that changes nothing: the same weights for two losses


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as c:
        yield c


def new_run(client, **body) -> str:
    r = client.post(f"{V1}/runs", json={"seed": 0, **body})
    assert r.status_code == 201, r.text
    return r.json()["run_id"]


def batch(client, run_id: str, seed: int, n: int = 4) -> list[dict]:
    """``n`` fresh samples of the run, with advantages +1 / -1."""
    r = client.post(f"{V1}/runs/{run_id}/sample", json={**PROMPT, "num_samples": n, "seed": seed})
    assert r.status_code == 200, r.text
    return [
        {"sample_id": s["sample_id"], "advantage": 1.0 if i % 2 else -1.0}
        for i, s in enumerate(r.json()["samples"])
    ]


def step(client, run_id: str, items: list[dict], **body) -> dict:
    r = client.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items, **body})
    assert r.status_code == 200, r.text
    return r.json()


def diverge(client, run_id: str, steps: int = 4) -> None:
    for k in range(steps):
        step(client, run_id, batch(client, run_id, 100 + k, n=8), optimizer=BIG_LR)


# -- the loss term ----------------------------------------------------------------------------------
def _batch_tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[2, 5:] = False
    adv = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, -2, -2, -2, -2], [0, 0.5, 0.5, 0.5, 0.5, 0, 0]])
    inputs = {
        "logprobs": lp + 0.1 * torch.randn(3, 7, generator=g, dtype=torch.float64),
        "advantages": adv.to(torch.float64),
        "ref_logprobs": lp - torch.rand(3, 7, generator=g, dtype=torch.float64),
    }
    return lp, inputs, valid


@pytest.mark.parametrize("loss", [name for name in LOSSES if name != "cross_entropy"])
def test_the_term_is_coef_times_k3_over_the_trained_positions_and_off_by_default(loss):
    lp, inputs, valid = _batch_tensors()
    plain = {k: v for k, v in inputs.items() if k != "ref_logprobs"}
    config = check_loss(loss, {})
    assert config["kl_ref_coef"] == 0.0
    base = compute_loss(loss, lp, plain, valid, config)
    # absent ref_logprobs, or a coefficient of 0: exactly the loss as it was
    assert torch.equal(compute_loss(loss, lp, inputs, valid, config), base)
    assert torch.equal(compute_loss(loss, lp, plain, valid, {**config, "kl_ref_coef": 2.0}), base)
    lp = lp.clone().requires_grad_(True)
    with_kl = compute_loss(loss, lp, inputs, valid, check_loss(loss, {"kl_ref_coef": 2.0}))
    active = valid & (inputs["advantages"] != 0)
    d = (inputs["ref_logprobs"] - lp.detach())[active]
    k3 = torch.exp(d) - d - 1
    assert float(with_kl.detach().sum() - base.sum()) == pytest.approx(2.0 * float(k3.sum()), rel=1e-9)
    # the gradient flows through lp: d/dlp of 2·k3 = 2·(1 − exp(ref − lp)) on the trained positions
    (with_kl.sum() - compute_loss(loss, lp, plain, valid, config).sum()).backward()
    want = torch.zeros_like(lp)
    want[active] = 2.0 * (1 - torch.exp(d))
    assert torch.allclose(lp.grad, want, rtol=1e-9, atol=1e-12)
    stats = ratio_stats(lp, inputs, valid, config)
    assert stats["kl_ref_sum"] == pytest.approx(float(k3.sum()), rel=1e-9)
    assert "kl_ref_sum" not in ratio_stats(lp, plain, valid, config)


def test_the_term_stays_finite_where_the_policies_disagree_wildly():
    lp, inputs, valid = _batch_tensors()
    inputs["ref_logprobs"] = torch.full_like(lp, -1e4)
    inputs["ref_logprobs"][0, 3] = 0.0
    lp[0, 3] = -200.0
    loss = compute_loss(
        "importance_sampling", lp, inputs, valid, check_loss("importance_sampling", {}) | {"kl_ref_coef": 1.0}
    )
    assert torch.isfinite(loss).all()


def test_kl_ref_coef_is_a_config_key_of_every_rl_loss_and_must_be_non_negative():
    for loss in LOSSES:
        assert ("kl_ref_coef" in LOSSES[loss].config) == (loss != "cross_entropy")
        assert ("ref_logprobs" in LOSSES[loss].optional) == (loss != "cross_entropy")
    with pytest.raises(UserError) as e:
        check_loss("ppo", {"kl_ref_coef": -0.5})
    assert e.value.field == "loss_fn_config.kl_ref_coef"
    with pytest.raises(UserError):
        check_loss("cross_entropy", {"kl_ref_coef": 1.0})


def test_the_tinker_api_takes_ref_logprobs_and_kl_ref_coef(service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=5).result()
    full = [72, 105, 58, 32, 97, 98, 99, 100]
    n = len(full) - 1
    adv = [0.0] * 3 + [1.0] * (n - 3)

    def datum(extra):
        inputs = {"target_tokens": full[1:], "logprobs": [0.0] * 3 + [-3.0] * (n - 3), "advantages": adv}
        return types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={**inputs, **extra}
        )

    lp = tc.forward([datum({})], "ppo").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    ref = (lp - 0.5).astype(np.float32)
    plain = tc.forward([datum({"ref_logprobs": ref})], "ppo").result()
    term = tc.forward([datum({"ref_logprobs": ref})], "ppo", {"kl_ref_coef": 3.0}).result()
    k3 = (math.exp(-0.5) + 0.5 - 1) * (n - 3)
    assert term.metrics["loss:sum"] - plain.metrics["loss:sum"] == pytest.approx(3.0 * k3, rel=1e-4)
    # the coefficient without the reference's logprobs would add nothing: refused, naming both
    with pytest.raises(tinker.RequestFailedError, match="ref_logprobs"):
        tc.forward([datum({})], "ppo", {"kl_ref_coef": 3.0}).result()


# -- the notebook API ---------------------------------------------------------------------------------
def test_kl_ref_is_zero_at_the_start_grows_as_the_policy_moves_and_raises_the_loss(alice):
    run_id = new_run(alice, name="kl-ref")
    try:
        first = step(alice, run_id, batch(alice, run_id, 1), kl_coef=0.5)
        assert first["kl_coef"] == 0.5
        assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference
        plain = step(alice, run_id, batch(alice, run_id, 2))
        assert plain["kl_ref"] is None and plain["kl_coef"] == 0.0

        diverge(alice, run_id)
        items = batch(alice, run_id, 7, n=8)
        without = step(alice, run_id, items, optimizer=FROZEN)
        with_kl = step(alice, run_id, items, optimizer=FROZEN, kl_coef=2.0)
        assert with_kl["kl_ref"] > 1e-3, with_kl  # moved away from its starting weights
        assert with_kl["kl"] == pytest.approx(without["kl"], abs=1e-6)  # the same weights both times
        assert with_kl["loss"] > without["loss"]
        # the loss rose by exactly kl_coef · Σ k3 over the trained (action) tokens
        rise = 2.0 * with_kl["kl_ref"] * with_kl["action_tokens"]
        assert with_kl["loss"] - without["loss"] == pytest.approx(rise, rel=1e-3)
    finally:
        alice.delete(f"{V1}/runs/{run_id}")


def test_the_reference_of_a_run_made_with_load_from_is_that_checkpoint(alice):
    src = new_run(alice, name="kl-ref-src")
    runs = [src]
    try:
        diverge(alice, src)
        path = alice.post(f"{V1}/runs/{src}/checkpoints", json={"name": "kl-ref-src"}).json()["path"]
        loaded = new_run(alice, name="kl-ref-dst", load_from=path)
        runs.append(loaded)
        # the same weights, two references: the checkpoint (loaded) and the base model (src)
        at_start = step(alice, loaded, batch(alice, loaded, 11), kl_coef=1.0, optimizer=FROZEN)
        from_base = step(alice, src, batch(alice, src, 11), kl_coef=1.0, optimizer=FROZEN)
        assert at_start["kl_ref"] == pytest.approx(0.0, abs=1e-6), at_start
        assert from_base["kl_ref"] > 1e-3, from_base
        # overwritten since (by other weights): refused rather than measured against them
        diverge(alice, src, steps=1)
        r = alice.post(f"{V1}/runs/{src}/checkpoints", json={"name": "kl-ref-src", "overwrite": True})
        assert r.status_code == 201, r.text
        r = alice.post(
            f"{V1}/runs/{loaded}/train_step", json={"samples": batch(alice, loaded, 12), "kl_coef": 1.0}
        )
        assert r.status_code == 409 and r.json()["field"] == "kl_coef", r.text
        step(alice, loaded, batch(alice, loaded, 13))  # without kl_coef it trains on; no gap was left
    finally:
        for r in runs:
            alice.delete(f"{V1}/runs/{r}")


def test_the_reference_survives_a_restart(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    live = start_server(data, tiny_model_dir)
    try:
        with live.client(ALICE_KEY) as c:
            src = new_run(c, name="src")
            diverge(c, src, steps=3)
            path = c.post(f"{V1}/runs/{src}/checkpoints", json={"name": "src"}).json()["path"]
            loaded = new_run(c, name="dst", load_from=path)
    finally:
        live.stop()
    live = start_server(data, tiny_model_dir)
    try:
        with live.client(ALICE_KEY) as c:
            got = step(c, loaded, batch(c, loaded, 21), kl_coef=1.0, optimizer=FROZEN)
            assert got["kl_ref"] == pytest.approx(0.0, abs=1e-6), got
    finally:
        live.stop()


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"kl_coef": -1}, "kl_coef"),
        ({"kl_coef": "x"}, "kl_coef"),
        ({"kl_coef": 1e7}, "kl_coef"),
        ({"kl_coef": True}, "kl_coef"),
        ({"loss_config": {"kl_ref_coef": 1.0}}, "loss_config.kl_ref_coef"),
    ],
)
def test_bad_kl_coef_is_refused_naming_the_field(alice, extra, field):
    run_id = new_run(alice, name="kl-ref-bad")
    try:
        items = batch(alice, run_id, 1)
        r = alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["field"] == field and "kl" in r.json()["error"], r.text
        if "kl_coef" in extra and extra["kl_coef"] == -1:
            assert "1000000" in r.json()["error"] or "1e+06" in r.json()["error"], r.text
        assert step(alice, run_id, items)["step"] == 1  # the service (and the run's order) goes on
    finally:
        alice.delete(f"{V1}/runs/{run_id}")


def test_the_engine_refuses_a_bad_kl_coef_too(server):
    """The engine's own check (native_checks.kl_coef), for callers that skip the HTTP layer."""
    from openrl_service.engine.native_checks import MAX_KL_COEF, kl_coef

    assert kl_coef({}) == 0.0 and kl_coef({"kl_coef": None}) == 0.0 and kl_coef({"kl_coef": 2}) == 2.0
    for bad in (-1, "x", MAX_KL_COEF * 2, float("nan")):
        with pytest.raises(UserError) as e:
            kl_coef({"kl_coef": bad})
        assert e.value.field == "kl_coef"


# -- capabilities ---------------------------------------------------------------------------------------
SETTINGS = {
    "max_tokens": "OPENRL_MAX_TOKENS",
    "max_rank": "OPENRL_MAX_RANK",
    "max_num_samples": "OPENRL_MAX_NUM_SAMPLES",
    "max_prompts": "OPENRL_MAX_DATUMS",
    "max_datums": "OPENRL_MAX_DATUMS",
    "max_stop_sequences": "OPENRL_MAX_STOP_SEQUENCES",
}


def test_capabilities_carry_the_limits(server):
    (entry,) = server.client().get("/api/v1/get_server_capabilities").json()["supported_models"]
    lim = Limits()
    assert entry["limits"] == {
        "max_tokens": min(lim.max_tokens, entry["max_context_length"]),
        "max_rank": lim.max_rank,
        "max_num_samples": lim.max_num_samples,
        "max_prompts": lim.max_datums,
        "max_datums": lim.max_datums,
        "max_stop_sequences": lim.max_stop_sequences,
        "settings": SETTINGS,
    }
    # the Tinker SDK still reads the entry
    caps = tinker.RestClient(base_url=server.url, api_key=ALICE_KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [TINY]


def test_the_limits_follow_the_settings(make_server):
    live = make_server(
        limits=Limits(max_tokens=5, max_rank=4, max_num_samples=3, max_datums=7, max_stop_sequences=2)
    )
    with live.client() as c:
        (entry,) = c.get("/api/v1/get_server_capabilities").json()["supported_models"]
        assert entry["limits"] == {
            "max_tokens": 5,
            "max_rank": 4,
            "max_num_samples": 3,
            "max_prompts": 7,
            "max_datums": 7,
            "max_stop_sequences": 2,
            "settings": SETTINGS,
        }
        run_id = new_run(c, name="limits", rank=4)  # and they are what the service enforces
        r = c.post(f"{V1}/runs/{run_id}/sample", json={**PROMPT, "max_tokens": 6})
        assert r.status_code == 400 and "OPENRL_MAX_TOKENS" in r.text, r.text
        r = c.post(f"{V1}/runs/{run_id}/sample", json={**PROMPT, "max_tokens": 4, "num_samples": 4})
        assert r.status_code == 400 and "OPENRL_MAX_NUM_SAMPLES" in r.text, r.text
        r = c.post(f"{V1}/runs/{run_id}/sample", json={**PROMPT, "max_tokens": 4, "prompts": ["a"] * 8})
        assert r.status_code == 400 and "OPENRL_MAX_DATUMS" in r.text, r.text
        r = c.post(f"{V1}/runs/{run_id}/sample", json={**PROMPT, "max_tokens": 4, "stop": ["x", "y", "z"]})
        assert r.status_code == 400 and "OPENRL_MAX_STOP_SEQUENCES" in r.text, r.text


# -- full runs, and a group of devices -------------------------------------------------------------------
def starts_at_its_reference(client, rank: int) -> None:
    """A run of ``rank`` (0: a full fine-tune) reports kl_ref 0 against its base until it moves, and a
    run made from its checkpoint reports 0 against that checkpoint."""
    src = new_run(client, name=f"kl-src-{rank}", rank=rank)
    runs = [src]
    try:
        assert step(client, src, batch(client, src, 1), kl_coef=1.0)["kl_ref"] == pytest.approx(0, abs=1e-6)
        diverge(client, src, steps=3)
        moved = step(client, src, batch(client, src, 2), kl_coef=1.0, optimizer=FROZEN)
        assert moved["kl_ref"] > 1e-3, moved
        path = client.post(f"{V1}/runs/{src}/checkpoints", json={"name": f"kl-src-{rank}"}).json()["path"]
        runs.append(new_run(client, name=f"kl-dst-{rank}", rank=rank, load_from=path))
        got = step(client, runs[1], batch(client, runs[1], 3), kl_coef=1.0, optimizer=FROZEN)
        assert got["kl_ref"] == pytest.approx(0.0, abs=1e-6), got
    finally:
        for r in runs:
            client.delete(f"{V1}/runs/{r}")


def test_a_full_run_measures_against_its_start_too(alice):
    starts_at_its_reference(alice, 0)


def test_a_group_of_devices_computes_the_reference_on_rank_0(tmp_path, tiny_model_dir):
    """At world size 2 (LoRA runs replicated, full runs sharded), the reference pass runs on rank 0
    alone and the term travels with the datums to both ranks."""
    from tests.service.test_world_size import ranks_of, serving

    with serving(tmp_path / "data", tiny_model_dir, "--world-size", "2") as s:
        assert len(ranks_of(s)) == 2
        with httpx.Client(base_url=s.url, headers={"X-API-Key": ALICE_KEY}, timeout=120) as c:
            for rank in (8, 0):
                starts_at_its_reference(c, rank)
