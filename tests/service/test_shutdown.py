"""Graceful shutdown: on SIGTERM a real `openrl-service serve` drains and exits 0 within its grace.

While it drains, new work gets 503 + Retry-After and a JSON error saying the service is shutting down,
/readyz answers 503 with state "draining" (so Kubernetes stops routing to it) and /healthz stays 200;
every op it had accepted runs, and retrieve_future hands out the results (try_again in between, never
a 5xx). With a grace too short for its queue, it still exits in time: with the journal (the default)
what did not run is kept and runs after the restart, its clients' polls getting the results then;
with ``--durability none`` it answers a "service shut down" error instead of hanging.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests._support.raw import RawTinker, fb_body, sft_datum
from tests._support.serve import Served, cli, finish, serving
from tests.conftest import ALICE_KEY, free_port

EXIT_MARGIN_S = 15  # closing connections and the interpreter's exit, on a loaded 2-core machine
HANG_GUARD_S = 120


def datums(n: int, length: int):
    half = length // 2
    return [
        sft_datum([10 + (i + j) % 200 for j in range(half)], list(range(20, 20 + half))) for i in range(n)
    ]


def wait_for(condition, what: str, timeout_s: float = HANG_GUARD_S):
    """Poll ``condition()`` until it returns something truthy (a hang guard, never a verdict on speed)."""
    deadline = time.monotonic() + timeout_s
    while not (out := condition()):
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.05)
    return out


def draining(http: httpx.Client) -> dict | None:
    r = http.get("/readyz")
    return r.json() if r.status_code == 503 and r.json().get("state") == "draining" else None


def assert_refused_while_draining(r: httpx.Response, sig: signal.Signals = signal.SIGTERM) -> None:
    assert r.status_code == 503, (r.status_code, r.text)
    assert int(r.headers["Retry-After"]) >= 1
    body = r.json()
    assert "shutting down" in body["error"] and sig.name in body["error"], body
    assert body["state"] == "draining"


@contextlib.contextmanager
def client(served: Served):
    """A raw Tinker client (tenant alice) with a fresh session and model: (http, raw, model_id)."""
    with httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=HANG_GUARD_S) as http:
        raw = RawTinker(http)
        yield http, raw, raw.create_model(raw.session())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_accepted_work_refuses_new_work_and_exits_0(tmp_path, tiny_model_dir, sig):
    grace_s = 90  # generous: this drain finishes its queue (the grace is only a hang guard here)
    env = {"OPENRL_API_KEYS": f"alice:{ALICE_KEY}", "OPENRL_LONG_POLL_S": "1"}
    with serving(tmp_path / "data", tiny_model_dir, "--drain-grace-s", str(grace_s), env=env) as served:
        with client(served) as (http, raw, model_id):
            accepted = []
            for step in range(4):  # forward_backward + optim_step, four times: several ops queued
                accepted.append(raw.submit_fb(model_id, 2 * step + 1, datums(8, 64)))
                accepted.append(raw.submit_optim(model_id, 2 * step + 2))
            assert http.get("/readyz").json()["state"] == "ready"
            served.proc.send_signal(sig)
            sigterm_at = time.monotonic()

            ready = wait_for(lambda: draining(http), "/readyz to say draining")
            assert ready["status"] == "draining"
            assert http.get("/healthz").status_code == 200  # the kubelet must not kill it early
            # New work of every kind is refused, before anything is read or queued.
            assert_refused_while_draining(raw.post("create_session"), sig)
            assert_refused_while_draining(
                raw.post(
                    "create_model", session_id=raw.sessions[0], model_seq_id=1, base_model="openrl/tiny"
                ),
                sig,
            )
            assert_refused_while_draining(
                http.post(
                    "/api/v1/forward_backward",
                    content=fb_body(model_id, 9, datums(1, 8)),
                    headers={"Content-Type": "application/x-protobuf"},
                ),
                sig,
            )
            assert_refused_while_draining(raw.post("optim_step", model_id=model_id, seq_id=9), sig)
            assert_refused_while_draining(http.post("/openrl/v1/runs", json={}), sig)

            # Every accepted op runs and its result is handed out; in between: try_again, never a 5xx.
            answers = []
            for request_id in accepted:
                while True:
                    r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
                    assert r.status_code == 200, (r.status_code, r.text)
                    if r.json().get("type") != "try_again":
                        break
                answers.append(r.json())
        assert [("error" in a) for a in answers] == [False] * len(accepted), answers
        assert all("loss_fn_outputs" in a for a in answers[0::2])
        assert all("metrics" in a for a in answers[1::2])

        assert finish(served, grace_s + EXIT_MARGIN_S) == 0, served.stderr
        assert time.monotonic() - sigterm_at < grace_s + EXIT_MARGIN_S
    log = served.stderr
    assert f"received {sig.name}: draining" in log
    assert "drained in" in log and "never fetched" not in log


def long_polls(served: Served, request_ids: list[str]) -> tuple[list[threading.Thread], dict[str, dict]]:
    """One long-poll per future, as the SDK polls; returns once every poll's body is on the wire, so the
    service has them all in hand before it is signalled. The answers fill in as they come."""
    answers: dict[str, dict] = {}
    sent = threading.Semaphore(0)

    def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            sent.release()

    def poll(request_id: str) -> None:
        with httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=HANG_GUARD_S) as c:
            r = c.post(
                "/api/v1/retrieve_future", json={"request_id": request_id}, extensions={"trace": trace}
            )
        answers[request_id] = {"status": r.status_code, **r.json()}

    pollers = [threading.Thread(target=poll, args=(rid,), daemon=True) for rid in request_ids]
    for t in pollers:
        t.start()
    for _ in pollers:
        assert sent.acquire(timeout=HANG_GUARD_S), "a long-poll was never sent"
    return pollers, answers


def assert_cut_short(answers: dict[str, dict], accepted: list[str], why: str) -> None:
    """Every accepted op answered (none hangs or vanishes): its result, or the shutdown error."""
    assert sorted(answers) == sorted(accepted)
    assert {a["status"] for a in answers.values()} == {200}
    failed = [a for a in answers.values() if "error" in a]
    assert failed, "the queue should have outlasted the drain"
    for a in failed:
        assert a["category"] == "server"
        assert "shut down before this request finished" in a["error"], a
        assert why in a["error"] and "Resubmit" in a["error"], a
    assert all("loss_fn_outputs" in a for a in answers.values() if "error" not in a)


LONG_QUEUE_ENV = {"OPENRL_API_KEYS": f"alice:{ALICE_KEY}", "OPENRL_LONG_POLL_S": str(HANG_GUARD_S)}


@contextlib.contextmanager
def a_long_queue(tmp_path, tiny_model_dir, grace_s: float):
    """A ``--durability none`` service with far more work queued than a second (30 forward_backward
    calls of about a second each), every future long-polled: (served, http, accepted request ids,
    the answers as they come)."""
    env = LONG_QUEUE_ENV
    with (
        serving(
            tmp_path / "data",
            tiny_model_dir,
            "--drain-grace-s",
            str(grace_s),
            "--durability",
            "none",
            env=env,
        ) as served,
        client(served) as (http, raw, model_id),
    ):
        accepted = [raw.submit_fb(model_id, seq, datums(16, 128)) for seq in range(1, 31)]
        pollers, answers = long_polls(served, accepted)
        yield served, http, accepted, answers
        for t in pollers:
            t.join(HANG_GUARD_S)


def test_without_journal_a_grace_too_short_fails_what_did_not_run_and_exits_in_time(tmp_path, tiny_model_dir):
    grace_s = 1.0
    with a_long_queue(tmp_path, tiny_model_dir, grace_s) as (served, http, accepted, answers):
        served.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        assert finish(served, grace_s + EXIT_MARGIN_S) == 0, served.stderr
        assert time.monotonic() - sigterm_at < grace_s + EXIT_MARGIN_S
    assert_cut_short(answers, accepted, "drain grace of 1 s, OPENRL_DRAIN_GRACE_S, ran out")
    assert "did not finish and answer 'service shutting down'" in served.stderr


def test_a_second_signal_skips_the_rest_of_the_grace(tmp_path, tiny_model_dir):
    """(--durability none, so what the cut left undone answers the shutdown error.)"""
    with a_long_queue(tmp_path, tiny_model_dir, grace_s=600) as (served, http, accepted, answers):
        served.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: draining(http), "/readyz to say draining")
        served.proc.send_signal(signal.SIGINT)  # Ctrl-C twice: the 600 s grace is never reached
        assert finish(served, HANG_GUARD_S) == 0, served.stderr
    assert_cut_short(answers, accepted, "a second signal (SIGINT) cut the drain short")


def poll_through_restart(url: str, request_id: str, answers: dict) -> None:
    """Poll a future as the Tinker SDK does: through try_again, and through connection errors and
    503s while the service is down or coming back, until it answers."""
    deadline = time.monotonic() + 3 * HANG_GUARD_S
    with httpx.Client(base_url=url, headers={"X-API-Key": ALICE_KEY}, timeout=HANG_GUARD_S) as c:
        while time.monotonic() < deadline:
            try:
                r = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if r.status_code == 503 or "try_again" in r.text:
                time.sleep(0.05)
                continue
            answers[request_id] = {"status": r.status_code, "body": r.text}
            return


def test_sigterm_with_the_journal_keeps_what_did_not_run_and_the_restart_runs_it(tmp_path, tiny_model_dir):
    """Grace too short for the queue: the service exits in time, fails nothing, and after a restart
    on the same data dir every accepted op runs, once, in order; its poller gets the result."""
    grace_s = 1.0
    port = free_port()
    data = tmp_path / "data"
    args = ("--drain-grace-s", str(grace_s))
    with serving(data, tiny_model_dir, *args, env=LONG_QUEUE_ENV, port=port) as served:
        with client(served) as (http, raw, model_id):
            accepted = [raw.submit_fb(model_id, seq, datums(16, 128)) for seq in range(1, 13)]
            accepted.append(raw.submit_optim(model_id, 13))
        answers: dict[str, dict] = {}
        pollers = [
            threading.Thread(target=poll_through_restart, args=(served.url, rid, answers), daemon=True)
            for rid in accepted
        ]
        for t in pollers:
            t.start()
        served.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        assert finish(served, grace_s + EXIT_MARGIN_S) == 0, served.stderr
        assert time.monotonic() - sigterm_at < grace_s + EXIT_MARGIN_S
    assert "journaled and run after the restart" in served.stderr, served.stderr
    assert "did not finish" not in served.stderr
    with serving(data, tiny_model_dir, *args, env=LONG_QUEUE_ENV, port=port) as again:
        for t in pollers:
            t.join(3 * HANG_GUARD_S)
        assert sorted(answers) == sorted(accepted), answers
        assert all(a["status"] == 200 and '"error"' not in a["body"] for a in answers.values()), answers
        assert all("loss_fn_outputs" in answers[rid]["body"] for rid in accepted[:-1])
        assert "metrics" in answers[accepted[-1]]["body"], answers[accepted[-1]]
        with httpx.Client(base_url=again.url, headers={"X-API-Key": ALICE_KEY}, timeout=HANG_GUARD_S) as h:
            raw = RawTinker(h)
            r = raw.post("save_weights", model_id=model_id, seq_id=14, path="after")
            assert r.status_code == 200, r.text
            saved = raw.result(r.json()["request_id"])
            assert saved["path"].endswith("/weights/after"), saved
    manifest = next(data.rglob("weights/after/manifest.json")).read_text()
    assert '"steps": 1' in manifest, manifest


def test_a_notebook_sample_in_flight_when_the_journal_takes_over_gets_503_and_the_service_exits(
    tmp_path, tiny_model_dir
):
    """The notebook API's waits on a held future: a kernel's sampling calls are queued when the drain
    hands its work to the journal. Each answers 503 "shutting down" (its client retries after the
    restart) and the service exits in time. Before, such a wait spun on the event loop and the
    service never exited (a kernel's embedded service hung at 100% CPU after its kernel ended)."""
    grace_s = 0.5  # far less than the queue below takes, even on a fast machine
    args = ("--drain-grace-s", str(grace_s))
    with serving(tmp_path / "data", tiny_model_dir, *args, env=LONG_QUEUE_ENV) as served:
        http = httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=HANG_GUARD_S)
        run_id = http.post("/openrl/v1/runs", json={"name": "busy"}).json()["run_id"]
        answers: list = []

        def sample() -> None:
            with contextlib.suppress(httpx.HTTPError):  # a connection the exiting service closed
                r = http.post(
                    f"/openrl/v1/runs/{run_id}/sample", json={"prompts": ["Count:"] * 32, "max_tokens": 256}
                )
                answers.append((r.status_code, r.text))

        callers = [threading.Thread(target=sample, daemon=True) for _ in range(12)]
        for t in callers:
            t.start()
        wait_for(lambda: served.proc.poll() is None and http.get("/readyz").status_code == 200, "ready")
        time.sleep(1.0)  # the calls are queued behind each other
        served.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        assert finish(served, grace_s + EXIT_MARGIN_S) == 0, served.stderr
        assert time.monotonic() - sigterm_at < grace_s + EXIT_MARGIN_S
        for t in callers:
            t.join(HANG_GUARD_S)
        http.close()
    assert "journaled and run after the restart" in served.stderr, served.stderr
    held = [text for status, text in answers if status == 503]
    assert held and all("shutting down" in text for text in held), answers
    assert {status for status, _ in answers} <= {200, 503}, answers


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_a_bad_drain_grace_is_refused_naming_the_setting(tmp_path, value):
    argv, env = cli("serve", "--data-dir", str(tmp_path), env={"OPENRL_DRAIN_GRACE_S": value})
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2
    assert "OPENRL_DRAIN_GRACE_S" in proc.stderr


