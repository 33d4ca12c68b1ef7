"""The CRD schema for issue 38's quota fields, held here until it joins the EgressBudget CRD (the chart's crds/,
its revision, deploy/ and values.schema.json move together: docs/quotas.md, "What is not built yet"). The real
kube-apiserver refuses the issue's Bad-input list and accepts its example, through a throwaway CRD of its own
group that carries exactly QUOTA_SCHEMA and TIME_ZONE_SCHEMA beside a team's max/ingress.max."""
from __future__ import annotations

import json
import re

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from core.direction import PerDirection
from core.quantity import RATE_MAX_CHARS, RATE_PATTERN
from core.quota import PERIODS, parse_team_quota, parse_time_zone

_BYTES_RULES = f"""
x-kubernetes-int-or-string: true
anyOf: [{{type: integer}}, {{type: string}}]
maxLength: {RATE_MAX_CHARS}
x-kubernetes-validations:
- rule: "string(self).matches('{RATE_PATTERN}')"
  message: >-
    must be a byte count: a number with an optional suffix k, M, G, T, P, E (powers of 1000) or Ki, Mi, Gi, Ti,
    Pi, Ei (powers of 1024) ("500Gi", "50Ti", "50T"); no units ("50TB" is "50T")
- rule: "!isQuantity(string(self)) || quantity(string(self)).isGreaterThan(quantity('0'))"
  message: must be above zero (leave the quota out for no quota)
# the API server's quantity() clamps an amount of 2^63-1 and more to 2^63-1 (9Ei equals 8Ei there), so the
# bound is "below 2^63-1": the schema's largest is 2^63-2, the parser's (exact) 2^63-1
- rule: "!isQuantity(string(self)) || quantity(string(self)).isLessThan(quantity('9223372036854775807'))"
  message: must be below 2^63-1 bytes (8Ei)
"""
_RATE_RULES = f"""
x-kubernetes-int-or-string: true
anyOf: [{{type: integer}}, {{type: string}}]
maxLength: {RATE_MAX_CHARS}
x-kubernetes-validations:
- rule: "string(self).matches('{RATE_PATTERN}')"
  message: >-
    must be a rate in bit/s: a number with an optional suffix k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei
    ("500k", "10M", "1.5G"); no units ("10Mbit" is "10M") and no "m", which means milli
- rule: "!isQuantity(string(self)) || quantity(string(self)).isGreaterThan(quantity('0'))"
  message: must be above zero (leave it out for only the safe floor once the quota is spent)
- rule: "!isQuantity(string(self)) || quantity(string(self)).compareTo(quantity('8Pi')) <= 0"
  message: must be at most 8Pi bit/s (2^53, about 9P)
"""


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line if line else line for line in text.strip("\n").splitlines())


