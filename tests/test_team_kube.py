"""A namespace's labels decide its pods' team, on the agent and on the controller alike, against the real
kube-apiserver (issue 33 item 2; root, runs in CI with the kube assets).

The real agent (lab node, the ClusterRole of deploy/) and the real controller (`--no-auth`: tokens are
tests/test_controller_kube.py's matter) watch the same apiserver. A label added to a running pod's
namespace moves the pod into the team its namespaceSelector names, on both, from the watch event (the
agent's periodic resync is set far beyond the test); a Namespace removed under its running pods (deleted,
its finalizer forced, as `kubectl replace --raw .../finalize` does) is said and counted, its pods resolve by
the namespace's name alone on both sides, and the neighbour in another namespace keeps what it had.
"""
from __future__ import annotations

import contextlib
import time
import urllib.request

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from lab.agentproc import wait_for
from lab.netns import require_root
from lab.topology import Lab
from tests.test_agent_kube import ceil_of, install_crds, make_pod, minor_of, rbac_agent
from tests.test_controller_kube import controller, post, workload

pytestmark = [pytest.mark.root]

M = 1_000_000
GROUP, VERSION = "netagent.io", "v1alpha1"
TEAM_LABEL = "netagent.io/team"


@pytest.fixture(scope="module")
def lab():
    require_root()
    with Lab(nodes=1, pods_per_node=2) as lab:
        yield lab


def answered(base: str, node: str, namespace: str, name: str) -> tuple[str, str] | None:
    """The controller's (team, class) for the pod in its answer to a report naming it (None: no round yet)."""
    code, answer = post(base, node, [workload(namespace, name)], None)
    assert code == 200, answer
    got = [(p["team"], p["egress_class"]) for p in answer.get("pods") or [] if p["name"] == name]
    return got[0] if got else None


@pytest.fixture
def research(kube_api, kube_namespace):
    """An EgressClass `<ns>-bulk` (max 400M) and the EgressBudget `default` whose team research takes the
    namespaces labelled netagent.io/team=research-<ns> (default class bulk); a namespace `<ns>-lab-...` for the
    research pod. Yields (namespace, bulk, label value); all of it gone after, the namespace's pod too."""
    ns = kube_namespace
    bulk, value = f"{ns}-bulk", f"research-{ns}"
    core, custom = client.CoreV1Api(kube_api.admin), client.CustomObjectsApi(kube_api.admin)
    install_crds(kube_api)
    objects = (("egressclasses", {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EgressClass", "metadata": {"name": bulk},
                                  "spec": {"weight": 4, "max": "400M"}}),
               ("egressbudgets", {"apiVersion": f"{GROUP}/{VERSION}", "kind": "EgressBudget",
                                  "metadata": {"name": "default"},
                                  "spec": {"total": "1G", "teams": [
                                      {"name": "research", "defaultClass": bulk,
                                       "namespaceSelector": {"matchLabels": {TEAM_LABEL: value}}}]}}))
    labelled = None
    try:
        for plural, obj in objects:
            with contextlib.suppress(ApiException):
                custom.delete_cluster_custom_object(GROUP, VERSION, plural, obj["metadata"]["name"])
            custom.create_cluster_custom_object(GROUP, VERSION, plural, obj)
        labelled = kube_api.create_namespace(f"{ns}-lab-")  # with its default ServiceAccount
        yield labelled, bulk, value
    finally:
        if labelled:
            with contextlib.suppress(ApiException):
                core.delete_namespaced_pod("trainer", labelled, grace_period_seconds=0)
            with contextlib.suppress(ApiException):
                core.delete_namespace(labelled)
            with contextlib.suppress(ApiException):
                core.replace_namespace_finalize(labelled, {"metadata": {"name": labelled},
                                                           "spec": {"finalizers": []}})
        for plural, obj in objects:
            with contextlib.suppress(ApiException):
                custom.delete_cluster_custom_object(GROUP, VERSION, plural, obj["metadata"]["name"])


