"""What a long run or a busy service accumulates stays bounded: metric rows, a session's snapshot ids,
remembered idempotent replies."""

import asyncio
import time

import pytest
from starlette.requests import Request
from starlette.responses import Response

from openrl_service.api.idempotency import idempotent
from openrl_service.config import Limits
from openrl_service.engine.replies import HEADER, IdempotentReplies
from tests._support.raw import RawTinker
from tests.conftest import ALICE_KEY

V1 = "/openrl/v1"


def test_a_run_keeps_its_newest_metric_rows_and_says_how_many_it_dropped(make_server):
    """OPENRL_MAX_METRIC_ROWS: a long run never fails for its statistics; the oldest rows go first."""
    live = make_server(limits=Limits(max_metric_rows=3))
    with live.client(ALICE_KEY) as c:
        rid = c.post(f"{V1}/runs", json={"name": "long", "seed": 0}).json()["run_id"]
        for step in range(5):
            r = c.post(f"{V1}/runs/{rid}/metrics", json={"step": step, "reward_mean": step / 10})
            assert r.status_code == 201, r.text
        rows = c.get(f"{V1}/runs/{rid}/metrics").json()["metrics"]
        assert [row["step"] for row in rows] == [2, 3, 4]
        info = c.get(f"{V1}/runs/{rid}").json()
        assert info["metrics_count"] == 3 and info["metrics_dropped"] == 2

        wide = {"step": 5, **{f"m{i}": 1.0 for i in range(65)}}
        r = c.post(f"{V1}/runs/{rid}/metrics", json=wide)
        assert r.status_code == 400 and "at most 64 values per row" in r.json()["error"]
        r = c.post(f"{V1}/runs/{rid}/metrics", json={"step": 5, "x" * 129: 1.0})
        assert r.status_code == 400 and "128 characters" in r.json()["error"]
        c.delete(f"{V1}/runs/{rid}")


def test_stored_samples_expire_on_housekeeping_without_new_traffic(make_server):
    """The sample store (SAMPLE_TTL_S) is swept by the housekeeping round, not only by the next
    sample: an idle service frees what a finished notebook left behind."""
    from openrl_service.engine.native import SAMPLE_TTL_S, NativeRuns

    live = make_server()
    svc = live.service
    native = next(f.__self__ for f in svc.sweepers if isinstance(getattr(f, "__self__", None), NativeRuns))
    with live.client(ALICE_KEY) as c:
        rid = c.post(f"{V1}/runs", json={"name": "s", "seed": 0}).json()["run_id"]
        r = c.post(f"{V1}/runs/{rid}/sample", json={"prompts": ["a", "b"], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(native.samples) == 2
        svc.reap_idle_sessions(now=time.time() + SAMPLE_TTL_S / 2)
        assert len(native.samples) == 2  # not yet
        c.post(f"{V1}/runs/{rid}/heartbeat")
        svc.reap_idle_sessions(now=time.time() + SAMPLE_TTL_S + 1)
        assert len(native.samples) == 0
        step = c.post(f"{V1}/runs/{rid}/train_step", json={"samples": [{"sample_id": "x", "advantage": 1.0}]})
        assert step.status_code == 404 and "kept 1800 s" in step.json()["error"]
        c.delete(f"{V1}/runs/{rid}")


def test_a_session_forgets_the_ids_of_evicted_snapshots(make_server):
    """An RL loop saves a sampler every step: the session keeps only the ids that still exist, so its
    record (written to disk on every run change) does not grow with the number of steps."""
    live = make_server(max_sampler_snapshots=2)
    raw = RawTinker(live.client())
    sid = raw.session()
    m = raw.create_model(sid)
    ids = []
    for seq in range(1, 7):
        r = raw.post(
            "save_weights_for_sampler", model_id=m, seq_id=seq, sampling_session_seq_id=seq, kind="snapshot"
        )
        ids.append(raw.result(r.json()["request_id"])["sampling_session_id"])
    sess = live.service.sessions[sid]
    assert sess.sampler_ids == ids[-2:]
    assert set(live.service.samplers) & set(ids) == set(ids[-2:])
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [11, 12]}]}
    gone = raw.post("asample", sampling_session_id=ids[0], num_samples=1, prompt=prompt)
    assert gone.status_code == 404 and "evicted" in gone.json()["error"]  # still explained
    raw.finish_sessions()


def _request(key: str, body: bytes = b"{}") -> Request:
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/openrl/v1/runs/r/sample",
        "headers": [(HEADER.lower().encode(), key.encode())],
        "query_string": b"",
    }
    return Request(scope, receive)


@pytest.mark.parametrize("limit", ["entries", "bytes"])
def test_remembered_replies_are_bounded_in_count_and_bytes(limit):
    """Replies kept for retries never exceed max_entries nor max_bytes; the oldest go first and a
    retry of a forgotten key runs again (as after the TTL)."""
    kw = {"max_entries": 3} if limit == "entries" else {"max_bytes": 3 * 1000}
    store = IdempotentReplies(ttl_s=3600, **kw)
    calls = []

    async def make(i):
        calls.append(i)
        return Response(b"x" * 1000, media_type="application/json")

    async def main():
        for i in range(10):
            await idempotent(store, _request(f"k{i}"), "alice", lambda _, i=i: make(i))
        assert len(store._entries) <= 3 and store.stored_bytes <= 3000
        await idempotent(store, _request("k9"), "alice", lambda _: make(99))  # remembered
        await idempotent(store, _request("k0"), "alice", lambda _: make(100))  # forgotten: runs again

    asyncio.run(main())
    assert calls == [*range(10), 100]
