"""Protocol details beyond the conformance script: wire schema, zstd bodies, sessions, health, op records."""

import zstandard
from google.protobuf import descriptor_pb2

from tests.service.raw import RawTinker, fb_body, sft_datum


def test_protobuf_schema_matches_the_sdk():
    from tinker.proto import tinker_public_pb2 as sdk

    from openrl_service.api import proto

    for name, cls in proto.MESSAGES.items():
        ours, theirs = descriptor_pb2.DescriptorProto(), descriptor_pb2.DescriptorProto()
        cls.DESCRIPTOR.CopyToProto(ours)
        getattr(sdk, name).DESCRIPTOR.CopyToProto(theirs)
        assert ours == theirs, name


def test_zstd_compressed_forward_backward(server):
    raw = RawTinker(server.client())
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
    assert anon.get("/healthz").json() == {"status": "ok"}
    assert anon.get("/api/v1/healthz").json() == {"status": "ok"}
    ready = anon.get("/readyz").json()
    assert ready["status"] == "ready" and ready["model"] == "openrl/tiny"


def test_finishing_a_session_frees_runs_but_keeps_checkpoints(server):
    raw = RawTinker(server.client())
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


def test_every_executed_op_is_recorded(server):
    raw = RawTinker(server.client())
    m = raw.create_model(raw.session())
    start = __import__("time").time()
    raw.result(raw.submit_fb(m, 1, [sft_datum([11, 12, 13], [21, 22])]))
    raw.result(raw.submit_optim(m, 2))
    ops = [op for op in server.service.recorder.since(start) if op.run == m]
    assert [op.kind for op in ops] == ["forward_backward", "optim_step"]
    assert ops[0].tokens == 4 and all(op.end >= op.start and op.ok for op in ops)
