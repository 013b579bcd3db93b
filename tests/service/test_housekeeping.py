"""The housekeeping loop (expired results, idle sessions, expired checkpoints) outlives its failures."""

import threading


def test_housekeeping_keeps_going_after_a_failed_round(make_server, monkeypatch):
    """A full disk (or any error) in one round is logged; the next round still reaps idle sessions."""
    live = make_server(future_ttl_s=2.0)  # a round every 0.5 s
    svc = live.service
    real = svc.reap_idle_sessions
    rounds = {"n": 0}
    second_round = threading.Event()

    def reap(now=None):
        rounds["n"] += 1
        if rounds["n"] == 1:
            raise OSError(28, "No space left on device")
        second_round.set()
        return real(now)

    monkeypatch.setattr(svc, "reap_idle_sessions", reap)
    assert second_round.wait(60), f"housekeeping stopped after its failed round ({rounds['n']} round(s))"


def test_a_hung_kubernetes_api_server_does_not_stall_housekeeping(make_server, monkeypatch):
    """A Kubernetes status call that does not come back (an API server that hangs, up to the client's
    35 s a call in production; here until the test releases it): expired results are still forgotten
    and an idle run's session is still finished while it hangs."""
    from tests.service.test_jobs_api import FakeKube, body, unique

    live = make_server(future_ttl_s=2.0, session_idle_timeout_s=60.0)  # a round every 0.5 s
    svc = live.service
    asked, release = threading.Event(), threading.Event()

    class HungKube(FakeKube):
        def status(self, job_name: str) -> dict:
            asked.set()
            release.wait(120)
            return super().status(job_name)

    monkeypatch.setattr(live.parts, "kube", HungKube())
    expired, reaped = threading.Event(), threading.Event()
    real_sweep, real_reap = svc.futures.sweep, svc.reap_idle_sessions

    def sweep(now=None):
        old = real_sweep(now)
        if old and asked.is_set():
            expired.set()
        return old

    def reap(now=None):
        done = real_reap(now)
        if done and asked.is_set():
            reaped.set()
        return done

    monkeypatch.setattr(svc.futures, "sweep", sweep)
    monkeypatch.setattr(svc, "reap_idle_sessions", reap)
    try:
        with live.client() as c:
            r = c.post("/openrl/v1/jobs", json=body(unique("hung"), where="k8s"))
            assert r.status_code == 201, r.text
            assert asked.wait(60), "the housekeeping round never asked Kubernetes"
            # While the status call hangs: a run samples (a result to expire), then goes quiet.
            run = c.post("/openrl/v1/runs", json={"name": "quiet", "seed": 0}).json()
            s = c.post(f"/openrl/v1/runs/{run['run_id']}/sample", json={"prompts": ["a"], "max_tokens": 2})
            assert s.status_code == 200, s.text
            rec = svc.runs[run["run_id"]]
            rec.last_request_time -= 1000  # backdated rather than slept
            svc.sessions[rec.session_id].last_heartbeat -= 1000
            assert expired.wait(60), "no result expired while the Kubernetes call hung"
            assert reaped.wait(60), "no idle session was finished while the Kubernetes call hung"
            assert c.get(f"/openrl/v1/runs/{run['run_id']}").status_code == 404
            assert not release.is_set()  # all of it happened while the call still hung
    finally:
        release.set()
