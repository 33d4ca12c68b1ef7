"""Internal bytes and packets counted by eBPF: each local pod's on its host-side device, the node's on its
uplinks.

Why: the iptables rules count a pod's internal traffic with ipset lookups, and those lookups are
what internal traffic pays at line rate. A program on each pod device (the device is the pod's,
so no lookup decides whose packet it is) counts what the pod sends to, and receives from, the
internal CIDRs; a program on each uplink counts the node's totals by the far end's scope. The
rules can then let internal packets go before any set or device test.

Why eBPF: a classic-BPF scope test whose action statistics count needs `gact`, which minimal
kernels (this one) lack; `mirred`, often the one action there, clones or steals the packet. A
`sched_cls` program in direct-action mode tests the scope and adds to a map itself, and returns
TC_ACT_UNSPEC so the device's other programs and filters (netagent's download redirect) still run.
Attached by tcx links where the kernel has them (Linux >= 6.6), else as cls_bpf filters on clsact:
the link runs the program straight from the device's hook, at a third of the filter's cost.

The gate (tcx links only): the shaper's redirect filters sit on the same egress hooks (uplinks for
uploads, pod devices for downloads) and match only a packet with the mark bit, yet every packet runs
the clsact machinery to find that out (~100 ns). The egress programs therefore return TC_ACT_OK
(TCX_PASS: the hook ends) for a packet without the bit, and TC_ACT_UNSPEC for a marked one, which
goes on to the filter. Ending the hook would also skip anybody else's filter or later tcx program
on it, so each attach gates a device only where it finds neither (a clsact filter added later is
found at the next full resync).

What it counts is what the ipset and iptables counters count: the IP bytes of each skb, a GSO
super-packet once with its one header. tc shows the program the frame from its MAC header in
both directions (at ingress it pushes the MAC header back before the program runs), so the count
is skb->len less the 14-byte Ethernet header on either hook.

One map for all pods, keyed by the pod's address (an IPv4 address as ::ffff:a.b.c.d), so no
pod-to-device mapping is needed and routed and bridged pods are alike; the node's totals in a
second, two-entry map. Maps, programs and tcx links are pinned in a bpffs: a restarted agent adopts
the maps with their counts, finds the programs it would load (same tag, same map) already running,
and the links keep the programs attached while no agent runs.

Loaded with raw bpf(2) calls through ctypes: the programs are tens of instructions (a few
hundred with 40 CIDRs) and need no compiler, no libbpf and no BTF.
"""
from __future__ import annotations

import ctypes
import errno
import ipaddress
import logging
import os
import platform
import socket
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import nlwire  # first: pyroute2 without its __init__ (nlwire.lean_pyroute2)
from pyroute2.netlink import NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE
from pyroute2.netlink.rtnl import RTM_DELQDISC, RTM_DELTFILTER, RTM_NEWQDISC, RTM_NEWTFILTER
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from . import rawnl
from .errors import TcError
from .netlink import CLSACT_EGRESS, CLSACT_INGRESS, ETH_P_ALL, FILTER_HANDLE, TC_H_CLSACT, tc_message

log = logging.getLogger(__name__)

SYS_BPF = {"x86_64": 321, "aarch64": 280}  # by platform.machine(); both little-endian (see _le)
BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM = 0, 1, 2, 3
BPF_PROG_LOAD, BPF_OBJ_PIN, BPF_OBJ_GET, BPF_OBJ_GET_INFO_BY_FD, BPF_PROG_QUERY = 5, 6, 7, 15, 16
BPF_MAP_LOOKUP_BATCH, BPF_LINK_CREATE, BPF_LINK_UPDATE = 24, 28, 29
BPF_TCX = {False: 46, True: 47}  # egress hook? -> BPF_TCX_INGRESS, BPF_TCX_EGRESS (Linux >= 6.6)
BPF_LINK_TYPE_TCX = 11
BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY = 5, 6
BPF_F_NO_PREALLOC = 1  # entries come from set_pods only: no memory for 4096 entries x every possible CPU up front
BPF_PROG_TYPE_SCHED_CLS = 3
BPF_NOEXIST = 1
BPF_PSEUDO_MAP_FD = 1
BPF_FUNC_MAP_LOOKUP_ELEM, BPF_FUNC_SKB_LOAD_BYTES = 1, 26
BPF_FS_MAGIC = 0xCAFE4A11
LICENSE = b"Apache-2.0"  # the project's; the two helpers used are not GPL-only

TC_ACT_UNSPEC = -1
TC_ACT_OK = 0  # tcx: TCX_PASS, the verdict without the hook's later programs and filters
ETH_HLEN = 14
SKB_LEN, SKB_PKT_TYPE, SKB_MARK, SKB_PROTOCOL = 0, 4, 8, 16  # offsets in struct __sk_buff
PACKET_OTHERHOST = 3
# where the addresses are, from the start of the frame (the MAC header): source and destination together
ADDRESSES = {4: (26, 8), 6: (22, 32)}  # family: (offset, length)
ETHERTYPE = {4: 0x0008, 6: 0xDD86}  # htons(ETH_P_IP), htons(ETH_P_IPV6) as a u32 load of skb->protocol sees them
R0, R1, R2, R3, R4, R6, R10 = 0, 1, 2, 3, 4, 6, 10

KEY_SIZE = 16
VALUE = struct.Struct("=4Q")  # egress bytes, egress packets, ingress bytes, ingress packets (pod's view)
MAP_NAME = b"na_internal"
PIN_NAME = "internal"
# the node's totals through its uplinks: a per-CPU array of two VALUEs (node's view), by the far end's scope
NODE_MAP_NAME = b"na_node"
NODE_PIN_NAME = "node"
NODE_INTERNAL, NODE_INTERNET = 0, 1
ARPHRD_ETHER = 1
BATCH = 128  # entries a map read asks for at once

TCA_BPF_FLAG_ACT_DIRECT = 1
TCA_BPF_NAME, TCA_BPF_FLAGS, TCA_BPF_ID = 7, 8, 11
# the programs by (on an uplink?, on the device's egress?, gated?): their names, and where they are pinned so
# that a restarted agent finds them (with CAP_BPF alone it cannot open a program by its id); the gated ones
# (egress, tcx links only) end the hook for a packet without the shaper's mark bit
PROGRAMS = {(False, False, False): "na_count_in", (False, True, False): "na_count_out",
            (True, False, False): "na_node_in", (True, True, False): "na_node_out",
            (False, True, True): "na_count_out_g", (True, True, True): "na_node_out_g"}
