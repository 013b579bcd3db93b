"""The cluster gives the service its own hub token, and nothing else gets it: every Deployment of
every overlay reads JUPYTERHUB_API_TOKEN from the optional Secret openrl-hub-token (and talks to a
hub, so the service uses it), the chart values give the openrl hub service read:users and nothing
more, and no token is in git."""

from __future__ import annotations

import pytest

from tests.k8s._k8s import OVERLAYS, containers, env_of, flag, overlay, own_values, pod_templates


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_service_deployment_reads_its_hub_token_from_the_optional_secret(name):
    # the pods that serve HTTP: a Deployment's, or a LeaderWorkerSet's leader (its workers serve none)
    serving = [t for t in pod_templates(overlay(name)) if t.role in ("deployment", "leader")]
    assert serving, name
    for pod in serving:
        (c,) = [c for c in containers(pod) if c["name"] == "openrl-service"]
        assert flag(c["args"], "--hub-api-url").startswith("http://hub.")  # the token is read only then
        ref = env_of(c)["JUPYTERHUB_API_TOKEN"]
        assert "value" not in ref, "a hub token written into the manifest"
        assert ref["valueFrom"]["secretKeyRef"] == {
            "name": "openrl-hub-token",
            "key": "token",
            "optional": True,
        }


def test_the_openrl_hub_service_may_read_users_and_nothing_more_and_no_token_is_in_git():
    hub = own_values()["hub"]
    assert "apiToken" not in hub["services"]["openrl"], "the service's hub token must not be in git"
    holders = {
        role_name: role
        for role_name, role in hub["loadRoles"].items()
        if "openrl" in (role.get("services") or [])
    }
    assert list(holders) == ["openrl-service"], holders
    assert holders["openrl-service"]["scopes"] == ["read:users"]
