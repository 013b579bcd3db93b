"""JupyterHub identity with a real hub: two users' servers really spawned, each trains from a kernel of
its own server with that server's own $JUPYTERHUB_API_TOKEN, and sees only its own runs.

One hub, one OpenRL service and two kernels serve the whole module (tests/_support/jhub.py): the hub
has the chart's roles and server-token scopes (k8s/jupyterhub/values.yaml), the service runs with
``--hub-api-url``, a short ``--hub-cache-ttl-s`` and the hub token of the ``openrl`` hub service (as
the cluster's Deployment reads it), plus an API-key user (carol). The tests run in
file order: the culling test stops bob's server and the last test stops the hub.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx
import pytest

from openrl_jupyter.local import free_port
from tests._support import serve
from tests._support.jhub import Hub, HubKernel, HubUnavailable, proxy_command, start_hub, wait_hub

SCOPE = "access:services!service=openrl"
TTL_S = 2  # --hub-cache-ttl-s
CAROL_KEY = "tml-carol-" + "0123456789abcdef"  # the API-key user beside the hub users
USERS = ("alice", "bob")
CULL_TIMEOUT_S = 8  # the culler's --timeout: several activity intervals, so a slow report is not a cull
ACTIVITY_INTERVAL_S = 1
V1 = "/openrl/v1"

REWARD = """%%openrl reward letters
def reward(prompt, completion, **info):
    return sum(c.isalpha() for c in completion) / max(1, len(completion))
"""
GATED = """%%openrl reward gated
import threading
gate = threading.Event()
def reward(prompt, completion, **info):
    assert gate.wait(300), "the gate was never opened"
    return 0.5