PROG_PIN = "prog-"  # + the program's name
LINK_PIN = "link-"  # + "<ifindex>-in" / "-out": a tcx link, the attachment itself
# the two hooks: (clsact parent, the filter's name, is it the device's egress), on a pod's device and on an uplink
HOOKS = {"ingress": (CLSACT_INGRESS, "netagent-count-in", False), "egress": (CLSACT_EGRESS, "netagent-count-out", True)}
NODE_HOOKS = {"ingress": (CLSACT_INGRESS, "netagent-node-in", False), "egress": (CLSACT_EGRESS, "netagent-node-out", True)}
OUR_NAMES = {hook: {HOOKS[hook][1], NODE_HOOKS[hook][1]} for hook in HOOKS}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class EbpfError(TcError):
    """A bpf(2) or tc operation of the internal counter failed; the message says what and why."""


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        raise EbpfError(f"bpf(2): no syscall number known for {platform.machine()!r} (known: {', '.join(SYS_BPF)})")
    ret = _libc.syscall(ctypes.c_long(nr), ctypes.c_long(cmd), ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _attr(fmt: str, *values) -> ctypes.Array:
    """A zeroed union bpf_attr (128 bytes: more than any command here uses) starting with `values`."""
    attr = (ctypes.c_uint8 * 128)()
    struct.pack_into(fmt, attr, 0, *values)
    return attr


def _addr(buf) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


# -- pure: keys, networks, the program -----------------------------------------------------------------

def key_of(address: str) -> bytes:
    """A pod address as the map's key: 16 bytes, an IPv4 address as IPv4-mapped IPv6."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError as exc:
        raise EbpfError(f"pod address {address!r} is not an IP address") from exc
    return ip.packed if ip.version == 6 else b"\0" * 10 + b"\xff\xff" + ip.packed


def address_of(key: bytes) -> str:
    """The canonical text of a key's address (an IPv4-mapped key as plain IPv4)."""
    ip = ipaddress.IPv6Address(bytes(key))
    return str(ip.ipv4_mapped or ip)


Networks = dict[int, tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]]


def parse_networks(networks: dict[int, tuple[str, ...]]) -> Networks:
    """family -> CIDR texts, checked (the family's, not /0) and in a canonical order (sorted, no
    duplicates), so that the same set always makes the same program."""
    out: Networks = {}
    for family, texts in sorted(networks.items()):
        if family not in (4, 6):
            raise EbpfError(f"internal networks: family {family!r} is neither 4 nor 6")
        parsed = set()
        for text in texts:
            try:
                net = ipaddress.ip_network(text, strict=False)
            except ValueError as exc:
                raise EbpfError(f"internal network {text!r} is not a CIDR: {exc}") from exc
            if net.version != family:
                raise EbpfError(f"internal network {text!r} is not an IPv{family} network")
            if net.prefixlen == 0:
                raise EbpfError(f"internal network {text!r} is every address: a /0 would count all traffic "
                                "as internal; list the internal networks")
            parsed.add(net)
        if parsed:
            out[family] = tuple(sorted(parsed))
    return out


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _le(word: bytes) -> int:
    """Four network-order bytes as a 32-bit load on a little-endian host sees them, as a signed immediate."""
    return struct.unpack("<i", word)[0]


def program(networks: dict[int, tuple[str, ...]], egress: bool, map_fd: int, node: bool = False, gate: int = 0) -> bytes:
    """The counting program of one hook of a pod's device (node=False) or of an uplink (node=True),
    as instructions.

    Pod device: on its ingress (egress=False: what the pod sends) a packet whose destination is in
    `networks` is added to the entry of its source, in the entry's egress slots; on its egress (what
    the pod receives) a packet whose source is internal to its destination's entry, in the ingress
    slots. A packet of no entry, or not IP over Ethernet, is not counted.

    Uplink (the node's totals, in the node map): on its egress a packet with an internal destination
    is added to NODE_INTERNAL's egress slots (the rules count the node's internet egress, which they
    classify anyway); on its ingress every IP packet for this host is added to NODE_INTERNAL's or
    NODE_INTERNET's ingress slots by its source's scope, as the rules' PREROUTING hook counted it.

    Returns TC_ACT_UNSPEC: the next program or filter decides. With `gate` (a mark bit, egress hooks
    only), a packet without that bit gets TC_ACT_OK instead: on a tcx link that ends the hook, so the
    clsact filters after it (the shaper's redirect, which only a marked packet matches) are not run
    for it."""
    nets = parse_networks(networks)
    if node:
        scope, slot, other = (1, 0, False) if egress else (0, 16, True)
    else:
        scope, slot, other = (0, 16, False) if egress else (1, 0, False)
    key = 1 - scope  # pods: which address (0: source, 1: destination) is the key
    if gate and not egress:
        raise EbpfError("a gate only on an egress hook: the shaper redirects what leaves a device")
    if not nets and not other:  # nothing to count
        return _resolve([insn(0xBF, R6, R1), *_verdict(gate)]) if gate else _resolve(_verdict(0))
    # instructions, ("label", name), and ("jmp", code, dst, imm, target): a jump resolved once labels are placed
    body: list = []

    def jump(code: int, dst: int, imm: int, target: str) -> None:
        body.append(("jmp", code, dst, imm, target))

    miss = "OTHER" if other else "OUT"  # where an IP packet of no internal network goes
    body.append(insn(0xBF, R6, R1))  # r6 = ctx
    if node and not egress:
        body.append(insn(0x61, R2, R6, SKB_PKT_TYPE))  # a frame for another host never reaches IP (nor the rules)
        jump(0x15, R2, PACKET_OTHERHOST, "OUT")
    body.append(insn(0x61, R2, R6, SKB_PROTOCOL))  # r2 = skb->protocol
    for family in (4, 6):
        if family in nets:
            jump(0x15, R2, ETHERTYPE[family], f"V{family}")  # if r2 == ethertype
        elif other:
            jump(0x15, R2, ETHERTYPE[family], "OTHER")  # no internal network of this family: all of it is not
    jump(0x05, 0, 0, "OUT")
    for family, family_nets in nets.items():
        offset, size = ADDRESSES[family]
        base = -32 if family == 6 else -8  # both addresses copied to the stack at fp+base
        width = size // 2
        body.append(("label", f"V{family}"))
        # bpf_skb_load_bytes(skb, offset, fp+base, size): the addresses, also from a frame whose
        # headers are not in the linear area, without changing the skb
        body += [insn(0xBF, R1, R6), insn(0xB7, R2, 0, 0, offset), insn(0xBF, R3, R10), insn(0x07, R3, 0, 0, base),
                 insn(0xB7, R4, 0, 0, size), insn(0x85, 0, 0, 0, BPF_FUNC_SKB_LOAD_BYTES)]
        jump(0x55, R0, 0, "OUT")  # if r0 != 0: a short packet
        for n, net in enumerate(family_nets):
            raw, mask = net.network_address.packed, net.netmask.packed
            for i in range(0, len(raw), 4):
                if mask[i:i + 4] == b"\0\0\0\0":
                    continue
                body.append(insn(0x61, R4, R10, base + scope * width + i))  # r4 = a word of the tested address
                if mask[i:i + 4] != b"\xff\xff\xff\xff":
                    body.append(insn(0x54, R4, 0, 0, _le(mask[i:i + 4])))  # w4 &= mask (32-bit ALU)
                jump(0x56, R4, _le(raw[i:i + 4]), f"NEXT{family}.{n}")  # if w4 != word (JMP32): the next network
            jump(0x05, 0, 0, "INTERNAL" if node else f"KEY{family}")
            body.append(("label", f"NEXT{family}.{n}"))
        jump(0x05, 0, 0, miss)
        if node:
            continue
        body.append(("label", f"KEY{family}"))
        if family == 6:
            body += [insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, base + key * width)]  # the key is the copied address
        else:  # the key ::ffff:a.b.c.d built at fp-24
            body += [insn(0x7A, R10, 0, -24, 0), insn(0x62, R10, 0, -16, _le(b"\0\0\xff\xff")),
                     insn(0x61, R4, R10, base + key * width), insn(0x63, R10, R4, -12),
                     insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, -24)]
        jump(0x05, 0, 0, "LOOKUP")
    if node:  # the node map's index, a u32 at fp-40
        if nets:
            body.append(("label", "INTERNAL"))
            body.append(insn(0x62, R10, 0, -40, NODE_INTERNAL))
            jump(0x05, 0, 0, "INDEX")
        if other:
            body.append(("label", "OTHER"))
            body.append(insn(0x62, R10, 0, -40, NODE_INTERNET))
        if nets or other:
            body.append(("label", "INDEX"))
            body += [insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, -40)]
    if nets or other:
        body.append(("label", "LOOKUP"))
        body += [insn(0x18, R1, BPF_PSEUDO_MAP_FD, 0, map_fd), insn(0, 0, 0, 0, 0),  # r1 = the map (ld_imm64)
                 insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM)]
        jump(0x15, R0, 0, "OUT")  # no such pod
        body += [insn(0x61, R1, R6, SKB_LEN), insn(0x17, R1, 0, 0, ETH_HLEN),  # r1 = skb->len - ETH_HLEN
                 insn(0x79, R2, R0, slot), insn(0x0F, R2, R1), insn(0x7B, R0, R2, slot),  # bytes += r1 (this CPU's)
                 insn(0x79, R2, R0, slot + 8), insn(0x07, R2, 0, 0, 1), insn(0x7B, R0, R2, slot + 8)]  # packets += 1
    body.append(("label", "OUT"))
    body += _verdict(gate)
    return _resolve(body)


