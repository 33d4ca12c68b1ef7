"""The node's totals by the far end's scope on a real kernel (issue 39): the uplink's programs look an
internal packet's far address up in the scopes' tries, as the pods' programs do, and add a cross-zone or
cross-region packet's bytes to the node's scope map beside the node map's internal count.

Real packets (pings and one-way UDP datagrams of known sizes) cross the uplink up0 of
tests/test_tc_ebpf_kernel.py's lab, to and from peers beyond it in this node's zone, in another zone,
in another region and on the internet, IPv4 and IPv6; each scope's count must be exact, and the node
map's figures those it counted before (the scopes only split its internal count). The namespaces and
the bpffs are the test's own and go after it, also after a failure; nothing runs in the root network
namespace. A frame run through the programs by BPF_PROG_TEST_RUN shows that an internet packet is not
looked up."""
from __future__ import annotations

import ipaddress
import os

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from lab.netns import bpf_filesystem, sh
from tc import ebpf
from tc.ebpf import InternalCounter, maps, syscall
from tc.ebpf import programs as progs
from tests.test_tc_ebpf_kernel import (  # noqa: F401 (bpffs, far, lab: fixtures)
    A4, A6, DEVICES, FAR4, FAR6, NETS, WAN4, WAN6, WAYS, attached, both, bpffs, far, lab, ours, ping, send_udp, settled,
    started)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and bpf(2) need root")

# beyond up0, on the far side's loopback: a peer in another zone and one in another region (both in the
# internal 10/8 and fd00::/8); FAR4/FAR6 (the far side's address on up0's subnet) is in this node's zone
ZONE4, ZONE6, REGION4, REGION6 = "10.9.1.1", "fd00:9:1::1", "10.9.2.1", "fd00:9:2::1"
ENTRIES = {ipaddress.ip_network(n): sid for n, sid in (
    ("10.9.0.0/24", 0), ("10.9.1.0/24", 1), ("10.9.2.0/24", 2),
    ("fd00:9::/64", 0), ("fd00:9:1::/64", 1), ("fd00:9:2::/64", 2))}
# peer -> its (IPv4, IPv6) addresses; each scope gets its own packet counts below, so a byte in the wrong slot shows
PEERS = {"internal": (FAR4, FAR6), "cross-zone": (ZONE4, ZONE6), "cross-region": (REGION4, REGION6),
         "internet": (WAN4, WAN6)}
PINGS = {"internal": 1, "cross-zone": 2, "cross-region": 3, "internet": 1}  # pod a -> peer and back, per family
IN = {"internal": 2, "cross-zone": 3, "cross-region": 4, "internet": 5}  # peer -> pod a, per family
OUT = {"internal": 3, "cross-zone": 4, "cross-region": 5, "internet": 2}  # the node's own -> peer, per family
CROSS = ("cross-zone", "cross-region")


def traffic(lab, far: str) -> None:
    """PINGS, IN and OUT, both families, across up0."""
    for scope, addresses in PEERS.items():
        for peer in addresses:
            ping(lab.pod["a"], peer, PINGS[scope])
            send_udp(far, peer, A4 if ":" not in peer else A6, IN[scope])
            send_udp(lab.node, "10.9.0.1" if ":" not in peer else "fd00:9::1", peer, OUT[scope])


def node_scopes(counter: InternalCounter) -> tuple[dict[str, int], tuple[int, int, int, int]]:
    return counter.read_node(), counter.read_node_scopes()


