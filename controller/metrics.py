"""The controller's Prometheus metrics, in their own registry (docs/controller.md lists them).

Each budget metric has a download twin named with `ingress_` after `netagent_controller_`
(`netagent_controller_ingress_budget_bytes_per_second`...), present while an agent that
shapes downloads reports; the download budget and `ingress_agents` (0) also whenever
spec.ingressTotal is set and none does.

Event counts (reports, rejections, rounds, status writes) are counters updated as they
happen; the budget view (by team and class) is yielded at scrape time from the latest
allocation round, so a team or class that disappears takes its series with it. Rates
are exported in bytes per second (Prometheus convention); the engine works in bit/s.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from core.direction import PerDirection

from .allocator import Summary
from .state import ControllerState

P = "netagent_controller_"
TC, T = ["team", "class"], ["team"]


class BudgetCollector:
    """Yields the budget view of the latest round; the leader flag and agent count always."""

    def __init__(self, state: ControllerState, is_leader: Callable[[], bool]):
        self.state = state
        self.is_leader = is_leader

    def collect(self) -> Iterable[Metric]:
        leader = self.is_leader()
        yield GaugeMetricFamily(P + "is_leader", "1 on the replica that holds the Lease and serves agents",
                                value=1.0 if leader else 0.0)
        result = self.state.result if leader else None
        summary: Summary | None = result.summary if result is not None else None
        yield GaugeMetricFamily(P + "agents", "nodes whose agent reported within the report TTL",
                                value=float(self.state.nodes() if leader else 0))
        # a node silent for --report-ttl leaves the rounds (its share goes back to the others): docs/scale.md
        yield CounterMetricFamily(P + "expired_agents", "nodes dropped from the allocation after --report-ttl "
                                  "without a report", value=float(self.state.expired_nodes))
        yield GaugeMetricFamily(P + "demand_above_use_pods", "pods of the last round reported unthrottled with a "
                                "demand over 64x their use (at least 1 Mbit/s): a lying or broken agent, or a pod "
                                "whose use just collapsed", value=float(self.state.demand_above_use if leader else 0))
        yield GaugeMetricFamily(P + "pods", "pods in the latest allocation round",
                                value=float(summary.pods if summary else 0))
        if result is not None:
            yield GaugeMetricFamily(P + "last_round_timestamp_seconds",
                                    "when the latest allocation round finished (Unix time)",
                                    value=result.wall_time)
            for d, floor in PerDirection(result.safe_floor_bps, result.safe_ingress_floor_bps).items():
                if floor is not None:
                    yield SAFE_FLOOR[d](floor / 8)
        if summary is None:
            return
        yield GaugeMetricFamily(P + "policy_problems", "EgressClass/EgressBudget problems (objects or teams ignored)",
                                value=float(len(summary.policy_problems)))
        # uploads always; downloads while an agent that shapes them reports (or spec.ingressTotal is set)
        for d, s in PerDirection(summary, summary.ingress).items():
            if s is not None:
                yield from LANE_FAMILIES[d](s)
                yield from _direction(s, BUDGET_FAMILIES[d](s))


# The families per Direction, one table: the names stay literal (dashboards/contract.py reads
# them from this source) and as users know them (downloads: `ingress_` after the prefix).
SAFE_FLOOR = PerDirection(
    lambda v: GaugeMetricFamily(P + "safe_floor_bytes_per_second",
                                "per-pod rate agents fall to when their lease runs out", value=v),
    lambda v: GaugeMetricFamily(P + "ingress_safe_floor_bytes_per_second",
                                "per-pod download rate agents fall to when their lease runs out", value=v))
LANE_FAMILIES: PerDirection[Callable[[Summary], tuple[Metric, ...]]] = PerDirection(
    lambda s: (GaugeMetricFamily(P + "held_back_bytes_per_second", "budget a new leader holds back for the nodes "
                                 "it has not heard from yet (they keep the old leader's answers)",
                                 value=s.held_back_bps / 8),),
    lambda s: (GaugeMetricFamily(P + "ingress_agents", "nodes whose agent shapes downloads and reported",
                                 value=float(s.nodes)),
               GaugeMetricFamily(P + "ingress_held_back_bytes_per_second", "download budget a new leader holds "
                                 "back for the nodes it has not heard from yet", value=s.held_back_bps / 8)))
BUDGET_FAMILIES: PerDirection[Callable[[Summary], tuple[GaugeMetricFamily, ...]]] = PerDirection(
    lambda s: (
        GaugeMetricFamily(P + "budget_bytes_per_second", "the EgressBudget's spec.total", value=s.budget_bps / 8),
        GaugeMetricFamily(P + "oversubscribed", "1 when the teams' guarantees add up to more than the budget",
                          value=1.0 if s.oversubscribed else 0.0),
        GaugeMetricFamily(P + "feedback_gain", "the engine's gain on the budget: 1 - (measured egress - pods' "
                          "shaped usage) / budget, so the measured total settles at the budget", value=s.gain),
        GaugeMetricFamily(P + "allocated_bytes_per_second", "sum of the pods' fair shares", labels=TC),
        GaugeMetricFamily(P + "demand_bytes_per_second", "sum of the pods' estimated demand", labels=TC),
        GaugeMetricFamily(P + "used_bytes_per_second", "sum of the pods' measured internet egress", labels=TC),
        GaugeMetricFamily(P + "group_pods", "pods by team and class", labels=TC),
        GaugeMetricFamily(P + "team_guarantee_bytes_per_second", "the team's guaranteed minimum", labels=T),
        GaugeMetricFamily(P + "guarantee_unmet", "1 when a team is allocated less than its guarantee (up to its "
                          "demand)", labels=T)),
    lambda s: (
        GaugeMetricFamily(P + "ingress_budget_bytes_per_second", "the EgressBudget's spec.ingressTotal "
                          "(downloads; 2^53/8 when unset)", value=s.budget_bps / 8),
        GaugeMetricFamily(P + "ingress_oversubscribed", "1 when the teams' download guarantees add up to more "
                          "than spec.ingressTotal", value=1.0 if s.oversubscribed else 0.0),
        GaugeMetricFamily(P + "ingress_feedback_gain", "the engine's gain on spec.ingressTotal: 1 - (measured "
                          "internet ingress - pods' shaped downloads) / spec.ingressTotal", value=s.gain),
        GaugeMetricFamily(P + "ingress_allocated_bytes_per_second", "sum of the pods' download fair shares",
                          labels=TC),
        GaugeMetricFamily(P + "ingress_demand_bytes_per_second", "sum of the pods' estimated download demand",
                          labels=TC),
        GaugeMetricFamily(P + "ingress_used_bytes_per_second", "sum of the pods' measured internet ingress",
                          labels=TC),
        GaugeMetricFamily(P + "ingress_group_pods", "pods in the download allocation by team and class",
                          labels=TC),
        GaugeMetricFamily(P + "ingress_team_guarantee_bytes_per_second", "the team's guaranteed download minimum",
                          labels=T),
        GaugeMetricFamily(P + "ingress_guarantee_unmet", "1 when a team is allocated less than its download "
                          "guarantee (up to its demand)", labels=T)))


def _direction(summary: Summary, families: tuple[GaugeMetricFamily, ...]) -> Iterable[Metric]:
    """One direction's budget view: the scalar families as given, the per team/class and per team
    ones filled from `summary` (the families are built where they are named, literally, so
    dashboards/contract.py can read every name)."""
    budget, oversubscribed, gain, allocated, demand, used, pods, guarantee, unmet = families
    for (team, egress_class), g in sorted(summary.groups.items()):
        labels = [team, egress_class]
        allocated.add_metric(labels, g.allocated_bps / 8)
        demand.add_metric(labels, g.demand_bps / 8)
        used.add_metric(labels, g.used_bps / 8)
        pods.add_metric(labels, float(g.pods))
    for team, t in sorted(summary.teams.items()):
        guarantee.add_metric([team], t.guarantee_bps / 8)
        unmet.add_metric([team], 1.0 if t.guarantee_unmet else 0.0)
    yield from families


class ControllerMetrics:
    def __init__(self, state: ControllerState, is_leader: Callable[[], bool]):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.reports = Counter(P + "reports", "node reports answered with allocations", registry=r)
        self.rejected = Counter(P + "rejected_reports", "node reports refused, by reason", ["reason"], registry=r)
        self.rounds = Counter(P + "allocation_rounds", "allocation rounds computed", registry=r)
        self.round_failures = Counter(P + "allocation_failures", "allocation rounds that failed", registry=r)
        self.duration = Histogram(P + "allocation_duration_seconds", "time to compute one allocation round",
                                  buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5), registry=r)
        self.status_writes = Counter(P + "status_writes", "EgressBudget status writes, by result", ["result"],
                                     registry=r)
        self.refused_pods = Counter(P + "refused_pods", "pods refused from reports (the rest of the report is "
                                    "answered), by reason", ["reason"], registry=r)
        self.events = Counter(P + "events", "Kubernetes Events: written (ok), failed (error), dropped (queue full)",
                              ["result"], registry=r)
        self.tls_changes = Counter(P + "tls_secret_changes", "the TLS Secret created or its certificate renewed "
                                   "by this replica", ["change"], registry=r)
        self.token_reviews = Counter(P + "token_reviews", "TokenReview calls (cache misses)", registry=r)
        self.watch_events = Counter(P + "watch_events", "watch events by resource and type", ["resource", "type"],
                                    registry=r)
        self.namespaces_missing = Counter(P + "namespaces_missing", "Namespaces gone (deleted under running pods, "
                                          "their finalizer forced) while pods were still in them; those pods "
                                          "resolve by the namespace's name alone", registry=r)
        r.register(BudgetCollector(state, is_leader))

    def observe_round(self, result) -> None:
        self.rounds.inc()
        self.duration.observe(result.duration_s)
