"""CI's strictness: under OPENRL_CI_STRICT=1 only tests marked gpu may skip."""

EXAMPLE = """
import pytest

def test_needs_a_browser():
    pytest.skip("chromium not installed")

@pytest.mark.gpu
def test_needs_cuda():
    pytest.skip("no CUDA device")

def test_runs():
    assert True
"""


def _run(pytester, monkeypatch, strict):
    monkeypatch.setenv("OPENRL_CI_STRICT", "1" if strict else "0")
    pytester.makepyfile(EXAMPLE)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    # the inner run reads only its own ini: keep kmock's pytest plugin out as the project's addopts do
    return pytester.runpytest_inprocess("-p", "tests._support.strict_skips", "-p", "no:kmock")


def test_a_skip_fails_under_strict_mode_unless_marked_gpu(pytester, monkeypatch):
    _run(pytester, monkeypatch, strict=True).assert_outcomes(passed=1, failed=1, skipped=1)


def test_skips_are_skips_outside_ci(pytester, monkeypatch):
    _run(pytester, monkeypatch, strict=False).assert_outcomes(passed=1, skipped=2)
