"""Dimuon (training/dimuon.py): what its update is, and that the unmodified Tinker SDK selects it at create,
steps it with DimuonParams, and resumes it exactly from a checkpoint (LoRA and full runs)."""

from __future__ import annotations

import math

import pytest
import tinker
import torch
from tinker import types

from openrl_service.errors import UserError
from openrl_service.training.dimuon import Dimuon, DimuonParams, direction
from openrl_service.training.optim_params import dimuon_params, optim_params, optimizer_kind
from tests.conftest import ALICE_KEY
from tests.service.test_full_finetune import TEXT, assert_same, datum, folder, solo, step  # noqa: F401

DIMUON = types.DimuonOptimizerConfig()


def update(opt_cls, grad: torch.Tensor, **kw) -> torch.Tensor:
    """The change one step of the optimizer makes to a zero matrix with gradient ``grad``."""
    p = torch.zeros_like(grad, requires_grad=True)
    p.grad = grad.clone()
    if opt_cls is Dimuon:
        opt = Dimuon([p], lora_rank=kw.pop("rank", None))
        opt.configure(DimuonParams(**kw))
    else:
        opt = torch.optim.AdamW([p], **kw)
    opt.step()
    return p.detach().clone()


def test_the_dimuon_update_has_unit_singular_values_where_adams_do_not():
    torch.manual_seed(0)
    # a LoRA A-matrix's shape (rank 8 × 64 inputs) with a badly conditioned gradient
    u, _, v = torch.linalg.svd(torch.randn(8, 64), full_matrices=False)
    grad = u @ torch.diag(torch.logspace(1, -3, 8)) @ v
    d = update(Dimuon, grad, learning_rate=0.1, beta1=0.0, rank=32)  # rank 32: no rank correction
    s = torch.linalg.svdvals(-d / 0.1)
    assert torch.allclose(s, torch.ones(8), atol=2e-2), s  # an orthogonalised direction
    assert math.isclose(
        float(torch.linalg.matrix_norm(d)), 0.1 * math.sqrt(8), rel_tol=1e-4
    )  # ‖D‖ = sqrt(rank)
    adam = update(torch.optim.AdamW, grad, lr=0.1, betas=(0.0, 0.95), weight_decay=0.0)
    sa = torch.linalg.svdvals(adam)
    assert float(sa.max() / sa.min()) > 5  # Adam's update keeps a spread of singular values
    # the step is invariant to the gradient's scale: only its direction reaches the update
    assert torch.allclose(update(Dimuon, grad * 1e4, learning_rate=0.1, beta1=0.0, rank=32), d, atol=1e-5)


def test_dimuon_rank_correction_and_momentum():
    torch.manual_seed(1)
    grad = torch.randn(16, 48)
    at32 = update(Dimuon, grad, learning_rate=0.01, beta1=0.0, rank=32)
    at8 = update(Dimuon, grad, learning_rate=0.01, beta1=0.0, rank=8)
    off = update(Dimuon, grad, learning_rate=0.01, beta1=0.0, rank=8, rank_lr_correction_exponent=0.0)
    assert torch.allclose(at8, at32 * 4**0.175, atol=1e-7)  # (32 / rank) ** 0.175
    assert torch.equal(off, at32)
    full = update(Dimuon, grad, learning_rate=0.01, beta1=0.0)  # a full fine-tune: no LoRA rank
    assert torch.equal(full, at32)
    # a full run's embeddings are not orthogonalised: the preconditioned momentum, at the same norm
    p = torch.zeros(16, 48, requires_grad=True)
    p.grad = grad.clone()
    opt = Dimuon([p], lora_rank=None, plain=[p])
    opt.configure(DimuonParams(learning_rate=1.0, beta1=0.0))
    opt.step()
    s = torch.linalg.svdvals(p.detach())
    assert float(s.max() / s.min()) > 2 and math.isclose(float(s.norm()), 4.0, rel_tol=1e-4)
    assert torch.allclose(p.detach(), -direction(grad, 1e-4, orthogonalise=False))
    # the momentum is an EMA: two steps with beta1 = 0.5 follow the average of the two gradients
    p = torch.zeros(16, 48, requires_grad=True)
    opt = Dimuon([p], lora_rank=None)
    opt.configure(DimuonParams(learning_rate=1.0, beta1=0.5))
    g2 = torch.randn(16, 48)
    for g in (grad, g2):
        p.grad = g.clone()
        opt.step()
    m = 0.5 * (0.5 * grad) + 0.5 * g2
    assert torch.allclose(opt.state[p]["momentum"], m)
    assert torch.allclose(p.detach(), -(direction(0.5 * grad, 1e-4) + direction(m, 1e-4)), atol=1e-5)


