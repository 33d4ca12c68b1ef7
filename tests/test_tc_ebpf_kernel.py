"""tc/ebpf/: the pods' internal counters on a real kernel.

A scratch "node" namespace routes between two "pod" namespaces (a veth each, addresses in the
internal CIDRs) and holds an "internet" address on its loopback; the counter's map is pinned in a
private bpffs mounted for the test. Known traffic (pings and one-way UDP datagrams of known sizes)
must be counted exactly, per pod and direction, in both families; internet traffic not at all.

The kernel tests need root (marked one by one: the pure tests at the end need nothing). Nothing
here touches the root network namespace; the namespaces, the mount and the iperf3 server go,
also after a failure.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from scapy.layers.inet import GRE, IP, TCP, UDP, IPOption_NOP
from scapy.layers.inet6 import IPv6, IPv6ExtHdrHopByHop
from scapy.layers.l2 import Ether
from scapy.packet import Raw

import nlwire
from bench import segments_cost
from lab.netns import bpf_filesystem, scratch_netns, sh
from tc import ebpf
from tc.ebpf import EbpfError, InternalCounter, asm, maps, syscall, tcx
from tc.ebpf import programs as progs

root = pytest.mark.root

NETS = {4: ("10.0.0.0/8",), 6: ("fd00::/8",)}
A4, A6, B4, B6 = "10.244.0.10", "fd00:244::10", "10.244.1.10", "fd00:244:1::10"
NODE_A4, NODE_A6 = "10.244.0.1", "fd00:244::1"
INET4, INET6 = "192.0.2.1", "2001:db8::1"
PODS = (A4, A6, B4, B6)
DEVICES = ("veth-a", "veth-b")
# forty CIDRs a family, as many as a cluster's internal networks may be
FORTY = {4: tuple(f"172.{16 + i // 4}.{i % 4}.0/24" for i in range(40)), 6: tuple(f"fd{i:02x}::/16" for i in range(40))}
# IP bytes of one ICMP echo (or UDP datagram) with 100 bytes of payload: the header, 8, 100
V4, V6 = 20 + 8 + 100, 40 + 8 + 100
ETH = 14


@pytest.fixture
def bpffs():
    """A bpffs of the test's own, unmounted after it (its pinned map goes with it)."""
    with bpf_filesystem() as root:
        yield root


@dataclass
class Lab:
    node: str
    pod: dict[str, str]  # "a", "b" -> the pod's namespace


@pytest.fixture
def lab():
    """node <-veth-a-> pod a (10.244.0.10, fd00:244::10), node <-veth-b-> pod b (10.244.1.10,
    fd00:244:1::10); the node forwards, and holds 192.0.2.1 and 2001:db8::1 on its loopback (this
    kernel has no dummy devices). The IPv6 neighbours are static: neighbour discovery between
    internal addresses would be counted."""
    with contextlib.ExitStack() as stack:
        node = stack.enter_context(scratch_netns("ebpf"))
        pods = {name: stack.enter_context(scratch_netns(f"ebpf{name}")) for name in "ab"}
        sh(f"sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1 && ip addr add {INET4}/32 dev lo && "
           f"ip addr add {INET6}/128 dev lo", node)
        for n, (name, ns) in enumerate(pods.items()):
            host_mac, pod_mac = f"02:00:00:00:0{n}:01", f"02:00:00:00:0{n}:02"
            pod4, pod6, node6 = (A4, A6, NODE_A6) if name == "a" else (B4, B6, "fd00:244:1::1")
            sh(f"ip link add veth-{name} address {host_mac} type veth peer name eth0 address {pod_mac} netns {ns} && "
               f"ip link set veth-{name} up && ip addr add 10.244.{n}.1/24 dev veth-{name} && "
               f"ip addr add {node6}/64 dev veth-{name} nodad && "
               f"ip neigh add {pod6} lladdr {pod_mac} dev veth-{name} nud permanent", node)
            sh(f"ip link set eth0 up && ip addr add {pod4}/24 dev eth0 && ip addr add {pod6}/64 dev eth0 nodad && "
               f"ip route add default via 10.244.{n}.1 && ip -6 route add default via {node6} && "
               f"ip neigh add {node6} lladdr {host_mac} dev eth0 nud permanent && "
               # one-way datagrams to port 9 are dropped without an ICMP error back
               "iptables -A INPUT -p udp --dport 9 -j DROP && ip6tables -A INPUT -p udp --dport 9 -j DROP", ns)
        yield Lab(node, pods)


def ping(ns: str, dst: str, count: int) -> None:
    sh(f"ping -q -c {count} -i 0.2 -W 2 -s 100 {dst}", ns)


def send_udp(ns: str, src: str, dst: str, count: int) -> None:
    """`count` datagrams of 100 bytes from `src` to `dst` port 9."""
    family = "AF_INET6" if ":" in dst else "AF_INET"
    sh(f"{sys.executable} -c \"import socket; s = socket.socket(socket.{family}, socket.SOCK_DGRAM); "
       f"s.bind(('{src}', 0)); [s.sendto(bytes(100), ('{dst}', 9)) for _ in range({count})]\"", ns)


def settled(read, expected):
    """What `read()` gives once it equals `expected` (datagrams are still on their way when the sender
    returns; an unpinned link's release is deferred by the kernel), or as it is after 5 s."""
    for _ in range(50):
        counts = read()
        if counts == expected:
            break
        time.sleep(0.1)
    return counts


def both(v4: int, v6: int) -> tuple[int, int]:
    """(bytes, packets) of v4 IPv4 and v6 IPv6 packets of 100 bytes' payload."""
    return v4 * V4 + v6 * V6, v4 + v6


def entry(egress: tuple[int, int], ingress: tuple[int, int]) -> tuple[int, int, int, int]:
    """A pod's counts as read() gives them."""
    return (*egress, *ingress)


