"""Disk work stays off the event loop: while a slow disk holds one request, the health check and
long-polls are still answered; listings do not re-read every file ever written."""

import builtins
import contextlib
import pathlib
import threading

import httpx
import pytest

from tests._support.raw import RawTinker
from tests.conftest import ALICE_KEY


@contextlib.contextmanager
def held(obj, name: str, monkeypatch):
    """Make ``obj.name`` block (a disk that stalls) until the block exits; yields an Event set once a
    call is inside it."""
    real = getattr(obj, name)
    entered, release = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, slow)
    try:
        yield entered
    finally:
        release.set()


def answered_while_held(live, obj, name, monkeypatch, request) -> httpx.Response:
    """Run ``request(client)`` while ``obj.name`` stalls; meanwhile /healthz and a long-poll answer."""
    raw = RawTinker(live.client())
    done_request = raw.post("create_session")  # warm: a finished future to long-poll for
    assert done_request.status_code == 200
    sid = done_request.json()["session_id"]
    model = raw.post("create_model", session_id=sid, model_seq_id=0, base_model="openrl/tiny")
    request_id = model.json()["request_id"]
    raw.result(request_id)
    out = {}
    with held(obj, name, monkeypatch) as entered:
        worker = threading.Thread(target=lambda: out.update(r=request(live.client())))
        worker.start()
        assert entered.wait(60), f"the request never reached {name}"
        with httpx.Client(base_url=live.url, headers={"X-API-Key": ALICE_KEY}, timeout=30) as c:
            assert c.get("/healthz").status_code == 200
            poll = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
            assert poll.status_code == 200 and poll.json()["model_id"]
    worker.join(60)
    assert out["r"].status_code in (200, 204), out["r"].text
    return out["r"]


def test_create_and_finish_session_write_off_the_loop(make_server, monkeypatch):
    live = make_server()
    store = live.service.store
    r = answered_while_held(
        live, store, "write_session", monkeypatch, lambda c: c.post("/api/v1/create_session", json={})
    )
    sid = r.json()["session_id"]
    monkeypatch.undo()
    answered_while_held(
        live,
        store,
        "write_session",
        monkeypatch,
        lambda c: c.post(f"/api/v1/sessions/{sid}/finish", json={}),
    )


@pytest.mark.parametrize(
    "name, path",
    [
        ("list_sessions", "/api/v1/sessions"),
        ("list_runs", "/api/v1/training_runs"),
        ("list_runs", "/api/v1/checkpoints"),
    ],
)
def test_catalog_listings_read_off_the_loop(make_server, monkeypatch, name, path):
    live = make_server()
    answered_while_held(live, live.service.store, name, monkeypatch, lambda c: c.get(path))


def test_listings_do_not_reread_every_file_ever_written(make_server, monkeypatch):
    """Once the service has read a tenant's sessions and runs, listing them again reads no files."""
    live = make_server()
    raw = RawTinker(live.client())
    for i in range(3):
        sid = raw.session()
        raw.create_model(sid, 0, seed=i)
    with live.client() as c:
        assert len(c.get("/api/v1/sessions").json()["sessions"]) == 3
        assert len(c.get("/api/v1/training_runs").json()["training_runs"]) == 3
        reads = []
        real_open, real_path_open = builtins.open, pathlib.Path.open

        def note(path) -> None:
            if str(path).startswith(str(live.data_dir)):
                reads.append(str(path))

        def counting_open(file, *a, **kw):
            note(file)
            return real_open(file, *a, **kw)

        def counting_path_open(self, *a, **kw):
            note(self)
            return real_path_open(self, *a, **kw)

        monkeypatch.setattr(builtins, "open", counting_open)
        monkeypatch.setattr(pathlib.Path, "open", counting_path_open)
        assert len(c.get("/api/v1/sessions").json()["sessions"]) == 3
        assert len(c.get("/api/v1/training_runs").json()["training_runs"]) == 3
    monkeypatch.undo()
    assert not [p for p in reads if "/sessions/" in p or p.endswith("run.json")], reads
