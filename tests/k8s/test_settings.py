"""k8s/settings/settings.env reaches every overlay: rendered with other values, no object keeps a
default one (a new overlay that does not list components/settings last fails here), and the images
are named in one place, as the release publishes them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.k8s._k8s import (
    K8S,
    OVERLAYS,
    ROOT,
    SETTINGS,
    SETTINGS_ENV,
    containers,
    env_of,
    flag,
    kubectl,
    of_kind,
    overlay,
    own_values,
    pod_templates,
    read_settings,
)

OTHER = {
    "namespace": "team-rl",
    "hub_namespace": "hub-prod",
    "bucket": "acme-llm-weights",
    "apiserver_cidr": "10.9.8.7/32",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ClusterQueue", "ResourceFlavor"}
PROJECT_VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def render_in(k8s: Path, name: str) -> list[dict]:
    proc = subprocess.run(
        [str(kubectl()), "kustomize", str(k8s / "overlays" / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"kubectl kustomize overlays/{name} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def other_k8s(tmp_path_factory) -> Path:
    """A copy of k8s/ whose settings.env an admin has edited: every key set to another value."""
    k8s = tmp_path_factory.mktemp("checkout") / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("images", "*.md"))
    text = SETTINGS_ENV.read_text()
    for key, value in OTHER.items():
        text, n = re.subn(rf"(?m)^{key}=.*$", f"{key}={value}", text)
        assert n == 1, f"settings.env has no line {key}=..."
    (k8s / "settings" / "settings.env").write_text(text)
    return k8s


def test_settings_env_holds_the_keys_the_overlays_read_and_is_a_shell_file():
    assert set(SETTINGS) == set(OTHER), (
        f"settings.env keys {sorted(SETTINGS)}; this test sets {sorted(OTHER)}"
    )
    # k8s/README.md loads it with `. k8s/settings/settings.env`: the same values in the shell
    out = subprocess.run(
        ["bash", "-c", f'. "{SETTINGS_ENV}" && printf "%s\\n" "$namespace" "$hub_namespace" "$bucket"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [SETTINGS["namespace"], SETTINGS["hub_namespace"], SETTINGS["bucket"]]


def scalars(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from scalars(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from scalars(v)
    elif isinstance(obj, str):
        yield obj


@pytest.mark.parametrize("name", OVERLAYS)
def test_other_settings_reach_every_object_of_every_overlay(name, other_k8s):
    objs = render_in(other_k8s, name)
    hint = f"overlays/{name}: list ../../components/settings last in its components"
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Namespace":
            assert o["metadata"]["name"] == OTHER["namespace"], f"{where}: {hint}"
        elif o["kind"] not in CLUSTER_SCOPED:
            assert o["metadata"].get("namespace") == OTHER["namespace"], f"{where}: {hint}"
        # no default value is left anywhere: as a whole string, or as the namespace inside a DNS name
        for s in scalars(o):
            assert s not in {SETTINGS["namespace"], SETTINGS["hub_namespace"]}, f"{where}: {s!r}; {hint}"
            for value in (SETTINGS["bucket"], SETTINGS["apiserver_cidr"]):
                assert value not in s, f"{where}: {s!r}; {hint}"
            for ns in (SETTINGS["namespace"], SETTINGS["hub_namespace"]):
                assert f".{ns}.svc" not in s, f"{where}: {s!r}; {hint}"
    # the local settings ConfigMap is never applied
    assert not [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("openrl-settings")]
    for t in pod_templates(objs):
        c = t.container()
        if t.serves_http:
            url = urlsplit(flag(c["args"], "--hub-api-url"))
            assert url.hostname == f"hub.{OTHER['hub_namespace']}.svc.cluster.local", t.name
        for v in t.spec["volumes"]:
            if "csi" in v:
                assert v["csi"]["volumeAttributes"]["bucketName"] == OTHER["bucket"], t.name
        if "OPENRL_JOB_SERVICE_URL" in env_of(c):
            url = urlsplit(env_of(c)["OPENRL_JOB_SERVICE_URL"]["value"])
            assert url.hostname == f"openrl-service.{OTHER['namespace']}.svc.cluster.local"
    (policy,) = [p for p in of_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "openrl-service"]
    peers = [
        peer
        for r in policy["spec"]["ingress"] + policy["spec"]["egress"]
        for peer in r.get("from", r.get("to"))
    ]
    assert {"kubernetes.io/metadata.name": OTHER["hub_namespace"]} in [
        p.get("namespaceSelector", {}).get("matchLabels") for p in peers
    ]
    for binding in of_kind(objs, "RoleBinding"):
        assert {s["namespace"] for s in binding["subjects"]} == {OTHER["namespace"]}
    for p in of_kind(objs, "NetworkPolicy"):
        for r in p["spec"].get("egress", []):
            for peer in r["to"]:
                if peer.get("ipBlock", {}).get("cidr", "").endswith("/32") and p["metadata"]["name"].endswith(
                    "jobs"
                ):
                    assert peer["ipBlock"]["cidr"] == OTHER["apiserver_cidr"]


def test_an_overlay_without_the_settings_component_is_caught(other_k8s, tmp_path):
    """What the test above catches: a new overlay that forgets components/settings."""
    new = other_k8s / "overlays" / "forgot-settings"
    new.mkdir()
    (new / "kustomization.yaml").write_text("resources:\n  - ../../base\n")
    objs = render_in(other_k8s, "forgot-settings")
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {
        SETTINGS["namespace"]
    }


def test_a_missing_setting_is_named(tmp_path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("images", "*.md"))
    env = k8s / "settings" / "settings.env"
    env.write_text(re.sub(r"(?m)^bucket=.*\n", "", env.read_text()))
    proc = subprocess.run(
        [str(kubectl()), "kustomize", str(k8s / "overlays" / "gke-gpu-l4")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "data.bucket" in proc.stderr and "openrl-settings" in proc.stderr


# --- images: one place, the names and tag a release publishes -------------------------------------


def settings_component() -> dict:
    return yaml.safe_load((K8S / "components" / "settings" / "kustomization.yaml").read_text())


def test_images_are_named_in_one_place():
    """Only components/settings maps image names to a registry and tag; no other kustomization, patch
    or manifest of base/, components/ or overlays/ names a registry."""
    images = settings_component()["images"]
    assert {i["name"] for i in images} == {"openrl-service", "openrl-service-cuda", "openrl-notebook"}
    for path in [
        *(K8S / "base").rglob("*.yaml"),
        *(K8S / "components").rglob("*.yaml"),
        *(K8S / "overlays").rglob("*.yaml"),
    ]:
        if path.parent.name == "settings" and path.parent.parent.name == "components":
            continue
        where = path.relative_to(ROOT)
        assert "ghcr.io" not in path.read_text(), (
            f"{where} names a registry: name images in components/settings"
        )
        if path.name == "kustomization.yaml":
            assert "images" not in yaml.safe_load(path.read_text()), (
                f"{where}: images: belong in components/settings"
            )


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_image_an_overlay_pulls_is_one_a_release_publishes(name):
    """ghcr.io/<owner>/<image>:<version>: what .github/workflows/images.yml pushes for the package
    version, one owner for all, the notebook image the same in the jobs list and the hub's values."""
    published = {f"{i['newName']}:{i['newTag']}" for i in settings_component()["images"]}
    owners = {i["newName"].split("/")[1] for i in settings_component()["images"]}
    assert len(owners) == 1
    for i in settings_component()["images"]:
        assert re.fullmatch(r"ghcr\.io/[a-z0-9-]+/" + re.escape(i["name"]), i["newName"]), i
        assert i["newTag"] == PROJECT_VERSION, i
    for t in pod_templates(overlay(name)):
        for c in containers(t):
            assert c["image"] in published, f"{t.name}: {c['image']} is not one of {sorted(published)}"
            jobs = env_of(c).get("OPENRL_JOB_IMAGES")
            if jobs:
                assert set(jobs["value"].split(",")) <= published
    hub = own_values()["singleuser"]["image"]
    assert f"{hub['name']}:{hub['tag']}" in published


def test_the_service_namespace_in_the_hub_values_is_the_settings_one():
    """values.yaml is helm's, not kustomize's: it names the service's namespace itself."""
    text = (K8S / "jupyterhub" / "values.yaml").read_text()
    assert f".{SETTINGS['namespace']}.svc.cluster.local" in text
    egress = own_values()["singleuser"]["networkPolicy"]["egress"]
    assert (
        egress[0]["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        == SETTINGS["namespace"]
    )
    assert read_settings()["hub_namespace"] in text
