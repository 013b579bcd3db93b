"""The Dockerfiles in k8s/images, checked statically (tests/images builds and runs them: make
image-check): a Debian base by build argument, a context that is only the image's wheelhouse,
offline installs that match the pyproject extras, the chart's JupyterHub in the notebook image, an
entrypoint that is a real command of the package, a non-root user, no key; and the images workflow
builds each of them under the names the manifests use, recording the base's digest."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.images._containers import images
from tests.k8s._k8s import K8S, OVERLAYS, ROOT, containers, overlay, own_values, pod_templates

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

IMAGES = K8S / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
SCRIPTS = set(PYPROJECT["project"]["scripts"])
WORKFLOW = ROOT / ".github" / "workflows" / "images.yml"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, rest = buf.partition(" ")
        out.append((op.upper(), rest.strip()))
        buf = ""
    return out


def args_of(path: Path, op: str) -> list[str]:
    return [rest for o, rest in instructions(path) if o == op]


def test_there_are_service_cpu_cuda_and_notebook_images():
    assert {p.name for p in DOCKERFILES} >= {
        "service-cpu.Dockerfile",
        "service-cuda.Dockerfile",
        "notebook.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_base_is_debian_bookworm_slim_by_default(path):
    """FROM ${BASE}, ARG BASE=debian:bookworm-slim: the registry's image in a user's CI (the workflow
    records its digest), Debian's own packages here (images.py's stand-in, passed as BASE)."""
    (frm,) = args_of(path, "FROM")
    assert frm.split()[0] in ("${BASE}", "$BASE"), f"{path.name}: FROM {frm}"
    before = instructions(path)[: [op for op, _ in instructions(path)].index("FROM")]
    assert ("ARG", f"BASE={images.BASE}") in before, f"{path.name}: no ARG BASE={images.BASE} before FROM"
    assert images.BASE == "debian:bookworm-slim"


def ignore_patterns(path: Path) -> list[str]:
    ignore = Path(str(path) + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} missing: the whole repo (venvs, build/) would be the context"
    return [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_context_is_only_the_images_wheelhouse(path):
    """Nothing of the checkout is copied: the install step bind-mounts build/images/NAME (the wheelhouse
    images.py fills), which is all its .dockerignore lets through."""
    name = path.name.removesuffix(".Dockerfile")
    assert not args_of(path, "COPY") and not args_of(path, "ADD"), f"{path.name} copies from the context"
    assert ignore_patterns(path) == ["*", f"!build/images/{name}/"]
    mounts = re.findall(r"--mount=type=bind,source=(\S+?),target=(\S+)", " ".join(args_of(path, "RUN")))
    assert mounts == [(f"build/images/{name}", "/build")], mounts
    assert images.SPECS[name].context == ROOT / "build" / "images" / name


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_installs_are_offline_from_the_wheelhouse_and_match_the_pyproject_extras(path):
    name = path.name.removesuffix(".Dockerfile")
    installs = pip_installs(path)
    assert installs == [["--no-index", "--find-links", "/build/wheels", "-r", "/build/requirements.txt"]], (
        installs
    )
    known = requirement_names()
    spec = images.SPECS[name]
    assert any(r.startswith(".") for r in spec.requirements), f"{name} does not install the project"
    for req in spec.requirements:
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", req)
        if m:
            extras = set(filter(None, (m.group(1) or "").split(",")))
            assert extras <= EXTRAS, f"{name}: extras {extras - EXTRAS} not in pyproject"
            continue
        dist = re.split(r"[<>=!~\[]", req, maxsplit=1)[0].lower()
        assert dist in known, f"{name}: installs {req}, which pyproject/constraints do not name"
    # the service images never get the notebook's Jupyter; the notebook image never gets torch
    if name.startswith("service-"):
        assert any("service" in r for r in spec.requirements)
    else:
        assert not any("service" in r or "vllm" in r for r in spec.requirements)


def test_the_notebook_image_carries_the_charts_jupyterhub():
    """jupyterhub-singleuser talks to the chart's hub: the same JupyterHub as the hub image of the chart
    version values.yaml pins."""
    header = (K8S / "jupyterhub" / "values.yaml").read_text().split("\n\n", 1)[0]
    m = re.search(r"JupyterHub (\d+\.\d+\.\d+) in the\s*(?:#\s*)?hub image", header)
    assert m, header
    assert f"jupyterhub=={m.group(1)}" == images.JUPYTERHUB
    assert images.JUPYTERHUB in images.SPECS["notebook"].requirements


def pip_installs(path: Path) -> list[list[str]]:
    out = []
    for rest in args_of(path, "RUN"):
        for cmd in rest.split("&&"):
            words = shlex.split(cmd)
            if "pip" in words and "install" in words:
                out.append(words[words.index("install") + 1 :])
    return out


def requirement_names() -> set[str]:
    reqs = list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        reqs += extra
    reqs += [
        ln for ln in (ROOT / "constraints-cpu.txt").read_text().splitlines() if ln and not ln.startswith("#")
    ]
    return {re.split(r"[<>=!~\[; ]", r.strip(), maxsplit=1)[0].lower() for r in reqs}


@pytest.fixture(scope="module")
def subcommands() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "openrl_service.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    (choices,) = re.findall(r"\{([a-z,-]+)\}", out.stdout)[:1]
    return set(choices.split(","))


@pytest.mark.parametrize(
    "path", [p for p in DOCKERFILES if p.name.startswith("service-")], ids=lambda p: p.name
)
def test_service_entrypoint_is_a_real_command(path, subcommands):
    (entry,) = args_of(path, "ENTRYPOINT")
    (cmd,) = args_of(path, "CMD")
    entry, cmd = json.loads(entry), json.loads(cmd)  # exec form: signals reach the process (the drain)
    assert entry[0] in SCRIPTS, f"{entry[0]} is not in [project.scripts]"
    assert cmd[0] in subcommands, f"{cmd[0]} is not a subcommand of {entry[0]}"
    assert "serve" in subcommands


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_non_root_user_without_a_key(path):
    users = args_of(path, "USER")
    assert users, f"{path.name} has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and (user.isdigit() or re.fullmatch(r"[a-z_][a-z0-9_-]*", user)), user
    text = path.read_text()
    assert "tml-" not in text
    for rest in args_of(path, "ENV") + args_of(path, "ARG"):
        assert not re.search(r"(?i)(KEY|TOKEN|SECRET|PASSWORD)\w*=", rest), f"{path.name}: {rest}"


def test_service_image_user_matches_the_pod_security_context():
    for path in IMAGES.glob("service-*.Dockerfile"):
        uid = args_of(path, "USER")[-1].split(":")[0]
        for name in OVERLAYS:
            for dep in pod_templates(overlay(name)):
                assert str(dep.spec["securityContext"]["runAsUser"]) == uid


def test_workflow_builds_every_image_under_the_names_the_cluster_pulls():
    wf = yaml.safe_load(WORKFLOW.read_text())
    (job,) = wf["jobs"].values()
    matrix = {e["dockerfile"]: e["image"] for e in job["strategy"]["matrix"]["include"]}
    assert set(matrix) == {str(p.relative_to(ROOT)) for p in DOCKERFILES}
    pulled = set()
    for name in OVERLAYS:
        for dep in pod_templates(overlay(name)):
            pulled |= {c["image"] for c in containers(dep)}
    image = own_values()["singleuser"]["image"]
    pulled.add(f"{image['name']}:{image['tag']}")
    pulled_names = {p.rsplit(":", 1)[0].rsplit("/", 1)[1] for p in pulled}
    assert pulled_names <= set(matrix.values()), (
        f"pulled but never built: {pulled_names - set(matrix.values())}"
    )
    assert "k8s/images/service-cuda.Dockerfile" in matrix and matrix[
        "k8s/images/service-cuda.Dockerfile"
    ].endswith("-cuda")
    steps = json.dumps(job["steps"])
    assert "docker/build-push-action" in steps and "${{ matrix.dockerfile }}" in steps
    assert "steps.version.outputs.version" in steps, "the tag must be the package version the manifests pin"
    # each image's wheelhouse first, then the build on the base's digest, recorded
    for e in job["strategy"]["matrix"]["include"]:
        assert e["dockerfile"] == f"k8s/images/{e['name']}.Dockerfile", e
    assert "k8s/images/images.py wheels ${{ matrix.name }}" in steps
    assert "BASE=${{ steps.base.outputs.ref }}" in steps and "GITHUB_STEP_SUMMARY" in steps
    assert "org.opencontainers.image.base.digest=${{ steps.base.outputs.digest }}" in steps
