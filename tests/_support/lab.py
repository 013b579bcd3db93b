"""A headless JupyterLab and Debian chromium (through Playwright) for browser tests, plus page helpers.

``start_lab()`` runs ``python -m jupyterlab`` from this venv on a free loopback port with a fresh token,
its own config/data/runtime/settings folders (the venv's labextensions -- anywidget, jupyter-widgets,
plotly -- are still found through ``sys.prefix``) and a root folder for the notebooks under test.
``launch_chromium()`` starts ``/usr/bin/chromium`` (Playwright cannot download its own browsers here).

Page helpers work on the notebook currently shown and fail with the page's visible text, the kernel status
and the server's kernels attached: ``open_notebook``, ``wait_kernel_idle``, ``run_all``, ``count_points``,
``wait_points``, ``screenshot``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from openrl_jupyter.local import free_port

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Playwright

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM = os.environ.get("OPENRL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 1000}
# The notebook shown in the main area (other open documents are hidden by Lumino).
ACTIVE = "#jp-main-dock-panel .jp-NotebookPanel:not(.lm-mod-hidden)"

# User settings for the lab under test: no news/update pop-ups, every cell attached to the DOM.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def missing() -> str | None:
    """Why the browser tests cannot run here (None when they can)."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"{CHROMIUM} is missing: install Debian chromium (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is missing (pip install -e '.[test]')"
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return "jupyterlab is missing (pip install -e '.[test]')"
    return None


# -- the JupyterLab server ----------------------------------------------------------------------------


@dataclass
class Lab:
    url: str
    token: str
    root_dir: Path
    state_dir: Path
    proc: subprocess.Popen

    @property
    def log_path(self) -> Path:
        return self.state_dir / "lab.log"

    def notebook_url(self, path: str) -> str:
        """The URL that opens ``path`` (relative to ``root_dir``) in JupyterLab."""
        return f"{self.url}/lab/tree/{quote(path)}?token={self.token}"

    def api(self, method: str, path: str, body: Any = None, timeout: float = 10) -> Any:
        """Call the Jupyter server REST API (``/api/...``); returns the decoded JSON (None if empty)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def kernels(self) -> list[dict[str, Any]]:
        """The server's running kernels (id, name, execution_state...)."""
        return self.api("GET", "/api/kernels")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """Shut the kernels down through the API, then SIGTERM the server, SIGKILL after ``grace`` s."""
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                for k in self.kernels():
                    self.api("DELETE", f"/api/kernels/{k['id']}", timeout=grace)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace)


def write_notebook(path: Path, *sources: str) -> None:
    """A notebook of code cells ``sources`` with the python3 kernelspec, as Lab opens it."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    nbformat.write(nb, str(path))


def start_lab(
    root_dir: Path,
    state_dir: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    base_url: str = "/",
    app: str = "jupyterlab",
) -> Lab:
    """Start JupyterLab on 127.0.0.1 and wait until ``/api/status`` answers; ``env`` reaches its kernels.
    ``base_url`` (e.g. ``/user/alice/``, as under JupyterHub) ends up in ``lab.url``; ``app="notebook"``
    starts Notebook 7 instead."""
    root_dir, state_dir = Path(root_dir), Path(state_dir)
    root_dir.mkdir(parents=True, exist_ok=True)
    dirs = {
        "JUPYTER_CONFIG_DIR": state_dir / "config",
        "JUPYTER_DATA_DIR": state_dir / "data",
        "JUPYTER_RUNTIME_DIR": state_dir / "runtime",
        "JUPYTERLAB_SETTINGS_DIR": state_dir / "lab-settings",
        "JUPYTERLAB_WORKSPACES_DIR": state_dir / "lab-workspaces",
        "IPYTHONDIR": state_dir / "ipython",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    for rel, settings in LAB_SETTINGS.items():
        f = dirs["JUPYTERLAB_SETTINGS_DIR"] / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(settings))
    port, token = free_port(), secrets.token_hex(16)
    # JUPYTER_PATH is left alone: the venv's share/jupyter (labextensions, kernelspec) comes from sys.prefix.
    full_env = {**os.environ, **{k: str(v) for k, v in dirs.items()}, **(env or {})}
    full_env.pop("PYTEST_CURRENT_TEST", None)
    cmd = [
        sys.executable,
        "-m",
        app,
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        "--ServerApp.terminals_enabled=False",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        f"--ServerApp.base_url={base_url}",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(state_dir / "lab.log", "wb")  # noqa: SIM115 (the child owns it until stop)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=root_dir)
    log.close()
    lab = Lab(f"http://127.0.0.1:{port}{base_url.rstrip('/')}", token, root_dir, state_dir, proc)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{lab.log_tail()}")
        try:
            lab.api("GET", "/api/status", timeout=2)
            return lab
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            lab.stop()
            raise RuntimeError(
                f"jupyter lab did not answer /api/status in {timeout:.0f} s:\n{lab.log_tail()}"
            )
        time.sleep(0.2)


# -- the browser --------------------------------------------------------------------------------------


def launch_chromium(pw: Playwright) -> Browser:
    """Debian chromium, headless, with the closed-network flags; no video, no trace."""
    return pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


# -- page helpers -------------------------------------------------------------------------------------


def kernel_status(page: Page) -> str:
    """The active notebook's kernel status as its toolbar shows it (idle, busy, starting...), or ``?``."""
    loc = page.locator(f"{ACTIVE} .jp-Notebook-ExecutionIndicator")
    try:
        return loc.first.get_attribute("data-status", timeout=1000) or "?"
    except Exception:
        return "?"


