"""One level-triggered reconcile: the node's inputs -> the kernel state that shapes them.

`NodeSync.sync()` resolves the latest snapshot's pods against the policy, decides what
each pod gets (`Allocations`; in single-node mode the local engine runs first when the
pods changed), renders the desired kernel state (`desired.desired_state`) and has the
data path apply the difference. After each good sync it publishes an immutable
`SyncState` that the sampler, the view and the reporter read; they never reach into
this object's fields. A failed sync raises nothing: it is logged, counted, and the
previous kernel state stays in force.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from core.direction import Direction, PerDirection
from core.objects import Snapshot
from core.policy import PolicyCache, ResolvedPod, namespaces_missing, resolve_pods
from tc.model import MIN_RATE_BPS, NODE_MINOR

from .allocations import Allocation, cap_to_node, least_ceils, pod_rates
from .config import AgentConfig
from .datapath import DataPath
from .lane import Lane
from .outbound import with_outbound_problems
from .facts import NodeFacts
from .desired import (NODE_RATIO_KEY, DesiredState, DesiredStateError, NodeInputs, PodShape, assign_minors,
                      desired_state, pod_class_ip)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncState:
    """What the last sync decided, published whole after each sync (readers never see half)."""

    pods: tuple[ResolvedPod, ...] = ()
    # per direction, the budget the local engine shares (single-node mode; uploads: the budget's total)
    budgets: PerDirection[int] = PerDirection(0, 0)
    desired: DesiredState | None = None
    minors: dict[str, int] = field(default_factory=dict)  # pod key -> HTB minor
    skipped: dict[str, str] = field(default_factory=dict)  # pod key -> why it is not programmed yet
    ready: bool = False
    ready_reason: str = "waiting for the first snapshot"
    last_success: float = 0.0  # Unix time
    sync_count: int = 0
    source_errors: tuple[str, ...] = ()
    pods_known: bool = False  # a snapshot of the pod source was resolved: `pods` is this node's pods
    # per direction: pod key -> the rate and ceil it was given (a direction not shaped: none)
    effective: PerDirection[dict[str, Allocation]] = field(default_factory=lambda: PerDirection({}, {}))


class NodeSync:
    def __init__(self, cfg: AgentConfig, datapath: DataPath, lanes: PerDirection[Lane], metrics=None, problems=None,
                 facts: NodeFacts | None = None):
        """`lanes`: one per direction (netagent.lane); a download lane not `shaped` is counted only.
        `facts`: what is learnt about the node while running (default: as configured); the agent
        swaps it whole (`facts.NodeFacts`), the next sync reads it."""
        self.cfg = cfg
        self.facts = facts or NodeFacts(cfg.uplinks, cfg.internal_cidrs)
        self.lanes = lanes
        self.datapath = datapath
        self.metrics = metrics
        self.problems = problems
        self.state = SyncState()
        self._snapshot: Snapshot | None = None
        self._policy_objects: tuple | None = None
        self._missing_namespaces: set[str] = set()  # said once per disappearance
        self._namespaces_seen: set[str] = set()  # of this node's pods, present at the last sync
        self.policy = PolicyCache(self._current_policy_objects)
        # per direction: the pods (and budget) the local engine last saw
        self._allocated_inputs: dict[Direction, dict[str, object]] = {}
        self._lock = threading.Lock()  # one sync at a time (the runner's thread, or a test)

    def shaped_lanes(self) -> list[Lane]:
        return [lane for _, lane in self.lanes.items() if lane.shaped]

    # -- inputs ---------------------------------------------------------------
    def on_snapshot(self, snap: Snapshot) -> None:
        """Record the newest snapshot; the next sync uses it."""
        self._snapshot = snap

    def _current_policy_objects(self) -> tuple[list[dict], list[dict]]:
        classes, budgets = self._policy_objects or ((), ())
        return list(classes), list(budgets)

    def minor_of(self, p: ResolvedPod) -> int | None:
        """The pod's HTB minor: as programmed, else the one it will get (its address decides)."""
        minor = self.state.minors.get(p.key)
        if minor is None and p.ips:
            minor = assign_minors([PodShape(p.key, p.ips, 1, 1)]).get(p.key)
        return minor

    # -- the reconcile -----------------------------------------------------------
    def sync(self, full: bool = True) -> bool:
        """One level-triggered reconcile. Returns True when the kernel matches the desired state.

        `full` re-reads every part of the kernel state; otherwise parts whose desired state did
        not change since the last good sync are trusted (the periodic resync re-reads them)."""
        with self._lock:
            return self._sync(full)

    def _sync(self, full: bool) -> bool:
        snap, before = self._snapshot, self.state
        if snap is None:
            return True
        t0 = time.perf_counter()
        stage = "policy"
        pods: list[ResolvedPod] | None = None
        try:
            if (snap.classes, snap.budgets) != self._policy_objects:
                self._policy_objects = (snap.classes, snap.budgets)
                self.policy.invalidate()
            policy, _ = self.policy()
            pods = [with_outbound_problems(p) for p in resolve_pods(policy, snap.pods, snap.namespaces)]
            self._note_missing_namespaces(pods, snap)
            if self.problems is not None:
                for p in pods:
                    self.problems.report(p.namespace, p.name, p.uid, p.problems)
                self.problems.forget({p.uid for p in pods})
            # per direction, the budget the local engine shares: the node's configured rate (downloads:
            # --ingress-rate), else the budget's total for the direction
            budgets = PerDirection.build(lambda d: self.cfg.node_rate_bps[d] or int(policy.totals[d]))
            node_rates: dict[Direction, int] = {}
            effective: dict[Direction, dict[str, Allocation]] = {}
            for lane in self.shaped_lanes():
                d = lane.direction
                stage = "allocate"
                self._allocate_locally_if_inputs_changed(pods, budgets[d], lane)
                eff = lane.allocations.effective(pods, self.minor_of, time.monotonic())
                stage = "plan"
                # the node class's rate: the controller's answer, else what the pods' rates add up to
                floor = self.cfg.datapath.floors[d]
                node_rates[d] = lane.allocations.node_rate(eff, floor)
                effective[d] = cap_to_node(eff, node_rates[d], floor, least_ceils(lane.allocations, pods))
            desired = self._desired(pods, effective, node_rates)
            stage = "apply"
            changes = self.datapath.apply(desired, full=full or before.desired is None)
        except (DesiredStateError, ValueError) as exc:
            self._failed(stage, f"{stage}: {exc}", pods, snap)
            return False
        except Exception as exc:
            log.exception("sync failed at %s", stage)
            self._failed(stage, f"{stage}: {exc.__class__.__name__}: {exc}", pods, snap)
            return False
        elapsed = time.perf_counter() - t0
        self.state = SyncState(tuple(pods), budgets, desired, dict(desired.minors), dict(desired.skipped), True,
                               "kernel matches the desired state", time.time(), before.sync_count + 1, snap.errors,
                               pods_known=True, effective=PerDirection.build(lambda d: effective.get(d, {})))
        self._count(changes, before.desired, desired, elapsed)
        return True

    def _note_missing_namespaces(self, pods: list[ResolvedPod], snap: Snapshot) -> None:
        """A namespace gone while pods of this node still run in it (deleted under them, its finalizer
        forced): said once and counted; its pods resolve by its name alone, as on the controller. One
        this agent never saw (its watch event behind the pod's, or gone before the agent started) is
        only noted: a race of two watches is no alarm."""
        missing = namespaces_missing(pods, snap.namespaces)
        for ns in sorted(set(missing) - self._missing_namespaces):
            if ns not in self._namespaces_seen:
                log.info("namespace %s of %d pod(s) of this node is not known (yet): they resolve by its name "
                         "alone until it is", ns, missing[ns])
                continue
            log.warning("namespace %s is gone while %d pod(s) of this node run in it: they resolve by the "
                        "namespace's name alone (its labels are gone; the controller does the same)", ns, missing[ns])
            if self.metrics:
                self.metrics.namespaces_missing.inc()
        self._missing_namespaces = set(missing)
        self._namespaces_seen = {p.namespace for p in pods} - self._missing_namespaces

    def _desired(self, pods: list[ResolvedPod], effective: dict[Direction, dict[str, Allocation]],
                 node_rates: dict[Direction, int]) -> DesiredState:
        """The kernel state for `pods` at the rates each shaped direction gave them, on the node as
        it is now (its facts, its pod devices where downloads are shaped or internal bytes counted)."""
        self._seed_frames(pods, effective, node_rates)
        shapes = tuple(self._shape(p, effective) for p in pods)
        on_devices = Direction.DOWNLOAD in node_rates or self.cfg.datapath.internal_by_device
        facts = self.facts
        devices = self.datapath.pod_devices(facts.uplinks) if on_devices else ()
        return desired_state(NodeInputs(
            facts.uplinks, facts.internal, shapes, PerDirection.build(node_rates.get), self.cfg.datapath,
            pod_devices=devices, wire_ratio=PerDirection.build(lambda d: self.lanes[d].frames.get(NODE_RATIO_KEY)),
            scopes=facts.scopes))

    def _shape(self, p: ResolvedPod, effective: dict[Direction, dict[str, Allocation]]) -> PodShape:
        """Pod `p` as the desired state needs it: per direction its rate and ceil (a direction not
        shaped, or a pod it has no class for: None, the floor) and its class's measured frame ratio."""
        rates = PerDirection.build(lambda d: pod_rates(effective[d][p.key]) if p.key in effective.get(d, {})
                                   else (None, None))
        return PodShape(p.key, p.ips, rates.map(lambda r: r[0]), rates.map(lambda r: r[1]),
                        wire_ratio=PerDirection.build(lambda d: self.lanes[d].frames.get(p.key)))

    def _seed_frames(self, pods: list[ResolvedPod], effective: dict[Direction, dict[str, Allocation]],
                     node_rates: dict[Direction, int]) -> None:
        """Classes this process has no measured frame ratio for keep the one the kernel shows they
        were given (`FrameRatios.seed`): a restarted agent changes nothing, its numbers being the same."""
        for d, node in node_rates.items():
            ratios, eff = self.lanes[d].frames, effective[d]
            if NODE_RATIO_KEY in ratios.ratios and all(p.key in ratios.ratios for p in pods):
                continue
            kernel = self.datapath.class_stats(d)
            node = max(MIN_RATE_BPS, node)
            st = kernel.get(NODE_MINOR)
            if st is not None:
                ratios.seed(NODE_RATIO_KEY, node, node, st.rate_bytes * 8, st.ceil_bytes * 8)
            for p in pods:
                minor, a = self.minor_of(p), eff.get(p.key)
                st = kernel.get(minor) if minor is not None else None
                if a is not None and st is not None:
                    ratios.seed(p.key, *pod_class_ip(*pod_rates(a), node), st.rate_bytes * 8, st.ceil_bytes * 8)

    def _count(self, changes: dict[str, int], before: DesiredState | None, desired: DesiredState,
               elapsed: float) -> None:
        # a part (tc, or iptables with its ipsets) planned exactly as in the last good sync, yet the
        # kernel needed changes there: someone else changed it
        drift = {kind: n for kind, n in changes.items() if n and before is not None and (
            desired.shapers == before.shapers if kind == "tc"
            else desired.device_counting == before.device_counting if kind == "ebpf"
            else desired.classifier == before.classifier)}
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
        if sum(changes.values()) > sum(drift.values()):
            log.info("reconciled: applied %s in %.1f ms",
                     ", ".join(f"{n} {k}" for k, n in changes.items() if n and k not in drift), elapsed * 1000)

    def _failed(self, stage: str, reason: str, pods: list[ResolvedPod] | None, snap: Snapshot) -> None:
        s = self.state  # the pods as resolved, if it got that far: the view shows what failed to apply
        self.state = SyncState(tuple(pods) if pods is not None else s.pods, s.budgets, s.desired, s.minors, s.skipped,
                               False, reason, s.last_success, s.sync_count, snap.errors,
                               pods_known=s.pods_known or pods is not None)
        if self.metrics:
            self.metrics.reconcile_errors.labels(stage).inc()
        log.error("reconcile failed (%s); the previous kernel state stays in force", reason)

    def _allocate_locally_if_inputs_changed(self, pods: list[ResolvedPod], budget: int, lane: Lane) -> None:
        """Single-node mode: a pod that appears, gets its IP or changes class (or a new budget
        total) gets its share in this sync, not at the next allocation round. Right after a
        restart, pods whose class the kernel already holds keep it (adoption) until the next round.
        The lane's direction says whose values (weight, guarantee, cap) and allocator."""
        d = lane.direction
        if lane.local is None:
            return
        inputs: dict[str, object] = {p.key: (p.team, p.egress_class, p.limits[d], bool(p.ips)) for p in pods}
        inputs[""] = budget  # a new budget total is a change too
        if inputs == self._allocated_inputs.get(d):
            return
        first = d not in self._allocated_inputs
        self._allocated_inputs[d] = inputs
        adopted = lane.allocations.adopted
        if first and adopted and all(self.minor_of(p) in adopted for p in pods if p.ips):
            return
        lane.allocations.replace(lane.local(pods, lane.demand, budget))