# -- the states /readyz reports ------------------------------------------------------------------------------
@contextlib.contextmanager
def in_thread(settings, svc):
    """The app on a loopback port, served by uvicorn in a thread (no signals: the test drives it)."""
    import uvicorn

    from openrl_service.app import create_app

    app = create_app(settings, service=svc)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{settings.port}", timeout=HANG_GUARD_S) as http:
            wait_for(lambda: _answers(http), "the server to listen")
            yield app, http
    finally:
        server.should_exit = True
        thread.join(HANG_GUARD_S)


def _answers(http: httpx.Client) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return http.get("/readyz").status_code > 0
    return False


def test_readyz_reports_starting_recovering_ready_and_draining(tmp_path, tiny_model_dir):
    import asyncio

    from openrl_service.config import Settings
    from openrl_service.engine.service import TrainingService

    shutil.copytree(tiny_model_dir, tmp_path / "models" / "openrl-tiny")
    settings = Settings(data_dir=tmp_path, port=free_port(), no_auth=True)
    svc = TrainingService(settings)
    loading, replaying = threading.Event(), threading.Event()
    setup, recover = svc._setup, svc.durability.recover
    svc._setup = lambda: (loading.wait(HANG_GUARD_S), setup())  # the model "loads" until the test says

    async def slow_recovery():  # and the journal "replays" until it says so too
        await asyncio.to_thread(replaying.wait, HANG_GUARD_S)
        return await recover()

    svc.durability.recover = slow_recovery
    with in_thread(settings, svc) as (app, http):
        for state, status in [("starting", "loading"), ("recovering", "recovering")]:
            r = wait_for(lambda s=state: (r := http.get("/readyz")).json()["state"] == s and r, state)
            assert (r.status_code, r.json()["status"]) == (503, status)
            refused = http.post("/api/v1/create_session", json={})  # new work: come back shortly
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert state in refused.json()["error"]
            # A future it may be about to replay, and a session it may be about to restore, are not 404s.
            poll = http.post("/api/v1/retrieve_future", json={"request_id": "req-from-before-the-crash"})
            assert (poll.status_code, poll.json()["type"]) == (200, "try_again")
            beat = http.post("/api/v1/session_heartbeat", json={"session_id": "s-from-before"})
            assert beat.status_code == 200
            # Nor is a run it may be about to restore, nor an empty list of them: a 404 or [] is final
            # to a client (the SDK does not retry a 404), a 503 with Retry-After is not.
            for method, path, body in [
                ("POST", "/api/v1/get_info", {"model_id": "s-from-before:train:0"}),
                ("POST", "/api/v1/sessions/s-from-before/finish", {}),
                ("GET", "/api/v1/training_runs", None),
                ("GET", "/api/v1/sessions", None),
                ("GET", "/openrl/v1/runs", None),
                ("GET", "/oai/api/v1/models", None),
            ]:
                early = http.request(method, path, json=body)
                assert early.status_code == 503 and int(early.headers["Retry-After"]) >= 1, (path, early.text)
                assert state in early.text, (path, early.text)
            loading.set()
        replaying.set()
        ready = wait_for(
            lambda: http.get("/readyz").json()["state"] == "ready" and http.get("/readyz"), "ready"
        )
        assert ready.status_code == 200 and ready.json()["model"] == "openrl/tiny"

        # A drain lasts until the results it handed out are fetched (here: a create_model's), then stops.
        raw = RawTinker(http)
        r = raw.post("create_model", session_id=raw.session(), model_seq_id=0, base_model="openrl/tiny")
        app.state.lifecycle.request_stop("a test")
        body = wait_for(lambda: draining(http), "draining")
        assert body == {"status": "draining", "state": "draining"}
        assert http.get("/healthz").status_code == 200
        assert "error" not in raw.result(r.json()["request_id"])
        wait_for(lambda: http.get("/readyz").json()["state"] == "stopped", "the drain to end")


