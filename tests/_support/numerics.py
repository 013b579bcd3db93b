"""Fused vs unfused numerics: the tolerance the fused path really has, and AdamW in float64.

Measured on CPU (float32, openrl/tiny), fused vs unfused at identical inputs:
- ``Trainer.forward_backward_fused`` vs one ``forward_backward`` per run (tests/service/test_fusion.py,
  seeds 0-11, one and several micro-batches, the Llama-shaped build): loss ≤ 1.5e-6 relative (an
  importance-sampling loss sums terms of both signs, so its relative error is larger than its
  terms'), logprobs ≤ 9.5e-7 absolute (two float32 ulp of a logprob near -5), ratio/KL statistics
  ≤ 5.0e-7 relative, gradients ≤ 6.4e-6 × the tensor's largest element;
- the service's fused op vs fusion off (tests/service/test_fused_scheduling.py): loss and logprobs
  bit-identical, gradients ≤ 1.85e-6 × the tensor's largest element.
The fused pass sums the same terms in another order (one padded batch, one backward of the sum of
the runs' losses), so the gradient's error is float32 reassociation on the tensor's scale. The bounds
below are about three times the largest measured.

Weights after an Adam step are never compared element-wise between fused and unfused runs: with
eps = 1e-12 a near-zero gradient still moves its weight by about lr·sign(g), so a rounding-level
gradient difference can flip a whole step. Instead each step is checked against the AdamW update
computed in float64 from the (compared) gradient: :func:`adamw_in_float64`.
"""

from __future__ import annotations

import math

import torch

LOSS_RTOL = 5e-6
LOGPROBS_ATOL = 3e-6
STATS_RTOL = 2e-6
GRADS_ATOL_OF_MAX = 2e-5  # × the tensor's largest |element|


def adamw_in_float64(state, adam) -> list[torch.Tensor]:
    """The adapter's weights after ``Trainer.optim_step(state, adam)`` (an AdamParams), from its current
    weights, gradients and moments, computed in float64 (clipping by the global norm as the trainer does)."""
    params = state.adapter.parameters()
    grads = [p.grad.double() for p in params]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
        grads = [g * (adam.grad_clip_norm / (norm + 1e-6)) for g in grads]
    out = []
    for p, g in zip(params, grads, strict=True):
        st = state.optimizer.state.get(p, {})
        m = st["exp_avg"].double() if st else torch.zeros_like(g)
        v = st["exp_avg_sq"].double() if st else torch.zeros_like(g)
        t = int(st["step"]) + 1 if st else 1
        b1, b2, lr = adam.beta1, adam.beta2, adam.learning_rate
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = p.detach().double() * (1 - lr * adam.weight_decay)
        out.append(w - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + adam.eps))
    return out


def assert_weights_match(params, expected, lr: float) -> None:
    """float32 weights equal the float64 AdamW result up to float32 rounding of weight and update."""
    for got, want in zip(params, expected, strict=True):
        tol = 4 * 2**-23 * (float(want.abs().max()) + lr)  # a few ulp
        torch.testing.assert_close(got.detach().double(), want, rtol=0, atol=tol)
