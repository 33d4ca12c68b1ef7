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
names, fewer series: 4 a pod (5 when downloads are shaped) instead of 11 (18).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from core.direction import DIRECTIONS, Direction, PerDirection

from . import __version__
from .view import NodeView

BYTES_PER_BIT = 1 / 8


LEAN_SCOPES = ("internet",)  # lean mode: the pods' byte counters of this scope only
LEAN_POD_FIELDS = ("throttled_seconds", "ingress_throttled_seconds")  # lean mode: the only per-pod decision kept

_POD = ["namespace", "pod"]
# One lane of pod families per direction: (the family, the PodView field it reads, the factor to its unit).
# The first is the lane's bytes by scope. The PodView field names are the /state JSON's (an edge: kept);
# each family's name is literal at its constructor, as dashboards/contract.py reads them from this source.
POD_LANE_FAMILIES: PerDirection[tuple[tuple[Callable[[], Metric], str, float], ...]] = PerDirection(
    upload=(
        (lambda: CounterMetricFamily("netagent_pod_egress_bytes",
                                     "IP bytes sent by the pod, by destination scope; internet: as they "
                                     "left its shaper for the uplink (docs/accounting.md).",
                                     labels=["namespace", "pod", "scope"]), "egress_bytes", 1),
        (lambda: CounterMetricFamily("netagent_pod_egress_dropped_packets",
                                     "Internet-bound packets of the pod dropped by its shaper.",
                                     labels=_POD), "dropped_packets", 1),
        (lambda: CounterMetricFamily(
            "netagent_pod_egress_dropped_bytes",
            "IP bytes the pod offered its internet shaper that it dropped: offered = sent + dropped.",
            labels=_POD), "dropped_bytes", 1),
        (lambda: CounterMetricFamily(
            "netagent_pod_egress_throttled_seconds",
            "Seconds during which the pod's internet egress was held back by its limit (sampled each second).",
            labels=_POD), "throttled_seconds", 1),
        (lambda: GaugeMetricFamily("netagent_pod_egress_limit_bytes_per_second",
                                   "Internet egress limit enforced for the pod (HTB ceil).",
                                   labels=_POD), "limit_bps", BYTES_PER_BIT),
        (lambda: GaugeMetricFamily("netagent_pod_egress_allocation_bytes_per_second",
                                   "The pod's fair share of the internet budget (HTB rate).",
                                   labels=_POD), "allocation_bps", BYTES_PER_BIT),
        (lambda: GaugeMetricFamily("netagent_pod_egress_demand_bytes_per_second",
                                   "Estimated internet egress demand of the pod.", labels=_POD), "demand_bps",
         BYTES_PER_BIT),
    ),
    download=(
        (lambda: CounterMetricFamily("netagent_pod_ingress_bytes",
                                     "IP bytes received for the pod, by source scope; internet: as they "
                                     "arrived from the uplink, before its download shaper.",
                                     labels=["namespace", "pod", "scope"]), "ingress_bytes", 1),
        (lambda: GaugeMetricFamily(
            "netagent_pod_ingress_limit_bytes_per_second",
            "Internet ingress (download) limit enforced for the pod (HTB ceil of its download class).",
            labels=_POD), "ingress_limit_bps", BYTES_PER_BIT),
        (lambda: GaugeMetricFamily(
            "netagent_pod_ingress_allocation_bytes_per_second",
            "The pod's fair share of the download budget (HTB rate of its download class).",
            labels=_POD), "ingress_allocation_bps", BYTES_PER_BIT),
        (lambda: GaugeMetricFamily("netagent_pod_ingress_demand_bytes_per_second",
                                   "Estimated internet ingress (download) demand of the pod.",
                                   labels=_POD), "ingress_demand_bps", BYTES_PER_BIT),
        (lambda: CounterMetricFamily("netagent_pod_ingress_dropped_packets",
                                     "Internet packets to the pod dropped by its download shaper.",
                                     labels=_POD), "ingress_dropped_packets", 1),
        (lambda: CounterMetricFamily(
            "netagent_pod_ingress_dropped_bytes",
            "Internet IP bytes for the pod that its download shaper dropped: arrived = delivered + dropped.",
            labels=_POD), "ingress_dropped_bytes", 1),
        (lambda: CounterMetricFamily(
            "netagent_pod_ingress_delivered_bytes",
            "Internet IP bytes that left the pod's download shaper towards the pod.", labels=_POD),
         "ingress_delivered_bytes", 1),
        (lambda: CounterMetricFamily("netagent_pod_ingress_throttled_seconds",
                                     "Seconds during which the pod's downloads were held back by its "
                                     "limit (sampled each second).", labels=_POD), "ingress_throttled_seconds", 1),
    ),
)


