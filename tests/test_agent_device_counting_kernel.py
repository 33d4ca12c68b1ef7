"""Issue 12: the pods' internal bytes counted on their own devices and the node's totals on its uplink
(tc/ebpf/), driven through the agent's `KernelDataPath` on a lab node, in both pod networks (routed veths,
and veths on a bridge) and both families.

The rules then count no internal byte and no node ingress (no set lookup and no device test for an internal
packet: tests/test_iptables_pure.py holds them), so every internal byte a pod's counters show, and every
node total but its internet egress, was counted by the device counter; the counts must be exactly what a
packet generator sent, agree with iperf3, stay across an agent restart, and go with the counter when the
agent is switched back to counting by the rules.
"""
from __future__ import annotations

import os

import pytest

from lab.netns import bpf_filesystem, require_root, residue_snapshot
from lab.topology import INTERNAL_CIDRS, INTERNET_V4, INTERNET_V6, PEER_V4, PEER_V6, UPLINK, Lab, run
from netagent.datapath import KernelDataPath
from iptables.render import KINDS
from netagent.desired import DataPathOptions, NodeInputs, PodShape, desired_state
from tc.probe import probe
from tests.test_agent_datapath_traffic import datagram_sender, edge_cases, egress_moved, udp_l3_bytes
from tests.test_tc_ebpf_kernel import attached, ours, ours_soon

pytestmark = [pytest.mark.root, pytest.mark.traffic]

G = 1_000_000_000
PORT = 5301


@pytest.fixture(scope="module", params=["routed", "bridge"])
def lab(request):
    require_root()
    with Lab(nodes=1, pods_per_node=2, pod_network=request.param) as lab:
        node = lab.nodes[0]
        for tool in ("iptables", "ip6tables"):  # kubelet's chains, as on every node: cleanup keeps the tables
            run(f"{tool} -t mangle -N KUBE-IPTABLES-HINT", node.netns)
            run(f"{tool} -t mangle -N KUBE-KUBELET-CANARY", node.netns)
        for ns in (lab.peer, lab.internet, node.pods[1].netns):
            lab.iperf_server(ns, PORT)
        pin_neighbours(lab)
        yield lab


def pin_neighbours(lab: Lab) -> None:
    """Neighbour discovery between a pod and its node is internal traffic the pod sends and receives, and the
    device counter counts it (the rules never saw it: it is delivered to the node, not forwarded). For exact
    counts the pods' and the node's IPv6 neighbours are learnt once and made permanent: no solicitation during
    a measurement."""
    node = lab.nodes[0]
    for pod in node.pods:
        run(f"ping -c 1 -W 2 {PEER_V6}", pod.netns)
        for other in node.pods:
            if other is not pod:
                run(f"ping -c 1 -W 2 {other.ip6}", pod.netns)
    for ns in (node.netns, *(p.netns for p in node.pods)):
        for line in run("ip -6 neigh show", ns).splitlines():
            words = line.split()
            if "lladdr" in words and "dev" in words:
                addr, dev, mac = words[0], words[words.index("dev") + 1], words[words.index("lladdr") + 1]
                run(f"ip -6 neigh replace {addr} dev {dev} lladdr {mac} nud permanent", ns)


@pytest.fixture(scope="module")
def bpf_dir():
    with bpf_filesystem() as root:
        yield os.path.join(root, "netagent")


