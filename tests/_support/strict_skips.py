"""Under OPENRL_CI_STRICT=1 (CI), a skipped test fails unless it is marked ``gpu``.

A missing browser, venv or package must not turn CI green by skipping the tests that need it.
"""

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("OPENRL_CI_STRICT") == "1" and rep.skipped and "gpu" not in item.keywords:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped under OPENRL_CI_STRICT=1 (only gpu tests may skip): {reason}"
        if hasattr(rep, "wasxfail"):  # an xfail: pytest does not count a failure that carries this
            del rep.wasxfail
