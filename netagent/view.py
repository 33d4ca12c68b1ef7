"""What the agent exposes (metrics, /state, `netagent status`), as plain data.

Built at scrape time from kernel counters plus the agent's last decisions, so the
collector, the JSON endpoint and the status table all say the same thing. The views'
field names are the /state JSON keys (an edge: tests/test_agent_names.py holds them), so
downloads keep their `ingress_` names here; inside, both directions are read by one code path.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from core.direction import Direction, PerDirection
from core.wire import TEAM_QUOTA, TeamQuotaState, quota_entry
from tc.model import HtbClassSpec

from .accounting import Accounting, ClassReading
from .config import AgentConfig
from .datapath import DataPath
from .demand import PodDemand
from .desired import NODE_RATIO_KEY, from_wire, ip_bytes
from .lane import Lane
from .sync import SyncState

SCOPES = ("internal", "internet")
# every scope a pod's bytes may carry, in the metrics' order: the two between them while a NetworkScopes
# description is in force, or once counted (issue 39; netagent.datapath.add_device_counts)
ALL_SCOPES = ("internal", "cross-zone", "cross-region", "internet")


def scopes_of(c: dict[str, int], direction: str) -> tuple[str, ...]:
    """The scopes a pod's or the node's counters `c` show in `direction`: internal and internet, and the
    cross ones the data path put in (netagent.datapath.move_scopes)."""
    return tuple(s for s in ALL_SCOPES if s in SCOPES or f"{direction}_{s}" in c)


def _by_scope(c: dict[str, int], direction: str) -> dict[str, int]:
    return {s: c.get(f"{direction}_{s}", 0) for s in scopes_of(c, direction)}


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


# A pod's (or node's) bytes by scope in one direction, read by the code outside this edge
BYTES_BY_SCOPE: PerDirection = PerDirection(lambda v: v.egress_bytes, lambda v: v.ingress_bytes)

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
    # volume quotas of the node's pods' teams (docs/quotas.md), in the shape of single-machine mode's (which
    # replaces this key: netagent.localquota): from the controller's last answer that carried them; None: not
    # known (no such answer yet, or an older controller)
    quota: list[dict] | None = None
    quota_age_seconds: float | None = None  # since that answer

    def as_dict(self) -> dict:
        return asdict(self)


def _utc(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, timezone.utc)


def quota_entries(states: list[TeamQuotaState]) -> list[dict]:
    """The controller's quota states as /state shows them: the shape of single-machine mode's `quota`
    (netagent.localquota LocalQuota.teams) and of the leader's /v1/status, so `netagent status` renders both."""
    return [quota_entry(q.team, q.period, _utc(q.period_start), _utc(q.period_end),
                        PerDirection.build(lambda d: TEAM_QUOTA[d](q)))
            for q in sorted(states, key=lambda q: q.team)]


def reading(st, opts) -> ClassReading | None:
    return None if st is None else ClassReading(ip_bytes(st.bytes, st.packets, opts), st.packets)


