"""Detached runs as Kubernetes Jobs: openrl_service/kube.py with the real `kubernetes` client against
kmock (an in-process Kubernetes API on loopback, tests/k8s/kubeapi.py), and k8s/components/jobs."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from openrl_service.errors import UserError
from openrl_service.kube import (
    API_VERBS,
    DNS_LABEL_RE,
    LABEL_VALUE_RE,
    JobVolume,
    KubeLauncher,
    KubernetesError,
    KubeSettings,
    parse_volumes,
)
from tests.conftest import ALICE_KEY
from tests.k8s._k8s import K8S, SERVICE_NAMESPACE, SETTINGS, env_of, of_kind, overlay
from tests.k8s.kubeapi import KubeAPI, pod_command_and_env
from tests.k8s.netpol import Cluster, External, Pod, allowed

K8S_VERSION = "1.33"
JOBS_OVERLAY = "gke-gpu-l4-jobs"
IMAGE = "ghcr.io/openrl-jupyter/openrl-notebook:0.1.0"
OTHER_IMAGE = "ghcr.io/openrl-jupyter/openrl-notebook-gpu:0.1.0"
SERVICE_URL = "http://openrl-service.openrl.svc.cluster.local:8000"
KEY = "tml-job-0123456789abcdef0123456789abcdef"
TENANT = "hub:alice@example.org"
JOB_ID = "job-7f3a9c2e41d8"
VOLUMES = parse_volumes((K8S / "components" / "jobs" / "job-volumes.yaml").read_text(), "job-volumes.yaml")
VERBS = {
    "CREATE": "create",
    "FETCH": "get",
    "LIST": "list",
    "WATCH": "watch",
    "UPDATE": "patch",
    "DELETE": "delete",
}


@pytest.fixture
def api():
    k = KubeAPI()
    yield k
    k.close()


def launcher(api: KubeAPI, **overrides) -> KubeLauncher:
    settings = {
        "namespace": SERVICE_NAMESPACE,
        "images": [IMAGE, OTHER_IMAGE],
        "service_url": SERVICE_URL,
        "volumes": VOLUMES,
        **overrides,
    }
    return KubeLauncher(KubeSettings(**settings), api_client=api.client)


def submit(launch: KubeLauncher, request: dict | None = None, **kw) -> dict:
    args = {"tenant": TENANT, "job_id": JOB_ID, "name": "sql-rl", "kind": "run", "key": KEY, **kw}
    return launch.submit(request=request, **args)


# --- what a submit creates ----------------------------------------------------------------------


def test_submit_creates_exactly_the_job_its_configmap_and_secret(api):
    out = submit(launcher(api), {"volumes": ["scratch"], "cpu": "2", "memory": "3Gi"})
    assert out == {
        "namespace": "openrl",
        "job": out["job"],
        "configmap": out["job"] + "-spec",
        "secret": out["job"] + "-token",
    }
    assert set(api.objects()) == {
        f"jobs/{out['job']}",
        f"configmaps/{out['configmap']}",
        f"secrets/{out['secret']}",
    }
    job = api.objects("jobs")[out["job"]]
    cm = api.objects("configmaps")[out["configmap"]]
    secret = api.objects("secrets")[out["secret"]]

    labels = job["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "openrl-job"
    assert labels["app.kubernetes.io/managed-by"] == "openrl-service"
    assert labels["openrl.dev/job-id"] == JOB_ID
    assert LABEL_VALUE_RE.match(labels["openrl.dev/tenant"]) and ":" not in labels["openrl.dev/tenant"]
    assert job["metadata"]["annotations"]["openrl.dev/tenant"] == TENANT
    assert job["metadata"]["annotations"]["openrl.dev/job-name"] == "sql-rl"
    assert "kueue.x-k8s.io/queue-name" not in labels and "suspend" not in job["spec"]
    assert job["metadata"]["namespace"] == "openrl"

    spec = job["spec"]
    assert spec["backoffLimit"] == 2 and spec["ttlSecondsAfterFinished"] == 3600
    # exit code 3 = the worker reported its job failed (its key is revoked): fail the Job, no retry;
    # an evicted or preempted pod is retried without using up backoffLimit
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [3]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    assert "activeDeadlineSeconds" not in spec
    tmpl = spec["template"]
    assert (
        tmpl["metadata"]["labels"]["app.kubernetes.io/name"] == "openrl-job"
    )  # the NetworkPolicy's selector
    pod = tmpl["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["serviceAccountName"] == "openrl-job"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["image"] == IMAGE
    assert c["command"] == ["python", "-m", "openrl_jupyter.jobs", "worker"]
    assert "args" not in c
    assert c["resources"] == {
        "requests": {"cpu": "2", "memory": "3Gi"},
        "limits": {"cpu": "2", "memory": "3Gi"},
    }
    sc = c["securityContext"]
    assert sc == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    env = env_of(c)
    assert env["OPENRL_URL"]["value"] == SERVICE_URL
    assert env["OPENRL_JOB_ID"]["value"] == JOB_ID
    assert env["OPENRL_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": out["secret"], "key": "token"}}
    assert env["HOME"]["value"].startswith("/tmp/")
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    spec_path = env["OPENRL_JOB_SPEC"]["value"]
    (spec_mount,) = [m for m in mounts.values() if spec_path.startswith(m["mountPath"] + "/")]
    assert spec_mount["readOnly"] is True
    assert volumes[spec_mount["name"]]["configMap"]["name"] == out["configmap"]
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert mounts["/scratch"]["name"] == "scratch" and mounts["/scratch"]["readOnly"] is False
    assert volumes["scratch"] == {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}
    assert "datasets" not in volumes, "only the volumes asked for are mounted"
    # the key is only in the Secret: nowhere in the Job or the ConfigMap
    assert KEY not in json.dumps(job) and KEY not in json.dumps(cm)

    uid = job["metadata"]["uid"]
    for owned in (cm, secret):
        assert owned["metadata"]["ownerReferences"] == [
            {"apiVersion": "batch/v1", "kind": "Job", "name": out["job"], "uid": uid}
        ]
        assert owned["metadata"]["labels"] == {k: v for k, v in labels.items()}
        assert owned["immutable"] is True
    assert json.loads(cm["data"][spec_path.rsplit("/", 1)[1]]) == {
        "job_id": JOB_ID,
        "name": "sql-rl",
        "kind": "run",
        "service_url": SERVICE_URL,
    }
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["token"]).decode() == KEY


def test_a_queue_adds_the_kueue_label_and_creates_the_job_suspended(api):
    out = submit(launcher(api, queue="openrl-jobs", active_deadline_s=7200, backoff_limit=0, ttl_s=600))
    job = api.objects("jobs")[out["job"]]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "openrl-jobs"
    assert job["spec"]["suspend"] is True
    assert job["spec"]["activeDeadlineSeconds"] == 7200
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["ttlSecondsAfterFinished"] == 600


def test_defaults_fit_under_the_limits(api):
    launch = launcher(api, max_cpu="500m", max_memory="1Gi")
    assert launch.validate(None) == {"image": IMAGE, "volumes": [], "cpu": "500m", "memory": "1Gi"}
    assert launcher(api).validate({}) == {"image": IMAGE, "volumes": [], "cpu": "1", "memory": "2Gi"}


@pytest.mark.parametrize("queue", [None, "openrl-jobs"])
def test_every_created_object_validates_strictly_against_kubernetes_1_33(api, queue):
    submit(
        launcher(api, queue=queue, active_deadline_s=3600), {"volumes": sorted(VOLUMES), "image": OTHER_IMAGE}
    )
    objs = api.objects()
    assert len(objs) == 3
    for obj in objs.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_strict_validation_would_catch_a_wrong_field(api):
    submit(launcher(api))
    (job,) = api.objects("jobs").values()
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = {"cores": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    "name",
    ["sql-rl", "A" * 64, "My_Run.v2", "---", "x", "UPPER.case_and-dots." * 3],
)
def test_object_names_are_dns_labels_of_at_most_63_characters(name):
    names = KubeLauncher.object_names(name, JOB_ID)
    for n in names.values():
        assert len(n) <= 63 and DNS_LABEL_RE.match(n), n
    # two jobs of one name (a resubmit after the first finished) never collide
    assert KubeLauncher.object_names(name, JOB_ID + "x")["job"] != names["job"]


# --- what is refused ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_, field, words",
    [
        ({"image": "docker.io/evil/miner:latest"}, "k8s.image", [IMAGE, OTHER_IMAGE]),
        ({"volumes": ["host-root"]}, "k8s.volumes[0]", ["datasets", "scratch"]),
        (
            {"volumes": ["scratch", {"name": "x", "hostPath": {"path": "/"}}]},
            "k8s.volumes[1]",
            ["datasets", "scratch"],
        ),
        (
            {"hostPath": {"path": "/var/run/docker.sock"}},
            "k8s.hostPath",
            ["image", "volumes", "cpu", "memory"],
        ),
        ({"serviceAccountName": "openrl-service"}, "k8s.serviceAccountName", ["image", "volumes"]),
        ({"volumes": "scratch"}, "k8s.volumes", ["datasets", "scratch"]),
        ({"cpu": "5"}, "k8s.cpu", ["4", "OPENRL_JOB_MAX_CPU"]),
        ({"cpu": "4001m"}, "k8s.cpu", ["4", "OPENRL_JOB_MAX_CPU"]),
        ({"memory": "17Gi"}, "k8s.memory", ["16Gi", "OPENRL_JOB_MAX_MEMORY"]),
        ({"memory": "lots"}, "k8s.memory", ["quantity"]),
        ({"cpu": "0"}, "k8s.cpu", ["above 0"]),
        ({"cpu": "-1"}, "k8s.cpu", ["above 0"]),
        ({"cpu": "NaN"}, "k8s.cpu", ["quantity"]),  # the client's parser takes it; Kubernetes would not
        ({"memory": "inf"}, "k8s.memory", ["quantity"]),
        ({"cpu": True}, "k8s.cpu", ["quantity"]),
        # the Kubernetes client's parser takes these; the API server would refuse the Job (a 502
        # after the job's key was minted): refused here, naming the field
        ({"memory": "2 Gi"}, "k8s.memory", ["quantity"]),
        ({"cpu": "1_000m"}, "k8s.cpu", ["quantity"]),
        ({"cpu": "\u0662"}, "k8s.cpu", ["quantity"]),  # ARABIC-INDIC DIGIT TWO
        ({"memory": "1e-3Gi"}, "k8s.memory", ["quantity"]),
    ],
)
def test_a_request_outside_what_the_admin_allows_is_refused_naming_the_field(api, request_, field, words):
    launch = launcher(api)
    with pytest.raises(UserError) as e:
        submit(launch, request_)
    assert e.value.field == field
    assert e.value.status_code == 400
    for w in words:
        assert w in e.value.message, (w, e.value.message)
    assert api.calls() == [], "nothing reaches the API server"
    assert api.objects() == {}


def test_exactly_the_limit_is_accepted(api):
    submit(launcher(api), {"cpu": "4", "memory": "16Gi"})
    (job,) = api.objects("jobs").values()
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "cpu": "4",
        "memory": "16Gi",
    }


# --- failures, status, delete -------------------------------------------------------------------


@pytest.mark.parametrize(
    "refused, kind",
    [("jobs", "Job"), ("configmaps", "ConfigMap"), ("secrets", "Secret")],
)
def test_a_failed_create_removes_what_was_created(api, refused, kind):
    api.emu.refuse = {refused}
    with pytest.raises(KubernetesError) as e:
        submit(launcher(api))
    assert e.value.status_code == 502
    assert e.value.message.startswith("Kubernetes: creating " + kind)
    assert "403" in e.value.message and "forbidden" in e.value.message
    assert KEY not in e.value.message
    assert api.objects() == {}, "a half-created job was left behind"
    # newest first; the Job with Background propagation (its pods go with it)
    deletes = [(r, q) for _, r, v, q in api.calls() if v == "delete"]
    expected = {
        "jobs": [],
        "configmaps": [("jobs", {"propagationPolicy": "Background"})],
        "secrets": [("configmaps", {}), ("jobs", {"propagationPolicy": "Background"})],
    }[refused]
    assert deletes == expected


def test_unreachable_api_server_is_a_kubernetes_error(api):
    launch = launcher(api)
    api.close()
    with pytest.raises(KubernetesError) as e:
        submit(launch)
    assert "Kubernetes" in e.value.message


def set_status(api: KubeAPI, name: str, status: dict, spec: dict | None = None) -> None:
    for (res, _, n), obj in api.emu.objects.items():
        if res.plural == "jobs" and n == name:
            obj.patch({"status": status, **({"spec": spec} if spec else {})})


def test_status_maps_job_conditions_to_phases(api):
    launch = launcher(api)
    job = submit(launch)["job"]
    assert launch.status(job)["phase"] == "pending"  # created, no pod yet
    set_status(api, job, {"active": 1, "ready": 0})
    assert launch.status(job)["phase"] == "pending"  # the pod is pulling its image
    set_status(api, job, {"active": 1, "ready": 1})
    assert launch.status(job) == {
        "phase": "running",
        "active": 1,
        "succeeded": 0,
        "failed": 0,
        "reason": None,
    }
    set_status(
        api,
        job,
        {
            "active": 0,
            "ready": 0,
            "failed": 3,
            "conditions": [
                {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded"},
                {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"},
            ],
        },
    )
    assert launch.status(job) == {
        "phase": "failed",
        "active": 0,
        "succeeded": 0,
        "failed": 3,
        "reason": "BackoffLimitExceeded",
    }
    set_status(
        api,
        job,
        {
            "failed": 0,
            "succeeded": 1,
            "conditions": [
                {"type": "SuccessCriteriaMet", "status": "True", "reason": "CompletionsReached"},
                {"type": "Complete", "status": "True", "reason": "CompletionsReached"},
            ],
        },
    )
    assert launch.status(job)["phase"] == "succeeded"
    assert launch.status("openrl-never-was-00000000") == {
        "phase": "missing",
        "active": 0,
        "succeeded": 0,
        "failed": 0,
        "reason": None,
    }


def test_a_queued_job_is_pending_until_kueue_admits_it(api):
    launch = launcher(api, queue="openrl-jobs")
    job = submit(launch)["job"]
    set_status(api, job, {"conditions": [{"type": "Suspended", "status": "True", "reason": "JobSuspended"}]})
    assert launch.status(job)["phase"] == "pending"
    set_status(api, job, {"active": 1, "ready": 1, "conditions": []}, spec={"suspend": False})
    assert launch.status(job)["phase"] == "running"


def test_delete_uses_background_propagation_and_tolerates_a_gone_job(api):
    launch = launcher(api)
    job = submit(launch)["job"]
    launch.delete(job)
    assert job not in api.objects("jobs")
    assert api.calls()[-1] == ("batch", "jobs", "delete", {"propagationPolicy": "Background"})
    launch.delete(job)  # already gone: not an error
    assert launch.status(job)["phase"] == "missing"


# --- the manifests: RBAC, the job account, the network path, the settings ------------------------


def role_rules(objs: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, res, verb)
        for role in of_kind(objs, "Role")
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_role_allows_exactly_what_the_launcher_calls(api):
    """Every call a submit, a failed submit's clean-up, a status and a delete make is granted by the
    rendered Role, and the Role grants nothing the launcher does not call."""
    launch = launcher(api)
    job = submit(launch)["job"]
    launch.status(job)
    launch.delete(job)
    api.emu.refuse = {"secrets"}
    with pytest.raises(KubernetesError):
        submit(launch, job_id=JOB_ID + "b")
    called = {(g, r, v) for g, r, v, _ in api.calls()}
    granted = role_rules(overlay(JOBS_OVERLAY))
    assert called == granted
    assert granted == {(g, r, v) for (g, r), verbs in API_VERBS.items() for v in verbs}


@pytest.mark.parametrize("name", sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir()))
def test_rbac_is_namespaced_and_least_privilege(name):
    objs = overlay(name)
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
    for role in of_kind(objs, "Role"):
        assert role["metadata"]["namespace"] == SERVICE_NAMESPACE
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert not {"list", "watch", "patch", "update", "escalate", "bind", "impersonate"} & set(
                rule["verbs"]
            )
            assert not {"pods", "pods/exec", "roles", "rolebindings", "serviceaccounts"} & set(
                rule["resources"]
            )
    for binding in of_kind(objs, "RoleBinding"):
        assert binding["metadata"]["namespace"] == SERVICE_NAMESPACE
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "openrl-service", "namespace": SERVICE_NAMESPACE}
        ]
    if of_kind(objs, "Role"):
        (job_sa,) = [s for s in of_kind(objs, "ServiceAccount") if s["metadata"]["name"] == "openrl-job"]
        assert job_sa["automountServiceAccountToken"] is False


def service_env() -> dict[str, dict]:
    (dep,) = of_kind(overlay(JOBS_OVERLAY), "Deployment")
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "openrl-service"]
    return env_of(c)


def test_the_overlay_configures_the_launcher_it_grants(api):
    """The service settings the overlay renders build a launcher whose Job uses the account the
    overlay creates, an image pinned like the service's, the overlay's Service URL and volumes."""
    objs = overlay(JOBS_OVERLAY)
    env = service_env()
    assert env["OPENRL_JOBS_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    images = env["OPENRL_JOB_IMAGES"]["value"].split(",")
    assert all(i.rsplit(":", 1)[1] == "0.1.0" for i in images)
    url = env["OPENRL_JOB_SERVICE_URL"]["value"]
    svc_names = {
        f"http://{s['metadata']['name']}.{SERVICE_NAMESPACE}.svc.cluster.local:{p['port']}"
        for s in of_kind(objs, "Service")
        for p in s["spec"]["ports"]
    }
    assert url in svc_names
    (cm,) = [m for m in of_kind(objs, "ConfigMap") if m["metadata"]["name"].startswith("openrl-job-volumes")]
    volumes = parse_volumes(cm["data"]["volumes.yaml"], "rendered openrl-job-volumes")
    assert env["OPENRL_JOB_VOLUMES_FILE"]["value"].endswith("/volumes.yaml")
    launch = launcher(
        api,
        images=images,
        service_url=url,
        volumes=volumes,
        max_cpu=env["OPENRL_JOB_MAX_CPU"]["value"],
        max_memory=env["OPENRL_JOB_MAX_MEMORY"]["value"],
    )
    submit(launch, {"volumes": sorted(volumes)})
    (job,) = api.objects("jobs").values()
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    assert sa in {s["metadata"]["name"] for s in of_kind(objs, "ServiceAccount")}
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_job_pods_reach_the_service_and_nothing_else(api):
    """The NetworkPolicies of the jobs overlay, applied to a pod with the labels the launcher
    really gives job pods."""
    objs = overlay(JOBS_OVERLAY)
    submit(launcher(api))
    (job,) = api.objects("jobs").values()
    (dep,) = of_kind(objs, "Deployment")
    service = Pod(
        "openrl-service",
        SERVICE_NAMESPACE,
        dep["spec"]["template"]["metadata"]["labels"],
        "10.8.3.2",
        {"http": 8000},
    )
    worker = Pod("worker", SERVICE_NAMESPACE, job["spec"]["template"]["metadata"]["labels"], "10.8.3.9", {})
    impostor = Pod("impostor", "team-b", job["spec"]["template"]["metadata"]["labels"], "10.8.1.2", {})
    neighbour = Pod("debug", SERVICE_NAMESPACE, {"run": "debug"}, "10.8.2.9", {"http": 8080})
    dns = Pod("kube-dns-1", "kube-system", {"k8s-app": "kube-dns"}, "10.8.0.6", {"dns": 53})
    (jobs_policy,) = [
        p for p in of_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "openrl-service-jobs"
    ]
    api_server = External(
        "kube-apiserver", jobs_policy["spec"]["egress"][0]["to"][0]["ipBlock"]["cidr"].split("/")[0]
    )
    cluster = Cluster(
        {SERVICE_NAMESPACE: {}, "team-b": {}, "kube-system": {}},
        [service, worker, impostor, neighbour, dns],
        of_kind(objs, "NetworkPolicy"),
    )
    assert allowed(cluster, worker, service, 8000)
    assert allowed(cluster, worker, dns, 53, "UDP")
    assert allowed(cluster, service, api_server, 443)
    assert not allowed(cluster, impostor, service, 8000), "another namespace's copy of the labels"
    assert not allowed(cluster, neighbour, service, 8000)
    assert not allowed(cluster, worker, service, 9090)
    assert not allowed(cluster, worker, neighbour, 8080)
    assert not allowed(cluster, worker, External("internet", "1.1.1.1"), 443)
    assert not allowed(cluster, worker, External("metadata", "169.254.169.254"), 80)
    assert not allowed(cluster, worker, api_server, 443), "job pods have no business with the API"
    assert not allowed(cluster, service, worker, 8000), "nothing connects to a job pod"


def test_example_volumes_are_valid_kubernetes_volumes():
    assert set(VOLUMES) == {"datasets", "scratch"}
    for v in VOLUMES.values():
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "x"},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "i",
                            "volumeMounts": [{"name": v.name, "mountPath": v.mount_path}],
                        }
                    ],
                    "volumes": [{"name": v.name, **v.volume}],
                },
            },
            K8S_VERSION,
            strict=True,
        )


def test_kueue_example_names_the_namespace_and_a_cluster_queue():
    docs = list(yaml.safe_load_all((K8S / "jobs" / "kueue-localqueue.yaml").read_text()))
    (lq,) = [d for d in docs if d["kind"] == "LocalQueue"]
    (cq,) = [d for d in docs if d["kind"] == "ClusterQueue"]
    assert lq["metadata"]["namespace"] == SERVICE_NAMESPACE
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert "openrl-jobs" in (K8S / "components" / "jobs" / "deployment.yaml").read_text()
    flavors = {d["metadata"]["name"] for d in docs if d["kind"] == "ResourceFlavor"}
    assert {f["name"] for g in cq["spec"]["resourceGroups"] for f in g["flavors"]} <= flavors


# --- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"images": []}, ["--job-image", "OPENRL_JOB_IMAGES"]),
        ({"service_url": "openrl:8000"}, ["--job-service-url"]),
        ({"queue": "no spaces"}, ["--job-queue"]),
        ({"max_cpu": "four"}, ["OPENRL_JOB_MAX_CPU"]),
        ({"max_memory": "0"}, ["OPENRL_JOB_MAX_MEMORY"]),
        ({"backoff_limit": -1}, ["OPENRL_JOB_BACKOFF_LIMIT"]),
        ({"namespace": "Not_A_Namespace"}, ["--jobs-namespace"]),
        ({"service_account": "default:x"}, ["OPENRL_JOB_SERVICE_ACCOUNT"]),
    ],
)
def test_bad_job_settings_name_their_flag(overrides, words):
    args = {"namespace": "openrl", "images": [IMAGE], "service_url": SERVICE_URL, **overrides}
    with pytest.raises(ValueError) as e:
        KubeSettings(**args)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ("tmp: {volume: {emptyDir: {}}, mountPath: /x}", ["tmp"]),
        ("data: {volume: {emptyDir: {}, hostPath: {path: /}}, mountPath: /x}", ["exactly one source"]),
        ("data: {volume: {emptyDir: {}}, mountPath: relative}", ["mountPath"]),
        ("data: {volume: {emptyDir: {}}, mountPath: /tmp}", ["mountPath"]),
        ("Data: {volume: {emptyDir: {}}, mountPath: /x}", ["DNS-1123"]),
        (
            "a: {volume: {emptyDir: {}}, mountPath: /x}\nb: {volume: {emptyDir: {}}, mountPath: /x/}",
            ["share"],
        ),
        ("[1, 2]", ["mapping"]),
    ],
)
def test_bad_volumes_files_are_refused(text, words):
    with pytest.raises(ValueError) as e:
        parse_volumes(text, "vols.yaml")
    assert "vols.yaml" in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_volumes_file_accepts_json_too():
    vols = parse_volumes('{"data": {"volume": {"emptyDir": {}}, "mountPath": "/data"}}', "v.json")
    assert vols == {"data": JobVolume("data", {"emptyDir": {}}, "/data", True)}


def test_the_service_runs_without_kubernetes_when_jobs_are_off():
    """openrl_service imports no `kubernetes` unless --jobs-namespace is set; with it set and the
    package missing, the error `serve` exits 2 with names the flag and the extra."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'kubernetes' or name.startswith('kubernetes.'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from openrl_service import cli, config, kube\n"
        "assert kube.launcher_from_settings(config.Settings()) is None\n"
        "assert not [m for m in sys.modules if m.startswith('kubernetes')]\n"
        "kube.load_api_client()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ValueError" in proc.stderr, proc.stderr
    assert "--jobs-namespace needs the kubernetes package" in proc.stderr and "[k8s]" in proc.stderr


