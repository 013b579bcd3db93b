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

from tests._support.datadir_fixture import adapter_digest, loss_of, train_step
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


def this_machines_continuation(fixture: Path, expected: dict, tmp_path: Path, tiny_model_dir: Path):
    """(adapter digest, next loss) of the fixture's run continued without a crash on this machine: the
    snapshot alone (the journal after it removed), then the step the journal holds sent through the
    API. The replayed step is computed here, and float arithmetic differs between CPUs (kernels chosen
    per instruction set), so this, not the writing machine's numbers, is what recovery must equal bit
    for bit."""
    shutil.copytree(fixture / "data", tmp_path / "reference")
    for segment in (tmp_path / "reference" / "journal").glob("seg-*.log"):
        segment.unlink()
    model_id, seq = expected["model_id"], expected["next_seq_id"]
    live = start_server(tmp_path / "reference", tiny_model_dir, torch_threads=1)
    try:
        with live.client() as http:
            raw = RawTinker(http)
            assert train_step(raw, model_id, seq - 2) == seq  # the journal's records after the snapshot
            return adapter_digest(live.service, model_id), loss_of(raw, model_id, seq)
    finally:
        live.stop()


def test_an_earlier_release_s_run_continues_bit_for_bit(recovered, request, tmp_path, tiny_model_dir):
    live, expected = recovered
    model_id = expected["model_id"]
    with live.client() as http:  # after the replayed steps (one lane, in seq order)
        loss = loss_of(RawTinker(http), model_id, expected["next_seq_id"])
    digest = adapter_digest(live.service, model_id)  # a forward_backward keeps it
    fixture = FIXTURES / request.node.callspec.params["recovered"]
    want_digest, want_loss = this_machines_continuation(fixture, expected, tmp_path, tiny_model_dir)
    assert (digest, loss) == (want_digest, want_loss)
    # the same computation as on the machine that wrote the fixture (bit for bit there; here within
    # the rounding another CPU's kernels may differ by)
    assert loss == pytest.approx(expected["next_loss"], rel=1e-5)
    if want_loss == expected["next_loss"]:
        assert digest == expected["adapter_sha256"]
