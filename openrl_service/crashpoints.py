"""Crash hooks for the recovery tests: ``kill -9`` of the service at a named point, on demand.

Off unless ``OPENRL_CRASH_AT`` is set (``<point>`` or ``<point>:<n>``, the n-th time the point is
reached, 1 by default). When it fires it first writes ``OPENRL_CRASH_MARKER`` (a file naming the
point), so a test can assert that the crash happened where it meant it to, and then sends itself
SIGKILL: no handler, no flush, no atexit — what an OOM kill or a lost node does.

Points: ``forward_backward`` (the gradient is accumulated, the result not yet stored),
``before_optim_step`` (between a forward_backward and its optim_step), ``sample`` (tokens sampled,
the result not yet stored), ``checkpoint_save`` (a checkpoint's files written, not yet renamed into
place), ``after_ack`` (just after a request's reply was sent), ``spill_write`` (half of a full run's tensors
written to its spill file), ``snapshot_write`` (half of a run's tensors written to a journal snapshot's
file).
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "forward_backward",
    "before_optim_step",
    "sample",
    "checkpoint_save",
    "after_ack",
    "spill_write",
    "snapshot_write",
)

_spec = os.environ.get("OPENRL_CRASH_AT", "")
_point, _, _nth = _spec.partition(":")
_target = int(_nth) if _nth.isdigit() else 1
_hits = 0
_lock = threading.Lock()


def armed(point: str) -> bool:
    return _point == point


def hit(point: str) -> None:
    """Kill the process here if ``OPENRL_CRASH_AT`` names this point (on its n-th hit)."""
    global _hits
    if _point != point:
        return
    with _lock:
        _hits += 1
        if _hits != _target:
            return
    marker = os.environ.get("OPENRL_CRASH_MARKER")
    if marker:
        with open(marker, "w") as f:
            f.write(point)
            f.flush()
            os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
    # PID 1 (the service in a container) cannot be killed by its own signal: end it just as abruptly
    # (no handler, no flush, no atexit), with the exit status of a SIGKILL
    os._exit(137)
