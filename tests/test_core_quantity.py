"""Kubernetes quantities as bit/s rates: what parses, what is refused and how it says so."""
import pytest
from hypothesis import given, strategies as st

from core.quantity import MAX_BPS, format_bps, parse_bps


@pytest.mark.parametrize("text, bps", [
    ("500k", 500_000), ("10M", 10_000_000), ("1G", 10**9), ("1.5G", 1_500_000_000),
    ("100Mi", 100 * 2**20), ("1Ki", 1024), ("2e9", 2 * 10**9), ("1E3", 1000), ("1T", 10**12),
    (".5k", 500), ("1.e3", 1000), ("+3M", 3_000_000), ("1e-3", 1), ("0.001Ei", 1_152_921_504_606_847),
    ("0.1", 1),  # fractions round up to a whole bit/s, like Quantity.Value()
    (1000, 1000), (2.5, 3), ("1P", 10**15),
])
def test_parses(text, bps):
    assert parse_bps(text, "x") == bps


@pytest.mark.parametrize("value, fragment", [
    ("500m", 'which means milli'),
    ("10Mbit", 'write "10M", not "10Mbit"'),
    ("10Mbps", "units are implied"),
    ("-1", "negative"),
    ("0", "zero"),
    ("abc", "is not a Kubernetes quantity"),
    ("", "is not a Kubernetes quantity"),
    ("10 M", "is not a Kubernetes quantity"),
    (" 7k ", "no spaces around it"),  # Kubernetes, the CRDs and the chart refuse it too
    ("-1M", "negative"),
    ("1e31", "exponent must be between -30 and 30"),
    (float("nan"), "not a finite rate"),
    (float("inf"), "not a finite rate"),
    (True, "is not a Kubernetes quantity"),
    (None, "is not a Kubernetes quantity"),
    ("1e400", "exponent must be between -30 and 30"),
    ("99E", "leave the field out"),
])
def test_refuses_with_a_message_naming_the_field(value, fragment):
    with pytest.raises(ValueError) as err:
        parse_bps(value, "EgressClass gold: spec.max")
    assert str(err.value).startswith("EgressClass gold: spec.max: ")
    assert fragment in str(err.value)


def test_zero_only_where_allowed():
    assert parse_bps("0", "x", allow_zero=True) == 0
    assert parse_bps(0, "x", allow_zero=True) == 0


def test_largest_rate_is_exact_in_float():
    assert parse_bps(MAX_BPS, "x") == MAX_BPS
    assert float(MAX_BPS) == MAX_BPS


@pytest.mark.parametrize("bps, text", [
    (0, "0"), (999, "999"), (500_000, "500k"), (10_000_000, "10M"), (1_500_000_000, "1.5G"),
    (1_234_567, "1.23M"), (12.3e12, "12.3T"), (MAX_BPS, "unlimited"),
])
def test_format(bps, text):
    assert format_bps(bps) == text


@given(st.integers(min_value=1, max_value=10**15))
def test_format_round_trips_within_its_precision(bps):
    back = parse_bps(format_bps(bps), "x")
    assert abs(back - bps) <= max(0.005 * bps, 1)


@given(st.text(max_size=20) | st.floats() | st.integers())
def test_anything_parses_or_raises_value_error(value):
    try:
        bps = parse_bps(value, "x", allow_zero=True)
    except ValueError as exc:
        assert str(exc).startswith("x: ")
    else:
        assert 0 <= bps <= MAX_BPS and isinstance(bps, int)
