"""Issue 13's download data path in the kernel, packet by packet (no rates: no traffic lock).

Each pod pings: the echo replies from the "internet" host come back through the node's NAT
(internet -> pod, a download), those from the internal peer, the node and the other pod do not
come from the internet. Which HTB class of the download shaper counted them says how they were
classified. Both lab topologies: native routing (a veth per pod) and pods behind a bridge.
Then: a restart adopts (zero changes), drift is repaired, a new pod's veth gets the filter, and
cleanup leaves the node exactly as it was.
"""
from __future__ import annotations

import pytest

from lab.netns import require_root
from lab.topology import INTERNET_V4, INTERNET_V6, PEER_V4, PEER_V6, UPLINK, run
from tc.model import DEFAULT_MINOR, NODE_MINOR
from tests.test_agent_datapath_traffic import residue_snapshot
from tests.test_agent_downloads_traffic import DownloadNode, make_lab

pytestmark = [pytest.mark.root]

M = 1_000_000
PINGS = 3


@pytest.fixture(scope="module", params=["routed", "bridge"])
def lab(request):
    lab = make_lab(request.param)
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(scope="module")
def before(lab):
    return residue_snapshot(lab.nodes[0].netns)


@pytest.fixture(scope="module")
def node(lab, before):
    require_root()
    n = DownloadNode(lab, "pfifo")
    try:
        yield n
    finally:
        try:
            n.remove()
        finally:
            n.close()


def packets(node: DownloadNode) -> dict[int, int]:
    return {minor: st.packets for minor, st in node.stats().items()}


def ping(netns: str, dst: str, count: int = PINGS) -> None:
    run(["ping", "-c", str(count), "-i", "0.05", "-W", "2", dst], netns)


def test_only_internet_to_pod_packets_enter_the_download_shaper(lab, node):
    a, b = node.pods
    node.program({a.name: (50 * M, 50 * M)})  # b is not known to the agent yet
    ma = node.minor(a)
    for dst in (INTERNET_V4, INTERNET_V6):
        p0 = packets(node)
        ping(a.netns, dst)
        p1 = packets(node)
        assert p1[ma] - p0[ma] == PINGS, f"replies from {dst} in the pod's download class: {p0} -> {p1}"
        assert p1[DEFAULT_MINOR] == p0[DEFAULT_MINOR]
        ping(b.netns, dst)  # an unknown pod: the download default class, never unshaped
        p2 = packets(node)
        assert p2[DEFAULT_MINOR] - p1[DEFAULT_MINOR] == PINGS and p2[ma] == p1[ma], f"{p1} -> {p2}"
    p0 = packets(node)
    for dst in (PEER_V4, PEER_V6, b.ip4, b.ip6):  # internal peer, pod-to-pod on the node
        ping(a.netns, dst)
        ping(b.netns, dst if dst not in (b.ip4, b.ip6) else (a.ip4 if ":" not in dst else a.ip6))
    ping(lab.nodes[0].netns, a.ip4)  # host -> pod
    ping(lab.nodes[0].netns, a.ip6)
    assert packets(node) == p0, "internal, pod-to-pod or host traffic entered the download shaper"


def test_a_restart_adopts_and_drift_is_repaired(lab, node):
    a, b = node.pods
    rates = {a.name: (50 * M, 80 * M), b.name: (20 * M, 80 * M)}
    node.program(rates)
    fresh = DownloadNode(lab, "pfifo")  # a restarted agent: new objects, the same desired state
    try:
        ops, changes = fresh.program(rates)
        assert ops == [] and changes == {"iptables": 0, "ipset": 0}
        # someone deletes the filter on a pod's device and the download IFB's node class
        dev = a.node_veth
        run(["tc", "filter", "del", "dev", dev, "egress"], lab.nodes[0].netns)
        ops, _ = fresh.program(rates)
        assert [str(op) for op in ops] == [f"add_filter {dev}"]
        run(["ip", "link", "del", node.options.ifbs.download], lab.nodes[0].netns)
        ops, _ = fresh.program(rates)
        assert ops and ops[0].action == "create_ifb"
        ping(a.netns, INTERNET_V4)
        assert fresh.stats()[fresh.minor(a)].packets == PINGS and fresh.stats()[NODE_MINOR].packets >= PINGS
    finally:
        fresh.close()


def test_a_new_pod_device_gets_the_filter(lab, node):
    new = lab.add_pod(lab.nodes[0])
    try:
        ops, _ = node.program({p.name: (10 * M, 10 * M) for p in node.pods})
        assert f"add_filter {new.node_veth}" in [str(op) for op in ops]
        assert new.node_veth in node.state.shapers.download.devices and UPLINK not in node.state.shapers.download.devices
        ping(new.netns, INTERNET_V4)
        assert node.stats()[node.minor(new)].packets == PINGS
    finally:
        node.pods.remove(new)
        run(["ip", "link", "del", new.node_veth], lab.nodes[0].netns)
    # the device went with its filter: the next reconcile of the remaining pods is quiet about it
    ops, _ = node.program({p.name: (10 * M, 10 * M) for p in node.pods})
    assert all(op.device != new.node_veth for op in ops)


def test_cleanup_leaves_no_residue(lab, node, before):
    node.program({p.name: (10 * M, 10 * M) for p in node.pods})
    node.remove()
    assert residue_snapshot(lab.nodes[0].netns) == before
    node.remove()  # twice: harmless
