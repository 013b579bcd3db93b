"""Session fixtures for browser tests: ``lab`` (a running JupyterLab), ``browser`` and ``page`` (Playwright).

Without chromium or Playwright the tests skip with the reason; under OPENRL_CI_STRICT=1 (CI) that skip is a
failure (tests/_support/strict_skips.py allows only ``gpu`` tests to skip), so CI must install chromium
(``.ci/run`` does). A failing test leaves ``tests/artifacts/<test>-failed.png``.

The fixtures are package-scoped: Playwright's sync API keeps an asyncio loop running on the main
thread while it is started, so it must stop before the rest of the suite (which calls asyncio.run).
"""

from __future__ import annotations

import re

import pytest

from tests._support.lab import VIEWPORT, launch_chromium, missing, screenshot, start_lab


@pytest.fixture(scope="package")
def lab(tmp_path_factory):
    """JupyterLab on loopback: ``lab.url``, ``lab.token``, ``lab.root_dir`` (write notebooks there)."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    server = start_lab(tmp_path_factory.mktemp("lab-root"), tmp_path_factory.mktemp("lab-state"))
    yield server
    server.stop()


@pytest.fixture(scope="package")
def browser():
    reason = missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        chromium = launch_chromium(pw)
        yield chromium
        chromium.close()
    finally:
        pw.stop()


@pytest.fixture(scope="package")
def page(browser, lab):
    """One Playwright page for the session (tests navigate with ``open_notebook``)."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(30_000)
    pg = context.new_page()
    yield pg
    context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed and "page" in getattr(item, "funcargs", {}):
        name = re.sub(r"[^\w.-]+", "_", item.name)
        try:
            path = screenshot(item.funcargs["page"], f"{name}-failed")
            rep.sections.append(("screenshot", str(path)))
        except Exception as e:  # a dead browser must not hide the real failure
            rep.sections.append(("screenshot", f"not saved: {e}"))
