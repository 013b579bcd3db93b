"""Big models on one box (issue 37), proven on the tiny model: the memory accountant reads a container's
limit, an op that runs out of memory fails alone, moving a run or writing a snapshot never stalls the
HTTP side, ``/healthz`` fails only for a wedged worker, snapshots rewrite only what changed, results
are held to a byte budget, and a ``kill -9`` in the middle of a spill or of a snapshot recovers
exactly. ``make bench-scale`` proves the same at ~180M parameters under a container memory limit."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
import tinker
import torch

from openrl_service import memory
from openrl_service.engine.futures import FutureStore
from openrl_service.errors import Gone
from tests.conftest import ALICE_KEY, BOB_KEY, start_server
from tests.service.test_full_finetune import TEXT, datum, footprint, solo_run, step
from tests.service.test_shutdown import wait_for

FULL = {"base_model": "openrl/tiny", "rank": 0, "seed": 0}
LORA = {"base_model": "openrl/tiny", "rank": 4, "seed": 1}


# -- the accountant ----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_room_is_the_container_limit_less_its_use_when_that_is_lower(tmp_path, version):
    """cgroup files as a pod's container sees them (v1 on this host, v2 on GKE): the limit less the
    working set (in use less the inactive page cache, as the kubelet counts it), not the node's
    available memory; no limit file, the OS's figure."""
    root = tmp_path / "cgroup"
    if version == "v1":
        (root / "memory").mkdir(parents=True)
        (root / "memory" / "memory.limit_in_bytes").write_text(f"{6 << 30}\n")
        (root / "memory" / "memory.usage_in_bytes").write_text(f"{(1 << 30) + 4096}\n")
        (root / "memory" / "memory.stat").write_text("cache 999\ntotal_inactive_file 4096\n")
    else:
        root.mkdir()
        (root / "memory.max").write_text(f"{6 << 30}\n")
        (root / "memory.current").write_text(f"{(1 << 30) + 4096}\n")
        (root / "memory.stat").write_text("anon 12345\ninactive_file 4096\n")
    room, source = memory.host_room(64 << 30, root)
    assert room == 5 << 30 and "container limit 6.00 GiB" in source
    assert memory.host_room(2 << 30, root) == (2 << 30, "available memory")  # the lower one wins
    unlimited = tmp_path / "none"
    (unlimited / "memory").mkdir(parents=True)
    (unlimited / "memory" / "memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")  # v1: no limit
    assert memory.container_limit(unlimited) is None
    assert memory.host_room(64 << 30, unlimited) == (64 << 30, "available memory")


def test_deferred_tensors_are_made_one_at_a_time_as_the_file_is_written(tmp_path):
    """A merged export's weights (base + B @ A) are made when the writer reaches each one and dropped
    once written: one merged weight in memory at a time, never the merged model."""
    import gc
    import weakref

    from safetensors.torch import load_file

    from openrl_service.storage.tensorfile import Deferred, write_tensors

    alive: list[weakref.ref] = []
    most = 0

    def make(i: int) -> torch.Tensor:
        nonlocal most
        gc.collect()
        most = max(most, sum(1 for r in alive if r() is not None) + 1)
        t = torch.full((64, 64), float(i))
        alive.append(weakref.ref(t))
        return t

    tensors = {f"w{i}": Deferred((64, 64), torch.float32, lambda i=i: make(i)) for i in range(6)}
    write_tensors(tmp_path / "m.safetensors", tensors)
    back = load_file(tmp_path / "m.safetensors")
    assert [float(back[f"w{i}"][0, 0]) for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert most == 1, f"{most} made tensors were alive at once"
    wrong = {"w": Deferred((2, 2), torch.float32, lambda: torch.zeros(3))}
    with pytest.raises(ValueError, match="declared"):  # the header promised another shape
        write_tensors(tmp_path / "bad.safetensors", wrong)
    assert not list(tmp_path.glob("bad.safetensors*"))


def test_the_plan_is_published_and_is_the_full_runs_share(tmp_path, tiny_model_dir):
    live = start_server(tmp_path / "d", tiny_model_dir)
    try:
        trainer = live.service.models["openrl/tiny"].trainer
        plan = trainer.memory_plan
        assert plan.room and set(plan.parts) == {
            "activations",
            "sampling",
            "sampler_snapshots",
            "moves",
            "margin",
        }
        assert plan.full_runs == plan.room - sum(plan.parts.values()) == trainer.residency.budget
        text = httpx.get(f"{live.url}/metrics", timeout=10).text
        from prometheus_client.parser import text_string_to_metric_families

        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "openrl_memory_bytes"]
        published = {s.labels["part"]: s.value for s in family.samples}
        assert published == {**plan.parts, "room": plan.room, "full_runs": plan.full_runs}
    finally:
        live.stop()