class Agent:
    """The agent's data path on the lab node, programmed as the sync loop does."""

    def __init__(self, lab: Lab, bpf_dir: str, by_device: bool = True, attach: str = "auto"):
        self.lab, self.node = lab, lab.nodes[0]
        self.options = DataPathOptions(leaf_qdisc=probe(self.node.netns).leaf_qdisc, internal_by_device=by_device,
                                       bpf_dir=bpf_dir, count_attach=attach)
        self.dp = KernelDataPath(self.options, iptables_backend="nft", netns=self.node.netns)

    def apply(self, full: bool = True) -> dict[str, int]:
        shapes = tuple(PodShape(f"default/{p.name}", (p.ip4, p.ip6), 1 * G, 1 * G) for p in self.node.pods)
        devices = self.dp.pod_devices((UPLINK,))
        return self.dp.apply(desired_state(NodeInputs((UPLINK,), INTERNAL_CIDRS, shapes, 10 * G, self.options,
                                                      pod_devices=devices)), full=full)

    def counts(self, pod) -> dict[str, int]:
        return self.dp.counters()[0].get(f"default/{pod.name}", {})

    def rules_counts(self, pod) -> dict[str, int]:
        """What the rules alone counted (the ipsets), without the device counter's bytes."""
        return self.dp._classifier.counters()[0].get(f"default/{pod.name}", {})

    def node_counts(self) -> dict[str, int]:
        return self.dp.counters()[1]

    def rules_node_counts(self) -> dict[str, int]:
        return self.dp._classifier.counters()[1]

    @property
    def way(self) -> str:
        """How its counter attaches: tcx links (this kernel), or tc filters."""
        return self.dp._counter.attach_by


# the node kinds the uplink counts (its internet egress is the rules')
NODE_BY_DEVICE = ("egress_internal", "ingress_internal", "ingress_internet")


@pytest.fixture(scope="module")
def agent(lab, bpf_dir):
    before = residue_snapshot(lab.nodes[0].netns)
    a = Agent(lab, bpf_dir)
    try:
        a.apply()
        yield a
    finally:
        a.dp.close()
        from netagent.cleanup import remove_counting, unpin_dir  # what `netagent cleanup` runs
        node = lab.nodes[0]
        remove_counting((*(p.node_veth for p in node.pods), UPLINK), DataPathOptions.count_pref, node.netns)
        unpin_dir(bpf_dir)
        from tc.netlink import Shaper
        from iptables.apply import Classifier
        with Shaper(node.netns) as shaper:
            shaper.cleanup(a.options.ifbs.upload, (UPLINK,), a.options.filter_pref)
        Classifier(backend="nft", netns=node.netns).cleanup()
        assert residue_snapshot(node.netns) == before


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


def test_every_pod_device_and_the_uplink_carry_the_counter(lab, agent):
    assert agent.way == "tcx"  # this kernel has tcx: the counter's programs run straight from the hooks
    for pod in lab.nodes[0].pods:
        assert ours(lab.nodes[0].netns, pod.node_veth) == attached("tcx", gate=True), pod.node_veth
    assert ours(lab.nodes[0].netns, UPLINK) == attached("tcx", uplink=True, gate=True)


def test_classification_edges_are_counted_exactly_on_the_device(lab, agent):
    """Datagrams to the first and last address of each internal CIDR, and just outside it: the internal ones in
    the pod's internal egress (the device counter's), the others in its internet egress (the rules'), to the byte."""
    pod = lab.nodes[0].pods[0]
    wrong = []
    with datagram_sender(lab, pod) as send:
        for dst, scope in edge_cases():
            count = 3
            before, rules_before = agent.counts(pod), agent.rules_counts(pod)
            size = send(dst, count)
            moved = egress_moved(lambda: agent.counts(pod), before, count * size)
            other = "internet" if scope == "internal" else "internal"
            by_rules = delta(agent.rules_counts(pod), rules_before)
            if (moved[f"egress_{scope}"], moved[f"egress_{other}"], by_rules["egress_internal"]) != (count * size, 0, 0):
                wrong.append(f"{dst}: want {scope} {count * size} B, got {moved} (the rules' internal: {by_rules})")
    assert not wrong, "\n".join(wrong)


CASES = [("egress", PEER_V4, False), ("ingress", PEER_V4, True), ("egress", PEER_V6, False),
         ("ingress", PEER_V6, True), ("egress", "pod", False), ("ingress", "pod", True),
         ("egress", INTERNET_V4, False), ("ingress", INTERNET_V6, True)]


@pytest.mark.parametrize("direction,dst,reverse", CASES,
                         ids=["egress-peer-v4", "ingress-peer-v4", "egress-peer-v6", "ingress-peer-v6",
                              "egress-pod-v4", "ingress-pod-v4", "egress-internet-v4", "ingress-internet-v6"])