class AgentCollector(Collector):
    def __init__(self, view: Callable[[], NodeView], lean: bool = False):
        self.view = view
        self.lean = lean
        self._lines: dict[tuple[str, tuple[str, ...]], str] = {}

    def collect(self):
        for family, rows in self.families(self.view()):
            for labels, value in rows:
                family.add_metric(labels, value)
            yield family

    def render(self) -> str:
        """What `generate_latest` makes of `collect()`, byte for byte (tests/test_agent_metrics_render.py
        holds it to that), at a fraction of the cost: a sample's line up to its value is kept across
        scrapes, since a pod's labels rarely change while its counters change every second."""
        return render(self.families(self.view()), self._lines)

    def families(self, v: NodeView) -> list[tuple[Metric, list[tuple[list[str], float]]]]:
        """Every family of the view, empty, with its samples as (label values, value) rows, in order."""
        out: list[tuple[Metric, list[tuple[list[str], float]]]] = []

        def rows(family: Metric) -> list[tuple[list[str], float]]:
            out.append((family, []))
            return out[-1][1]

        lanes = {d: [(rows(make()), attr, scale) for make, attr, scale in POD_LANE_FAMILIES[d]] for d in DIRECTIONS}
        info = rows(GaugeMetricFamily("netagent_pod_info", "The pod's bandwidth class and team.",
                                      labels=["namespace", "pod", "class", "team"]))
        problem = rows(GaugeMetricFamily(
            "netagent_pod_policy_problem",
            "1 while the pod's netagent annotations are invalid and the default class applies.",
            labels=["namespace", "pod", "reason"]))
        # a download lane's series exist while the download shaper is programmed, for pods with a class
        shaped = PerDirection(True, v.ingress_allocation_bps is not None)
        lean = self.lean
        scopes = LEAN_SCOPES if lean else None  # else: the scopes the pod's view has (cross-* while described)
        for p in v.pods:
            ids = [p.namespace, p.name]
            for d in DIRECTIONS:
                (bytes_rows, bytes_attr, _), *families = lanes[d]
                counts = getattr(p, bytes_attr)
                for scope in scopes or counts:
                    bytes_rows.append(([*ids, scope], counts.get(scope, 0)))
                if not shaped[d] or (d is Direction.DOWNLOAD and p.minor is None):
                    continue
                for family_rows, attr, scale in families:
                    if not lean or attr in LEAN_POD_FIELDS:
                        family_rows.append((ids, getattr(p, attr) * scale))
            info.append(([*ids, p.egress_class, p.team], 1))
            for reason in sorted({r for r, _ in p.problems}):
                problem.append(([*ids, reason], 1))

        _node_families(v, rows, shaped)
        return out


