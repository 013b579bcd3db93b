"""Cross-run fusion in the scheduler (issue 5 part 2), through the real HTTP service.

The device worker is held by a blocking op while several runs queue work; on release, the worker
runs the ready ops of the three runs as ONE fused pass (fusion on, the default) or one by one
(``fusion=False``, OPENRL_FUSION=off). Checked:

- the op record shows one fused op covering the three runs (same ``fused_id``, ``fused_runs``),
  back to back within the call, and /metrics counts it;
- fused results equal unfused execution at identical inputs, within the tolerance measured for the
  fused path (see LOSS_RTOL...), and every optim_step applies the AdamW update computed in float64
  from the gradient that was compared (never an element-wise comparison of weights after Adam);
- with fusion off, every run is bit-identical to the same run alone; with fusion on, a run alone is
  bit-identical too (a single op never takes the fused path's different kernels);
- the native API's sample and train_step fuse across runs, with the same seeded tokens as unfused;
- a failed fused call runs each member alone (nobody fails because of another), and a call bigger than
  one micro-batch is never fused (it runs sliced, as before).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from openrl_jupyter.client import Client
from openrl_service.training.optim_params import AdamParams
from tests._support.numerics import (
    GRADS_ATOL_OF_MAX,
    LOGPROBS_ATOL,
    LOSS_RTOL,
    adamw_in_float64,
    assert_weights_match,
)
from tests._support.raw import RawTinker, sft_datum
from tests.conftest import ALICE_KEY
from tests.service.test_scheduling import held_worker, wait_for

PROMPTS = {0: [11, 12, 13, 14], 1: [21, 22], 2: [31, 32, 33, 34, 35, 36]}


def run_datums(k: int) -> list:
    """Different lengths per run, so the fused pass pads rows of different runs together."""
    p = PROMPTS[k]
    return [sft_datum(p, [40 + k, 50 + k, 60 + k][: 1 + (k + j) % 3]) for j in range(2 + k)]


def grads(svc, run_id: str) -> list[torch.Tensor]:
    state = svc.runs[run_id].state
    return [p.grad.clone() for p in state.adapter.parameters()]


def weights(svc, run_id: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in svc.runs[run_id].state.adapter.parameters()]


def fb_records(svc, since: float, n: int) -> list:
    """The ``n`` forward_backward records since ``since``, once the worker has written them all
    (it completes futures before it records them)."""
    ready = lambda recs: len([r for r in recs if r.kind == "forward_backward"]) >= n  # noqa: E731
    return [r for r in svc.recorder.wait_for(ready, since=since) if r.kind == "forward_backward"]


LR = 1e-2


def optim_checked(live, raw: RawTinker, run_id: str, seq_id: int) -> None:
    """One optim_step, checked against the AdamW update computed in float64 from the gradient the
    test compared (see tests/_support/numerics.py: weights after Adam are not compared element-wise)."""
    state = live.service.runs[run_id].state
    expected = adamw_in_float64(state, AdamParams(learning_rate=LR))
    assert "error" not in raw.result(raw.submit_optim(run_id, seq_id, lr=LR))
    assert_weights_match(state.adapter.parameters(), expected, LR)


def train_three(live, runs_seen: list[int] = (0, 1, 2), *, reference=None) -> dict:
    """Runs k in ``runs_seen`` (seed k+1): fb, optim, fb, optim, each fb round queued while the worker
    is held so the runs' calls can fuse. Each optim_step is checked against float64 AdamW. Returns
    the fb results and gradients of both rounds, plus the fb op records.

    ``reference``: a second service (e.g. fusion off) driven in lockstep; before the second round its
    runs take this service's weights, so both rounds compare the two services at identical inputs."""
    svcs = [live] if reference is None else [live, reference]
    raws = [RawTinker(s.client()) for s in svcs]
    sids = [raw.session() for raw in raws]
    ids = [
        {k: raw.create_model(sid, k, seed=k + 1) for k in runs_seen}
        for raw, sid in zip(raws, sids, strict=True)
    ]
    outs = [{"ids": i, "fb": {1: {}, 3: {}}, "grads": {1: {}, 3: {}}} for i in ids]
    t0 = time.time()
    for seq in (1, 3):
        for s, raw, out in zip(svcs, raws, outs, strict=True):
            with held_worker(s.service.engine, s.service.futures):
                reqs = {k: raw.submit_fb(out["ids"][k], seq, run_datums(k)) for k in runs_seen}
            for k in runs_seen:
                out["fb"][seq][k] = raw.result(reqs[k])
                assert "error" not in out["fb"][seq][k], out["fb"][seq][k]
                out["grads"][seq][k] = grads(s.service, out["ids"][k])
            for k in runs_seen:
                optim_checked(s, raw, out["ids"][k], seq + 1)
        if reference is not None and seq == 1:
            with torch.no_grad():
                for k in runs_seen:
                    for dst, src in zip(
                        reference.service.runs[outs[1]["ids"][k]].state.adapter.parameters(),
                        weights(live.service, outs[0]["ids"][k]),
                        strict=True,
                    ):
                        dst.copy_(src)
    for s, out in zip(svcs, outs, strict=True):
        out["records"] = fb_records(s.service, t0, 2 * len(runs_seen))
        out["weights"] = {k: weights(s.service, out["ids"][k]) for k in runs_seen}
    return outs[0] if reference is None else outs


