"""The recovery journal's files: a torn or corrupt record is dropped, never misread; only journal
types load; a full disk refuses new work with a 507 and loses nothing acknowledged."""

from __future__ import annotations

import os
import pickle
import resource
import struct

import httpx
import numpy as np
import pytest

from openrl_service.storage.journal import (
    HEADER,
    MAGIC,
    Journal,
    JournalFormatError,
    JournalFull,
    frame,
    loads,
    read_records,
)
from tests._support.raw import RawTinker, fb_body, sft_datum
from tests._support.serve import finish, serving
from tests.conftest import ALICE_KEY, free_port

GUARD_S = 120


def journal_with(tmp_path, records) -> Journal:
    j = Journal(tmp_path / "journal")
    for r in records:
        j.append(r)
    j.sync()
    return j


def segment(j: Journal):
    return next(j.folder.glob("seg-*.log"))


def test_records_come_back_in_order_with_their_arrays(tmp_path):
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    j = journal_with(tmp_path, [("call", "req-1", "forward_backward", {"x": arr}), ("session", {"a": 1})])
    got = list(j.records_since(1))
    assert got[1] == ("session", {"a": 1})
    assert got[0][:3] == ("call", "req-1", "forward_backward")
    assert got[0][3]["x"].dtype == np.float32 and (got[0][3]["x"] == arr).all()


def test_a_torn_last_record_is_dropped(tmp_path, caplog):
    j = journal_with(tmp_path, [("r", i) for i in range(3)])
    path = segment(j)
    size = path.stat().st_size
    os.truncate(path, size - 3)  # the crash came mid-write of the third record
    assert list(read_records(path)) == [("r", 0), ("r", 1)]
    assert "torn last record" in caplog.text


def test_a_record_failing_its_checksum_and_what_follows_are_dropped(tmp_path, caplog):
    j = journal_with(tmp_path, [("r", "first"), ("r", "second"), ("r", "third")])
    path = segment(j)
    data = bytearray(path.read_bytes())
    first = HEADER.size + struct.unpack_from("<I", data, 5)[0]
    data[first + HEADER.size + 4] ^= 0xFF  # one bit pattern flipped inside the second record's payload
    path.write_bytes(bytes(data))
    assert list(read_records(path)) == [("r", "first")]
    assert "checksum" in caplog.text


def test_a_record_of_a_later_format_stops_the_reading_and_says_which_release_reads_it(tmp_path):
    """Never dropped as if torn: a newer release's records are acknowledged work."""
    path = tmp_path / "seg-00000001.log"
    good = frame(("r", 1))
    future = bytearray(frame(("r", 2)))
    future[4] = 99  # a later format
    path.write_bytes(good + bytes(future))
    with pytest.raises(JournalFormatError, match=r"format 99.*a newer release wrote it.*nothing was changed"):
        list(read_records(path))


def test_only_journal_types_load(tmp_path):
    evil = pickle.dumps(os.system)
    with pytest.raises(pickle.UnpicklingError, match="not a journal type"):
        loads(evil)
    assert not MAGIC.startswith(b"\x80")  # a bare pickle is never taken for a record


def test_a_snapshot_sweeps_what_a_crash_left_half_written_with_or_without_tensors(tmp_path):
    """A snapshot written whole removes the temporary files an interrupted one left (either name
    they had), whether or not this snapshot has tensors of its own; the older snapshot goes too."""
    j = journal_with(tmp_path, [("r", 1)])
    j.write_snapshot(1, {"state": 1}, {"t0": np.zeros(3, dtype=np.float32)})
    leftovers = [j.folder / "snap-00000002.tensors.tmp", j.folder / ".snap-00000002.bin.x7k2q"]
    for p in leftovers:
        p.write_bytes(b"half")
    j.write_snapshot(2, {"state": 2})  # no tensors this time
    assert not any(p.exists() for p in leftovers)
    assert sorted(p.name for p in j.folder.iterdir() if p.name.startswith(("snap", ".snap"))) == [
        "snap-00000002.bin"
    ]


def test_a_full_disk_refuses_the_append_and_leaves_the_segment_readable(tmp_path):
    j = Journal(tmp_path / "journal")
    j.append(("r", "kept"))
    j.sync()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (segment(j).stat().st_size + 100, hard))
    try:
        with pytest.raises(JournalFull):
            j.append(("r", "x" * 10_000))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    j.append(("r", "after"))
    assert list(read_records(segment(j))) == [("r", "kept"), ("r", "after")]


