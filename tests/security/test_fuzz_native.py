"""Every JSON field of the notebook API (``/openrl/v1/runs…``), the jobs API (``/openrl/v1/jobs…``)
and the keys API (``/api/v1/keys``), sent with each wrong JSON type — an object, an array, a bool, a
float, a string, null, integers past 64 bits, long strings, arrays nested 300 deep — into an
otherwise valid body.

The promise: never a 5xx. A value of a type the field does not take is a 4xx whose JSON error
names the field (in the message or as ``field``); a value of a type it takes may work or be
refused, never fail the service. Afterwards the service still creates, samples, trains and saves.

Each route is one table-driven test that sends every (field, value) pair and reports every broken
promise at once. A hypothesis test then sends arbitrary JSON values to random fields.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import uuid
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ALICE_KEY, free_port, start_server

V1 = "/openrl/v1"


def nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


# name → (value, its JSON type). "int" values past 64 bits arrive as floats (orjson); still ints here.
VALUES: dict[str, tuple[object, str]] = {
    "object": ({"k": 1}, "object"),
    "empty-object": ({}, "object"),
    "array": ([1], "array"),
    "empty-array": ([], "array"),
    "true": (True, "bool"),
    "false": (False, "bool"),
    "float": (1.5, "number"),
    "int": (7, "int"),
    "negative": (-3, "int"),
    "string": ("x", "string"),
    "empty-string": ("", "string"),
    "null": (None, "null"),
    "2**64": (2**64, "int"),
    "-2**63-1": (-(2**63) - 1, "int"),
    "long-string": ("é" * 5000, "string"),
    "nested-300": (nested(300), "array"),
}


@dataclass(frozen=True)
class Field:
    """A body field and the JSON types it takes (``number`` takes ints too)."""

    name: str
    takes: frozenset[str]

    def accepts(self, kind: str) -> bool:
        return kind in self.takes or (kind == "int" and "number" in self.takes)


def F(name: str, *takes: str) -> Field:
    return Field(name, frozenset(takes))


class Findings:
    """Every broken promise of one route, reported together."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def check(self, route: str, field: Field, label: str, kind: str, r: httpx.Response) -> None:
        where = f"{route} {field.name}={label}"
        if r.status_code >= 500:
            self.items.append(f"{where}: {r.status_code} {r.text[:200]}")
            return
        if r.status_code < 400:
            if not field.accepts(kind):
                self.items.append(f"{where}: accepted ({r.status_code}) a {kind} the field does not take")
            return
        try:
            err = r.json()
        except ValueError:
            self.items.append(f"{where}: {r.status_code} without a JSON error: {r.text[:200]}")
            return
        if not isinstance(err, dict) or not isinstance(err.get("error"), str):
            self.items.append(f"{where}: {r.status_code} JSON without an error message: {r.text[:200]}")
            return
        named = field.name in err["error"] or str(err.get("field") or "").startswith(field.name)
        if not field.accepts(kind) and not named:
            self.items.append(f"{where}: {r.status_code} does not name the field: {err}")

    def assert_none(self) -> None:
        assert not self.items, f"{len(self.items)} broken:\n" + "\n".join(self.items)


