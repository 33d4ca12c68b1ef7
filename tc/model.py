"""Desired and observed shaper state as plain, comparable data.

The agent (`netagent.desired`) builds a `ShaperSpec`; `tc.diff` compares it with an `ObservedShaper`
read from the kernel and yields the operations that make them equal. Rates are
bits per second here, as users write them; the netlink layer converts to bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# HTB minors that are never handed to a pod. A pod's leaf qdisc takes the handle <minor>:, so a
# minor equal to an HTB root's major (1: uploads, 2: downloads) would collide with that root (EINVAL).
NODE_MINOR = 0x1
DOWNLOAD_ROOT_MAJOR = 0x2
DEFAULT_MINOR = 0xFFFE
RESERVED_MINORS = frozenset({0x0, NODE_MINOR, DOWNLOAD_ROOT_MAJOR, DEFAULT_MINOR, 0xFFFF})

# A pod's class (minor P, at most POD_MINOR_MAX) is an inner class with the pod's rate and ceil and
# two leaves that share them: its small packets (pure ACKs, handshakes, requests, pings, DNS; prio 0)
# ahead of its bulk data (prio 1). One FIFO for both made a pod's download ACKs wait behind up to
# a whole queue of its own 64 KiB GSO uploads (and an upload's ACKs behind its downloads), so a
# pod that moved data both ways could fill neither limit. The leaves' minors are P with one high
# bit set, so they never collide with a pod's minor, each other, or the reserved ones.
POD_MINOR_MAX = 0x3FFF
BULK_LEAF_BIT = 0x4000
ACK_LEAF_BIT = 0x8000


def bulk_minor(pod_minor: int) -> int:
    """The pod's bulk leaf: everything but its small packets."""
    return pod_minor | BULK_LEAF_BIT


def ack_minor(pod_minor: int) -> int:
    """The pod's control leaf: packets of at most 256 bytes (pure ACKs, SYN/FIN/RST, pings, DNS queries)."""
    return pod_minor | ACK_LEAF_BIT


def pod_of_leaf(minor: int) -> int | None:
    """The pod minor whose leaf `minor` is, or None when it is no pod leaf (no leaf bit, or both:
    the default class 0xfffe and 0xffff among them)."""
    if bool(minor & BULK_LEAF_BIT) == bool(minor & ACK_LEAF_BIT):
        return None
    return minor & POD_MINOR_MAX

# Largest rate we accept: HTB's 64-bit rate attribute holds bytes/s as u64.
MAX_RATE_BPS = (1 << 64) - 1
MIN_RATE_BPS = 8  # one byte per second: HTB cannot express less

# The IFB's alias says what it carries and marks it as ours (adoption, cleanup). The texts are what
# nodes already carry (an agent adopts by them): the names say the pod's direction, the texts stay.
UPLOAD_IFB_ALIAS = "netagent: internet egress shaper"
DOWNLOAD_IFB_ALIAS = "netagent: internet ingress (download) shaper"
IFB_ALIASES = frozenset({UPLOAD_IFB_ALIAS, DOWNLOAD_IFB_ALIAS})


@dataclass(frozen=True, order=True)
class HtbClassSpec:
    """One HTB class under the node class: a pod, or the default class."""

    minor: int
    rate: int  # guaranteed, bit/s
    ceil: int  # may borrow up to, bit/s
    key: str = ""  # "namespace/pod" (or "default"): for messages and stats only

    def __post_init__(self) -> None:
        validate_rate(self.rate, f"class {self.key or hex(self.minor)} rate")
        validate_rate(self.ceil, f"class {self.key or hex(self.minor)} ceil")
        if self.ceil < self.rate:
            raise ValueError(
                f"class {self.key or hex(self.minor)}: ceil {self.ceil} bit/s is below rate {self.rate} bit/s"
            )
        if not 0 < self.minor < 0xFFFF:
            raise ValueError(f"class {self.key}: HTB minor {self.minor:#x} out of range 1..0xfffe")


