"""Every public method of the Tinker SDK's ServiceClient, TrainingClient, SamplingClient and RestClient,
driven with the unmodified ``tinker`` package against a private service, checking the values each
returns (the checks live in tinker_surface.py, one per method).

The methods are enumerated from the SDK at test time, so a method new to the SDK fails here until it
has a check. The suite renders docs/tinker-compatibility.md and fails when the committed file
differs; ``make compat-doc`` (OPENRL_WRITE_COMPAT_DOC=1) rewrites it.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from tests._support import tinker_surface as surface
from tests.conftest import ALICE_KEY, BOB_KEY, start_server

DOC = Path(__file__).resolve().parents[2] / "docs" / "tinker-compatibility.md"
WRITE_DOC = os.environ.get("OPENRL_WRITE_COMPAT_DOC") == "1"
MIN_SUPPORTED = 90

# The only methods allowed to be unsupported: billing, audit, admin and JWT-only calls. One reason each.
_AUDIT = "admin: the organization's audit log (now on AdminClient); the service has no organizations or audit trail"
_BILLING = "billing: usage events for invoicing (now on AdminClient); a self-hosted service bills no one"
_STORAGE = "billing: checkpoint storage billed per project (now on AdminClient); nothing is billed here"
ALLOWED_UNSUPPORTED: dict[tuple[str, str], str] = {
    ("RestClient", "get_audit_log"): _AUDIT,
    ("RestClient", "get_audit_log_async"): _AUDIT,
    ("RestClient", "get_billing_usage"): _BILLING,
    ("RestClient", "get_billing_usage_async"): _BILLING,
    ("RestClient", "get_current_checkpoint_storage_usage"): _STORAGE,
    ("RestClient", "get_current_checkpoint_storage_usage_async"): _STORAGE,
    ("RestClient", "whoami"): (
        "JWT-only: it reads the claims of the auth-exchange JWT, and the service authenticates with "
        "API keys (`pjwt_auth_enabled` is false), so the SDK raises before any request"
    ),
}

METHODS = surface.sdk_methods()
ALL = [(c, m) for c, ms in METHODS.items() for m in ms]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_model_dir):
    """Run every check once against a private service (exact counts for listings and paging)."""
    live = start_server(tmp_path_factory.mktemp("surface"), tiny_model_dir)
    ctx = surface.Ctx(url=live.url, key=ALICE_KEY, other_key=BOB_KEY)
    try:
        yield surface.run_all(ctx, ALLOWED_UNSUPPORTED)
    finally:
        ctx.close()
        live.stop()


def test_the_sdk_surface_is_what_the_suite_covers():
    """101 methods in tinker 0.38.0; a new method needs a check, a removed one loses its check."""
    counts = {c: len(ms) for c, ms in METHODS.items()}
    assert sum(counts.values()) >= 101, counts
    missing = [k for k in ALL if k not in surface.CHECKS]
    stale = [k for k in surface.CHECKS if k not in ALL]
    assert not missing, f"SDK methods with no check in tinker_surface.py: {missing}"
    assert not stale, f"checks for methods the SDK no longer has: {stale}"
    assert set(ALLOWED_UNSUPPORTED) <= set(ALL)
    for key, reason in ALLOWED_UNSUPPORTED.items():
        assert reason.split(":")[0] in ("billing", "audit", "admin", "JWT-only"), (key, reason)


@pytest.mark.parametrize("key", ALL, ids=[f"{c}.{m}" for c, m in ALL])
def test_method(outcomes, key):
    o = outcomes.get(key)
    assert o is not None, f"{key} has no check"
    if key in ALLOWED_UNSUPPORTED:
        assert o.status == "unsupported", (
            f"{key} is listed as unsupported but now works: give it a value check in tinker_surface.py "
            "and drop it from ALLOWED_UNSUPPORTED"
        )
        return
    assert o.status == "pass", f"{key[0]}.{key[1]} failed:\n{o.error}"


def test_enough_methods_are_supported(outcomes):
    n = sum(o.status == "pass" for o in outcomes.values())
    assert n >= MIN_SUPPORTED, f"{n} of {len(ALL)} supported (need {MIN_SUPPORTED})"


def test_compat_doc_is_current(outcomes):
    text = surface.render_doc(METHODS, outcomes, ALLOWED_UNSUPPORTED)
    if WRITE_DOC:
        DOC.write_text(text)
        return
    have = DOC.read_text() if DOC.exists() else ""
    if have != text:
        diff = "".join(
            difflib.unified_diff(have.splitlines(True), text.splitlines(True), str(DOC), "generated")
        )
        pytest.fail(f"{DOC.name} is out of date; run `make compat-doc`:\n{diff}")
