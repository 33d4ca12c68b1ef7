"""Dashboards, recording rules and alerts (dashboards/).

- the committed JSON is exactly what dashboards/build.py generates, and the chart ships it;
- `promtool check rules` and the promtool unit tests (dashboards/rules_test.yaml) pass, with a
  firing case for every alert, and a saturated budget fires NetagentBudgetSaturated;
- every metric the dashboards and rules query is one the agent or controller defines;
- a real Prometheus (loopback, empty TSDB, our rules loaded) accepts every panel query and
  every template variable's selector, with the variables filled in as Grafana would;
- scraping the agent's real collector (synthetic node views of two nodes) and a real controller
  (`netagent controller --from-file`, fed reports over HTTP), every panel query returns data,
  with the variables at "All" and at one node, namespace and pod.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from dashboards import build, contract
from lab.procs import stop_process

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = REPO / "dashboards"
RULES = DASHBOARDS / "rules.yaml"
RULES_TEST = DASHBOARDS / "rules_test.yaml"
ALERTS_DOC = REPO / "docs" / "alerts.md"


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: install Debian's prometheus package (scripts/bootstrap.sh does)"
    return path


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alerts() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in contract.dashboard_files()}


def github_anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


# --- generated files -------------------------------------------------------------------------


def test_committed_files_are_what_the_generator_produces():
    stale = [str(p.relative_to(REPO)) for p, text in build.outputs().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `python3 -m dashboards.build` and commit: {stale} differ from the generator's output"


def test_every_dashboard_is_generated_and_packaged():
    generated = set(build.DASHBOARDS)
    assert {p.name for p in contract.dashboard_files()} == generated
    # the chart's ConfigMaps (rendered into deploy/ by hack/render-deploy.sh) carry every dashboard
    configmaps = [d for d in yaml.safe_load_all((REPO / "deploy" / "base" / "dashboards.yaml").read_text()) if d]
    packaged = {key.removeprefix("netagent-") for cm in configmaps for key in cm["data"]}
    assert packaged == generated
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in configmaps)


# --- dashboard structure ---------------------------------------------------------------------


def test_dashboards_are_well_formed():
    uids = set()
    for name, d in dashboards().items():
        assert d["uid"] not in uids, f"{name}: duplicate uid {d['uid']}"
        uids.add(d["uid"])
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert "cluster" in variables, f"{name}: every dashboard selects a cluster"
        ids = []
        for panel in d["panels"]:
            for inner in [panel, *panel.get("panels", [])]:
                ids.append(inner["id"])
                if inner["type"] == "row":
                    continue
                where = f"{name}: panel {inner['title']!r}"
                assert inner.get("description"), f"{where} has no description"
                assert inner["datasource"]["uid"] == "${datasource}", where
                assert inner["fieldConfig"]["defaults"].get("unit"), f"{where} has no unit"
                refs = [t["refId"] for t in inner["targets"]]
                assert inner["targets"] and len(refs) == len(set(refs)), where
                for t in inner["targets"]:
                    assert '$cluster"' in t["expr"], f"{where}: query ignores the cluster variable: {t['expr']}"
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat"


def test_node_and_pod_drilldown_has_its_variables():
    d = dashboards()["node-pod.json"]
    variables = [v["name"] for v in d["templating"]["list"]]
    assert variables == ["datasource", "cluster", "team", "node", "namespace", "pod"]
    pod_panels = [t["expr"] for title, t in ((p.get("title"), t) for p in d["panels"] for t in p.get("targets", []))
                  if title and title.startswith("Pod ")]
    assert pod_panels and all('pod=~"$pod"' in e and 'namespace=~"$namespace"' in e for e in pod_panels)


def test_cluster_dashboard_covers_the_budget_view():
    titles = {p["title"] for p in dashboards()["cluster.json"]["panels"]}
    for wanted in ("Internet egress by team, against the budget", "Internet egress by team and class",
                   "Demand vs allocation by team", "Top pods by internet egress", "Most throttled pods",
                   "Shaper drops by team", "Agents ready", "Controller leader", "Allocation p99"):
        assert wanted in titles


def test_cluster_dashboard_has_the_volume_quota_row():
    """Per team and direction: quota bytes and use, share spent and exhausted, the forecast (docs/quotas.md)."""
    panels = dashboards()["cluster.json"]["panels"]
    titles = {p["title"] for p in panels}
    for wanted in ("Volume quotas", "Quotas spent", "Quota use by team", "Quota spent by team", "Quota forecast"):
        assert wanted in titles, wanted
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    for metric in ("netagent_team_quota_bytes", "netagent_team_quota_used_bytes", "netagent_team_quota_exhausted",
                   "netagent_team_quota_exhaustion_forecast_seconds"):
        assert metric in exprs, metric


def test_cluster_dashboard_covers_the_download_view():
    """Downloads (ingress) have the budget view uploads have: budget vs used vs allocated, teams, top pods."""
    titles = {p["title"] for p in dashboards()["cluster.json"]["panels"]}
    for wanted in ("Downloads (internet to pod)", "Download budget", "Downloads used / budget",
                   "Internet downloads by team, against the download budget", "Internet downloads by team and class",
                   "Download demand vs allocation by team", "Download demand, allocation and use by team and class",
                   "Teams below download guarantee", "Download guarantee vs allocation by team",
                   "Top pods by internet download", "Agents not shaping downloads", "Most throttled pods (downloads)",
                   "Download drops by team"):
        assert wanted in titles, wanted


def test_node_and_pod_dashboard_covers_the_pods_downloads():
    """The pod's download limit, fair share, demand, usage, drops and throttled time, beside the upload ones."""
    d = dashboards()["node-pod.json"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in d["panels"]}
    downloads = exprs["Pod internet downloads against limit, fair share and demand"]
    for metric in ("netagent_pod_ingress_bytes_total", "netagent_pod_ingress_limit_bytes_per_second",
                   "netagent_pod_ingress_allocation_bytes_per_second", "netagent_pod_ingress_demand_bytes_per_second"):
        assert metric in downloads, metric
    assert "netagent_pod_ingress_dropped_packets_total" in exprs["Pod download drops"]
    assert "netagent_pod_ingress_throttled_seconds_total" in exprs["Pod download throttled share"]
    assert "netagent_node_ingress_allocation_bytes_per_second" in exprs[
        "Node ingress by scope, against its download allocation"]
    assert "netagent_pod_ingress_limit_bytes_per_second" in exprs["Pods on the node"]


