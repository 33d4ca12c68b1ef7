"""GET /v1/status: the leader's last round as `netagent status --kubeconfig` shows it (cli/cluster.py).

Small and read-only: per direction the budget totals and each team's figures, the pods that use
the most, and how long ago each node's agent reported (an agent silent for longer than the lease
it was given runs on the safe floor: fail-static). Guarded like /metrics (controller/app.py).
"""
from __future__ import annotations

import heapq
import time

from core.direction import PerDirection
from core.scopes import cost as cost_of
from core.wire import POD_ALLOCATION, POD_USAGE, quota_entry

from .quota import figures

TOP_PODS = 10
MAX_TOP_PODS = 100


def _direction(summary) -> dict | None:
    if summary is None:
        return None
    return {
        "budget_bps": summary.budget_bps, "allocated_bps": summary.allocated_bps, "demand_bps": summary.demand_bps,
        "used_bps": summary.used_bps, "pods": summary.pods, "nodes": summary.nodes,
        "oversubscribed": summary.oversubscribed, "held_back_bps": summary.held_back_bps,
        "teams": [{"team": team, "allocated_bps": t.allocated_bps, "demand_bps": t.demand_bps, "used_bps": t.used_bps,
                   "guarantee_bps": t.guarantee_bps, "guarantee_unmet": t.guarantee_unmet, "pods": t.pods}
                  for team, t in sorted(summary.teams.items())],
    }


def _quota(keeper) -> list[dict]:
    """Each team's volume quota and its use this period (docs/quotas.md); only where this replica counts."""
    if keeper is None or not keeper.active:
        return []
    return [quota_entry(u.name, u.quota.period.value, u.period_start, u.period_end,
                        PerDirection.build(lambda d: figures(u, d)))
            for u in keeper.teams()]


def _cost(keeper, is_leader: bool) -> list[dict]:
    """Each team's cost this period by priced scope, and its cost quota (docs/scopes.md); leader only, and only
    while the NetworkScopes prices are known."""
    prices = keeper.prices if keeper is not None else None
    if prices is None or not is_leader:
        return []
    quotas = keeper.quotas
    by_team: dict[str, dict[str, float]] = {}
    for team, scope, d, in_period, _ in keeper.figures():
        scopes = by_team.setdefault(team, {})
        scopes[scope.value] = scopes.get(scope.value, 0.0) + float(cost_of(prices, in_period, scope, d))
    out = []
    for team, scopes in sorted(by_team.items()):
        q = quotas.get(team)
        limit = float(q.cost) if q is not None and q.cost is not None else None
        spent = sum(scopes.values())
        out.append({"team": team, "currency": prices.currency, "period_cost": spent, "by_scope": scopes,
                    "quota_cost": limit, "spent": limit is not None and spent >= limit})
    return out


def cluster_view(state, top: int = TOP_PODS, now: float | None = None) -> dict:
    """The view from `state` (a ControllerState); reads its last round and latest reports only."""
    now = time.monotonic() if now is None else now
    ready, why = state.ready()
    latest, result = state.last()
    nodes = {node: round(now - t, 1) for node, (t, _) in sorted(latest.items())}
    out = {"leader": state.is_leader(), "ready": ready, "why": why, "lease_seconds": state.lease_seconds,
           "report_ttl_seconds": state.report_ttl, "nodes": nodes, "generation": 0, "uploads": None,
           "downloads": None, "top_pods": [], "quota": _quota(getattr(state.allocate, "quota", None)),
           "cost": _cost(getattr(state.allocate, "cost", None), state.is_leader())}
    if result is None:
        return out
    summary = result.summary
    out.update(generation=result.generation, uploads=_direction(summary),
               downloads=_direction(summary.ingress if summary else None))
    usage = {}
    for node, (_, prepared) in latest.items():
        report = getattr(prepared, "report", prepared)  # allocator.PreparedReport keeps the report it was made from
        for p in getattr(report, "pods", ()):
            usage[(p.namespace, p.name)] = (POD_USAGE.upload(p), POD_USAGE.download(p))

    def rank(item):
        _, a = item
        up, down = usage.get((a.namespace, a.name), (0.0, 0.0))
        return (up + down, a.allocation_bps)

    ranked = heapq.nlargest(max(0, min(top, MAX_TOP_PODS)),
                            ((node, a) for node, allocations in result.by_node.items() for a in allocations), key=rank)
    for node, a in ranked:
        up, down = usage.get((a.namespace, a.name), (0.0, 0.0))
        out["top_pods"].append({"namespace": a.namespace, "name": a.name, "node": node, "team": a.team,
                                "class": a.egress_class, "used_bps": up, "allocation_bps": a.allocation_bps,
                                "limit_bps": a.limit_bps, "download_used_bps": down,
                                "download_allocation_bps": POD_ALLOCATION.download(a)})
    return out