def started(bpffs: str, lab: Lab, **kw) -> InternalCounter:
    """A counter of the four pod addresses, attached to both pod devices."""
    counter = InternalCounter(os.path.join(bpffs, "netagent"), netns=lab.node, **kw)
    counter.set_networks(NETS)
    counter.set_pods(PODS)
    counter.attach(DEVICES)
    return counter


WAYS = ("tcx", "tc")  # how the programs are attached: tcx links (Linux >= 6.6), cls_bpf filters (before)


def ours(netns: str, dev: str) -> list[str]:
    """Our programs on a device, sorted, as "<way> <hook> <name>": tcx programs by their names (opened by id:
    the test runs as root), tc filters by theirs."""
    found = []
    with nlwire.in_netns(netns):
        index = socket.if_nametoindex(dev)
        for egress, hook in ((False, "ingress"), (True, "egress")):
            for prog_id in tcx.tcx_programs(index, egress):
                fd = syscall.bpf(13, syscall.bpf_attr("=I", prog_id))  # BPF_PROG_GET_FD_BY_ID
                try:
                    found.append(f"tcx {hook} {syscall.obj_info(fd, 80)[64:80].rstrip(bytes(1)).decode()}")
                finally:
                    os.close(fd)
    for hook in ("ingress", "egress"):
        found += [f"tc {hook} {word}" for line in sh(f"tc filter show dev {dev} {hook}", netns).splitlines()
                  for word in line.split() if word.startswith("netagent-")]
    return sorted(found)


def attached(way: str, uplink: bool = False, gate: bool = False) -> list[str]:
    """What `ours` shows on a device that carries the counter: a pod device's programs, or an uplink's (on tcx
    links, with `gate` the gated egress program: the agent's data path gates)."""
    if way == "tcx":
        names = ("na_node_in", "na_node_out") if uplink else ("na_count_in", "na_count_out")
        names = (names[0], names[1] + "_g" if gate else names[1])
    else:
        names = ("netagent-node-in", "netagent-node-out") if uplink else ("netagent-count-in", "netagent-count-out")
    return sorted([f"{way} ingress {names[0]}", f"{way} egress {names[1]}"])


def ours_soon(netns: str, dev: str, want: list[str]) -> list[str]:
    """`ours` once it is `want`, or after 5 s."""
    return settled(lambda: ours(netns, dev), want)


@root
def test_counts_are_exact_ip_bytes_per_pod_and_direction_and_internet_is_not_counted(bpffs, lab):
    """An ICMP echo or datagram of 100 bytes is 128 IP bytes in IPv4 and 148 in IPv6 on both hooks:
    cls_bpf shows the frame with its MAC header on the device's ingress as on its egress."""
    a, b = lab.pod["a"], lab.pod["b"]
    with started(bpffs, lab) as counter:
        assert counter.read() == {p: (0, 0, 0, 0) for p in PODS}
        ping(a, B4, 2)  # pod to pod
        ping(a, B6, 2)
        ping(a, NODE_A4, 3)  # pod to node
        ping(a, NODE_A6, 3)
        ping(a, INET4, 4)  # the internet: neither way counted
        ping(a, INET6, 4)
        ping(b, INET4, 2)
        send_udp(a, A4, B4, 5)  # one way: a's egress, b's ingress
        send_udp(a, A6, B6, 5)
        send_udp(lab.node, NODE_A4, A4, 3)  # node to pod: internal
        send_udp(lab.node, NODE_A6, A6, 3)
        send_udp(lab.node, INET4, A4, 7)  # from an internet address: not counted
        send_udp(lab.node, INET6, A6, 7)
        send_udp(b, B4, INET4, 7)
        expected = {
            A4: entry(both(2 + 3 + 5, 0), both(2 + 3 + 3, 0)),
            A6: entry(both(0, 2 + 3 + 5), both(0, 2 + 3 + 3)),
            B4: entry(both(2, 0), both(2 + 5, 0)),
            B6: entry(both(0, 2), both(0, 2 + 5)),
        }
        assert settled(counter.read, expected) == expected


