"""Program 110 pods' shaping from nothing, change one pod's rate, collect statistics.

netagent (pyroute2 over netlink, one process) against exec'ing `tc` once per command
as the CNI bandwidth plugin does, measured in the same run, in scratch namespaces.

    sudo python3 bench/tc_program.py [--pods 110] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tc import bpf, sizing  # noqa: E402
from tc.model import DEFAULT_MINOR, HtbClassSpec, ShaperSpec  # noqa: E402
from tc.netlink import Shaper  # noqa: E402


def netns(name: str) -> None:
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"], check=True)
    subprocess.run(["ip", "-n", name, "link", "set", "eth0", "up"], check=True)


def spec_for(pods: int, bump: int = 0) -> ShaperSpec:
    classes = tuple(
        HtbClassSpec(0x100 + i, 10_000_000 + (bump if i == 0 else 0), 100_000_000 + (bump if i == 0 else 0), f"ns/p{i}")
        for i in range(pods)
    )
    return ShaperSpec("na-ifb0", ("eth0",), 0x20000, 10_000_000_000,
                      HtbClassSpec(DEFAULT_MINOR, 1_000_000, 1_000_000, "default"), classes)


def tc_commands(spec: ShaperSpec) -> list[list[str]]:
    """The same state as `tc` command lines, one exec each."""
    cmds = [["ip", "link", "add", spec.ifb, "type", "ifb"], ["ip", "link", "set", spec.ifb, "txqueuelen", "5000", "up"],
            ["tc", "qdisc", "add", "dev", spec.ifb, "root", "handle", "1:", "htb", "default", "fffe", "r2q", "100"],
            ["tc", "class", "add", "dev", spec.ifb, "parent", "1:", "classid", "1:1", "htb",
             "rate", f"{spec.node_rate}bit", "ceil", f"{spec.node_rate}bit"]]
    for c in spec.classes:
        cmds.append(class_cmd("add", spec, c))
        cmds.append(["tc", "qdisc", "add", "dev", spec.ifb, "parent", f"1:{c.minor:x}", "handle", f"{c.minor:x}:",
                     "pfifo", "limit", str(sizing.leaf_limit_packets(c.ceil))])
    cmds.append(["tc", "qdisc", "add", "dev", "eth0", "clsact"])
    cmds.append(["tc", "filter", "add", "dev", "eth0", "egress", "pref", "49152", "handle", "1", "bpf", "bytecode",
                 bpf.as_tc_bytecode(bpf.mark_test(spec.mark_bit)), "action", "mirred", "egress", "redirect", "dev", spec.ifb])
    return cmds


def class_cmd(verb: str, spec: ShaperSpec, c: HtbClassSpec) -> list[str]:
    return ["tc", "class", verb, "dev", spec.ifb, "parent", "1:1", "classid", f"1:{c.minor:x}", "htb",
            "rate", f"{c.rate}bit", "ceil", f"{c.ceil}bit", "burst", str(sizing.burst_bytes(c.rate)),
            "cburst", str(sizing.burst_bytes(c.ceil)), "quantum", str(sizing.quantum_bytes(c.rate))]


def run_tc(ns: str, cmds: list[list[str]]) -> None:
    for cmd in cmds:
        subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, capture_output=True)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    base, changed = spec_for(args.pods), spec_for(args.pods, bump=5_000_000)
    res: dict[str, list[float]] = {k: [] for k in ("na_full", "tc_full", "na_change", "tc_change", "na_stats", "tc_stats")}
    pid = os.getpid()
    for r in range(args.rounds):
        a, b = f"na-bench-a{pid}-{r}", f"na-bench-b{pid}-{r}"
        try:
            netns(a)
            netns(b)
            with Shaper(a) as s:
                res["na_full"].append(timed(lambda: s.apply(base)))
                res["na_change"].append(timed(lambda: s.apply(changed)))
                assert s.apply(changed).changes == 0
                res["na_stats"].append(statistics.median(timed(lambda: s.stats("na-ifb0")) for _ in range(20)))
            res["tc_full"].append(timed(lambda: run_tc(b, tc_commands(base))))
            c0 = changed.classes[0]
            res["tc_change"].append(timed(lambda: run_tc(b, [class_cmd("change", changed, c0)])))

            def tc_stats():
                out = subprocess.run(["ip", "netns", "exec", b, "tc", "-s", "class", "show", "dev", "na-ifb0"],
                                     check=True, capture_output=True, text=True).stdout
                sent = [int(line.split()[1]) for line in out.splitlines() if line.strip().startswith("Sent")]
                assert len(sent) == args.pods + 2
            res["tc_stats"].append(statistics.median(timed(tc_stats) for _ in range(20)))
        finally:
            for ns in (a, b):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    med = {k: statistics.median(v) * 1000 for k, v in res.items()}
    print(f"tc programming, {args.pods} pods, median of {args.rounds} rounds (ms)")
    print(f"{'':34}{'netagent':>12}{'exec tc':>12}{'ratio':>9}")
    for label, na, tc in (("program from nothing", "na_full", "tc_full"),
                          ("change one pod's rate (reconcile)", "na_change", "tc_change"),
                          ("collect all class statistics", "na_stats", "tc_stats")):
        print(f"{label:34}{med[na]:12.2f}{med[tc]:12.2f}{med[tc] / med[na]:8.1f}x")
    na_total, tc_total = med["na_full"] + med["na_change"], med["tc_full"] + med["tc_change"]
    print(f"{f'{args.pods} pods from nothing + one change':34}{na_total:12.2f}{tc_total:12.2f}{tc_total / na_total:8.1f}x"
          f"   (aim ≥ 5x)")
    print("netagent's change includes reading the whole kernel state and diffing it; exec tc runs one command.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
