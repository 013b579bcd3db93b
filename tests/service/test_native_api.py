"""The notebook API (/openrl/v1): runs by id, text in and out, one-call train steps, metrics, SSE."""

import json
import statistics
import threading

import httpx
import pytest
import tinker

from tests.conftest import ALICE_KEY, BOB_KEY

V1 = "/openrl/v1"


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as c:
        yield c


@pytest.fixture
def run_id(alice):
    r = alice.post(f"{V1}/runs", json={"name": "native-test", "seed": 0})
    assert r.status_code == 201, r.text
    yield r.json()["run_id"]
    alice.delete(f"{V1}/runs/{r.json()['run_id']}")


def letters(text: str) -> float:
    return sum(c.isalpha() for c in text) / max(1, len(text))


def test_run_lifecycle_and_tenancy(server, alice, run_id):
    run = alice.get(f"{V1}/runs/{run_id}").json()
    assert run["name"] == "native-test" and run["base_model"] == "openrl/tiny" and run["lora_rank"] == 8
    assert run_id in [r["run_id"] for r in alice.get(f"{V1}/runs").json()["runs"]]
    with server.client(BOB_KEY) as bob:
        assert bob.get(f"{V1}/runs/{run_id}").status_code == 404
        assert bob.post(f"{V1}/runs/{run_id}/sample", json={"prompts": ["x"]}).status_code == 404
        assert run_id not in [r["run_id"] for r in bob.get(f"{V1}/runs").json()["runs"]]
    assert alice.delete(f"{V1}/runs/{run_id}").status_code == 200
    assert alice.get(f"{V1}/runs/{run_id}").status_code == 404


def test_sample_returns_text_without_the_stop_token(alice, run_id):
    greedy = {"prompts": ["Hi"], "num_samples": 2, "temperature": 0.0, "max_tokens": 4}
    first = alice.post(f"{V1}/runs/{run_id}/sample", json={**greedy, "stop": []}).json()["samples"][0][
        "tokens"
    ][0]
    samples = alice.post(f"{V1}/runs/{run_id}/sample", json={**greedy, "stop": [first]}).json()["samples"]
    assert len(samples) == 2 and len({s["sample_id"] for s in samples}) == 2
    for s in samples:  # the stop token is in the tokens (last), not in the text
        assert s["stop_reason"] == "stop" and s["tokens"] == [first] and s["text"] == ""
    plain = alice.post(
        f"{V1}/runs/{run_id}/sample", json={"prompts": ["Hi", "Yo"], "max_tokens": 5, "stop": []}
    )
    for s in plain.json()["samples"]:
        assert s["stop_reason"] == "length" and len(s["tokens"]) == len(s["logprobs"]) == 5
        if all(t < 256 for t in s["tokens"]):  # openrl/tiny: byte tokens decode to exactly those bytes
            assert s["text"] == bytes(s["tokens"]).decode("utf-8", "replace")


def test_train_step_reports_on_policy_statistics_and_changes_the_weights(alice, run_id):
    body = {"prompts": ["Name a colour"], "num_samples": 8, "max_tokens": 8, "seed": 3, "stop": []}
    before = alice.post(f"{V1}/runs/{run_id}/sample", json=body).json()
    items = [{"sample_id": s["sample_id"], "advantage": letters(s["text"]) - 0.25} for s in before["samples"]]
    step = alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items, "loss": "ppo"}).json()
    assert step["step"] == 1 and step["snapshot"] == 1 and step["tokens"] > 0
    assert step["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # on-policy: trainer and sampler agree
    assert step["ratio_min"] <= step["ratio_mean"] <= step["ratio_max"]
    assert (
        step["kl"] == pytest.approx(0.0, abs=1e-4) and step["clip_fraction"] == 0.0 and step["grad_norm"] > 0
    )
    after = alice.post(f"{V1}/runs/{run_id}/sample", json=body).json()
    assert after["snapshot"] == 1
    assert [s["logprobs"] for s in after["samples"]] != [s["logprobs"] for s in before["samples"]]


def test_native_rl_loop_learns(alice, run_id):
    prompts = ["Say hello", "Name a colour", "Write a word", "Greet me"]
    means = []
    for step in range(30):
        out = alice.post(
            f"{V1}/runs/{run_id}/sample",
            json={"prompts": prompts, "num_samples": 8, "max_tokens": 16, "seed": step},
        ).json()["samples"]
        rewards = [letters(s["text"]) for s in out]
        means.append(statistics.fmean(rewards))
        items = []
        for i in range(len(prompts)):
            group = [(s, r) for s, r in zip(out, rewards, strict=True) if s["prompt_index"] == i]
            mean = statistics.fmean(r for _, r in group)
            items += [{"sample_id": s["sample_id"], "advantage": r - mean} for s, r in group if r != mean]
        if items:
            r = alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items})
            assert r.status_code == 200, r.text
        alice.post(
            f"{V1}/runs/{run_id}/metrics",
            json={"step": step, "reward_mean": means[-1], "reward_name": "letters", "reward_version": 1},
        )
    assert statistics.fmean(means[-5:]) - statistics.fmean(means[:5]) >= 0.1, means
    rows = alice.get(f"{V1}/runs/{run_id}/metrics").json()["metrics"]
    assert [row["step"] for row in rows] == list(range(30)) and rows[0]["reward_name"] == "letters"
    # a whole number stays whole (the reward version a dashboard shows as "v1", not "v1.0")
    assert all(type(row["reward_version"]) is int and type(row["reward_mean"]) is float for row in rows)


