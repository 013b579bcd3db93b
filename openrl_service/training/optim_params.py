"""What an optimizer step is asked to do: Adam's and Dimuon's parameters as requests send them, checked,
and which optimizer a run chose (``optimizer_config`` at create, kept by its checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from openrl_service.checks import number
from openrl_service.errors import UserError
from openrl_service.training.dimuon import DimuonParams


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


OPTIMIZERS = ("adamw", "dimuon")


def optimizer_kind(config: Any, field: str = "optimizer_config") -> str:
    """The optimizer a run is created with, from the SDK's ``optimizer_config`` ({"type": "adamw"} or
    {"type": "dimuon", "version": 1}; absent: AdamW)."""
    if config is None:
        return "adamw"
    if not isinstance(config, dict):
        raise UserError(f'{field} must be an object like {{"type": "adamw"}}', field=field)
    kind = config.get("type")
    if kind not in OPTIMIZERS:
        raise UserError(
            f"{field}.type {kind!r} is not supported; supported optimizers: {', '.join(OPTIMIZERS)}",
            field=f"{field}.type",
        )
    extra = sorted(set(config) - {"type", "version"})
    if extra:
        raise UserError(
            f"{field}: unknown field(s) {', '.join(extra)} for {kind}", field=f"{field}.{extra[0]}"
        )
    version = config.get("version", 1)
    if kind == "dimuon" and (isinstance(version, bool) or version != 1):
        raise UserError(
            f"{field}.version: Dimuon version {version!r} is not supported (1 is)", field=f"{field}.version"
        )
    return kind


def optimizer_config(kind: str) -> dict:
    """The SDK's optimizer_config for a run's optimizer (get_info, weights_info)."""
    return {"type": "dimuon", "version": 1} if kind == "dimuon" else {"type": "adamw"}


MIN_DAMPING = 1e-8  # Dimuon's damping: below it the float32 preconditioner can divide 0 by 0


def dimuon_params(raw: Any) -> DimuonParams:
    """``optimizer_params`` of type "dimuon", every field range-checked (SDK 0.38 sends learning_rate,
    grad_clip_norm and beta1; older clients damping and rank_lr_correction_exponent too)."""
    if not isinstance(raw, dict):
        raise UserError("optimizer_params must be an object", field="optimizer_params")
    if raw.get("type", "dimuon") != "dimuon":
        raise UserError(
            f"optimizer_params.type {raw.get('type')!r} is not supported; supported: dimuon (AdamW's "
            "parameters go in adam_params)",
            field="optimizer_params.type",
        )
    big = float(torch.finfo(torch.float32).max)
    known = {"type", "learning_rate", "grad_clip_norm", "beta1", "damping", "rank_lr_correction_exponent"}
    extra = sorted(set(raw) - known)
    if extra:
        raise UserError(
            f"optimizer_params: unknown field(s) {', '.join(extra)} for dimuon (accepted: {', '.join(sorted(known - {'type'}))})",
            field=f"optimizer_params.{extra[0]}",
        )
    if raw.get("learning_rate") is None:
        raise UserError(
            "optimizer_params.learning_rate is required for dimuon", field="optimizer_params.learning_rate"
        )
    out = DimuonParams(learning_rate=number(raw["learning_rate"], "optimizer_params.learning_rate", 0, big))
    if raw.get("grad_clip_norm") is not None:  # nonpositive: no clipping (as the SDK documents)
        out.grad_clip_norm = max(
            0.0, number(raw["grad_clip_norm"], "optimizer_params.grad_clip_norm", -big, big)
        )
    if raw.get("beta1") is not None:
        out.beta1 = number(raw["beta1"], "optimizer_params.beta1", 0, 1)
        if out.beta1 >= 1:
            raise UserError(
                f"optimizer_params.beta1 must be a finite number in [0, 1); got {raw['beta1']!r}",
                field="optimizer_params.beta1",
            )
    if raw.get("damping") is not None:
        out.damping = number(raw["damping"], "optimizer_params.damping", 0, big)
        if out.damping < MIN_DAMPING:  # smaller underflows in float32: a zero row and column give 0/0
            raise UserError(
                f"optimizer_params.damping must be >= {MIN_DAMPING:g}; got {out.damping!r}",
                field="optimizer_params.damping",
            )
    if raw.get("rank_lr_correction_exponent") is not None:
        out.rank_lr_correction_exponent = number(
            raw["rank_lr_correction_exponent"], "optimizer_params.rank_lr_correction_exponent", -8, 8
        )
    return out


def optim_params(body: dict) -> AdamParams | DimuonParams:
    """The step's hyperparameters: ``adam_params`` (AdamW) or ``optimizer_params`` (Dimuon)."""
    if body.get("optimizer_params") is not None:
        if body.get("adam_params") is not None:
            raise UserError("send adam_params or optimizer_params, not both", field="optimizer_params")
        return dimuon_params(body["optimizer_params"])
    return adam_params(body)


def adam_params(body: dict) -> AdamParams:
    """``adam_params`` from a request body, every field range-checked."""
    raw = body.get("adam_params")
    if raw is None:
        raise UserError("adam_params is required (or optimizer_params for Dimuon)", field="adam_params")
    if not isinstance(raw, dict):
        raise UserError("adam_params must be an object", field="adam_params")
    out = AdamParams()
    big = float(torch.finfo(torch.float32).max)  # the optimizer holds them as float32
    bounds = {
        "learning_rate": (0, big),
        "beta1": (0, 1),
        "beta2": (0, 1),
        "eps": (0, big),
        "weight_decay": (0, big),
        "grad_clip_norm": (0, big),
    }
    for name, (lo, hi) in bounds.items():
        if name not in raw or raw[name] is None:
            continue
        v = number(raw[name], f"adam_params.{name}", lo, hi)
        if name in ("beta1", "beta2") and v >= 1:  # [0, 1): a beta of 1 never forgets
            raise UserError(
                f"adam_params.{name} must be a finite number in [0, 1); got {raw[name]!r}",
                field=f"adam_params.{name}",
            )
        setattr(out, name, v)
    return out
