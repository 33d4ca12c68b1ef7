"""Desired vs observed tc state -> the operations that make them equal. Pure.

Order matters and is encoded here, not in the executor: the IFB, its HTB root
and every class exist before any uplink filter redirects traffic into them, so
no packet ever meets an IFB without a shaper; deletions come last.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import sizing
from .model import (
    MIN_RATE_BPS,
    NODE_MINOR,
    HtbClassSpec,
    ObservedShaper,
    ShaperSpec,
    ack_minor,
    bulk_minor,
)

# (rate bytes/s, size bytes) -> kernel ticks; the executor passes the kernel's clock.
TickFn = Callable[[int, int], int]


@dataclass(frozen=True)
class ClassParams:
    """An HTB class exactly as the kernel stores it, so specs and dumps compare."""

    minor: int
    parent_minor: int
    rate_bytes: int
    ceil_bytes: int
    burst_bytes: int
    cburst_bytes: int
    quantum: int
    buffer: int
    cbuffer: int
    prio: int = 0  # leaves only: HTB serves a lower prio first (the kernel keeps it for leaves alone)
    inner: bool = False  # has children: HTB fixes quantum and prio at creation and ignores later values


@dataclass(frozen=True)
class Leaf:
    """A leaf class and the queue under it."""

    minor: int
    ceil: int  # bit/s: sizes the queue


@dataclass(frozen=True)
class Op:
    action: str  # see Executor.apply for the list
    device: str = ""
    minor: int = 0
    params: ClassParams | None = None
    leaf_kind: str = ""
    leaf_limit: int = 0
    leaf_rate: int = 0  # tbf: bytes/s
    leaf_burst: int = 0  # tbf: bytes
    detail: str = ""

    def __str__(self) -> str:
        where = f" {self.device}" if self.device else ""
        what = f" class {self.minor:#x}" if self.minor else ""
        return f"{self.action}{where}{what}{(' ' + self.detail) if self.detail else ''}"


MAX_TICKS = 0xFFFFFFFF  # HTB's buffer and cbuffer are 32-bit tick counts


def _bucket(rate_b: int, size: int, ticks: TickFn) -> tuple[int, int]:
    """(bucket bytes, its ticks at `rate_b`), the size cut so that its time fits HTB's 32-bit buffer
    field: a 64 KiB bucket at a few hundred bit/s (a pod's control leaf at a tiny guarantee) is days
    of ticks."""
    t = ticks(rate_b, size)
    if t <= MAX_TICKS:
        return size, t
    size = max(1, size * MAX_TICKS // t - 1)
    return size, ticks(rate_b, size)


def class_params(spec: HtbClassSpec | None, minor: int, parent: int, rate: int, ceil: int, ticks: TickFn,
                 prio: int = 0, inner: bool = False) -> ClassParams:
    rate_b, ceil_b = sizing.bytes_per_second(rate), sizing.bytes_per_second(ceil)
    burst, buffer = _bucket(rate_b, sizing.burst_bytes(rate), ticks)
    cburst, cbuffer = _bucket(ceil_b, sizing.burst_bytes(ceil), ticks)
    return ClassParams(
        minor=minor,
        parent_minor=parent,
        rate_bytes=rate_b,
        ceil_bytes=ceil_b,
        burst_bytes=burst,
        cburst_bytes=cburst,
        quantum=sizing.quantum_bytes(rate),
        buffer=buffer,
        cbuffer=cbuffer,
        prio=prio,
        inner=inner,
    )


def desired_classes(spec: ShaperSpec, ticks: TickFn) -> dict[int, ClassParams]:
    """node class -> pod classes (inner: the pod's rate and ceil) -> each pod's control leaf (prio 0)
    and bulk leaf (prio 1), and the default class (a leaf) beside the pods."""
    out = {NODE_MINOR: class_params(None, NODE_MINOR, 0, spec.node_rate, spec.node_rate, ticks, inner=True)}
    out[spec.default.minor] = class_params(spec.default, spec.default.minor, NODE_MINOR, spec.default.rate,
                                           spec.default.ceil, ticks)
    for c in spec.pods:
        out[c.minor] = class_params(c, c.minor, NODE_MINOR, c.rate, c.ceil, ticks, inner=True)
        ack_rate, bulk_rate = sizing.split_rate(c.rate, MIN_RATE_BPS)
        out[ack_minor(c.minor)] = class_params(c, ack_minor(c.minor), c.minor, ack_rate, c.ceil, ticks, prio=0)
        out[bulk_minor(c.minor)] = class_params(c, bulk_minor(c.minor), c.minor, bulk_rate, c.ceil, ticks, prio=1)
    return out


def desired_leaves(spec: ShaperSpec) -> list[Leaf]:
    """Every leaf class, in minor order: the default class and both leaves of each pod."""
    out = [Leaf(spec.default.minor, spec.default.ceil)]
    for c in spec.pods:
        out += [Leaf(ack_minor(c.minor), c.ceil), Leaf(bulk_minor(c.minor), c.ceil)]
    return sorted(out, key=lambda leaf: leaf.minor)


def leaf_kind(spec: ShaperSpec, c: HtbClassSpec | Leaf, have: str | None = None) -> str:
    """The leaf's qdisc kind. `spec.leaf == "tbf"` (the probe's choice where the kernel has no fq_codel)
    segments where a GSO packet is a long wait and costs the least: classes whose ceil is at most
    sizing.SEGMENT_CEIL_BPS get the segmenting tbf, faster ones pfifo. Between that ceil and twice it a
    leaf keeps the kind it has (`have`), so a ceil moving around the boundary does not replace its queue
    every period."""
    if spec.leaf != "tbf":
        return spec.leaf
    if c.ceil <= sizing.SEGMENT_CEIL_BPS:
        return "tbf"
    if c.ceil <= 2 * sizing.SEGMENT_CEIL_BPS and have in ("tbf", "pfifo"):
        return have
    return "pfifo"


def leaf_limit(kind: str, c: HtbClassSpec | Leaf) -> int:
    """The leaf's limit: bytes for bfifo and tbf, packets for pfifo (fq_codel has none of ours)."""
    if kind in ("bfifo", "tbf"):
        return sizing.leaf_limit_bytes(c.ceil)
    return sizing.leaf_limit_packets(c.ceil)


def plan_ops(spec: ShaperSpec, obs: ObservedShaper, ticks: TickFn) -> list[Op]:
    ops: list[Op] = []
    ifb = spec.ifb

    # 1. the IFB device
    if obs.ifb_index is None:
        ops.append(Op("create_ifb", ifb))
    elif obs.ifb_txqueuelen != spec.ifb_txqueuelen or not obs.ifb_up:
        ops.append(Op("set_ifb", ifb))

    # 2. the HTB root: adopted when it is ours, never replaced in place
    root_ok = obs.root_kind == "htb" and obs.root_handle_major == spec.major
    if not root_ok:
        if obs.root_kind not in (None, "noqueue", "pfifo_fast", "pfifo", "fq_codel", "mq"):
            # our own IFB carries a qdisc we did not put there: replace it, say what it was
            ops.append(Op("delete_root", ifb, detail=f"(was {obs.root_kind})"))
        elif obs.root_kind == "htb":
            ops.append(Op("delete_root", ifb, detail=f"(htb with foreign handle {obs.root_handle_major:#x})"))
        ops.append(Op("add_root", ifb))
    elif obs.root_default_minor != spec.default.minor:
        ops.append(Op("change_root", ifb))
    observed_classes = obs.classes if root_ok else {}
    observed_leaves = obs.leaves if root_ok else {}

    # 3. classes: parents before children (the node class, then pods below 0x4000, then their
    # leaves above it), then the leaves' queues
    want = desired_classes(spec, ticks)
    for minor in sorted(want, key=lambda m: (m != NODE_MINOR, m)):
        p = want[minor]
        have = observed_classes.get(minor)
        if have is None:
            ops.append(Op("add_class", ifb, minor, p))
        elif (
            have.parent_minor != p.parent_minor
            or have.rate_bytes != p.rate_bytes
            or have.ceil_bytes != p.ceil_bytes
            # HTB sets a class's quantum and prio only while it is a leaf and ignores them after
            # (htb_change_class): an inner class keeps its creation-time values, unused
            or (not p.inner and (have.quantum != p.quantum or have.prio != p.prio))
            or have.buffer != p.buffer
            or have.cbuffer != p.cbuffer
        ):
            if have.parent_minor != p.parent_minor:
                ops.append(Op("delete_class", ifb, minor, detail="(wrong parent)"))
                ops.append(Op("add_class", ifb, minor, p))
            else:
                ops.append(Op("change_class", ifb, minor, p))
    burst = sizing.segmenter_burst_bytes(obs.feed_mtu)
    for c in desired_leaves(spec):
        have_leaf = observed_leaves.get(c.minor)
        kind = leaf_kind(spec, c, have_leaf.kind if have_leaf else None)
        limit = leaf_limit(kind, c)
        if (
            have_leaf is None or have_leaf.kind != kind or have_leaf.handle_major != c.minor
            or (kind in ("pfifo", "bfifo", "tbf") and have_leaf.limit != limit)
            or (kind == "tbf" and (have_leaf.tbf_rate, have_leaf.tbf_burst) != (sizing.SEGMENTER_RATE_BYTES, burst))
        ):
            tbf = kind == "tbf"
            if have_leaf is not None and have_leaf.kind != kind and have_leaf.handle_major == c.minor:
                # the kernel changes a qdisc in place only within its kind: another kind under our handle
                # is deleted first (HTB puts a default queue there until the new one is grafted)
                ops.append(Op("delete_leaf", ifb, c.minor, detail=f"(was {have_leaf.kind})"))
            ops.append(Op("replace_leaf", ifb, c.minor, leaf_kind=kind, leaf_limit=limit,
                          leaf_rate=sizing.SEGMENTER_RATE_BYTES if tbf else 0, leaf_burst=burst if tbf else 0))

    # 4. uplinks: clsact, then the redirect filter (only now is the IFB ready)
    for up in spec.devices:
        if obs.uplink_index.get(up) is None:
            ops.append(Op("missing_uplink", up))
            continue
        if not obs.uplink_clsact.get(up):
            ops.append(Op("add_clsact", up))
        ours = [f for f in obs.filters.get(up, []) if f.pref == spec.filter_pref]
        good = [
            f
            for f in ours
            if f.kind == "bpf" and f.mark_bit == spec.mark_bit and f.redirect_ifindex == obs.ifb_index and obs.ifb_index
        ]
        if not good:
            ops.append(Op("replace_filter" if ours else "add_filter", up))
        elif len(ours) > 1:
            ops.append(Op("replace_filter", up, detail="(duplicate handles)"))

    # 5. deletions last: classes nobody wants (leaf qdisc goes with its class)
    for minor in sorted(set(observed_classes) - set(want), reverse=True):
        ops.append(Op("delete_class", ifb, minor))
    return ops
