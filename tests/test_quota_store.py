"""controller/quotastore.py against the real kube-apiserver (tests/kube.py): status.quota written with the
resourceVersion, a real 409 (another writer in between) re-read and written again without losing the other
writer's fields, a new leader resuming from it (counted bytes never counted twice and never above the true
bytes), a real outage (the API server's address refusing connections) retried with backoff while counting goes
on, told by a metric and a Warning Event, then a Normal one on recovery; and the per-team metrics."""
from __future__ import annotations

import contextlib
import time
import uuid
from datetime import datetime, timezone

import numpy as np
import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from prometheus_client import CollectorRegistry

from controller.allocator import Summary
from controller.quota import QuotaKeeper
from controller.quotastore import QuotaCollector, QuotaStore
from controller.status import StatusWriter
from core.direction import Direction
from core.kubeapi import GROUP, VERSION
from core.policy import load_policy
from core.wire import NodeReport, PodReport
from lab.kube import free_port
from tests.test_agent_kube import install_crds

UP, DOWN = Direction.UPLOAD, Direction.DOWNLOAD
QUOTA = {"period": "Month", "bytes": "1G", "exhaustedRate": "1M", "ingress": {"bytes": "10G"}}


@pytest.fixture
def budget(kube_api):
    install_crds(kube_api)
    custom = client.CustomObjectsApi(kube_api.admin)
    name = f"quota-{uuid.uuid4().hex[:8]}"
    obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EgressBudget", "metadata": {"name": name},
           "spec": {"total": "1G", "teams": [{"name": "research", "namespaces": ["research"], "quota": QUOTA}]}}
    custom.create_cluster_custom_object(GROUP, VERSION, "egressbudgets", obj)
    try:
        yield obj
    finally:
        with contextlib.suppress(ApiException):
            custom.delete_cluster_custom_object(GROUP, VERSION, "egressbudgets", name)


def _keeper(obj) -> QuotaKeeper:
    policy, problems = load_policy([], [obj])
    assert problems == []
    keeper = QuotaKeeper()
    keeper.set_policy(policy)
    return keeper


def _report(up: int, down: int = 0) -> NodeReport:
    return NodeReport("n1", [PodReport("research", "a", 0.0, 0.0, bytes_total=up, ingress_bytes_total=down,
                                       uid="uid-a")], epoch="boot-1")


def _observe(keeper: QuotaKeeper, report: NodeReport) -> None:
    """As the allocator feeds it: every pod in policy row 0, team research."""
    keeper.observe(report, np.zeros(len(report.pods), dtype=np.intp), lambda row: "research", _observe)


def _status(kube_api, name) -> dict:
    obj = client.CustomObjectsApi(kube_api.admin).get_cluster_custom_object(GROUP, VERSION, "egressbudgets", name)
    return obj.get("status") or {}


def _store(api, keeper, events) -> QuotaStore:
    return QuotaStore(api, keeper, interval=1.0, max_backoff=8.0, registry=CollectorRegistry(),
                      event=lambda budget, kind, reason, message: events.append((budget, kind, reason)))