@dataclass(frozen=True)
class ShaperSpec:
    """One shaper: an IFB with its HTB tree, fed by a redirect filter on the egress hook of `devices`.

    Uploads: the uplinks (internet-bound pod traffic). Downloads (`optional_devices`): the
    pod-facing devices, internet-sourced traffic on its way to the pods; a pod's device may go
    at any moment, so a missing one is skipped, and a node without pods has none."""

    ifb: str  # the IFB device that carries the shaped traffic
    devices: tuple[str, ...]  # devices whose egress hook is redirected into the IFB
    mark_bit: int  # the firewall-mark bit iptables sets on internet traffic
    node_rate: int  # node class rate = ceil, bit/s (the node's internet allocation)
    default: HtbClassSpec  # unknown-source internet traffic: shaped at a floor
    pods: tuple[HtbClassSpec, ...] = ()
    major: int = 0x1  # HTB handle major on the IFB
    leaf: str = "pfifo"  # leaf qdisc kind: fq_codel where the kernel has it, else tbf (tc/sizing.py: segmenting)
    filter_pref: int = 0xC000  # clsact filter priority on `devices` (ours alone)
    ifb_txqueuelen: int = 5000
    ifb_alias: str = UPLOAD_IFB_ALIAS
    optional_devices: bool = False  # downloads: `devices` are pod devices that come and go

    def __post_init__(self) -> None:
        validate_rate(self.node_rate, "node rate")
        if not self.ifb or len(self.ifb) > 15:
            raise ValueError(f"IFB name {self.ifb!r} must be 1..15 characters")
        if self.ifb_alias not in IFB_ALIASES:
            raise ValueError(f"IFB alias {self.ifb_alias!r} is not one of netagent's")
        if not self.devices and not self.optional_devices:
            raise ValueError("no uplink given: name the node's internet-facing device(s)")
        if self.mark_bit <= 0 or self.mark_bit & (self.mark_bit - 1) or self.mark_bit >= 1 << 32:
            raise ValueError(f"mark bit {self.mark_bit:#x} must be exactly one bit of a 32-bit mark")
        minors = [p.minor for p in self.pods]
        if len(set(minors)) != len(minors):
            raise ValueError("two pod classes share one HTB minor")
        if RESERVED_MINORS & set(minors):
            raise ValueError(f"pod classes use reserved HTB minors {sorted(RESERVED_MINORS & set(minors))}")
        beyond = [m for m in minors if m > POD_MINOR_MAX]
        if beyond:
            raise ValueError(f"pod classes use HTB minors above {POD_MINOR_MAX:#x} (kept for their leaves): "
                             f"{[hex(m) for m in sorted(beyond)[:5]]}")
        if self.default.minor != DEFAULT_MINOR:
            raise ValueError(f"the default class must use minor {DEFAULT_MINOR:#x}")
        if not 0 < self.major < 0xFFFF:
            raise ValueError(f"HTB major {self.major:#x} out of range")

    @property
    def classes(self) -> tuple[HtbClassSpec, ...]:
        """The node class's children (pods and default) in minor order."""
        return tuple(sorted((*self.pods, self.default)))


def validate_rate(bps: int, what: str) -> None:
    if isinstance(bps, bool) or not isinstance(bps, int):
        raise ValueError(f"{what}: rate must be an integer number of bit/s, got {bps!r}")
    if bps < MIN_RATE_BPS:
        raise ValueError(f"{what}: rate {bps} bit/s is too small; the least HTB can shape is {MIN_RATE_BPS} bit/s")
    if bps > MAX_RATE_BPS:
        raise ValueError(f"{what}: rate {bps} bit/s exceeds 2^64-1 bit/s")


# ---- observed state -------------------------------------------------------


@dataclass(frozen=True)
class ObservedClass:
    minor: int
    parent_minor: int
    rate_bytes: int
    ceil_bytes: int
    buffer: int
    cbuffer: int
    quantum: int
    prio: int


@dataclass(frozen=True)
class ObservedLeaf:
    parent_minor: int
    kind: str
    handle_major: int
    limit: int | None
    tbf_rate: int | None = None  # the segmenting leaf's (tbf) rate, bytes/s
    tbf_burst: int | None = None  # and its bucket in bytes, as netagent recorded it (tc.netlink.tbf_options)


@dataclass(frozen=True)
class ObservedFilter:
    uplink: str
    pref: int
    handle: int
    kind: str
    mark_bit: int | None  # decoded from the classic-BPF program, None when not ours
    redirect_ifindex: int | None


@dataclass
class ObservedShaper:
    ifb_index: int | None = None
    ifb_ours: bool = False
    ifb_up: bool = False
    ifb_txqueuelen: int = 0
    root_kind: str | None = None
    root_handle_major: int | None = None
    root_default_minor: int | None = None
    classes: dict[int, ObservedClass] = field(default_factory=dict)
    leaves: dict[int, ObservedLeaf] = field(default_factory=dict)
    uplink_index: dict[str, int | None] = field(default_factory=dict)
    uplink_clsact: dict[str, bool] = field(default_factory=dict)
    filters: dict[str, list[ObservedFilter]] = field(default_factory=dict)
    feed_mtu: int = 0  # the largest MTU of the feeding devices present (the tbf leaf's frame size)


@dataclass(frozen=True)
class ClassStats:
    """Counters of one HTB class, read in one dump per device."""

    minor: int
    bytes: int
    packets: int
    drops: int
    overlimits: int
    backlog_bytes: int
    backlog_packets: int
    rate_bytes: int
    ceil_bytes: int


def fold_leaves(raw: dict[int, ClassStats]) -> dict[int, ClassStats]:
    """Class counters as the agent reads them: one entry per pod (its inner class, which counts what
    both its leaves sent) with its leaves' drops, backlog and overlimits added; the leaves dropped.
    A leaf whose pod class is missing (a half-made tree) keeps its own entry."""
    out = dict(raw)
    for minor, leaf in raw.items():
        pod = pod_of_leaf(minor)
        if pod is None or pod not in out:
            continue
        del out[minor]
        p = out[pod]
        out[pod] = ClassStats(pod, p.bytes, p.packets, p.drops + leaf.drops, p.overlimits + leaf.overlimits,
                              p.backlog_bytes + leaf.backlog_bytes, p.backlog_packets + leaf.backlog_packets,
                              p.rate_bytes, p.ceil_bytes)
    return out
