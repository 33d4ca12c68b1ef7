"""core/scopes (issue 39 foundations): parsing NetworkScopes, its problems, the reference
classification, the LPM entries and their diff, prices (pure; no kernel here)."""
from decimal import Decimal
import ipaddress

from core.direction import Direction
from core.scopes import (CURRENCIES, MAX_CIDRS, SCOPE_IDS, Scope, cost, diff_entries, keep_last_valid,
                         lpm_entries, parse, scope_of)

EXAMPLE = {"apiVersion": "netagent.io/v1alpha1", "kind": "NetworkScopes", "metadata": {"name": "cluster"},
           "spec": {"zones": [{"name": "us-east-1a", "cidrs": ["10.0.0.0/18", "2001:db8:a::/48"]},
                              {"name": "us-east-1b", "cidrs": ["10.0.64.0/18"]}],
                    "regions": [{"name": "us-west-2", "cidrs": ["10.1.0.0/16"]}],
                    "prices": {"currency": "USD", "internet": {"egress": "0.09", "ingress": "0"},
                               "cross-zone": {"egress": "0.01", "ingress": "0.01"},
                               "cross-region": {"egress": "0.02", "ingress": "0"}}}}


def spec(**kw):
    return {"spec": {**EXAMPLE["spec"], **kw}}


def test_example_classifies_by_the_issue_rules():
    p = parse(EXAMPLE, pod_cidrs=["172.16.0.0/16"], service_cidrs=["172.17.0.0/16"])
    assert p.problems == [] and p.description is not None
    d = p.description
    assert scope_of(d, "10.0.1.1", "us-east-1a") is Scope.INTERNAL
    assert scope_of(d, "2001:db8:a::1", "us-east-1a") is Scope.INTERNAL
    assert scope_of(d, "10.0.65.1", "us-east-1a") is Scope.CROSS_ZONE
    assert scope_of(d, "10.0.1.1", "us-east-1b") is Scope.CROSS_ZONE
    assert scope_of(d, "10.1.2.3", "us-east-1a") is Scope.CROSS_REGION
    assert scope_of(d, "172.16.3.4", "us-east-1a") is Scope.INTERNAL  # internal, in no zone
    assert scope_of(d, "192.0.2.1", "us-east-1a") is Scope.INTERNET
    assert scope_of(d, "2001:db8:b::1", "us-east-1a") is Scope.INTERNET
    assert scope_of(d, "10.0.1.1", None) is Scope.CROSS_ZONE  # a node without a zone label


def test_lpm_entries_are_a_diffable_dict():
    d = parse(EXAMPLE).description
    assert d is not None
    a = lpm_entries(d, "us-east-1a")
    assert a[ipaddress.ip_network("10.0.0.0/18")] == SCOPE_IDS[Scope.INTERNAL]
    moved = spec(zones=[{"name": "us-east-1a", "cidrs": ["10.0.0.0/18", "2001:db8:a::/48"]},
                        {"name": "us-east-1b", "cidrs": ["10.0.64.0/19"]}])
    d2 = parse(moved).description
    assert d2 is not None
    ups, dels = diff_entries(a, lpm_entries(d2, "us-east-1a"))
    assert ups == {ipaddress.ip_network("10.0.64.0/19"): SCOPE_IDS[Scope.CROSS_ZONE]}
    assert dels == [ipaddress.ip_network("10.0.64.0/18")]
    assert diff_entries(a, a) == ({}, [])


def test_bad_input_names_the_field_and_keeps_the_last_valid():
    good = parse(EXAMPLE).description
    cases = {
        "spec.zones[1].cidrs[0]": spec(zones=[{"name": "a", "cidrs": ["10.0.0.0/16"]}, {"name": "b", "cidrs": ["10.0.64.0/18"]}]),
        "spec.regions[0].cidrs[0]": spec(regions=[{"name": "r", "cidrs": ["10.0.0.0/8"]}]),
        "spec.zones[0].cidrs[0]": spec(zones=[{"name": "a", "cidrs": ["10.0.0.300/18"]}]),
        "spec.prices.internet.egress": spec(prices={"currency": "USD", "internet": {"egress": "-1"}}),
        "spec.prices.cross-zone.ingress": spec(prices={"currency": "USD", "cross-zone": {"ingress": "cheap"}}),
        "spec.prices.currency": spec(prices={"currency": "XYZ"}),
        "spec.prices.moon": spec(prices={"currency": "EUR", "moon": {"egress": "1"}}),
    }
    for field_, obj in cases.items():
        p = parse(obj)
        assert p.description is None and any(f.startswith(field_) for f in p.problems), (field_, p.problems)
        assert keep_last_valid(good, p) is good
    p = parse(EXAMPLE, pod_cidrs=["10.0.0.0/16"])
    assert any("spec.zones[0].cidrs[0]" in f and "pod/service" in f for f in p.problems)
    p = parse(spec(prices={"currency": "USD", "internet": {"egress": 0.09}}))  # a float, never
    assert any(f.startswith("spec.prices.internet.egress") for f in p.problems)


def test_thousands_of_cidrs_bounded():
    nets = [str(n) for n in ipaddress.ip_network("10.0.0.0/8").subnets(new_prefix=20)]  # 4096
    assert parse({"spec": {"zones": [{"name": "a", "cidrs": nets}]}}).problems == []
    nets2 = [str(n) for n in ipaddress.ip_network("10.0.0.0/8").subnets(new_prefix=21)][: MAX_CIDRS + 1]
    p = parse({"spec": {"zones": [{"name": "a", "cidrs": nets2}]}})
    assert p.description is None and any("at most 4096" in f for f in p.problems)


def test_cost_is_decimal_per_gib():
    d = parse(EXAMPLE).description
    assert d is not None and d.prices is not None
    assert cost(d.prices, 2**30, Scope.INTERNET, Direction.UPLOAD) == Decimal("0.09")
    assert cost(d.prices, 3 * 2**29, Scope.CROSS_ZONE, Direction.DOWNLOAD) == Decimal("0.015")
    assert cost(d.prices, 2**30, Scope.INTERNAL, Direction.UPLOAD) == 0
    assert {"USD", "EUR", "JPY"} <= CURRENCIES and len(CURRENCIES) > 150
