"""The controller's state and rounds beyond one request (tests/test_controller_api.py's server where HTTP
is needed): bounded memory, robust aggregation, Events from a bounded queue, a new leader's first
rounds (failover in seconds), a silent node ageing out, a node that lies about its demand."""
from __future__ import annotations

import asyncio

import pytest

from lab.procs import wait_for

from controller.allocator import Allocator
from controller.state import ControllerState
from tests.test_controller_api import pod, policy_source, post, report, serve
from tests.test_controller_downloads import IN_BUDGET, IN_CLASSES


def test_one_nodes_absurd_egress_does_not_move_the_cluster():
    """Nine honest nodes report their egress, one reports 1e18 bit/s: its word on the measured total
    is clamped to what it was allocated plus a margin, so the gain stays near 1 (unclamped it would
    fall to its floor, 0.5: half the cluster's capacity gone)."""
    from core.wire import NodeReport, PodReport

    now = [0.0]

    def run(liar: bool) -> float:
        alloc = Allocator(policy_source(), clock=lambda: now[0])
        result = None
        for _ in range(8):
            now[0] += 5.0
            reports = {}
            for n in range(10):
                pods = [PodReport("web", f"p{n}", usage_bps=8e6, demand_bps=10e6)]
                egress = 1e18 if (liar and n == 0) else 8e6
                reports[f"node-{n}"] = alloc.prepare(NodeReport(f"node-{n}", pods, 1, 5.0, egress))
            result = alloc(reports)
        return result.summary.gain

    honest, lied = run(False), run(True)
    assert honest == pytest.approx(1.0, abs=0.01)
    assert lied > 0.9


def test_the_gain_moves_at_the_first_feedback_only_when_every_node_read_both_counts_together():
    """Issue 37: ten nodes' pods send a quarter of the 100M budget beside 0.3M of host traffic each, then
    their shares of 97M. When every report carries what its classes carried over the same seconds as its
    node's counter (node_shaped_egress_bps), the first feedback sets the gain the budget needs, 0.97, and
    it stays there; one older agent's report (its pods' last samples only) brings back the wait for a
    steady plant. A node's classes count at most its measured egress: one that says 1e18 moves nothing more."""
    from core.wire import NodeReport, PodReport

    now = [0.0]

    def gains(older: set[int], liar: bool = False) -> list[float]:
        alloc = Allocator(policy_source(), clock=lambda: now[0])
        out = []
        for sent in (2.5e6, 9.7e6, 9.7e6, 9.7e6):
            now[0] += 5.0
            reports = {}
            for n in range(10):
                pods = [PodReport("web", f"p{n}", usage_bps=sent, demand_bps=50e6)]
                shaped = None if n in older else (1e18 if liar and n == 0 else sent)
                reports[f"node-{n}"] = alloc.prepare(NodeReport(f"node-{n}", pods, 1, 5.0, sent + 0.3e6,
                                                                node_shaped_egress_bps=shaped))
            out.append(alloc(reports).summary.gain)
        return out

    same = gains(set())
    assert all(g == pytest.approx(0.97, abs=0.001) for g in same), same
    mixed = gains({3})  # the ramp's feedback is no steady plant, the next sets the point: the third moves
    assert mixed[:2] == [1.0, 1.0] and mixed[2] == pytest.approx(0.97, abs=0.001), mixed
    assert gains(set(), liar=True)[0] == pytest.approx(1.0 - 0.3e6 * 9 / 100e6, abs=0.001)


def test_resolution_cache_is_bounded(monkeypatch):
    """Agent-supplied annotation strings key the resolution cache: it starts afresh when full, and
    reports prepared against the old one are resolved again, correctly."""
    from controller import allocator as allocator_module
    from core.wire import NodeReport, PodReport

    monkeypatch.setattr(allocator_module, "MAX_RESOLVED", 8)
    alloc = Allocator(policy_source())
    reports = {}
    for n in range(20):
        pods = [PodReport("research", f"r{n}", usage_bps=0, demand_bps=1e6, egress_class="bulk",
                          egress_bandwidth=f"{n + 1}M")]
        reports[f"node-{n}"] = alloc.prepare(NodeReport(f"node-{n}", pods, 1, 5.0, 0.0))
        assert len(alloc._tables[6]) <= 8
    result = alloc(reports)
    for n in range(20):
        (a,) = result.by_node[f"node-{n}"]
        assert (a.team, a.egress_class) == ("research", "bulk") and a.limit_bps <= (n + 1) * 1e6 * (1 + 1e-9)


