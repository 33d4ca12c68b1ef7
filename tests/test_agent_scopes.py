"""The agent's side of issue 39 without a kernel: the NetworkScopes object and its Node's zone read from
files, followed into the facts (the counter's trie entries, the internal networks), the last valid
description kept, the device counter's scope bytes into the pods' and the node's `scope` values (only
internal and internet without a description), their metrics, and the report's per-scope wire fields. The
kernel's side: tests/test_tc_ebpf_scopes_kernel.py, tests/test_tc_ebpf_node_scopes_kernel.py."""
from __future__ import annotations

import msgspec
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.direction import Direction
from core.files import FileSource
from core.objects import Snapshot
from core.wire import POD_SCOPE_BYTES, NodeReport
from iptables.model import PodClassification
from netagent.datapath import add_device_counts, move_scopes
from netagent.datapath_fake import FakeDataPath
from netagent.metrics import AgentMetrics
from netagent.reporter import build_report
from netagent.status import render
from netagent.view import NodeView, PodView
from tests.agents import make_agent

SCOPES_OBJ = {
    "apiVersion": "netagent.io/v1alpha1", "kind": "NetworkScopes", "metadata": {"name": "cluster"},
    "spec": {"zones": [{"name": "a", "cidrs": ["10.1.0.0/16", "fd01::/16"]},
                       {"name": "b", "cidrs": ["10.2.0.0/16"]}],
             "regions": [{"name": "far", "cidrs": ["10.3.0.0/16"]}]},
}
NODE = {"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "a"}}}
ENTRIES_IN_A = (("10.1.0.0/16", 0), ("10.2.0.0/16", 1), ("10.3.0.0/16", 2), ("fd01::/16", 0))


def test_the_file_source_reads_the_cluster_scopes_and_this_nodes_zone(tmp_path):
    other = {"kind": "NetworkScopes", "metadata": {"name": "other"}, "spec": {}}
    other_node = {"kind": "Node", "metadata": {"name": "n2", "labels": {"topology.kubernetes.io/zone": "b"}}}
    f = tmp_path / "net.yaml"
    f.write_text(yaml.safe_dump_all([SCOPES_OBJ, NODE, other, other_node]))
    snap = FileSource([str(f)], node="n1").load()[0]
    assert snap.network_scopes == SCOPES_OBJ and snap.node_zone == "a"
    # no label: no zone; another node's Node is not this one's
    f.write_text(yaml.safe_dump({**NODE, "metadata": {"name": "n1"}}))
    assert FileSource([str(f)], node="n1").load()[0].node_zone is None
    assert FileSource([str(f)], node="n2").load()[0].network_scopes is None


def test_the_agent_follows_the_description_keeps_the_last_valid_and_counts_a_problem():
    agent, _ = make_agent()
    counted: list[str] = []
    agent.node.problems = type("P", (), {"count": lambda self, reason: counted.append(reason)})()
    agent.on_snapshot(Snapshot(network_scopes=SCOPES_OBJ, node_zone="a"))
    assert agent.facts.scopes == ENTRIES_IN_A
    # every described CIDR is internal: the rules never mark it for the shaper, the counter looks it up
    assert {"10.1.0.0/16", "10.2.0.0/16", "10.3.0.0/16", "fd01::/16"} <= set(agent.facts.internal)
    # an overlap between zones is refused: the last valid description stays, the problem is counted
    bad = {**SCOPES_OBJ, "spec": {**SCOPES_OBJ["spec"], "zones": [{"name": "a", "cidrs": ["10.1.0.0/16"]},
                                                                   {"name": "b", "cidrs": ["10.1.128.0/17"]}]}}
    agent.on_snapshot(Snapshot(network_scopes=bad, node_zone="a"))
    assert agent.facts.scopes == ENTRIES_IN_A and counted == ["network_scopes_invalid"]
    # a node without a zone label: every described zone is cross-zone (core.scopes.lpm_entries' precedence)
    agent.on_snapshot(Snapshot(network_scopes=SCOPES_OBJ, node_zone=None))
    assert dict(agent.facts.scopes) == {"10.1.0.0/16": 1, "10.2.0.0/16": 1, "10.3.0.0/16": 2, "fd01::/16": 1}
    # the object deleted: no description, the internal networks as configured
    agent.on_snapshot(Snapshot())
    assert agent.facts.scopes == () and agent.facts.internal == ("10.0.0.0/8",)


POD = PodClassification("ns/p", ("10.244.0.10",), (1, 2))


def test_the_scope_bytes_move_out_of_internal_and_appear_only_while_described_or_counted():
    device = {"10.244.0.10": (1000, 10, 500, 5)}
    pods: dict = {}
    add_device_counts(pods, device, (POD,), None, {"10.244.0.10": (0, 0, 0, 0)}, described=False)
    assert pods == {"ns/p": {"egress_internal": 1000, "ingress_internal": 500}}  # as without scopes
    pods = {}
    add_device_counts(pods, device, (POD,), None, {"10.244.0.10": (300, 200, 100, 0)}, described=True)
    assert pods == {"ns/p": {"egress_internal": 500, "ingress_internal": 400, "egress_cross-zone": 300,
                             "egress_cross-region": 200, "ingress_cross-zone": 100, "ingress_cross-region": 0}}
    # the description removed: what was counted by scope stays in its scope (no series steps down)
    pods = {}
    add_device_counts(pods, device, (POD,), None, {"10.244.0.10": (300, 200, 100, 0)}, described=False)
    assert pods["ns/p"]["egress_internal"] == 500 and pods["ns/p"]["egress_cross-zone"] == 300


def node_scrape(metrics: AgentMetrics) -> dict[tuple, float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, s.labels["scope"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in ("netagent_node_egress_bytes_total", "netagent_node_ingress_bytes_total")}


def test_the_nodes_cross_bytes_move_out_of_internal_into_the_view_metrics_and_state():
    """The uplinks' cross bytes (InternalCounter.read_node_scopes) out of the node's internal totals, as a
    pod's: only internal and internet without a description (and none counted), all four once described,
    the sum over the scopes the internal + internet the node counted before."""
    counted = {"egress_internal": 1000, "ingress_internal": 800, "egress_internet": 50, "ingress_internet": 70,
               "egress_internet_wire": 55}
    node = dict(counted)
    move_scopes(node, (0, 0, 0, 0), described=False)
    assert node == counted  # as without scopes
    dp = FakeDataPath()
    agent, metrics = make_agent(dp)
    dp.node_counters = node
    egress, ingress = "netagent_node_egress_bytes_total", "netagent_node_ingress_bytes_total"
    assert node_scrape(metrics) == {(egress, "internal"): 1000, (egress, "internet"): 55,
                                    (ingress, "internal"): 800, (ingress, "internet"): 70}
    node = dict(counted)
    move_scopes(node, (300, 200, 100, 0), described=True)
    dp.node_counters = node
    view = agent.view()
    assert view.egress_bytes == {"internal": 500, "cross-zone": 300, "cross-region": 200, "internet": 55}
    assert view.ingress_bytes == {"internal": 700, "cross-zone": 100, "cross-region": 0, "internet": 70}
    assert sum(view.ingress_bytes.values()) == counted["ingress_internal"] + counted["ingress_internet"]
    assert sum(view.egress_bytes.values()) == counted["egress_internal"] + counted["egress_internet_wire"]
    got = node_scrape(metrics)
    assert {scope: v for (name, scope), v in got.items() if name == egress} == view.egress_bytes
    assert {scope: v for (name, scope), v in got.items() if name == ingress} == view.ingress_bytes
    # the description removed: what was counted by scope stays in its scope (no series steps down)
    node = dict(counted)
    move_scopes(node, (300, 200, 100, 0), described=False)
    assert node["egress_cross-zone"] == 300 and node["ingress_internal"] == 700
    # /state carries them, and `netagent status` still renders the node's line from it
    state = msgspec.json.decode(msgspec.json.encode(view.as_dict()))
    assert state["egress_bytes"]["cross-region"] == 200
    assert "internet out 55 B" in render(state)


def scrape(view: NodeView) -> dict[tuple, float]:
    text = generate_latest(AgentMetrics(lambda: view).registry).decode()
    return {(s.name, s.labels.get("scope")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "netagent_pod_egress_bytes_total"}


def test_the_metrics_scope_values_with_and_without_a_description():
    without = PodView("ns", "p", team="web", egress_class="default", egress_bytes={"internal": 5, "internet": 7})
    assert set(scrape(NodeView("n1", [without]))) == {("netagent_pod_egress_bytes_total", "internal"),
                                                       ("netagent_pod_egress_bytes_total", "internet")}
    scoped = PodView("ns", "p", team="web", egress_class="default", egress_bytes={"internal": 5, "cross-zone": 3, "cross-region": 2, "internet": 7})
    got = scrape(NodeView("n1", [scoped]))
    assert {scope: v for (_, scope), v in got.items()} == {"internal": 5, "cross-zone": 3, "cross-region": 2,
                                                             "internet": 7}


def test_the_report_carries_the_per_scope_bytes_and_old_shaped_counters_still_work():
    agent, _ = make_agent(controller="https://c:8443", pods=[("ns", "p"), ("ns", "q")])
    inputs = agent.report_inputs()
    report = build_report(inputs, 1, 10.0, 0.0, counters={
        "ns/p": (7, 9, {"cross-zone": 3, "cross-region": 2}, {"cross-zone": 1}),
        "ns/q": (4, 6)}, epoch="e1")
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=NodeReport)
    by = {p.name: p for p in decoded.pods}
    assert POD_SCOPE_BYTES[Direction.UPLOAD](by["p"]) == {"cross-zone": 3, "cross-region": 2}
    assert POD_SCOPE_BYTES[Direction.DOWNLOAD](by["p"]) == {"cross-zone": 1}
    assert by["p"].bytes_total == 7 and POD_SCOPE_BYTES[Direction.UPLOAD](by["q"]) == {}
