"""What `make fuzz` found: each request below was answered 500 (or failed its future as a server error)
before its fix; now it is a 4xx naming the field, or it works. Also: the published schema's links
name real operations and parameters, so a stateful client can follow them."""

from __future__ import annotations

import pytest

from tests._support.raw import result
from tests.service.test_bad_input import (
    RawRun,
    asample,
    assert_error_result,
    assert_refused,
    assert_still_serves,
)


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture
def native_run(client):
    r = client.post("/openrl/v1/runs", json={"name": "fuzz-findings", "rank": 4})
    assert r.status_code == 201, r.text
    run_id = r.json()["run_id"]
    yield run_id
    client.delete(f"/openrl/v1/runs/{run_id}")


# -- sampling parameters at the edge of float32 -----------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 5e-324},  # 0.0 in float32: every token was dropped, softmax of all -inf is NaN
        {"temperature": 1e-300},  # 0 in float32: logits / 0
        {"temperature": 1e-40},  # a float32 subnormal: logits / 1e-40 overflowed to inf
        {"temperature": 1e-300, "top_k": 3, "top_p": 0.5},
    ],
)
def test_extreme_sampling_params_sample_instead_of_failing_on_the_worker(server, client, params):
    run = RawRun(client)
    try:
        r = asample(client, run.sampler(), sampling_params={"max_tokens": 4, **params})
        assert r.status_code == 200, r.text
        out = result(client, r.json()["request_id"])
        assert "error" not in out, out
        assert len(out["sequences"][0]["tokens"]) >= 1
    finally:
        run.finish()
    assert_still_serves(server.url)


def test_tiny_top_p_is_greedy_on_the_notebook_api(client, native_run):
    """The notebook API waits for its sample: it answered 500 here."""
    body = {"prompts": ["Say hi:"], "chat": False, "max_tokens": 3, "top_p": 5e-324, "seed": 1}
    first = client.post(f"/openrl/v1/runs/{native_run}/sample", json=body)
    greedy = client.post(f"/openrl/v1/runs/{native_run}/sample", json={**body, "temperature": 0})
    assert first.status_code == 200, first.text
    assert first.json()["samples"][0]["tokens"] == greedy.json()["samples"][0]["tokens"]


def test_learning_rate_beyond_float32_fails_as_a_result_naming_the_limit(client):
    run = RawRun(client)
    try:
        r = run.post_optim({"learning_rate": 7e306})
        out = result(client, r.json()["request_id"])
        assert out["category"] == "user" and "adam_params.learning_rate" in out["error"], out
        assert "3.4028234663852886e+38" in out["error"], out
        run.train_ok()
    finally:
        run.finish()


def test_sampling_diverged_weights_is_a_user_error_not_a_crash(client, native_run):
    """A learning rate of 1e30 is legal and ruins the run: sampling it says so instead of a 500."""
    url = f"/openrl/v1/runs/{native_run}"
    smp = client.post(f"{url}/sample", json={"prompts": ["Hi"], "max_tokens": 4, "num_samples": 2, "seed": 3})
    samples = [
        {"sample_id": s["sample_id"], "advantage": a}
        for s, a in zip(smp.json()["samples"], (1, -1), strict=True)
    ]
    step = client.post(f"{url}/train_step", json={"samples": samples, "optimizer": {"learning_rate": 1e30}})
    assert step.status_code == 200, step.text
    again = client.post(f"{url}/sample", json={"prompts": ["Hi"], "max_tokens": 4, "temperature": 1.0})
    assert_refused(again, 400, "NaN or infinite logits", "learning_rate")


# -- notebook API bodies ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "message", [{"role": "user"}, {"content": "hi"}, {"role": "user", "content": {"text": "hi"}}, "hi"]
)
def test_chat_message_that_is_not_role_and_content_strings_is_a_400(client, native_run, message):
    r = client.post(f"/openrl/v1/runs/{native_run}/sample", json={"prompts": [[message]]})
    assert_refused(r, 400, "prompts[0][0]", "role, content")


@pytest.mark.parametrize("sample_id", [{}, [None], 7])
def test_sample_id_that_is_not_a_string_is_a_400(client, native_run, sample_id):
    r = client.post(
        f"/openrl/v1/runs/{native_run}/train_step",
        json={"samples": [{"sample_id": sample_id, "advantage": 1}]},
    )
    assert_refused(r, 400, "samples[0].sample_id")


