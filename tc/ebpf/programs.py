"""The counting programs: built from the internal networks, loaded as sched_cls programs.

Which program runs where is `PROGRAMS`; the maps they fill are maps.py's, the hooks they run on
tcx.py's and clsact.py's.
"""
from __future__ import annotations

import ctypes
import errno
import ipaddress
import struct

from .asm import R0, R1, R2, R3, R4, R6, R7, R8, R10, Item, insn, le, resolve
from .maps import NODE_INTERNAL, NODE_INTERNET
from .syscall import BPF_PROG_LOAD, BPF_PROG_TYPE_SCHED_CLS, EbpfError, addr, bpf, bpf_attr, refusal

BPF_PSEUDO_MAP_FD = 1
BPF_FUNC_MAP_LOOKUP_ELEM, BPF_FUNC_SKB_LOAD_BYTES = 1, 26
NO_MAP = -1
LICENSE = b"Apache-2.0"  # the project's; the two helpers used are not GPL-only

TC_ACT_UNSPEC = -1
TC_ACT_OK = 0  # tcx: TCX_PASS, the verdict without the hook's later programs and filters
ETH_HLEN = 14
SKB_LEN, SKB_PKT_TYPE, SKB_MARK, SKB_PROTOCOL = 0, 4, 8, 16  # offsets in struct __sk_buff
SKB_GSO_SEGS, SKB_GSO_SIZE = 164, 176  # readable by sched_cls programs since Linux 5.7 (gso_size)
IPPROTO_TCP, IPPROTO_UDP, UDP_HLEN = 6, 17, 8
# the stack beyond the addresses (fp-32..-1), the IPv4 key (fp-24..-9) and the node map's index (fp-40):
MERGED, MERGED_SEGS, HEADER = -48, -56, -72  # merged segments' headers (u64), their count (u64), header bytes read
# the scopes' trie key (u32 prefix length + the address, up to 20 bytes) and the packet's length kept over a call
SCOPE_KEY, SCOPE_LEN = -96, -104
SCOPE_SLOTS = {1: 0, 2: 8}  # scope id (core.scopes.SCOPE_IDS: cross-zone, cross-region) -> its u64 in a direction's half
PACKET_OTHERHOST = 3
# where the addresses are, from the start of the frame (the MAC header): source and destination together
ADDRESSES = {4: (26, 8), 6: (22, 32)}  # family: (offset, length)
ETHERTYPE = {4: 0x0008, 6: 0xDD86}  # htons(ETH_P_IP), htons(ETH_P_IPV6) as a u32 load of skb->protocol sees them

# the programs by (on an uplink?, on the device's egress?, gated?): their names, and where they are pinned so
# that a restarted agent finds them (with CAP_BPF alone it cannot open a program by its id); the gated ones
# (egress, tcx links only) end the hook for a packet without the shaper's mark bit
PROGRAMS = {(False, False, False): "na_count_in", (False, True, False): "na_count_out",
            (True, False, False): "na_node_in", (True, True, False): "na_node_out",
            (False, True, True): "na_count_out_g", (True, True, True): "na_node_out_g"}


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


