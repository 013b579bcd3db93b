"""Pause / resume / stop through the server extension (the panel's buttons), for a notebook run and a
Tinker-SDK run: relayed to the service's run control, announced on the relayed event stream, and a
stopped SDK run's next operation refused by the service."""

from __future__ import annotations

import json

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY, TINY


def control(http: httpx.Client, run_id: str, action: str, reason: str | None = None) -> httpx.Response:
    return http.post(f"openrl/runs/{run_id}/control", json={"action": action, "reason": reason})


def next_control_event(lines, run_id: str) -> dict:
    """Read the relayed stream until the service announces a control change of ``run_id``."""
    for line in lines:
        if line.startswith("data:"):
            data = json.loads(line[5:])
            if data.get("event") == "control" and data.get("run_id") == run_id:
                return data["control"]
    raise AssertionError("the event stream ended before the control event")


@pytest.fixture
def notebook_run(server):
    with server.client(ALICE_KEY) as http:
        run_id = http.post("/openrl/v1/runs", json={"name": "panel-control", "rank": 4}).json()["run_id"]
        yield run_id
        http.delete(f"/openrl/v1/runs/{run_id}")


def test_pause_resume_stop_a_notebook_run_from_the_panel(alice_jupyter, server, notebook_run):
    with alice_jupyter.client() as http, http.stream("GET", "openrl/events") as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        r = control(http, notebook_run, "pause", "from the test")
        assert r.status_code == 200, r.text
        assert r.json()["run_id"] == notebook_run
        assert r.json()["control"]["state"] == "pause_requested"
        assert r.json()["control"]["reason"] == "from the test"
        assert next_control_event(lines, notebook_run)["state"] == "pause_requested"
        assert control(http, notebook_run, "resume").json()["control"]["state"] == "running"
        assert next_control_event(lines, notebook_run)["state"] == "running"
        stopped = control(http, notebook_run, "stop").json()["control"]
        assert stopped["state"] == "stop_requested"
        assert stopped["reason"] == "stopped from the panel"
        announced = next_control_event(lines, notebook_run)
        assert (announced["state"], announced["reason"]) == ("stop_requested", "stopped from the panel")
        listed = {r["run_id"]: r for r in http.get("openrl/runs").json()["runs"]}
        assert listed[notebook_run]["kind"] == "notebook"
        assert listed[notebook_run]["control"]["state"] == "stop_requested"
        bad = control(http, notebook_run, "halt")
    assert bad.status_code == 400
    assert "action must be one of pause, resume, stop" in bad.json()["error"]


def test_another_tenants_run_cannot_be_stopped(alice_jupyter, server):
    with server.client(BOB_KEY) as bob:
        run_id = bob.post("/openrl/v1/runs", json={"name": "bobs", "rank": 4}).json()["run_id"]
        try:
            with alice_jupyter.client() as http:
                r = control(http, run_id, "stop")
            assert r.status_code == 404
            assert r.json()["error"].startswith(f"openrl service at {server.url}: ")
            listed = {e["run_id"]: e for e in bob.get("/openrl/v1/runs?include=all").json()["runs"]}
            assert listed[run_id]["control"]["state"] == "running"
        finally:
            bob.delete(f"/openrl/v1/runs/{run_id}")


def test_stop_a_tinker_sdk_run_from_the_panel(alice_jupyter, server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=TINY, rank=4)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([11, 12, 13, 14, 15]),
            loss_fn_inputs={"target_tokens": [12, 13, 14, 15, 16], "weights": [1.0] * 5},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        run_id = tc.model_id
        with alice_jupyter.client() as http:
            listed = {e["run_id"]: e for e in http.get("openrl/runs").json()["runs"]}
            assert listed[run_id]["kind"] == "sdk"
            detail = http.get(f"openrl/runs/{run_id}")
            assert detail.status_code == 200, detail.text
            assert detail.json()["run"]["kind"] == "sdk"
            assert detail.json()["metrics"] == []
            r = control(http, run_id, "stop", "enough from the panel")
            assert r.status_code == 200, r.text
            assert r.json()["control"]["state"] == "stopped"
        with pytest.raises(Exception, match="enough from the panel") as refused:
            tc.forward_backward([datum], "cross_entropy").result()
        assert run_id in str(refused.value)
    finally:
        sc.close("success").result()