def _verdict(gate: int) -> list:
    """The program's end (r6 = ctx): TC_ACT_UNSPEC, or with a gate TC_ACT_OK for a packet without the bit."""
    if not gate:
        return [insn(0xB7, R0, 0, 0, TC_ACT_UNSPEC), insn(0x95)]
    return [insn(0xB7, R0, 0, 0, TC_ACT_UNSPEC), insn(0x61, R2, R6, SKB_MARK),  # r0 = UNSPEC, w2 = skb->mark
            insn(0x54, R2, 0, 0, _le(struct.pack("<I", gate))), ("jmp", 0x56, R2, 0, "END"),  # w2 &= bit; if w2 != 0
            insn(0xB7, R0, 0, 0, TC_ACT_OK), ("label", "END"), insn(0x95)]


def _resolve(body: list) -> bytes:
    """Place the labels and fill in the jumps' offsets. Every item but a label is one 8-byte slot
    (ld_imm64's two slots are two items)."""
    labels, pos = {}, 0
    for item in body:
        if isinstance(item, tuple) and item[0] == "label":
            labels[item[1]] = pos
        else:
            pos += 1
    out: list[bytes] = []
    for item in body:
        if isinstance(item, tuple):
            if item[0] == "jmp":
                _, code, dst, imm, target = item
                out.append(insn(code, dst, 0, labels[target] - len(out) - 1, imm))
        else:
            out.append(item)
    return b"".join(out)


# -- the kernel's side -----------------------------------------------------------------------------

def _statfs_magic(path: str) -> int:
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field, a long
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return struct.unpack_from("=l", buf, 0)[0] & 0xFFFFFFFF


def _bpffs_problem(pin_dir: str) -> str | None:
    """Why maps cannot be pinned in `pin_dir` (it, or its parent when it does not exist yet, must be
    on a bpffs), or None."""
    where = pin_dir if os.path.isdir(pin_dir) else os.path.dirname(os.path.abspath(pin_dir))
    try:
        magic = _statfs_magic(where)
    except OSError as exc:
        return f"the pin directory {pin_dir} cannot be made: {where}: {exc.strerror}"
    if magic != BPF_FS_MAGIC:
        return (f"{where} is not on a bpffs (filesystem magic {magic:#x}), so the counter's map cannot be pinned "
                f"there; mount one (mount -t bpf bpf {where}) or choose a pin directory under one")
    return None


def _bpf_refusal(exc: OSError) -> str:
    if exc.errno == errno.EPERM:
        return "bpf(2) refused: EPERM (the process needs CAP_BPF and CAP_NET_ADMIN, or CAP_SYS_ADMIN)"
    if exc.errno == errno.ENOSYS:
        return "bpf(2) is missing: ENOSYS (a kernel without CONFIG_BPF_SYSCALL)"
    return f"bpf(2) failed: {errno.errorcode.get(exc.errno, exc.errno)} ({exc.strerror})"


def map_shape(max_entries: int) -> tuple[int, int, int, int, int]:
    """The pods' map's (type, key size, value size, max entries, flags), as bpf_map_info gives them back."""
    return BPF_MAP_TYPE_PERCPU_HASH, KEY_SIZE, VALUE.size, max_entries, BPF_F_NO_PREALLOC


NODE_MAP_SHAPE = (BPF_MAP_TYPE_PERCPU_ARRAY, 4, VALUE.size, 2, 0)  # the node's map: NODE_INTERNAL, NODE_INTERNET


def _create_map(shape: tuple[int, int, int, int, int], name: bytes = MAP_NAME) -> int:
    return _bpf(BPF_MAP_CREATE, _attr("=IIIIIII16s", *shape, 0, 0, name))


def _prog_load(code: bytes, name: str, vlog: ctypes.Array | None) -> int:
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(LICENSE)
    return _bpf(BPF_PROG_LOAD, _attr("=IIQQIIQII16s", BPF_PROG_TYPE_SCHED_CLS, len(code) // 8, _addr(insns), _addr(lic),
                                     1 if vlog is not None else 0, len(vlog) if vlog is not None else 0, _addr(vlog),
                                     0, 0, name.encode()[:15]))


