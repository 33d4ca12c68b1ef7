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
from typing import Iterable, TypeVar

from core.direction import Direction, PerDirection
from core.errors import NetagentError
from iptables.model import ClassifierState, PodClassification
from iptables.render import set_members
from tc.model import (
    DEFAULT_MINOR,
    DOWNLOAD_IFB_ALIAS,
    MAX_RATE_BPS,
    MIN_RATE_BPS,
    POD_MINOR_MAX,
    RESERVED_MINORS,
    UPLOAD_IFB_ALIAS,
    HtbClassSpec,
    ShaperSpec,
    ack_minor,
    bulk_minor,
)

from .options import COUNTING_MODES, DEFAULT_MARK_BIT, DataPathOptions  # noqa: F401 (importers of desired take them here)

V = TypeVar("V")


class DesiredStateError(NetagentError, ValueError):
    """The inputs cannot be turned into a kernel state; the message names the input."""


@dataclass(frozen=True)
class PodShape:
    """A pod as the desired state needs it: key, addresses, and its class's rate and ceil per direction.

    An int rate/ceil/ratio is the upload's alone (downloads at their floor): most callers shape uploads."""
    key: str  # "namespace/name"
    ips: tuple[str, ...]
    # guaranteed internet rate, bit/s; a download's None: the download floor
    rate: int | PerDirection[int | None]
    ceil: int | PerDirection[int | None]  # internet cap, bit/s; a download's None: as its rate
    # frames HTB counts per IP byte of this pod's class, as measured (netagent.frames); None: full-size
    wire_ratio: float | None | PerDirection[float | None] = None

    def rates(self, d: Direction) -> tuple[int | None, int | None]:
        """(rate, ceil) in direction `d`."""
        return per_direction(self.rate)[d], per_direction(self.ceil)[d]

    def ratio(self, d: Direction) -> float | None:
        return per_direction(self.wire_ratio)[d]


def per_direction(value: V | PerDirection[V | None]) -> PerDirection[V | None]:
    """A value given per direction, or the upload's alone (the download's None)."""
    return value if isinstance(value, PerDirection) else PerDirection(value, None)


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
    # the node's internet allocation, bit/s, per direction (an int: the upload's); a download's
    # None: downloads are counted, not shaped
    node_rate: int | PerDirection[int | None]
    options: DataPathOptions = field(default_factory=DataPathOptions)
    pod_devices: tuple[str, ...] = ()  # pod-facing devices (host-side veths): downloads are shaped, internal bytes counted there
    # the node classes' measured frames per IP byte (netagent.frames); None: full-size
    wire_ratio: float | None | PerDirection[float | None] = None
    scopes: tuple[tuple[str, int], ...] = ()  # (CIDR, scope id) for the device counter's tries (NodeFacts.scopes)

    @property
    def node_rates(self) -> PerDirection[int | None]:
        return per_direction(self.node_rate)

    @property
    def node_ratios(self) -> PerDirection[float | None]:
        return per_direction(self.wire_ratio)


@dataclass(frozen=True)
class DeviceCounting:
    """The eBPF counter of the internal bytes (tc/ebpf/): what is internal, which pod addresses are
    counted, on which devices; and the uplinks, where the node's totals are counted."""
    networks: tuple[tuple[int, tuple[str, ...]], ...]  # (family, CIDRs): the internal CIDRs, link-local and multicast too
    addresses: tuple[str, ...]  # every programmed pod's addresses
    devices: tuple[str, ...]  # the pod-facing devices (host-side veths)
    uplinks: tuple[str, ...] = ()  # the node's internet-facing devices
    scopes: tuple[tuple[str, int], ...] = ()  # (CIDR, scope id): the counter's tries (NodeFacts.scopes)


@dataclass(frozen=True)
class DesiredState:
    """The kernel state to apply: a tc shaper per direction, the iptables classifier, the pods' minors."""
    shapers: PerDirection[ShaperSpec | None]  # the upload's always; the download's None: not shaped on this node
    classifier: ClassifierState
    minors: dict[str, int]  # pod key -> its HTB class's minor (its leaves': tc.model), the same in both shapers
    skipped: dict[str, str]  # pod key -> why it is not programmed yet (e.g. no IP)
    # per direction, the measured frames per IP byte the classes were given (pod key, or
    # NODE_RATIO_KEY for the node class): the view turns their rates back into IP rates with them
    wire_ratios: PerDirection[dict[str, float]] = field(default_factory=lambda: PerDirection({}, {}))
    device_counting: DeviceCounting | None = None  # None: the rules count internal bytes

    @property
    def shaper(self) -> ShaperSpec:
        """The upload shaper (always programmed)."""
        up = self.shapers.upload
        assert up is not None
        return up


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