def test_checkpoint_loads_with_the_tinker_sdk(server, alice, run_id):
    path = alice.post(f"{V1}/runs/{run_id}/checkpoints", json={"name": "nb"}).json()["path"]
    assert path == f"tinker://{run_id}/weights/nb"
    assert [c["tinker_path"] for c in alice.get(f"{V1}/runs/{run_id}/checkpoints").json()["checkpoints"]] == [
        path
    ]
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_training_client_from_state_with_optimizer(path).result()
    assert tc.get_info().lora_rank == 8
    sc.close("success").result()


def test_event_stream_carries_ticks_and_run_events(server, alice, run_id):
    sample = alice.post(
        f"{V1}/runs/{run_id}/sample", json={"prompts": ["a"], "num_samples": 2, "max_tokens": 4}
    ).json()
    items = [{"sample_id": s["sample_id"], "advantage": 1.0} for s in sample["samples"]]
    seen = {}
    with (
        httpx.Client(base_url=server.url, headers={"X-API-Key": ALICE_KEY}, timeout=30) as c,
        c.stream("GET", f"{V1}/events") as stream,
    ):
        threading.Thread(
            target=lambda: alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items})
        ).start()
        kind = None
        for line in stream.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                event = json.loads(line[5:])
                seen.setdefault(kind, event)
                if kind == "run" and event["event"] == "step":
                    seen["step"] = event
                if "tick" in seen and "step" in seen:
                    break
    tick = seen["tick"]
    assert tick["schema"] == 2 and tick["utilisation"]["label"] == "engine busy"
    assert 0.0 <= tick["utilisation"]["value"] <= 1.0
    assert seen["step"]["schema"] == 2 and seen["step"]["run_id"] == run_id and seen["step"]["step"] == 1


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("sample", {"prompts": []}, "prompts"),
        ("sample", {"prompts": [5]}, "prompts[0]"),
        ("sample", {"prompts": ["x"], "num_samples": 0}, "OPENRL_MAX_NUM_SAMPLES"),
        ("train_step", {"samples": []}, "samples"),
        ("train_step", {"samples": [{"sample_id": "smp-nope", "advantage": 1}]}, "samples[0].sample_id"),
        ("train_step", {"samples": [{"sample_id": "x", "advantage": 1}], "loss": "cross_entropy"}, "loss"),
        ("metrics", {"step": 1, "reward_mean": "high"}, "reward_mean"),
        ("metrics", {"reward_mean": 1.0}, "step"),
    ],
)
def test_bad_input_names_the_field(alice, run_id, path, body, field):
    r = alice.post(f"{V1}/runs/{run_id}/{path}", json=body)
    assert 400 <= r.status_code < 500 and field in r.json()["error"], r.text
    assert alice.get(f"{V1}/runs/{run_id}").status_code == 200  # the run is still there


def test_openapi_schema_lists_the_native_routes(server):
    paths = server.client().get("/openapi.json").json()["paths"]
    assert {
        f"{V1}/runs",
        f"{V1}/runs/{{run_id}}/sample",
        f"{V1}/runs/{{run_id}}/train_step",
        f"{V1}/events",
    } <= set(paths)


