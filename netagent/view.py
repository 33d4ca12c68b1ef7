"""What the agent exposes (metrics, /state, `netagent status`), as plain data.

Built at scrape time from kernel counters plus the agent's last decisions, so the
collector, the JSON endpoint and the status table all say the same thing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
    problems: tuple[tuple[str, str], ...] = ()  # (reason, message)


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

    def as_dict(self) -> dict:
        return asdict(self)
