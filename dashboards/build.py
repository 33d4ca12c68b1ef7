"""Generate netagent's Grafana dashboards as code (the chart embeds them, and dashboards/rules.yaml, directly).

    python3 -m dashboards.build          # write dashboards/*.json (the chart renders rules.yaml as a PrometheusRule)
    python3 -m dashboards.build --check  # exit 1 if a committed file differs from what this produces

Dashboards are built with grafana-foundation-sdk. Rates are shown in bit/s (the unit of the
CRDs and of `kubernetes.io/egress-bandwidth`); the metrics are in bytes, hence the `* 8`.
The dashboards query the exporters' raw series with $__rate_interval, so they work on the
day the chart is installed (no recording rule needed); the recording rules and alerts of
dashboards/rules.yaml ship with the chart's PrometheusRule (monitoring.prometheusRule).
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Iterator

from grafana_foundation_sdk.builders import common as gcb
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import table as gtable
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as gc
from grafana_foundation_sdk.models import dashboard as gm
from grafana_foundation_sdk.models import prometheus as gpm

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RULES = HERE / "rules.yaml"

DATASOURCE = gm.DataSourceRef(type_val="prometheus", uid="${datasource}")
CLUSTER = 'cluster=~"$cluster"'
NODE = f'{CLUSTER}, node=~"$node"'
POD = f'{NODE}, namespace=~"$namespace", pod=~"$pod"'
# a follower's view is stale by design: controller series count only from the Lease holder
LEADER = "and on (cluster, job, instance) (netagent_controller_is_leader == 1)"
TEAM = 'team=~"$team"'
# Grafana's window for rate(): at least four scrape intervals, whatever the monitors' interval is
RATE = "$__rate_interval"
# template variables a query may reference (fill_variables substitutes them as Grafana would)
VARIABLES = ("datasource", "cluster", "team", "node", "namespace", "pod")
# the dashboard's time range (increase over it: fill_variables substitutes range_)
RANGE = "$__range"

# The dashboards query the exporters' raw series, never the recording rules of dashboards/rules.yaml:
# those ship only with monitoring.prometheusRule (a CRD and a rule evaluator the cluster may not have,
# off by default), and a fixed rate1m cannot follow $__rate_interval. Each entry is what the recording
# rule of the same name computes, with the dashboard's selector inside (docs/dashboards.md).
POD_INFO = f"max by (cluster, namespace, pod, team, class) (netagent_pod_info{{{CLUSTER}, {TEAM}}})"


def _pods(metric: str, sel: str, extra: str = "") -> str:
    """Per-pod rate of an agent counter, only the selected teams' pods, with their team and class."""
    return (f"(sum by (cluster, node, namespace, pod) (rate({metric}{{{sel}{extra}}}[{RATE}])) "
            f"* on (cluster, namespace, pod) group_left (team, class) {POD_INFO})")


def _leader(metric: str, by: str, sel: str, extra: str = "") -> str:
    """A controller gauge as the replica holding the Lease reports it (a follower's view is stale)."""
    return f"max by ({by}) ({metric}{{{sel}{extra}}} {LEADER})"


def raw(name: str, sel: str) -> str:
    """The raw-series expression of recording rule netagent:<name>, restricted by selector sel."""
    internet = ', scope="internet"'
    team = f", {TEAM}"
    for direction, infix in (("egress", ""), ("ingress", "ingress_")):
        pods = {
            f"pod_internet_{direction}_bytes:rate1m": _pods(f"netagent_pod_{direction}_bytes_total", sel, internet),
            f"pod_{direction}_dropped_packets:rate5m": _pods(f"netagent_pod_{direction}_dropped_packets_total", sel),
            f"pod_{direction}_throttled:ratio_rate5m": _pods(f"netagent_pod_{direction}_throttled_seconds_total", sel),
            f"team_class_internet_{direction}_bytes:rate1m":
                f"sum by (cluster, team, class) {_pods(f'netagent_pod_{direction}_bytes_total', sel, internet)}",
            f"cluster_internet_{direction}_bytes:rate1m":
                f"sum by (cluster) (rate(netagent_pod_{direction}_bytes_total{{{sel}{internet}}}[{RATE}]))",
            f"controller_{infix}budget_bytes_per_second:leader": _leader(
                f"netagent_controller_{infix}budget_bytes_per_second", "cluster", sel),
            # a pod's cost per second by priced scope (docs/scopes.md): its bytes x the price per GiB
            f"pod_{direction}_cost:rate5m":
                f'sum by (cluster, namespace, pod, scope) (rate(netagent_pod_{direction}_bytes_total'
                f'{{{sel}, scope!="internal"}}[{RATE}])) * on (cluster, scope) group_left (currency) '
                f'(max by (cluster, scope, currency) (netagent_controller_scope_price_per_gib'
                f'{{direction="{direction}"}}) / 1073741824)',
        }
        for kind in ("allocated", "demand", "used"):
            pods[f"controller_{infix}{kind}_bytes_per_second:leader"] = _leader(
                f"netagent_controller_{infix}{kind}_bytes_per_second", "cluster, team, class", sel, team)
        if name in pods:
            expr = pods[name]
            if name == "controller_ingress_budget_bytes_per_second:leader":
                # without spec.ingressTotal the download budget is 2^50 B/s: no budget
                expr = expr.replace(f"}} {LEADER}", f"}} < 2^50 {LEADER}")
            return expr
    if name in ("controller_budget_used:ratio", "controller_ingress_budget_used:ratio"):
        infix = "ingress_" if "ingress" in name else ""
        budget = raw(f"controller_{infix}budget_bytes_per_second:leader", sel)
        used = _leader(f"netagent_controller_{infix}used_bytes_per_second", "cluster, team, class", sel)
        return f"sum by (cluster) ({used}) / on (cluster) ({budget} > 0)"
    if name == "team_class_egress_demand_bytes_per_second:sum":
        return (f"sum by (cluster, team, class) (netagent_pod_egress_demand_bytes_per_second{{{sel}}} "
                f"* on (cluster, namespace, pod) group_left (team, class) {POD_INFO})")
    if name == "cluster_node_internet_ingress_bytes:rate5m":
        return f"sum by (cluster) (rate(netagent_node_ingress_bytes_total{{{sel}{internet}}}[{RATE}]))"
    if name == "controller_allocation_duration_seconds:p99_5m":
        return (f"histogram_quantile(0.99, sum by (cluster, le) "
                f"(rate(netagent_controller_allocation_duration_seconds_bucket{{{sel}}}[{RATE}]) {LEADER}))")
    raise KeyError(f"no raw expression for netagent:{name}")


