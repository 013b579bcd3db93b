"""A release, up to the publishing step: .ci/release-build makes an sdist and a wheel that twine
accepts, carrying the lab extension (built, and its sources in the sdist) and the server extension's
enable file, at pyproject.toml's version; a tag other than ``v<version>`` is refused before anything is
built; and the workflows publish the images under exactly the names and tag the overlays pull."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
import zipfile
from pathlib import Path

import tomllib
import yaml

from tests.packaging.conftest import ROOT, release_build

LABEXT = "openrl-jupyter-labextension"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
WORKFLOWS = ROOT / ".github" / "workflows"
SETTINGS = ROOT / "k8s" / "components" / "settings" / "kustomization.yaml"


def test_the_release_files_are_checked_and_carry_the_extension_at_the_version(release):
    sdist, wheel = release["sdist"], release["wheel"]
    assert sdist.name == f"openrl_jupyter-{VERSION}.tar.gz"
    assert wheel.name == f"openrl_jupyter-{VERSION}-py3-none-any.whl"
    # twine check --strict passed both (the script exits non-zero otherwise), then the script's checks
    output = re.sub(r"\x1b\[[0-9;]*m", "", release["output"])
    assert output.count("PASSED") == 2, output
    for f in (sdist, wheel):
        assert re.search(rf"release-build: {re.escape(f.name)} sha256 [0-9a-f]{{64}}", output), output

    data = f"openrl_jupyter-{VERSION}.data/data/"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = json.loads(zf.read(f"{data}share/jupyter/labextensions/{LABEXT}/package.json"))
        metadata = zf.read(f"openrl_jupyter-{VERSION}.dist-info/METADATA").decode()
        assert json.loads(zf.read(f"{data}etc/jupyter/jupyter_server_config.d/openrl_jupyter.json")) == {
            "ServerApp": {"jpserver_extensions": {"openrl_jupyter": True}}
        }
    assert meta["name"] == LABEXT and meta["version"] == VERSION
    assert f"{data}share/jupyter/labextensions/{LABEXT}/static/style.js" in names
    assert re.search(rf"^Version: {re.escape(VERSION)}$", metadata, re.M)
    # every extra a doc page's install line may name is declared in the wheel's metadata
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        assert f"Provides-Extra: {extra}" in metadata, extra

    top = f"openrl_jupyter-{VERSION}/"
    with tarfile.open(sdist) as tf:
        members = set(tf.getnames())
    sources = [p.relative_to(ROOT).as_posix() for p in (ROOT / "labextension" / "src").glob("*.ts")]
    assert sources
    for name in [
        *sources,
        "labextension/package.json",
        "labextension/yarn.lock",
        "labextension/tsconfig.json",
    ]:
        assert top + name in members, f"the sdist lacks {name}"
    assert top + "openrl_jupyter/labextension/static/style.js" in members, "the sdist lacks the built bundle"
    assert not [m for m in members if "/node_modules/" in m or m.startswith(top + ".venv")]


def test_a_tag_that_is_not_the_version_is_refused_before_anything_is_built(tmp_path):
    out = tmp_path / "dist"
    proc = release_build(out, "--tag", "v9.9.9")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"the tag v9.9.9 is not v{VERSION}, the version pyproject.toml says" in proc.stderr
    assert not out.exists() or not list(out.iterdir())


def _expressions(text: str, values: dict[str, str]) -> str:
    """The workflow's ``${{ expr }}`` replaced as Actions would, for the given context values."""

    def value(m: re.Match) -> str:
        expr = m.group(1).strip()
        assert expr in values, f"the test does not know {expr!r}"
        return values[expr]

    return re.sub(r"\$\{\{(.*?)\}\}", value, text)


