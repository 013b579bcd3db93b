"""The registries have one owner (engine/owner.py): sessions, runs and samplers change only through its
commands, and two owners given the same commands in the same order hold the same registry.

The workload runs through the real HTTP API of a real service (two tenants; LoRA and full runs;
samplers on the base model, on snapshots and on a checkpoint; a refused run; snapshot-budget
evictions; a finished session; a removed tenant). Every command its owner applied is recorded; a
second owner, with nothing but those commands, must end with the same sessions, runs, samplers and
tombstones, and write the same journal records: what an engine spread over several processes needs
(each process fed the same commands) and what recovery relies on.
"""

from __future__ import annotations

import threading

import pytest

from openrl_service.config import Limits
from openrl_service.engine import records
from openrl_service.engine.owner import Owner, RestoreRegistry
from openrl_service.errors import ApiError
from tests._support.raw import RawTinker
from tests.conftest import ALICE_KEY, BOB_KEY


def _registry(owner: Owner) -> dict:
    """What a client can tell apart: who holds which session, run and sampler, and what is gone."""
    return {
        "sessions": {
            sid: (s.tenant, s.finished, s.finish_reason, list(s.run_ids), list(s.sampler_ids), s.tags)
            for sid, s in owner.sessions.items()
        },
        "runs": {
            rid: (r.tenant, r.session_id, r.spec, r.seed, r.base_model) for rid, r in owner.runs.items()
        },
        "samplers": {
            sid: (e.tenant, e.session_id, e.base_model, e.model_path, e.source_run, e.adapter is not None)
            for sid, e in owner.samplers.items()
        },
        "ended": dict(owner.ended),
        "evicted": dict(owner.evicted),
    }


def test_the_registries_change_only_through_their_owner(server):
    svc = server.service
    for name in ("sessions", "runs", "samplers"):
        with pytest.raises(TypeError):
            getattr(svc, name)["s-forged"] = object()  # read-only views: look, do not change
        assert not hasattr(getattr(svc, name), "pop")


def test_two_owners_given_the_same_commands_hold_the_same_registry(make_server, monkeypatch):
    live = make_server(
        max_sampler_snapshots=100,
        max_sampler_snapshots_per_tenant=2,
        limits=Limits(max_full_runs_per_tenant=1),
    )
    svc = live.service
    applied: list[tuple] = []  # (command, the refusal's type or None), in the order applied
    written: list[tuple] = []  # journal records the owner wrote
    lock = threading.Lock()
    apply, journal = svc.owner.apply, svc.owner._journal

    def recording_apply(command):
        try:
            out = apply(command)
        except ApiError as e:
            with lock:
                applied.append((command, type(e)))
            raise
        with lock:
            applied.append((command, None))
        return out

    def recording_journal(record):
        written.append(record)
        journal(record)

    monkeypatch.setattr(svc.owner, "apply", recording_apply)
    monkeypatch.setattr(svc.owner, "_journal", recording_journal)

    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        alice, bob = RawTinker(a), RawTinker(b)
        s1, s2 = alice.session(), alice.session()
        lora = alice.create_model(s1, rank=4)
        full = alice.create_model(s1, model_seq_id=1, rank=0)
        refused = alice.post(
            "create_model", session_id=s2, model_seq_id=0, base_model="openrl/tiny", lora_config={"rank": 0}
        )  # a second full run: over the tenant's quota
        assert refused.status_code == 429 or refused.status_code >= 400, refused.text
        snaps = [alice.snapshot(lora, seq) for seq in (1, 2, 3)]  # the first is evicted (2 per tenant)
        gone = alice.post(
            "asample",
            sampling_session_id=snaps[0],
            num_samples=1,
            prompt={"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
        )
        assert gone.status_code == 404 and "evicted" in gone.json()["error"], gone.text
        saved = alice.post("save_weights_for_sampler", model_id=full, seq_id=1, path="kept")
        path = alice.result(saved.json()["request_id"])["path"]
        on_base = alice.post(
            "create_sampling_session", session_id=s2, sampling_session_seq_id=0, base_model="openrl/tiny"
        )
        on_ckpt = alice.post(
            "create_sampling_session", session_id=s2, sampling_session_seq_id=1, model_path=path
        )
        assert on_base.status_code == 200 and on_ckpt.status_code == 200, (on_base.text, on_ckpt.text)
        b1 = bob.session()
        bob.create_model(b1, rank=2)
        assert alice.post(f"sessions/{s1}/finish", reason={"type": "errored"}).status_code == 200
    svc.remove_tenant("bob")

    assert any(err is not None for _, err in applied), "the refused run was not a command refused"
    kinds = {type(c).__name__ for c, _ in applied}
    assert {"OpenSession", "OpenRun", "AddSampler", "FinishSession", "ForgetTenant"} <= kinds, kinds

    # Every command's journal record is plain data: it survives the journal's encoding unchanged.
    for command, _ in applied:
        record = command.record()
        if record is not None:
            assert records.decode(records.encode(record)) == record, command

    replica_wrote: list[tuple] = []
    replica = Owner(
        journal=replica_wrote.append,
        cut_lock=threading.RLock(),
        limits=svc.limits,
        settings=svc.settings,
        snapshot_bytes_cap=lambda: svc.snapshot_bytes_cap,
        write_session=lambda sess: None,
        open_lane=lambda run_id: None,
        close_lane=lambda lane: None,
        session_listeners=[],
    )
    for command, refusal in applied:
        if refusal is None:
            replica.apply(command)
        else:
            with pytest.raises(refusal):
                replica.apply(command)
    assert _registry(replica) == _registry(svc.owner)
    assert replica.applied == svc.owner.applied  # every command was seen; a refused one is not counted
    assert replica_wrote == written
    assert snaps[0] in replica.evicted and s1 in replica.sessions and replica.sessions[s1].finished
    assert not any(s.tenant == "bob" for s in replica.sessions.values())


def test_a_command_refused_changes_nothing_and_writes_no_record(server):
    svc = server.service
    before = (svc.owner.applied, dict(svc.runs))
    written: list[tuple] = []
    owner = Owner(
        journal=written.append,
        cut_lock=threading.RLock(),
        limits=Limits(max_runs_per_tenant=0),
        settings=svc.settings,
        snapshot_bytes_cap=lambda: 0,
        write_session=lambda sess: None,
        open_lane=lambda run_id: None,
        close_lane=lambda lane: None,
        session_listeners=[],
    )
    from openrl_service.engine.owner import OpenRun, OpenSession
    from openrl_service.errors import QuotaExceeded
    from openrl_service.training.lora import LoraSpec

    sess = owner.apply(OpenSession({"session_id": "s1", "tenant": "alice"}))
    with pytest.raises(QuotaExceeded, match="OPENRL_MAX_RUNS_PER_TENANT"):
        owner.apply(OpenRun("s1:train:0", "alice", "s1", LoraSpec(rank=2), 0, "openrl/tiny"))
    assert dict(owner.runs) == {} and sess.run_ids == [] and owner.applied == 1
    assert [r[0] for r in written] == ["session"]
    owner.apply(RestoreRegistry())
    assert (svc.owner.applied, dict(svc.runs)) == before  # the live service's owner was not touched
