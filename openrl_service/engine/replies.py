"""Idempotent POSTs: a request re-sent with its ``X-Idempotency-Key`` gets the first one's reply.

The store of replies (this module) knows no HTTP: api/idempotency.py hands it a request's tenant,
method, path, key and body and a way to make a response; the notebook API's intents
(engine/native.py) journal and restore it.

A client whose reply was lost (a dropped connection, a timeout) re-sends the same request with the
same key; the service answers with the ORIGINAL status and body instead of doing the work again
(a re-sent ``train_step`` must not apply a second optimizer step). A duplicate that arrives while
the first is still running waits for it. Keys are per (tenant, method, path): the same key on
another route is another request.

Which outcomes are remembered: every reply below 500 except 429, and every :class:`UserError`
(the same bad request fails the same way). A 429, a 503 or a server failure is forgotten, so the
re-sent request is tried again. The work runs in its own task: a client that disconnects does not
cancel it, and its retry finds the result. Entries expire after ``ttl_s`` (OPENRL_FUTURE_TTL_S)
and at most ``max_entries`` replies holding at most ``max_bytes`` of bodies in all are kept: over
either, the tenant holding the most gives up its oldest finished reply first, so one tenant's flood of
keyed requests never makes another tenant's retry run twice (a retry of a forgotten key runs again,
as after the TTL).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from openrl_service.errors import RestoredError, UserError

HEADER = "X-Idempotency-Key"
MAX_KEY_CHARS = 128


@dataclass
class _Entry:
    digest: bytes  # of the request body: a key reused for another body is refused
    done: asyncio.Event = field(default_factory=asyncio.Event)
    created_at: float = field(default_factory=lambda: time.monotonic())
    reply: tuple[int, bytes, str | None] | None = None  # status, body, media type
    error: UserError | None = None


class IdempotentReplies:
    def __init__(self, *, ttl_s: float, max_entries: int = 10_000, max_bytes: int = 256 << 20):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str, str, str], _Entry] = OrderedDict()
        self.stored_bytes = 0  # of the remembered reply bodies
        self.waiting = 0  # duplicates now waiting for their first request to finish

    async def reply(
        self,
        tenant: str,
        method: str,
        path: str,
        key: str | None,
        body: bytes,
        make: Callable[[tuple | None], Awaitable[Any]],
        respond: Callable[[bytes, int, str | None], Any],
    ) -> Any:
        """``make(identity)``'s response, or the remembered one (``respond(body, status, media
        type)``) when this request's key was seen before. ``identity`` (tenant, method, path, key,
        body digest; None without a key) is what a journal keeps to remember the reply again after a
        crash (:meth:`begin`, :meth:`settle`). A response has ``status_code``, ``body`` and
        ``media_type``."""
        if key is None:
            return await make(None)
        if not 0 < len(key) <= MAX_KEY_CHARS:
            raise UserError(f"{HEADER} must be 1 to {MAX_KEY_CHARS} characters; got {len(key)}", field=HEADER)
        digest = hashlib.sha256(body).digest()
        k = (tenant, method, path, key)
        while (entry := self._lookup(k)) is not None:
            if entry.digest != digest:
                raise UserError(
                    f"{HEADER} {key!r} was already used for a different request to {path}",
                    field=HEADER,
                )
            self.waiting += 1
            try:
                await entry.done.wait()
            finally:
                self.waiting -= 1
            if entry.reply is not None or entry.error is not None:
                return self._replay(entry, respond)
            # The first attempt failed in a way worth retrying (429, 503, a server error): try again.
        entry = self._entries[k] = _Entry(digest)
        identity = (*k, digest)
        outcome = await asyncio.shield(asyncio.ensure_future(self._run(k, entry, lambda: make(identity))))
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _run(self, k, entry: _Entry, make) -> Any:
        """The work, in its own task; never raises (a client that went away must not leave an
        unretrieved exception behind)."""
        try:
            resp = await make()
        except UserError as e:
            entry.error = e
            outcome: Any = e
        except Exception as e:  # noqa: BLE001 - handed to the request that started it
            self._entries.pop(k, None)
            outcome = e
        else:
            if resp.status_code < 500 and resp.status_code != 429:
                entry.reply = (resp.status_code, bytes(resp.body), resp.media_type)
                if self._entries.get(k) is entry:
                    self.stored_bytes += len(entry.reply[1])
            else:
                self._entries.pop(k, None)
            outcome = resp
        entry.done.set()
        self._bound()
        return outcome

    def begin(self, identity: tuple) -> _Entry:
        """A reply being made again from the journal (recovery): a re-sent request waits for it."""
        k, digest = tuple(identity[:4]), identity[4]
        entry = self._entries[k] = _Entry(digest)
        return entry

    def settle(
        self,
        identity: tuple,
        entry: _Entry,
        *,
        reply: tuple[int, bytes] | None = None,
        error: UserError | None = None,
    ) -> None:
        """The outcome of :meth:`begin`'s request: its reply, its UserError, or neither (forgotten:
        a re-sent request runs again)."""
        k = tuple(identity[:4])
        if reply is not None:
            entry.reply = (reply[0], reply[1], "application/json")
            self.stored_bytes += len(reply[1])
        elif isinstance(error, UserError):
            entry.error = error
        elif self._entries.get(k) is entry:
            del self._entries[k]
        entry.done.set()
        self._bound()

    def capture(self) -> list[tuple]:
        """The finished replies, for a snapshot: (key, digest, age in s, reply, error JSON and status)."""
        now = time.monotonic()
        return [
            (
                k,
                e.digest,
                now - e.created_at,
                e.reply,
                None if e.error is None else (e.error.to_json(), e.error.status_code),
            )
            for k, e in self._entries.items()
            if e.done.is_set() and (e.reply is not None or e.error is not None)
        ]

    def restore(self, captured: list[tuple]) -> None:
        now = time.monotonic()
        for k, digest, age, reply, error in captured:
            entry = _Entry(digest, created_at=now - age, reply=reply)
            if error is not None:
                entry.error = RestoredError(*error)
            entry.done.set()
            self._entries[tuple(k)] = entry
            if reply is not None:
                self.stored_bytes += len(reply[1])

    @staticmethod
    def _replay(entry: _Entry, respond: Callable[[bytes, int, str | None], Any]) -> Any:
        if entry.error is not None:
            raise entry.error
        status, body, media_type = entry.reply  # type: ignore[misc]
        return respond(body, status, media_type)

    def _lookup(self, k) -> _Entry | None:
        now = time.monotonic()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if not oldest.done.is_set() or now - oldest.created_at <= self.ttl_s:
                break
            self._drop(next(iter(self._entries)))
        entry = self._entries.get(k)
        if entry is not None and entry.done.is_set() and now - entry.created_at > self.ttl_s:
            self._drop(k)
            return None
        return entry

    def _drop(self, k) -> None:
        entry = self._entries.pop(k)
        if entry.reply is not None:
            self.stored_bytes -= len(entry.reply[1])

    def _bound(self) -> None:
        """Until within max_entries and max_bytes: the oldest finished reply of the tenant holding the
        most (replies when there are too many, bytes when they are too big) goes first; running ones
        stay."""
        if len(self._entries) <= self.max_entries and self.stored_bytes <= self.max_bytes:
            return
        held: dict[str, list] = {}  # tenant -> [bytes, its finished keys oldest first]
        for k, entry in self._entries.items():
            mine = held.setdefault(k[0], [0, []])
            if entry.reply is not None:
                mine[0] += len(entry.reply[1])
            if entry.done.is_set():
                mine[1].append(k)
        while len(self._entries) > self.max_entries or self.stored_bytes > self.max_bytes:
            candidates = [(t, v) for t, v in held.items() if v[1]]
            if not candidates:
                break
            if len(self._entries) > self.max_entries:
                tenant, mine = max(candidates, key=lambda tv: (len(tv[1][1]), tv[1][0]))
            else:
                tenant, mine = max(candidates, key=lambda tv: (tv[1][0], len(tv[1][1])))
            k = mine[1].pop(0)
            entry = self._entries[k]
            mine[0] -= len(entry.reply[1]) if entry.reply is not None else 0
            self._drop(k)
