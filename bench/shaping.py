"""Shaping accuracy: a pod's internet egress against its configured rate, TCP and a UDP flood.

Builds the namespace lab (one node, two pods, an internet host, an internal peer), programs
the node as the agent does (desired_state -> Shaper.apply + Classifier.apply), and for each rate
runs iperf3 TCP and a UDP flood at twice the rate from the pod to the internet host.

Measured rate = the pod's HTB class counters in IP bytes (bytes - 14 x packets: a configured
rate is IP bytes on the wire), read after a warm-up and again at the end of a window, divided
by the time between the reads.
The unshaped path (no netagent) is measured first in the same run: it says what this
machine can carry at all. Then: the pod's internal traffic while it is shaped, against
that unshaped baseline and against the CNI bandwidth plugin's TBF (which shapes every
destination), and two pods sharing a node class (HTB's expected split), with TCP and with UDP
floods (always backlogged: HTB's own split, without TCP's). Then the same for downloads
(internet -> pod, issue 13): the pod's download class, TCP and a UDP flood from the internet
host, and the pod's internal download against the unshaped path.
Exits 1 when a rate error exceeds 5% of the rate, or a sharing row's error 5% of the node rate
(the bound tests/test_agent_datapath_traffic.py checks); both kinds of row count.

    sudo python3 bench/shaping.py [--rates 10M,100M,1G] [--runs 1] [--window 2.4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.direction import PerDirection  # noqa: E402
from iptables.apply import Classifier  # noqa: E402
from lab.topology import INTERNAL_CIDRS, INTERNET_V4, PEER_V4, UPLINK, Lab, run  # noqa: E402
from netagent.desired import NodeInputs, DataPathOptions, PodShape, desired_state, ip_bytes, to_wire  # noqa: E402
from tc import sizing  # noqa: E402
from tc.netlink import Shaper  # noqa: E402
from tc.probe import probe  # noqa: E402

TOLERANCE = 0.05
M = 1_000_000
UNITS = {"k": 1_000, "M": 1_000_000, "G": 1_000_000_000}
# (node rate, pod a (rate, ceil), pod b (rate, ceil)); the second is the one tests/test_agent_datapath_traffic.py checks
SHARING = ((100 * M, (20 * M, 100 * M), (60 * M, 100 * M)), (400 * M, (40 * M, 400 * M), (120 * M, 400 * M)))
IPERF_UDP_LIMIT = 500_000_000  # above this, iperf3 3.12 cannot offer 2x the rate here: the GSO flood does


def parse_rate(text: str) -> int:
    text = text.strip()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def fmt(bps: float) -> str:
    return f"{bps / 1e9:.3f} G" if bps >= 1e9 else f"{bps / 1e6:.2f} M"


class Bench:
    def __init__(self, lab: Lab, window: float, warmup: float):
        self.lab, self.window, self.warmup = lab, window, warmup
        self.node = lab.nodes[0]
        self.pod = self.node.pods[0]
        self.key = f"default/{self.pod.name}"
        self.other = self.node.pods[1]
        self.shaper = Shaper(self.node.netns)
        self.classifier = Classifier(netns=self.node.netns)
        self.options = DataPathOptions(leaf_qdisc=probe(self.node.netns).leaf_qdisc)
        self.state = None

    def program(self, rate: int, ceil: int | None = None, node_rate: int | None = None,
                other: tuple[int, int] | None = None) -> None:
        shapes = [PodShape(self.key, (self.pod.ip4, self.pod.ip6), rate, ceil or rate)]
        if other:
            shapes.append(PodShape(f"default/{self.other.name}", (self.other.ip4, self.other.ip6), *other))
        self.state = desired_state(NodeInputs((UPLINK,), INTERNAL_CIDRS, tuple(shapes), node_rate or 10 * rate, self.options))
        self.shaper.apply(self.state.shaper)
        self.classifier.apply(self.state.classifier)

    def sharing(self, proto: str, node_rate: int, a: tuple[int, int], b: tuple[int, int]) -> list[tuple[str, float, float]]:
        """Two pods flood one node class: (pod, HTB's expected share, measured)."""
        self.program(*a, node_rate=node_rate, other=b)
        pods = (self.pod, self.other)
        minors = [self.state.minors[f"default/{p.name}"] for p in pods]
        procs = [self.senders(p, port, proto, node_rate, self.warmup + self.window + 0.8)[0]
                 for p, port in zip(pods, (5201, 5203))]
        try:
            time.sleep(self.warmup)
            s1, t1 = self.shaper.stats(self.state.shaper.ifb), time.monotonic()
            time.sleep(self.window)
            s2, t2 = self.shaper.stats(self.state.shaper.ifb), time.monotonic()
            for p in procs:
                p.communicate(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        spare = node_rate - a[0] - b[0]
        # HTB: each gets its rate; the spare goes in proportion to quantum (rate/100 here)
        want = [r + spare * r / (a[0] + b[0]) for r in (a[0], b[0])]
        return [(f"rate {fmt(r)} ceil {fmt(c)}", w, self.ip_bits(s1[m], s2[m]) / (t2 - t1))
                for (r, c), w, m in zip((a, b), want, minors)]

    def ip_bits(self, before, after) -> int:
        return ip_bytes(after.bytes - before.bytes, after.packets - before.packets, self.options) * 8

    def remove(self) -> None:
        if self.state:
            s = self.state.shaper
            self.shaper.cleanup(s.ifb, s.devices, s.filter_pref)
        self.classifier.cleanup()
        self.state = None

    def class_stats(self):
        return self.shaper.stats(self.state.shaper.ifb)[self.state.minors[self.key]]

    def senders(self, pod, port: int, proto: str, rate: int, seconds: float):
        """One sender from `pod` to the internet host: TCP, or UDP offered at twice `rate`."""
        if proto == "tcp":
            return self.lab.iperf_async(pod.netns, INTERNET_V4, port, seconds=seconds), "iperf3"
        if rate <= IPERF_UDP_LIMIT:
            return self.lab.iperf_async(pod.netns, INTERNET_V4, port, seconds=seconds, udp_bitrate=str(2 * rate)), "iperf3"
        return self.lab.udp_flood(pod.netns, INTERNET_V4, 9, 2 * rate, seconds=seconds), "udp-gso"

    def run(self, proto: str, rate: int) -> dict:
        proc, tool = self.senders(self.pod, 5201, proto, rate, self.warmup + self.window + 0.8)
        s1, s2, seconds, sent = self.window_of([proc], self.class_stats)
        measured = self.ip_bits(s1, s2) / seconds
        return {"measured": measured, "error": (measured - rate) / rate, "drops": s2.drops - s1.drops, "sender": sent,
                "tool": tool}

    def window_of(self, procs, read):
        """`read()` after the warm-up and again after the window while `procs` send; then their
        JSON results. -> (first read, second read, seconds between them, what the senders sent)."""
        try:
            time.sleep(self.warmup)
            first, t1 = read(), time.monotonic()
            time.sleep(self.window)
            second, t2 = read(), time.monotonic()
            outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        sent = sum(o["end"]["sum_sent"]["bits_per_second"] if "end" in o else o["bits_per_second"] for o in outs)
        return first, second, t2 - t1, sent

    def unshaped(self) -> dict[str, float]:
        self.remove()
        tcp = self.lab.iperf(self.pod.netns, INTERNET_V4, 5201, seconds=2)["end"]["sum_sent"]["bits_per_second"]
        udp = self.lab.iperf(self.pod.netns, INTERNET_V4, 5201, seconds=2, udp_bitrate="5G")["end"]["sum"]["bits_per_second"]
        flood = self.lab.udp_flood(self.pod.netns, INTERNET_V4, 9, 10e9, seconds=2)
        gso = json.loads(flood.communicate(timeout=60)[0])["bits_per_second"]
        return {"tcp (iperf3)": tcp, "udp 1400 B (iperf3)": udp, "udp 1400 B (udp-gso)": gso}

    def cni_plugin(self, rate: int) -> tuple[float, float]:
        """The CNI bandwidth plugin's egress shaping, rebuilt with tc as it does it: the pod's
        host-side veth ingress redirected (u32 match-all, mirred) into an IFB with a TBF
        (latency 25 ms; the same 64 KB + 1 MTU burst as netagent's classes). Every
        destination goes through it. Returns (internet L2 rate, internal TCP goodput)."""
        self.remove()
        ns, veth, ifb = self.node.netns, self.pod.node_veth, "bwp0"
        cmds = [f"ip link add {ifb} type ifb", f"ip link set {ifb} up",
                f"tc qdisc add dev {veth} ingress",
                f"tc filter add dev {veth} parent ffff: protocol all u32 match u32 0 0 "
                f"action mirred egress redirect dev {ifb}",
                f"tc qdisc add dev {ifb} root tbf rate {rate}bit burst {sizing.burst_bytes(rate)} latency 25ms"]
        try:
            for cmd in cmds:
                run(cmd, ns)

            def sent() -> int:
                return json.loads(run(f"tc -s -j qdisc show dev {ifb}", ns))[0]["bytes"]

            procs = [self.lab.iperf_async(self.pod.netns, INTERNET_V4, 5201, seconds=self.warmup + self.window + 0.8)]
            time.sleep(self.warmup)
            b1, t1 = sent(), time.monotonic()
            time.sleep(self.window)
            b2, t2 = sent(), time.monotonic()
            procs[0].communicate(timeout=60)
            internal = self.lab.iperf(self.pod.netns, PEER_V4, 5202, seconds=2)["end"]["sum_sent"]["bits_per_second"]
        finally:
            run(f"ip link del {ifb}", ns, check=False)
            run(f"tc qdisc del dev {veth} ingress", ns, check=False)
        return (b2 - b1) * 8 / (t2 - t1), internal

    def internal(self, rate: int, pairs: int = 3) -> tuple[float, float]:
        """Pod -> peer TCP (median of `pairs`), without netagent and with the pod shaped at
        `rate`, alternated so both see the same machine load."""
        unshaped, shaped = [], []
        for _ in range(pairs):
            self.remove()
            unshaped.append(self.lab.iperf(self.pod.netns, PEER_V4, 5202, seconds=2)["end"]["sum_sent"]["bits_per_second"])
            self.program(rate)
            shaped.append(self.lab.iperf(self.pod.netns, PEER_V4, 5202, seconds=2)["end"]["sum_sent"]["bits_per_second"])
        return statistics.median(unshaped), statistics.median(shaped)


class DownloadBench:
    """Downloads (internet -> pod, issue 13): the same table for the pod's download class. The pod's
    iperf3 client runs in reverse mode (the internet host sends through the node's NAT); the UDP
    flood comes from the internet host (`Lab.download_flood`). Measured in IP bytes (HTB class
    bytes - 14 x packets), the unit of every configured rate."""

    def __init__(self, bench: Bench):
        self.b = bench

    def program(self, rate: int) -> None:
        b = self.b
        shapes = (PodShape(b.key, (b.pod.ip4, b.pod.ip6), PerDirection(100 * 10**9, rate),
                           PerDirection(100 * 10**9, rate)),)
        devices = b.shaper.devices_of_kind(("veth",), exclude=(UPLINK,))
        b.state = desired_state(NodeInputs((UPLINK,), INTERNAL_CIDRS, shapes, PerDirection(100 * 10**9, 10 * rate),
                                           b.options, pod_devices=devices))
        b.shaper.apply(b.state.shaper)
        b.shaper.apply(b.state.shapers.download)
        b.classifier.apply(b.state.classifier)

    def remove(self) -> None:
        # the redirect filters hang on the pod devices (and their clsact qdiscs), not on the uplink
        devices = self.b.state.shapers.download.devices if self.b.state is not None else ()
        self.b.remove()
        self.b.shaper.cleanup(self.b.options.ifbs.download, tuple(devices), self.b.options.filter_pref)

    def class_ip_bytes(self) -> tuple[int, int]:
        s = self.b.state.shapers.download
        st = self.b.shaper.stats(s.ifb, s.major)[self.b.state.minors[self.b.key]]
        return ip_bytes(st.bytes, st.packets, self.b.options), st.drops

    def run(self, proto: str, rate: int) -> dict:
        b = self.b
        seconds = b.warmup + b.window + 0.8
        if proto == "tcp":
            procs, tool = [b.lab.iperf_async(b.pod.netns, INTERNET_V4, 5201, seconds=seconds, extra=["-R"])], "iperf3"
        elif rate <= IPERF_UDP_LIMIT:  # (the GSO flood's 61 KB packets would sit in the pfifo, not overflow it)
            procs, tool = [b.lab.iperf_async(b.pod.netns, INTERNET_V4, 5201, seconds=seconds, udp_bitrate=str(2 * rate),
                                             extra=["-R"])], "iperf3"
        else:
            procs, tool = [b.lab.download_flood(b.pod.netns, b.lab.internet, INTERNET_V4, 5299, 2 * rate, seconds)], "udp-gso"
        (b1, d1), (b2, d2), seconds, sent = b.window_of(procs, self.class_ip_bytes)
        measured = (b2 - b1) * 8 / seconds
        return {"measured": measured, "error": (measured - rate) / rate, "drops": d2 - d1, "sender": sent, "tool": tool}

    def internal(self, rate: int, pairs: int = 3) -> tuple[float, float]:
        """The pod's download from the internal peer (TCP, iperf3 -R), without netagent and with the
        pod's internet downloads shaped at `rate`, alternated; medians."""
        b = self.b
        unshaped, shaped = [], []
        for i in range(pairs):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                self.program(rate) if on else self.remove()
                got = b.lab.iperf(b.pod.netns, PEER_V4, 5202, seconds=2, reverse=True)["end"]["sum_received"]["bits_per_second"]
                (shaped if on else unshaped).append(got)
        return statistics.median(unshaped), statistics.median(shaped)


def download_table(bench: Bench, rates: list[int], runs: int) -> list[str]:
    """Print the download table; -> the failures (error above TOLERANCE)."""
    dl = DownloadBench(bench)
    failed = []
    bench.remove()
    print(f"download accuracy (internet -> pod): measured = the pod's download class in IP bytes over a "
          f"{bench.window:g} s window after {bench.warmup:g} s; median of {runs} run(s)")
    print(f"{'configured':>12}{'proto':>6}{'sender':>9}{'offered':>14}{'measured':>14}{'error':>9}{'drops':>9}")
    try:
        for rate in rates:
            dl.program(rate)
            for proto in ("tcp", "udp"):
                got = [dl.run(proto, rate) for _ in range(runs)]
                mid = sorted(got, key=lambda r: r["measured"])[len(got) // 2]
                err = statistics.median(r["error"] for r in got)
                print(f"{fmt(rate):>12}{proto:>6}{mid['tool']:>9}{fmt(mid['sender']):>14}{fmt(mid['measured']):>14}"
                      f"{err * 100:+8.2f}%{mid['drops']:9d}")
                if abs(err) > TOLERANCE:
                    failed.append(f"download {proto} at {fmt(rate)}bit/s: {err:+.2%}")
        unshaped, shaped = dl.internal(rates[0])
        print(f"internal download (peer -> pod, TCP, median of 3 alternated pairs): {fmt(shaped)}bit/s with the pod's "
              f"internet downloads shaped at {fmt(rates[0])}bit/s, {fmt(unshaped)}bit/s without netagent: "
              f"{shaped / unshaped:.2f}x")
    finally:
        dl.remove()
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="10M,100M,1G")
    ap.add_argument("--runs", type=int, default=1, help="runs per rate and protocol; the median is shown")
    ap.add_argument("--window", type=float, default=2.4, help="measurement window, seconds")
    ap.add_argument("--warmup", type=float, default=0.8, help="seconds before the window opens")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/shaping.py needs root (it builds network namespaces)", file=sys.stderr)
        return 2
    rates = [parse_rate(r) for r in args.rates.split(",")]
    failed = []
    with Lab(nodes=1, pods_per_node=2, prefix=f"nash{os.getpid() % 10000}") as lab:
        for port in (5201, 5203):
            lab.iperf_server(lab.internet, port)
        lab.iperf_server(lab.peer, 5202)
        bench = Bench(lab, args.window, args.warmup)
        try:
            base = bench.unshaped()
            print("unshaped path on this machine, same run (pod -> internet host, no netagent):")
            for label, bps in base.items():
                print(f"  {label:24}{fmt(bps):>12}bit/s")
            print()
            print(f"shaping accuracy: measured = HTB class IP bytes over a {args.window:g} s window "
                  f"after {args.warmup:g} s; median of {args.runs} run(s)")
            print(f"{'configured':>12}{'proto':>6}{'sender':>9}{'offered':>14}{'measured':>14}{'error':>9}{'drops':>9}")
            for rate in rates:
                bench.program(rate)

                for proto in ("tcp", "udp"):
                    runs = [bench.run(proto, rate) for _ in range(args.runs)]
                    mid = sorted(runs, key=lambda r: r["measured"])[len(runs) // 2]
                    err = statistics.median(r["error"] for r in runs)
                    print(f"{fmt(rate):>12}{proto:>6}{mid['tool']:>9}{fmt(mid['sender']):>14}{fmt(mid['measured']):>14}"
                          f"{err * 100:+8.2f}%{mid['drops']:9d}")
                    if abs(err) > TOLERANCE:
                        failed.append(f"{proto} at {fmt(rate)}bit/s: {err:+.2%}")
            print()
            unshaped, shaped = bench.internal(rates[0])
            print(f"internal traffic (pod -> peer, same uplink, TCP, median of 3 alternated pairs): "
                  f"{fmt(shaped)}bit/s with the pod's internet egress shaped at {fmt(rates[0])}bit/s, "
                  f"{fmt(unshaped)}bit/s without netagent: {shaped / unshaped:.2f}x")
            cni_rate = rates[0]
            cni_internet, cni_internal = bench.cni_plugin(cni_rate)
            print(f"CNI bandwidth plugin's way (TBF on an IFB for all of the pod's egress) at {fmt(cni_rate)}bit/s, "
                  f"same run: internet {fmt(cni_internet)}bit/s ({(cni_internet - cni_rate) / cni_rate * 100:+.2f}%), "
                  f"internal {fmt(cni_internal)}bit/s = {cni_internal / unshaped:.4f}x the unshaped path "
                  f"(netagent: {shaped / unshaped:.2f}x)")
            print()
            for node_rate, a, b in SHARING:
                for proto in ("tcp", "udp"):
                    print(f"two pods sharing a {fmt(node_rate)}bit/s node class (both flooding, {proto}):")
                    print(f"{'pod':>32}{'quantum':>10}{'HTB share':>12}{'measured':>12}{'error':>9}{'of node':>9}")
                    for (label, want, got), (rate, _) in zip(bench.sharing(proto, node_rate, a, b), (a, b)):
                        wire = to_wire(rate, bench.options)
                        print(f"{label:>32}{sizing.quantum_bytes(wire):>9}B{fmt(want):>12}{fmt(got):>12}"
                              f"{(got - want) / want * 100:+8.2f}%{(got - want) / node_rate * 100:+8.2f}%")
                        if abs(got - want) > TOLERANCE * node_rate:
                            failed.append(f"{label} sharing {fmt(node_rate)}bit/s ({proto}): "
                                          f"{(got - want) / node_rate:+.2%} of the node rate")
            print()
            failed += download_table(bench, rates, args.runs)
        finally:
            bench.remove()
            bench.shaper.close()
    print()
    print("offered: the sender's own rate over its whole run (TCP: goodput, the payload that got through).")
    if failed:
        print("FAIL: " + "; ".join(failed))
        return 1
    print("all rates within ±5% of the rate and all shares within ±5% of the node rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
