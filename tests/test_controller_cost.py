"""Cost per team, scope and direction in the controller (controller/cost.py, issue 39) through the real
allocator: reports' internet counters and per-scope counters feed the keeper; the exported cost agrees with
bytes x price (core.scopes.cost) from the same counters; a refused NetworkScopes keeps the last valid prices;
nothing is counted without prices. Pure: no API server."""
from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

from prometheus_client import CollectorRegistry

from controller.allocator import Allocator
from controller.cost import CostCollector, CostKeeper
from core.direction import Direction
from core.policy import load_policy
from core.scopes import GIB, Scope, cost
from core.wire import NodeReport, PodReport
from tests.test_scopes import EXAMPLE

UP, DOWN = Direction.UPLOAD, Direction.DOWNLOAD
DAY1 = datetime(2026, 3, 10, 12, 0, tzinfo=timezone.utc).timestamp()


def _policy():
    budget = {"metadata": {"name": "main"}, "spec": {"total": "100M", "ingressTotal": "100M", "teams": [
        {"name": "research", "namespaces": ["research"]}, {"name": "web", "namespaces": ["web"]}]}}
    policy, problems = load_policy([], [budget])
    assert problems == []
    return policy


def _report(n: int, epoch: str = "boot-1") -> NodeReport:
    """Pod a (research) and w (web) with counters that grow with n (GiB-scale, so prices show)."""
    def pod(ns, name, k):
        return PodReport(ns, name, 1e6, 1e6, ingress_usage_bps=1e6, ingress_demand_bps=1e6, uid=f"uid-{name}",
                         bytes_total=k * n * GIB, ingress_bytes_total=2 * k * n * GIB,
                         scope_bytes_total={"cross-zone": 3 * k * n * GIB, "cross-region": k * n * GIB // 2},
                         ingress_scope_bytes_total={"cross-zone": 5 * k * n * GIB})
    return NodeReport("n1", [pod("research", "a", 1), pod("web", "w", 2)], epoch=epoch, shapes_ingress=True)


def _setup():
    policy = _policy()
    keeper = CostKeeper(lambda: DAY1)
    alloc = Allocator(lambda: (policy, []), cost=keeper)
    return alloc, keeper


def _feed(alloc, *reports):
    for r in reports:
        alloc({"n1": alloc.prepare(r)})


def _samples(keeper) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(CostCollector(keeper, lambda: True))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in registry.collect() for s in m.samples}


def test_nothing_is_counted_without_prices():
    alloc, keeper = _setup()
    _feed(alloc, _report(1), _report(2))
    assert keeper.figures() == []
    assert [k for k in _samples(keeper) if k[0].startswith("netagent_team_")] == []


def test_cost_agrees_with_bytes_times_price_from_the_same_counters():
    alloc, keeper = _setup()
    assert keeper.set_scopes(EXAMPLE) == []
    _feed(alloc, _report(1), _report(3))  # the first report is each pod's baseline: 2 steps of n counted
    prices = keeper.prices
    assert prices is not None
    want_bytes = {("research", Scope.INTERNET, UP): 2 * GIB, ("research", Scope.INTERNET, DOWN): 4 * GIB,
                  ("research", Scope.CROSS_ZONE, UP): 6 * GIB, ("research", Scope.CROSS_ZONE, DOWN): 10 * GIB,
                  ("research", Scope.CROSS_REGION, UP): GIB}
    want_bytes.update({("web", s, d): 2 * b for (_, s, d), b in list(want_bytes.items())})
    got = {(t, s, d): total for t, s, d, _, total in keeper.figures()}
    assert got == want_bytes
    samples = _samples(keeper)
    for (team, scope, d), nbytes in want_bytes.items():
        labels = (("direction", d.metric_word), ("scope", scope.value), ("team", team))
        priced = (("currency", "USD"),) + labels
        assert samples[("netagent_team_scope_bytes_total", labels)] == nbytes
        assert samples[("netagent_team_cost_total", priced)] == float(cost(prices, nbytes, scope, d))
        assert samples[("netagent_team_cost_period", priced)] == float(cost(prices, nbytes, scope, d))
    # research: internet 2 GiB up x 0.09 + 4 GiB down x 0; cross-zone 6 x 0.01 + 10 x 0.01; cross-region 1 x 0.02
    assert keeper.team_cost("research") == Decimal("0.18") + Decimal("0.16") + Decimal("0.02")
    assert keeper.team_cost("web") == 2 * keeper.team_cost("research")