def test_readyz_reports_a_model_that_failed_to_load(tmp_path):
    from openrl_service.config import Settings
    from openrl_service.engine.service import TrainingService

    settings = Settings(
        data_dir=tmp_path, port=free_port(), no_auth=True, model=str(tmp_path / "no-such-model")
    )
    with in_thread(settings, TrainingService(settings)) as (app, http):
        r = wait_for(lambda: (r := http.get("/readyz")).json()["state"] == "failed" and r, "the load to fail")
        assert (
            r.status_code == 503 and r.json()["status"] == "failed" and "no-such-model" in r.json()["error"]
        )


def test_an_embedded_service_signalled_while_its_parent_lives_exits_0(tmp_path):
    """`--exit-with-parent` watches its stdin from a daemon thread; a SIGTERM while that pipe is still
    open must exit 0, not abort at interpreter exit (SIGABRT: "could not acquire lock for <stdin>")."""
    from openrl_jupyter.local import start_service

    service = start_service(data_dir=tmp_path / "data")
    try:
        service.process.send_signal(signal.SIGTERM)
        code = service.process.wait(HANG_GUARD_S)
    finally:
        service.stop()
    log = service.log_tail(20_000)
    assert code == 0, log
    assert "Fatal Python error" not in log and "drained in" in log
