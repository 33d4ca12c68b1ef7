"""What the agent exposes (metrics, /state, `netagent status`), as plain data.

Built at scrape time from kernel counters plus the agent's last decisions, so the
collector, the JSON endpoint and the status table all say the same thing.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from .accounting import Accounting, ClassReading
from .allocations import Allocations
from .config import AgentConfig
from .datapath import DataPath
from .demand import PodDemand
from .desired import NODE_RATIO_KEY, from_wire, ip_bytes
from .sync import SyncState

SCOPES = ("internal", "internet")


@dataclass
class PodView:
    namespace: str
    name: str
    team: str
    egress_class: str
    ips: tuple[str, ...] = ()
    minor: int | None = None  # HTB class 1:<minor>, None while the pod waits (no IP)
    waiting: str = ""  # why the pod is not programmed yet
    allocation_bps: float = 0.0
    limit_bps: float = 0.0
    demand_bps: float = 0.0
    usage_bps: float = 0.0
    throttled: bool = False
    throttled_seconds: float = 0.0
    egress_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SCOPES, 0))
    ingress_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SCOPES, 0))
    dropped_packets: int = 0
    dropped_bytes: int = 0  # offered to the upload shaper and neither sent nor queued (netagent.accounting)
    problems: tuple[tuple[str, str], ...] = ()  # (reason, message)
    # downloads (internet ingress): the pod's download class (HTB rate/ceil), usage and demand
    ingress_allocation_bps: float = 0.0
    ingress_limit_bps: float = 0.0
    ingress_demand_bps: float = 0.0
    ingress_usage_bps: float = 0.0
    ingress_throttled: bool = False
    ingress_throttled_seconds: float = 0.0
    ingress_dropped_packets: int = 0
    ingress_dropped_bytes: int = 0
    # internet bytes that left the pod's download class towards the pod (ingress_bytes: as they arrived)
    ingress_delivered_bytes: int = 0


@dataclass
class NodeView:
    node: str
    pods: list[PodView]
    egress_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SCOPES, 0))
    ingress_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SCOPES, 0))
    # internet egress the node forwarded from sources that are no known pod (shaped in the default class)
    unknown_source_egress_bytes: int = 0
    allocation_bps: float = 0.0
    ready: bool = False
    ready_reason: str = ""
    controller: str = ""  # URL, or "" in single-node mode
    controller_reachable: bool = False
    fail_static: bool = False
    lease_expires_in: float | None = None
    safe_floor_bps: float = 0.0  # what every pod falls to when the controller's lease runs out
    allocation_source: str = ""  # controller, local, adopted (after a restart, before an answer), none
    last_reconcile_success: float = 0.0
    leaf_qdisc: str = ""
    iptables_backend: str = ""
    source_errors: tuple[str, ...] = ()
    # downloads: None when the download shaper is not programmed
    ingress_allocation_bps: float | None = None  # the node's download class rate
    ingress_safe_floor_bps: float = 0.0
    unknown_destination_ingress_bytes: int = 0  # internet ingress to no known pod (the download default class)

    def as_dict(self) -> dict:
        return asdict(self)


def reading(st, opts) -> ClassReading | None:
    return None if st is None else ClassReading(ip_bytes(st.bytes, st.packets, opts), st.packets)


def node_view(cfg: AgentConfig, state: SyncState, allocations: Allocations, demand: dict[str, PodDemand],
              datapath: DataPath, controller_reachable: bool, ingress_allocations: Allocations | None = None,
              ingress_demand: dict[str, PodDemand] | None = None, accounting: Accounting | None = None) -> NodeView:
    """The node as the agent sees it now: its last decisions plus the kernel's counters, as the
    sampler and the reporter last read them (byte counters at most a report period old in controller
    mode, a second otherwise): a scrape costs no kernel read of its own, whatever the scrape rate."""
    pod_counters, node_counters = datapath.counters(max_age=cfg.report_period if cfg.controller else 1.0)
    stats = datapath.class_stats()
    desired = state.desired
    opts = cfg.datapath  # rates in the view are IP bit/s; the HTB classes hold them as frame rates
    shapes = {c.minor: c for c in desired.shaper.pods} if desired is not None else {}
    dl = desired.ingress_shaper if desired is not None else None
    ingress_shapes = {c.minor: c for c in dl.pods} if dl is not None else {}
    ingress_stats = datapath.ingress_class_stats() if dl is not None else {}
    ingress_demand = ingress_demand or {}
    # the classes' rates back in IP bit/s with the frames per IP byte each was given
    ratios = desired.wire_ratios if desired is not None else {}
    ingress_ratios = desired.ingress_wire_ratios if desired is not None else {}
    accounting = accounting or Accounting()
    out = []
    for p in state.pods:
        minor = state.minors.get(p.key)
        shape = shapes.get(minor) if minor is not None else None
        d = demand.get(p.key) or PodDemand()
        c = pod_counters.get(p.key, {})
        st = stats.get(minor) if minor is not None else None
        out.append(PodView(
            namespace=p.namespace, name=p.name, team=p.team, egress_class=p.egress_class, ips=p.ips,
            minor=minor, waiting=state.skipped.get(p.key, ""),
            allocation_bps=from_wire(shape.rate, opts, ratios.get(p.key)) if shape else 0,
            limit_bps=from_wire(shape.ceil, opts, ratios.get(p.key)) if shape else 0,
            demand_bps=d.demand_bps, usage_bps=d.usage_bps, throttled=d.throttled,
            throttled_seconds=d.throttled_seconds,
            egress_bytes={s: c.get(f"egress_{s}", 0) for s in SCOPES},
            ingress_bytes={s: c.get(f"ingress_{s}", 0) for s in SCOPES},
            dropped_packets=st.drops if st else 0, problems=p.problems,
        ))
        # uploads counted as they left the pod's class (docs/accounting.md); the rules' count is what it offered
        sent = accounting.delivered("egress", p.key, reading(st, opts))
        if sent is not None and not accounting.seeding:  # seeding: the rules' count, as the agent before showed
            offered = c.get("egress_internet", 0)
            out[-1].egress_bytes["internet"] = sent[0]
            out[-1].dropped_bytes = accounting.dropped("egress", p.key, offered)
        ishape, ist, idem = ingress_shapes.get(minor), ingress_stats.get(minor), ingress_demand.get(p.key)
        if ishape is not None:
            v = out[-1]
            iratio = ingress_ratios.get(p.key)
            v.ingress_allocation_bps = from_wire(ishape.rate, opts, iratio)
            v.ingress_limit_bps = from_wire(ishape.ceil, opts, iratio)
            v.ingress_dropped_packets = ist.drops if ist else 0
            got = accounting.delivered("ingress", p.key, reading(ist, opts))
            if got is not None:  # arrived (the rules, ingress_bytes) = reached the pod + dropped + queued
                v.ingress_delivered_bytes = got[0]
                v.ingress_dropped_bytes = accounting.dropped("ingress", p.key, c.get("ingress_internet", 0))
            if idem is not None:
                v.ingress_demand_bps, v.ingress_usage_bps = idem.demand_bps, idem.usage_bps
                v.ingress_throttled, v.ingress_throttled_seconds = idem.throttled, idem.throttled_seconds
    allocs = allocations.current
    return NodeView(
        node=cfg.node, pods=out,
        # internet uploads as they left (after the node's shaper, plus what bypasses it); downloads as they arrived
        egress_bytes={s: node_counters.get(f"egress_{s}_wire" if s == "internet" else f"egress_{s}",
                                           node_counters.get(f"egress_{s}", 0)) for s in SCOPES},
        ingress_bytes={s: node_counters.get(f"ingress_{s}", 0) for s in SCOPES},
        unknown_source_egress_bytes=node_counters.get("egress_unknown_internet", 0),
        allocation_bps=from_wire(desired.shaper.node_rate, opts, ratios.get(NODE_RATIO_KEY)) if desired else 0,
        ready=state.ready, ready_reason=state.ready_reason, controller=cfg.controller or "",
        controller_reachable=controller_reachable, fail_static=allocations.fail_static,
        lease_expires_in=None if allocs.lease_expires == float("inf") else allocs.lease_expires - time.monotonic(),
        safe_floor_bps=allocations.floor_bps,
        allocation_source="floor" if allocations.fail_static else allocs.source,
        last_reconcile_success=state.last_success, leaf_qdisc=datapath.leaf_qdisc,
        iptables_backend=datapath.iptables_backend, source_errors=state.source_errors,
        ingress_allocation_bps=from_wire(dl.node_rate, opts, ingress_ratios.get(NODE_RATIO_KEY)) if dl is not None else None,
        ingress_safe_floor_bps=ingress_allocations.floor_bps if ingress_allocations is not None else 0.0,
        unknown_destination_ingress_bytes=node_counters.get("ingress_unknown_internet", 0),
    )