def fb_loss_and_logprobs(result: dict) -> tuple[float, list[np.ndarray]]:
    lps = [np.asarray(o["logprobs"]["data"], dtype=np.float32) for o in result["loss_fn_outputs"]]
    return result["metrics"]["loss:sum"], lps


def measure(a: dict, b: dict) -> dict:
    """Largest differences between two services' fb rounds: loss (relative), logprobs (absolute),
    gradients (absolute, relative to the largest gradient element)."""
    worst = {"loss": 0.0, "logprobs": 0.0, "grads": 0.0}
    for seq in (1, 3):
        for k in a["fb"][seq]:
            la, lpa = fb_loss_and_logprobs(a["fb"][seq][k])
            lb, lpb = fb_loss_and_logprobs(b["fb"][seq][k])
            worst["loss"] = max(worst["loss"], abs(la - lb) / abs(lb))
            for x, y in zip(lpa, lpb, strict=True):
                worst["logprobs"] = max(worst["logprobs"], float(np.abs(x - y).max()))
            for ga, gb in zip(a["grads"][seq][k], b["grads"][seq][k], strict=True):
                scale = max(float(gb.abs().max()), 1e-30)
                worst["grads"] = max(worst["grads"], float((ga - gb).abs().max()) / scale)
    return worst


def assert_close(a: dict, b: dict) -> None:
    """Within the fused path's measured tolerance (tests/_support/numerics.py; this test measured loss
    and logprobs bit-identical, gradients 1.85e-6 x the tensor's largest element)."""
    worst = measure(a, b)
    assert worst["loss"] <= LOSS_RTOL, worst
    assert worst["logprobs"] <= LOGPROBS_ATOL, worst
    assert worst["grads"] <= GRADS_ATOL_OF_MAX, worst


def test_three_runs_share_one_fused_op_with_unfused_results(make_server):
    fused, unfused = train_three(make_server(), reference=make_server(fusion=False))  # fusion: on by default
    ids = fused["ids"]
    # The op record: each held round of three forward_backwards ran as one fused op for all three runs.
    by_call: dict[str, list] = {}
    for r in fused["records"]:
        assert r.fused_id is not None, r
        by_call.setdefault(r.fused_id, []).append(r)
    assert len(by_call) == 2
    for members in by_call.values():
        assert sorted(m.run for m in members) == sorted(ids.values())
        assert set(members[0].fused_runs) == set(ids.values())
        members.sort(key=lambda m: m.start)
        for m, n in zip(members, members[1:], strict=False):
            assert m.end == pytest.approx(n.start)  # back to back within the one call
    assert all(r.fused_id is None for r in unfused["records"])
    assert len(unfused["records"]) == 6
    assert_close(fused, unfused)  # and each optim_step matched float64 AdamW of its gradients


def test_fusion_off_runs_are_bit_identical_to_a_run_alone(make_server):
    together = train_three(make_server(fusion=False))
    alone = train_three(make_server(fusion=False), runs_seen=[1])
    alone_fused_on = train_three(make_server(), runs_seen=[1])
    for other in (alone, alone_fused_on):
        assert_identical(together, other, [1])
        for x, y in zip(together["weights"][1], other["weights"][1], strict=True):
            assert torch.equal(x, y)
    assert all(r.fused_id is None for r in alone_fused_on["records"])


def assert_identical(a: dict, b: dict, runs) -> None:
    for seq in (1, 3):
        for k in runs:
            assert fb_loss_and_logprobs(a["fb"][seq][k])[0] == fb_loss_and_logprobs(b["fb"][seq][k])[0]
            for x, y in zip(a["grads"][seq][k], b["grads"][seq][k], strict=True):
                assert torch.equal(x, y)


