"""The real agent shaping downloads in the namespace lab (root; real traffic).

`python3 -m netagent run` in a lab node, fed by YAML files the test edits (as
tests/test_agent_lab.py does for uploads). Behaviour is asserted by polling the kernel
(the download IFB's classes over netlink) with bounded waits, never by wall-clock time.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from lab.agentproc import INGRESS_IFB, AgentProcess, pod_object, received_bps, tc_classes, wait_for, write_objects
from lab.netns import require_root
from lab.topology import INTERNET_V4, PEER_V4, Lab, run
from netagent.desired import DataPathOptions, PodShape, assign_minors, from_wire

pytestmark = [pytest.mark.root, pytest.mark.traffic]

M = 1_000_000
CLASS_MAX, NODE_TOTAL = 30 * M, 200 * M
POLICY = [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "bronze"},
     "spec": {"weight": 1, "max": "20M", "ingress": {"weight": 1, "max": "30M"}}},
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
     "spec": {"total": "1G", "ingressTotal": "200M",
              "teams": [{"name": "team-a", "namespaces": ["team-a"], "defaultClass": "bronze"}]}},
]
PORT = 5321


@pytest.fixture(scope="module")
def lab():
    require_root()
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.iperf_server(lab.internet, PORT)
        lab.iperf_server(lab.peer, PORT)
        yield lab


@pytest.fixture(scope="module")
def files(lab, tmp_path_factory):
    d = tmp_path_factory.mktemp("agent-files")
    write_objects(d / "policy.yaml", POLICY)
    write_objects(d / "pods.yaml", [])
    return d


@pytest.fixture(scope="module")
def agent(lab, files):
    a = AgentProcess(lab, lab.nodes[0], [files], port=9575, log_dir=files,
                     extra=["--default-rate", "1M", "--ingress-default-rate", "1M"]).start()
    try:
        a.wait_ready()
        yield a
    finally:
        print(a.log())
        a.close()


def download_ceil(netns: str, minor: int) -> int | None:
    got = tc_classes(netns, INGRESS_IFB, 0x2).get(minor)
    return from_wire(got[1], DataPathOptions()) if got else None


def test_annotation_edits_apply_to_a_running_download(lab, files, agent):
    node = lab.nodes[0]
    pod = node.pods[0]
    minor = assign_minors([PodShape("x", (pod.ip4, pod.ip6), 1, 1)])["x"]

    write_objects(files / "pods.yaml", [pod_object(pod, node)])
    wait_for(lambda: download_ceil(node.netns, minor) == CLASS_MAX, what="the class's download cap in the kernel")
    assert from_wire(tc_classes(node.netns, INGRESS_IFB, 0x2)[1][1], DataPathOptions()) == NODE_TOTAL
    rate = received_bps(lab.iperf(pod.netns, INTERNET_V4, PORT, seconds=3, reverse=True))
    assert 0.85 * CLASS_MAX < rate < 1.02 * CLASS_MAX, rate  # TCP goodput under a 30M IP-rate cap
    internal = received_bps(lab.iperf(pod.netns, PEER_V4, PORT, seconds=1, reverse=True))
    assert internal > 10 * CLASS_MAX, internal  # an internal download is not capped

    # a new kubernetes.io/ingress-bandwidth value while a download runs: enforced, traffic flowing
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        lab.iperf(pod.netns, INTERNET_V4, PORT, seconds=6, reverse=True, extra=["-i", "0.5"])))
    t.start()
    try:
        write_objects(files / "pods.yaml", [pod_object(pod, node, annotations={"kubernetes.io/ingress-bandwidth": "10M"})])
        wait_for(lambda: download_ceil(node.netns, minor) == 10 * M, what="the new download cap")
    finally:
        t.join(60)
    moved = [i["sum"]["bytes"] for i in result["intervals"]]
    assert all(b > 0 for b in moved), f"a 0.5 s interval without a byte: {moved}"
    assert agent.metric("netagent_pod_ingress_limit_bytes_per_second", f'pod="{pod.name}"') == 10 * M / 8

    # a malformed value: the class's download cap, an Event-worthy problem naming the annotation
    for bad in ("-5M", "0", "lots"):
        write_objects(files / "pods.yaml", [pod_object(pod, node, annotations={"kubernetes.io/ingress-bandwidth": bad})])
        wait_for(lambda: {r for r, _ in (agent.pod(pod.name) or {}).get("problems", [])} == {"InvalidIngressBandwidth"},
                 what=f"the problem for {bad!r}")
        assert download_ceil(node.netns, minor) == CLASS_MAX
    assert "kubernetes.io/ingress-bandwidth" in agent.log()
    assert agent.alive() and agent.get("/readyz")[0] == 200
    seen = agent.pod(pod.name)
    assert seen["ingress_limit_bps"] == CLASS_MAX and agent.state()["ingress_allocation_bps"] == NODE_TOTAL


def test_cleanup_removes_the_download_shaper(lab, files, agent):
    node = lab.nodes[0]
    write_objects(files / "pods.yaml", [pod_object(p, node) for p in node.pods])
    # the node class, the default class and one class for each of the two pods
    wait_for(lambda: len(tc_classes(node.netns, INGRESS_IFB, 0x2)) >= 4, what="both pods' download classes")
    # SIGUSR1 writes every thread's stack to the log and the agent runs on
    os.kill(agent.proc.pid, signal.SIGUSR1)
    wait_for(lambda: "most recent call first" in agent.log(), what="the thread dump in the log")
    assert agent.alive() and agent.get("/readyz")[0] == 200
    assert agent.terminate() == 0
    assert "removed" in run([sys.executable, "-m", "netagent", "cleanup"], node.netns)
    assert "already clean" in run([sys.executable, "-m", "netagent", "cleanup"], node.netns)
    assert INGRESS_IFB not in run(["ip", "link"], node.netns)
    for p in node.pods:
        assert "bpf" not in run(["tc", "filter", "show", "dev", p.node_veth, "egress"], node.netns)