def test_events_are_written_from_a_bounded_queue_and_dropped_when_full():
    import threading

    from controller.events import EventWriter

    release = threading.Event()
    written, results = [], []

    def create(namespace, body):  # an API server that hangs until released
        release.wait(10)
        written.append((namespace, body["involvedObject"]["name"], body["reason"]))

    events = EventWriter(create, max_queue=4, on_result=results.append)
    events.start()
    try:
        queued = [events.pod_event("web", f"p{i}", "RefusedAnnotationTooLong", "too long") for i in range(10)]
        assert not events.pod_event("web", "p0", "RefusedAnnotationTooLong", "again")  # told recently: not again
        assert queued.count(True) <= 5 and results.count("dropped") >= 5  # never blocks the caller: drops, counts
        release.set()
        wait_for(lambda: results.count("ok") == queued.count(True), what="the queued Events written")
        assert len(written) == queued.count(True)
    finally:
        release.set()
        events.stop()


def test_a_new_leader_shares_only_the_heard_nodes_part_of_the_budget_until_the_report_ttl():
    """After a failover the nodes not heard from yet keep the old leader's answers (then their floor):
    the new leader holds their part of both budgets back (heard / known nodes) for the report TTL,
    so the cluster total never passes the budget while agents find it; afterwards it shares it all."""
    from core.wire import NodeReport, PodReport

    now = [1000.0]
    alloc = Allocator(policy_source(IN_CLASSES, (IN_BUDGET,)), clock=lambda: now[0],
                      known_pods=lambda: 40, known_nodes=lambda: 4, takeover_seconds=150.0)
    state = ControllerState(alloc, lease_seconds=30.0, report_ttl=1e9)

    def node_report(node: str) -> NodeReport:  # ten pods that each want far more than the budget
        pods = [PodReport("research", f"{node}-{i}", usage_bps=0.0, demand_bps=80e6, ingress_demand_bps=30e6)
                for i in range(10)]
        return NodeReport(node, pods, 1, 5.0, shapes_ingress=True)

    def totals(result) -> tuple[float, float]:
        up = sum(p.limit_bps for node in result.by_node for p in result.by_node[node])
        down = sum(p.ingress_limit_bps for node in result.by_node for p in result.by_node[node])
        return up, down

    # the first term of a fresh replica holds back too: agents may hold answers of a controller before it
    state.on_leadership(True)
    state.submit(None, node_report("node-a"))
    result = state.run_round()
    up, down = totals(result)
    assert up == pytest.approx(25e6, rel=0.01) and down == pytest.approx(15e6, rel=0.01)
    assert (result.summary.held_back_bps, result.summary.ingress.held_back_bps) == (75e6, 45e6)
    assert result.node_rate["node-a"] <= 25e6 * 1.01
    assert result.safe_floor_bps == pytest.approx(100e6 / 40)  # the floor is the whole budget's, per pod

    now[0] += 60.0
    state.submit(None, node_report("node-b"))
    up, down = totals(state.run_round())
    assert up == pytest.approx(50e6, rel=0.01) and down == pytest.approx(30e6, rel=0.01)

    now[0] += 91.0  # the report TTL since the term began: silent nodes are no longer held for
    result = state.run_round()
    up, down = totals(result)
    assert up == pytest.approx(100e6, rel=0.01) and down == pytest.approx(60e6, rel=0.01)
    assert result.summary.held_back_bps == 0.0

    # a follower again, then leader again: a new term holds back again
    state.on_leadership(False)
    state.on_leadership(True)
    state.submit(None, node_report("node-a"))
    state.submit(None, node_report("node-b"))
    state.submit(None, node_report("node-c"))
    up, _ = totals(state.run_round())
    assert up == pytest.approx(75e6, rel=0.01)


# -- failover in seconds: a new term answers from its first round, not after the period's tick -----