def test_metrics_count_fused_ops(make_server):
    live = make_server()
    assert live.client().get("/readyz").json()["fusion"] is True
    train_three(live)
    text = live.client().get("/metrics").text
    fused_ops = [ln for ln in text.splitlines() if ln.startswith("openrl_fused_ops_total ")]
    members = [ln for ln in text.splitlines() if ln.startswith("openrl_fused_members_total ")]
    assert float(fused_ops[0].split()[1]) == 2
    assert float(members[0].split()[1]) == 6


def native_round(live, n_runs: int = 3, *, reference=None) -> dict | tuple[dict, dict]:
    """Three native runs: seeded sample, train_step on it, seeded sample again, each round queued
    while the worker is held so the three runs' calls can fuse. ``reference``: a second service driven
    in lockstep whose runs take this service's weights before the second sample, so both sample at
    identical weights (weights after an Adam step are not compared, see tests/_support/numerics.py)."""
    lives = [live] if reference is None else [live, reference]
    prompts = [["ab", "cde"], ["fghij"], ["k", "lm", "nop"]]
    sides = []
    for lv in lives:
        clients = [Client(lv.url, token=ALICE_KEY) for _ in range(n_runs)]
        runs = [c.create_run(name=f"r{k}", seed=k + 1)["run_id"] for k, c in enumerate(clients)]
        sides.append({"live": lv, "clients": clients, "runs": runs, "t0": time.time()})

    def held_round(side, call) -> list:
        svc = side["live"].service
        results: list = [None] * n_runs
        with held_worker(svc.engine, svc.futures):
            threads = [
                threading.Thread(target=lambda k=k: results.__setitem__(k, call(side, k)))
                for k in range(n_runs)
            ]
            depth = svc.engine.queue_depth()
            for t in threads:
                t.start()
            wait_for(lambda: svc.engine.queue_depth() == depth + n_runs)
        for t in threads:
            t.join(60)
        return results

    def sample(seed):
        return lambda side, k: side["clients"][k].sample(
            side["runs"][k], prompts[k], num_samples=2, max_tokens=6, seed=seed, temperature=1.0
        )

    def step(side, k):
        items = [
            {"sample_id": s["sample_id"], "advantage": (-1.0) ** i}
            for i, s in enumerate(side["first"][k]["samples"])
        ]
        return side["clients"][k].train_step(side["runs"][k], items, optimizer={"learning_rate": 1e-2})

    for side in sides:
        side["first"] = held_round(side, sample(7))
    for side in sides:
        side["steps"] = held_round(side, step)
    if reference is not None:
        with torch.no_grad():
            for k in range(n_runs):
                src = live.service.runs[sides[0]["runs"][k]].state.adapter.parameters()
                dst = reference.service.runs[sides[1]["runs"][k]].state.adapter.parameters()
                for d, w in zip(dst, src, strict=True):
                    d.copy_(w)
    outs = []
    ours = lambda recs: [r for r in recs if r.kind in ("sample", "forward_backward")]  # noqa: E731
    for side in sides:
        second = held_round(side, sample(8))
        svc = side["live"].service
        records = ours(svc.recorder.wait_for(lambda recs: len(ours(recs)) >= 3 * n_runs, since=side["t0"]))
        outs.append({"samples": [side["first"], second], "steps": side["steps"], "records": records})
        for c in side["clients"]:
            c.close()
    return outs[0] if reference is None else tuple(outs)


def test_native_sample_and_train_step_fuse_across_runs(make_server):
    fused, unfused = native_round(make_server(), reference=make_server(fusion=False))
    calls: dict[str, set] = {}
    for r in fused["records"]:
        assert r.fused_id is not None, r
        calls.setdefault(r.fused_id, set()).add((r.kind, r.run))
    # sample, train_step's forward_backward, sample: one fused op each, covering the three runs
    assert len(calls) == 3
    assert sorted(len(v) for v in calls.values()) == [3, 3, 3]
    assert all(r.fused_id is None for r in unfused["records"])
    for rnd in range(2):
        for k in range(3):
            a = fused["samples"][rnd][k]["samples"]
            b = unfused["samples"][rnd][k]["samples"]
            assert [s["tokens"] for s in a] == [s["tokens"] for s in b]
            for x, y in zip(a, b, strict=True):  # measured: at most 9.5e-7 apart
                np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=LOGPROBS_ATOL)
    for k in range(3):
        # The IS loss is a sum of about ±1 per token that cancels to ~1e-6: measured at most 2.7e-8 x
        # tokens apart; the gradient norm at most 1.5e-7 relative.
        want = unfused["steps"][k]
        assert fused["steps"][k]["loss"] == pytest.approx(want["loss"], rel=0, abs=1e-7 * want["tokens"])
        assert fused["steps"][k]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)