def program(networks: dict[int, tuple[str, ...]], egress: bool, map_fd: int, node: bool = False, gate: int = 0,
            segments_fd: int = NO_MAP, scopes_fds: dict[int, int] | None = None, scope_bytes_fd: int = NO_MAP) -> bytes:
    """The counting program of one hook of a pod's device (node=False) or of an uplink (node=True),
    as instructions.

    Pod device: on its ingress hook (egress=False: what the pod sends) a packet whose destination is
    in `networks` is added to the entry of its source, in the entry's sent slots; on its egress hook
    (what the pod receives) a packet whose source is internal to its destination's entry, in the
    received slots. A packet of no entry, or not IP over Ethernet, is not counted. With `segments_fd`
    (the egress hook only), a packet from the internet that carries several segments (GRO merged it on
    the uplink, or TSO built it) adds the headers of its segments beyond the first, and their count, to
    its destination's entry in that map: the rules count such a packet once with one header, the
    uplink's wire carried each segment with its own (`_merged`). With `scopes_fds` (family -> the
    scopes' LPM trie) and `scope_bytes_fd`, an internal packet's far address (the destination of what
    the pod sends, the source of what it receives) is looked up once in its family's trie, and a
    cross-zone or cross-region one is added to the pod's entry in that map too (its bytes in the
    direction's half, SCOPE_SLOTS): the pods' map keeps its shape, and a changed trie changes the
    counting without reloading or re-attaching anything.

    Uplink (the node's totals, in the node map): on its egress hook a packet with an internal
    destination is added to NODE_INTERNAL's sent slots (the rules count what the node sends to the
    internet, which they classify anyway); on its ingress hook every IP packet for this host is added
    to NODE_INTERNAL's or NODE_INTERNET's received slots by its source's scope, as the rules'
    PREROUTING hook counted it, an internet packet with the headers of each of its segments (in bytes;
    packets stay packets). With `scopes_fds` and `scope_bytes_fd` (maps.NODE_SCOPES_SHAPE: one entry, key 0),
    an internal packet's far address (destination on egress, source on ingress) is looked up as the pods'
    is, and a cross-zone or cross-region one's bytes (the figure added to NODE_INTERNAL) go to that entry too;
    an internet packet is not looked up.

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
    if segments_fd != NO_MAP and (node or not egress):
        raise EbpfError("the segments map only on a pod device's egress hook: what the pod receives")
    segments = segments_fd != NO_MAP
    scoped = scopes_fds is not None and scope_bytes_fd != NO_MAP
    if scoped:
        assert scopes_fds is not None
        missing = set(nets) - set(scopes_fds)
        if missing:
            raise EbpfError(f"no scopes trie for IPv{min(missing)}")
    if not nets and not other and not segments:  # nothing to count
        return resolve([insn(0xBF, R6, R1), *_verdict(gate)]) if gate else resolve(_verdict(0))
    # instructions, ("label", name), and ("jmp", code, dst, imm, target): a jump resolved once labels are placed
    body: list[Item] = []

    def jump(code: int, dst: int, imm: int, target: str) -> None:
        body.append(("jmp", code, dst, imm, target))

    # where an IP packet of no internal network goes: the node's internet slots, the segments map, or out
    def miss(family: int) -> str:
        return f"OTHER{family}" if other else f"INET{family}" if segments else "OUT"
    loaded = tuple(f for f in (4, 6) if f in nets or segments)  # families whose addresses are read
    body.append(insn(0xBF, R6, R1))  # r6 = ctx
    if node and not egress:
        body.append(insn(0x61, R2, R6, SKB_PKT_TYPE))  # a frame for another host never reaches IP (nor the rules)
        jump(0x15, R2, PACKET_OTHERHOST, "OUT")
    body.append(insn(0x61, R2, R6, SKB_PROTOCOL))  # r2 = skb->protocol
    for family in (4, 6):
        if family in loaded:
            jump(0x15, R2, ETHERTYPE[family], f"V{family}")  # if r2 == ethertype
        elif other:
            jump(0x15, R2, ETHERTYPE[family], miss(family))  # no internal network of this family: all of it is not
    jump(0x05, 0, 0, "OUT")
    for family in loaded:
        family_nets = nets.get(family, ())
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
                    body.append(insn(0x54, R4, 0, 0, le(mask[i:i + 4])))  # w4 &= mask (32-bit ALU)
                jump(0x56, R4, le(raw[i:i + 4]), f"NEXT{family}.{n}")  # if w4 != word (JMP32): the next network
            jump(0x05, 0, 0, "INTERNAL" if node and not scoped else f"KEY{family}")
            body.append(("label", f"NEXT{family}.{n}"))
        jump(0x05, 0, 0, miss(family))
        if node:
            if scoped and family_nets:  # r8 = the far address's scope, then counted as any internal packet
                assert scopes_fds is not None
                body.append(("label", f"KEY{family}"))
                body += _scope_lookup(family, base + scope * width, scopes_fds[family])
                jump(0x05, 0, 0, "INTERNAL")
            continue
        if family_nets:
            body.append(("label", f"KEY{family}"))
            if scoped:
                assert scopes_fds is not None
                body += _scope_lookup(family, base + scope * width, scopes_fds[family])
            body += _key(family, base + key * width)
            jump(0x05, 0, 0, "LOOKUP")
        if segments:  # from the internet: the headers of the segments merged into it, to its destination's entry
            body.append(("label", f"INET{family}"))
            body += _merged(family, f"SEG{family}")
            body.append(("label", f"SEG{family}"))
            body.append(insn(0x79, R2, R10, MERGED_SEGS))
            jump(0x15, R2, 0, "OUT")  # one segment: nothing the rules miss
            body += _key(family, base + key * width)
            jump(0x05, 0, 0, "SEGLOOKUP")
    if node:  # the node map's index, a u32 at fp-40
        if nets:
            body.append(("label", "INTERNAL"))
            body += [insn(0x62, R10, 0, -40, NODE_INTERNAL), insn(0x7A, R10, 0, MERGED, 0)]
            jump(0x05, 0, 0, "INDEX")
        if other:
            for family in (4, 6):
                body.append(("label", f"OTHER{family}"))
                body += _merged(family, "INET")
            body.append(("label", "INET"))
            body.append(insn(0x62, R10, 0, -40, NODE_INTERNET))
            if scoped:  # not looked up: no scope (the verifier also wants r8 set on every path to its test)
                body.append(insn(0xB7, R8, 0, 0, 0))
        if nets or other:
            body.append(("label", "INDEX"))
            body += [insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, -40)]
    if nets or other:
        body.append(("label", "LOOKUP"))
        if scoped and not node:
            body.append(insn(0xBF, R7, R2))  # the pod's key, for the scopes' map after this lookup
        body += [insn(0x18, R1, BPF_PSEUDO_MAP_FD, 0, map_fd), insn(0, 0, 0, 0, 0),  # r1 = the map (ld_imm64)
                 insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM)]
        jump(0x15, R0, 0, "OUT")  # no such pod
        body += [insn(0x61, R1, R6, SKB_LEN), insn(0x17, R1, 0, 0, ETH_HLEN)]  # r1 = skb->len - ETH_HLEN
        if node:
            body += [insn(0x79, R2, R10, MERGED), insn(0x0F, R1, R2)]  # + the merged segments' headers
        body += [insn(0x79, R2, R0, slot), insn(0x0F, R2, R1), insn(0x7B, R0, R2, slot),  # bytes += r1 (this CPU's)
                 insn(0x79, R2, R0, slot + 8), insn(0x07, R2, 0, 0, 1), insn(0x7B, R0, R2, slot + 8)]  # packets += 1
        if scoped:  # r8 = the far address's scope id; only cross-zone and cross-region have slots
            jump(0x15, R8, 0, "OUT")
            jump(0x25, R8, max(SCOPE_SLOTS), "OUT")
            body.append(insn(0x7B, R10, R1, SCOPE_LEN))
            if node:  # the node's scope entry: key 0 (the u32 at fp-40 is free once the node map is read)
                body += [insn(0x62, R10, 0, -40, 0), insn(0xBF, R7, R10), insn(0x07, R7, 0, 0, -40)]
            body += [insn(0x18, R1, BPF_PSEUDO_MAP_FD, 0, scope_bytes_fd),
                     insn(0, 0, 0, 0, 0), insn(0xBF, R2, R7), insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM)]
            jump(0x15, R0, 0, "OUT")  # no such pod (the node's entry always exists)
            body.append(insn(0x79, R1, R10, SCOPE_LEN))
            for sid, at in SCOPE_SLOTS.items():
                jump(0x55, R8, sid, f"NOTSCOPE{sid}")
                body += [insn(0x79, R2, R0, slot + at), insn(0x0F, R2, R1), insn(0x7B, R0, R2, slot + at)]
                jump(0x05, 0, 0, "OUT")
                body.append(("label", f"NOTSCOPE{sid}"))  # the last one: on to what follows, as without scopes
        if segments:
            jump(0x05, 0, 0, "OUT")
    if segments:
        body.append(("label", "SEGLOOKUP"))
        body += [insn(0x18, R1, BPF_PSEUDO_MAP_FD, 0, segments_fd), insn(0, 0, 0, 0, 0),
                 insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM)]
        jump(0x15, R0, 0, "OUT")  # no such pod
        for at, stack in ((0, MERGED), (8, MERGED_SEGS)):  # headers' bytes, then segments, += (this CPU's)
            body += [insn(0x79, R1, R10, stack), insn(0x79, R2, R0, at), insn(0x0F, R2, R1), insn(0x7B, R0, R2, at)]
    body.append(("label", "OUT"))
    body += _verdict(gate)
    return resolve(body)


def _key(family: int, at: int) -> list[Item]:
    """r2 = a pointer to the map key of the address copied to fp+at: an IPv6 address as it is, an IPv4 one
    as ::ffff:a.b.c.d built at fp-24."""
    if family == 6:
        return [insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, at)]
    return [insn(0x7A, R10, 0, -24, 0), insn(0x62, R10, 0, -16, le(b"\0\0\xff\xff")),
            insn(0x61, R4, R10, at), insn(0x63, R10, R4, -12),
            insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, -24)]


def _scope_lookup(family: int, at: int, trie_fd: int) -> list[Item]:
    """r8 = the scope id of the address copied to fp+at, from the family's LPM trie (a full-length key built
    at fp+SCOPE_KEY), 0 (internal) when no prefix holds it. Uses r0-r4."""
    size = 4 if family == 4 else 16
    body: list[Item] = [insn(0x62, R10, 0, SCOPE_KEY, size * 8)]  # the key's prefix length: every bit
    for i in range(0, size, 4):
        body += [insn(0x61, R4, R10, at + i), insn(0x63, R10, R4, SCOPE_KEY + 4 + i)]
    body += [insn(0x18, R1, BPF_PSEUDO_MAP_FD, 0, trie_fd), insn(0, 0, 0, 0, 0),
             insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, SCOPE_KEY), insn(0x85, 0, 0, 0, BPF_FUNC_MAP_LOOKUP_ELEM),
             insn(0xB7, R8, 0, 0, 0), ("jmp", 0x15, R0, 0, f"SCOPED{family}"),
             insn(0x61, R8, R0, 0), ("label", f"SCOPED{family}")]
    return body


def _merged(family: int, done: str) -> list[Item]:
    """fp+MERGED = (gso_segs - 1) x the segment's IP and TCP (or UDP) headers, fp+MERGED_SEGS = gso_segs - 1,
    for a packet that carries several segments (GRO merged them; a local sender's TSO built it): what the
    wire carried beyond skb->len - ETH_HLEN, as the kernel's own qdisc_pkt_len counts it for a shaper.
    Both 0 for any other packet (one segment, or headers this does not parse: IPv6 extension headers,
    tunnels); then on to `done`. Needs r6 = ctx; uses r0-r4."""
    p = f"M{family}."
    body: list[Item] = [
        insn(0x61, R2, R6, SKB_GSO_SIZE), ("jmp", 0x15, R2, 0, p + "NONE"),  # not a GSO packet
        insn(0x61, R2, R6, SKB_GSO_SEGS), ("jmp", 0xB5, R2, 1, p + "NONE"),  # if segs <= 1
        insn(0x17, R2, 0, 0, 1), insn(0x7B, R10, R2, MERGED_SEGS),  # segments beyond the first
        # bpf_skb_load_bytes(skb, ETH_HLEN, fp+HEADER, n): the IP header's first bytes
        insn(0xBF, R1, R6), insn(0xB7, R2, 0, 0, ETH_HLEN), insn(0xBF, R3, R10), insn(0x07, R3, 0, 0, HEADER),
        insn(0xB7, R4, 0, 0, 10 if family == 4 else 8), insn(0x85, 0, 0, 0, BPF_FUNC_SKB_LOAD_BYTES),
        ("jmp", 0x55, R0, 0, p + "NONE"),
    ]
    if family == 4:  # r2 = IHL x 4, r3 = protocol
        body += [insn(0x71, R2, R10, HEADER), insn(0x57, R2, 0, 0, 15), insn(0x67, R2, 0, 0, 2),
                 ("jmp", 0xA5, R2, 20, p + "NONE"), insn(0x71, R3, R10, HEADER + 9)]
    else:  # r2 = the fixed header, r3 = next header (an extension header is not parsed)
        body += [insn(0xB7, R2, 0, 0, 40), insn(0x71, R3, R10, HEADER + 6)]
    body += [insn(0x7B, R10, R2, MERGED),  # the IP header's length, for now
             insn(0xB7, R4, 0, 0, UDP_HLEN), ("jmp", 0x15, R3, IPPROTO_UDP, p + "L4"),
             ("jmp", 0x55, R3, IPPROTO_TCP, p + "NONE"),
             # the TCP header's data offset: the high nibble of its byte 12
             insn(0xBF, R1, R6), insn(0x07, R2, 0, 0, ETH_HLEN + 12), insn(0xBF, R3, R10), insn(0x07, R3, 0, 0, HEADER),
             insn(0xB7, R4, 0, 0, 1), insn(0x85, 0, 0, 0, BPF_FUNC_SKB_LOAD_BYTES),
             ("jmp", 0x55, R0, 0, p + "NONE"),
             insn(0x71, R4, R10, HEADER), insn(0x77, R4, 0, 0, 4), insn(0x67, R4, 0, 0, 2),
             ("jmp", 0xA5, R4, 20, p + "NONE"),
             ("label", p + "L4"),  # r4 = the transport header's length
             insn(0x79, R2, R10, MERGED), insn(0x0F, R2, R4), insn(0x79, R3, R10, MERGED_SEGS), insn(0x2F, R2, R3),
             insn(0x7B, R10, R2, MERGED), ("jmp", 0x05, 0, 0, done),
             ("label", p + "NONE"),
             insn(0x7A, R10, 0, MERGED, 0), insn(0x7A, R10, 0, MERGED_SEGS, 0), ("jmp", 0x05, 0, 0, done)]
    return body


def _verdict(gate: int) -> list[Item]:
    """The program's end (r6 = ctx): TC_ACT_UNSPEC, or with a gate TC_ACT_OK for a packet without the bit."""
    if not gate:
        return [insn(0xB7, R0, 0, 0, TC_ACT_UNSPEC), insn(0x95)]
    return [insn(0xB7, R0, 0, 0, TC_ACT_UNSPEC), insn(0x61, R2, R6, SKB_MARK),  # r0 = UNSPEC, w2 = skb->mark
            insn(0x54, R2, 0, 0, le(struct.pack("<I", gate))), ("jmp", 0x56, R2, 0, "END"),  # w2 &= bit; if w2 != 0
            insn(0xB7, R0, 0, 0, TC_ACT_OK), ("label", "END"), insn(0x95)]


def _prog_load(code: bytes, name: str, vlog: ctypes.Array[ctypes.c_char] | None) -> int:
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(LICENSE)
    return bpf(BPF_PROG_LOAD, bpf_attr("=IIQQIIQII16s", BPF_PROG_TYPE_SCHED_CLS, len(code) // 8, addr(insns), addr(lic),
                                     1 if vlog is not None else 0, len(vlog) if vlog is not None else 0, addr(vlog),
                                     0, 0, name.encode()[:15]))


def load(code: bytes, name: str) -> int:
    """Load a sched_cls program. A refused one is loaded again with the verifier's log on, for the
    error to say why (a log on every load would cost the verifier time and a buffer)."""
    try:
        return _prog_load(code, name, None)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSYS):
            raise EbpfError(f"loading the counting program {name} failed: {refusal(exc)}") from None
    vlog = ctypes.create_string_buffer(1 << 20)
    try:
        return _prog_load(code, name, vlog)
    except OSError as exc:
        tail = vlog.value.decode(errors="replace")[-2000:].strip()
        raise EbpfError(f"loading the counting program {name} failed: {refusal(exc)}; "
                        f"the verifier said: ...{tail}") from None
