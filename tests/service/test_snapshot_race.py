"""A snapshot never cuts a change in half: a session, a finish or a sampler acknowledged while a
snapshot is being taken is in the snapshot or in the journal kept after it, never in neither.

Each test forces the interleaving a shared-state design loses: the journal record of the change is
written, and before the change is applied to the service's maps a snapshot is asked for (a hook on
the journal's append, in the thread that writes the record). The data dir is then copied as a
``kill -9`` would leave it (the running service never gets to snapshot again) and a second service
recovers from the copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil

import pytest

from tests._support.raw import RawTinker
from tests.conftest import start_server

HANG_GUARD_S = 60


class SnapshotInside:
    """Wraps the journal's append: after the first record of ``kind`` is written, ask the service's
    loop for a snapshot and give it a moment (the old code took it right there: the record was in the
    segment the snapshot replaced, the change not yet in the maps it copied)."""

    def __init__(self, svc, kind: str):
        self.svc, self.kind = svc, kind
        self.durability = svc.durability
        self.append = svc.durability.append
        self.snapshot: concurrent.futures.Future | None = None

    def __call__(self, record: tuple) -> None:
        self.append(record)
        if record[0] == self.kind and self.snapshot is None:
            loop = self.svc.futures.loop
            self.snapshot = asyncio.run_coroutine_threadsafe(self.durability.snapshot("race"), loop)
            try:  # the fixed code holds the snapshot until the change is whole: it cannot end now
                self.snapshot.result(timeout=2)
            except concurrent.futures.TimeoutError:
                pass

    def taken(self) -> bool:
        assert self.snapshot is not None, f"no {self.kind!r} record was written"
        return self.snapshot.result(timeout=HANG_GUARD_S)


def crash_copy(live, tmp_path, tiny_model_dir):
    """A second service on a copy of ``live``'s data dir as it is now (what a kill -9 leaves)."""
    copy = tmp_path / "after-crash"
    shutil.copytree(live.data_dir, copy, ignore=shutil.ignore_patterns("*.lock", "lock"))
    return start_server(copy, tiny_model_dir)


@pytest.fixture
def journaled(make_server, monkeypatch):
    live = make_server(snapshot_interval_s=0)  # snapshots only when a test asks

    def arm(kind: str) -> SnapshotInside:
        hook = SnapshotInside(live.service, kind)
        monkeypatch.setattr(live.service.durability, "append", hook)
        return hook

    return live, arm


def test_a_session_acknowledged_during_a_snapshot_survives_a_crash(journaled, tmp_path, tiny_model_dir):
    live, arm = journaled
    hook = arm("session")
    with live.client() as http:
        session_id = RawTinker(http).session()
    assert hook.taken()
    again = crash_copy(live, tmp_path, tiny_model_dir)
    try:
        assert session_id in again.service.sessions, "an acknowledged session was lost"
        with again.client() as http:
            r = http.post("/api/v1/session_heartbeat", json={"session_id": session_id})
            assert r.status_code == 200, r.text
    finally:
        again.stop()


def test_a_session_finished_during_a_snapshot_stays_finished_after_a_crash(
    journaled, tmp_path, tiny_model_dir
):
    live, arm = journaled
    with live.client() as http:
        raw = RawTinker(http)
        session_id = raw.session()
        model_id = raw.create_model(session_id)
        hook = arm("finish")
        r = http.post(f"/api/v1/sessions/{session_id}/finish", json={})
        assert r.status_code == 200, r.text
    assert hook.taken()
    again = crash_copy(live, tmp_path, tiny_model_dir)
    try:
        sess = again.service.sessions.get(session_id)
        assert sess is None or sess.finished, "a finished session came back to life"
        assert model_id not in again.service.runs, "a finished session's run came back to device memory"
        with again.client() as http:
            r = http.post("/api/v1/session_heartbeat", json={"session_id": session_id})
            assert r.status_code == 410, r.text
    finally:
        again.stop()


def test_a_sampler_created_during_a_snapshot_survives_a_crash(journaled, tmp_path, tiny_model_dir):
    live, arm = journaled
    with live.client() as http:
        raw = RawTinker(http)
        session_id = raw.session()
        hook = arm("sampler")
        r = raw.post(
            "create_sampling_session",
            session_id=session_id,
            sampling_session_seq_id=0,
            base_model="openrl/tiny",
        )
        assert r.status_code == 200, r.text
        sampler_id = r.json()["sampling_session_id"]
    assert hook.taken()
    again = crash_copy(live, tmp_path, tiny_model_dir)
    try:
        assert sampler_id in again.service.samplers, "an acknowledged sampler was lost"
        with again.client() as http:
            assert http.get(f"/api/v1/samplers/{sampler_id}").status_code == 200
    finally:
        again.stop()
