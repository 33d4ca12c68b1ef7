"""Cost quotas (issue 39, docs/scopes.md): EgressBudget `teams[].quota.cost`, a decimal amount in the
NetworkScopes currency. The real kube-apiserver (a server-side dry run against the chart's CRD) and the
parser (core/quota.py) accept the same good quotas and each refuses the bad ones, naming the field."""
from __future__ import annotations

from decimal import Decimal

import pytest
from kubernetes import client

from core.direction import Direction, PerDirection
from core.quota import parse_team_quota
from tests.test_agent_kube import install_crds
from tests.test_quota_crd import _create

CAPS = PerDirection(10**9, 2 * 10**9)
GOOD = [
    {"period": "Month", "cost": "5000"},
    {"period": "Month", "cost": "12.50", "bytes": "50Ti"},
    {"period": "Day", "cost": "1", "exhaustedRate": "10M", "ingress": {"exhaustedRate": "20M"}},
]
BAD = [
    ({"period": "Month", "cost": "-5"}, "cost"),
    ({"period": "Month", "cost": "five"}, "cost"),
    ({"period": "Month", "cost": "0"}, "cost"),
    ({"period": "Month", "cost": "0.00"}, "cost"),
    ({"period": "Month", "cost": "1e3"}, "cost"),
    ({"period": "Month", "cost": "1" * 40}, "cost"),
    ({"period": "Month", "cost": "10", "exhaustedRate": "2G"}, "exhaustedRate"),  # above the team's max
    ({"period": "Month", "exhaustedRate": "1M"}, "needs bytes"),  # neither bytes nor cost
]


def test_parser_reads_cost_and_its_exhausted_rates():
    quota, problems = parse_team_quota(GOOD[2], "EgressBudget b: teams[t].quota", CAPS)
    assert problems == [] and quota is not None
    assert quota.cost == Decimal("1") and quota.limits == PerDirection(None, None)
    assert quota.exhausted_bps(Direction.UPLOAD) == 10**7 and quota.exhausted_bps(Direction.DOWNLOAD) == 2 * 10**7
    both, _ = parse_team_quota(GOOD[1], "q", CAPS)
    assert both is not None and both.cost == Decimal("12.50") and both.limits.upload is not None
    assert both.exhausted_bps(Direction.UPLOAD) is None  # the safe floor


@pytest.mark.parametrize("quota, field", [(q, f) for q, f in BAD if f != "needs bytes"] + [
    ({"period": "Month", "cost": "NaN"}, "cost"), ({"period": "Month", "cost": True}, "cost")])
def test_parser_refuses_a_bad_cost_naming_the_field(quota, field):
    parsed, problems = parse_team_quota(quota, "EgressBudget b: teams[t].quota", CAPS)
    assert parsed is None and any(f"teams[t].quota.{field}" in p for p in problems), problems


@pytest.fixture
def budgets(kube_api):
    install_crds(kube_api)
    return client.CustomObjectsApi(kube_api.admin)


def test_schema_accepts_cost_quotas_and_refuses_the_bad_ones(budgets):
    for quota in GOOD:
        assert _create(budgets, quota) is None, quota
        assert parse_team_quota(quota, "q", CAPS)[1] == [], quota
    wrong = []
    for quota, fragment in BAD:
        body = _create(budgets, quota)
        if body is None or fragment not in body:
            wrong.append(f"{quota!r}: {body}")
        assert parse_team_quota(quota, "q", CAPS)[0] is None, quota
    assert not wrong, "\n".join(wrong)
