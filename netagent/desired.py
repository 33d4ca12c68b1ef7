"""The desired kernel state: a pure function from what the node should do to the kernel state that does it.

Inputs are plain data (uplinks, internal CIDRs, pods with IPs and rates, the node's
internet rate, options); the output is the desired tc state (`tc.model.ShaperSpec`)
and the desired iptables state (`iptables.model.ClassifierState`). Nothing here
touches the kernel; the appliers in `tc/` and `iptables/` diff it against what the
kernel holds.

Rates are IP bytes on the wire (what clouds meter and bill for internet egress): a pod's rate,
the node's and the floor are IP bit/s. HTB counts each segment's link-layer frame (the Ethernet
header included, GSO packets as their segments), so the HTB classes get the IP rate times
(MTU + L2 header) / MTU: exact for full-size segments, the bulk traffic that fills a budget;
smaller packets carry more header per byte. Where a class's own counters show its mix (a pod's
upload class carries the ACKs of its downloads), the agent gives it its measured ratio instead
(`netagent.frames`, `PodShape.wire_ratio`, `NodeInputs.wire_ratio`), so its rate is IP bytes for the
packets it really carries. `to_wire`/`from_wire` convert; the sampler turns class bytes back into
IP bytes exactly (bytes - L2 header x packets).

HTB minors are derived from the pod's IP address (its low 16 bits), probing upward
on collision in a fixed order. The same pods therefore get the same minors after an
agent restart, with no state to persist, and a restart changes nothing in the kernel.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field

from core.errors import NetagentError
from iptables.model import ClassifierState, PodClassification
from iptables.render import set_members
from tc.model import (
    DEFAULT_MINOR,
    DOWNLOAD_ROOT_MAJOR,
    DOWNLOAD_IFB_ALIAS,
    MAX_RATE_BPS,
    MIN_RATE_BPS,
    POD_MINOR_MAX,
    RESERVED_MINORS,
    HtbClassSpec,
    ShaperSpec,
    ack_minor,
    bulk_minor,
)

# Not used by kube-proxy (0x4000, 0x8000), portmap (0x2000), Calico (0xff000000),
# Tailscale (0xff0000) or Cilium's magic marks (0xf00).
DEFAULT_MARK_BIT = 0x1000


class DesiredStateError(NetagentError, ValueError):
    """The inputs cannot be turned into a kernel state; the message names the input."""


@dataclass(frozen=True)
class PodShape:
    """A pod as the desired state needs it: key, addresses, rate and ceil in both directions."""
    key: str  # "namespace/name"
    ips: tuple[str, ...]
    rate: int  # guaranteed internet egress, bit/s
    ceil: int  # internet egress cap, bit/s
    ingress_rate: int | None = None  # guaranteed internet ingress (downloads), bit/s; None: the download floor
    ingress_ceil: int | None = None  # internet ingress cap, bit/s; None: as ingress_rate
    # frames HTB counts per IP byte of this pod's class, as measured (netagent.frames); None: full-size
    wire_ratio: float | None = None
    ingress_wire_ratio: float | None = None


# --internal-counting: where the pods' internal bytes are counted (netagent.datapath.choose_internal_counting)
COUNTING_MODES = ("auto", "device", "rules")


@dataclass(frozen=True)
class DataPathOptions:
    """How the data path is laid out on this node (mark bit, IFB, HTB major, leaf qdisc, floor)."""
    mark_bit: int = DEFAULT_MARK_BIT
    ifb: str = "netagent0"
    htb_major: int = 0x1
    leaf_qdisc: str = "pfifo"  # the probe picks fq_codel where the kernel has it
    default_rate: int = 1_000_000  # the floor for internet traffic from unknown sources, bit/s
    filter_pref: int = 0xC000
    wire_l2_bytes: int = 14  # what HTB counts per packet beyond the IP packet (Ethernet header)
    wire_mtu: int = 1500  # the uplink's IP MTU: the size of a full segment
    # downloads (internet ingress): a second IFB fed from the pod-facing devices, its own HTB tree
    ingress_ifb: str = "netagent-in"
    ingress_htb_major: int = DOWNLOAD_ROOT_MAJOR  # a major of its own: a download class never reads as an upload one
    ingress_default_rate: int = 1_000_000  # the download floor for pods not known yet, bit/s
    # the pods' internal bytes: counted on their devices by an eBPF program (tc/ebpf/; chosen at
    # start, `choose_internal_counting`) rather than by the rules in ipsets
    internal_by_device: bool = False
    bpf_dir: str = "/sys/fs/bpf/netagent"  # where the device counter's maps, programs and links are pinned (a bpffs)
    count_pref: int = 0xC001  # its filters' priority on the pod devices (after the download redirect)
    # how it attaches its programs: tcx links where the kernel has them (auto), else tc filters
    count_attach: str = "auto"
    # on tcx links, its egress programs end the hook for a packet without the mark bit, so an internal
    # packet skips the shaper's redirect filter (~100 ns a packet), where that skips nobody else's
    count_gate: bool = True


MAX_WIRE_RATIO = 2.0  # frames per IP byte: a 14-byte header on a 14-byte packet; beyond it the input is wrong


def to_wire(bps: int, opts: DataPathOptions, ratio: float | None = None) -> int:
    """An IP rate (bit/s) as the HTB rate that carries it in full-size frames (or in frames of
    `ratio` bytes per IP byte, a class's measured mix), rounded up to the whole bytes per second
    HTB holds (so the kernel holds exactly this number)."""
    if ratio is not None:
        return frames_bits(bps, ratio)
    m = opts.wire_mtu + opts.wire_l2_bytes
    return min(MAX_RATE_BPS // 8 * 8, -(-bps * m // (8 * opts.wire_mtu)) * 8)


def frames_bits(bps: int, ratio: float) -> int:
    """An IP rate (bit/s) in frames of `ratio` bytes per IP byte, rounded up to HTB's whole bytes per
    second (a billionth of a byte under a whole one counts as it: a ratio taken from the kernel's
    number gives that number back)."""
    return min(MAX_RATE_BPS // 8 * 8, math.ceil(bps * ratio / 8 - 1e-9) * 8)


def from_wire(bps: int, opts: DataPathOptions, ratio: float | None = None) -> int:
    """The IP rate an HTB rate stands for: an inverse of `to_wire` (to_wire(from_wire(r)) == r),
    and the one a whole number of bytes when there is one, so a round rate reads back as itself
    (with a measured `ratio`: the IP rate within a byte per second)."""
    if ratio is not None:
        return int(bps / ratio)
    m = opts.wire_mtu + opts.wire_l2_bytes
    k = bps // 8
    lo, hi = (k - 1) * 8 * opts.wire_mtu // m, k * 8 * opts.wire_mtu // m  # to_wire(x) == 8k for lo < x <= hi
    whole = hi - hi % 8
    return whole if whole > lo else hi


def ip_bytes(l2_bytes: int, packets: int, opts: DataPathOptions) -> int:
    """IP bytes in HTB class counters (which count each segment's frame)."""
    return max(0, l2_bytes - opts.wire_l2_bytes * packets)


@dataclass(frozen=True)
class NodeInputs:
    """Everything `desired_state` needs: uplinks, internal CIDRs, pods, the node's rate, options."""
    uplinks: tuple[str, ...]
    internal_cidrs: tuple[str, ...]
    pods: tuple[PodShape, ...]
    node_rate: int  # the node's internet egress allocation, bit/s
    options: DataPathOptions = field(default_factory=DataPathOptions)
    # the node's download (internet ingress) allocation, bit/s; None: downloads are counted, not shaped
    ingress_node_rate: int | None = None
    pod_devices: tuple[str, ...] = ()  # pod-facing devices (host-side veths): downloads are shaped, internal bytes counted there
    # the node classes' measured frames per IP byte (netagent.frames); None: full-size
    wire_ratio: float | None = None
    ingress_wire_ratio: float | None = None


@dataclass(frozen=True)
class DeviceCounting:
    """The eBPF counter of the internal bytes (tc/ebpf/): what is internal, which pod addresses are
    counted, on which devices; and the uplinks, where the node's totals are counted."""
    networks: tuple[tuple[int, tuple[str, ...]], ...]  # (family, CIDRs): the internal CIDRs, link-local and multicast too
    addresses: tuple[str, ...]  # every programmed pod's addresses
    devices: tuple[str, ...]  # the pod-facing devices (host-side veths)
    uplinks: tuple[str, ...] = ()  # the node's internet-facing devices


@dataclass(frozen=True)
class DesiredState:
    """The kernel state to apply: the tc shaper, the iptables classifier, and the pods' minors."""
    shaper: ShaperSpec
    classifier: ClassifierState
    minors: dict[str, int]  # pod key -> its HTB class's minor (its leaves': tc.model), the same in both shapers
    skipped: dict[str, str]  # pod key -> why it is not programmed yet (e.g. no IP)
    ingress_shaper: ShaperSpec | None = None  # downloads; None: not shaped on this node
    # the measured frames per IP byte the classes were given (pod key, or NODE_RATIO_KEY for the
    # node class): the view turns their rates back into IP rates with them
    wire_ratios: dict[str, float] = field(default_factory=dict)
    ingress_wire_ratios: dict[str, float] = field(default_factory=dict)
    device_counting: DeviceCounting | None = None  # None: the rules count internal bytes


NODE_RATIO_KEY = ""  # the node class's key among the wire ratios (no pod key is empty)


def canonical_cidrs(cidrs: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Networks in canonical form (host bits cleared), de-duplicated, IPv4 before IPv6."""
    out = set()
    for c in cidrs:
        try:
            out.add(str(ipaddress.ip_network(c.strip(), strict=False)))
        except ValueError as exc:
            raise DesiredStateError(f"internal CIDR {c!r} is not a valid IPv4/IPv6 network ({exc})") from None
    return tuple(sorted(out, key=lambda s: (":" in s, ipaddress.ip_network(s))))


def _check_rate(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DesiredStateError(f"{what}: rate must be an integer bit/s, got {value!r}")
    if value <= 0:
        raise DesiredStateError(f"{what}: rate {value} bit/s must be positive (to stop a pod's internet egress, use a tiny rate)")
    if value > MAX_RATE_BPS:
        raise DesiredStateError(f"{what}: rate {value} bit/s is beyond 2^64-1 bit/s")


def _minor_seed(ips: tuple[str, ...]) -> int:
    addrs = sorted((ipaddress.ip_address(ip) for ip in ips), key=lambda a: (a.version, a))
    return int(addrs[0]) & POD_MINOR_MAX


def assign_minors(pods: list[PodShape]) -> dict[str, int]:
    """Pod key -> HTB minor: the low 14 bits of its lowest address (the minors above are its
    leaves'), probing upward on collision in a fixed order, so the same pods get the same minors
    after a restart."""
    free = POD_MINOR_MAX + 1 - len(RESERVED_MINORS & set(range(POD_MINOR_MAX + 1)))
    if len(pods) > free:
        raise DesiredStateError(f"{len(pods)} pods on one node: HTB has room for {free}")
    taken = set(RESERVED_MINORS)
    out: dict[str, int] = {}
    # IPv4-addressed pods first, then by key: a fixed order makes probing deterministic
    for pod in sorted(pods, key=lambda p: (_minor_seed(p.ips), p.key)):
        minor = _minor_seed(pod.ips)
        while minor in taken:
            minor = (minor + 1) & POD_MINOR_MAX
        taken.add(minor)
        out[pod.key] = minor
    return out


def desired_state(inputs: NodeInputs) -> DesiredState:
    """The tc and iptables state that shapes `inputs.pods` on `inputs.uplinks`; raises
    DesiredStateError naming the input that cannot be programmed."""
    opts = inputs.options
    if not inputs.uplinks:
        raise DesiredStateError("no uplink: the node's internet-facing device(s) must be known (--uplink)")
    _check_rate(inputs.node_rate, "node allocation")
    _check_rate(opts.default_rate, "default-class floor")
    if not (68 <= opts.wire_mtu <= 65535 and 0 <= opts.wire_l2_bytes <= 256):
        raise DesiredStateError(f"wire MTU {opts.wire_mtu} / L2 header {opts.wire_l2_bytes} bytes out of range "
                                "(68-65535, 0-256)")
    internal = canonical_cidrs(inputs.internal_cidrs)
    node_rate = max(MIN_RATE_BPS, inputs.node_rate)
    _check_ratio(inputs.wire_ratio, "node")
    _check_ratio(inputs.ingress_wire_ratio, "node download")

    ready: list[PodShape] = []
    skipped: dict[str, str] = {}
    seen_ips: dict[str, str] = {}
    for pod in sorted(inputs.pods, key=lambda p: p.key):
        _check_rate(pod.rate, f"pod {pod.key}")
        _check_rate(pod.ceil, f"pod {pod.key} ceil")
        _check_ratio(pod.wire_ratio, f"pod {pod.key}")
        _check_ratio(pod.ingress_wire_ratio, f"pod {pod.key} download")
        if not pod.ips:
            skipped[pod.key] = "no IP yet"
            continue
        ips = []
        for ip in pod.ips:
            try:
                ips.append(str(ipaddress.ip_address(ip)))
            except ValueError:
                raise DesiredStateError(f"pod {pod.key}: {ip!r} is not an IP address") from None
        clash = [ip for ip in ips if ip in seen_ips]
        if clash:
            # an IP still held by another pod object (a deleted pod not yet gone): the older key wins
            skipped[pod.key] = f"IP {clash[0]} is still in use by {seen_ips[clash[0]]}"
            continue
        for ip in ips:
            seen_ips[ip] = pod.key
        ready.append(dataclasses.replace(pod, ips=tuple(ips)))

    minors = assign_minors(ready)
    classes = [_pod_class(minors[p.key], p.key, p.rate, p.ceil, node_rate, opts, p.wire_ratio) for p in ready]
    floor = max(MIN_RATE_BPS, to_wire(min(opts.default_rate, node_rate), opts))
    shaper = ShaperSpec(
        ifb=opts.ifb,
        uplinks=tuple(inputs.uplinks),
        mark_bit=opts.mark_bit,
        node_rate=max(MIN_RATE_BPS, to_wire(node_rate, opts, inputs.wire_ratio)),
        default=HtbClassSpec(DEFAULT_MINOR, floor, floor, "default"),
        pods=tuple(sorted(classes)),
        major=opts.htb_major,
        leaf=opts.leaf_qdisc,
        filter_pref=opts.filter_pref,
    )
    ingress_shaper = None
    if inputs.ingress_node_rate is not None:
        ingress_shaper = _ingress_shaper(inputs, ready, minors)
    dl = ingress_shaper is not None
    # packets go straight to the pod's leaves: bulk by its address, its small packets to its control leaf
    classify = [PodClassification(p.key, p.ips, (opts.htb_major, bulk_minor(minors[p.key])),
                                  (opts.ingress_htb_major, bulk_minor(minors[p.key])) if dl else None,
                                  ack_class=(opts.htb_major, ack_minor(minors[p.key])),
                                  ingress_ack_class=(opts.ingress_htb_major, ack_minor(minors[p.key])) if dl else None)
                for p in ready]
    classifier = ClassifierState(
        mark_bit=opts.mark_bit,
        internal_cidrs=internal,
        pods=tuple(classify),
        uplinks=tuple(inputs.uplinks),
        default_class=(opts.htb_major, DEFAULT_MINOR),  # unknown sources: shaped at the floor, never unshaped
        # downloads to addresses no known pod holds: the download floor, never unshaped
        ingress_default_class=(opts.ingress_htb_major, DEFAULT_MINOR) if dl else None,
        internal_by_device=opts.internal_by_device,
    )
    counting = None
    if opts.internal_by_device:
        members = set_members(internal)
        counting = DeviceCounting(tuple((family, members[family]) for family in (4, 6)),
                                  tuple(sorted(ip for p in ready for ip in p.ips)),
                                  tuple(sorted(set(inputs.pod_devices) - set(inputs.uplinks))),
                                  tuple(inputs.uplinks))
    ratios = _ratios(inputs.wire_ratio, ((p.key, p.wire_ratio) for p in ready))
    ingress_ratios = _ratios(inputs.ingress_wire_ratio, ((p.key, p.ingress_wire_ratio) for p in ready)) if dl else {}
    return DesiredState(shaper, classifier, minors, skipped, ingress_shaper, ratios, ingress_ratios, counting)


def _ratios(node: float | None, pods) -> dict[str, float]:
    out = {key: r for key, r in pods if r is not None}
    if node is not None:
        out[NODE_RATIO_KEY] = node
    return out


def _check_ratio(ratio: float | None, what: str) -> None:
    if ratio is not None and not (isinstance(ratio, (int, float)) and 1.0 <= ratio <= MAX_WIRE_RATIO):
        raise DesiredStateError(f"{what}: frames per IP byte {ratio!r} must be a number in 1..{MAX_WIRE_RATIO:g}")


def _pod_class(minor: int, key: str, rate: int, ceil: int, node_rate: int, opts: DataPathOptions,
              ratio: float | None = None) -> HtbClassSpec:
    """A pod's HTB class within a node class of `node_rate` (IP bit/s in, wire bit/s out, in frames
    of `ratio` bytes per IP byte when measured)."""
    rate, ceil = pod_class_ip(rate, ceil, node_rate)
    return HtbClassSpec(minor, max(to_wire(rate, opts, ratio), MIN_RATE_BPS),
                        max(to_wire(ceil, opts, ratio), MIN_RATE_BPS), key)


def pod_class_ip(rate: int, ceil: int, node_rate: int) -> tuple[int, int]:
    """A pod class's (rate, ceil) in IP bit/s within a node class of `node_rate`."""
    rate = min(rate, node_rate)
    return rate, min(max(ceil, rate), node_rate)


def _ingress_shaper(inputs: NodeInputs, ready: list[PodShape], minors: dict[str, int]) -> ShaperSpec:
    """The download shaper: the same tree as the upload one (node class, a class per pod with the
    pod's minor, the default class at the download floor) on the download IFB, fed from the
    pod-facing devices."""
    opts = inputs.options
    _check_rate(inputs.ingress_node_rate, "node download allocation")
    _check_rate(opts.ingress_default_rate, "download floor")
    node_rate = max(MIN_RATE_BPS, inputs.ingress_node_rate)
    floor = min(opts.ingress_default_rate, node_rate)
    classes = []
    for p in ready:
        rate = floor if p.ingress_rate is None else p.ingress_rate
        ceil = rate if p.ingress_ceil is None else p.ingress_ceil
        _check_rate(rate, f"pod {p.key} download")
        _check_rate(ceil, f"pod {p.key} download ceil")
        classes.append(_pod_class(minors[p.key], p.key, rate, ceil, node_rate, opts, p.ingress_wire_ratio))
    wire_floor = max(MIN_RATE_BPS, to_wire(floor, opts))
    devices = tuple(sorted(set(inputs.pod_devices) - set(inputs.uplinks)))
    return ShaperSpec(
        ifb=opts.ingress_ifb,
        uplinks=devices,
        mark_bit=opts.mark_bit,
        node_rate=max(MIN_RATE_BPS, to_wire(node_rate, opts, inputs.ingress_wire_ratio)),
        default=HtbClassSpec(DEFAULT_MINOR, wire_floor, wire_floor, "default"),
        pods=tuple(sorted(classes)),
        major=opts.ingress_htb_major,
        leaf=opts.leaf_qdisc,
        filter_pref=opts.filter_pref,
        ifb_alias=DOWNLOAD_IFB_ALIAS,
        optional_devices=True,
    )