def test_a_retried_report_adds_nothing_and_a_new_epoch_counts_afresh():
    alloc, keeper = _setup()
    keeper.set_scopes(EXAMPLE)
    _feed(alloc, _report(1), _report(2), _report(2), _report(1))  # retried, then an older (reordered) one
    before = keeper.figures()
    assert {(t, s, d): total for t, s, d, _, total in before}[("research", Scope.CROSS_ZONE, UP)] == 3 * GIB
    _feed(alloc, _report(1, epoch="boot-2"))  # the agent restarted: its counters count from 0
    after = {(t, s, d): total for t, s, d, _, total in keeper.figures()}
    assert after[("research", Scope.CROSS_ZONE, UP)] == 6 * GIB


def test_a_refused_description_keeps_the_last_valid_prices():
    alloc, keeper = _setup()
    keeper.set_scopes(EXAMPLE)
    bad = {**EXAMPLE, "spec": {**EXAMPLE["spec"], "prices": {"currency": "XXY", "internet": {"egress": "-1"}}}}
    problems = keeper.set_scopes(bad)
    assert any("spec.prices.currency" in p for p in problems) and any("spec.prices.internet.egress" in p
                                                                      for p in problems)
    assert keeper.prices is not None and keeper.prices.currency == "USD"
    assert _samples(keeper)[("netagent_controller_scopes_problems", ())] == len(problems)
    keeper.set_scopes(None)  # the object deleted: no prices, nothing counted
    assert keeper.prices is None


def test_a_spent_cost_quota_holds_the_teams_internet_traffic_at_its_exhausted_rates():
    """research may spend 0.5 USD a Month; its cost is mostly cross-zone (never shaped), yet once the sum over
    every priced scope reaches 0.5 its internet traffic is held at its exhaustedRates, both directions."""
    from controller.quota import QuotaKeeper
    budget = {"metadata": {"name": "main"}, "spec": {"total": "100M", "ingressTotal": "100M", "teams": [
        {"name": "research", "namespaces": ["research"], "min": "30M",
         "quota": {"period": "Month", "cost": "0.5", "exhaustedRate": "2M", "ingress": {"exhaustedRate": "3M"}}},
        {"name": "web", "namespaces": ["web"]}]}}
    policy, problems = load_policy([], [budget])
    assert problems == []
    quota, keeper = QuotaKeeper(lambda: DAY1), CostKeeper(lambda: DAY1)
    quota.set_policy(policy)
    quota.resume(None)
    keeper.set_scopes(EXAMPLE)
    alloc = Allocator(lambda: (policy, []), quota=quota, cost=keeper)

    def round_(n):
        result = alloc({"n1": alloc.prepare(_report(n))})
        return {p.name: p for p in result.by_node["n1"]}

    round_(0)  # baselines
    pods = round_(2)  # research: 0.18 USD per step of n (see above): 0.36, below 0.5
    assert pods["a"].limit_bps > 30e6 and quota.exhausted(UP) == frozenset()
    round_(3)  # 0.54 USD: spent; the next round holds it
    pods = round_(3)
    assert keeper.spent(quota.quotas) == {"research"}
    assert quota.exhausted(UP) == quota.exhausted(DOWN) == {"research"}
    assert pods["a"].limit_bps <= 2e6 and pods["a"].ingress_limit_bps <= 3e6
    assert pods["w"].limit_bps > 30e6  # web has no quota: not held