"""


@dataclass
class World:
    hub: Hub
    url: str  # the OpenRL service
    served: serve.Served
    kernels: dict[str, HubKernel]
    tokens: dict[str, str] = field(default_factory=dict, repr=False)  # each server's own token
    runs: dict[str, str] = field(default_factory=dict)  # user -> run id
    paths: dict[str, str] = field(default_factory=dict)  # user -> tinker:// checkpoint
    outputs: dict[str, str] = field(default_factory=dict)  # "user:step" -> what the cell printed

    def get(self, path: str, token: str | None, **kw) -> httpx.Response:
        headers = {"X-API-Key": token} if token else {}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    try:
        proxy_command()
    except HubUnavailable as e:
        pytest.skip(str(e))  # a failure under OPENRL_CI_STRICT=1
    root = tmp_path_factory.mktemp("jhub")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    service_token = secrets.token_hex(32)  # the openrl hub service's apiToken, as on the cluster
    hub = start_hub(
        root / "hub",
        environment={"OPENRL_URL": url, "OPENRL_HUB_ACTIVITY_INTERVAL_S": str(ACTIVITY_INTERVAL_S)},
        service_tokens={"openrl": service_token},
    )
    served = None
    kernels: dict[str, HubKernel] = {}
    try:
        keys = root / "api-keys"
        keys.write_text(f"carol {CAROL_KEY}\n")
        (root / "data").mkdir()
        served = serve.start(
            root / "data",
            tiny_model_dir,
            "--hub-api-url",
            hub.api_url,
            "--hub-cache-ttl-s",
            str(TTL_S),
            "--api-keys-file",
            str(keys),
            env={"JUPYTERHUB_API_TOKEN": service_token},
            port=port,
        )
        wait_hub(hub)
        hub.spawn(*USERS)  # both servers start while the service loads
        serve.wait_ready(served)
        for user in USERS:
            kernels[user] = hub.kernel(user).start()
        w = World(hub, url, served, kernels)
        for user, k in kernels.items():
            w.tokens[user] = k.execute("import os; print(os.environ['JUPYTERHUB_API_TOKEN'])").stdout.strip()
        yield w
    finally:
        for k in kernels.values():
            k.shutdown()
        if served is not None and served.proc.poll() is None:
            served.proc.terminate()
            serve.finish(served, 30)
        hub.stop()


def error_of(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error") or r.json().get("detail"))
    except ValueError:
        return r.text


# -- tenancy: each user, from their own server ------------------------------------------------------------
def trained(world: World) -> World:
    """Each user connected (``%openrl connect``, no arguments) and trained 2 steps, both runs at once,
    then saved a checkpoint; done once per module (the first test, or whichever test runs first)."""
    if world.runs:
        return world
    for user, k in world.kernels.items():
        world.outputs[f"{user}:connect"] = k.execute(
            "%load_ext openrl_jupyter\n%openrl connect", timeout=60
        ).stdout
        world.outputs[f"{user}:reward"] = k.execute(REWARD).stdout
    for user, k in world.kernels.items():  # both runs train at once, in the background
        world.outputs[f"{user}:train"] = k.execute(
            "P = ['Say hi:', 'Name a colour:']\n"
            f"run = %openrl train --reward letters --prompts P --steps 2 --batch 2 --group 2 "
            f"--max-tokens 8 --name {user}-run",
            timeout=60,
        ).stdout
    for user, k in world.kernels.items():
        out = k.execute(
            "import json\nrun.wait(180)\npath = run.save('ck')\n"
            "print(json.dumps([run.run_id, str(run.state), path, run.session.credential]))",
            timeout=240,
        ).stdout
        run_id, state, path, credential = json.loads(out.strip().splitlines()[-1])
        assert (state, credential) == ("finished", "hub"), out
        world.runs[user], world.paths[user] = run_id, path
    return world


def test_each_user_trains_from_a_kernel_of_their_server_and_sees_only_their_own(world):
    trained(world)
    for user in USERS:
        out = world.outputs[f"{user}:connect"]
        assert f"connected to the service at {world.url} as your JupyterHub user" in out, out
        assert world.tokens[user] not in out
        assert "reward letters v1 registered" in world.outputs[f"{user}:reward"]
        # the kernel told its user once that the server is kept alive while the run steps
        note = world.outputs[f"{user}:train"]
        assert "kept alive" in note and "idle culler" in note, note

    for user, other in (("alice", "bob"), ("bob", "alice")):
        token = world.tokens[user]
        mine = world.get(f"{V1}/runs", token)
        assert mine.status_code == 200, mine.text
        assert [r["run_id"] for r in mine.json()["runs"]] == [world.runs[user]]
        own = world.get(f"/api/v1/training_runs/{world.runs[user]}/checkpoints", token)
        assert own.status_code == 200 and world.paths[user] in own.text, own.text
        for path in (
            f"{V1}/runs/{world.runs[other]}",
            f"/api/v1/training_runs/{world.runs[other]}/checkpoints",
        ):
            r = world.get(path, token)
            assert r.status_code == 404, (user, path, r.status_code, r.text)
    for user in USERS:  # the API-key user sees neither
        assert world.get(f"{V1}/runs/{world.runs[user]}", CAROL_KEY).status_code == 404
    assert world.get(f"{V1}/runs", CAROL_KEY).json()["runs"] == []


# -- minted Tinker keys ----------------------------------------------------------------------------------
def test_a_minted_key_works_with_the_tinker_sdk_as_the_same_user_and_is_revocable(world):
    k = trained(world).kernels["alice"]
    out = k.execute("%openrl token --name sdk", timeout=60).stdout
    key = k.execute("print(os.environ['TINKER_API_KEY'], os.environ['TINKER_BASE_URL'])").stdout.split()
    assert key[0].startswith("tml-") and key[1] == world.url
    assert key[0] not in out and "minted key" in out and "TINKER_API_KEY" in out, out
    key_id = out.split("minted key ", 1)[1].split()[0]

    # the real SDK in the notebook picks the key up from the environment: alice's checkpoint loads,
    # bob's is not found
    sdk = k.execute(
        "import tinker\nsc = tinker.ServiceClient()\n"
        f"tc = sc.create_training_client_from_state({world.paths['alice']!r}).result()\n"
        "print('rank', tc.get_info().lora_rank)\n"
        "try:\n"
        f"    sc.create_training_client_from_state({world.paths['bob']!r}).result()\n"
        "except tinker.NotFoundError:\n"
        "    print('bob: not found')\n",
        timeout=120,
    ).stdout
    assert "rank 8" in sdk and "bob: not found" in sdk, sdk
    assert [r["run_id"] for r in world.get(f"{V1}/runs", key[0]).json()["runs"]] == [world.runs["alice"]]

    listed = k.execute("%openrl token list", timeout=30).outputs[-1]["text/plain"]
    assert key_id in listed and "sdk" in listed and "expires" in listed and key[0] not in listed
    # another user cannot revoke it; an API-key user cannot mint
    r = httpx.delete(
        f"{world.url}/api/v1/keys/{key_id}", headers={"X-API-Key": world.tokens["bob"]}, timeout=30
    )
    assert r.status_code == 404, r.text
    r = httpx.post(f"{world.url}/api/v1/keys", json={}, headers={"X-API-Key": CAROL_KEY}, timeout=30)
    assert r.status_code == 403 and "JupyterHub" in error_of(r), r.text

    assert "revoked" in k.execute(f"%openrl token revoke {key_id}", timeout=30).stdout
    assert world.get(f"{V1}/runs", key[0]).status_code == 401
    assert "TINKER_API_KEY" not in k.execute("print(sorted(os.environ))").stdout


# -- hub tokens: revoked, unscoped, made up --------------------------------------------------------------
def test_hub_tokens_without_the_scope_made_up_or_revoked_are_refused(world):
    hub = world.hub
    made_up = world.get(f"{V1}/runs", secrets.token_hex(16))
    assert made_up.status_code == 401, made_up.text

    _, narrow = hub.new_token("alice", scopes=["read:users!user"])
    r = world.get(f"{V1}/runs", narrow)
    assert r.status_code == 401 and SCOPE in error_of(r), r.text

    token_id, full = hub.new_token("alice")  # all of alice's scopes, the service's included
    assert world.get(f"{V1}/runs", full).status_code == 200
    hub.revoke("alice", token_id)
    revoked_at = time.monotonic()
    deadline = revoked_at + TTL_S + 30  # the TTL, plus a hang guard for a busy machine
    while (status := world.get(f"{V1}/runs", full).status_code) == 200:
        assert time.monotonic() < deadline, "a token revoked at the hub still works after the cache TTL"
        time.sleep(0.2)
    assert status == 401


# -- culling ---------------------------------------------------------------------------------------------
def test_the_idle_culler_spares_a_server_whose_kernel_has_a_live_run(world):
    hub = world.hub
    alice = trained(world).kernels["alice"]
    alice.execute(GATED, timeout=30)
    alice.execute(
        "live = %openrl train --reward gated --prompts P --steps 1000 --batch 2 --group 2 --max-tokens 4 "
        "--name live",
        timeout=60,
    )
    # bob is the more recently active of the two as far as the hub knows: without its reports,
    # alice's server would be culled no later than bob's
    time.sleep(0.05)
    r = hub.api(
        "POST",
        "/users/bob/activity",
        json={"last_activity": _now(), "servers": {"": {"last_activity": _now()}}},
    )
    assert r.is_success, r.text
    bob_marked = datetime.fromisoformat(hub.server("bob")["last_activity"].replace("Z", "+00:00"))

    log = open(hub.root / "culler.log", "ab")  # noqa: SIM115 - closed below
    culler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterhub_idle_culler",
            f"--url={hub.api_url}",
            f"--timeout={CULL_TIMEOUT_S}",
            "--cull-every=1",
        ],
        env={**os.environ, "JUPYTERHUB_API_TOKEN": hub.culler_token, "OPENRL_HUB_TEST_MARKER": hub.marker},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        wait_for(lambda: hub.server("bob") is None, 60 + CULL_TIMEOUT_S, "bob's idle server culled", hub)
        server = hub.server("alice")
        assert server is not None, "alice's server was culled while its kernel had a live run"
        seen = datetime.fromisoformat(server["last_activity"].replace("Z", "+00:00"))
        assert seen > bob_marked, (seen, bob_marked)
        reports = int(
            alice.execute("from openrl_jupyter import hub as h\nprint(h.reporter().reports)").stdout
        )
        assert reports >= 2, reports
        status = alice.execute("%openrl status", timeout=30).outputs[-1]["text/plain"]
        assert "JupyterHub server's own token" in status and "hub activity" in status, status
        assert alice.execute("print(live.state)").stdout.strip() == "running"

        # the run ends: reports stop, and the culler takes alice's server too
        alice.execute("live.stop()\ngate.set()\nlive.wait(120)", timeout=150)
        wait_for(lambda: hub.server("alice") is None, 60 + CULL_TIMEOUT_S, "alice's server culled", hub)
    finally:
        culler.terminate()
        culler.wait(30)
        log.close()


# -- the hub down ----------------------------------------------------------------------------------------
def test_with_the_hub_down_hub_tokens_get_503_naming_it_and_api_keys_still_work(world):
    world.hub.stop_hub()
    r = world.get(f"{V1}/runs", secrets.token_hex(16))
    assert r.status_code == 503, r.text
    assert world.hub.api_url.split("/hub/api")[0].removeprefix("http://") in error_of(r), r.text
    ok = world.get(f"{V1}/runs", CAROL_KEY)
    assert ok.status_code == 200 and ok.json()["runs"] == []


def wait_for(predicate, timeout_s: float, what: str, hub: Hub) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{hub.log_tail(30)}"
        time.sleep(0.25)


def _now() -> str:
    from openrl_jupyter.hub import isoformat_utc

    return isoformat_utc()
