"""What classifying a packet costs internal traffic: per packet, CPU seconds per GB, share of unshaped.

Run as root, alone on the machine's traffic lock:

    flock /tmp/netagent-traffic.lock python3 bench/classify_cost.py [--rounds 15] [--seconds 2]

Configurations (each with the rules of 10 and of 110 pods: the measured pod in the middle of
them, fake pods on the addresses around it; on the nft and the legacy backend):

  none     no netagent rules at all; none2: the same again, the noise floor of the method
  today    the ruleset before issue 12 (`iptables/render.py` at commit TODAY, loaded from git):
           a 16-way dispatch tree on the source, a pod chain with the internal-set test
  new      the ruleset this checkout's `Classifier` programs, counting internal bytes by the rules (ipsets: one
           or two lookups; `--internal-counting rules`)
  device   the same with internal bytes counted on the devices (`--internal-counting device`): the rules
           of `internal_by_device` and the eBPF counter of tc/ebpf/ on the pod's device, which the `ingress`
           case crosses, and on the uplink (the node's totals), which the `egress` case crosses
  lean     a reference, not a product path: `new` with one rule on top that returns a packet whose both ends
           are internal before anything else, counted nowhere (`--candidates`: none, the bare hook, new,
           device, lean)
  nftmap   a candidate in native nftables (IPv4 only, not a product path): interval sets and sets
           with per-element counters, the pod's class from a classid map; the same layout as `new`

Every configuration is programmed once, in a namespace (a lab node) of its own, and the runs
go round-robin over them for `--rounds` rounds: no reprogramming between runs, so a burst of
load from the rest of the machine falls on neighbouring runs of different configurations.

1. Per-packet cost. One process sends 64-byte UDP datagrams from a local address through the
   namespace's POSTROUTING to a device whose peer is down (dropped after the hook): all the work
   is in its own context; its scheduler run time per datagram (/proc/self/schedstat).
     egress   a pod's address -> the internal peer, out of the uplink     (pod egress internal)
     ingress  an internal peer's address -> a pod, out of the pod's device (pod ingress internal)
   Interference can only add time, so the minimum over the rounds is the configuration's own
   cost; the median is printed beside it.
2. CPU seconds per GB. The lab pod of each node sends TCP to the internal peer at a fixed offered
   rate that leaves the CPU idle part of the time: `tcp` as the lab sends it (GSO, ~64 KB per
   packet through the node) and `tcp-mss` with GSO off on the pod's device (gso_max_segs 1: one
   segment per packet, the classifier's worst case per byte, as on a NIC without GRO). The cost
   is the run time of both iperf3 processes (a cpuacct cgroup: scheduler time, which includes
   the softirq work forwarding does in their context) plus the ksoftirqd threads' (where the
   kernel defers that work under load; they also run the rest of the machine's deferred packets,
   so this column is noisier), per GB received. Medians over the rounds; `delta` is the
   difference to `none`. At GSO sizes the classifier's share is a few per cent of the path's
   cost, inside this method's noise; the per-packet table is the precise figure.
3. Share of unshaped. Unlimited TCP from the pod to the peer for `--seconds`, with the whole
   data path as the agent programs it (desired state -> tc Shaper -> classifier; the pod shaped to
   10 Mbit/s on the internet side) on one node, and no netagent on another; medians of the
   alternated runs, and the median of each round's ratio to `none` in the same round. The rows
   (`--rows`, default all) are the table SHARES: the whole path counting by the rules (`new`) and
   on the devices (`device`), its pieces, and `lean` (above).
"""
from __future__ import annotations


import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import secrets
import statistics
import subprocess
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from iptables import render as R  # noqa: E402
from iptables.apply import Classifier  # noqa: E402
from iptables.model import ClassifierState, PodClassification  # noqa: E402
from lab.netns import bpf_filesystem, run  # noqa: E402
from lab.topology import INTERNAL_CIDRS, PEER_V4, UPLINK, Lab  # noqa: E402
from netagent.desired import DataPathOptions, NodeInputs, PodShape, desired_state  # noqa: E402
from tc.ebpf import InternalCounter  # noqa: E402
from tc.netlink import Shaper  # noqa: E402