def controller_metric(base: str, name: str) -> float:
    """The controller's sample `name` (its /metrics is open: `controller` starts it with --metrics-auth false)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name) and line[len(name)] in "{ ")


def test_a_namespace_label_change_and_a_namespace_gone_move_the_team_on_both_sides(
        kube_api, kube_namespace, lab, research, tmp_path):
    ns, node = kube_namespace, lab.nodes[0]
    mine, other = node.pods
    labelled, bulk, value = research
    node_name = f"{ns}-node0"
    core = client.CoreV1Api(kube_api.admin)
    with rbac_agent(kube_api, ns, lab, node, tmp_path, 9582, node_name) as agent, \
            controller(kube_api, tmp_path, ns, "--no-auth") as (_, base, ctl_log):
        agent.resync = 3600  # every change below must come from a watch event
        make_pod(core, labelled, "trainer", node_name, mine)
        make_pod(core, ns, "neighbour", node_name, other)
        agent.start()
        agent.wait_ready(60)

        def agent_sees(name: str):
            p = agent.pod(name)
            return (p["team"], p["egress_class"]) if p else None

        wait_for(lambda: agent_sees("trainer") == ("default", "default"), 30, what="the pod in the default team")
        neighbour = wait_for(lambda: agent_sees("neighbour"), 30, what="the neighbour")
        assert wait_for(lambda: answered(base, node_name, labelled, "trainer"), 30) == ("default", "default")

        # the label arrives: the pod's team follows, on the agent (the kernel too) and on the controller
        syncs = agent.metric("netagent_reconcile_duration_seconds_count")
        t0 = time.monotonic()
        core.patch_namespace(labelled, {"metadata": {"labels": {TEAM_LABEL: value}}})
        wait_for(lambda: agent_sees("trainer") == ("research", bulk), 30, 0.02, "the agent to follow the label")
        agent_s = time.monotonic() - t0
        wait_for(lambda: answered(base, node_name, labelled, "trainer") == ("research", bulk), 30, 0.02,
                 "the controller to follow the label")
        controller_s = time.monotonic() - t0
        print(f"team followed the label: agent {agent_s:.2f} s, controller {controller_s:.2f} s (upper bounds: "
              f"polled)")
        wait_for(lambda: ceil_of(node.netns, minor_of(mine)) == 400 * M, 30, what="the bulk class's cap")
        assert agent.metric("netagent_reconcile_duration_seconds_count") - syncs <= 5  # event-driven, no resync
        # the neighbour keeps its team and class (its share of the node moves with the trainer's cap: local mode)
        assert agent_sees("neighbour") == neighbour and ceil_of(node.netns, minor_of(other)) is not None

        # the Namespace removed under its running pod: said, counted; the pod resolves by the name alone
        assert agent.metric("netagent_namespaces_missing_total") == 0
        core.delete_namespace(labelled)
        core.replace_namespace_finalize(labelled, {"metadata": {"name": labelled}, "spec": {"finalizers": []}})
        wait_for(lambda: not core.list_namespace(field_selector=f"metadata.name={labelled}").items, 30,
                 what="the namespace gone")
        wait_for(lambda: agent.metric("netagent_namespaces_missing_total") == 1, 30, what="counted")
        assert f"namespace {labelled} is gone while 1 pod(s) of this node run in it" in agent.log()
        wait_for(lambda: agent_sees("trainer") == ("default", "default"), 30, what="the agent by the name alone")
        wait_for(lambda: answered(base, node_name, labelled, "trainer") == ("default", "default"), 30,
                 what="the controller alike")
        assert controller_metric(base, "netagent_controller_namespaces_missing_total") == 1
        assert f"namespace {labelled} is gone while 1 pod(s) are still in it" in ctl_log.read_text()
        assert agent_sees("neighbour") == neighbour and ceil_of(node.netns, minor_of(other)) is not None
        assert agent.wait_ready(5) and agent.metric("netagent_reconcile_errors_total") == 0
        assert "Forbidden" not in agent.log() and "API error 403" not in agent.log()


def test_an_agent_without_the_namespaces_grant_runs_and_resolves_by_the_name_alone(
        kube_api, kube_namespace, lab, research, tmp_path):
    """An older chart's ClusterRole (no namespaces): the agent says so once, becomes ready and resolves a
    labelled namespace's pod by the namespace's name alone (as before the watch), nothing else failing."""
    ns, node = kube_namespace, lab.nodes[0]
    mine = node.pods[0]
    labelled, _, value = research
    core = client.CoreV1Api(kube_api.admin)
    core.patch_namespace(labelled, {"metadata": {"labels": {TEAM_LABEL: value}}})
    with rbac_agent(kube_api, ns, lab, node, tmp_path, 9583, f"{ns}-node0", without=("namespaces",)) as agent:
        make_pod(core, labelled, "trainer", f"{ns}-node0", mine)
        agent.start()
        agent.wait_ready(60)
        p = wait_for(lambda: agent.pod("trainer"), 30, what="the pod")
        assert (p["team"], p["egress_class"]) == ("default", "default")
        assert ceil_of(node.netns, minor_of(mine)) is not None
        log = agent.log()
        assert log.count("namespaces: the resource type may not be read (403)") == 1, log
        assert "list/watch on namespaces in the agent's ClusterRole" in log
