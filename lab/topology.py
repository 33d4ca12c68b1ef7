"""A throwaway network of namespaces that looks like a cloud node: for tests, benchmarks and the demo.

    pod ns ──veth──┐                         ┌── internal peer 10.0.0.100 / fd00::100
    pod ns ──veth──┤ node ns ─eth0─┐         │
                   (native /32 routes)  fabric ns: br0 10.0.0.1 ──┤
    node 2 ...                     ┘         └── inet0 203.0.113.1 ── internet ns 203.0.113.10
                                                                            2001:db8:ffff::10

The internal peer and the internet host are reached through the *same* node uplink
(eth0), so only the classifier decides what is shaped. Pods use documentation-free
private ranges inside the namespaces; the "internet" uses documentation ranges. No
namespace has a route out of the sandbox: the fabric has no default route.
Every name starts with a per-lab prefix, and `close()` removes all of it (also on error).
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .netns import LabError, run

INTERNET_V4 = "203.0.113.10"
INTERNET_V6 = "2001:db8:ffff::10"
PEER_V4 = "10.0.0.100"
PEER_V6 = "fd00::100"
INTERNAL_CIDRS = ("10.0.0.0/8", "fd00::/8")
UPLINK = "eth0"
GATEWAY_V4 = "10.0.0.1"  # the fabric bridge: every node's default gateway
GATEWAY_V6 = "fd00::1"
FABRIC_V6 = "fd00::/64"
BRIDGE = "cbr0"  # the node's pod bridge in Lab(pod_network="bridge")


@dataclass
class Pod:
    name: str  # "namespace/name"-free short name, e.g. "n0p1"
    netns: str
    ip4: str
    ip6: str  # "" in an IPv4-only lab (Lab(ipv6=False))
    node_veth: str


@dataclass
class Node:
    name: str
    netns: str
    ip4: str
    ip6: str
    pod_cidr4: str
    pod_cidr6: str
    pods: list[Pod] = field(default_factory=list)
    uplink: str = UPLINK


class Lab:
    """Build with `Lab(nodes=1, pods_per_node=2)`; use as a context manager."""

    def __init__(self, nodes: int = 1, pods_per_node: int = 2, prefix: str | None = None, ipv6: bool = True,
                 pod_network: str = "routed"):
        """`pod_network`: "routed" (one veth per pod with a /32 route, native routing) or "bridge"
        (the pods' veths are ports of a bridge `cbr0` on the node holding the pod subnet's gateway
        address, as the CNI bridge plugin and flannel build it)."""
        if not 1 <= nodes <= 50 or not 0 <= pods_per_node <= 200:
            raise LabError("lab size out of range (1..50 nodes, 0..200 pods per node)")
        if pod_network not in ("routed", "bridge"):
            raise LabError(f"pod_network {pod_network!r} must be 'routed' or 'bridge'")
        self.pod_network = pod_network
        self.prefix = prefix or f"na{secrets.token_hex(2)}"
        self.ipv6 = ipv6
        self.fabric = f"{self.prefix}-fab"
        self.internet = f"{self.prefix}-inet"
        self.peer = f"{self.prefix}-peer"
        self.nodes: list[Node] = []
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._n_nodes, self._n_pods = nodes, pods_per_node

    # -- lifecycle ------------------------------------------------------------
    def __enter__(self) -> "Lab":
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> str:
        run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        run("ip link set lo up", name)
        for knob in ("net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"):
            run(["sysctl", "-qw", knob], name, check=False)
        return name

    def build(self) -> None:
        fab, inet, peer = self._netns(self.fabric), self._netns(self.internet), self._netns(self.peer)
        run("ip link add br0 type bridge", fab)
        run(f"ip addr add {GATEWAY_V4}/24 dev br0", fab)
        self._run6(f"ip -6 addr add {GATEWAY_V6}/64 dev br0 nodad", fab)
        run("ip link set br0 up", fab)
        run("sysctl -qw net.ipv4.ip_forward=1", fab)
        run("sysctl -qw net.ipv6.conf.all.forwarding=1", fab)
        # internet host behind the fabric's "gateway"
        run(["ip", "link", "add", "inet0", "netns", fab, "type", "veth", "peer", "name", "eth0", "netns", inet])
        run("ip addr add 203.0.113.1/24 dev inet0", fab)
        self._run6("ip -6 addr add 2001:db8:ffff::1/64 dev inet0 nodad", fab)
        run("ip link set inet0 up", fab)
        run(f"ip addr add {INTERNET_V4}/24 dev eth0", inet)
        self._run6(f"ip -6 addr add {INTERNET_V6}/64 dev eth0 nodad", inet)
        run("ip link set eth0 up", inet)
        run("ip route add 10.0.0.0/8 via 203.0.113.1", inet)
        self._run6("ip -6 route add fd00::/8 via 2001:db8:ffff::1", inet)
        # internal peer on the VPC bridge
        self._bridge_port(peer, "peer", f"{PEER_V4}/24", f"{PEER_V6}/64")
        run(f"ip route add 10.244.0.0/16 via {GATEWAY_V4}", peer)
        self._run6(f"ip -6 route add fd00:244::/32 via {GATEWAY_V6}", peer)
        for n in range(self._n_nodes):
            self._add_node(n)

    def _run6(self, cmd: str, netns: str) -> None:
        if self.ipv6:
            run(cmd, netns)

    def _bridge_port(self, ns: str, port: str, ip4: str, ip6: str) -> None:
        run(["ip", "link", "add", port, "netns", self.fabric, "type", "veth", "peer", "name", UPLINK, "netns", ns])
        run(f"ip link set {port} master br0 up", self.fabric)
        run(f"ip addr add {ip4} dev {UPLINK}", ns)
        self._run6(f"ip -6 addr add {ip6} dev {UPLINK} nodad", ns)
        run(f"ip link set {UPLINK} up", ns)

    def _add_node(self, n: int) -> None:
        ns = self._netns(f"{self.prefix}-n{n}")
        node = Node(
            name=f"node{n}",
            netns=ns,
            ip4=f"10.0.0.{10 + n}",
            ip6=f"fd00::{10 + n:x}" if self.ipv6 else "",
            pod_cidr4=f"10.244.{n}.0/24",
            pod_cidr6=str(ipaddress.ip_network(f"fd00:244:{n:x}::/64")),  # canonical text, as the kernel prints it
        )
        # The node's IPv6 uplink address is a /128 plus an on-link route: a forwarding node
        # with fd00::a/64 would own the subnet-router anycast fd00:: and swallow packets to
        # the first address of the internal CIDR instead of sending them out of the uplink.
        self._bridge_port(ns, f"n{n}", f"{node.ip4}/24", f"{node.ip6}/128")
        self._run6(f"ip -6 route add {FABRIC_V6} dev {UPLINK}", ns)
        # default route only towards the fabric, which itself has none: nothing leaves the sandbox
        run(f"ip route add default via {GATEWAY_V4}", ns)
        self._run6(f"ip -6 route add default via {GATEWAY_V6}", ns)
        # 10.0.0.0 is on the uplink's /24: without this it is never resolved (ARP) and never
        # leaves; through the gateway it does, like every other internal destination
        run(f"ip route add 10.0.0.0/32 via {GATEWAY_V4}", ns)
        self._run6(f"ip -6 route add fd00::/128 via {GATEWAY_V6}", ns)
        for knob in ("net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"):
            run(["sysctl", "-qw", knob], ns)
        # SNAT to the node address for anything leaving the VPC, as a cloud node does
        run(f"iptables -t nat -A POSTROUTING -s {node.pod_cidr4} ! -d 10.0.0.0/8 -o {UPLINK} -j MASQUERADE", ns)
        self._run6(f"ip6tables -t nat -A POSTROUTING -s {node.pod_cidr6} ! -d fd00::/8 -o {UPLINK} -j MASQUERADE", ns)
        # the fabric routes each node's pod CIDR to it (native routing, no overlay)
        run(f"ip route add {node.pod_cidr4} via {node.ip4}", self.fabric)
        self._run6(f"ip -6 route add {node.pod_cidr6} via {node.ip6}", self.fabric)
        for other in self.nodes:
            run(f"ip route add {other.pod_cidr4} via {other.ip4}", ns)
            run(f"ip route add {node.pod_cidr4} via {node.ip4}", other.netns)
            self._run6(f"ip -6 route add {other.pod_cidr6} via {other.ip6}", ns)
            self._run6(f"ip -6 route add {node.pod_cidr6} via {node.ip6}", other.netns)
        self.nodes.append(node)
        if self.pod_network == "bridge":
            run(f"ip link add {BRIDGE} type bridge", ns)
            run(f"ip addr add {_first(node.pod_cidr4)} dev {BRIDGE}", ns)
            self._run6(f"ip -6 addr add {_first(node.pod_cidr6)} dev {BRIDGE} nodad", ns)
            run(f"ip link set {BRIDGE} up", ns)
        for k in range(self._n_pods):
            self.add_pod(node)

    def add_pod(self, node: Node) -> Pod:
        k = len(node.pods)
        n = self.nodes.index(node)
        pns = self._netns(f"{self.prefix}-n{n}p{k}")
        ip6 = str(ipaddress.ip_address(f"fd00:244:{n:x}::{10 + k:x}")) if self.ipv6 else ""
        pod = Pod(f"n{n}p{k}", pns, f"10.244.{n}.{10 + k}", ip6, f"vp{k}")
        run(["ip", "link", "add", pod.node_veth, "netns", node.netns, "type", "veth", "peer", "name", "eth0", "netns", pns])
        if self.pod_network == "bridge":
            gw4, gw6 = (_first(c).split("/")[0] for c in (node.pod_cidr4, node.pod_cidr6))
            run(f"ip addr add {pod.ip4}/24 dev eth0", pns)
            self._run6(f"ip -6 addr add {pod.ip6}/64 dev eth0 nodad", pns)
            run("ip link set eth0 up", pns)
            run(f"ip route add default via {gw4}", pns)
            self._run6(f"ip -6 route add default via {gw6}", pns)
            run(f"ip link set {pod.node_veth} master {BRIDGE} up", node.netns)
            node.pods.append(pod)
            return pod
        run(f"ip addr add {pod.ip4}/32 dev eth0", pns)
        self._run6(f"ip -6 addr add {pod.ip6}/128 dev eth0 nodad", pns)
        run("ip link set eth0 up", pns)
        run("ip route add 169.254.1.1 dev eth0 scope link", pns)
        run("ip route add default via 169.254.1.1 dev eth0", pns)
        run(f"sysctl -qw net.ipv4.conf.{pod.node_veth}.proxy_arp=1", node.netns)
        # answer at once: proxy ARP replies are otherwise delayed up to 0.8 s (neigh proxy_delay)
        run(f"sysctl -qw net.ipv4.neigh.{pod.node_veth}.proxy_delay=0", node.netns)
        self._run6(f"ip -6 addr add fe80::1/64 dev {pod.node_veth} nodad", node.netns)
        run(f"ip link set {pod.node_veth} up", node.netns)
        run(f"ip route add {pod.ip4}/32 dev {pod.node_veth}", node.netns)
        self._run6(f"ip -6 route add {pod.ip6}/128 dev {pod.node_veth}", node.netns)
        self._run6(f"ip -6 route add default via fe80::1 dev eth0", pns)
        node.pods.append(pod)
        return pod

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self._procs.clear()
        for ns in reversed(self._namespaces):
            # kill anything still running inside (iperf3, agents) before the namespace goes
            pids = run(["ip", "netns", "pids", ns], check=False).split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run(["ip", "netns", "del", ns], check=False)
        self._namespaces.clear()

    # -- processes and traffic -------------------------------------------------
    def spawn(self, netns: str, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", netns, *argv], start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def iperf_server(self, netns: str, port: int) -> subprocess.Popen:
        p = self.spawn(netns, ["iperf3", "-s", "-p", str(port)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(netns, port)
        return p

    def iperf(self, netns: str, dst: str, port: int, seconds: float = 5, udp_bitrate: str | None = None,
              reverse: bool = False, extra: list[str] | None = None) -> dict:
        argv = ["iperf3", "-c", dst, "-p", str(port), "-t", str(seconds), "-J"]
        if udp_bitrate:
            argv += ["-u", "-b", udp_bitrate, "-l", "1400"]
        if reverse:
            argv += ["-R"]
        argv += extra or []
        out = run(argv, netns, timeout=seconds + 30)
        return json.loads(out)

    def iperf_async(self, netns: str, dst: str, port: int, seconds: float = 5, udp_bitrate: str | None = None,
                    extra: list[str] | None = None) -> subprocess.Popen:
        argv = ["iperf3", "-c", dst, "-p", str(port), "-t", str(seconds), "-J"]
        if udp_bitrate:
            argv += ["-u", "-b", udp_bitrate, "-l", "1400"]
        argv += extra or []
        return self.spawn(netns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


    def udp_flood(self, netns: str, dst: str, port: int, bitrate: float, seconds: float = 5) -> subprocess.Popen:
        """A paced UDP GSO flood (lab.udpflood) of 1400-byte datagrams; its stdout is one JSON line."""
        argv = [sys.executable, "-m", "lab.udpflood", dst, str(port), str(bitrate), str(seconds)]
        return self.spawn(netns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


    def udp_burst(self, netns: str, dst: str, port: int) -> dict:
        """One 61,600-byte UDP GSO packet from `netns` (lab.udpflood --burst); waits for it to be sent."""
        argv = [sys.executable, "-m", "lab.udpflood", "--burst", dst, str(port)]
        p = self.spawn(netns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out, err = p.communicate(timeout=30)
        if p.returncode != 0:
            raise LabError(f"udp burst from {netns} failed ({p.returncode}): {err.strip()}")
        return json.loads(out)

    def download_flood(self, pod_netns: str, server_netns: str, dst: str, port: int, bitrate: float,
                       seconds: float = 5) -> subprocess.Popen:
        """A paced UDP GSO flood from `server_netns` to a pod (through the node's NAT): the server
        waits on `port`, the pod's sink sends it one datagram from its socket, the server floods
        that socket. Returns the server's Popen (stdout: one JSON line, as `udp_flood`)."""
        cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        server = self.spawn(server_netns, [sys.executable, "-m", "lab.udpflood", "--reply", str(port), str(bitrate),
                                           str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        deadline = time.monotonic() + 10
        while not run(["ss", "-Hlun", f"sport = :{port}"], server_netns, check=False).strip():
            if time.monotonic() > deadline:
                raise LabError(f"the flood server in {server_netns} did not bind port {port}")
            time.sleep(0.05)
        self.spawn(pod_netns, [sys.executable, "-m", "lab.udpflood", "--sink", dst, str(port), str(seconds + 1)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        return server


def _first(cidr: str) -> str:
    """The first host of a subnet with its prefix length: the bridge's (gateway's) address."""
    net = ipaddress.ip_network(cidr)
    return f"{net.network_address + 1}/{net.prefixlen}"


def _wait_listening(netns: str, port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = run(["ss", "-Hltn", f"sport = :{port}"], netns, check=False)
        if out.strip():
            return
        time.sleep(0.05)
    raise LabError(f"iperf3 server in {netns} did not listen on port {port} within {timeout}s")