def test_scopes_dashboard_shows_where_the_bytes_go():
    """Issue 39 (docs/scopes.md): bytes by scope per team and direction, cost per team against the cost quota,
    the top pods by cost (the recording rules' expressions), the prices in force and the NetworkScopes problems."""
    d = dashboards()["scopes.json"]
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "cluster", "team"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in d["panels"]}
    wanted = {
        "Uploads (egress) by team and scope": ["netagent_pod_egress_bytes_total"],
        "Downloads (ingress) by team and scope": ["netagent_pod_ingress_bytes_total"],
        "Priced bytes by team, scope and direction over the range": ["netagent_team_scope_bytes_total"],
        "Cost per hour by team": ["netagent_team_cost_total"],
        "Cost this period against the cost quota": ["netagent_team_cost_period", "netagent_team_cost_quota"],
        "Cost quotas": ["netagent_team_cost_period", "netagent_team_cost_quota"],
        "Top pods by upload cost": [build.raw("pod_egress_cost:rate5m", build.CLUSTER)],
        "Top pods by download cost": [build.raw("pod_ingress_cost:rate5m", build.CLUSTER)],
        "Prices in force": ["netagent_controller_scope_price_per_gib"],
        "NetworkScopes problems": ["netagent_controller_scopes_problems"],
    }
    for title, parts in wanted.items():
        for part in parts:
            assert part in exprs[title], (title, part)
    # a team's period cost is the sum of its scopes' and directions' series, never their max
    assert "sum by (cluster, team, currency) (netagent_team_cost_period" in exprs["Cost quotas"]


# --- the metric contract ---------------------------------------------------------------------


def test_every_metric_queried_is_defined_by_an_exporter():
    defined = contract.defined_metrics()
    recorded = contract.recording_rules()
    unknown = {name: sorted(where) for name, where in contract.used_metrics().items()
               if name not in defined and name not in recorded}
    assert not unknown, f"queried but neither exported (netagent/metrics.py, controller/metrics.py) nor recorded: {unknown}"


