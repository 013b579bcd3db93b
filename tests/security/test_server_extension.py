"""The Jupyter server extension (openrl_jupyter/server/): bob's lab, holding bob's key server-side,
against alice's objects and against routes the panel does not offer.

A lab user reaches the service only through the extension's five routes, with the key the server
holds: nothing more than that key reaches, and nothing the panel does not use. Already held elsewhere:
every route and verb needs the server's token and is decorated for auth, a cookie-authenticated POST
needs the XSRF token, the key never reaches the browser or the log, and the panel cannot stop another
tenant's notebook run (tests/server/test_handlers.py::test_every_route_refuses_a_request_without_the_servers_token,
::test_a_cookie_authenticated_post_needs_the_xsrf_token, ::test_the_key_reaches_neither_the_browser_nor_the_log,
tests/server/test_connection.py::test_every_route_and_verb_is_authenticated,
tests/server/test_control.py::test_another_tenants_run_cannot_be_stopped).
"""

from __future__ import annotations

import httpx
import pytest
import tinker

from tests.conftest import ALICE_KEY, BOB_KEY, TINY
from tests.security.conftest import V1
from tests.server.conftest import start_jupyter


@pytest.fixture(scope="module")
def bob_lab(live, tmp_path_factory):
    """Bob's single-user server (a hub-like base URL), its extension configured with bob's key."""
    jupyter = start_jupyter(
        tmp_path_factory.mktemp("jp-bob"),
        base_url="/user/bob/",
        env={"OPENRL_URL": live.url, "OPENRL_TOKEN": BOB_KEY},
    )
    yield jupyter
    jupyter.stop()


@pytest.fixture(scope="module")
def targets(live, alice, bob):
    """alice's notebook run (with a metrics row), her Tinker-SDK run and job; bob's own run."""
    notebook = alice.post(f"{V1}/runs", json={"name": "alice-secret-run", "rank": 4}).json()["run_id"]
    alice.post(f"{V1}/runs/{notebook}/metrics", json={"step": 1, "reward_mean": 0.987654})
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    sdk = sc.create_lora_training_client(base_model=TINY, rank=4).result().model_id
    mine = bob.post(f"{V1}/runs", json={"name": "bob-run", "rank": 4}).json()["run_id"]
    yield {"notebook": notebook, "sdk": sdk, "mine": mine}
    sc.close("success").result()


def no_data(r: httpx.Response, *secrets: str) -> None:
    """An extension error: ``{"error"}`` and nothing of alice's in it."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert set(r.json()) == {"error"}, r.text
    for secret in secrets:
        assert secret not in r.text, secret


@pytest.mark.parametrize("which", ["notebook", "sdk"])
def test_my_lab_cannot_read_another_tenants_run(bob_lab, targets, which):
    """Attack: bob's panel asks for one of alice's runs by id (its entry, metrics and samples)."""
    with bob_lab.client() as lab:
        r = lab.get(f"openrl/runs/{targets[which]}")
    assert r.status_code == 404
    no_data(r, "alice-secret-run", "0.987654")


@pytest.mark.parametrize("action", ["pause", "stop", "resume"])
@pytest.mark.parametrize("which", ["notebook", "sdk"])
def test_my_lab_cannot_control_another_tenants_run(alice, bob_lab, targets, which, action):
    """Attack: bob's panel pauses, stops or resumes alice's notebook run or her Tinker-SDK run."""
    run_id = targets[which]
    with bob_lab.client() as lab:
        r = lab.post(f"openrl/runs/{run_id}/control", json={"action": action, "reason": "bob"})
    assert r.status_code == 404
    no_data(r, "alice-secret-run")
    assert alice.get(f"{V1}/runs/{run_id}").json()["control"]["state"] == "running"


# A run id that tries to leave /openrl/v1/runs/<id> on the service (the extension quotes it whole).
WALKS = [
    "..%2F..%2Fjobs",
    "..%2Fruns",
    "%2E%2E",
    "%2E",
    "%2E%2E%2F%2E%2E%2F..%2Fapi%2Fv1%2Fkeys",
    "..%2F..%2F..%2Fmetrics",
    "x%2F..%2F..%2Fjobs",
    "x%3Finclude%3Dall",
    "x%23fragment",
    "%252E%252E%252Fjobs",
]


@pytest.mark.parametrize("walk", WALKS)
def test_a_run_id_cannot_walk_to_another_service_route(bob_lab, targets, walk):
    """Attack: a run id made of dot segments, encoded slashes, a query or a fragment, so that the
    service path the extension builds lands on another route (jobs, keys, metrics, the runs list)."""
    with bob_lab.client() as lab:
        got = lab.get(f"openrl/runs/{walk}")
        posted = lab.post(f"openrl/runs/{walk}/control", json={"action": "stop"})
    for r in (got, posted):
        no_data(r, targets["mine"], "bob-run", "openrl_")
    with bob_lab.client() as lab:  # bob's own run was not stopped by any of them
        assert lab.get(f"openrl/runs/{targets['mine']}").json()["run"]["control"]["state"] == "running"


@pytest.mark.parametrize("method", ["DELETE", "PUT", "PATCH"])
@pytest.mark.parametrize(
    "route", ["openrl/runs/{id}", "openrl/runs/{id}/control", "openrl/runs", "openrl/events"]
)
def test_verbs_the_panel_does_not_offer_are_refused(bob_lab, targets, method, route):
    """Attack: a lab user sends DELETE / PUT / PATCH through the extension, hoping it forwards them
    (a DELETE would free a run)."""
    with bob_lab.client() as lab:
        r = lab.request(method, route.format(id=targets["mine"]), json={"action": "stop"})
        assert r.status_code == 405, (r.status_code, r.text[:200])
        assert lab.get(f"openrl/runs/{targets['mine']}").status_code == 200


def test_a_cross_origin_page_cannot_post_with_the_lab_cookie(bob_lab, targets):
    """Attack: a page on another origin, in bob's browser (his login cookie and, say, a stolen XSRF
    cookie value), posts a stop to his run."""
    with bob_lab.client() as http:
        assert http.get("openrl/health").status_code == 200  # sets the login cookie
        cookies = httpx.Cookies(http.cookies)
    with bob_lab.client(auth=False, cookies=cookies) as browser:
        browser.get("lab")
        xsrf = browser.cookies.get("_xsrf")
        r = browser.post(
            f"openrl/runs/{targets['mine']}/control",
            json={"action": "stop"},
            headers={"X-XSRFToken": xsrf, "Origin": "http://evil.example", "Referer": "http://evil.example/"},
        )
        assert r.status_code in (403, 404), (r.status_code, r.text[:200])
        assert not any(h.lower().startswith("access-control-") for h in r.headers)
        assert browser.get(f"openrl/runs/{targets['mine']}").json()["run"]["control"]["state"] == "running"
