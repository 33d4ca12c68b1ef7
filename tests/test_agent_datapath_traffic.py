"""Issue 2's data path with real traffic: desired state + Shaper + Classifier on a lab node, iperf3.

How rates are compared (docs/datapath.md, "Measuring"): a configured rate is IP bytes per
second on the wire. HTB counts frames (Ethernet header included; a GSO packet counts as its
segments), so the measured rate is the pod's HTB class counter turned into IP bytes (bytes -
14 x packets, exact per segment), read twice inside the run after a warm-up (so the initial
bucket burst and the TCP ramp are outside the window), divided by the time between the reads.
It must be within ±5% of the configured rate, and so must what the receiver got
(`receiver_ip_rate`: iperf3's receiving end, its payload turned into IP bytes), so a shaper
whose counters and conversion agreed with each other but not with the wire would fail.
Accounting compares the iptables counters (L3: IP header included) with what iperf3
moved, converted to L3 with its exact datagram count (UDP, so the count is known).

One lab for the module; each test programs the node it needs through `program()`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Callable

import pytest

from core.direction import Direction
from iptables.apply import Classifier
from iptables.errors import IptablesError
from lab.agentproc import server_intervals
from lab.netns import normalised, residue_snapshot  # noqa: F401 (other tests import them from here)
from lab.topology import INTERNAL_CIDRS, INTERNET_V4, INTERNET_V6, PEER_V4, PEER_V6, UPLINK, Lab, run
from netagent.desired import DataPathOptions, DesiredState, NodeInputs, PodShape, desired_state, ip_bytes
from tc.model import DEFAULT_MINOR, ack_minor, bulk_minor
from tc.netlink import Shaper
from tc.probe import probe
from tc.sizing import LEAST_CEIL_BPS
from lab.netns import require_root

pytestmark = [pytest.mark.root, pytest.mark.traffic]

M = 1_000_000
G = 1_000_000_000
TOLERANCE = 0.05
WARMUP_S, WINDOW_S, RUN_S = 0.8, 2.4, 4
UDP_HEADERS = {4: 20 + 8, 6: 40 + 8}
DATAGRAM = 1400  # the lab's UDP payload size
PORTS = (5201, 5202)
KUBE_BIT, OUR_BIT = 0x4000, 0x1000

# kube-proxy-like rules present on the node before netagent: they must stay untouched.
KUBE_RULES = [
    "-t nat -N KUBE-MARK-MASQ",
    f"-t nat -A KUBE-MARK-MASQ -j MARK --set-xmark {KUBE_BIT:#x}/{KUBE_BIT:#x}",
    "-t nat -N KUBE-POSTROUTING",
    f"-t nat -A KUBE-POSTROUTING -m mark ! --mark {KUBE_BIT:#x}/{KUBE_BIT:#x} -j RETURN",
    f"-t nat -A KUBE-POSTROUTING -j MARK --set-xmark 0x0/{KUBE_BIT:#x}",
    "-t nat -I POSTROUTING 1 -j KUBE-POSTROUTING",
    "-t mangle -N KUBE-LIKE-MARK",
    "-t mangle -I PREROUTING 1 -j KUBE-LIKE-MARK",
]


def pod_key(pod) -> str:
    return f"default/{pod.name}"


def rate_error(measured: float, configured: float) -> float:
    return (measured - configured) / configured


class NodeUnderTest:
    """One lab node driven the way the agent drives it: plan, then both appliers."""

    def __init__(self, lab: Lab, leaf: str):
        self.lab = lab
        self.node = lab.nodes[0]
        self.pods = self.node.pods
        self.options = DataPathOptions(leaf_qdisc=leaf)
        self.shaper = Shaper(self.node.netns)
        self.classifier = Classifier(netns=self.node.netns)
        self.state: DesiredState | None = None

    def inputs(self, rates: dict, node_rate: int) -> NodeInputs:
        shapes = tuple(PodShape(pod_key(p), (p.ip4, p.ip6), *rates[p.name]) for p in self.pods if p.name in rates)
        return NodeInputs((UPLINK,), INTERNAL_CIDRS, shapes, node_rate, self.options)

    def program(self, rates: dict, node_rate: int = 10 * G):
        """rates: pod name -> (rate, ceil) in bit/s. Returns (tc ops, iptables changes)."""
        self.state = desired_state(self.inputs(rates, node_rate))
        ops = self.shaper.apply(self.state.shaper).ops
        changes = self.classifier.apply(self.state.classifier)
        return ops, changes

    def minor(self, pod) -> int:
        return self.state.minors[pod_key(pod)]

    def class_stats(self, pod):
        return self.shaper.stats(self.state.shaper.ifb, self.state.shaper.major)[self.minor(pod)]

    def remove(self) -> None:
        spec = self.state.shaper if self.state else None
        if spec:
            self.shaper.cleanup(spec.ifb, spec.devices, spec.filter_pref)
        self.classifier.cleanup()
        self.state = None

    def close(self) -> None:
        self.shaper.close()


@pytest.fixture(scope="module")
def lab():
    require_root()
    with Lab(nodes=1, pods_per_node=2) as lab:
        node = lab.nodes[0]
        for rule in KUBE_RULES:
            run(f"iptables {rule}", node.netns)
        # kubelet's hint and canary chains (both families), as on every kube-proxy node; without
        # them no ip6tables mangle table exists before netagent, and the nft backend keeps an
        # emptied table after cleanup (see docs/datapath.md)
        for tool in ("iptables", "ip6tables"):
            run(f"{tool} -t mangle -N KUBE-IPTABLES-HINT", node.netns)
            run(f"{tool} -t mangle -N KUBE-KUBELET-CANARY", node.netns)
        # pod 0's internet traffic also carries kube-proxy's bit, so both bits must survive together
        run(f"iptables -t mangle -A KUBE-LIKE-MARK -s {node.pods[0].ip4} ! -d 10.0.0.0/8 "
            f"-j MARK --set-xmark {KUBE_BIT:#x}/{KUBE_BIT:#x}", node.netns)
        for port in PORTS:
            lab.iperf_server(lab.internet, port)
            lab.iperf_server(lab.peer, port)
        yield lab


@pytest.fixture(scope="module")
def before(lab):
    """The node as it was before netagent: the cleanup test compares against it."""
    return residue_snapshot(lab.nodes[0].netns)


@pytest.fixture(scope="module")
def capacity(lab, before) -> dict[str, float]:
    """What this machine carries pod -> internet with no netagent (TCP; the UDP flood sender)."""
    pod = lab.nodes[0].pods[0]
    tcp = lab.iperf(pod.netns, INTERNET_V4, PORTS[0], seconds=2)["end"]["sum_sent"]["bits_per_second"]
    flood = lab.udp_flood(pod.netns, INTERNET_V4, 9, 10 * G, seconds=1)
    udp = json.loads(flood.communicate(timeout=30)[0])["bits_per_second"]
    return {"tcp": tcp, "udp": udp / 2}  # a UDP flood must be offered at twice the rate


@pytest.fixture(scope="module")
def node(lab, before):
    n = NodeUnderTest(lab, probe(lab.nodes[0].netns).leaf_qdisc)
    try:
        yield n
    finally:
        n.close()


def ip_rate(s1, s2, seconds: float) -> float:
    """IP bit/s between two reads of a class's counters (which count each segment's frame)."""
    opts = DataPathOptions()
    return (ip_bytes(s2.bytes, s2.packets, opts) - ip_bytes(s1.bytes, s1.packets, opts)) * 8 / seconds


def receiver_ip_rate(result: dict, dst: str, udp: bool, reverse: bool = False, after_s: float = 1.0,
                     until_s: float = float("inf")) -> float:
    """What iperf3's receiving end got, IP bit/s, over its intervals from `after_s` (the ramp and
    the class's first burst are in the first second) to `until_s`: the server's intervals for an
    upload (the client ran with --get-server-output), the client's own for a download (-R). Its
    payload is turned into IP bytes by the headers of each 1400-byte datagram or MSS-sized TCP
    segment."""
    if reverse:
        intervals = [(i["sum"]["start"], i["sum"]["end"], i["sum"]["bits_per_second"]) for i in result["intervals"]]
    else:
        intervals = server_intervals(result)
    kept = [(start, end, bps) for start, end, bps in intervals
            if start >= after_s - 1e-3 and end <= until_s + 1e-3 and end > start]
    assert kept, f"no receiver intervals after {after_s} s: {result.get('server_output_text') or result.get('error')}"
    payload = sum((end - start) * bps for start, end, bps in kept) / sum(end - start for start, end, _ in kept)
    family = 6 if ":" in dst else 4
    size = DATAGRAM if udp else result["start"]["tcp_mss_default"]
    headers = UDP_HEADERS[family] if udp else (40 if family == 6 else 20) + 20 + 12  # TCP with timestamps
    return payload * (size + headers) / size


def udp_datagrams_in(netns: str, family: int = 4) -> int:
    """Datagrams the namespace's UDP took in at a bound socket, read or dropped at its full buffer
    (/proc/net/snmp InDatagrams + InErrors, snmp6 for IPv6; a GSO packet counts each of its
    datagrams there). The receiving host's count, whether or not its application keeps up."""
    if family == 6:
        rows = dict(l.split() for l in run(["cat", "/proc/net/snmp6"], netns).splitlines() if l.strip())
        return int(rows["Udp6InDatagrams"]) + int(rows["Udp6InErrors"])
    lines = [l.split() for l in run(["cat", "/proc/net/snmp"], netns).splitlines() if l.startswith("Udp:")]
    udp = dict(zip(lines[0][1:], map(int, lines[1][1:])))
    return udp["InDatagrams"] + udp["InErrors"]