def test_the_contract_reads_both_exporters():
    defined = contract.defined_metrics()
    for name in ("netagent_pod_egress_bytes_total", "netagent_pod_policy_problem",
                 "netagent_reconcile_duration_seconds_bucket", "netagent_controller_is_leader",
                 "netagent_controller_budget_bytes_per_second", "netagent_controller_allocation_duration_seconds_bucket",
                 "netagent_controller_rejected_reports_total", "netagent_pod_ingress_limit_bytes_per_second",
                 "netagent_pod_ingress_dropped_packets_total", "netagent_pod_ingress_throttled_seconds_total",
                 "netagent_node_ingress_allocation_bytes_per_second", "netagent_controller_ingress_guarantee_unmet"):
        assert name in defined, name
    with pytest.raises(ValueError, match="not a constant string"):
        contract.exported_names("from prometheus_client import Gauge\nGauge(name_from_somewhere, 'help')\n")
    # a constructor picked at run time would hide its families from the contract
    with pytest.raises(ValueError, match="chosen at run time"):
        contract.exported_names("(Gauge if counter else Counter)('netagent_x', 'help')\n")


def test_dashboards_need_no_recording_rule_and_follow_the_rate_interval():
    """Day one: the chart's defaults ship the dashboards but no PrometheusRule (monitoring.prometheusRule
    is off), so a panel reading a recording rule would stay empty; every rate() follows Grafana's
    $__rate_interval (a fixed window breaks at a scrape interval above a quarter of it)."""
    recorded = contract.recording_rules()
    for where, expr in contract.dashboard_expressions():
        assert not set(contract.NAME.findall(expr)) & recorded, f"{where} reads a recording rule: {expr}"
        for window in re.findall(r"\b(?:rate|irate)\([^\[]*\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", f"{where}: rate over [{window}]: {expr}"
    for name, d in dashboards().items():
        variables = {v["name"] for v in d["templating"]["list"]}
        assert "team" in variables, f"{name} has no team variable"


def test_every_recording_rule_is_used():
    """Used by an alert, or the recorded twin of a dashboard expression (build.raw: the same computation
    on raw series, for those who query the rules outside the dashboards)."""
    used = set(contract.used_metrics())
    mirrored = set()
    for name in contract.recording_rules():
        try:
            build.raw(name.removeprefix("netagent:"), 'cluster=~".*"')
            mirrored.add(name)
        except KeyError:
            pass
    unused = contract.recording_rules() - used - mirrored
    assert not unused, f"recording rules nothing queries: {sorted(unused)}"


# --- promtool --------------------------------------------------------------------------------


def test_promtool_check_rules():
    result = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass():
    result = subprocess.run([tool("promtool"), "test", "rules", RULES_TEST.name], cwd=DASHBOARDS,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_unit_test():
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    missing = {a["alert"] for a in alerts()} - fired
    assert not missing, f"alerts without a promtool test in which they fire: {sorted(missing)}"


def test_saturated_budget_fires_its_alert(tmp_path):
    """A budget used at 99% for 15 minutes fires NetagentBudgetSaturated; at 50% it does not."""
    shutil.copy(RULES, tmp_path / "rules.yaml")
    series = "{job=\"netagent-controller\",instance=\"c1\"}"
    used = "{job=\"netagent-controller\",instance=\"c1\",team=\"ml\",class=\"bulk\"}"
    case = textwrap.dedent(f"""\
        rule_files: [rules.yaml]
        evaluation_interval: 1m
        tests:
          - interval: 1m
            input_series:
              - {{series: 'netagent_controller_is_leader{series}', values: '1x20'}}
              - {{series: 'netagent_controller_budget_bytes_per_second{series}', values: '125000000x20'}}
              - {{series: 'netagent_controller_used_bytes_per_second{used}', values: '62500000x4 123750000x16'}}
            alert_rule_test:
              - alertname: NetagentBudgetSaturated
                eval_time: 4m
                exp_alerts: []
              - alertname: NetagentBudgetSaturated
                eval_time: 20m
                exp_alerts:
                  - exp_labels: {{severity: warning}}
                    exp_annotations:
                      summary: Cluster internet egress is at 99% of the budget
                      description: >-
                        The measured internet egress of all pods has stayed above 95% of the EgressBudget total
                        for 10 minutes: pods are being held to their fair shares and cannot grow.
                      runbook_url: docs/alerts.md#netagentbudgetsaturated
        """)
    (tmp_path / "saturated_test.yaml").write_text(case)
    result = subprocess.run([tool("promtool"), "test", "rules", "saturated_test.yaml"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_documented():
    doc = ALERTS_DOC.read_text()
    anchors = {github_anchor(line.lstrip("#")) for line in doc.splitlines() if line.startswith("## ")}
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = alert["annotations"]
        assert annotations.get("summary") and annotations.get("description"), name
        assert annotations["runbook_url"] == f"docs/alerts.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/alerts.md has no '## {name}' runbook section"


# --- a real Prometheus accepts every query -----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"prometheus not ready: {log.read_text()[-2000:]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """Debian's prometheus on loopback with an empty TSDB, no scrape targets, and our rules."""
    workdir = tmp_path_factory.mktemp("prometheus")
    shutil.copy(RULES, workdir / "rules.yaml")
    (workdir / "prometheus.yml").write_text("global: {evaluation_interval: 1s}\nrule_files: [rules.yaml]\n")
    port = _free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen([tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, workdir / "prometheus.log")
        yield url
    finally:
        stop_process(proc, 20)
        log.close()


def test_prometheus_loads_the_rules(prometheus):
    groups = _get(f"{prometheus}/api/v1/rules")["data"]["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"]}
    assert loaded == {r.get("record") or r["alert"] for g in rule_groups() for r in g["rules"]}


def test_prometheus_accepts_every_panel_query(prometheus):
    rejected = []
    for where, expr in contract.dashboard_expressions():
        if where.split(": ", 1)[1].startswith("variable"):
            continue
        for values in ({}, {"cluster": "prod", "node": "node-1", "namespace": "ml", "pod": "trainer-0"}):
            q = build.fill_variables(expr, values)
            answer = _get(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
            if answer.get("status") != "success":
                rejected.append(f"{where}: {q}: {answer.get('error')}")
    assert not rejected, "\n".join(rejected)


def test_prometheus_accepts_every_variable_query(prometheus):
    """Grafana's label_values(SELECTOR, LABEL) asks /api/v1/series for SELECTOR."""
    rejected = []
    for where, q in contract.dashboard_expressions():
        if not where.split(": ", 1)[1].startswith("variable"):
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
        assert m, f"{where}: not a label_values(selector, label) query: {q}"
        selector = build.fill_variables(m.group(1))
        answer = _get(f"{prometheus}/api/v1/series?" + urllib.parse.urlencode({"match[]": selector}))
        if answer.get("status") != "success":
            rejected.append(f"{where}: {selector}: {answer.get('error')}")
    assert not rejected, "\n".join(rejected)


# --- every panel returns data from the real exporters ----------------------------------------

# two nodes' pods: (namespace, name, team, class, internet egress bit/s, internet ingress (downloads) bit/s,
# policy problem); uploads use the whole budget (1G), downloads the whole spec.ingressTotal (500M) of
# docs/examples/policy.yaml
LIVE_PODS = {
    "node-a": [("research", "r1", "research", "gold", 400e6, 300e6, None),
               ("batch", "b1", "batch", "bulk", 300e6, 50e6, None)],
    "node-b": [("research-eval", "r2", "research", "standard", 200e6, 100e6, None),
               ("default", "s1", "shared", "standard", 100e6, 50e6, "UnknownEgressClass")],
}
LIVE_CHOICE = {"node": "node-a", "namespace": "research", "pod": "r1"}


def _node_view(node: str, started: float):
    """What an agent of `node` would expose `elapsed` seconds into steady traffic."""
    from netagent.view import NodeView, PodView

    elapsed = time.monotonic() - started + 1
    pods = []
    for namespace, name, team, egress_class, rate, download, problem in LIVE_PODS[node]:
        internet = int(rate / 8 * elapsed)
        received = int(download / 8 * elapsed)
        pods.append(PodView(
            namespace=namespace, name=name, team=team, egress_class=egress_class, ips=("10.1.0.1",), minor=10,
            allocation_bps=rate, limit_bps=rate * 1.1, demand_bps=rate * 1.5, usage_bps=rate, throttled=True,
            throttled_seconds=elapsed / 2, egress_bytes={"internal": internet * 3, **_scoped(internet),
                                                         "internet": internet},
            ingress_bytes={"internal": internet, **_scoped(received), "internet": received},
            dropped_packets=int(elapsed * 5),
            # an agent that shapes downloads: the pod's download class, demand, drops and throttled time
            ingress_allocation_bps=download, ingress_limit_bps=download * 1.1, ingress_demand_bps=download * 1.5,
            ingress_usage_bps=download, ingress_throttled=True, ingress_throttled_seconds=elapsed / 4,
            ingress_dropped_packets=int(elapsed * 3),
            problems=((problem, "unknown class"),) if problem else ()))
    total = sum(p.egress_bytes["internet"] for p in pods)
    received = sum(p.ingress_bytes["internet"] for p in pods)
    return NodeView(node=node, pods=pods, egress_bytes={"internal": total * 3, "internet": total},
                    ingress_bytes={"internal": total, "internet": received}, allocation_bps=1e9, ready=True,
                    controller="http://controller", controller_reachable=True, last_reconcile_success=time.time(),
                    leaf_qdisc="pfifo", iptables_backend="nft", unknown_source_egress_bytes=int(1000 * elapsed),
                    ingress_allocation_bps=250e6, unknown_destination_ingress_bytes=int(800 * elapsed))


def _scoped(internet: int) -> dict[str, int]:
    """A pod's cross-zone and cross-region bytes beside its internet ones (the scopes dashboard, docs/scopes.md)."""
    return {"cross-zone": internet // 2, "cross-region": internet // 4}


@dataclass
class Live:
    url: str
    workdir: Path
    controller: subprocess.Popen

    def diagnosis(self) -> str:
        """Why a live check may have failed: the scrape targets' health and the controller's log."""
        targets = _get(f"{self.url}/api/v1/targets")["data"]["activeTargets"]
        lines = [f"target {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}" for t in targets]
        exited = self.controller.poll()
        log = (self.workdir / "controller.log").read_text()[-1500:]
        return "\n".join(lines) + f"\ncontroller {'exited ' + str(exited) if exited is not None else 'running'}, log:\n" + log


@pytest.fixture(scope="module")
def live_prometheus(tmp_path_factory):
    """Prometheus scraping two agents' real collectors (synthetic node views, in-process) and a
    real controller (`netagent controller --from-file`, fed reports over its HTTP API)."""
    import threading

    from prometheus_client import start_http_server

    from netagent.metrics import AgentMetrics

    workdir = tmp_path_factory.mktemp("live")
    started = time.monotonic()
    stop = threading.Event()
    servers, threads, procs = [], [], []
    try:
        agents = {}
        for node in LIVE_PODS:
            metrics = AgentMetrics(lambda node=node: _node_view(node, started))
            for seconds in (0.002, 0.004, 0.03):
                metrics.reconcile_duration.observe(seconds)
            port = _free_port()
            server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
            servers.append(server)
            agents[node] = (port, metrics)

        controller_port = _free_port()
        controller_log = (workdir / "controller.log").open("w")
        # the example policy with a volume quota on research (the dashboard's quota row; docs/quotas.md)
        objects = list(yaml.safe_load_all((REPO / "docs/examples/policy.yaml").read_text()))
        for o in objects:
            for team in (o or {}).get("spec", {}).get("teams", []) if (o or {}).get("kind") == "EgressBudget" else []:
                if team["name"] == "research":
                    # and a cost quota (the scopes dashboard's cost quota panels; docs/scopes.md)
                    team["quota"] = {"period": "Month", "bytes": "50Ti", "exhaustedRate": "100M",
                                     "ingress": {"bytes": "200Ti"}, "cost": "5000"}
        # the NetworkScopes prices: the controller counts the reports' bytes by scope and prices them
        objects.append(yaml.safe_load((REPO / "docs/examples/networkscopes-aws.yaml").read_text()))
        (workdir / "policy.yaml").write_text(yaml.safe_dump_all(objects))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "netagent", "controller", "--from-file", str(workdir / "policy.yaml"),
             "--no-auth", "--insecure-http", "--listen", f"127.0.0.1:{controller_port}", "--period", "1"],
            stdout=controller_log, stderr=subprocess.STDOUT, cwd=REPO))

        def report_loop():
            while not stop.wait(1.0):
                for node, pods in LIVE_PODS.items():
                    # an agent that shapes downloads: the controller exports its download view
                    # cumulative counters in one epoch (the cost's and the quotas' counting, docs/scopes.md)
                    views = {p.name: p for p in _node_view(node, started).pods}
                    body = {"node": node, "period_seconds": 1.0, "shapes_ingress": True, "epoch": "live",
                            "node_internet_ingress_bps": sum(pod[5] for pod in pods), "pods": [
                        {"namespace": ns, "name": name, "usage_bps": rate, "demand_bps": rate * 1.5,
                         "throttled": True, "egress_class": egress_class, "ingress_usage_bps": download,
                         "ingress_demand_bps": download * 1.5, "ingress_throttled": True,
                         "bytes_total": views[name].egress_bytes["internet"],
                         "ingress_bytes_total": views[name].ingress_bytes["internet"],
                         "scope_bytes_total": _scoped(views[name].egress_bytes["internet"]),
                         "ingress_scope_bytes_total": _scoped(views[name].ingress_bytes["internet"])}
                        for ns, name, _, egress_class, rate, download, _ in pods]}
                    request = urllib.request.Request(f"http://127.0.0.1:{controller_port}/v1/nodes/{node}/report",
                                                     data=json.dumps(body).encode(),
                                                     headers={"Content-Type": "application/json"})
                    try:
                        urllib.request.urlopen(request, timeout=5).read()
                        agents[node][1].reconcile_duration.observe(0.005)
                    except OSError:
                        pass  # the controller is still starting: the next round reports again

        threads.append(threading.Thread(target=report_loop, daemon=True))
        threads[-1].start()

        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            group.pop("interval", None)  # evaluate every second, like the scrapes
            for rule in group["rules"]:
                rule.pop("for", None)  # alerts fire at once: their expressions are under test, not their delays
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {"job_name": "netagent-agent", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"node": node}}
                                    for node, (port, _) in agents.items()]},
                {"job_name": "netagent-controller", "static_configs": [{"targets": [f"127.0.0.1:{controller_port}"]}]},
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _free_port()
        prom_log = (workdir / "prometheus.log").open("w")
        procs.append(subprocess.Popen(
            [tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=prom_log, stderr=subprocess.STDOUT))
        _wait_ready(f"http://127.0.0.1:{port}", procs[-1], workdir / "prometheus.log")
        yield Live(f"http://127.0.0.1:{port}", workdir, procs[0])
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        for proc in procs:
            stop_process(proc, 20)
        for server in servers:
            server.shutdown()
            server.server_close()


def test_every_panel_query_returns_data_from_the_exporters(live_prometheus):
    deadline = time.monotonic() + 120
    for values in ({}, LIVE_CHOICE):
        while empty := contract.queries_without_data(live_prometheus.url, values):
            assert time.monotonic() < deadline, (f"queries without data (variables {values or 'All'}):\n"
                                                 + "\n".join(empty) + "\n" + live_prometheus.diagnosis())
            time.sleep(2)


def test_template_variables_list_the_exporters_values(live_prometheus):
    def values(variable: str) -> set[str]:
        for name, model in dashboards().items():
            for v, q in build.variable_queries(model):
                if v == variable:
                    selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q).groups()
                    answer = _get(f"{live_prometheus.url}/api/v1/series?" +
                                  urllib.parse.urlencode({"match[]": build.fill_variables(selector)}))
                    return {s.get(label) for s in answer["data"]}
        raise AssertionError(f"no variable {variable}")

    deadline = time.monotonic() + 60
    while values("node") != set(LIVE_PODS):
        assert time.monotonic() < deadline, f"nodes {values('node')}\n{live_prometheus.diagnosis()}"
        time.sleep(1)
    assert values("namespace") == {ns for pods in LIVE_PODS.values() for ns, *_ in pods}
    assert values("pod") == {name for pods in LIVE_PODS.values() for _, name, *_ in pods}


