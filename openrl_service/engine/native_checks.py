"""Input checks of the notebook API's bodies that the engine's own checks (validation.py) do not
cover: true/false flags, a train step's loss config (named ``loss_config`` here, ``loss_fn_config``
on the Tinker API) and its optimizer block. Each refusal is a UserError (400) naming the field.
"""

from __future__ import annotations

from typing import Any

from openrl_service.errors import UserError
from openrl_service.training.losses import check_loss
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


def loss_config(loss: str, raw: Any) -> dict:
    """The loss's config (absent or null: its defaults), each refusal naming ``loss_config`` (the
    Tinker API's own check calls it loss_fn_config)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(
            f"loss_config must be an object of named numbers; got {type(raw).__name__}", field="loss_config"
        )
    try:
        return check_loss(loss, raw)
    except UserError as e:
        field = (e.field or "loss_config").replace("loss_fn_config", "loss_config", 1)
        raise UserError(e.message.replace("loss_fn_config", "loss_config"), field=field) from None


def adam_of(raw: dict, defaults: dict) -> AdamParams:
    """The optimizer block of a train step; lr defaults to the model's capability entry."""
    if not isinstance(raw, dict):
        raise UserError("optimizer must be an object of AdamW params", field="optimizer")
    return adam_params({"adam_params": {"learning_rate": defaults.get("learning_rate", 1e-4), **raw}})