def test_dimuon_parameters_are_checked_naming_the_field():
    assert optimizer_kind({"type": "dimuon", "version": 1}) == "dimuon"
    assert optimizer_kind(None) == "adamw"
    with pytest.raises(UserError, match="optimizer_config.type 'lion' is not supported") as e:
        optimizer_kind({"type": "lion"})
    assert e.value.field == "optimizer_config.type"
    cases = [
        ({"learning_rate": -1}, "optimizer_params.learning_rate"),
        ({}, "optimizer_params.learning_rate"),
        ({"learning_rate": 1e-3, "beta1": 1.0}, "optimizer_params.beta1"),
        ({"learning_rate": 1e-3, "damping": 0}, "optimizer_params.damping"),
        ({"learning_rate": 1e-3, "damping": 1e-30}, "optimizer_params.damping"),
        ({"learning_rate": 1e-3, "nesterov": True}, "optimizer_params.nesterov"),
        ({"learning_rate": float("nan")}, "optimizer_params.learning_rate"),
    ]
    for raw, field in cases:
        with pytest.raises(UserError) as e:
            dimuon_params({"type": "dimuon", **raw})
        assert e.value.field == field, (raw, e.value)
    # what SDK 0.38 sends, and what older clients add
    p = optim_params(
        {"optimizer_params": {"type": "dimuon", "learning_rate": 0.02, "grad_clip_norm": 0.0, "beta1": 0.9}}
    )
    assert p == DimuonParams(learning_rate=0.02)
    old = dimuon_params({"learning_rate": 0.02, "damping": 1e-3, "rank_lr_correction_exponent": 0})
    assert (old.damping, old.rank_lr_correction_exponent) == (1e-3, 0.0)


def dimuon_step(tc, k: int, lr: float = 0.02) -> float:
    fb = tc.forward_backward([datum(TEXT[k % len(TEXT)])], "cross_entropy")
    tc.optim_step(types.DimuonParams(learning_rate=lr)).result()
    return float(fb.result().metrics["loss:sum"])


@pytest.mark.parametrize("rank", [8, 0], ids=["lora", "full"])
def test_the_sdk_trains_with_dimuon_and_resumes_it_exactly(solo, rank):  # noqa: F811
    sc = tinker.ServiceClient(base_url=solo.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=rank, seed=0, optimizer=DIMUON)
    assert tc.get_info().is_lora is (rank > 0)
    losses = [dimuon_step(tc, 0) for _ in range(4)]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.85 * losses[0], losses
    mid = tc.save_state("mid").result().path
    after = [dimuon_step(tc, k) for k in (1, 2)]
    end = tc.save_state("end").result().path
    assert (
        sc.create_rest_client().get_weights_info_by_tinker_path(mid).result().optimizer_config.type
        == "dimuon"
    )

    resumed = sc.create_training_client_from_state_with_optimizer(mid)
    assert [dimuon_step(resumed, k) for k in (1, 2)] == after  # the momentum came back with it
    name = "model.safetensors" if rank == 0 else "adapter_model.safetensors"
    from safetensors.torch import load_file

    got = load_file(folder(solo, resumed.save_state("end").result().path) / name)
    assert_same(got, load_file(folder(solo, end) / name))
    # weights only, without the momentum: a different continuation
    fresh = sc.create_training_client_from_state(mid, optimizer=DIMUON)
    assert [dimuon_step(fresh, k) for k in (1, 2)] != after

    # the step's parameters must be the run's optimizer's
    with pytest.raises(Exception, match="created with the dimuon optimizer; send DimuonParams"):
        tc.forward_backward([datum(TEXT[0])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    adam = sc.create_lora_training_client(base_model="openrl/tiny", rank=max(rank, 4), seed=0)
    with pytest.raises(Exception, match="created with the adamw optimizer; send AdamParams"):
        adam.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    # Dimuon state cannot be restored into an AdamW run
    switched = sc.create_training_client_from_state(mid, optimizer=types.AdamOptimizerConfig())
    step(switched, 1)  # its weights move away from mid's
    before = load_file(folder(solo, switched.save_state("before").result().path) / name)
    with pytest.raises(Exception, match="holds dimuon optimizer state"):
        switched.load_state_with_optimizer(mid).result()
    # refused before anything was loaded: the run's weights are its own still
    assert_same(load_file(folder(solo, switched.save_state("after").result().path) / name), before)
    sc.close("success").result()
