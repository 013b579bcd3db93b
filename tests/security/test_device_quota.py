"""One tenant cannot take all the device time: OPENRL_MAX_DEVICE_SECONDS_PER_TENANT per
OPENRL_DEVICE_SECONDS_WINDOW_S.

The engine measures the seconds its ops hold the devices for each tenant (engine/usage.py); over the
quota a tenant's new work is refused with a 429 that names the quota, its usage and when it frees
up, on the Tinker API and the notebook API, while work it had already sent runs to the end and
another tenant is not refused at all. The attack: one tenant keeps the device busy so that every
neighbour's steps wait behind its own.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
import tinker
from tinker import types

from openrl_service.config import Limits, from_env
from openrl_service.engine.usage import DeviceUsage
from tests._support.raw import RawTinker, sft_datum
from tests.conftest import ALICE_KEY, BOB_KEY, TINY
from tests.service.test_scheduling import asample, held_worker, sampler

QUOTA_S = 0.2  # device-seconds: a few dozen steps of the tiny model
WINDOW_S = 4.0
DATUM = [sft_datum(list(range(10, 40)), list(range(40, 70)))]
V1 = "/openrl/v1"


def quota_server(make_server, quota_s: float = QUOTA_S, window_s: float = WINDOW_S):
    return make_server(limits=Limits(max_device_seconds_per_tenant=quota_s, device_seconds_window_s=window_s))


def fb(raw: RawTinker, model_id: str, seq: int) -> httpx.Response:
    from tests._support.raw import fb_body

    return raw.http.post(
        "/api/v1/forward_backward",
        content=fb_body(model_id, seq, DATUM),
        headers={"Content-Type": "application/x-protobuf"},
    )


def step(raw: RawTinker, model_id: str, seq: int) -> None:
    r = fb(raw, model_id, seq)
    assert r.status_code == 200, r.text
    assert "error" not in raw.result(r.json()["request_id"])


def assert_names_the_quota(r: httpx.Response) -> dict:
    assert r.status_code == 429, r.text
    body = r.json()
    text = body["error"]
    assert body["limit"] == "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT", body
    for what in ("OPENRL_MAX_DEVICE_SECONDS_PER_TENANT", "OPENRL_DEVICE_SECONDS_WINDOW_S", "device-seconds"):
        assert what in text, text
    assert f"{QUOTA_S:g}" in text and f"{WINDOW_S:g}" in text and "frees up in" in text, text
    assert body["device_seconds"] >= QUOTA_S and body["device_seconds_limit"] == QUOTA_S, body
    assert 0 < body["retry_after_s"] <= WINDOW_S + 0.1, body
    assert 1 <= int(r.headers["Retry-After"]) <= WINDOW_S + 1, r.headers
    return body


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_over_its_device_time_a_tenant_is_refused_naming_the_quota_and_a_neighbour_is_not(make_server):
    live = quota_server(make_server)
    svc = live.service
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        alice, bob = RawTinker(a), RawTinker(b)
        hers, his = alice.create_model(alice.session()), bob.create_model(bob.session())
        her_sampler, his_sampler = sampler(alice, alice.sessions[0], 1), sampler(bob, bob.sessions[0], 1)
        her_run = a.post(f"{V1}/runs", json={"name": "nb", "rank": 2})
        assert her_run.status_code == 201, her_run.text
        her_run_id = her_run.json()["run_id"]
        drawn = a.post(f"{V1}/runs/{her_run_id}/sample", json={"prompts": ["abc"], "max_tokens": 2})
        assert drawn.status_code == 200, drawn.text
        scored = [{"sample_id": x["sample_id"], "advantage": 1.0} for x in drawn.json()["samples"]]

        # accepted work always runs: steps queued while she was under the quota all complete, and
        # take her past it (enough of them for 2.5 times the quota, by what one step costs)
        before = svc.device_time.used_s("alice")
        step(alice, hers, 1)
        n = math.ceil(2.5 * QUOTA_S / (svc.device_time.used_s("alice") - before)) + 1
        with held_worker(svc.engine, svc.futures):
            queued = []
            for seq in range(2, n + 2):
                r = fb(alice, hers, seq)
                assert r.status_code == 200, r.text
                queued.append(r.json()["request_id"])
        assert all("error" not in alice.result(rid) for rid in queued)
        assert svc.device_time.used_s("alice") >= QUOTA_S

        seq = n + 2
        refused = fb(alice, hers, seq)
        assert_names_the_quota(refused)
        assert "'alice'" in refused.json()["error"]
        # every kind of new device work is refused: sampling on both APIs, a new notebook run
        assert_names_the_quota(asample(a, her_sampler))
        sample = a.post(f"{V1}/runs/{her_run_id}/sample", json={"prompts": ["abc"], "max_tokens": 2})
        assert_names_the_quota(sample)
        assert_names_the_quota(a.post(f"{V1}/runs/{her_run_id}/train_step", json={"samples": scored}))
        completion = a.post("/v1/completions", json={"model": TINY, "prompt": "abc", "max_tokens": 2})
        assert completion.status_code == 429 and "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT" in completion.text
        assert_names_the_quota(a.post(f"{V1}/runs", json={"name": "more", "rank": 2}))

        # bob is not refused, on either API, and his usage is his own
        mine = fb(bob, his, 1)
        assert mine.status_code == 200, mine.text
        assert "error" not in bob.result(mine.json()["request_id"])
        assert asample(b, his_sampler).status_code == 200
        his_run = b.post(f"{V1}/runs", json={"name": "nb", "rank": 2})
        assert his_run.status_code == 201, his_run.text
        got = b.post(
            f"{V1}/runs/{his_run.json()['run_id']}/sample", json={"prompts": ["abc"], "max_tokens": 2}
        )
        assert got.status_code == 200, got.text

        # what each tenant sees of its own usage in /metrics; the operator sees everyone's
        own = a.get("/metrics").text
        assert metric(own, "openrl_tenant_device_seconds_limit") == QUOTA_S
        assert metric(own, "openrl_tenant_device_quota_refusals_total") >= 6
        assert metric(own, "openrl_tenant_device_seconds_total") >= QUOTA_S
        assert metric(b.get("/metrics").text, "openrl_tenant_device_quota_refusals_total") == 0
        admin_key = (live.data_dir / "admin-key").read_text().strip()
        rows = httpx.get(f"{live.url}{V1}/admin/tenants", headers={"X-API-Key": admin_key}).json()["tenants"]
        by = {row["tenant"]: row for row in rows}
        assert by["alice"]["device_quota_refusals"] >= 6 and by["bob"]["device_quota_refusals"] == 0
        assert by["alice"]["device_seconds_total"] > by["bob"]["device_seconds_total"] > 0

        # the window frees it up: the refused step (its seq_id was never taken) is accepted then
        deadline = time.monotonic() + 3 * WINDOW_S
        while (r := fb(alice, hers, seq)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(r.json()["retry_after_s"])
        assert r.status_code == 200, r.text
        assert "error" not in alice.result(r.json()["request_id"])
        alice.finish_sessions()
        bob.finish_sessions()


def test_the_tinker_sdk_waits_out_the_window_and_its_steps_complete(make_server):
    """The SDK retries a 429 after its Retry-After (when the window frees room), so a training loop
    over the quota slows down to it instead of failing; each of its steps completes, once."""
    live = quota_server(make_server)
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(10, 70))),
        loss_fn_inputs={"target_tokens": list(range(11, 71)), "weights": [1.0] * 60},
    )
    usage = live.service.device_time
    steps = 0
    while usage.refusals("alice") < 2 and steps < 2000:
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        steps += 1
    assert usage.refusals("alice") >= 2, f"{steps} steps never reached the quota"
    ops = [r for r in live.service.recorder.since(0) if r.kind == "optim_step" and r.ok]
    assert len(ops) == steps  # every step the loop made ran, once, refusals and retries included
    sc.close("success").result()


def test_a_fused_call_is_charged_to_its_tenants_by_their_tokens(make_server):
    """Alice's and bob's steps run in one fused pass: each pays the share of its tokens, as the op
    records lay them out, not the whole call."""
    live = make_server()
    svc = live.service
    usage = svc.device_time
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        alice, bob = RawTinker(a), RawTinker(b)
        hers, his = alice.create_model(alice.session()), bob.create_model(bob.session())
        short = [sft_datum([11, 12, 13, 14, 15], [21, 22, 23, 24, 25])]
        long = [sft_datum(list(range(10, 25)), list(range(30, 42)))]
        before = usage.total_s("alice"), usage.total_s("bob")
        with held_worker(svc.engine, svc.futures):
            t0 = time.time()
            ids = [alice.submit_fb(hers, 1, short), bob.submit_fb(his, 1, long)]
        assert all("error" not in raw.result(rid) for raw, rid in zip((alice, bob), ids, strict=True))
        records = [r for r in svc.recorder.since(t0) if r.kind == "forward_backward"]
        assert len(records) == 2 and records[0].fused_id and records[0].fused_id == records[1].fused_id
        spent = usage.total_s("alice") - before[0], usage.total_s("bob") - before[1]
        by_run = {r.run: r for r in records}
        assert spent[0] > 0 and by_run[his].tokens > by_run[hers].tokens > 0
        assert spent[1] / spent[0] == pytest.approx(by_run[his].tokens / by_run[hers].tokens, rel=1e-6)
        for run, paid in ((hers, spent[0]), (his, spent[1])):  # what each op record says it took
            assert paid == pytest.approx(by_run[run].duration_s, rel=0.05, abs=0.005)
        alice.finish_sessions()
        bob.finish_sessions()


def test_device_time_on_several_ranks_is_summed_and_leaves_the_window():
    """The accounting, on a clock the test moves (a real group: tests/service/test_world_size_device_time.py):
    an op's cost is its wall time on rank 0 plus what the other ranks reported spending during it,
    sampling (rank 0 only) costs its wall time, a fused call is split by tokens, and usage leaves
    the window when its oldest charges do, which is when the 429 said it would."""
    now, followers = [1000.0], [0.0]
    usage = DeviceUsage(
        Limits(max_device_seconds_per_tenant=5.0, device_seconds_window_s=60.0),
        others_busy_s=lambda: followers[0],
        clock=lambda: now[0],
    )
    began = usage.begin()
    now[0] += 2.0
    followers[0] += 1.5  # rank 1's part of a training step
    assert usage.charge(began, [("alice", 1.0)]) == pytest.approx(3.5)
    began = usage.begin()
    now[0] += 1.0  # a sample: rank 0 alone
    usage.charge(began, [("alice", 1.0)])
    began = usage.begin()
    now[0] += 1.0
    followers[0] += 1.0
    usage.charge(began, [("alice", 10.0), ("bob", 30.0)])  # fused: 2 device-seconds by tokens
    assert usage.used_s("alice") == pytest.approx(5.0) and usage.used_s("bob") == pytest.approx(1.5)
    with pytest.raises(Exception) as refused:
        usage.check("alice")
    assert refused.value.status_code == 429 and "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT" in str(refused.value)
    usage.check("bob")
    wait = refused.value.retry_after_s
    assert 56 <= wait <= 60.5  # her first step leaves the window then (and takes her under the limit)
    now[0] += wait
    usage.check("alice")
    assert usage.used_s("alice") == pytest.approx(1.5)
    now[0] += 61
    assert usage.used_s("alice") == 0 and usage.total_s("alice") == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"OPENRL_MAX_DEVICE_SECONDS_PER_TENANT": "0"}, "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT must be"),
        ({"OPENRL_MAX_DEVICE_SECONDS_PER_TENANT": "-3"}, "> 0"),
        (
            {"OPENRL_MAX_DEVICE_SECONDS_PER_TENANT": "lots"},
            "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT must be a number",
        ),
        (
            {"OPENRL_DEVICE_SECONDS_WINDOW_S": "0.5"},
            "OPENRL_DEVICE_SECONDS_WINDOW_S must be a number of seconds in [1,",
        ),
        ({"OPENRL_DEVICE_SECONDS_WINDOW_S": "1e9"}, "30 days"),
    ],
)
def test_bad_quota_settings_are_refused_naming_the_variable(env, says):
    with pytest.raises(ValueError) as refused:
        from_env(env)
    assert says in str(refused.value)


def test_the_quota_is_off_by_default():
    s = from_env({})
    assert s.limits.max_device_seconds_per_tenant is None and s.limits.device_seconds_window_s == 3600
    s = from_env({"OPENRL_MAX_DEVICE_SECONDS_PER_TENANT": "900", "OPENRL_DEVICE_SECONDS_WINDOW_S": "600"})
    assert s.limits.max_device_seconds_per_tenant == 900 and s.limits.device_seconds_window_s == 600
