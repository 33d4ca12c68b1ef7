"""What counting a download in segments (issue 34) costs the pod device's egress program, a packet: the
program with the segments map against the same program without it, on three packets (BPF_PROG_TEST_RUN: the
kernel's average ns a run over --repeat runs; CPU time, no traffic), rounds alternated, medians. Root.

    python3 -m bench.segments_cost [--rounds 9] [--repeat 200000]

  internet, 1 segment   what most download packets are (the ACKs of uploads, UDP, anything not merged):
                        with the map, `_merged` reads gso_size and stops
  internet, merged      a packet GRO merged from 5 segments: the headers read and added to the map
  internal              from an internal source: the program's internal path, unchanged

Verdict rule, set before the first run: the one-segment internet packet costs at most 10 ns more with the
segments map (median of the rounds); exit 1 if not.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from tc.ebpf import maps, programs
from tc.ebpf.syscall import BPF_MAP_UPDATE_ELEM, addr, bpf, bpf_attr, run_program

NETS: dict[int, tuple[str, ...]] = {4: ("10.0.0.0/8",), 6: ("fd00::/8",)}
POD = "10.244.0.10"
TS = [("NOP", None), ("NOP", None), ("Timestamp", (1, 2))]


def frame(src: str, payload: int) -> bytes:
    """An Ethernet frame to the pod (both MACs given: scapy would otherwise resolve one, by ARP; the destination
    the test run's device's, lo's zeros)."""
    return bytes(Ether(src="02:00:00:00:00:01", dst="00:00:00:00:00:00") / IP(src=src, dst=POD) / TCP(options=TS)
                 / Raw(bytes(payload)))


PACKETS = {  # name -> (frame, gso_segs)
    "internet, 1 segment": (frame("192.0.2.1", 1000), 1),
    "internet, merged": (frame("192.0.2.1", 2500), 5),
    "internal": (frame("10.244.1.10", 1000), 1),
}
BOUND_NS = 10


def with_entry(shape, name: bytes) -> int:
    fd = maps.create_map(shape, name)
    key, zero = ctypes.create_string_buffer(maps.key_of(POD)), ctypes.create_string_buffer(shape[2] * maps.possible_cpus())
    bpf(BPF_MAP_UPDATE_ELEM, bpf_attr("=IIQQQ", fd, 0, addr(key), addr(zero), 0))
    return fd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeat", type=int, default=200_000)
    args = ap.parse_args()
    pods = with_entry(maps.map_shape(4), maps.MAP_NAME)
    segments = with_entry(maps.segments_shape(4), maps.SEGMENTS_MAP_NAME)
    fds = [pods, segments]
    try:
        progs = {"without": programs.load(programs.program(NETS, True, pods), "na_cost_without"),
                 "with": programs.load(programs.program(NETS, True, pods, segments_fd=segments), "na_cost_with")}
        fds += progs.values()
        runs: dict[tuple[str, str], list[int]] = {(p, v): [] for p in PACKETS for v in progs}
        for r in range(args.rounds):
            order = list(progs) if r % 2 == 0 else list(reversed(progs))  # alternated
            for name, (frame, segs) in PACKETS.items():
                for variant in order:
                    runs[(name, variant)].append(run_program(progs[variant], frame, args.repeat, segs,
                                                             500 if segs > 1 else 0)[1])
        print(f"ns a packet, the pod device's egress program (median of {args.rounds} alternated rounds of "
              f"{args.repeat:,} runs; min-max)")
        print("| packet | without the segments map | with it | added |")
        print("|---|---|---|---|")
        added = {}
        for name in PACKETS:
            w, s = runs[(name, "without")], runs[(name, "with")]
            added[name] = statistics.median(s) - statistics.median(w)
            print(f"| {name} | {statistics.median(w):.0f} ({min(w)}-{max(w)}) | {statistics.median(s):.0f} "
                  f"({min(s)}-{max(s)}) | {added[name]:+.0f} |")
        ok = added["internet, 1 segment"] <= BOUND_NS
        print(f"verdict: a one-segment internet packet costs {added['internet, 1 segment']:+.0f} ns with the map "
              f"(rule: at most +{BOUND_NS} ns): {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