def _load(code: bytes, name: str) -> int:
    """Load a sched_cls program. A refused one is loaded again with the verifier's log on, for the
    error to say why (a log on every load would cost the verifier time and a buffer)."""
    try:
        return _prog_load(code, name, None)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSYS):
            raise EbpfError(f"loading the counting program {name} failed: {_bpf_refusal(exc)}") from None
    vlog = ctypes.create_string_buffer(1 << 20)
    try:
        return _prog_load(code, name, vlog)
    except OSError as exc:
        tail = vlog.value.decode(errors="replace")[-2000:].strip()
        raise EbpfError(f"loading the counting program {name} failed: {_bpf_refusal(exc)}; "
                        f"the verifier said: ...{tail}") from None


def _info(fd: int, size: int, extra: str = "", *values) -> bytes:
    """BPF_OBJ_GET_INFO_BY_FD: the first `size` bytes of the object's info (prefilled with `values`
    packed as `extra`, for the info's own pointers)."""
    buf = ctypes.create_string_buffer(size)
    if extra:
        struct.pack_into(extra, buf, 0, *values)
    _bpf(BPF_OBJ_GET_INFO_BY_FD, _attr("=IIQ", fd, size, _addr(buf)))
    return buf.raw


def map_info(fd: int) -> tuple[int, int, int, int, int, int]:
    """(type, id, key size, value size, max entries, flags) of a map."""
    return struct.unpack_from("=IIIIII", _info(fd, 40), 0)


def link_info(fd: int) -> tuple[int, int, int, int]:
    """(link type, program id, ifindex, attach type) of a tcx link (struct bpf_link_info: type at 0,
    prog_id at 8, tcx.ifindex at 16, tcx.attach_type at 20); ifindex 0: its device went."""
    kind, _id, prog_id, ifindex, attach_type = struct.unpack_from("=III4xII", _info(fd, 24), 0)
    return kind, prog_id, ifindex, attach_type


def tcx_available(netns: str | None = None) -> bool:
    """Whether the kernel attaches programs to devices with tcx (Linux >= 6.6): a query of lo's."""
    with nlwire.in_netns(netns):
        try:
            _bpf(BPF_PROG_QUERY, _attr("=IIII", socket.if_nametoindex("lo"), BPF_TCX[False], 0, 0))
        except OSError:
            return False
    return True


def tcx_programs(ifindex: int, egress: bool) -> list[int]:
    """The ids of the programs on a device's tcx hook (in the calling thread's network namespace), in the
    order they run; OSError when the kernel cannot list them."""
    room = 16
    while True:
        ids = (ctypes.c_uint32 * room)()
        attr = _attr("=IIIIQI", ifindex, BPF_TCX[egress], 0, 0, _addr(ids), room)
        try:
            _bpf(BPF_PROG_QUERY, attr)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:  # ENOSPC: more than `room`, their count given
                raise
        (count,) = struct.unpack_from("=I", attr, 24)
        if count <= room:
            return list(ids[:count])
        room = count


def prog_info(fd: int) -> tuple[int, bytes, tuple[int, ...]]:
    """(id, tag, the ids of the maps it uses) of a program (struct bpf_prog_info: id at 4, tag at
    8, nr_map_ids at 52, map_ids at 56)."""
    ids = (ctypes.c_uint32 * 8)()
    raw = _info(fd, 64, "=52xIQ", len(ids), _addr(ids))
    prog_id, tag = struct.unpack_from("=4xI8s", raw, 0)
    (n,) = struct.unpack_from("=I", raw, 52)
    return prog_id, tag, tuple(ids[:min(n, len(ids))])


def possible_cpus() -> int:
    """How many values a per-CPU map holds for each key: one per possible CPU."""
    with open("/sys/devices/system/cpu/possible") as f:
        text = f.read().strip()
    count = 0
    for part in text.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def unavailable(pin_dir: str) -> str | None:
    """None when the counter can run here, else the reason as a sentence. Loads the program the
    counter would load (against a one-entry map) and closes both: nothing is left behind."""
    if platform.machine() not in SYS_BPF:
        return f"bpf(2) has no syscall number known here ({platform.machine()!r}; known: {', '.join(SYS_BPF)})"
    fds: list[int] = []
    try:
        fds.append(_create_map(map_shape(1)))
        fds.append(_load(program({4: ("10.0.0.0/8",), 6: ("fd00::/8",)}, False, fds[0]), "na_probe"))
        fds.append(_create_map(NODE_MAP_SHAPE, NODE_MAP_NAME))
        fds.append(_load(program({4: ("10.0.0.0/8",), 6: ("fd00::/8",)}, False, fds[2], node=True), "na_probe_node"))
    except OSError as exc:
        return _bpf_refusal(exc)
    except EbpfError as exc:
        return str(exc)
    finally:
        for fd in fds:
            os.close(fd)
    return _bpffs_problem(pin_dir)


class Found(NamedTuple):
    """A filter at the counter's pref, as a dump shows it (name empty: not a cls_bpf filter)."""

    handle: int
    name: str
    prog_id: int
    flags: int


def _bpf_options(payload: bytes) -> dict:
    """A dumped filter's cls_bpf options by attribute type; empty for a filter of another kind."""
    a = rawnl.attrs(payload)
    return rawnl.attrs(a.get(rawnl.TCA_OPTIONS, b"")) if a.get(rawnl.TCA_KIND, b"").rstrip(b"\0") == b"bpf" else {}


def _u32(value: bytes | None) -> int:
    return struct.unpack_from("=I", value)[0] if value is not None and len(value) >= 4 else 0