def test_the_period_cost_is_persisted_with_the_bytes_and_a_new_leader_resumes_it():
    """status.quota carries each quota team's bytes per priced scope and its cost (the CRD keeps the fields:
    its schema names them, so the API server does not prune them); a new leader resumes them, so a spent
    cost quota stays spent across a failover."""
    import yaml
    from controller.quota import QuotaKeeper
    from tests.kube import REPO
    budget = {"metadata": {"name": "main"}, "spec": {"total": "100M", "ingressTotal": "100M", "teams": [
        {"name": "research", "namespaces": ["research"], "quota": {"period": "Month", "cost": "0.5"}},
        {"name": "web", "namespaces": ["web"]}]}}
    policy, _ = load_policy([], [budget])

    def leader(persisted):
        quota, keeper = QuotaKeeper(lambda: DAY1), CostKeeper(lambda: DAY1)
        quota.cost = keeper
        keeper.set_scopes(EXAMPLE)
        quota.set_policy(policy)
        quota.resume(persisted)
        return quota, keeper, Allocator(lambda: (policy, []), quota=quota, cost=keeper)

    quota, keeper, alloc = leader(None)
    for n in (0, 3, 3):
        alloc({"n1": alloc.prepare(_report(n))})
    status = quota.status()
    entry, = status["teams"]
    assert entry["costUsed"] == "0.540000" and entry["scopeUsed"]["cross-zone"] == str(9 * GIB)
    crd = yaml.safe_load((REPO / "charts/netagent/crds/egressbudgets.netagent.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    declared = schema["quota"]["properties"]["teams"]["items"]["properties"]
    assert set(entry) <= set(declared)
    assert set(entry["scopeUsed"]) == set(declared["scopeUsed"]["properties"])

    quota2, keeper2, alloc2 = leader(status)  # failover: the new leader resumes from status.quota
    assert keeper2.team_cost("research") == Decimal("0.54")
    alloc2({"n1": alloc2.prepare(_report(3, epoch="boot-1"))})  # its first report: baselines, nothing twice
    assert keeper2.team_cost("research") == Decimal("0.54") and quota2.exhausted(UP) == {"research"}


def test_netagent_status_shows_cost_per_team_from_v1_status():
    from cli import clusterview
    from controller.quota import QuotaKeeper
    from controller.state import ControllerState
    from controller.view import cluster_view
    from tests.test_status_cluster import snapshot
    budget = {"metadata": {"name": "main"}, "spec": {"total": "100M", "ingressTotal": "100M", "teams": [
        {"name": "research", "namespaces": ["research"], "quota": {"period": "Month", "cost": "0.5"}},
        {"name": "web", "namespaces": ["web"]}]}}
    policy, _ = load_policy([], [budget])
    quota, keeper = QuotaKeeper(lambda: DAY1), CostKeeper(lambda: DAY1)
    quota.set_policy(policy)
    quota.resume(None)
    keeper.set_scopes(EXAMPLE)
    state = ControllerState(Allocator(lambda: (policy, []), quota=quota, cost=keeper))
    for n in (0, 3):
        state.submit(None, _report(n))
    state.run_round()
    research, web = cluster_view(state)["cost"]
    assert research["team"] == "research" and research["currency"] == "USD"
    assert abs(research["period_cost"] - 0.54) < 1e-9 and research["quota_cost"] == 0.5 and research["spent"]
    assert abs(research["by_scope"]["cross-zone"] - 0.24) < 1e-9 and web["quota_cost"] is None
    snap = snapshot()
    snap["controller"]["view"]["cost"] = cluster_view(state)["cost"]
    text = clusterview.render(clusterview.view(snap))
    line = next(x for x in text.splitlines() if x.strip().startswith("research") and "USD" in x)
    assert "0.54 USD" in line and "0.50 USD SPENT" in line and "0.27 USD" in line, line  # internet 0.27
    assert "Cost:" in text and clusterview.view(snapshot())["costs"] == []


def test_a_new_period_starts_the_period_cost_at_zero_and_keeps_the_total():
    policy = _policy()
    now = [DAY1]
    keeper = CostKeeper(lambda: now[0])
    keeper.set_scopes(EXAMPLE)
    alloc = Allocator(lambda: (policy, []), cost=keeper)
    _feed(alloc, _report(0), _report(1))
    now[0] = datetime(2026, 4, 1, 0, 0, 1, tzinfo=timezone.utc).timestamp()  # the next calendar Month
    _feed(alloc, _report(2))
    got = {(t, s, d): (period, total) for t, s, d, period, total in keeper.figures()}
    assert got[("research", Scope.CROSS_ZONE, UP)] == (3 * GIB, 6 * GIB)  # only April's step in the period


def test_cross_zone_bytes_alone_mark_the_cost_figures_for_writing():
    """status.quota is written when the quota keeper's version moves: a cost quota team's bytes that are all
    cross-zone (no internet bytes for the volume ledger) move it too, so costUsed is persisted."""
    from controller.quota import QuotaKeeper
    budget = {"metadata": {"name": "main"}, "spec": {"total": "100M", "teams": [
        {"name": "research", "namespaces": ["research"], "quota": {"period": "Month", "cost": "100"}}]}}
    policy, _ = load_policy([], [budget])
    quota, keeper = QuotaKeeper(lambda: DAY1), CostKeeper(lambda: DAY1)
    quota.set_policy(policy)
    quota.resume(None)
    keeper.set_scopes(EXAMPLE)
    alloc = Allocator(lambda: (policy, []), quota=quota, cost=keeper)
    alloc({"n1": alloc.prepare(_report(0))})

    def cross_zone_only(n):
        pod = PodReport("research", "a", 1e6, 1e6, uid="uid-a", bytes_total=0, ingress_bytes_total=0,
                        scope_bytes_total={"cross-zone": n * GIB})
        return NodeReport("n1", [pod], epoch="boot-1")
    alloc({"n1": alloc.prepare(cross_zone_only(0))})
    before = quota.version
    alloc.prepare(cross_zone_only(1))
    assert quota.version > before


def test_the_array_path_counts_as_the_ledgers_and_never_twice():
    """controller/cost.py counts a node's unchanged pods on arrays (no Python step per pod): a duplicated, replayed
    or reordered report still adds nothing, and every figure equals the ledgers' own count of the same reports
    (the same keeper with the node cache dropped before each report), through pods and epochs changing."""
    def shrunk(n):  # pod w gone: the node's pods changed (the ledgers count, the arrays are rebuilt)
        r = _report(n)
        return NodeReport(r.node, r.pods[:1], epoch=r.epoch, shapes_ingress=True)

    seq = [_report(1), _report(2), _report(3), _report(3), _report(2), _report(5), shrunk(6), shrunk(6),
           _report(7), _report(1, epoch="boot-2"), _report(2, epoch="boot-2"), _report(3), _report(4, epoch="boot-2")]
    (alloc, keeper), (ref_alloc, ref) = _setup(), _setup()
    keeper.set_scopes(EXAMPLE)
    ref.set_scopes(EXAMPLE)
    for r in seq:
        _feed(alloc, r)
        ref._nodes.clear()  # the reference counts through the ledgers only
        _feed(ref_alloc, r)
        assert keeper.figures() == ref.figures()
    totals = {(t, s, d): total for t, s, d, _, total in keeper.figures()}
    # boot-1 up to 7 (the replays and the older report add nothing), then boot-2 from 0 up to 4 (its late
    # boot-1 report ignored): research's cross-zone upload 3 GiB per step
    assert totals[("research", Scope.CROSS_ZONE, UP)] == 3 * GIB * (7 - 1 + 4)
    assert keeper._nodes  # the arrays were in use