def _node_families(v: NodeView, rows: Callable[[Metric], list[tuple[list[str], float]]],
                   shaped: PerDirection[bool]) -> None:
    """The node's families, after the pods' (`rows(family)` appends one and gives its rows)."""
    node_egress = rows(CounterMetricFamily("netagent_node_egress_bytes",
                                           "IP bytes leaving the node's uplinks, host traffic included; "
                                           "internet: after the node's shaper.",
                                           labels=["scope"]))
    node_ingress = rows(CounterMetricFamily("netagent_node_ingress_bytes",
                                            "Bytes entering the node's uplinks, host traffic included.",
                                            labels=["scope"]))
    # the scopes the view has: internal and internet always, cross-zone and cross-region while described or
    # once counted (netagent.view.scopes_of)
    for family, counts in ((node_egress, v.egress_bytes), (node_ingress, v.ingress_bytes)):
        family.extend(([scope], n) for scope, n in counts.items())
    # one sample without labels each (what `value=` would add)
    rows(CounterMetricFamily("netagent_node_unknown_source_egress_bytes",
                             "Internet egress the node forwarded from sources that are no known pod "
                             "(not yet learnt by the agent), shaped in the default class at the floor.",
                             labels=[])).append(([], v.unknown_source_egress_bytes))
    rows(GaugeMetricFamily("netagent_node_allocation_bytes_per_second",
                           "The node class rate: this node's share of the internet budget.",
                           labels=[])).append(([], v.allocation_bps * BYTES_PER_BIT))
    if shaped[Direction.DOWNLOAD]:
        rows(GaugeMetricFamily("netagent_node_ingress_allocation_bytes_per_second",
                               "The node's download class rate: this node's share of the download budget.",
                               labels=[])).append(([], v.ingress_allocation_bps * BYTES_PER_BIT))
    rows(CounterMetricFamily("netagent_node_unknown_destination_ingress_bytes",
                             "Internet ingress the node forwarded to addresses that are no known pod (not yet "
                             "learnt by the agent), shaped in the download default class at the floor.",
                             labels=[])).append(([], v.unknown_destination_ingress_bytes))
    rows(GaugeMetricFamily("netagent_ready", "1 when the kernel data path matches the desired state.",
                           labels=[])).append(([], 1 if v.ready else 0))
    rows(GaugeMetricFamily("netagent_controller_reachable", "1 when the last report to the controller succeeded.",
                           labels=[])).append(([], 1 if v.controller_reachable else 0))
    rows(GaugeMetricFamily("netagent_fail_static",
                           "1 while the controller's lease ran out and pods run at the safe floor.",
                           labels=[])).append(([], 1 if v.fail_static else 0))
    rows(GaugeMetricFamily("netagent_last_reconcile_success_timestamp_seconds",
                           "Unix time of the last reconcile that left the kernel as desired.",
                           labels=[])).append(([], v.last_reconcile_success))
    rows(GaugeMetricFamily("netagent_build_info", "Version and what the kernel probe chose.",
                           labels=["version", "leaf_qdisc", "iptables_backend"])).append(
        ([__version__, v.leaf_qdisc, v.iptables_backend], 1))


def go_float(d) -> str:
    """prometheus_client.utils.floatToGoString, with the common case first."""
    d = float(d)
    s = repr(d)
    if s[-1] in "fn":  # inf, -inf, nan
        return "+Inf" if d > 0 else "-Inf" if d < 0 else "NaN"
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def render(families: list[tuple[Metric, list[tuple[list[str], float]]]],
           lines: dict[tuple[str, tuple[str, ...]], str]) -> str:
    """The text format of `generate_latest` for counter and gauge families (legacy names, no
    timestamps, no created samples): the families' samples given as rows. `lines` caches each
    sample's line up to its value, by (sample name, label values); it is emptied when it holds
    more than twice the lines of this call (pods come and go)."""
    out: list[str] = []
    new = 0
    for family, rows in families:
        name = family.name + "_total" if family.type == "counter" else family.name
        doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {family.type}\n")
        labelnames = family._labelnames  # type: ignore[attr-defined]  # what add_metric zips the values with
        order = sorted(range(len(labelnames)), key=labelnames.__getitem__)
        for values, value in rows:
            key = (name, tuple(values))
            head = lines.get(key)
            if head is None:
                new += 1
                if values:
                    labels = ",".join(f'{labelnames[i]}="{_label_value(values[i])}"' for i in order)
                    head = lines[key] = f"{name}{{{labels}}} "
                else:
                    head = lines[key] = f"{name} "
            out.append(f"{head}{go_float(value)}\n")
    if new and len(lines) > 2 * (len(out)):
        lines.clear()
    return "".join(out)


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
        self.namespaces_missing = Counter(
            "netagent_namespaces_missing",
            "Namespaces found gone (deleted under running pods) while pods of this node run in them, once per "
            "disappearance; their pods resolve by the namespace's name alone, as on the controller.", registry=r)
        # the instruments above, in their registration order: the registry's collect() before the collector's
        self._instruments = [c for c in vars(self).values() if isinstance(c, MetricWrapperBase)]
        self.collector = AgentCollector(view, lean)
        r.register(self.collector)

    def collect_instruments(self):
        for instrument in self._instruments:
            yield from instrument.collect()

    def exposition(self) -> bytes:
        """`generate_latest(self.registry)`, byte for byte: the instruments through prometheus-client,
        the pods' and node's families (nearly all of it) through `AgentCollector.render`."""
        return generate_latest(_Collect(self.collect_instruments)) + self.collector.render().encode()


class _Collect:
    def __init__(self, collect: Callable):
        self.collect = collect
