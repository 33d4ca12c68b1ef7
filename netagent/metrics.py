"""Prometheus metrics of the agent.

A custom collector builds every pod and node series from a fresh `NodeView` at
scrape time (kernel counters read then, in one pass per table/device), so a
deleted pod's series simply stop existing and nothing is cached between scrapes.
Labels stay bounded: namespace, pod, scope, class, team, reason; never IPs or
destinations. The names are the contract the dashboards use (dashboards/contract.py).

Lean mode (`--lean-metrics`, for very large clusters: docs/scale.md "Metric series") keeps per
pod only what accounting and the "who is held back" panels need: internet bytes both ways,
the throttled seconds (both directions), the pod's info (team and class joins) and policy
problems (present only on a problem); the per-pod limit, allocation, demand and drop families
and the in-cluster scope are left out (the controller holds the decisions per team). Same
names, fewer series: 4 a pod (5 when downloads are shaped) instead of 10 (15).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from . import __version__
from .view import SCOPES, NodeView

BYTES_PER_BIT = 1 / 8


LEAN_SCOPES = ("internet",)  # lean mode: the pods' byte counters of this scope only


class AgentCollector(Collector):
    def __init__(self, view: Callable[[], NodeView], lean: bool = False):
        self.view = view
        self.lean = lean

    def collect(self):
        v = self.view()
        pod_egress = CounterMetricFamily("netagent_pod_egress_bytes", "Bytes sent by the pod, by destination scope.",
                                         labels=["namespace", "pod", "scope"])
        pod_ingress = CounterMetricFamily("netagent_pod_ingress_bytes", "Bytes received by the pod, by source scope.",
                                          labels=["namespace", "pod", "scope"])
        dropped = CounterMetricFamily("netagent_pod_egress_dropped_packets",
                                      "Internet-bound packets of the pod dropped by its shaper.", labels=["namespace", "pod"])
        throttled = CounterMetricFamily(
            "netagent_pod_egress_throttled_seconds",
            "Seconds during which the pod's internet egress was held back by its limit (sampled each second).",
            labels=["namespace", "pod"])
        limit = GaugeMetricFamily("netagent_pod_egress_limit_bytes_per_second",
                                  "Internet egress limit enforced for the pod (HTB ceil).", labels=["namespace", "pod"])
        alloc = GaugeMetricFamily("netagent_pod_egress_allocation_bytes_per_second",
                                  "The pod's fair share of the internet budget (HTB rate).", labels=["namespace", "pod"])
        demand = GaugeMetricFamily("netagent_pod_egress_demand_bytes_per_second",
                                   "Estimated internet egress demand of the pod.", labels=["namespace", "pod"])
        info = GaugeMetricFamily("netagent_pod_info", "The pod's bandwidth class and team.",
                                 labels=["namespace", "pod", "class", "team"])
        problem = GaugeMetricFamily("netagent_pod_policy_problem",
                                    "1 while the pod's netagent annotations are invalid and the default class applies.",
                                    labels=["namespace", "pod", "reason"])
        # each family named literally at its call: dashboards/contract.py reads the names from this source
        dl = {f.name: f for f in (
            GaugeMetricFamily("netagent_pod_ingress_limit_bytes_per_second",
                              "Internet ingress (download) limit enforced for the pod (HTB ceil of its download class).",
                              labels=["namespace", "pod"]),
            GaugeMetricFamily("netagent_pod_ingress_allocation_bytes_per_second",
                              "The pod's fair share of the download budget (HTB rate of its download class).",
                              labels=["namespace", "pod"]),
            GaugeMetricFamily("netagent_pod_ingress_demand_bytes_per_second",
                              "Estimated internet ingress (download) demand of the pod.", labels=["namespace", "pod"]),
            CounterMetricFamily("netagent_pod_ingress_dropped_packets",
                                "Internet packets to the pod dropped by its download shaper.",
                                labels=["namespace", "pod"]),
            CounterMetricFamily("netagent_pod_ingress_throttled_seconds",
                                "Seconds during which the pod's downloads were held back by its limit "
                                "(sampled each second).", labels=["namespace", "pod"]))}
        shaped = v.ingress_allocation_bps is not None
        lean = self.lean
        scopes = LEAN_SCOPES if lean else SCOPES
        for p in v.pods:
            ids = [p.namespace, p.name]
            for scope in scopes:
                pod_egress.add_metric([*ids, scope], p.egress_bytes.get(scope, 0))
                pod_ingress.add_metric([*ids, scope], p.ingress_bytes.get(scope, 0))
            throttled.add_metric(ids, p.throttled_seconds)
            info.add_metric([*ids, p.egress_class, p.team], 1)
            for reason in sorted({r for r, _ in p.problems}):
                problem.add_metric([*ids, reason], 1)
            if shaped and p.minor is not None:
                dl["netagent_pod_ingress_throttled_seconds"].add_metric(ids, p.ingress_throttled_seconds)
            if lean:
                continue
            if shaped and p.minor is not None:
                dl["netagent_pod_ingress_limit_bytes_per_second"].add_metric(ids, p.ingress_limit_bps * BYTES_PER_BIT)
                dl["netagent_pod_ingress_allocation_bytes_per_second"].add_metric(
                    ids, p.ingress_allocation_bps * BYTES_PER_BIT)
                dl["netagent_pod_ingress_demand_bytes_per_second"].add_metric(ids, p.ingress_demand_bps * BYTES_PER_BIT)
                dl["netagent_pod_ingress_dropped_packets"].add_metric(ids, p.ingress_dropped_packets)
            dropped.add_metric(ids, p.dropped_packets)
            limit.add_metric(ids, p.limit_bps * BYTES_PER_BIT)
            alloc.add_metric(ids, p.allocation_bps * BYTES_PER_BIT)
            demand.add_metric(ids, p.demand_bps * BYTES_PER_BIT)
        yield from (pod_egress, pod_ingress, dropped, throttled, limit, alloc, demand, info, problem)
        yield from dl.values()

        node_egress = CounterMetricFamily("netagent_node_egress_bytes",
                                          "Bytes leaving the node's uplinks, host traffic included.", labels=["scope"])
        node_ingress = CounterMetricFamily("netagent_node_ingress_bytes",
                                           "Bytes entering the node's uplinks, host traffic included.", labels=["scope"])
        for scope in SCOPES:
            node_egress.add_metric([scope], v.egress_bytes.get(scope, 0))
            node_ingress.add_metric([scope], v.ingress_bytes.get(scope, 0))
        yield node_egress
        yield node_ingress
        yield CounterMetricFamily("netagent_node_unknown_source_egress_bytes",
                                  "Internet egress the node forwarded from sources that are no known pod "
                                  "(not yet learnt by the agent), shaped in the default class at the floor.",
                                  value=v.unknown_source_egress_bytes)
        yield GaugeMetricFamily("netagent_node_allocation_bytes_per_second",
                                "The node class rate: this node's share of the internet budget.",
                                value=v.allocation_bps * BYTES_PER_BIT)
        if shaped:
            yield GaugeMetricFamily("netagent_node_ingress_allocation_bytes_per_second",
                                    "The node's download class rate: this node's share of the download budget.",
                                    value=v.ingress_allocation_bps * BYTES_PER_BIT)
        yield CounterMetricFamily("netagent_node_unknown_destination_ingress_bytes",
                                  "Internet ingress the node forwarded to addresses that are no known pod (not yet "
                                  "learnt by the agent), shaped in the download default class at the floor.",
                                  value=v.unknown_destination_ingress_bytes)
        yield GaugeMetricFamily("netagent_ready", "1 when the kernel data path matches the desired state.",
                                value=1 if v.ready else 0)
        yield GaugeMetricFamily("netagent_controller_reachable", "1 when the last report to the controller succeeded.",
                                value=1 if v.controller_reachable else 0)
        yield GaugeMetricFamily("netagent_fail_static",
                                "1 while the controller's lease ran out and pods run at the safe floor.",
                                value=1 if v.fail_static else 0)
        yield GaugeMetricFamily("netagent_last_reconcile_success_timestamp_seconds",
                                "Unix time of the last reconcile that left the kernel as desired.",
                                value=v.last_reconcile_success)
        build = GaugeMetricFamily("netagent_build_info", "Version and what the kernel probe chose.",
                                  labels=["version", "leaf_qdisc", "iptables_backend"])
        build.add_metric([__version__, v.leaf_qdisc, v.iptables_backend], 1)
        yield build


class AgentMetrics:
    """The agent's own instruments (the sync loop), plus the scrape-time collector."""

    def __init__(self, view: Callable[[], NodeView], lean: bool = False):
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconcile_duration = Histogram(
            "netagent_reconcile_duration_seconds", "Time to compute and apply the desired kernel state.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.reconcile_errors = Counter("netagent_reconcile_errors", "Reconciles that failed, by stage.",
                                        ["stage"], registry=r)
        self.drift_repairs = Counter("netagent_drift_repairs",
                                     "Kernel state found changed by someone else and restored, by kind.",
                                     ["kind"], registry=r)
        self.kernel_changes = Counter("netagent_datapath_changes",
                                      "Changes made to the kernel (tc operations, iptables/ipset updates), by kind. "
                                      "Flat while nothing changes: a restart adds none.", ["kind"], registry=r)
        self.report_failures = Counter("netagent_controller_report_failures",
                                       "Reports to the controller that failed.", registry=r)
        self.refused_pods = Counter("netagent_controller_refused_pods",
                                    "Pods of this node's reports the controller refused, by reason.", ["reason"],
                                    registry=r)
        self.policy_problems = Counter("netagent_policy_problems",
                                       "Invalid pod annotations seen (once per change), by reason.", ["reason"], registry=r)
        self.watch_events = Counter("netagent_watch_events", "Kubernetes watch events, by resource and type.",
                                    ["resource", "type"], registry=r)
        self.events_dropped = Counter("netagent_events_dropped",
                                      "Kubernetes Events not written because the Event queue was full (the API "
                                      "server slower than problems arrive); the log line and metric still tell.",
                                      registry=r)
        self.report_omitted = Counter("netagent_report_omitted",
                                      "What the agent left out of its controller reports, by reason "
                                      "(annotation_too_long: fields; too_many_pods: pods).", ["reason"], registry=r)
        self.http_rejected = Counter("netagent_http_rejected",
                                     "Connections to the agent's HTTP endpoints closed without an answer or "
                                     "refused, by reason.", ["reason"], registry=r)
        self.drift_checks = Counter("netagent_drift_detected",
                                    "Changes to the kernel state noticed between syncs that triggered an "
                                    "immediate resync, by source (netlink, hooks, uplinks).", ["source"], registry=r)
        r.register(AgentCollector(view, lean))
