"""The journal's records are declared, versioned data: a release that renames a parameter or meets a
record it does not know says so by name instead of failing its start with a TypeError."""

from __future__ import annotations

import dataclasses
import inspect
import json

import numpy as np
import pytest

from openrl_service.engine import records
from openrl_service.engine.native_state import Control, StoredSample
from openrl_service.engine.service import TrainingService
from openrl_service.engine.state import SessionRecord
from openrl_service.errors import UserError
from openrl_service.sampling.base import SampleJob, SamplingParams
from openrl_service.storage.journal import HEADER, Journal, frame, loads
from openrl_service.training.lora import LoraSpec
from openrl_service.training.optim_params import AdamParams
from openrl_service.training.trainer import DatumArrays
from tests._support.raw import RawTinker, sft_datum
from tests.conftest import start_server

# What journal records and snapshots hold as a dataclass's fields by name (``vars(obj)`` written,
# ``Class(**fields)`` read back). Renaming, removing or adding a required field here changes what an
# earlier release's data dir holds: give the record (records.TYPES / records.UPGRADES) or the snapshot
# format (engine/snapshots.py) a new version with an upgrade, then update this list. The committed
# fixtures of tests/service/test_journal_upgrade.py must still replay.
WRITTEN_BY_NAME = {
    SessionRecord: records.SESSION_FIELDS,
    StoredSample: ("run_id", "tenant", "prompt", "tokens", "logprobs", "created_at"),
    Control: ("state", "reason", "at"),
}


@pytest.mark.parametrize("cls", list(WRITTEN_BY_NAME), ids=lambda c: c.__name__)
def test_fields_written_by_name_change_only_with_a_new_record_or_snapshot_version(cls):
    assert tuple(f.name for f in dataclasses.fields(cls)) == WRITTEN_BY_NAME[cls]


@pytest.mark.parametrize("method", sorted(records.CALLS))
def test_each_journaled_call_declares_exactly_the_arguments_its_replay_passes(method):
    """A renamed or added parameter fails here: declare a new version of the call in records.py
    (with an upgrade of the old one), or the committed fixtures stop replaying."""
    params = [p for p in inspect.signature(getattr(TrainingService, method)).parameters if p != "self"]
    assert list(records.CALLS[method].fields) == params


def _values():
    return {
        "spec": LoraSpec(4, train_mlp=False, alpha=8.0),
        "adam": AdamParams(learning_rate=3e-4, beta2=0.99),
        "data": [DatumArrays(np.arange(5), {"weights": np.ones(5, dtype=np.float32)})],
        "params": SamplingParams(
            max_tokens=7, temperature=0.5, seed=3, stop_token_ids=(2,), stop_strings=("\n",)
        ),
        "jobs": [SampleJob([1, 2], 2, SamplingParams(seed=1), None, topk_sample_logprobs=2)],
        "refused": UserError("loss_fn: unknown", field="loss_fn"),
        "user_metadata": {"__api_error__": {"error": "not one"}, "status": 400, "~": [1, 2]},
    }


def test_values_go_to_disk_as_plain_data_and_come_back_equal():
    v = _values()
    record = (
        "call",
        "req-1",
        "forward_backward",
        {
            "tenant": "alice",
            "model_id": "m",
            "seq_id": 3,
            "data": v["data"],
            "loss_fn": "cross_entropy",
            "loss_fn_config": {},
            "forward_only": False,
            "idem": None,
        },
    )
    payload = frame(records.encode(record))
    assert b"openrl_service" not in payload  # no class of the service is pickled
    back = records.decode(loads(payload[HEADER.size :]))
    assert back[:3] == record[:3]
    datum = back[3]["data"][0]
    assert np.array_equal(datum.tokens, np.arange(5)) and np.array_equal(datum.inputs["weights"], np.ones(5))
    for name in ("spec", "adam", "params", "jobs", "user_metadata"):
        enc = records.encode_value(v[name])
        assert b"openrl_service" not in frame(enc)
        assert records.decode_value(loads(frame(enc)[HEADER.size :])) == v[name], name
    refused = records.decode_value(records.encode_value(v["refused"]))
    assert refused.status_code == 400 and refused.to_json() == v["refused"].to_json()
    # a user's metadata shaped like the first format's error marker stays the user's metadata
    assert records.decode_value(records.encode_value(v["user_metadata"])) == v["user_metadata"]


def test_a_record_type_or_version_this_release_does_not_know_is_named():
    with pytest.raises(records.UnknownRecord, match="'quota_change' v1.*does not know this record type"):
        records.decode({"type": "quota_change", "v": 1})
    with pytest.raises(records.UnknownRecord, match="'finish' v7.*version 7 is not one this release reads"):
        records.decode({"type": "finish", "v": 7, "tenant": "a", "session_id": "s", "reason": "x"})
    with pytest.raises(records.UnknownRecord, match="call forward_backward.*call version 9"):
        records.decode(
            {"type": "call", "v": 1, "id": "r", "method": "forward_backward", "call_v": 9, "args": {}}
        )


