"""The agent: sources in, kernel state out, level-triggered. This module only wires its parts.

  sync      (`sync.NodeSync`)      inputs -> one reconcile; publishes `SyncState`
  runner    (`runner.Runner`)      when to sync: on change, on a timer, after failures
  sampler   (`sampler.Sampler`)    class counters every second -> usage, throttling, demand
  allocations (`allocations.Allocations`) what each pod gets: lease, floor, adoption
  view      (`view.node_view`)     what metrics, /state and `netagent status` show
The reporter (controller mode) talks to the agent only through `report_inputs` and
`set_allocations`. Stopping the agent changes nothing in the kernel (fail-static).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from core.direction import Direction, PerDirection
from core.objects import Snapshot
from core.scopes import ScopesDescription, keep_last_valid, lpm_entries, parse
from core.policy import ResolvedPod
from core.wire import TeamQuotaState

from .accounting import Accounting
from .allocations import Allocations, AllocationSet
from .config import AgentConfig
from .datapath import DataPath
from .demand import PodDemand
from .desired import ip_bytes
from .facts import NodeFacts
from .frames import FrameRatios
from .lane import Lane, LocalAllocate
from .runner import Runner
from .sampler import Sampler
from .sync import NodeSync
from .view import NodeView, node_view, quota_entries

log = logging.getLogger(__name__)
# the node's counters and its classes' counters read within this many seconds count as one read: their
# rates since the last report cover the same seconds (a 5 s period: within 4 %)
SAME_READ_S = 0.2


@dataclass(frozen=True)
class ReportInputs:
    """What the reporter sends: the node's pods, per direction their demand and the node's internet bytes."""

    node: str
    pods: tuple[ResolvedPod, ...]
    demand: PerDirection[Mapping[str, PodDemand]]  # per direction, per pod key
    node_internet_bytes: PerDirection[int | None] = PerDirection(None, None)  # None: the data path could not read it
    # the direction's shaper is programmed (the last good sync applied it): only then is its demand measured
    shaped: PerDirection[bool] = PerDirection(True, False)
    # per direction, each class's IP bytes (by pod key, as the sampler counts them) read together with
    # node_internet_bytes, so the two give rates over the same seconds (issue 37); None: not read with it
    class_bytes: PerDirection[Mapping[str, int] | None] = PerDirection(None, None)
    read_at: float | None = None  # monotonic time of those reads; None: the reporter's clock when it builds


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


class Agent:
    def __init__(self, cfg: AgentConfig, datapath: DataPath, local: Callable[..., LocalAllocate]
                 | None = None, metrics=None, problems=None, initial: AllocationSet | None = None,
                 facts: NodeFacts | None = None):
        """`local(policy, direction=d)` makes the single-node allocator of direction `d` from the agent's
        policy (netagent.local.LocalAllocator); None in controller mode."""
        self.cfg = cfg
        self.datapath = datapath
        opts = cfg.datapath

        # one lane per direction: the same machinery on the pods' values for it (pod.limits[d]);
        # downloads are counted only without --shape-ingress
        def lane(d: Direction) -> Lane:
            floor = cfg.default_floor_bps if d is Direction.UPLOAD else opts.floors[d]
            start = dataclasses.replace(initial) if initial is not None and d is Direction.DOWNLOAD else initial
            return Lane(d, Allocations(floor, start, direction=d), FrameRatios(opts.wire_mtu, opts.wire_l2_bytes),
                        shaped=d is Direction.UPLOAD or cfg.shape_ingress)

        self.lanes = PerDirection.build(lane)
        self.node = NodeSync(cfg, datapath, self.lanes, metrics=metrics, problems=problems, facts=facts)
        if local is not None:
            for d, ln in self.lanes.items():
                ln.local = local(lambda: self.node.policy()[0], direction=d)
        self.runner = Runner(self.node.sync, cfg.min_sync_interval, cfg.resync_seconds)
        self.accounting = Accounting()  # where a pod's internet byte is counted (netagent.accounting)
        self.sampler = Sampler(self.node, datapath, self.runner.wake, cfg.sample_seconds, cfg.allocate_seconds,
                               self.accounting)
        self.controller_reachable = False
        # the quota state of the controller's last answer that carried one: (monotonic, /state entries)
        self.quota: tuple[float, list[dict]] | None = None
        self.scopes: ScopesDescription | None = None  # the NetworkScopes description in force (last valid)
        self._scopes_seen: tuple = (None, None, ())  # (object, zone, service CIDRs) last followed

    # -- inputs ---------------------------------------------------------------
    def on_snapshot(self, snap: Snapshot) -> None:
        self.node.on_snapshot(snap)
        services, facts = snap.service_cidrs, self.node.facts
        full = False
        if self.cfg.services_from_cluster and services and services != facts.service_cidrs:
            # a ServiceCIDR came or went: the internal networks (rules and device counter) follow
            log.info("service CIDRs from the cluster's ServiceCIDR objects: %s (were %s)", ",".join(services),
                     ",".join(facts.service_cidrs) or "none")
            self.node.facts = dataclasses.replace(facts, service_cidrs=services)
            full = True
        # the described CIDRs: internal networks too, and the device counter's tries
        full = self._follow_scopes(snap) or full
        self.runner.wake(full=full)

    def _follow_scopes(self, snap: Snapshot) -> bool:
        """The NetworkScopes object and this node's zone into the facts' scope entries (issue 39). An
        invalid object is logged and counted (netagent_policy_problems{reason="network_scopes_invalid"})
        and the last valid description stays in force; no object: no description (internal and internet
        only). -> whether the entries changed (the device counter's tries and the internal networks follow)."""
        services = snap.service_cidrs or self.node.facts.service_cidrs
        seen = (snap.network_scopes, snap.node_zone, services)
        if seen == self._scopes_seen:
            return False
        self._scopes_seen = seen
        if snap.network_scopes is None:
            self.scopes = None
        else:
            # the service CIDRs are the cluster's own ranges a zone must not overlap; the pods' ranges are a
            # zone's (the "subnets, pod ranges"), so they are not passed as the cluster's
            parsed = parse(snap.network_scopes, service_cidrs=services)
            if parsed.problems:
                log.error("NetworkScopes %s is invalid, %s: %s", "cluster", "the last valid description stays in force"
                          if self.scopes is not None else "no description is in force", "; ".join(parsed.problems))
                if self.node.problems is not None:
                    self.node.problems.count("network_scopes_invalid")
            self.scopes = keep_last_valid(self.scopes, parsed)
            if self.scopes is not None and snap.node_zone is None and self.scopes.zones:
                log.warning("this node has no topology.kubernetes.io/zone label: every described zone counts as "
                            "cross-zone from here (docs/scopes.md)")
        entries = lpm_entries(self.scopes, snap.node_zone) if self.scopes is not None else {}
        scopes = tuple(sorted(((str(n), sid) for n, sid in entries.items()), key=lambda e: e[0]))
        if scopes == self.node.facts.scopes:
            return False
        log.info("destination scopes: %d CIDR(s) described, this node's zone %s", len(scopes), snap.node_zone)
        self.node.facts = dataclasses.replace(self.node.facts, scopes=scopes)
        return True

    def set_allocations(self, allocs: PerDirection[AllocationSet] | PerDirection[AllocationSet | None]) -> None:
        """The controller's answer, per direction (None: that direction's allocations stay as they are)."""
        changed = False
        for d, a in allocs.items():
            changed = (a is not None and self.lanes[d].allocations.replace(a)) or changed
        if changed:
            self.runner.wake()

    def wake_full(self) -> None:
        """Someone else changed the kernel: a full reconcile now."""
        self.runner.wake(full=True)

    def set_uplinks(self, uplinks: tuple[str, ...]) -> None:
        """The default-route devices changed (learnt uplinks): shape there from the next sync on."""
        self.node.facts = dataclasses.replace(self.node.facts, uplinks=tuple(uplinks))
        self.runner.wake(full=True)

    def set_controller_reachable(self, reachable: bool) -> None:
        self.controller_reachable = reachable

    def set_quota(self, states: list[TeamQuotaState]) -> None:
        """The quota state of the node's pods' teams from the controller's answer (shown in /state)."""
        self.quota = (time.monotonic(), quota_entries(states))

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        # what the kernel holds now seeds the allocations: a restart changes nothing
        try:
            for d, ln in self.lanes.items():
                ln.allocations.adopted = self.datapath.adopted_rates(d)
        except Exception as exc:
            log.warning("could not read existing tc classes to adopt: %s", exc)
        try:  # the counts go on from the carries the agent before kept (docs/accounting.md)
            self.accounting.restore(self.datapath.load_carries())
        except Exception as exc:  # unreadable: no seeding either (it would count the pods' drops as sent)
            log.warning("could not read the accounting carries: %s", exc)
        self.runner.start()
        self.sampler.start()

    def stop(self) -> None:
        """Leave the data path in force (fail-static): stopping changes nothing in the kernel."""
        self.runner.stop()
        self.sampler.stop()

    def sync(self, full: bool = True) -> bool:
        """One reconcile now, in the caller's thread (tests; the runner calls `node.sync` itself)."""
        return self.node.sync(full)

    # -- what others read -------------------------------------------------------
    @property
    def pods(self) -> tuple[ResolvedPod, ...]:
        return self.node.state.pods

    @property
    def facts(self) -> NodeFacts:
        """What the agent knows of its node now (uplinks, service CIDRs)."""
        return self.node.facts

    @property
    def allocations(self) -> Allocations:
        """The upload lane's allocations (what the controller's answer and its lease are judged by)."""
        return self.lanes.upload.allocations

    @property
    def demand(self) -> dict[str, PodDemand]:
        """The upload lane's demand, per pod key."""
        return self.lanes.upload.demand

    @property
    def fail_static(self) -> bool:
        return self.allocations.fail_static

    def pods_known(self) -> bool:
        """True once a snapshot of the pod source was resolved (the source lists before it
        hands one over): until then the agent does not know its pods and must not report."""
        return self.node.state.pods_known

    def report_inputs(self) -> ReportInputs:
        state = self.node.state
        desired = state.desired if state.ready else None
        shaped = PerDirection.build(lambda d: desired is not None and desired.shapers[d] is not None)
        node_bytes: PerDirection[int | None] = PerDirection(None, None)
        read_at = time.monotonic()
        try:
            _, node_counters = self.datapath.counters()  # a fresh read, once per report period
            # IP bytes on the wire (docs/datapath.md): the unit of the pods' usage and of the budget
            node_bytes = PerDirection.build(lambda d: _int(node_counters.get(
                f"{d.metric_word}_internet_wire", node_counters.get(f"{d.metric_word}_internet"))))
        except Exception as exc:
            log.debug("node counters unreadable: %s", exc)
        classes = PerDirection.build(lambda d: self._class_bytes(d, read_at) if shaped[d] else None)
        return ReportInputs(self.cfg.node, state.pods, self.lanes.map(lambda lane: dict(lane.demand)), node_bytes,
                            shaped.replace(Direction.UPLOAD, True), classes, read_at)

    def _class_bytes(self, direction: Direction, since: float) -> dict[str, int] | None:
        """Each class's IP bytes read now, right after the node's counters (`since`); None when that read
        took longer than SAME_READ_S (an apply held the counters' lock): not the same seconds then."""
        try:
            at, stats = self.datapath.sample_stats(direction)
        except Exception as exc:
            log.debug("class counters unreadable: %s", exc)
            return None
        if at - since > SAME_READ_S:
            return None
        opts = self.cfg.datapath
        return {key: ip_bytes(st.bytes, st.packets, opts) for key, minor in self.node.state.minors.items()
                if (st := stats.get(minor)) is not None}

    def view(self) -> NodeView:
        return node_view(self.cfg, self.node.state, self.lanes, self.datapath, self.controller_reachable,
                         self.accounting, self.quota)

    def health(self) -> tuple[bool, str]:
        return self.runner.health()

    def readiness(self) -> tuple[bool, str]:
        state = self.node.state
        return state.ready, state.ready_reason
