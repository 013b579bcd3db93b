"""A notebook Run controlled from outside its kernel (the side panel's POST /openrl/v1/runs/{id}/control,
sent here by another client of the same tenant): it pauses at its next step, resumes, and stops with
"stopped from the panel"; the service's runs list shows what the kernel reported."""

from __future__ import annotations

import threading
import time

import pytest

from openrl_jupyter import NotFoundError
from openrl_jupyter import session as sess
from openrl_jupyter.client import Client
from openrl_jupyter.rewards import registry
from openrl_jupyter.run import RunState
from tests._support.runs import PROMPTS, SMALL, forget_runs, letters
from tests.conftest import ALICE_KEY, BOB_KEY


@pytest.fixture
def session(server):
    s = sess.connect(server.url, token=ALICE_KEY, name="control")
    yield s
    forget_runs(s)
    sess.disconnect("control")


@pytest.fixture
def panel(server):
    """Another client of the same tenant: what the Jupyter server extension sends for the panel."""
    with Client(server.url, token=ALICE_KEY) as c:
        yield c


def wait_until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def listed(panel: Client, run_id: str) -> dict:
    return next(e for e in panel.list_runs(include="all") if e["run_id"] == run_id)


def test_the_panel_pauses_resumes_and_stops_a_run_in_the_kernel(session, panel):
    name = f"panel_{time.monotonic_ns()}"
    registry.register(name, letters)
    run = session.train(reward=name, prompts=PROMPTS, steps=200, **SMALL)
    logs: list[str] = []
    run.subscribe(lambda e: logs.append(e["text"]) if e.get("kind") == "log" else None)
    wait_until(lambda: run.step >= 1, what="the first step")
    entry = listed(panel, run.run_id)
    assert entry["kind"] == "notebook" and entry["steps"] == 200 and entry["state"] == "running"
    assert entry["last_reward"] is not None and entry["orphaned"] is False

    assert panel.control(run.run_id, "pause")["control"]["state"] == "pause_requested"
    wait_until(lambda: run.state == RunState.PAUSED, what="the run to pause at its next step")
    held = run.step
    wait_until(
        lambda: listed(panel, run.run_id)["control"]["state"] == "paused",
        what="the kernel's report of the pause",
    )
    assert listed(panel, run.run_id)["state"] == "paused"
    time.sleep(1.5)  # it polls the service while paused: still held
    assert run.step == held and run.state == RunState.PAUSED
    assert "paused from the panel" in logs

    panel.control(run.run_id, "resume")
    wait_until(lambda: run.step >= held + 1, what="a step after the panel's resume")
    assert "resumed from the panel" in logs

    panel.control(run.run_id, "stop")
    wait_until(lambda: run.done, what="the run to stop")
    assert run.state == RunState.STOPPED and run.stop_reason == "stopped from the panel"
    assert run.step < 200 and [r["step"] for r in run.history] == list(range(1, run.step + 1))
    assert "stopped from the panel" in logs
    wait_until(
        lambda: listed(panel, run.run_id)["control"]["state"] == "stopped",
        what="the kernel's report of the stop",
    )
    assert listed(panel, run.run_id)["state"] == "stopped"
    assert run.save("after-panel-stop").endswith("/weights/after-panel-stop")  # its weights stay usable


def test_a_run_paused_in_the_notebook_is_stopped_from_the_panel_with_its_reason(session, panel, server):
    name = f"panel_reason_{time.monotonic_ns()}"
    release = threading.Event()

    def gated(prompt, completion, **info):
        assert release.wait(60)
        return letters(prompt, completion)

    registry.register(name, gated)
    run = session.train(reward=name, prompts=PROMPTS, steps=50, **SMALL)
    run.pause()
    release.set()
    run.pause(wait=True, timeout=60)
    wait_until(lambda: listed(panel, run.run_id)["state"] == "paused", what="the reported pause")
    with Client(server.url, token=BOB_KEY) as bob, pytest.raises(NotFoundError, match="unknown run"):
        bob.control(run.run_id, "stop")  # another tenant's run: 404
    assert run.state == RunState.PAUSED
    panel.control(run.run_id, "stop", reason="reward is flat")
    wait_until(lambda: run.done, what="the paused run to stop")
    assert run.state == RunState.STOPPED
    assert run.stop_reason == "stopped from the panel: reward is flat"


def test_run_stop_in_the_notebook_says_so(session):
    name = f"nb_stop_{time.monotonic_ns()}"
    registry.register(name, letters)
    run = session.train(reward=name, prompts=PROMPTS, steps=50, **SMALL)
    run.stop(wait=True, timeout=60)
    assert run.state == RunState.STOPPED and run.stop_reason == "stopped in the notebook (run.stop())"


REWARD = """%%openrl reward rc_letters
def reward(prompt, completion, **info):
    return sum(c.isalpha() for c in completion) / max(1, len(completion))
"""


def test_the_panel_stops_a_run_while_its_kernel_is_busy_in_a_cell(server, panel):
    """A real ipykernel, busy in ``run.wait()``: the stop comes from outside (the panel's request)
    and the waiting cell returns with the run stopped "from the panel"."""
    from tests._support.kernel import Kernel

    with Kernel(env={"OPENRL_URL": server.url, "OPENRL_TOKEN": ALICE_KEY}) as k:
        k.execute("%load_ext openrl_jupyter\n%openrl connect", timeout=60)
        k.execute("P = ['Say hi:', 'Name a colour:']")
        assert "reward rc_letters v1 registered" in k.execute(REWARD).stdout
        k.execute(
            "run = %openrl train --reward rc_letters --prompts P --steps 500 --batch 2 --group 4 "
            "--max-tokens 8 --name rc-kernel",
            timeout=30,
        )
        run_id = k.execute("print(run.run_id)").stdout.strip()
        sent: list[dict] = []

        def stop_once_stepping() -> None:
            wait_until(lambda: listed(panel, run_id)["step"] >= 1, what="the kernel's run to step")
            sent.append(panel.control(run_id, "stop"))

        stopper = threading.Thread(target=stop_once_stepping, daemon=True)
        stopper.start()
        out = k.execute("run.wait(120)\nprint(run.state, '|', run.stop_reason, '|', run.step)", timeout=150)
        stopper.join(60)
        state, reason, step = (part.strip() for part in out.stdout.split("|"))
        assert (state, reason) == ("stopped", "stopped from the panel") and 1 <= int(step) < 500
        assert sent and sent[0]["control"]["state"] in ("stop_requested", "stopped")
        wait_until(lambda: listed(panel, run_id)["state"] == "stopped", what="the kernel's report")
        assert listed(panel, run_id)["control"]["state"] == "stopped"
        k.execute("run.session.client.delete_run(run.run_id)", timeout=60)  # the shared server's quota


def test_a_stop_asked_with_a_magic_says_so_and_still_counts_as_a_stop_from_outside():
    """%openrl stop on a detached run sends its own reason: the run's log and the job's end say
    "stopped with %openrl stop", not "stopped from the panel"; the job still ends as stopped."""
    from openrl_jupyter.run_state import from_panel, stopped_from_outside

    assert from_panel("stopped", "stopped with %openrl stop") == "stopped with %openrl stop"
    assert from_panel("stopped", None) == "stopped from the panel"
    assert from_panel("stopped", "reward is flat") == "stopped from the panel: reward is flat"
    assert stopped_from_outside("stopped with %openrl stop") and stopped_from_outside(
        "stopped from the panel"
    )
    assert not stopped_from_outside("finished") and not stopped_from_outside(None)
