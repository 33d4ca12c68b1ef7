"""Per-packet cost of one scopes LPM lookup (issue 39): a tiny sched_cls program with and without one
bpf_map_lookup_elem on the v4 trie (loaded from core.scopes.lpm_entries of the issue's example), timed by
BPF_PROG_TEST_RUN's repeat (the kernel's average ns per run; CPU time, no traffic). Root.
    python3 -m bench.scope_lookup_cost [--repeat N]"""
from __future__ import annotations

import argparse
import ctypes
import os
import struct

from core.scopes import diff_entries, lpm_entries, parse
from tc.ebpf.asm import insn
from tc.ebpf.maps import SCOPE_MAP_NAMES, create_map, scope_apply, scope_map_shape
from tc.ebpf.syscall import BPF_PROG_LOAD, BPF_PROG_TYPE_SCHED_CLS, addr, bpf, bpf_attr

BPF_PROG_TEST_RUN = 10
EXAMPLE = {"spec": {"zones": [{"name": "a", "cidrs": ["10.0.0.0/18"]}, {"name": "b", "cidrs": ["10.0.64.0/18"]}],
                    "regions": [{"name": "r", "cidrs": ["10.1.0.0/16"]}]}}


def program(map_fd: int | None, address: bytes) -> bytes:
    body = [insn(0x62, 10, 0, -8, 32), insn(0x62, 10, 0, -4, struct.unpack("<i", address)[0])]  # key on the stack
    if map_fd is not None:
        body += [insn(0x18, 1, 1, 0, map_fd), insn(0, 0, 0, 0, 0),  # r1 = the trie (ld_imm64 pseudo map fd)
                 insn(0xBF, 2, 10), insn(0x07, 2, 0, 0, -8), insn(0x85, 0, 0, 0, 1)]  # r2 = &key; lookup
    body += [insn(0xB7, 0, 0, 0, 0), insn(0x95)]  # return TC_ACT_OK
    return b"".join(body)


def per_run_ns(code: bytes, repeat: int) -> int:
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(b"GPL")
    fd = bpf(BPF_PROG_LOAD, bpf_attr("=IIQQIIQII16s", BPF_PROG_TYPE_SCHED_CLS, len(code) // 8, addr(insns), addr(lic),
                                     0, 0, 0, 0, 0, b"na_scope_cost"))
    try:
        pkt = ctypes.create_string_buffer(bytes(14) + bytes(50))
        attr = bpf_attr("=IIIIQQII", fd, 0, len(pkt.raw), 0, addr(pkt), 0, repeat, 0)
        bpf(BPF_PROG_TEST_RUN, attr)
        return int(struct.unpack_from("=I", attr, 36)[0])
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1_000_000)
    args = ap.parse_args()
    desc = parse(EXAMPLE).description
    assert desc is not None
    fds = {v: create_map(scope_map_shape(v, 4096), SCOPE_MAP_NAMES[v]) for v in (4, 6)}
    try:
        scope_apply(fds, *diff_entries({}, lpm_entries(desc, "a")))
        ip = bytes([10, 0, 1, 1])
        base = per_run_ns(program(None, ip), args.repeat)
        with_lookup = per_run_ns(program(fds[4], ip), args.repeat)
        print(f"ns/run without lookup {base}, with one LPM lookup {with_lookup}, lookup ~{with_lookup - base} ns "
              f"(repeat {args.repeat}, {len(lpm_entries(desc, 'a'))} entries)")
    finally:
        for fd in fds.values():
            os.close(fd)


if __name__ == "__main__":
    main()
