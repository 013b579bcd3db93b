"""Telemetry: the event stream's tick (schema 2) and Prometheus /metrics (aggregates unless authenticated)."""

import json
import threading
import time
import types

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from openrl_service.api.metrics import EngineCollector
from openrl_service.engine.events import EVENTS_SCHEMA_VERSION
from openrl_service.engine.native import NativeRuns
from openrl_service.engine.usage import DeviceUsage
from openrl_service.telemetry import OpRecorder, percentile, token_direction
from tests.conftest import ALICE_KEY, BOB_KEY, fake_pynvml
from tests.service.test_scheduling import held_worker, wait_for

V1 = "/openrl/v1"
AGGREGATES = {
    "openrl_ready",
    "openrl_engine_busy_seconds",
    "openrl_engine_busy_ratio",
    "openrl_queue_depth",
    "openrl_queue_wait_seconds",
    "openrl_tokens_trained",
    "openrl_tokens_sampled",
    "openrl_ops",
    "openrl_runs",
    "openrl_samplers",
}


def rl_step(client: httpx.Client, run_id: str) -> None:
    """A few sampling ops submitted at once (so some wait in the queue) and one train step."""
    body = {"prompts": ["a", "b"], "num_samples": 2, "max_tokens": 4, "stop": []}
    outs: list[dict] = []
    threads = [
        threading.Thread(
            target=lambda: outs.append(client.post(f"{V1}/runs/{run_id}/sample", json=body).json())
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    items = [
        {"sample_id": s["sample_id"], "advantage": 1.0 - i % 2} for i, s in enumerate(outs[0]["samples"])
    ]
    r = client.post(f"{V1}/runs/{run_id}/train_step", json={"samples": items})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def runs(server):
    """One run each for alice and bob, each with some sampling and training done."""
    made = []
    with server.client(ALICE_KEY) as alice, server.client(BOB_KEY) as bob:
        for who, client in (("alice", alice), ("bob", bob)):
            r = client.post(f"{V1}/runs", json={"name": f"telemetry-{who}", "seed": 0})
            assert r.status_code == 201, r.text
            made.append((client, r.json()["run_id"]))
            rl_step(client, made[-1][1])
        yield {"alice": made[0][1], "bob": made[1][1]}
        for client, run_id in made:
            client.delete(f"{V1}/runs/{run_id}")


def first_tick(server, key: str) -> dict:
    with (
        httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=30) as c,
        c.stream("GET", f"{V1}/events") as stream,
    ):
        kind = None
        for line in stream.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and kind == "tick":
                return json.loads(line[5:])
    raise AssertionError("no tick")


def test_tick_schema_2_fields_and_labels_on_cpu(server, runs):
    tick = first_tick(server, ALICE_KEY)  # through the event stream: shape and labels
    assert tick["schema"] == EVENTS_SCHEMA_VERSION == 2 and tick["type"] == "tick"
    # schema 1's fields are all still there, with the same meaning
    assert {"time", "window_s", "utilisation", "engine_busy", "runs", "queue_depth"} <= set(tick)
    assert tick["utilisation"]["label"] == "engine busy" and tick["window_s"] == 5.0
    assert tick["utilisation"]["value"] == tick["engine_busy"]
    assert "gpu" not in json.dumps(tick).lower()  # no GPU here: nothing is called GPU
    assert tick["memory"] is None and runs["bob"] not in tick["runs"]
    # The activity figures over a window that surely holds this step (the stream's window is the
    # last 5 s, which a slow machine could let the step fall out of).
    t0 = time.time()
    with server.client(ALICE_KEY) as alice:
        rl_step(alice, runs["alice"])
    tick = server.parts.native.tick("alice", window_s=time.time() - t0 + 0.5)
    assert 0.0 < tick["utilisation"]["value"] <= 1.0
    # this tenant's runs only, with their share of the engine's busy time
    assert runs["alice"] in tick["runs"] and runs["bob"] not in tick["runs"]
    assert 0.0 < tick["runs"][runs["alice"]] <= 1.0
    wait = tick["queue_wait_s"]
    assert wait["ops"] >= 4 and wait["p50"] <= wait["p99"]  # three samples and a train step
    assert tick["tokens_per_s"]["trained"] > 0 and tick["tokens_per_s"]["sampled"] > 0
    assert 0.0 <= tick["fused_share"] <= 1.0


def test_tick_reports_the_queue_depth(server, runs):
    svc = server.service
    with server.client(ALICE_KEY) as alice:
        with held_worker(svc.engine, svc.futures):
            before = svc.engine.queue_depth()
            body = {"prompts": ["a"], "max_tokens": 2}
            t = threading.Thread(target=lambda: alice.post(f"{V1}/runs/{runs['alice']}/sample", json=body))
            t.start()
            wait_for(lambda: svc.engine.queue_depth() == before + 1)
            assert server.parts.native.tick("alice")["queue_depth"] == before + 1
        t.join(60)


def test_op_record_carries_the_queue_wait(server, runs):
    ops = [op for op in server.service.recorder.since(0) if op.run == runs["alice"]]
    # three sampling requests were submitted together: the later ones waited for the first
    assert max(op.queued_s for op in ops if op.kind == "sample") > 0.0


def test_window_statistics_are_exact():
    rec = OpRecorder()
    for i, (kind, tokens) in enumerate(
        [("sample", 40), ("train_step", 100), ("optim_step", 0), ("forward", 7)]
    ):
        rec.record(run="r", kind=kind, start=100.0 + i, end=100.5 + i, tokens=tokens, queued_s=0.1 * (i + 1))
    rec.record(run="r", kind="sample", start=101.0, end=101.5, tokens=999, ok=False, queued_s=0.0)
    rec.record(
        run="q",
        kind="sample",
        start=105.0,
        end=105.25,
        tokens=0,
        ok=False,
        fused_id="f",
        fused_runs=("q", "r"),
    )
    stats = rec.window(100.0, 110.0)
    assert stats["busy_s"] == {"r": pytest.approx(2.5), "q": pytest.approx(0.25)}
    assert stats["fused_busy_s"] == pytest.approx(0.25)
    assert stats["tokens_per_s"] == {"trained": pytest.approx(10.0), "sampled": pytest.approx(4.0)}
    assert stats["queue_wait_s"]["ops"] == 6
    assert stats["queue_wait_s"]["p50"] == pytest.approx(0.15)
    assert stats["queue_wait_s"]["p99"] == pytest.approx(0.4, abs=0.01)
    totals = rec.totals()
    assert totals.tokens == {"trained": 100, "sampled": 40} and totals.wait_count == 6
    assert totals.fused_ops == 1 and totals.fused_members == 1
    assert totals.ops[("sample", False)] == 2 and totals.busy_s == pytest.approx(2.75)
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    assert [
        token_direction(k) for k in ("sample", "forward_backward", "train_step", "forward", "optim_step")
    ] == [
        "sampled",
        "trained",
        "trained",
        None,
        None,
    ]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_unauthenticated_scrape_is_aggregates_only(server, runs):
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    fams = families(r.text)
    assert set(fams) >= AGGREGATES, sorted(fams)
    assert not any(name.startswith("openrl_run_") for name in fams)
    assert not any(name.startswith("openrl_gpu_") for name in fams)  # no GPU here
    value = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels}
    assert value["openrl_ready"] == 1.0 and value["openrl_runs"] >= 2
    assert value["openrl_tokens_trained_total"] > 0 and value["openrl_tokens_sampled_total"] > 0
    assert value["openrl_engine_busy_seconds_total"] > 0 and value["openrl_queue_wait_seconds_count"] > 0
    kinds = {s.labels["kind"] for s in fams["openrl_ops"].samples}
    assert {"sample", "forward_backward", "optim_step"} <= kinds  # a native train_step is these two ops
    # no tenant's identifiers anywhere: not a run id, sampler id or tenant name
    labels = {v for f in fams.values() for s in f.samples for v in s.labels.values()}
    for secret in (runs["alice"], runs["bob"], "alice", "bob", "telemetry-alice", *server.service.samplers):
        assert secret not in r.text and secret not in labels


