"""The range checks (:mod:`openrl_common.checks`) raising the service's UserError: a 400 that names
the field, the range and the setting behind it.

    >>> integer(500, "num_samples", 1, 64, setting="OPENRL_MAX_NUM_SAMPLES")
    Traceback (most recent call last):
    ...
    openrl_service.errors.UserError: num_samples must be an integer in [1, 64] (OPENRL_MAX_NUM_SAMPLES); got 500
"""

from __future__ import annotations

import functools

from openrl_common import checks
from openrl_service.errors import UserError

integer = functools.partial(checks.integer, error=UserError)
number = functools.partial(checks.number, error=UserError)