TODAY = "4d6b65a"  # dp-classify's base: the dispatch-tree ruleset
PORT = 5201
CGROUP_ROOT = "/sys/fs/cgroup/cpuacct"
M = 1_000_000


def load_today():
    """iptables/render.py as it was at TODAY, as a module (it only imports stable helpers)."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{TODAY}:iptables/render.py"], capture_output=True,
                         text=True, check=True).stdout
    mod = types.ModuleType("render_today")
    sys.modules["render_today"] = mod  # dataclasses look their module up
    exec(compile(src, f"{TODAY}:iptables/render.py", "exec"), mod.__dict__)
    return mod


def state_for(pod, n: int) -> ClassifierState:
    """The lab pod plus n-1 fake pods on the addresses around it, alternately above and below
    (+1, -1, +2, ...): the pod sits in the middle of the sorted addresses, where today's dispatch
    tree puts an average pod (the first pod of the tree is its cheapest, the last its dearest)."""
    a4, a6 = ipaddress.ip_address(pod.ip4), ipaddress.ip_address(pod.ip6)
    offsets = [(i + 1) // 2 * (1 if i % 2 else -1) for i in range(1, n)]
    fake = tuple(PodClassification(f"bench/fake-{i}", (str(a4 + d), str(a6 + d)), (1, 0x100 + i))
                 for i, d in enumerate(offsets, 1))
    real = PodClassification("bench/real", (pod.ip4, pod.ip6), (1, 0x10))
    return ClassifierState(0x1000, INTERNAL_CIDRS, (real, *fake), (UPLINK,), (1, 0xFFFE))


class TodayRules:
    """Programs and removes the pre-issue-12 ruleset with plain iptables-restore and ipset."""

    PREFIX = "NAOLD"

    def __init__(self, render, netns: str, backend: str):
        self.R, self.netns, self.backend = render, netns, backend

    def _restore(self, family: int, text: str) -> None:
        tool = f"{'iptables' if family == 4 else 'ip6tables'}-{self.backend}-restore"
        subprocess.run(["ip", "netns", "exec", self.netns, tool, "--noflush", "-w", "5"], input=text, text=True,
                       check=True, capture_output=True)

    def apply(self, st: ClassifierState) -> None:
        members = self.R.set_members(st.internal_cidrs)
        lines = []
        for fam, fam_name in ((4, "inet"), (6, "inet6")):
            name = self.R.ipset_name(self.PREFIX, fam)
            lines += [f"create {name} hash:net family {fam_name}", *(f"add {name} {m}" for m in members[fam])]
        subprocess.run(["ip", "netns", "exec", self.netns, "ipset", "-exist", "restore"], input="\n".join(lines) + "\n",
                       text=True, check=True, capture_output=True)
        for fam in (4, 6):
            self._restore(fam, self.R.render(st, fam, self.PREFIX))
        self.state = st

    def remove(self) -> None:
        for fam in (4, 6):
            rs = self.R.build(self.state, fam, self.PREFIX)
            self._restore(fam, "\n".join(["*mangle", *(f"-D {h} {r}" for h, r in rs.jumps),
                                           *(f":{c} - [0:0]" for c in rs.chains), *(f"-X {c}" for c in rs.chains),
                                           "COMMIT"]) + "\n")
            run(["ipset", "destroy", self.R.ipset_name(self.PREFIX, fam)], self.netns)


class NftMaps:
    """The candidate in native nftables (IPv4), same layout as the ipset ruleset."""

    TABLE = "nabench"

    def __init__(self, netns: str):
        self.netns = netns

    def apply(self, st: ClassifierState) -> None:
        internal = [ipaddress.ip_network(c) for c in R.set_members(st.internal_cidrs)[4]]
        pods = sorted((ipaddress.ip_address(ip), p) for p in st.pods for ip in p.ips if ":" not in ip)
        peer = []  # the internal ranges with the pods' addresses cut out (interval sets cannot say "nomatch")
        for net in internal:
            start = int(net.network_address)
            for addr, _ in pods:
                if addr in net:
                    if int(addr) > start:
                        peer.append(f"{ipaddress.ip_address(start)}-{ipaddress.ip_address(int(addr) - 1)}")
                    start = int(addr) + 1
            if start <= int(net.broadcast_address):
                peer.append(f"{ipaddress.ip_address(start)}-{net.broadcast_address}")
        ips = ", ".join(str(a) for a, _ in pods)
        counted = ", ".join(f"{a} counter" for a, _ in pods)
        prio = ", ".join(f"{a} counter : {p.tc_class[0]:x}:{p.tc_class[1]:x}" for a, p in pods)
        text = f"""table ip {self.TABLE} {{
  set internal {{ type ipv4_addr; flags interval; elements = {{ {", ".join(str(n) for n in internal)} }} }}
  set peer {{ type ipv4_addr; flags interval; elements = {{ {", ".join(peer)} }} }}
  set pods {{ type ipv4_addr; elements = {{ {ips} }} }}
  set eint {{ type ipv4_addr; counter; elements = {{ {counted} }} }}
  set iint {{ type ipv4_addr; counter; elements = {{ {counted} }} }}
  set iinet {{ type ipv4_addr; counter; elements = {{ {counted} }} }}
  map enet {{ type ipv4_addr : classid; counter; elements = {{ {prio} }} }}
  chain pre {{ type filter hook prerouting priority mangle; policy accept;
    iifname "{UPLINK}" ip saddr @internal counter return
    iifname "{UPLINK}" counter
  }}
  chain post {{ type filter hook postrouting priority mangle; policy accept;
    oifname "{UPLINK}" goto nodeout
    ip saddr @peer goto frompeer
    ip saddr @pods goto frompod
    ip daddr @iinet return
  }}
  chain nodeout {{
    ip daddr @internal counter goto egint
    meta priority set ip saddr map @enet meta mark set meta mark | 0x1000
    meta mark & 0x1000 != 0x1000 fib saddr type != local counter meta mark set meta mark | 0x1000 meta priority set 1:fffe
    counter
  }}
  chain egint {{
    ip saddr @eint return
  }}
  chain frompeer {{
    ip daddr @iint return
  }}
  chain frompod {{
    ip daddr @internal ip saddr @eint goto topod
    ip saddr @enet goto topod
  }}
  chain topod {{
    ip saddr @internal ip daddr @iint return
    ip daddr @iinet return
  }}
}}
"""
        subprocess.run(["ip", "netns", "exec", self.netns, "nft", "-f", "-"], input=text, text=True, check=True,
                       capture_output=True)

    def remove(self) -> None:
        run(["nft", "delete", "table", "ip", self.TABLE], self.netns)


class Cpu:
    """Run time (ns) of the processes in one cpuacct cgroup plus the ksoftirqd threads."""

    def __init__(self):
        self.path = f"{CGROUP_ROOT}/netagent-bench-{secrets.token_hex(3)}"
        os.mkdir(self.path)
        self.softirqd = [int(p) for p in subprocess.run(["pgrep", "-x", "ksoftirqd/[0-9]+"], capture_output=True,
                                                        text=True).stdout.split()]

    def add(self, pid: int) -> None:
        with open(f"{self.path}/cgroup.procs", "w") as f:
            f.write(str(pid))

    def read(self) -> tuple[int, int]:
        """(run time of the group's processes, of the ksoftirqd threads), ns."""
        with open(f"{self.path}/cpuacct.usage") as f:
            own = int(f.read())
        softirqd = 0
        for pid in self.softirqd:
            try:
                with open(f"/proc/{pid}/schedstat") as f:
                    softirqd += int(f.read().split()[0])
            except FileNotFoundError:
                pass
        return own, softirqd

    def close(self) -> None:
        with open(f"{self.path}/cgroup.procs") as f:
            pids = f.read().split()
        for pid in pids:  # back to the root group, so the directory can go
            with open(f"{CGROUP_ROOT}/cgroup.procs", "w") as root:
                root.write(pid)
        os.rmdir(self.path)


SENDER = """
import socket, sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_IP, 19, 1)  # IP_TRANSPARENT: also a source address the namespace does not hold (forward_cost)
s.bind((src, 0))
s.connect((dst, 9))
payload = b"x" * 64
def runtime():
    with open("/proc/self/schedstat") as f:
        return int(f.read().split()[0])
for _ in range(2000):
    s.send(payload)
t0 = runtime()
for _ in range(n):
    s.send(payload)
print((runtime() - t0) / n)
"""
POD4, OTHER4, PEER4, NODE4 = "10.244.0.10", "10.244.0.11", "10.0.0.100", "10.0.0.200"


def make_netns(tag: str) -> str:
    """A scratch namespace for the per-packet cost: local pod and peer addresses, an uplink and a
    pod device whose peers are down (packets are dropped after POSTROUTING)."""
    ns = f"na-bench-{tag}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for cmd in ("ip link set lo up",
                    f"ip link add {UPLINK} type veth peer name {UPLINK}-peer", f"ip link set {UPLINK} up",
                    "ip link add vp0 type veth peer name vp0-peer", "ip link set vp0 up",
                    f"ip addr add {POD4}/32 dev lo", f"ip addr add {NODE4}/32 dev lo",
                    f"ip route add {PEER4}/32 dev {UPLINK}", f"ip route add {OTHER4}/32 dev vp0",
                    f"ip neigh add {PEER4} lladdr 02:00:00:00:00:01 dev {UPLINK} nud permanent",
                    f"ip neigh add {OTHER4} lladdr 02:00:00:00:00:02 dev vp0 nud permanent"):
            run(cmd, ns)
    except Exception:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        raise
    return ns


