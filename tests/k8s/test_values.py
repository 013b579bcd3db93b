"""k8s/jupyterhub/values.yaml: valid for the pinned zero-to-jupyterhub chart, and wired to the service."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import jsonschema
import pytest

from tests.k8s._k8s import (
    CHART_VERSION,
    K8S,
    OVERLAYS,
    SERVICE_NAMESPACE,
    VALUES,
    merged_values,
    of_kind,
    overlay,
    own_values,
    schema,
)

VALUES_SCHEMA = schema(f"z2jh-{CHART_VERSION}.values.schema.json")
ACTIVITY_INTERVAL_S = 60  # OPENRL_HUB_ACTIVITY_INTERVAL_S default (docs/identity contract)


def test_values_validate_against_the_chart_schema():
    # helm validates the coalesced values (the chart's defaults under ours) against values.schema.json
    jsonschema.validate(merged_values(), VALUES_SCHEMA)


def test_schema_catches_a_wrong_key():
    bad = own_values()
    bad["singleuser"]["networkPolicy"]["egressAllowRules"]["privateIP"] = True  # missing "s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged_values(bad), VALUES_SCHEMA)
    bad = own_values()
    bad["cull"]["timeout"] = "1h"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged_values(bad), VALUES_SCHEMA)


def test_chart_version_is_stated_where_the_admin_reads_it():
    text = VALUES.read_text()
    assert f"--version {CHART_VERSION}" in text
    assert f"--version {CHART_VERSION}" in (K8S / "README.md").read_text()


def test_hub_registers_the_service_and_grants_its_scope():
    hub = own_values()["hub"]
    assert "openrl" in hub["services"]
    assert "access:services!service=openrl" in hub["loadRoles"]["user"]["scopes"]
    scopes = hub["config"]["Spawner"]["server_token_scopes"]
    assert {"access:services!service=openrl", "users:activity!user", "access:servers!server"} <= set(scopes)


def test_user_image_is_pinned():
    image = own_values()["singleuser"]["image"]
    assert image["tag"] and image["tag"] != "latest" and not image["tag"].startswith("set-by")


def service_urls() -> list[str]:
    su = own_values()["singleuser"]
    urls = [su["extraEnv"]["OPENRL_URL"]]
    urls += [p["kubespawner_override"]["environment"]["OPENRL_URL"] for p in su["profileList"]]
    return urls


def test_openrl_urls_name_rendered_services():
    """Every OPENRL_URL a notebook can get is a Service some overlay renders, on its port."""
    services = {}
    for name in OVERLAYS:
        for svc in of_kind(overlay(name), "Service"):
            host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
            services[host] = {p["port"] for p in svc["spec"]["ports"]}
    for url in service_urls():
        parts = urlsplit(url)
        assert parts.scheme == "http" and parts.hostname in services, url
        assert parts.port in services[parts.hostname], url
        assert parts.hostname.split(".")[1] == SERVICE_NAMESPACE


def test_default_profile_talks_to_the_default_service():
    su = own_values()["singleuser"]
    (default,) = [p for p in su["profileList"] if p.get("default")]
    assert default["kubespawner_override"]["environment"]["OPENRL_URL"] == su["extraEnv"]["OPENRL_URL"]
    assert len({p["slug"] for p in su["profileList"]}) == len(su["profileList"])
    # profiles differ in the model they train and the notebook's size, never in a GPU for the notebook
    urls = {p["kubespawner_override"]["environment"]["OPENRL_URL"] for p in su["profileList"]}
    assert len(urls) == len(su["profileList"])
    for p in su["profileList"]:
        assert "extra_resource_limits" not in p["kubespawner_override"]


def test_culling_outlives_the_activity_reports():
    cull = merged_values()["cull"]
    assert cull["enabled"] is True
    # a kernel with a live run reports activity every 60 s; the culler must not beat it
    assert cull["timeout"] >= 10 * ACTIVITY_INTERVAL_S
    assert cull["every"] < cull["timeout"]
    assert cull["users"] is False


def test_no_token_in_values():
    text = VALUES.read_text()
    assert not re.search(r"(?i)(api_?token|secret|password)\s*:\s*\S", text)
    assert "tml-" not in text
