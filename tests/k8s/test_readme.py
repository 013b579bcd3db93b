"""k8s/README.md: what it tells an admin to run matches what is in the repo and renders."""

from __future__ import annotations

import re

import pytest

from tests.k8s._k8s import K8S, OVERLAYS, ROOT, containers, flag, of_kind, overlay, pod_templates, render

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


def test_secret_command_matches_the_mounted_file():
    m = re.search(r"-n (\S+) create secret generic (\S+) --from-file=([\w.-]+)=", README)
    assert m, "k8s/README.md does not show how to create the API-key Secret"
    namespace, name, key = m.groups()
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
    m = re.search(r"subject/ns/([\w-]+)/sa/([\w-]+)", README)
    assert m
    namespace, sa = m.groups()
    for o in OVERLAYS:
        objs = overlay(o)
        assert any(
            s["metadata"]["name"] == sa and s["metadata"]["namespace"] == namespace
            for s in of_kind(objs, "ServiceAccount")
        )
        for dep in pod_templates(objs):
            assert dep.spec["serviceAccountName"] == sa


def test_bucket_sed_hits_every_bucket_literal():
    m = re.search(r'sed -i "s/(bucket=[\w-]+)/bucket=\$BUCKET/" ([^\n]+)', README)
    assert m, "k8s/README.md does not show how to set the bucket"
    literal, files = m.group(1), m.group(2).split()
    targets = set()
    for pattern in files:
        targets |= set(ROOT.glob(pattern))
    holding = {p for p in (K8S / "overlays").rglob("kustomization.yaml") if "bucket=" in p.read_text()}
    assert holding and holding <= targets, f"the sed misses {holding - targets}"
    for p in holding:
        assert literal in p.read_text()


def test_readme_helm_command_uses_the_namespace_the_service_calls():
    m = re.search(r"helm upgrade --install (\S+) jupyterhub .*?--namespace (\S+)", README, re.S)
    assert m
    release, namespace = m.groups()
    (dep,) = of_kind(overlay("cpu"), "Deployment")
    assert f"hub.{namespace}.svc.cluster.local" in flag(containers(dep)[-1]["args"], "--hub-api-url")
    assert release == namespace == "jhub"
