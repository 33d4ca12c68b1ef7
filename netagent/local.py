"""Single-node mode: the agent runs the shared allocation engine over its own pods.

With no `--controller`, this node is the whole cluster: its EgressBudget's total is
shared among its pods by exactly the engine the controller uses (teams, classes,
guarantees, caps, demand, headroom, hysteresis), and the node class is capped at the
total. There is no lease: local allocations never expire. A team whose volume quota is spent is
capped at its exhaustedRate (netagent.localquota), as the controller caps it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from core.direction import Direction
from core.engine import PodDemandIn, allocate
from core.policy import Policy, ResolvedPod

from .allocations import Allocation, AllocationSet
from .demand import MIN_DEMAND_BPS, PodDemand

if TYPE_CHECKING:
    from .localquota import LocalQuota


class LocalAllocator:
    def __init__(self, policy: Callable[[], Policy], floor_bps: int, direction: Direction = Direction.UPLOAD,
                 quota: LocalQuota | None = None):
        self.policy = policy  # the policy the pods were resolved against
        self.quota = quota  # the teams' volume quotas (None: none counted)
        self.floor_bps = floor_bps
        self.direction = direction  # the engine allocates this direction's budget on the pods' values for it
        self._previous = None  # the engine's last result: its hysteresis works from it
        self._generation = 0

    def __call__(self, pods: list[ResolvedPod], demand: dict[str, PodDemand], budget_bps: int) -> AllocationSet:
        inputs = []
        measured = 0.0
        for p in pods:
            if not p.ips:
                continue  # waiting for an IP (or gave it up): nothing to shape, no share to hold
            d = demand.get(p.key)
            measured += d.usage_bps if d else 0.0
            limits = p.limits[self.direction]
            inputs.append(PodDemandIn(
                key=p.key, team=p.team, egress_class=p.egress_class, weight=limits.weight,
                min_bps=limits.min_bps, max_bps=limits.max_bps,
                demand_bps=float(d.demand_bps) if d else float(max(limits.min_bps, MIN_DEMAND_BPS)),
            ))
        previous = self._previous if self._previous is not None and self._previous.keys else None
        policy = self.policy()
        if self.quota is not None:
            policy = self.quota.limit(policy, pods, self.direction, self.floor_bps)
        result = allocate(policy, inputs, measured_total_bps=measured if demand else None, previous=previous,
                          direction=self.direction)
        self._previous = result
        self._generation += 1
        return AllocationSet(
            pods={k: Allocation(int(r.allocation_bps), int(r.limit_bps)) for k, r in result.pods.items()},
            node_rate_bps=int(budget_bps),
            safe_floor_bps=self.floor_bps,
            generation=self._generation,
            source="local",
        )
