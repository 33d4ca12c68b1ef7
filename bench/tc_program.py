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

from tc import markfilter, sizing  # noqa: E402
from tc.diff import ClassParams, desired_classes, desired_leaves  # noqa: E402
from tc.model import DEFAULT_MINOR, NODE_MINOR, HtbClassSpec, ShaperSpec, ack_minor, bulk_minor  # noqa: E402
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
    """The same state as `tc` command lines, one exec each: the node class, each pod's class with its
    control and bulk leaves (tc.diff's tree), a queue per leaf, the redirect filter."""
    cmds = [["ip", "link", "add", spec.ifb, "type", "ifb"], ["ip", "link", "set", spec.ifb, "txqueuelen", "5000", "up"],
            ["tc", "qdisc", "add", "dev", spec.ifb, "root", "handle", "1:", "htb", "default", "fffe", "r2q", "100"]]
    want = desired_classes(spec, lambda rate, size: 0)
    for minor in sorted(want, key=lambda m: (m != NODE_MINOR, m)):
        cmds.append(class_cmd("add", spec, want[minor]))
    for leaf in desired_leaves(spec):
        cmds.append(["tc", "qdisc", "add", "dev", spec.ifb, "parent", f"1:{leaf.minor:x}", "handle", f"{leaf.minor:x}:",
                     "pfifo", "limit", str(sizing.leaf_limit_packets(leaf.ceil))])
    cmds.append(["tc", "qdisc", "add", "dev", "eth0", "clsact"])
    cmds.append(["tc", "filter", "add", "dev", "eth0", "egress", "pref", "49152", "handle", "1", "bpf", "bytecode",
                 markfilter.as_tc_bytecode(markfilter.mark_test(spec.mark_bit)),
                 "action", "mirred", "egress", "redirect", "dev", spec.ifb])
    return cmds


def class_cmd(verb: str, spec: ShaperSpec, p: ClassParams) -> list[str]:
    parent = f"1:{p.parent_minor:x}" if p.parent_minor else "1:"
    return ["tc", "class", verb, "dev", spec.ifb, "parent", parent, "classid", f"1:{p.minor:x}", "htb",
            "rate", f"{p.rate_bytes}bps", "ceil", f"{p.ceil_bytes}bps", "burst", str(p.burst_bytes),
            "cburst", str(p.cburst_bytes), "quantum", str(p.quantum), "prio", str(p.prio)]


def change_commands(spec: ShaperSpec, pod: HtbClassSpec) -> list[list[str]]:
    """A pod's rate change: its class and both leaves (the leaves' rates split the pod's)."""
    want = desired_classes(spec, lambda rate, size: 0)
    return [class_cmd("change", spec, want[m]) for m in (pod.minor, ack_minor(pod.minor), bulk_minor(pod.minor))]


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
            c0 = changed.pods[0]
            res["tc_change"].append(timed(lambda: run_tc(b, change_commands(changed, c0))))

            def tc_stats():
                out = subprocess.run(["ip", "netns", "exec", b, "tc", "-s", "class", "show", "dev", "na-ifb0"],
                                     check=True, capture_output=True, text=True).stdout
                sent = [int(line.split()[1]) for line in out.splitlines() if line.strip().startswith("Sent")]
                assert len(sent) == 3 * args.pods + 2  # node, default, each pod and its two leaves
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
    print("netagent's change includes reading the whole kernel state and diffing it; exec tc runs the pod's three.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
