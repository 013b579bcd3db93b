"""The scheduler and the one device-worker thread that owns the model.

Work arrives as :class:`Op`s in *lanes*: one lane per training run (executed strictly by seq_id,
waiting for gaps) and one per sampler (FIFO). Rules it keeps:

- **least recently served**: the worker serves, one op (or one slice of a chunked op) at a time, the
  ready lane whose last service is oldest; a lane seen for the first time joins at the back (it counts
  as served when it appeared), so a backlog of one run never delays another by more than one turn per
  lane, and a stream of new samplers cannot overtake lanes that are already waiting;
- **chunked ops**: an op whose work is a generator runs one slice per turn (``next()``); after each
  slice it goes back to the *head* of its own lane, so other lanes are served in between while its own
  later ops still wait behind it. forward/backward yields after each padded micro-batch, so one big
  batch holds the device for about one micro-batch (``microbatch_tokens``) at a time, not its whole
  duration. Contiguous slices of one op are recorded as one op record;
- **queue limits**: a lane holds at most ``max_queued_per_lane`` queued ops and the engine at most
  ``max_queued_total`` (OPENRL_MAX_QUEUED_PER_RUN / OPENRL_MAX_QUEUED_TOTAL). Sampling over a limit is
  *refused* before anything is queued (:class:`QueueFull`, HTTP 429 + Retry-After; the Tinker SDK
  backs off and resubmits). Training is never refused for queue length (a refused chunk of a
  parallel forward/backward would leave a seq gap): it is accepted, keeps its seq slot, and while it
  is over the limit its future reports ``queue_state="paused_capacity"`` (:meth:`Engine.queue_state`);
  it runs, once and in order, when the ops ahead of it have run;
- a retry (same (run, seq_id), or same X-Idempotency-Key) gets the original future, never a second
  execution, also when the queue is full;
- a rejected request whose (run, seq_id) parsed still takes its slot and completes as an error;
- a gap (a missing seq_id) open longer than ``seq_gap_timeout_s`` fails the requests waiting behind
  it, naming the missing seq_id, and the run moves on: a run never hangs;
- **fusion** (``fusion=True``, OPENRL_FUSION): an op that carries a :class:`Fusable` is not run
  alone. When its lane's turn comes, the worker also takes the ready head ops of other lanes (in
  least-recently-served order) and, for unordered lanes, further ready ops of the same lane, that have
  the same fusion key (``"train"``: a forward/backward of at most one micro-batch; ``"sample"``), up to
  ``fusion_max_tokens`` padded tokens, and runs them as ONE call of that key's *fuser* (one padded pass
  with per-row adapters). Every lane it served counts as served this turn. Each member's future gets its
  own result; if the fused call fails, each member runs alone instead, so one bad request never fails
  another. With fusion off nothing is fused and every op runs exactly as it would alone;
- every executed op is recorded (run, kind, start, end, tokens) for telemetry. The members of one fused
  op are recorded one after another within the op's time, each with a share proportional to its
  tokens, with the same ``fused_id`` and ``fused_runs`` (the runs the op covered). Its device time is
  charged to its tenant by the same shares (``usage``, engine/usage.py: the device-time quota).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import traceback
import types
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from openrl_service import progress
from openrl_service.engine.futures import FutureRecord, FutureStore
from openrl_service.engine.ops import Fusable, Op, OpLog, QueueFull, WorkerStopped, out_of_memory, tokens_of
from openrl_service.engine.usage import DeviceUsage
from openrl_service.errors import ApiError, InternalError, UserError
from openrl_service.telemetry import OpRecorder

log = logging.getLogger(__name__)


@dataclass
class _Lane:
    ready: deque = field(default_factory=deque)
    last_served: int = 0  # the engine's service counter at its last turn (or when it appeared)
    # Ordered lanes only (training runs):
    next_seq: int | None = None
    waiting: dict[int, Op] = field(default_factory=dict)
    seq_index: dict[int, FutureRecord] = field(default_factory=dict)
    # seq_ids a gap expiry moved past, as [lo, hi) ranges (a far-ahead seq_id must not expand into a
    # set of every id before it)
    skipped: list[tuple[int, int]] = field(default_factory=list)

    def was_skipped(self, seq_id: int) -> bool:
        return any(lo <= seq_id < hi for lo, hi in self.skipped)


class Engine:
    def __init__(
        self,
        *,
        futures: FutureStore,
        seq_gap_timeout_s: float,
        recorder: OpRecorder,
        max_queued_per_lane: int = 1 << 30,
        max_queued_total: int = 1 << 30,
        retry_after_s: float = 1.0,
        fusion: bool = False,
        fusion_max_tokens: int = 16384,
        fusers: dict[str, Callable[[list[Any]], list[Any]]] | None = None,
        usage: DeviceUsage | None = None,
    ):
        self.futures = futures
        self.usage = usage or DeviceUsage()  # each executed op's device-seconds, charged to its tenant
        self.seq_gap_timeout_s = seq_gap_timeout_s
        self.recorder = recorder
        self.max_queued_per_lane = max_queued_per_lane
        self.max_queued_total = max_queued_total
        self.retry_after_s = retry_after_s
        self.fusion = fusion
        self.fusion_max_tokens = fusion_max_tokens
        # key -> fn(list of members' prepared parts) -> list of their outputs, in order
        self.fusers: dict[str, Callable[[list[Any]], list[Any]]] = dict(fusers or {})
        self._lanes: dict[str, _Lane] = {}
        self._served = 0  # service counter: +1 per turn (least-recently-served order)
        self._queued = 0  # ops in all lanes' ready + waiting
        self._queued_by: Counter[str] = Counter()  # the same, per tenant (fair refusals when full)
        # The op whose slices ran last and are not recorded yet: [op, start, end, tokens, queued_s].
        self.oplog = OpLog(recorder)  # every executed op, for telemetry
        self._idem: dict[tuple[str, str], FutureRecord] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._setup: Callable[[], None] | None = None
        self.ready = threading.Event()
        self.setup_error: BaseException | None = None
        self.current: Op | None = None
        self._running: list[Op] = []  # the op running now, with its fused companions
        self._in_flight: set[str] = set()  # their lanes
        self._abandoned = False  # set by abandon(): the worker starts no further op
        # Work that needs the device idle (a snapshot): run by the worker between two ops, never
        # while a chunked op is between slices.
        self._exclusive: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, setup: Callable[[], None] | None = None) -> None:
        """Start the worker; ``setup`` (e.g. loading the model) runs first, on the worker thread."""
        self._setup = setup
        self._thread = threading.Thread(target=self._run, name="openrl-device-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker after its current op; wait up to ``timeout_s`` (1 s once :meth:`abandon`
        has given up on that op: nobody will get its result, and the thread is a daemon)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            if self._abandoned:
                timeout_s = min(timeout_s, 1.0)
            for _, fut in self._exclusive:
                fut.cancel()
            self._exclusive = []
        if self._thread is not None:
            self._thread.join(timeout_s)

    def has_work(self) -> bool:
        """An op running or queued, or exclusive work waiting (read without the lock: for /healthz)."""
        return self.current is not None or self._queued > 0 or bool(self._exclusive)

    def runnable(self) -> int:
        """Ops that are running or ready to run (not those waiting for an earlier seq_id)."""
        with self._cv:
            return len(self._running) + sum(len(lane.ready) for lane in self._lanes.values())

    def hold(self) -> None:
        """Start no further op (the one running finishes); queued ops stay queued, their futures
        pending: the journal has them, and a restarted service runs them."""
        with self._cv:
            self._abandoned = True
            self._cv.notify_all()

    def abandon(self, error: ApiError) -> int:
        """The service is going away: start no further op, and complete every queued op's future, and
        the running op's, with ``error`` (a running op's own completion, later, is ignored). Returns
        how many futures this completed."""
        with self._cv:
            self._abandoned = True
            running = {id(op) for op in self._running}
            ops = list(self._running)
            for lane in self._lanes.values():
                ops += [*lane.ready, *lane.waiting.values()]
                lane.ready.clear()
                lane.waiting.clear()
            self._queued = 0
            self._queued_by.clear()
            self._cv.notify_all()
        failed = 0
        for op in ops:
            if op.steps is not None and id(op) not in running:
                op.steps.close()  # a chunked op between slices: its cleanup runs, the rest never does
            failed += not op.future.done
            self.futures.complete(op.future, error=error)
        return failed

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def require_alive(self) -> None:
        """Raise :class:`WorkerStopped` if the worker started, set up, and has since died."""
        if self.ready.is_set() and not self.alive:
            raise WorkerStopped(
                "the service's device worker has stopped; queued requests will not run. Restart the service"
            )

    # -- submission (event-loop side) -----------------------------------------------------------
    def open_ordered_lane(self, run_id: str, next_seq: int) -> None:
        with self._cv:
            lane = self._new_lane(f"run:{run_id}")
            lane.next_seq = next_seq

    def close_lane(self, lane_key: str) -> None:
        with self._cv:
            lane = self._lanes.pop(lane_key, None)
            if lane is not None:
                for gone in [*lane.ready, *lane.waiting.values()]:
                    self._count(gone, -1)
        if lane is not None:
            for op in list(lane.ready) + list(lane.waiting.values()):
                if op.steps is not None:
                    op.steps.close()  # a chunked op between slices: its cleanup runs, the rest never does
                self.futures.complete(
                    op.future, error=UserError(f"{lane_key} was closed before this request ran")
                )

    def run_exclusive(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the worker between two ops (no chunked op half done); its result or error
        comes back in the returned future. Without a live worker it runs here, now."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            return fut
        with self._cv:
            self._exclusive.append((fn, fut))
            self._cv.notify_all()
        return fut

    def _run_exclusive(self) -> bool:
        """On the worker (lock held on entry and exit): run the queued exclusive work if the device
        is between ops. True when something ran."""
        if not self._exclusive or any(
            ln.ready and ln.ready[0].steps is not None for ln in self._lanes.values()
        ):
            return False
        work, self._exclusive = self._exclusive, []
        self._cv.release()
        try:
            for fn, fut in work:
                progress.tick()
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
        finally:
            self._cv.acquire()
        return True

    def lane_position(self, lane_key: str) -> dict:
        """An ordered lane's place for a snapshot taken between ops: the first seq_id not yet applied
        (its queued ops are replayed from their journal records) and the seq_ids skipped by gaps."""
        with self._cv:
            lane = self._lanes.get(lane_key)
            if lane is None:
                return {"next_seq": 0, "skipped": []}
            return {"next_seq": (lane.next_seq or 0) - len(lane.ready), "skipped": list(lane.skipped)}

    def restore_lane(self, lane_key: str, position: dict, seq_index: dict[int, FutureRecord]) -> None:
        """Reopen an ordered lane from a snapshot, with the results of its seq_ids already applied."""
        with self._cv:
            lane = self._new_lane(lane_key)
            lane.next_seq = position["next_seq"]
            lane.skipped = [tuple(r) for r in position["skipped"]]
            lane.seq_index.update(seq_index)

    def restore_idempotency(self, futures: FutureStore) -> None:
        with self._cv:
            for rec in futures.idempotency_index():
                self._idem[(rec.tenant, rec.idem_key)] = rec

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

    def submit(
        self, op: Op, *, idem_key: str | None = None, on_accept: Callable[[], None] | None = None
    ) -> tuple[FutureRecord, bool]:
        """Queue ``op``; returns (the future to answer with, whether this was a retry). ``on_accept``
        runs once the op is known to be new and to fit, before anything is queued (the journal records
        it there; if it raises, nothing was queued)."""
        tenant = op.future.tenant
        with self._cv:
            if self.current is None and self._queued == 0 and not self._exclusive:
                progress.tick()  # an idle worker's clock starts with the work (not at its last op)
            if idem_key and (tenant, idem_key) in self._idem:
                return self._idem[(tenant, idem_key)], True
            lane = self._lanes.get(op.lane)
            if lane is None and op.seq_id is not None:
                raise UserError(f"{op.lane} is not open", field="model_id")
            if op.refuse_when_full:
                self._check_room(op, lane)
            if op.seq_id is not None and lane is not None:
                prior = lane.seq_index.get(op.seq_id)
                if prior is not None:
                    return prior, True
            if on_accept is not None:
                on_accept()
            if lane is None:
                lane = self._new_lane(op.lane)
            if op.seq_id is not None:
                lane.seq_index[op.seq_id] = op.future
                op.future.slot = (op.lane, op.seq_id)
                if op.seq_id < (lane.next_seq or 0) or lane.was_skipped(op.seq_id):
                    late = UserError(
                        f"seq_id {op.seq_id} arrived after model {op.run_id} had moved past it "
                        f"(next expected seq_id is {lane.next_seq}); it was not executed",
                        field="seq_id",
                    )
                    self.futures.complete(op.future, error=late)
                elif op.seq_id == lane.next_seq:
                    self._count(op, 1)
                    lane.ready.append(op)
                    lane.next_seq += 1
                    while lane.next_seq in lane.waiting:
                        lane.ready.append(lane.waiting.pop(lane.next_seq))
                        lane.next_seq += 1
                else:
                    self._count(op, 1)
                    lane.waiting[op.seq_id] = op
            else:
                self._count(op, 1)
                lane.ready.append(op)
            if idem_key:
                self._idem[(tenant, idem_key)] = op.future
                op.future.idem_key = idem_key
            self._cv.notify_all()
        return op.future, False

    def _new_lane(self, key: str) -> _Lane:
        """The lane ``key``, created at the back of the least-recently-served order if it is new."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(last_served=self._served)
        return lane

    def _check_room(self, op: Op, lane: _Lane | None) -> None:
        """Raise QueueFull when ``op``'s lane or the whole engine is at its queue limit (lock held)."""
        depth = 0 if lane is None else len(lane.ready) + len(lane.waiting)
        what = "sampler " + op.lane.split(":", 1)[1] if op.lane.startswith("sampler:") else op.lane
        if depth >= self.max_queued_per_lane:
            raise QueueFull(
                f"{what} already has {depth} requests queued, the limit per run or sampler "
                f"(OPENRL_MAX_QUEUED_PER_RUN={self.max_queued_per_lane}); retry after "
                f"{self.retry_after_s:g} s",
                field="sampling_session_id" if op.lane.startswith("sampler:") else "model_id",
                limit="OPENRL_MAX_QUEUED_PER_RUN",
                retry_after_s=self.retry_after_s,
            )
        tenant = op.future.tenant
        mine, tenants = self._queued_by[tenant], len(+self._queued_by | Counter({tenant: 1}))
        # Over the total, a tenant holding less than its share of the queue is still served: one
        # tenant's flood gets only its own requests refused.
        if self._queued >= self.max_queued_total and mine * tenants >= self._queued:
            raise QueueFull(
                f"the service already has {self._queued} requests queued, its limit "
                f"(OPENRL_MAX_QUEUED_TOTAL={self.max_queued_total}); retry after {self.retry_after_s:g} s",
                field="queue",
                limit="OPENRL_MAX_QUEUED_TOTAL",
                retry_after_s=self.retry_after_s,
            )

    def _count(self, op: Op, n: int) -> None:
        """``n`` ops of ``op``'s tenant entered (1) or left (-1) the queues (lock held)."""
        self._queued += n
        self._queued_by[op.future.tenant] += n

    def queue_depth(self) -> int:
        with self._cv:
            return self._queued

    def lane_depth(self, lane_key: str) -> int:
        """Ops queued (not running) in one lane; 0 for an unknown or drained lane."""
        with self._cv:
            lane = self._lanes.get(lane_key)
            return 0 if lane is None else len(lane.ready) + len(lane.waiting)

    def queue_state(self, rec: FutureRecord) -> tuple[str, str | None]:
        """The Tinker ``queue_state`` of a pending future, with a reason when it is paused.

        A seq-ordered (training) op is ``paused_capacity`` while more than the per-run limit of its
        run's ops are queued ahead of it, or while the engine's queue is over its total limit and it is
        not next in its lane; otherwise ``active``. A paused op is still queued: it runs, once, in order.
        """
        if rec.done or rec.slot is None:
            return "active", None
        lane_key, seq = rec.slot
        with self._cv:
            lane = self._lanes.get(lane_key)
            if lane is None:
                return "active", None
            ahead = sum(1 for o in lane.ready if o.seq_id is not None and o.seq_id < seq)
            ahead += sum(1 for s in lane.waiting if s < seq)
            if lane_key in self._in_flight:
                ahead += 1
            total = self._queued
        if ahead >= self.max_queued_per_lane:
            return "paused_capacity", (
                f"{ahead} earlier requests of {lane_key.split(':', 1)[1]} are queued ahead of this one; the "
                f"limit per run is {self.max_queued_per_lane} (OPENRL_MAX_QUEUED_PER_RUN)"
            )
        if total > self.max_queued_total and ahead > 0:
            return "paused_capacity", (
                f"the service has {total} requests queued, over its limit of {self.max_queued_total} "
                "(OPENRL_MAX_QUEUED_TOTAL)"
            )
        return "active", None

    # -- the worker -----------------------------------------------------------------------------
    def _next_op(self) -> Op | None:
        best: _Lane | None = None
        for lane in self._lanes.values():
            if lane.ready and (best is None or lane.last_served < best.last_served):
                best = lane
        if best is None:
            return None
        self._served += 1
        best.last_served = self._served
        op = self._pop(best)
        if self.fusion and op.fuse is not None and op.steps is None and op.fuse.key in self.fusers:
            # Alone, it runs as it would with fusion off (its own work, once, bit for bit).
            op.companions = self._companions(op, best) or None
        return op

    def _pop(self, lane: _Lane) -> Op:
        op = lane.ready.popleft()
        self._count(op, -1)
        if lane.next_seq is None and not lane.ready:
            # Unordered lanes (samplers) carry no state between ops: drop them when drained so that
            # one lane per sampler ever used does not pile up.
            self._lanes.pop(op.lane, None)
        return op

    def _fits(self, members: list[Fusable], f: Fusable) -> bool:
        budget = min([self.fusion_max_tokens] + [m.limit for m in (*members, f) if m.limit is not None])
        if f.decode:  # sampling: nobody waits on a decode more than twice as long as its own
            lengths = [m.decode for m in (*members, f)]
            if max(lengths) > 2 * max(1, min(lengths)):
                return False
        if f.rows:  # rows padded to the longest member (a training micro-batch, a shared KV cache)
            rows = f.rows + sum(m.rows for m in members)
            width = max([f.width] + [m.width for m in members])
            return rows * width <= budget
        return f.size + sum(m.size for m in members) <= budget

    def _companions(self, op: Op, lane: _Lane) -> list[Op]:
        """Ready ops that can share ``op``'s fused call (lock held): heads of other lanes in
        least-recently-served order, plus following ops of unordered lanes (ops of one ordered lane
        depend on each other, so only its head is eligible). Taken ops leave their lanes."""
        key = op.fuse.key  # type: ignore[union-attr]
        members = [op.fuse]
        taken: list[Op] = []
        # Other lanes' heads first (least recently served first), then this lane's own backlog.
        lanes = sorted(
            (ln for ln in self._lanes.values() if ln is not lane and ln.ready), key=lambda ln: ln.last_served
        ) + [lane]
        for ln in lanes:
            if ln is lane and ln.next_seq is not None:
                continue  # the run's next op depends on this one
            served = False
            while ln.ready:
                head = ln.ready[0]
                f = head.fuse
                if f is None or f.key != key or head.steps is not None or head.error is not None:
                    break
                if not self._fits(members, f):
                    break
                members.append(f)
                taken.append(self._pop(ln))
                served = True
                if ln.next_seq is not None:
                    break  # ordered lane: only the head
            if served and ln is not lane:
                self._served += 1
                ln.last_served = self._served
        return taken

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
            for lo, hi in zip([missing, *(k + 1 for k in stuck[:-1])], stuck, strict=True):
                if lo < hi:
                    lane.skipped.append((lo, hi))
            for s in stuck:
                gone = lane.waiting.pop(s)
                self._count(gone, -1)
                self.futures.complete(gone.future, error=err)
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
                        if self._run_exclusive():
                            continue
                        op = None if self._abandoned else self._next_op()
                        if op is not None:
                            break
                        self._cv.wait(timeout=0.25)
                    if self._stop:
                        return
                    self.current = op
                    self._running = [op, *(op.companions or ())]
                    self._in_flight = {o.lane for o in self._running}
                progress.tick()
                self._execute(op)
                progress.tick()
            except Exception:  # noqa: BLE001 - the worker must outlive any one bad op or bookkeeping bug
                log.exception("device worker: unexpected error; continuing")
                if op is not None:
                    self.futures.complete(
                        op.future, error=InternalError(f"internal error while running {op.kind}")
                    )
            finally:
                with self._cv:
                    self.current = None
                    self._running = []
                    self._in_flight = set()

    def _execute(self, op: Op) -> None:
        """Run ``op`` (or its next slice); complete its future unless it yielded, then requeue it."""
        if op.companions is not None:
            members, op.companions = [op, *op.companions], None
            self._execute_fused(members)
            return
        now = time.monotonic()
        self.oplog.close_unless(op)
        start, began = time.time(), self.usage.begin()
        result, error, more, sliced = None, op.error, False, 0
        if error is None:
            try:
                if op.steps is None:
                    out = op.fn()
                    if isinstance(out, types.GeneratorType):
                        op.steps = out
                    else:
                        result = out
                if op.steps is not None:
                    try:
                        sliced = int(next(op.steps) or 0)
                        more = True
                    except StopIteration as stop:
                        result = stop.value
            except ApiError as e:
                error = e
            except (torch.OutOfMemoryError, MemoryError) as e:
                error = out_of_memory(op, e)
            except Exception as e:  # noqa: BLE001 - reported to the client with an id, logged in full
                error = self._internal(op, e)
        end = time.time()
        if op.error is None:  # each slice as it runs: a long op counts while it holds the device
            self.usage.charge(began, [(op.future.tenant, 1.0)])
        queued_s = max(0.0, now - op.queued_since)
        if more:
            op.sliced_tokens += sliced
            self.oplog.note(op, start, end, sliced, queued_s)
            with self._cv:
                lane = self._lanes.get(op.lane) if op.seq_id is not None else self._new_lane(op.lane)
                if lane is not None:
                    op.queued_since = time.monotonic()
                    lane.ready.appendleft(op)  # its lane's later ops still wait behind it
                    self._count(op, 1)
                    self._cv.notify_all()
                    return
            op.steps.close()  # the lane was closed between two slices: the op's cleanup runs
            result, error = None, UserError(f"{op.lane} was closed before this request finished")
        tokens = max(0, tokens_of(op, result) - op.sliced_tokens)
        if op.error is None:
            self.oplog.note(op, start, end, tokens, queued_s)
            self.oplog.flush(ok=error is None)
        self.futures.complete(op.future, result=result, error=error)

    def _internal(self, op: Op, e: Exception) -> InternalError:
        """An unexpected failure of ``op``: logged in full under an incident id the client gets."""
        incident = uuid.uuid4().hex[:8]
        log.error("op %s on %s failed (incident %s):\n%s", op.kind, op.lane, incident, traceback.format_exc())
        return InternalError(
            f"internal error while running {op.kind} (incident {incident}): {type(e).__name__}"
        )

    def _execute_fused(self, ops: list[Op]) -> None:
        """Run ``ops`` (same fusion key) as one fuser call; complete each one's future.

        A member whose ``prepare`` fails completes with that error and leaves the call. If the call
        itself fails, each remaining member runs alone (the fusers leave every run's state as it was
        on failure), so a bad member cannot fail the others. Whatever happens, every member's future
        completes."""
        try:
            self._run_fused(ops)
        except Exception as e:  # noqa: BLE001 - bookkeeping bug: no member may be left waiting
            error = self._internal(ops[0], e)
            for op in ops:
                if not op.future.done:
                    self.futures.complete(op.future, error=error)

    def _run_fused(self, ops: list[Op]) -> None:
        self.oplog.flush()
        now = time.monotonic()
        start, began = time.time(), self.usage.begin()
        parts, live = [], []
        for op in ops:
            try:
                parts.append(op.fuse.prepare())  # type: ignore[union-attr]
                live.append(op)
            except ApiError as e:
                self._fail_prepare(op, e, now)
            except Exception as e:  # noqa: BLE001
                self._fail_prepare(op, self._internal(op, e), now)
        if not live:
            return
        if len(live) == 1:  # the others failed to join: it runs alone, as an op without companions does
            live[0].fuse = None
            self._execute(live[0])
            return
        try:
            outputs = self.fusers[live[0].fuse.key](parts)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - fall back to running each member alone
            log.warning(
                "fused %s of %d ops failed; running them one by one", live[0].kind, len(live), exc_info=True
            )
            for op in live:
                op.fuse = None
                self._execute(op)
            return
        results: list[tuple[Any, ApiError | None]] = []
        for op, out in zip(live, outputs, strict=True):
            try:
                results.append((op.fuse.finish(out), None))  # type: ignore[union-attr]
            except ApiError as e:
                results.append((None, e))
            except Exception as e:  # noqa: BLE001 - reported to the client with an id, logged in full
                results.append((None, self._internal(op, e)))
        end = time.time()
        # recorded first: a client that has its result finds the op in its trace and in /metrics
        shares = self.oplog.record_fused(live, results, start, end, now)  # each member's tokens
        self.usage.charge(began, list(zip([op.future.tenant for op in live], shares, strict=True)))
        for op, (result, error) in zip(live, results, strict=True):
            self.futures.complete(op.future, result=result, error=error)

    def _fail_prepare(self, op: Op, error: ApiError, now: float) -> None:
        """A member that could not join its fused call: an error result, recorded as a failed op."""
        t = time.time()
        self.oplog.record(op, t, t, 0, False, max(0.0, now - op.queued_since))
        self.futures.complete(op.future, error=error)
