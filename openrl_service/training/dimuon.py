"""Dimuon: the optimizer the Tinker SDK selects with ``DimuonOptimizerConfig`` (``{"type": "dimuon"}``).

What Tinker documents (DimuonParams): the learning rate applies to a direction with Frobenius norm
sqrt(rank); a rank correction relative to rank 32, with exponent ``rank_lr_correction_exponent``
(0.175; 0 turns it off), applies uniformly to all LoRA matrices; ``beta1`` is the EMA coefficient of
the momentum; ``grad_clip_norm`` clips the global gradient norm (<= 0: off); ``damping`` (>= 1e-8)
smooths a row and column preconditioner; the matrix-sign iteration count and its normalisation
epsilon are internal constants; there is no weight decay. The rest is this service's reading, since
the update's full definition is not published. For each parameter ``P`` (a vector is a 1 × n matrix):

    G  ← the gradient, the global norm clipped to grad_clip_norm (as AdamW's)
    M  ← β1·M + (1 − β1)·G                                  (EMA momentum, the state it keeps)
    ρ_i = mean_j M_ij² / mean(M²),  γ_j = mean_i M_ij² / mean(M²)   (row and column second moments)
    X  = M_ij / sqrt((ρ_i + damping)(γ_j + damping))        (two-sided diagonal preconditioning)
    O  = sign(X) = U Vᵀ (X = U Σ Vᵀ), by Newton–Schulz iteration on X/‖X‖_F
    D  = O · sqrt(k) / ‖O‖_F,  k = min(rows, cols)           (‖D‖_F = sqrt(rank): unit singular values)
    P  ← P − lr · c · D,   c = (32 / r)^exponent for a rank-r LoRA matrix, 1 for a full fine-tune

For a full fine-tune there is no LoRA rank, so no rank correction (c = 1): the docs apply it to LoRA
matrices only, and a full weight's direction already has one unit singular value per dimension. A full
run's embedding matrices (input and output, vocabulary × hidden) are not orthogonalised, as Muon leaves
embeddings to another rule: their D is X scaled to the same Frobenius norm sqrt(k). Newton-Schulz on a
vocabulary-sized matrix costs more than the whole forward/backward (SmolLM2-135M: ~15x a step), and a
token's row should move by its own gradient, not be mixed with every other token's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NS_QUINTIC = (3.4445, -4.7750, 2.0315)  # fast approach to the sign (Muon's coefficients)
NS_QUINTIC_STEPS = 6
NS_CUBIC_STEPS = 6  # then X ← 1.5X − 0.5XXᵀX: singular values converge to 1
NS_EPS = 1e-7
RANK_REFERENCE = 32


@dataclass
class DimuonParams:
    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175


def matrix_sign(x: torch.Tensor) -> torch.Tensor:
    """The polar factor U Vᵀ of ``x`` [m, n] (zero for a zero matrix), by Newton–Schulz in float32."""
    x = x.float()
    norm = torch.linalg.matrix_norm(x)
    if float(norm) == 0.0:
        return torch.zeros_like(x)
    tall = x.shape[0] > x.shape[1]
    y = (x.T if tall else x) / (norm + NS_EPS)  # rows <= cols: the Gram matrix is the small one
    a, b, c = NS_QUINTIC
    for _ in range(NS_QUINTIC_STEPS):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    for _ in range(NS_CUBIC_STEPS):
        y = 1.5 * y - 0.5 * (y @ y.T) @ y
    return y.T if tall else y


def direction(m: torch.Tensor, damping: float, orthogonalise: bool = True) -> torch.Tensor:
    """The unit-singular-value direction D of a momentum ``m`` (see the module's formula);
    ``orthogonalise=False`` (embeddings) skips the matrix sign."""
    x = m.float().reshape(m.shape[0], -1) if m.dim() > 1 else m.float().reshape(1, -1)
    sq = x * x
    mean = sq.mean()
    if float(mean) == 0.0:
        return torch.zeros_like(m, dtype=torch.float32)
    rho = sq.mean(dim=1, keepdim=True) / mean
    gamma = sq.mean(dim=0, keepdim=True) / mean
    x = x / torch.sqrt((rho + damping) * (gamma + damping))
    o = matrix_sign(x) if orthogonalise else x
    k = min(o.shape)
    o = o * (math.sqrt(k) / (torch.linalg.matrix_norm(o) + NS_EPS))
    return o.reshape(m.shape)


class Dimuon(torch.optim.Optimizer):
    """Dimuon over a run's tensors; ``lora_rank`` (None for a full fine-tune) sets the rank correction.

    State per parameter: ``momentum`` and ``step``, saved with checkpoints like AdamW's moments."""

    def __init__(self, params, lora_rank: int | None, plain: list[torch.Tensor] = ()):
        super().__init__(params, {"lr": 0.0, "beta1": 0.9, "damping": 1e-4, "exponent": 0.175})
        self.lora_rank = lora_rank
        self.plain = {id(p) for p in plain}  # embeddings: not orthogonalised

    def configure(self, p: DimuonParams) -> None:
        for group in self.param_groups:
            group["lr"] = p.learning_rate
            group["beta1"] = p.beta1
            group["damping"] = p.damping
            group["exponent"] = p.rank_lr_correction_exponent

    def correction(self, exponent: float) -> float:
        if self.lora_rank is None or exponent == 0:
            return 1.0
        return (RANK_REFERENCE / self.lora_rank) ** exponent

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr = group["lr"] * self.correction(group["exponent"])
            beta1 = group["beta1"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                    st["step"] = torch.tensor(0.0)
                m = st["momentum"]
                m.mul_(beta1).add_(p.grad.float(), alpha=1 - beta1)
                st["step"] += 1
                d = direction(m, group["damping"], orthogonalise=id(p) not in self.plain)
                p.add_(d.to(p.dtype), alpha=-lr)
        return None
