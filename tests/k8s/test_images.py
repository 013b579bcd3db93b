"""The Dockerfiles in k8s/images, checked statically (no container runtime here can pull a base):
pinned bases, COPY sources that exist, installs that match the pyproject extras, an entrypoint
that is a real command of the package, a non-root user, no key; and the images workflow builds
each of them under the names the manifests use."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.k8s._k8s import K8S, OVERLAYS, ROOT, containers, of_kind, overlay, own_values

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
def test_base_images_are_pinned(path):
    stages = set()
    for rest in args_of(path, "FROM"):
        words = rest.split()
        words = [w for w in words if not w.startswith("--")]
        image = words[0]
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2])
        if image in stages or image == "scratch":
            continue
        assert "$" not in image, f"{path.name}: FROM {image} resolves at build time, pin it"
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{path.name}: {image} has no tag"
        assert tag != "latest", f"{path.name}: {image}"
        assert re.search(r"\d", tag), f"{path.name}: {image}: a moving tag, not a version"


def copy_sources(path: Path) -> list[str]:
    sources = []
    for rest in args_of(path, "COPY") + args_of(path, "ADD"):
        words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue  # from another stage, not the build context
        words = [w for w in words if not w.startswith("--")]
        sources.extend(words[:-1])
    return sources


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_are_not_ignored(path):
    sources = copy_sources(path)
    assert sources, f"{path.name} copies nothing of the project"
    ignore = Path(str(path) + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} missing: the whole repo (venvs, build/) would be the context"
    patterns = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for src in sources:
        assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such file in the repo"
        # .dockerignore: the last matching pattern wins; "!" re-includes
        included = True
        for pat in patterns:
            neg = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(src.rstrip("/"), pat):
                included = neg
        assert included, f"{path.name}: COPY {src} is excluded by {ignore.name}"


def pip_installs(path: Path) -> list[list[str]]:
    out = []
    for rest in args_of(path, "RUN"):
        for cmd in re.split(r"&&|;", rest):
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


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_installs_match_the_pyproject_extras(path):
    installs = pip_installs(path)
    assert installs, f"{path.name} installs nothing"
    project_installed = False
    known = requirement_names()
    for words in installs:
        takes_value = False
        for w in words:
            if takes_value or w.startswith("-"):
                # an option, or the value of the previous one (a constraints file, an index URL)
                takes_value = w in (
                    "-c",
                    "--constraint",
                    "-r",
                    "--requirement",
                    "-i",
                    "--index-url",
                    "--extra-index-url",
                )
                continue
            m = re.fullmatch(r"(\.|/[\w./-]+)(?:\[([\w,-]+)\])?", w)
            if m:  # the project itself, with extras
                project_installed = True
                extras = set(filter(None, (m.group(2) or "").split(",")))
                assert extras <= EXTRAS, f"{path.name}: extras {extras - EXTRAS} not in pyproject"
                continue
            name = re.split(r"[<>=!~\[]", w, maxsplit=1)[0].lower()
            assert name in known, f"{path.name}: installs {w}, which pyproject/constraints do not name"
    assert project_installed, f"{path.name} does not install the project"
    for rest in args_of(path, "RUN"):
        for m in re.finditer(r"-c\s+(\S+)", rest):
            assert (ROOT / m.group(1)).is_file() and m.group(1) in " ".join(copy_sources(path))


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
            for dep in of_kind(overlay(name), "Deployment"):
                assert str(dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == uid


def test_workflow_builds_every_image_under_the_names_the_cluster_pulls():
    wf = yaml.safe_load(WORKFLOW.read_text())
    (job,) = wf["jobs"].values()
    matrix = {e["dockerfile"]: e["image"] for e in job["strategy"]["matrix"]["include"]}
    assert set(matrix) == {str(p.relative_to(ROOT)) for p in DOCKERFILES}
    pulled = set()
    for name in OVERLAYS:
        for dep in of_kind(overlay(name), "Deployment"):
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
