"""The namespace lab itself: it builds, it connects, it stays sealed, and it leaves nothing behind."""
import json
import re
import subprocess
import sys
import textwrap

import pytest

from lab.topology import (
    BRIDGE,
    INTERNET_V4,
    INTERNET_V6,
    PEER_V4,
    PEER_V6,
    UPLINK,
    Lab,
    LabError,
    run,
)
from lab.netns import require_root

pytestmark = pytest.mark.root

# Prints the source address of the first UDP datagram it receives (who the receiver sees).
RECEIVER = textwrap.dedent("""
    import socket, sys
    fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], 9999))
    print("ready", flush=True)
    s.settimeout(10)
    print(s.recvfrom(100)[1][0], flush=True)
""")


LAB_LINK = re.compile(r"^(inet0|peer|eth0|n\d+|vp\d+)$")  # the names the lab gives its links


def lab_namespaces(prefix: str) -> set[str]:
    return {line.split()[0] for line in run("ip netns list").splitlines() if line.startswith(prefix + "-")}


@pytest.fixture(scope="module")
def lab():
    require_root()
    with Lab(nodes=2, pods_per_node=2) as lab:
        yield lab


def ping(netns: str, dst: str) -> bool:
    return subprocess.run(["ip", "netns", "exec", netns, "ping", "-c", "1", "-W", "2", dst],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("dst", [INTERNET_V4, PEER_V4, INTERNET_V6, PEER_V6])
def test_every_pod_reaches_internet_and_peer(lab, dst):
    for node in lab.nodes:
        for pod in node.pods:
            assert ping(pod.netns, dst), f"{pod.name} cannot reach {dst}"


def test_pod_to_pod_across_nodes(lab):
    a, b = lab.nodes[0].pods[0], lab.nodes[1].pods[1]
    assert ping(a.netns, b.ip4) and ping(a.netns, b.ip6)


@pytest.mark.parametrize("dst", [INTERNET_V4, PEER_V4, INTERNET_V6, PEER_V6])
def test_internet_and_peer_leave_through_the_same_uplink(lab, dst):
    node, pod = lab.nodes[0], lab.nodes[0].pods[0]
    src = pod.ip6 if ":" in dst else pod.ip4
    route = run(["ip", "route", "get", dst, "from", src, "iif", pod.node_veth], node.netns)
    assert f"dev {UPLINK}" in route, route


def sender(pod_netns: str, src: str, dst: str) -> None:
    fam = "AF_INET6" if ":" in dst else "AF_INET"
    code = f"import socket; s = socket.socket(socket.{fam}, socket.SOCK_DGRAM); s.bind(({src!r}, 0)); " \
           f"s.sendto(b'x', ({dst!r}, 9999))"
    run([sys.executable, "-c", code], pod_netns)


@pytest.mark.parametrize("dst,who,snat", [
    (INTERNET_V4, "internet", True), (INTERNET_V6, "internet", True),
    (PEER_V4, "peer", False), (PEER_V6, "peer", False),
])
def test_snat_only_towards_the_internet(lab, dst, who, snat):
    """A cloud node: the internet sees the node's address, the VPC sees the pod's."""
    node, pod = lab.nodes[0], lab.nodes[0].pods[1]
    v6 = ":" in dst
    rx = lab.spawn(getattr(lab, who), [sys.executable, "-c", RECEIVER, dst], stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    sender(pod.netns, pod.ip6 if v6 else pod.ip4, dst)
    seen = rx.stdout.readline().strip()
    rx.wait(timeout=10)
    expected = (node.ip6 if v6 else node.ip4) if snat else (pod.ip6 if v6 else pod.ip4)
    assert seen == expected


def test_no_route_out_of_the_sandbox(lab):
    """No lab namespace has a link into any namespace outside the lab, and the fabric,
    the internet host and the peer have no default route: a stray packet dies inside."""
    names = lab_namespaces(lab.prefix)
    for ns in names:
        ids = {}
        for line in run("ip netns list-id", ns).splitlines():
            # "nsid 0 (iproute2 netns name: na1234-fab)"
            parts = line.replace("(", "").replace(")", "").split()
            ids[int(parts[1])] = parts[-1] if "name:" in parts else None
        for link in json.loads(run("ip -j link show", ns)):
            if "link_netnsid" in link:
                peer_ns = ids.get(link["link_netnsid"])
                assert peer_ns in names, f"{ns}: {link['ifname']} leads to namespace {peer_ns!r} outside the lab"
    for ns in (lab.fabric, lab.internet, lab.peer):
        assert "default" not in run("ip route", ns) and "default" not in run("ip -6 route", ns)
    for node in lab.nodes:
        assert run("ip route show default", node.netns).split()[2] == "10.0.0.1"
    # even from a pod, a public address outside the documentation ranges is unreachable
    assert not ping(lab.nodes[0].pods[0].netns, "1.1.1.1")


def test_first_and_last_internal_addresses_leave_through_the_uplink(lab):
    """The classification edge tests rely on these being routed out, not swallowed locally."""
    node, pod = lab.nodes[0], lab.nodes[0].pods[0]
    for dst in ("10.0.0.0", "10.255.255.255", "fd00::", "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"):
        src = pod.ip6 if ":" in dst else pod.ip4
        route = run(["ip", "route", "get", dst, "from", src, "iif", pod.node_veth], node.netns)
        assert f"dev {UPLINK}" in route and "anycast" not in route and "local" not in route, route


def root_links() -> set[str]:
    return {link["ifname"] for link in json.loads(run("ip -j link show"))}


def test_close_removes_everything_and_kills_processes():
    require_root()
    links_before = root_links()
    lab = Lab(nodes=1, pods_per_node=1)
    with lab:
        proc = lab.spawn(lab.nodes[0].pods[0].netns, ["sleep", "600"])
        assert lab_namespaces(lab.prefix)
        # every link lives in a lab namespace: none was created in (or moved to) this one
        assert not {name for name in root_links() - links_before if LAB_LINK.match(name)}
    assert proc.poll() is not None
    assert lab_namespaces(lab.prefix) == set()
    assert not {name for name in root_links() - links_before if LAB_LINK.match(name)}


def test_failed_build_leaves_nothing(monkeypatch):
    require_root()

    def broken(self, node):
        raise LabError("injected failure while adding a pod")

    monkeypatch.setattr(Lab, "add_pod", broken)
    lab = Lab(nodes=1, pods_per_node=1)
    with pytest.raises(LabError, match="injected"):
        with lab:
            pass
    assert lab_namespaces(lab.prefix) == set()


def test_ipv4_only_lab():
    require_root()
    with Lab(nodes=1, pods_per_node=1, ipv6=False) as lab:
        pod = lab.nodes[0].pods[0]
        assert pod.ip6 == "" and lab.nodes[0].ip6 == ""
        assert "inet6" not in run("ip -o addr show scope global", pod.netns)
        assert ping(pod.netns, INTERNET_V4) and ping(pod.netns, PEER_V4)


def test_bad_size_is_refused():
    with pytest.raises(LabError, match="lab size"):
        Lab(nodes=0)


def test_bridge_lab_pods_behind_a_bridge():
    """Lab(pod_network="bridge"): the pods' veths are ports of the node's bridge, which holds the pod
    subnet's gateway; pods reach the internet host (through the node's NAT), the peer and each
    other (bridged), IPv4 and IPv6; close() leaves no namespace."""
    require_root()
    with Lab(nodes=1, pods_per_node=2, pod_network="bridge") as lab:
        node = lab.nodes[0]
        a, b = node.pods
        ports = run(["ip", "-o", "link", "show", "master", BRIDGE], node.netns)
        assert a.node_veth in ports and b.node_veth in ports
        for dst in (INTERNET_V4, PEER_V4, INTERNET_V6, PEER_V6, b.ip4, b.ip6):
            assert ping(a.netns, dst), f"{a.name} cannot reach {dst} behind the bridge"
        prefix = lab.prefix
    assert lab_namespaces(prefix) == set()
    with pytest.raises(LabError, match="pod_network"):
        Lab(pod_network="overlay")
