"""bench/scale.py --quotas' pure parts (issue 38's overhead row): the budget it applies is one the
policy accepts with a quota on every team, and the window arithmetic and verdict judge what they say."""
import math

from bench.scale import (CLASSES, QUOTA_CPU_RATIO_MAX, TEAMS, WindowCost, budget_object, quota_verdict, stored_writes,
                         window_cost, with_quotas)
from collections import Counter
from core.direction import Direction
from core.policy import load_policy
from core.quota import DirectionQuota, Period


def test_every_team_gets_a_quota_the_policy_accepts_in_both_directions():
    budget = with_quotas(budget_object(100, 10))
    policy, problems = load_policy(CLASSES, [budget])
    assert not problems, problems
    quotas = [t.quota for t in policy.teams if t.name.startswith("team")]
    assert len(quotas) == TEAMS
    for q in quotas:
        assert q is not None and q.period is Period.MONTH
        for d in Direction:
            assert q.limits[d] == DirectionQuota(100 * 2**50, 10_000_000)
    # the bench's own object is left as it was (the first window's budget)
    assert all("quota" not in t for t in budget_object(100, 10)["spec"]["teams"])


def test_without_downloads_the_quota_is_for_uploads_only():
    budget = with_quotas(budget_object(100, 10, downloads=False))
    assert all("ingress" not in t["quota"] for t in budget["spec"]["teams"])
    policy, problems = load_policy(CLASSES, [budget])
    assert not problems, problems
    assert all(t.quota.limits[Direction.DOWNLOAD] is None for t in policy.teams if t.name.startswith("team"))


def test_window_cost_is_per_report_answered_and_per_minute():
    c = window_cost(leader_cores=0.4, answered=8000, measure_s=40, writes=100, netagent_writes=2, budget_writes=1)
    assert math.isclose(c.reports_per_s, 200)
    assert math.isclose(c.cpu_per_report_s, 0.002)
    assert math.isclose(c.writes_per_min, 150)
    assert math.isclose(c.netagent_writes_per_min, 3)
    assert math.isclose(c.budget_writes_per_min, 1.5)
    assert window_cost(0.4, 0, 40, 0, 0, 0).cpu_per_report_s == math.inf


def test_only_writes_the_api_server_stores_count_as_netagents():
    counts = Counter({("controller", "patch", "egressbudgets/status"): 4, ("controller", "create", "tokenreviews"): 900,
                      ("controller", "update", "leases"): 30, ("agent", "create", "events"): 1,
                      ("agent", "watch", "pods"): 50, ("system:admin", "patch", "egressbudgets"): 1,
                      ("controller", "get", "egressbudgets"): 7})
    assert stored_writes(counts) == 4 + 30 + 1
    assert stored_writes(counts, "egressbudgets") == 4


def test_the_verdict_judges_both_the_cpu_and_the_budget_writes():
    off = WindowCost(0.002, 200, 1000, 150, 2)
    assert quota_verdict(off, off._replace(cpu_per_report_s=0.002 * QUOTA_CPU_RATIO_MAX), 60)[0]
    assert not quota_verdict(off, off._replace(cpu_per_report_s=0.002 * QUOTA_CPU_RATIO_MAX * 1.01), 60)[0]
    # at 60 s and a 30 s status interval: at most 3 EgressBudget writes a minute more
    assert quota_verdict(off, off._replace(budget_writes_per_min=5), 60)[0]
    ok, why = quota_verdict(off, off._replace(budget_writes_per_min=6), 60)
    assert not ok and "FAIL" in why
    # the leases' writes are the same in both windows and are not judged
    assert quota_verdict(off, off._replace(netagent_writes_per_min=400), 60)[0]
