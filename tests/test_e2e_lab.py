"""End to end on one machine: the demo's lab (two nodes, six pods, real agents and a real
controller, iperf3 traffic to the "internet" host) scraped by real Prometheus servers inside the
lab. Day one: a Prometheus configured as the chart's default values configure it (the PodMonitors'
jobs and interval, and only the rules the chart ships by default: none, monitoring.prometheusRule
is off) answers every panel query of every dashboard with data, $__rate_interval at four scrape
intervals as Grafana makes it. A second one, with dashboards/rules.yaml loaded and scraping every
second, fires the budget-saturated alert because the pods want far more than the budget.

Prometheus runs in the lab's fabric namespace (where agents and controller listen); the
test reaches its HTTP API through a thread that entered that namespace (lab.nsexec).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse

import pytest
import yaml

from dashboards import contract
from lab.demo import AGENT_PORT, CONTROLLER_IP, CONTROLLER_PORT, Demo, DemoOptions
from lab.nsexec import http_get
from lab.netns import require_root

PROM_PORT = 9590
DAY_ONE_PORT = 9591


def chart_day_one() -> tuple[list[dict], str, dict[str, str]]:
    """What the chart's default values give Prometheus in a cluster with the Prometheus operator
    (PodMonitors: monitoring.podMonitor.enabled=auto): the rule groups it ships, the scrape interval,
    the job of the agents (DaemonSet) and of the controllers (Deployment) as the operator names them."""
    from tests.test_alerts_chart import monitor_jobs
    from tests.test_deploy import helm_template

    docs = helm_template("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
    groups = [g for d in docs if d["kind"] == "PrometheusRule" for g in d["spec"]["groups"]]
    intervals = {ep["interval"] for d in docs if d["kind"] == "PodMonitor" for ep in d["spec"]["podMetricsEndpoints"]}
    interval, = intervals
    jobs = {kind: job for kind, (job,) in ((k, tuple(v)) for k, v in monitor_jobs(docs).items())}
    return groups, interval, jobs


def _seconds(duration: str) -> int:
    import re

    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return int(sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration)))


@pytest.fixture(scope="module")
def lab_with_prometheus(tmp_path_factory):
    require_root()
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is not installed: scripts/bootstrap.sh installs Debian's package"
    work = tmp_path_factory.mktemp("e2e")
    demo = Demo(DemoOptions(duration=90, png=str(work / "demo.png"), plain=True))
    try:
        demo.start()
        demo.start_traffic(90)
        rules = yaml.safe_load((contract.dashboard_files()[0].parent / "rules.yaml").read_text())
        for group in rules["groups"]:
            group.pop("interval", None)  # evaluate every second, like the scrapes
            for rule in group["rules"]:
                rule.pop("for", None)  # alerts fire at once: their expressions are under test, not their delays
        (work / "rules.yaml").write_text(yaml.safe_dump(rules))
        (work / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                # as deploy/'s PodMonitor: the agents' namespace/pod labels name the shaped pod
                {"job_name": "netagent-agent", "honor_labels": True,
                 "static_configs": [{"targets": [f"{n.ip4}:{AGENT_PORT}"], "labels": {"node": n.name}}
                                    for n in demo.lab.nodes]},
                {"job_name": "netagent-controller",
                 "static_configs": [{"targets": [f"{CONTROLLER_IP}:{CONTROLLER_PORT}"]}]},
            ],
        }))
        groups, interval, jobs = chart_day_one()
        day_one = work / "day-one"
        day_one.mkdir()
        (day_one / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
        (day_one / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {"job_name": jobs["DaemonSet"], "honor_labels": True,
                 "static_configs": [{"targets": [f"{n.ip4}:{AGENT_PORT}"], "labels": {"node": n.name}}
                                    for n in demo.lab.nodes]},
                {"job_name": jobs["Deployment"],
                 "static_configs": [{"targets": [f"{CONTROLLER_IP}:{CONTROLLER_PORT}"]}]},
            ],
        }))
        servers = {PROM_PORT: work, DAY_ONE_PORT: day_one}
        for port, where in servers.items():
            demo.lab.spawn(demo.lab.fabric, [prometheus, f"--config.file={where / 'prometheus.yml'}",
                                             f"--storage.tsdb.path={where / 'data'}",
                                             f"--web.listen-address={CONTROLLER_IP}:{port}"],
                           stdout=open(where / "prometheus.log", "w"), stderr=subprocess.STDOUT)
        for port, where in servers.items():
            deadline = time.monotonic() + 60
            while True:
                try:
                    if demo.fabric.call(http_get, f"http://{CONTROLLER_IP}:{port}/-/ready", 2)[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, (where / "prometheus.log").read_text()[-2000:]
                time.sleep(0.5)
        url = f"http://{CONTROLLER_IP}:{PROM_PORT}"
        yield demo, url, work
    finally:
        demo.close()


def _query(demo: Demo, url: str, path: str, **params) -> dict:
    code, body = demo.fabric.call(http_get, f"{url}{path}?{urllib.parse.urlencode(params)}", 10)
    return json.loads(body)


def test_every_panel_returns_data_on_day_one(lab_with_prometheus):
    """The chart's default values ship no PrometheusRule, and every panel still has data: the
    dashboards read only the exporters' series (docs/dashboards.md "Raw series")."""
    demo, _, work = lab_with_prometheus
    groups, interval, _ = chart_day_one()
    assert groups == [], "the chart's defaults ship rules now: this test no longer shows the dashboards need none"
    url = f"http://{CONTROLLER_IP}:{DAY_ONE_PORT}"
    rate_interval = f"{4 * _seconds(interval)}s"  # Grafana's $__rate_interval: four scrape intervals at least
    choice = {"node": "node1", "namespace": "data", "pod": "crawl"}
    deadline = time.monotonic() + 150 + 4 * _seconds(interval)
    for values in ({}, choice):
        while empty := demo.fabric.call(contract.queries_without_data, url, values, rate_interval, timeout=120):
            targets = _query(demo, url, "/api/v1/targets")
            health = [(t["labels"].get("job"), t["health"], t.get("lastError")) for t in
                      targets.get("data", {}).get("activeTargets", [])]
            assert time.monotonic() < deadline, (f"queries without data (variables {values or 'All'}):\n"
                                                 + "\n".join(empty) + f"\ntargets: {health}")
            time.sleep(3)


def test_saturated_budget_fires_its_alert_and_health_alerts_stay_quiet(lab_with_prometheus):
    demo, url, work = lab_with_prometheus
    deadline = time.monotonic() + 90
    while True:
        alerts = _query(demo, url, "/api/v1/alerts")["data"]["alerts"]
        firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
        if "NetagentBudgetSaturated" in firing:
            break
        assert time.monotonic() < deadline, f"NetagentBudgetSaturated never fired; firing: {sorted(firing)}"
        time.sleep(2)
    quiet = {"NetagentAgentNotReady", "NetagentReconcileFailing", "NetagentControllerUnreachable",
             "NetagentFailStatic", "NetagentControllerNoLeader", "NetagentAllocationFailing"}
    assert not firing & quiet, f"health alerts firing in a healthy lab: {sorted(firing & quiet)}"
