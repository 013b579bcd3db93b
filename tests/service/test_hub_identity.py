"""JupyterHub identity, the parts that need no hub: tenant folders of hub users, the minted-key store,
the flags, and an unreachable hub. The real hub (users' own server tokens, scopes, revocation, mint
through the Tinker SDK) is exercised in tests/hub.
"""

from __future__ import annotations

import asyncio
import stat
import subprocess

import httpx
import pytest

from openrl_jupyter.local import free_port
from openrl_service.api.hubauth import HubAccounts, HubUnavailable, KnownIdentities, MintedKeys, has_access
from openrl_service.config import from_env, tenant_folder
from tests._support.serve import cli, serving
from tests.conftest import ALICE_KEY


def test_hub_tenants_get_their_own_folders_one_to_one():
    # API-key tenants keep their names; a hub user's name is encoded, never a path or a collision.
    assert tenant_folder("alice") == "alice"
    assert tenant_folder("hub:alice") == "hub~alice"
    assert tenant_folder("hub:../../etc") == "hub~..%2f..%2fetc"
    assert tenant_folder("hub:a@b.org") == "hub~a%40b.org"
    assert tenant_folder("hub:a b") != tenant_folder("hub:a_b")
    long_a, long_b = tenant_folder("hub:" + "x" * 300), tenant_folder("hub:" + "x" * 301)
    assert len(long_a) < 255 and long_a != long_b
    for bad in ("", "hub:", "a/b", "../x", "a:b"):
        with pytest.raises(ValueError, match="invalid tenant"):
            tenant_folder(bad)


def test_access_scope_is_the_filtered_or_the_whole_one():
    assert has_access(["access:services!service=openrl", "read:users:name!user=a"], "openrl")
    assert has_access(["access:services"], "openrl")
    assert not has_access(["access:services!service=other"], "openrl")
    assert not has_access(["read:users!user=a", "self"], "openrl")


def test_minted_keys_survive_a_restart_and_are_revocable_by_their_owner_only(tmp_path):
    path = tmp_path / "minted-keys.json"
    store = MintedKeys(path, max_per_tenant=2)
    rec, key = store.mint("hub:alice", "laptop")
    assert key.startswith("tml-") and rec["tenant"] == "hub:alice" and "key" not in rec
    assert store.tenant(key) == "hub:alice"
    # Only digests on disk, readable by the service's user alone.
    assert key not in path.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o600
    again = MintedKeys(path, max_per_tenant=2)  # a restarted service
    assert again.tenant(key) == "hub:alice"
    assert [r["id"] for r in again.list("hub:alice")] == [rec["id"]] and again.list("hub:bob") == []
    assert not again.revoke("hub:bob", rec["id"])  # another user's id: refused, key still valid
    assert again.tenant(key) == "hub:alice"
    again.mint("hub:alice", None)
    with pytest.raises(OverflowError, match="OPENRL_MAX_KEYS_PER_USER=2"):
        again.mint("hub:alice", None)
    assert again.revoke("hub:alice", rec["id"])
    assert MintedKeys(path, max_per_tenant=2).tenant(key) is None
    with pytest.raises(ValueError, match="JupyterHub users"):
        again.mint("alice", None)  # API-key tenants have their keys already