def test_a_failed_fused_call_runs_each_member_alone(make_server, caplog):
    live = make_server()
    reference = train_three(make_server(fusion=False))

    def broken(items):
        raise RuntimeError("fused pass exploded")

    live.service.engine.fusers["train:openrl/tiny"] = broken  # the fusion key names the model
    with caplog.at_level("WARNING"):
        alone = train_three(live)
    assert "running them one by one" in caplog.text
    assert all(r.fused_id is None for r in alone["records"])
    assert_identical(alone, reference, alone["ids"])  # each member ran alone, as with fusion off


def test_a_call_larger_than_one_micro_batch_is_not_fused(make_server):
    """With 16-token micro-batches, run 2's six datums need several: it runs sliced and alone, while
    the two small calls still fuse with each other."""
    live = make_server(microbatch_tokens=16)
    svc = live.service
    raw = RawTinker(live.client())
    sid = raw.session()
    ids = [raw.create_model(sid, k, seed=k + 1) for k in range(3)]
    small = [sft_datum([11, 12, 13], [21, 22])]
    big = [sft_datum([31, 32, 33, 34, 35], [41, 42, 43])] * 6
    t0 = time.time()
    with held_worker(svc.engine, svc.futures):
        reqs = [
            raw.submit_fb(ids[0], 1, small),
            raw.submit_fb(ids[1], 1, small),
            raw.submit_fb(ids[2], 1, big),
        ]
    for r in reqs:
        assert "error" not in raw.result(r)
    recs = fb_records(svc, t0, 3)
    by_run = {r.run: r for r in recs}
    assert by_run[ids[0]].fused_id is not None
    assert by_run[ids[0]].fused_id == by_run[ids[1]].fused_id
    assert set(by_run[ids[0]].fused_runs) == {ids[0], ids[1]}
    assert by_run[ids[2]].fused_id is None


def test_fusion_setting_is_validated():
    from openrl_service.cli import main
    from openrl_service.config import from_env

    assert from_env({"OPENRL_FUSION": "off"}).fusion is False
    assert from_env({"OPENRL_FUSION": "ON"}).fusion is True
    assert from_env({}).fusion is True
    with pytest.raises(ValueError, match="OPENRL_FUSION must be on or off; got 'maybe'"):
        from_env({"OPENRL_FUSION": "maybe"})
    with pytest.raises(SystemExit):
        main(["serve", "--fusion", "maybe"])
    assert from_env({"OPENRL_FUSION_MAX_TOKENS": "4096"}).fusion_max_tokens == 4096
    with pytest.raises(ValueError, match="OPENRL_FUSION_MAX_TOKENS must be a whole number; got 'abc'"):
        from_env({"OPENRL_FUSION_MAX_TOKENS": "abc"})
    with pytest.raises(ValueError, match="OPENRL_MAX_DATUMS must be a whole number; got '1e3'"):
        from_env({"OPENRL_MAX_DATUMS": "1e3"})


# -- the engine alone: which ops join a fused call ------------------------------------------------
def fused_engine(key: str = "k", **kw):
    from openrl_service.engine.futures import FutureStore
    from openrl_service.engine.scheduler import Engine
    from openrl_service.telemetry import OpRecorder

    calls: list[list] = []

    def double(parts):
        calls.append(list(parts))
        return [p * 2 for p in parts]

    futures = FutureStore(ttl_s=60)
    recorder = OpRecorder()
    engine = Engine(
        futures=futures, seq_gap_timeout_s=60, recorder=recorder, fusion=True, fusers={key: double}, **kw
    )
    engine.start()
    engine.ready.wait(10)
    return engine, futures, recorder, calls


def fusable_op(futures, lane: str, value, *, size: int = 1, key: str = "k", seq_id=None):
    from openrl_service.engine.ops import Fusable, Op

    def prepare():
        if isinstance(value, Exception):
            raise value
        return value

    return Op(
        kind="work",
        lane=lane,
        fn=lambda: prepare() * 2,
        future=futures.new("t", "work"),
        run_id=lane.split(":", 1)[1],
        seq_id=seq_id,
        fuse=Fusable(key=key, size=size, prepare=prepare),
    )


