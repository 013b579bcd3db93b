"""Protocol details beyond the conformance script: wire schema, zstd bodies, sessions, health, op records."""

import zstandard
from google.protobuf import descriptor_pb2

from tests._support.raw import RawTinker, fb_body, sft_datum


def test_protobuf_schema_matches_the_sdk():
    from tinker.proto import tinker_public_pb2 as sdk

    from openrl_service.api import proto

    for name, cls in proto.MESSAGES.items():
        ours, theirs = descriptor_pb2.DescriptorProto(), descriptor_pb2.DescriptorProto()
        cls.DESCRIPTOR.CopyToProto(ours)
        getattr(sdk, name).DESCRIPTOR.CopyToProto(theirs)
        assert ours == theirs, name


def test_zstd_compressed_forward_backward(server, raw):
    m = raw.create_model(raw.session())
    body = zstandard.ZstdCompressor().compress(fb_body(m, 1, [sft_datum([11, 12, 13], [21, 22])]))
    r = server.client().post(
        "/api/v1/forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
    )
    assert r.status_code == 200
    out = raw.result(r.json()["request_id"])
    assert len(out["loss_fn_outputs"]) == 1 and out["metrics"]["loss:sum"] > 0


def test_health_and_readiness_need_no_key(server):
    anon = server.client(key=None)
    assert anon.get("/healthz").json()["status"] == "ok"
    assert anon.get("/api/v1/healthz").json()["status"] == "ok"
    ready = anon.get("/readyz").json()
    assert ready["status"] == "ready" and ready["model"] == "openrl/tiny"


def test_finishing_a_session_frees_runs_but_keeps_checkpoints(server, raw):
    sid = raw.session()
    m = raw.create_model(sid)
    path = raw.result(raw.post("save_weights", model_id=m, seq_id=1, path="keep").json()["request_id"])[
        "path"
    ]
    assert raw.post(f"sessions/{sid}/finish", reason={"type": "success"}).status_code == 200
    assert raw.post("session_heartbeat", session_id=sid).status_code == 410  # the SDK stops heartbeating
    assert raw.post("get_info", model_id=m).status_code == 404
    assert m not in server.service.runs
    sid2 = raw.session()
    r = raw.post("load_weights", session_id=sid2, model_seq_id=0, path=path, optimizer=True)
    assert r.status_code == 200
    assert raw.result(r.json()["request_id"])["model_id"] == f"{sid2}:train:0"


def test_every_executed_op_is_recorded(server, raw):
    m = raw.create_model(raw.session())
    start = __import__("time").time()
    raw.result(raw.submit_fb(m, 1, [sft_datum([11, 12, 13], [21, 22])]))
    raw.result(raw.submit_optim(m, 2))
    ops = [op for op in server.service.recorder.since(start) if op.run == m]
    assert [op.kind for op in ops] == ["forward_backward", "optim_step"]
    assert ops[0].tokens == 4 and all(op.end >= op.start and op.ok for op in ops)


def test_old_snapshots_are_evicted_with_an_explanation(make_server):
    live = make_server(max_sampler_snapshots=2)
    raw = RawTinker(live.client())
    sid = raw.session()
    m = raw.create_model(sid)
    ids = []
    for seq in (1, 2, 3):
        r = raw.post(
            "save_weights_for_sampler", model_id=m, seq_id=seq, sampling_session_seq_id=seq, kind="snapshot"
        )
        ids.append(raw.result(r.json()["request_id"])["sampling_session_id"])
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [11, 12]}]}
    gone = raw.post("asample", sampling_session_id=ids[0], num_samples=1, prompt=prompt)
    assert gone.status_code == 404 and "evicted" in gone.json()["error"]
    assert "OPENRL_MAX_SAMPLER_SNAPSHOTS" in gone.json()["error"]
    ok = raw.post("asample", sampling_session_id=ids[2], num_samples=1, prompt=prompt)
    assert ok.status_code == 200 and len(ok.json()["sample_sequence_ids"]) == 1


def test_a_client_that_vanished_has_its_session_finished(make_server):
    live = make_server(session_idle_timeout_s=60)
    raw = RawTinker(live.client())
    sid = raw.session()
    m = raw.create_model(sid)
    assert live.service.reap_idle_sessions() == []  # heartbeats and requests keep a session alive
    assert live.service.reap_idle_sessions(now=__import__("time").time() + 120) == [sid]
    assert raw.post("session_heartbeat", session_id=sid).status_code == 410
    assert raw.post("get_info", model_id=m).status_code == 404


def test_retries_are_remembered_as_long_as_results(make_server):
    live = make_server(future_ttl_s=1)
    raw = RawTinker(live.client())
    m = raw.create_model(raw.session())
    first = raw.submit_fb(m, 1, [sft_datum([11, 12, 13], [21, 22])])
    raw.result(first)
    assert raw.submit_fb(m, 1, [sft_datum([11, 12, 13], [21, 22])]) == first  # a retry within the TTL
    live.service.engine.forget(live.service.futures.sweep(now=__import__("time").time() + 10))
    late = raw.submit_fb(m, 1, [sft_datum([11, 12, 13], [21, 22])])
    assert late != first and "arrived after" in raw.result(late)["error"]  # never applied a second time


def test_each_retrieve_gets_its_own_response():
    """A result fetched twice is sent as two responses: a header one reply gained (as middleware adds
    them) does not ride along on the next, and the body is the same."""
    from openrl_service.api.codec import encode_result
    from openrl_service.engine.futures import FutureRecord

    rec = FutureRecord("r1", "alice", "optim_step", done=True, result={"metrics": {"loss:mean": 1.5}})
    first = encode_result(rec, False)
    first.headers["x-added-by-middleware"] = "1"
    second = encode_result(rec, False)
    assert second is not first
    assert "x-added-by-middleware" not in second.headers
    assert second.body == first.body and second.media_type == "application/json"
