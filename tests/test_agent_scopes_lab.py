"""Issue 39's lab Show through the real agent (root; real traffic, under `flock /tmp/netagent-traffic.lock`).

Two lab nodes; `python3 -m netagent run` on node0 only, counting internal bytes on the pods' devices (eBPF),
with a NetworkScopes object and node0's Node (zone-a) among its --from-file files. Pod a (node0) sends to and
receives from a peer in its own zone (node0's address), one in zone-b (pod b on node1), one in another region
(the lab's peer host) and the internet host, UDP of 1400-byte datagrams (so the IP bytes are exact), IPv4 and
IPv6. Asserted:
- each scope's bytes in the agent's /state (what /metrics exports and the reports carry) within 2 % of the IP
  bytes iperf3's receiver got, both ways; the internal flows never shaped (they run at many times the cap);
- the internet upload shaped as before, at the pod's 8M cap (within 5 %), with the scopes described;
- a CIDR moved between scopes (the peer's address from the region into zone-b) under a steady 20M stream:
  not a datagram lost, every byte counted once (the two scopes' sum within 2 % of what the peer got), and
  counted in its new scope within a second of the file's write (the old scope's count stops growing by then).
The counter alone, TCP too: tests/test_tc_ebpf_scopes_traffic.py."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from lab.agentproc import AgentProcess, pod_object, wait_for, write_objects
from lab.netns import bpf_filesystem, require_root
from lab.topology import INTERNET_V4, INTERNET_V6, PEER_V4, PEER_V6, Lab, run
# one pod class capped at 8M (CAP) both ways; 1400-byte datagrams and their headers
from tests.test_agent_accounting_traffic import CAP, DATAGRAM, M, POLICY, UDP_HEADERS

pytestmark = [pytest.mark.root, pytest.mark.traffic]

PORT = 5361
RATE = "40M"  # 5x the internet cap: internal flows at this rate prove they are not shaped


def scopes_object(peer_in: str) -> dict:
    """node0's subnet and address in zone-a, node1's subnet in zone-b, the peer host in the region `far`
    (peer_in="far") or in zone-b (peer_in="zone-b")."""
    peer = [f"{PEER_V4}/32", f"{PEER_V6}/128"]
    zone_b = ["10.244.1.0/24", "fd00:244:1::/64", *(peer if peer_in == "zone-b" else [])]
    regions = [{"name": "far", "cidrs": peer}] if peer_in == "far" else []
    return {"apiVersion": "netagent.io/v1alpha1", "kind": "NetworkScopes", "metadata": {"name": "cluster"},
            "spec": {"zones": [{"name": "zone-a", "cidrs": ["10.244.0.0/24", "fd00:244::/64", "10.0.0.10/32",
                                                            "fd00::a/128"]},
                               {"name": "zone-b", "cidrs": zone_b}],
                     "regions": regions}}


NODE0 = {"apiVersion": "v1", "kind": "Node",
         "metadata": {"name": "node0", "labels": {"topology.kubernetes.io/zone": "zone-a"}}}


@pytest.fixture(scope="module")
def lab():
    require_root()
    with Lab(nodes=2, pods_per_node=1) as lab:
        node0, node1 = lab.nodes
        for ns in (node0.netns, node1.pods[0].netns, lab.peer, lab.internet):
            lab.iperf_server(ns, PORT)
        yield lab


@pytest.fixture(scope="module")
def agent(lab, tmp_path_factory):
    d = tmp_path_factory.mktemp("scopes")
    node = lab.nodes[0]
    write_objects(d / "policy.yaml", POLICY)
    write_objects(d / "pods.yaml", [pod_object(node.pods[0], node)])
    write_objects(d / "scopes.yaml", [scopes_object("far"), NODE0])
    with bpf_filesystem() as bpffs:
        bpf_dir = os.path.join(bpffs, "netagent")
        a = AgentProcess(lab, node, [d], port=9583, log_dir=d,
                         extra=["--internal-counting", "device", "--bpf-dir", bpf_dir, "--service-cidr", "10.96.0.0/16"])
        a.start()
        a.dir = d
        try:
            a.wait_ready()
            wait_for(lambda: (a.pod(node.pods[0].name) or {}).get("limit_bps") == CAP, what="pod capped")
            wait_for(lambda: "cross-region" in (a.pod(node.pods[0].name) or {}).get("egress_bytes", {}),
                     what="the scopes described")
            yield a
        finally:
            print(a.log())
            a.close()
            run([sys.executable, "-m", "netagent", "cleanup", "--bpf-dir", bpf_dir], node.netns, check=False)


def peers(lab: Lab, family: int) -> dict[str, str]:
    """scope -> the address of a peer in it, from pod a on node0."""
    node0, node1 = lab.nodes
    if family == 4:
        return {"internal": node0.ip4, "cross-zone": node1.pods[0].ip4, "cross-region": PEER_V4,
                "internet": INTERNET_V4}
    return {"internal": node0.ip6, "cross-zone": node1.pods[0].ip6, "cross-region": PEER_V6, "internet": INTERNET_V6}


def counts(agent: AgentProcess, pod: str) -> dict[str, dict[str, int]]:
    """The pod's bytes by direction and scope once they stopped moving (the agent samples each second)."""
    last: list = [None]

    def still():
        p = agent.pod(pod)
        now = {d: dict(p[d]) for d in ("egress_bytes", "ingress_bytes")}
        same, last[0] = now == last[0], now
        return now if same else None
    return wait_for(still, 20, 1.5, "counters settled")


