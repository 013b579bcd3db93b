"""Each test leaves ``os.environ`` as it found it, or fails (a pytest plugin, see tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

# Set by libraries on themselves when first used (torch's compile cache): not a test's doing.
LIBRARY_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR", "PYTEST_CURRENT_TEST"})  # and pytest's own
_ENV_BEFORE = pytest.StashKey[dict]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_ENV_BEFORE] = dict(os.environ)  # before any fixture of this test is set up
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Every test leaves os.environ as it found it (monkeypatch.setenv undoes itself). A variable set
    directly leaks into every later test and every process they start: a kernel inherited
    TRANSFORMERS_OFFLINE=1 from an in-process service and could not reach the hub mirror, so a test
    failed in full runs and passed alone. Such a change is undone here and fails the test that made it."""
    result = yield
    before = item.stash.get(_ENV_BEFORE, None)
    if before is not None and dict(os.environ) != before:
        changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
        leaked = [k for k in changed if k not in LIBRARY_ENV]
        for k in leaked:
            if k in before:
                os.environ[k] = before[k]
            else:
                del os.environ[k]
        if leaked:
            raise AssertionError(
                f"{item.nodeid} changed os.environ ({', '.join(leaked)}) and left it changed; "
                "use monkeypatch.setenv (or restore it) so later tests and the processes they start "
                "do not inherit it"
            )
    return result