# -- out of memory -----------------------------------------------------------------------------------
def test_an_op_out_of_memory_fails_alone_and_every_other_tenant_is_served(tmp_path, tiny_model_dir):
    """torch.OutOfMemoryError inside alice's forward_backward (injected: the model raises it while her
    run's weights are in use): her op fails with a 413 saying what to change, nothing of it is applied
    (her next steps equal a run that never failed), bob's run trains meanwhile, the service is healthy."""
    solo = start_server(tmp_path / "solo", tiny_model_dir, fusion=False)
    try:
        want, _ = solo_run(solo, 3)
    finally:
        solo.stop()
    live = start_server(tmp_path / "d", tiny_model_dir, fusion=False)
    try:
        base = live.service.models["openrl/tiny"].base
        alice = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY).create_lora_training_client(**FULL)
        bob = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY).create_lora_training_client(**LORA)
        victim = next(r for r in live.service.runs.values() if r.tenant == "alice").state.adapter
        layer = base.model.model.layers[1]
        name = "model.layers.1.mlp.up_proj.weight"
        slot_module, slot_attr = base.router.slots[name][0]
        fired = []

        def oom(module, args):  # alice's weights are in the model's slots: her op is running
            if slot_module._parameters[slot_attr] is victim.weights[name] and not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")

        hook = layer.register_forward_pre_hook(oom)
        try:
            failed = alice.forward_backward([datum(TEXT[0])], "cross_entropy")
            with pytest.raises(
                Exception, match=r"ran out of memory and was not applied.*OPENRL_MICROBATCH_TOKENS"
            ):
                failed.result()
            assert fired == [1]
            assert step(bob, 0) > 0  # the neighbour is served
        finally:
            hook.remove()
        assert httpx.get(f"{live.url}/healthz", timeout=5).status_code == 200
        got = [step(alice, k) for k in range(3)]
        assert got == want  # the failed call left no gradient behind
    finally:
        live.stop()


# -- no stalls ---------------------------------------------------------------------------------------
def test_a_spill_holds_no_lock_the_http_side_waits_on(tmp_path, tiny_model_dir, monkeypatch):
    """While the worker is in the middle of writing a full run to disk (held there), /metrics,
    /healthz and /readyz answer, another tenant's session is created and finished, and the run
    moved out comes back exactly."""
    import openrl_service.training.full as full

    real = full.write_tensors
    inside, release = threading.Event(), threading.Event()

    def held(path, tensors, *, progress=None, **kw):
        def tick(i):
            if progress is not None:
                progress(i)
            if i == 1 and not inside.is_set():
                inside.set()
                release.wait(60)

        return real(path, tensors, progress=tick, **kw)

    monkeypatch.setattr(full, "write_tensors", held)
    solo = start_server(tmp_path / "solo", tiny_model_dir, fusion=False)
    try:
        want_a, _ = solo_run(solo, 2)
    finally:
        solo.stop()
    live = start_server(
        tmp_path / "d",
        tiny_model_dir,
        fusion=False,
        full_run_budget_bytes=int(footprint(tiny_model_dir) * 1.5),
    )
    try:
        sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
        a = sc.create_lora_training_client(**FULL)
        got_a = [step(a, 0)]
        b = sc.create_lora_training_client(**FULL)  # room for one: a is written out for b
        assert inside.wait(60), "no spill began"
        for path in ("/metrics", "/healthz", "/readyz"):
            assert httpx.get(f"{live.url}{path}", timeout=5).status_code == 200, path
        other = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)  # a new session...
        other.close("success").result()  # ...and its end (the registry's lock; never the spill's)
        running = live.service.engine.current
        assert running is not None and running.kind == "create_model"  # all that while the spill was held
        release.set()
        got_a.append(step(a, 1))
        assert step(b, 0) == want_a[0]
        assert got_a == want_a
        assert live.service.models["openrl/tiny"].trainer.residency.status()["bytes"]["out_disk"] > 0
    finally:
        release.set()
        live.stop()


