"""What netagent's data path costs an internal packet the node forwards: ns per packet, both directions.

Run as root, alone on the machine's traffic lock:

    flock /tmp/netagent-traffic.lock python3 bench/forward_cost.py [--rounds 15] [--packets 100000] [--pods 110]

bench/classify_cost.py's per-packet table sends from the node itself through POSTROUTING only; a
packet the node forwards also crosses PREROUTING and the tc hooks of the device it arrives by. Here
each configuration gets a chain of three namespaces of its own:

    pod (P) --veth-- node (N) --uplink veth-- far side (F)

with static routes and neighbours and no address any packet is for: the senders use the pod's and
the internal peer's addresses through IP_TRANSPARENT, N forwards, and the next hop drops the packet
silently (forwarding off: no ICMP error). One process sends 64-byte UDP datagrams, and the whole path
runs in its own context on one CPU: each veth hands the packet to this CPU's backlog, processed when
the send leaves its bottom-half section (this kernel accounts softirq time to the task it runs in:
no IRQ_TIME_ACCOUNTING). Its scheduler run time per datagram is the path's cost; interference only
adds time, so the minimum over the rounds is the configuration's own cost, the median beside it.

  upload     P -> the internal peer: the pod device's ingress, N's hooks, the uplink's egress
  download   the internal peer -> P: the uplink's ingress, N's hooks, the pod device's egress
             (the ACKs of an upload take this path)

Configurations (`--rows`, ROWS), each the agent's own `KernelDataPath` on N (uploads and downloads
shaped, the measured pod among --pods pods' classes) or one piece of it:
  none        no netagent
  rules       --internal-counting rules: internal bytes counted in ipsets, the node's totals by rules
  device      --internal-counting device: the pods' internal bytes counted on their devices, the node's
              totals on the uplink (tc/ebpf/, on tcx links), the rules' internal path without a set or
              device test; device-tc: the same with the counter on tc filters (kernels before 6.6)
  device-open the same without the gate: every packet meets the shaper's redirect filters
  tc          the shaper alone; ipt-rules, ipt-device: the rules alone; ebpf, ebpf-tc: the device counter alone

Last, what each costs a one-core TCP transfer at --rate: the data skbs take the upload path and
its ACKs the download path, `--skb-rate` and `--ack-rate` a second (measured on this lab at
~16 Gbit/s: docs/datapath.md), so the core time per second is their sum of deltas, and the share of
unshaped 1 / (1 + that).
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import secrets
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.classify_cost import SENDER  # noqa: E402  (one datagram sender for both per-packet benches)
from core.direction import PerDirection  # noqa: E402
from lab.netns import bpf_filesystem, run  # noqa: E402
from iptables.apply import Classifier  # noqa: E402
from netagent.datapath import KernelDataPath  # noqa: E402
from netagent.desired import DataPathOptions, NodeInputs, PodShape, desired_state  # noqa: E402
from tc.ebpf import InternalCounter  # noqa: E402
from tc.netlink import Shaper  # noqa: E402
from tc.probe import probe  # noqa: E402

POD4, PEER4 = "10.244.0.10", "10.0.0.100"
UPLINK, POD_DEV = "eth0", "vp0"
INTERNAL = ("10.0.0.0/8", "fd00::/8")
MACS = {"pod": "02:00:00:00:01:02", "vp0": "02:00:00:00:01:01", "up": "02:00:00:00:02:01", "far": "02:00:00:00:02:02"}
G = 1_000_000_000
CASES = {"upload": ("pod", POD4, PEER4), "download": ("far", PEER4, POD4)}


def sh(cmd: str, netns: str) -> str:
    return run(cmd, netns, shell=True)


class Chain:
    """pod -- node -- far side, three scratch namespaces; removed with everything in them."""

    def __init__(self, label: str):
        tag = secrets.token_hex(3)
        self.ns = {side: f"na-fwd-{side}-{label}-{tag}"[:40] for side in ("pod", "node", "far")}
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            p, n, f = self.ns["pod"], self.ns["node"], self.ns["far"]
            sh(f"ip link add {POD_DEV} address {MACS['vp0']} type veth peer name eth0 address {MACS['pod']} netns {p}", n)
            sh(f"ip link add {UPLINK} address {MACS['up']} type veth peer name eth0 address {MACS['far']} netns {f}", n)
            for ns in (p, f):
                sh("ip link set lo up && ip link set eth0 up", ns)
            sh(f"ip route add default dev eth0 && ip neigh add {PEER4} lladdr {MACS['vp0']} dev eth0 nud permanent", p)
            sh(f"ip route add 10.244.0.0/16 dev eth0 && "
                f"ip neigh add {POD4} lladdr {MACS['up']} dev eth0 nud permanent", f)
            sh(f"sysctl -qw net.ipv4.ip_forward=1 && ip link set lo up && ip link set {POD_DEV} up && "
                f"ip link set {UPLINK} up && ip addr add 10.0.0.1/24 dev {UPLINK} && "
                f"ip route add {POD4}/32 dev {POD_DEV} && "
                f"ip neigh add {POD4} lladdr {MACS['pod']} dev {POD_DEV} nud permanent && "
                f"ip neigh add {PEER4} lladdr {MACS['far']} dev {UPLINK} nud permanent", n)
        except Exception:
            self.close()
            raise

    def send(self, case: str, packets: int) -> float:
        side, src, dst = CASES[case]
        return float(run([sys.executable, "-c", SENDER, src, dst, str(packets)], self.ns[side], timeout=600))

    def close(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def pods(n: int) -> tuple[PodShape, ...]:
    """The measured pod and n-1 others on the addresses around it (their classes are in the rules and
    the counter's map; their devices do not exist)."""
    base = ipaddress.ip_address(POD4)
    offsets = [(i + 1) // 2 * (1 if i % 2 else -1) for i in range(1, n)]
    return (PodShape("bench/real", (POD4,), G, G),
            *(PodShape(f"bench/fake-{i}", (str(base + d),), G, G) for i, d in enumerate(offsets, 1)))


ROWS = {  # the configurations: the whole data path by counting mode, and its pieces alone
    "none": "no netagent",
    "rules": "the data path, --internal-counting rules",
    "device": "the data path, --internal-counting device (the counter on tcx links)",
    "device-open": "the same without the gate (every packet meets the shaper's redirect filters)",
    "device-tc": "the same with the counter on tc filters (kernels before 6.6)",
    "tc": "its shaper alone (both IFBs and trees, the redirect filters on the uplink and the pod device)",
    "ipt-rules": "its rules alone, counting by the rules",
    "ipt-device": "its rules alone, counting on the devices",
    "ebpf": "the device counter alone (programs on the pod device and the uplink, tcx links)",
    "ebpf-tc": "the same on tc filters",
    "ebpf-scoped": "the device counter alone with destination scopes described (the peer's /24 cross-zone, "
                   "among 256 CIDRs in the trie: issue 39)",
}
# the scoped row's description: the peer's /24 in another zone, 255 more /24s of zones and regions around it
SCOPED = {ipaddress.ip_network(f"10.{i // 256}.{i % 256}.0/24"): 1 + i % 2 for i in range(256)}


def install(chain: Chain, row: str, n: int, bpf_root: str | None, stack: contextlib.ExitStack) -> None:
    """Row `row` on the chain's node: the agent's data path as its sync programs it (uploads and downloads
    shaped), or one piece of it."""
    if row == "none":
        return
    netns = chain.ns["node"]
    by_device = row in ("device", "device-open", "device-tc", "ipt-device", "ebpf", "ebpf-tc", "ebpf-scoped")
    options = DataPathOptions(leaf_qdisc=probe(netns).leaf_qdisc, internal_by_device=by_device,
                              bpf_dir=os.path.join(bpf_root or "/nonexistent", netns),
                              count_attach="tc" if row.endswith("-tc") else "auto", count_gate=row != "device-open")
    desired = desired_state(NodeInputs((UPLINK,), INTERNAL, pods(n), PerDirection.same(10 * G), options,
                                       pod_devices=(POD_DEV,)))
    if row in ("rules", "device", "device-open", "device-tc"):
        dp = KernelDataPath(options, iptables_backend="nft", netns=netns)
        stack.callback(dp.close)
        dp.apply(desired)
    elif row == "tc":
        shaper = stack.enter_context(Shaper(netns))
        shaper.apply(desired.shaper)
        shaper.apply(desired.shapers.download)
    elif row.startswith("ipt-"):
        Classifier(backend="nft", netns=netns).apply(desired.classifier)
    else:
        counter = stack.enter_context(InternalCounter(options.bpf_dir, netns=netns, attach_by=options.count_attach))
        counting = desired.device_counting
        counter.set_networks(dict(counting.networks))
        counter.set_pods(counting.addresses)
        if row == "ebpf-scoped":
            counter.set_scopes(SCOPED)
        counter.attach(counting.devices, counting.uplinks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--packets", type=int, default=100_000)
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--rows", default="none,rules,device")
    ap.add_argument("--skb-rate", type=float, default=37_500, help="data skbs a second of the one-core transfer")
    ap.add_argument("--ack-rate", type=float, default=31_000, help="ACKs a second of it")
    args = ap.parse_args()
    rows = args.rows.split(",")
    if rows[0] != "none" or not set(rows) <= set(ROWS):
        raise SystemExit(f"--rows: none first, then any of {', '.join(ROWS)}")
    with contextlib.ExitStack() as stack:
        bpf_root = stack.enter_context(bpf_filesystem()) if any("device" in r or "ebpf" in r for r in rows) else None
        chains = {}
        for row in rows:  # the pinned maps go with the bpffs, everything else with the namespaces
            chains[row] = Chain(row)
            stack.callback(chains[row].close)
            install(chains[row], row, args.pods, bpf_root, stack)
        got: dict[str, dict[str, list[float]]] = {case: {row: [] for row in rows} for case in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                for row in rows:
                    got[case][row].append(chains[row].send(case, args.packets))
        print(f"per-packet cost of an internal packet the node forwards: run time of one sender per 64-byte UDP "
              f"datagram through pod - node - peer, ns ({args.rounds} round-robin rounds of {args.packets} "
              f"datagrams, {args.pods} pods' classes, uploads and downloads shaped; "
              + "; ".join(f"{row}: {ROWS[row]}" for row in rows) + ")")
        for pick, name in ((min, "minimum (the configuration's own cost)"), (statistics.median, "median")):
            print(f"  {name}")
            print(f"  {'configuration':<14}" + "".join(f"{c:>10}{'delta':>8}" for c in CASES))
            base = {case: pick(got[case]["none"]) for case in CASES}
            for row in rows:
                cells = "".join(f"{pick(got[case][row]):>10.0f}{pick(got[case][row]) - base[case]:>+8.0f}"
                                for case in CASES)
                print(f"  {row:<14}{cells}")
        print(f"a one-core transfer at {args.skb_rate:,.0f} data skbs and {args.ack_rate:,.0f} ACKs a second "
              "(minimum deltas): core time a second, and the share of unshaped it leaves")
        for row in rows[1:]:
            up = min(got["upload"][row]) - min(got["upload"]["none"])
            down = min(got["download"][row]) - min(got["download"]["none"])
            core = (up * args.skb_rate + down * args.ack_rate) / 1e9
            print(f"  {row:<14}{core * 1e3:6.1f} ms   share {1 / (1 + core):.3f}")


if __name__ == "__main__":
    main()
