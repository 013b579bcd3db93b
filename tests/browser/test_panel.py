"""The OpenRL JupyterLab extension in a real Lab and Debian chromium, against a real service.

A notebook starts a background run in its kernel; the left panel lists it and its step advances; the status
bar shows the device load and one running run; the run's tab draws a reward plot whose points grow; pause,
resume and stop from the panel change the run's state *in the kernel* (the kernel writes ``run.state`` to a
file the test reads). Meanwhile everything the browser receives is captured inside the page (fetch bodies
and headers, every event-stream message, websocket frames, plus Playwright's view of each HTTP response)
and scanned for the service key; so are the page config, the Lab settings and the server log. A
cookie-authenticated POST without the XSRF token is refused (403). A second Lab with no service, under a
non-root base URL (as under JupyterHub), shows the panel's disconnected state.

The lab extension comes from this checkout's build (``make labextension``), put on ``JUPYTER_PATH``; the
server extension is enabled by the repo's ``jupyter_server_config.d`` file, as ``pip install`` does.
Screenshots: ``tests/artifacts/panel.png``, ``panel-run-tab.png``, ``panel-disconnected.png``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from openrl_jupyter.client import Client
from tests._support.lab import VIEWPORT, open_notebook, report, run_all, screenshot, start_lab, write_notebook
from tests.conftest import ALICE_KEY

ROOT = Path(__file__).resolve().parents[2]
BUILT = ROOT / "openrl_jupyter" / "labextension"
LABEXT = "openrl-jupyter-labextension"
PANEL = "#openrl-panel"

START = """\
import json, os, pathlib, threading, time
from openrl_jupyter import session as sess

s = sess.connect(os.environ["OPENRL_URL"], token=os.environ["OPENRL_TOKEN"], name="panel")

def letters(prompt, completion, **info):
    return sum(c.isalpha() for c in completion) / max(1, len(completion))

run = s.train(reward=letters, prompts=["Name a colour:", "Say hello:", "Write a word:", "A city:"],
              steps=5000, batch=2, group=4, max_tokens=8, name="panel-run")

def _report():  # what the kernel's Run says, for the test to read
    out = pathlib.Path("run-state.json")
    while True:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": run.run_id, "state": str(run.state), "step": run.step,
                                   "reason": run.stop_reason}))
        os.replace(tmp, out)
        time.sleep(0.2)

threading.Thread(target=_report, daemon=True).start()
"""

# Inside the page, before Lab's code: keep what fetch, EventSource and XHR deliver (the browser driver
# cannot read an open event stream).
CAPTURE = """
(() => {
  const seen = window.__openrlSeen = {texts: [], events: 0, streams: []};
  const keep = s => { if (typeof s === 'string' && s.length) seen.texts.push(s); };
  const origFetch = window.fetch.bind(window);
  window.fetch = async (...args) => {
    const response = await origFetch(...args);
    try {
      let head = `${response.status} ${response.url}\\n`;
      response.headers.forEach((v, k) => { head += `${k}: ${v}\\n`; });
      keep(head);
      if (!(response.headers.get('content-type') || '').includes('event-stream')) {
        response.clone().text().then(keep, () => {});
      }
    } catch (e) {}
    return response;
  };
  const OrigES = window.EventSource;
  class CapturingEventSource extends OrigES {
    constructor(url, init) {
      super(url, init);
      seen.streams.push(String(url));
      for (const type of ['message', 'tick', 'run', 'control', 'state', 'metrics']) {
        super.addEventListener(type, ev => { seen.events += 1; keep(ev.data); });
      }
    }
  }
  window.EventSource = CapturingEventSource;
})();
"""


def lab_state(state_dir: Path) -> None:
    """The server extension's enable file (as pip installs it), this checkout's built lab extension on
    JUPYTER_PATH, and a 1 s panel refresh in the Lab settings."""
    if not (BUILT / "package.json").is_file():
        pytest.fail(f"{BUILT} is not built: run `make labextension`")
    conf = state_dir / "config" / "jupyter_server_config.d"
    conf.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "jupyter-config" / "server-config" / "openrl_jupyter.json", conf)
    ext = state_dir / "jupyter-path" / "labextensions"
    ext.mkdir(parents=True, exist_ok=True)
    (ext / LABEXT).symlink_to(BUILT, target_is_directory=True)
    settings = state_dir / "lab-settings" / LABEXT / "plugin.jupyterlab-settings"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"refreshInterval": 1}))


def lab_env(state_dir: Path, **extra: str) -> dict[str, str]:
    # this checkout's openrl_jupyter in the server and its kernels
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        "PYTHONPATH": path,
        "JUPYTER_PATH": str(state_dir / "jupyter-path"),
        **extra,
    }


@pytest.fixture(scope="module")
def panel_lab(server, tmp_path_factory):
    from tests._support.lab import missing

    reason = missing()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("panel-lab-state")
    lab_state(state)
    env = lab_env(state, OPENRL_URL=server.url, OPENRL_TOKEN=ALICE_KEY)
    lab = start_lab(tmp_path_factory.mktemp("panel-lab-root"), state, env=env)
    yield lab
    lab.stop()


class Capture:
    """Everything the browser received: page-side captures plus Playwright's responses and frames."""

    def __init__(self, page):
        self.page = page
        self.responses: list[bytes] = []
        self.frames: list[str] = []
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        page.on("response", self._response)
        page.on("websocket", lambda ws: ws.on("framereceived", lambda f: self.frames.append(str(f))))
        page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))

    def _response(self, response) -> None:
        try:
            head = f"{response.status} {response.url}\n" + "".join(
                f"{k}: {v}\n" for k, v in response.all_headers().items()
            )
            self.responses.append(head.encode())
            if "event-stream" not in (response.headers.get("content-type") or ""):
                self.responses.append(response.body())
        except Exception:  # a response whose body is gone (navigation) has nothing left to scan
            pass

    def page_side(self) -> dict:
        return self.page.evaluate("() => window.__openrlSeen")


