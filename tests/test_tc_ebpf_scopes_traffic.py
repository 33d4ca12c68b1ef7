"""The scopes counted on real traffic (issue 39's lab Show, the counter's part): pod a in zone A sends to and
receives from a peer in its own zone (the node's address on its subnet), one in zone B (pod b), one in
another region (an address on the node's loopback) and the internet host, with iperf3, TCP and UDP, IPv4
and IPv6; each scope's counter (the pods' map for internal, `scopebytes` for cross-zone and
cross-region) within 2 % of the IP bytes iperf3 moved; the internet host's bytes in no device counter
(the rules and the shaper count them, as before). Run under the traffic lock (flock
/tmp/netagent-traffic.lock)."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from lab.netns import sh
from tc.ebpf import InternalCounter
from tests.test_tc_ebpf_kernel import A4, A6, B4, B6, DEVICES, INET4, INET6, PODS, bpffs, lab  # noqa: F401
from tests.test_tc_ebpf_scopes_kernel import net

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and bpf(2) need root")

REGION4, REGION6 = "10.99.0.1", "fd00:99::1"
NETS = {4: ("10.0.0.0/8",), 6: ("fd00::/8",)}
# the node is in zone A (pod a's subnet); pod b's subnet is zone B; 10.99/16 another region
ENTRIES = {net("10.244.0.0/24"): 0, net("fd00:244::/64"): 0, net("10.244.1.0/24"): 1, net("fd00:244:1::/64"): 1,
           net("10.99.0.0/16"): 2, net("fd00:99::/32"): 2}
# (peer name, family) -> (the peer's address, whose namespace serves it: "node" or "b"), the slot it counts in
PEERS = {("same", 4): ("10.244.0.1", "node"), ("same", 6): ("fd00:244::1", "node"),
         ("zone-b", 4): (B4, "b"), ("zone-b", 6): (B6, "b"),
         ("region", 4): (REGION4, "node"), ("region", 6): (REGION6, "node"),
         ("internet", 4): (INET4, "node"), ("internet", 6): (INET6, "node")}
SCOPE_OF = {"same": "internal", "zone-b": "cross-zone", "region": "cross-region", "internet": "internet"}
IP_UDP = {4: 20 + 8, 6: 40 + 8}


def by_scope(counter: InternalCounter, pod: str) -> dict[str, tuple[int, int]]:
    """scope -> (bytes the pod sent, bytes it received) as the agent reads them (internal: the pods' map minus
    the cross scopes)."""
    total = counter.read()[pod]
    cz_out, cr_out, cz_in, cr_in = counter.read_scopes()[pod]
    return {"internal": (total[0] - cz_out - cr_out, total[2] - cz_in - cr_in), "cross-zone": (cz_out, cz_in),
            "cross-region": (cr_out, cr_in)}


def iperf(lab, server_ns: str, address: str, client_args: str) -> dict:
    server = subprocess.Popen(["ip", "netns", "exec", server_ns, "iperf3", "-s", "-1", "-B", address],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            if ":5201" in sh("ss -ltnuH", server_ns):
                break
            time.sleep(0.1)
        return json.loads(sh(f"iperf3 -c {address} {client_args} -J", lab.pod["a"]))
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_each_scope_is_counted_within_two_percent_of_what_iperf3_moved(bpffs, lab, family, proto):  # noqa: F811
    sh(f"ip addr add {REGION4}/32 dev lo && ip addr add {REGION6}/128 dev lo", lab.node)
    pod = A4 if family == 4 else A6
    with InternalCounter(os.path.join(bpffs, "netagent"), netns=lab.node) as counter:
        counter.set_networks(NETS)
        counter.set_pods(PODS)
        counter.set_scopes(ENTRIES)
        counter.attach(DEVICES)
        rows = []
        for peer in ("same", "zone-b", "region", "internet"):
            address, where = PEERS[(peer, family)]
            server_ns = lab.node if where == "node" else lab.pod["b"]
            for reverse in (False, True):
                before = by_scope(counter, pod)
                args = ("-t 1" if proto == "tcp" else f"-u -b 50M -l 1200 -t 1") + (" -R" if reverse else "")
                result = iperf(lab, server_ns, address, args)
                time.sleep(0.3)  # the last segments through the device
                after = by_scope(counter, pod)
                end = result["end"]
                if proto == "tcp":
                    moved = end["sum_received"]["bytes"]  # payload; the counter adds one header per GSO packet
                else:
                    s = end["sum"]
                    moved = s["bytes"] + (s["packets"] - (s.get("lost_packets", 0) if reverse else 0)) * IP_UDP[family]
                side = 1 if reverse else 0
                delta = {scope: after[scope][side] - before[scope][side] for scope in after}
                rows.append((peer, "in" if reverse else "out", moved, delta))
    for peer, way, moved, delta in rows:
        scope = SCOPE_OF[peer]
        print(f"IPv{family} {proto} {way} {peer}: iperf3 {moved} B, counted {delta}")
        if scope == "internet":
            assert all(v < 0.01 * moved for v in delta.values()), (peer, way, delta)  # no device counter's
            continue
        assert abs(delta[scope] - moved) <= 0.02 * moved, (peer, way, moved, delta)
        assert all(v < 0.01 * moved for s, v in delta.items() if s != scope), (peer, way, delta)
