"""The agent's Kubernetes source on a real kube-apiserver: the controller's status writes to the
EgressBudget (every few seconds: used, demand, quota) are no change for the agent, a spec change is.
Before, each status write woke every node's agent to re-resolve and reconcile its pods. The budget
the test creates is removed even on failure."""
from __future__ import annotations

import threading
import time
import uuid

from kubernetes import client

from netagent.sources import KubeSource
from tests.test_agent_kube import install_crds

GROUP, VERSION, PLURAL = "netagent.io", "v1alpha1", "egressbudgets"


def test_a_budget_status_write_wakes_no_agent_and_a_spec_change_does(kube_api):
    install_crds(kube_api)
    custom = client.CustomObjectsApi(kube_api.admin)
    name = f"status-{uuid.uuid4().hex[:8]}"
    budget = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EgressBudget", "metadata": {"name": name},
              "spec": {"total": "100M", "teams": [{"name": "a", "namespaces": ["a"]}]}}
    seen: list = []  # every snapshot the source handed on
    source = KubeSource(kube_api.admin, f"node-{uuid.uuid4().hex[:8]}")
    thread = threading.Thread(target=source.run, args=(seen.append,), daemon=True)

    def ours(snap) -> dict | None:
        return next((b for b in snap.budgets if b["metadata"]["name"] == name), None)

    def wait_for(check, what: str) -> None:
        deadline = time.monotonic() + 30
        while not (seen and check(ours(seen[-1]))):
            assert time.monotonic() < deadline, f"the source never showed {what}: {seen[-1:] or 'nothing'}"
            time.sleep(0.05)

    try:
        custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, budget)
        thread.start()
        wait_for(lambda b: b is not None, "the budget")
        stored = custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)  # with the schema's defaults
        kept = {"metadata": {"name": name, "generation": 1}, "spec": stored["spec"]}
        assert ours(seen[-1]) == kept
        before = len(seen)
        for i in range(5):  # as the controller writes it
            custom.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, name, {"status": {
                "used": f"{i + 1}M", "lastComputed": f"2026-11-29T05:00:0{i}Z"}})
        status = custom.get_cluster_custom_object_status(GROUP, VERSION, PLURAL, name)["status"]
        assert status["used"] == "5M"  # the writes landed
        time.sleep(1.5)  # the watch delivers each event within ~0.1 s here: an absence, not a speed
        # (another resource's event, a namespace an earlier test deleted, may hand one on: with the budget as it was)
        changed = [ours(s) for s in seen[before:] if ours(s) != kept]
        assert not changed, f"{len(changed)} snapshots handed on for status writes alone: {changed[:1]}"
        # the positive control: a spec change is handed on, with its generation
        custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, name, {"spec": {"total": "200M"}})
        wait_for(lambda b: b is not None and b["spec"]["total"] == "200M", "the spec change")
        assert ours(seen[-1])["metadata"]["generation"] == 2
    finally:
        source.stop()
        thread.join(timeout=10)
        try:
            custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
