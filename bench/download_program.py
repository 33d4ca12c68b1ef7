"""Programming the download shaper at scale: 110 pods, each with its own veth (its filter).

Builds a lab node with 110 pods (native routing, IPv4), plans the node as the agent does, and
times `Shaper.apply` of the upload tree and of the download tree (IFB, HTB, a redirect filter
on every pod device) from nothing, then reconciles that change the node's download rate
(a full read of the kernel state and one class change), and the pod-device listing.

    sudo python3 bench/download_program.py [--pods 110] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.direction import PerDirection  # noqa: E402
from lab.topology import INTERNAL_CIDRS, UPLINK, Lab  # noqa: E402
from netagent.desired import DataPathOptions, NodeInputs, PodShape, desired_state  # noqa: E402
from tc.netlink import Shaper  # noqa: E402

M = 1_000_000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (it builds network namespaces)", file=sys.stderr)
        return 2
    with Lab(nodes=1, pods_per_node=args.pods, ipv6=False, prefix=f"nadp{os.getpid() % 10000}") as lab:
        node = lab.nodes[0]
        sh = Shaper(node.netns)
        opts = DataPathOptions()
        try:
            t = time.perf_counter()
            devices = sh.devices_of_kind(("veth",), exclude=(UPLINK,))
            listing = time.perf_counter() - t
            shapes = tuple(PodShape(f"d/{p.name}", (p.ip4,), PerDirection.same(10 * M), PerDirection(10 * M, 20 * M))
                           for p in node.pods)

            def state(rate: int):
                return desired_state(NodeInputs((UPLINK,), INTERNAL_CIDRS, shapes, PerDirection(10**9, rate), opts,
                                                pod_devices=devices))

            s = state(10**9)
            t0 = time.perf_counter()
            sh.apply(s.shaper)
            t1 = time.perf_counter()
            sh.apply(s.shapers.download)
            t2 = time.perf_counter()
            changes = []
            for i in range(args.rounds):
                s = state((2 + i) * 10**9)
                t = time.perf_counter()
                assert sh.apply(s.shapers.download).changes == 1
                changes.append(time.perf_counter() - t)
            print(f"{len(devices)} pod devices; device listing {listing * 1000:.1f} ms")
            print(f"from nothing: upload tree {(t1 - t0) * 1000:.1f} ms, download tree with "
                  f"{len(devices)} redirect filters {(t2 - t1) * 1000:.1f} ms")
            print(f"reconcile changing the node download rate (reads everything, one change): "
                  f"median {statistics.median(changes) * 1000:.1f} ms of {args.rounds}")
        finally:
            sh.cleanup(opts.ifbs.upload, (UPLINK, *devices), opts.filter_pref)
            sh.cleanup(opts.ifbs.download, (), opts.filter_pref)
            sh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
