"""The NetworkScopes CRD (issue 39, charts/netagent/crds/networkscopes.netagent.io.yaml). The real
kube-apiserver accepts the issue's example and refuses what a schema can refuse: a negative or non-numeric price, a bad CIDR, an unknown scope under prices, a currency
that is not 3 upper-case letters. core/scopes.parse refuses each too."""
from __future__ import annotations

import json

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from core.scopes import parse
from tests.kube import REPO
from tests.test_scopes import EXAMPLE

CRD = REPO / "charts" / "netagent" / "crds" / "networkscopes.netagent.io.yaml"


def _crd() -> dict:
    return yaml.safe_load(CRD.read_text())


@pytest.fixture
def scopes_crd(kube_api):
    kube_api.kubectl("apply", "-f", "-", input=json.dumps(_crd()))
    try:
        kube_api.kubectl("wait", "--for=condition=Established", "crd/networkscopes.netagent.io")
        yield client.CustomObjectsApi(kube_api.admin)
    finally:
        kube_api.kubectl("delete", "crd", "networkscopes.netagent.io", "--ignore-not-found")


def _create(objects, spec) -> str | None:
    body = {**EXAMPLE, "spec": spec}
    try:
        objects.create_cluster_custom_object("netagent.io", "v1alpha1", "networkscopes", body, dry_run="All",
                                               field_validation="Strict")  # an unknown key refused, not pruned
    except ApiException as exc:
        # 422: the schema refuses; 400: strict decoding refuses an unknown field (an API server prunes it otherwise)
        assert exc.status in (400, 422), f"{spec!r}: {exc.status} {exc.body}"
        return exc.body
    return None


def _with(**kw):
    return {**EXAMPLE["spec"], **kw}


BAD = [
    (_with(prices={"currency": "USD", "internet": {"egress": "-0.09"}}), "spec.prices.internet.egress"),
    (_with(prices={"currency": "USD", "cross-zone": {"ingress": "cheap"}}), "spec.prices.cross-zone.ingress"),
    (_with(prices={"currency": "usd"}), "spec.prices.currency"),
    (_with(prices={"currency": "USDX"}), "spec.prices.currency"),
    (_with(prices={"currency": "USD", "moon": {"egress": "1"}}), "moon"),
    (_with(zones=[{"name": "a", "cidrs": ["10.0.0.300/18"]}]), "spec.zones[0].cidrs[0]"),
    (_with(regions=[{"name": "r", "cidrs": ["not-a-cidr"]}]), "spec.regions[0].cidrs[0]"),
]


def test_schema_accepts_the_example_and_refuses_the_bad_input(scopes_crd):
    assert _create(scopes_crd, EXAMPLE["spec"]) is None
    wrong = []
    for spec, fragment in BAD:
        body = _create(scopes_crd, spec)
        if body is None or fragment not in body:
            wrong.append(f"{spec!r}: {body}")
        # "usd" and "USDX" fail the table too; every case is a problem for the parser as well
        assert parse({"spec": spec}).description is None, spec
    assert not wrong, "\n".join(wrong)


EXAMPLES = {name: yaml.safe_load((REPO / "docs" / "examples" / f"networkscopes-{name}.yaml").read_text())
            for name in ("aws", "azure")}
# docs/scopes.md "Worked examples": one team's month, GiB per (scope, direction)
MONTH_GIB = {("internet", "egress"): 500, ("internet", "ingress"): 2000, ("cross-zone", "egress"): 3000,
             ("cross-zone", "ingress"): 3000, ("cross-region", "egress"): 100}


def test_the_docs_examples_parse_and_cost_what_the_docs_say():
    from decimal import Decimal

    from core.direction import Direction
    from core.scopes import GIB, Scope, cost
    want = {"aws": (Decimal("107"), Decimal("60")), "azure": (Decimal("42"), Decimal("0"))}
    for name, obj in EXAMPLES.items():
        parsed = parse(obj)
        assert parsed.problems == [] and parsed.description is not None and parsed.description.prices
        prices = parsed.description.prices
        by = {(s, d): cost(prices, gib * GIB, Scope(s), Direction.UPLOAD if d == "egress" else Direction.DOWNLOAD)
              for (s, d), gib in MONTH_GIB.items()}
        total, cross_zone = want[name]
        assert sum(by.values()) == total, name
        assert by[("cross-zone", "egress")] + by[("cross-zone", "ingress")] == cross_zone, name


def test_the_api_server_accepts_the_docs_examples(scopes_crd):
    for name, obj in EXAMPLES.items():
        assert _create(scopes_crd, obj["spec"]) is None, name
