"""Telemetry: the record of every operation the device worker executed.

Each entry says which run (or sampler), what kind of op, when it started and ended (wall-clock
seconds) and how many tokens it processed. The busy fraction and per-run shares the dashboards show
are computed from these records.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OpRecord:
    run: str
    kind: str
    start: float
    end: float
    tokens: int
    ok: bool = True

    @property
    def duration_s(self) -> float:
        return self.end - self.start


class OpRecorder:
    def __init__(self, maxlen: int = 100_000):
        self._ops: deque[OpRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def record(self, **kw) -> None:
        with self._lock:
            self._ops.append(OpRecord(**kw))

    def since(self, t: float = 0.0) -> list[OpRecord]:
        with self._lock:
            return [op for op in self._ops if op.end >= t]

    def busy_fraction(self, window_start: float, window_end: float) -> float:
        """Fraction of [start, end] during which the worker was executing an op."""
        span = max(window_end - window_start, 1e-9)
        busy = 0.0
        for op in self.since(window_start):
            busy += max(0.0, min(op.end, window_end) - max(op.start, window_start))
        return min(1.0, busy / span)

    def as_dicts(self, t: float = 0.0) -> list[dict]:
        return [asdict(op) for op in self.since(t)]