def test_counts_agree_with_iperf(lab, agent, direction, dst, reverse):
    """UDP at 50 Mbit/s for 2 s: the counted IP bytes agree with iperf3's datagrams (within 2 %: its control
    connection); internal bytes counted by the device only (the rules' internal counts stay still), internet
    bytes by the rules as before; pod to pod on the node counts once for each end. The node's totals likewise:
    through the uplink, by the uplink's counter (the rules' node counts of those kinds stay still), its internet
    egress by the rules; pod to pod on the node, nothing."""
    pod, neighbour = lab.nodes[0].pods
    target = neighbour.ip4 if dst == "pod" else dst
    scope = "internet" if target in (INTERNET_V4, INTERNET_V6) else "internal"
    before, rules_before, n_before = agent.counts(pod), agent.rules_counts(pod), agent.counts(neighbour)
    node_before, rules_node_before = agent.node_counts(), agent.rules_node_counts()
    result = lab.iperf(pod.netns, target, PORT, seconds=2, udp_bitrate="50M", reverse=reverse)
    moved, by_rules = delta(agent.counts(pod), before), delta(agent.rules_counts(pod), rules_before)
    node_moved, rules_node_moved = delta(agent.node_counts(), node_before), delta(agent.rules_node_counts(),
                                                                                   rules_node_before)
    _, l3 = udp_l3_bytes(result, 6 if ":" in target else 4, reverse)
    counted = moved[f"{direction}_{scope}"]
    assert abs(counted - l3) <= 0.02 * l3, f"counted {counted} B, iperf3 moved {l3} B (L3): {moved}"
    assert all(v <= 0.01 * l3 for k, v in moved.items() if k != f"{direction}_{scope}"), moved
    assert by_rules["egress_internal"] == by_rules["ingress_internal"] == 0, by_rules
    node_kind = None if dst == "pod" else f"{direction}_{scope}"
    if node_kind is not None:
        assert abs(node_moved[node_kind] - l3) <= 0.02 * l3, f"node counted {node_moved}, iperf3 moved {l3} B (L3)"
    assert all(node_moved[k] <= 0.01 * l3 for k in KINDS if k != node_kind), node_moved
    assert all(rules_node_moved.get(k, 0) == 0 for k in NODE_BY_DEVICE), rules_node_moved
    if dst == "pod":  # the neighbour counts the same bytes the other way
        other = "ingress" if direction == "egress" else "egress"
        n_moved = delta(agent.counts(neighbour), n_before)
        assert abs(n_moved[f"{other}_internal"] - l3) <= 0.02 * l3, n_moved


def test_a_restarted_agent_adopts_the_counter_and_changes_nothing(lab, agent, bpf_dir):
    pod = lab.nodes[0].pods[0]
    run(f"ping -c 3 -i 0.2 {PEER_V4}", pod.netns)  # something counted to carry on from
    again = Agent(lab, bpf_dir)
    try:
        snap = residue_snapshot(lab.nodes[0].netns)
        changes = again.apply()
        assert changes == {"tc": 0, "ebpf": 0, "iptables": 0, "ipset": 0}, changes
        assert residue_snapshot(lab.nodes[0].netns) == snap
        old, new = agent.counts(pod), again.counts(pod)
        assert new["egress_internal"] >= old["egress_internal"] > 0, (old, new)  # the map's counts, not zero
        old, new = agent.node_counts(), again.node_counts()
        assert all(new[k] >= old[k] > 0 for k in ("egress_internal", "ingress_internal")), (old, new)  # the node's
    finally:
        again.dp.close()


