"""The ceiling: the highest aggregate internet rate one node shapes through its one IFB and HTB tree.

Run as root, alone on the machine's traffic lock:

    flock /tmp/netagent-traffic.lock python3 bench/ceiling.py [--pods 1,10,100] [--seconds 4] [--rounds 2]

One lab node with the largest pod count; for each count N, N pods each send one TCP flow
(iperf3, one server port per pod on the internet host) at once, alternately without netagent
and with every pod programmed as the agent does it (its class's rate = the node rate / N, ceil
= the node rate, the node class far above what the machine can carry: the shaper is in the
path of every byte but never the limit). The aggregate is what the internet host's device received (Ethernet frames) in a
common window after every flow started; the median of --rounds rounds. What the shaped side loses against the unshaped one is the cost
of the path through one IFB and one HTB lock (every packet of the node's internet egress is
enqueued and dequeued under that qdisc's lock, on whichever CPU runs it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iptables.apply import Classifier  # noqa: E402
from lab.netns import run  # noqa: E402
from lab.topology import INTERNAL_CIDRS, INTERNET_V4, UPLINK, Lab  # noqa: E402
from netagent.desired import DataPathOptions, NodeInputs, PodShape, desired_state  # noqa: E402
from tc.netlink import Shaper  # noqa: E402
from tc.probe import probe  # noqa: E402

NODE_RATE = 40_000_000_000  # far above this machine's forwarding rate: the shaper never limits
BASE_PORT = 5300


def rx_bytes(lab: Lab) -> int:
    return int(run("cat /sys/class/net/eth0/statistics/rx_bytes", lab.internet))


def aggregate(lab: Lab, pods, seconds: float) -> float:
    """bit/s the internet host received (frames) in a common window while all N flows run: the
    sum of each iperf3's own rate would overstate it (100 flows start over a second or more)."""
    procs = [lab.iperf_async(p.netns, INTERNET_V4, BASE_PORT + i, seconds=seconds + 3) for i, p in enumerate(pods)]
    try:
        time.sleep(2)
        b1, t1 = rx_bytes(lab), time.monotonic()
        time.sleep(seconds)
        b2, t2 = rx_bytes(lab), time.monotonic()
        for p in procs:
            p.communicate(timeout=seconds + 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return (b2 - b1) * 8 / (t2 - t1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", default="1,10,100")
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--leaf", default=None, help="the leaf qdisc (default: what the probe picks)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/ceiling.py needs root (network namespaces)", file=sys.stderr)
        return 2
    counts = [int(n) for n in args.pods.split(",")]
    with Lab(nodes=1, pods_per_node=max(counts), prefix=f"nace{os.getpid() % 10000}", ipv6=False) as lab:
        node = lab.nodes[0]
        for i in range(max(counts)):
            lab.iperf_server(lab.internet, BASE_PORT + i)
        shaper, classifier = Shaper(node.netns), Classifier(netns=node.netns)
        options = DataPathOptions(leaf_qdisc=args.leaf or probe(node.netns).leaf_qdisc)
        print(f"one node, one IFB/HTB, leaf {options.leaf_qdisc}, {os.cpu_count()} CPUs; one TCP flow per pod, "
              f"{args.seconds:g} s, median of {args.rounds} alternated rounds")
        print(f"{'pods':>5} {'unshaped':>12} {'through HTB':>12} {'share':>7}")
        try:
            for n in counts:
                pods = node.pods[:n]
                state = desired_state(NodeInputs(
                    (UPLINK,), INTERNAL_CIDRS,
                    tuple(PodShape(f"bench/{p.name}", (p.ip4,), NODE_RATE // n, NODE_RATE) for p in pods),
                    NODE_RATE, options))
                plain, shaped = [], []
                for _ in range(args.rounds):
                    plain.append(aggregate(lab, pods, args.seconds))
                    shaper.apply(state.shaper)
                    classifier.apply(state.classifier)
                    before = sum(s.bytes for s in shaper.stats(state.shaper.ifb).values())
                    shaped.append(aggregate(lab, pods, args.seconds))
                    if sum(s.bytes for s in shaper.stats(state.shaper.ifb).values()) - before < shaped[-1] / 8 * args.seconds:
                        raise SystemExit("the shaped traffic did not go through HTB")
                    shaper.cleanup(state.shaper.ifb, state.shaper.devices, state.shaper.filter_pref)
                    classifier.cleanup()
                    time.sleep(0.5)
                u, s = statistics.median(plain), statistics.median(shaped)
                print(f"{n:>5} {u / 1e9:>9.2f} G {s / 1e9:>9.2f} G {s / u:>7.2f}", flush=True)
        finally:
            classifier.cleanup()
            shaper.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