def query(expr: str, legend: str = "", instant: bool = False, ref: str = "A") -> gp.Dataquery:
    q = gp.Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant().format(gpm.PromQueryFormat.TABLE)
    return q


def timeseries(title: str, description: str, unit: str, *targets: gp.Dataquery, width: int = 12,
               stacked: bool = False) -> gts.Panel:
    p = (gts.Panel().title(title).description(description).unit(unit).span(width).height(8)
         .datasource(DATASOURCE).fill_opacity(10).line_width(1)
         .legend(gcb.VizLegendOptions().show_legend(True).display_mode(gc.LegendDisplayMode.TABLE)
                 .placement(gc.LegendPlacement.BOTTOM).calcs(["lastNotNull", "max"]))
         .tooltip(gcb.VizTooltipOptions().mode(gc.TooltipDisplayMode.MULTI).sort(gc.SortOrder.DESCENDING)))
    if stacked:
        p = p.stacking(gcb.StackingConfig().mode(gc.StackingMode.NORMAL))
    for t in targets:
        p = p.with_target(t)
    return p


def stat(title: str, description: str, unit: str, expr: str, width: int = 4,
         thresholds: list[tuple[float | None, str]] | None = None) -> gstat.Panel:
    steps = [gm.Threshold(value=v, color=c) for v, c in (thresholds or [(None, "green")])]
    return (gstat.Panel().title(title).description(description).unit(unit).span(width).height(4)
            .datasource(DATASOURCE).with_target(query(expr, instant=True))
            .thresholds(gd.ThresholdsConfig().mode(gm.ThresholdsMode.ABSOLUTE).steps(steps))
            .color_mode(gc.BigValueColorMode.BACKGROUND).graph_mode(gc.BigValueGraphMode.NONE)
            .reduce_options(gcb.ReduceDataOptions().calcs(["lastNotNull"])))


def table(title: str, description: str, unit: str, *targets: gp.Dataquery, width: int = 12) -> gtable.Panel:
    p = (gtable.Panel().title(title).description(description).unit(unit).span(width).height(9)
         .datasource(DATASOURCE)
         .with_transformation(gm.DataTransformerConfig(id_val="merge", options={}))
         .with_transformation(gm.DataTransformerConfig(
             id_val="organize", options={"excludeByName": {"Time": True}})))
    for t in targets:
        p = p.with_target(t)
    return p