def test_written_with_conflicts_resumed_by_a_new_leader_and_retried_through_an_outage(kube_api, budget, tmp_path):
    name = budget["metadata"]["name"]
    events: list = []
    keeper = _keeper(budget)
    store = _store(kube_api.admin, keeper, events)
    store.step()  # leading, not counting yet: resume (nothing persisted)
    assert keeper.active and keeper.teams()[0].used.upload == 0
    for up in (1000, 5000, 5000, 3000, 9000):  # the first a baseline; a retry and a reordered one add nothing
        _observe(keeper, _report(up, up * 2))
    assert tuple(keeper.teams()[0].used.items()) == ((UP, 8000), (DOWN, 16000))
    store.step()
    start = datetime.now(timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    assert _status(kube_api, name)["quota"] == {"teams": [
        {"name": "research", "periodStart": start.strftime("%Y-%m-%dT%H:%M:%SZ"), "used": "8000",
         "ingressUsed": "16000", "exhausted": False, "ingressExhausted": False}]}
    store.step()  # nothing changed: no write
    assert store.writes._value.get() == 1

    # another writer (the status writer's round figures) in between: our resourceVersion is stale -> 409
    client.CustomObjectsApi(kube_api.admin).patch_cluster_custom_object_status(
        GROUP, VERSION, "egressbudgets", name, {"status": {"used": "5M"}})
    _observe(keeper, _report(10_000, 20_000))
    store.step()
    assert store.write_failures.labels("conflict")._value.get() == 1 and store.failures == 0
    status = _status(kube_api, name)
    assert status["used"] == "5M" and status["quota"]["teams"][0]["used"] == "9000"  # both kept
    true_up = 9000 + 1000  # what the pod really sent since its baseline (the new leader's report below included)

    # the leader dies after its last write; bytes counted after it are lost, never counted twice
    _observe(keeper, _report(10_500, 20_500))
    keeper.stop()
    new_keeper = _keeper(budget)
    new_store = _store(kube_api.admin, new_keeper, events)
    new_store.step()
    assert tuple(new_keeper.teams()[0].used.items()) == ((UP, 9000), (DOWN, 18000))
    version = client.CustomObjectsApi(kube_api.admin).get_cluster_custom_object(
        GROUP, VERSION, "egressbudgets", name)["metadata"]["resourceVersion"]
    new_store.step()  # resumed, nothing counted since: what it would write is what it read, so no write
    assert new_store.writes._value.get() == 0 and client.CustomObjectsApi(kube_api.admin).get_cluster_custom_object(
        GROUP, VERSION, "egressbudgets", name)["metadata"]["resourceVersion"] == version
    for _ in range(3):  # the first report a baseline, then replays
        _observe(new_keeper, _report(10_500, 20_500))
    _observe(new_keeper, _report(11_000, 21_000))
    used = new_keeper.teams()[0].used.upload
    assert used == 9500 <= true_up  # lost: the 500 bytes counted after the last write, at most one interval's

    # an outage: the API server's address refuses connections; counting goes on, retried with backoff
    port = free_port()
    down = config.new_client_from_config(config_file=str(kube_api.kubeconfig_through(port, tmp_path / "down")))
    new_store.custom = client.CustomObjectsApi(down)
    new_store.step()
    _observe(new_keeper, _report(12_000, 22_000))
    new_store.step()
    assert new_store.failures == 2 and new_store.backoff() == 2.0
    assert new_store.write_failures.labels("unreachable")._value.get() == 2
    assert events.count((name, "Warning", "QuotaStatusWriteFailed")) == 1  # once per streak
    assert new_keeper.teams()[0].used.upload == 10_500
    new_store.custom = client.CustomObjectsApi(kube_api.admin)  # the API server back
    new_store.step()
    assert new_store.failures == 0 and events[-1] == (name, "Normal", "QuotaStatusWritten")
    assert _status(kube_api, name)["quota"]["teams"][0]["used"] == "10500"

    registry = CollectorRegistry()
    registry.register(QuotaCollector(new_keeper, new_store, lambda: True))
    labels = {"team": "research", "direction": "egress"}
    assert registry.get_sample_value("netagent_team_quota_bytes", labels) == 10**9
    assert registry.get_sample_value("netagent_team_quota_used_bytes", labels) == 10_500
    assert registry.get_sample_value("netagent_team_quota_exhausted", labels) == 0
    assert registry.get_sample_value("netagent_team_quota_period_start_seconds", labels) == start.timestamp()
    assert registry.get_sample_value("netagent_controller_quota_status_last_write_timestamp_seconds") > 0
    follower = CollectorRegistry()
    follower.register(QuotaCollector(new_keeper, new_store, lambda: False))
    assert follower.get_sample_value("netagent_team_quota_used_bytes", labels) is None


def test_the_round_figures_written_by_the_same_process_are_no_conflict(kube_api, budget):
    """The controller writes one EgressBudget's status from two threads: the round's figures (StatusWriter) and
    the quotas' use. The status writer hands its new resourceVersion to the quota store (as controller/app.py
    wires them), so the store's next write is one PATCH; before, each met the other's write as a 409 and wrote
    again after a GET (a conflict counted at every write, three requests for one)."""
    name = budget["metadata"]["name"]
    keeper = _keeper(budget)
    store = _store(kube_api.admin, keeper, [])
    writer = StatusWriter(kube_api.admin, on_version=store.observed)
    store.step()  # resume
    _observe(keeper, _report(1000))
    _observe(keeper, _report(4000))
    store.step()
    assert store.writes._value.get() == 1
    for used in (1_000_000, 2_000_000):
        assert writer.write(Summary(name, 1e9, used, used, used, 1, 1, False), time.time())
        _observe(keeper, _report(4000 + used))
        store.step()
    assert store.writes._value.get() == 3
    assert store.write_failures.labels("conflict")._value.get() == 0 and store.failures == 0
    status = _status(kube_api, name)
    assert status["quota"]["teams"][0]["used"] == str(3000 + 2_000_000) and status["pods"] == 1  # both writers' fields


def test_a_follower_counts_nothing_and_a_missing_budget_resumes_from_nothing(kube_api, budget):
    keeper = _keeper(budget)
    events: list = []
    store = QuotaStore(kube_api.admin, keeper, leading=lambda: False, registry=CollectorRegistry(),
                       event=lambda *a: events.append(a))
    store.step()
    _observe(keeper, _report(1000))
    _observe(keeper, _report(2000))
    assert not keeper.active and keeper.teams()[0].used.upload == 0
    gone = {**budget, "metadata": {"name": "no-such-budget"}}
    other = _keeper(gone)
    QuotaStore(kube_api.admin, other, registry=CollectorRegistry()).step()
    assert other.active and other.teams()[0].used.upload == 0 and not events
