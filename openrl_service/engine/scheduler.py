"""The scheduler and the one device-worker thread that owns the model.

Work arrives as :class:`Op`s in *lanes*: one lane per training run (executed strictly by seq_id,
waiting for gaps) and one per sampler (FIFO). The worker serves the lane that was served least
recently, one op at a time, so no run can starve another. Rules it keeps:

- a retry (same (run, seq_id), or same X-Idempotency-Key) gets the original future, never a second
  execution;
- a rejected request whose (run, seq_id) parsed still takes its slot and completes as an error;
- a gap (a missing seq_id) open longer than ``seq_gap_timeout_s`` fails the requests waiting behind
  it, naming the missing seq_id, and the run moves on: a run never hangs;
- every executed op is recorded (run, kind, start, end, tokens) for telemetry.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openrl_service.engine.futures import FutureRecord, FutureStore
from openrl_service.errors import InternalError, ServiceError, UserError
from openrl_service.telemetry import OpRecorder

log = logging.getLogger(__name__)


@dataclass
class Op:
    kind: str
    lane: str  # "run:<id>" or "sampler:<id>" or "control"
    fn: Callable[[], Any] | None  # runs on the worker; None when ``error`` is set
    future: FutureRecord
    run_id: str | None = None
    seq_id: int | None = None
    error: ServiceError | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    tokens: Callable[[Any], int] | None = None


@dataclass
class _Lane:
    ready: deque = field(default_factory=deque)
    last_served: float = 0.0
    # Ordered lanes only (training runs):
    next_seq: int | None = None
    waiting: dict[int, Op] = field(default_factory=dict)
    seq_index: dict[int, FutureRecord] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)


class Engine:
    def __init__(self, *, futures: FutureStore, seq_gap_timeout_s: float, recorder: OpRecorder):
        self.futures = futures
        self.seq_gap_timeout_s = seq_gap_timeout_s
        self.recorder = recorder
        self._lanes: dict[str, _Lane] = {}
        self._idem: dict[tuple[str, str], FutureRecord] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._setup: Callable[[], None] | None = None
        self.ready = threading.Event()
        self.setup_error: BaseException | None = None
        self.current: Op | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, setup: Callable[[], None] | None = None) -> None:
        """Start the worker; ``setup`` (e.g. loading the model) runs first, on the worker thread."""
        self._setup = setup
        self._thread = threading.Thread(target=self._run, name="openrl-device-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- submission (event-loop side) -----------------------------------------------------------
    def open_ordered_lane(self, run_id: str, next_seq: int) -> None:
        with self._cv:
            lane = self._lanes.setdefault(f"run:{run_id}", _Lane())
            lane.next_seq = next_seq

    def close_lane(self, lane_key: str) -> None:
        with self._cv:
            lane = self._lanes.pop(lane_key, None)
        if lane is not None:
            for op in list(lane.ready) + list(lane.waiting.values()):
                self.futures.complete(
                    op.future, error=UserError(f"{lane_key} was closed before this request ran")
                )

    def idempotent(self, tenant: str, key: str | None) -> FutureRecord | None:
        if not key:
            return None
        with self._cv:
            return self._idem.get((tenant, key))

    def forget(self, expired: list[FutureRecord]) -> None:
        """Drop index entries of expired futures, so retries are remembered only as long as results."""
        with self._cv:
            for rec in expired:
                if rec.idem_key and self._idem.get((rec.tenant, rec.idem_key)) is rec:
                    del self._idem[(rec.tenant, rec.idem_key)]
                if rec.slot is not None:
                    lane = self._lanes.get(rec.slot[0])
                    if lane is not None and lane.seq_index.get(rec.slot[1]) is rec:
                        del lane.seq_index[rec.slot[1]]

    def submit(self, op: Op, *, idem_key: str | None = None) -> tuple[FutureRecord, bool]:
        """Queue ``op``; returns (the future to answer with, whether this was a retry)."""
        tenant = op.future.tenant
        with self._cv:
            if idem_key and (tenant, idem_key) in self._idem:
                return self._idem[(tenant, idem_key)], True
            lane = self._lanes.get(op.lane)
            if lane is None:
                if op.seq_id is not None:
                    raise UserError(f"{op.lane} is not open", field="model_id")
                lane = self._lanes.setdefault(op.lane, _Lane())
            if op.seq_id is not None:
                prior = lane.seq_index.get(op.seq_id)
                if prior is not None:
                    return prior, True
                lane.seq_index[op.seq_id] = op.future
                op.future.slot = (op.lane, op.seq_id)
                if op.seq_id < (lane.next_seq or 0) or op.seq_id in lane.skipped:
                    late = UserError(
                        f"seq_id {op.seq_id} arrived after model {op.run_id} had moved past it "
                        f"(next expected seq_id is {lane.next_seq}); it was not executed",
                        field="seq_id",
                    )
                    self.futures.complete(op.future, error=late)
                elif op.seq_id == lane.next_seq:
                    lane.ready.append(op)
                    lane.next_seq += 1
                    while lane.next_seq in lane.waiting:
                        lane.ready.append(lane.waiting.pop(lane.next_seq))
                        lane.next_seq += 1
                else:
                    lane.waiting[op.seq_id] = op
            else:
                lane.ready.append(op)
            if idem_key:
                self._idem[(tenant, idem_key)] = op.future
                op.future.idem_key = idem_key
            self._cv.notify_all()
        return op.future, False

    def queue_depth(self) -> int:
        with self._cv:
            return sum(len(lane.ready) + len(lane.waiting) for lane in self._lanes.values())

    # -- the worker -----------------------------------------------------------------------------
    def _next_op(self) -> Op | None:
        best: _Lane | None = None
        for lane in self._lanes.values():
            if lane.ready and (best is None or lane.last_served < best.last_served):
                best = lane
        if best is None:
            return None
        best.last_served = time.monotonic()
        op = best.ready.popleft()
        if best.next_seq is None and not best.ready:
            # Unordered lanes (samplers) carry no state between ops: drop them when drained so that
            # one lane per sampler ever used does not pile up.
            self._lanes.pop(op.lane, None)
        return op

    def _expire_gaps(self) -> None:
        now = time.monotonic()
        for lane in self._lanes.values():
            if not lane.waiting:
                continue
            oldest = min(op.submitted_at for op in lane.waiting.values())
            if now - oldest < self.seq_gap_timeout_s:
                continue
            missing = lane.next_seq
            stuck = sorted(lane.waiting)
            err = UserError(
                f"seq_id {missing} never arrived within {self.seq_gap_timeout_s:g} s (OPENRL_SEQ_GAP_TIMEOUT_S); "
                f"requests with seq_id {', '.join(map(str, stuck))} waiting behind it were not executed",
                field="seq_id",
            )
            for s in range(missing, stuck[-1] + 1):
                if s not in lane.waiting:
                    lane.skipped.add(s)
            for s in stuck:
                self.futures.complete(lane.waiting.pop(s).future, error=err)
            lane.next_seq = stuck[-1] + 1

    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
            self.ready.set()
        except BaseException as e:  # noqa: BLE001 - reported through /readyz and the log
            self.setup_error = e
            log.exception("model setup failed")
            return
        while True:
            try:
                with self._cv:
                    op = None
                    while not self._stop:
                        self._expire_gaps()
                        op = self._next_op()
                        if op is not None:
                            break
                        self._cv.wait(timeout=0.25)
                    if self._stop:
                        return
                    self.current = op
                self._execute(op)
            except Exception:  # noqa: BLE001 - the worker must outlive any one bad op or bookkeeping bug
                log.exception("device worker: unexpected error; continuing")
                if op is not None:
                    self.futures.complete(
                        op.future, error=InternalError(f"internal error while running {op.kind}")
                    )
            finally:
                with self._cv:
                    self.current = None

    def _execute(self, op: Op) -> None:
        start = time.time()
        result, error = None, op.error
        if error is None:
            try:
                result = op.fn()
            except ServiceError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - reported to the client with an id, logged in full
                incident = uuid.uuid4().hex[:8]
                log.error(
                    "op %s on %s failed (incident %s):\n%s",
                    op.kind,
                    op.lane,
                    incident,
                    traceback.format_exc(),
                )
                error = InternalError(
                    f"internal error while running {op.kind} (incident {incident}): {type(e).__name__}"
                )
        end = time.time()
        tokens = 0
        if result is not None and op.tokens is not None:
            try:
                tokens = int(op.tokens(result))
            except Exception:  # noqa: BLE001
                tokens = 0
        if op.error is None:
            self.recorder.record(
                run=op.run_id or op.lane, kind=op.kind, start=start, end=end, tokens=tokens, ok=error is None
            )
        self.futures.complete(op.future, result=result, error=error)
