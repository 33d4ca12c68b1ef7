"""Kubernetes quantities as rates in bit/s: "500k", "10M", "1.5G", "100Mi", 2000000.

The grammar is Kubernetes' own (resource.Quantity): decimal suffixes k M G T P E,
binary suffixes Ki Mi Gi Ti Pi Ei, or an exponent ("1e9"); fractions round up to a
whole bit/s as Quantity.Value() does. The sub-unit suffixes n, u and m are refused:
for a rate "500m" is half a bit per second and always a typo for "500M".
"""
from __future__ import annotations

import math
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext

# The largest rate we represent: 2**53 bit/s (9 Pbit/s) is still exact in a float64,
# so the numpy engine and the integer policy agree bit for bit. Also "no cap".
MAX_BPS = 2**53

_DECIMAL = {"": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUB_UNIT = {"n": "nano (10^-9)", "u": "micro (10^-6)", "m": "milli (10^-3)"}
# The one grammar of a rate, used as is by this parser, the CRDs' CEL `matches()` and the chart's
# validation (tests/test_rate_grammar.py checks they carry this exact string and agree on a table).
# A subset of RE2 and of Python's re, so one string means the same everywhere: no \d (Unicode digits
# in Python), no \Z; fullmatch() so "$" never lets a trailing newline through. Exponents are bounded
# here (|e| <= 30): a huge one is a cheap DoS for Decimal, and every grammar refuses it the same way.
# No sign but "+": "-1M" and "-0" are refused by the pattern everywhere (the CRDs cannot word it).
RATE_PATTERN = ("^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)"
                "([KMGTPE]i|[kMGTPE]|[eE][+-]?0*([0-9]|[12][0-9]|30))?$")
_QUANTITY = re.compile(RATE_PATTERN)
# The CRDs' maxLength on a rate (it bounds CEL's cost); the parser and the chart refuse longer text too.
RATE_MAX_CHARS = 32
# The same shape with the sub-unit suffixes and a minus sign, only to word the refusal well.
_NEAR_MISS = re.compile(r"^(?P<sign>[+-]?)(?P<num>[0-9]+(?:[.][0-9]*)?|[.][0-9]+)(?P<suffix>[A-Za-z]{0,2})$")
ALLOWED = ('a Kubernetes quantity in bit/s: a number with an optional suffix k, M, G, T, P, E '
           '(powers of 1000), Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or an exponent, '
           'e.g. "500k", "10M", "1.5G", "100Mi", "2e9"')


def parse_bps(value: str | int | float, what: str, allow_zero: bool = False) -> int:
    """`value` as whole bit/s. Raises ValueError starting with `what` (e.g. "EgressClass gold: spec.max")."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{what}: {value!r} is not {ALLOWED}")
    if isinstance(value, str):
        amount = _parse_text(value, what)
    else:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{what}: {value!r} is not a finite rate; use {ALLOWED}")
        amount = Decimal(value)
    if amount < 0:
        raise ValueError(f"{what}: {value!r} is negative; a rate must be positive")
    bps = int(amount.to_integral_value(rounding=ROUND_CEILING))
    if bps == 0 and not allow_zero:
        raise ValueError(f"{what}: {value!r} is zero; a rate here must be at least 1 bit/s")
    if bps > MAX_BPS:
        raise ValueError(f"{what}: {value!r} is above the largest rate supported "
                         f"(2^53 bit/s, about 9P); to mean no limit, leave the field out")
    return bps


# The largest byte count: a signed 64-bit counter's top (a quota, a used figure, Kubernetes' own int64).
MAX_BYTES = 2**63 - 1
BYTES_ALLOWED = ('a Kubernetes quantity in bytes: a number with an optional suffix k, M, G, T, P, E '
                 '(powers of 1000), Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or an exponent, '
                 'e.g. "500Gi", "50Ti", "50T", "1e12"')


def parse_bytes(value: str | int, what: str) -> int:
    """`value` as whole bytes, by the rates' grammar (RATE_PATTERN): "50Ti" is 50*2^40, "50T" 50*10^12.

    Zero, negative, non-finite and above MAX_BYTES (2^63-1) are refused: raises ValueError starting with `what`
    (e.g. "EgressBudget main: teams[research].quota.bytes"). Fractions round up to a whole byte.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{what}: {value!r} is not {BYTES_ALLOWED}")
    amount = (_parse_text(value, what, BYTES_ALLOWED, "a byte count") if isinstance(value, str)
              else Decimal(value))
    if amount < 0:
        raise ValueError(f"{what}: {value!r} is negative; a byte count must be positive")
    count = int(amount.to_integral_value(rounding=ROUND_CEILING))
    if count == 0:
        raise ValueError(f"{what}: {value!r} is zero; a byte count here must be at least 1 byte")
    if count > MAX_BYTES:
        raise ValueError(f"{what}: {value!r} is above the largest byte count supported (2^63-1 bytes, about 8Ei)")
    return count


def _parse_text(text: str, what: str, allowed: str = ALLOWED, noun: str = "a rate") -> Decimal:
    # exact: the default 28 digits would round "9007199254740992.000000000000001" down to 2^53 (accepted),
    # where the CRDs and the chart compare the exact value (refused); 32 characters fit in 80 digits
    with localcontext() as ctx:
        ctx.prec = 80
        return _parse_exact(text, what, allowed, noun)


def _parse_exact(text: str, what: str, allowed: str, noun: str) -> Decimal:
    unit = "bit/s" if noun == "a rate" else "bytes"
    if len(text) > RATE_MAX_CHARS:
        raise ValueError(f"{what}: {text[:RATE_MAX_CHARS]!r}... is longer than {RATE_MAX_CHARS} characters; "
                         f"expected {allowed}")
    match = _QUANTITY.fullmatch(text)
    if not match:
        hint = ""
        near = _NEAR_MISS.fullmatch(text)
        if near and near["sign"] == "-":
            raise ValueError(f"{what}: {text!r} is negative; {noun} must be positive")
        if near and near["suffix"] in _SUB_UNIT:
            suffix = near["suffix"]
            raise ValueError(f'{what}: {text!r} uses {suffix!r}, which means {_SUB_UNIT[suffix]} {unit}; '
                             f'for mega{unit[:4] if unit == "bytes" else "bit"} write "M", e.g. "{near["num"]}M"')
        if re.match(r"^[+]?[0-9.]+[eE][+-]?[0-9]+$", text):
            hint = " (an exponent must be between -30 and 30)"
        elif text != text.strip():
            hint = " (no spaces around it)"
        elif re.match(r"^[\d.]+\s*[kKmMgGtT]?(bit|bps|b/s|bit/s|ibit)", text, re.IGNORECASE):
            hint = ' (units are implied: write "10M", not "10Mbit" or "10Mbps")'
        raise ValueError(f"{what}: {text!r} is not {allowed}{hint}")
    number, suffix = match[1], match[3] or ""
    if match[4] is not None:  # an exponent ("1e3"), not a suffix ("1Ei")
        try:
            return Decimal(number).scaleb(int(suffix[1:]))
        except InvalidOperation as exc:
            raise ValueError(f"{what}: {text!r} is not {allowed}") from exc
    value = Decimal(number)
    if suffix in _BINARY:
        return value * (1 << _BINARY[suffix])
    return value.scaleb(_DECIMAL[suffix])


def format_bps(bps: float) -> str:
    """Short decimal form for tables: 0, 999, 500k, 10M, 1.5G, 12.3T; "unlimited" for MAX_BPS and above."""
    if bps >= MAX_BPS:
        return "unlimited"
    if bps < 0:
        return "-" + format_bps(-bps)
    for suffix, power in (("P", 15), ("T", 12), ("G", 9), ("M", 6), ("k", 3)):
        scaled = bps / 10**power
        if scaled >= 1 - 5e-4:
            return _trim(scaled) + suffix
    return _trim(bps)


def _trim(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def human_bps(bps: float) -> str:
    """A rate for people reading a table or a log line: "12.3 Mbit/s"."""
    bps = float(bps or 0)
    for unit, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= div:
            return f"{bps / div:.1f} {unit}"
    return f"{bps:.0f} bit/s"


def human_bytes(n: float) -> str:
    """A byte count for people: "1.5 GiB"."""
    n = float(n or 0)
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


# The least a pod is ever given (rate, demand, safe floor): enough for DNS and a health check,
# and far above where HTB's bucket timing overflows.
TRICKLE_BPS = 8_000
