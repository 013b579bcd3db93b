"""The device worker's heartbeat: when it last made progress, for ``/healthz``.

Long work ticks as it goes: each op as it starts and ends, each decoder layer a forward pass enters,
each tensor a spill, a load or a snapshot writes or reads. ``/healthz`` fails when work is waiting and
nothing has ticked for ``OPENRL_HEALTH_STALL_S`` (a wedged worker: a deadlock, a hung device call),
while a long spill or a big model's step, which tick all along, never trips it. A tick is a store
of a float: cheap enough for every layer.
"""

from __future__ import annotations

import time

_last = [time.monotonic()]


def tick(*_args, **_kwargs) -> None:
    """Record progress now (any arguments are ignored: usable as a hook)."""
    _last[0] = time.monotonic()


def idle_for() -> float:
    """Seconds since the last tick."""
    return time.monotonic() - _last[0]
