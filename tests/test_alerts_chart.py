"""The alerts as the chart ships them, under any release name (docs/alerts.md "Release names").

The chart is rendered with `helm template` under the default release (netagent in netagent-system)
and under another (egress in traffic-control), with the PodMonitors or the ServiceMonitors and the
PrometheusRule on. For each rendering:

- the `job` each monitor gives its targets is worked out as the Prometheus operator does (the
  monitor's name, or the label `jobLabel` names, then the monitor's relabelings), and every `job`
  a rule selects is one of them;
- the PrometheusRule's groups are written as a rules file: `promtool check rules` passes, and
  `promtool test rules` runs dashboards/rules_test.yaml's cases against it with their series
  labelled as that release's monitors label them; every alert of the rendered rules fires in one
  of the cases, and no case names an alert the rules do not have;
- the rules and dashboards the chart ships are the same text under both releases.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.node import require_node_assets

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "netagent"
RULES_TEST = REPO / "dashboards" / "rules_test.yaml"
# the jobs dashboards/rules_test.yaml's series carry: the default release's
TEST_JOBS = {"DaemonSet": "netagent-agent", "Deployment": "netagent-controller"}
RELEASES = [("netagent", "netagent-system"), ("egress", "traffic-control")]
MONITORS = {"podMonitor": "PodMonitor", "serviceMonitor": "ServiceMonitor"}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is not installed: install Debian's prometheus package (scripts/bootstrap.sh does)"
    return path


def helm_template(release: str, namespace: str, *args: str) -> subprocess.CompletedProcess:
    helm = require_node_assets(["helm"]) / "helm"
    return subprocess.run([str(helm), "template", release, str(CHART), "--namespace", namespace, *args],
                          capture_output=True, text=True, timeout=120)


def render(release: str, namespace: str, monitor: str, *args: str) -> list[dict]:
    result = helm_template(release, namespace, "--set", f"monitoring.{monitor}.enabled=true",
                           "--set", "monitoring.prometheusRule.enabled=true", *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def runbook_base() -> str:
    return yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["runbookBaseURL"]


def _replacement(template: str, match: re.Match) -> str:
    # Prometheus writes groups as $1 or ${1}
    return re.sub(r"\$\{?(\w+)\}?", lambda g: match.group(int(g.group(1))) or "", template)


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str]:
    """Prometheus' `replace` relabelling (the only action the chart's monitors use)."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace").lower()
        assert action == "replace", f"relabel action {action} is not emulated here: {rule}"
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule.get("sourceLabels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            new = _replacement(rule.get("replacement", "$1"), match)
            if new:
                labels[rule["targetLabel"]] = new
            else:
                labels.pop(rule["targetLabel"], None)
    return labels


def selected(objs: list[dict], selector: dict, labels_of) -> list[dict]:
    want = selector["matchLabels"].items()
    return [o for o in objs if want <= (labels_of(o) or {}).items()]


def monitor_jobs(docs: list[dict]) -> dict[str, set[str]]:
    """Workload kind (DaemonSet: the agents, Deployment: the controllers) -> the `job` values the
    rendered PodMonitors/ServiceMonitors give their targets, as the Prometheus operator does: a
    PodMonitor's job is "<namespace>/<name>", a ServiceMonitor's the Service's name; `jobLabel`
    takes the pod's (Service's) label of that name instead; the endpoint's relabelings come last."""
    workloads = [d for d in docs if d["kind"] in ("DaemonSet", "Deployment")]
    services = [d for d in docs if d["kind"] == "Service"]
    jobs: dict[str, set[str]] = {}
    for m in (d for d in docs if d["kind"] in MONITORS.values()):
        spec, meta = m["spec"], m["metadata"]
        if m["kind"] == "PodMonitor":
            endpoints = spec["podMetricsEndpoints"]
            targets = [(w, w["spec"]["template"]["metadata"]["labels"], f"{meta['namespace']}/{meta['name']}")
                       for w in selected(workloads, spec["selector"], lambda w: w["spec"]["template"]["metadata"]
                                         ["labels"])]
        else:
            endpoints = spec["endpoints"]
            targets = [(w, s["metadata"].get("labels", {}), s["metadata"]["name"])
                       for s in selected(services, spec["selector"], lambda s: s["metadata"].get("labels"))
                       for w in workloads
                       if s["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert targets, f"{m['kind']} {meta['name']} selects nothing the chart renders"
        for workload, labels, default in targets:
            job = labels.get(spec["jobLabel"], default) if spec.get("jobLabel") else default
            for ep in endpoints:
                target = relabel({"job": job, "__meta_kubernetes_pod_node_name": "n1"}, ep.get("relabelings", []))
                jobs.setdefault(workload["kind"], set()).add(target["job"])
    return jobs


def rule_groups(docs: list[dict]) -> list[dict]:
    rule, = (d for d in docs if d["kind"] == "PrometheusRule")
    return rule["spec"]["groups"]


def alerts(groups: list[dict]) -> set[str]:
    return {r["alert"] for g in groups for r in g["rules"] if "alert" in r}


def relabelled_cases(jobs: dict[str, set[str]]) -> str:
    """dashboards/rules_test.yaml with its series' and expected alerts' `job` the release's."""
    text = RULES_TEST.read_text()
    for kind, test_job in TEST_JOBS.items():
        job, = jobs[kind]
        text = re.sub(rf'(\bjob="){re.escape(test_job)}"', rf'\g<1>{job}"', text)
        text = re.sub(rf"(\bjob: ){re.escape(test_job)}$", rf"\g<1>{job}", text, flags=re.M)
    # the chart makes the runbook URLs absolute (monitoring.runbookBaseURL)
    text = text.replace("runbook_url: docs/alerts.md#", f"runbook_url: {runbook_base()}#")
    cases = yaml.safe_load(text)
    cases["rule_files"] = ["rules.yaml"]
    return yaml.safe_dump(cases, sort_keys=False, width=1000)


@pytest.mark.parametrize("monitor", MONITORS)
@pytest.mark.parametrize("release,namespace", RELEASES)
def test_rendered_rules_fire_every_alert_under_the_release(tmp_path, release, namespace, monitor):
    docs = render(release, namespace, monitor)
    jobs = monitor_jobs(docs)
    assert set(jobs) == set(TEST_JOBS) and all(len(j) == 1 for j in jobs.values()), jobs
    groups = rule_groups(docs)

    # a rule selecting a job no monitor gives is an alert that never fires
    monitored = set().union(*jobs.values())
    selected_jobs = {j for g in groups for r in g["rules"] for j in re.findall(r'\bjob\s*=~?\s*"([^"]*)"', r["expr"])}
    assert selected_jobs <= monitored, (f"rules select job {sorted(selected_jobs - monitored)} but the {release} "
                                        f"release's monitors set {sorted(monitored)}")

    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False, width=1000))
    check = subprocess.run([promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    (tmp_path / "rules_test.yaml").write_text(relabelled_cases(jobs))
    unit = subprocess.run([promtool(), "test", "rules", "rules_test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert unit.returncode == 0, f"release {release} in {namespace} ({monitor}):\n{unit.stdout}{unit.stderr}"

    cases = yaml.safe_load((tmp_path / "rules_test.yaml").read_text())["tests"]
    fired = {c["alertname"] for t in cases for c in t.get("alert_rule_test", []) if c.get("exp_alerts")}
    tested = {c["alertname"] for t in cases for c in t.get("alert_rule_test", [])}
    rendered = alerts(groups)
    assert fired == rendered, (f"alerts the chart renders that no promtool case fires: {sorted(rendered - fired)}; "
                               f"alerts fired that the chart does not render: {sorted(fired - rendered)}")
    assert tested <= rendered, f"cases test alerts the chart does not render: {sorted(tested - rendered)}"


def test_rules_dashboards_and_jobs_do_not_depend_on_the_release():
    """What Prometheus and Grafana read is the same text under any release name and namespace."""
    shipped = {}
    for release, namespace in RELEASES:
        docs = render(release, namespace, "podMonitor")
        dashboards = {k: v for d in docs if d["kind"] == "ConfigMap" for k, v in d.get("data", {}).items()
                      if k.endswith(".json")}
        assert dashboards, "the chart renders no dashboards"
        service_jobs = monitor_jobs(render(release, namespace, "serviceMonitor"))
        shipped[release] = (rule_groups(docs), dashboards, monitor_jobs(docs), service_jobs)
    assert shipped["egress"] == shipped["netagent"]
    # and any job a dashboard query selects is one the monitors give
    _, dashboards, jobs, _ = shipped["egress"]
    dashboard_jobs = {j for text in dashboards.values() for j in re.findall(r'\bjob\s*=~?\s*\\"([^"\\]*)', text)}
    assert dashboard_jobs <= set().union(*jobs.values()), dashboard_jobs
    # ServiceMonitors and PodMonitors name the jobs alike: the alerts fit either
    assert shipped["egress"][2] == shipped["egress"][3] == {k: {v} for k, v in TEST_JOBS.items()}


def test_monitoring_knobs(tmp_path):
    """kube-prometheus-stack's knobs: runbookBaseURL, relabelings and metricRelabelings on every monitor
    (after the chart's job/node relabelings, which they cannot undo by accident), additionalRuleLabels on
    every alert (its own severity wins), per-alert disabling; a misspelt alert name is refused by name."""
    base = "https://wiki.example.com/netagent/alerts"
    extra = {"targetLabel": "cluster", "replacement": "eu-1"}
    drop = {"sourceLabels": ["__name__"], "regex": "netagent_pod_ingress_.*", "action": "drop"}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump({"monitoring": {
        "runbookBaseURL": base, "relabelings": [extra], "metricRelabelings": [drop],
        "prometheusRule": {"additionalRuleLabels": {"team": "platform", "severity": "page"},
                           "disabled": {"NetagentDropsHigh": True, "NetagentIngressDropsHigh": False}}}}))
    for monitor in MONITORS:
        docs = render("egress", "traffic-control", monitor, "-f", str(tmp_path / "values.yaml"))
        monitors = [d for d in docs if d["kind"] == MONITORS[monitor]]
        assert len(monitors) == 2
        for m in monitors:
            for ep in m["spec"].get("podMetricsEndpoints", m["spec"].get("endpoints")):
                assert ep["relabelings"][0]["targetLabel"] == "job" and ep["relabelings"][-1] == extra
                assert ep["metricRelabelings"] == [drop]
        assert monitor_jobs(docs) == {k: {v} for k, v in TEST_JOBS.items()}
        groups = rule_groups(docs)
        rules = [r for g in groups for r in g["rules"] if "alert" in r]
        names = {r["alert"] for r in rules}
        assert "NetagentDropsHigh" not in names and "NetagentIngressDropsHigh" in names
        assert len(names) == len(alerts(rule_groups(render("egress", "traffic-control", monitor)))) - 1
        for r in rules:
            assert r["labels"]["team"] == "platform" and r["labels"]["severity"] != "page", r["alert"]
            assert r["annotations"]["runbook_url"] == f"{base}#{r['alert'].lower()}"
        assert all("labels" not in r or "team" not in r["labels"] for g in groups for r in g["rules"] if "record" in r)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    check = subprocess.run([promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    typo = helm_template("egress", "traffic-control", "--set", "monitoring.prometheusRule.enabled=true",
                         "--set", "monitoring.prometheusRule.disabled.NetagentDropHigh=true")
    assert typo.returncode != 0
    assert "monitoring.prometheusRule.disabled.NetagentDropHigh: no alert of that name" in typo.stderr
    assert "NetagentDropsHigh" in typo.stderr  # what it expected


def test_runbook_urls_are_absolute_by_default():
    base = runbook_base()
    assert base.startswith("https://") and base.endswith("docs/alerts.md")
    for r in (r for g in rule_groups(render("netagent", "netagent-system", "podMonitor")) for r in g["rules"]):
        if "alert" in r:
            assert r["annotations"]["runbook_url"] == f"{base}#{r['alert'].lower()}"
