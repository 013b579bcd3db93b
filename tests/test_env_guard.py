"""Tests cannot leak environment variables into later tests (and the kernels and services they start)."""

EXAMPLE = """
import os

def test_sets_a_variable_directly():
    os.environ["OPENRL_ENV_GUARD_PROBE"] = "1"

def test_sets_one_through_monkeypatch(monkeypatch):
    monkeypatch.setenv("OPENRL_ENV_GUARD_OTHER", "1")

def test_later_tests_see_neither():
    assert "OPENRL_ENV_GUARD_PROBE" not in os.environ and "OPENRL_ENV_GUARD_OTHER" not in os.environ
"""


def test_a_test_that_leaves_a_variable_set_fails_and_the_variable_is_undone(pytester):
    pytester.makepyfile(EXAMPLE)
    result = pytester.runpytest_inprocess("-p", "tests._support.env_guard", "-p", "no:kmock")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*changed os.environ (OPENRL_ENV_GUARD_PROBE)*"])
