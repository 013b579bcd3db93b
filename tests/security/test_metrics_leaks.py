"""Prometheus /metrics: what an anonymous scraper, a rebinding web page, or another tenant learns.

The promise (api/metrics.py): no key, aggregates only (no run id, sampler id, session id or tenant
name in any series); a valid key, also that tenant's per-run series and nobody else's. Already held
elsewhere for notebook runs (tests/service/test_telemetry.py::test_metrics_unauthenticated_scrape_is_aggregates_only,
::test_metrics_with_a_key_adds_only_that_tenants_runs), and a job key is refused here
(tests/service/test_jobs_api.py::test_a_local_job_key_drives_its_own_runs_and_nothing_else). This module
adds alice's Tinker-SDK objects (a training run, an ephemeral sampler, a checkpoint-backed sampler, a
base-model sampler, their sessions), both exposition formats, and a scrape under a foreign Host and
Origin (/metrics answers any Host, for probes and Prometheus).
"""

from __future__ import annotations

import httpx
import pytest
import tinker
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY, TINY

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture(scope="module")
def secrets(live) -> set[str]:
    """alice's identifiers, each with some work done so it has series: her SDK run, its session, an
    ephemeral sampler, a checkpoint-backed sampler and a base-model sampler; and bob's run."""
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5]), loss_fn_inputs={"target_tokens": [4, 5, 6]}
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    samplers = [
        tc.save_weights_and_get_sampling_client().result(),
        sc.create_sampling_client(model_path=tc.save_weights_for_sampler("s").result().path).result(),
        sc.create_sampling_client(base_model=TINY).result(),
    ]
    for s in samplers:
        s.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    ids = {tc.model_id, tc.model_id.split(":")[0], *(s._sampling_session_id for s in samplers), "alice"}
    bsc = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    btc = bsc.create_lora_training_client(base_model=TINY, rank=4).result()
    btc.forward_backward([datum], "cross_entropy").result()
    yield {"alice": ids, "bob": {btc.model_id}}
    sc.close("success").result()
    bsc.close("success").result()


def run_labels(families) -> set[str]:
    return {s.labels["run_id"] for f in families for s in f.samples if "run_id" in s.labels}


@pytest.mark.parametrize("accept", ["text/plain", OPENMETRICS])
def test_a_keyed_scrape_names_none_of_another_tenants_sdk_objects(live, secrets, accept):
    """Attack: bob scrapes /metrics with his key (both exposition formats), looking for alice's run,
    sampler and session ids or her name among the per-run series."""
    r = httpx.get(f"{live.url}/metrics", headers={"X-API-Key": BOB_KEY, "Accept": accept}, timeout=30)
    assert r.status_code == 200
    for secret in secrets["alice"]:
        assert secret not in r.text, secret
    parse = parse_openmetrics if accept == OPENMETRICS else parse_text
    labels = run_labels(parse(r.text))
    assert labels == secrets["bob"], labels  # his one run, and nothing else


def test_alices_key_sees_her_sdk_runs_series(live, secrets):
    """The baseline bob's scrape is compared with: her key does get her own per-run series."""
    r = httpx.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=30)
    assert run_labels(parse_text(r.text)) & secrets["alice"]
    assert not run_labels(parse_text(r.text)) & secrets["bob"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Host": "evil.example"},
        {"Host": "evil.example", "Origin": "http://evil.example"},
        {"Accept": OPENMETRICS, "Host": "10.0.0.1:9090"},
    ],
)
def test_an_anonymous_scrape_under_any_host_is_aggregates_only(live, secrets, headers):
    """Attack: scrape without a key, as a DNS-rebinding page (a foreign Host and Origin: /metrics
    answers any Host for Prometheus) or a pod on the cluster network would."""
    r = httpx.get(f"{live.url}/metrics", headers=headers, timeout=30)
    assert r.status_code == 200
    for secret in secrets["alice"] | secrets["bob"] | {"bob"}:
        assert secret not in r.text, secret
    parse = parse_openmetrics if "Accept" in headers else parse_text
    assert run_labels(parse(r.text)) == set()
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    "auth", [{"X-API-Key": "tml-guess"}, {"Authorization": "Bearer tml-guess"}, {"X-API-Key": ""}]
)
def test_a_wrong_key_on_metrics_is_refused_not_answered_with_aggregates(live, auth):
    """Attack: a made-up key (or an empty X-API-Key header) on /metrics, to learn whether keys are
    checked there at all."""
    r = httpx.get(f"{live.url}/metrics", headers=auth, timeout=30)
    assert r.status_code == 401, (r.status_code, r.text[:200])
    assert "openrl_" not in r.text
