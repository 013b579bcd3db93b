"""The kustomize overlays render, validate strictly against Kubernetes 1.33 (and the PodMonitoring and
LeaderWorkerSet CRDs), and pass the checks a reviewer of a production Deployment would make, for every
pod template: a Deployment's, and a LeaderWorkerSet's leader and worker."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest

from openrl_service.config import env_variables
from tests.k8s._k8s import (
    GPU_OVERLAYS,
    HUB_NAMESPACE,
    LWS_API,
    OVERLAYS,
    ROOT,
    SERVICE_NAMESPACE,
    SETTINGS,
    PodTemplate,
    containers,
    env_of,
    flag,
    of_kind,
    overlay,
    pod_templates,
    render,
    render_text,
    schema,
)
from tests.k8s.netpol import selects

K8S_VERSION = "1.33"
SPOT_WINDOW_S = 15  # GKE: a preempted Spot VM's non-system pods get at most 15 s (then the VM stops at 30 s)
CLOSE_MARGIN_S = 2  # after the drain, uvicorn's timeout_graceful_shutdown (openrl_service/cli.py)
PROJECT_VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def deployments(name: str) -> list[dict]:
    found = of_kind(overlay(name), "Deployment")
    assert found, f"overlay {name} renders no Deployment"
    return found


def service_container(dep: dict | PodTemplate) -> dict:
    if isinstance(dep, PodTemplate):
        return dep.container()
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "openrl-service"]
    return c


def templates(name: str) -> list[PodTemplate]:
    found = pod_templates(overlay(name))
    assert found, f"overlay {name} renders no Deployment and no LeaderWorkerSet"
    return found


def strict_crd_schema(s: dict) -> dict:
    """An openAPIV3Schema as the API server's strict field validation applies it: fields not in the
    schema are errors unless x-kubernetes-preserve-unknown-fields says otherwise."""
    s = copy.deepcopy(s)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    s.pop("$comment", None)
    return s


PODMONITORING_SCHEMA = strict_crd_schema(schema("podmonitoring-v1-prometheus-engine-v0.17.2.json"))
LEADERWORKERSET_SCHEMA = strict_crd_schema(schema("leaderworkerset-v1-lws-v0.10.0.json"))
CRD_SCHEMAS = {
    ("monitoring.googleapis.com/v1", "PodMonitoring"): PODMONITORING_SCHEMA,
    (LWS_API, "LeaderWorkerSet"): LEADERWORKERSET_SCHEMA,
}
# One validator per schema, its schema checked once (the LWS schema is large)
CRD_VALIDATORS = {}
for _key, _schema in CRD_SCHEMAS.items():
    _cls = jsonschema.validators.validator_for(_schema)
    _cls.check_schema(_schema)
    CRD_VALIDATORS[_key] = _cls(_schema["properties"]["spec"])


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        CRD_VALIDATORS[key].validate(obj.get("spec", {}))
        assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}, f"unexpected top-level keys in {key}"
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    if obj["kind"] == "LeaderWorkerSet":
        # The controller creates the group's pods from these templates; the API server then checks them
        # as it checks any pod template, more strictly than the CRD's copy of the schema.
        for t in pod_templates([obj]):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": t.role}}
            kubernetes_validate.validate({**pod_template, "template": t.template}, K8S_VERSION, strict=True)


# --- render and validate -----------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_renders_the_whole_service(name):
    objs = overlay(name)
    kinds = {o["kind"] for o in objs}
    assert kinds & {"Deployment", "LeaderWorkerSet"}, f"{name}: no pods"
    assert {
        "Namespace",
        "ServiceAccount",
        "PersistentVolumeClaim",
        "Service",
        "NetworkPolicy",
        "PodMonitoring",
    } <= kinds
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == SERVICE_NAMESPACE, (o["kind"], o["metadata"]["name"])


def test_expected_overlays_exist():
    assert {
        "cpu",
        "gke-gpu-l4",
        "gke-gpu-h100",
        "gke-spot",
        "two-model",
        "gke-gpu-a3-8xh100",
        "gke-gpu-lws-2x8xh100",
    } <= set(OVERLAYS)


@pytest.mark.parametrize("name", ["k8s/base", *(f"k8s/overlays/{o}" for o in OVERLAYS)])
def test_every_object_validates_strictly(name):
    for obj in render(name):
        validate(obj)


def test_strict_validation_rejects_a_misspelled_field():
    dep = deployments("cpu")[0]
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
    (pm,) = of_kind(overlay("cpu"), "PodMonitoring")
    pm["spec"]["endpoints"][0]["scrapeInterval"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate(pm)


def test_strict_validation_rejects_a_misspelled_field_in_the_leaderworkerset():
    def lws() -> dict:
        (o,) = of_kind(overlay("gke-gpu-lws-2x8xh100"), "LeaderWorkerSet")
        return o

    validate(lws())
    broken = lws()
    broken["spec"]["leaderWorkerTemplate"]["restartPolicyy"] = "RecreateGroupOnPodRestart"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = lws()
    broken["spec"]["startupPolicy"] = "LeaderStarted"  # not one of the CRD's values
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = lws()
    worker = broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    worker["containers"][0]["resource"] = worker["containers"][0].pop("resources")
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = lws()
    broken["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["label"] = {"a": "b"}
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


# --- policy checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_container_has_resources_and_probes(name):
    for pod in templates(name):
        for c in containers(pod):
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), (pod.name, c["name"], kind)
            if not pod.serves_http:
                # a group's worker node runs ranks only: an HTTP probe would fail forever and restart it
                assert not c.get("ports"), f"{pod.name}: a worker declares ports it never listens on"
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    assert "httpGet" not in c.get(probe, {}), (pod.name, c["name"], probe)
                continue
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert probe in c, (pod.name, c["name"], probe)
        if not pod.serves_http:
            continue
        c = service_container(pod)
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        startup = c["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        gpu = "nvidia.com/gpu" in c["resources"]["limits"]
        assert budget >= (1200 if gpu else 300), f"{pod.name}: startup budget {budget}s"


@pytest.mark.parametrize("name", OVERLAYS)
def test_pods_run_as_non_root_with_a_read_only_root(name):
    # Only where a Role is bound to the service's account (components/jobs) does it need its token.
    bound = {s["name"] for b in of_kind(overlay(name), "RoleBinding") for s in b["subjects"]}
    for dep in templates(name):
        pod = dep.spec
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is (pod["serviceAccountName"] in bound)
        # Service links would inject OPENRL_SERVICE_PORT=tcp://... (and, for a Service named
        # "openrl", OPENRL_PORT=tcp://..., which the service reads as its port setting).
        assert pod["enableServiceLinks"] is False
        for c in containers(dep):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
        # A read-only root needs writable volumes for the data dir and /tmp, and every cache there.
        c = service_container(dep)
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        data_dir = flag(c["args"], "--data-dir")
        assert data_dir in mounts
        data = volumes[mounts[data_dir]["name"]]
        assert ("persistentVolumeClaim" if dep.owns_data_dir else "emptyDir") in data, dep.name
        assert not mounts[data_dir].get("readOnly")
        assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]["name"]]
        env = env_of(c)
        for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"):
            assert env[var]["value"].startswith(("/tmp/", data_dir + "/")), var


@pytest.mark.parametrize("name", OVERLAYS)
def test_images_are_pinned_to_the_package_version(name):
    for dep in templates(name):
        for c in containers(dep):
            image = c["image"]
            assert "@sha256:" in image or re.search(r":[^/:]+$", image), f"untagged image {image}"
            tag = image.rsplit(":", 1)[1]
            assert tag != "latest", image
            # The images workflow pushes the package version as the tag.
            assert tag == PROJECT_VERSION, f"{image}: tag is not the package version {PROJECT_VERSION}"


SECRET_PATTERNS = [
    re.compile(r"tml-[A-Za-z0-9_\-]{6,}"),  # an API key of this service / Tinker
    re.compile(r"\b(?:ghp|gho|github_pat|glpat|xox[bap])_[A-Za-z0-9_]{10,}"),  # forge and chat tokens
    re.compile(r"AIza[0-9A-Za-z_\-]{30,}"),  # a Google API key
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"\b[A-Fa-f0-9]{32,}\b"),  # a long hex secret (a hub API token is 32 hex digits)
    re.compile(r"\b[A-Za-z0-9+/]{40,}={0,2}"),  # a base64 blob (Secret data)
]


@pytest.mark.parametrize("name", ["k8s/base", *(f"k8s/overlays/{o}" for o in OVERLAYS)])
def test_no_secret_object_and_no_secret_literal(name):
    objs = render(name)
    assert not of_kind(objs, "Secret"), "a Secret object in the rendered output: keys must not live in git"
    text = render_text(name)
    for pattern in SECRET_PATTERNS:
        assert not pattern.search(text), f"{name}: secret-looking literal {pattern.search(text).group(0)!r}"


def test_secret_scan_catches_a_key():
    text = render_text("k8s/overlays/cpu") + "\n  OPENRL_API_KEYS: alice:tml-0123456789abcdef\n"
    assert any(p.search(text) for p in SECRET_PATTERNS)


@pytest.mark.parametrize("name", OVERLAYS)
def test_api_keys_come_from_the_admins_secret(name):
    for dep in templates(name):
        c = service_container(dep)
        keys_file = flag(c["args"], "--api-keys-file")
        volumes = {v["name"]: v for v in dep.spec["volumes"]}
        (mount,) = [m for m in c["volumeMounts"] if keys_file.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mount.get("readOnly") is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == "openrl-api-keys"
        assert not secret.get("optional"), "the pod must not start without its keys"
        assert "OPENRL_API_KEYS" not in env_of(c)


@pytest.mark.parametrize("name", OVERLAYS)
def test_recreate_strategy_with_a_read_write_once_volume(name):
    objs = overlay(name)
    rwo = {
        p["metadata"]["name"]
        for p in of_kind(objs, "PersistentVolumeClaim")
        if "ReadWriteOnce" in p["spec"]["accessModes"]
    }
    for dep in of_kind(objs, "Deployment"):
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in dep["spec"]["template"]["spec"]["volumes"]
            if "persistentVolumeClaim" in v and not v["persistentVolumeClaim"].get("readOnly")
        }
        assert claims & rwo, f"{dep['metadata']['name']} has no read-write data volume"
        assert claims <= {p["metadata"]["name"] for p in of_kind(objs, "PersistentVolumeClaim")}
        assert dep["spec"]["strategy"] == {"type": "Recreate"}
        assert dep["spec"]["replicas"] == 1


def drain_grace(c: dict) -> float:
    args = c["args"]
    if "--drain-grace-s" in args:
        return float(flag(args, "--drain-grace-s"))
    return float(env_of(c).get("OPENRL_DRAIN_GRACE_S", {"value": "25"})["value"])


@pytest.mark.parametrize("name", OVERLAYS)
def test_termination_grace_outlasts_the_drain(name):
    for dep in templates(name):
        grace = dep.spec["terminationGracePeriodSeconds"]
        assert grace >= drain_grace(service_container(dep)) + CLOSE_MARGIN_S


def test_spot_drain_fits_in_the_preemption_window():
    (dep,) = deployments("gke-spot")
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert {
        "key": "cloud.google.com/gke-spot",
        "operator": "Equal",
        "value": "true",
        "effect": "NoSchedule",
    } in pod["tolerations"]
    grace = drain_grace(service_container(dep))
    assert grace + CLOSE_MARGIN_S <= pod["terminationGracePeriodSeconds"] <= SPOT_WINDOW_S
    # still a GPU deployment: the spot patch must not have dropped the GPU toleration
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


ACCELERATORS = {"nvidia-l4", "nvidia-h100-80gb"}


@pytest.mark.parametrize("name", GPU_OVERLAYS)
def test_gpu_overlays_request_and_select_the_gpu(name):
    for dep in templates(name):
        pod = dep.spec
        c = service_container(dep)
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] in ACCELERATORS
        assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in pod["tolerations"])
        env = env_of(c)
        assert env["OPENRL_SAMPLER"]["value"] == "vllm"
        assert c["image"].split(":")[0].endswith("-cuda")
        # the model is a folder on a read-only volume (a bucket or a pre-filled disk), named by a ConfigMap
        ref = env["OPENRL_MODEL"]["valueFrom"]["configMapKeyRef"]
        (cm,) = [m for m in of_kind(overlay(name), "ConfigMap") if m["metadata"]["name"] == ref["name"]]
        model = cm["data"][ref["key"]]
        (mount,) = [m for m in c["volumeMounts"] if model.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True


def test_l4_and_h100_variants_pick_their_gpu():
    (l4,) = deployments("gke-gpu-l4")
    (h100,) = deployments("gke-gpu-h100")
    assert l4["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-l4"
    h = h100["spec"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-accelerator"]
    assert h == "nvidia-h100-80gb"


def test_cpu_overlay_serves_the_tiny_model_without_a_gpu():
    (dep,) = deployments("cpu")
    c = service_container(dep)
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]
    env = env_of(c)
    assert env["OPENRL_MODEL"]["value"] == "tiny" and env["OPENRL_SAMPLER"]["value"] == "torch"


@pytest.mark.parametrize("name", OVERLAYS)
def test_gcsfuse_volumes_are_wired(name):
    objs = overlay(name)
    for dep in pod_templates(objs):
        tmpl = dep.template
        fuse = [
            v
            for v in tmpl["spec"]["volumes"]
            if v.get("csi", {}).get("driver") == "gcsfuse.csi.storage.gke.io"
        ]
        if not fuse:
            continue
        # GKE injects the FUSE sidecar only into annotated pods; the bucket is settings.env's
        assert tmpl["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
        assert tmpl["spec"]["serviceAccountName"] == "openrl-service"
        bucket = fuse[0]["csi"]["volumeAttributes"]["bucketName"]
        assert bucket == SETTINGS["bucket"] and fuse[0]["csi"]["readOnly"] is True
        # and the sidecar may reach Cloud Storage: some egress policy selects this pod and allows 443
        extra = [
            p
            for p in of_kind(objs, "NetworkPolicy")
            if selects(p["spec"]["podSelector"], dep.labels)
            and any(
                port.get("port") == 443 for r in p["spec"].get("egress", []) for port in r.get("ports", [])
            )
        ]
        assert extra, f"{dep.name}: GCS FUSE without egress to Cloud Storage"


@pytest.mark.parametrize("name", OVERLAYS)
def test_selectors_tie_services_policies_and_monitoring_to_the_pods(name):
    objs = overlay(name)
    deps = of_kind(objs, "Deployment")
    pods = pod_templates(objs)
    (policy,) = [p for p in of_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "openrl-service"]
    (pm,) = of_kind(objs, "PodMonitoring")
    for pod in pods:
        labels = pod.labels
        if pod.role == "deployment":
            assert selects(pod.workload["spec"]["selector"], labels)
            # one Deployment per base model: no other Deployment's selector matches these pods
            others = [d for d in deps if d is not pod.workload]
            assert not any(selects(o["spec"]["selector"], labels) for o in others)
        assert selects(policy["spec"]["podSelector"], labels), "the NetworkPolicy does not select the service"
        if not pod.serves_http:
            continue  # a worker has no port to scrape (PodMonitoring targets only pods with the port)
        assert selects(pm["spec"]["selector"], labels), "PodMonitoring does not scrape the service"
        ports = {p["name"]: p["containerPort"] for p in service_container(pod)["ports"]}
        assert all(e["port"] in ports for e in pm["spec"]["endpoints"])
        assert pm["spec"]["endpoints"][0]["path"] == "/metrics"
    # every Service selects exactly one kind of pod, one that serves HTTP, on the container's named port
    for svc in of_kind(objs, "Service"):
        sel = {"matchLabels": svc["spec"]["selector"]}
        backing = [p for p in pods if selects(sel, p.labels)]
        assert len(backing) == 1, (svc["metadata"]["name"], [p.name for p in backing])
        assert backing[0].serves_http, f"{svc['metadata']['name']} sends requests to {backing[0].name}"
        ports = {p["name"] for p in service_container(backing[0])["ports"]}
        assert svc["spec"]["type"] == "ClusterIP"
        assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])


def test_two_model_example_has_two_services_and_volumes():
    objs = overlay("two-model")
    assert {s["metadata"]["name"] for s in of_kind(objs, "Service")} == {
        "openrl-service",
        "openrl-service-large",
    }
    assert len(of_kind(objs, "Deployment")) == 2
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for d in of_kind(objs, "Deployment")
        for v in d["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "data"
    ]
    assert len(set(claims)) == 2, "two processes would fight over one data dir (it is locked)"
    models = {m["data"]["model"] for m in of_kind(objs, "ConfigMap") if "model" in m.get("data", {})}
    assert len(models) == 2


@pytest.fixture(scope="module")
def serve_flags() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "openrl_service.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", out.stdout))


@pytest.mark.parametrize("name", OVERLAYS)
def test_container_args_are_real_serve_flags(name, serve_flags):
    for dep in templates(name):
        c = service_container(dep)
        args = c["args"]
        assert args[0] == "serve"
        used = [a for a in args if a.startswith("--")]
        assert set(used) <= serve_flags, f"not flags of `openrl-service serve`: {set(used) - serve_flags}"
        assert len(used) == len(set(used)), f"{dep.name}: a flag given twice (the last one wins): {used}"
        if dep.serves_http:
            assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "8000"
        for var in env_of(c):
            if var.startswith("OPENRL_"):
                assert var in env_variables(), f"{var} is not a setting"
        # $(VAR) is expanded by the kubelet only when VAR is in the container's environment; otherwise
        # serve gets the literal text
        defined = set(env_of(c)) | dep.injected_variables
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(args)):
            assert ref in defined, f"{dep.name}: $({ref}) in the args is set by nothing"


@pytest.mark.parametrize("name", OVERLAYS)
def test_hub_api_url_is_the_hub_the_policy_lets_through(name):
    objs = overlay(name)
    (policy,) = [p for p in of_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "openrl-service"]
    for dep in pod_templates(objs):
        if not dep.serves_http:
            continue  # a worker node authenticates nobody
        url = urlsplit(flag(service_container(dep)["args"], "--hub-api-url"))
        assert url.hostname == f"hub.{HUB_NAMESPACE}.svc.cluster.local" and url.port == 8081
        assert url.path == "/hub/api"
        to_hub = [
            r
            for r in policy["spec"]["egress"]
            if any(p.get("port") == url.port for p in r["ports"])
            and any(
                peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
                == HUB_NAMESPACE
                for peer in r["to"]
            )
        ]
        assert to_hub, "the NetworkPolicy's egress does not reach the hub named by --hub-api-url"
