"""End to end on one machine: the demo's lab (two nodes, six pods, real agents and a real
controller, iperf3 traffic to the "internet" host) scraped by a real Prometheus inside the
lab. Every panel query of every dashboard returns data from the live exporters, and the
budget-saturated alert fires because the pods want far more than the budget.

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
        demo.lab.spawn(demo.lab.fabric, [prometheus, f"--config.file={work / 'prometheus.yml'}",
                                         f"--storage.tsdb.path={work / 'data'}",
                                         f"--web.listen-address={CONTROLLER_IP}:{PROM_PORT}"],
                       stdout=open(work / "prometheus.log", "w"), stderr=subprocess.STDOUT)
        url = f"http://{CONTROLLER_IP}:{PROM_PORT}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if demo.fabric.call(http_get, f"{url}/-/ready", 2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (work / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        yield demo, url, work
    finally:
        demo.close()


def _query(demo: Demo, url: str, path: str, **params) -> dict:
    code, body = demo.fabric.call(http_get, f"{url}{path}?{urllib.parse.urlencode(params)}", 10)
    return json.loads(body)


def test_every_panel_returns_data_from_live_agents_and_controller(lab_with_prometheus):
    demo, url, work = lab_with_prometheus
    choice = {"node": "node1", "namespace": "data", "pod": "crawl"}
    deadline = time.monotonic() + 150
    for values in ({}, choice):
        while empty := demo.fabric.call(contract.queries_without_data, url, values, timeout=120):
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
