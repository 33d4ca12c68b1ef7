"""The agent's lean metrics mode (--lean-metrics, docs/scale.md "Metric series"): the same
metric names with fewer series per pod, for very large clusters."""
import inspect

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cli.main import _flags_for, build_parser
from netagent import config as agent_config
from netagent.metrics import AgentMetrics
from netagent.view import NodeView, PodView


def node(pods: int, downloads: bool = False) -> NodeView:
    return NodeView("n1", [PodView(f"ns{j % 3}", f"p{j}", "team-a", "bulk", minor=j + 2, limit_bps=8e6,
                                   allocation_bps=4e6, demand_bps=5e6, throttled_seconds=3.0 + j,
                                   egress_bytes={"internal": 10, "internet": 1000 + j},
                                   ingress_bytes={"internal": 20, "internet": 2000 + j},
                                   ingress_throttled_seconds=1.0,
                                   problems=(("bad-class", "no class x"),) if j == 0 else ())
                           for j in range(pods)],
                    ingress_allocation_bps=1e9 if downloads else None)


def samples(view: NodeView, lean: bool) -> dict[tuple, float]:
    text = generate_latest(AgentMetrics(lambda: view, lean=lean).registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_created")}  # the registry's creation time differs per registry


def test_lean_mode_exports_four_series_a_pod_instead_of_eleven():
    full0, lean0 = len(samples(node(0), False)), len(samples(node(0), True))
    assert full0 == lean0  # the node's own series are the same
    # pod 0 has a policy problem (one series more in both modes)
    assert len(samples(node(110), False)) - full0 == 11 * 110 + 1
    assert len(samples(node(110), True)) - lean0 == 4 * 110 + 1
    # downloads shaped: 18 a pod in full (drops in bytes, delivered downloads), 5 in lean
    assert len(samples(node(30, True), False)) - len(samples(node(0, True), False)) == 18 * 30 + 1
    assert len(samples(node(30, True), True)) - len(samples(node(0, True), True)) == 5 * 30 + 1


def scoped(view: NodeView) -> NodeView:
    """The same node with a NetworkScopes description in force: each pod's bytes carry the two scopes between
    internal and internet (netagent.view: described, so shown even at zero)."""
    for p in view.pods:
        for counts in (p.egress_bytes, p.ingress_bytes):
            counts.update({"cross-zone": 0, "cross-region": 0})
    return view


def test_scopes_described_add_four_series_a_pod_in_full_mode_and_none_in_lean():
    """Issue 39's series per node, with scopes described against without, at 110 pods (docs/scale.md
    "Metric series"): bytes by 4 scopes instead of 2, in both directions; lean keeps internet only."""
    for downloads in (False, True):
        full, lean = len(samples(node(110, downloads), False)), len(samples(node(110, downloads), True))
        assert len(samples(scoped(node(110, downloads)), False)) == full + 4 * 110
        assert len(samples(scoped(node(110, downloads)), True)) == lean
    assert len(samples(scoped(node(110)), False)) == len(samples(node(0), False)) + 15 * 110 + 1


def test_lean_series_are_a_subset_of_the_full_ones_with_the_same_values():
    full, lean = samples(node(5, True), False), samples(node(5, True), True)
    assert lean.keys() < full.keys()  # no new names or label sets: dashboards keep working
    assert all(lean[k] == full[k] for k in lean)
    names = {name for name, _ in lean}
    for kept in ("netagent_pod_egress_bytes_total", "netagent_pod_ingress_bytes_total", "netagent_pod_info",
                 "netagent_pod_egress_throttled_seconds_total", "netagent_pod_ingress_throttled_seconds_total",
                 "netagent_pod_policy_problem"):
        assert kept in names
    for dropped in ("netagent_pod_egress_limit_bytes_per_second", "netagent_pod_egress_allocation_bytes_per_second",
                    "netagent_pod_egress_demand_bytes_per_second", "netagent_pod_egress_dropped_packets_total",
                    "netagent_pod_ingress_limit_bytes_per_second", "netagent_pod_ingress_dropped_packets_total"):
        assert dropped not in names and dropped in {name for name, _ in full}
    scopes = {dict(labels).get("scope") for name, labels in lean if name.startswith("netagent_pod_")}
    assert scopes == {None, "internet"}  # the in-cluster scope is left out per pod, kept per node
    assert ("netagent_node_egress_bytes_total", (("scope", "internal"),)) in lean


def test_the_flag_reaches_the_agent_config():
    a = build_parser().parse_args(["run", "--node", "n1", "--lean-metrics"])
    assert _flags_for(agent_config.from_flags, a)["lean_metrics"] is True
    assert _flags_for(agent_config.from_flags, build_parser().parse_args(["run", "--node", "n1"]))["lean_metrics"] is False
    assert inspect.signature(agent_config.from_flags).parameters["lean_metrics"].default is False