def test_alerts_fire_on_what_the_exporters_say(live_prometheus):
    """The pods use the whole budget (1 Gbit/s of 1G, and 500 Mbit/s of downloads of the 500M
    spec.ingressTotal) and one has an unknown class: those alerts fire from the real exporters'
    series; the health alerts, and the download ones of a healthy cluster, stay quiet."""
    must_fire = {"NetagentBudgetSaturated", "NetagentIngressBudgetSaturated", "NetagentPodPolicyProblem"}
    must_not = {"NetagentAgentNotReady", "NetagentControllerUnreachable", "NetagentFailStatic",
                "NetagentControllerNoLeader", "NetagentAgentDrifting", "NetagentReconcileFailing", "NetagentDropsHigh",
                "NetagentAllocationFailing", "NetagentTeamStarved", "NetagentTeamIngressStarved",
                "NetagentIngressBudgetExceeded", "NetagentIngressNotShaped", "NetagentIngressDropsHigh"}
    deadline = time.monotonic() + 120
    while True:
        firing = {a["labels"]["alertname"] for a in _get(f"{live_prometheus.url}/api/v1/alerts")["data"]["alerts"]
                  if a["state"] == "firing"}
        assert not firing & must_not, f"firing in a healthy setup: {firing & must_not}\n{live_prometheus.diagnosis()}"
        if must_fire <= firing:
            break
        assert time.monotonic() < deadline, (f"firing: {sorted(firing)}; expected at least {sorted(must_fire)}\n"
                                             + live_prometheus.diagnosis())
        time.sleep(1)