def test_a_full_disk_answers_507_and_a_restart_has_everything_acknowledged(tmp_path, tiny_model_dir):
    """The journal's file cannot grow (RLIMIT_FSIZE: the kernel refuses the write, as on a full
    volume): new work is refused with 507 naming the cause, the service stays up and answers what
    it had accepted; a restart with room replays every acknowledged request, exactly once."""
    data, port = tmp_path / "data", free_port()
    env = {"OPENRL_API_KEYS": f"alice:{ALICE_KEY}", "OPENRL_SNAPSHOT_INTERVAL_S": "0"}
    datum = sft_datum(list(range(10, 60)), list(range(20, 70)))
    with (
        serving(data, tiny_model_dir, env=env, port=port, max_file_bytes=40_000) as served,
        httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=GUARD_S) as http,
    ):
        raw = RawTinker(http)
        model_id = raw.create_model(raw.session())
        acked, refused = [], None
        for seq in range(1, 200):
            r = http.post(
                "/api/v1/forward_backward",
                content=fb_body(model_id, seq, [datum] * 4),
                headers={"Content-Type": "application/x-protobuf"},
            )
            if r.status_code != 200:
                refused = (seq, r)
                break
            acked.append(r.json()["request_id"])
        assert refused is not None, "the journal never filled up"
        seq, r = refused
        assert r.status_code == 507, r.text
        assert "disk is full" in r.json()["error"] and "Nothing was accepted" in r.json()["error"]
        assert http.get("/healthz").status_code == 200
        results = [raw.result(rid) for rid in acked]  # everything accepted still answers
        assert all("loss_fn_outputs" in x for x in results)
        # The refused seq_id was not taken: a smaller request may take it (if it fits).
        optim = raw.post("optim_step", model_id=model_id, seq_id=seq, adam_params={"learning_rate": 1e-3})
        assert optim.status_code in (200, 507), optim.text
        if optim.status_code == 200:
            acked.append(optim.json()["request_id"])
            seq += 1
            # fetched, as a client does: a result never fetched holds the drain for its whole grace
            assert "error" not in raw.result(optim.json()["request_id"])
    assert finish(served) == 0
    with (
        serving(data, tiny_model_dir, env=env, port=port) as again,
        httpx.Client(base_url=again.url, headers={"X-API-Key": ALICE_KEY}, timeout=GUARD_S) as http,
    ):
        raw = RawTinker(http)
        kept = [raw.result(rid) for rid in acked]  # the original results, or the ops replayed
        assert all("error" not in x for x in kept), kept
        r = raw.post("optim_step", model_id=model_id, seq_id=seq, adam_params={"learning_rate": 1e-3})
        assert r.status_code == 200, r.text
        assert raw.result(r.json()["request_id"])["metrics"]


def test_a_native_request_refused_for_a_full_disk_leaves_no_gap_in_its_run(tmp_path, tiny_model_dir):
    """A notebook-API request whose journal record does not fit (507) takes no place in its run's
    order: the run's next request that fits runs at once, instead of waiting OPENRL_SEQ_GAP_TIMEOUT_S
    for the refused one and then failing. The journal's file cannot grow past ``limit`` bytes
    (RLIMIT_FSIZE), and the test fills it until a big record no longer fits and a small one still does."""
    data, limit = tmp_path / "data", 60_000
    env = {
        "OPENRL_API_KEYS": f"alice:{ALICE_KEY}",
        "OPENRL_SNAPSHOT_INTERVAL_S": "0",
        "OPENRL_SEQ_GAP_TIMEOUT_S": "3",  # old behaviour: the next request fails after this, not hangs
    }
    big = {"prompts": ["a"] * 8, "num_samples": 16, "max_tokens": 1}  # 128 sample ids in its record
    small = {"prompts": ["a"], "max_tokens": 1}
    with (
        serving(data, tiny_model_dir, env=env, max_file_bytes=limit) as served,
        httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=GUARD_S) as http,
    ):
        r = http.post("/openrl/v1/runs", json={"name": "full-disk", "seed": 0})
        assert r.status_code == 201, r.text
        run_id = r.json()["run_id"]
        seg = max((data / "journal").glob("seg-*.log"))

        def room() -> int:
            return limit - seg.stat().st_size

        def sample(body: dict) -> httpx.Response:
            return http.post(f"/openrl/v1/runs/{run_id}/sample", json=body)

        sizes = {}
        for name, body in (("big", big), ("small", small)):
            before = room()
            assert sample(body).status_code == 200
            sizes[name] = before - room()
        assert sizes["big"] > 3 * sizes["small"] > 0, sizes
        while room() >= 2 * sizes["big"]:
            assert sample(big).status_code == 200
        while room() >= sizes["big"]:
            assert sample(small).status_code == 200
        assert sizes["small"] * 2 < room() < sizes["big"]  # a small record fits, a big one does not
        refused = sample(big)
        assert refused.status_code == 507, refused.text
        assert "Nothing was accepted" in refused.json()["error"]
        after = sample(small)  # the run's next request: runs now, not behind a missing seq_id
        assert after.status_code == 200, after.text
        assert len(after.json()["samples"]) == 1
        assert http.get(f"/openrl/v1/runs/{run_id}").status_code == 200