def test_counting_by_the_rules_again_removes_the_counter(lab, agent, bpf_dir):
    """Back to the rules: the device counter's filters go from every pod device (they would count beside
    the sets), internal bytes are counted by the sets again, and back on the devices everything returns."""
    pod, node = lab.nodes[0].pods[0], lab.nodes[0]
    rules = Agent(lab, bpf_dir, by_device=False)
    try:
        changes = rules.apply()
        assert changes["ebpf"] >= 2 * len(node.pods) + 2 and changes["iptables"] > 0, changes  # links and pins
        assert all(ours_soon(node.netns, dev, []) == [] for dev in (*(p.node_veth for p in node.pods), UPLINK))
        # the rules count the node's ingress and internal egress again (from what the old rules carried on)
        assert "-j NETAGENT-PREROUTING" in run("iptables-nft-save -t mangle", node.netns)
        before = rules.rules_counts(pod)
        result = lab.iperf(pod.netns, PEER_V4, PORT, seconds=1, udp_bitrate="20M")
        _, l3 = udp_l3_bytes(result, 4, False)
        assert abs(delta(rules.rules_counts(pod), before)["egress_internal"] - l3) <= 0.02 * l3
    finally:
        rules.dp.close()
    back = agent.apply()
    assert back["ebpf"] >= 2 * len(node.pods) + 2 and back["iptables"] > 0, back
    assert all(ours(node.netns, p.node_veth) == attached("tcx", gate=True) for p in node.pods)
    assert ours(node.netns, UPLINK) == attached("tcx", uplink=True, gate=True)
    assert "-j NETAGENT-PREROUTING" not in run("iptables-nft-save -t mangle", node.netns)


def test_a_device_that_refuses_the_counter_holds_back_no_other_pod(lab, agent, bpf_dir, caplog):
    """Attached by tc filters (kernels before 6.6): another filter at the counter's priority on one pod's device
    leaves that device as it is, named in a warning; the apply goes on (the rules, the other pods' counters), and
    the next one, once the device is free again, puts the counter there. Back to tcx links after."""
    node = lab.nodes[0]
    first, odd = node.pods[0].node_veth, node.pods[1].node_veth
    run(f"tc qdisc add dev {odd} clsact", node.netns, check=False)
    run(f"tc filter add dev {odd} ingress pref 0xc001 bpf bytecode '1,6 0 0 0'", node.netns)  # "never matches"
    by_tc = Agent(lab, bpf_dir, attach="tc")
    try:
        with caplog.at_level("WARNING", logger="netagent.datapath"):
            changes = by_tc.apply()
        assert "iptables" in changes and odd in caplog.text, (changes, caplog.text)
        assert ours_soon(node.netns, first, attached("tc")) == attached("tc")  # the tcx links went
        assert ours_soon(node.netns, odd, ["tc egress netagent-count-out"]) == ["tc egress netagent-count-out"]
        run(f"tc filter del dev {odd} ingress pref 0xc001", node.netns)
        assert by_tc.apply()["ebpf"] >= 1
        assert ours(node.netns, odd) == attached("tc")
    finally:
        run(f"tc filter del dev {odd} ingress pref 0xc001", node.netns, check=False)
        by_tc.dp.close()
    assert agent.apply()["ebpf"] >= 2 * len(node.pods) + 2  # the tcx links back, the filters gone
    assert all(ours(node.netns, p.node_veth) == attached("tcx", gate=True) for p in node.pods)
    assert ours(node.netns, UPLINK) == attached("tcx", uplink=True, gate=True)


def test_an_ordinary_sync_trusts_the_counter_it_applied_and_a_full_one_repairs_it(lab, agent, bpf_dir):
    """As for the rules: a sync whose device counting is what the last one applied reads nothing back; the
    periodic full resync does, and puts back a link someone removed."""
    node = lab.nodes[0]
    dev = node.pods[0].node_veth
    agent.apply()
    index = int(run(f"cat /sys/class/net/{dev}/ifindex", node.netns))
    os.unlink(os.path.join(bpf_dir, f"link-{index}-out"))  # released: its program detached
    assert ours_soon(node.netns, dev, ["tcx ingress na_count_in"]) == ["tcx ingress na_count_in"]
    assert agent.apply(full=False)["ebpf"] == 0
    assert ours(node.netns, dev) == ["tcx ingress na_count_in"]
    assert agent.apply(full=True)["ebpf"] == 1
    assert ours(node.netns, dev) == attached("tcx", gate=True)
