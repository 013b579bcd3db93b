"""Input checks of the notebook API's bodies that the engine's own checks (validation.py) do not
cover: true/false flags, a train step's loss config (named ``loss_config`` here, ``loss_fn_config``
on the Tinker API), its ``kl_coef`` and its optimizer block. Each refusal is a UserError (400)
naming the field.
"""

from __future__ import annotations

from typing import Any

from openrl_service.checks import number
from openrl_service.errors import UserError
from openrl_service.training.losses import LOSSES, check_loss
from openrl_service.training.optim_params import AdamParams, adam_params


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A true/false field (absent or null: ``default``); anything else is refused, not read as truthy."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UserError(
            f"{name} must be true or false; got {type(value).__name__} {repr(value)[:100]}", field=name
        )
    return value


def loss_config_keys(loss: str) -> list[str]:
    """The config keys ``loss`` takes here: the Tinker API's but kl_ref_coef, which kl_coef sets."""
    return [k for k in LOSSES[loss].config if k != "kl_ref_coef"]


def unknown_key(loss: str, key: str) -> str:
    """Why ``loss_config.<key>`` is refused."""
    if key == "kl_ref_coef":  # the train step's kl_coef sets it, with the reference logprobs it needs
        return "kl_ref_coef is set by the train step's kl_coef (the KL to the run's starting weights)"
    return f"{loss} takes no key {key!r} (accepted: {', '.join(loss_config_keys(loss)) or 'none'})"


def loss_config(loss: str, raw: Any) -> dict:
    """The loss's config (absent or null: its defaults), each refusal naming ``loss_config`` (the
    Tinker API's own check calls it loss_fn_config)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(
            f"loss_config must be an object of named numbers; got {type(raw).__name__}", field="loss_config"
        )
    if "kl_ref_coef" in raw:
        raise UserError(f"loss_config.{unknown_key(loss, 'kl_ref_coef')}", field="loss_config.kl_ref_coef")
    try:
        return check_loss(loss, raw)
    except UserError as e:
        field = (e.field or "loss_config").replace("loss_fn_config", "loss_config", 1)
        raise UserError(e.message.replace("loss_fn_config", "loss_config"), field=field) from None


# kl_coef's bound: far above any useful weight (TRL's beta is ~0.04), low enough that the term stays
# finite in float32 (k3 per token is at most e^20, losses/KL_REF_LOG_RATIO_CAP)
MAX_KL_COEF = 1e6


def kl_coef(body: dict) -> float:
    """A train step's weight of the KL to the run's starting weights (absent or null: 0, off)."""
    raw = body.get("kl_coef")
    return 0.0 if raw is None else number(raw, "kl_coef", 0, MAX_KL_COEF)


def adam_of(raw: dict, defaults: dict) -> AdamParams:
    """The optimizer block of a train step; lr defaults to the model's capability entry."""
    if not isinstance(raw, dict):
        raise UserError("optimizer must be an object of AdamW params", field="optimizer")
    return adam_params({"adam_params": {"learning_rate": defaults.get("learning_rate", 1e-4), **raw}})