@pytest.mark.parametrize("way", WAYS)
def test_the_uplinks_count_the_nodes_cross_zone_and_cross_region_bytes_exactly(bpffs, lab, far, way):  # noqa: F811
    sh(f"ip addr add {ZONE4}/32 dev lo && ip addr add {REGION4}/32 dev lo && "
       f"ip addr add {ZONE6}/128 dev lo && ip addr add {REGION6}/128 dev lo", far)
    sh(f"ip route add {ZONE4}/32 via {FAR4} && ip route add {REGION4}/32 via {FAR4} && "
       f"ip -6 route add {ZONE6}/128 via {FAR6} && ip -6 route add {REGION6}/128 via {FAR6}", lab.node)
    # what the uplink counts of each scope's traffic, as (egress, ingress) IP bytes: what leaves for an internal
    # destination (the internet egress is the rules'), what arrives by its source
    each = {s: (both(PINGS[s] + OUT[s], PINGS[s] + OUT[s])[0] if s != "internet" else 0,
                both(PINGS[s] + IN[s], PINGS[s] + IN[s])[0]) for s in PEERS}
    internal = {d: sum(each[s][d] for s in ("internal", *CROSS)) for d in (0, 1)}
    counter = started(bpffs, lab, attach_by=way)
    try:
        counter.attach(DEVICES, uplinks=("up0",))
        assert ours(lab.node, "up0") == attached(way, uplink=True)
        # without a description: the node map's counts as ever, nothing by scope
        traffic(lab, far)
        before = {"egress_internal": internal[0], "ingress_internal": internal[1],
                  "ingress_internet": each["internet"][1]}
        assert settled(lambda: node_scopes(counter), (before, (0, 0, 0, 0))) == (before, (0, 0, 0, 0))
        # described: the tries change in place, the programs stay; the same traffic again
        loaded = {k: v[1] for k, v in counter.progs.items()}
        assert counter.set_scopes(ENTRIES) == len(ENTRIES)
        assert counter.set_networks(NETS) is False and {k: v[1] for k, v in counter.progs.items()} == loaded
        traffic(lab, far)
        after = {k: 2 * v for k, v in before.items()}  # the node map counts every internal byte, as before
        cross = (each["cross-zone"][0], each["cross-region"][0], each["cross-zone"][1], each["cross-region"][1])
        assert settled(lambda: node_scopes(counter), (after, cross)) == (after, cross)
        # the sum over the scopes is the node map's internal count: same zone + cross-zone + cross-region
        assert after["egress_internal"] - cross[0] - cross[1] == internal[0] + each["internal"][0]
        assert after["ingress_internal"] - cross[2] - cross[3] == internal[1] + each["internal"][1]
        # a restarted agent adopts the node's scope map with its counts (and the node map with its own)
        counter.close()
        counter = InternalCounter(os.path.join(bpffs, "netagent"), netns=lab.node, attach_by=way)
        assert node_scopes(counter) == (after, cross)
        counter.set_networks(NETS)
        assert counter.attach(DEVICES, uplinks=("up0",)) == 0  # the same programs, still attached
        counter.detach([*DEVICES, "up0"])
    finally:
        counter.close()
        ebpf.unpin_dir(os.path.join(bpffs, "netagent"))


# both MACs given; the destination is the test run's device's (lo, all zeros): a frame for this host
ETHER = {"src": "02:00:00:00:00:01", "dst": "00:00:00:00:00:00"}


def frame(src: str, dst: str) -> bytes:
    ip = IPv6(src=src, dst=dst) if ":" in src else IP(src=src, dst=dst)
    return bytes(Ether(**ETHER) / ip / UDP(sport=1000, dport=2000) / Raw(bytes(100)))


def test_the_uplinks_look_up_internal_packets_only():
    """A trie entry that no internal network holds (the agent never writes one: every described CIDR is
    internal) still gives an internet packet no scope: the uplink looks up only what it counts as internal.
    BPF_PROG_TEST_RUN, no traffic."""
    with bpf_filesystem() as root, InternalCounter(os.path.join(root, "na")) as c:
        c.set_networks(NETS)
        c.set_scopes({**ENTRIES, ipaddress.ip_network("192.0.2.0/24"): 1, ipaddress.ip_network("2001:db8::/32"): 2})
        node_in, node_out = c.progs[(True, False, False)][0], c.progs[(True, True, False)][0]
        sizes = []
        for src, dst, prog in (("192.0.2.7", A4, node_in), ("2001:db8::7", A6, node_in),  # internet: no scope
                               (ZONE4, A4, node_in), (A6, REGION6, node_out)):  # cross-zone in, cross-region out
            raw = frame(src, dst)
            assert syscall.run_program(prog, raw)[0] == progs.TC_ACT_UNSPEC
            sizes.append(len(raw) - 14)
        assert c.read_node_scopes() == (0, sizes[3], sizes[2], 0)
        assert c.read_node() == {"egress_internal": sizes[3], "ingress_internal": sizes[2],
                                 "ingress_internet": sizes[0] + sizes[1]}
        # the node map keeps the shape an earlier agent pinned it with (the scope bytes have their own map)
        assert syscall.map_info(c.node_map_fd)[2:] == maps.NODE_MAP_SHAPE[1:]
