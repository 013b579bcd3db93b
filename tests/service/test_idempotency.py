"""X-Idempotency-Key on the notebook API's POSTs: a duplicate waits for the first and gets its reply;
remembered replies expire (TTL) and are bounded (count)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.responses import Response
from starlette.requests import Request

from openrl_service.api.idempotency import idempotent
from openrl_service.engine import replies as idempotency
from openrl_service.engine.replies import IdempotentReplies
from openrl_service.errors import UserError
from tests.conftest import ALICE_KEY
from tests.service.test_scheduling import held_worker, wait_for

V1 = "/openrl/v1"


def request(key: str, body: bytes = b"{}", path: str = "/openrl/v1/runs/r/train_step") -> Request:
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"x-idempotency-key", key.encode()), (b"content-type", b"application/json")],
        "query_string": b"",
    }
    return Request(scope, receive)


def counting():
    calls = []

    async def make(identity):
        calls.append(1)
        return Response(f"reply {len(calls)}".encode(), status_code=200)

    return calls, make


def test_replies_expire_after_the_ttl_and_the_count_is_bounded(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(idempotency.time, "monotonic", lambda: clock[0])
    replies = IdempotentReplies(ttl_s=60, max_entries=2)
    calls, make = counting()

    async def send(key):
        return (await idempotent(replies, request(key), "alice", make)).body

    async def scenario():
        assert await send("a") == b"reply 1"
        assert await send("a") == b"reply 1"  # remembered
        clock[0] += 61
        assert await send("a") == b"reply 2"  # expired: done again
        await send("b")
        await send("c")  # over the bound: the oldest ("a") is forgotten
        assert await send("a") == b"reply 5"
        assert await send("c") == b"reply 4"

    asyncio.run(scenario())
    assert len(calls) == 5


def test_a_key_reused_for_another_body_is_refused():
    replies = IdempotentReplies(ttl_s=60)
    _, make = counting()

    async def scenario():
        await idempotent(replies, request("k", b'{"a": 1}'), "alice", make)
        with pytest.raises(UserError, match="X-Idempotency-Key 'k' was already used for a different request"):
            await idempotent(replies, request("k", b'{"a": 2}'), "alice", make)
        # another tenant's key is another key
        assert (await idempotent(replies, request("k", b'{"a": 2}'), "bob", make)).status_code == 200

    asyncio.run(scenario())


def test_a_duplicate_in_flight_waits_for_the_first_and_queues_nothing(make_server, monkeypatch):
    made: list[IdempotentReplies] = []
    real_init = IdempotentReplies.__init__

    def spy(self, **kw):
        real_init(self, **kw)
        made.append(self)

    monkeypatch.setattr(IdempotentReplies, "__init__", spy)
    live = make_server()
    (replies_memory,) = made
    svc = live.service
    with live.client(ALICE_KEY) as c:
        run = c.post(f"{V1}/runs", json={"name": "dup"}).json()["run_id"]
        sample = c.post(f"{V1}/runs/{run}/sample", json={"prompts": ["a"], "num_samples": 2, "max_tokens": 3})
        items = [
            {"sample_id": s["sample_id"], "advantage": float(i)}
            for i, s in enumerate(sample.json()["samples"])
        ]
        key = {"X-Idempotency-Key": "in-flight"}
        replies = []
        send = lambda: replies.append(  # noqa: E731
            c.post(f"{V1}/runs/{run}/train_step", json={"samples": items}, headers=key)
        )
        with held_worker(svc.engine, svc.futures):
            depth = svc.engine.queue_depth()
            first = threading.Thread(target=send)
            first.start()
            wait_for(lambda: svc.engine.queue_depth() == depth + 1)  # the first is queued
            second = threading.Thread(target=send)
            second.start()
            wait_for(lambda: replies_memory.waiting == 1)  # the duplicate waits for the first...
            assert svc.engine.queue_depth() == depth + 1 and not replies  # ...having queued nothing
        first.join(60)
        second.join(60)
        assert [r.status_code for r in replies] == [200, 200] and replies[0].content == replies[1].content
        assert c.get(f"{V1}/runs/{run}").json()["step"] == 1
