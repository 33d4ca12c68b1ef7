"""Node reports -> one engine run -> per-node answers. Pure apart from the engine call.

One round takes the latest report of every node, resolves each pod's policy from the
annotations the agent carried (team from the namespace, class, cap), runs the
allocation engine once over all of them, and splits the result back per node:

- a pod's answer: allocation (HTB rate, its fair share) and limit (HTB ceil: share plus
  headroom, never above its cap);
- node_rate: the sum of the node's pods' limits, capped at the budget total. The node
  class therefore never holds a pod below what the engine gave it, and the cluster-wide
  total is held by the engine (feedback on the measured total), not by node classes;
- safe_floor: the budget total divided by the number of pods in the round, so that if
  every agent lost the controller at once and fell to the floor, the cluster would still
  stay within its budget (each agent also caps the floor at the pod's own max);
- measured total (the engine's feedback input): the sum of the reports'
  node_internet_egress_bps, when agents report it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from .service import RoundResult
from .wire import NodeReport, PodAllocation

MIN_SAFE_FLOOR_BPS = 8_000.0  # a pod always keeps a trickle: enough for DNS and a health check


@dataclass
class GroupTotals:
    allocated_bps: float = 0.0
    demand_bps: float = 0.0
    used_bps: float = 0.0
    pods: int = 0


@dataclass
class TeamTotals(GroupTotals):
    guarantee_bps: float = 0.0  # the team's guarantee in effect: its min (or its pods' mins) up to its demand
    guarantee_unmet: bool = False  # allocated less than that: starved of its guarantee


@dataclass
class Summary:
    budget_name: str
    budget_bps: float
    allocated_bps: float
    demand_bps: float
    used_bps: float
    pods: int
    nodes: int
    oversubscribed: bool  # the teams' guarantees add up to more than the budget
    gain: float = 1.0  # the engine's feedback gain on the budget (measured total vs budget)
    groups: dict[tuple[str, str], GroupTotals] = field(default_factory=dict)  # (team, class)
    teams: dict[str, TeamTotals] = field(default_factory=dict)
    policy_problems: tuple[str, ...] = ()


class Adapter:
    """Callable for ControllerState: (reports by node) -> RoundResult.

    `policy` returns the current (Policy, problems) from the watched or loaded CRDs;
    `namespace_labels` (optional) returns a namespace's labels for teams chosen by
    namespaceSelector."""

    def __init__(self, policy: Callable[[], tuple[object, list[str]]],
                 namespace_labels: Callable[[str], Mapping[str, str] | None] | None = None):
        self.policy = policy
        self.namespace_labels = namespace_labels or (lambda ns: None)
        self.previous = None  # the engine's last result: hysteresis works across rounds
        self._resolved: dict[tuple, object] = {}
        self._resolved_for = None  # the Policy the resolution cache belongs to

    def _resolver(self, policy) -> Callable:
        from .policy import resolve_pod

        if policy is not self._resolved_for:
            self._resolved, self._resolved_for = {}, policy
        cache = self._resolved
        labels = self.namespace_labels

        def resolve(namespace: str, egress_class: str | None, bandwidth: str | None):
            key = (namespace, egress_class, bandwidth)
            pp = cache.get(key)
            if pp is None:
                pp = cache[key] = resolve_pod(policy, namespace, egress_class, bandwidth, labels(namespace))
            return pp

        return resolve

    def __call__(self, reports: dict[str, NodeReport]) -> RoundResult:
        from .engine import PodDemandIn, allocate

        policy, problems = self.policy()
        resolve = self._resolver(policy)
        pods_in = []
        meta = []  # per engine row: (node, namespace, name, team, class, usage)
        seen: set[str] = set()
        measured, any_measured = 0.0, False
        for node, rep in reports.items():  # newest report first: a pod that moved counts where it is now
            if rep.node_internet_egress_bps > 0:
                any_measured = True
                measured += rep.node_internet_egress_bps
            for p in rep.pods:
                key = f"{p.namespace}/{p.name}"
                if key in seen:
                    continue
                seen.add(key)
                pp = resolve(p.namespace, p.egress_class, p.egress_bandwidth)
                pods_in.append(PodDemandIn(key, pp.team, pp.egress_class, pp.weight, pp.min_bps, pp.max_bps,
                                           float(p.demand_bps)))
                meta.append((node, p.namespace, p.name, key, pp.team, pp.egress_class, p.usage_bps, p.demand_bps))
        result = allocate(policy, pods_in, measured_total_bps=measured if any_measured else None,
                          previous=self.previous)
        self.previous = result
        total = float(policy.total_bps)

        by_node: dict[str, list[PodAllocation]] = {node: [] for node in reports}
        node_rate: dict[str, float] = dict.fromkeys(reports, 0.0)
        groups: dict[tuple[str, str], GroupTotals] = {}
        teams: dict[str, TeamTotals] = {}
        used_total = demand_total = allocated_total = 0.0
        for node, namespace, name, key, team, egress_class, usage, demand in meta:
            r = result.pods[key]
            by_node[node].append(PodAllocation(namespace, name, team, egress_class,
                                               float(r.allocation_bps), float(r.limit_bps)))
            node_rate[node] += r.limit_bps
            group = groups.get((team, egress_class))
            if group is None:
                group = groups[(team, egress_class)] = GroupTotals()
            team_totals = teams.get(team)
            if team_totals is None:
                team_totals = teams[team] = TeamTotals()
            for g in (group, team_totals):
                g.allocated_bps += r.allocation_bps
                g.demand_bps += demand
                g.used_bps += usage
                g.pods += 1
            allocated_total += r.allocation_bps
            demand_total += demand
            used_total += usage
        for name, t in teams.items():
            engine_team = result.teams.get(name)
            # the engine's floor: the team's min (or its pods' mins) capped by what it wants
            t.guarantee_bps = float(engine_team.min_bps) if engine_team else 0.0
            t.guarantee_unmet = t.allocated_bps < t.guarantee_bps * (1 - 1e-6)
        node_rate = {n: min(rate, total) for n, rate in node_rate.items()}
        floor = max(MIN_SAFE_FLOOR_BPS, total / max(1, len(meta)))
        summary = Summary(
            budget_name=policy.budget_name, budget_bps=total, allocated_bps=allocated_total,
            demand_bps=demand_total, used_bps=measured if any_measured else used_total,
            pods=len(meta), nodes=len(reports), oversubscribed=bool(result.oversubscribed), gain=float(result.gain),
            groups=groups, teams=teams, policy_problems=tuple(problems),
        )
        return RoundResult(by_node, node_rate, floor, summary)
