"""The building blocks of the request models (:mod:`openrl_service.api.schemas`): field types that
carry their range and the setting behind it into both the check and the published schema, the
strict ``Body`` base, and the checks that span fields (one of several forms; at least one LoRA
layer). A refusal raised here names the whole rule (``must be an integer in [1, 128]
(OPENRL_MAX_RANK); got 0``); :func:`openrl_service.api.http.refusal` puts the field's path in front.
"""

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from openrl_common.checks import requirement
from openrl_service.storage.checkpoints import KINDS

TTL_MAX_S = 10 * 365 * 24 * 3600  # Tinker's ten years
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # storage.checkpoints.check_name
TINKER_PATH_PATTERN = (
    r"^tinker://[A-Za-z0-9][A-Za-z0-9:._-]{0,127}/("
    + "|".join(KINDS)
    + r")/[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
)
FLOAT32_MAX = 3.4028234663852886e38  # AdamW holds its parameters as float32
INT32_MAX = 2**31 - 1


# -- field types --------------------------------------------------------------------------------------
def explained(message):
    """A validator around a field's own: any refusal becomes ``message(value)`` (the field's path is
    put in front of it when the 400 is made), so it names the whole rule, not one broken part."""

    def check(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("explained", "{why}", {"why": message(value)}) from None

    return WrapValidator(check)


def Int(lo: int | None = None, hi: int | None = None, setting: str | None = None, **field: Any) -> Any:
    """A whole number in ``[lo, hi]`` (not a bool, not 1.0)."""
    return Annotated[
        int,
        Field(ge=lo, le=hi, **field),
        explained(lambda v: requirement("an integer", v, lo, hi, setting)),
    ]


def Num(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    below: float | None = None,
    setting: str | None = None,
) -> Any:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; ``[lo, below)`` with ``below``)."""
    bounds = {"gt" if lo_open else "ge": lo, "le": hi, "lt": below}
    return Annotated[
        float,
        Field(**{k: v for k, v in bounds.items() if v is not None}, allow_inf_nan=False),
        explained(
            lambda v: (
                requirement("a finite number", v, lo, hi if below is None else below, setting, lo_open)
                + ("" if below is None else f" (below {below})")
            )
        ),
    ]


def Sized(item: Any, max_items: int, setting: str, min_items: int = 0) -> Any:
    """A list of at most ``max_items`` (the limit ``setting`` sets)."""

    def check(value: Any, handler):
        if isinstance(value, list) and len(value) > max_items:
            why = f"must have at most {max_items} items ({setting}); got {len(value)}"
            raise PydanticCustomError("explained", "{why}", {"why": why})
        return handler(value)

    return Annotated[list[item], Field(min_length=min_items, max_length=max_items), WrapValidator(check)]


def OneOf(*members: Any, what: str) -> Any:
    """A value of one of several shapes; a refusal says what the shapes are (not how each failed)."""
    return Annotated[Union[members], explained(lambda v: requirement(what, v))]  # noqa: UP007


def Choice(*values: str) -> Any:
    """One of ``values``; a refusal lists them."""
    return Annotated[Literal[values], explained(lambda v: requirement(f"one of {', '.join(values)}", v))]


def Str(min_length: int = 0, max_length: int | None = None, pattern: str | None = None, **field: Any) -> Any:
    return Annotated[str, Field(min_length=min_length, max_length=max_length, pattern=pattern, **field)]


def Ttl(min_ttl_s: float) -> Any:
    lo = int(min_ttl_s) if float(min_ttl_s).is_integer() else min_ttl_s
    return Int(lo, TTL_MAX_S, "OPENRL_MIN_TTL_S", description="seconds from now")


SeqId = Int(0, description="the op's place in its run's order")
Token = Int(0, description="a token id below the vocabulary size")
Metadata = Annotated[
    dict[str, Any], Field(description="a JSON object of at most OPENRL_MAX_METADATA_BYTES as JSON")
]
CheckpointName = Str(pattern=NAME_PATTERN, description="a checkpoint name")
TinkerPath = Str(pattern=TINKER_PATH_PATTERN, description="a tinker:// checkpoint path")


class Body(BaseModel):
    """A JSON request body: strict types (``"8"`` is not 8, ``true`` is not 1), unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def at_least_one_layer(model: Any, field: str | None = None) -> Any:
    """At least one of the three trains (each defaults to true); ``field``: the one a refusal names
    (none: the object holding them)."""
    if model.train_attn is False and model.train_mlp is False and model.train_unembed is False:
        ctx = {"why": "enable at least one of train_attn, train_mlp, train_unembed"}
        raise PydanticCustomError("form", "{why}", {**ctx, "field": field} if field else ctx)
    return model


SOME_LAYERS = {  # the JSON Schema of at_least_one_layer: not all three false
    "not": {
        "properties": {k: {"const": False} for k in ("train_attn", "train_mlp", "train_unembed")},
        "required": ["train_attn", "train_mlp", "train_unembed"],
    }
}


def one_of_forms(*forms: tuple[str, ...], description: str):
    """JSON Schema for a body that takes one of several sets of required fields."""
    return {"anyOf": [{"required": list(f)} for f in forms], "description": description}


def require_form(data: Any, *forms: tuple[str, ...]) -> Any:
    """A before-validator's check that ``data`` (the body as sent) has every field of one of
    ``forms``; a refusal names the first missing field of the first form, in the form's order (so an
    op's missing model_id or seq_id is named before its path). Before the fields are checked, so a
    bad value elsewhere does not hide a missing field."""
    if not isinstance(data, dict):
        return data  # the model says "must be a JSON object"
    present = {k for k, v in data.items() if v is not None}
    if not any(set(f) <= present for f in forms):
        missing = [k for k in forms[0] if k not in present]
        alternatives = " or ".join("(" + ", ".join(f) + ")" for f in forms)
        raise PydanticCustomError(
            "form",
            "{why}",
            {"why": f"takes {alternatives}; {missing[0]} is missing", "field": missing[0]},
        )
    return data