# teams[].quota: to paste under the EgressBudget CRD's teams.items.properties
QUOTA_SCHEMA = f"""
type: object
description: >-
  A volume quota: the team's internet bytes per calendar period (docs/quotas.md). Top level = uploads,
  ingress = downloads.
required: [period]
properties:
  period:
    type: string
    enum: {json.dumps(list(PERIODS))}
    description: Calendar period in spec.quotaTimeZone (UTC if unset), for both directions.
  bytes:
    description: Internet uploads allowed per period, in bytes ("50Ti" is 50x2^40, "50T" 50x10^12).
{_indent(_BYTES_RULES, 4)}
  exhaustedRate:
    description: bit/s the whole team may still upload once the period's bytes are spent; unset, the safe floor.
{_indent(_RATE_RULES, 4)}
  ingress:
    type: object
    properties:
      bytes:
        description: Internet downloads allowed per period, in bytes.
{_indent(_BYTES_RULES, 8)}
      exhaustedRate:
        description: bit/s the whole team may still download once spent; unset, the safe floor.
{_indent(_RATE_RULES, 8)}
    x-kubernetes-validations:
    - rule: "!has(self.exhaustedRate) || has(self.bytes)"
      message: ingress.exhaustedRate needs ingress.bytes
x-kubernetes-validations:
- rule: "has(self.bytes) || (has(self.ingress) && has(self.ingress.bytes))"
  message: a quota needs bytes (uploads) or ingress.bytes (downloads)
- rule: "!has(self.exhaustedRate) || has(self.bytes)"
  message: exhaustedRate needs bytes
"""
# beside the team's own rules: an exhaustedRate above the team's cap (the parser says it too)
TEAM_RULES = """
- rule: "!has(self.quota) || !has(self.quota.exhaustedRate) || !has(self.max) || !isQuantity(string(self.quota.exhaustedRate)) || !isQuantity(string(self.max)) || quantity(string(self.quota.exhaustedRate)).compareTo(quantity(string(self.max))) <= 0"
  message: a team's quota.exhaustedRate must not be above its max
  fieldPath: .quota.exhaustedRate
- rule: "!has(self.quota) || !has(self.quota.ingress) || !has(self.quota.ingress.exhaustedRate) || !has(self.ingress) || !has(self.ingress.max) || !isQuantity(string(self.quota.ingress.exhaustedRate)) || !isQuantity(string(self.ingress.max)) || quantity(string(self.quota.ingress.exhaustedRate)).compareTo(quantity(string(self.ingress.max))) <= 0"
  message: a team's quota.ingress.exhaustedRate must not be above its ingress.max
  fieldPath: .quota.ingress.exhaustedRate
"""
# spec.quotaTimeZone: the shape of an IANA name; the controller's parser says whether the zone exists
TIME_ZONE_SCHEMA = """
type: string
maxLength: 64
pattern: '^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$'
description: IANA time zone of the quota periods ("Europe/Berlin"); unset, UTC.
"""

GROUP = "quotatest.netagent.io"
GOOD = {"period": "Month", "bytes": "50Ti", "exhaustedRate": "100M",
        "ingress": {"bytes": "200Ti", "exhaustedRate": "500M"}}
BAD = [
    ({"period": "Month", "bytes": "-1Ti"}, "bytes"),
    ({"period": "Month", "bytes": "0"}, "must be above zero"),
    ({"period": "Month", "bytes": 0}, "must be above zero"),
    ({"period": "Year", "bytes": "1Ti"}, "Unsupported value"),
    ({"period": "month", "bytes": "1Ti"}, "Unsupported value"),
    ({"bytes": "1Ti"}, "period"),
    # 2^63 and more, in every form (the parser's exact refusals: tests/test_quantity_bytes.py)
    ({"period": "Month", "bytes": "8Ei"}, "below 2^63-1"), ({"period": "Month", "bytes": "9223372036854775807"}, "below"),
    ({"period": "Month", "bytes": "9Ei"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "10000000000000000000"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "1e30"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "8.5Ei"}, "below 2^63-1"), ({"period": "Month", "bytes": "100Ei"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "9.5E"}, "below 2^63-1"), ({"period": "Month", "bytes": "20E"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "9000Pi"}, "below 2^63-1"), ({"period": "Month", "bytes": "1e19"}, "below 2^63-1"),
    ({"period": "Month", "bytes": "50TB"}, "must be a byte count"),
    ({"period": "Month", "bytes": "lots"}, "must be a byte count"),
    ({"period": "Month", "bytes": "1" * 40}, "bytes"),
    ({"period": "Month", "ingress": {"bytes": "-5"}}, "ingress.bytes"),
    ({"period": "Month", "bytes": "1Ti", "exhaustedRate": "10Mbit"}, "must be a rate"),
    ({"period": "Month", "bytes": "1Ti", "exhaustedRate": "2G"}, "must not be above its max"),
    ({"period": "Month", "ingress": {"bytes": "1Ti", "exhaustedRate": "3G"}}, "must not be above its ingress.max"),
    ({"period": "Month"}, "needs bytes"),
    ({"period": "Month", "exhaustedRate": "1M", "ingress": {"bytes": "1G"}}, "exhaustedRate needs bytes"),
]