class _Filters:
    """The counter's filters at one pref on the devices of one network namespace, over one netlink
    channel: what attach, detach and remove_counting share."""

    def __init__(self, netns: str | None, pref: int):
        self.netns = netns
        self.pref = pref
        self._chan: rawnl.NetlinkChannel | None = None

    @property
    def chan(self) -> rawnl.NetlinkChannel:
        if self._chan is None:
            self._chan = rawnl.open_channel(self.netns, EbpfError)
        return self._chan

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    def at_pref(self, ifindex: int) -> dict[str, tuple[list[Found], int]]:
        """Per hook: the filters at our pref, and how many filter messages the hook's dump had in all
        (anyone's, chain headers too)."""
        out = {}
        for hook, (parent, _, _) in HOOKS.items():
            found, total = [], 0
            for handle, info, payload in self.chan.dump_filters(ifindex, parent):
                total += 1
                if info >> 16 != self.pref or not handle:
                    continue  # somebody else's, or a chain header
                o = _bpf_options(payload)
                found.append(Found(handle, nlwire.text(o.get(TCA_BPF_NAME, b"")), _u32(o.get(TCA_BPF_ID)),
                                   _u32(o.get(TCA_BPF_FLAGS))))
            out[hook] = (found, total)
        return out

    def indexes(self, devices: Iterable[str]) -> dict[str, int]:
        try:
            links = {name: index for name, _, index, _ in self.chan.dump_links()}
        except OSError as exc:
            raise EbpfError(f"listing devices in network namespace {self.netns!r} failed: {exc}") from exc
        return {d: links[d] for d in dict.fromkeys(devices) if d in links}  # a device that is gone: nothing to do

    def send(self, ops: list[tuple[str, tcmsg]]) -> list[str]:
        """Send the messages in one batch; -> the descriptions of those done. A device that went
        meanwhile (ENODEV, or ENOENT for what it held) is skipped."""
        done = []
        for (what, _), err in zip(ops, self.chan.batch([m for _, m in ops]) if ops else []):
            if not err:
                done.append(what)
            elif err not in (errno.ENODEV, errno.ENOENT):
                raise EbpfError(f"tc: {what} failed: {rawnl.errno_name(err)}")
        return done

    def detach(self, devices: Iterable[str]) -> list[str]:
        """Remove our filters (our pref and our name) from these devices, and the clsact qdisc of a
        device we removed one from when no filter (anyone's) remains on it. -> what was removed."""
        removed: list[str] = []
        try:
            index = self.indexes(devices)
            clsact = self.chan.clsact_devices()
            for dev, idx in index.items():
                if idx not in clsact:
                    continue
                ops = [(f"filter {dev} {hook} pref {self.pref:#x}",
                        tc_message(RTM_DELTFILTER, 0, idx, handle, HOOKS[hook][0], "bpf",
                                   info=(self.pref << 16) | socket.htons(ETH_P_ALL)))
                       for hook, (filters, _) in self.at_pref(idx).items()
                       for handle, name, *_ in filters if name in OUR_NAMES[hook]]
                done = self.send(ops)
                removed += done
                if done and not any(total for _, total in self.at_pref(idx).values()):
                    removed += self.send([(f"clsact {dev}",
                                           tc_message(RTM_DELQDISC, 0, idx, 0xFFFF0000, TC_H_CLSACT))])
        except OSError as exc:
            raise EbpfError(f"tc in network namespace {self.netns!r}: {exc}") from exc
        return removed


def remove_counting(devices: Iterable[str], pref: int = 0xC001, netns: str | None = None) -> list[str]:
    """InternalCounter.detach without a counter (`netagent cleanup`, or an agent that counts by the rules
    again): needs netlink only, neither bpf(2) nor a bpffs. -> what was removed."""
    filters = _Filters(netns, pref)
    try:
        return filters.detach(devices)
    finally:
        filters.close()


def unpin_dir(pin_dir: str) -> list[str]:
    """Remove the counter's pins from `pin_dir` (its tcx links, which detaches their programs once no
    process holds them, its programs and its maps), and `pin_dir` when that left it empty; nothing off
    a bpffs (then it is not ours). Programs attached as tc filters keep the maps while they run. ->
    what was removed."""
    if not os.path.isdir(pin_dir) or _statfs_magic(pin_dir) != BPF_FS_MAGIC:
        return []
    removed = []
    for name in sorted(os.listdir(pin_dir)):
        pin = os.path.join(pin_dir, name)
        if name.startswith(LINK_PIN):  # releasing the link detaches its program
            os.unlink(pin)
            removed.append(f"tcx link {pin}")
        elif name.startswith(PROG_PIN):
            os.unlink(pin)
            removed.append(f"pinned program {pin}")
    for name in (PIN_NAME, NODE_PIN_NAME):
        pin = os.path.join(pin_dir, name)
        if os.path.lexists(pin):
            os.unlink(pin)
            removed.append(f"pinned map {pin}")
    if not os.listdir(pin_dir):
        os.rmdir(pin_dir)
        removed.append(f"directory {pin_dir}")
    return removed


