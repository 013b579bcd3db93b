"""Run the built images as the cluster would: a rendered Deployment's container spec as podman (or
docker) flags, the volumes and Secret as kubelet would lay them out, and small helpers around them."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.k8s._k8s import ROOT, containers, of_kind, overlay

_spec = importlib.util.spec_from_file_location("openrl_images", ROOT / "k8s" / "images" / "images.py")
images = importlib.util.module_from_spec(_spec)
sys.modules["openrl_images"] = images  # dataclasses look their module up
_spec.loader.exec_module(images)

CHECK = os.environ.get("OPENRL_IMAGE_CHECK", "") not in ("", "0")  # make image-check: absent images fail


def engine_or_skip() -> str:
    try:
        return images.engine()
    except SystemExit as e:
        if CHECK:
            raise
        pytest.skip(f"no container engine here ({e}); make image-check installs podman and runs these")


def image_or_skip(eng: str, name: str) -> str:
    tag = images.tag_of(name)
    if images.image_id(eng, tag) is None:
        msg = f"{tag} is not built: make images (make image-check builds it and runs these)"
        if CHECK:
            pytest.fail(msg)
        pytest.skip(msg)
    return tag


def sh(*cmd: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def deployment(name: str = "cpu") -> dict:
    (dep,) = [d for d in of_kind(overlay(name), "Deployment") if d["metadata"]["name"] == "openrl-service"]
    return dep


# What the translation below handles; a field outside these sets fails it rather than being ignored.
CONTAINER_KEYS = {
    "name", "image", "imagePullPolicy", "args", "env", "ports", "resources", "securityContext",
    "volumeMounts", "livenessProbe", "readinessProbe", "startupProbe",
}  # fmt: skip
CONTAINER_SECURITY = {"allowPrivilegeEscalation", "capabilities", "readOnlyRootFilesystem", "runAsNonRoot"}
POD_SECURITY = {"fsGroup", "fsGroupChangePolicy", "runAsGroup", "runAsNonRoot", "runAsUser", "seccompProfile"}
MOUNT_KEYS = {"name", "mountPath", "readOnly"}


def quantity(q: str) -> int:
    """A Kubernetes quantity in bytes (binary Ki/Mi/Gi, decimal k/M/G, or plain)."""
    units = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }
    for suffix in sorted(units, key=len, reverse=True):
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * units[suffix])
    return int(q)


def cpus(q: str) -> str:
    return str(int(q[:-1]) / 1000) if q.endswith("m") else q


def pod_run_args(dep: dict, host: Path, keys: str, eng: str = "podman") -> tuple[list[str], dict]:
    """`run` flags for the Deployment's openrl-service container, as rendered: user and groups, read-only
    root (podman's writable /run and /var/tmp tmpfs turned off), dropped capabilities, no privilege
    escalation, the default seccomp profile (podman's and docker's own, as RuntimeDefault), env values,
    args, the memory (no swap, as on the nodes) and CPU limits; its volumes under `host` laid out as
    kubelet does (a PVC and a Secret owned by the pod's fsGroup; the emptyDir as a tmpfs of its size
    limit, which counts against the memory limit here where the node's disk would hold it). Fields it
    does not know fail it. Returns (flags before the image, {"args", "grace", "port", "memory"})."""
    pod = dep["spec"]["template"]["spec"]
    (c,) = [c for c in containers(dep) if c["name"] == "openrl-service"]
    assert set(c) <= CONTAINER_KEYS, f"container fields with no local equivalent: {set(c) - CONTAINER_KEYS}"
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    assert set(psc) <= POD_SECURITY and set(csc) <= CONTAINER_SECURITY, (psc, csc)
    assert set(csc.get("capabilities", {})) <= {"drop"}, csc
    uid, gid = psc["runAsUser"], psc.get("runAsGroup", psc["runAsUser"])
    fs_group = psc.get("fsGroup")
    flags = ["--user", f"{uid}:{gid}"]
    if fs_group is not None:
        flags += ["--group-add", str(fs_group)]
    if csc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
        if eng == "podman":
            flags.append("--read-only-tmpfs=false")
    for cap in csc.get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", cap]
    if csc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", psc
    for e in c.get("env", []):
        if "value" in e:
            assert "$(" not in e["value"], e  # kubelet would expand it
            flags += ["--env", f"{e['name']}={e['value']}"]
        else:  # a Secret that may be absent (the hub token): absent here, as without a hub
            assert e["valueFrom"]["secretKeyRef"].get("optional"), e
    assert not any("$(" in a for a in c["args"]), c["args"]
    limits = c.get("resources", {}).get("limits", {})
    memory = quantity(limits["memory"]) if "memory" in limits else None
    if memory:
        flags += ["--memory", str(memory), "--memory-swap", str(memory)]
    if "cpu" in limits:
        flags += ["--cpus", cpus(limits["cpu"])]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in c["volumeMounts"]:
        assert set(m) <= MOUNT_KEYS, m
        v = volumes[m["name"]]
        if "emptyDir" in v:
            assert set(v["emptyDir"]) <= {"sizeLimit"} and "sizeLimit" in v["emptyDir"], v
            flags += ["--tmpfs", f"{m['mountPath']}:rw,size={quantity(v['emptyDir']['sizeLimit'])},mode=1777"]
        elif "persistentVolumeClaim" in v:
            # kubelet gives the volume to the fsGroup: group-owned, group-writable, setgid
            d = host / v["persistentVolumeClaim"]["claimName"]
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, 0, fs_group)
            d.chmod(0o2770)
            flags += ["--volume", f"{d}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")]
        elif "secret" in v:
            # a Secret volume: root-owned files of defaultMode, group fsGroup, mounted read-only
            assert set(v["secret"]) <= {"secretName", "defaultMode"}, v  # no items: one file per key
            d = host / v["secret"]["secretName"]
            d.mkdir(parents=True, exist_ok=True)
            (d / "api-keys").write_text(keys)
            os.chown(d / "api-keys", 0, fs_group)
            (d / "api-keys").chmod(v["secret"].get("defaultMode", 0o644))
            flags += ["--volume", f"{d}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")]
        else:
            raise AssertionError(f"volume {m['name']}: no local equivalent for {v}")
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "http"]
    spec = {"args": c["args"], "grace": pod["terminationGracePeriodSeconds"], "port": port, "memory": memory}
    return flags, spec


def wait_http(url: str, timeout: float, ok=lambda r: r.status_code == 200, container: tuple | None = None):
    """GET url until ok(response); on timeout, fail with the container's log."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=5)
            if ok(r):
                return r
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        if container:
            eng, name = container
            state = sh(eng, "inspect", "--format", "{{.State.Running}}", name, check=False).stdout.strip()
            if state == "false":
                logs = sh(eng, "logs", name, check=False)
                raise AssertionError(
                    f"{name} exited before {url} answered:\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}"
                )
        time.sleep(1)
    logs = sh(container[0], "logs", container[1], check=False) if container else None
    raise AssertionError(
        f"{url} not ready in {timeout} s (last: {last})"
        + (f"\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}" if logs else "")
    )


@contextlib.contextmanager
def network(eng: str):
    name = f"openrl-check-{uuid.uuid4().hex[:8]}"
    sh(eng, "network", "create", name)
    try:
        yield name
    finally:
        sh(eng, "network", "rm", "-f", name, check=False)


def remove(eng: str, *names: str) -> None:
    for n in names:
        sh(eng, "rm", "-f", *(["-t", "0"] if eng == "podman" else []), n, check=False)
