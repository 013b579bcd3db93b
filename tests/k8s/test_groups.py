"""Several GPUs per base model: the one-node overlay (one pod, `serve --world-size 8` on an
a3-highgpu-8g) and the LeaderWorkerSet group across two such nodes. What an admin would notice:
a group whose flags disagree with its GPUs or with each other never forms; a Service that reaches a
worker answers nothing; a closed rendezvous port hangs the group; a group without all its GPUs waits
in Kueue forever."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.k8s._k8s import (
    K8S,
    LWS_WORKER_INDEX_LABEL,
    SERVICE_NAMESPACE,
    env_of,
    flag,
    of_kind,
    overlay,
    pod_templates,
)
from tests.k8s.netpol import Cluster, Pod, allowed, selects

ONE_NODE = "gke-gpu-a3-8xh100"
GROUP = "gke-gpu-lws-2x8xh100"
# Group flags every node of a group must pass alike (only --node-rank differs)
GROUP_FLAGS = ("--world-size", "--nnodes", "--devices", "--master-addr", "--master-port", "--vllm-tp")
NCCL_PORT = 40000  # a port from Linux's ephemeral range, where NCCL's sockets bind
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(q: str) -> float:
    """A Kubernetes resource quantity ("64Gi", "160", "500m") as a number."""
    m = re.fullmatch(r"([0-9.]+)(m|[KMGT]i|[kMGT])?", str(q))
    assert m, f"not a quantity: {q}"
    number, unit = float(m.group(1)), m.group(2)
    return number / 1000 if unit == "m" else number * UNITS.get(unit, 1)


def gpus(pod) -> int:
    res = pod.container()["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"], pod.name
    return int(res["limits"]["nvidia.com/gpu"])


def group() -> tuple[dict, object, object]:
    """The LeaderWorkerSet and its leader and worker pod templates."""
    objs = overlay(GROUP)
    (lws,) = of_kind(objs, "LeaderWorkerSet")
    leader, worker = pod_templates([lws])
    assert (leader.role, worker.role) == ("leader", "worker")
    return lws, leader, worker


def expand(args: list[str], variables: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of container args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables.get(m[1], m[0]), a) for a in args]


# --- one node, eight GPUs ------------------------------------------------------------------------


def test_one_node_pod_runs_one_rank_per_gpu():
    (pod,) = pod_templates(overlay(ONE_NODE))
    args = pod.container()["args"]
    assert gpus(pod) == 8
    assert int(flag(args, "--world-size")) == 8
    devices = flag(args, "--devices").split(",")
    assert devices == [f"cuda:{i}" for i in range(8)], "one rank per GPU the pod was given"
    # one node: no rendezvous across nodes to configure
    assert "--nnodes" not in args and "--master-addr" not in args
    assert pod.spec["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"


@pytest.mark.parametrize("name", [ONE_NODE, GROUP])
def test_eight_gpu_pods_have_shared_memory_for_nccl(name):
    for pod in pod_templates(overlay(name)):
        c = pod.container()
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        shm = volumes[mount["name"]]["emptyDir"]
        assert shm["medium"] == "Memory"
        # the runtime's 64 MB default stops NCCL; 1 GiB per rank is ample. It counts against the limit.
        assert quantity(shm["sizeLimit"]) >= gpus(pod) * 2**30, pod.name
        assert quantity(shm["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"]) / 4


# --- the LeaderWorkerSet group -------------------------------------------------------------------


def test_group_replaces_the_single_pod_deployment():
    objs = overlay(GROUP)
    assert not of_kind(objs, "Deployment"), "the base's Deployment would run a second service on the data dir"
    (lws,) = of_kind(objs, "LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 1, "one group owns a data dir"
    assert lws["metadata"]["namespace"] == SERVICE_NAMESPACE


def test_world_size_is_group_size_times_gpus_per_pod():
    lws, leader, worker = group()
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert size == 2
    assert gpus(leader) == gpus(worker) == 8
    for pod in (leader, worker):
        args = pod.container()["args"]
        assert int(flag(args, "--world-size")) == size * gpus(pod), pod.name
        assert int(flag(args, "--nnodes")) == size, pod.name
        assert len(flag(args, "--devices").split(",")) == gpus(pod), f"{pod.name}: one rank per GPU"
    # the nodes agree on the group's shape; a disagreement fails the rendezvous, or worse
    for f in GROUP_FLAGS:
        assert flag(leader.container()["args"], f) == flag(worker.container()["args"], f), f


def test_node_ranks_and_master_address_come_from_lws():
    lws, leader, worker = group()
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    leader_args, worker_args = leader.container()["args"], worker.container()["args"]
    assert flag(leader_args, "--node-rank") == "0"
    assert flag(worker_args, "--node-rank") == "$(LWS_WORKER_INDEX)"
    for args in (leader_args, worker_args):
        assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert 1024 <= int(flag(args, "--master-port")) <= 65535
    # as the kubelet expands them on each worker LWS creates (worker indices 1 .. size-1)
    address = f"{lws['metadata']['name']}-0.{lws['metadata']['name']}.{SERVICE_NAMESPACE}"
    ranks = [0]
    for index in range(1, size):
        args = expand(worker_args, {"LWS_WORKER_INDEX": str(index), "LWS_LEADER_ADDRESS": address})
        ranks.append(int(flag(args, "--node-rank")))
        assert flag(args, "--master-addr") == address
    assert ranks == list(range(size)), "every node rank exactly once"


def test_group_restarts_as_a_whole_and_starts_with_the_leader():
    lws, leader, _ = group()
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # the leader is ready only once the group has met (/readyz), so workers must not wait for that
    assert spec["startupPolicy"] == "LeaderCreated"
    assert leader.container()["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_workers_find_the_leader_through_the_headless_service_lws_creates():
    lws, _, worker = group()
    assert lws["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"
    # LWS creates the headless Service under the set's name only if no Service has that name: the
    # HTTP Service must not take it, or $(LWS_LEADER_ADDRESS) would not resolve
    services = {s["metadata"]["name"] for s in of_kind(overlay(GROUP), "Service")}
    assert lws["metadata"]["name"] not in services
    assert "LWS_LEADER_ADDRESS" not in env_of(worker.container()), "LWS's own value must not be shadowed"


def test_http_service_selects_only_the_leader():
    _, leader, worker = group()
    (svc,) = [s for s in of_kind(overlay(GROUP), "Service") if s["metadata"]["name"] == "openrl-service"]
    selector = {"matchLabels": svc["spec"]["selector"]}
    assert svc["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"
    assert selects(selector, leader.labels)
    assert not selects(selector, worker.labels), "requests would reach a node that serves no HTTP"
    assert not worker.container().get("ports")
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= {p["name"] for p in leader.container()["ports"]}


def test_group_pods_reach_each_other_on_the_rendezvous_and_nccl_ports_only():
    objs = overlay(GROUP)
    _, leader, worker = group()
    port = int(flag(leader.container()["args"], "--master-port"))
    pods = {
        "leader": Pod("leader", SERVICE_NAMESPACE, leader.labels, "10.8.3.2"),
        "worker": Pod("worker", SERVICE_NAMESPACE, worker.labels, "10.8.3.3"),
        "neighbour": Pod("debug", SERVICE_NAMESPACE, {"run": "debug"}, "10.8.2.9"),
    }
    cluster = Cluster({SERVICE_NAMESPACE: {}}, list(pods.values()), of_kind(objs, "NetworkPolicy"))
    assert allowed(cluster, pods["worker"], pods["leader"], port), "the worker cannot reach the rendezvous"
    for a, b in (("worker", "leader"), ("leader", "worker")):
        assert allowed(cluster, pods[a], pods[b], NCCL_PORT), f"NCCL {a} -> {b}"
        assert not allowed(cluster, pods[a], pods[b], 8000)
        assert not allowed(cluster, pods[a], pods[b], 22)
    assert not allowed(cluster, pods["neighbour"], pods["leader"], port)
    assert not allowed(cluster, pods["neighbour"], pods["worker"], NCCL_PORT)


def data_volume(pod) -> dict:
    """The volume mounted at the pod's --data-dir."""
    c = pod.container()
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == flag(c["args"], "--data-dir")]
    assert not mount.get("readOnly"), f"{pod.name}: the data dir must be writable"
    (volume,) = [v for v in pod.spec["volumes"] if v["name"] == mount["name"]]
    return volume