CASES = {"egress": (POD4, PEER4), "ingress": (NODE4, OTHER4)}


class FakePod:  # the per-packet namespace's pod: .10 is the measured pod, .11 a neighbour in the state
    ip4, ip6 = POD4, "fd00:244::10"
    node_veth = "vp0"  # the pod device the `ingress` case leaves by: where the device counter runs


def program(label: str, netns: str, pod, today) -> None:
    """Install configuration `label` (none | none2 | today-<backend>-<n> | new-<backend>-<n> | lean-<backend>-<n> |
    nftmap-<n> | component-<backend>-<piece>)."""
    if label in ("none", "none2"):
        return
    if label.startswith("component-"):
        program_component(label, netns)
        return
    kind, *backend, n = label.split("-")
    st = state_for(pod, int(n))
    if kind == "nftmap":
        NftMaps(netns).apply(st)
    elif kind == "today":
        TodayRules(today, netns, backend[0]).apply(st)
    elif kind == "device":
        Classifier(backend=backend[0], netns=netns).apply(dataclasses.replace(st, internal_by_device=True))
        device_counting(netns, pod.node_veth, st)
    else:
        Classifier(backend=backend[0], netns=netns).apply(st)
        if kind == "lean":
            lean_internal(netns, backend[0])


def lean_internal(netns: str, backend: str) -> None:
    """The `lean` candidate (not a product path): this checkout's rules with one plain rule per family on top of
    NETAGENT-POSTROUTING that returns a packet whose both ends are internal before any set lookup. What the classifier
    would cost internal traffic if a pod's internal bytes were counted elsewhere (for example by a counting filter on
    the pod's own device, which needs no lookup: the device is the pod)."""
    for tool, cidr in ((f"iptables-{backend}", INTERNAL_CIDRS[0]), (f"ip6tables-{backend}", INTERNAL_CIDRS[1])):
        run([tool, "-w", "5", "-t", "mangle", "-I", "NETAGENT-POSTROUTING", "1", "-s", cidr, "-d", cidr, "-j", "RETURN"],
            netns)


