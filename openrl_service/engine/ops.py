"""What the engine queues and records: an :class:`Op` (one request's work on the device worker, in a
lane), the :class:`Fusable` part of one that may share a fused call, the errors of a full queue
(:class:`QueueFull`, 429) and of a dead worker (:class:`WorkerStopped`, 503), and :class:`OpLog`,
the telemetry record of every executed op (scheduler.py schedules them).
"""

from __future__ import annotations

import gc
import logging
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from openrl_service import memory
from openrl_service.engine.futures import FutureRecord
from openrl_service.errors import ApiError, OutOfMemory
from openrl_service.telemetry import OpRecorder

log = logging.getLogger(__name__)


class QueueFull(ApiError):
    """A request refused because a queue is at its limit (HTTP 429 with Retry-After); nothing was queued,
    so resubmitting it later is safe."""

    status_code = 429
    category = "server"

    def __init__(self, message: str, *, field: str, limit: str, retry_after_s: float):
        super().__init__(message, field=field)
        self.limit = limit
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict:
        return {**super().to_json(), "limit": self.limit, "retry_after_s": self.retry_after_s}


class WorkerStopped(ApiError):
    """The device-worker thread has died: nothing queued will run until the service restarts (503)."""

    status_code = 503
    category = "server"


@dataclass
class Fusable:
    """How an op joins a fused call: ops with the same ``key`` can share one call of that key's fuser.

    ``size``: tokens it adds (the fused op's budget); ``rows``/``width``: its rows (datums, or
    samples) and longest row, when the fused call pads every row to the longest of all members (then
    rows × width is what counts);
    ``prepare()`` (on the worker) returns its part of the fuser's input; ``finish(part)`` turns its
    part of the fuser's output into the op's result."""

    key: str
    size: int
    prepare: Callable[[], Any]
    finish: Callable[[Any], Any] = lambda part: part
    rows: int = 0
    width: int = 0
    limit: int | None = None  # the most padded tokens a call holding it may cover (e.g. one micro-batch)
    decode: int = 0  # sampling: tokens it decodes (members differ at most 2x, so none waits long)


@dataclass
class Op:
    kind: str
    lane: str  # "run:<id>" or "sampler:<id>" or "control"
    fn: Callable[[], Any] | None  # runs on the worker; None when ``error`` is set
    future: FutureRecord
    run_id: str | None = None
    seq_id: int | None = None
    error: ApiError | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    tokens: Callable[[Any], int] | None = None
    # Refused with QueueFull (rather than queued) when its lane or the engine is at its limit.
    refuse_when_full: bool = False
    # A chunked op's generator once its first slice ran; each later turn runs ``next(steps)``.
    steps: Generator[int, None, Any] | None = None
    sliced_tokens: int = 0  # tokens of the slices already recorded
    queued_since: float = field(default_factory=time.monotonic)  # submission, or requeue after a slice
    fuse: Fusable | None = None  # set when the op may run as part of a fused call (fusion on)
    admitted: bool = False  # its tenant's device time was checked already (engine/usage.py)
    companions: list[Op] | None = None  # the other members of its fused call, chosen by the worker


class OpLog:
    """Executed ops as telemetry records: contiguous slices of one op make one record; the members
    of a fused op are recorded back to back within its time, each lasting its share of the tokens,
    with the same ``fused_id`` and ``fused_runs``."""

    def __init__(self, recorder: OpRecorder):
        self.recorder = recorder
        self._open: list | None = None  # [op, start, end, tokens, queued_s] of the op being sliced

    def close_unless(self, op: Op) -> None:
        """A different op starts: the open record (another op's slices) is complete."""
        if self._open is not None and self._open[0] is not op:
            self.flush()

    def record_fused(
        self,
        ops: list[Op],
        results: list[tuple[Any, ApiError | None]],
        start: float,
        end: float,
        now: float,
    ) -> list[int]:
        """One record per member, back to back within [start, end], each lasting its share of the tokens
        (returned: the device time is apportioned by the same shares, engine/usage.py)."""
        tokens = [max(0, tokens_of(op, result)) for op, (result, _) in zip(ops, results, strict=True)]
        weights = [t or op.fuse.size or 1 for t, op in zip(tokens, ops, strict=True)]  # type: ignore[union-attr]
        total = float(sum(weights))
        fused_id = uuid.uuid4().hex[:12] if len(ops) > 1 else None
        runs = tuple(dict.fromkeys(op.run_id or op.lane for op in ops)) if len(ops) > 1 else ()
        t = start
        for op, (_, error), n, w in zip(ops, results, tokens, weights, strict=True):
            t_end = end if op is ops[-1] else t + (end - start) * w / total
            self.record(
                op,
                t,
                t_end,
                n,
                error is None,
                max(0.0, now - op.queued_since),
                fused_id=fused_id,
                fused_runs=runs,
            )
            t = t_end
        return weights

    def note(self, op: Op, start: float, end: float, tokens: int, queued_s: float) -> None:
        """Add a slice to the open record: contiguous slices of one op make one record."""
        rec = self._open
        if rec is not None and rec[0] is op:
            rec[2] = end
            rec[3] += tokens
        else:
            self._open = [op, start, end, tokens, queued_s]

    def flush(self, ok: bool = True) -> None:
        rec, self._open = self._open, None
        if rec is None:
            return
        op, start, end, tokens, queued_s = rec
        self.record(op, start, end, tokens, ok, queued_s)  # queued: submission (or requeue) → start

    def record(
        self, op: Op, start: float, end: float, tokens: int, ok: bool, queued_s: float, **fused
    ) -> None:
        self.recorder.record(
            run=op.run_id or op.lane,
            kind=op.kind,
            start=start,
            end=end,
            tokens=tokens,
            ok=ok,
            queued_s=queued_s,
            **fused,
        )


def tokens_of(op: Op, result: Any) -> int:
    """The tokens ``op``'s result reports (0 when it has none or counting them fails)."""
    if result is None or op.tokens is None:
        return 0
    try:
        return int(op.tokens(result))
    except Exception:  # noqa: BLE001 - telemetry must never fail an op
        return 0


def out_of_memory(op: Op, e: BaseException) -> OutOfMemory:
    """``op`` ran out of memory: it fails alone (a training call's gradient and counts are put back
    as they were, trainer.accumulating_grads), what it allocated is freed, and the worker goes on
    with the next op."""
    device = "GPU memory" if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available() else "memory"
    del e
    gc.collect()
    memory.give_back()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.warning("op %s on %s ran out of %s; it failed alone, the service goes on", op.kind, op.lane, device)
    return OutOfMemory(
        f"{op.kind} ran out of {device} and was not applied; nothing of it was kept. Send less at "
        "once (fewer or shorter datums per forward_backward, fewer samples or max_tokens per "
        "sample call), or give the service more memory or a smaller full-run share "
        "(OPENRL_MICROBATCH_TOKENS, OPENRL_SAMPLE_BATCH_BYTES, OPENRL_FULL_RUN_BUDGET_BYTES; "
        "GET /metrics, openrl_memory_bytes, shows the memory plan)",
        field="memory",
    )
