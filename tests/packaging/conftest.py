"""One build of the release's files for the packaging tests: ``.ci/release-build`` (what the release
workflow runs on a tag) with ``--no-isolation``, so hatchling, hatch-jupyter-builder, build and twine
come from this venv's dev extra and nothing is fetched; the lab extension's own build runs only if
``make labextension`` has not built ``openrl_jupyter/labextension`` yet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASE_BUILD = ROOT / ".ci" / "release-build"


def release_build(outdir: Path, *args: str) -> subprocess.CompletedProcess:
    # jlpm/jupyter-builder/node for a lab build that has not happened yet come from this venv's bin
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    cmd = [sys.executable, str(RELEASE_BUILD), str(outdir), "--no-isolation", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=outdir.parent)


@pytest.fixture(scope="session")
def release(tmp_path_factory):
    """{"sdist", "wheel", "output"}: the release's files, built and checked by .ci/release-build."""
    for module in ("hatchling", "hatch_jupyter_builder", "build", "twine"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"{module} is missing: pip install -e '.[dev]' (make venv)")
    out = tmp_path_factory.mktemp("release") / "dist"
    proc = release_build(out)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f".ci/release-build exited {proc.returncode}:\n{output[-6000:]}"
    (sdist,) = out.glob("openrl_jupyter-*.tar.gz")
    (wheel,) = out.glob("openrl_jupyter-*.whl")
    return {"sdist": sdist, "wheel": wheel, "output": output}