@pytest.mark.parametrize(
    "loss_config, needle",
    # this API's field is loss_config (Tinker's is loss_fn_config): the refusal names the one sent
    [([None], "loss_config"), ({"clip_low_threshold": "low"}, "loss_config.clip_low_threshold")],
)
def test_loss_config_that_is_not_named_numbers_is_a_400(client, native_run, loss_config, needle):
    smp = client.post(f"/openrl/v1/runs/{native_run}/sample", json={"prompts": ["Hi"], "max_tokens": 2})
    sid = smp.json()["samples"][0]["sample_id"]
    r = client.post(
        f"/openrl/v1/runs/{native_run}/train_step",
        json={"samples": [{"sample_id": sid, "advantage": 1}], "loss": "ppo", "loss_config": loss_config},
    )
    assert_refused(r, 400, needle)


@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo"])
@pytest.mark.parametrize("key, value", [("clip_high_threshold", 1e39), ("clip_low_threshold", -1e39)])
def test_a_clip_threshold_beyond_float32_is_a_400_not_a_failed_step(client, native_run, loss, key, value):
    """A clip threshold no float32 can hold made torch.clamp raise on the worker: the train step
    failed as an internal error (make fuzz, a protobuf forward_backward with cispo). Now refused
    before anything runs, naming the field and the range; the run still trains after it."""
    smp = client.post(f"/openrl/v1/runs/{native_run}/sample", json={"prompts": ["Hi"], "max_tokens": 2})
    sid = smp.json()["samples"][0]["sample_id"]
    body = {"samples": [{"sample_id": sid, "advantage": 1}], "loss": loss}
    r = client.post(f"/openrl/v1/runs/{native_run}/train_step", json={**body, "loss_config": {key: value}})
    assert_refused(r, 400, f"loss_config.{key}")
    assert "float32" in r.json()["error"]
    ok = client.post(f"/openrl/v1/runs/{native_run}/train_step", json=body)
    assert ok.status_code == 200, ok.text


# -- REST bodies ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, field",
    [
        ({"owner": "own"}, "owner"),
        ({"user_metadata": [1]}, "user_metadata"),
        ({"project_ids": 3}, "project_ids"),
        ({"statuses": [["active"]]}, "statuses[0]"),
        ({"cursor": {"last_created_at": 1, "last_session_id": "s"}}, "cursor.last_created_at"),
        ({"cursor": {"last_created_at": "2026-01-01T00:00:00Z"}}, "cursor.last_session_id"),
    ],
)
def test_session_search_filters_of_the_wrong_type_are_a_400(client, body, field):
    assert_refused(client.post("/api/v1/sessions/search", json=body), 400, field)


def test_session_search_still_pages_with_a_well_formed_cursor(client):
    for _ in range(2):
        client.post("/api/v1/create_session", json={"display_name": "paged"})
    first = client.post("/api/v1/sessions/search", json={"display_name": "paged", "limit": 1}).json()
    cursor = first["next_cursor"]
    assert cursor is not None
    second = client.post(
        "/api/v1/sessions/search", json={"display_name": "paged", "limit": 1, "cursor": cursor}
    )
    assert second.status_code == 200, second.text
    assert second.json()["sessions"][0]["session_id"] != first["sessions"][0]["session_id"]


@pytest.mark.parametrize("session_id", [{}, ["s"]])
def test_copy_weights_into_a_session_id_that_is_not_a_string_is_a_400(client, session_id):
    body = {"source_path": "tinker://r/weights/x", "session_id": session_id, "model_seq_id": 0}
    assert_refused(client.post("/api/v1/copy_weights", json=body), 400, "session_id")


# -- a run's name and model of the wrong JSON type (issue 21) ------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"base_model": {}}, "base_model"),  # answered 500: unhashable type in the model lookup
        ({"base_model": []}, "base_model"),
        ({"base_model": 7}, "base_model"),
        ({"name": []}, "name"),  # accepted with 201 (an empty list is falsy: a default name)
        ({"name": {}}, "name"),
        ({"name": 0}, "name"),
        ({"name": False}, "name"),
    ],
)
def test_a_run_name_or_model_that_is_not_a_string_is_a_400(server, client, body, field):
    before = {r["run_id"] for r in client.get("/openrl/v1/runs").json()["runs"]}
    r = client.post("/openrl/v1/runs", json=body)
    err = assert_refused(r, 400, field)
    assert err["field"] == field
    assert {r["run_id"] for r in client.get("/openrl/v1/runs").json()["runs"]} == before  # none made