def test_nvml_utilisation_is_reported_where_a_gpu_exists_else_engine_busy(monkeypatch):
    """No GPU here: NVML is faked at the library boundary (pynvml) to check the tick's shape."""
    from openrl_service.telemetry import NvmlReader
    from tests.conftest import fake_pynvml

    assert NvmlReader.for_device("cpu").read() is None
    fake_pynvml(monkeypatch)
    assert NvmlReader.for_device("cpu").read() is None  # the model is not on a GPU: never "GPU"
    reading = NvmlReader.for_device("cuda:1").read()
    assert reading["label"] == "GPU utilisation (NVML)" and reading["value"] == pytest.approx(0.73)
    assert reading["memory_used_bytes"] == 3 << 30 and reading["device"] == "FakeGPU"


def test_heartbeat_keeps_an_idle_run_alive_and_a_reaped_run_leaves_memory(make_server):
    """A paused notebook heartbeats its run; a run nobody heartbeats is finished by the idle reaper
    and forgotten (its metric rows and samples too)."""
    live = make_server(session_idle_timeout_s=60.0)
    svc = live.service
    with live.client(ALICE_KEY) as c:
        kept, lost = (c.post(f"{V1}/runs", json={"name": n, "seed": 0}).json() for n in ("kept", "lost"))
        assert kept["idle_timeout_s"] == 60.0
        for run in (kept, lost):
            c.post(f"{V1}/runs/{run['run_id']}/sample", json={"prompts": ["a"], "max_tokens": 2})
            c.post(f"{V1}/runs/{run['run_id']}/metrics", json={"step": 0, "reward_mean": 0.5})
        # Both went quiet long ago (backdated rather than slept)...
        for run in (kept, lost):
            rec = svc.runs[run["run_id"]]
            rec.last_request_time -= 1000
            svc.sessions[rec.session_id].last_heartbeat -= 1000
        # ...then the notebook of "kept" heartbeats it.
        hb = c.post(f"{V1}/runs/{kept['run_id']}/heartbeat")
        assert hb.status_code == 200, hb.text
        assert hb.json()["run_id"] == kept["run_id"] and hb.json()["idle_timeout_s"] == 60.0
        assert len(svc.reap_idle_sessions()) == 1
        assert c.get(f"{V1}/runs/{kept['run_id']}").status_code == 200
        assert c.get(f"{V1}/runs/{lost['run_id']}").status_code == 404
        assert c.post(f"{V1}/runs/{lost['run_id']}/heartbeat").status_code == 404
        native = live.parts.native
        assert set(native.runs) == {kept["run_id"]}
        assert {s.run_id for s in native.samples.values()} == {kept["run_id"]}
        c.delete(f"{V1}/runs/{kept['run_id']}")
        assert native.runs == {} and not native.samples


def test_a_resent_train_step_with_the_same_idempotency_key_is_applied_once(server, alice, run_id):
    """A train_step whose reply was lost is re-sent with its key: the original reply, one update."""
    sample = alice.post(
        f"{V1}/runs/{run_id}/sample", json={"prompts": ["a"], "num_samples": 4, "max_tokens": 4, "stop": []}
    ).json()
    items = [{"sample_id": s["sample_id"], "advantage": 1.0 - i} for i, s in enumerate(sample["samples"])]
    key = {"X-Idempotency-Key": "step-1-of-" + run_id}
    weights = server.service.runs[run_id].state.adapter.weights
    before = {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in weights.items()}
    replies = []
    send = lambda: replies.append(  # noqa: E731
        alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items}, headers=key)
    )
    threads = [threading.Thread(target=send) for _ in range(2)]  # the duplicate may arrive mid-flight
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    send()  # or after the first finished
    assert [r.status_code for r in replies] == [200, 200, 200], replies[0].text
    assert replies[0].content == replies[1].content == replies[2].content
    assert replies[0].json()["step"] == 1 and alice.get(f"{V1}/runs/{run_id}").json()["step"] == 1
    assert server.service.runs[run_id].state.steps == 1  # one optimizer step, not three
    import torch

    moved = [
        not torch.equal(a, before[n][0]) or not torch.equal(b, before[n][1]) for n, (a, b) in weights.items()
    ]
    assert any(moved)
    # Another key is another step.
    other = alice.post(
        f"{V1}/runs/{run_id}/train_step", json={"samples": items}, headers={"X-Idempotency-Key": "step-2"}
    )
    assert other.json()["step"] == 2


