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
