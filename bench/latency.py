"""Latency under load: ping RTT to the internet host while the pod's upload saturates its limit.

Run as root, alone on the machine's traffic lock:

    flock /tmp/netagent-traffic.lock python3 bench/latency.py [--rates 20M,100M] [--pings 40] [--rounds 2]

For each limit, with the pod's HTB leaf as pfifo (a packet count: ~100 ms of full-size packets
at the ceil, 64..2000) and as bfifo (bytes: 5 ms at the ceil plus one 64 KiB GSO packet,
`tc/sizing.leaf_limit_bytes`), alternated round by round: an iperf3 TCP upload from the pod
to the internet host, and after a 2 s ramp `--pings` pings (0.1 s apart) from the same pod to
the same host, through the same class. Prints the median and 90th percentile RTT, the
upload's goodput, the leaf's drops and the class's backlog (sampled every 0.1 s while the
pings run). The unloaded RTT is measured first.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iptables.apply import Classifier  # noqa: E402
from lab.netns import run  # noqa: E402
from lab.topology import INTERNAL_CIDRS, INTERNET_V4, UPLINK, Lab  # noqa: E402
from netagent.desired import DataPathOptions, NodeInputs, PodShape, desired_state  # noqa: E402
from tc.netlink import Shaper  # noqa: E402

UNITS = {"k": 1_000, "M": 1_000_000, "G": 1_000_000_000}
PORT = 5201


def parse_rate(text: str) -> int:
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def pings(netns: str, count: int) -> list[float]:
    out = run(["ping", "-c", str(count), "-i", "0.1", INTERNET_V4], netns, check=False, timeout=count + 30)
    return [float(v) for v in re.findall(r"time=([\d.]+) ms", out)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="20M,100M")
    ap.add_argument("--pings", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/latency.py needs root (network namespaces)", file=sys.stderr)
        return 2
    with Lab(nodes=1, pods_per_node=1) as lab:
        node, pod = lab.nodes[0], lab.nodes[0].pods[0]
        lab.iperf_server(lab.internet, PORT)
        shaper, classifier = Shaper(node.netns), Classifier(netns=node.netns)
        try:
            idle = pings(pod.netns, 20)
            print(f"unloaded RTT pod -> internet host: median {statistics.median(idle):.3f} ms")
            print(f"{'limit':>8} {'leaf':6} {'leaf limit':>12} {'RTT p50':>9} {'RTT p90':>9} {'goodput':>10} {'drops':>7}"
                  f"  {'backlog p50 (B, pkts)':>22}")
            for text in args.rates.split(","):
                rate = parse_rate(text)
                rows: dict[str, list] = {"pfifo": [], "bfifo": []}
                for _ in range(args.rounds):
                    for leaf in rows:
                        state = desired_state(NodeInputs((UPLINK,), INTERNAL_CIDRS,
                                                (PodShape("bench/pod", (pod.ip4, pod.ip6), rate, rate),), 10 * rate,
                                                DataPathOptions(leaf_qdisc=leaf)))
                        shaper.apply(state.shaper)
                        classifier.apply(state.classifier)
                        minor = state.minors["bench/pod"]
                        before = shaper.stats(state.shaper.ifb)[minor]
                        seconds = 2 + args.pings * 0.1 + 2
                        upload = lab.iperf_async(pod.netns, INTERNET_V4, PORT, seconds=seconds)
                        try:
                            time.sleep(2)
                            ping = subprocess.Popen(["ip", "netns", "exec", pod.netns, "ping", "-c", str(args.pings), "-i",
                                                     "0.1", INTERNET_V4], stdout=subprocess.PIPE, text=True)
                            backlog = []
                            while ping.poll() is None:  # the HTB class's queue (its leaf) while the pings cross it
                                c = shaper.stats(state.shaper.ifb)[minor]
                                backlog.append((c.backlog_bytes, c.backlog_packets))
                                time.sleep(0.1)
                            rtts = [float(v) for v in re.findall(r"time=([\d.]+) ms", ping.communicate()[0])]
                            out, err = upload.communicate(timeout=seconds + 30)
                        finally:
                            if upload.poll() is None:
                                upload.kill()
                        after = shaper.stats(state.shaper.ifb)[minor]
                        leaf_limit = shaper.observe(state.shaper).leaves[minor].limit
                        goodput = json.loads(out)["end"]["sum_received"]["bits_per_second"]
                        rows[leaf].append((rtts, goodput, after.drops - before.drops, leaf_limit, backlog))
                        shaper.cleanup(state.shaper.ifb, state.shaper.devices, state.shaper.filter_pref)
                for leaf, runs in rows.items():
                    rtts = [r for run_ in runs for r in run_[0]]
                    p90 = statistics.quantiles(rtts, n=10)[-1] if len(rtts) > 1 else rtts[0]
                    unit = "B" if leaf == "bfifo" else "pkt"
                    print(f"{text:>8} {leaf:6} {runs[0][3]:>9} {unit:3}{statistics.median(rtts):>8.2f}ms{p90:>8.2f}ms"
                          f"{statistics.median(r[1] for r in runs) / 1e6:>8.2f} M{sum(r[2] for r in runs):>7}"
                          f"  {statistics.median(b for r in runs for b, _ in r[4]):>12.0f} "
                          f"{statistics.median(p for r in runs for _, p in r[4]):>6.0f}", flush=True)
        finally:
            classifier.cleanup()
            shaper.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