# -- one private service for the module -------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir):
    served = start_server(tmp_path_factory.mktemp("fuzz"), tiny_model_dir)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def alice(live):
    with live.client(ALICE_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def run_id(alice):
    r = alice.post(f"{V1}/runs", json={"name": "fuzzed", "seed": 0, "rank": 4})
    assert r.status_code == 201, r.text
    yield r.json()["run_id"]
    alice.delete(f"{V1}/runs/{r.json()['run_id']}")


def fuzz_route(c: httpx.Client, method: str, path: str, base: dict, fields: list[Field], after=None) -> None:
    """Send ``base`` with each field replaced by each value; ``after(response)`` cleans up a success."""
    found = Findings()
    for f in fields:
        for label, (value, kind) in VALUES.items():
            try:
                r = c.request(method, path, json={**base, f.name: value})
            except httpx.TimeoutException:
                found.items.append(f"{method} {path} {f.name}={label}: no answer in {c.timeout.read} s")
                continue
            found.check(f"{method} {path}", f, label, kind, r)
            if after is not None and r.status_code < 300:
                after(r)
    found.assert_none()


def still_serves(c: httpx.Client) -> None:
    """The service is ready and a fresh run creates, samples, trains and saves."""
    assert c.get("/readyz").json()["status"] == "ready"
    run = c.post(f"{V1}/runs", json={"name": f"after-{uuid.uuid4().hex[:6]}", "rank": 4})
    assert run.status_code == 201, run.text
    rid = run.json()["run_id"]
    try:
        out = c.post(f"{V1}/runs/{rid}/sample", json={"prompts": ["a"], "num_samples": 2, "max_tokens": 3})
        assert out.status_code == 200, out.text
        items = [
            {"sample_id": s["sample_id"], "advantage": a}
            for s, a in zip(out.json()["samples"], (1, -1), strict=True)
        ]
        step = c.post(f"{V1}/runs/{rid}/train_step", json={"samples": items})
        assert step.status_code == 200 and step.json()["step"] == 1, step.text
        saved = c.post(f"{V1}/runs/{rid}/checkpoints", json={"name": "after"})
        assert saved.status_code == 201, saved.text
    finally:
        c.delete(f"{V1}/runs/{rid}")


# -- the notebook API -------------------------------------------------------------------------------
def test_create_run_fields(alice):
    def delete(r: httpx.Response) -> None:
        alice.delete(f"{V1}/runs/{r.json()['run_id']}")

    fields = [
        F("name", "string", "null"),
        F("base_model", "string", "null"),
        F("rank", "int", "null"),
        F("train_attn", "bool", "null"),
        F("train_mlp", "bool", "null"),
        F("train_unembed", "bool", "null"),
        F("seed", "int", "null"),
        F("steps", "int", "null"),
        F("load_from", "string", "null"),
        F("user_metadata", "object", "null"),
    ]
    fuzz_route(alice, "POST", f"{V1}/runs", {"name": "fz", "rank": 4}, fields, after=delete)
    still_serves(alice)


def test_heartbeat_and_control_fields(alice, run_id):
    fuzz_route(alice, "POST", f"{V1}/runs/{run_id}/heartbeat", {}, [F("state", "string", "null")])
    fuzz_route(
        alice,
        "POST",
        f"{V1}/runs/{run_id}/control",
        {"action": "resume"},
        [F("action", "string"), F("reason", "string", "null")],
    )
    still_serves(alice)


def test_sample_fields(alice, run_id):
    fields = [
        F("prompts", "array"),
        F("chat", "bool", "null"),
        F("max_tokens", "int", "null"),
        F("temperature", "number", "null"),
        F("top_p", "number", "null"),
        F("top_k", "int", "null"),
        F("seed", "int", "null"),
        F("stop", "array", "string", "null"),
        F("num_samples", "int", "null"),
    ]
    base = {"prompts": ["a"], "max_tokens": 2}
    fuzz_route(alice, "POST", f"{V1}/runs/{run_id}/sample", base, fields)
    # inside the prompts list: each prompt, and each chat message's parts
    found = Findings()
    for label, (value, kind) in VALUES.items():
        url = f"{V1}/runs/{run_id}/sample"
        r = alice.post(url, json={**base, "prompts": [value]})
        found.check("sample", F("prompts", "string", "array"), label, kind, r)
        for part in ("role", "content"):
            msg = {"role": "user", "content": "hi", part: value}
            r = alice.post(url, json={**base, "prompts": [[msg]]})
            found.check("sample", F("prompts", "string"), label, kind, r)
    found.assert_none()
    still_serves(alice)


def test_train_step_fields(alice, run_id):
    def samples() -> list[dict]:
        out = alice.post(
            f"{V1}/runs/{run_id}/sample", json={"prompts": ["a"], "num_samples": 2, "max_tokens": 3}
        )
        assert out.status_code == 200, out.text
        return [
            {"sample_id": s["sample_id"], "advantage": a}
            for s, a in zip(out.json()["samples"], (1, -1), strict=True)
        ]

    base = {"samples": samples()}
    fields = [
        F("samples", "array"),
        F("loss", "string", "null"),
        F("loss_config", "object", "null"),
        F("optimizer", "object", "null"),
    ]
    fuzz_route(alice, "POST", f"{V1}/runs/{run_id}/train_step", base, fields)
    found = Findings()
    items = samples()
    for label, (value, kind) in VALUES.items():
        for part, takes in (("sample_id", ("string",)), ("advantage", ("number",))):
            bad = [{**items[0], part: value}, items[1]]
            r = alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": bad})
            found.check("train_step", F("samples[0]", *takes), f"{part}={label}", kind, r)
        r = alice.post(f"{V1}/runs/{run_id}/train_step", json={"samples": [value]})
        found.check("train_step", F("samples[0]", "object"), label, kind, r)
        for key, takes in (("learning_rate", "number"), ("beta1", "number"), ("eps", "number")):
            r = alice.post(
                f"{V1}/runs/{run_id}/train_step", json={"samples": items, "optimizer": {key: value}}
            )
            found.check("train_step", F(key, takes, "null"), label, kind, r)  # null: the default
        r = alice.post(
            f"{V1}/runs/{run_id}/train_step", json={"samples": items, "loss_config": {"clip": value}}
        )
        found.check("train_step", F("loss_config", "number"), label, kind, r)
    found.assert_none()
    still_serves(alice)


def test_checkpoint_fields(alice, run_id):
    fields = [
        F("name", "string"),
        F("overwrite", "bool", "null"),
        F("user_metadata", "object", "null"),
        F("ttl_seconds", "int", "null"),
    ]
    fuzz_route(alice, "POST", f"{V1}/runs/{run_id}/checkpoints", {"name": "fz", "overwrite": True}, fields)
    still_serves(alice)


def test_metrics_fields(alice, run_id):
    fields = [
        F("step", "int"),
        F("reward_mean", "number", "null"),
        F("reward_name", "string", "null"),  # null: not given (api/schemas.py), as every optional field
        F("anything", "number", "null"),
    ]
    fuzz_route(alice, "POST", f"{V1}/runs/{run_id}/metrics", {"step": 1, "reward_mean": 0.5}, fields)
    still_serves(alice)


# -- the jobs API -----------------------------------------------------------------------------------
PAYLOAD = b"opaque job payload bytes"


def job_body(name: str, data: bytes = PAYLOAD) -> dict:
    return {
        "name": name,
        "kind": "run",
        "where": "local",
        "payload": base64.b64encode(data).decode(),
        "payload_sha256": hashlib.sha256(data).hexdigest(),
        "reward": "letters",
        "meta": {"steps": 3},
    }


def test_job_fields(alice):
    def delete(r: httpx.Response) -> None:
        alice.delete(f"{V1}/jobs/{r.json()['job_id']}")

    fields = [
        F("name", "string"),
        F("kind", "string"),
        F("where", "string"),
        F("payload", "string"),
        F("payload_sha256", "string"),
        F("reward", "string", "null"),
        F("meta", "object", "null"),
        F("k8s", "object", "null"),
    ]
    fuzz_route(alice, "POST", f"{V1}/jobs", job_body("fz"), fields, after=delete)
    found = Findings()
    for label, (value, kind) in VALUES.items():  # the values inside meta
        r = alice.post(f"{V1}/jobs", json={**job_body("fz"), "meta": {"m": value}})
        found.check("jobs", F("meta", "string", "number", "bool", "null"), label, kind, r)
        if r.status_code < 300:
            delete(r)
    found.assert_none()

    r = alice.post(f"{V1}/jobs", json=job_body("fz-state"))
    assert r.status_code == 201, r.text
    job = r.json()
    try:
        with httpx.Client(base_url=str(alice.base_url), headers={"X-API-Key": job["key"]}, timeout=60) as jk:
            state = [F("state", "string"), F("pid", "int", "null"), F("host", "string", "null")]
            state.append(F("message", "string", "null"))
            fuzz_route(jk, "POST", f"{V1}/jobs/{job['job_id']}/state", {"state": "running"}, state)
        fuzz_route(
            alice,
            "POST",
            f"{V1}/jobs/{job['job_id']}/control",
            {"action": "pause"},
            [F("action", "string"), F("reason", "string", "null")],
        )
        new = job_body("fz", b"another version")
        payload = {k: new[k] for k in ("payload", "payload_sha256", "reward")}
        fields = [F("payload", "string"), F("payload_sha256", "string"), F("reward", "string", "null")]
        fuzz_route(alice, "POST", f"{V1}/jobs/{job['job_id']}/payloads", payload, fields)
    finally:
        alice.delete(f"{V1}/jobs/{job['job_id']}")
    assert alice.post(f"{V1}/jobs", json=job_body("fz-after")).status_code == 201
    still_serves(alice)


# -- the keys API: its router on its own (minting needs a hub user; the hub is not what is fuzzed) ----
@pytest.fixture(scope="module")
def keys_service(tmp_path_factory):
    import uvicorn
    from fastapi import FastAPI, Request

    from openrl_service.api.hubauth import MintedKeys
    from openrl_service.api.keys import build_keys_router
    from openrl_service.app import ApiError, json_response
    from openrl_service.config import hub_tenant

    app = FastAPI()
    minted = MintedKeys(tmp_path_factory.mktemp("keys") / "minted-keys.json", 1000)
    app.include_router(build_keys_router(minted, 1 << 20))

    @app.middleware("http")
    async def as_hub_user(request: Request, call_next):  # what AuthMiddleware sets for a hub token
        request.state.tenant, request.state.auth_via = hub_tenant("alice"), "hub"
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def service_error(request: Request, exc: ApiError):
        return json_response(exc.to_json(), status=exc.status_code)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.started:
            break
        threading.Event().wait(0.05)
    yield url
    server.should_exit = True
    thread.join(15)


def test_key_fields(keys_service):
    with httpx.Client(base_url=keys_service, timeout=60) as c:
        fuzz_route(c, "POST", "/api/v1/keys", {"name": "laptop"}, [F("name", "string", "null")])
        assert c.post("/api/v1/keys", json={"name": "after"}).status_code == 201


# -- arbitrary JSON anywhere ------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ROUTES = {
    "sample": (
        {"prompts": ["a"], "max_tokens": 2},
        ["prompts", "chat", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_samples"],
    ),
    "checkpoints": ({"name": "hy", "overwrite": True}, ["name", "overwrite", "user_metadata", "ttl_seconds"]),
    "metrics": ({"step": 1}, ["step", "reward_mean", "reward_name", "x"]),
    "heartbeat": ({}, ["state"]),
}


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(route=st.sampled_from(sorted(ROUTES)), data=st.data(), value=JSON)
def test_arbitrary_json_in_any_field_is_never_a_server_error(alice, run_id, route, data, value):
    base, names = ROUTES[route]
    name = data.draw(st.sampled_from(names))
    r = alice.post(f"{V1}/runs/{run_id}/{route}", json={**base, name: value})
    assert r.status_code < 500, (route, name, value, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert isinstance(r.json().get("error"), str), r.text[:300]
