"""A run's states and the small rules about them that other modules share (the job worker, sweeps):
which states are active, how often a run heartbeats, what counts as a stop from outside."""

from __future__ import annotations

import enum
from typing import Any

from openrl_jupyter._exceptions import OpenRLError

HEARTBEAT_MAX_S = 120.0  # a run heartbeats every third of the service's idle timeout, at most this apart


def heartbeat_interval(idle_timeout_s: Any) -> float:
    """How often a run heartbeats: a third of the service's idle timeout, between 0.5 s and 2 min."""
    if type(idle_timeout_s) not in (int, float) or idle_timeout_s <= 0:  # JSON's numbers; not a bool
        return HEARTBEAT_MAX_S
    return max(0.5, min(HEARTBEAT_MAX_S, idle_timeout_s / 3))


class RunState(str, enum.Enum):
    STARTING = "starting"  # creating the run on the service
    RUNNING = "running"  # stepping
    PAUSING = "pausing"  # pause asked; the current step finishes first
    PAUSED = "paused"  # between steps, waiting for resume() (or stop())
    STOPPING = "stopping"  # stop asked; the current step finishes first
    STOPPED = "stopped"  # stopped before its last step
    FINISHED = "finished"  # every step done
    FAILED = "failed"  # cannot continue (the service lost the run, or it could not be created)

    def __str__(self) -> str:
        return self.value


ACTIVE = {RunState.STARTING, RunState.RUNNING, RunState.PAUSING, RunState.PAUSED, RunState.STOPPING}


def from_panel(verb: str, reason: Any) -> str:
    """ "stopped from the panel", with the panel's reason when it gave its own; a reason that says
    itself how ("stopped with %openrl stop") as it is."""
    text = f"{verb} from the panel"
    if reason and str(reason).startswith(f"{verb} "):
        return str(reason)
    return text if not reason or reason == text else f"{text}: {reason}"


def stopped_from_outside(reason: str | None) -> bool:
    """Whether a run's ``stop_reason`` is a stop asked from outside its loop (the panel, a magic in
    another kernel, the service's control), not its own end."""
    return (reason or "").startswith(("stopped from the panel", "stopped with "))


def one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, OpenRLError) else f"{type(exc).__name__}: {text}"