def received_ip_bytes(result: dict, family: int) -> int:
    rx = result["end"]["sum_received"]
    return (rx["packets"] - rx["lost_packets"]) * (DATAGRAM + UDP_HEADERS[family])


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("direction", ["upload", "download"])
@pytest.mark.parametrize("scope", ["internal", "cross-zone", "cross-region"])
def test_each_scope_counted_within_2_percent_and_never_shaped(lab, agent, scope, direction, family):
    pod = lab.nodes[0].pods[0]
    key = "egress_bytes" if direction == "upload" else "ingress_bytes"
    before = counts(agent, pod.name)
    result = lab.iperf(pod.netns, peers(lab, family)[scope], PORT, seconds=2, udp_bitrate=RATE,
                       reverse=direction == "download")
    after = counts(agent, pod.name)
    truth = received_ip_bytes(result, family)
    got = {s: after[key][s] - before[key][s] for s in after[key]}
    print(f"IPv{family} {direction} {scope}: counted {got[scope]} B against {truth} B "
          f"({(got[scope] - truth) / truth:+.2%}); the other scopes {got}")
    # a 40M stream for 2 s: 5x the internet cap, delivered whole (internal traffic is never shaped)
    assert truth >= 0.95 * 40 * M / 8 * 2
    assert abs(got[scope] - truth) <= 0.02 * truth
    # nothing of it in another scope (the control connection's few KB go to the same peer)
    assert all(n <= 0.005 * truth for s, n in got.items() if s != scope), got


@pytest.mark.parametrize("family", [4, 6])
def test_the_internet_upload_is_shaped_as_before_with_scopes_described(lab, agent, family):
    pod = lab.nodes[0].pods[0]
    before = counts(agent, pod.name)
    result = lab.iperf(pod.netns, peers(lab, family)["internet"], PORT, seconds=3, udp_bitrate=RATE)
    after = counts(agent, pod.name)
    rx = result["end"]["sum_received"]
    rate = (rx["packets"] - rx["lost_packets"]) * (DATAGRAM + UDP_HEADERS[family]) * 8 / rx["seconds"]
    counted = after["egress_bytes"]["internet"] - before["egress_bytes"]["internet"]
    truth = received_ip_bytes(result, family)
    print(f"IPv{family} internet upload with scopes described: {rate / M:.2f}M at the far end (cap 8M); "
          f"counted {counted} B against {truth} B")
    assert abs(rate - CAP) <= 0.05 * CAP
    # what the far end got, and at most the shaper queue's tail more (iperf3's receiver stops before it drains)
    assert truth * 0.98 <= counted <= truth * 1.02 + 0.1 * CAP / 8


def test_a_cidr_moved_between_scopes_is_counted_in_its_new_scope_within_a_second_without_loss(lab, agent):
    pod = lab.nodes[0].pods[0]
    rate, seconds, move_at = 20 * M, 8, 3.0
    before = counts(agent, pod.name)["egress_bytes"]
    stream = lab.iperf_async(pod.netns, PEER_V4, PORT, seconds=seconds, udp_bitrate=str(rate))
    try:
        started = time.monotonic()
        time.sleep(move_at)
        write_objects(agent.dir / "scopes.yaml", [scopes_object("zone-b"), NODE0])
        moved = time.monotonic() - started
        out, err = stream.communicate(timeout=seconds + 30)
        assert stream.returncode == 0, err
    finally:
        if stream.poll() is None:
            stream.kill()
        write_objects(agent.dir / "scopes.yaml", [scopes_object("far"), NODE0])
    result = json.loads(out)
    rx = result["end"]["sum_received"]
    after = counts(agent, pod.name)["egress_bytes"]
    got = {s: after[s] - before[s] for s in ("cross-zone", "cross-region")}
    truth = received_ip_bytes(result, 4)
    per_second = rate / 8
    print(f"moved at {moved:.2f} s of {seconds}: cross-region {got['cross-region']} B, cross-zone {got['cross-zone']} B, "
          f"the peer got {truth} B, {rx['lost_packets']} datagrams lost; counted in the new scope "
          f"{got['cross-region'] / per_second - moved:+.2f} s after the write (at the stream's rate)")
    assert rx["lost_packets"] == 0  # the tries change in place: no datagram is lost
    assert abs(sum(got.values()) - truth) <= 0.02 * truth  # every byte counted, once
    # in its new scope within a second of the write: the old scope got at most the stream until then
    assert got["cross-region"] <= (moved + 1.0) * per_second
    assert got["cross-zone"] >= (seconds - moved - 1.0) * per_second * 0.98
