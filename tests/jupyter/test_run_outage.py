"""A notebook Run rides through a service that is unavailable for a while: it says so in its log (the
dashboard's) and carries on by itself when the service answers again, without pausing or failing."""

from __future__ import annotations

import itertools
import threading

from openrl_jupyter import AsyncClient
from openrl_jupyter import session as sess
from openrl_jupyter.run import RunState
from openrl_service.lifecycle import State
from tests.conftest import ALICE_KEY

PROMPTS = ["Name a colour:", "Say hello:", "Write a word:", "A city you like:"]
GUARD_S = 120  # hang guards only


def test_a_run_retries_through_a_draining_service_and_continues_when_it_takes_work_again(make_server):
    live = make_server()
    lifecycle = live.server.config.app.state.lifecycle
    s = sess.connect(live.url, token=ALICE_KEY, name="outage")
    s._aclient = AsyncClient(live.url, token=ALICE_KEY, retries=0)  # the Run's own retry, not the client's
    counter = itertools.count()
    draining, retrying, subscribed = threading.Event(), threading.Event(), threading.Event()
    states, logs = [], []

    def reward(prompt, completion, **info):
        assert subscribed.wait(GUARD_S)  # every event is heard
        value = float(next(counter))  # distinct rewards: every step trains
        if value == 8 and not draining.is_set():  # step 2's first sample is scored: its update is next
            lifecycle.state = State.DRAINING  # new work is refused with 503 + Retry-After, as on SIGTERM
            draining.set()
        return value

    def listen(event: dict) -> None:
        if event["kind"] == "state":
            states.append(event["state"])
        elif event["kind"] == "log":
            logs.append(event["text"])
            if "service unavailable — retrying" in event["text"]:
                retrying.set()

    try:
        run = s.train(reward=reward, prompts=PROMPTS, steps=3, batch=2, group=4, max_tokens=8)
        run.subscribe(listen)
        subscribed.set()
        assert retrying.wait(GUARD_S), logs
        assert run.step == 1 and run.state == RunState.RUNNING
        assert s.client.get_run(run.run_id)["step"] == 1  # step 2's update was refused, not applied
        lifecycle.state = State.READY  # the service takes work again
        run.wait(GUARD_S)

        assert run.state == RunState.FINISHED
        assert [r["step"] for r in run.history] == [1, 2, 3] and all(r["trained"] for r in run.history)
        assert s.client.get_run(run.run_id)["step"] == 3  # one update per step: none lost, none twice
        assert "paused" not in states and "failed" not in states
        retried = next(t for t in logs if "service unavailable — retrying" in t)
        assert retried.startswith("step 2:") and "shutting down" in retried
        assert "step 2: the service is back; continuing" in logs
    finally:
        lifecycle.state = State.READY
        for run in s.runs.values():
            run.stop()
            run.wait(GUARD_S)
        sess.disconnect("outage")
