"""Run control (/openrl/v1/runs?include=all, /runs/{id}/control): the side panel's view of every run
of a tenant, notebook and Tinker SDK, and its pause / resume / stop; a stopped SDK run's next op is
refused with a message naming the run and the reason, as the real tinker SDK shows it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY, TINY, start_server

V1 = "/openrl/v1"


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def train_step(tc) -> float:
    fb = tc.forward_backward([datum([11, 12, 13, 14, 15, 16])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return fb.result().metrics["loss:sum"]


def entry(client: httpx.Client, run_id: str, include: str | None = "all") -> dict | None:
    r = client.get(f"{V1}/runs", params={"include": include} if include else None)
    assert r.status_code == 200, r.text
    return next((e for e in r.json()["runs"] if e["run_id"] == run_id), None)


def control(client: httpx.Client, run_id: str, action: str, reason: str | None = None) -> httpx.Response:
    body = {"action": action, **({"reason": reason} if reason else {})}
    return client.post(f"{V1}/runs/{run_id}/control", json=body)


class EventReader:
    """The tenant's SSE stream read on a thread (the service ticks every second, so reads never hang)."""

    def __init__(self, url: str, key: str):
        self.events: list[dict] = []
        self._stop = threading.Event()
        self._open = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, key), daemon=True)
        self._thread.start()
        assert self._open.wait(30), "the event stream did not open"

    def _read(self, url: str, key: str) -> None:
        with (
            httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=30) as c,
            c.stream("GET", f"{V1}/events") as r,
        ):
            self._open.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event.get("type") == "run":
                        self.events.append(event)
                if self._stop.is_set():
                    return

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if predicate(e):
                    return e
            time.sleep(0.05)
        raise AssertionError(f"no such event within {timeout} s; got {self.events}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as c:
        yield c


def test_an_sdk_run_is_listed_and_stopping_it_refuses_its_next_op_until_resumed(
    server, alice, service_client
):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=0)
    run_id = tc.model_id
    first_loss = train_step(tc)
    sampler = tc.save_weights_and_get_sampling_client("rc-before-stop")

    assert entry(alice, run_id, include=None) is None  # without include=all: notebook runs only
    listed = entry(alice, run_id)
    assert listed["kind"] == "sdk" and listed["base_model"] == TINY and listed["lora_rank"] == 8
    assert listed["step"] == 1 and listed["steps"] is None and listed["state"] == "active"
    assert listed["control"]["state"] == "running" and listed["control"]["reason"] is None
    assert listed["last_loss"] == pytest.approx(first_loss, rel=1e-5)
    deadline = time.monotonic() + 10  # the op's record is written as it ends: poll briefly
    while entry(alice, run_id)["share"] == 0.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 0.0 < entry(alice, run_id)["share"] <= 1.0  # it used the device within the last minute
    assert time.time() - listed["last_activity"] < 60 and listed["orphaned"] is False
    one = alice.get(f"{V1}/runs/{run_id}").json()  # one run, as listed
    assert one["kind"] == "sdk" and one["step"] == 1 and one["run_id"] == run_id
    assert alice.get(f"{V1}/runs/{run_id}/metrics").json() == {"metrics": []}

    events = EventReader(server.url, ALICE_KEY)
    try:
        stopped = control(alice, run_id, "stop", "too slow")
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["control"]["state"] == "stopped" and stopped.json()["state"] == "stopped"
        assert stopped.json()["control"]["reason"] == "too slow"
        announced = events.wait_for(lambda e: e.get("event") == "control" and e["run_id"] == run_id)
        assert announced["control"]["state"] == "stopped" and announced["control"]["reason"] == "too slow"
    finally:
        events.close()

    # The user's next call through the Tinker SDK fails with the run and the reason.
    with pytest.raises(tinker.RequestFailedError) as refused:
        tc.forward_backward([datum([11, 12, 13, 14])], "cross_entropy").result()
    message = str(refused.value)
    assert f"training run {run_id} was stopped from the panel: too slow" in message
    assert "resume" in message
    with pytest.raises(tinker.RequestFailedError, match=f"training run {run_id} was stopped"):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    with pytest.raises(tinker.RequestFailedError, match=f"training run {run_id} was stopped"):
        tc.save_state("rc-after-stop").result()
    params = types.SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(tinker.RequestFailedError, match=f"training run {run_id} was stopped"):
        sampler.sample(types.ModelInput.from_ints([11, 12]), 1, params).result()
    assert entry(alice, run_id)["step"] == 1  # nothing ran

    resumed = control(alice, run_id, "resume")
    assert resumed.status_code == 200 and resumed.json()["control"]["state"] == "running"
    assert resumed.json()["state"] == "active"
    train_step(tc)  # the SDK's later seq_ids follow the refused ones: the lane did not wait on a gap
    assert entry(alice, run_id)["step"] == 2
    assert len(sampler.sample(types.ModelInput.from_ints([11, 12]), 1, params).result().sequences) == 1