def test_an_idempotent_create_returns_the_same_run_and_an_overlong_key_is_refused(alice):
    key = {"X-Idempotency-Key": "create-once"}
    first = alice.post(f"{V1}/runs", json={"name": "idem"}, headers=key)
    again = alice.post(f"{V1}/runs", json={"name": "idem"}, headers=key)
    try:
        assert first.status_code == again.status_code == 201 and first.content == again.content
        mine = [r for r in alice.get(f"{V1}/runs").json()["runs"] if r["name"] == "idem"]
        assert [r["run_id"] for r in mine] == [first.json()["run_id"]]
    finally:
        for r in {first.json()["run_id"], again.json()["run_id"]}:
            alice.delete(f"{V1}/runs/{r}")
    long = alice.post(f"{V1}/runs", json={"name": "x"}, headers={"X-Idempotency-Key": "k" * 129})
    assert long.status_code == 400 and "X-Idempotency-Key" in long.json()["error"], long.text
    assert "128" in long.json()["error"]


def test_a_native_request_answers_503_when_the_device_worker_has_died(make_server):
    """A request queued when the worker dies, and one sent after, answer 503 naming the worker
    instead of waiting forever."""
    from tests.service.test_scheduling import held_worker, wait_for

    live = make_server()
    svc = live.service
    with httpx.Client(base_url=live.url, headers={"X-API-Key": ALICE_KEY}, timeout=20) as c:
        run = c.post(f"{V1}/runs", json={"name": "doomed"}).json()["run_id"]
        body = {"prompts": ["a"], "max_tokens": 2}
        replies = []
        with held_worker(svc.engine, svc.futures):
            depth = svc.engine.queue_depth()
            t = threading.Thread(target=lambda: replies.append(c.post(f"{V1}/runs/{run}/sample", json=body)))
            t.start()
            wait_for(lambda: svc.engine.queue_depth() == depth + 1)
            svc.engine._stop = True  # the worker exits after the held op, leaving the sample queued
        svc.engine._thread.join(10)
        assert not svc.engine.alive
        t.join(30)
        after = c.post(f"{V1}/runs/{run}/sample", json=body)
        for r in [*replies, after]:
            assert r.status_code == 503 and "device worker" in r.json()["error"], r.text


def test_a_native_request_that_fails_before_its_op_is_queued_leaves_no_gap(make_server, monkeypatch):
    """A request that fails after taking its place in the run's order but before its op reached the
    engine (here: an unexpected error queueing it) fills its place with its error: the run's next
    request runs at once instead of failing after OPENRL_SEQ_GAP_TIMEOUT_S behind a missing seq_id."""
    live = make_server(seq_gap_timeout_s=3.0)
    svc = live.service
    real, calls = svc.sample_run, []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("queueing failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(svc, "sample_run", broken_once)
    with httpx.Client(base_url=live.url, headers={"X-API-Key": ALICE_KEY}, timeout=60) as c:
        run = c.post(f"{V1}/runs", json={"name": "gapless"}).json()["run_id"]
        body = {"prompts": ["a"], "max_tokens": 2}
        try:  # an unexpected error: a 500 (the in-process test server may drop the connection instead)
            assert c.post(f"{V1}/runs/{run}/sample", json=body).status_code == 500
        except httpx.TransportError:
            pass
    with httpx.Client(
        base_url=live.url, headers={"X-API-Key": ALICE_KEY}, timeout=60
    ) as c:  # a new connection
        after = c.post(f"{V1}/runs/{run}/sample", json=body)
        assert after.status_code == 200, after.text
        assert len(calls) == 2


@pytest.mark.parametrize("call", ["create", "delete"])
def test_a_slow_session_write_does_not_stall_other_requests(make_server, call):
    """Creating or deleting a run writes (and fsyncs) its session file; while that disk write hangs,
    the service still answers other requests (the write runs off the event loop)."""
    live = make_server()
    store = live.service.store
    entered, release = threading.Event(), threading.Event()
    real = store.write_session
    with live.client(ALICE_KEY) as c, httpx.Client(base_url=live.url, timeout=10) as probe:
        run = c.post(f"{V1}/runs", json={"name": "slow"}).json()["run_id"] if call == "delete" else None

        def slow(*args, **kw):
            entered.set()
            release.wait(30)
            return real(*args, **kw)

        store.write_session = slow
        replies = []
        if call == "create":
            t = threading.Thread(target=lambda: replies.append(c.post(f"{V1}/runs", json={"name": "x"})))
        else:
            t = threading.Thread(target=lambda: replies.append(c.delete(f"{V1}/runs/{run}")))
        t.start()
        try:
            assert entered.wait(30)
            assert probe.get("/healthz").status_code == 200  # answered while the write hangs
        finally:
            release.set()
            t.join(30)
            store.write_session = real
        assert replies[0].status_code in (200, 201), replies[0].text