BPFFS = contextlib.ExitStack()  # the device rows' bpf filesystem (a mount of the bench's own), once one is needed
BPF_ROOT: list[str] = []  # its mount point, once mounted
COUNTERS: list[InternalCounter] = []  # the device rows' counters: read after the runs, removed at the end


def close_counters() -> None:
    """Remove the device rows' counters (their pinned maps; the programs go with their namespaces' devices) and
    unmount the bpffs the bench mounted: it leaves nothing behind."""
    while COUNTERS:
        counter = COUNTERS.pop()
        counter.unpin()
        counter.close()
    BPFFS.close()
    BPF_ROOT.clear()


def device_counting(netns: str, device: str, st: ClassifierState) -> None:
    """The device counter as the agent programs it (tc/ebpf/): every pod's addresses in its map, its programs
    on both hooks of the measured pod's host-side device and of the uplinks (the node's totals)."""
    if not BPF_ROOT:
        BPF_ROOT.append(BPFFS.enter_context(bpf_filesystem()))
    counter = InternalCounter(f"{BPF_ROOT[0]}/{netns}", netns=netns)
    COUNTERS.append(counter)
    counter.set_networks(R.set_members(INTERNAL_CIDRS))
    counter.set_pods(ip for p in st.pods for ip in p.ips)
    counter.attach((device,), st.uplinks)


