"""The wheel carries the prebuilt JupyterLab extension and enables the server extension on install.

The wheel is the release's (conftest.py's ``release``: ``.ci/release-build``, built once for the
packaging tests). It is installed with ``--no-deps`` into a fresh venv whose dependencies are borrowed
from the test venv through a ``.pth`` line (Jupyter, httpx...), and that venv's own ``jupyter
labextension list`` and ``jupyter server extension list`` are asked with empty user config/data folders,
so nothing but the wheel's files can make them say "enabled".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LABEXT = "openrl-jupyter-labextension"


def _run(cmd: list[str], env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory, release):
    tmp = tmp_path_factory.mktemp("wheel")
    home = tmp / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    wheel = release["wheel"]

    target = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(target)
    py = target / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)], env)
    # the wheel's dependencies (and Jupyter itself) from the test venv, after the wheel's own files
    purelib = subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    Path(purelib, "zz_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    clean = {k: v for k, v in env.items() if not k.startswith(("JUPYTER", "JUPYTERLAB"))}
    clean.update(
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTER_PLATFORM_DIRS="1",
        PATH=f"{target / 'bin'}{os.pathsep}/usr/bin:/bin",
    )
    return {"wheel": wheel, "venv": target, "python": py, "env": clean}


def test_wheel_carries_the_built_extension_and_the_server_config(installed):
    with zipfile.ZipFile(installed["wheel"]) as zf:
        names = zf.namelist()
        data = f"openrl_jupyter-0.1.0.data/data/share/jupyter/labextensions/{LABEXT}/"
        meta = json.loads(zf.read(data + "package.json"))
        enable = json.loads(
            zf.read("openrl_jupyter-0.1.0.data/data/etc/jupyter/jupyter_server_config.d/openrl_jupyter.json")
        )
    assert meta["name"] == LABEXT
    entry = meta["jupyterlab"]["_build"]["load"]
    assert data + entry in names, f"{entry} (the remote entry the package.json names) is not in the wheel"
    assert data + "static/style.js" in names
    assert data + f"schemas/{LABEXT}/plugin.json" in names
    assert enable == {"ServerApp": {"jpserver_extensions": {"openrl_jupyter": True}}}
    # the bundle once (in share/), not a second copy inside the package
    assert not [n for n in names if n.startswith("openrl_jupyter/labextension/")]
    # no TypeScript sources, node_modules or lockfile in the wheel
    assert not [n for n in names if "node_modules" in n or n.endswith((".ts", "yarn.lock"))]


def test_jupyter_lists_both_extensions_enabled(installed):
    py, env, target = str(installed["python"]), installed["env"], installed["venv"]
    labs = _run([py, "-m", "jupyterlab.labextensions", "list"], env)
    line = next((ln for ln in labs.splitlines() if LABEXT in ln), None)
    assert line is not None, f"{LABEXT} is not listed:\n{labs}"
    assert re.search(rf"{LABEXT} v0\.1\.0 .*enabled.*OK", line), line
    assert str(target / "share" / "jupyter" / "labextensions") in labs, labs

    servers = re.sub(
        r"\x1b\[[0-9;]*m", "", _run([py, "-m", "jupyter_server.extension.serverextension", "list"], env)
    )
    # the section of the venv's own config dir (etc/jupyter, where jupyter_server_config.d lies)
    head = f"Config dir: {target / 'etc' / 'jupyter'}\n"
    assert head in servers, f"no server extension is enabled from the installed wheel's config:\n{servers}"
    section = servers.split(head, 1)[1].split("Config dir:", 1)[0]
    assert re.search(r"openrl_jupyter\s+enabled", section), servers
    assert "validation failed" not in section and re.search(r"openrl_jupyter [0-9.]+ OK", section), servers
