"""Futures: a request's result, waited on by long-poll, kept fetchable for a while, then gone (410).

The device worker completes a future from its own thread; waiters live on the HTTP event loop and
are woken through ``loop.call_soon_threadsafe``, so a finished result reaches a polling client at
once instead of on its next poll.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openrl_service.errors import ApiError, Gone, NotFound, RestoredError


@dataclass
class FutureRecord:
    request_id: str
    tenant: str
    kind: str
    created_at: float = field(default_factory=time.time)
    done: bool = False
    result: Any = None
    error: ApiError | None = None
    completed_at: float | None = None
    extra: dict = field(default_factory=dict)  # e.g. model_id, sample_sequence_ids for the submit reply
    cache: Any = None  # the encoded reply, made once on first retrieve
    # Where the scheduler indexed this future, so the index can forget it when the result expires.
    idem_key: str | None = None
    slot: tuple[str, int] | None = None
    # A Tinker client was handed the request_id (it will poll), and has fetched the final answer:
    # a draining service waits for the fetch (see openrl_service.lifecycle).
    handed_out: bool = False
    fetched: bool = False
    size: int = 0  # the result's estimated bytes (results are held to OPENRL_MAX_RESULT_BYTES)
    _event: asyncio.Event | None = None

    def reply(self) -> dict:
        """The submit reply naming the request_id; the client will poll ``retrieve_future`` for it."""
        self.handed_out = True
        return {"request_id": self.request_id, **self.extra}


class FutureStore:
    def __init__(self, *, ttl_s: float, max_bytes: int = 1 << 30, expired_memory: int = 200_000):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes  # completed results together; over it the oldest go first
        self.held_bytes = 0
        self._records: dict[str, FutureRecord] = {}
        self._expired: OrderedDict[str, str] = OrderedDict()  # expired request id -> its tenant
        self._expired_memory = expired_memory
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.held = False  # see hold()
        # Called (on the completing thread) after a future completes: the journal drops its record.
        self.on_complete: Callable[[FutureRecord], None] | None = None

    def new(self, tenant: str, kind: str, *, request_id: str | None = None, **extra) -> FutureRecord:
        """A pending future; ``request_id`` is given when a journal replay recreates one."""
        rec = FutureRecord(
            request_id=request_id or f"req-{uuid.uuid4().hex}", tenant=tenant, kind=kind, extra=extra
        )
        if self.loop is not None:
            rec._event = asyncio.Event()
        with self._lock:
            self._records[rec.request_id] = rec
        return rec

    def complete(self, rec: FutureRecord, result: Any = None, error: ApiError | None = None) -> None:
        """Thread-safe; the first completion wins."""
        with self._lock:
            if rec.done:
                return
            rec.result, rec.error = result, error
            rec.completed_at = time.time()
            rec.done = True
            if self._records.get(rec.request_id) is rec:
                rec.size = result_bytes(result)
                self.held_bytes += rec.size
            self._done.notify_all()
        if self.on_complete is not None:
            self.on_complete(rec)
        if rec._event is not None and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(rec._event.set)

    def discard(self, rec: FutureRecord) -> None:
        """Forget a future that was never queued (its request was a retry, or was refused)."""
        with self._lock:
            if self._records.get(rec.request_id) is rec and not rec.done:
                del self._records[rec.request_id]

    def drop(self, rec: FutureRecord) -> None:
        """Forget a future whose caller took its result directly (an OpenAI request held open): no one
        polls for it, so it is neither kept for a retry nor written into a snapshot."""
        with self._lock:
            if self._records.get(rec.request_id) is rec:
                del self._records[rec.request_id]
                self.held_bytes -= rec.size

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._records

    def capture(self, recent_s: float = 120.0) -> list[dict]:
        """The completed results a client may still ask for, for a snapshot: those handed out and not
        fetched yet, and any completed in the last ``recent_s`` (a retry of a request whose reply was
        lost, a replayed intent's first op). Pending ones are replayed from their records."""
        now = time.time()
        with self._lock:
            done = [
                r
                for r in self._records.values()
                if r.done and ((r.handed_out and not r.fetched) or now - (r.completed_at or now) < recent_s)
            ]
        return [
            {
                "request_id": r.request_id,
                "tenant": r.tenant,
                "kind": r.kind,
                "created_at": r.created_at,
                "completed_at": r.completed_at,
                "result": r.result,
                "error": None if r.error is None else (r.error.to_json(), r.error.status_code),
                "extra": {k: v for k, v in r.extra.items()},
                "idem_key": r.idem_key,
                "slot": r.slot,
                "handed_out": r.handed_out,
                "fetched": r.fetched,
            }
            for r in done
        ]

    def restore(self, captured: list[dict]) -> dict[str, dict[int, FutureRecord]]:
        """Put snapshot results back; returns {lane: {seq_id: future}} for the engine's seq index."""
        slots: dict[str, dict[int, FutureRecord]] = {}
        with self._lock:
            for c in captured:
                error = None if c["error"] is None else RestoredError(*c["error"])
                rec = FutureRecord(
                    request_id=c["request_id"],
                    tenant=c["tenant"],
                    kind=c["kind"],
                    created_at=c["created_at"],
                    done=True,
                    result=c["result"],
                    error=error,
                    completed_at=c["completed_at"],
                    extra=c["extra"],
                    idem_key=c["idem_key"],
                    slot=tuple(c["slot"]) if c["slot"] else None,
                    handed_out=c["handed_out"],
                    fetched=c["fetched"],
                )
                rec.size = result_bytes(rec.result)
                self.held_bytes += rec.size - (old.size if (old := self._records.get(rec.request_id)) else 0)
                self._records[rec.request_id] = rec
                if rec.slot is not None:
                    slots.setdefault(rec.slot[0], {})[rec.slot[1]] = rec
        return slots

    def idempotency_index(self) -> list[FutureRecord]:
        with self._lock:
            return [r for r in self._records.values() if r.idem_key]

    def get(self, tenant: str, request_id: str) -> FutureRecord:
        with self._lock:
            rec = self._records.get(request_id)
            expired = self._expired.get(request_id) == tenant  # another tenant's: as unknown as any
        if rec is None or rec.tenant != tenant:
            if expired and rec is None:
                raise Gone(
                    f"request {request_id} finished too long ago; results are kept {self.ttl_s:.0f} s "
                    f"(OPENRL_FUTURE_TTL_S), and {self.max_bytes / 2**20:.0f} MiB of them at most "
                    "(OPENRL_MAX_RESULT_BYTES: the oldest go first)",
                    field="request_id",
                )
            raise NotFound(f"unknown request_id {request_id!r}", field="request_id")
        return rec

    def hold(self) -> None:
        """The service is shutting down with these futures journaled for its successor: wake every
        long-poll now (it answers try_again) and hold no new one, so none is cut off mid-wait."""
        with self._lock:
            self.held = True
            pending = [r for r in self._records.values() if not r.done and r._event is not None]
        if self.loop is not None and not self.loop.is_closed():
            for r in pending:
                self.loop.call_soon_threadsafe(r._event.set)

    async def wait(self, rec: FutureRecord, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for completion; True when done."""
        if rec.done or self.held:
            return rec.done
        if rec._event is None:
            return rec.done
        try:
            await asyncio.wait_for(rec._event.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass
        return rec.done

    def wait_sync(self, rec: FutureRecord, timeout_s: float | None = None) -> bool:
        """Block a plain thread (no event loop: scripts, benchmarks) until ``rec`` completes."""
        with self._done:
            return self._done.wait_for(lambda: rec.done, timeout_s)

    def sweep(self, now: float | None = None) -> list[FutureRecord]:
        """Forget completed results older than the TTL, then the oldest ones (fetched first) while
        the rest hold more than ``max_bytes`` (returned); remember their ids (and tenants) to answer
        their owner 410."""
        now = time.time() if now is None else now
        with self._lock:
            old = [
                r
                for r in self._records.values()
                if r.done and r.completed_at and now - r.completed_at > self.ttl_s
            ]
            gone = {id(r) for r in old}
            left = self.held_bytes - sum(r.size for r in old)
            if left > self.max_bytes:
                done = sorted(
                    (r for r in self._records.values() if r.done and id(r) not in gone),
                    key=lambda r: (not r.fetched, r.completed_at or 0.0),
                )
                for r in done:
                    if left <= self.max_bytes:
                        break
                    old.append(r)
                    left -= r.size
            for r in old:
                del self._records[r.request_id]
                self.held_bytes -= r.size
                self._expired[r.request_id] = r.tenant
            while len(self._expired) > self._expired_memory:
                self._expired.popitem(last=False)
        return old

    def unfetched(self, since: float, *, pending: bool = True) -> int:
        """Results handed out to a client and not fetched yet: those completed after ``since`` (wall
        clock; older ones' clients are taken to have gone) and, with ``pending``, unfinished ones."""
        with self._lock:
            return sum(
                1
                for r in self._records.values()
                if r.handed_out
                and not r.fetched
                and ((pending and not r.done) or (r.done and (r.completed_at or 0) >= since))
            )

    def pending_count(self) -> int:
        with self._lock:
            return sum(1 for r in self._records.values() if not r.done)


def result_bytes(value: Any, depth: int = 0) -> int:
    """A result's size in memory, estimated: arrays by their bytes, text by its length, containers by
    what they hold (a list of numbers at 8 bytes each, without walking it past its first items)."""
    if value is None or isinstance(value, (bool, int, float)):
        return 8
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if depth > 8:
        return 64
    if isinstance(value, dict):
        return 64 + sum(result_bytes(k, depth + 1) + result_bytes(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        if len(value) > 16 and all(isinstance(x, (int, float)) for x in value[:16]):
            return 56 + 8 * len(value)
        return 56 + sum(result_bytes(x, depth + 1) for x in value)
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):
        return 64 + result_bytes(fields, depth + 1)
    return 64