COMPONENT_SETS = """create c-net hash:net family inet
add c-net 10.0.0.0/8
add c-net 169.254.0.0/16
add c-net 224.0.0.0/4
add c-net 255.255.255.255/32
create c-ip hash:ip family inet counters comment
add c-ip 10.244.0.10 comment "bench/real"
"""
COMPONENTS = {  # what one piece of the ruleset costs: rules in a chain hooked into mangle POSTROUTING
    "hook": [],
    "hook+hash:net": ["-m set --match-set c-net dst -j RETURN"],
    "hook+hash:ip-counters": ["-m set --match-set c-ip src -j RETURN"],
    "hook+both": ["-m set --match-set c-net dst -g C-2", "@C-2 -m set --match-set c-ip src -j RETURN"],
    "hook+22-rules": [f"-s 10.9.0.{i}/32 -j RETURN" for i in range(22)],
    # what the device-counting rules' internal paths are made of: a both-ends rule, an uplink test and a goto,
    # and the comment a node counting rule carries
    "hook+1-rule": ["-s 10.0.0.0/8 -d 10.0.0.0/8 -j RETURN"],
    "hook+goto-rule": [f"-o {UPLINK} -g C-2", "@C-2 -d 10.0.0.0/8 -j RETURN"],
    "hook+goto-comment": [f"-o {UPLINK} -g C-2", '@C-2 -d 10.0.0.0/8 -m comment --comment "c" -j RETURN'],
    "hook2": [],  # an empty chain hooked into PREROUTING too, as the ruleset is (the share runs only)
}


def program_component(label: str, netns: str) -> None:
    """component-<backend>-<piece>: the piece alone, hooked as our ruleset is."""
    _, backend, piece = label.split("-", 2)
    subprocess.run(["ip", "netns", "exec", netns, "ipset", "restore"], input=COMPONENT_SETS, text=True, check=True)
    chains: dict[str, list[str]] = {"C-1": [], "C-2": []}
    for rule in COMPONENTS[piece]:
        chain, rule = (rule[1:].split(" ", 1) if rule.startswith("@") else ("C-1", rule))
        chains[chain].append(rule)
    text = "*mangle\n" + "".join(f":{c} - [0:0]\n" for c in chains)
    text += "".join(f"-A {c} {r}\n" for c, rules in chains.items() for r in rules)
    text += "-I POSTROUTING 1 -j C-1\n" + ("-I PREROUTING 1 -j C-2\n" if piece == "hook2" else "") + "COMMIT\n"
    subprocess.run(["ip", "netns", "exec", netns, f"iptables-{backend}-restore", "--noflush"], input=text, text=True,
                   check=True)


