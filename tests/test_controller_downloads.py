"""Downloads (ingress) in the controller's agent API over real HTTP on loopback (tests/test_controller_api.py's
server): the same engine against its own total, answered only to agents that shape them; the download
metrics and gain."""
from __future__ import annotations

import pytest

from controller.allocator import Allocator
from controller.state import ControllerState
from core.direction import PerDirection
from core.wire import MAX_ANNOTATION_VALUE
from tests.test_controller_api import new_state, pod, policy_source, post, report, serve


IN_CLASSES = [
    {"kind": "EgressClass", "metadata": {"name": "bulk"}, "spec": {"weight": 1, "max": "80M"}},
    {"kind": "EgressClass", "metadata": {"name": "interactive"},
     "spec": {"weight": 3, "min": "5M", "ingress": {"weight": 3, "max": "30M"}}},
]
IN_BUDGET = {"kind": "EgressBudget", "metadata": {"name": "default"}, "spec": {
    "total": "100M", "ingressTotal": "60M",
    "teams": [
        {"name": "research", "namespaces": ["research"], "weight": 1, "defaultClass": "bulk", "ingress": {"weight": 2}},
        {"name": "web", "namespaces": ["web"], "weight": 2, "min": "10M"},  # no ingress block: weight 2
    ],
}}


def down(namespace: str, name: str, ingress_demand: float, cls: str | None = None, ingress_bandwidth=None,
         ingress_usage: float = 0.0) -> dict:
    return {**pod(namespace, name, 20e6, cls=cls), "ingress_demand_bps": ingress_demand,
            "ingress_usage_bps": ingress_usage, "ingress_bandwidth": ingress_bandwidth}


async def test_download_demand_above_ingress_total_is_shared_by_team_and_class_weights():
    """Two nodes whose agents shape downloads want 500M against ingressTotal 60M: the answers'
    download allocations add up to the budget, split by the teams' ingress weights (research 2,
    web 2 from its upload weight) and inside a team by the classes' (bulk 1, interactive 3, capped
    at 30M); uploads are allocated as before, against their own total."""
    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    a_pods = [down("research", "r1", 100e6), down("research", "r2", 100e6, cls="interactive"),
              down("web", "w1", 100e6)]
    b_pods = [down("web", "w2", 100e6), down("research", "r3", 100e6)]
    async with serve(state) as (session, base):
        for node, pods in (("node-a", a_pods), ("node-b", b_pods)):
            assert (await post(session, base, node, report(node, pods, shapes_ingress=True)))[0] == 200
        result = state.run_round()
        _, ans_a, _ = await post(session, base, "node-a", report("node-a", a_pods, shapes_ingress=True))
        _, ans_b, _ = await post(session, base, "node-b", report("node-b", b_pods, shapes_ingress=True))
    got = {p["name"]: p for p in ans_a["pods"] + ans_b["pods"]}
    assert sum(p["ingress_allocation_bps"] for p in got.values()) == pytest.approx(60e6)
    # teams 1:1 (30M each); research: r2 (interactive, 3) : r1 : r3 (bulk, 1 each) = 18 : 6 : 6
    assert got["w1"]["ingress_allocation_bps"] == pytest.approx(15e6)
    assert got["w2"]["ingress_allocation_bps"] == pytest.approx(15e6)
    assert got["r2"]["ingress_allocation_bps"] == pytest.approx(18e6)
    assert got["r1"]["ingress_allocation_bps"] == pytest.approx(6e6)
    assert got["r3"]["ingress_allocation_bps"] == pytest.approx(6e6)
    for p in got.values():
        assert p["ingress_allocation_bps"] <= p["ingress_limit_bps"] <= 60e6 * (1 + 1e-9)
    assert got["r2"]["ingress_limit_bps"] <= 30e6 * (1 + 1e-9)  # the class's download cap
    assert sum(p["ingress_limit_bps"] for p in got.values()) <= 60e6 * (1 + 1e-9)
    for answer in (ans_a, ans_b):
        assert answer["node_ingress_rate_bps"] == pytest.approx(
            min(60e6, sum(p["ingress_limit_bps"] for p in answer["pods"])))
        assert answer["safe_ingress_floor_bps"] == pytest.approx(60e6 / 5)
    # uploads: their own total and weights (web 2 : research 1 of 100M, 20M demand each)
    assert sum(p["allocation_bps"] for p in got.values()) == pytest.approx(100e6)
    assert answer["safe_floor_bps"] == pytest.approx(100e6 / 5)
    ingress = result.summary.ingress
    assert (ingress.budget_bps, ingress.allocated_bps, ingress.demand_bps, ingress.nodes, ingress.pods) == \
        (60e6, pytest.approx(60e6), 500e6, 2, 5)
    assert ingress.teams["research"].allocated_bps == pytest.approx(30e6)
    assert ingress.groups[("research", "interactive")].allocated_bps == pytest.approx(18e6)
    assert result.summary.budget_bps == 100e6 and result.summary.demand_bps == pytest.approx(100e6)


