"""The metric-name contract between the exporters and the dashboards and rules.

`defined_metrics()` reads netagent/metrics.py and controller/metrics.py (their source, so
families yielded only in some states, such as the controller's budget view on a follower,
count too) and lists every sample name they can expose. `used_metrics()` lists the names
the dashboards and rules query. A name used but not defined is a dashboard that would stay
empty: tests/test_dashboards.py fails on it.
"""
from __future__ import annotations

import ast
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXPORTERS = (REPO / "netagent" / "metrics.py", REPO / "controller" / "metrics.py",
             REPO / "controller" / "quotastore.py",  # the volume quotas' families (docs/quotas.md)
             REPO / "controller" / "cost.py")  # bytes and cost by scope (docs/scopes.md)
RULES = HERE / "rules.yaml"
# series Prometheus itself makes for every target
BUILTIN = frozenset({"up"})

# constructor -> the sample names it exposes for a family called NAME
SUFFIXES = {
    "Counter": ("_total",),
    "CounterMetricFamily": ("_total",),
    "Gauge": ("",),
    "GaugeMetricFamily": ("",),
    "Histogram": ("_bucket", "_sum", "_count"),
    "HistogramMetricFamily": ("_bucket", "_sum", "_count"),
    "Summary": ("_sum", "_count"),
    "SummaryMetricFamily": ("_sum", "_count"),
    "Info": ("_info",),
    "InfoMetricFamily": ("_info",),
}
# counters with labels have no series until their event first happens: a panel query of
# these may be empty in a healthy cluster, as long as another query of its panel has data
RARE_EVENTS = ("netagent_controller_rejected_reports_total", "netagent_reconcile_errors_total",
               "netagent_drift_repairs_total")
# gauges with no series until a minute of use was counted (the quota forecast: docs/quotas.md): a live query of
# them may be empty; their exporter is tested on its own (tests/test_quota_controller.py)
SLOW_SERIES = ("netagent_team_quota_exhaustion_forecast_seconds",)
# names a query mentions: exporter metrics (netagent_...) and recording rules (netagent:...)
NAME = re.compile(r"(?<![\w:])netagent[_:][a-zA-Z0-9_:]*")


def _string(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The value of a string literal, a module constant, or a `+` of those."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string(node.left, constants), _string(node.right, constants)
        return left + right if left is not None and right is not None else None
    return None


def _callee(func: ast.AST) -> str | None:
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def exported_names(source: str) -> set[str]:
    tree = ast.parse(source)
    constants = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = _string(stmt.value, constants)
            if value is not None:
                constants[stmt.targets[0].id] = value
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        if isinstance(node.func, ast.IfExp) and {_callee(node.func.body), _callee(node.func.orelse)} & set(SUFFIXES):
            raise ValueError(f"a metric constructor chosen at run time at line {node.lineno}; call each "
                             "family's constructor with its name literally so the dashboards' contract can be "
                             "checked")
        func = _callee(node.func)
        if func not in SUFFIXES:
            continue
        family = _string(node.args[0], constants)
        if family is None:
            raise ValueError(f"{func}(...) at line {node.lineno}: metric name is not a constant string; "
                             "keep metric names literal so the dashboards' contract can be checked")
        names.update(family + suffix for suffix in SUFFIXES[func])
    return names


def defined_metrics() -> dict[str, Path]:
    """Every sample name the agent and the controller can expose -> the module defining it."""
    defined = {}
    for path in EXPORTERS:
        for name in exported_names(path.read_text()):
            defined[name] = path
    return defined


def recording_rules() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def rule_expressions() -> list[tuple[str, str]]:
    """(rule name, expression) of every recording rule and alert."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(rule.get("record") or rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def dashboard_files() -> list[Path]:
    return sorted(HERE.glob("*.json"))


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expression) for every panel target and template variable query of every dashboard."""
    from .build import panel_queries, variable_queries

    found = []
    for path in dashboard_files():
        model = json.loads(path.read_text())
        found += [(f"{path.name}: panel {title!r}", expr) for title, expr in panel_queries(model)]
        found += [(f"{path.name}: variable {name!r}", q) for name, q in variable_queries(model)]
    return found


def used_metrics() -> dict[str, set[str]]:
    """Every netagent metric or recording-rule name the dashboards and rules query -> where."""
    used: dict[str, set[str]] = {}
    for where, expr in [*dashboard_expressions(), *(("rules.yaml: " + n, e) for n, e in rule_expressions())]:
        for name in NAME.findall(expr):
            used.setdefault(name, set()).add(where)
    return used


def queries_without_data(prometheus_url: str, values: dict[str, str] | None = None,
                         rate_interval: str = "1m") -> list[str]:
    """Every panel query that returns no series from a live Prometheus, with the template
    variables filled in (unset ones as "All"; $__rate_interval as rate_interval, which Grafana
    makes four scrape intervals at least), except rare-event queries in a panel that has other
    data. An empty list means every panel shows something."""
    from .build import fill_variables, panel_queries

    def has_data(expr: str) -> bool:
        url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode(
            {"query": fill_variables(expr, values, rate_interval)})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                answer = json.load(r)
        except urllib.error.HTTPError as e:
            answer = json.load(e)
        return answer.get("status") == "success" and bool(answer["data"]["result"])

    empty = []
    for path in dashboard_files():
        panels: dict[str, list[tuple[str, bool]]] = {}
        for title, expr in panel_queries(json.loads(path.read_text())):
            panels.setdefault(title, []).append((expr, has_data(expr)))
        for title, queries in panels.items():
            panel_has_data = any(ok for _, ok in queries)
            for expr, ok in queries:
                if any(m in expr for m in SLOW_SERIES):
                    continue
                if not ok and not (panel_has_data and any(m in expr for m in RARE_EVENTS)):
                    empty.append(f"{path.name}: {title!r}: {expr}")
    return empty
