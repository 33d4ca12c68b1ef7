"""Issue 13's data path with real traffic: downloads (internet -> pod) shaped on their way to the pod.

The node is programmed as the agent programs it: `desired_state` with a download rate for the
node and each pod -> `Shaper.apply` of both shapers -> `Classifier.apply`. A download is the pod's
iperf3 client in reverse mode (`-R`: the server on the "internet" host sends, through the node's
NAT) or a UDP flood from the internet host to the pod (`Lab.download_flood`). Rates are measured
as for uploads (tests/test_datapath_traffic.py): the pod's download HTB class counter in IP bytes
over a window after a warm-up, within ±2 % of the configured rate.

Two labs: native routing (one veth per pod, /32 routes) and pods behind a bridge.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import time
import warnings

import pytest

from iptables.apply import Classifier
from lab.netns import require_root
from lab.topology import INTERNAL_CIDRS, INTERNET_V4, INTERNET_V6, PEER_V4, PEER_V6, UPLINK, Lab, run
from netagent.desired import DataPathOptions, DesiredState, NodeInputs, PodShape, desired_state
from tc.model import DEFAULT_MINOR
from tc.netlink import Shaper
from tc.probe import probe
from tests.test_datapath_traffic import iperf_rate, ip_rate, rate_error, residue_snapshot

pytestmark = [pytest.mark.root, pytest.mark.traffic]

M = 1_000_000
G = 1_000_000_000
TOLERANCE = 0.02
WARMUP_S, WINDOW_S, RUN_S = 0.8, 2.4, 4
PORTS = (5301, 5302)
FLOOD_PORT = 5399
UNSHAPED_UPLOAD = 100 * G  # uploads are not what these tests look at


def pod_key(pod) -> str:
    return f"default/{pod.name}"


class DownloadNode:
    """One lab node driven the way the agent drives it, with both shapers."""

    def __init__(self, lab: Lab, leaf: str):
        self.lab = lab
        self.node = lab.nodes[0]
        self.pods = self.node.pods
        self.options = DataPathOptions(leaf_qdisc=leaf)
        self.shaper = Shaper(self.node.netns)
        self.classifier = Classifier(netns=self.node.netns)
        self.state: DesiredState | None = None

    def devices(self) -> tuple[str, ...]:
        return self.shaper.devices_of_kind(("veth",), exclude=(UPLINK,))

    def program(self, rates: dict, node_rate: int = 10 * G, known: tuple | None = None):
        """rates: pod name -> (download rate, ceil) bit/s; pods not named are unknown to the agent.
        Returns the number of changes (tc ops of both shapers, iptables changes)."""
        shapes = tuple(PodShape(pod_key(p), (p.ip4, p.ip6), UNSHAPED_UPLOAD, UNSHAPED_UPLOAD, *rates[p.name])
                       for p in self.pods if p.name in rates)
        self.state = desired_state(NodeInputs((UPLINK,), INTERNAL_CIDRS, shapes, UNSHAPED_UPLOAD, self.options,
                                              ingress_node_rate=node_rate, pod_devices=self.devices()))
        ops = self.shaper.apply(self.state.shaper).ops + self.shaper.apply(self.state.ingress_shaper).ops
        changes = self.classifier.apply(self.state.classifier)
        return ops, changes

    def stats(self) -> dict:
        spec = self.state.ingress_shaper
        return self.shaper.stats(spec.ifb, spec.major)

    def minor(self, pod) -> int:
        return self.state.minors[pod_key(pod)]

    def remove(self) -> None:
        o = self.options
        self.shaper.cleanup(o.ifb, (UPLINK, *self.devices()), o.filter_pref)
        self.shaper.cleanup(o.ingress_ifb, (), o.filter_pref)
        self.classifier.cleanup()
        self.state = None

    def close(self) -> None:
        self.shaper.close()


def make_lab(pod_network: str):
    require_root()
    lab = Lab(nodes=1, pods_per_node=2, pod_network=pod_network)
    lab.__enter__()
    try:
        node = lab.nodes[0]
        for tool in ("iptables", "ip6tables"):  # kubelet's chains, as on every kube-proxy node
            run(f"{tool} -t mangle -N KUBE-IPTABLES-HINT", node.netns)
            run(f"{tool} -t mangle -N KUBE-KUBELET-CANARY", node.netns)
        for port in PORTS:
            lab.iperf_server(lab.internet, port)
            lab.iperf_server(lab.peer, port)
        lab.iperf_server(node.pods[1].netns, PORTS[0])  # pod-to-pod on the node
    except BaseException:
        lab.close()
        raise
    return lab


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
    n = DownloadNode(lab, probe(lab.nodes[0].netns).leaf_qdisc)
    try:
        yield n
    finally:
        try:
            n.remove()
        finally:
            n.close()


def download(lab, pod, dst: str, port: int, seconds: float = RUN_S, udp_bitrate: str | None = None):
    """The pod's iperf3 client in reverse mode: the server at `dst` sends to the pod."""
    return lab.iperf_async(pod.netns, dst, port, seconds=seconds, udp_bitrate=udp_bitrate, extra=["-R"])


def window(node: DownloadNode, minors: list[int], clients: list[subprocess.Popen]) -> tuple[list[float], list[int], list[dict]]:
    """(IP rate per minor over the window, drops per minor, the clients' JSON results)."""
    try:
        time.sleep(WARMUP_S)
        s1, t1 = node.stats(), time.monotonic()
        time.sleep(WINDOW_S)
        s2, t2 = node.stats(), time.monotonic()
        results = []
        for c in clients:
            out, err = c.communicate(timeout=RUN_S + 30)
            assert c.returncode == 0, f"traffic generator failed: {err or out}"
            results.append(json.loads(out))
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
    return ([ip_rate(s1[m], s2[m], t2 - t1) for m in minors], [s2[m].drops - s1[m].drops for m in minors], results)


RATE_CASES = [(rate, proto, INTERNET_V4) for rate in (10 * M, 100 * M, 1 * G) for proto in ("tcp", "udp")]
RATE_CASES += [(100 * M, proto, INTERNET_V6) for proto in ("tcp", "udp")]


@pytest.mark.parametrize("rate,proto,dst", RATE_CASES,
                         ids=[f"{p}-{r // M}M-ipv{6 if ':' in d else 4}" for r, p, d in RATE_CASES])
def test_download_held_to_its_rate(lab, node, rate, proto, dst):
    """TCP (iperf3 -R) and a UDP flood at twice the rate from the internet host, held by the pod's
    download class within ±2 %; the flood's drops prove it was held, not merely under the rate."""
    pod = node.pods[0]
    node.program({pod.name: (rate, rate)})
    if proto == "tcp":
        clients = [download(lab, pod, dst, PORTS[0])]
    else:
        clients = [lab.download_flood(pod.netns, lab.internet, dst, FLOOD_PORT, 2 * rate, seconds=RUN_S)]
    (measured,), (drops,), results = window(node, [node.minor(pod)], clients)
    err = rate_error(measured, rate)
    assert abs(err) <= TOLERANCE, f"{proto} download from {dst} at {rate / M:g} Mbit/s: {measured / M:.2f} ({err:+.2%})"
    if proto == "udp":
        assert results[0]["bits_per_second"] >= 1.9 * rate, f"the flood offered only {results[0]}"
        assert drops > 0, "the flood never exceeded the class"