def report(page: Page, lab: Lab | None = None, chars: int = 3000) -> str:
    """What a person would see: URL, kernel status, visible text (and the server's kernels)."""
    try:
        text = page.locator("body").inner_text(timeout=2000)
    except Exception as e:
        text = f"<no page text: {e}>"
    lines = [f"url: {page.url}", f"kernel status (toolbar): {kernel_status(page)}"]
    if lab is not None:
        try:
            lines.append(
                "server kernels: " + ", ".join(f"{k['name']}:{k['execution_state']}" for k in lab.kernels())
            )
        except Exception as e:
            lines.append(f"server kernels: <{e}>")
    text = "\n".join(line for line in text.splitlines() if line.strip())
    lines.append(f"visible text (last {chars} chars):\n{text[-chars:]}")
    return "\n".join(lines)


def screenshot(page: Page, name: str) -> Path:
    """Save ``tests/artifacts/<name>.png`` and return its path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / (name if name.endswith(".png") else f"{name}.png")
    page.screenshot(path=str(path))
    return path


def _wait(page: Page, lab: Lab | None, what: str, js: str, arg: Any, timeout: float) -> Any:
    try:
        return page.wait_for_function(js, arg=arg, timeout=timeout * 1000, polling=200).json_value()
    except Exception as e:
        raise AssertionError(
            f"timed out after {timeout:.0f} s waiting for {what}\n{report(page, lab)}"
        ) from e


_KERNEL_STATE = """sel => {
  const p = document.querySelector(sel);
  if (!p) return null;
  return {status: p.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status ?? null,
          kernel: p.querySelector('.jp-KernelName')?.textContent.trim() ?? null};
}"""


def _server_kernel_state(lab: Lab, path: str) -> str | None:
    try:
        sessions = lab.api("GET", "/api/sessions")
    except Exception:
        return None
    for sess in sessions:
        if sess.get("path") == path and sess.get("kernel"):
            return sess["kernel"].get("execution_state")
    return None


def wait_kernel_idle(
    page: Page, lab: Lab | None = None, timeout: float = 60, *, path: str | None = None, settle: float = 1.0
) -> None:
    """Wait until the active notebook has a kernel (its toolbar names one) that has been idle for ``settle``
    seconds; with ``lab`` and ``path`` the server's session for ``path`` must report it idle too.

    The toolbar alone is not enough: while a notebook opens it shows "idle" before any kernel exists, then
    initializing/connecting/unknown; a Run All clicked then does nothing.
    """
    deadline = time.monotonic() + timeout
    idle_since = None
    state: dict[str, Any] = {}
    while True:
        state = page.evaluate(_KERNEL_STATE, ACTIVE) or {}
        ok = state.get("status") == "idle" and state.get("kernel") not in (None, "", "No Kernel")
        if ok and lab is not None and path is not None:
            state["server"] = _server_kernel_state(lab, path)
            ok = state["server"] == "idle"
        now = time.monotonic()
        if not ok:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= settle:
            return
        if now > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for an idle kernel ({state})\n{report(page, lab)}"
            )
        time.sleep(0.2)


def open_notebook(page: Page, lab: Lab, path: str, timeout: float = 90) -> None:
    """Open ``path`` (relative to ``lab.root_dir``) in JupyterLab and wait for its cells and an idle kernel."""
    page.goto(lab.notebook_url(path), wait_until="domcontentloaded", timeout=timeout * 1000)
    name = Path(path).name
    _wait(
        page,
        lab,
        f"{name} to show its cells",
        """([sel, name]) => { const p = document.querySelector(sel);
             const tab = document.querySelector('.lm-DockPanel-tabBar .lm-mod-current .lm-TabBar-tabLabel');
             return !!p && !!p.querySelector('.jp-Cell') && !!tab && tab.textContent === name; }""",
        [ACTIVE, name],
        timeout,
    )
    wait_kernel_idle(page, lab, timeout, path=path)


# Run-all bookkeeping in the page: a MutationObserver notes any "[*]" prompt (a cell queued or running), so
# a fast run is not missed between two polls and saved execution counts do not look like a finished run.
_WATCH_RUN = """sel => {
  const nb = document.querySelector(sel);
  window.__openrlRunSeen = false;
  if (window.__openrlRunObserver) window.__openrlRunObserver.disconnect();
  const seen = () => [...nb.querySelectorAll('.jp-InputArea-prompt')].some(p => p.textContent.includes('*'));
  window.__openrlRunObserver = new MutationObserver(() => { if (seen()) window.__openrlRunSeen = true; });
  window.__openrlRunObserver.observe(nb, {subtree: true, childList: true, characterData: true});
}"""

_RUN_STATE = """sel => {
  const nb = document.querySelector(sel);
  if (!nb) return null;
  const cells = [...nb.querySelectorAll('.jp-CodeCell')].filter(
    c => (c.querySelector('.cm-content')?.textContent ?? 'x').trim() !== '');  // empty cells never run
  const prompts = cells.map(c => c.querySelector('.jp-InputArea-prompt')?.textContent.trim() ?? '');
  const errors = [...nb.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.textContent).filter(t => t.includes('Traceback (most recent call last)') || /^UsageError: /m.test(t));
  const status = nb.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status;
  return {prompts, errors, status, seen: !!window.__openrlRunSeen};
}"""


def _click_run_all(page: Page) -> None:
    page.locator(f"{ACTIVE} .jp-Cell").first.click()  # the notebook must be the current widget
    page.evaluate(_WATCH_RUN, ACTIVE)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()


def run_all(
    page: Page,
    lab: Lab | None = None,
    timeout: float = 120,
    allow_errors: bool = False,
    retry_after: float = 15,
) -> None:
    """Menu Run -> Run All Cells, then wait until every non-empty code cell has an execution count and the
    kernel is idle. Fails at once (with the traceback) when a cell shows an error, unless ``allow_errors``.

    If no cell was queued ``retry_after`` s after the click while the kernel is idle (the command found no
    ready kernel), the menu is used again, twice at most.
    """
    _click_run_all(page)
    clicked, retries = time.monotonic(), 0
    deadline = clicked + timeout
    while True:
        state = page.evaluate(_RUN_STATE, ACTIVE) or {}
        prompts = state.get("prompts", [])
        if state.get("errors") and not allow_errors:
            raise AssertionError("a cell failed:\n" + "\n".join(state["errors"]) + f"\n{report(page, lab)}")
        numbered = all(p.strip("[]: ").isdigit() for p in prompts)
        if state.get("seen") and numbered and state.get("status") == "idle":
            return
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(
                f"Run All did not finish in {timeout:.0f} s (prompts {prompts}, saw a running cell: "
                f"{state.get('seen')}, menu used {retries + 1} times)\n{report(page, lab)}"
            )
        if (
            not state.get("seen")
            and state.get("status") == "idle"
            and now - clicked > retry_after
            and retries < 2
        ):
            retries += 1
            _click_run_all(page)
            clicked = time.monotonic()
        time.sleep(0.2)


def _points(page: Page, trace_index: int, plot_index: int):
    plot = page.locator(f"{ACTIVE} .js-plotly-plot").nth(plot_index)
    return plot, plot.locator(".scatterlayer .trace").nth(trace_index).locator(".points path.point")


def count_points(page: Page, trace_index: int = 0, plot_index: int = 0) -> int:
    """Markers plotly has drawn for one scatter trace of one plot in the active notebook (0 if none yet)."""
    plot, points = _points(page, trace_index, plot_index)
    if plot.count() == 0:
        return 0
    return points.count()


def wait_points(
    page: Page,
    n: int,
    lab: Lab | None = None,
    trace_index: int = 0,
    plot_index: int = 0,
    timeout: float = 60,
    at_least: bool = False,
) -> int:
    """Wait until the trace shows ``n`` drawn points (``>= n`` with ``at_least``); returns the count."""
    deadline = time.monotonic() + timeout
    seen = -1
    while True:
        seen = count_points(page, trace_index, plot_index)
        if seen == n or (at_least and seen >= n):
            plot, _ = _points(page, trace_index, plot_index)
            plot.scroll_into_view_if_needed()
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(
                f"plot {plot_index} trace {trace_index}: {seen} points drawn after {timeout:.0f} s, "
                f"expected {'>= ' if at_least else ''}{n}\n{report(page, lab)}"
            )
        time.sleep(0.25)
