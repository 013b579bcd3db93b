"""A data dir written by an earlier release recovers on this one: every acknowledged session,
sampler, checkpoint and step comes back, bit for bit.

The fixtures under tests/fixtures/ were written by ``tests/_support/datadir_fixture.py`` with the
release named in each one's README and are never regenerated: they stand for data dirs users have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests._support.datadir_fixture import adapter_digest, loss_of
from tests._support.raw import RawTinker
from tests.conftest import start_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(params=["datadir-journal-v1", "datadir-journal-v2"])
def recovered(request, tmp_path, tiny_model_dir):
    fixture = FIXTURES / request.param
    expected = json.loads((fixture / "expected.json").read_text())
    shutil.copytree(fixture / "data", tmp_path / "data")
    live = start_server(tmp_path / "data", tiny_model_dir, torch_threads=1)  # as the fixtures were written
    yield live, expected
    live.stop()


def test_an_earlier_release_s_data_dir_recovers_everything_acknowledged(recovered):
    live, expected = recovered
    svc = live.service
    for sid in expected["live_sessions"]:
        assert sid in svc.sessions and not svc.sessions[sid].finished, sid
    with live.client() as http:
        for sid in expected["finished_sessions"]:
            r = http.post("/api/v1/session_heartbeat", json={"session_id": sid})
            assert r.status_code == 410, r.text
        for sampler in expected["samplers"]:
            assert http.get(f"/api/v1/samplers/{sampler}").status_code == 200, sampler
        nb = expected["notebook_run"]
        r = http.get(f"/openrl/v1/runs/{nb['run_id']}")
        assert r.status_code == 200, r.text
        assert r.json()["step"] == nb["steps"], r.json()
        raw = RawTinker(http)
        loaded = raw.post(
            "load_weights",
            session_id=expected["live_sessions"][0],
            model_seq_id=50,
            path=expected["checkpoint"],
            optimizer=True,
        )
        assert loaded.status_code == 200, loaded.text
        assert "error" not in raw.result(loaded.json()["request_id"])


def test_an_earlier_release_s_run_continues_bit_for_bit(recovered):
    live, expected = recovered
    model_id = expected["model_id"]
    with live.client() as http:  # after the replayed steps (one lane, in seq order)
        loss = loss_of(RawTinker(http), model_id, expected["next_seq_id"])
    assert loss == expected["next_loss"]
    assert adapter_digest(live.service, model_id) == expected["adapter_sha256"]  # a forward_backward keeps it
