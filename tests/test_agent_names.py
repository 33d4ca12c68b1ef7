"""Issue 35: the agent's edges keep their names while the code inside moves to `Direction`.

The metric names users and dashboards read and the keys of the agent's /state JSON (what
`netagent status` and scripts read) are held here as snapshots: a name may be added, none
renamed or removed. The view is the metrics renderer test's, with downloads shaped, so every
download family and key is present."""
from __future__ import annotations

from netagent.metrics import AgentMetrics

from .test_agent_metrics_render import view

METRICS = (
    "netagent_build_info", "netagent_controller_reachable", "netagent_controller_refused_pods_total",
    "netagent_controller_report_failures_created", "netagent_controller_report_failures_total",
    "netagent_datapath_changes_total", "netagent_drift_detected_total", "netagent_drift_repairs_total",
    "netagent_events_dropped_created", "netagent_events_dropped_total", "netagent_fail_static",
    "netagent_http_rejected_total", "netagent_last_reconcile_success_timestamp_seconds",
    "netagent_namespaces_missing_created", "netagent_namespaces_missing_total",
    "netagent_node_allocation_bytes_per_second", "netagent_node_egress_bytes_total",
    "netagent_node_ingress_allocation_bytes_per_second", "netagent_node_ingress_bytes_total",
    "netagent_node_unknown_destination_ingress_bytes_total", "netagent_node_unknown_source_egress_bytes_total",
    "netagent_pod_egress_allocation_bytes_per_second", "netagent_pod_egress_bytes_total",
    "netagent_pod_egress_demand_bytes_per_second", "netagent_pod_egress_dropped_bytes_total",
    "netagent_pod_egress_dropped_packets_total", "netagent_pod_egress_limit_bytes_per_second",
    "netagent_pod_egress_throttled_seconds_total", "netagent_pod_info",
    "netagent_pod_ingress_allocation_bytes_per_second", "netagent_pod_ingress_bytes_total",
    "netagent_pod_ingress_delivered_bytes_total", "netagent_pod_ingress_demand_bytes_per_second",
    "netagent_pod_ingress_dropped_bytes_total", "netagent_pod_ingress_dropped_packets_total",
    "netagent_pod_ingress_limit_bytes_per_second", "netagent_pod_ingress_throttled_seconds_total",
    "netagent_pod_policy_problem", "netagent_policy_problems_total", "netagent_ready",
    "netagent_reconcile_duration_seconds", "netagent_reconcile_duration_seconds_created",
    "netagent_reconcile_errors_total", "netagent_report_omitted_total", "netagent_watch_events_total",
)
STATE_NODE = (
    "allocation_bps", "allocation_source", "controller", "controller_reachable", "egress_bytes", "fail_static",
    "ingress_allocation_bps", "ingress_bytes", "ingress_safe_floor_bps", "iptables_backend",
    "last_reconcile_success", "leaf_qdisc", "lease_expires_in", "node", "pods", "quota", "quota_age_seconds",
    "ready", "ready_reason", "safe_floor_bps", "source_errors", "unknown_destination_ingress_bytes",
    "unknown_source_egress_bytes",
)
STATE_POD = (
    "allocation_bps", "demand_bps", "dropped_bytes", "dropped_packets", "egress_bytes", "egress_class",
    "ingress_allocation_bps", "ingress_bytes", "ingress_delivered_bytes", "ingress_demand_bps",
    "ingress_dropped_bytes", "ingress_dropped_packets", "ingress_limit_bps", "ingress_throttled",
    "ingress_throttled_seconds", "ingress_usage_bps", "ips", "limit_bps", "minor", "name", "namespace", "problems",
    "team", "throttled", "throttled_seconds", "usage_bps", "waiting",
)


def test_the_agents_metric_names_are_kept():
    for lean in (False, True):
        text = AgentMetrics(lambda: view(3, True), lean=lean).exposition().decode()
        names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        assert not set(METRICS) - names, f"lean={lean}: renamed or removed: {sorted(set(METRICS) - names)}"


def test_the_state_json_keys_are_kept():
    state = view(3, True).as_dict()
    assert not set(STATE_NODE) - set(state), sorted(set(STATE_NODE) - set(state))
    for pod in state["pods"]:
        assert not set(STATE_POD) - set(pod), sorted(set(STATE_POD) - set(pod))
