"""Bad input gets a 4xx, or an error result, whose message names the field and the limit; never a 500.

Two ways a bad request is answered, and both are checked here:

* refused at the door: HTTP 4xx with ``{"error", "category": "user", "field"}``;
* a training request that already took its seq slot (its model_id and seq_id parsed): HTTP 200 with a
  request id whose ``retrieve_future`` result is ``{"error", "category": "user"}`` (the Tinker
  "error-as-result" convention), and the run carries on at the next seq_id.

After every bad request the service must still serve: /readyz is ready, a fresh run trains and a
fresh sampler samples.
"""

from __future__ import annotations

import math
import struct

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types

from openrl_service.api import proto
from openrl_service.config import Limits
from tests._support.raw import fb_body, result
from tests.conftest import ALICE_KEY, BOB_KEY, TINY

PROTO = "application/x-protobuf"
VOCAB = 260  # openrl/tiny
CONTEXT = 2048  # openrl/tiny


# -- helpers: the Tinker flow over raw HTTP ------------------------------------------------------------
def datum(tokens=(11, 12, 13, 14, 15), **inputs) -> dict:
    """A cross-entropy datum; ``inputs`` override or add loss_fn_inputs (numpy arrays keep their dtype)."""
    tokens = list(tokens)
    base = {
        "target_tokens": np.asarray(tokens[1:] + [tokens[0]], dtype=np.int64),
        "weights": np.ones(len(tokens), dtype=np.float32),
    }
    base.update(inputs)
    return {"tokens": tokens, "inputs": {k: v for k, v in base.items() if v is not None}}


def rl_datum(tokens=(11, 12, 13, 14), **inputs) -> dict:
    n = len(tokens)
    rl = {
        "weights": None,
        "logprobs": np.full(n, -1.0, dtype=np.float32),
        "advantages": np.ones(n, dtype=np.float32),
    }
    return datum(tokens, **{**rl, **inputs})


def fb_request(model_id: str, seq_id: int, data: list[dict], loss_fn: str = "cross_entropy", **kw) -> bytes:
    return fb_body(model_id, seq_id, [(d["tokens"], d["inputs"]) for d in data], loss_fn, **kw)


class RawRun:
    """One LoRA training run in its own session, driven the way the SDK drives it (seq ids from 1)."""

    def __init__(self, client: httpx.Client, rank: int = 8):
        self.client = client
        self.session_id = client.post("/api/v1/create_session", json={}).json()["session_id"]
        r = client.post(
            "/api/v1/create_model",
            json={
                "session_id": self.session_id,
                "model_seq_id": 0,
                "base_model": TINY,
                "lora_config": {"rank": rank},
            },
        )
        assert r.status_code == 200, r.text
        self.model_id = r.json()["model_id"]
        assert result(client, r.json()["request_id"])["model_id"] == self.model_id
        self.seq = 0
        self.samplers = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def post_fb(self, data: list[dict], loss_fn: str = "cross_entropy", **kw) -> httpx.Response:
        body = fb_request(self.model_id, self.next_seq(), data, loss_fn, **kw)
        return self.client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": PROTO})

    def valid_request(self):
        """A valid one-datum ForwardBackwardRequest at the next seq_id, for a test to break."""
        msg = proto.ForwardBackwardRequest()
        msg.ParseFromString(fb_request(self.model_id, self.next_seq(), [datum()]))
        return msg

    def post_proto(self, msg) -> httpx.Response:
        return self.client.post(
            "/api/v1/forward_backward", content=msg.SerializeToString(), headers={"Content-Type": PROTO}
        )

    def post_optim(self, adam_params: dict) -> httpx.Response:
        return self.client.post(
            "/api/v1/optim_step",
            json={"model_id": self.model_id, "seq_id": self.next_seq(), "adam_params": adam_params},
        )

    def train_ok(self) -> float:
        """A good forward_backward at the next seq_id succeeds: the run was not wedged."""
        r = self.post_fb([datum()])
        assert r.status_code == 200, r.text
        out = result(self.client, r.json()["request_id"])
        assert "error" not in out, out
        loss = out["metrics"]["loss:sum"]
        assert math.isfinite(loss)
        return loss

    def sampler(self) -> str:
        r = self.client.post(
            "/api/v1/create_sampling_session",
            json={
                "session_id": self.session_id,
                "sampling_session_seq_id": self.samplers,
                "base_model": TINY,
            },
        )
        self.samplers += 1
        assert r.status_code == 200, r.text
        return r.json()["sampling_session_id"]

    def finish(self) -> None:
        """Free the run's slot. A fresh connection: after a 500 the server may drop the pooled one."""
        with httpx.Client(base_url=self.client.base_url, headers=self.client.headers, timeout=60) as c:
            c.post(f"/api/v1/sessions/{self.session_id}/finish", json={"reason": {"type": "success"}})