def variable(name: str, label: str, query_text: str) -> gd.QueryVariable:
    return (gd.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query({"query": query_text, "refId": f"{name}-values"})
            .refresh(gm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(gm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(gm.VariableOption(selected=True, text="All", value="$__all")))


def datasource_variable() -> gd.DatasourceVariable:
    return gd.DatasourceVariable("datasource").label("Data source").type("prometheus")


def base(uid: str, title: str, description: str) -> gd.Dashboard:
    return (gd.Dashboard(title).uid(uid).description(description).tags(["netagent", "network"])
            .editable().refresh("30s").time("now-1h", "now").timezone("browser")
            .tooltip(gm.DashboardCursorSync.CROSSHAIR)
            .with_variable(datasource_variable())
            .with_variable(variable("cluster", "Cluster", "label_values(netagent_build_info, cluster)"))
            .with_variable(variable("team", "Team", f"label_values(netagent_pod_info{{{CLUSTER}}}, team)")))


# the budget drawn as a dashed red line over stacked usage
BUDGET_LINE = [gm.DynamicConfigValue(id_val="custom.stacking", value={"mode": "none"}),
               gm.DynamicConfigValue(id_val="custom.fillOpacity", value=0),
               gm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
               gm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"})]


def cluster_dashboard() -> gd.Dashboard:
    d = base("netagent-cluster", "netagent / cluster",
             "Internet egress of the cluster against its budget, by team and class; demand and fair "
             "allocation; the pods that send, drop and are throttled most; the same for downloads (internet "
             "to pod, 'ingress') against spec.ingressTotal; health of agents and controller.")
    d = d.with_row(gd.Row("Budget"))
    d = d.with_panel(stat(
        "Budget", "spec.total of the EgressBudget, as the leader controller holds it.", "bps",
        f"sum({raw('controller_budget_bytes_per_second:leader', CLUSTER)}) * 8"))
    d = d.with_panel(stat(
        "Used / budget", "Internet egress the controller measures, as a share of the budget (per cluster).",
        "percentunit", f"{raw('controller_budget_used:ratio', CLUSTER)}",
        thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")]))
    d = d.with_panel(stat(
        "Internet egress now", "Sum of the pods' internet egress measured by the agents.", "bps",
        f"sum({raw('cluster_internet_egress_bytes:rate1m', CLUSTER)}) * 8"))
    d = d.with_panel(stat(
        "Demand", "Sum of the pods' estimated internet egress demand.", "bps",
        f"sum({raw('team_class_egress_demand_bytes_per_second:sum', CLUSTER)}) * 8"))
    d = d.with_panel(stat(
        "Pods", "Pods the controller allocates for.", "short",
        f"sum(netagent_controller_pods{{{CLUSTER}}} {LEADER})"))
    d = d.with_panel(stat(
        "Agents reporting", "Agents the controller heard from recently.", "short",
        f"sum(netagent_controller_agents{{{CLUSTER}}} {LEADER})"))
    d = d.with_panel(timeseries(
        "Internet egress by team, against the budget",
        "Stacked: each team's measured internet egress (agents' counters). Line: the budget.", "bps",
        query(f"sum by (team) ({raw('team_class_internet_egress_bytes:rate1m', CLUSTER)}) * 8", "{{team}}"),
        query(f"sum({raw('controller_budget_bytes_per_second:leader', CLUSTER)}) * 8", "budget", ref="B"),
        width=12, stacked=True)
        .override_by_name("budget", BUDGET_LINE))
    d = d.with_panel(timeseries(
        "Internet egress by team and class", "Measured internet egress per (team, class).", "bps",
        query(f"{raw('team_class_internet_egress_bytes:rate1m', CLUSTER)} * 8", "{{team}} / {{class}}"),
        width=12))

    d = d.with_row(gd.Row("Demand and allocation"))
    d = d.with_panel(timeseries(
        "Demand vs allocation by team",
        "What each team's pods want (estimated demand) and the fair share the controller gives them.", "bps",
        query(f"sum by (team) ({raw('controller_demand_bytes_per_second:leader', CLUSTER)}) * 8",
              "demand {{team}}"),
        query(f"sum by (team) ({raw('controller_allocated_bytes_per_second:leader', CLUSTER)}) * 8",
              "allocated {{team}}", ref="B"),
        width=12))
    d = d.with_panel(table(
        "Demand, allocation and use by team and class",
        "The controller's view at the end of the range (leader only).", "bps",
        query(f"{raw('controller_demand_bytes_per_second:leader', CLUSTER)} * 8", "demand", True),
        query(f"{raw('controller_allocated_bytes_per_second:leader', CLUSTER)} * 8", "allocated", True, "B"),
        query(f"{raw('controller_used_bytes_per_second:leader', CLUSTER)} * 8", "used", True, "C"),
        width=12))

    d = d.with_panel(stat(
        "Teams below guarantee", "Teams allocated less than min(guarantee, demand) (NetagentTeamStarved).", "short",
        f"sum(netagent_controller_guarantee_unmet{{{CLUSTER}}} {LEADER}) or vector(0)",
        thresholds=[(None, "green"), (1, "red")], width=6))
    d = d.with_panel(stat(
        "Oversubscribed", "1 when the teams' guarantees add up to more than the budget.", "short",
        f"max(netagent_controller_oversubscribed{{{CLUSTER}}} {LEADER}) or vector(0)",
        thresholds=[(None, "green"), (1, "orange")], width=6))
    d = d.with_panel(timeseries(
        "Guarantee vs allocation by team", "Each team's guaranteed minimum and its fair share now.", "bps",
        query(f"max by (team) (netagent_controller_team_guarantee_bytes_per_second{{{CLUSTER}}} {LEADER}) * 8",
              "guarantee {{team}}"),
        query(f"sum by (team) ({raw('controller_allocated_bytes_per_second:leader', CLUSTER)}) * 8",
              "allocated {{team}}", ref="B"),
        width=12))

    d = d.with_row(gd.Row("Pods"))
    d = d.with_panel(table(
        "Top pods by internet egress", "The 15 pods sending most to the internet now.", "bps",
        query(f"topk(15, {raw('pod_internet_egress_bytes:rate1m', CLUSTER)}) * 8", "", True), width=8))
    d = d.with_panel(table(
        "Most throttled pods",
        "Share of the rate interval each pod spent held back by its limit (1 = always).", "percentunit",
        query(f"topk(15, {raw('pod_egress_throttled:ratio_rate5m', CLUSTER)})", "", True), width=8))
    d = d.with_panel(timeseries(
        "Shaper drops by team", "Internet-bound packets dropped at the pods' limits.", "pps",
        query(f"sum by (team) ({raw('pod_egress_dropped_packets:rate5m', CLUSTER)} "
              f")", "{{team}}"),
        width=8))

    d = downloads_rows(d)
    d = quota_rows(d)

    d = d.with_row(gd.Row("Agents and controller"))
    d = d.with_panel(stat(
        "Agents ready", "Agents whose kernel data path matches their desired state.", "short",
        f"count(netagent_ready{{{CLUSTER}}} == 1) or vector(0)"))
    d = d.with_panel(stat(
        "Agents not ready", "Agents whose data path does not match (see NetagentAgentNotReady).", "short",
        f"count(netagent_ready{{{CLUSTER}}} == 0) or vector(0)", thresholds=[(None, "green"), (1, "red")]))
    d = d.with_panel(stat(
        "Agents at safe floor", "Agents whose controller lease ran out (fail-static).", "short",
        f"count(netagent_fail_static{{{CLUSTER}}} == 1) or vector(0)", thresholds=[(None, "green"), (1, "red")]))
    d = d.with_panel(stat(
        "Pods with invalid annotations", "Pods running in their default class because of a policy problem.",
        "short", f"count(netagent_pod_policy_problem{{{CLUSTER}}} == 1) or vector(0)",
        thresholds=[(None, "green"), (1, "orange")]))
    d = d.with_panel(stat(
        "Allocation p99", "99th percentile of the leader's allocation round duration over the rate interval.", "s",
        f"max({raw('controller_allocation_duration_seconds:p99_5m', CLUSTER)})",
        thresholds=[(None, "green"), (0.5, "orange"), (2, "red")]))
    d = d.with_panel(stat(
        "Drift repairs (1h)", "Kernel state changed by someone else and restored by the agents.", "short",
        f"sum(increase(netagent_drift_repairs_total{{{CLUSTER}}}[1h])) or vector(0)",
        thresholds=[(None, "green"), (1, "orange")]))
    d = d.with_panel(timeseries(
        "Controller leader", "1 for the replica holding the Lease; exactly one line should be at 1.", "short",
        query(f"netagent_controller_is_leader{{{CLUSTER}}}", "{{instance}}"), width=8))
    d = d.with_panel(timeseries(
        "Reports", "Agent reports the controller accepts and rejects (by reason), per second.", "reqps",
        query(f"sum(rate(netagent_controller_reports_total{{{CLUSTER}}}[$__rate_interval]))", "accepted"),
        query(f"sum by (reason) (rate(netagent_controller_rejected_reports_total{{{CLUSTER}}}[$__rate_interval]))",
              "rejected {{reason}}", ref="B"),
        width=8))
    d = d.with_panel(timeseries(
        "Allocation rounds and feedback gain",
        "Rounds per second of the leader (and failed ones); the feedback gain: what the engine shares is the "
        "budget times this, so that the measured total stays at the budget (1 = no correction; above 1 when "
        "the pods, fully loaded, measure short of it; below 1 when they overshoot); the download gain does the "
        "same on spec.ingressTotal.", "short",
        query(f"sum(rate(netagent_controller_allocation_rounds_total{{{CLUSTER}}}[$__rate_interval]) {LEADER})", "rounds/s"),
        query(f"sum(rate(netagent_controller_allocation_failures_total{{{CLUSTER}}}[$__rate_interval]) {LEADER})",
              "failed rounds/s", ref="B"),
        query(f"max(netagent_controller_feedback_gain{{{CLUSTER}}} {LEADER})", "feedback gain", ref="C"),
        query(f"max(netagent_controller_ingress_feedback_gain{{{CLUSTER}}} {LEADER})", "download feedback gain",
              ref="D"),
        width=8))
    d = d.with_panel(timeseries(
        "Agents reaching the controller", "Agents whose last report succeeded, and those that failed.", "short",
        query(f"count(netagent_controller_reachable{{{CLUSTER}}} == 1) or vector(0)", "reachable"),
        query(f"count(netagent_controller_reachable{{{CLUSTER}}} == 0) or vector(0)", "unreachable", ref="B"),
        width=8))
    return d


def quota_rows(d: gd.Dashboard) -> gd.Dashboard:
    """The teams' volume quotas per direction (docs/quotas.md): the period's use against the quota, whether
    spent, and the forecast time to exhaustion; the leader's figures (it alone counts)."""
    by = "cluster, team, direction"
    d = d.with_row(gd.Row("Volume quotas"))
    d = d.with_panel(stat(
        "Quotas spent", "Teams and directions whose volume quota is spent this period: held at their "
        "exhaustedRate (NetagentQuotaSpent).", "short",
        f"count({_leader('netagent_team_quota_exhausted', by, CLUSTER, ', ' + TEAM)} == 1) or vector(0)",
        thresholds=[(None, "green"), (1, "orange")], width=4))
    d = d.with_panel(timeseries(
        "Quota use by team", "Each team's internet bytes this period per direction (uploads: egress, downloads: "
        "ingress), and its quota (the flat line).", "bytes",
        query(_leader("netagent_team_quota_used_bytes", by, CLUSTER, ", " + TEAM), "used {{team}} {{direction}}"),
        query(_leader("netagent_team_quota_bytes", by, CLUSTER, ", " + TEAM), "quota {{team}} {{direction}}",
              ref="B"),
        width=10))
    d = d.with_panel(timeseries(
        "Quota spent by team", "Share of the quota used this period; 1 = spent (the team is capped at its "
        "exhaustedRate until the next period).", "percentunit",
        query(f"{_leader('netagent_team_quota_used_bytes', by, CLUSTER, ', ' + TEAM)} / on ({by}) "
              f"({_leader('netagent_team_quota_bytes', by, CLUSTER, ', ' + TEAM)} > 0)", "{{team}} {{direction}}"),
        query(_leader("netagent_team_quota_exhausted", by, CLUSTER, ", " + TEAM), "exhausted {{team}} {{direction}}",
              ref="B"),
        width=10))
    d = d.with_panel(table(
        "Quota forecast", "Seconds until each team's quota is spent at its rate over the last minute "
        "(0: spent; no row: no use this period).", "s",
        query(_leader("netagent_team_quota_exhaustion_forecast_seconds", by, CLUSTER, ", " + TEAM), "", True),
        width=24))
    return d


def downloads_rows(d: gd.Dashboard) -> gd.Dashboard:
    """The cluster's downloads (internet -> pod, "ingress") against spec.ingressTotal: the twins of the
    upload panels. The controller's download view exists while an agent that shapes downloads reports;
    the budget panels are empty without spec.ingressTotal (downloads then held only by the pods' caps)."""
    d = d.with_row(gd.Row("Downloads (internet to pod)"))
    d = d.with_panel(stat(
        "Download budget", "spec.ingressTotal of the EgressBudget, as the leader controller holds it (empty "
        "when unset: downloads are then held only by the pods' caps).", "bps",
        f"sum({raw('controller_ingress_budget_bytes_per_second:leader', CLUSTER)}) * 8"))
    d = d.with_panel(stat(
        "Downloads used / budget", "Internet downloads the controller measures, as a share of spec.ingressTotal "
        "(per cluster).", "percentunit", f"{raw('controller_ingress_budget_used:ratio', CLUSTER)}",
        thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")]))
    d = d.with_panel(stat(
        "Internet downloads now", "Sum of the pods' internet ingress measured by the agents.", "bps",
        f"sum({raw('cluster_internet_ingress_bytes:rate1m', CLUSTER)}) * 8"))
    d = d.with_panel(stat(
        "Download demand", "Sum of the pods' estimated download demand (the controller's view).", "bps",
        f"sum({raw('controller_ingress_demand_bytes_per_second:leader', CLUSTER)}) * 8"))
    d = d.with_panel(stat(
        "Uplinks' internet ingress", "Everything arriving from the internet at the nodes' uplinks, host traffic "
        "and downloads dropped at the pods included (NetagentIngressBudgetExceeded compares it with the "
        "budget).", "bps", f"sum({raw('cluster_node_internet_ingress_bytes:rate5m', CLUSTER)}) * 8"))
    d = d.with_panel(stat(
        "Agents not shaping downloads", "Agents reporting to the controller that do not shape downloads (older "
        "agents, or a download data path that could not be programmed): their pods get no download share "
        "(NetagentIngressNotShaped).", "short",
        f"sum(netagent_controller_agents{{{CLUSTER}}} {LEADER}) "
        f"- (sum(netagent_controller_ingress_agents{{{CLUSTER}}} {LEADER}) or vector(0))",
        thresholds=[(None, "green"), (1, "orange")]))
    d = d.with_panel(timeseries(
        "Internet downloads by team, against the download budget",
        "Stacked: each team's measured internet ingress (agents' counters). Line: spec.ingressTotal.", "bps",
        query(f"sum by (team) ({raw('team_class_internet_ingress_bytes:rate1m', CLUSTER)}) * 8", "{{team}}"),
        query(f"sum({raw('controller_ingress_budget_bytes_per_second:leader', CLUSTER)}) * 8", "budget",
              ref="B"),
        width=12, stacked=True)
        .override_by_name("budget", BUDGET_LINE))
    d = d.with_panel(timeseries(
        "Internet downloads by team and class", "Measured internet ingress per (team, class).", "bps",
        query(f"{raw('team_class_internet_ingress_bytes:rate1m', CLUSTER)} * 8", "{{team}} / {{class}}"),
        width=12))
    d = d.with_panel(timeseries(
        "Download demand vs allocation by team",
        "What each team's pods want to download (estimated demand) and the fair download share the controller "
        "gives them.", "bps",
        query(f"sum by (team) ({raw('controller_ingress_demand_bytes_per_second:leader', CLUSTER)}) * 8",
              "demand {{team}}"),
        query(f"sum by (team) ({raw('controller_ingress_allocated_bytes_per_second:leader', CLUSTER)}) * 8",
              "allocated {{team}}", ref="B"),
        width=12))
    d = d.with_panel(table(
        "Download demand, allocation and use by team and class",
        "The controller's download view at the end of the range (leader only).", "bps",
        query(f"{raw('controller_ingress_demand_bytes_per_second:leader', CLUSTER)} * 8", "demand", True),
        query(f"{raw('controller_ingress_allocated_bytes_per_second:leader', CLUSTER)} * 8", "allocated", True,
              "B"),
        query(f"{raw('controller_ingress_used_bytes_per_second:leader', CLUSTER)} * 8", "used", True, "C"),
        width=12))
    d = d.with_panel(stat(
        "Teams below download guarantee", "Teams allocated less downloads than min(download guarantee, demand) "
        "(NetagentTeamIngressStarved).", "short",
        f"sum(netagent_controller_ingress_guarantee_unmet{{{CLUSTER}}} {LEADER}) or vector(0)",
        thresholds=[(None, "green"), (1, "red")], width=6))
    d = d.with_panel(stat(
        "Downloads oversubscribed", "1 when the teams' download guarantees add up to more than spec.ingressTotal.",
        "short", f"max(netagent_controller_ingress_oversubscribed{{{CLUSTER}}} {LEADER}) or vector(0)",
        thresholds=[(None, "green"), (1, "orange")], width=6))
    d = d.with_panel(timeseries(
        "Download guarantee vs allocation by team", "Each team's guaranteed download minimum and its fair download "
        "share now.", "bps",
        query(f"max by (team) (netagent_controller_ingress_team_guarantee_bytes_per_second{{{CLUSTER}}} {LEADER}) "
              f"* 8", "guarantee {{team}}"),
        query(f"sum by (team) ({raw('controller_ingress_allocated_bytes_per_second:leader', CLUSTER)}) * 8",
              "allocated {{team}}", ref="B"),
        width=12))
    d = d.with_panel(table(
        "Top pods by internet download", "The 15 pods receiving most from the internet now.", "bps",
        query(f"topk(15, {raw('pod_internet_ingress_bytes:rate1m', CLUSTER)}) * 8", "", True), width=8))
    d = d.with_panel(table(
        "Most throttled pods (downloads)",
        "Share of the rate interval each pod's downloads spent held back by its download limit (1 = always).",
        "percentunit", query(f"topk(15, {raw('pod_ingress_throttled:ratio_rate5m', CLUSTER)})", "", True),
        width=8))
    d = d.with_panel(timeseries(
        "Download drops by team", "Internet packets to the pods dropped at their download limits (they crossed "
        "the uplink already).", "pps",
        query(f"sum by (team) ({raw('pod_ingress_dropped_packets:rate5m', CLUSTER)} "
              f")", "{{team}}"),
        width=8))
    return d


def node_pod_dashboard() -> gd.Dashboard:
    d = base("netagent-node-pod", "netagent / node and pod",
             "One node's uplink traffic, allocation and agent health, and its pods' internet egress and "
             "downloads (ingress) against their limits, fair shares and demand.")
    d = (d.with_variable(variable("node", "Node", f"label_values(netagent_build_info{{{CLUSTER}}}, node)"))
         .with_variable(variable("namespace", "Namespace",
                                 f"label_values(netagent_pod_info{{{NODE}, {TEAM}}}, namespace)"))
         .with_variable(variable("pod", "Pod",
                                 f'label_values(netagent_pod_info{{{NODE}, {TEAM}, namespace=~"$namespace"}}, pod)')))
    d = d.with_row(gd.Row("Node"))
    d = d.with_panel(timeseries(
        "Node egress by scope, against its allocation",
        "All traffic leaving the node's uplinks (host traffic included), internal vs internet; the node class "
        "rate (this node's share of the budget); internet egress forwarded from sources that are no known pod "
        "(pods the agent has not learnt yet), held at the default-class floor.", "bps",
        query(f"sum by (node, scope) (rate(netagent_node_egress_bytes_total{{{NODE}}}[$__rate_interval])) * 8",
              "{{node}} {{scope}}"),
        query(f"sum by (node) (netagent_node_allocation_bytes_per_second{{{NODE}}}) * 8",
              "{{node}} allocation", ref="B"),
        query(f"sum by (node) (rate(netagent_node_unknown_source_egress_bytes_total{{{NODE}}}[$__rate_interval])) * 8",
              "{{node}} internet from unknown sources", ref="C"),
        width=12))
    d = d.with_panel(timeseries(
        "Node ingress by scope, against its download allocation",
        "All traffic entering the node's uplinks (host traffic and downloads dropped at the pods' limits "
        "included), internal vs internet; the node's download class rate (its share of spec.ingressTotal; "
        "absent while the agent does not shape downloads); internet ingress to addresses that are no known pod "
        "(pods the agent has not learnt yet), held at the download default-class floor.", "bps",
        query(f"sum by (node, scope) (rate(netagent_node_ingress_bytes_total{{{NODE}}}[$__rate_interval])) * 8",
              "{{node}} {{scope}}"),
        query(f"sum by (node) (netagent_node_ingress_allocation_bytes_per_second{{{NODE}}}) * 8",
              "{{node}} download allocation", ref="B"),
        query(f"sum by (node) (rate(netagent_node_unknown_destination_ingress_bytes_total{{{NODE}}}[$__rate_interval])) * 8",
              "{{node}} internet to unknown destinations", ref="C"),
        width=12))
    d = d.with_panel(timeseries(
        "Reconcile duration p99", "Time to compute and apply the desired kernel state.", "s",
        query(f"histogram_quantile(0.99, sum by (node, le) "
              f"(rate(netagent_reconcile_duration_seconds_bucket{{{NODE}}}[$__rate_interval])))", "{{node}}"),
        width=8))
    d = d.with_panel(timeseries(
        "Reconciles, errors and drift repairs",
        "Reconciles per second; failed ones by stage; kernel state someone else changed and the agent restored, "
        "by kind.", "ops",
        query(f"sum by (node) (rate(netagent_reconcile_duration_seconds_count{{{NODE}}}[$__rate_interval]))", "{{node}} reconciles"),
        query(f"sum by (node, stage) (rate(netagent_reconcile_errors_total{{{NODE}}}[$__rate_interval]))",
              "{{node}} errors {{stage}}", ref="B"),
        query(f"sum by (node, kind) (rate(netagent_drift_repairs_total{{{NODE}}}[$__rate_interval]))",
              "{{node}} drift {{kind}}", ref="C"),
        width=8))
    d = d.with_panel(timeseries(
        "Agent state", "Ready (data path as desired), controller reachable, at the safe floor.", "short",
        query(f"netagent_ready{{{NODE}}}", "{{node}} ready"),
        query(f"netagent_controller_reachable{{{NODE}}}", "{{node}} controller reachable", ref="B"),
        query(f"netagent_fail_static{{{NODE}}}", "{{node}} at safe floor", ref="C"),
        width=8))
    d = d.with_panel(table(
        "Pods on the node", "Class and team of each pod; its internet egress, limit and fair share now (B, C, D); "
        "its internet downloads, download limit and download fair share now (E, F, G).", "bps",
        query(f"max by (node, namespace, pod, team, class) (netagent_pod_info{{{POD}}})", "", True),
        query(f"sum by (node, namespace, pod) ({raw('pod_internet_egress_bytes:rate1m', POD)}) * 8", "", True, "B"),
        query(f"sum by (node, namespace, pod) (netagent_pod_egress_limit_bytes_per_second{{{POD}}}) * 8", "", True, "C"),
        query(f"sum by (node, namespace, pod) (netagent_pod_egress_allocation_bytes_per_second{{{POD}}}) * 8",
              "", True, "D"),
        query(f"sum by (node, namespace, pod) ({raw('pod_internet_ingress_bytes:rate1m', POD)}) * 8", "", True, "E"),
        query(f"sum by (node, namespace, pod) (netagent_pod_ingress_limit_bytes_per_second{{{POD}}}) * 8", "", True,
              "F"),
        query(f"sum by (node, namespace, pod) (netagent_pod_ingress_allocation_bytes_per_second{{{POD}}}) * 8",
              "", True, "G"),
        width=24)
        .override_by_name("Value #A", [gm.DynamicConfigValue(id_val="custom.hidden", value=True)]))

    d = d.with_row(gd.Row("Pods"))
    d = d.with_panel(timeseries(
        "Pod internet egress against limit, fair share and demand",
        "Measured internet egress; the limit the agent enforces (HTB ceil); the fair share (HTB rate); the "
        "estimated demand.", "bps",
        query(f"sum by (namespace, pod) (rate(netagent_pod_egress_bytes_total{{{POD}, scope=\"internet\"}}[$__rate_interval])) * 8",
              "{{namespace}}/{{pod}} sent"),
        query(f"sum by (namespace, pod) (netagent_pod_egress_limit_bytes_per_second{{{POD}}}) * 8",
              "{{namespace}}/{{pod}} limit", ref="B"),
        query(f"sum by (namespace, pod) (netagent_pod_egress_allocation_bytes_per_second{{{POD}}}) * 8",
              "{{namespace}}/{{pod}} fair share", ref="C"),
        query(f"sum by (namespace, pod) (netagent_pod_egress_demand_bytes_per_second{{{POD}}}) * 8",
              "{{namespace}}/{{pod}} demand", ref="D"),
        width=24))
    d = d.with_panel(timeseries(
        "Pod internet downloads against limit, fair share and demand",
        "Downloads (internet to pod): measured internet ingress; the download limit the agent enforces (HTB ceil "
        "of the pod's download class); its fair share of spec.ingressTotal (HTB rate); the estimated download "
        "demand.", "bps",
        query(f"sum by (namespace, pod) (rate(netagent_pod_ingress_bytes_total{{{POD}, scope=\"internet\"}}[$__rate_interval])) * 8",
              "{{namespace}}/{{pod}} received"),
        query(f"sum by (namespace, pod) (netagent_pod_ingress_limit_bytes_per_second{{{POD}}}) * 8",
              "{{namespace}}/{{pod}} download limit", ref="B"),
        query(f"sum by (namespace, pod) (netagent_pod_ingress_allocation_bytes_per_second{{{POD}}}) * 8",
              "{{namespace}}/{{pod}} download fair share", ref="C"),
        query(f"sum by (namespace, pod) (netagent_pod_ingress_demand_bytes_per_second{{{POD}}}) * 8",
              "{{namespace}}/{{pod}} download demand", ref="D"),
        width=24))
    d = d.with_panel(timeseries(
        "Pod egress by scope", "Internal traffic is never shaped; internet traffic is.", "bps",
        query(f"sum by (namespace, pod, scope) (rate(netagent_pod_egress_bytes_total{{{POD}}}[$__rate_interval])) * 8",
              "{{namespace}}/{{pod}} {{scope}}"),
        width=12))
    d = d.with_panel(timeseries(
        "Pod ingress by scope", "Received traffic by source scope: internet downloads are shaped (by an agent "
        "that shapes downloads), internal traffic never is.", "bps",
        query(f"sum by (namespace, pod, scope) (rate(netagent_pod_ingress_bytes_total{{{POD}}}[$__rate_interval])) * 8",
              "{{namespace}}/{{pod}} {{scope}}"),
        width=12))
    d = d.with_panel(timeseries(
        "Pod shaper drops", "Internet-bound packets of the pod dropped at its limit.", "pps",
        query(f"sum by (namespace, pod) (rate(netagent_pod_egress_dropped_packets_total{{{POD}}}[$__rate_interval]))",
              "{{namespace}}/{{pod}}"),
        width=12))
    d = d.with_panel(timeseries(
        "Pod throttled share", "Share of time the pod's internet egress was held back by its limit.", "percentunit",
        query(f"sum by (namespace, pod) (rate(netagent_pod_egress_throttled_seconds_total{{{POD}}}[$__rate_interval]))",
              "{{namespace}}/{{pod}}"),
        width=12))
    d = d.with_panel(timeseries(
        "Pod download drops", "Internet packets to the pod dropped at its download limit.", "pps",
        query(f"sum by (namespace, pod) (rate(netagent_pod_ingress_dropped_packets_total{{{POD}}}[$__rate_interval]))",
              "{{namespace}}/{{pod}}"),
        width=12))
    d = d.with_panel(timeseries(
        "Pod download throttled share", "Share of time the pod's downloads were held back by its download limit.",
        "percentunit",
        query(f"sum by (namespace, pod) (rate(netagent_pod_ingress_throttled_seconds_total{{{POD}}}[$__rate_interval]))",
              "{{namespace}}/{{pod}}"),
        width=12))
    return d


def _team_pods(metric: str) -> str:
    """A pod byte counter's rate by team and scope: every scope, internal included (the agents' counters)."""
    return (f"sum by (team, scope) (sum by (cluster, namespace, pod, scope) (rate({metric}{{{CLUSTER}}}[{RATE}])) "
            f"* on (cluster, namespace, pod) group_left (team) {POD_INFO}) * 8")


def _leader_rate(metric: str, by: str) -> str:
    """The rate of a leader-only controller counter of the selected teams (it restarts at a leader change)."""
    return f"sum by ({by}) (rate({metric}{{{CLUSTER}, {TEAM}}}[{RATE}]) {LEADER})"


def _pod_cost(direction: str) -> str:
    """The 15 pods costing most per hour in one direction, over every priced scope, with their team."""
    cost = raw(f"pod_{direction}_cost:rate5m", CLUSTER)
    return (f"topk(15, sum by (cluster, namespace, pod, team, currency) ({cost} "
            f"* on (cluster, namespace, pod) group_left (team) {POD_INFO})) * 3600")


def scopes_dashboard() -> gd.Dashboard:
    """Where the bytes go (issue 39, docs/scopes.md): bytes by scope, their cost against the cost quotas, the
    pods costing most, the prices in force. The cost series exist while a NetworkScopes object has prices."""
    d = base("netagent-scopes", "netagent / where the bytes go",
             "Bytes by destination scope (internal, cross-zone, cross-region, internet) per team and direction; "
             "their cost at the NetworkScopes prices, per team, against the cost quotas; the pods that cost most; "
             "the prices in force and the NetworkScopes problems (docs/scopes.md).")
    # the period's cost is one series per scope and direction: summed, never max'ed, per team
    period = f"sum by (cluster, team, currency) (netagent_team_cost_period{{{CLUSTER}, {TEAM}}} {LEADER})"
    quota = _leader("netagent_team_cost_quota", "cluster, team, currency", CLUSTER, ", " + TEAM)
    d = d.with_row(gd.Row("Bytes by scope"))
    for direction, word, end in (("egress", "Uploads (egress)", "destination"),
                                 ("ingress", "Downloads (ingress)", "source")):
        d = d.with_panel(timeseries(
            f"{word} by team and scope", f"Each team's pods' bits per second by {end} scope, from the agents' "
            "counters (internal included: never priced, never shaped).", "bps",
            query(_team_pods(f"netagent_pod_{direction}_bytes_total"), "{{team}} {{scope}}"),
            width=12, stacked=True))
    d = d.with_panel(table(
        "Priced bytes by team, scope and direction over the range",
        "The bytes the leader counted per team, priced scope and direction over the dashboard's time range "
        "(the counts the cost is computed from).", "bytes",
        query(f"sum by (team, scope, direction) (increase(netagent_team_scope_bytes_total{{{CLUSTER}, {TEAM}}}"
              f"[{RANGE}]) {LEADER})", "", True),
        width=24))

    d = d.with_row(gd.Row("Cost"))
    d = d.with_panel(timeseries(
        "Cost per hour by team", "Each team's cost per hour at the prices in force, every priced scope and both "
        "directions (the leader's count).", "short",
        query(f"{_leader_rate('netagent_team_cost_total', 'team, currency')} * 3600", "{{team}} {{currency}}/h"),
        width=12, stacked=True))
    d = d.with_panel(timeseries(
        "Cost per hour by scope and direction", "Which scope and direction the money goes to (all selected "
        "teams).", "short",
        query(f"{_leader_rate('netagent_team_cost_total', 'scope, direction, currency')} * 3600",
              "{{scope}} {{direction}} {{currency}}/h"),
        width=12, stacked=True))
    d = d.with_panel(timeseries(
        "Cost this period against the cost quota", "Each team's cost in its current quota period (a calendar "
        "Month without a quota), and its quota.cost (dashed; teams with a cost quota only).", "short",
        query(f"sum by (team, currency) ({period})", "{{team}} {{currency}}"),
        query(f"sum by (team, currency) ({quota})", "quota {{team}} {{currency}}", ref="B"),
        width=12)
        .override_by_regexp("^quota ", BUDGET_LINE))
    d = d.with_panel(table(
        "Cost quotas", "Per team: its cost this period (A), its quota.cost (B) and the share spent (C; 1 = spent: "
        "its internet traffic is held at its exhaustedRate, NetagentCostQuotaSpent).", "short",
        query(period, "", True),
        query(quota, "", True, "B"),
        query(f"sum by (cluster, team) ({period}) / on (cluster, team) (sum by (cluster, team) ({quota}) > 0)",
              "", True, "C"),
        width=12)
        .override_by_name("Value #C", [gm.DynamicConfigValue(id_val="unit", value="percentunit")]))

    d = d.with_row(gd.Row("Pods and prices"))
    d = d.with_panel(table(
        "Top pods by upload cost", "The 15 pods whose uploads cost most per hour now (their bytes by priced scope "
        "x the price: netagent:pod_egress_cost:rate5m).", "short", query(_pod_cost("egress"), "", True), width=8))
    d = d.with_panel(table(
        "Top pods by download cost", "The 15 pods whose downloads cost most per hour now "
        "(netagent:pod_ingress_cost:rate5m).", "short", query(_pod_cost("ingress"), "", True), width=8))
    d = d.with_panel(table(
        "Prices in force", "The NetworkScopes price per GiB by scope and direction (the last valid description; "
        "every controller replica exports it).", "short",
        query(f"max by (scope, direction, currency) (netagent_controller_scope_price_per_gib{{{CLUSTER}}})", "",
              True), width=5))
    d = d.with_panel(stat(
        "NetworkScopes problems", "Problems of the NetworkScopes object (a Warning Event NetworkScopesInvalid "
        "names them); the last valid description stays in force.", "short",
        f"max(netagent_controller_scopes_problems{{{CLUSTER}}}) or vector(0)",
        thresholds=[(None, "green"), (1, "red")], width=3))
    return d


DASHBOARDS = {
    "cluster.json": cluster_dashboard,
    "node-pod.json": node_pod_dashboard,
    "scopes.json": scopes_dashboard,
}


def render_dashboard(build) -> str:
    model = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    panel_id = 0
    for panel in model["panels"]:  # Grafana links and embeds panels by id: number them in order
        for inner in [panel, *panel.get("panels", [])]:
            panel_id += 1
            inner["id"] = panel_id
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def outputs() -> dict[Path, str]:
    files = {HERE / name: render_dashboard(build) for name, build in DASHBOARDS.items()}
    return files


def panel_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel, rows included."""
    for panel in dashboard.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                if target.get("expr"):
                    yield inner.get("title", ""), target["expr"]


def variable_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(variable name, label_values(...) query) of every query variable."""
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            yield v["name"], q["query"] if isinstance(q, dict) else q


def fill_variables(expr: str, values: dict[str, str] | None = None, rate_interval: str = "1m",
                   range_: str = "1h") -> str:
    """Substitute template variables as Grafana does; unset ones get "All" (the regex `.*`);
    $__rate_interval gets rate_interval (Grafana: four scrape intervals at least), $__range range_."""
    values = values or {}
    expr = expr.replace(RATE, rate_interval).replace(RANGE, range_)
    for name in VARIABLES:
        expr = expr.replace(f"${{{name}}}", values.get(name, ".*")).replace(f"${name}", values.get(name, ".*"))
    return expr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        if args.check:
            stale.append(path)
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       str(path), "generated", n=1))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print(f"stale: {', '.join(str(p.relative_to(REPO)) for p in stale)}; run `python3 -m dashboards.build`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