@root
def test_a_tcp_transfer_is_counted_in_gso_packets_within_a_percent_of_its_bytes(bpffs, lab):
    """iperf3 pod a -> pod b: each GSO super-packet counted once with its one header, so the count
    is the payload and a little more; b received on its device what a sent on its own."""
    a, b = lab.pod["a"], lab.pod["b"]
    server = subprocess.Popen(["ip", "netns", "exec", b, "iperf3", "-s", "-1", "-B", B4], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        with started(bpffs, lab) as counter:
            for _ in range(50):
                if ":5201" in sh("ss -ltnH", b):
                    break
                time.sleep(0.1)
            result = json.loads(sh(f"iperf3 -c {B4} -t 2 -J", a))
            payload = result["end"]["sum_received"]["bytes"]
            sent = counter.read()[A4]
            for _ in range(50):  # b's device has sent on what a's received once the last segment is through
                received = counter.read()[B4]
                if received[2:] == sent[:2]:
                    break
                time.sleep(0.1)
            assert received[2:] == sent[:2]
    finally:
        server.kill()
        server.wait()
    assert payload <= sent[0] <= payload * 1.01, (sent, payload)
    assert sent[0] / sent[1] > 3000, f"{sent}: no GSO packets, the test does not see what it is for"


@root
@pytest.mark.parametrize("way", WAYS)
def test_a_second_counter_adopts_the_pins_and_the_attachments_then_follows_new_networks(bpffs, lab, way):
    """A restarted agent finds the programs it would load pinned and running (with CAP_BPF alone it could not
    open them by id), so it changes nothing; new networks are new programs, swapped in on every hook."""
    a = lab.pod["a"]
    pin_dir = os.path.join(bpffs, "netagent")
    first = started(bpffs, lab, attach_by=way)
    assert first.attach_by == way
    ping(a, B4, 2)
    before = first.read()
    first.close()  # an agent that went: its programs keep counting
    ping(a, B4, 1)
    with InternalCounter(pin_dir, netns=lab.node, attach_by=way) as second:
        assert second.read()[A4] == entry(both(3, 0), both(3, 0)) and before[A4] == entry(both(2, 0), both(2, 0))
        assert second.set_networks(NETS) is True  # a new process takes its programs...
        assert second.attach(DEVICES) == 0  # ...which are the ones running
        assert second.set_pods(PODS) == 0
        assert second.set_networks({6: NETS[6], 4: NETS[4]}) is False
        # forty networks, the internet's test range the last one tested
        assert second.set_networks({4: (*NETS[4], *FORTY[4][1:], "192.0.2.0/24"), 6: FORTY[6]}) is True
        assert second.attach(DEVICES) == 4  # both hooks of both devices run the new program
        assert second.attach(DEVICES) == 0
        ping(a, INET4, 2)  # internal now
        ping(a, B4, 1)
        assert second.read()[A4] == entry(both(6, 0), both(6, 0))
        assert ours(lab.node, "veth-a") == attached(way)
        if way == "tc":
            assert sh("tc filter show dev veth-a ingress; tc filter show dev veth-a egress", lab.node).count(
                "direct-action") == 2


@root
def test_a_pinned_map_of_another_size_is_replaced_and_the_filters_follow_the_new_map(bpffs, lab):
    """The programs' tag leaves their map out: a filter running the same instructions against the
    replaced map is not current."""
    a = lab.pod["a"]
    with started(bpffs, lab, max_entries=8) as small:
        ping(a, B4, 1)
        assert small.read()[A4][1] == 1
    with InternalCounter(os.path.join(bpffs, "netagent"), netns=lab.node, max_entries=16) as counter:
        assert counter.read() == {}
        counter.set_networks(NETS)
        counter.set_pods(PODS)
        assert counter.attach(DEVICES) == 4
        ping(a, B4, 1)
        assert counter.read()[A4] == entry(both(1, 0), both(1, 0))


@root
def test_set_pods_keeps_the_counts_of_pods_that_stay_and_refuses_more_than_max_entries(bpffs, lab):
    a = lab.pod["a"]
    with started(bpffs, lab) as counter:
        ping(a, B4, 2)
        ping(a, B6, 1)
        assert counter.set_pods([A4, A6, B6, "10.244.2.10"]) == 2  # b's IPv4 address went, a new pod came
        assert counter.set_pods([A4, A6, B6, "10.244.2.10"]) == 0
        assert counter.read() == {A4: entry(both(2, 0), both(2, 0)), A6: entry(both(0, 1), both(0, 1)),
                                  B6: entry(both(0, 1), both(0, 1)), "10.244.2.10": (0, 0, 0, 0)}
        ping(a, B4, 1)  # b's IPv4 address is no pod's now: counted for a, for no one on b's side
        assert counter.read()[A4] == entry(both(3, 0), both(3, 0))
        assert B4 not in counter.read()
        with pytest.raises(EbpfError, match="not an IP address"):
            counter.set_pods([A4, "pod-a"])
    with InternalCounter(os.path.join(bpffs, "small"), netns=lab.node, max_entries=2) as small:
        small.set_pods([A4, B4])
        with pytest.raises(EbpfError, match="3 pod addresses do not fit .* 2 entries"):
            small.set_pods([A4, B4, A6])
        assert set(small.read()) == {A4, B4}


@root
@pytest.mark.parametrize("way", WAYS)
def test_an_agent_with_only_its_pods_capabilities_adopts_what_is_attached(bpffs, lab, way):
    """The agent's pod has NET_ADMIN, NET_RAW and BPF, not SYS_ADMIN: it cannot open a running program by its id,
    so it tells its own by the pinned programs; a restart under those capabilities changes nothing."""
    pin_dir = os.path.join(bpffs, "netagent")
    started(bpffs, lab, attach_by=way, gate_mark=MARK).close()
    code = ("import sys; from tc.ebpf import InternalCounter; "
            f"c = InternalCounter({pin_dir!r}, attach_by={way!r}, gate_mark={MARK}); c.set_networks({NETS!r}); "
            f"print(c.set_pods({PODS!r}), c.attach({DEVICES!r}), c.gated)")
    # in the node's namespace as the agent runs (entering one needs CAP_SYS_ADMIN), then without it
    run = subprocess.run(["ip", "netns", "exec", lab.node, "setpriv", "--bounding-set=-all,+net_admin,+net_raw,+bpf",
                          "--inh-caps=-all",
                          "--no-new-privs", "--", sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    gated = "{'veth-a': None, 'veth-b': None}" if way == "tcx" else "{}"
    assert run.stdout.strip() == f"0 0 {gated}", run.stdout + run.stderr
    ebpf.remove_counting(DEVICES, netns=lab.node)
    ebpf.unpin_dir(pin_dir)


@root
def test_the_pin_of_a_gone_devices_link_is_removed(bpffs, lab):
    """A pod's device goes with its pod, and its links' programs with it; their pins are left to the next attach."""
    with started(bpffs, lab, attach_by="tcx") as counter:
        pins = sorted(n for n in os.listdir(counter.pin_dir) if n.startswith("link-"))
        assert len(pins) == 4
        gone = socket.if_nametoindex  # (resolved in the lab's namespace below)
        with nlwire.in_netns(lab.node):
            b = gone("veth-b")
        sh("ip link del veth-b", lab.node)
        assert counter.attach(["veth-a"]) == 2  # the two pins of veth-b's links
        assert sorted(n for n in os.listdir(counter.pin_dir) if n.startswith("link-")) == [
            p for p in pins if not p.startswith(f"link-{b}-")]
        counter.unpin()


@root
@pytest.mark.parametrize("way", WAYS)
def test_detach_removes_only_what_is_ours_and_a_clsact_nobody_else_uses(bpffs, lab, way):
    """The download redirect's pref (0xC000) on a pod device's egress stands for another netagent
    filter: a classic-BPF filter there (this kernel has no gact for `matchall action pass`)."""
    other = "tc filter add dev veth-a egress pref 0xc000 bpf bytecode '1,6 0 0 0'"
    sh(f"tc qdisc add dev veth-a clsact && {other}", lab.node)
    with started(bpffs, lab, attach_by=way) as counter:
        assert counter.attach([*DEVICES, "veth-gone"]) == 0  # a device that is not there: nothing to do
        removed = counter.detach([*DEVICES, "veth-gone"])
        if way == "tc":
            assert sorted(removed) == ["clsact veth-b", "filter veth-a egress pref 0xc001",
                                       "filter veth-a ingress pref 0xc001", "filter veth-b egress pref 0xc001",
                                       "filter veth-b ingress pref 0xc001"]
        else:
            assert sorted(removed) == [f"tcx link veth-{d} {hook}" for d in "ab" for hook in ("egress", "ingress")]
        assert counter.detach(DEVICES) == []
        assert ours_soon(lab.node, "veth-a", []) == ours_soon(lab.node, "veth-b", []) == []
        assert "pref 49152 bpf" in sh("tc filter show dev veth-a egress", lab.node)
        assert "clsact" in sh("tc qdisc show dev veth-a", lab.node)
        assert "clsact" not in sh("tc qdisc show dev veth-b", lab.node)
        if way == "tc":
            # another filter at our pref is not ours to replace: the other devices are done, that one named
            sh("tc qdisc add dev veth-b clsact && tc filter add dev veth-b ingress pref 0xc001 bpf bytecode '1,6 0 0 0'",
               lab.node)
            with pytest.raises(EbpfError, match="veth-b ingress: another filter holds pref 0xc001"):
                counter.attach(DEVICES)
            assert ours(lab.node, "veth-a") == attached("tc")
            assert ours(lab.node, "veth-b") == ["tc egress netagent-count-out"]
            counter.detach(DEVICES)
            assert "pref 49153 bpf" in sh("tc filter show dev veth-b ingress", lab.node)  # not ours: still there
            sh("tc filter del dev veth-b ingress pref 0xc001", lab.node)
        # switching the way: what the other way attached goes
        counter.attach(DEVICES)
        other_way = InternalCounter(counter.pin_dir, netns=lab.node, attach_by="tc" if way == "tcx" else "tcx")
        with other_way:
            other_way.set_networks(NETS)
            other_way.attach(DEVICES)
            assert ours_soon(lab.node, "veth-a", attached(other_way.attach_by)) == attached(other_way.attach_by)
            other_way.detach(DEVICES)
        counter.unpin()
    assert "netagent" not in os.listdir(bpffs)  # (a bpffs may hold the kernel's own maps.debug, progs.debug)


MARK = 0x1000  # the shaper's mark bit, as the gate tests it


def seen(ns: str, dev: str) -> int:
    """Packets a filter mirrored to the IFB `dev` (an IFB counts what it receives before it drops a copy
    no redirect sent)."""
    return json.loads(sh(f"ip -s -j link show {dev}", ns))[0]["stats64"]["rx"]["packets"]


@root
def test_the_gate_spares_an_unmarked_packet_the_filters_only_while_it_skips_nobody_elses(bpffs, lab):
    """With a gate, the egress links end the hook for a packet without the mark bit, so the shaper's
    redirect filter (the only other one there) is not run for internal traffic. A filter that is not
    the shaper's (a classic-BPF filter mirroring the test's datagrams to an IFB, standing for somebody else's),
    or a tcx program after ours, turns the gate off on that device at the next attach, and on again
    when it goes. The counts are the same either way."""
    sh("ip link add seen0 type ifb && ip link set seen0 up && tc qdisc add dev veth-b clsact", lab.node)
    # it mirrors the test's datagrams only (IPv4, UDP, port 9; offsets from the Ethernet header): one
    # that mirrored every packet also caught the node's own packets to pod b once the gate was off
    # (neighbour probes; 29 mirrored of 25 sent in one CI run)
    others = ("tc filter {} dev veth-b egress pref 0x100 bpf bytecode "
              "'8,40 0 0 12,21 0 5 2048,48 0 0 23,21 0 3 17,40 0 0 36,21 0 1 9,6 0 0 4294967295,6 0 0 0' "
              "action mirred egress mirror dev seen0")
    with started(bpffs, lab, attach_by="tcx", gate_mark=MARK) as counter:
        assert counter.gated == {"veth-a": None, "veth-b": None}
        assert ours(lab.node, "veth-b") == ["tcx egress na_count_out_g", "tcx ingress na_count_in"]
        sh(others.format("add"), lab.node)  # after the attach: the gate does not know of it yet
        send_udp(lab.pod["a"], A4, B4, 20)
        assert settled(counter.read, {**counter.read(), B4: entry((0, 0), both(20, 0))})[B4] == entry((0, 0), both(20, 0))
        assert seen(lab.node, "seen0") == 0  # unmarked: the hook ended at our program
        sh(f"iptables -t mangle -A POSTROUTING -d {B4} -j MARK --set-xmark {MARK:#x}/{MARK:#x}", lab.node)
        send_udp(lab.pod["a"], A4, B4, 5)
        assert settled(lambda: seen(lab.node, "seen0"), 5) == 5  # marked: the filters after our program run
        sh(f"iptables -t mangle -F POSTROUTING", lab.node)

        assert counter.attach(DEVICES) == 1  # veth-b's egress link now runs the ungated program
        assert counter.gated["veth-a"] is None
        assert counter.gated["veth-b"] == "a tc filter at pref 0x100 on its egress is not netagent's"
        assert ours(lab.node, "veth-b") == attached("tcx")
        send_udp(lab.pod["a"], A4, B4, 20)
        assert settled(lambda: seen(lab.node, "seen0"), 25) == 25
        assert settled(counter.read, {**counter.read(), B4: entry((0, 0), both(45, 0))})[B4] == entry((0, 0), both(45, 0))

        sh(others.format("del").split(" bpf")[0], lab.node)
        assert counter.attach(DEVICES) == 1
        assert counter.gated == {"veth-a": None, "veth-b": None}

        # a tcx program after ours (one that decides nothing) would not see an unmarked packet either
        with nlwire.in_netns(lab.node):
            prog = progs.load(asm.insn(0xB7, 0, 0, 0, -1) + asm.insn(0x95), "other")
            link = syscall.bpf(syscall.BPF_LINK_CREATE, syscall.bpf_attr("=IIII", prog, socket.if_nametoindex("veth-a"),
                                                                           syscall.BPF_TCX[True], 0))
        try:
            assert counter.attach(DEVICES) == 1
            assert counter.gated["veth-a"].startswith("the tcx program ")
            assert counter.gated["veth-a"].endswith(" runs after netagent's")
            assert counter.gated["veth-b"] is None
        finally:
            os.close(link)
            os.close(prog)
        for _ in range(50):  # the kernel releases a closed link a little later
            if counter.attach(DEVICES) and counter.gated["veth-a"] is None:
                break
            time.sleep(0.1)
        assert counter.gated == {"veth-a": None, "veth-b": None}
        counter.detach(DEVICES)
        counter.unpin()


# beyond the node's uplink up0: an internal peer, and an internet host on the far side's loopback
FAR4, FAR6, WAN4, WAN6 = "10.9.0.2", "fd00:9::2", "198.51.100.1", "2001:db8:1::1"
UP_MAC, FAR_MAC = "02:00:00:00:09:01", "02:00:00:00:09:02"


@pytest.fixture
def far(lab):
    """The lab's node with an uplink up0 to a "far" namespace holding FAR4/FAR6 (internal) and WAN4/WAN6
    (internet). Neighbours are static both ways, and the far side sends no ICMPv6 but echo replies
    (no MLD report nor DAD probe lands in a count); one-way datagrams to port 9 are dropped there."""
    with scratch_netns("ebpfw") as ns:
        sh(f"ip link add up0 address {UP_MAC} type veth peer name eth0 address {FAR_MAC} netns {ns} && "
           f"ip link set up0 up && ip addr add 10.9.0.1/24 dev up0 && ip addr add fd00:9::1/64 dev up0 nodad && "
           f"ip neigh add {FAR6} lladdr {FAR_MAC} dev up0 nud permanent && "
           f"ip neigh add {FAR4} lladdr {FAR_MAC} dev up0 nud permanent && "
           f"ip route add {WAN4}/32 via {FAR4} && ip -6 route add {WAN6}/128 via {FAR6}", lab.node)
        sh("ip6tables -A OUTPUT -p icmpv6 --icmpv6-type echo-reply -j ACCEPT && ip6tables -A OUTPUT -p icmpv6 -j DROP && "
           "iptables -A INPUT -p udp --dport 9 -j DROP && ip6tables -A INPUT -p udp --dport 9 -j DROP && "
           f"ip link set lo up && ip link set eth0 up && ip addr add {FAR4}/24 dev eth0 && "
           f"ip addr add {FAR6}/64 dev eth0 nodad && ip addr add {WAN4}/32 dev lo && ip addr add {WAN6}/128 dev lo && "
           f"ip neigh add fd00:9::1 lladdr {UP_MAC} dev eth0 nud permanent && "
           f"ip neigh add 10.9.0.1 lladdr {UP_MAC} dev eth0 nud permanent && "
           "ip route add 10.244.0.0/16 via 10.9.0.1 && ip -6 route add fd00:244::/32 via fd00:9::1", ns)
        yield ns


@root
@pytest.mark.parametrize("way", WAYS)
def test_the_uplinks_count_the_nodes_totals_by_the_far_ends_scope_in_ip_bytes(bpffs, lab, far, way):
    """On the uplink, what leaves for an internal destination is the node's internal egress, and every
    IP packet that arrives for this host its internal or internet ingress by its source; the internet
    egress is left to the rules, and a frame for another host is not counted (it never reaches IP)."""
    a = lab.pod["a"]
    counter = started(bpffs, lab, attach_by=way)
    try:
        assert counter.attach(DEVICES, uplinks=("up0",)) == (3 if way == "tc" else 2)  # (a clsact and) two hooks
        assert ours(lab.node, "up0") == attached(way, uplink=True)
        assert counter.read_node() == {"egress_internal": 0, "ingress_internal": 0, "ingress_internet": 0}
        ping(a, FAR4, 2)  # out and back internal
        ping(a, FAR6, 2)
        ping(a, WAN4, 3)  # out internet (not counted here), back internet
        ping(a, WAN6, 3)
        send_udp(far, FAR4, A4, 4)  # in, internal
        send_udp(far, FAR6, A6, 4)
        send_udp(far, WAN4, A4, 5)  # in, internet
        send_udp(far, WAN6, A6, 5)
        send_udp(lab.node, "10.9.0.1", FAR4, 6)  # the node's own, out internal
        send_udp(lab.node, "10.9.0.1", WAN4, 7)  # ... and out internet: the rules'
        sh(f"{sys.executable} -c \"from scapy.all import Ether, IP, UDP, sendp; "  # for another host's MAC
           f"sendp(Ether(src='{FAR_MAC}', dst='02:00:00:00:77:77') / IP(src='{FAR4}', dst='{A4}') / UDP(dport=9) / "
           "bytes(100), iface='eth0', count=3, verbose=False)\"", far)
        expected = {"egress_internal": both(2 + 6, 2)[0], "ingress_internal": both(2 + 4, 2 + 4)[0],
                    "ingress_internet": both(3 + 5, 3 + 5)[0]}
        assert settled(counter.read_node, expected) == expected
        # the pods' counts are the pod devices' as before: the far peer is internal, the internet host not
        assert counter.read()[A4] == entry(both(2, 0), both(2 + 4, 0))
        # a restarted agent adopts the node's map and its counts, and finds its programs attached
        counter.close()
        counter = InternalCounter(os.path.join(bpffs, "netagent"), netns=lab.node, attach_by=way)
        counter.set_networks(NETS)
        assert counter.read_node() == expected
        assert counter.attach(DEVICES, uplinks=("up0",)) == 0
        # an uplink that is not Ethernet would be misread: named, the others done
        with pytest.raises(EbpfError, match="uplink lo: link type 772 is not Ethernet"):
            counter.attach(DEVICES, uplinks=("up0", "lo"))
        assert ours(lab.node, "lo") == []
        # a device that changes role gets the other role's programs
        assert counter.attach(("up0",), uplinks=()) == 2
        assert ours(lab.node, "up0") == attached(way)
        assert counter.attach((), uplinks=("up0",)) == 2
        assert ours(lab.node, "up0") == attached(way, uplink=True)
        removed = counter.detach([*DEVICES, "up0"])
        assert ({"clsact up0", "filter up0 egress pref 0xc001", "filter up0 ingress pref 0xc001"} if way == "tc" else
                {"tcx link up0 egress", "tcx link up0 ingress"}) <= set(removed)
        assert ours_soon(lab.node, "up0", []) == []
    finally:
        counter.close()
        ebpf.unpin_dir(os.path.join(bpffs, "netagent"))


def link_counts(netns: str, dev: str) -> tuple[int, int]:
    """A device's received (bytes, packets), as its own counters have them."""
    stats = json.loads(sh(f"ip -s -j link show dev {dev}", netns))[0]["stats64"]["rx"]
    return stats["bytes"], stats["packets"]


@root
@pytest.mark.parametrize("family", (4, 6))
def test_an_internet_download_is_counted_in_segments_on_the_pod_and_on_the_uplink(bpffs, lab, far, family):
    """iperf3 from the internet host beyond up0 to pod a: its TSO packets cross up0 and veth-a merged (as
    a NIC's GRO merges a real download). The rules and the devices' own counters see each such packet
    once with one header; the wire carried every segment with its own. The segments map holds, for pod a,
    exactly the headers of the segments beyond each packet's first; the node's internet arrival on up0
    adds the same; with them both equal the download in segments."""
    a = lab.pod["a"]
    wan, pod, header = (WAN4, A4, 20 + 32) if family == 4 else (WAN6, A6, 40 + 32)  # IP + TCP with timestamps
    server = subprocess.Popen(["ip", "netns", "exec", far, "iperf3", "-s", "-1", "-B", wan],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counter = started(bpffs, lab)
    try:
        counter.attach(DEVICES, uplinks=("up0",))
        for _ in range(50):
            if ":5201" in sh("ss -ltnH", far):
                break
            time.sleep(0.1)
        up_before, pod_before = link_counts(lab.node, "up0"), link_counts(a, "eth0")
        result = json.loads(sh(f"iperf3 -c {wan} -R -t 2 -J", a))
        time.sleep(0.5)  # the last segments and the control connection's close
        up_after, pod_after = link_counts(lab.node, "up0"), link_counts(a, "eth0")
        merged_bytes, merged = counter.read_segments()[pod]
        node = counter.read_node()["ingress_internet"]
    finally:
        counter.close()
        ebpf.unpin_dir(os.path.join(bpffs, "netagent"))
        server.kill()
        server.wait()
    mss = result["start"]["tcp_mss_default"]
    # the payload that crossed veth-a lies between what iperf3 received while it counted and what the sender
    # wrote: the receiver stops counting at its timer, the sender at the end message, and what came between
    # (up to ~17 MB at these rates on a loaded box) crossed veth-a uncounted by the receiver
    received, sent = result["end"]["sum_received"]["bytes"], result["end"]["sum_sent"]["bytes"]
    up_bytes, up_packets = up_after[0] - up_before[0], up_after[1] - up_before[1]
    pod_bytes, pod_packets = pod_after[0] - pod_before[0], pod_after[1] - pod_before[1]
    # a retransmitted segment crosses veth-a again but is received once (payload): on a loaded machine a few
    retransmits = int(result["end"].get("sum_sent", {}).get("retransmits") or 0)
    fewest, most = (math.ceil(payload / mss) + retransmits for payload in (received, sent))
    print(f"IPv{family}: {received}-{sent} B payload, {fewest}-{most} segments of {mss} B ({retransmits} "
          f"retransmitted) in {pod_packets} packets; merged: {merged} segments, {merged_bytes} B of headers")
    assert merged > pod_packets, "the download was not merged: the test does not see what it is for"
    assert merged_bytes == merged * header  # each merged segment's IP and TCP headers, exactly
    # the packets that crossed veth-a, with the merged segments' headers: the download as its segments
    counted = pod_bytes - ETH * pod_packets + merged_bytes
    low, high = (payload + retransmits * mss + (segments + 10) * header
                 for payload, segments in ((received, fewest), (sent, most)))
    print(f"counted {counted} B, the download in segments {low}-{high} B")
    assert 0.995 * low <= counted <= 1.005 * high
    # at least the full-sized segments the payload makes (a TSO packet's last one may be short: a few more)
    assert fewest <= pod_packets + merged <= 1.01 * most + 20
    # the node's arrival on up0: its own count of what arrived (per packet) and the same headers
    assert node == up_bytes - ETH * up_packets + merged_bytes


@root
@pytest.mark.parametrize("way", WAYS)
def test_cleanup_without_a_counter_removes_what_a_gone_agent_left(bpffs, lab, tmp_path, way):
    """`netagent cleanup` has no counter: remove_counting needs netlink only (the filters), unpin_dir the path (the
    links, which detach their programs once released, the programs and the maps)."""
    pin_dir = os.path.join(bpffs, "netagent")
    started(bpffs, lab, attach_by=way, gate_mark=MARK).close()  # an agent that went: its programs and maps stay
    assert ebpf.remove_counting(["veth-a"], 0xC000, lab.node) == []  # another pref: not ours
    filters = [f"filter veth-{d} {hook} pref 0xc001" for d in "ab" for hook in ("egress", "ingress")]
    assert sorted(ebpf.remove_counting([*DEVICES, "lo"], netns=lab.node)) == (
        ["clsact veth-a", "clsact veth-b", *filters] if way == "tc" else [])
    assert sh("tc qdisc show dev veth-a; tc qdisc show dev veth-b", lab.node).count("clsact") == 0
    links = [f"tcx link {pin_dir}/{name}" for name in sorted(os.listdir(pin_dir)) if name.startswith("link-")]
    programs = [f"pinned program {pin_dir}/prog-{name}" for name in sorted(  # the gated ones on tcx links only
        name for (_, _, gated), name in progs.PROGRAMS.items() if way == "tcx" or not gated)]
    assert ebpf.unpin_dir(pin_dir) == [*links, *programs, f"pinned map {pin_dir}/internal",
                                       f"pinned map {pin_dir}/node", f"pinned map {pin_dir}/segments",
                                       f"pinned map {pin_dir}/scopebytes", f"pinned map {pin_dir}/nodescopes",
                                       f"pinned map {pin_dir}/scopes4",
                                       f"pinned map {pin_dir}/scopes6", f"directory {pin_dir}"]
    assert len(links) == (4 if way == "tcx" else 0)
    assert ours_soon(lab.node, "veth-a", []) == ours_soon(lab.node, "veth-b", []) == []
    assert ebpf.unpin_dir(pin_dir) == []
    plain = tmp_path / "plain"
    (plain / "internal").mkdir(parents=True)
    assert ebpf.unpin_dir(str(plain)) == [] and (plain / "internal").exists()  # off a bpffs: not ours


@root
def test_unavailable_says_why_and_the_counter_refuses_a_directory_off_bpffs(bpffs, tmp_path):
    before = os.listdir(bpffs)
    assert ebpf.unavailable(os.path.join(bpffs, "netagent")) is None
    assert os.listdir(bpffs) == before  # it created nothing
    plain = str(tmp_path / "plain")
    reason = ebpf.unavailable(plain)
    assert reason and "is not on a bpffs" in reason and "mount -t bpf" in reason
    with pytest.raises(EbpfError, match="is not on a bpffs"):
        InternalCounter(plain)
    assert not os.path.exists(plain)
    assert "cannot be made" in ebpf.unavailable(str(tmp_path / "no" / "such" / "dir"))
    # the agent's pod capabilities (NET_ADMIN, NET_RAW) are not enough for bpf(2)
    code = f"from tc import ebpf; print(ebpf.unavailable({os.path.join(bpffs, 'x')!r}))"
    run = subprocess.run(["setpriv", "--bounding-set=-all,+net_admin,+net_raw", "--inh-caps=-all", "--no-new-privs",
                          "--", sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "bpf(2) refused: EPERM" in run.stdout, run.stdout + run.stderr


@root
def test_the_programs_for_no_networks_and_for_forty_a_family_load(bpffs):
    with InternalCounter(os.path.join(bpffs, "netagent")) as counter:
        assert counter.set_networks(FORTY) is True
        assert counter.set_networks({}) is True


@root
def test_a_program_the_verifier_refuses_is_named_with_the_verifiers_words(bpffs, monkeypatch):
    monkeypatch.setattr(progs, "program", lambda networks, egress, map_fd, **kw: asm.insn(0x95))  # exit, r0 unset
    with InternalCounter(os.path.join(bpffs, "netagent")) as counter:
        with pytest.raises(EbpfError, match=r"(?s)na_count_in failed: .*EACCES.*the verifier said: .*R0 !read_ok"):
            counter.set_networks(NETS)
        with pytest.raises(EbpfError, match="before set_networks"):
            counter.attach(DEVICES)


def one_map(shape, name: bytes, *addresses: str) -> int:
    """A map of this shape (not pinned) holding zeroed entries for these pod addresses."""
    fd = maps.create_map(shape, name)
    words = shape[2] // 8
    for address in addresses:
        key, zero = ctypes.create_string_buffer(maps.key_of(address)), ctypes.create_string_buffer(8 * words * CPUS)
        syscall.bpf(syscall.BPF_MAP_UPDATE_ELEM, syscall.bpf_attr("=IIQQQ", fd, 0, syscall.addr(key), syscall.addr(zero), 0))
    return fd


def entry_of(fd: int, words: int, key: bytes) -> tuple[int, ...]:
    """One entry of a per-CPU map, summed over the CPUs."""
    k, values = ctypes.create_string_buffer(key), (ctypes.c_uint64 * (words * CPUS))()
    syscall.bpf(syscall.BPF_MAP_LOOKUP_ELEM, syscall.bpf_attr("=IIQQ", fd, 0, syscall.addr(k), syscall.addr(values)))
    return tuple(sum(values[i::words]) for i in range(words))


CPUS = maps.possible_cpus()
TS = [("NOP", None), ("NOP", None), ("Timestamp", (1, 2))]  # TCP options as Linux sends them: 12 bytes
PAYLOAD = Raw(bytes(2000))
# both MACs given (scapy would otherwise resolve one, by ARP); the destination is the test run's device's
# (lo, all zeros): a frame for this host, as the uplink's program counts only those
ETHER = {"src": "02:00:00:00:00:01", "dst": "00:00:00:00:00:00"}


# a packet to pod A4/A6 as GRO merged it: (frame, gso_segs) -> the headers of the segments beyond the first
MERGED = {
    "ipv4-tcp": (Ether(**ETHER) / IP(src=INET4, dst=A4) / TCP(options=TS) / PAYLOAD, 5, 4 * (20 + 32)),
    "ipv4-options-tcp": (Ether(**ETHER) / IP(src=INET4, dst=A4, options=[IPOption_NOP()] * 4) / TCP() / PAYLOAD, 3,
                         2 * (24 + 20)),
    "ipv6-tcp": (Ether(**ETHER) / IPv6(src=INET6, dst=A6) / TCP(options=TS) / PAYLOAD, 4, 3 * (40 + 32)),
    "ipv4-udp": (Ether(**ETHER) / IP(src=INET4, dst=A4) / UDP() / PAYLOAD, 3, 2 * (20 + 8)),
    "ipv4-gre": (Ether(**ETHER) / IP(src=INET4, dst=A4) / GRE() / PAYLOAD, 3, 0),  # a tunnel: not parsed, not counted
    "ipv6-extension-header": (Ether(**ETHER) / IPv6(src=INET6, dst=A6) / IPv6ExtHdrHopByHop() / TCP() / PAYLOAD, 3, 0),
    "one-segment": (Ether(**ETHER) / IP(src=INET4, dst=A4) / TCP(options=TS) / PAYLOAD, 1, 0),
    "internal-source": (Ether(**ETHER) / IP(src=B4, dst=A4) / TCP(options=TS) / PAYLOAD, 5, 0),  # counted as internal
}


@root
@pytest.mark.parametrize("case", MERGED)
def test_the_merged_segments_headers_are_read_from_the_packet(case):
    """The pod device's egress program on one packet (BPF_PROG_TEST_RUN, a real kernel, no traffic) made as GRO
    would, gso_segs segments of gso_size: the segments map gets the IP and TCP (or UDP) headers of every
    segment beyond the first, with their options; a tunnel, an IPv6 extension header or one segment add
    nothing, and an internal source's packet is the pods' map's, counted once as before. The uplink's
    ingress program adds the same headers to the node's internet arrival."""
    frame, segs, headers = MERGED[case]
    raw = bytes(frame)
    pod = A6 if IPv6 in frame else A4
    pods = one_map(maps.map_shape(4), maps.MAP_NAME, pod)
    segments = one_map(maps.segments_shape(4), maps.SEGMENTS_MAP_NAME, pod)
    node = maps.create_map(maps.NODE_MAP_SHAPE, maps.NODE_MAP_NAME)
    fds = [pods, segments, node]
    try:
        fds.append(progs.load(progs.program(NETS, True, pods, segments_fd=segments), "na_test_out"))
        fds.append(progs.load(progs.program(NETS, False, node, node=True), "na_test_node_in"))
        assert syscall.run_program(fds[-2], raw, gso_segs=segs, gso_size=500)[0] == progs.TC_ACT_UNSPEC
        assert syscall.run_program(fds[-1], raw, gso_segs=segs, gso_size=500)[0] == progs.TC_ACT_UNSPEC
        assert entry_of(segments, 2, maps.key_of(pod)) == (headers, segs - 1 if headers else 0)
        internal = case == "internal-source"
        assert entry_of(pods, 4, maps.key_of(pod)) == ((0, 0, len(raw) - ETH, 1) if internal else (0, 0, 0, 0))
        index = maps.NODE_INTERNAL if internal else maps.NODE_INTERNET
        assert entry_of(node, 4, struct.pack("=I", index)) == (0, 0, len(raw) - ETH + headers, 1)
    finally:
        for fd in fds:
            os.close(fd)


@root
def test_the_segments_cost_bench_runs_and_judges(capsys, monkeypatch):
    """bench/segments_cost.py's table and verdict (its figures are docs/accounting.md's; not judged here)."""
    monkeypatch.setattr(sys, "argv", ["segments_cost", "--rounds", "2", "--repeat", "1000"])
    assert segments_cost.main() in (0, 1)
    out = capsys.readouterr().out
    assert out.count("| internet, ") == 2 and "| internal |" in out and "verdict: " in out


# -- pure ----------------------------------------------------------------------------------------

def test_keys_are_sixteen_bytes_ipv4_mapped_and_read_back_canonical():
    assert maps.key_of("10.244.0.10") == bytes(10) + b"\xff\xff" + bytes([10, 244, 0, 10])
    assert maps.key_of("fd00:244:0::10") == bytes.fromhex("fd000244000000000000000000000010")
    assert maps.address_of(maps.key_of("10.244.0.10")) == "10.244.0.10"
    assert maps.address_of(maps.key_of("FD00:244:0:0::10")) == "fd00:244::10"
    with pytest.raises(EbpfError, match="not an IP address"):
        maps.key_of("10.244.0.0/24")


@pytest.mark.parametrize("networks,message", [
    ({4: ("0.0.0.0/0",)}, "every address"),
    ({6: ("fd00::/8", "::/0")}, "every address"),
    ({4: ("fd00::/8",)}, "not an IPv4 network"),
    ({5: ("10.0.0.0/8",)}, "neither 4 nor 6"),
    ({4: ("10.0.0.0/33",)}, "not a CIDR"),
])
def test_the_program_refuses_networks_it_cannot_mean(networks, message):
    with pytest.raises(EbpfError, match=message):
        progs.program(networks, False, 3)


def test_the_same_networks_make_the_same_program_and_none_count_nothing():
    one = progs.program({4: ("10.0.0.0/8", "172.16.0.0/12"), 6: ("fd00::/8",)}, True, 3)
    assert one == progs.program({6: ("fd00::/8",), 4: ("172.16.0.1/12", "10.0.0.0/8", "10.0.0.0/8")}, True, 3)
    assert one != progs.program({4: ("10.0.0.0/8", "172.16.0.0/12"), 6: ("fd00::/8",)}, False, 3)
    assert progs.program({}, False, 3) == asm.insn(0xB7, 0, 0, 0, -1) + asm.insn(0x95)  # return TC_ACT_UNSPEC
    assert len(progs.program(FORTY, False, 3)) // 8 < 4096  # the unprivileged limit, for scale
    # the gate is two loads, a test and a jump more at the end, on an egress hook only
    assert len(progs.program(NETS, True, 3, gate=MARK)) == len(progs.program(NETS, True, 3)) + 4 * 8
    assert progs.program({}, True, 3, gate=MARK) != progs.program({}, True, 3)
    with pytest.raises(EbpfError, match="only on an egress hook"):
        progs.program(NETS, False, 3, gate=MARK)
