"""The one range check every integer/number field goes through: the refusal names field, range, setting."""

import doctest

import pytest

from openrl_service import checks
from openrl_service.checks import integer, number
from openrl_service.errors import UserError


def test_the_module_example_holds():
    assert doctest.testmod(checks).failed == 0


@pytest.mark.parametrize("bad", [True, 1.0, "3", None, 0, 65])
def test_an_integer_outside_its_range_or_of_another_type_is_refused_by_name(bad):
    with pytest.raises(UserError) as e:
        integer(bad, "num_samples", 1, 64, setting="OPENRL_MAX_NUM_SAMPLES")
    assert e.value.field == "num_samples"
    assert "num_samples must be an integer in [1, 64] (OPENRL_MAX_NUM_SAMPLES)" in str(e.value)


def test_open_ends_and_another_error_class():
    assert integer(10**12, "offset", 0) == 10**12
    with pytest.raises(ValueError, match=r"^seed must be an integer <= 5; got 6$"):
        integer(6, "seed", hi=5, error=ValueError)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), False, "0.1", -0.5])
def test_a_number_must_be_finite_and_in_range(bad):
    with pytest.raises(UserError, match="temperature must be a finite number >= 0"):
        number(bad, "temperature", 0)
    assert number(2, "temperature", 0) == 2.0


@pytest.mark.parametrize("bad", [0, 0.0, -1e-9, 1.5])
def test_an_open_lower_end_refuses_the_end_itself(bad):
    with pytest.raises(UserError, match=r"^top_p must be a finite number in \(0, 1\]; got "):
        number(bad, "top_p", 0, 1, lo_open=True)
    assert number(1e-9, "top_p", 0, 1, lo_open=True) == 1e-9


def test_numpy_integers_are_integers_and_come_back_as_int():
    """A value from numpy (a grid made with np.array, a seed from rng.integers) is an integer; it
    comes back as a plain int, which JSON encodes. A numpy bool or float is still not one."""
    np = pytest.importorskip("numpy")
    for value in (np.int64(8), np.int32(8), np.uint8(8), np.array([8, 16])[0]):
        got = integer(value, "rank", 1, 512)
        assert got == 8 and type(got) is int
    for bad in (np.bool_(True), np.float64(8.0), np.array([8]), np.int64(513)):
        with pytest.raises(UserError, match=r"^rank must be an integer in \[1, 512\]"):
            integer(bad, "rank", 1, 512)
    got = number(np.float32(0.5), "top_p", 0, 1, lo_open=True)
    assert got == 0.5 and type(got) is float
    with pytest.raises(UserError, match="must be a finite number"):
        number(np.bool_(True), "top_p", 0, 1)