def _data_dir_with(tmp_path, tiny_model_dir, bad: dict):
    """A data dir that holds a session and then ``bad`` in its journal (as a newer release leaves it)."""
    live = start_server(tmp_path / "data", tiny_model_dir, snapshot_interval_s=0)
    with live.client() as http:
        session_id = RawTinker(http).session()
    live.stop()
    journal = Journal(tmp_path / "data" / "journal")
    journal.open(journal.next_segment())
    journal.append(bad)
    journal.close()
    return session_id


BAD = {"type": "quota_change", "v": 1, "tenant": "alice"}
BROKEN_CALL = {  # a call whose arguments no longer fit the method
    "type": "call",
    "v": 1,
    "id": "req-broken",
    "method": "optim_step",
    "call_v": 1,
    "args": {"tenant": "alice", "model_id": "nope", "seq_id": 0, "adam": None},
}


@pytest.mark.parametrize(
    "bad,named", [(BAD, "'quota_change' v1"), (BROKEN_CALL, "call optim_step' (request req-broken)")]
)
def test_a_start_meeting_a_record_it_cannot_replay_is_refused_with_the_record_and_the_choices(
    tmp_path, tiny_model_dir, bad, named
):
    _data_dir_with(tmp_path, tiny_model_dir, bad)
    live = start_server(tmp_path / "data", tiny_model_dir, expect="failed")
    try:
        with live.client() as http:
            body = http.get("/readyz").json()
        error = body["error"]
        assert named in error, error
        assert "--recovery-skip-failed" in error and "OPENRL_RECOVERY_SKIP_FAILED=1" in error, error
        assert "nothing in the data dir was changed" in error, error
        listed = next((tmp_path / "data" / "journal").glob("unreplayed-*.json"))
        assert named in json.loads(listed.read_text())[0]["record"]
    finally:
        live.stop()


def test_told_to_skip_it_the_service_starts_with_everything_else(tmp_path, tiny_model_dir):
    session_id = _data_dir_with(tmp_path, tiny_model_dir, BAD)
    live = start_server(tmp_path / "data", tiny_model_dir, recovery_skip_failed=True)
    try:
        assert session_id in live.service.sessions
        assert next((tmp_path / "data" / "journal").glob("unreplayed-*.json")).exists()
    finally:
        live.stop()


def test_a_snapshot_is_plain_data_with_its_tensors_in_a_file_beside_it(tmp_path, tiny_model_dir):
    """No class of the service is pickled in a snapshot, and each run's adapter, gradients and Adam
    moments are a safetensors file of its own that it names (full fine-tuning makes them gigabytes):
    a restart from it has the run bit for bit."""
    import asyncio

    from safetensors import safe_open

    from tests._support.datadir_fixture import adapter_digest, train_step

    live = start_server(tmp_path / "data", tiny_model_dir, snapshot_interval_s=0)
    try:
        with live.client() as http:
            raw = RawTinker(http)
            model_id = raw.create_model(raw.session(), rank=4)
            seq = train_step(raw, model_id, 1)
            raw.result(raw.submit_fb(model_id, seq, [sft_datum([1, 2, 3], [4, 5])]))  # a gradient pending
        svc = live.service
        assert asyncio.run_coroutine_threadsafe(svc.durability.snapshot("test"), svc.futures.loop).result(60)
        digest = adapter_digest(svc, model_id)
        journal = tmp_path / "data" / "journal"
        (snap,) = journal.glob("snap-*.bin")
        assert b"openrl_service" not in snap.read_bytes()
        (file,) = journal.glob("run-*.tensors")
        assert file.name.encode() in snap.read_bytes()
        with safe_open(str(file), framework="numpy") as f:
            keys = list(f.keys())
        run = svc.runs[model_id]
        per_run = 2 * len(run.state.adapter.weights)  # A and B of each module
        kinds = {k.split(":", 1)[0] for k in keys}
        assert kinds == {"w", "g", "o"} and len(keys) >= 4 * per_run  # weights, gradients, Adam moments
    finally:
        live.stop()
    again = start_server(tmp_path / "data", tiny_model_dir)
    try:
        assert adapter_digest(again.service, model_id) == digest
        grads = [p.grad for _, p in again.service.runs[model_id].state.adapter.named_parameters()]
        assert all(g is not None for g in grads), "the pending gradient was not restored"
    finally:
        again.stop()


def test_a_dropped_record_stays_dropped_after_the_next_restart(tmp_path, tiny_model_dir):
    """Skipped once with --recovery-skip-failed, an intent nobody can replay is not kept as pending
    work: the snapshot after recovery leaves it out, so a plain restart is not refused again."""
    unknown_intent = {"type": "native", "v": 1, "id": "int-unknown", "kind": "teleport", "inputs": {}}
    session_id = _data_dir_with(tmp_path, tiny_model_dir, unknown_intent)
    live = start_server(tmp_path / "data", tiny_model_dir, recovery_skip_failed=True)
    assert "int-unknown" not in live.service.durability.pending
    live.stop()  # the drain takes a snapshot
    again = start_server(tmp_path / "data", tiny_model_dir)
    try:
        assert session_id in again.service.sessions
    finally:
        again.stop()
