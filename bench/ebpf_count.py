"""A prototype for bench/classify_cost.py's `ebpf` row, not a product path: a pod's internal bytes
counted by an eBPF program on its host-side device, so that the iptables rules need no set lookup
for internal packets.

Why eBPF: the documented next step was a classic-BPF scope test whose action statistics count, but
this kernel (like other minimal ones) has no `gact`, and `mirred`, the one action it has, clones or
steals the packet. An eBPF `sched_cls` program in direct-action mode can test the scope and add the
bytes to a per-CPU array itself, and returns TC_ACT_UNSPEC so the device's other filters (the
download redirect) still run.

What it counts is the unit the ipsets count: the IP bytes of each skb, a GSO packet once. On a
device's ingress (what the pod sends) skb->len has no MAC header; on its egress (what the pod
receives) it has, so the program takes ETH_HLEN off there.

Loaded with raw bpf(2) calls through ctypes: the program is a few dozen instructions and needs no
compiler, no libbpf and no BTF.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import struct

SYS_BPF = 321  # x86_64
BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_PROG_LOAD, BPF_OBJ_PIN = 0, 1, 5, 6
BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_PROG_TYPE_SCHED_CLS = 3
TC_ACT_UNSPEC = -1
ETH_HLEN = 14
SKB_LEN, SKB_PROTOCOL, SKB_DATA, SKB_DATA_END = 0, 16, 76, 80  # offsets in struct __sk_buff
ADDR = {4: {"src": 26, "dst": 30, "end": 34}, 6: {"src": 22, "dst": 38, "end": 54}}  # from the MAC header
R0, R1, R2, R3, R4, R5, R6, R7, R8, R10 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    ret = _libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return ret


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _le(word: bytes) -> int:
    """A network-order word as a 32-bit load on this (little-endian) host sees it, as a signed immediate."""
    return struct.unpack("<i", word)[0]


def program(networks: dict[int, tuple[str, ...]], egress: bool, map_fd: int) -> bytes:
    """Count the skbs that cross a pod's device with the far end in `networks` into map[0] = (bytes, packets):
    on its ingress (what the pod sends) by destination, on its egress (what it receives) by source. Always
    returns TC_ACT_UNSPEC."""
    where = "src" if egress else "dst"
    # instructions, ("label", name), and ("jmp", code, dst, src, imm, target): a jump resolved once labels are placed
    body: list = []

    def jump(code: int, dst: int, imm: int, target: str, src: int = 0) -> None:
        body.append(("jmp", code, dst, src, imm, target))

    body += [insn(0xBF, R6, R1),  # r6 = ctx
             insn(0x61, R2, R6, SKB_PROTOCOL), insn(0x61, R7, R6, SKB_DATA), insn(0x61, R8, R6, SKB_DATA_END)]
    jump(0x15, R2, 0x0008, "V4")  # htons(ETH_P_IP) as loaded
    jump(0x15, R2, 0xDD86, "V6")
    jump(0x05, 0, 0, "OUT")
    for family in (4, 6):
        body.append(("label", f"V{family}"))
        body += [insn(0xBF, R3, R7), insn(0x07, R3, 0, 0, ADDR[family]["end"])]
        jump(0x2D, R3, 0, "OUT", src=R8)  # r3 > data_end: too short
        for n, text in enumerate(networks.get(family, ())):
            net = ipaddress.ip_network(text)
            raw, mask = net.network_address.packed, net.netmask.packed
            words = [i for i in range(0, len(raw), 4) if mask[i:i + 4] != b"\0\0\0\0"]
            for i in words:
                body.append(insn(0x61, R4, R7, ADDR[family][where] + i))  # r4 = address word (u32 load)
                if mask[i:i + 4] != b"\xff\xff\xff\xff":
                    body.append(insn(0x54, R4, 0, 0, _le(mask[i:i + 4])))  # w4 &= mask (32-bit ALU)
                jump(0x56, R4, _le(raw[i:i + 4]), f"NEXT{family}.{n}")  # w4 != word (JMP32): the next network
            jump(0x05, 0, 0, "COUNT")
            body.append(("label", f"NEXT{family}.{n}"))
        jump(0x05, 0, 0, "OUT")
    body.append(("label", "COUNT"))
    body += [insn(0x62, R10, 0, -4, 0), insn(0xBF, R2, R10), insn(0x07, R2, 0, 0, -4),
             insn(0x18, R1, 1, 0, map_fd), insn(0, 0, 0, 0, 0),  # r1 = the map (ld_imm64, pseudo map fd)
             insn(0x85, 0, 0, 0, 1)]  # call bpf_map_lookup_elem
    jump(0x15, R0, 0, "OUT")
    body += [insn(0x61, R1, R6, SKB_LEN)]
    if egress:
        body.append(insn(0x17, R1, 0, 0, ETH_HLEN))  # r1 -= ETH_HLEN
    body += [insn(0x79, R2, R0, 0), insn(0x0F, R2, R1), insn(0x7B, R0, R2, 0),  # bytes += len (per CPU)
             insn(0x79, R2, R0, 8), insn(0x07, R2, 0, 0, 1), insn(0x7B, R0, R2, 8)]  # packets += 1
    body.append(("label", "OUT"))
    body += [insn(0xB7, R0, 0, 0, TC_ACT_UNSPEC), insn(0x95)]
    # resolve labels: every item but a label is one 8-byte slot, except ld_imm64's two (already two items)
    pos, labels = 0, {}
    for item in body:
        if isinstance(item, tuple) and item[0] == "label":
            labels[item[1]] = pos
        else:
            pos += 1
    out, pos = [], 0
    for item in body:
        if isinstance(item, tuple) and item[0] == "label":
            continue
        if isinstance(item, tuple):
            _, code, dst, src, imm, target = item
            out.append(insn(code, dst, src, labels[target] - pos - 1, imm))
        else:
            out.append(item)
        pos += 1
    return b"".join(out)


class DeviceCounter:
    """One per-CPU (bytes, packets) counter and the program that fills it, pinned where tc can load it."""

    def __init__(self, networks: dict[int, tuple[str, ...]], egress: bool, pin: str):
        attr = (ctypes.c_uint8 * 128)()
        struct.pack_into("<IIII", attr, 0, BPF_MAP_TYPE_PERCPU_ARRAY, 4, 16, 1)
        self.map_fd = _bpf(BPF_MAP_CREATE, attr)
        code = program(networks, egress, self.map_fd)
        insns = ctypes.create_string_buffer(code, len(code))
        lic = ctypes.create_string_buffer(b"GPL")
        log = ctypes.create_string_buffer(1 << 16)
        attr = (ctypes.c_uint8 * 128)()
        struct.pack_into("<IIQQIIQ", attr, 0, BPF_PROG_TYPE_SCHED_CLS, len(code) // 8, ctypes.addressof(insns),
                         ctypes.addressof(lic), 1, len(log), ctypes.addressof(log))
        try:
            self.prog_fd = _bpf(BPF_PROG_LOAD, attr)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc}: {log.value.decode(errors='replace')[-2000:]}") from None
        path = ctypes.create_string_buffer(pin.encode())
        attr = (ctypes.c_uint8 * 128)()
        struct.pack_into("<QI", attr, 0, ctypes.addressof(path), self.prog_fd)
        _bpf(BPF_OBJ_PIN, attr)
        self.pin = pin

    def read(self) -> tuple[int, int]:
        with open("/sys/devices/system/cpu/possible") as f:  # a per-CPU map holds a value per possible CPU
            cpus = int(f.read().strip().split("-")[-1]) + 1
        key, value = ctypes.c_uint32(0), (ctypes.c_uint64 * (2 * cpus))()
        attr = (ctypes.c_uint8 * 128)()
        struct.pack_into("<IIQQ", attr, 0, self.map_fd, 0, ctypes.addressof(key), ctypes.addressof(value))
        _bpf(BPF_MAP_LOOKUP_ELEM, attr)
        return sum(value[0::2]), sum(value[1::2])

    def close(self) -> None:
        for fd in (self.prog_fd, self.map_fd):
            os.close(fd)
        if os.path.exists(self.pin):
            os.unlink(self.pin)