@contextlib.contextmanager
def bound_udp_port(lab, netns: str, port: int):
    """A socket bound to `port` that never reads: the receiving kernel counts each datagram once
    (with no socket a GSO packet would count once as NoPorts)."""
    code = ("import socket, sys, time; s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); "
            f"s.bind(('::', {port})); print('bound', flush=True); time.sleep(600)")
    proc = lab.spawn(netns, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "bound"
        yield
    finally:
        proc.kill()
        proc.wait()


def measure(node: NodeUnderTest, pod, clients: list[subprocess.Popen],
            received: Callable[[], int] | None = None, headers: int = UDP_HEADERS[4]
            ) -> tuple[float, int, list[dict], float | None]:
    """(IP rate in bit/s from the pod's HTB class over the window, class drops, iperf3 results, and
    with `received` (a receiver's datagram count) the IP rate of the 1400-byte datagrams (+ their
    `headers`) it counted in the same window)."""
    try:
        time.sleep(WARMUP_S)
        r1 = received() if received else 0
        s1, t1 = node.class_stats(pod), time.monotonic()
        time.sleep(WINDOW_S)
        s2, t2 = node.class_stats(pod), time.monotonic()
        r2 = received() if received else 0
        results = []
        for c in clients:
            out, err = c.communicate(timeout=RUN_S + 30)
            assert c.returncode == 0, f"iperf3 failed: {err or out}"
            results.append(json.loads(out))
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
    got = (r2 - r1) * (DATAGRAM + headers) * 8 / (t2 - t1) if received else None
    return ip_rate(s1, s2, t2 - t1), s2.drops - s1.drops, results, got


# -- rates -----------------------------------------------------------------------------

RATE_CASES = [(rate, proto, INTERNET_V4) for rate in (10 * M, 100 * M, 1 * G) for proto in ("tcp", "udp")]
RATE_CASES += [(100 * M, proto, INTERNET_V6) for proto in ("tcp", "udp")]


@pytest.mark.parametrize("rate,proto,dst", RATE_CASES,
                         ids=[f"{p}-{r // M}M-ipv{6 if ':' in d else 4}" for r, p, d in RATE_CASES])
def test_internet_egress_held_to_its_rate(lab, node, capacity, rate, proto, dst):
    pod = node.pods[0]
    node.program({pod.name: (rate, rate)})
    if proto == "tcp":
        clients = [lab.iperf_async(pod.netns, dst, PORTS[0], seconds=RUN_S, extra=["--get-server-output"])]
    elif rate < G:
        clients = [lab.iperf_async(pod.netns, dst, PORTS[0], seconds=RUN_S, udp_bitrate=str(2 * rate))]
    else:
        # iperf3 3.12 sends one 1400-byte datagram per syscall, ~0.7 Gbit/s on this machine:
        # the 2 Gbit/s flood comes from a UDP GSO sender of the same datagrams
        clients = [lab.udp_flood(pod.netns, dst, 9, 2 * rate, seconds=RUN_S)]
    # What the receiver got: TCP, iperf3's receiving end (a segment lost is sent again, so what it read is
    # what arrived); UDP, the receiving host's kernel count in the same window as the class's (iperf3's
    # single-threaded reader drops datagrams at its socket on a busy machine: that is not the shaper)
    family = 6 if ":" in dst else 4
    with contextlib.ExitStack() as stack:
        if proto == "udp" and rate >= G:
            stack.enter_context(bound_udp_port(lab, lab.internet, 9))  # the GSO flood's port
        measured, drops, results, got = measure(
            node, pod, clients, (lambda: udp_datagrams_in(lab.internet, family)) if proto == "udp" else None,
            UDP_HEADERS[family])
    err = rate_error(measured, rate)
    what = f"{proto} to {dst} at {rate / M:g} Mbit/s: measured {measured / M:.2f} Mbit/s ({err:+.2%})"
    got = receiver_ip_rate(results[0], dst, udp=False) if proto == "tcp" else got
    what += f", the receiver got {got / M:.2f} Mbit/s ({rate_error(got, rate):+.2%})"
    print(what)
    if capacity[proto] < 1.1 * rate:
        # the machine cannot carry this rate even unshaped: all it can honestly show is that
        # the class never lets more through; said loudly, never silently passed as accurate
        warnings.warn(f"{what}: only {capacity[proto] / M:.0f} Mbit/s unshaped here, accuracy not shown")
        assert measured <= (1 + TOLERANCE) * rate, what
        assert got <= (1 + TOLERANCE) * rate, what
        return
    assert abs(err) <= TOLERANCE, what
    assert abs(rate_error(got, rate)) <= TOLERANCE, what
    if proto == "udp":
        offered = sum(r["end"]["sum"]["bits_per_second"] if "end" in r else r["bits_per_second"] for r in results)
        assert offered >= 1.9 * rate, f"the flood offered only {offered / M:.0f} Mbit/s"
        # drops prove the flood arrived faster than the class lets out: it was held, not merely under the rate
        assert drops > 0, f"UDP offered {offered / M:.0f} Mbit/s never exceeded {rate / M:g} Mbit/s"


@pytest.mark.parametrize("dst,peer", [(INTERNET_V4, PEER_V4), (INTERNET_V6, PEER_V6)], ids=["ipv4", "ipv6"])
def test_unknown_pod_is_held_at_the_floor(lab, node, dst, peer):
    """A pod missing from the desired state (just created, or an IP the agent has not learnt)
    is never unshaped: the classifier's catch-all marks its forwarded internet traffic and
    classifies it to HTB's default class 1:fffe, held at the floor, while a known pod sending
    at the same time keeps its own class and rate. Its internal traffic is not shaped at all."""
    known, unknown = node.pods
    floor, rate = 5 * M, 100 * M
    node.options = DataPathOptions(leaf_qdisc=node.options.leaf_qdisc, floors=DataPathOptions.floors.replace(Direction.UPLOAD, floor))
    try:
        node.program({known.name: (rate, rate)})
        ifb = node.state.shaper.ifb
        counted0 = node.classifier.counters()[1]["egress_unknown_internet"]
        clients = [lab.iperf_async(known.netns, dst, PORTS[0], seconds=RUN_S),
                   lab.iperf_async(unknown.netns, dst, PORTS[1], seconds=RUN_S)]
        try:
            time.sleep(WARMUP_S)
            s1, t1 = node.shaper.stats(ifb), time.monotonic()
            time.sleep(WINDOW_S)
            s2, t2 = node.shaper.stats(ifb), time.monotonic()
            for c in clients:
                out, err = c.communicate(timeout=RUN_S + 30)
                assert c.returncode == 0, f"iperf3 failed: {err or out}"
        finally:
            for c in clients:
                if c.poll() is None:
                    c.kill()
        held, own = (ip_rate(s1[m], s2[m], t2 - t1) for m in (DEFAULT_MINOR, node.minor(known)))
        assert abs(rate_error(held, floor)) <= TOLERANCE, f"unknown pod in the default class: {held / M:.2f} Mbit/s"
        assert abs(rate_error(own, rate)) <= TOLERANCE, f"known pod in its own class: {own / M:.2f} Mbit/s"
        assert node.classifier.counters()[1]["egress_unknown_internet"] - counted0 > floor / 8 * WINDOW_S

        # the internet flows' last segments (a FIN, the final ACK) may still pass the default class
        # after iperf3 returned (CI saw one 66-byte frame): read its counter once it is quiet
        before = wait_quiet(lambda: node.shaper.stats(ifb)[DEFAULT_MINOR].bytes)
        internal = iperf_rate(lab.iperf(unknown.netns, peer, PORTS[1], seconds=2))
        assert node.shaper.stats(ifb)[DEFAULT_MINOR].bytes == before, "the unknown pod's internal traffic entered HTB"
        assert internal >= 20 * floor, f"the unknown pod's internal traffic: {internal / M:.0f} Mbit/s"
    finally:
        node.options = DataPathOptions(leaf_qdisc=node.options.leaf_qdisc)


def wait_quiet(read, quiet_s: float = 0.5, timeout: float = 10.0) -> int:
    """`read()`'s value once it held still for `quiet_s` (a counter whose traffic has ended)."""
    deadline = time.monotonic() + timeout
    value = read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = read()
        if again == value:
            return value
        value = again
    raise AssertionError(f"the counter kept moving for {timeout:.0f} s: {value}")


def iperf_rate(result: dict) -> float:
    return result["end"]["sum_sent"]["bits_per_second"]


FIXED_RATE = 1 * G  # 100x the pod's internet limit, well under what one veth flow carries here
FIXED_RUNS = 5  # alternated pairs at the fixed offered rate
LINE_RUNS = 9  # alternated pairs at line rate
# At the fixed offered rate both sides carry what is offered: >= 0.97 of unshaped is a statement
# about shaping, not about this machine's load. At line rate (~10 Gbit/s CPU-bound veth flows) the
# 2-core development VM, shared with other work, swings 2x between runs (4.4-13.4 Gbit/s seen in one
# session); identical configurations then differ by up to 10 % in any estimator over nine pairs, and a
# 0.95 bound failed about 1 run in 5. The line-rate share is therefore held where it is reliably true
# (a gross regression, e.g. internal traffic through the IFB, fails it); the per-packet figure that
# separates rulesets is CPU seconds per GB at a fixed offered rate in bench/classify_cost.py, and the
# lookup counts per packet are pinned by tests/test_iptables_pure.py.
LINE_SHARE = 0.85


def test_internal_traffic_is_not_shaped(lab, node):
    """Pod -> peer through the same uplink, with the pod's internet egress at 10 Mbit/s, against the
    same path with no netagent at all, alternated so both sides share the machine's noise (and in
    turn first and second in a pair, so neither side always runs right after a reprogramming).
    Offered 1 Gbit/s (100x the pod's limit), the shaped pod delivers what the unshaped one does
    (medians within 3 %); at line rate the pooled ratio of the pairs is at least LINE_SHARE.
    Nothing enters HTB; the pod's internal counter counts at least the bytes delivered."""
    pod = node.pods[0]

    def received(result: dict) -> float:
        return result["end"]["sum_received"]["bits_per_second"]

    def pairs(count: int, extra: list[str] | None) -> dict[bool, list[float]]:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for i in range(count):
            for shaped in ((False, True) if i % 2 == 0 else (True, False)):
                if not shaped:
                    node.remove()
                    runs[False].append(received(lab.iperf(pod.netns, PEER_V4, PORTS[0], seconds=2, extra=extra)))
                    continue
                node.program({pod.name: (10 * M, 10 * M)})
                before = node.class_stats(pod).bytes
                counted = node.classifier.counters()[0].get(pod_key(pod), {}).get("egress_internal", 0)
                result = lab.iperf(pod.netns, PEER_V4, PORTS[0], seconds=2, extra=extra)
                runs[True].append(received(result))
                assert node.class_stats(pod).bytes == before, "internal traffic entered the shaper"
                delivered = result["end"]["sum_received"]["bytes"]
                assert node.classifier.counters()[0][pod_key(pod)]["egress_internal"] - counted >= delivered
        return runs

    fixed = pairs(FIXED_RUNS, ["-b", str(FIXED_RATE)])
    shaped, unshaped = statistics.median(fixed[True]), statistics.median(fixed[False])
    assert unshaped >= 0.9 * FIXED_RATE, f"the machine did not carry {FIXED_RATE / G:g} Gbit/s unshaped: {fixed}"
    assert shaped / unshaped >= 0.97, (
        f"offered {FIXED_RATE / G:g} Gbit/s: internal {shaped / G:.3f} vs unshaped {unshaped / G:.3f} Gbit/s "
        f"(runs {[round(v / G, 3) for v in fixed[True]]} vs {[round(v / G, 3) for v in fixed[False]]})")

    share, report = line_rate_share(pairs(LINE_RUNS, None), "internal")
    assert share >= LINE_SHARE, report


def line_rate_share(runs: dict[bool, list[float]], what: str) -> tuple[float, str]:
    """The pooled ratio of alternated line-rate pairs (all shaped bytes over all unshaped ones) and a
    report, printed, that sets the earlier rules beside it (the median of the pairs' ratios, the rule
    until 2026-11-28, and each side's fastest run); `runs` are each side's runs in pair order."""
    pooled = sum(runs[True]) / sum(runs[False])
    median = statistics.median(s / u for s, u in zip(runs[True], runs[False]))
    fastest = max(runs[True]) / max(runs[False])
    report = (f"{what} at line rate: pooled {pooled:.3f} (earlier rules: median of pair ratios {median:.3f}, "
              f"fastest runs {fastest:.3f}); Gbit/s shaped {[round(v / G, 2) for v in runs[True]]} "
              f"unshaped {[round(v / G, 2) for v in runs[False]]}")
    print(report)
    return pooled, report


# -- sharing -----------------------------------------------------------------------------

def test_two_pods_share_the_node_class(lab, node):
    """HTB: each class gets its rate; the parent's spare goes to the classes that want
    more in proportion to their quantum (rate/100 here), up to each ceil. TCP competing in
    one tree wobbles by a few % of the node rate over a short window, so the split is checked
    to ±5% of the node rate: enough to tell HTB's 1:3 split of the spare (100/300) from an
    equal one (160/240) or none (40/120). Four flows a pod keep each class backlogged: with one,
    a flow that halved its window after a drop left its class short for a moment and HTB lent
    that to the other (a CI run, 2026-11-29: 117.6/271.5 Mbit/s against 100/300)."""
    a, b = node.pods
    node_rate, rate_a, rate_b = 400 * M, 40 * M, 120 * M
    node.program({a.name: (rate_a, node_rate), b.name: (rate_b, node_rate)}, node_rate)
    clients = [lab.iperf_async(p.netns, INTERNET_V4, port, seconds=RUN_S, extra=["-P", "4"])
               for p, port in zip((a, b), PORTS)]
    try:
        time.sleep(WARMUP_S)
        s1, t1 = {p.name: node.class_stats(p) for p in (a, b)}, time.monotonic()
        time.sleep(WINDOW_S)
        s2, t2 = {p.name: node.class_stats(p) for p in (a, b)}, time.monotonic()
        for c in clients:
            c.communicate(timeout=RUN_S + 30)
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
    got = {name: ip_rate(s1[name], s2[name], t2 - t1) for name in s1}
    spare = node_rate - rate_a - rate_b
    want = {a.name: rate_a + spare * rate_a / (rate_a + rate_b), b.name: rate_b + spare * rate_b / (rate_a + rate_b)}
    print("the node class shared, Mbit/s: " + ", ".join(f"{n} {got[n] / M:.1f} (want {want[n] / M:.0f})" for n in got))
    assert abs(rate_error(sum(got.values()), node_rate)) <= TOLERANCE, got
    for name, guaranteed in ((a.name, rate_a), (b.name, rate_b)):
        assert got[name] >= (1 - TOLERANCE) * guaranteed, f"{name} below its guaranteed rate: {got}"
        assert abs(got[name] - want[name]) <= TOLERANCE * node_rate, f"not HTB's split: got {got}, want {want}"

    # alone, a pod borrows the idle capacity up to its own ceil
    node.program({a.name: (20 * M, 50 * M), b.name: (60 * M, 100 * M)}, 100 * M)
    measured, _, _, _ = measure(node, a, [lab.iperf_async(a.netns, INTERNET_V4, PORTS[0], seconds=RUN_S)])
    assert abs(rate_error(measured, 50 * M)) <= TOLERANCE, f"alone with ceil 50 Mbit/s: {measured / M:.2f}"


def test_rate_change_applies_in_place(lab, node):
    pod = node.pods[0]
    node.program({pod.name: (20 * M, 20 * M)})
    leaf_before = node.shaper.observe(node.state.shaper).leaves[bulk_minor(node.minor(pod))]
    client = lab.iperf_async(pod.netns, INTERNET_V4, PORTS[0], seconds=6, extra=["-i", "0.5"])
    try:
        time.sleep(0.8)
        s0, t0 = node.class_stats(pod), time.monotonic()
        time.sleep(1.6)
        s1, t1 = node.class_stats(pod), time.monotonic()
        ops, changes = node.program({pod.name: (40 * M, 40 * M)})
        time.sleep(0.8)
        s2, t2 = node.class_stats(pod), time.monotonic()
        time.sleep(1.6)
        s3, t3 = node.class_stats(pod), time.monotonic()
        out, err = client.communicate(timeout=40)
    finally:
        if client.poll() is None:
            client.kill()
    assert {op.action for op in ops} <= {"change_class", "replace_leaf"}, [str(o) for o in ops]
    assert changes == {"iptables": 0, "ipset": 0}  # the pod keeps its class: no rule is touched
    leaf_after = node.shaper.observe(node.state.shaper).leaves[bulk_minor(node.minor(pod))]
    assert (leaf_after.kind, leaf_after.handle_major) == (leaf_before.kind, leaf_before.handle_major)
    assert s0.bytes <= s1.bytes <= s2.bytes <= s3.bytes, "the class counter went backwards: the class was recreated"
    before, after = ip_rate(s0, s1, t1 - t0), ip_rate(s2, s3, t3 - t2)
    assert abs(rate_error(before, 20 * M)) <= TOLERANCE, before
    assert abs(rate_error(after, 40 * M)) <= TOLERANCE, after
    intervals = [i["sum"]["bytes"] for i in json.loads(out)["intervals"]]
    assert all(b > 0 for b in intervals), f"traffic stalled during the change: {intervals}"


@pytest.mark.parametrize("low,leaf,stalls", [(LEAST_CEIL_BPS, "pfifo", False), (27_000, "pfifo", True), (27_000, "tbf", False)],
                         ids=["least-ceil", "27k-pfifo", "27k-segmenting"])
def test_a_short_cut_costs_no_stall_at_the_least_ceil(lab, node, low, leaf, stalls):
    """HTB sends a packet when its class has any tokens and keeps the debt, in time at the ceil of
    that moment: one 61.6 KB GSO packet sent at 27 kbit/s (an answer computed while the pod was
    idle) owes 18 s, and the pod stalls after its ceil is raised again. At LEAST_CEIL_BPS, the least
    ceil the agent ever gives a pod (`cap_to_node`), it is back at once even with a pfifo leaf. The
    27k case with a pfifo leaf shows that this test sees the stall it guards against; the segmenting
    leaf (tbf: HTB only ever sees frames, so its debt is one frame) has none even there.

    The worst packet is sent on purpose (one UDP GSO send) and the load afterwards is a paced UDP
    flood: a TCP flow's GSO size follows its pacing rate and varies from machine to machine."""
    if leaf == "tbf" and "tbf" not in probe(lab.nodes[0].netns).qdiscs:
        pytest.skip("this kernel has no tbf")
    saved = node.options
    node.options = dataclasses.replace(node.options, leaf_qdisc=leaf)
    pod = node.pods[0]
    node.remove()  # a new class: no debt from an earlier test
    try:
        node.program({pod.name: (40 * M, 40 * M)})  # an idle class: its buckets are full
        node.program({pod.name: (8_000, low)})
        lab.udp_burst(pod.netns, INTERNET_V4, 9)
        time.sleep(1.0)
        node.program({pod.name: (40 * M, 40 * M)})
        flood = lab.udp_flood(pod.netns, INTERNET_V4, 9, 80 * M, seconds=4)
        try:
            time.sleep(0.8)
            s0, t0 = node.class_stats(pod), time.monotonic()
            time.sleep(1.6)
            s1, t1 = node.class_stats(pod), time.monotonic()
            flood.communicate(timeout=30)
        finally:
            if flood.poll() is None:
                flood.kill()
    finally:
        node.options = saved
        node.remove()  # and none left for a later one
    after = ip_rate(s0, s1, t1 - t0)
    if stalls:
        assert after < 0.1 * 40 * M, f"{after / M:.2f} Mbit/s: the class did not stall; LEAST_CEIL_BPS may be too careful"
    else:
        assert after > 0.8 * 40 * M, f"{after / M:.2f} Mbit/s after the ceil went back to 40M: the class stalled"


# -- classification and accounting --------------------------------------------------------

SENDER = textwrap.dedent("""
    import socket, sys
    from scapy.all import IP, IPv6, UDP, Raw
    # Crafted by scapy, sent through raw IP sockets (header included): the kernel routes and
    # resolves the gateway, as for any pod packet (scapy's own ARP/ND is not used)
    raw = {4: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW),
           6: socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_RAW)}
    print("ready", flush=True)
    for line in sys.stdin:
        dst, src, size, count = line.split()
        family = 6 if ":" in dst else 4
        l3 = IPv6(src=src, dst=dst) if family == 6 else IP(src=src, dst=dst)
        pkt = bytes(l3 / UDP(sport=40000, dport=9) / Raw(b"x" * int(size)))
        for _ in range(int(count)):
            raw[family].sendto(pkt, (dst, 0))
        print("sent", len(pkt), flush=True)
""")



def edges(cidr: str) -> tuple[list[str], list[str]]:
    """(first and last address of the CIDR, the addresses just outside it)."""
    net = ipaddress.ip_network(cidr)
    return [str(net[0]), str(net[-1])], [str(net[0] - 1), str(net[-1] + 1)]


def edge_cases() -> list[tuple[str, str]]:
    """(destination, scope) at every internal CIDR's edges: its first and last address are internal, the
    addresses just outside it internet."""
    cases = []
    for cidr in INTERNAL_CIDRS:
        inside, outside = edges(cidr)
        cases += [(dst, "internal") for dst in inside] + [(dst, "internet") for dst in outside]
    return cases


@contextlib.contextmanager
def datagram_sender(lab: Lab, pod):
    """SENDER in the pod; yields send(dst, count) -> the size of the IP packet it sent `count` times (100
    bytes of UDP payload, from the pod's address of dst's family). Killed after the block."""
    sender = lab.spawn(pod.netns, [sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    try:
        assert sender.stdout.readline().strip() == "ready", sender.stderr.read()

        def send(dst: str, count: int) -> int:
            sender.stdin.write(f"{dst} {pod.ip6 if ':' in dst else pod.ip4} 100 {count}\n")
            sender.stdin.flush()
            return int(sender.stdout.readline().split()[1])
        yield send
    finally:
        sender.stdin.close()
        sender.kill()


def egress_moved(read, before: dict[str, int], want: int) -> dict[str, int]:
    """Poll `read()` (a pod's counters) until its egress of either scope moved by `want` bytes since `before`, or
    3 s went (a packet may wait for the gateway's neighbour entry); -> how much each kind moved."""
    deadline = time.monotonic() + 3
    while True:
        time.sleep(0.1)
        after = read()
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
        if moved.get("egress_internal", 0) + moved.get("egress_internet", 0) >= want or time.monotonic() > deadline:
            return moved


def test_classification_edges(lab, node):
    pod = node.pods[0]
    node.program({pod.name: (100 * M, 100 * M)})
    key = pod_key(pod)
    wrong = []
    with datagram_sender(lab, pod) as send:
        for dst, scope in edge_cases():
            count = 3
            before_counts = node.classifier.counters()[0].get(key, {})
            before_class = node.class_stats(pod).packets
            size = send(dst, count)
            delta = egress_moved(lambda: node.classifier.counters()[0][key], before_counts, count * size)
            shaped = node.class_stats(pod).packets - before_class
            other = "internet" if scope == "internal" else "internal"
            expect_shaped = count if scope == "internet" else 0
            if delta[f"egress_{scope}"] != count * size or delta[f"egress_{other}"] != 0 or shaped != expect_shaped:
                wrong.append(f"{dst}: want {scope} {count * size} B, got {delta}, {shaped} packets through HTB")
    assert not wrong, "\n".join(wrong)


def leaf_packets(node, pod) -> tuple[int, int]:
    """(packets through the pod's control leaf, through its bulk leaf): the raw class dump, unfolded."""
    spec, minor = node.state.shaper, node.minor(pod)
    raw = node.shaper.chan.dump_class_counters(node.shaper._index(spec.ifb), spec.major)
    return raw[ack_minor(minor)][1], raw[bulk_minor(minor)][1]


def test_a_pods_small_packets_of_any_protocol_go_ahead_of_its_bulk_data(lab, node):
    """The control leaf is the pod's lane for sparse traffic (fq_codel's new-flow queue, where the
    kernel has no fq_codel): a ping, a DNS-sized UDP datagram and a small TCP segment wait only for
    the frame HTB is sending, not behind the pod's own bulk backlog; full-size packets of any
    protocol stay in the bulk leaf. Counted in packets per leaf, both families."""
    pod = node.pods[0]
    node.program({pod.name: (100 * M, 100 * M)})
    sender = lab.spawn(pod.netns, [sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    try:
        assert sender.stdout.readline().strip() == "ready", sender.stderr.read()
        wrong = []
        for dst, src in ((INTERNET_V4, pod.ip4), (INTERNET_V6, pod.ip6)):
            cases = [  # (what, how to send it, count, the leaf it must take: 0 control, 1 bulk)
                ("a 56-byte ping", f"ping -c 3 -i 0.2 -s 56 {dst}", 3, 0),
                ("a 1400-byte ping", f"ping -c 3 -i 0.2 -s 1400 {dst}", 3, 1),
                ("a 100-byte UDP datagram", (dst, src, 100, 3), 3, 0),
                ("a 1400-byte UDP datagram", (dst, src, 1400, 3), 3, 1),
            ]
            for what, how, count, leaf in cases:
                before = leaf_packets(node, pod)
                if isinstance(how, str):
                    run(how, pod.netns, check=False)  # the internet host may not answer: the request is what counts
                else:
                    sender.stdin.write(" ".join(map(str, how)) + "\n")
                    sender.stdin.flush()
                    sender.stdout.readline()
                deadline = time.monotonic() + 3  # a packet may wait for the gateway's neighbour entry
                while True:
                    moved = [a - b for a, b in zip(leaf_packets(node, pod), before)]
                    if moved[leaf] >= count or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                if moved[leaf] < count or moved[1 - leaf] > 0:
                    wrong.append(f"{what} to {dst}: control leaf +{moved[0]}, bulk leaf +{moved[1]} packets; "
                                 f"want {count} in the {('control', 'bulk')[leaf]} leaf only")
        assert not wrong, "\n".join(wrong)
    finally:
        sender.stdin.close()
        sender.kill()


def udp_l3_bytes(result: dict, family: int, reverse: bool) -> tuple[int, int]:
    """(payload bytes the sender moved, the same as L3 bytes) from an iperf3 UDP result."""
    sent = result["end"]["sum_sent"]["bytes"] if reverse else result["end"]["sum"]["bytes"]
    assert sent % DATAGRAM == 0
    return sent, sent + sent // DATAGRAM * UDP_HEADERS[family]


@pytest.mark.parametrize("direction,scope,dst,reverse", [
    ("egress", "internet", INTERNET_V4, False),
    ("egress", "internal", PEER_V4, False),
    ("ingress", "internet", INTERNET_V4, True),
    ("ingress", "internal", PEER_V4, True),
    ("egress", "internet", INTERNET_V6, False),
    ("ingress", "internet", INTERNET_V6, True),
    ("egress", "internal", PEER_V6, False),
], ids=["egress-internet", "egress-internal", "ingress-internet", "ingress-internal", "egress-internet-v6",
        "ingress-internet-v6", "egress-internal-v6"])
def test_accounting_agrees_with_iperf(lab, node, direction, scope, dst, reverse):
    pod = node.pods[1]
    node.program({pod.name: (1 * G, 1 * G)})
    key = pod_key(pod)
    before = node.classifier.counters()[0].get(key, {})
    result = lab.iperf(pod.netns, dst, PORTS[1], seconds=2, udp_bitrate="50M", reverse=reverse)
    after = node.classifier.counters()[0][key]
    delta = {k: after[k] - before.get(k, 0) for k in after}
    payload, l3 = udp_l3_bytes(result, 6 if ":" in dst else 4, reverse)
    counted = delta[f"{direction}_{scope}"]
    assert abs(counted - l3) <= 0.02 * l3, f"counted {counted} B, iperf3 moved {l3} B (L3; {payload} B payload)"
    # the rest is iperf3's control connection: a few kilobytes
    others = {k: v for k, v in delta.items() if k != f"{direction}_{scope}"}
    assert all(v <= 0.01 * l3 for v in others.values()), others


# -- restart, coexistence, cleanup ---------------------------------------------------------

def test_restart_adopts_without_changes(lab, node):
    a, b = node.pods
    rates = {a.name: (30 * M, 60 * M), b.name: (10 * M, 20 * M)}
    node.program(rates, 100 * M)
    snap = residue_snapshot(node.node.netns)
    fresh_shaper, fresh_classifier = Shaper(node.node.netns), Classifier(netns=node.node.netns)
    try:
        state = desired_state(node.inputs(rates, 100 * M))
        assert fresh_shaper.apply(state.shaper).changes == 0
        assert fresh_classifier.apply(state.classifier) == {"iptables": 0, "ipset": 0}
    finally:
        fresh_shaper.close()
    assert residue_snapshot(node.node.netns) == snap


def kube_rules(netns: str) -> list[str]:
    return [line for line in normalised(run("iptables-save", netns)).splitlines() if "KUBE" in line]


BOTH_BITS = f"-m mark --mark {OUR_BIT | KUBE_BIT:#x}/{OUR_BIT | KUBE_BIT:#x} -m comment --comment both-bits -j RETURN"


def test_coexists_with_kube_proxy_marks(lab, node, before):
    pod = node.pods[0]
    node.program({pod.name: (50 * M, 50 * M)})
    # an observer after our hook: packets that carry kube-proxy's bit and ours together
    run(f"iptables -t mangle -A POSTROUTING {BOTH_BITS}", node.node.netns)
    try:
        lab.iperf(pod.netns, INTERNET_V4, PORTS[0], seconds=1)
        assert _rule_packets(node.node.netns, "both-bits") > 0, "our MARK cleared kube-proxy's bit (or never set ours)"
    finally:
        run(f"iptables -t mangle -D POSTROUTING {BOTH_BITS}", node.node.netns)
    assert node.class_stats(pod).bytes > 0
    assert kube_rules(node.node.netns) == [line for line in before["iptables-save"].splitlines() if "KUBE" in line]
    node.classifier.check_conflicts(OUR_BIT)  # free: no error
    with pytest.raises(IptablesError, match="0x4000.*KUBE-MARK-MASQ"):
        node.classifier.check_conflicts(KUBE_BIT)
    conflicting = f"-d 192.0.2.1 -j MARK --set-xmark {OUR_BIT:#x}/{OUR_BIT:#x}"
    run(f"iptables -t mangle -A KUBE-LIKE-MARK {conflicting}", node.node.netns)
    try:
        with pytest.raises(IptablesError, match="0x1000.*KUBE-LIKE-MARK"):
            node.classifier.check_conflicts(OUR_BIT)
    finally:
        run(f"iptables -t mangle -D KUBE-LIKE-MARK {conflicting}", node.node.netns)


def _rule_packets(netns: str, comment: str) -> int:
    for line in run("iptables-save -c -t mangle", netns).splitlines():
        if comment in line:
            return int(line[1:].split(":")[0])
    raise AssertionError(f"rule {comment!r} not found")


def test_cleanup_leaves_no_residue(lab, node, before):
    node.program({p.name: (10 * M, 20 * M) for p in node.pods})
    lab.iperf(node.pods[0].netns, INTERNET_V4, PORTS[0], seconds=1)
    node.remove()
    after = residue_snapshot(node.node.netns)
    assert {k: v for k, v in after.items() if v != before.get(k)} == {}
    node.remove()  # idempotent
    assert residue_snapshot(node.node.netns) == after


def test_legacy_backend_end_to_end(lab, node):
    """The same data path with the rules in iptables-legacy (nodes that never moved to nft):
    shaped to ±5%, counted to 2%, and removed again. Runs last: a legacy table, once used,
    stays registered in the namespace (the kernel never unregisters it), so only our chains
    and sets are compared."""
    node.remove()
    pod = node.pods[1]
    legacy = Classifier(backend="legacy", netns=node.node.netns)
    state = desired_state(node.inputs({pod.name: (100 * M, 100 * M)}, 10 * G))
    node.shaper.apply(state.shaper)
    legacy.apply(state.classifier)
    try:
        assert "NETAGENT" not in run("iptables-save", node.node.netns)  # nothing of ours in nft
        node.state = state
        measured, _, _, _ = measure(node, pod, [lab.iperf_async(pod.netns, INTERNET_V4, PORTS[1], seconds=RUN_S)])
        assert abs(rate_error(measured, 100 * M)) <= TOLERANCE, f"legacy: {measured / M:.2f} Mbit/s"
        before = legacy.counters()[0][pod_key(pod)]["egress_internet"]
        result = lab.iperf(pod.netns, INTERNET_V4, PORTS[1], seconds=2, udp_bitrate="50M")
        _, l3 = udp_l3_bytes(result, 4, reverse=False)
        counted = legacy.counters()[0][pod_key(pod)]["egress_internet"] - before
        assert abs(counted - l3) <= 0.02 * l3, f"legacy counted {counted} B, iperf3 moved {l3} B"
    finally:
        legacy.cleanup()
        node.remove()
    for tool in ("iptables-legacy-save", "ip6tables-legacy-save"):
        assert "NETAGENT" not in run(tool, node.node.netns)
    assert "netagent" not in run("ipset list -n", node.node.netns)