def test_a_tinker_model_whose_base_model_is_not_a_string_is_a_400(client):
    sess = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0"}).json()["session_id"]
    try:
        body = {"session_id": sess, "model_seq_id": 0, "base_model": {"x": 1}, "lora_config": {"rank": 4}}
        r = client.post("/api/v1/create_model", json=body)
        assert r.status_code == 400 or (
            r.status_code == 200 and "base_model" in result(client, r.json()["request_id"])["error"]
        ), r.text
    finally:
        client.post("/api/v1/session_heartbeat", json={"session_id": sess})


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/api/v1/load_weights", {"path": "not-a-tinker-path", "seq_id": 1}, "model_id"),
        ("/api/v1/load_weights", {"model_id": "m", "path": 5}, "seq_id"),
        ("/api/v1/optim_step", {"model_id": "m", "adam_params": {"beta1": 2}}, "seq_id"),
        ("/api/v1/save_weights", {"seq_id": 1, "path": "bad name"}, "model_id"),
        ("/api/v1/save_weights_for_sampler", {"model_id": "m", "seq_id": -1, "path": 7}, "seq_id"),
        ("/api/v1/save_weights_for_sampler", {"seq_id": 3}, "model_id"),  # no path nor session seq either
    ],
)
def test_an_op_with_no_run_or_slot_and_another_bad_field_is_a_400_naming_the_slot(
    server, client, path, body, field
):
    """An op ordered by seq_id keeps its slot when a field is refused (the refusal is its result), but
    one with no model_id or seq_id has no slot: a 400 naming that field, whichever error came first (a
    bad path first once made the route read the missing model_id: a 500)."""
    r = client.post(path, json=body)
    assert_refused(r, 400, field)
    assert r.json()["field"] == field
    assert_still_serves(server.url)


# -- found by a review of the request models ---------------------------------------------------
@pytest.mark.parametrize(
    "path, extra, field",
    [
        ("/api/v1/save_weights", {"path": "flagged", "overwrite": "false"}, "overwrite"),
        ("/api/v1/load_weights", {"path": "tinker://x:train:0/weights/y", "optimizer": "true"}, "optimizer"),
        ("/api/v1/save_weights_for_sampler", {"sampling_session_seq_id": -1}, "sampling_session_seq_id"),
    ],
)
def test_an_ops_flag_or_id_of_the_wrong_kind_fails_in_its_slot_instead_of_being_guessed(
    client, path, extra, field
):
    """ "false" is not false (it used to overwrite), "true" is not true (it used to load without the
    optimizer, silently), -1 is no sampling session: the op fails as a result naming the field, and
    the run goes on."""
    run = RawRun(client)
    r = client.post(path, json={"model_id": run.model_id, "seq_id": run.next_seq(), **extra})
    assert_error_result(client, r, field)
    run.train_ok()


def test_a_metric_that_is_not_a_number_is_named_by_its_own_key(client, native_run):
    for key in ("reward_mean", "Accuracy", "pass@1-top"):
        r = client.post(f"/openrl/v1/runs/{native_run}/metrics", json={"step": 1, key: "0.5"})
        err = assert_refused(r, 400, "a finite number or null")
        assert err["field"] == key, err


def test_chat_messages_keep_the_keys_a_chat_template_reads_and_k8s_takes_numeric_quantities(server):
    from openrl_service.api.schemas import bodies

    b = bodies(server.service.limits, server.service.settings.min_ttl_s)
    message = {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "calc"}
    sent = b.NativeSample.model_validate({"prompts": [[message]]}).model_dump(exclude_none=True)
    assert sent["prompts"] == [[message]]
    job = b.SubmitJob.model_validate(
        {
            "name": "j",
            "kind": "run",
            "where": "k8s",
            "payload": "aGVsbG8=",
            "payload_sha256": "0" * 64,
            "k8s": {"cpu": 2, "memory": 4e9},
        }
    )
    assert job.k8s.cpu == 2 and job.k8s.memory == 4e9


# -- the published schema ---------------------------------------------------------------------
def test_every_link_names_a_real_operation_and_parameter(server):
    with server.client() as c:
        spec = c.get("/openapi.json").json()
    ops = {
        op["operationId"]: (path, op) for path, methods in spec["paths"].items() for op in methods.values()
    }
    links = 0
    for _, op in ops.values():
        for response in op["responses"].values():
            for name, link in response.get("links", {}).items():
                links += 1
                target_path, target = ops[link["operationId"]]  # KeyError: a link to nowhere
                for param in link.get("parameters", {}):
                    pname = param.partition(".")[2]
                    assert f"{{{pname}}}" in target_path, (name, param, target_path)
                if "requestBody" in link:
                    schema = target["requestBody"]["content"]["application/json"]["schema"]
                    variants = [schema, *schema.get("anyOf", [])]
                    for key in link["requestBody"]:
                        assert any(key in v.get("properties", {}) for v in variants), (name, key)
    assert links >= 40
    # each JSON body the handlers read is described, with its required fields
    create_model = ops["tinker_create_model"][1]["requestBody"]["content"]["application/json"]["schema"]
    assert create_model["required"] == ["session_id", "model_seq_id"]
    lora, null = create_model["properties"]["lora_config"]["anyOf"]  # the SDK sends null for "not set"
    assert null == {"type": "null"}
    assert lora["properties"]["rank"]["anyOf"][0]["maximum"] == 128