def test_pause_refuses_an_sdk_run_with_its_default_reason(alice, service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=1)
    paused = control(alice, tc.model_id, "pause")
    assert paused.json()["control"] == {
        "state": "paused",
        "reason": "paused from the panel",
        "at": pytest.approx(time.time(), abs=30),
    }
    with pytest.raises(
        tinker.RequestFailedError, match=f"training run {tc.model_id} was paused from the panel;"
    ):
        tc.forward_backward([datum([11, 12, 13])], "cross_entropy").result()
    control(alice, tc.model_id, "resume")
    train_step(tc)


def test_bad_control_requests_name_the_field_and_other_tenants_get_404(server, alice, service_client):
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=2)
    run_id = tc.model_id
    r = control(alice, run_id, "explode")
    assert r.status_code == 400 and r.json()["field"] == "action"
    assert "pause, resume, stop" in r.json()["error"] and "'explode'" in r.json()["error"]
    r = alice.post(f"{V1}/runs/{run_id}/control", json={})
    assert r.status_code == 400 and r.json()["field"] == "action"
    r = control(alice, run_id, "stop", "x" * 201)
    assert r.status_code == 400 and r.json()["field"] == "reason" and "200" in r.json()["error"]
    r = alice.post(f"{V1}/runs/{run_id}/control", json={"action": "stop", "reason": 5})
    assert r.status_code == 400 and r.json()["field"] == "reason"
    r = alice.get(f"{V1}/runs", params={"include": "everything"})
    assert r.status_code == 400 and r.json()["field"] == "include"
    assert control(alice, "no-such-run", "stop").status_code == 404
    with server.client(BOB_KEY) as bob:
        assert control(bob, run_id, "stop").status_code == 404
        assert bob.get(f"{V1}/runs/{run_id}").status_code == 404
        assert bob.get(f"{V1}/runs/{run_id}/metrics").status_code == 404
        assert entry(bob, run_id) is None
    assert entry(alice, run_id)["control"]["state"] == "running"  # bob's attempts changed nothing


def test_a_notebook_run_reports_its_state_and_the_panel_control_follows_it(server, alice):
    created = alice.post(f"{V1}/runs", json={"name": "rc-notebook", "seed": 0, "steps": 40})
    assert created.status_code == 201, created.text
    run_id = created.json()["run_id"]
    try:
        listed = entry(alice, run_id, include=None)
        assert listed["kind"] == "notebook" and listed["name"] == "rc-notebook" and listed["steps"] == 40
        assert listed["state"] == "running" and listed["control"]["state"] == "running"
        assert listed["orphaned"] is False and listed["last_reward"] is None
        assert (
            alice.post(f"{V1}/runs/{run_id}/metrics", json={"step": 1, "reward_mean": 0.25}).status_code
            == 201
        )
        assert entry(alice, run_id)["last_reward"] == 0.25

        bad = alice.post(f"{V1}/runs/{run_id}/heartbeat", json={"state": "dancing"})
        assert bad.status_code == 400 and bad.json()["field"] == "state" and "paused" in bad.json()["error"]

        events = EventReader(server.url, ALICE_KEY)
        try:
            # pause: requested until the kernel says it paused
            assert control(alice, run_id, "pause").json()["control"]["state"] == "pause_requested"
            beat = alice.post(f"{V1}/runs/{run_id}/heartbeat", json={"state": "running"}).json()
            assert beat["control"]["state"] == "pause_requested"  # what the kernel's Run obeys
            beat = alice.post(f"{V1}/runs/{run_id}/heartbeat", json={"state": "paused"}).json()
            assert beat["state"] == "paused" and beat["control"]["state"] == "paused"
            events.wait_for(lambda e: e.get("event") == "state" and e["state"] == "paused")
            events.wait_for(lambda e: e.get("event") == "control" and e["control"]["state"] == "paused")
            # resume; then stop: requested until the kernel reports "stopped"
            assert control(alice, run_id, "resume").json()["control"]["state"] == "running"
            alice.post(f"{V1}/runs/{run_id}/heartbeat", json={"state": "running"})
            stop = control(alice, run_id, "stop").json()["control"]
            assert stop["state"] == "stop_requested" and stop["reason"] == "stopped from the panel"
            alice.post(f"{V1}/runs/{run_id}/heartbeat", json={"state": "stopped"})
            listed = entry(alice, run_id)
            assert listed["state"] == "stopped" and listed["control"]["state"] == "stopped"
            events.wait_for(lambda e: e.get("event") == "control" and e["control"]["state"] == "stopped")
        finally:
            events.close()
        r = control(alice, run_id, "resume")  # its kernel ended it: nothing to resume
        assert r.status_code == 409 and "cannot resume" in r.json()["error"]
        # a notebook run's ops are not refused by the service: its Run obeys in the kernel
        assert alice.post(f"{V1}/runs/{run_id}/checkpoints", json={"name": "rc-nb"}).status_code == 201
    finally:
        alice.delete(f"{V1}/runs/{run_id}")


