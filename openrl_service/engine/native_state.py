"""What the notebook API keeps beside an engine run (engine/native.py): the run's own state
(:class:`NativeRunState`: name, seq counter, steps, metric rows, what its kernel reported), its
control state as the side panel set it (:class:`Control`; :class:`RunControlled` is the 409 of a
paused or stopped Tinker-SDK run's op), and a stored completion (:class:`StoredSample`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from openrl_service.engine.state import RunState
from openrl_service.errors import Conflict

DEFAULT_REASONS = {"pause": "paused from the panel", "stop": "stopped from the panel", "resume": None}
# What a notebook kernel may report as its Run's state (openrl_jupyter.run.RunState's values).
KERNEL_STATES = ("starting", "running", "pausing", "paused", "stopping", "stopped", "finished", "failed")
KERNEL_DONE = ("stopped", "finished", "failed")


@dataclass
class Control:
    """A run's control state as the panel set it (and the kernel confirmed): running |
    pause_requested | stop_requested | paused | stopped, why, and since when."""

    state: str = "running"
    reason: str | None = None
    at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {"state": self.state, "reason": self.reason, "at": self.at}


class RunControlled(Conflict):
    """A paused or stopped (from the panel) Tinker-SDK run's op: 409, naming the run and why."""

    def __init__(self, run_id: str, control: Control):
        verb = "stopped" if control.state == "stopped" else "paused"
        text = f"training run {run_id} was {verb} from the panel"
        if control.reason and control.reason != DEFAULT_REASONS["stop" if verb == "stopped" else "pause"]:
            text += f": {control.reason}"
        super().__init__(
            f"{text}; resume it from the panel (POST /openrl/v1/runs/{run_id}/control "
            '{"action": "resume"}) to continue',
            field="model_id",
        )


@dataclass
class StoredSample:
    """A completion kept for a later train step to name by its sample id."""

    run_id: str
    tenant: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    created_at: float = field(default_factory=time.time)


@dataclass
class NativeRunState:
    """What the notebook API keeps beside an engine run: its name, seq counter, steps and metrics."""

    run: RunState
    name: str
    seq: int = 0
    steps: int = 0
    metrics: list[dict] = field(default_factory=list)  # the newest OPENRL_MAX_METRIC_ROWS rows
    metrics_dropped: int = 0  # older rows dropped to keep that bound
    lock: threading.Lock = field(default_factory=threading.Lock)
    planned: int | None = None  # the steps the notebook plans ("steps" at create), if it said
    kernel_state: str = "running"  # what the kernel last reported of its Run

    def next_seq(self, n: int = 1) -> int:
        """The first of ``n`` consecutive seq_ids of the run's lane (nothing else can come between)."""
        with self.lock:
            self.seq += n
            return self.seq - n + 1

    def give_back(self, first: int, n: int = 1) -> bool:
        """Return the ``n`` seq_ids from ``first`` (a request refused before it was queued) if no
        later one was taken meanwhile; False when one was (the caller fills the slots instead)."""
        with self.lock:
            if self.seq != first + n - 1:
                return False
            self.seq = first - 1
            return True

    def bump(self, last: int) -> None:
        """A replayed request used seq_ids up to ``last``: later requests come after it."""
        with self.lock:
            self.seq = max(self.seq, last)
