"""Reachability: the rendered NetworkPolicies of each overlay plus the zero-to-jupyterhub chart's own
hub and singleuser policies (modelled from its 4.4.0 templates with k8s/jupyterhub/values.yaml merged
over the chart's defaults) allow exactly

    hub user pod  -> OpenRL service :8000
    OpenRL service -> hub API :8081 (and DNS)
    GKE managed Prometheus collector -> OpenRL service :8000 (/metrics)

and nothing else reaches the service or leaves it. Schema checks cannot see any of this: one wrong
label or namespace and `%openrl connect` times out in the notebook."""

from __future__ import annotations

import copy

import pytest

from tests.k8s._k8s import (
    HUB_NAMESPACE,
    HUB_RELEASE,
    OVERLAYS,
    SERVICE_NAMESPACE,
    merged_values,
    of_kind,
    overlay,
    own_values,
    pod_templates,
)
from tests.k8s.netpol import Cluster, External, Pod, allowed, chart_policies, match_labels, user_pod_labels

INTERNET = External("internet", "1.1.1.1")
GOOGLE_API = External("storage.googleapis.com", "142.250.74.27")
METADATA = External("metadata server", "169.254.169.254")
GCSFUSE_OVERLAYS = [
    o
    for o in OVERLAYS
    if o
    in ("gke-gpu-l4", "gke-gpu-h100", "gke-spot", "two-model", "gke-gpu-a3-8xh100", "gke-gpu-lws-2x8xh100")
]


def build(objs: list[dict], values: dict) -> tuple[Cluster, dict[str, Pod], list[Pod]]:
    """A cluster with the hub release, its user pods, the monitoring collector, kube-dns, strangers,
    and one pod per rendered OpenRL pod template (a Deployment's; a LeaderWorkerSet's leader and
    worker, with the labels its controller adds)."""
    pods = {
        "hub": Pod("hub", HUB_NAMESPACE, {**match_labels("hub", HUB_RELEASE)}, "10.8.0.2", {"http": 8081}),
        "proxy": Pod(
            "proxy",
            HUB_NAMESPACE,
            match_labels("proxy", HUB_RELEASE),
            "10.8.0.3",
            {"http": 8000, "api": 8001},
        ),
        "user": Pod(
            "jupyter-alice",
            HUB_NAMESPACE,
            user_pod_labels(values, HUB_RELEASE),
            "10.8.0.4",
            {"notebook-port": 8888},
        ),
        "collector": Pod(
            "collector-x",
            "gmp-system",
            {"app": "managed-prometheus-collector", "app.kubernetes.io/name": "collector"},
            "10.8.0.5",
            {"prom-metrics": 19090},
        ),
        "dns": Pod("kube-dns-1", "kube-system", {"k8s-app": "kube-dns"}, "10.8.0.6", {"dns": 53}),
        # another team's pod that copies a user pod's labels: the namespace must still keep it out
        "impostor": Pod("impostor", "team-b", user_pod_labels(values, HUB_RELEASE), "10.8.1.2", {}),
        "other": Pod("web", "default", {"app": "web"}, "10.8.1.3", {"http": 8080}),
        # a pod in the service's own namespace that is not the service (a debug shell)
        "neighbour": Pod("debug", SERVICE_NAMESPACE, {"run": "debug"}, "10.8.2.9", {}),
    }
    services = []
    for i, tmpl in enumerate(pod_templates(objs)):
        ports = {p["name"]: p["containerPort"] for c in tmpl.spec["containers"] for p in c.get("ports", [])}
        services.append(Pod(tmpl.name, SERVICE_NAMESPACE, tmpl.labels, f"10.8.3.{i + 2}", ports))
    policies = of_kind(objs, "NetworkPolicy") + chart_policies(values, HUB_RELEASE, HUB_NAMESPACE)
    namespaces = {
        HUB_NAMESPACE: {},
        SERVICE_NAMESPACE: {},
        "gmp-system": {},
        "kube-system": {},
        "team-b": {},
        "default": {},
    }
    return Cluster(namespaces, [*pods.values(), *services], policies), pods, services


@pytest.fixture(params=OVERLAYS)
def world(request):
    objs = overlay(request.param)
    return (request.param, *build(objs, merged_values()))


def test_the_three_intended_paths_are_open(world):
    name, cluster, pods, services = world
    assert services
    for svc in services:
        assert allowed(cluster, svc, pods["dns"], 53, "UDP"), f"{name}: {svc.name} has no DNS"
        if "http" not in svc.ports:
            # a group's worker node serves nobody and asks the hub nothing
            assert not allowed(cluster, svc, pods["hub"], 8081), f"{name}: {svc.name} reaches the hub"
            continue
        assert allowed(cluster, pods["user"], svc, 8000), f"{name}: user pod cannot reach {svc.name}:8000"
        assert allowed(cluster, svc, pods["hub"], 8081), f"{name}: {svc.name} cannot reach the hub API"
        assert allowed(cluster, pods["collector"], svc, 8000), f"{name}: Prometheus cannot scrape {svc.name}"