def test_leader_owns_the_data_volume_and_the_worker_has_scratch():
    """Rank 0, on the leader, alone reads and writes the journal, checkpoints and run files (the
    leader's supervisor holds the lock) and sends the other ranks what they need: the leader mounts
    the data PVC, one pod on one node (ReadWriteOnce is enough), and the worker's data dir, at the same
    path, is a bounded emptyDir for its small caches."""
    objs = overlay(GROUP)
    _, leader, worker = group()
    claims = {p["metadata"]["name"]: p for p in of_kind(objs, "PersistentVolumeClaim")}
    assert flag(leader.container()["args"], "--data-dir") == flag(worker.container()["args"], "--data-dir")

    claim = claims[data_volume(leader)["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"], "one pod writes it: no Filestore needed"

    scratch = data_volume(worker)
    assert set(scratch) == {"name", "emptyDir"}, f"the worker's data dir is {scratch}"
    assert scratch["emptyDir"].get("medium") != "Memory", "caches on disk, not in the memory limit"
    assert quantity(scratch["emptyDir"]["sizeLimit"]) > 0, (
        "bounded: a runaway cache evicts the pod, not the node"
    )
    assert not [v for v in worker.spec["volumes"] if "persistentVolumeClaim" in v], (
        "the worker mounts no claim: a second node cannot attach the leader's ReadWriteOnce volume"
    )
    # the worker's disk-backed emptyDirs fit its ephemeral-storage limit, or the kubelet evicts the
    # pod (and LWS recreates the group) before any of them reaches its own sizeLimit
    disk = sum(
        quantity(v["emptyDir"]["sizeLimit"])
        for v in worker.spec["volumes"]
        if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"
    )
    assert disk < quantity(worker.container()["resources"]["limits"]["ephemeral-storage"])


def test_group_waits_in_its_kueue_queue_for_all_its_gpus():
    lws, leader, worker = group()
    queue = lws["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    docs = list(yaml.safe_load_all((K8S / "jobs" / "kueue-gpu-queue.yaml").read_text()))
    (local,) = [d for d in docs if d["kind"] == "LocalQueue"]
    assert local["metadata"] == {"name": queue, "namespace": SERVICE_NAMESPACE}
    (cq,) = [
        d
        for d in docs
        if d["kind"] == "ClusterQueue" and d["metadata"]["name"] == local["spec"]["clusterQueue"]
    ]
    assert cq["spec"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == SERVICE_NAMESPACE
    # Kueue admits the group only if its ClusterQueue covers every resource its pods request, with
    # quota for the whole group (one leader, size - 1 workers) at once
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    need: dict[str, float] = {}
    for pod, count in ((leader, 1), (worker, size - 1)):
        for c in pod.spec["containers"]:
            for res, q in c["resources"]["requests"].items():
                need[res] = need.get(res, 0) + count * quantity(q)
    (group_,) = cq["spec"]["resourceGroups"]
    assert set(need) <= set(group_["coveredResources"]), (
        f"not covered: {set(need) - set(group_['coveredResources'])}"
    )
    quota = {r["name"]: quantity(r["nominalQuota"]) for f in group_["flavors"] for r in f["resources"]}
    for res, amount in need.items():
        assert quota[res] >= amount, f"{res}: the group needs {amount:g}, the queue holds {quota[res]:g}"
    assert need["nvidia.com/gpu"] == 16
