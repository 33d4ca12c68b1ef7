"""Collect every HTB class's counters of a 110-pod node: how long one collection takes.

netagent's `Shaper.stats` (one raw class dump, only the fields we export) against
exec'ing `tc -s -j class show` and parsing what it prints
(text: this iproute2 has no JSON for classes), and against pyroute2's own
decoder (`get_classes`), all in the same run on the same scratch namespace.
Aim: ≤ 20 ms per collection.

    sudo python3 bench/tc_stats.py [--pods 110] [--samples 500]
"""
from __future__ import annotations

import argparse
import re
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import pct, timed_ms  # noqa: E402
from tc.model import DEFAULT_MINOR, HtbClassSpec, ShaperSpec  # noqa: E402
from tc.netlink import Shaper  # noqa: E402

IFB = "na-ifb0"


def spec_for(pods: int) -> ShaperSpec:
    classes = tuple(HtbClassSpec(0x100 + i, 10_000_000, 100_000_000, f"ns/p{i}") for i in range(pods))
    return ShaperSpec(IFB, ("eth0",), 0x20000, 10_000_000_000,
                      HtbClassSpec(DEFAULT_MINOR, 1_000_000, 1_000_000, "default"), classes)


SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+).*?backlog (\d+)b (\d+)p", re.S)


def tc_counters(block: str) -> tuple[int, ...]:
    m = SENT.search(block)
    if m is None:
        raise RuntimeError(f"cannot parse tc class output: {block[:200]!r}")
    return tuple(int(x) for x in m.groups())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--samples", type=int, default=500)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/tc_stats.py needs root (it builds a scratch network namespace)", file=sys.stderr)
        return 2
    ns = f"na-bench-stats{os.getpid()}"
    want = args.pods + 2  # pods, the default class and the node class
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        with Shaper(ns) as s:
            s.apply(spec_for(args.pods))
            ifindex = s._index(IFB)

            def netagent():
                assert len(s.stats(IFB)) == want

            def pyroute2_decoder():
                assert len([c for c in s.ipr.get_classes(ifindex) if c.get_attr("TCA_KIND") == "htb"]) == want

            def exec_tc():
                # this iproute2 ignores -j for classes and prints text: parse the counters we export
                out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "-j", "class", "show", "dev", IFB],
                                     check=True, capture_output=True, text=True).stdout
                counters = [tc_counters(block) for block in out.split("class htb ")[1:]]
                assert len(counters) == want

            netagent()  # warm up both paths once
            exec_tc()
            results = {
                "netagent Shaper.stats (raw dump)": timed_ms(netagent, args.samples),
                "pyroute2 get_classes (full decode)": timed_ms(pyroute2_decoder, max(20, args.samples // 10)),
                "exec tc -s -j class show + parse": timed_ms(exec_tc, max(20, args.samples // 5)),
            }
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    base = statistics.median(results["exec tc -s -j class show + parse"])
    print(f"collect all class statistics: {args.pods} pods ({want} HTB classes), one collection (ms)")
    print(f"{'':38}{'samples':>8}{'p50':>9}{'p99':>9}{'vs exec tc (p50)':>18}")
    for label, xs in results.items():
        p50 = statistics.median(xs)
        print(f"{label:38}{len(xs):8d}{p50:9.2f}{pct(xs, 99):9.2f}{base / p50:17.1f}x")
    ours = results["netagent Shaper.stats (raw dump)"]
    print(f"aim ≤ 20 ms per collection: p99 {pct(ours, 99):.2f} ms -> {'met' if pct(ours, 99) <= 20 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