def test_checkpoint_loads_are_hashed_off_the_device_worker(tmp_path, tiny_model_dir, monkeypatch):
    """A full run's checkpoint is the model's size: its SHA-256 is checked on the request's pool
    thread before the load is queued, so the worker, which every tenant's ops wait for, only reads it
    (a training client from state with its optimizer, a sampler on a checkpoint, the OpenAI endpoint)."""
    from openrl_service.storage import checkpoint_read

    where: list[str] = []
    real = checkpoint_read.check_digest

    def watched(f, want, name, ref):
        where.append(threading.current_thread().name)
        return real(f, want, name, ref)

    monkeypatch.setattr(checkpoint_read, "check_digest", watched)
    live = start_server(tmp_path / "d", tiny_model_dir)
    try:
        sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
        tc = sc.create_lora_training_client(**FULL).result()
        before = step(tc, 0)
        saved = tc.save_state("mid").result().path
        for_sampler = tc.save_weights_for_sampler("s").result().path
        where.clear()
        again = sc.create_training_client_from_state_with_optimizer(saved).result()
        assert step(again, 1) == pytest.approx(step(tc, 1), rel=1e-6)  # the same state, optimizer included
        sampler = sc.create_sampling_client(model_path=for_sampler)
        prompt = tinker.types.ModelInput.from_ints([1, 2, 3])
        params = tinker.types.SamplingParams(max_tokens=2, seed=1)
        assert len(sampler.sample(prompt, 1, params).result().sequences) == 1
        with httpx.Client(base_url=live.url, headers={"X-API-Key": ALICE_KEY}, timeout=60) as http:
            r = http.post(
                "/oai/api/v1/completions", json={"model": for_sampler, "prompt": [1, 2], "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
        assert where, "no checkpoint was hashed: the test watched nothing"
        assert "openrl-device-worker" not in where, where
        assert before > 0
        sc.close("success").result()
    finally:
        live.stop()


def test_healthz_fails_only_when_the_worker_makes_no_progress_with_work_waiting(tmp_path, tiny_model_dir):
    live = start_server(tmp_path / "d", tiny_model_dir, health_stall_s=1.0)
    try:
        assert httpx.get(f"{live.url}/healthz", timeout=5).status_code == 200
        time.sleep(1.5)
        assert httpx.get(f"{live.url}/healthz", timeout=5).status_code == 200  # idle is not stalled
        wedged = threading.Event()
        live.service.engine.run_exclusive(lambda: wedged.wait(30))  # the worker hangs (a deadlock)
        tc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY).create_lora_training_client
        waiting = threading.Thread(target=lambda: tc(**LORA), daemon=True)
        waiting.start()
        # the SDK's session and its create_model reach the queue, then the stall limit (1 s) passes
        r = wait_for(
            lambda: (h := httpx.get(f"{live.url}/healthz", timeout=5)).status_code != 200 and h,
            "/healthz to fail with the worker wedged",
            30,
        )
        assert live.service.engine.has_work()
        assert (
            r.status_code == 503 and "no progress" in r.json()["status"] and "OPENRL_HEALTH_STALL_S" in r.text
        )
        wedged.set()
        waiting.join(30)
        assert httpx.get(f"{live.url}/healthz", timeout=5).status_code == 200
    finally:
        live.stop()


# -- snapshots ---------------------------------------------------------------------------------------
def test_a_snapshot_rewrites_only_the_runs_that_changed(tmp_path, tiny_model_dir):
    live = start_server(tmp_path / "d", tiny_model_dir, snapshot_interval_s=0)
    try:
        sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
        idle = sc.create_lora_training_client(**LORA)
        busy = sc.create_lora_training_client(**FULL)
        step(idle, 0)
        step(busy, 0)
        idle.save_weights_and_get_sampling_client().result()  # a sampler snapshot: its file is written once
        durability = live.service.durability

        def snapshot() -> set[str]:
            fut = asyncio.run_coroutine_threadsafe(durability.snapshot("test"), live.service.futures.loop)
            assert fut.result(60)
            return {p.name for p in (live.data_dir / "journal").glob("run-*.tensors")}

        first = snapshot()
        assert len(first) == 2 and len(list((live.data_dir / "journal").glob("sampler-*.tensors"))) == 1
        journal = live.data_dir / "journal"
        assert all((journal / name).stat().st_mode & 0o777 == 0o600 for name in first)
        step(busy, 1)
        second = snapshot()
        assert len(second) == 2 and len(first & second) == 1  # the idle run's file is kept as it was
        written = durability.files.written
        third = snapshot()
        assert third == second and durability.files.written == written  # nothing changed, nothing written
        assert not (journal / next(iter(first - second))).exists()  # a file no snapshot names is gone
        want = tensors_of(live.service)
    finally:
        live.stop()
    # restored from snapshots that referred to files again: the runs and the sampler as they were
    again = start_server(tmp_path / "d", tiny_model_dir, snapshot_interval_s=0)
    try:
        got = tensors_of(again.service)
        assert got.keys() == want.keys() and len({k[1] for k in got if k[0] == "sampler"}) == 1
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        again.stop()


def tensors_of(svc) -> dict[tuple, torch.Tensor]:
    """Every run's and sampler snapshot's weights, by (kind, id, name), read where they are."""
    out = {}
    for run in svc.runs.values():
        run.state.adapter.ensure_resident()
        for n, t in run.state.adapter.named_parameters():
            out[("run", run.run_id, n)] = t.detach().clone()
    for e in svc.samplers.values():
        if e.adapter is not None:
            e.adapter.ensure_resident()
            for n, t in e.adapter.named_parameters():
                out[("sampler", e.sampler_id, n)] = t.detach().clone()
    return out


# -- results -----------------------------------------------------------------------------------------
def test_results_are_held_to_a_byte_budget_oldest_fetched_first():
    store = FutureStore(ttl_s=3600, max_bytes=(3 << 20) + 4096)  # three results and their keys
    recs = []
    for _ in range(5):
        rec = store.new("alice", "forward")
        store.complete(rec, result={"logprobs": np.zeros(1 << 18, dtype=np.float32)})  # 1 MiB each
        recs.append(rec)
    recs[3].fetched = True
    gone = store.sweep()
    assert store.held_bytes <= (3 << 20) + 4096
    assert [r.request_id for r in gone] == [recs[3].request_id, recs[0].request_id]  # fetched first
    with pytest.raises(Gone, match="OPENRL_MAX_RESULT_BYTES"):
        store.get("alice", recs[0].request_id)
    assert store.get("alice", recs[4].request_id).result is not None


# -- kill -9 in the middle of moving gigabytes ------------------------------------------------------
@pytest.mark.parametrize("point", ["spill_write", "snapshot_write"])
def test_kill_9_in_the_middle_of_a_spill_or_a_snapshot_recovers_exactly(point, tmp_path, tiny_model_dir):
    """Two full runs taking turns (room for one), snapshots every 0.3 s; the service kills itself half
    way through writing a run's tensors (its spill file, or its snapshot file), is restarted, and both
    runs end bit-identical to runs never interrupted."""
    from tests._support.serve import finish, start, wait_ready

    solo = start_server(tmp_path / "solo", tiny_model_dir, fusion=False)
    try:
        want_a, _ = solo_run(solo, 5)
        want_b, _ = solo_run(solo, 5, offset=1)
    finally:
        solo.stop()
    data = tmp_path / "d"
    data.mkdir()
    marker = tmp_path / "crashed"
    env = {
        "OPENRL_API_KEYS": f"alice:{ALICE_KEY}",
        "OPENRL_FUSION": "off",
        "OPENRL_FULL_RUN_BUDGET_BYTES": str(int(footprint(tiny_model_dir) * 1.5)),
        "OPENRL_SNAPSHOT_INTERVAL_S": "0.3",
    }
    served = start(
        data, tiny_model_dir, env=env | {"OPENRL_CRASH_AT": f"{point}:3", "OPENRL_CRASH_MARKER": str(marker)}
    )
    port = int(served.url.rsplit(":", 1)[1])
    got: dict[str, list[float]] = {}
    try:
        wait_ready(served)
        sc = tinker.ServiceClient(base_url=served.url, api_key=ALICE_KEY)
        a = sc.create_lora_training_client(**FULL)
        b = sc.create_lora_training_client(**FULL)

        def loop():  # the SDK's retries carry a call the kill cuts through the restart
            got_a, got_b = got.setdefault("a", []), got.setdefault("b", [])
            for k in range(5):
                got_a.append(step(a, k))
                got_b.append(step(b, k + 1))
                time.sleep(0.35)  # a snapshot between steps

        clients = threading.Thread(target=loop, daemon=True)
        clients.start()
        assert finish(served, 120) == -9, served.stderr[-3000:]
        assert marker.read_text() == point
        (data / "tmp" / "left-by-the-killed-one").write_text("x")
        served = start(data, tiny_model_dir, env=env, port=port)
        wait_ready(served)
        # serve's temporary files go under the data dir (never a memory-backed /tmp), emptied at start
        assert (data / "tmp").stat().st_mode & 0o777 == 0o700 and not list((data / "tmp").iterdir())
        clients.join(240)
        assert not clients.is_alive()
        assert got["a"] == want_a and got["b"] == want_b
        sc.close("success").result()
        assert not list((data / "spill").glob("*.safetensors"))
    finally:
        if served.proc.poll() is None:
            served.proc.terminate()
            finish(served)