def test_a_member_that_fails_to_prepare_fails_alone():
    engine, futures, recorder, calls = fused_engine()
    try:
        with held_worker(engine, futures):
            ops = [
                fusable_op(futures, "sampler:a", 1),
                fusable_op(futures, "sampler:b", RuntimeError("boom")),
                fusable_op(futures, "sampler:c", 3),
            ]
            for o in ops:
                engine.submit(o)
        for o in ops:
            assert futures.wait_sync(o.future, 10)
        assert [o.future.result for o in ops] == [2, None, 6]
        assert "internal error while running work" in str(ops[1].future.error)
        assert calls == [[1, 3]]
        # The worker completes the futures before it writes the records: wait for the records.
        work = lambda rs: [r for r in rs if r.kind == "work"]  # noqa: E731
        recs = work(recorder.wait_for(lambda rs: len(work(rs)) >= 3))
        fused = [r for r in recs if r.ok]
        assert {r.run for r in fused} == {"a", "c"} and len({r.fused_id for r in fused}) == 1
        assert [(r.run, r.ok, r.fused_id) for r in recs if not r.ok] == [("b", False, None)]  # counted
    finally:
        engine.stop()


def test_companions_respect_the_budget_the_key_and_run_order():
    """Budget 4: a(2) + c(2) fuse; b has another key; d(1) would overflow; a run's second op (e2)
    depends on its first and never joins the call that runs its first; an op alone runs its own work."""
    engine, futures, recorder, calls = fused_engine(fusion_max_tokens=4)
    try:
        engine.open_ordered_lane("e", 0)
        with held_worker(engine, futures):
            ops = [
                fusable_op(futures, "sampler:a", 1, size=2),
                fusable_op(futures, "sampler:b", 2, key="other"),
                fusable_op(futures, "sampler:c", 3, size=2),
                fusable_op(futures, "sampler:d", 4, size=1),
            ]
            for o in ops:
                engine.submit(o)
        for o in ops:
            assert futures.wait_sync(o.future, 10)
        assert calls[0] == [1, 3]
        assert [o.future.result for o in ops] == [2, 4, 6, 8]
        calls.clear()
        with held_worker(engine, futures):
            e1 = fusable_op(futures, "run:e", 5, seq_id=0)
            e2 = fusable_op(futures, "run:e", 6, seq_id=1)
            engine.submit(e1)
            engine.submit(e2)
        for o in (e1, e2):
            assert futures.wait_sync(o.future, 10)
        assert calls == []  # each ran alone, through its own work, not the fuser
        assert [e1.future.result, e2.future.result] == [10, 12]
    finally:
        engine.stop()


def test_a_fused_call_stays_within_one_micro_batch_of_the_trainer(make_server):
    """OPENRL_FUSION_MAX_TOKENS above the micro-batch does not let a fused pass grow past one
    micro-batch: two 4-token calls under 6-token micro-batches run apart."""
    live = make_server(microbatch_tokens=6, fusion_max_tokens=10_000)
    svc = live.service
    raw = RawTinker(live.client())
    sid = raw.session()
    ids = [raw.create_model(sid, k, seed=k + 1) for k in range(2)]
    t0 = time.time()
    with held_worker(svc.engine, svc.futures):
        reqs = [raw.submit_fb(run, 1, [sft_datum([11, 12, 13], [21, 22])]) for run in ids]
    for r in reqs:
        assert "error" not in raw.result(r)
    recs = fb_records(svc, t0, 2)
    assert len(recs) == 2 and all(r.fused_id is None for r in recs)


def test_other_runs_join_before_the_lanes_own_backlog():
    """Budget 4, sampler s1 with six ops and s2 with one: s2's op joins s1's first call rather than
    waiting behind s1's backlog."""
    engine, futures, recorder, calls = fused_engine(fusion_max_tokens=4)
    try:
        with held_worker(engine, futures):
            s1 = [fusable_op(futures, "sampler:s1", 10 + i) for i in range(6)]
            engine.submit(s1[0])
            s2 = fusable_op(futures, "sampler:s2", 20)
            engine.submit(s2)
            for o in s1[1:]:
                engine.submit(o)
        for o in [*s1, s2]:
            assert futures.wait_sync(o.future, 10)
        assert calls[0] == [10, 20, 11, 12]
    finally:
        engine.stop()


