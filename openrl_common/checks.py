"""The one integer/number range check: every field that must be a whole number or a finite number
in a range goes through here, so each refusal names the field, the range and the setting behind it.

Standard library only: the service (``openrl_service.checks``, with its UserError: a 400 naming the
field) and the notebook side (``openrl_jupyter``, with its UsageError) both use it, and neither
imports the other. ``error`` is the exception to raise; one whose class sets ``takes_field = True``
is given the field's name as ``field=``.

    >>> integer(500, "num_samples", 1, 64, setting="OPENRL_MAX_NUM_SAMPLES")
    Traceback (most recent call last):
    ...
    ValueError: num_samples must be an integer in [1, 64] (OPENRL_MAX_NUM_SAMPLES); got 500
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def requirement(
    kind: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    setting: str | None = None,
    lo_open: bool = False,
) -> str:
    """What a refused value should have been, and what it was: ``must be an integer in [1, 64]
    (OPENRL_MAX_NUM_SAMPLES); got 500`` (the field's name goes in front)."""
    why = f" ({setting})" if setting else ""
    try:
        shown = repr(value)
    except ValueError:  # an int of more than sys.get_int_max_str_digits() digits
        shown = f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    if len(shown) > 100:
        shown = shown[:100] + "…"
    return f"must be {kind}{_range(lo, hi, lo_open)}{why}; got {shown}"


def _refuse(
    kind: str,
    value: Any,
    name: str,
    lo: float | None,
    hi: float | None,
    setting: str | None,
    error: type[Exception],
    lo_open: bool = False,
) -> Exception:
    message = f"{name} {requirement(kind, value, lo, hi, setting, lo_open)}"
    if getattr(error, "takes_field", False):
        return error(message, field=name)
    return error(message)


def integer(
    value: Any,
    name: str,
    lo: int | None = None,
    hi: int | None = None,
    *,
    setting: str | None = None,
    error: type[Exception] = ValueError,
) -> int:
    """``value`` as an int if it is an integral number (an int, a numpy integer: any
    ``numbers.Integral``; not a bool, not a float) within ``[lo, hi]`` (either end may be open), else
    ``error`` naming ``name``, the range and the ``setting`` that sets the limit. The int returned
    is a plain one, which JSON encodes (a numpy integer does not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _refuse("an integer", value, name, lo, hi, setting, error)
    value = operator.index(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _refuse("an integer", value, name, lo, hi, setting, error)
    return value


def number(
    value: Any,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    setting: str | None = None,
    error: type[Exception] = ValueError,
    lo_open: bool = False,
) -> float:
    """``value`` as a float if it is a finite real number (an int, a float, a numpy number: any
    ``numbers.Real``; not a bool) within ``[lo, hi]``, or ``(lo, hi]`` with ``lo_open`` (a learning
    rate or top_p of 0 means nothing)."""
    real = None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            real = float(value)
        except OverflowError:  # an int past float's range: not finite
            real = math.inf
    if (
        real is None
        or not math.isfinite(real)
        or (lo is not None and (real <= lo if lo_open else real < lo))
        or (hi is not None and real > hi)
    ):
        raise _refuse("a finite number", value, name, lo, hi, setting, error, lo_open)
    return real
