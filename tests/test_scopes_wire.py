"""The per-scope byte counters on the wire (issue 39, core/wire.py PodReport.scope_bytes_total and
ingress_scope_bytes_total): bounded and checked by the decoder; a report without them (an older agent)
decodes with {} for both."""
from __future__ import annotations

import msgspec
import pytest

import core.wire as wire
from core.direction import Direction
from core.quantity import MAX_BYTES

POD = {"namespace": "ns", "name": "p", "usage_bps": 0.0, "demand_bps": 0.0}


def _decode(**pod) -> wire.NodeReport:
    return wire.report_decoder.decode(msgspec.json.encode({"node": "n1", "pods": [{**POD, **pod}]}))


def test_old_and_new_agents_decode():
    old, = _decode().pods
    assert [dict(wire.POD_SCOPE_BYTES[d](old)) for d in Direction] == [{}, {}]
    new, = _decode(scope_bytes_total={"cross-zone": 123, "cross-region": 0},
                   ingress_scope_bytes_total={"cross-zone": MAX_BYTES}).pods
    assert dict(wire.POD_SCOPE_BYTES[Direction.UPLOAD](new)) == {"cross-zone": 123, "cross-region": 0}
    assert dict(wire.POD_SCOPE_BYTES[Direction.DOWNLOAD](new)) == {"cross-zone": MAX_BYTES}


@pytest.mark.parametrize("field, value, fragment", [
    ("scope_bytes_total", {"internet": 1}, "Invalid enum value 'internet'"),  # internet stays in bytes_total
    ("scope_bytes_total", {"internal": 1}, "Invalid enum value 'internal'"),
    ("scope_bytes_total", {"cross-zone": -1}, ">= 0"),
    ("ingress_scope_bytes_total", {"cross-zone": MAX_BYTES + 1}, "<= "),
    ("ingress_scope_bytes_total", {"cross-region": 1.5}, "Expected `int`"),
    ("scope_bytes_total", [1, 2], "Expected `object | null`"),
])
def test_bad_scope_counters_are_refused_naming_the_field(field, value, fragment):
    with pytest.raises(msgspec.ValidationError) as caught:
        _decode(**{field: value})
    assert fragment in str(caught.value) and field in str(caught.value), str(caught.value)