async def test_a_new_terms_first_reports_are_answered_from_a_round_without_waiting_for_the_period():
    """The allocation loop runs every 60 s here, so only the new-term wake can explain an answer
    from a round: the term's first reports are held (FIRST_ROUND_WAIT) and answered from its first
    round, run FIRST_ROUND_GATHER after the first report; a node that reports after that round is
    answered at once with generation 0 (keep what you have), never held for the next tick. The
    takeover hold-back bounds that round: one of four known nodes heard, a quarter of the budget."""
    alloc = Allocator(policy_source(), known_pods=lambda: 4, known_nodes=lambda: 4, takeover_seconds=150.0)
    state = ControllerState(alloc, lease_seconds=120.0, report_ttl=150.0)
    state.on_leadership(True)
    state.start(60.0)
    try:
        async with serve(state) as (session, base):
            answers = await asyncio.gather(*(post(session, base, node, report(node, [pod("research", f"{node}-p",
                                                                                            demand=300e6)]))
                                             for node in ("node-a", "node-b")))
            for code, answer, _ in answers:
                assert (code, answer["generation"]) == (200, 1), answer
                assert answer["problems"] == []
            assert sum(p["limit_bps"] for _, a, _ in answers for p in a["pods"]) <= 50e6 * 1.01  # 2 of 4 heard
            code, late, _ = await post(session, base, "node-c", report("node-c", [pod("research", "c-p")]))
            assert (code, late["generation"], late["pods"]) == (200, 0, [])  # not in the round: at once
            assert not state._round_waiters
            # a follower, then leader again: the new term starts from nothing and answers from its own round
            state.on_leadership(False)
            state.on_leadership(True)
            code, again, _ = await post(session, base, "node-c", report("node-c", [pod("research", "c-p")]))
            assert (code, again["generation"]) == (200, 2)
            assert [p["name"] for p in again["pods"]] == ["c-p"]
    finally:
        state.stop()


def test_a_silent_node_ages_out_after_the_report_ttl_and_is_counted():
    """A node that stops reporting keeps its share for --report-ttl (it may still enforce its last
    answer for the lease), then leaves the rounds: the others get its share, and the metric counts it."""
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics
    from core.wire import NodeReport, PodReport

    now = [1000.0]  # the TTL judged on a clock the test moves (no sleeping)
    state = ControllerState(Allocator(policy_source()), lease_seconds=30.0, report_ttl=60.0, clock=lambda: now[0])
    metrics = ControllerMetrics(state, lambda: True)

    def node_report(node: str) -> NodeReport:
        return NodeReport(node, [PodReport("research", f"{node}-p", usage_bps=0.0, demand_bps=300e6)], 1, 5.0)

    state.submit(None, node_report("node-a"))
    state.submit(None, node_report("node-b"))
    first = state.run_round()
    assert first.node_rate["node-a"] == pytest.approx(50e6, rel=0.01)
    now[0] += 59.0
    state.submit(None, node_report("node-a"))  # node b is silent from here on
    assert state.run_round().node_rate["node-a"] == pytest.approx(50e6, rel=0.01)  # b's share still held
    now[0] += 2.0
    result = state.run_round()
    assert "node-b" not in result.node_rate and result.node_rate["node-a"] == pytest.approx(80e6, rel=0.01)
    assert state.expired_nodes == 1
    assert "netagent_controller_expired_agents_total 1.0" in generate_latest(metrics.registry).decode()


def test_a_node_reporting_1000x_its_use_takes_at_most_its_weighted_share_and_is_counted():
    """Bad input: node a's pod uses 10M and reports 1,000x that as its (unthrottled) demand. The
    engine treats it as real demand, so the pod takes its weighted fair share and no more: the three
    honest pods (40M wanted each, same class and weight) keep a quarter of the budget each (25M;
    30M with an honest neighbour): the others lose at most the liar's share minus its use. Under a
    cap (kubernetes.io/egress-bandwidth 5M) the lie gains nothing above the cap. The gauge counts it."""
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics
    from core.wire import NodeReport, PodReport

    def run(liar_bandwidth: str | None) -> tuple[ControllerState, dict[str, float]]:
        state = ControllerState(Allocator(policy_source()), lease_seconds=30.0, report_ttl=60.0)
        state.submit(None, NodeReport("node-a", [PodReport("research", "liar", usage_bps=10e6, demand_bps=10e9,
                                                           egress_bandwidth=liar_bandwidth)], 1, 5.0))
        for node in ("node-b", "node-c", "node-d"):
            state.submit(None, NodeReport(node, [PodReport("research", f"{node}-p", usage_bps=40e6,
                                                           demand_bps=40e6)], 1, 5.0))
        result = state.run_round()
        return state, {p.name: p.allocation_bps for pods in result.by_node.values() for p in pods}

    state, shares = run(None)
    assert shares["liar"] == pytest.approx(25e6, rel=0.01)  # its weighted share, not the 80M class cap
    for node in ("node-b", "node-c", "node-d"):
        assert shares[f"{node}-p"] == pytest.approx(25e6, rel=0.01)
    assert state.demand_above_use == 1
    assert "netagent_controller_demand_above_use_pods 1.0" in generate_latest(
        ControllerMetrics(state, lambda: True).registry).decode()

    state, shares = run("5M")
    assert shares["liar"] <= 5e6 * 1.0001
    for node in ("node-b", "node-c", "node-d"):
        assert shares[f"{node}-p"] == pytest.approx(95e6 / 3, rel=0.01)  # the rest, shared