def test_nothing_else_reaches_the_service(world):
    name, cluster, pods, services = world
    for svc in services:
        for who in ("impostor", "other", "neighbour", "hub", "proxy", "dns"):
            assert not allowed(cluster, pods[who], svc, 8000), f"{name}: {who} reaches {svc.name}"
        assert not allowed(cluster, INTERNET, svc, 8000)
        # the right source, the wrong port
        for port in (22, 8001, 8080, 9090):
            assert not allowed(cluster, pods["user"], svc, port), (
                f"{name}: user pod reaches {svc.name}:{port}"
            )
            assert not allowed(cluster, pods["collector"], svc, port)
        # the service pods do not talk to each other (two-model) or to anything else in the cluster
        for other in services:
            if other is not svc:
                assert not allowed(cluster, svc, other, 8000)


def test_the_service_reaches_only_the_hub_and_dns(world):
    name, cluster, pods, services = world
    for svc in services:
        assert not allowed(cluster, svc, pods["hub"], 8000)
        assert not allowed(cluster, svc, pods["proxy"], 8001), "the proxy's API must stay closed"
        assert not allowed(cluster, svc, pods["user"], 8888), "the service never calls into notebooks"
        assert not allowed(cluster, svc, pods["other"], 8080)
        assert not allowed(cluster, svc, INTERNET, 80)
        assert not allowed(cluster, svc, METADATA, 8080)
        fuse = svc.labels.get("openrl-jupyter/model-volume") == "gcsfuse"
        # HTTPS to the internet only where the GCS FUSE sidecar needs Cloud Storage
        assert allowed(cluster, svc, GOOGLE_API, 443) == fuse, f"{name}: {svc.name} egress to :443"
        assert allowed(cluster, svc, INTERNET, 443) == fuse


@pytest.mark.parametrize("name", GCSFUSE_OVERLAYS)
def test_gcsfuse_sidecar_gets_its_workload_identity_token(name):
    cluster, _, services = build(overlay(name), merged_values())
    for svc in services:
        assert allowed(cluster, svc, METADATA, 80)
        assert allowed(cluster, svc, External("gke-metadata-server", "169.254.169.252"), 988)


def test_chart_keeps_user_pods_off_other_private_addresses():
    values = merged_values()
    egress = values["singleuser"]["networkPolicy"]["egressAllowRules"]
    assert egress["privateIPs"] is False and egress["cloudMetadataServer"] is False
    cluster, pods, _ = build(overlay("cpu"), values)
    assert not allowed(cluster, pods["user"], pods["other"], 8080)
    assert not allowed(cluster, pods["user"], pods["neighbour"], 8000)
    assert not allowed(cluster, pods["user"], METADATA, 80)
    assert allowed(cluster, pods["user"], INTERNET, 443), "users keep pip install"
    assert allowed(cluster, pods["user"], pods["hub"], 8081), "a user server must reach its hub"


def test_without_our_singleuser_egress_rule_users_cannot_connect():
    """The chart's default blocks user pods' egress to private addresses: the service is a pod IP
    behind a ClusterIP, so the values' egress rule is what makes `%openrl connect` work."""
    own = own_values()
    own["singleuser"]["networkPolicy"].pop("egress")
    cluster, pods, services = build(overlay("cpu"), merged_values(own))
    assert not allowed(cluster, pods["user"], services[0], 8000)


def test_without_inter_namespace_access_the_hub_refuses_the_service():
    """The hub policy admits labelled pods from other namespaces only with "accept"."""
    own = own_values()
    own["hub"]["networkPolicy"]["interNamespaceAccessLabels"] = "ignore"
    cluster, pods, services = build(overlay("cpu"), merged_values(own))
    assert not allowed(cluster, services[0], pods["hub"], 8081)


def test_without_the_hub_access_label_the_hub_refuses_the_service():
    objs = overlay("cpu")
    for dep in of_kind(objs, "Deployment"):
        del dep["spec"]["template"]["metadata"]["labels"]["hub.jupyter.org/network-access-hub"]
    cluster, pods, services = build(objs, merged_values())
    assert not allowed(cluster, services[0], pods["hub"], 8081)


def test_evaluator_default_deny_and_additivity():
    """The evaluator itself: an unselected pod is open, a selected one is closed except for its
    rules, and a second policy adds to the first."""
    a = Pod("a", "ns", {"app": "a"}, "10.0.0.1", {"http": 80})
    b = Pod("b", "ns", {"app": "b"}, "10.0.0.2", {"http": 80})
    deny_b = {
        "metadata": {"name": "deny", "namespace": "ns"},
        "spec": {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]},
    }
    allow_a = {
        "metadata": {"name": "allow", "namespace": "ns"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "b"}},
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": "http"}]}
            ],
        },
    }
    open_cluster = Cluster({"ns": {}}, [a, b], [])
    assert allowed(open_cluster, a, b, 80) and allowed(open_cluster, b, a, 443)
    closed = Cluster({"ns": {}}, [a, b], [deny_b])
    assert not allowed(closed, a, b, 80) and allowed(closed, b, a, 80)
    both = Cluster({"ns": {}}, [a, b], [deny_b, copy.deepcopy(allow_a)])
    assert allowed(both, a, b, 80) and not allowed(both, a, b, 81)
    assert not allowed(both, External("x", "10.0.0.9"), b, 80)