async def test_an_agent_that_does_not_shape_downloads_gets_no_download_answer():
    """Older agents (no shapes_ingress) get None in every download field and their pods take no share
    of the download budget, even if their report carries download numbers."""
    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    async with serve(state) as (session, base):
        await post(session, base, "node-a", report("node-a", [down("web", "w1", 100e6)], shapes_ingress=True))
        await post(session, base, "node-old", report("node-old", [down("web", "w2", 100e6)]))
        result = state.run_round()
        _, new, _ = await post(session, base, "node-a", report("node-a", [down("web", "w1", 100e6)],
                                                                shapes_ingress=True))
        _, old, _ = await post(session, base, "node-old", report("node-old", [down("web", "w2", 100e6)]))
    assert new["pods"][0]["ingress_allocation_bps"] == pytest.approx(60e6)  # alone in the download budget
    assert (old["node_ingress_rate_bps"], old["safe_ingress_floor_bps"]) == (None, None)
    assert (old["pods"][0]["ingress_allocation_bps"], old["pods"][0]["ingress_limit_bps"]) == (None, None)
    assert old["pods"][0]["allocation_bps"] == pytest.approx(20e6)  # uploads as ever
    assert result.summary.ingress.nodes == 1 and result.summary.nodes == 2


async def test_bad_ingress_bandwidth_annotation_keeps_the_class_download_values():
    """A malformed kubernetes.io/ingress-bandwidth is ignored for that pod (its class's download
    values, reason InvalidIngressBandwidth, which the agent turns into an Event); a good one caps;
    an oversize one refuses that pod alone, as for the upload annotation."""
    from core.policy import REASON_INVALID_INGRESS_BANDWIDTH, resolve_pod

    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    pods = [down("research", "bad", 100e6, cls="interactive", ingress_bandwidth="-5M"),
            down("research", "capped", 100e6, cls="interactive", ingress_bandwidth="2M"),
            down("research", "huge", 100e6, ingress_bandwidth="9" * (MAX_ANNOTATION_VALUE + 1)),
            down("web", "fine", 100e6)]
    async with serve(state) as (session, base):
        code, answer, _ = await post(session, base, "node-a", report("node-a", pods, shapes_ingress=True))
        assert code == 200 and answer["refused"] == [{"namespace": "research", "name": "huge",
                                                      "reason": "AnnotationTooLong"}]
        state.run_round()
        _, answer, _ = await post(session, base, "node-a", report("node-a", pods, shapes_ingress=True))
    got = {p["name"]: p for p in answer["pods"]}
    assert set(got) == {"bad", "capped", "fine"}
    assert got["capped"]["ingress_limit_bps"] <= 2e6 * (1 + 1e-9)
    assert got["bad"]["ingress_allocation_bps"] == pytest.approx(28e6)  # 30M for research, less capped's 2M
    assert got["bad"]["ingress_limit_bps"] <= 30e6 * (1 + 1e-9)  # the class's cap, not unshaped
    assert got["fine"]["ingress_allocation_bps"] == pytest.approx(30e6)
    policy, _ = policy_source(IN_CLASSES, (IN_BUDGET,))()
    (reason, message), = resolve_pod(policy, "research", "interactive",
                                     PerDirection(None, "-5M")).problems
    assert reason == REASON_INVALID_INGRESS_BANDWIDTH and "kubernetes.io/ingress-bandwidth" in message


