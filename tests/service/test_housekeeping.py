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
