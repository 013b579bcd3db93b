"""k8s/README.md: what it tells an admin to run matches what is in the repo and renders."""

from __future__ import annotations

import re

import pytest

from tests.k8s._k8s import (
    HUB_NAMESPACE,
    K8S,
    OVERLAYS,
    ROOT,
    SERVICE_NAMESPACE,
    SETTINGS,
    containers,
    flag,
    of_kind,
    overlay,
    pod_templates,
    render,
)

README = (K8S / "README.md").read_text()
KUSTOMIZE_PATHS = sorted(set(re.findall(r"kubectl (?:apply -k|kustomize) (k8s/[\w./-]+)", README)))


def test_readme_names_kustomize_paths():
    assert len(KUSTOMIZE_PATHS) >= 4, KUSTOMIZE_PATHS


@pytest.mark.parametrize("path", KUSTOMIZE_PATHS)
def test_every_kustomize_path_in_the_readme_exists_and_renders(path):
    assert (ROOT / path / "kustomization.yaml").is_file(), (
        f"k8s/README.md names {path}, which has no kustomization"
    )
    assert pod_templates(render(path)), f"{path} renders no Deployment and no LeaderWorkerSet"


def test_every_overlay_is_documented():
    for name in OVERLAYS:
        assert f"overlays/{name}" in README, f"k8s/README.md does not mention overlays/{name}"


def shell_value(word: str) -> str:
    """A README word as the shell sees it once settings.env is loaded ("$namespace" -> openrl)."""
    word = word.strip('"')
    m = re.fullmatch(r"\$\{?(\w+)\}?", word)
    return SETTINGS[m.group(1)] if m else word


def test_secret_command_matches_the_mounted_file():
    m = re.search(r"-n (\S+) create secret generic (\S+) --from-file=([\w.-]+)=", README)
    assert m, "k8s/README.md does not show how to create the API-key Secret"
    namespace, name, key = m.groups()
    namespace = shell_value(namespace)
    for o in OVERLAYS:
        for dep in pod_templates(overlay(o)):
            assert dep.workload["metadata"]["namespace"] == namespace
            c = containers(dep)[-1]
            volumes = {v["name"]: v for v in dep.spec["volumes"]}
            keys_file = flag(c["args"], "--api-keys-file")
            (mount,) = [m for m in c["volumeMounts"] if keys_file.startswith(m["mountPath"] + "/")]
            assert volumes[mount["name"]]["secret"]["secretName"] == name
            assert keys_file == f"{mount['mountPath']}/{key}"


def test_workload_identity_member_is_the_service_account():
    m = re.search(r"subject/ns/([\w$-]+)/sa/([\w-]+)", README)
    assert m
    namespace, sa = m.groups()
    namespace = shell_value(namespace)
    for o in OVERLAYS:
        objs = overlay(o)
        assert any(
            s["metadata"]["name"] == sa and s["metadata"]["namespace"] == namespace
            for s in of_kind(objs, "ServiceAccount")
        )
        for dep in pod_templates(objs):
            assert dep.spec["serviceAccountName"] == sa


def test_no_file_is_patched_with_sed_and_settings_come_from_settings_env():
    """Cluster values live in k8s/settings/settings.env, which the README loads and names key by key."""
    assert "sed -i" not in README
    assert ". k8s/settings/settings.env" in README
    for key in SETTINGS:
        assert f"`{key}`" in README, f"k8s/README.md does not say what {key} (settings.env) is"
    # the bucket the README creates and grants is the one settings.env names
    assert "gcloud storage buckets create gs://$bucket" in README
    assert "add-iam-policy-binding gs://$bucket" in README


def test_readme_helm_command_uses_the_namespace_the_service_calls():
    commands = re.findall(r"helm upgrade (?:--install )?(\S+) jupyterhub .*?--namespace (\S+)", README, re.S)
    assert commands
    for release, namespace in commands:
        namespace = shell_value(namespace)
        (dep,) = of_kind(overlay("cpu"), "Deployment")
        assert f"hub.{namespace}.svc.cluster.local" in flag(containers(dep)[-1]["args"], "--hub-api-url")
        assert namespace == HUB_NAMESPACE and release == "jhub"
    assert SERVICE_NAMESPACE in README