def test_controller_metrics_have_download_twins():
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics
    from core.wire import NodeReport, PodReport

    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    metrics = ControllerMetrics(state, lambda: True)
    state.submit(None, NodeReport("node-old", [PodReport("web", "o", 0, 1e6)]))
    state.run_round()
    before = generate_latest(metrics.registry).decode()
    assert "netagent_controller_budget_bytes_per_second 1.25e+07" in before
    # no agent shapes downloads yet: the download budget alone, with no agent keeping it (the
    # NetagentIngressNotShaped alert reads exactly this), and no per-team download view
    assert "netagent_controller_ingress_agents 0.0" in before
    assert "netagent_controller_ingress_budget_bytes_per_second 7.5e+06" in before
    assert "netagent_controller_ingress_allocated_bytes_per_second{" not in before
    plain = new_state()  # a budget without spec.ingressTotal: no download view at all
    plain_metrics = ControllerMetrics(plain, lambda: True)
    plain.submit(None, NodeReport("node-old", [PodReport("web", "o", 0, 1e6)]))
    plain.run_round()
    assert "netagent_controller_ingress_" not in generate_latest(plain_metrics.registry).decode()
    state.submit(None, NodeReport("node-a", [PodReport("web", "w", 0, 1e6, ingress_demand_bps=1e9)],
                                  shapes_ingress=True))
    state.run_round()
    text = generate_latest(metrics.registry).decode()
    for line in ("netagent_controller_ingress_budget_bytes_per_second 7.5e+06",
                 'netagent_controller_ingress_allocated_bytes_per_second{class="default",team="web"} 7.5e+06',
                 'netagent_controller_ingress_demand_bytes_per_second{class="default",team="web"} 1.25e+08',
                 'netagent_controller_ingress_used_bytes_per_second{class="default",team="web"} 0.0',
                 'netagent_controller_ingress_guarantee_unmet{team="web"} 0.0',
                 "netagent_controller_ingress_feedback_gain 1.0", "netagent_controller_ingress_oversubscribed 0.0",
                 "netagent_controller_ingress_agents 1.0", "netagent_controller_ingress_safe_floor_bytes_per_second",
                 'netagent_controller_allocated_bytes_per_second{class="default",team="web"} 250000.0'):
        assert line in text, line


def test_refused_pods_keep_the_reports_download_fields():
    """A report with a refused pod is stored without that pod but with all its other fields."""
    from core.wire import NodeReport, PodReport

    state = new_state()
    pods = [PodReport("web", "a", 0, 1e6), PodReport("web", "a", 0, 1e6)]  # a duplicate
    state.submit(None, NodeReport("node-a", pods, 3, 5.0, 1e6, node_internet_ingress_bps=7e6, shapes_ingress=True))
    stored = state.latest["node-a"][1].report
    assert (len(stored.pods), stored.node_internet_ingress_bps, stored.shapes_ingress) == (1, 7e6, True)


def _ingress_gain(ingress_of, rounds=8) -> tuple[float, float]:
    """(upload gain, download gain) after `rounds` rounds of ten nodes reporting."""
    from core.wire import NodeReport, PodReport

    now = [0.0]
    alloc = Allocator(policy_source(IN_CLASSES, (IN_BUDGET,)), clock=lambda: now[0])
    result = None
    for _ in range(rounds):
        now[0] += 5.0
        reports = {}
        for n in range(10):
            pods = [PodReport("web", f"p{n}", usage_bps=8e6, demand_bps=10e6, ingress_usage_bps=5e6,
                              ingress_demand_bps=6e6)]
            ingress = ingress_of(n)
            reports[f"node-{n}"] = alloc.prepare(NodeReport(f"node-{n}", pods, 1, 5.0, 8e6,
                                                            node_internet_ingress_bps=ingress, shapes_ingress=True))
        result = alloc(reports)
    return result.summary.gain, result.summary.ingress.gain


def test_download_gain_is_its_own_and_bounded_per_node():
    """The download gain follows node_internet_ingress_bps (other traffic the pods' classes do not
    carry lowers it) without touching the upload gain; one node's absurd download total is clamped
    to what it was allocated plus a margin, as for uploads."""
    honest = _ingress_gain(lambda n: 5e6)
    assert honest == (pytest.approx(1.0, abs=0.01), pytest.approx(1.0, abs=0.01))
    from core.wire import NodeReport, PodReport

    # 10% more arrives than the pods' classes carried, at full use of the budget (6M x 10 = the 60M): gain < 1
    now = [0.0]
    alloc = Allocator(policy_source(IN_CLASSES, (IN_BUDGET,)), clock=lambda: now[0])
    for _ in range(12):
        now[0] += 5.0
        reports = {f"node-{n}": alloc.prepare(NodeReport(
            f"node-{n}", [PodReport("web", f"p{n}", 8e6, 10e6, ingress_usage_bps=6e6, ingress_demand_bps=20e6)],
            1, 5.0, 8e6, node_internet_ingress_bps=6.6e6, shapes_ingress=True)) for n in range(10)}
        result = alloc(reports)
    assert result.summary.gain == pytest.approx(1.0, abs=0.01)
    assert result.summary.ingress.gain == pytest.approx(1 / 1.1, abs=0.02)
    assert result.summary.ingress.allocated_bps == pytest.approx(60e6 * result.summary.ingress.gain)
    lied = _ingress_gain(lambda n: 1e18 if n == 0 else 5e6)
    assert lied[0] == pytest.approx(1.0, abs=0.01) and lied[1] > 0.9