def test_the_service_reads_its_own_hub_token_only_when_it_talks_to_a_hub():
    # An embedded service started by a kernel inherits the kernel's $JUPYTERHUB_API_TOKEN (the
    # user's own server token): without --hub-api-url it is never used as the service's token.
    env = {"JUPYTERHUB_API_TOKEN": "token-of-a-kernel"}
    assert from_env(env).hub_api_token is None
    hubbed = from_env({**env, "OPENRL_HUB_API_URL": "http://hub:8081/hub/api"})
    assert hubbed.hub_api_token == "token-of-a-kernel"
    assert "token-of-a-kernel" not in repr(hubbed)  # settings are logged; the token never is
    # the documented defaults: a deleted user's keys stop within a minute, keys live 30 days
    assert from_env({}).hub_user_recheck_s <= 60
    assert from_env({}).minted_key_ttl_s == 30 * 86400


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--hub-api-url", "hub:8081/hub/api", "--hub-api-url (OPENRL_HUB_API_URL) must be an http(s) URL"),
        ("--hub-cache-ttl-s", "-1", "--hub-cache-ttl-s"),
        ("--hub-service-name", "a/b", "--hub-service-name (OPENRL_HUB_SERVICE_NAME)"),
        ("--hub-failed-lookups-per-min", "0", "OPENRL_HUB_FAILED_LOOKUPS_PER_MIN"),
        ("--hub-user-recheck-s", "-1", "OPENRL_HUB_USER_RECHECK_S"),
        ("--minted-key-ttl-s", "0", "OPENRL_MINTED_KEY_TTL_S"),
    ],
)
def test_bad_hub_flags_are_refused_at_startup(tmp_path, flag, value, says):
    argv, env = cli("serve", "--port", str(free_port()), "--data-dir", str(tmp_path), flag, value)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr


def test_unreachable_hub_is_a_503_naming_it_and_api_keys_still_work(tmp_path, tiny_model_dir):
    hub = f"http://127.0.0.1:{free_port()}/hub/api"  # nothing listens there
    with serving(
        tmp_path / "data",
        tiny_model_dir,
        "--hub-api-url",
        hub,
        env={"OPENRL_API_KEYS": f"alice:{ALICE_KEY}"},
    ) as s:
        r = httpx.get(f"{s.url}/api/v1/keys", headers={"Authorization": "token 0123456789abcdef"})
        assert r.status_code == 503 and hub in r.json()["error"], r.text
        assert r.json()["field"] == "hub" and int(r.headers["retry-after"]) > 0
        # API keys never wait on the hub, and a wrong tml- key is not sent to it.
        ok = httpx.get(f"{s.url}/api/v1/training_runs", headers={"X-API-Key": ALICE_KEY})
        assert ok.status_code == 200, ok.text
        wrong = httpx.get(f"{s.url}/api/v1/keys", headers={"X-API-Key": "tml-not-a-key"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]
        # Keys are minted with a hub token only: an API key gets a 403 that says so.
        mint = httpx.post(f"{s.url}/api/v1/keys", headers={"X-API-Key": ALICE_KEY}, json={})
        assert mint.status_code == 403 and "JUPYTERHUB_API_TOKEN" in mint.json()["error"], mint.text
        assert httpx.get(f"{s.url}/api/v1/keys", headers={"X-API-Key": ALICE_KEY}).json() == {"keys": []}


def test_a_failed_retirement_refuses_the_request_and_is_tried_again(tmp_path):
    # retire_tenant runs before the new account's request goes on; if it fails, the request is
    # refused (503) and the account is not recorded, so the next request retires again.
    calls = []

    def retire(tenant: str, reason: str) -> None:
        calls.append((tenant, reason))
        if len(calls) == 1:
            raise OSError("disk full")

    known = KnownIdentities(tmp_path / "hub-identities.json")
    accounts = HubAccounts(None, known, retire)

    async def go():
        await accounts.observe("alice", "2025-01-01T00:00:00Z")  # first seen: recorded, nothing retired
        with pytest.raises(HubUnavailable, match="retiring the tenant of the earlier JupyterHub account"):
            await accounts.observe("alice", "2025-02-02T00:00:00Z")
        assert known.get("alice")["created"] == "2025-01-01T00:00:00Z"
        await accounts.observe("alice", "2025-02-02T00:00:00Z")

    asyncio.run(go())
    assert [t for t, _ in calls] == ["hub:alice", "hub:alice"]
    assert "was deleted and created again" in calls[0][1]
    again = KnownIdentities(tmp_path / "hub-identities.json")  # what a restarted service reads
    assert again.get("alice")["created"] == "2025-02-02T00:00:00Z" and again.get("alice")["since"] > 0
    assert stat.S_IMODE((tmp_path / "hub-identities.json").stat().st_mode) == 0o600
