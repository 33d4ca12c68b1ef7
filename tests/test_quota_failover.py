"""Volume quotas end to end through real controller processes and the real kube-apiserver (tests/kube.py):
reports carrying the pods' byte counters are counted by the leader, its use lands in the EgressBudget's
status.quota at the status interval, an exhausted team's pod is answered at its exhaustedRate, and after a
kill -9 of the leader the next one resumes from status.quota: with the last report replayed (and replayed again)
its figure is within one persistence interval of the true bytes and never above them. Reports are posted as
tests/test_controller_kube.py posts them (no agent process: the agent's side is tests/test_quota_wire.py)."""
from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from core.kubeapi import GROUP, VERSION
from lab.procs import wait_for
from tests.test_controller_kube import controller, crds, leading, nodes_and_pods  # noqa: F401 (fixtures)

QUOTA = {"period": "Month", "bytes": "1M", "exhaustedRate": "2M"}


@pytest.fixture
def quota_budget(crds, nodes_and_pods):
    namespace, _ = nodes_and_pods
    custom = client.CustomObjectsApi(crds.admin)
    obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EgressBudget", "metadata": {"name": "default"},
           "spec": {"total": "100M", "teams": [{"name": "lab", "namespaces": [namespace], "quota": QUOTA}]}}
    with contextlib.suppress(ApiException):
        custom.delete_cluster_custom_object(GROUP, VERSION, "egressbudgets", "default")
    custom.create_cluster_custom_object(GROUP, VERSION, "egressbudgets", obj)
    try:
        yield custom
    finally:
        with contextlib.suppress(ApiException):
            custom.delete_cluster_custom_object(GROUP, VERSION, "egressbudgets", "default")


def post(base: str, node: str, namespace: str, counter: int) -> dict:
    pod = {"namespace": namespace, "name": "work-a", "usage_bps": 10e6, "demand_bps": 50e6,
           "bytes_total": counter, "uid": "uid-work-a"}
    body = json.dumps({"node": node, "pods": [pod], "epoch": "boot-1", "node_internet_egress_bps": 10e6}).encode()
    req = urllib.request.Request(f"{base}/v1/nodes/{node}/report", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, **json.loads(exc.read() or b"{}")}


def used(custom) -> int | None:
    status = custom.get_cluster_custom_object(GROUP, VERSION, "egressbudgets", "default").get("status") or {}
    teams = (status.get("quota") or {}).get("teams") or []
    return int(teams[0]["used"]) if teams else None


def allocation(answer: dict) -> float | None:
    pods = answer.get("pods") or []
    return pods[0]["allocation_bps"] if pods and answer.get("generation") else None


def test_counted_by_the_leader_persisted_enforced_and_resumed_after_kill_9(kube_api, quota_budget, nodes_and_pods,
                                                                          tmp_path):
    namespace, nodes = nodes_and_pods
    node = nodes["a"]
    args = ("--no-auth", "--status-interval", "1")
    with controller(kube_api, tmp_path, namespace, *args, name="first") as (proc, base, _):
        wait_for(lambda: leading(base), what="the first replica to lead")
        wait_for(lambda: "generation" in post(base, node, namespace, 0) and used(quota_budget) == 0, timeout=30,
                 what="the first report counted as a baseline and persisted")
        for counter in (200_000, 400_000, 600_000):
            post(base, node, namespace, counter)
        wait_for(lambda: used(quota_budget) == 600_000, timeout=30, what="the use persisted")
        assert (allocation(post(base, node, namespace, 600_000)) or 0) > 2e6  # quota left: its fair share
        post(base, node, namespace, 700_000)  # counted, maybe not persisted before the kill
        proc.kill()  # kill -9: no lease release, no last write
        proc.wait()
    true_bytes = 700_000
    with controller(kube_api, tmp_path, namespace, *args, name="second") as (_, base, log_path):
        wait_for(lambda: leading(base), timeout=60, what="the second replica to take the lease")
        persisted = used(quota_budget)
        assert persisted is not None and 600_000 <= persisted <= true_bytes
        for _ in range(3):  # the last report replayed: its counter is this leader's baseline
            post(base, node, namespace, 700_000)
        wait_for(lambda: "counting as leader" in log_path.read_text(), timeout=30, what="the resume")
        post(base, node, namespace, 700_000)
        post(base, node, namespace, 900_000)
        wait_for(lambda: used(quota_budget) == persisted + 200_000, timeout=30, what="counting on from the resume")
        assert used(quota_budget) <= 900_000  # never above the true bytes
        post(base, node, namespace, 1_300_000)  # past the quota's 1M bytes

        def capped():
            a = allocation(post(base, node, namespace, 1_300_000))
            return a is not None and a <= 2e6

        wait_for(capped, timeout=30, what="the exhausted team answered at its exhaustedRate")
        status = quota_budget.get_cluster_custom_object(GROUP, VERSION, "egressbudgets", "default")["status"]
        wait_for(lambda: quota_budget.get_cluster_custom_object(GROUP, VERSION, "egressbudgets", "default")[
            "status"]["quota"]["teams"][0]["exhausted"] is True, timeout=30, what="exhausted persisted")
        assert status["quota"]["teams"][0]["name"] == "lab"
