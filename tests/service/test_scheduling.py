"""Fair scheduling and backpressure (issue 5 part 1).

- least-recently-served order across lanes, checked deterministically: the device worker is held by a
  blocking op while ops of several runs queue up, then the order of the service's op record is read;
- a forward/backward of several micro-batches runs one micro-batch per turn (other runs in between)
  with a result bit-identical to one uninterrupted call;
- sampling over a queue limit is refused with 429 + Retry-After and a JSON error naming the limit;
  training over the limit is queued and reported as ``try_again`` / ``paused_capacity``;
- an SDK run under backpressure loses and repeats no step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np
import pytest
import torch

from openrl_service.config import Limits
from openrl_service.engine.futures import FutureStore
from openrl_service.engine.ops import Op, QueueFull
from openrl_service.engine.scheduler import Engine
from openrl_service.telemetry import OpRecorder
from openrl_service.training.lora import LoraSpec
from openrl_service.training.trainer import DatumArrays
from tests._support.raw import RawTinker, result, sft_datum
from tests.conftest import ALICE_KEY, TINY


# -- helpers --------------------------------------------------------------------------------------
def wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@contextlib.contextmanager
def held_worker(engine: Engine, futures: FutureStore):
    """Hold the device worker in a blocking op until the block exits."""
    gate = threading.Event()
    op = Op(kind="hold", lane="control:hold", fn=gate.wait, future=futures.new("test", "hold"))
    engine.submit(op)
    wait_for(lambda: engine.current is op)
    try:
        yield
    finally:
        gate.set()


def make_engine(**limits) -> tuple[Engine, FutureStore, OpRecorder]:
    futures = FutureStore(ttl_s=60)
    recorder = OpRecorder()
    engine = Engine(futures=futures, seq_gap_timeout_s=60, recorder=recorder, **limits)
    engine.start()
    engine.ready.wait(10)
    return engine, futures, recorder


def op(futures: FutureStore, lane: str, fn, *, seq_id: int | None = None, **kw) -> Op:
    run = lane.split(":", 1)[1]
    return Op(kind="work", lane=lane, fn=fn, future=futures.new("t", "work"), run_id=run, seq_id=seq_id, **kw)


def asample(client, sampler_id: str, **headers):
    body = {
        "sampling_session_id": sampler_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12, 13]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 1.0},
    }
    return client.post("/api/v1/asample", json=body, headers=headers)


def sampler(raw: RawTinker, sid: str, seq: int) -> str:
    r = raw.post("create_sampling_session", session_id=sid, sampling_session_seq_id=seq, base_model=TINY)
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


# -- least recently served ------------------------------------------------------------------------
def test_runs_are_served_least_recently_served_first(make_server):
    """Three runs queue 3 steps each, in the order C, B, A, while the worker is held: they run A B C A B C
    A B C (A was served longest ago), not in arrival order."""
    live = make_server()
    svc = live.service
    raw = RawTinker(live.client())
    sid = raw.session()
    a, b, c = (raw.create_model(sid, i) for i in range(3))  # served in this order
    datum = [sft_datum([11, 12, 13], [21, 22])]
    with held_worker(svc.engine, svc.futures):
        t0 = time.time()
        ids = [raw.submit_fb(run, seq, datum) for run in (c, b, a) for seq in (1, 2, 3)]
        assert svc.engine.queue_depth() == 9
    for rid in ids:
        assert "error" not in raw.result(rid)
    ops = sorted((r for r in svc.recorder.since(t0) if r.kind == "forward_backward"), key=lambda r: r.start)
    assert [r.run for r in ops] == [a, b, c] * 3


def test_a_new_lane_joins_at_the_back():
    """x and y wait with backlogs; a lane w that appears while x runs is served after the lanes that were
    already waiting (y, then x), not before them, and every backlog gets one turn per round."""
    engine, futures, _ = make_engine()
    order: list[str] = []

    def x_first():
        order.append("x")
        engine.submit(op(futures, "sampler:w", lambda: order.append("w")))

    try:
        with held_worker(engine, futures):
            engine.submit(op(futures, "sampler:x", x_first))
            for lane, n in (("x", 2), ("y", 2)):
                for _ in range(n):
                    engine.submit(op(futures, f"sampler:{lane}", lambda lane=lane: order.append(lane)))
        wait_for(lambda: len(order) == 6)
        assert order == ["x", "y", "x", "w", "y", "x"]
    finally:
        engine.stop()


# -- chunked ops ----------------------------------------------------------------------------------
def test_a_chunked_op_yields_to_other_lanes_and_keeps_its_lane_in_order():
    engine, futures, recorder = make_engine()
    order: list[str] = []
    cleaned = []

    def chunked():
        try:
            for k in range(3):
                order.append(f"big{k}")
                if k < 2:
                    yield 10
        finally:
            cleaned.append(True)
        return "big done"

    try:
        engine.open_ordered_lane("a", next_seq=1)
        with held_worker(engine, futures):
            t0 = time.time()
            big = op(futures, "run:a", chunked, seq_id=1, tokens=lambda r: 35)
            after = op(futures, "run:a", lambda: order.append("a2"), seq_id=2)
            other = op(futures, "sampler:b", lambda: order.append("b"))
            for o in (big, after, other):
                engine.submit(o)
        assert futures.wait_sync(after.future, 10) and futures.wait_sync(other.future, 10)
        assert order == ["big0", "b", "big1", "big2", "a2"]
        assert big.future.result == "big done" and cleaned == [True]
        records = [r for r in recorder.since(t0) if r.kind == "work"]
        # big0 | b | big1+big2 (contiguous slices are one record) | a2; tokens add up to the op's total
        assert [r.run for r in records] == ["a", "b", "a", "a"]
        assert records[0].tokens + records[2].tokens == 35
    finally:
        engine.stop()


def test_closing_a_lane_between_slices_runs_the_ops_cleanup():
    engine, futures, _ = make_engine()
    cleaned = []
    started = threading.Event()

    def chunked():
        try:
            started.set()
            yield 1
            yield 1
        finally:
            cleaned.append(True)

    try:
        engine.open_ordered_lane("a", next_seq=1)
        with held_worker(engine, futures):
            big = op(futures, "run:a", chunked, seq_id=1)
            engine.submit(big)
            # a second held op queued behind the first slice keeps the chunked op between slices
            gate = threading.Event()
            engine.submit(op(futures, "sampler:g", gate.wait))
        started.wait(10)
        wait_for(lambda: engine.current is not None and engine.current.lane == "sampler:g")
        engine.close_lane("run:a")
        gate.set()
        assert futures.wait_sync(big.future, 10)
        assert "closed" in big.future.error.message and cleaned == [True]
    finally:
        engine.stop()


def test_chunked_forward_backward_is_bit_identical_and_interleaves(make_server):
    """microbatch_tokens=64: a 4-datum call is several micro-batches. Run as a chunked op, its logprobs,
    loss and gradient equal one uninterrupted trainer call exactly; through the service, other runs'
    ops run between its chunks."""
    live = make_server(microbatch_tokens=64)
    svc = live.service
    data = [
        DatumArrays(
            tokens=np.arange(10, 10 + n, dtype=np.int64),
            inputs={
                "target_tokens": np.arange(11, 11 + n, dtype=np.int64),
                "weights": np.linspace(0.1, 1.0, n, dtype=np.float32),
            },
        )
        for n in (40, 25, 30, 12)
    ]
    assert len(svc.trainer._microbatches([len(d.tokens) for d in data])) > 1
    spec = LoraSpec(rank=4)
    whole_state, split_state = svc.trainer.new_state(spec, 5), svc.trainer.new_state(spec, 5)
    for st in (whole_state, split_state):  # an earlier call's gradient is already there
        svc.trainer.forward_backward(st, data[:1], "cross_entropy", {}, forward_only=False)
    whole = svc.trainer.forward_backward(whole_state, data, "cross_entropy", {}, forward_only=False)
    gen = svc._forward_backward(split_state, data, "cross_entropy", {}, False)
    slices = 0
    try:
        while True:
            next(gen)
            slices += 1
    except StopIteration as stop:
        split = stop.value
    assert slices >= 1
    assert split.loss == whole.loss and split.tokens == whole.tokens
    for x, y in zip(split.logprobs, whole.logprobs, strict=True):
        assert np.array_equal(x, y)
    for p, q in zip(split_state.adapter.parameters(), whole_state.adapter.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert split_state.pending_backward == whole_state.pending_backward == 2

    # Through the service: run A's big call yields to B between its chunks.
    raw = RawTinker(live.client())
    sid = raw.session()
    a, b = raw.create_model(sid, 0), raw.create_model(sid, 1)
    big = [sft_datum(list(range(10, 10 + n)), [97, 98]) for n in (40, 25, 30, 12)]
    with held_worker(svc.engine, svc.futures):
        t0 = time.time()
        ra = raw.submit_fb(a, 1, big)
        rb = raw.submit_fb(b, 1, [sft_datum([11, 12, 13], [21, 22])])
    assert "error" not in raw.result(ra) and "error" not in raw.result(rb)
    runs = [r.run for r in sorted(svc.recorder.since(t0), key=lambda r: r.start) if r.run in (a, b)]
    assert runs[:3] == [a, b, a]


# -- backpressure: wire shapes --------------------------------------------------------------------
def test_sampling_over_a_queue_limit_is_429_with_retry_after_and_names_the_limit(make_server):
    live = make_server(limits=Limits(max_queued_per_run=1, max_queued_total=2))
    svc = live.service
    http = live.client()
    raw = RawTinker(http)
    sid = raw.session()
    s1, s2 = sampler(raw, sid, 0), sampler(raw, sid, 1)
    with held_worker(svc.engine, svc.futures):
        first = asample(http, s1, **{"X-Idempotency-Key": "k1"})
        assert first.status_code == 200, first.text
        refused = asample(http, s1)
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1" and refused.headers["retry-after-ms"] == "1000"
        body = refused.json()
        assert body["limit"] == "OPENRL_MAX_QUEUED_PER_RUN" and body["field"] == "sampling_session_id"
        assert "OPENRL_MAX_QUEUED_PER_RUN=1" in body["error"] and s1 in body["error"]
        # An accepted request's retry is never refused: it gets the original future.
        again = asample(http, s1, **{"X-Idempotency-Key": "k1"})
        assert again.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]
        assert asample(http, s2).status_code == 200  # queue: 2 of 2
        s3 = sampler(raw, sid, 2)
        full = asample(http, s3)
        assert full.status_code == 429 and full.json()["limit"] == "OPENRL_MAX_QUEUED_TOTAL"
        assert "OPENRL_MAX_QUEUED_TOTAL=2" in full.json()["error"] and "Retry-After" in full.headers
    assert "error" not in result(http, first.json()["request_id"])
    wait_for(lambda: svc.engine.queue_depth() == 0)
    ok = asample(http, s3)  # the service is up and takes work again
    assert ok.status_code == 200 and "error" not in result(http, ok.json()["request_id"])
    assert http.get("/healthz").status_code == 200


def test_training_over_the_limit_is_queued_and_reported_paused_capacity(make_server):
    live = make_server(limits=Limits(max_queued_per_run=1), long_poll_s=0.2)
    svc = live.service
    http = live.client()
    raw = RawTinker(http)
    m = raw.create_model(raw.session())
    datum = [sft_datum([11, 12, 13], [21, 22])]
    with held_worker(svc.engine, svc.futures):
        t0 = time.time()
        ids = [raw.submit_fb(m, seq, datum) for seq in (1, 2, 3)]  # never refused
        head = raw.post("retrieve_future", request_id=ids[0]).json()
        assert head == {"type": "try_again", "request_id": ids[0], "queue_state": "active"}
        tail = raw.post("retrieve_future", request_id=ids[2]).json()
        assert tail["type"] == "try_again" and tail["queue_state"] == "paused_capacity"
        assert (
            "OPENRL_MAX_QUEUED_PER_RUN" in tail["queue_state_reason"]
            and "2 earlier" in tail["queue_state_reason"]
        )
    outs = [raw.result(i) for i in ids]
    assert all("error" not in o for o in outs)
    ran = [r for r in svc.recorder.since(t0) if r.run == m and r.kind == "forward_backward"]
    assert len(ran) == 3  # each accepted step ran exactly once


def test_queue_limits_are_settings_with_env_vars():
    from openrl_service.config import from_env

    s = from_env(
        {
            "OPENRL_MAX_QUEUED_PER_RUN": "7",
            "OPENRL_MAX_QUEUED_TOTAL": "70",
            "OPENRL_BACKPRESSURE_RETRY_AFTER_S": "2.5",
        }
    )
    assert (s.limits.max_queued_per_run, s.limits.max_queued_total) == (7, 70)
    assert s.backpressure_retry_after_s == 2.5
    engine, futures, _ = make_engine(max_queued_per_lane=0)
    try:
        with pytest.raises(QueueFull) as e:
            engine.submit(op(futures, "sampler:s", lambda: None, refuse_when_full=True))
        assert e.value.status_code == 429 and e.value.limit == "OPENRL_MAX_QUEUED_PER_RUN"
    finally:
        engine.stop()


# -- backpressure: the real SDK -------------------------------------------------------------------
def test_an_sdk_run_under_backpressure_loses_and_repeats_no_step(make_server, caplog):
    """Tiny queue limits, many concurrent submits from the Tinker SDK: every training step runs exactly
    once, in order (the optimizer's step count equals the steps accepted), every sample comes back after
    429 back-offs, and nothing fails on the server."""
    import tinker
    from tinker import types

    live = make_server(limits=Limits(max_queued_per_run=2, max_queued_total=4), long_poll_s=0.3)
    svc = live.service
    states: list[str] = []
    refusals: list[str] = []
    real_state, real_check = svc.engine.queue_state, svc.engine._check_room

    def spy_state(rec):
        out = real_state(rec)
        states.append(out[0])
        return out

    def spy_check(o, lane):
        try:
            real_check(o, lane)
        except QueueFull as e:
            refusals.append(e.limit)
            raise

    svc.engine.queue_state, svc.engine._check_room = spy_state, spy_check
    caplog.set_level(logging.WARNING)
    steps = 8
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
        sampling = sc.create_sampling_client(base_model=TINY).result()
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(list(range(10, 10 + n))),
                loss_fn_inputs={"target_tokens": list(range(11, 11 + n)), "weights": [1.0] * n},
            )
            for n in (12, 9, 15)
        ]
        with held_worker(svc.engine, svc.futures):  # let a backlog build up
            train = [
                (
                    tc.forward_backward(data, "cross_entropy"),
                    tc.optim_step(types.AdamParams(learning_rate=1e-3)),
                )
                for _ in range(steps)
            ]
            samples = [
                sampling.sample(
                    prompt=types.ModelInput.from_ints([11, 12, 13]),
                    num_samples=1,
                    sampling_params=types.SamplingParams(max_tokens=2),
                )
                for _ in range(10)
            ]
            # samples meet the full queue; training futures are polled while paused
            wait_for(lambda: "paused_capacity" in states and refusals, 120)
        optim = [o.result(timeout=180) for _, o in train]
        fb = [f.result(timeout=180) for f, _ in train]
        outs = [s.result(timeout=180) for s in samples]
        model_id = tc.model_id
    finally:
        sc.close("success").result()
    assert [r.metrics["step:max"] for r in optim] == [float(k) for k in range(1, steps + 1)]
    assert all(np.isfinite(r.metrics["loss:sum"]) for r in fb)
    assert all(len(o.sequences) == 1 for o in outs)
    assert "paused_capacity" in states and refusals  # backpressure really happened, both kinds
    run_ops = [r for r in svc.recorder.since(0) if r.run == model_id]
    assert sum(r.kind == "optim_step" for r in run_ops) == steps
    assert sum(r.kind == "forward_backward" for r in run_ops) == steps
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert live.client().get("/healthz").status_code == 200