def test_an_orphaned_notebook_run_is_listed_so_and_stops_at_once(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("OPENRL_ORPHAN_AFTER_S", "1")
    live = start_server(tmp_path / "data", tiny_model_dir)
    try:
        with live.client(ALICE_KEY) as alice:
            run_id = alice.post(f"{V1}/runs", json={"name": "rc-orphan", "seed": 0}).json()["run_id"]
            assert entry(alice, run_id)["orphaned"] is False
            time.sleep(1.5)  # no heartbeat, no request: its kernel is gone
            listed = entry(alice, run_id)
            assert listed["orphaned"] is True and listed["state"] == "running"
            stopped = control(alice, run_id, "stop").json()  # nobody to confirm: stopped now
            assert stopped["control"]["state"] == "stopped"
    finally:
        live.stop()


def test_control_state_survives_a_restart_with_the_journal(tmp_path, tiny_model_dir):
    live = start_server(tmp_path / "data", tiny_model_dir, durability="journal")
    try:
        sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
        tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=0)
        train_step(tc)
        with live.client(ALICE_KEY) as alice:
            assert control(alice, tc.model_id, "stop", "budget").status_code == 200
    finally:
        live.stop()
    live = start_server(tmp_path / "data", tiny_model_dir, durability="journal")
    try:
        with live.client(ALICE_KEY) as alice:
            listed = entry(alice, tc.model_id)
            assert listed["control"]["state"] == "stopped" and listed["control"]["reason"] == "budget"
            deadline = time.monotonic() + 30  # the replayed ops run on the worker after readyz
            while entry(alice, tc.model_id)["step"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            # the step acknowledged before the stop was replayed (not refused by the later stop)
            assert entry(alice, tc.model_id)["step"] == 1
    finally:
        live.stop()


@pytest.mark.parametrize("snapshots", [False, True], ids=["journal", "snapshot"])
def test_finished_and_stopped_runs_read_as_such_after_kill_9_and_a_restart(
    tmp_path, tiny_model_dir, snapshots
):
    """What a kernel reported of its run (finished, stopped, failed) is journaled with the panel's
    control: after a SIGKILL and a restart the runs list, the panel's buttons and the status bar's
    count (all read from it) say what they said before, from the journal or from a snapshot."""
    from tests._support.serve import finish, start, wait_ready

    env = {
        "OPENRL_API_KEYS": f"alice:{ALICE_KEY}",
        "OPENRL_SNAPSHOT_INTERVAL_S": "0.3" if snapshots else "0",
    }
    data = tmp_path / "d"
    data.mkdir()
    served = start(data, tiny_model_dir, env=env)
    try:
        wait_ready(served)
        with httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=60) as alice:
            ids = {}
            for name, final in (
                ("done", "finished"),
                ("halted", "stopped"),
                ("broke", "failed"),
                ("live", None),
            ):
                r = alice.post(f"{V1}/runs", json={"name": name, "seed": 0, "steps": 3})
                assert r.status_code == 201, r.text
                ids[name] = run_id = r.json()["run_id"]
                alice.post(f"{V1}/runs/{run_id}/heartbeat", json={"state": "running"})
                if name == "halted":  # stopped from the panel, confirmed by its kernel
                    assert control(alice, run_id, "stop").json()["control"]["state"] == "stop_requested"
                if final is not None:
                    assert (
                        alice.post(f"{V1}/runs/{run_id}/heartbeat", json={"state": final}).status_code == 200
                    )
            sc = tinker.ServiceClient(base_url=served.url, api_key=ALICE_KEY)
            sdk = sc.create_lora_training_client(base_model=TINY, rank=4, seed=0)
            assert control(alice, sdk.model_id, "stop").status_code == 200
            before = {
                e["run_id"]: (e["state"], e["control"]["state"])
                for e in alice.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]
            }
        assert before[ids["done"]] == ("finished", "running")
        assert before[ids["halted"]] == ("stopped", "stopped")
        assert before[ids["broke"]] == ("failed", "running")
        assert before[ids["live"]] == ("running", "running")
        assert before[sdk.model_id] == ("stopped", "stopped")
        if snapshots:
            deadline = time.monotonic() + 30
            while not list((data / "journal").glob("snap-*")) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # a snapshot after the last report
            assert list((data / "journal").glob("snap-*"))
        served.proc.kill()
        served.proc.wait()
        served = start(data, tiny_model_dir, env=env, port=int(served.url.rsplit(":", 1)[1]))
        wait_ready(served)
        with httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=60) as alice:
            deadline = time.monotonic() + 30  # notebook runs come back as their intents replay
            while True:
                after = {
                    e["run_id"]: (e["state"], e["control"]["state"])
                    for e in alice.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]
                }
                if set(before) <= set(after) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert {k: after.get(k) for k in before} == before
            running = [k for k, (state, _) in after.items() if state in ("running", "active")]
            assert running == [ids["live"]]  # what the status bar counts
            r = control(alice, ids["done"], "pause")
            assert r.status_code == 409 and "finished" in r.json()["error"]
    finally:
        served.proc.terminate()
        finish(served)