def test_metrics_with_a_key_adds_only_that_tenants_runs(server, runs):
    for key, mine, theirs in ((ALICE_KEY, runs["alice"], runs["bob"]), (BOB_KEY, runs["bob"], runs["alice"])):
        r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200
        fams = families(r.text)
        assert set(fams) >= AGGREGATES
        by_run = {s.labels["run_id"]: s.value for s in fams["openrl_run_busy_seconds"].samples}
        assert by_run[mine] > 0 and theirs not in r.text
        trained = {s.labels["run_id"]: s.value for s in fams["openrl_run_tokens_trained"].samples}
        assert trained[mine] > 0
    wrong = httpx.get(f"{server.url}/metrics", headers={"X-API-Key": "tml-wrong"}, timeout=30)
    assert wrong.status_code == 401 and runs["alice"] not in wrong.text


def test_metrics_speak_openmetrics_when_asked(server, runs):
    r = httpx.get(
        f"{server.url}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")
    assert {f.name for f in parse_openmetrics(r.text)} >= AGGREGATES


def fake_service(device: str) -> types.SimpleNamespace:
    ready = threading.Event()
    ready.set()
    rec = OpRecorder()
    return types.SimpleNamespace(
        recorder=rec,
        engine=types.SimpleNamespace(queue_depth=lambda: 3, ready=ready),
        base=types.SimpleNamespace(device=device),
        runs={},
        samplers={},
        session_listeners=[],
        sweepers=[],  # NativeRuns hooks into both, and into the journal
        settings=types.SimpleNamespace(future_ttl_s=3600.0),
        durability=types.SimpleNamespace(loop_state=[], intent_replayers={}, record_replayers={}),
        device_time=DeviceUsage(),  # /metrics counts the device-seconds of every service
    )


def test_gpu_telemetry_where_nvml_exists(monkeypatch):
    """No GPU here: NVML is faked at the library boundary (pynvml) to check the tick and /metrics."""
    fake_pynvml(monkeypatch)
    svc = fake_service("cuda:0")
    tick = NativeRuns(svc).tick("alice")
    assert tick["utilisation"]["label"] == "GPU utilisation (NVML)" and tick["utilisation"]["value"] == 0.73
    assert tick["memory"] == {"label": "GPU memory (NVML)", "used_bytes": 3 << 30, "total_bytes": 80 << 30}
    assert tick["engine_busy"] == 0.0 and tick["queue_depth"] == 3
    assert tick["queue_wait_s"] == {"p50": None, "p99": None, "ops": 0}  # nothing ran in the window

    from prometheus_client import generate_latest

    from openrl_service.telemetry import NvmlReader

    text = generate_latest(EngineCollector(svc, NvmlReader.for_device("cuda:0"), None)).decode()
    value = {s.name: s.value for f in families(text).values() for s in f.samples if not s.labels}
    assert (
        value["openrl_gpu_utilisation_ratio"] == 0.73 and value["openrl_gpu_memory_total_bytes"] == 80 << 30
    )

    cpu = fake_service("cpu")
    assert NativeRuns(cpu).tick("alice")["utilisation"]["label"] == "engine busy"  # never "GPU" off a GPU