class InternalCounter:
    """The pods' internal counters and the node's totals through its uplinks: two pinned maps and the
    four programs that fill them, attached to the pod devices and the uplinks of one network
    namespace (None: this one).

    Attached with tcx links where the kernel has them (`attach_by` "tcx", Linux >= 6.6: a program runs
    straight from the device's hook, ~50 ns a packet), else as cls_bpf filters on a clsact qdisc ("tc":
    ~150 ns, the qdisc and classifier machinery; bench/forward_cost.py). The links are pinned in
    `pin_dir`, so they outlive the agent (fail-static) and a restarted agent adopts them; the programs
    are pinned too, so it can tell the ones it would load without opening a program by id (which
    needs CAP_SYS_ADMIN)."""

    def __init__(self, pin_dir: str, netns: str | None = None, pref: int = 0xC001, max_entries: int = 4096,
                 attach_by: str = "auto", gate_mark: int = 0, gate_pref: int = 0xC000):
        if attach_by not in ("auto", "tcx", "tc"):
            raise EbpfError(f"attach_by {attach_by!r}: choose auto, tcx or tc")
        if gate_mark and (gate_mark & (gate_mark - 1) or not 0 < gate_mark < 1 << 32):
            raise EbpfError(f"gate_mark {gate_mark:#x}: one bit of a 32-bit mark")
        self.pin_dir = pin_dir
        self.pin = os.path.join(pin_dir, PIN_NAME)
        self.node_pin = os.path.join(pin_dir, NODE_PIN_NAME)
        self.netns = netns
        self.pref = pref
        self.max_entries = max_entries
        self.cpus = possible_cpus()
        self.networks: Networks | None = None
        self.progs: dict[tuple[bool, bool, bool], tuple[int, int, bytes]] = {}  # PROGRAMS' keys -> (fd, id, tag)
        self._tc = _Filters(netns, pref)
        self._batch: tuple[ctypes.Array, ctypes.Array] | None = None
        self.map_fd = self.node_map_fd = -1
        problem = _bpffs_problem(pin_dir)
        if problem:
            raise EbpfError(problem)
        os.makedirs(pin_dir, exist_ok=True)
        try:
            self.map_fd = self._adopt(self.pin, map_shape(max_entries), MAP_NAME)
            self.node_map_fd = self._adopt(self.node_pin, NODE_MAP_SHAPE, NODE_MAP_NAME)
        except BaseException:
            self.close()
            raise
        self.map_ids = {False: map_info(self.map_fd)[1], True: map_info(self.node_map_fd)[1]}  # uplink? -> map id
        self.attach_by = attach_by if attach_by != "auto" else "tcx" if tcx_available(netns) else "tc"
        # the egress links end the hook for an unmarked packet, sparing it the clsact filters after them (the
        # shaper's redirect at gate_pref), where nothing else would be skipped (attach() checks each device)
        self.gate_mark = gate_mark if self.attach_by == "tcx" else 0
        self.gate_pref = gate_pref
        self.gated: dict[str, str | None] = {}  # device -> None (its egress link gates) or why not, as last attached


    def _create(self, pin: str, shape: tuple[int, int, int, int, int], name: bytes) -> int:
        try:
            fd = _create_map(shape, name)
        except OSError as exc:
            raise EbpfError(f"creating the counter's map {name.decode()} failed: {_bpf_refusal(exc)}") from None
        try:
            self._pin(fd, pin)
        except EbpfError:
            os.close(fd)
            raise
        return fd

    def _adopt(self, pin: str, shape: tuple[int, int, int, int, int], name: bytes) -> int:
        """The map pinned by an earlier agent, with its counts; a new one when nothing is pinned there,
        or what is is not such a map (another object, or another shape or size)."""
        fd = self._get(pin)
        if fd is None:
            return self._create(pin, shape, name)
        if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-map":
            kind, _id, *found_shape = map_info(fd)
            # a different capacity too: set_pods refuses by the capacity it was given
            if (kind, *found_shape) == shape:
                return fd
            found = f"a map of (type, key, value, entries, flags) {(kind, *found_shape)}"
        else:
            found = "another kind of bpf object"
        os.close(fd)
        log.warning("ebpf: %s holds %s, not the counter's map %s: replaced by a new map, its counts start at zero",
                    pin, found, shape)
        os.unlink(pin)
        return self._create(pin, shape, name)

    def close(self) -> None:
        """Close the map's and programs' descriptors; attached programs keep running (their filters
        hold them, and they hold the map)."""
        for fd, _, _ in self.progs.values():
            os.close(fd)
        self.progs = {}
        for fd in (self.map_fd, self.node_map_fd):
            if fd >= 0:
                os.close(fd)
        self.map_fd = self.node_map_fd = -1
        self._tc.close()

    def __enter__(self) -> "InternalCounter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def unpin(self) -> None:
        """Remove the pinned maps (the programs attached keep them while they run) and the pin
        directory when nothing else is in it."""
        unpin_dir(self.pin_dir)

    # -- programs ---------------------------------------------------------------------------------
    def set_networks(self, networks: dict[int, tuple[str, ...]]) -> bool:
        """Load the four programs (pod device and uplink, ingress and egress) for these internal CIDRs
        (family -> CIDR texts) unless they are the ones loaded; True when (re)loaded. attach() then
        puts them on the devices."""
        nets = parse_networks(networks)
        if nets == self.networks and self.progs:
            return False
        texts = {family: tuple(map(str, n)) for family, n in nets.items()}
        loaded: dict[tuple[bool, bool, bool], tuple[int, int, bytes]] = {}
        try:
            for (uplink, egress, gated), name in PROGRAMS.items():
                if gated and not self.gate_mark:
                    continue
                fd = _load(program(texts, egress, self.node_map_fd if uplink else self.map_fd, node=uplink,
                                   gate=self.gate_mark if gated else 0), name)
                prog_id, tag, _ = prog_info(fd)
                pinned = self._pinned_program(name, tag, self.map_ids[uplink])
                if pinned is not None:  # the same program, already running: keep it (its id is the filters')
                    os.close(fd)
                    fd, prog_id = pinned
                else:
                    self._pin(fd, os.path.join(self.pin_dir, PROG_PIN + name))
                loaded[(uplink, egress, gated)] = (fd, prog_id, tag)
        except BaseException:
            for fd, _, _ in loaded.values():
                os.close(fd)
            raise
        for fd, _, _ in self.progs.values():
            os.close(fd)
        self.progs, self.networks = loaded, nets
        return True

    def _pinned_program(self, name: str, tag: bytes, map_id: int) -> tuple[int, int] | None:
        """(fd, id) of the program pinned as `name` when it is the one with this tag using this map."""
        pin = os.path.join(self.pin_dir, PROG_PIN + name)
        fd = self._get(pin)
        if fd is None:
            return None
        if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog":
            prog_id, found_tag, maps = prog_info(fd)
            if found_tag == tag and maps == (map_id,):
                return fd, prog_id
        os.close(fd)
        return None

    @staticmethod
    def _get(pin: str) -> int | None:
        """The object pinned at `pin` (an fd), or None when nothing is."""
        if not os.path.lexists(pin):
            return None
        path = ctypes.create_string_buffer(os.fsencode(pin))
        try:
            return _bpf(BPF_OBJ_GET, _attr("=QI", _addr(path), 0))
        except OSError as exc:
            raise EbpfError(f"opening the pinned object {pin} failed: {exc.strerror}") from None

    @staticmethod
    def _pin(fd: int, pin: str) -> None:
        """Pin `fd` at `pin`, in place of what was pinned there."""
        if os.path.lexists(pin):
            os.unlink(pin)
        path = ctypes.create_string_buffer(os.fsencode(pin))
        try:
            _bpf(BPF_OBJ_PIN, _attr("=QI", _addr(path), fd))
        except OSError as exc:
            raise EbpfError(f"pinning at {pin} failed: {exc.strerror}") from None

    # -- the map ----------------------------------------------------------------------------------
    def _entries(self) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, per-CPU values as u64s) of the map, BATCH at a time (BPF_MAP_LOOKUP_BATCH)."""
        if self._batch is None:
            self._batch = ((ctypes.c_uint8 * (KEY_SIZE * BATCH))(), (ctypes.c_uint64 * (4 * self.cpus * BATCH))())
        keys, values = self._batch
        token_in, token_out = ctypes.c_uint32(0), ctypes.c_uint32(0)  # a hash map's batch token: a bucket
        first = True
        while True:
            attr = _attr("=QQQQII", 0 if first else _addr(token_in), _addr(token_out), _addr(keys), _addr(values),
                         BATCH, self.map_fd)
            try:
                _bpf(BPF_MAP_LOOKUP_BATCH, attr)
                done = False
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # ENOENT: the last batch (its entries are still given)
                    raise EbpfError(f"reading the internal-counter map failed: {exc.strerror}") from None
                done = True
            (count,) = struct.unpack_from("=I", attr, 32)
            raw_keys, raw_values = bytes(keys), memoryview(values).cast("B").cast("Q")
            per = 4 * self.cpus
            for i in range(count):
                yield raw_keys[i * KEY_SIZE:(i + 1) * KEY_SIZE], raw_values[i * per:(i + 1) * per]
            if done:
                return
            token_in.value, first = token_out.value, False

    def read(self) -> dict[str, tuple[int, int, int, int]]:
        """Pod address -> (egress bytes, egress packets, ingress bytes, ingress packets), the pod's
        view (egress: what it sent), summed over the CPUs."""
        return {address_of(key): (sum(v[0::4]), sum(v[1::4]), sum(v[2::4]), sum(v[3::4])) for key, v in self._entries()}

    def read_node(self) -> dict[str, int]:
        """The node's totals through its uplinks, summed over the CPUs, in bytes, by the rules' node
        kinds: egress_internal, ingress_internal, ingress_internet (its internet egress is the rules')."""
        key = ctypes.c_uint32(0)
        values = (ctypes.c_uint64 * (4 * self.cpus))()
        found = {}
        for index in (NODE_INTERNAL, NODE_INTERNET):
            key.value = index
            try:
                _bpf(BPF_MAP_LOOKUP_ELEM, _attr("=IIQQ", self.node_map_fd, 0, _addr(key), _addr(values)))
            except OSError as exc:
                raise EbpfError(f"reading the node counter's map failed: {exc.strerror}") from None
            found[index] = (sum(values[0::4]), sum(values[2::4]))
        return {"egress_internal": found[NODE_INTERNAL][0], "ingress_internal": found[NODE_INTERNAL][1],
                "ingress_internet": found[NODE_INTERNET][1]}

    def set_pods(self, addresses: Iterable[str]) -> int:
        """Make the map's keys exactly these pods' addresses: a new pod starts at zero, a pod that
        stays keeps its counts. -> how many entries were added or deleted."""
        want = {key_of(a) for a in addresses}
        if len(want) > self.max_entries:
            raise EbpfError(f"{len(want)} pod addresses do not fit the internal counter's {self.max_entries} entries "
                            "(its max_entries); nothing was changed")
        have = {key for key, _ in self._entries()}
        key_buf = ctypes.create_string_buffer(KEY_SIZE)
        zero = ctypes.create_string_buffer(VALUE.size * self.cpus)
        for key in have - want:  # first: room for the new ones
            key_buf.raw = key
            try:
                _bpf(BPF_MAP_DELETE_ELEM, _attr("=IIQ", self.map_fd, 0, _addr(key_buf)))
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise EbpfError(f"deleting {address_of(key)} from the internal counter failed: "
                                    f"{exc.strerror}") from None
        for key in want - have:
            key_buf.raw = key
            try:
                _bpf(BPF_MAP_UPDATE_ELEM, _attr("=IIQQQ", self.map_fd, 0, _addr(key_buf), _addr(zero), BPF_NOEXIST))
            except OSError as exc:
                if exc.errno != errno.EEXIST:  # another counter on the same map added it meanwhile
                    raise EbpfError(f"adding {address_of(key)} to the internal counter failed: "
                                    f"{exc.strerror}") from None
        return len(have ^ want)

    # -- filters ----------------------------------------------------------------------------------
    def _runs_current(self, which: tuple[bool, bool, bool], prog_id: int) -> bool:
        """Whether a filter's program is the one we run: set_networks adopted the pinned program when it
        was the one it would load (the same tag and our map), so the filter of a restarted agent runs
        exactly that program."""
        return prog_id == self.progs[which][1]

    def attach(self, devices: Iterable[str], uplinks: Iterable[str] = ()) -> int:
        """On each listed pod device and uplink, on its ingress and egress, the current programs (the
        pods' or the node's): a pinned tcx link each (`attach_by` "tcx"; a link running another program
        is updated in place), or a clsact qdisc and our filter at our pref ("tc"; a filter running
        another program, or the other role's, is replaced). What the other way left on those devices
        goes. Devices not listed are left alone (a pod's device takes its filters when it goes; the
        link pins of devices that went are removed here). -> changes made.

        Another filter at our pref is not ours to replace, and an uplink that is not an Ethernet
        device would be misread: such devices are named in an EbpfError after the others were done."""
        if not self.progs:
            raise EbpfError("attach() before set_networks(): no counting program is loaded")
        tc = self._tc
        uplinks = tuple(dict.fromkeys(uplinks))
        try:
            self._ensure_pins()
            index = tc.indexes((*devices, *uplinks))
            taken: list[str] = []
            if uplinks:
                kinds = tc.chan.link_types()
                for dev in uplinks:
                    if dev in index and kinds.get(dev) != ARPHRD_ETHER:
                        taken.append(f"uplink {dev}: link type {kinds.get(dev)} is not Ethernet, and the program reads "
                                     "the addresses at Ethernet offsets (count by the rules here: --internal-counting rules)")
                        del index[dev]
            # what an agent that attached the other way left goes (a filter dump only where a clsact is)
            if self.attach_by == "tcx":
                done = self._attach_links(index, uplinks)
                done += tc.detach(index)
            else:
                done = self._attach_filters(index, uplinks, taken)
                done += self._drop_links(index)
        except OSError as exc:
            raise EbpfError(f"attaching the counter in network namespace {self.netns!r}: {exc}") from exc
        if done:
            log.info("ebpf: %d change(s): %s", len(done), ", ".join(done[:8]) + (" ..." if len(done) > 8 else ""))
        if taken:
            raise EbpfError(f"the counter is not attached to {'; '.join(taken)}")
        return len(done)

    def _ensure_pins(self) -> None:
        """Pin the maps and programs again where their pins went (someone removed the directory): a restarted
        agent finds them, and the links have a directory to be pinned in."""
        os.makedirs(self.pin_dir, exist_ok=True)
        for fd, pin in ((self.map_fd, self.pin), (self.node_map_fd, self.node_pin),
                        *((fd, os.path.join(self.pin_dir, PROG_PIN + PROGRAMS[which])) for which, (fd, _, _)
                          in self.progs.items())):
            if not os.path.lexists(pin):
                self._pin(fd, pin)

    def _link_pin(self, ifindex: int, egress: bool) -> str:
        return os.path.join(self.pin_dir, f"{LINK_PIN}{ifindex}-{'out' if egress else 'in'}")

    def _attach_links(self, index: dict[str, int], uplinks: tuple[str, ...]) -> list[str]:
        """A pinned tcx link on each hook of each device, running the current program: on the egress
        the gated one where `_gate_blocker` finds nothing it would skip. A pin whose link lost its
        device (the ifindex reused by a new one) is replaced."""
        done: list[str] = []
        checked: set[str] = set()  # the pins looked at here: the prune skips them
        clsact = self._tc.chan.clsact_devices() if self.gate_mark else set()
        gated: dict[str, str | None] = {}
        with nlwire.in_netns(self.netns):  # links name their device by ifindex
            for dev, idx in index.items():
                for egress in (False, True):
                    hook = "egress" if egress else "ingress"
                    pin = self._link_pin(idx, egress)
                    checked.add(os.path.basename(pin))
                    fd = self._get(pin)
                    linked = None  # the program our link on this hook runs
                    if fd is not None:
                        try:
                            kind, prog, ifindex, attach_type = link_info(fd)
                        except BaseException:
                            os.close(fd)
                            raise
                        if (kind, ifindex, attach_type) == (BPF_LINK_TYPE_TCX, idx, BPF_TCX[egress]):
                            linked = prog
                        else:
                            os.close(fd)
                            os.unlink(pin)  # the link of a device that went: released
                            fd = None
                    blocker = None
                    if egress and self.gate_mark:
                        blocker = gated[dev] = self._gate_blocker(idx, idx in clsact, linked)
                        if blocker is not None and self.gated.get(dev, "") != blocker:
                            log.warning("ebpf: %s egress: every packet meets the shaper's filter there (~100 ns "
                                        "more for internal ones): %s", dev, blocker)
                    prog_fd, prog_id, _ = self.progs[(dev in uplinks, egress,
                                                      bool(egress and self.gate_mark and blocker is None))]
                    if fd is not None:
                        try:
                            if linked != prog_id:
                                _bpf(BPF_LINK_UPDATE, _attr("=IIII", fd, prog_fd, 0, 0))
                                done.append(f"update tcx link {dev} {hook}")
                        finally:
                            os.close(fd)
                        continue
                    try:
                        fd = _bpf(BPF_LINK_CREATE, _attr("=IIII", prog_fd, idx, BPF_TCX[egress], 0))
                    except OSError as exc:
                        if exc.errno == errno.ENODEV:
                            continue  # gone meanwhile
                        raise
                    try:
                        self._pin(fd, pin)
                    finally:
                        os.close(fd)
                    done.append(f"tcx link {dev} {hook}")
        self.gated = gated
        done += self._prune_links(checked)
        return done

    def _gate_blocker(self, ifindex: int, has_clsact: bool, linked: int | None) -> str | None:
        """Why the egress link of this device (running program `linked`, None: no link yet, it will be
        the last) may not end the hook for an unmarked packet, or None: a tcx program after ours, or a
        clsact filter but the shaper's (and our own of the tc way), would not see such packets any more."""
        try:
            chain = tcx_programs(ifindex, True)
        except OSError as exc:
            return f"its tcx programs cannot be listed ({exc.strerror})"
        if len(chain) > 64:
            return f"{len(chain)} tcx programs on it"
        if linked is not None and linked in chain and chain[-1] != linked:
            return f"the tcx program {chain[-1]} runs after netagent's"
        if has_clsact:
            for handle, info, payload in self._tc.chan.dump_filters(ifindex, CLSACT_EGRESS):
                pref = info >> 16
                if not handle or pref == self.gate_pref:
                    continue  # a chain header, or the shaper's redirect
                if pref == self.pref:
                    if nlwire.text(_bpf_options(payload).get(TCA_BPF_NAME, b"")) in OUR_NAMES["egress"]:
                        continue  # our own filter of the tc way, removed right after
                return f"a tc filter at pref {pref:#x} on its egress is not netagent's"
        return None

    def _prune_links(self, checked: set[str]) -> list[str]:
        """Remove the pins of links whose device went (their programs were detached with it); those in
        `checked` are the listed devices' own, just looked at."""
        removed = []
        for name in os.listdir(self.pin_dir):
            if not name.startswith(LINK_PIN) or name in checked:
                continue
            pin = os.path.join(self.pin_dir, name)
            fd = self._get(pin)
            if fd is None:
                continue
            try:
                gone = link_info(fd)[2] == 0
            finally:
                os.close(fd)
            if gone:
                os.unlink(pin)
                removed.append(f"pin of a gone device's link {name}")
        return removed

    def _drop_links(self, index: dict[str, int]) -> list[str]:
        """Unpin our links on these devices: released, they detach their programs."""
        removed = []
        for dev, idx in index.items():
            for egress in (False, True):
                pin = self._link_pin(idx, egress)
                if os.path.lexists(pin):
                    os.unlink(pin)
                    removed.append(f"tcx link {dev} {'egress' if egress else 'ingress'}")
        return removed

    def _attach_filters(self, index: dict[str, int], uplinks: tuple[str, ...], taken: list[str]) -> list[str]:
        """A clsact qdisc and our filter at our pref on each hook of each device, running the current
        program; a device where another filter holds our pref is added to `taken`."""
        tc = self._tc
        clsact = tc.chan.clsact_devices()
        ops: list[tuple[str, tcmsg]] = []
        for dev, idx in index.items():
            uplink = dev in uplinks
            if idx not in clsact:
                ops.append((f"add clsact to {dev}",
                            tc_message(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, idx, 0xFFFF0000, TC_H_CLSACT,
                                       "clsact")))
                found = {hook: ([], 0) for hook in HOOKS}
            else:
                found = tc.at_pref(idx)
            for hook, (parent, name, egress) in (NODE_HOOKS if uplink else HOOKS).items():
                filters = found[hook][0]
                if any(f.name not in OUR_NAMES[hook] for f in filters):
                    taken.append(f"{dev} {hook}: another filter holds pref {self.pref:#x} (remove it, or give the "
                                 "counter another pref)")
                    continue
                stale = [f.handle for f in filters if not (f.name == name and f.flags & TCA_BPF_FLAG_ACT_DIRECT and
                                                           self._runs_current((uplink, egress, False), f.prog_id))]
                options = {"attrs": [["TCA_BPF_FD", self.progs[(uplink, egress, False)][0]], ["TCA_BPF_NAME", name],
                                     ["TCA_BPF_FLAGS", TCA_BPF_FLAG_ACT_DIRECT]]}
                for handle in stale or ([] if filters else [FILTER_HANDLE]):
                    ops.append((f"{'replace' if filters else 'add'} filter {dev} {hook} pref {self.pref:#x}",
                                tc_message(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_REPLACE, idx, handle, parent,
                                           "bpf", options, info=(self.pref << 16) | socket.htons(ETH_P_ALL))))
        return tc.send(ops)

    def detach(self, devices: Iterable[str]) -> list[str]:
        """Remove our links and our filters (our pref and our name) from these devices, and the clsact
        qdisc of a device we removed a filter from when no filter (anyone's) remains on it. -> what was
        removed."""
        removed = self._tc.detach(devices)
        try:
            removed += self._drop_links(self._tc.indexes(devices))
        except OSError as exc:
            raise EbpfError(f"detaching the counter in network namespace {self.netns!r}: {exc}") from exc
        return removed
