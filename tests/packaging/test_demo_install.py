"""What ``make demo`` leaves a newcomer: .venv with the service and the demo extra only (no test
tools), then the lab panel and the server extension linked into it, before the notebook runs; and this
venv, set up the same way by ``make venv``/``make test``, shows both enabled to ``jupyter``."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

from tests.packaging.conftest import ROOT

LABEXT = "openrl-jupyter-labextension"
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NOTEBOOK = ROOT / "notebooks" / "01-quickstart.ipynb"
DEMO_SCRIPT = ROOT / "examples" / "notebook_demo.py"


def _make_n(target: str, venv: Path) -> list[str]:
    """The commands ``make TARGET`` would run for a fresh .venv at ``venv``, in order."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def _index(lines: list[str], pattern: str) -> int:
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no command matches {pattern!r}:\n" + "\n".join(lines)
    return found[-1]


def test_make_demo_installs_the_demo_extra_alone_and_links_the_panel_before_the_notebook_runs(tmp_path):
    venv = tmp_path / "venv"
    lines = _make_n("demo", venv)
    installs = [line for line in lines if "pip install" in line and " -e " in line]
    assert len(installs) == 1 and '-e ".[service,demo]"' in installs[0], installs
    link = _index(
        lines, rf"ln -sfn {ROOT}/openrl_jupyter/labextension {venv}/share/jupyter/labextensions/{LABEXT}$"
    )
    server = _index(
        lines,
        rf"ln -sfn {ROOT}/jupyter-config/server-config/openrl_jupyter.json "
        rf"{venv}/etc/jupyter/jupyter_server_config.d/openrl_jupyter.json$",
    )
    run = _index(lines, r"examples/notebook_demo.py")
    assert _index(lines, re.escape(installs[0])) < link < run and server < run


def test_make_venv_installs_the_demo_extra_too_then_links_after_the_full_install(tmp_path):
    venv = tmp_path / "venv"
    lines = _make_n("venv", venv)
    full = _index(lines, r'-e "\.\[service,tinker,test,dev,demo\]"')
    assert _index(lines, r'-e "\.\[service,demo\]"') < full  # never two pips in one venv at once
    assert full < _index(lines, rf"ln -sfn \S+ {venv}/share/jupyter/labextensions/{LABEXT}$")


def _jupyter(*args: str) -> str:
    """``jupyter ...`` of this venv, with empty user folders: only the venv's own files count."""
    home = Path(os.environ.get("TMPDIR", "/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "no-jupyter-config"), JUPYTER_DATA_DIR=str(home / "no-jupyter-data")
    )
    proc = subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)


def test_this_venv_shows_the_panel_and_the_server_extension_enabled():
    """What `make demo` and `make venv` leave (labextension-link); run `make labextension-link` if this
    fails after a bare `pip install -e .`."""
    labs = _jupyter("jupyterlab.labextensions", "list")
    assert re.search(rf"{LABEXT} v[0-9.]+ .*enabled.*OK", labs), labs
    servers = _jupyter("jupyter_server.extension.serverextension", "list")
    head = f"Config dir: {Path(sys.prefix) / 'etc' / 'jupyter'}\n"
    assert head in servers, servers
    section = servers.split(head, 1)[1].split("Config dir:", 1)[0]
    assert re.search(r"openrl_jupyter\s+enabled", section) and re.search(
        r"openrl_jupyter [0-9.]+ OK", section
    ), servers


def _imports(code: str) -> set[str]:
    from IPython.core.inputtransformer2 import TransformerManager

    # magics and shell escapes become the calls IPython makes of them; a cell magic's body is a string
    code = TransformerManager().transform_cell(code)
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_demo_extra_names_every_package_the_demo_imports():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    modules = set().union(*(_imports("".join(c["source"])) for c in cells if c["cell_type"] == "code"))
    modules |= _imports(DEMO_SCRIPT.read_text())
    modules |= {"ipykernel"}  # the kernel nbclient starts
    declared = {
        re.split(r"[=<>\[ ;]", r)[0].lower().replace("_", "-")
        for r in EXTRAS["dependencies"]
        + EXTRAS["optional-dependencies"]["service"]
        + EXTRAS["optional-dependencies"]["demo"]
    }
    ours = {"openrl_jupyter", "openrl_service", "openrl_common"}
    owners = packages_distributions()
    missing = {}
    for module in sorted(modules - ours - set(sys.stdlib_module_names)):
        dists = {d.lower().replace("_", "-") for d in owners.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert not missing, (
        f"the demo imports these, which neither the base, service nor demo extra names: {missing}"
    )
