"""What the agent enforces per pod: the allocations in force, their lease, the safe floor,
and adoption of what the kernel already holds after a restart.

`Allocations` is the one place that decides, for a pod at a moment, which numbers stand:
  * the controller's (or the local engine's) allocation while its lease holds;
  * after the lease ran out (the controller unreachable): the safe floor (fail-static);
  * for a pod nobody allocated yet: what the kernel already enforces for its class
    (adoption after a restart), else its guaranteed minimum, else the floor.
Whatever the source, the floor is never above a fair share of the node's rate, and
`cap_to_node` keeps what is enforced within the node's rate (each ceil, and the sum of the
HTB rates: HTB lets a child send up to its own rate whatever its parent has left).
Pure apart from its lock: callers pass the time and how to find a pod's HTB minor.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from core.direction import Direction
from core.policy import ResolvedPod
from core.quantity import MAX_BPS, TRICKLE_BPS
from tc.model import NODE_MINOR
from tc.sizing import LEAST_CEIL_BPS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Allocation:
    allocation_bps: int  # HTB rate: the pod's fair share
    limit_bps: int  # HTB ceil: what is enforced


@dataclass
class AllocationSet:
    pods: dict[str, Allocation] = field(default_factory=dict)
    node_rate_bps: int = 0
    safe_floor_bps: int = 0
    lease_expires: float = float("inf")  # monotonic; inf in single-node mode
    generation: int = 0
    source: str = ""  # "controller", "local", "adopted", "none"
    # downloads from a controller that gave no download allocation (None in its answer): every pod
    # not in `pods` gets its own cap (min(class ingress max, kubernetes.io/ingress-bandwidth)), else
    # the node's rate, instead of its guarantee
    own_cap: bool = False


class Allocations:
    """The allocation set in force, adoption after a restart, and the fail-static decision."""

    def __init__(self, default_floor_bps: int, initial: AllocationSet | None = None,
                 direction: Direction = Direction.UPLOAD):
        self.default_floor_bps = default_floor_bps
        self.direction = direction  # whose pod values (cap, guarantee) bound what is enforced
        self.current = initial or AllocationSet(source="none")
        self.adopted: dict[int, tuple[int, int]] = {}  # HTB minor -> (rate, ceil) the kernel held at start
        self.fail_static = False
        self.answers = 0  # allocation sets received (controller answers or local rounds): the demand estimator counts them
        self._lock = threading.Lock()

    def replace(self, allocs: AllocationSet) -> bool:
        """Put `allocs` in force; True when what is enforced may change (a new number, or leaving fail-static)."""
        with self._lock:
            old = self.current
            self.current = allocs
            self.answers += 1
            return allocs.pods != old.pods or allocs.node_rate_bps != old.node_rate_bps or self.fail_static

    def lease_expired(self, now: float) -> bool:
        return now >= self.current.lease_expires

    @property
    def floor_bps(self) -> int:
        return self.current.safe_floor_bps or self.default_floor_bps

    def effective(self, pods: Iterable[ResolvedPod], minor_of: Callable[[ResolvedPod], int | None],
                  now: float) -> dict[str, Allocation]:
        """Per pod key: the numbers to enforce now (see the module docstring)."""
        with self._lock:
            a = self.current
            expired = now >= a.lease_expires
            if expired and not self.fail_static:
                log.warning("controller lease expired: falling back to the safe floor")
            self.fail_static = expired
        pods = list(pods)
        floor = a.safe_floor_bps or self.default_floor_bps
        if 0 < a.node_rate_bps < MAX_BPS:  # never above a fair share of the node (the pods with an address)
            floor = min(floor, max(TRICKLE_BPS, a.node_rate_bps // max(1, sum(1 for p in pods if p.ips))))
        out: dict[str, Allocation] = {}
        for p in pods:
            got = a.pods.get(p.key)
            limits = p.limits[self.direction]
            if got is not None and not expired:
                out[p.key] = Allocation(min(got.allocation_bps, limits.max_bps), min(got.limit_bps, limits.max_bps))
                continue
            if expired:
                f = min(floor, limits.max_bps)
                out[p.key] = Allocation(f, f)
                continue
            minor = minor_of(p) if self.adopted else None
            if got is None and a.own_cap:
                cap = min(limits.max_bps, a.node_rate_bps or MAX_BPS)
                out[p.key] = Allocation(cap, cap)
            elif minor is not None and minor in self.adopted:
                rate, ceil = self.adopted[minor]
                out[p.key] = Allocation(rate, ceil)
            else:
                base = min(max(limits.min_bps, floor), limits.max_bps)
                out[p.key] = Allocation(base, base)
        return out

    def node_rate(self, effective: dict[str, Allocation], at_least: int) -> int:
        """The node class's rate: the allocation's, else what the kernel held (adoption), else the
        sum of the pods' limits; never below `at_least` (the default class's floor)."""
        adopted_node = self.adopted.get(NODE_MINOR)
        rate = (self.current.node_rate_bps or (adopted_node[1] if adopted_node else 0)
                or sum(a.limit_bps for a in effective.values()))
        return min(max(int(rate), at_least, 8), MAX_BPS)


def cap_to_node(effective: dict[str, Allocation], node_rate: int, reserved: int = 0,
                caps: Mapping[str, int] | None = None) -> dict[str, Allocation]:
    """`effective` within the node class: every ceil at most `node_rate`, and the HTB rates (the
    shares HTB grants without asking the parent) scaled down together, above the trickle every
    class keeps, when they add up to more than `node_rate - reserved` (`reserved`: the default
    class's guaranteed floor). Pure.

    Every ceil of a pod in `caps` is also at least min(its cap there, LEAST_CEIL_BPS, `node_rate`): below
    that one GSO packet puts the class in a debt HTB keeps after the ceil is raised (a pod whose
    flow started just after its report was answered as idle stalled 19 s). The node class's ceil
    still bounds the node's total, so the budget holds: such a pod only borrows what its node's
    other pods leave."""
    room = node_rate - reserved if node_rate > reserved else node_rate
    rates = {k: max(TRICKLE_BPS, int(a.allocation_bps)) for k, a in effective.items()}
    above = sum(r - TRICKLE_BPS for r in rates.values())
    avail = max(0, room - TRICKLE_BPS * len(rates))
    if sum(rates.values()) > room and above > 0:
        rates = {k: TRICKLE_BPS + int((r - TRICKLE_BPS) * avail / above) for k, r in rates.items()}
    least = {k: min(cap, LEAST_CEIL_BPS) for k, cap in (caps or {}).items()}
    return {k: Allocation(min(rates[k], node_rate), min(max(a.limit_bps, rates[k], least.get(k, 0)), node_rate))
            for k, a in effective.items()}


def least_ceils(allocations: Allocations, pods: Iterable[ResolvedPod]) -> dict[str, int] | None:
    """`cap_to_node`'s caps: each pod's cap, or None in fail-static (the safe floors then add up to
    the budget across the cluster only as ceils: no pod may borrow above its floor). Pure."""
    return None if allocations.fail_static else {p.key: p.limits[allocations.direction].max_bps for p in pods}


def pod_rates(a: Allocation) -> tuple[int, int]:
    """(rate, ceil) for the pod's HTB class: never below a trickle, ceil never below rate."""
    rate = max(TRICKLE_BPS, int(a.allocation_bps))
    return rate, max(rate, int(a.limit_bps))

