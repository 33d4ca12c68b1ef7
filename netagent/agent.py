"""The agent's core: sources in, kernel state out, level-triggered.

Threads and their one job each:
  source    -> `on_snapshot` only records the new snapshot and wakes the sync loop;
  sync loop -> all kernel work: plan from the current inputs, apply the difference
               (tc first, then iptables), at most once per `min_sync_interval`, and
               on a timer (`resync_seconds`) to repair drift;
  sampler   -> reads class counters every second: usage, throttling, demand;
               in single-node mode reruns the allocation engine;
  reporter  -> (with a controller) posts the node report, takes allocations + lease.
A failed sync is logged, counted and retried with backoff; the agent never exits
on bad input and never flushes what is in the kernel.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from .demand import PodDemand, Sample
from .model import Snapshot
from tc.model import NODE_MINOR

from .planner import DesiredState, PlanError, PlanInputs, PlanOptions, PodShape, assign_minors, plan
from .view import SCOPES, NodeView, PodView

log = logging.getLogger(__name__)


# No pod class below a trickle (DNS, health checks); HTB's bucket timing also overflows far below it.
MIN_POD_RATE_BPS = 8_000


@dataclass(frozen=True)
class ResolvedPod:
    """A pod with its policy applied (pure output of the policy layer)."""

    key: str
    namespace: str
    name: str
    uid: str
    ips: tuple[str, ...]
    team: str
    egress_class: str
    weight: float
    min_bps: int
    max_bps: int
    problems: tuple[tuple[str, str], ...] = ()
    class_annotation: str | None = None
    bandwidth_annotation: str | None = None


@dataclass(frozen=True)
class Allocation:
    allocation_bps: int  # HTB rate
    limit_bps: int  # HTB ceil


@dataclass
class AllocationSet:
    pods: dict[str, Allocation] = field(default_factory=dict)
    node_rate_bps: int = 0
    safe_floor_bps: int = 0
    lease_expires: float = float("inf")  # monotonic; inf in single-node mode
    generation: int = 0
    source: str = ""  # "controller", "local", "adopted", "floor"


class PolicyResolver(Protocol):
    def __call__(self, snapshot: Snapshot) -> tuple[list[ResolvedPod], int]:
        """-> (pods on this node with policy applied, the budget's total in bit/s)"""


class DataPath(Protocol):
    leaf_qdisc: str
    iptables_backend: str

    def apply(self, desired: DesiredState, full: bool = True) -> dict[str, int]: ...

    def class_stats(self) -> dict[int, object]: ...

    def counters(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]: ...

    def adopted_rates(self) -> dict[int, tuple[int, int]]: ...


@dataclass
class AgentConfig:
    node: str
    uplinks: tuple[str, ...]
    internal_cidrs: tuple[str, ...]
    plan_options: PlanOptions = field(default_factory=PlanOptions)
    controller: str | None = None
    min_sync_interval: float = 0.05
    resync_seconds: float = 30.0
    sample_seconds: float = 1.0
    allocate_seconds: float = 2.0
    default_floor_bps: int = 1_000_000  # per pod when nothing better is known


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        datapath: DataPath,
        resolve: PolicyResolver,
        local_allocate: Callable[[list[ResolvedPod], dict[str, PodDemand], int, AllocationSet], AllocationSet] | None,
        metrics=None,
        problems=None,
    ):
        self.cfg = cfg
        self.datapath = datapath
        self.resolve = resolve
        self.local_allocate = local_allocate
        self.metrics = metrics
        self.problems = problems
        self.snapshot: Snapshot | None = None
        self.pods: list[ResolvedPod] = []
        self.budget_bps = 0
        self.allocations = AllocationSet(source="none")
        self.demand: dict[str, PodDemand] = {}
        self.desired: DesiredState | None = None
        self.minors: dict[str, int] = {}
        self.skipped: dict[str, str] = {}
        self.ready = False
        self.ready_reason = "waiting for the first snapshot"
        self.last_success = 0.0
        self.last_loop = time.monotonic()
        self.controller_reachable = False
        self.fail_static = False
        self.sync_count = 0
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._threads: list[threading.Thread] = []
        self._adopted: dict[int, tuple[int, int]] = {}
        self._allocated_policies: dict[str, object] | None = None  # pods (and budget) the local engine last saw

    # -- inputs ---------------------------------------------------------------
    def on_snapshot(self, snap: Snapshot) -> None:
        with self._lock:
            self.snapshot = snap
        self._dirty.set()

    def set_allocations(self, allocs: AllocationSet) -> None:
        with self._lock:
            changed = (allocs.pods != self.allocations.pods or allocs.node_rate_bps != self.allocations.node_rate_bps
                       or self.fail_static)
            self.allocations = allocs
        if changed:
            self._dirty.set()

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        # what the kernel holds now seeds the allocations: a restart changes nothing
        try:
            self._adopted = self.datapath.adopted_rates()
        except Exception as exc:
            log.warning("could not read existing tc classes to adopt: %s", exc)
        for target, name in ((self._sync_loop, "sync"), (self._sample_loop, "sampler")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Leave the data path in force (fail-static): stopping changes nothing in the kernel."""
        self._stop.set()
        self._dirty.set()
        for t in self._threads:
            t.join(timeout=5)

    # -- the sync loop ---------------------------------------------------------
    def _sync_loop(self) -> None:
        backoff = 0.0
        retry_at = None
        next_resync = time.monotonic() + self.cfg.resync_seconds
        while not self._stop.is_set():
            self.last_loop = time.monotonic()
            wake_at = min(next_resync, retry_at or next_resync)
            woke = self._dirty.wait(max(0.0, min(wake_at - time.monotonic(), self.cfg.resync_seconds)))
            if self._stop.is_set():
                return
            self._dirty.clear()
            now = time.monotonic()
            periodic = not woke and now >= next_resync
            if not woke and not periodic and (retry_at is None or now < retry_at):
                continue
            if periodic:
                next_resync = now + self.cfg.resync_seconds
            if self.sync(full=periodic or retry_at is not None):
                backoff, retry_at = 0.0, None
            else:
                backoff = min(max(backoff * 2, 0.5), 10.0)
                retry_at = time.monotonic() + backoff
            time.sleep(self.cfg.min_sync_interval)  # coalesce bursts of changes

    def sync(self, full: bool = True) -> bool:
        """One level-triggered reconcile. Returns True when the kernel matches the desired state.

        `full` re-reads every part of the kernel state; otherwise parts whose desired state did
        not change since the last good sync are trusted (the periodic resync re-reads them)."""
        with self._lock:
            snap = self.snapshot
            applied_before = self.desired
        if snap is None:
            return True
        t0 = time.perf_counter()
        stage = "policy"
        try:
            pods, budget = self.resolve(snap)
            with self._lock:
                self.pods, self.budget_bps = pods, budget
            if self.problems is not None:
                for p in pods:
                    self.problems.report(p.namespace, p.name, p.uid, p.problems)
                self.problems.forget({p.uid for p in pods})
            stage = "allocate"
            self._allocate_locally_if_pods_changed(pods)
            allocs = self._effective_allocations(pods)
            stage = "plan"
            desired = plan(self._plan_inputs(pods, allocs))
            stage = "apply"
            changes = self.datapath.apply(desired, full=full or applied_before is None)
        except (PlanError, ValueError) as exc:
            self._failed(stage, f"{stage}: {exc}")
            return False
        except Exception as exc:
            log.exception("sync failed at %s", stage)
            self._failed(stage, f"{stage}: {exc.__class__.__name__}: {exc}")
            return False
        elapsed = time.perf_counter() - t0
        with self._lock:
            self.desired = desired
            self.minors = dict(desired.minors)
            self.skipped = dict(desired.skipped)
            self.ready, self.ready_reason = True, "kernel matches the desired state"
            self.last_success = time.time()
            self.sync_count += 1
        total = sum(changes.values())
        # a part (tc, or iptables with its ipsets) planned exactly as in the last good sync, yet the
        # kernel needed changes there: someone else changed it
        drift = {kind: n for kind, n in changes.items() if n and applied_before is not None and (
            desired.shaper == applied_before.shaper if kind == "tc" else desired.classifier == applied_before.classifier)}
        if self.metrics:
            self.metrics.reconcile_duration.observe(elapsed)
            for kind, n in changes.items():
                if n:
                    self.metrics.kernel_changes.labels(kind).inc(n)
            for kind, n in drift.items():
                self.metrics.drift_repairs.labels(kind).inc(n)
        if drift:
            log.warning("drift repaired: %s changed by someone else, restored in %.1f ms",
                        ", ".join(f"{n} {k}" for k, n in drift.items()), elapsed * 1000)
        if total > sum(drift.values()):
            log.info("reconciled: applied %s in %.1f ms",
                     ", ".join(f"{n} {k}" for k, n in changes.items() if n and k not in drift), elapsed * 1000)
        return True

    def _failed(self, stage: str, reason: str) -> None:
        with self._lock:
            self.ready, self.ready_reason = False, reason
        if self.metrics:
            self.metrics.reconcile_errors.labels(stage).inc()
        log.error("reconcile failed (%s); the previous kernel state stays in force", reason)

    def _plan_inputs(self, pods: list[ResolvedPod], allocs: dict[str, Allocation]) -> PlanInputs:
        shapes = []
        for p in pods:
            a = allocs[p.key]
            rate = max(MIN_POD_RATE_BPS, int(a.allocation_bps))
            shapes.append(PodShape(p.key, p.ips, rate, max(rate, int(a.limit_bps))))
        adopted_node = self._adopted.get(NODE_MINOR)
        node_rate = (self.allocations.node_rate_bps or (adopted_node[1] if adopted_node else 0)
                     or sum(a.limit_bps for a in allocs.values()))
        node_rate = max(int(node_rate), self.cfg.plan_options.default_rate, 8)
        return PlanInputs(self.cfg.uplinks, self.cfg.internal_cidrs, tuple(shapes), node_rate, self.cfg.plan_options)

    def _allocate_locally_if_pods_changed(self, pods: list[ResolvedPod]) -> None:
        """Single-node mode: a pod that appears, gets its IP or changes class (or a new budget
        total) gets its share in this sync, not at the next allocation round. Right after a
        restart, pods whose class the kernel already holds keep it (adoption) until the next round."""
        if not self.local_allocate:
            return
        with self._lock:
            budget = self.budget_bps
        policies = {p.key: (p.team, p.egress_class, p.weight, p.min_bps, p.max_bps, bool(p.ips)) for p in pods}
        policies[""] = budget  # a new budget total is a change too
        if policies == self._allocated_policies:
            return
        first = self._allocated_policies is None
        self._allocated_policies = policies
        if first and self._adopted and all(self._prospective_minor(p) in self._adopted for p in pods if p.ips):
            return
        with self._lock:
            prev = self.allocations
        allocs = self.local_allocate(pods, self.demand, budget, prev)
        with self._lock:
            self.allocations = allocs

    def _prospective_minor(self, p: ResolvedPod) -> int | None:
        minor = self.minors.get(p.key)
        if minor is None and p.ips:
            minor = assign_minors([PodShape(p.key, p.ips, 1, 1)]).get(p.key)
        return minor

    def _effective_allocations(self, pods: list[ResolvedPod]) -> dict[str, Allocation]:
        """Per pod: the controller's (or local engine's) allocation while its lease holds; after
        that the safe floor; for a pod nobody allocated yet: what the kernel already enforces
        for its class (adoption), else its guaranteed minimum, else the floor."""
        now = time.monotonic()
        with self._lock:
            a = self.allocations
            expired = now >= a.lease_expires
            if expired and not self.fail_static:
                log.warning("controller lease expired: falling back to the safe floor")
            self.fail_static = expired
        floor = a.safe_floor_bps or self.cfg.default_floor_bps
        out: dict[str, Allocation] = {}
        for p in pods:
            got = a.pods.get(p.key)
            if got is not None and not expired:
                out[p.key] = Allocation(min(got.allocation_bps, p.max_bps), min(got.limit_bps, p.max_bps))
                continue
            if expired:
                f = min(floor, p.max_bps)
                out[p.key] = Allocation(f, f)
                continue
            minor = self._prospective_minor(p) if self._adopted else None
            if minor is not None and minor in self._adopted:
                rate, ceil = self._adopted[minor]
                out[p.key] = Allocation(rate, ceil)
            else:
                base = min(max(p.min_bps, floor), p.max_bps)
                out[p.key] = Allocation(base, base)
        return out

    # -- sampling, demand, local allocation --------------------------------------
    def _sample_loop(self) -> None:
        next_alloc = time.monotonic() + self.cfg.allocate_seconds
        while not self._stop.wait(self.cfg.sample_seconds):
            try:
                if not self.fail_static and time.monotonic() >= self.allocations.lease_expires:
                    self._dirty.set()  # the lease just ran out: fall to the floor now, not at the next resync
                self.sample()
                if self.local_allocate and time.monotonic() >= next_alloc:
                    next_alloc = time.monotonic() + self.cfg.allocate_seconds
                    with self._lock:
                        pods, budget, prev = list(self.pods), self.budget_bps, self.allocations
                    if pods:
                        self.set_allocations(self.local_allocate(pods, self.demand, budget, prev))
                if self._adopted and self.sync_count and self.allocations.source in ("local", "controller"):
                    self._adopted = {}  # fresh allocations exist: adoption has done its job
            except Exception:
                log.exception("sampling failed")

    def sample(self) -> None:
        stats = self.datapath.class_stats()
        now = time.monotonic()
        with self._lock:
            minors = dict(self.minors)
            pods = {p.key: p for p in self.pods}
            allocs = self.allocations.pods
        for key, minor in minors.items():
            st = stats.get(minor)
            pod = pods.get(key)
            if st is None or pod is None:
                continue
            d = self.demand.setdefault(key, PodDemand())
            limit = allocs.get(key).limit_bps if key in allocs else st.ceil_bytes * 8
            d.update(Sample(now, st.bytes, st.drops, st.overlimits, st.backlog_bytes), int(limit), pod.max_bps)
        for gone in set(self.demand) - set(minors):
            del self.demand[gone]

    # -- what we show ------------------------------------------------------------
    def view(self) -> NodeView:
        with self._lock:
            pods, minors, skipped, allocs = list(self.pods), dict(self.minors), dict(self.skipped), self.allocations
            desired = self.desired
        pod_counters, node_counters = self.datapath.counters()
        stats = self.datapath.class_stats()
        out = []
        for p in pods:
            minor = minors.get(p.key)
            shape = None
            if desired is not None and minor is not None:
                shape = next((c for c in desired.shaper.pods if c.minor == minor), None)
            d = self.demand.get(p.key, PodDemand())
            c = pod_counters.get(p.key, {})
            st = stats.get(minor) if minor is not None else None
            out.append(PodView(
                namespace=p.namespace, name=p.name, team=p.team, egress_class=p.egress_class, ips=p.ips,
                minor=minor, waiting=skipped.get(p.key, ""),
                allocation_bps=shape.rate if shape else 0, limit_bps=shape.ceil if shape else 0,
                demand_bps=d.demand_bps, usage_bps=d.usage_bps, throttled=d.throttled,
                throttled_seconds=d.throttled_seconds,
                egress_bytes={s: c.get(f"egress_{s}", 0) for s in SCOPES},
                ingress_bytes={s: c.get(f"ingress_{s}", 0) for s in SCOPES},
                dropped_packets=st.drops if st else 0, problems=p.problems,
            ))
        return NodeView(
            node=self.cfg.node, pods=out,
            egress_bytes={s: node_counters.get(f"egress_{s}", 0) for s in SCOPES},
            ingress_bytes={s: node_counters.get(f"ingress_{s}", 0) for s in SCOPES},
            unknown_source_egress_bytes=node_counters.get("egress_unknown_internet", 0),
            allocation_bps=desired.shaper.node_rate if desired else 0,
            ready=self.ready, ready_reason=self.ready_reason, controller=self.cfg.controller or "",
            controller_reachable=self.controller_reachable, fail_static=self.fail_static,
            lease_expires_in=None if allocs.lease_expires == float("inf") else allocs.lease_expires - time.monotonic(),
            safe_floor_bps=allocs.safe_floor_bps or self.cfg.default_floor_bps,
            allocation_source="floor" if self.fail_static else allocs.source,
            last_reconcile_success=self.last_success, leaf_qdisc=self.datapath.leaf_qdisc,
            iptables_backend=self.datapath.iptables_backend,
            source_errors=self.snapshot.errors if self.snapshot else (),
        )

    def health(self) -> tuple[bool, str]:
        stale = time.monotonic() - self.last_loop
        limit = self.cfg.resync_seconds * 3 + 30
        return (stale < limit, f"sync loop last ran {stale:.0f}s ago")

    def readiness(self) -> tuple[bool, str]:
        return self.ready, self.ready_reason