def asample(client: httpx.Client, sampler_id: str, tokens=(11, 12, 13), **overrides) -> httpx.Response:
    body = {
        "sampling_session_id": sampler_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
        "sampling_params": {"max_tokens": 4, "temperature": 1.0},
    }
    body.update(overrides)
    return client.post("/api/v1/asample", json=body)


def assert_refused(resp: httpx.Response, status: int, *needles: str) -> dict:
    """Refused at the door with ``status``; the JSON message names every needle (field, limit)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert body["category"] == "user", body
    for needle in needles:
        assert needle in body["error"], (needle, body)
    return body


def assert_error_result(client: httpx.Client, resp: httpx.Response, *needles: str) -> dict:
    """Accepted (it took its seq slot) and failed as a user error result naming every needle."""
    assert resp.status_code == 200, (resp.status_code, resp.text)
    out = result(client, resp.json()["request_id"])
    assert set(out) >= {"error", "category"}, out
    assert out["category"] == "user", out
    for needle in needles:
        assert needle in out["error"], (needle, out)
    return out


def assert_still_serves(url: str) -> None:
    """The service is ready, a fresh run trains and a fresh sampler samples."""
    assert httpx.get(f"{url}/readyz", timeout=10).json()["status"] == "ready"
    with httpx.Client(base_url=url, headers={"X-API-Key": ALICE_KEY}, timeout=60) as c:
        run = RawRun(c)
        try:
            run.train_ok()
            r = asample(c, run.sampler())
            assert r.status_code == 200, r.text
            out = result(c, r.json()["request_id"])
            assert out["sequences"][0]["tokens"], out
        finally:
            run.finish()


@pytest.fixture
def client(server):
    with server.client(ALICE_KEY) as c:
        yield c


@pytest.fixture
def run(client):
    r = RawRun(client)
    yield r
    r.finish()


# -- malformed bodies ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [b"\x0a\xff\xff\xff\xff", b"\xff\xff\xff", b"definitely not a protobuf"],
    ids=["truncated-field", "bad-tag", "text"],
)
def test_malformed_protobuf_is_a_400_naming_the_body(server, client, body):
    r = client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": PROTO})
    assert_refused(r, 400, "ForwardBackwardRequest", "protobuf")
    assert r.json()["field"] == "body"
    assert_still_serves(server.url)


def test_forward_backward_as_json_is_refused_with_the_content_type_to_use(server, client, run):
    """The SDK always sends protobuf; a hand-written JSON body is told what to send instead."""
    r = client.post("/api/v1/forward_backward", json={"model_id": run.model_id, "seq_id": 1, "data": []})
    assert_refused(r, 400, PROTO)
    assert_still_serves(server.url)


@pytest.mark.parametrize(
    "path", ["/api/v1/create_session", "/api/v1/create_model", "/api/v1/asample", "/api/v1/retrieve_future"]
)
def test_malformed_json_is_a_400_naming_the_body(server, client, path):
    r = client.post(path, content=b'{"session_id": "s1", ', headers={"Content-Type": "application/json"})
    assert_refused(r, 400, "not valid JSON")
    assert r.json()["field"] == "body"
    assert_still_serves(server.url)


@pytest.mark.parametrize("body", [b"[1, 2, 3]", b'"hello"', b"42", b"null"])
def test_json_that_is_not_an_object_is_a_400(server, client, body):
    r = client.post("/api/v1/create_model", content=body, headers={"Content-Type": "application/json"})
    assert_refused(r, 400, "JSON object")
    assert_still_serves(server.url)


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/json ;charset=UTF-8",
        "application/problem+json",
        "application/vnd.openrl.v1+json; charset=utf-8",
    ],
)
def test_json_media_types_are_accepted(client, content_type):
    r = client.post(
        "/api/v1/retrieve_future", content=b'{"request_id": "nope"}', headers={"Content-Type": content_type}
    )
    assert r.status_code == 404 and "nope" in r.json()["error"], r.text  # parsed, then not found


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain; hint=json",  # held "json" somewhere: accepted before
        "text/json",
        "application/jsonp",
        "application/json-seq",
        "application/x-ndjson",
        "multipart/form-data; boundary=json",
        "application/x-www-form-urlencoded; x=application/json",
        "json",
        "application/+json",
        "text/plain",
        "",
    ],
)
def test_other_media_types_are_a_415_naming_the_header(client, content_type):
    """Only application/json and application/*+json bodies are read as JSON; anything else (a form a
    browser may post cross-site without CORS, a type merely containing "json") is refused before it
    is parsed, naming the header and what was sent."""
    r = client.post(
        "/api/v1/retrieve_future", content=b'{"request_id": "nope"}', headers={"Content-Type": content_type}
    )
    err = assert_refused(r, 415, "Content-Type", "application/json")
    assert err["field"] == "Content-Type"


def test_corrupt_zstd_body_is_a_400(server, client, run):
    r = client.post(
        "/api/v1/forward_backward",
        content=b"\x28\xb5\x2f\xfd garbage",
        headers={"Content-Type": PROTO, "Content-Encoding": "zstd"},
    )
    assert_refused(r, 400, "zstd")
    assert_still_serves(server.url)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/api/v1/create_model", {"session_id": 7, "model_seq_id": 0}, "session_id"),
        ("/api/v1/create_model", {"model_seq_id": 0}, "session_id"),
        ("/api/v1/get_info", {"model_id": ["x"]}, "model_id"),
        ("/api/v1/retrieve_future", {}, "request_id"),
        ("/api/v1/asample", {"sampling_session_id": "x", "prompt": "hello"}, "prompt"),
        ("/api/v1/asample", {"sampling_session_id": "x", "prompt": {"chunks": []}}, "prompt.chunks"),
        (
            "/api/v1/asample",
            {"sampling_session_id": "x", "prompt": {"chunks": [{"type": "encoded_text", "tokens": "abc"}]}},
            "prompt.chunks[0].tokens",
        ),
        ("/api/v1/optim_step", {"model_id": 3, "seq_id": 1, "adam_params": {}}, "model_id"),
    ],
    ids=[
        "session_id-not-a-string",
        "session_id-missing",
        "model_id-list",
        "request_id-missing",
        "prompt-string",
        "chunks-empty",
        "tokens-string",
        "optim-model_id-int",
    ],
)
def test_wrong_json_types_are_a_400_naming_the_field(server, client, path, body, field):
    r = client.post(path, json=body)
    assert_refused(r, 400, field)
    assert r.json()["field"] == field
    assert_still_serves(server.url)


# -- unknown ids ---------------------------------------------------------------------------------------
def test_unknown_model_id_is_a_404(server, client):
    assert_refused(
        client.post("/api/v1/get_info", json={"model_id": "nope:train:0"}), 404, "model_id", "nope"
    )
    body = fb_request("nope:train:0", 1, [datum()])
    r = client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": PROTO})
    assert_refused(r, 404, "model_id")
    r = client.post("/api/v1/optim_step", json={"model_id": "nope:train:0", "seq_id": 1, "adam_params": {}})
    assert_refused(r, 404, "model_id")
    assert_still_serves(server.url)


def test_unknown_session_id_is_a_404(server, client):
    r = client.post(
        "/api/v1/create_model", json={"session_id": "s-nope", "model_seq_id": 0, "lora_config": {"rank": 8}}
    )
    assert_refused(r, 404, "session_id")
    assert_still_serves(server.url)


def test_unknown_training_run_is_a_404(server, client):
    assert_refused(client.get("/api/v1/training_runs/nope:train:0"), 404, "training run", "nope")
    assert_refused(client.get("/api/v1/training_runs/nope:train:0/checkpoints"), 404, "nope")
    assert_still_serves(server.url)


def test_unknown_sampling_session_id_is_a_404(server, client):
    assert_refused(asample(client, "nope:sample:0"), 404, "sampling_session_id", "nope")
    assert_refused(client.get("/api/v1/samplers/nope:sample:0"), 404, "sampling_session_id")
    assert_still_serves(server.url)


def test_unknown_request_id_is_a_404(server, client):
    r = client.post("/api/v1/retrieve_future", json={"request_id": "req-does-not-exist"})
    assert_refused(r, 404, "request_id", "req-does-not-exist")
    assert_still_serves(server.url)


def test_unknown_base_model_names_the_served_one(server, client, run):
    r = client.post(
        "/api/v1/create_model",
        json={
            "session_id": run.session_id,
            "model_seq_id": 1,
            "base_model": "acme/giant-70b",
            "lora_config": {},
        },
    )
    assert_refused(r, 404, "base_model", "acme/giant-70b", TINY)
    assert_still_serves(server.url)


def test_unknown_checkpoint_path_is_a_404_or_names_the_path(server, client, run):
    missing = f"tinker://{run.model_id}/weights/never-saved"
    r = client.post(
        "/api/v1/load_weights",
        json={"session_id": run.session_id, "model_seq_id": 1, "path": missing, "optimizer": False},
    )
    assert_refused(r, 404, "never-saved")
    r = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": run.session_id, "sampling_session_seq_id": 0, "model_path": missing},
    )
    assert_refused(r, 404, "never-saved")
    r = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": run.session_id, "sampling_session_seq_id": 1, "model_path": "s3://bucket/x"},
    )
    assert_refused(r, 400, "model_path", "tinker://")
    # load_state on a live run takes its seq slot, so it fails as a result and the run carries on.
    r = client.post(
        "/api/v1/load_weights",
        json={"model_id": run.model_id, "seq_id": run.next_seq(), "path": missing, "optimizer": False},
    )
    assert_error_result(client, r, "never-saved", "not found")
    run.train_ok()
    assert_still_serves(server.url)


# -- datums: lengths, shapes, dtypes, vocabulary, context ---------------------------------------------
def test_target_tokens_length_mismatch_names_both_lengths(server, client, run):
    r = run.post_fb([datum(target_tokens=np.arange(3, dtype=np.int64))])
    assert_error_result(client, r, "data[0].loss_fn_inputs.target_tokens", "[3]", "model_input length 5")
    run.train_ok()
    assert_still_serves(server.url)


def test_weights_shape_mismatch_names_the_field(server, client, run):
    r = run.post_fb([datum(), datum(weights=np.ones(7, dtype=np.float32))])
    assert_error_result(client, r, "data[1].loss_fn_inputs.weights", "[7]", "[5]")
    run.train_ok()
    assert_still_serves(server.url)


@pytest.mark.parametrize(
    "inputs, field, expected",
    [
        ({"target_tokens": np.arange(1, 6, dtype=np.float32)}, "target_tokens", "int64"),
        ({"weights": np.ones(5, dtype=np.int64)}, "weights", "float32"),
    ],
    ids=["target_tokens-float32", "weights-int64"],
)
def test_wrong_dtype_names_the_field_and_the_expected_dtype(server, client, run, inputs, field, expected):
    r = run.post_fb([datum(**inputs)])
    assert_error_result(client, r, f"data[0].loss_fn_inputs.{field}", expected)
    run.train_ok()
    assert_still_serves(server.url)


def test_unsupported_tensor_dtype_names_the_field(server, client, run):
    msg = run.valid_request()
    msg.data[0].loss_fn_inputs["weights"].dtype = proto.DTYPE_BFLOAT16
    msg.data[0].loss_fn_inputs["weights"].dense = b"\x00\x3f" * 5
    r = run.post_proto(msg)
    assert_error_result(client, r, "data[0].loss_fn_inputs.weights", "bfloat16")
    run.train_ok()
    assert_still_serves(server.url)


def test_tensor_shape_that_lies_about_its_size_names_the_field(server, client, run):
    msg = run.valid_request()
    del msg.data[0].loss_fn_inputs["weights"].shape[:]
    msg.data[0].loss_fn_inputs["weights"].shape.extend([9])
    r = run.post_proto(msg)
    assert_error_result(client, r, "data[0].loss_fn_inputs.weights", "[9]", "5 values")
    run.train_ok()
    assert_still_serves(server.url)


def test_tensor_shape_whose_product_overflows_is_an_error_not_a_500(server, client, run):
    """2**62 * 4 wraps to 0 in int64, which "matches" an empty buffer; the shape must still be refused."""
    msg = run.valid_request()
    t = msg.data[0].loss_fn_inputs["weights"]
    t.dense = b""
    del t.shape[:]
    t.shape.extend([2**62, 4])
    r = run.post_proto(msg)
    assert_error_result(client, r, "data[0].loss_fn_inputs.weights")
    run.train_ok()
    assert_still_serves(server.url)


def test_sparse_tensor_declaring_a_huge_shape_is_an_error_not_a_500(server, client, run):
    """An empty CSR tensor can declare [N, 2**40] in a few bytes; decoding it must not allocate terabytes."""
    msg = run.valid_request()
    t = msg.data[0].loss_fn_inputs["target_tokens"]
    t.ClearField("dense")
    del t.shape[:]
    t.shape.extend([5, 2**40])
    t.sparse_csr.crow_indices = np.zeros(6, dtype="<i8").tobytes()
    del msg.data[0].loss_fn_inputs["weights"]
    r = run.post_proto(msg)
    assert_error_result(client, r, "data[0].loss_fn_inputs.target_tokens")
    run.train_ok()
    assert_still_serves(server.url)


def test_malformed_sparse_tensor_names_the_field(server, client, run):
    msg = run.valid_request()
    t = msg.data[0].loss_fn_inputs["target_tokens"]
    t.ClearField("dense")
    del t.shape[:]
    t.shape.extend([5, 2])
    t.sparse_csr.values = np.arange(3, dtype="<i8").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 1, 2, 3, 9, 3], dtype="<i8").tobytes()
    t.sparse_csr.col_indices = np.array([0, 5, 1], dtype="<i8").tobytes()
    r = run.post_proto(msg)
    assert_error_result(client, r, "data[0].loss_fn_inputs.target_tokens", "CSR")
    run.train_ok()
    assert_still_serves(server.url)


def test_token_bytes_that_are_not_whole_int32s_name_the_field(server, client, run):
    msg = run.valid_request()
    msg.data[0].model_input[0].encoded_text.tokens += b"\x01"
    r = run.post_proto(msg)
    assert_error_result(client, r, "data[0].model_input", "int32")
    run.train_ok()
    assert_still_serves(server.url)


def test_image_chunks_are_refused_for_a_text_model(server, client, run):
    msg = run.valid_request()
    msg.data[0].model_input.add().image.data = b"\x89PNG"
    r = run.post_proto(msg)
    assert_error_result(client, r, "data[0].model_input", "image")
    run.train_ok()
    assert_still_serves(server.url)


def test_token_id_outside_the_vocabulary_names_the_vocabulary_size(server, client, run):
    r = run.post_fb([datum(tokens=(11, 12, 300, 14, 15))])
    assert_error_result(client, r, "data[0].model_input", "300", f"[0, {VOCAB})")
    r = run.post_fb([datum(tokens=(11, -1, 13, 14, 15))])
    assert_error_result(client, r, "data[0].model_input", "-1")
    r = run.post_fb([datum(target_tokens=np.array([12, 13, 14, 15, VOCAB], dtype=np.int64))])
    assert_error_result(client, r, "data[0].loss_fn_inputs.target_tokens", f"[0, {VOCAB})")
    run.train_ok()
    assert_still_serves(server.url)


def test_sequence_over_the_context_length_names_the_limit(server, client, run):
    r = run.post_fb([datum(tokens=[7] * (CONTEXT + 1))])
    assert_error_result(client, r, "data[0].model_input", str(CONTEXT + 1), f"context length is {CONTEXT}")
    run.train_ok()
    assert_still_serves(server.url)


def test_empty_data_and_empty_model_input_name_the_field(server, client, run):
    assert_error_result(client, run.post_fb([]), "data", "at least one datum")
    empty = {"tokens": [], "inputs": {"target_tokens": np.zeros(0, dtype=np.int64)}}
    assert_error_result(client, run.post_fb([empty]), "data[0].model_input is empty")
    run.train_ok()
    assert_still_serves(server.url)


def test_too_many_datums_names_the_limit(server, client, run):
    r = run.post_fb([datum(tokens=(1, 2))] * (Limits().max_datums + 1))
    assert_error_result(client, r, "data", str(Limits().max_datums), "OPENRL_MAX_DATUMS")
    run.train_ok()
    assert_still_serves(server.url)


def test_missing_and_unexpected_loss_inputs_name_the_key(server, client, run):
    r = run.post_fb([rl_datum(advantages=None)], "importance_sampling")
    assert_error_result(client, r, "data[0].loss_fn_inputs", "advantages")
    r = run.post_fb([datum(mask=np.ones(5, dtype=np.float32))])
    assert_error_result(client, r, "data[0].loss_fn_inputs", "mask", "accepted: target_tokens, weights")
    run.train_ok()
    assert_still_serves(server.url)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_advantages_name_the_field(server, client, run, bad):
    adv = np.array([1.0, bad, 1.0, 1.0], dtype=np.float32)
    r = run.post_fb([rl_datum(advantages=adv)], "importance_sampling")
    assert_error_result(client, r, "data[0].loss_fn_inputs.advantages", "NaN or inf")
    run.train_ok()
    assert_still_serves(server.url)


# -- losses ----------------------------------------------------------------------------------------------
def test_stable_reinforce_without_provenance_is_refused_naming_the_spans(server, client, run):
    r = run.post_fb([rl_datum()], "stable_reinforce")
    assert_error_result(client, r, "data[0].loss_fn_input_spans", "provenance")
    run.train_ok()
    assert_still_serves(server.url)


def test_stable_reinforce_through_the_sdk_raises_request_failed_and_the_client_carries_on(
    server, service_client
):
    """Data without provenance (no sequence ids from a record_stability_info sampler): a clear error,
    then a working client."""
    tc = service_client.create_lora_training_client(base_model=TINY, rank=8).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([11, 12, 13]),
            loss_fn_inputs={"target_tokens": [12, 13, 14], "logprobs": [-1.0] * 3, "advantages": [1.0] * 3},
        )
    ]
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward_backward(data, "stable_reinforce").result()
    assert "stable_reinforce needs the datum's provenance" in str(err.value)
    assert "data[0].loss_fn_input_spans" in str(err.value)
    out = tc.forward_backward(data, "importance_sampling").result()
    assert math.isfinite(out.metrics["loss:sum"])
    assert_still_serves(server.url)


@pytest.mark.parametrize("loss_fn", ["not_a_loss", "custom", "CROSS_ENTROPY"])
def test_unknown_loss_is_refused_with_the_supported_losses(server, client, run, loss_fn):
    r = run.post_fb([datum()], loss_fn)
    assert_error_result(client, r, "loss_fn", repr(loss_fn), "supported losses: cross_entropy")
    run.train_ok()
    assert_still_serves(server.url)


def test_bad_loss_config_names_the_key(server, client, run):
    r = run.post_fb([rl_datum()], "ppo", loss_fn_config={"clip_sideways": 1.0})
    assert_error_result(client, r, "loss_fn_config", "clip_sideways", "clip_low_threshold")
    r = run.post_fb([rl_datum()], "ppo", loss_fn_config={"clip_low_threshold": math.nan})
    assert_error_result(client, r, "loss_fn_config.clip_low_threshold", "finite")
    r = run.post_fb(
        [rl_datum()], "ppo", loss_fn_config={"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}
    )
    assert_error_result(client, r, "clip_low_threshold must be <= clip_high_threshold")
    run.train_ok()
    assert_still_serves(server.url)


# -- optimizer, seq ids, checkpoint names -------------------------------------------------------------
@pytest.mark.parametrize(
    "adam, field",
    [
        ({"learning_rate": -1e-4}, "adam_params.learning_rate"),
        ({"learning_rate": 1e-4, "beta1": 1.0}, "adam_params.beta1"),
        ({"learning_rate": 1e-4, "eps": "tiny"}, "adam_params.eps"),
    ],
    ids=["negative-lr", "beta1-one", "eps-string"],
)
def test_invalid_adam_params_fail_as_a_result_and_the_run_continues(server, client, run, adam, field):
    run.train_ok()
    assert_error_result(client, run.post_optim(adam), field)
    run.train_ok()  # the next seq_id runs: the failed step took its slot and left no gap
    r = run.post_optim({"learning_rate": 1e-4})
    out = result(client, r.json()["request_id"])
    assert "error" not in out, out
    assert_still_serves(server.url)


def test_dimuon_params_are_checked_and_must_match_the_runs_optimizer(server, client, run):
    r = client.post(
        "/api/v1/optim_step",
        json={"model_id": run.model_id, "seq_id": run.next_seq(), "optimizer_params": {"type": "dimuon"}},
    )
    assert_error_result(client, r, "optimizer_params.learning_rate", "required")
    r = client.post(
        "/api/v1/optim_step",
        json={
            "model_id": run.model_id,
            "seq_id": run.next_seq(),
            "optimizer_params": {"type": "dimuon", "learning_rate": 1e-3},
        },
    )
    assert_error_result(client, r, "optimizer_params", "created with the adamw optimizer")
    run.train_ok()
    assert_still_serves(server.url)


def test_negative_or_missing_seq_id_is_a_400(server, client, run):
    body = fb_request(run.model_id, -3, [datum()])
    r = client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": PROTO})
    assert_refused(r, 400, "seq_id", "-3")
    r = client.post(
        "/api/v1/optim_step", json={"model_id": run.model_id, "adam_params": {"learning_rate": 1e-4}}
    )
    assert_refused(r, 400, "seq_id")
    run.train_ok()
    assert_still_serves(server.url)


@pytest.mark.parametrize("name", ["../../etc/passwd", "", "a/b", "x" * 200])
def test_bad_checkpoint_name_names_the_path_field(server, client, run, name):
    r = client.post(
        "/api/v1/save_weights", json={"model_id": run.model_id, "seq_id": run.next_seq(), "path": name}
    )
    assert_error_result(client, r, "path", "checkpoint name")
    run.train_ok()
    assert_still_serves(server.url)


# -- LoRA rank --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [-4, Limits().max_rank + 1, 8.5, "8", True])  # 0: a full fine-tune
def test_rank_out_of_range_names_the_limit(server, client, run, rank):
    r = client.post(
        "/api/v1/create_model",
        json={
            "session_id": run.session_id,
            "model_seq_id": 1,
            "base_model": TINY,
            "lora_config": {"rank": rank},
        },
    )
    assert_refused(r, 400, "lora_config.rank", f"[0, {Limits().max_rank}]", "OPENRL_MAX_RANK")
    assert_still_serves(server.url)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"model_seq_id": -1}, "model_seq_id"),
        ({"model_seq_id": "zero"}, "model_seq_id"),
        ({"lora_config": "rank-8"}, "lora_config"),
        ({"lora_config": {"rank": 8, "seed": "lucky"}}, "lora_config.seed"),
        (
            {"lora_config": {"rank": 8, "train_attn": False, "train_mlp": False, "train_unembed": False}},
            "lora_config",
        ),
        ({"optimizer_config": {"type": "lion"}}, "optimizer_config.type"),
    ],
    ids=["seq-negative", "seq-string", "lora-string", "seed-string", "nothing-to-train", "unknown-optimizer"],
)
def test_bad_create_model_fields_name_the_field(server, client, run, body, field):
    base = {"session_id": run.session_id, "model_seq_id": 1, "base_model": TINY, "lora_config": {"rank": 8}}
    r = client.post("/api/v1/create_model", json={**base, **body})
    assert_refused(r, 400, field)
    assert r.json()["field"] == field
    assert_still_serves(server.url)


# -- sampling ----------------------------------------------------------------------------------------------
@pytest.fixture
def sampler(run):
    return run.sampler()


@pytest.mark.parametrize("n", [0, -1, Limits().max_num_samples + 1, "2", 1.5])
def test_num_samples_out_of_range_names_the_limit(server, client, sampler, n):
    r = asample(client, sampler, num_samples=n)
    assert_refused(r, 400, "num_samples", f"[1, {Limits().max_num_samples}]", "OPENRL_MAX_NUM_SAMPLES")
    assert_still_serves(server.url)


@pytest.mark.parametrize("max_tokens", [0, -5, Limits().max_tokens + 1, 2.5])
def test_max_tokens_out_of_range_names_the_limit(server, client, sampler, max_tokens):
    r = asample(client, sampler, sampling_params={"max_tokens": max_tokens})
    assert_refused(r, 400, "sampling_params.max_tokens", f"[1, {Limits().max_tokens}]", "OPENRL_MAX_TOKENS")
    assert_still_serves(server.url)


def test_prompt_plus_max_tokens_over_the_context_length_names_the_limit(server, client, sampler):
    r = asample(client, sampler, tokens=[7] * (CONTEXT - 2), sampling_params={"max_tokens": 8})
    assert_refused(r, 400, "sampling_params.max_tokens", f"context length {CONTEXT}", str(CONTEXT - 2))
    r = asample(client, sampler, tokens=[7] * (CONTEXT + 1), sampling_params={"max_tokens": 1})
    assert_refused(r, 400, f"context length {CONTEXT}")
    assert_still_serves(server.url)


def test_prompt_token_outside_the_vocabulary_names_the_vocabulary_size(server, client, sampler):
    assert_refused(asample(client, sampler, tokens=(11, VOCAB)), 400, "prompt", f"[0, {VOCAB})")
    # a negative id is refused by the request model, which knows no vocabulary: it names the field
    r = asample(client, sampler, tokens=(11, -2))
    assert_refused(r, 400, "prompt", ">= 0")
    assert r.json()["field"] == "prompt.chunks[0].tokens[1]"
    assert_still_serves(server.url)


@pytest.mark.parametrize(
    "params, field, limit",
    [
        ({"temperature": -1.0}, "sampling_params.temperature", ">= 0"),
        ({"temperature": "hot"}, "sampling_params.temperature", ">= 0"),
        ({"top_p": 0}, "sampling_params.top_p", "(0, 1]"),
        ({"top_p": 1.5}, "sampling_params.top_p", "(0, 1]"),
        ({"top_k": 0}, "sampling_params.top_k", "-1"),
        ({"seed": "abc"}, "sampling_params.seed", "integer"),
        ({"stop": [VOCAB]}, "sampling_params.stop", f"[0, {VOCAB})"),
        ({"stop": ["x"] * 17}, "sampling_params.stop", "OPENRL_MAX_STOP_SEQUENCES"),
        ({"stop": ["x", 3]}, "sampling_params.stop", "mix"),
        ({"stop": [""]}, "sampling_params.stop", "non-empty"),
    ],
)
def test_bad_sampling_params_name_the_field(server, client, sampler, params, field, limit):
    r = asample(client, sampler, sampling_params={"max_tokens": 4, **params})
    assert_refused(r, 400, field, limit)
    assert_still_serves(server.url)


@pytest.mark.parametrize("name", ["topk_prompt_logprobs", "topk_sample_logprobs"])
def test_topk_over_the_limit_names_the_limit(server, client, sampler, name):
    r = asample(client, sampler, **{name: Limits().max_topk + 1})
    assert_refused(r, 400, name, "OPENRL_MAX_TOPK")
    assert_still_serves(server.url)


# -- body size ---------------------------------------------------------------------------------------------
@pytest.fixture
def small_server(make_server):
    return make_server(limits=Limits(max_body_bytes=1000))


def test_oversized_json_body_is_a_413_naming_the_limit(small_server):
    with small_server.client(ALICE_KEY) as c:
        r = c.post("/api/v1/create_session", json={"user_metadata": {"notes": "x" * 5000}})
        assert_refused(r, 413, "1000", "OPENRL_MAX_BODY_BYTES")
    assert_still_serves(small_server.url)


def test_oversized_body_without_content_length_is_a_413(small_server):
    """A chunked upload has no Content-Length to check up front; the limit is enforced while reading."""
    with small_server.client(ALICE_KEY) as c:
        chunks = iter([b'{"user_metadata": {"notes": "', b"x" * 5000, b'"}}'])
        r = c.post("/api/v1/create_session", content=chunks, headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers
        assert_refused(r, 413, "1000", "OPENRL_MAX_BODY_BYTES")
    assert_still_serves(small_server.url)


def test_oversized_protobuf_is_a_413_naming_the_limit(small_server):
    with small_server.client(ALICE_KEY) as c:
        run = RawRun(c)
        r = run.post_fb([datum(tokens=[7] * 400)])
        assert_refused(r, 413, "OPENRL_MAX_BODY_BYTES")
        run.finish()
    assert_still_serves(small_server.url)


def test_zstd_body_that_inflates_past_the_limit_is_a_413(small_server):
    with small_server.client(ALICE_KEY) as c:
        run = RawRun(c)
        body = zstandard.ZstdCompressor().compress(fb_request(run.model_id, 1, [datum(tokens=[7] * 2000)]))
        assert len(body) < 1000
        r = c.post(
            "/api/v1/forward_backward",
            content=body,
            headers={"Content-Type": PROTO, "Content-Encoding": "zstd"},
        )
        assert_refused(r, 413, "decompressed", "OPENRL_MAX_BODY_BYTES")
        run.finish()
    assert_still_serves(small_server.url)


def test_zstd_frame_declaring_a_terabyte_is_a_413_not_a_500(small_server):
    """A 17-byte zstd frame may *declare* 1 TiB of content; the limit must apply before allocating it."""
    frame = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", 2**40)
    frame += ((1000 << 3) | (1 << 1) | 1).to_bytes(3, "little") + b"\0"  # one last RLE block
    with small_server.client(ALICE_KEY) as c:
        r = c.post(
            "/api/v1/forward_backward",
            content=frame,
            headers={"Content-Type": PROTO, "Content-Encoding": "zstd"},
        )
        assert_refused(r, 413, "OPENRL_MAX_BODY_BYTES")
    assert_still_serves(small_server.url)


# -- isolation: one caller's bad input does not disturb anyone else ----------------------------------------
def test_bad_requests_do_not_disturb_other_runs_or_tenants(server):
    """Alice's run A trains while Bob's run B (and Alice's run C) send a stream of bad requests."""
    with server.client(ALICE_KEY) as alice, server.client(BOB_KEY) as bob:
        a, b, c = RawRun(alice), RawRun(bob), RawRun(alice)
        try:
            baseline = a.train_ok()
            # A has work in flight (submitted, not yet collected) while the bad requests arrive.
            in_flight = [a.post_fb([datum()]), a.post_optim({"learning_rate": 1e-2}), a.post_fb([datum()])]
            bad = [
                b.post_fb([datum(target_tokens=np.arange(2, dtype=np.int64))]),
                b.post_fb([rl_datum(advantages=np.full(4, np.nan, dtype=np.float32))], "importance_sampling"),
                b.post_fb([datum()], "stable_reinforce"),
                b.post_optim({"learning_rate": -1.0}),
                c.post_fb([datum(tokens=[7] * (CONTEXT + 1))]),
                c.post_fb([datum(tokens=(11, 999))]),
            ]
            refused = [
                bob.post(
                    "/api/v1/forward_backward", content=b"\x0a\xff\xff", headers={"Content-Type": PROTO}
                ),
                bob.post(
                    "/api/v1/create_model", content=b"{oops", headers={"Content-Type": "application/json"}
                ),
                asample(bob, b.sampler(), num_samples=10_000),
                bob.post("/api/v1/get_info", json={"model_id": a.model_id}),  # not Bob's
            ]
            # B parks a request behind a seq gap; A must not wait for it.
            gap = b.client.post(
                "/api/v1/forward_backward",
                content=fb_request(b.model_id, b.seq + 50, [datum()]),
                headers={"Content-Type": PROTO},
            )
            assert gap.status_code == 200, gap.text
            outs = [result(alice, r.json()["request_id"]) for r in in_flight]
            assert all("error" not in o for o in outs), outs
            assert outs[2]["metrics"]["loss:sum"] < baseline  # the optimizer step really happened
            for r, who in zip(bad, [bob] * 4 + [alice] * 2, strict=True):
                assert "error" in result(who, r.json()["request_id"])
            assert [r.status_code for r in refused] == [400, 400, 400, 404]
            a.train_ok()
            c.train_ok()
        finally:
            for r in (a, b, c):
                r.finish()
    assert_still_serves(server.url)


# -- what a newer SDK sends ---------------------------------------------------------------------------
def test_fields_a_newer_sdk_adds_are_ignored_and_null_means_not_set(server, client, run, sampler):
    """The Tinker routes take the SDK's bodies as they grow: an unknown field is ignored (not a 400),
    and ``null`` for an option is the option left out (the SDK sends null for every unset one)."""
    r = client.post(
        "/api/v1/create_model",
        json={
            "session_id": run.session_id,
            "model_seq_id": 7,
            "base_model": TINY,
            "lora_config": {"rank": 4, "seed": None, "train_mlp": None, "dropout_v2": 0.1},
            "optimizer_config": None,
            "user_metadata": None,
            "routing_hint": {"region": "eu"},
        },
    )
    assert r.status_code == 200, r.text
    made = result(client, r.json()["request_id"])
    info = client.post("/api/v1/get_info", json={"model_id": made["model_id"], "type": "get_info"}).json()
    assert info["lora_rank"] == 4, info
    r = asample(
        client,
        sampler,
        num_samples=None,
        sampling_params={"max_tokens": 3, "temperature": None, "top_p": None, "stop": None, "new_knob": 1},
        prompt_logprobs=None,
        future_option=True,
    )
    assert r.status_code == 200, r.text
    out = result(client, r.json()["request_id"])
    assert len(out["sequences"]) == 1 and len(out["sequences"][0]["tokens"]) <= 3, out
