"""Telemetry: the record of every operation the device worker executed.

Each entry says which run (or sampler), what kind of op, when it started and ended (wall-clock
seconds), how long it waited in the queue before it started and how many tokens it processed. The
busy fraction, per-run shares, queue-wait percentiles and token rates the dashboards show are
computed from these records over a window; cumulative totals (which the bounded record forgets)
are kept alongside for the Prometheus ``/metrics`` counters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class OpRecord:
    run: str
    kind: str
    start: float
    end: float
    tokens: int
    ok: bool = True
    queued_s: float = 0.0  # from submission to start (includes waiting for an earlier seq_id)
    # Set when this op ran inside one fused call with other ops: the call's id and the runs it covered.
    fused_id: str | None = None
    fused_runs: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        return self.end - self.start


# Queue-wait histogram buckets (seconds) of the Prometheus /metrics endpoint.
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

MAX_RUN_TOTALS = 10_000  # per-run counters kept (least recently active dropped first)


def token_direction(kind: str) -> str | None:
    """How an op kind's tokens count: "sampled", "trained" or None (forward-only, optimizer, bookkeeping)."""
    if "sample" in kind:
        return "sampled"
    if "backward" in kind or kind.startswith("train"):
        return "trained"
    return None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Totals:
    """Cumulative counters since the service started (never forgotten, unlike the bounded record)."""

    busy_s: float = 0.0
    tokens: dict[str, int] = field(default_factory=lambda: {"trained": 0, "sampled": 0})
    ops: dict[tuple[str, bool], int] = field(default_factory=dict)  # (kind, ok) -> count
    wait_buckets: list[int] = field(default_factory=lambda: [0] * len(QUEUE_WAIT_BUCKETS))
    wait_count: int = 0
    wait_sum: float = 0.0
    fused_ops: int = 0  # fused calls (each covered several ops)
    fused_members: int = 0  # ops that ran inside a fused call


@dataclass
class RunTotals:
    busy_s: float = 0.0
    tokens: dict[str, int] = field(default_factory=lambda: {"trained": 0, "sampled": 0})
    ops: int = 0


