"""CI's strictness: under OPENRL_CI_STRICT=1 only tests marked gpu may skip."""

import pytest

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


def test_an_expected_failure_fails_the_run_under_strict_mode(pytester, monkeypatch):
    """An xfail is reported as skipped: under strict mode it must fail the run's exit status too (it
    was shown as FAILED while pytest still exited 0, so CI stayed green)."""
    monkeypatch.setenv("OPENRL_CI_STRICT", "1")
    pytester.makepyfile(
        "import pytest\n@pytest.mark.xfail(strict=True, reason='a known hole')\ndef test_hole():\n    assert 0\n"
    )
    result = pytester.runpytest_inprocess("-p", "tests._support.strict_skips", "-p", "no:kmock")
    result.assert_outcomes(failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