def labels_for(args) -> list[str]:
    pods = [int(p) for p in args.pods.split(",")]
    backends = args.backends.split(",")
    if args.components:
        pieces = [piece for piece in COMPONENTS if piece != "hook2"]
        return ["none"] + [f"component-{b}-{piece}" for b in backends for piece in pieces] + ["none2"]
    if args.candidates:
        return ["none"] + [label for b in backends for label in (f"component-{b}-hook", f"new-{b}-{max(pods)}",
                                                                    f"device-{b}-{max(pods)}",
                                                                    f"lean-{b}-{max(pods)}")] + ["none2"]
    labels = ["none"] + [f"{k}-{b}-{n}" for n in pods for b in backends for k in ("today", "new")]
    return labels + [f"nftmap-{n}" for n in pods if args.nft] + ["none2"]


def table(title: str, labels: list[str], columns: dict[str, dict[str, list[float]]], fmt: str, stat) -> None:
    print(title)
    w = max(22, *(len(label) + 2 for label in labels))
    print(f"{'configuration':{w}}" + "".join(f"{c:>10}{'delta':>9}" for c in columns))
    base = {c: stat(v["none"]) for c, v in columns.items()}
    for label in labels:
        print(f"{label:{w}}" + "".join(f"{stat(v[label]):>10{fmt}}{stat(v[label]) - base[c]:>+9{fmt}}"
                                      for c, v in columns.items()), flush=True)


def packet_costs(args, today) -> None:
    labels = labels_for(args)
    spaces: dict[str, str] = {}
    try:
        for label in labels:
            spaces[label] = make_netns("pkt")
            program(label, spaces[label], FakePod, today)
        cost: dict[str, dict[str, list[float]]] = {case: {label: [] for label in labels} for case in CASES}
        for _ in range(args.rounds):
            for label in labels:
                for case, (src, dst) in CASES.items():
                    ns = float(run([sys.executable, "-c", SENDER, src, dst, str(args.packets)], spaces[label], timeout=120))
                    cost[case][label].append(ns)
        what = (f"per-packet cost: run time of one sender per 64-byte UDP datagram through POSTROUTING, ns "
                f"({args.rounds} round-robin rounds of {args.packets} datagrams)")
        table(what + "; minimum (the configuration's own cost)", labels, cost, ".0f", min)
        table("  the same, median", labels, cost, ".0f", statistics.median)
        for counter in COUNTERS:  # its program ran on every ingress-case datagram, or its row means nothing
            print(f"  device: the counter counted {sum(c[3] for c in counter.read().values())} datagrams received")
    finally:
        for ns in spaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        close_counters()


def measure(pod, cpu: Cpu, seconds: float, extra: list[str]) -> tuple[float, float, float]:
    """(CPU seconds per GB received, ksoftirqd's seconds per GB, received bit/s) of one iperf3 run pod -> peer."""
    argv = ["ip", "netns", "exec", pod.netns, "iperf3", "-c", PEER_V4, "-p", str(PORT), "-t", str(seconds), "-J", *extra]
    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cpu.add(client.pid)  # before iperf3 has done anything: `ip netns exec` execs it in place
    t0 = cpu.read()
    out, err = client.communicate(timeout=seconds + 30)
    t1 = cpu.read()
    if client.returncode:
        raise RuntimeError(f"iperf3 failed: {err or out}")
    received = json.loads(out)["end"]["sum_received"]
    gb = received["bytes"] / 1e9
    return (t1[0] - t0[0] + t1[1] - t0[1]) / 1e9 / gb, (t1[1] - t0[1]) / 1e9 / gb, received["bits_per_second"]


