"""Byte quantities (issue 38's quota bytes): the rates' grammar, binary and decimal suffixes distinguished."""
import pytest

from core.quantity import MAX_BYTES, RATE_PATTERN, parse_bytes


@pytest.mark.parametrize("text, count", [
    ("50Ti", 50 * 2**40), ("50T", 50 * 10**12), ("200Ti", 200 * 2**40), ("1Gi", 2**30), ("1G", 10**9),
    ("1", 1), ("1e12", 10**12), ("0.5Ki", 512), ("0.1", 1),  # fractions round up to a whole byte
    ("7Ei", 7 * 2**60), ("9223372036854775807", MAX_BYTES), (MAX_BYTES, MAX_BYTES), (4096, 4096),
])
def test_parses(text, count):
    assert parse_bytes(text, "x") == count


def test_binary_and_decimal_suffixes_differ():
    assert parse_bytes("50Ti", "x") - parse_bytes("50T", "x") == 50 * (2**40 - 10**12)


@pytest.mark.parametrize("value, fragment", [
    ("-1Gi", "negative"), ("-1", "negative"), (-5, "negative"),
    ("0", "zero"), ("0Ti", "zero"), (0, "zero"),
    ("8Ei", "above the largest byte count"), ("9223372036854775808", "above the largest byte count"),
    (2**63, "above the largest byte count"), ("1e30", "above the largest byte count"),
    ("1e31", "exponent must be between -30 and 30"),
    ("50TB", "is not a Kubernetes quantity in bytes"), ("lots", "is not a Kubernetes quantity in bytes"),
    ("", "is not a Kubernetes quantity in bytes"), ("5m", "milli (10^-3) bytes"),
    (float("inf"), "is not a Kubernetes quantity in bytes"), (float("nan"), "is not a Kubernetes quantity"),
    (1.5, "is not a Kubernetes quantity"), (True, "is not a Kubernetes quantity"), (None, "is not"),
    ("1" * 40, "longer than 32 characters"),
])
def test_refuses_with_a_message_naming_the_field(value, fragment):
    with pytest.raises(ValueError) as err:
        parse_bytes(value, "EgressBudget main: teams[research].quota.bytes")
    assert str(err.value).startswith("EgressBudget main: teams[research].quota.bytes: ")
    assert fragment in str(err.value)


def test_one_grammar_with_rates():
    # the byte grammar is the rates' pattern; only the bounds differ (>= 1 byte, <= 2^63-1)
    import re
    for text in ("50Ti", "50T", "1e12", ".5Ki"):
        assert re.fullmatch(RATE_PATTERN, text)
