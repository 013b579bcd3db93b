"""The built-in losses, exactly as Tinker defines them: summed over tokens and datums, never averaged.

Notation (per datum, per position t < N): ``lp`` = log p_θ(target_t | prefix), computed here;
``q`` = the sampler's logprobs (``loss_fn_inputs["logprobs"]``); ``A`` = advantages; r = exp(lp − q).

    cross_entropy        −Σ lp·w                       (w any real; [N,K] targets allowed)
    importance_sampling  −Σ r·A
    ppo                  −Σ min(r·A, clip(r, lo, hi)·A)
    cispo                −Σ sg(clip(r, lo, hi))·lp·A
    dro                  −Σ (lp·A − ½β(lp − q)²)        (over positions with A ≠ 0, see below)
    gspo                 s = mean_{mask≠0}(sg(lp) − q); r_t = exp(s + lp − sg(lp)); −Σ min(r·A, clip(r, lo, hi)·A)
    stable_reinforce     −Σ sg(min(r, ratio_cap))·lp·A + kl_coeff·Σ (r − 1 − log r)

stable_reinforce (Tinker's, alpha; its formula is not published, this is the service's reading): a
REINFORCE gradient (lp·A) weighted by the truncated importance ratio to the policy that really
sampled each token, so stale or differently computed samples (async RL, sampler vs trainer numerics)
cannot blow up a step, plus an optional k3 estimate of KL(sampler ‖ trainer) on the same tokens
(kl_coeff, default 0: off). Its q is not the client's: the Tinker API puts the logprobs recorded at
sampling time (record_stability_info=True, engine/stability.py) in place, found by the datum's
provenance (sequence ids).

KL to a reference policy (every RL loss, off by default): with ``loss_fn_config["kl_ref_coef"]`` = c > 0
and ``loss_fn_inputs["ref_logprobs"]`` = ref (a reference policy's logprobs of the same targets, e.g.
the run's starting weights), the loss adds

    c·Σ k3,   k3_t = exp(ref − lp) − (ref − lp) − 1

over the positions the RL loss acts on (A ≠ 0): the k3 estimate of KL(π_θ ‖ π_ref) per sampled token,
as TRL's GRPO ``beta`` term; its gradient flows through lp. ref − lp is clamped to [−20, 20] first (as
verl's low_var_kl), so a token one policy all but rules out stays finite. Without ref_logprobs, or
with c = 0, nothing is added: the losses are exactly Tinker's. Whenever ref_logprobs are given the
statistics report ``kl_ref_sum`` (Σ k3 over those positions), whatever c. On the Tinker API the client
sends both; the notebook API's train step sets c from its ``kl_coef`` and computes ref from the run's
starting weights (engine/reference.py).

RL losses act only where A ≠ 0. For the ratio losses that is the formula itself (an A = 0 term is
0); there the log-ratio is also taken as 0 before exponentiating, so a prompt position (A = 0,
q = 0) cannot produce inf·0 = NaN. For dro it is a choice: its ½β(lp − q)² penalty would otherwise
pull every prompt position (q = 0 there, as tinker-cookbook sends) towards log-probability 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openrl_service.checks import number
from openrl_service.errors import UserError


@dataclass(frozen=True)
class LossDef:
    required: tuple[str, ...]
    optional: tuple[str, ...]
    config: dict[str, float]  # accepted config keys and their defaults


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
# GSPO clips a sequence-level ratio, so its band is far narrower (GSPO paper: 3e-4 / 4e-4).
_GSPO_CLIP = {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
# the KL-to-reference term (module docstring), optional on every RL loss
_REF = ("ref_logprobs",)
_KL_REF = {"kl_ref_coef": 0.0}
KL_REF_LOG_RATIO_CAP = 20.0  # |ref − lp| is clamped to this before exponentiating

LOSSES: dict[str, LossDef] = {
    "cross_entropy": LossDef(("target_tokens",), ("weights",), {}),
    "importance_sampling": LossDef(_RL_INPUTS, _REF, dict(_KL_REF)),
    "ppo": LossDef(_RL_INPUTS, _REF, {**_CLIP, **_KL_REF}),
    "cispo": LossDef(_RL_INPUTS, _REF, {**_CLIP, **_KL_REF}),
    "dro": LossDef(_RL_INPUTS, _REF, {"beta": 0.05, **_KL_REF}),
    "gspo": LossDef(_RL_INPUTS, ("sequence_ratio_mask", *_REF), {**_GSPO_CLIP, **_KL_REF}),
    "stable_reinforce": LossDef(_RL_INPUTS, _REF, {"kl_coeff": 0.0, "ratio_cap": 2.0, **_KL_REF}),
}
UNSUPPORTED_REASONS = {
    "custom": "server-side custom losses are disabled (forward_backward_custom works client-side)",
}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", "ref_logprobs")


def check_loss(loss_fn: str, config: dict[str, float]) -> dict[str, float]:
    """Validate a loss name and its config; returns the config with defaults filled in."""
    if loss_fn not in LOSSES:
        why = UNSUPPORTED_REASONS.get(loss_fn)
        supported = ", ".join(LOSSES)
        prefix = f"loss_fn {loss_fn!r} is not supported ({why})" if why else f"unknown loss_fn {loss_fn!r}"
        raise UserError(f"{prefix}; supported losses: {supported}", field="loss_fn")
    spec = LOSSES[loss_fn]
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise UserError("loss_fn_config must be an object of named numbers", field="loss_fn_config")
    for k, v in config.items():
        # the loss runs in float32: a value it cannot hold made torch.clamp raise on the worker
        number(v, f"loss_fn_config.{k}", -FLOAT32_MAX, FLOAT32_MAX, setting="float32's range")
    unknown = sorted(set(config) - set(spec.config))
    if unknown:
        accepted = ", ".join(spec.config) or "none"
        raise UserError(
            f"loss_fn_config: unknown key(s) {', '.join(unknown)} for {loss_fn} (accepted: {accepted})",
            field="loss_fn_config",
        )
    full = dict(spec.config)
    full.update({k: float(v) for k, v in config.items()})
    if "ratio_cap" in full and not full["ratio_cap"] > 0:
        raise UserError(
            f"loss_fn_config.ratio_cap must be > 0; got {full['ratio_cap']}", field="loss_fn_config.ratio_cap"
        )
    for key in ("kl_coeff", "kl_ref_coef"):
        if key in full and full[key] < 0:
            raise UserError(
                f"loss_fn_config.{key} must be >= 0; got {full[key]}", field=f"loss_fn_config.{key}"
            )
    if "clip_low_threshold" in full and not full["clip_low_threshold"] <= full["clip_high_threshold"]:
        raise UserError(
            "loss_fn_config: clip_low_threshold must be <= clip_high_threshold; "
            f"got {full['clip_low_threshold']} > {full['clip_high_threshold']}",
            field="loss_fn_config",
        )
    return full


def compute_loss(
    loss_fn: str,
    lp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    valid: torch.Tensor,
    config: dict[str, float],
) -> torch.Tensor:
    """Per-datum losses [B] for a padded micro-batch.

    ``lp`` is [B, L] (or [B, L, K] for cross_entropy); ``inputs`` are padded alike with zeros;
    ``valid`` is [B, L], True on real positions.
    """
    v = valid if lp.dim() == 2 else valid.unsqueeze(-1)
    dims = tuple(range(1, lp.dim()))
    if loss_fn == "cross_entropy":
        w = inputs.get("weights")
        w = v.to(lp.dtype) if w is None else w * v
        return -(lp * w).sum(dim=dims)
    adv = inputs["advantages"]
    active = v & (adv != 0)
    loss = -(_rl_per_token(loss_fn, lp, inputs, v, active, config) * active).sum(dim=dims)
    coef = config.get("kl_ref_coef", 0.0)
    ref = inputs.get("ref_logprobs")
    if coef > 0 and ref is not None:
        loss = loss + coef * (kl_ref_k3(lp, ref) * active).sum(dim=dims)
    return loss


def kl_ref_k3(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position, k3 = exp(ref − lp) − (ref − lp) − 1 >= 0: an estimate of KL(π_θ ‖ π_ref) from a
    token π_θ sampled; ref − lp clamped to ±KL_REF_LOG_RATIO_CAP (module docstring)."""
    d = torch.clamp(ref - lp, -KL_REF_LOG_RATIO_CAP, KL_REF_LOG_RATIO_CAP)
    return torch.exp(d) - d - 1