# The share runs' configurations: name -> (the tc shaper on the uplink?, the ruleset `program` installs, what the
# row is)
SHARES = {
    "none": (False, "none", "no netagent"),
    "today": (True, "today-{backend}-{n}", "the whole data path before issue 12"),
    "new": (True, "new-{backend}-{n}", "the whole data path"),
    "rules": (False, "new-{backend}-{n}", "the new rules without tc"),
    "tc": (True, "none", "the shaper without rules"),
    "hook": (False, "component-{backend}-hook",
             "an empty chain hooked into mangle POSTROUTING, the entry fee of any iptables classifier"),
    "hook2": (False, "component-{backend}-hook2", "one in PREROUTING too, as the ruleset hooks both"),
    "device": (True, "device-{backend}-{n}", "the whole data path counting internal bytes on the pod's device"),
    "lean": (True, "lean-{backend}-{n}", "new, internal packets returned before anything, counted nowhere"),
}


def traffic(args, today) -> None:
    labels = [] if args.share_only else labels_for(args)
    rows = args.rows.split(",") if args.rows else list(SHARES)
    unknown = sorted(set(rows) - set(SHARES))
    if unknown or "none" not in rows:
        raise SystemExit(f"--rows {args.rows}: {', '.join(unknown) or 'none'} is not a share row or missing "
                         f"(the rows: {', '.join(SHARES)}; none is the baseline)")
    full = [f"share-{name}" for name in rows]
    backend, n = args.backends.split(",")[0], max(int(p) for p in args.pods.split(","))
    cpu = Cpu()
    shapers = []
    try:
        with Lab(nodes=len(labels) + len(full), pods_per_node=1) as lab:
            server = lab.iperf_server(lab.peer, PORT)
            cpu.add(server.pid)
            nodes = dict(zip(labels + full, lab.nodes))
            for label in labels:
                program(label, nodes[label].netns, nodes[label].pods[0], today)
            for name in rows:
                shaped, ruleset, _ = SHARES[name]
                node, pod = nodes[f"share-{name}"], nodes[f"share-{name}"].pods[0]
                if shaped:
                    shaper = Shaper(node.netns)
                    shapers.append(shaper)
                    shaper.apply(desired_state(NodeInputs((UPLINK,), INTERNAL_CIDRS, (PodShape("bench/real", (pod.ip4, pod.ip6),
                                                                                         10 * M, 10 * M),), 10_000 * M,
                                                 DataPathOptions())).shaper)
                program(ruleset.format(backend=backend, n=n), node.netns, pod, today)
            loads = {} if args.share_only else {"tcp": ("65535", ["-b", args.tcp_rate]), "tcp-mss": ("1", ["-b", args.mss_rate])}
            cost: dict[str, dict[str, list[float]]] = {load: {label: [] for label in labels} for load in loads}
            got: dict[str, list[float]] = {load: [] for load in loads}
            deferred: dict[str, list[float]] = {load: [] for load in loads}
            for load, (segs, extra) in loads.items():
                for label in labels:
                    run(["ip", "link", "set", "eth0", "gso_max_segs", segs], nodes[label].pods[0].netns)
                for _ in range(args.traffic_rounds):
                    for label in labels:
                        per_gb, softirqd, bps = measure(nodes[label].pods[0], cpu, args.seconds, extra)
                        cost[load][label].append(per_gb)
                        got[load].append(bps)
                        deferred[load].append(softirqd)
            if loads:
                table(f"CPU seconds per GB of internal TCP pod -> peer (the two iperf3 processes + ksoftirqd), median of "
                  f"{args.traffic_rounds} round-robin {args.seconds:g} s runs; offered tcp {args.tcp_rate}bit/s (GSO), "
                  f"tcp-mss {args.mss_rate}bit/s (one segment per packet); received (median): "
                  + ", ".join(f"{k} {statistics.median(v) / 1e9:.2f} Gbit/s" for k, v in got.items()),
                      labels, cost, ".3f", statistics.median)
                print("  of which ksoftirqd (it also runs the rest of the machine's deferred packets), median s/GB: "
                      + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in deferred.items()))

            rates: dict[str, list[float]] = {label: [] for label in full}
            for _ in range(args.share_rounds):
                for label in full:
                    rates[label].append(lab.iperf(nodes[label].pods[0].netns, PEER_V4, PORT, seconds=args.seconds,
                                                  extra=["-A", "0,1", "-O", "1"] if args.pin else [])
                                        ["end"]["sum_received"]["bits_per_second"])
            base = statistics.median(rates["share-none"])
            print(f"internal share of unshaped: TCP pod -> peer, unlimited, whole data path ({backend}, {n} pods' "
                  f"rules, tc shaper on the uplink) against no netagent, median of {args.share_rounds} alternated "
                  f"{args.seconds:g} s runs ("
                  + "; ".join(f"{name}: {SHARES[name][2]}" for name in rows) + ")"
                  + ("; iperf3 client on CPU 0, server on CPU 1, first second omitted" if args.pin else ""))
            for label, values in rates.items():
                med = statistics.median(values)
                # each round's rate against none's in the same round (seconds apart): slow swings of the shared
                # machine cancel in the ratio, where they move the medians of whole columns
                pairs = sorted(v / b for v, b in zip(values, rates["share-none"]))
                q1, q3 = statistics.quantiles(pairs, n=4)[::2] if len(pairs) > 1 else (pairs[0], pairs[0])
                print(f"  {label[6:]:6}{med / 1e9:8.2f} Gbit/s  {med / base:6.3f} of none   same-round ratio "
                      f"median {statistics.median(pairs):.3f} (quartiles {q1:.3f}-{q3:.3f})   runs "
                      + " ".join(f"{v / 1e9:.2f}" for v in values), flush=True)
            if "device" in rows:  # the counter must count what moved, or the row's figure means nothing
                moved = sum(v / 8 * (args.seconds + (1 if args.pin else 0)) for v in rates["share-device"])  # -O 1 runs a second more
                pod = nodes["share-device"].pods[0]
                counted = next(c for c in COUNTERS if c.pin_dir.endswith(nodes["share-device"].netns)).read()[pod.ip4]
                print(f"  device: the counter counted {counted[0] / 1e9:.2f} GB in {counted[1]} skbs sent and "
                      f"{counted[2] / 1e6:.1f} MB in {counted[3]} skbs received (ACKs) by the pod; iperf3's rate x "
                      f"time: {moved / 1e9:.2f} GB of payload")
    finally:
        for shaper in shapers:
            shaper.close()
        close_counters()
        cpu.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="round-robin rounds of the per-packet cost")
    ap.add_argument("--packets", type=int, default=100_000, help="datagrams per per-packet cost run")
    ap.add_argument("--traffic-rounds", type=int, default=7)
    ap.add_argument("--share-rounds", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=2)
    ap.add_argument("--pods", default="10,110")
    ap.add_argument("--backends", default="nft,legacy")
    ap.add_argument("--tcp-rate", default="2G", help="offered rate of the GSO TCP load")
    ap.add_argument("--mss-rate", default="200M", help="offered rate of the one-segment-per-packet TCP load")
    ap.add_argument("--nft", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure the native nftables candidate (needs nft)")
    ap.add_argument("--skip-traffic", action="store_true", help="only the per-packet cost (no iperf3)")
    ap.add_argument("--share-only", action="store_true", help="only the share of unshaped")
    ap.add_argument("--pin", action="store_true",
                    help="the share runs' iperf3 client on CPU 0 and server on CPU 1 (where the scheduler puts "
                         "them moves the rate by more than the rules cost)")
    ap.add_argument("--rows", default="", help=f"the share rows to run, comma-separated (default all: {','.join(SHARES)})")
    ap.add_argument("--candidates", action="store_true",
                    help="only none, the bare hook, the new rules counting by the rules and on the device, and the "
                         "lean reference (internal packets return before anything), on the first backend")
    ap.add_argument("--components", action="store_true",
                    help="per-packet cost of the pieces (the hook, one lookup of each kind, 22 plain rules); no iperf3")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/classify_cost.py needs root (network namespaces, cgroups)", file=sys.stderr)
        return 2
    today = load_today()
    if not args.share_only:
        packet_costs(args, today)
    if not args.skip_traffic and not args.components:
        traffic(args, today)
    return 0


if __name__ == "__main__":
    sys.exit(main())