def _pushed(tmp_path: Path, image: str, **github: str) -> tuple[int, list[str]]:
    """Run images.yml's tags step as Actions would for one matrix image; (exit code, its tags)."""
    (job,) = yaml.safe_load((WORKFLOWS / "images.yml").read_text())["jobs"].values()
    (step,) = [s for s in job["steps"] if s.get("id") == "tags"]
    push = next(s for s in job["steps"] if "docker/build-push-action" in s.get("uses", ""))
    assert push["with"]["tags"] == "${{ steps.tags.outputs.tags }}"
    values = {
        "github.repository_owner": github["owner"],
        "github.sha": "0" * 40,
        "github.ref_type": github["ref_type"],
        "github.ref_name": github["ref_name"],
        "github.ref": github["ref"],
        "matrix.image": image,
        "steps.version.outputs.version": VERSION,
    }
    out = tmp_path / f"output-{image}"
    out.write_text("")
    script = "set -eo pipefail\n" + _expressions(step["run"], values)
    proc = subprocess.run(["bash", "-c", script], env={"GITHUB_OUTPUT": str(out), "PATH": "/usr/bin:/bin"})
    lines = out.read_text().splitlines()
    return proc.returncode, lines[1:-1] if lines[:1] == ["tags<<EOF"] else lines


def test_a_release_tag_publishes_exactly_the_images_the_overlays_pull(tmp_path):
    pulled = {f"{i['newName']}:{i['newTag']}" for i in yaml.safe_load(SETTINGS.read_text())["images"]}
    (owner,) = {i["newName"].split("/")[1] for i in yaml.safe_load(SETTINGS.read_text())["images"]}
    (job,) = yaml.safe_load((WORKFLOWS / "images.yml").read_text())["jobs"].values()
    images = [e["image"] for e in job["strategy"]["matrix"]["include"]]
    tag = {"owner": owner, "ref_type": "tag", "ref_name": f"v{VERSION}", "ref": f"refs/tags/v{VERSION}"}
    released = set()
    for image in images:
        code, tags = _pushed(tmp_path, image, **tag)
        assert code == 0
        released |= {t for t in tags if ":sha-" not in t}
    assert released == pulled, f"a release pushes {sorted(released)}; the overlays pull {sorted(pulled)}"

    # main pushes :main and :sha-..., never the version a release owns
    main = {"owner": owner, "ref_type": "branch", "ref_name": "main", "ref": "refs/heads/main"}
    code, tags = _pushed(tmp_path, images[0], **main)
    assert code == 0 and sorted(t.rsplit(":", 1)[1] for t in tags) == ["main", "sha-" + "0" * 40], tags
    # a tag that is not the package version publishes nothing
    wrong = {"owner": owner, "ref_type": "tag", "ref_name": "v9.9.9", "ref": "refs/tags/v9.9.9"}
    assert _pushed(tmp_path, images[0], **wrong)[0] != 0


def test_the_release_workflow_builds_with_the_script_then_publishes_on_a_tag():
    wf = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on:` key as True
    assert on == {"push": {"tags": ["v*"]}}
    jobs = wf["jobs"]
    dist = json.dumps(jobs["dist"]["steps"])
    assert 'python .ci/release-build dist --tag \\"${{ github.ref_name }}\\" --no-isolation' in dist
    # the build tools the workflow installs are the dev extra's pins, as the tests here build with them
    (install,) = re.findall(r"python -m pip install ([^\"]+)", dist)
    dev = [r for r in PYPROJECT["project"]["optional-dependencies"]["dev"] if not r.startswith("ruff")]
    assert sorted(install.split()) == sorted(dev), install
    assert jobs["images"]["uses"] == "./.github/workflows/images.yml"
    images_wf = yaml.safe_load((WORKFLOWS / "images.yml").read_text())
    assert "workflow_call" in images_wf.get("on", images_wf.get(True))
    assert jobs["images"]["permissions"]["packages"] == "write"
    pypi = jobs["pypi"]
    assert [s["uses"] for s in pypi["steps"]][-1].startswith("pypa/gh-action-pypi-publish@")
    assert pypi["permissions"] == {"id-token": "write"} and pypi["environment"]["name"] == "pypi"
    assert "gh release create" in json.dumps(jobs["github-release"]["steps"])
    for publisher in ("pypi", "github-release"):
        assert {"dist", "images"} <= set(jobs[publisher]["needs"]), publisher
