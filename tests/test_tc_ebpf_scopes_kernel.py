"""The counter programs' scope lookup in the real kernel (issue 39): crafted frames run by
BPF_PROG_TEST_RUN through the programs an InternalCounter loads (no device, no traffic), IPv4 and IPv6,
both directions; a changed description moves a CIDR between scopes without reloading a program; the
pods' map keeps its shape (an upgrade resets nothing)."""
from __future__ import annotations

import ipaddress
import os

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from lab.netns import bpf_filesystem
from tc.ebpf import InternalCounter, maps, syscall
from tc.ebpf import programs as progs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bpf(2) needs root")

POD4, POD6 = "10.244.0.10", "fd00:244::10"
# internal networks: the pods' and the described zones and region (every described CIDR is internal)
NETS = {4: ("10.0.0.0/8",), 6: ("fd00::/8",)}
SAME4, ZONE_B4, REGION4, INET4 = "10.1.0.5", "10.2.0.5", "10.3.0.5", "192.0.2.1"
SAME6, ZONE_B6, REGION6, INET6 = "fd01::5", "fd02::5", "fd03::5", "2001:db8::1"
CROSS_ZONE, CROSS_REGION, INTERNAL = 1, 2, 0  # core.scopes.SCOPE_IDS


def net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


# node in zone A: 10.1/16 its own zone, 10.2/16 zone B, 10.3/16 another region (and the v6 twins)
ENTRIES = {net("10.1.0.0/16"): INTERNAL, net("10.2.0.0/16"): CROSS_ZONE, net("10.3.0.0/16"): CROSS_REGION,
           net("fd01::/16"): INTERNAL, net("fd02::/16"): CROSS_ZONE, net("fd03::/16"): CROSS_REGION}


def frame(src: str, dst: str, payload: int = 100) -> bytes:
    ip = IPv6(src=src, dst=dst) if ":" in src else IP(src=src, dst=dst)
    return bytes(Ether() / ip / UDP(sport=1000, dport=2000) / Raw(b"x" * payload))


@pytest.fixture
def counter():
    with bpf_filesystem() as root, InternalCounter(os.path.join(root, "na")) as c:
        c.set_networks(NETS)
        c.set_pods([POD4, POD6])
        yield c


def send(c: InternalCounter, pod: str, peer: str) -> int:
    """The pod sends one frame to `peer` (its device's ingress program) -> the IP bytes."""
    raw = frame(pod, peer)
    assert syscall.run_program(c.progs[(False, False, False)][0], raw)[0] == progs.TC_ACT_UNSPEC
    return len(raw) - 14


def receive(c: InternalCounter, pod: str, peer: str) -> int:
    raw = frame(peer, pod)
    assert syscall.run_program(c.progs[(False, True, False)][0], raw)[0] == progs.TC_ACT_UNSPEC
    return len(raw) - 14


@pytest.mark.parametrize("family", [4, 6])
def test_each_packet_is_counted_in_its_far_ends_scope_beside_the_pods_internal_count(counter, family):
    pod, same, zone_b, region, inet = ((POD4, SAME4, ZONE_B4, REGION4, INET4) if family == 4
                                       else (POD6, SAME6, ZONE_B6, REGION6, INET6))
    assert counter.set_scopes(ENTRIES) == len(ENTRIES)
    sent = {p: send(counter, pod, p) for p in (same, zone_b, region, inet)}
    got = {p: receive(counter, pod, p) for p in (same, zone_b, zone_b, region, inet)}
    sent_internal = sent[same] + sent[zone_b] + sent[region]  # the pods' map: every internal byte, as before
    received_internal = got[same] + 2 * got[zone_b] + got[region]
    assert counter.read()[pod] == (sent_internal, 3, received_internal, 4)
    assert counter.read_scopes()[pod] == (sent[zone_b], sent[region], 2 * got[zone_b], got[region])


def test_a_cidr_moved_between_zones_is_counted_in_its_new_scope_without_reloading_a_program(counter):
    counter.set_scopes(ENTRIES)
    loaded = {k: v[1] for k, v in counter.progs.items()}
    first = send(counter, POD4, ZONE_B4)
    # 10.2.0.0/17 joins this node's zone: a longer prefix in the trie; the rest of 10.2/16 stays zone B's
    moved = {**ENTRIES, net("10.2.0.0/17"): INTERNAL}
    assert counter.set_scopes(moved) == 1
    assert counter.set_networks(NETS) is False and {k: v[1] for k, v in counter.progs.items()} == loaded
    send(counter, POD4, ZONE_B4)
    later = send(counter, POD4, "10.2.200.1")
    assert counter.read_scopes()[POD4] == (first + later, 0, 0, 0)
    # and back; a removed description leaves only internal and internet, as without scopes
    assert counter.set_scopes(ENTRIES) == 1
    again = send(counter, POD4, ZONE_B4)
    assert counter.set_scopes({}) == len(ENTRIES)
    send(counter, POD4, REGION4)
    assert counter.read_scopes()[POD4] == (first + later + again, 0, 0, 0)


def test_without_a_description_nothing_is_counted_by_scope(counter):
    send(counter, POD4, ZONE_B4)
    receive(counter, POD6, REGION6)
    assert counter.read_scopes() == {POD4: (0, 0, 0, 0), POD6: (0, 0, 0, 0)}
    assert counter.read()[POD4][0] > 0


def test_a_restarted_counter_adopts_the_tries_and_counts_and_the_pods_map_keeps_its_shape():
    with bpf_filesystem() as root:
        pin_dir = os.path.join(root, "na")
        with InternalCounter(pin_dir) as c:
            c.set_networks(NETS)
            c.set_pods([POD4])
            c.set_scopes(ENTRIES)
            sent = send(c, POD4, REGION4)
        assert {"internal", "scopebytes", "scopes4", "scopes6", "segments"} <= set(os.listdir(pin_dir))
        with InternalCounter(pin_dir) as c:
            assert syscall.map_info(c.map_fd)[2:] == maps.map_shape(4096)[1:]  # the pods' map as before issue 39
            # the tries hold what the first agent wrote: the same description writes nothing
            assert c.set_scopes(ENTRIES) == 0
            c.set_networks(NETS)
            assert c.read_scopes()[POD4] == (0, sent, 0, 0)
            assert send(c, POD4, REGION4) == sent
            assert c.read_scopes()[POD4] == (0, 2 * sent, 0, 0)