def _crd() -> dict:
    team = yaml.safe_load(f"""
type: object
properties:
  max: {{x-kubernetes-int-or-string: true, anyOf: [{{type: integer}}, {{type: string}}], maxLength: 32}}
  ingress:
    type: object
    properties:
      max: {{x-kubernetes-int-or-string: true, anyOf: [{{type: integer}}, {{type: string}}], maxLength: 32}}
  quota:
{_indent(QUOTA_SCHEMA, 4)}
x-kubernetes-validations:
{_indent(TEAM_RULES, 0)}
""")
    spec = {"type": "object", "properties": {"quotaTimeZone": yaml.safe_load(TIME_ZONE_SCHEMA),
                                             "teams": {"type": "array", "maxItems": 64, "items": team}}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"quotabudgets.{GROUP}"},
            "spec": {"group": GROUP, "scope": "Cluster",
                     "names": {"plural": "quotabudgets", "singular": "quotabudget", "kind": "QuotaBudget"},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {"type": "object",
                                                                  "properties": {"spec": spec}}}}]}}


@pytest.fixture
def quota_crd(kube_api):
    body = json.dumps(_crd())
    kube_api.kubectl("apply", "-f", "-", input=body)
    try:
        kube_api.kubectl("wait", "--for=condition=Established", f"crd/quotabudgets.{GROUP}")
        yield client.CustomObjectsApi(kube_api.admin)
    finally:
        kube_api.kubectl("delete", "crd", f"quotabudgets.{GROUP}", "--ignore-not-found")


def _create(objects, quota, zone=None) -> str | None:
    spec: dict = {"teams": [{"max": "1G", "ingress": {"max": "2G"}, "quota": quota}]}
    if zone is not None:
        spec["quotaTimeZone"] = zone
    body = {"apiVersion": f"{GROUP}/v1", "kind": "QuotaBudget", "metadata": {"name": "q"}, "spec": spec}
    try:
        objects.create_cluster_custom_object(GROUP, "v1", "quotabudgets", body, dry_run="All")
    except ApiException as exc:
        assert exc.status == 422, f"{quota!r}: {exc.status} {exc.body}"
        return exc.body
    return None


def test_schema_refuses_the_bad_input_and_accepts_the_example(quota_crd):
    assert _create(quota_crd, GOOD, zone="Europe/Berlin") is None
    assert _create(quota_crd, {"period": "Day", "ingress": {"bytes": "1G"}}) is None
    assert _create(quota_crd, {"period": "Week", "bytes": "9223372036854775806"}) is None
    assert _create(quota_crd, {"period": "Week", "bytes": "7Ei"}) is None
    wrong = []
    for quota, fragment in BAD:
        body = _create(quota_crd, quota)
        if body is None or fragment not in body:
            wrong.append(f"{quota!r}: {body}")
        # the parser refuses each too (the previous valid policy stays in force there), but 2^63-1 (its largest)
        if quota.get("bytes") != "9223372036854775807":
            assert parse_team_quota(quota, "q", team_max_bps=PerDirection(10**9, 2 * 10**9))[0] is None, quota
    assert not wrong, "\n".join(wrong)
    for zone in ("../etc/passwd", "Europe Berlin", "x" * 65):
        assert _create(quota_crd, GOOD, zone=zone) is not None, zone
        assert parse_time_zone(zone, "z")[1], zone


def test_schema_carries_the_parsers_pattern():
    text = QUOTA_SCHEMA
    assert text.count(".matches('") == text.count(f".matches('{RATE_PATTERN}')") == 4
    assert re.search(r"enum: \[\"Day\", \"Week\", \"Month\"\]", text)