def _check_rate(value: object, what: str) -> None:
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
    rates = inputs.node_rates
    if rates.upload is None:
        raise DesiredStateError("node allocation: the upload shaper needs a rate")
    _check_rate(rates.upload, "node allocation")
    _check_rate(opts.floors.upload, "default-class floor")
    if not (68 <= opts.wire_mtu <= 65535 and 0 <= opts.wire_l2_bytes <= 256):
        raise DesiredStateError(f"wire MTU {opts.wire_mtu} / L2 header {opts.wire_l2_bytes} bytes out of range "
                                "(68-65535, 0-256)")
    internal = canonical_cidrs(inputs.internal_cidrs)
    for d, ratio in inputs.node_ratios.items():
        _check_ratio(ratio, f"node{_WORD[d]}")

    ready, skipped = _ready_pods(inputs.pods)
    minors = assign_minors(ready)
    shapers = PerDirection.build(lambda d: _shaper(d, inputs, ready, minors))

    def leaf(d: Direction, minor: int) -> tuple[int, int] | None:
        return (opts.htb_majors[d], minor) if shapers[d] is not None else None

    # packets go straight to the pod's leaves: bulk by its address, its small packets to its control leaf
    classify = [PodClassification(p.key, p.ips, (opts.htb_majors.upload, bulk_minor(minors[p.key])),
                                  leaf(Direction.DOWNLOAD, bulk_minor(minors[p.key])),
                                  leaf(Direction.UPLOAD, ack_minor(minors[p.key])),
                                  leaf(Direction.DOWNLOAD, ack_minor(minors[p.key])))
                for p in ready]
    # addresses no known pod holds: each shaped direction's default class (its floor), never unshaped
    classifier = ClassifierState(opts.mark_bit, internal, tuple(classify), tuple(inputs.uplinks),
                                 leaf(Direction.UPLOAD, DEFAULT_MINOR), leaf(Direction.DOWNLOAD, DEFAULT_MINOR),
                                 internal_by_device=opts.internal_by_device)
    counting = None
    if opts.internal_by_device:
        members = set_members(internal)
        counting = DeviceCounting(tuple((family, members[family]) for family in (4, 6)),
                                  tuple(sorted(ip for p in ready for ip in p.ips)),
                                  tuple(sorted(set(inputs.pod_devices) - set(inputs.uplinks))),
                                  tuple(inputs.uplinks), tuple(inputs.scopes))
    ratios = PerDirection.build(lambda d: _ratios(inputs.node_ratios[d], ((p.key, p.ratio(d)) for p in ready))
                                if shapers[d] is not None else {})
    return DesiredState(shapers, classifier, minors, skipped, ratios, counting)


_WORD = {Direction.UPLOAD: "", Direction.DOWNLOAD: " download"}  # in error messages: "pod ns/a download"


def _ready_pods(pods: tuple[PodShape, ...]) -> tuple[list[PodShape], dict[str, str]]:
    """The pods that can be programmed (their addresses canonical), and the others with why not
    (no IP yet, or an IP another pod still holds); a pod's bad rate, ratio or address raises."""
    ready: list[PodShape] = []
    skipped: dict[str, str] = {}
    seen_ips: dict[str, str] = {}
    for pod in sorted(pods, key=lambda p: p.key):
        rate, ceil = pod.rates(Direction.UPLOAD)
        _check_rate(rate, f"pod {pod.key}")
        _check_rate(ceil, f"pod {pod.key} ceil")
        for d in Direction:
            _check_ratio(pod.ratio(d), f"pod {pod.key}{_WORD[d]}")
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

    return ready, skipped


def _ratios(node: float | None, pods: Iterable[tuple[str, float | None]]) -> dict[str, float]:
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


def _shaper(d: Direction, inputs: NodeInputs, ready: list[PodShape], minors: dict[str, int]) -> ShaperSpec | None:
    """Direction `d`'s shaper: a node class, a class per pod (its minor, the same in both shapers)
    and the default class at the direction's floor, on the direction's IFB. Uploads are fed from
    the uplinks; downloads from the pod-facing devices (None when the node has no download rate:
    counted, not shaped)."""
    opts = inputs.options
    node_rate = inputs.node_rates[d]
    if node_rate is None:
        return None
    floor = opts.floors[d]
    word = _WORD[d]
    _check_rate(node_rate, f"node{word} allocation")
    _check_rate(floor, "default-class floor" if d is Direction.UPLOAD else "download floor")
    node_rate = max(MIN_RATE_BPS, node_rate)
    floor = min(floor, node_rate)
    classes = []
    for p in ready:
        rate, ceil = p.rates(d)
        rate = floor if rate is None else rate
        ceil = rate if ceil is None else ceil
        _check_rate(rate, f"pod {p.key}{word}")
        _check_rate(ceil, f"pod {p.key}{word} ceil")
        classes.append(_pod_class(minors[p.key], p.key, rate, ceil, node_rate, opts, p.ratio(d)))
    wire_floor = max(MIN_RATE_BPS, to_wire(floor, opts))
    upload = d is Direction.UPLOAD
    return ShaperSpec(
        ifb=opts.ifbs[d],
        devices=tuple(inputs.uplinks) if upload else tuple(sorted(set(inputs.pod_devices) - set(inputs.uplinks))),
        mark_bit=opts.mark_bit,
        node_rate=max(MIN_RATE_BPS, to_wire(node_rate, opts, inputs.node_ratios[d])),
        default=HtbClassSpec(DEFAULT_MINOR, wire_floor, wire_floor, "default"),
        pods=tuple(sorted(classes)),
        major=opts.htb_majors[d],
        leaf=opts.leaf_qdisc,
        filter_pref=opts.filter_pref,
        ifb_alias=UPLOAD_IFB_ALIAS if upload else DOWNLOAD_IFB_ALIAS,
        optional_devices=not upload,
    )