@pytest.fixture(scope="module")
def panel_page(browser, panel_lab):
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(30_000)
    context.add_init_script(CAPTURE)
    page = context.new_page()
    capture = Capture(page)
    yield page, capture
    context.close()


def poll(what: str, fn, page, lab, timeout: float = 60.0, interval: float = 0.25):
    """Call ``fn`` until it returns something truthy; fail with the page's state after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})\n{report(page, lab)}"
    )


def kernel_run(lab) -> dict | None:
    try:
        return json.loads((lab.root_dir / "run-state.json").read_text())
    except (OSError, ValueError):
        return None


def panel_step(page, run_id: str) -> int | None:
    text = page.locator(f'{PANEL} li[data-run-id="{run_id}"] .jp-OpenRL-run-step').first
    if text.count() == 0:
        return None
    m = re.match(r"step (\d+)", text.inner_text())
    return int(m.group(1)) if m else None


def reward_points(page) -> int:
    return page.locator('.jp-OpenRL-runview svg[data-metric="reward_mean"] circle.jp-OpenRL-point').count()


def test_panel_lists_controls_and_plots_a_kernel_run_without_leaking_the_key(server, panel_lab, panel_page):
    page, capture = panel_page
    lab = panel_lab
    write_notebook(lab.root_dir / "panel.ipynb", START)
    open_notebook(page, lab, "panel.ipynb")
    run_all(page, lab)
    run_id = poll("the kernel's run to take a step", lambda: (kernel_run(lab) or {}).get("step"), page, lab)
    run_id = kernel_run(lab)["run_id"]
    try:
        # the panel, opened from its side-bar tab
        page.locator(f'.jp-SideBar .lm-TabBar-tab[data-id="{PANEL[1:]}"]').click()
        row = page.locator(f'{PANEL} li[data-run-id="{run_id}"]')
        row.wait_for(timeout=30_000)
        assert "panel-run" in row.inner_text()
        first = poll("a step in the panel", lambda: panel_step(page, run_id), page, lab, timeout=30)
        poll(f"the panel's step to pass {first}", lambda: (panel_step(page, run_id) or 0) > first, page, lab)
        service = page.locator(f"{PANEL} .jp-OpenRL-facts").inner_text()
        assert server.url in service and "openrl/tiny" in service, service

        status = page.locator(".jp-OpenRL-status")

        def status_matches_panel():
            m = re.search(r"OpenRL: \d+% busy · (\d+) running", status.inner_text())
            running = page.locator(
                f'{PANEL} li[data-state="running"], {PANEL} li[data-state="active"]'
            ).count()
            return m and int(m.group(1)) >= 1 and int(m.group(1)) == running

        # other tests' runs of the same tenant may be listed too: the count must match the panel's
        poll(
            "the status bar to show the load and the running runs",
            status_matches_panel,
            page,
            lab,
            timeout=30,
        )
        screenshot(page, "panel")

        # the run's tab (opened from the keyboard): a reward plot whose points grow
        row.locator(".jp-OpenRL-run-name").focus()
        page.keyboard.press("Enter")
        page.locator(".jp-OpenRL-runview").wait_for()
        n1 = poll("reward points in the run tab", lambda: reward_points(page), page, lab)
        poll(f"more than {n1} reward points", lambda: reward_points(page) > n1, page, lab)
        screenshot(page, "panel-run-tab")

        # pause / resume / stop from the panel reach the Run in the kernel
        row.locator("button.jp-OpenRL-pause").click()
        poll("the kernel's run to pause", lambda: (kernel_run(lab) or {}).get("state") == "paused", page, lab)
        held = kernel_run(lab)["step"]
        poll("the panel to show it paused", lambda: row.get_attribute("data-state") == "paused", page, lab)
        assert row.locator("button.jp-OpenRL-resume").is_enabled()
        assert kernel_run(lab)["step"] == held
        row.locator("button.jp-OpenRL-resume").click()
        poll("a step after resume", lambda: (kernel_run(lab) or {}).get("step", 0) > held, page, lab)
        row.locator("button.jp-OpenRL-stop").click()
        poll("the kernel's run to stop", lambda: (kernel_run(lab) or {}).get("state") == "stopped", page, lab)
        assert "stopped from the panel" in (kernel_run(lab)["reason"] or "")
        poll("the panel to show it stopped", lambda: row.get_attribute("data-state") == "stopped", page, lab)
        assert row.locator("button.jp-OpenRL-stop").is_disabled()

        # no console errors while the panel, the run tab and the controls worked
        assert not capture.console_errors and not capture.page_errors, (
            capture.console_errors,
            capture.page_errors,
        )

        # XSRF: the page's cookie alone does not make a POST
        xsrf = page.evaluate(
            """async (runId) => {
                 const base = JSON.parse(document.getElementById('jupyter-config-data').textContent).baseUrl;
                 const r = await fetch(`${base}openrl/runs/${runId}/control`, {method: 'POST',
                   credentials: 'same-origin', headers: {'Content-Type': 'application/json'},
                   body: JSON.stringify({action: 'resume'})});
                 return r.status; }""",
            run_id,
        )
        assert xsrf == 403, f"a cookie-only POST without the XSRF token got {xsrf}"
        assert kernel_run(lab)["state"] == "stopped"

        # what the browser got: no key anywhere
        settings = page.evaluate(
            """async () => {
                 const base = JSON.parse(document.getElementById('jupyter-config-data').textContent).baseUrl;
                 return await (await fetch(`${base}lab/api/settings`)).text(); }"""
        )
        page_config = page.evaluate("() => document.getElementById('jupyter-config-data').textContent")
        seen = capture.page_side()
        assert seen["events"] > 0, "the page's EventSource received no event"
        assert any("openrl/events" in url for url in seen["streams"]), seen["streams"]
        texts = [t.encode() for t in seen["texts"]] + capture.responses + [f.encode() for f in capture.frames]
        scanned = sum(len(t) for t in texts)
        assert scanned > 100_000, f"only {scanned} bytes captured"
        for blob in texts:
            assert ALICE_KEY.encode() not in blob, "the service key reached the browser"
        for name, text in [
            ("page config", page_config),
            ("Lab settings", settings),
            ("server log", lab.log_tail(10**7)),
        ]:
            assert len(text) > 0 and ALICE_KEY not in text, f"the service key is in the {name}"
        print(f"scanned {scanned} bytes ({len(texts)} pieces, {seen['events']} stream events): no key")
        assert not capture.page_errors, capture.page_errors
    except BaseException:
        screenshot(page, "panel-failed")
        raise
    finally:
        with Client(server.url, token=ALICE_KEY) as c:
            c.control(run_id, "stop")
            deadline = time.monotonic() + 60
            while (kernel_run(lab) or {}).get("state") not in ("stopped", "finished", "failed"):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            try:
                c.delete_run(run_id)
            except Exception:  # the shared service's run quota: best effort, the run is stopped
                pass


def test_stop_all_from_the_palette_stops_a_tinker_sdk_run(server, panel_lab, panel_page, service_client):
    page, _ = panel_page
    try:
        stop_all_sdk_run(page, panel_lab, service_client)
    except BaseException:
        screenshot(page, "panel-stop-all-failed")
        raise


def stop_all_sdk_run(page, lab, service_client) -> None:
    import tinker
    from tinker import types

    tc = service_client.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=3)
    tokens = [11, 12, 13, 14, 15, 16]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    if page.locator(PANEL).count() == 0:  # run alone: open Lab and the panel
        page.goto(f"{lab.url}/lab?token={lab.token}", wait_until="domcontentloaded")
        page.locator(f'.jp-SideBar .lm-TabBar-tab[data-id="{PANEL[1:]}"]').click()
    row = page.locator(f'{PANEL} li[data-run-id="{tc.model_id}"]')
    row.wait_for(timeout=30_000)
    # a listing fetched before optim_step finished shows step 0: wait for the one after it
    poll(
        "the SDK run listed as active at step 1 with its loss",
        lambda: (
            row.get_attribute("data-state") == "active"
            and re.search(r"step 1\b", row.inner_text())
            and "loss" in row.inner_text()
        ),
        page,
        lab,
    )

    page.keyboard.press("Control+Shift+C")
    palette = page.locator(".lm-CommandPalette-input")
    palette.wait_for()
    palette.fill("OpenRL: stop all")
    page.locator('.lm-CommandPalette-item[data-command="openrl:stop-all"]').click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for()
    name = row.locator(".jp-OpenRL-run-name").inner_text()
    assert name in dialog.inner_text(), dialog.inner_text()  # the dialog names the runs it will stop
    dialog.locator(".jp-Dialog-button.jp-mod-warn").click()
    poll("the SDK run to show stopped", lambda: row.get_attribute("data-state") == "stopped", page, lab)
    with pytest.raises(tinker.RequestFailedError, match="stopped from the panel"):
        tc.forward_backward([datum], "cross_entropy").result()
    screenshot(page, "panel-stopped-sdk-run")


def test_panel_shows_disconnected_under_a_base_url(browser, tmp_path_factory):
    state = tmp_path_factory.mktemp("bare-lab-state")
    lab_state(state)
    theme = state / "lab-settings" / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings"
    theme.parent.mkdir(parents=True, exist_ok=True)
    theme.write_text(json.dumps({"theme": "JupyterLab Dark"}))
    lab = start_lab(
        tmp_path_factory.mktemp("bare-lab-root"), state, env=lab_env(state), base_url="/user/alice/"
    )
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.goto(f"{lab.url}/lab?token={lab.token}", wait_until="domcontentloaded")
        page.locator(f'.jp-SideBar .lm-TabBar-tab[data-id="{PANEL[1:]}"]').click()
        message = page.locator(f"{PANEL} .jp-OpenRL-disconnected")
        message.wait_for(timeout=60_000)
        assert "Not connected" in message.inner_text()
        hint = page.locator(f"{PANEL} .jp-OpenRL-error").inner_text()
        assert "connect" in hint.lower(), hint
        status = page.locator(".jp-OpenRL-status")
        poll("the status bar's disconnected state", lambda: "not connected" in status.inner_text(), page, lab)
        # the panel's requests went under the base URL
        with httpx.Client(headers={"Authorization": f"token {lab.token}"}) as http:
            assert http.get(f"{lab.url}/openrl/health").json()["connected"] is False
        # the dark theme reaches the panel (it uses the theme's variables, not fixed colours)
        poll(
            "the dark theme",
            lambda: page.evaluate("() => document.body.dataset.jpThemeLight") == "false",
            page,
            lab,
        )
        background = page.evaluate(
            f"() => getComputedStyle(document.querySelector('{PANEL}')).backgroundColor"
        )
        rgb = [int(v) for v in re.findall(r"\d+", background)[:3]]
        assert sum(rgb) / 3 < 96, f"the panel's background in the dark theme is {background}"
        screenshot(page, "panel-disconnected")
    finally:
        context.close()
        lab.stop()


def test_notebook7_shell_opens_the_panel_from_the_command_palette(browser, tmp_path_factory):
    try:
        import notebook  # noqa: F401
    except ImportError:
        pytest.skip("Notebook 7 is missing (pip install -e '.[test]')")
    state = tmp_path_factory.mktemp("nb7-state")
    lab_state(state)
    nb = start_lab(tmp_path_factory.mktemp("nb7-root"), state, env=lab_env(state), app="notebook")
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        errors: list[str] = []  # ours only: Notebook 7.6.5 itself throws one while loading its settings
        page.on(
            "pageerror",
            lambda e: errors.append(f"{e}\n{e.stack}") if "openrl" in f"{e}{e.stack}".lower() else None,
        )
        page.goto(f"{nb.url}/tree?token={nb.token}", wait_until="domcontentloaded")
        page.locator("#main-panel, .jp-FileBrowser").first.wait_for(timeout=60_000)
        page.keyboard.press("Control+Shift+C")
        palette = page.locator(".lm-CommandPalette-input")
        palette.wait_for()
        palette.fill("OpenRL: open panel")
        page.locator('.lm-CommandPalette-item[data-command="openrl:open-panel"]').click()
        panel = page.locator(PANEL)
        panel.wait_for(state="visible", timeout=30_000)
        poll("the panel's disconnected state", lambda: "Not connected" in panel.inner_text(), page, nb)
        assert not errors, errors
        screenshot(page, "panel-notebook7")
    finally:
        context.close()
        nb.stop()


def test_a_sweeps_runs_sit_under_the_sweep_and_stop_together(server, panel_lab, panel_page):
    """A sweep started with session.sweep (here in the test's own process, as the same user): the panel
    shows its runs under one sweep header with their count and how the sweep ranks them (no score:
    the ranking lives with the sweep), and "Stop sweep" stops every one of them —
    in the process that runs them (run.state "stopped", the panel's reason), and the sweep ends."""
    from openrl_jupyter import session as sess

    page, capture = panel_page
    s = sess.connect(server.url, token=ALICE_KEY, name="panel-sweep")
    try:
        sweep = s.sweep(
            reward=lambda prompt, completion, **info: (
                sum(c.isalpha() for c in completion) / max(1, len(completion))
            ),
            prompts=["Name a colour:", "Say hello:"],
            grid={"lr": [1e-4, 3e-4]},
            steps=5000,
            group=2,
            batch=1,
            max_tokens=4,
            rungs=0,
            save_best=False,
            name="panel-sweep",
        )
        if page.locator(PANEL).count() == 0:  # run alone: open Lab and the panel
            page.goto(f"{panel_lab.url}/lab?token={panel_lab.token}", wait_until="domcontentloaded")
            page.locator(f'.jp-SideBar .lm-TabBar-tab[data-id="{PANEL[1:]}"]').click()
        group = page.locator(f'{PANEL} li.jp-OpenRL-sweep[data-sweep="panel-sweep"]')
        group.wait_for(timeout=30_000)
        rows = group.locator("li.jp-OpenRL-run")
        poll("both runs of the sweep under its header", lambda: rows.count() == 2, page, panel_lab)
        ids = {rows.nth(i).get_attribute("data-run-id") for i in range(2)}
        assert ids == {r.run_id for r in sweep.runs}, (ids, [r.run_id for r in sweep.runs])
        header = group.locator(".jp-OpenRL-sweep-count")
        poll(
            "the header counting 2 of 2 running",
            lambda: "2 of 2 running" in header.inner_text(),
            page,
            panel_lab,
        )
        # no score in the header (the panel cannot see the sweep's ranking): it says where it is read
        assert header.inner_text().strip() == "2 of 2 running"
        ranking = group.locator(".jp-OpenRL-sweep-name").get_attribute("title") or ""
        assert "mean of its metric" in ranking and "since the last rung" in ranking, ranking
        screenshot(page, "panel-sweep")
        group.locator(".jp-OpenRL-sweep-stop").click()
        sweep.wait(timeout=60)
        for run in sweep.runs:
            assert str(run.state) == "stopped", (run.name, run.state)
            assert "stopped from the panel" in (run.stop_reason or ""), run.stop_reason
        poll(
            "the header counting 0 of 2 running",
            lambda: "0 of 2 running" in header.inner_text(),
            page,
            panel_lab,
        )
        assert group.locator(".jp-OpenRL-sweep-stop").is_disabled()
        assert not capture.page_errors, capture.page_errors
    finally:
        sess.disconnect("panel-sweep")