class OpRecorder:
    def __init__(self, maxlen: int = 100_000):
        self._ops: deque[OpRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._recorded = threading.Condition(self._lock)
        self._totals = Totals()
        self._runs: dict[str, RunTotals] = {}
        self._last_fused_id: str | None = None

    def record(self, **kw) -> None:
        op = OpRecord(**kw)
        with self._lock:
            self._ops.append(op)
            t = self._totals
            t.busy_s += op.duration_s
            t.ops[(op.kind, op.ok)] = t.ops.get((op.kind, op.ok), 0) + 1
            direction = token_direction(op.kind) if op.ok else None
            if direction:
                t.tokens[direction] += op.tokens
            wait = max(0.0, op.queued_s)
            t.wait_count += 1
            t.wait_sum += wait
            if op.fused_id is not None:
                t.fused_members += 1
                if op.fused_id != self._last_fused_id:
                    t.fused_ops += 1
                self._last_fused_id = op.fused_id
            for i, bound in enumerate(QUEUE_WAIT_BUCKETS):
                if wait <= bound:
                    t.wait_buckets[i] += 1
                    break
            r = self._runs[op.run] = self._runs.pop(op.run, None) or RunTotals()  # least recent first
            if len(self._runs) > MAX_RUN_TOTALS:
                del self._runs[next(iter(self._runs))]
            r.busy_s += op.duration_s
            r.ops += 1
            if direction:
                r.tokens[direction] += op.tokens
            self._recorded.notify_all()

    def totals(self) -> Totals:
        """A copy of the cumulative counters; ``wait_buckets`` are per bucket, not cumulative."""
        with self._lock:
            t = self._totals
            return Totals(
                t.busy_s,
                dict(t.tokens),
                dict(t.ops),
                list(t.wait_buckets),
                t.wait_count,
                t.wait_sum,
                t.fused_ops,
                t.fused_members,
            )

    def run_totals(self, runs: set[str] | None = None) -> dict[str, RunTotals]:
        """Copies of the per-run counters (of ``runs`` only, when given)."""
        with self._lock:
            return {
                k: RunTotals(v.busy_s, dict(v.tokens), v.ops)
                for k, v in self._runs.items()
                if runs is None or k in runs
            }

    def window(self, window_start: float, window_end: float) -> dict:
        """Statistics of [start, end]: busy seconds per run (overlap with the window) and how much of
        it ran inside fused calls, queue wait
        p50/p99 of the ops that started in it, tokens/s trained and sampled by the ops that ended in it."""
        span = max(window_end - window_start, 1e-9)
        busy: dict[str, float] = {}
        fused = 0.0
        waits: list[float] = []
        tokens = {"trained": 0, "sampled": 0}
        for op in self.since(window_start):
            overlap = max(0.0, min(op.end, window_end) - max(op.start, window_start))
            busy[op.run] = busy.get(op.run, 0.0) + overlap
            if op.fused_id is not None:
                fused += overlap
            if window_start <= op.start <= window_end:
                waits.append(max(0.0, op.queued_s))
            direction = token_direction(op.kind) if op.ok else None
            if direction and op.end <= window_end:
                tokens[direction] += op.tokens
        return {
            "busy_s": busy,
            "fused_busy_s": fused,  # of which inside fused calls (ops of several runs in one pass)
            "queue_wait_s": {"p50": percentile(waits, 50), "p99": percentile(waits, 99), "ops": len(waits)},
            "tokens_per_s": {k: v / span for k, v in tokens.items()},
        }

    def since(self, t: float = 0.0) -> list[OpRecord]:
        with self._lock:
            return [op for op in self._ops if op.end >= t]

    def wait_for(
        self, ready: Callable[[list[OpRecord]], bool], *, since: float = 0.0, timeout_s: float = 30.0
    ) -> list[OpRecord]:
        """Block until ``ready(records that ended at or after since)`` holds; returns those records.

        The worker writes an op's record before it completes the op's future (a fused call's members
        all at once, then their futures), so a reader who has a result finds its record without
        waiting; this waits for ops still running. Raises TimeoutError naming what it saw."""
        deadline = time.monotonic() + timeout_s
        with self._recorded:
            while not ready(records := [op for op in self._ops if op.end >= since]):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"op records never became ready in {timeout_s} s; saw {records}")
                self._recorded.wait(left)
        return records

    def busy_fraction(self, window_start: float, window_end: float) -> float:
        """Fraction of [start, end] during which the worker was executing an op."""
        span = max(window_end - window_start, 1e-9)
        busy = 0.0
        for op in self.since(window_start):
            busy += max(0.0, min(op.end, window_end) - max(op.start, window_start))
        return min(1.0, busy / span)

    def as_dicts(self, t: float = 0.0) -> list[dict]:
        return [asdict(op) for op in self.since(t)]


class NvmlReader:
    """GPU utilisation and memory from NVML (``nvidia-ml-py``) when a GPU and the library exist.

    ``read()`` returns None elsewhere, so callers fall back to the engine's busy fraction, which is
    labelled "engine busy" and never called GPU utilisation.
    """

    def __init__(self, device_index: int | None = 0):
        """``device_index=None``: a reader that is always absent (the model is not on a GPU)."""
        self._handle = None
        self._nvml = None
        if device_index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._nvml = pynvml
            self.name = pynvml.nvmlDeviceGetName(self._handle)
        except Exception:  # noqa: BLE001 - no library, no driver or no GPU: NVML is simply absent
            self._handle = None

    @classmethod
    def for_device(cls, device: str) -> NvmlReader:
        """The reader for a torch device string ("cuda", "cuda:1", "cpu", "mps")."""
        if not device.startswith("cuda"):
            return cls(None)
        return cls(int(device.split(":")[1]) if ":" in device else 0)

    @property
    def available(self) -> bool:
        return self._handle is not None

    def read(self) -> dict | None:
        if self._handle is None:
            return None
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception:  # noqa: BLE001 - a transient NVML error: report nothing this tick
            return None
        return {
            "label": "GPU utilisation (NVML)",
            "value": util.gpu / 100.0,
            "memory_used_bytes": int(mem.used),
            "memory_total_bytes": int(mem.total),
            "device": str(self.name),
        }