def test_sampling_members_are_budgeted_by_padded_rows_and_similar_length(tmp_path):
    """Sampling pads every row to the longest prompt + longest decode: a long-prompt request and a
    many-sample one that fit by their own sizes do not fit together; nor does a decode more than
    twice as long as another's (the short one would wait for it); a prompt-logprob request runs alone.
    The Fusables come from the service's own producer (``sample_fusable``), as in production."""
    from openrl_service.config import Settings
    from openrl_service.engine.ops import Op
    from openrl_service.engine.service import TrainingService
    from openrl_service.sampling.base import SampleJob, SamplingParams

    svc = TrainingService(Settings(data_dir=tmp_path))  # not started: only its fusion producer is used
    engine, futures, recorder, calls = fused_engine("sample", fusion_max_tokens=1000)

    def op(lane, value, prompt, max_tokens, num_samples=1, **job):
        jobs = [SampleJob([1] * prompt, num_samples, SamplingParams(max_tokens=max_tokens), None, **job)]
        fuse = svc.sample_fusable(lambda: value, jobs, lambda part: part)
        return Op(
            kind="work", lane=lane, fn=lambda: value * 2, future=futures.new("t", "w"), run_id=lane, fuse=fuse
        )

    try:
        with held_worker(engine, futures):
            ops = [
                op("sampler:long", 1, prompt=850, max_tokens=50),  # 1 row x 900 alone
                op("sampler:many", 2, prompt=10, max_tokens=50, num_samples=8),  # 8 x 60; with "long" 9 x 900
                op("sampler:short", 3, prompt=10, max_tokens=50),  # fits with "many": 9 x 60
                op("sampler:slow", 4, prompt=50, max_tokens=150),  # 3x the others' decode
                op("sampler:lp", 5, prompt=10, max_tokens=50, prompt_logprobs=True),
                op("sampler:topk", 6, prompt=10, max_tokens=50, topk_prompt_logprobs=2),
            ]
            assert ops[1].fuse.rows == 8 and ops[1].fuse.width == 60 and ops[1].fuse.decode == 50
            assert ops[4].fuse is None and ops[5].fuse is None  # prompt-logprob requests run alone
            for o in ops:
                engine.submit(o)
        for o in ops:
            assert futures.wait_sync(o.future, 10)
        assert calls == [[2, 3]]  # the others ran alone, through their own work
        assert [o.future.result for o in ops] == [2, 4, 6, 8, 10, 12]
    finally:
        engine.stop()


def test_a_lone_op_whose_work_fails_runs_once():
    engine, futures, recorder, _ = fused_engine()
    runs = []

    def boom():
        runs.append(1)
        raise RuntimeError("bad input")

    try:
        o = fusable_op(futures, "sampler:a", 1)
        o.fn = boom
        engine.submit(o)
        assert futures.wait_sync(o.future, 10)
        assert runs == [1] and "internal error" in str(o.future.error)
    finally:
        engine.stop()


def test_a_fused_ops_record_exists_once_its_result_is_out(make_server, monkeypatch):
    """A client that has its fused forward_backward's result and then exports its session's trace (or
    reads /metrics) finds the op in it: the worker writes the members' records before it completes
    their futures. (It used to complete them first; a quick client's trace then missed the op, made
    deterministic here by a slow record.)"""
    live = make_server()
    engine = live.service.engine
    real = engine.oplog.record_fused

    def slow_record(*args, **kwargs):
        time.sleep(0.5)  # a busy machine between the futures and the records
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.oplog, "record_fused", slow_record)
    with live.client(ALICE_KEY) as http:
        raw = RawTinker(http)
        session = raw.session()
        runs = [raw.create_model(session, model_seq_id=k, rank=4) for k in range(2)]
        data = [sft_datum([11, 12, 13], [14, 15])]
        with held_worker(engine, live.service.futures):  # both wait, then run as one fused call
            requests = [raw.submit_fb(run, 1, data) for run in runs]
        assert all("error" not in raw.result(r) for r in requests)
        trace = http.get(http.get(f"/api/v1/sessions/{session}/trace_export").json()["url"]).json()
        ops = [e for e in trace["traceEvents"] if e["name"] == "forward_backward"]
        assert sorted(e["tid"] for e in ops) == sorted(runs)
        assert all(e["args"].get("fused_with") for e in ops), ops  # they did run fused
        raw.finish_sessions()