def _rl_per_token(
    loss_fn: str,
    lp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    v: torch.Tensor,
    active: torch.Tensor,
    config: dict[str, float],
) -> torch.Tensor:
    """The RL loss's per-position objective (to maximise; taken over ``active`` by the caller)."""
    q = inputs["logprobs"]
    adv = inputs["advantages"]
    if loss_fn == "dro":
        beta = config["beta"]
        return lp * adv - 0.5 * beta * (lp - q) ** 2
    if loss_fn == "gspo":
        mask = inputs.get("sequence_ratio_mask")
        mask = active if mask is None else (mask != 0) & v
        lp_sg = lp.detach()
        count = mask.sum(dim=1).clamp(min=1)
        s = ((lp_sg - q) * mask).sum(dim=1) / count
        log_ratio = torch.where(active, s.unsqueeze(1) + lp - lp_sg, torch.zeros_like(lp))
    else:
        log_ratio = torch.where(active, lp - q, torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    if loss_fn == "stable_reinforce":
        per_tok = torch.clamp(ratio, max=config["ratio_cap"]).detach() * lp * adv
        per_tok = per_tok - config["kl_coeff"] * (ratio - 1 - log_ratio)
    elif loss_fn == "importance_sampling":
        per_tok = ratio * adv
    elif loss_fn in ("ppo", "gspo"):
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        per_tok = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    elif loss_fn == "cispo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        per_tok = torch.clamp(ratio, lo, hi).detach() * lp * adv
    else:  # pragma: no cover - check_loss guards the name
        raise UserError(f"unknown loss_fn {loss_fn!r}", field="loss_fn")
    return per_tok


def ratio_stats(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], valid: torch.Tensor, config: dict[str, float]
) -> dict[str, float] | None:
    """Importance-ratio statistics over the positions that carry an advantage (RL losses only)."""
    if "advantages" not in inputs or "logprobs" not in inputs or lp.dim() != 2:
        return None
    active = valid & (inputs["advantages"] != 0)
    n = int(active.sum())
    if n == 0:
        return None
    with torch.no_grad():
        log_ratio = (lp.detach() - inputs["logprobs"])[active]
        ratio = torch.exp(log_ratio)
        out = {
            "tokens": n,
            "ratio_sum": float(ratio.sum()),
            "ratio_min": float(ratio.min()),
            "ratio_max": float(ratio.max()),
            # k3 estimator of KL(sampler || trainer): E[r - 1 - log r], always >= 0.
            "kl_sum": float((ratio - 1 - log_ratio).sum()),
        }
        if "ref_logprobs" in inputs:  # Σ k3 to the reference policy, reported as its mean
            out["kl_ref_sum"] = float(kl_ref_k3(lp.detach()[active], inputs["ref_logprobs"][active]).sum())
        if "clip_low_threshold" in config:
            lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
            out["clipped"] = int(((ratio < lo) | (ratio > hi)).sum())
    return out