def node_view(cfg: AgentConfig, state: SyncState, lanes: PerDirection[Lane], datapath: DataPath,
              controller_reachable: bool, accounting: Accounting | None = None,
              quota: tuple[float, list[dict]] | None = None) -> NodeView:
    """The node as the agent sees it now: its last decisions plus the kernel's counters, as the
    sampler and the reporter last read them (byte counters at most a report period old in controller
    mode, a second otherwise): a scrape costs no kernel read of its own, whatever the scrape rate.
    `quota`: (monotonic time of the controller's answer, its quota entries), None when not known."""
    pod_counters, node_counters = datapath.counters(max_age=cfg.report_period if cfg.controller else 1.0)
    desired = state.desired
    opts = cfg.datapath  # rates in the view are IP bit/s; the HTB classes hold them as frame rates
    shapers = desired.shapers if desired is not None else PerDirection(None, None)
    # per direction, each shaped class by minor and its counters (a direction not shaped: none)
    shapes: PerDirection[dict[int, HtbClassSpec]] = shapers.map(
        lambda sh: {c.minor: c for c in sh.pods} if sh is not None else {})
    stats = PerDirection.build(lambda d: datapath.class_stats(d) if d is Direction.UPLOAD or shapers[d] else {})
    # the classes' rates back in IP bit/s with the frames per IP byte each was given
    ratios = desired.wire_ratios if desired is not None else PerDirection({}, {})
    accounting = accounting or Accounting()
    out = []
    for p in state.pods:
        minor = state.minors.get(p.key)
        c = pod_counters.get(p.key, {})
        v = PodView(namespace=p.namespace, name=p.name, team=p.team, egress_class=p.egress_class, ips=p.ips,
                    minor=minor, waiting=state.skipped.get(p.key, ""), problems=p.problems,
                    egress_bytes=_by_scope(c, "egress"), ingress_bytes=_by_scope(c, "ingress"))
        for d in Direction:
            shape = shapes[d].get(minor) if minor is not None else None
            st = stats[d].get(minor) if minor is not None else None
            if d is Direction.UPLOAD or shape is not None:
                _pod_direction(v, d, shape, st, ratios[d].get(p.key), lanes[d].demand.get(p.key), c, accounting, opts)
        out.append(v)
    allocs, up, down = lanes.upload.allocations.current, lanes.upload.allocations, lanes.download.allocations
    node_rates = PerDirection.build(
        lambda d: from_wire(sh.node_rate, opts, ratios[d].get(NODE_RATIO_KEY)) if (sh := shapers[d]) else None)
    return NodeView(
        node=cfg.node, pods=out,
        # internet uploads as they left (after the node's shaper, plus what bypasses it); downloads as they arrived
        egress_bytes={s: node_counters.get(f"egress_{s}_wire" if s == "internet" else f"egress_{s}",
                                           node_counters.get(f"egress_{s}", 0))
                      for s in scopes_of(node_counters, "egress")},
        ingress_bytes=_by_scope(node_counters, "ingress"),
        unknown_source_egress_bytes=node_counters.get("egress_unknown_internet", 0),
        allocation_bps=node_rates.upload or 0,
        ready=state.ready, ready_reason=state.ready_reason, controller=cfg.controller or "",
        controller_reachable=controller_reachable, fail_static=up.fail_static,
        lease_expires_in=None if allocs.lease_expires == float("inf") else allocs.lease_expires - time.monotonic(),
        safe_floor_bps=up.floor_bps, allocation_source="floor" if up.fail_static else allocs.source,
        last_reconcile_success=state.last_success, leaf_qdisc=datapath.leaf_qdisc,
        iptables_backend=datapath.iptables_backend, source_errors=state.source_errors,
        ingress_allocation_bps=node_rates.download, ingress_safe_floor_bps=down.floor_bps,
        unknown_destination_ingress_bytes=node_counters.get("ingress_unknown_internet", 0),
        quota=quota[1] if quota is not None else None,
        quota_age_seconds=round(time.monotonic() - quota[0], 1) if quota is not None else None)


# The /state keys of a pod's values per direction (uploads kept their unprefixed names)
_KEYS = {d: {k: (k if d is Direction.UPLOAD else f"ingress_{k}") for k in (
    "allocation_bps", "limit_bps", "dropped_packets", "dropped_bytes", "demand_bps", "usage_bps", "throttled",
    "throttled_seconds")} for d in Direction}


def _pod_direction(v: PodView, d: Direction, shape, st, ratio: float | None, demand: PodDemand | None,
                   c: dict[str, int], accounting: Accounting, opts) -> None:
    """Pod view `v`'s values in direction `d`: its class's rate and ceil, drops, what reached the
    far side (docs/accounting.md) and its demand."""
    key, word = f"{v.namespace}/{v.name}", d.metric_word
    values: dict[str, object] = {"dropped_packets": st.drops if st else 0}
    if shape is not None:
        values.update(allocation_bps=from_wire(shape.rate, opts, ratio), limit_bps=from_wire(shape.ceil, opts, ratio))
    else:  # an upload not programmed yet (waiting for its IP)
        values.update(allocation_bps=0, limit_bps=0)
    if demand is not None or d is Direction.UPLOAD:
        dem = demand or PodDemand()
        values.update(demand_bps=dem.demand_bps, usage_bps=dem.usage_bps, throttled=dem.throttled,
                      throttled_seconds=dem.throttled_seconds)
    for k, value in values.items():
        setattr(v, _KEYS[d][k], value)
    # counted as they left the pod's class; the rules' count is what was offered to it (uploads) or
    # what arrived (downloads: arrived = reached the pod + dropped + queued)
    got = accounting.delivered(word, key, reading(st, opts))
    if got is None:
        return
    offered = c.get(f"{word}_internet", 0)
    if d is Direction.UPLOAD:
        if not accounting.seeding:  # seeding: the rules' count, as the agent before showed
            v.egress_bytes["internet"] = got[0]
            v.dropped_bytes = accounting.dropped(word, key, offered)
    else:
        v.ingress_delivered_bytes = got[0]
        v.ingress_dropped_bytes = accounting.dropped(word, key, offered)