def test_bad_job_flags_are_refused_at_startup(tmp_path):
    argv = [sys.executable, "-m", "openrl_service.cli", "serve", "--port", "0", "--data-dir", str(tmp_path)]
    done = subprocess.run([*argv, "--jobs-namespace", "openrl"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--job-image (OPENRL_JOB_IMAGES) must name at least one image" in done.stderr


def test_readme_sets_the_api_server_address_the_policy_uses():
    """The README prints the apiserver_cidr= line for settings.env; the policy carries that setting."""
    readme = (K8S / "README.md").read_text()
    assert "jsonpath='apiserver_cidr={.subsets[0].addresses[0].ip}/32" in readme
    cidr = SETTINGS["apiserver_cidr"]
    (policy,) = [
        p
        for p in of_kind(overlay(JOBS_OVERLAY), "NetworkPolicy")
        if p["metadata"]["name"] == "openrl-service-jobs"
    ]
    assert [r["to"][0]["ipBlock"]["cidr"] for r in policy["spec"]["egress"]] == [cidr]


def test_the_service_builds_its_launcher_from_its_settings(api, tmp_path, monkeypatch):
    """The service's launcher (Container.kube): None without --jobs-namespace; with it, a launcher that
    reaches the API server the kubeconfig names (outside a pod) and submits with the configured images
    and volumes."""
    from openrl_service import config
    from openrl_service.container import Container

    assert Container.build(config.Settings(data_dir=tmp_path / "off")).kube is None
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": api.url}}],
                "users": [{"name": "svc", "user": {"token": "not-a-real-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "svc"}}],
                "current-context": "kmock",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: use the kubeconfig
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    env = {
        "OPENRL_JOBS_NAMESPACE": "openrl",
        "OPENRL_JOB_IMAGES": f"{IMAGE},{OTHER_IMAGE}",
        "OPENRL_JOB_VOLUMES_FILE": str(K8S / "components" / "jobs" / "job-volumes.yaml"),
        "OPENRL_JOB_QUEUE": "openrl-jobs",
        "OPENRL_JOB_MAX_CPU": "2",
    }
    kube = Container.build(config.from_env(env, data_dir=tmp_path / "on")).kube
    assert isinstance(kube, KubeLauncher)
    with pytest.raises(UserError, match=r"<= 2 \(OPENRL_JOB_MAX_CPU\)"):
        kube.validate({"cpu": "3"})
    out = submit(kube, {"volumes": ["datasets"]})
    job = api.objects("jobs")[out["job"]]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
    assert job["spec"]["template"]["spec"]["containers"][0]["env"][0] == {
        "name": "OPENRL_URL",
        "value": SERVICE_URL,
    }
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "openrl-jobs"


def test_the_job_container_can_be_materialised_here(api, tmp_path):
    """What a pod of the Job would see, resolved from the stored objects: the worker command, the
    service URL, the job key from the Secret and spec.json from the ConfigMap. (An end-to-end test
    runs this command against a live service with this environment.)"""
    out = submit(launcher(api))
    command, env = pod_command_and_env(api, out["job"], tmp_path)
    assert command == ["python", "-m", "openrl_jupyter.jobs", "worker"]
    assert env["OPENRL_TOKEN"] == KEY and env["OPENRL_URL"] == SERVICE_URL and env["OPENRL_JOB_ID"] == JOB_ID
    spec = json.loads(Path(env["OPENRL_JOB_SPEC"]).read_text())
    assert spec == {"job_id": JOB_ID, "name": "sql-rl", "kind": "run", "service_url": SERVICE_URL}
    assert env["OPENRL_JOB_SPEC"].startswith(str(tmp_path))


# --- the jobs API with the real launcher ----------------------------------------------------------


def job_body(job_name: str, **over) -> dict:
    data = b"\x80\x05 opaque payload bytes"
    out = {
        "name": job_name,
        "kind": "run",
        "where": "k8s",
        "payload": base64.b64encode(data).decode(),
        "payload_sha256": hashlib.sha256(data).hexdigest(),
        "meta": {"steps": 3},
    }
    return {**out, **over}


def test_the_jobs_api_creates_the_kubernetes_job_with_a_working_job_key(server, api, monkeypatch):
    """POST /openrl/v1/jobs where=k8s through the service with the real launcher: refusals name the
    field, the Job and its Secret are created, the key in the Secret (never in the reply) is the
    job's credential, the entry shows the Job's phase, DELETE deletes the Job and revokes the key;
    a Kubernetes refusal leaves no job, no object."""
    monkeypatch.setattr(server.parts, "kube", launcher(api))
    name = "kube-" + uuid.uuid4().hex[:8]
    with server.client(ALICE_KEY) as c:
        r = c.post("/openrl/v1/jobs", json=job_body(name, k8s={"volumes": [{"hostPath": {"path": "/"}}]}))
        assert r.status_code == 400 and r.json()["field"] == "k8s.volumes[0]", r.text
        r = c.post("/openrl/v1/jobs", json=job_body(name, k8s={"image": "docker.io/evil:1"}))
        assert r.status_code == 400 and IMAGE in r.json()["error"], r.text
        assert api.objects() == {}

        api.emu.refuse = {"secrets"}
        r = c.post("/openrl/v1/jobs", json=job_body(name))
        assert r.status_code == 502 and "Kubernetes" in r.json()["error"], r.text
        assert api.objects() == {}
        assert c.get(f"/openrl/v1/jobs/{name}").status_code == 404, "a failed submit leaves no job"
        api.emu.refuse = set()

        r = c.post("/openrl/v1/jobs", json=job_body(name, k8s={"volumes": ["scratch"], "cpu": "2"}))
        assert r.status_code == 201, r.text
        out = r.json()
        assert "key" not in out
        names = KubeLauncher.object_names(name, out["job_id"])
        assert out["k8s"] == {"namespace": "openrl", **names}
        job = api.objects("jobs")[names["job"]]
        assert job["metadata"]["annotations"]["openrl.dev/tenant"] == "alice"
        assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"
        set_status(api, names["job"], {"active": 1, "ready": 1})
        token = base64.b64decode(api.objects("secrets")[names["secret"]]["data"]["token"]).decode()
        assert token not in r.text
        with server.client(token) as worker:
            got = worker.get(f"/openrl/v1/jobs/{out['job_id']}")
            assert got.status_code == 200, got.text
            assert got.json()["k8s"] == {"namespace": "openrl", "job": names["job"], "phase": "running"}
            assert worker.get("/openrl/v1/jobs").json()["jobs"][0]["job_id"] == out["job_id"]

            assert c.delete(f"/openrl/v1/jobs/{out['job_id']}").status_code == 200
            assert names["job"] not in api.objects("jobs")
            assert api.calls()[-1] == ("batch", "jobs", "delete", {"propagationPolicy": "Background"})
            assert worker.get(f"/openrl/v1/jobs/{out['job_id']}").status_code == 401
