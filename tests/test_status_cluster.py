"""`netagent status --kubeconfig` (and `kubectl netagent status`): the cluster view.

The pure part (cli/clusterview.py) from hand-made snapshots; the I/O part (cli/cluster.py) as a
process against the real kube-apiserver of tests/kube.py, with the real controller of
tests/test_controller_kube.py and agents' reports posted as its tests post them (no agent
process: a node-local agent needs a network namespace and root, and this view only reads what
agents leave in the API server and the controller). Bad input: a namespace without netagent, a
Lease naming a controller nobody serves, a user RBAC denies.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cli import clusterview
from controller.allocator import RoundResult, Summary, TeamTotals
from controller.state import ControllerState
from controller.view import cluster_view
from core.wire import NodeReport, PodAllocation, PodReport
from tests.test_controller_kube import (  # noqa: F401 (fixtures)
    budget,
    controller,
    crds,
    leading,
    nodes_and_pods,
    post,
    workload,
)
from tests.kube import CONTROL_PLANE_BINARIES, ControlPlane, require_assets
from tests.test_controller_service import free_port, wait_for

REPO = Path(__file__).resolve().parent.parent
LEASE = ("--lease-name", "netagent-controller-test")  # the name tests/test_controller_kube.py's controllers use
AGENT_LABELS = {"app.kubernetes.io/part-of": "netagent", "app.kubernetes.io/component": "agent"}


# -- pure: snapshot -> view -> text ---------------------------------------------------------------

def snapshot(**over) -> dict:
    snap = {
        "schema": "netagent.io/status-snapshot/v1", "context": "lab", "server": "https://127.0.0.1:6443",
        "namespace": "netagent-system", "read_at": "2026-11-28T04:00:00Z", "problems": [], "crds_installed": True,
        "budgets": [{"name": "default", "spec": {"total": "100M", "ingressTotal": "50M", "teams": [{"name": "web"}]},
                     "status": {"allocated": "70M", "demand": "90M", "used": "60M", "ingressAllocated": "50M",
                                "ingressDemand": "80M", "ingressUsed": "6M", "pods": 3, "nodes": 3,
                                "teamsBelowGuarantee": ["web"], "lastComputed": "2026-11-28T03:59:59Z",
                                "conditions": [{"type": "Oversubscribed", "status": "True"},
                                               {"type": "IngressOversubscribed", "status": "False"}]}}],
        "classes": [{"name": "bulk", "spec": {"weight": 1, "max": "80M"}}],
        "agents": [{"name": "agent-a", "node": "n-a", "phase": "Running", "ready": True, "restarts": 0, "deleting": False},
                   {"name": "agent-b", "node": "n-b", "phase": "Running", "ready": True, "restarts": 0, "deleting": False},
                   {"name": "agent-c", "node": "n-c", "phase": "Running", "ready": True, "restarts": 0, "deleting": False},
                   {"name": "agent-d", "node": "n-d", "phase": "Pending", "ready": False, "restarts": 4, "deleting": False}],
        "controllers": [{"name": "ctl-0", "node": "n-a", "phase": "Running", "ready": True, "restarts": 0,
                         "deleting": False}],
        "lease": {"name": "netagent-controller", "holder": "ctl-0@10.0.0.5:8443", "renew_time": "2026-11-28T03:59:58Z",
                  "duration_seconds": 15, "transitions": 1},
        "events": [{"namespace": "web", "object": "Pod/w-1", "reason": "RefusedPodNotOnNode", "message": "refused",
                    "count": 2, "last": "2026-11-28T03:59:00Z"}],
        "controller": {"url": "https://10.0.0.5:8443", "source": "lease", "readyz": "leader, round 7", "ready": True,
                       "error": None, "ca_note": None, "view": {
                           "leader": True, "ready": True, "why": "leader, round 7", "lease_seconds": 30,
                           "report_ttl_seconds": 60, "nodes": {"n-a": 1.0, "n-b": 45.0}, "generation": 7,
                           "uploads": {"budget_bps": 100e6, "allocated_bps": 70e6, "demand_bps": 90e6,
                                       "used_bps": 60e6, "pods": 3, "nodes": 2, "oversubscribed": True,
                                       "held_back_bps": 0.0,
                                       "teams": [{"team": "web", "allocated_bps": 40e6, "demand_bps": 60e6,
                                                  "used_bps": 40e6, "guarantee_bps": 150e6, "guarantee_unmet": True,
                                                  "pods": 2}]},
                           "downloads": None,
                           "top_pods": [{"namespace": "web", "name": "w-1", "node": "n-a", "team": "web",
                                         "class": "bulk", "used_bps": 30e6, "allocation_bps": 20e6, "limit_bps": 25e6,
                                         "download_used_bps": 0.0, "download_allocation_bps": None}]}},
    }
    snap.update(over)
    return snap


def test_the_view_names_every_agent_state_the_budget_teams_and_pods():
    v = clusterview.view(snapshot())
    assert (v["schema"], v["verdict"], v["exit_code"]) == ("netagent.io/status/v1", "degraded", 1)
    a = v["agents"]
    assert (a["pods"], a["ready"], a["reporting"]) == (4, 3, 1)
    assert [x["pod"] for x in a["unready"]] == ["agent-d"]
    assert a["fail_static"] == [{"pod": "agent-b", "node": "n-b", "last_report_seconds": 45.0, "lease_seconds": 30}]
    assert a["not_reporting"] == [{"pod": "agent-c", "node": "n-c"}]
    b = v["budgets"][0]
    assert b["uploads"] == {"total": "100M", "allocated": "70M", "demand": "90M", "used": "60M", "oversubscribed": True}
    assert b["downloads"]["oversubscribed"] is False and b["teams_below_guarantee"] == ["web"]
    assert v["teams"]["uploads"][0]["share"] == pytest.approx(0.4) and v["teams"]["downloads"] == []
    assert v["controller"]["leader"] == "ctl-0@10.0.0.5:8443" and v["controller"]["pods"] == {"total": 1, "ready": 1}
    text = clusterview.render(v)
    for line in ("leader ctl-0@10.0.0.5:8443", "4 pods, 3 ready, 1 reporting to the controller",
                 "fail-static: agent-b on node n-b (last report 45 s ago, lease 30 s: on the safe floor)",
                 "unready: agent-d on node n-d (phase Pending, 4 restarts)", "not reporting: agent-c on node n-c",
                 "below their guarantee: web", "150M UNMET", "web/w-1", "RefusedPodNotOnNode (x2)",
                 "DEGRADED (exit 1)"):
        assert line in text, (line, text)
    assert json.loads(json.dumps(v)) == v  # -o json is this dict


def test_healthy_is_exit_0_and_the_view_is_json_stable():
    snap = snapshot()
    snap["agents"] = snap["agents"][:1]
    v = clusterview.view(snap)
    assert (v["verdict"], v["exit_code"], v["problems"]) == ("ok", 0, [])
    assert set(v) == {"schema", "context", "server", "namespace", "read_at", "installed", "budgets", "classes",
                      "controller", "teams", "top_pods", "quotas", "costs", "agents", "events", "problems", "verdict",
                      "exit_code"}
    assert "OK (exit 0)" in clusterview.render(v)


def test_not_installed_forbidden_and_unreachable_say_which():
    v = clusterview.view(snapshot(crds_installed=False, budgets=[], problems=[
        {"kind": "NotFound", "message": "404", "resource": "egressbudgets.netagent.io"}]))
    assert (v["verdict"], v["exit_code"]) == ("not-installed", 2)
    assert "netagent is not installed in this cluster" in clusterview.render(v)
    v = clusterview.view(snapshot(lease=None, agents=[], controllers=[], controller={}))
    assert (v["verdict"], v["exit_code"]) == ("not-installed", 2)
    assert "not installed in namespace netagent-system" in clusterview.render(v)
    denied = {"kind": "Forbidden", "verb": "list", "resource": "egressbudgets.netagent.io", "scope": "cluster scope",
              "message": 'User "u" cannot list resource "egressbudgets"'}
    v = clusterview.view(snapshot(problems=[denied]))
    assert (v["verdict"], v["exit_code"]) == ("forbidden", 3)
    snap = snapshot(controller={"url": "https://10.0.0.5:8443", "readyz": None, "ready": None, "view": None,
                                "error": "controller unreachable at https://10.0.0.5:8443: timed out"})
    v = clusterview.view(snap)
    assert (v["verdict"], v["exit_code"]) == ("degraded", 1)
    text = clusterview.render(v)
    assert "UNREACHABLE: controller unreachable at https://10.0.0.5:8443" in text and "100M" in text
    assert v["agents"]["reporting"] is None  # unknown without the controller, not "0 reporting"
    v = clusterview.view({"context": "x", "server": "https://127.0.0.1:1", "namespace": "n", "crds_installed": True,
                          "problems": [{"kind": "ApiServerUnreachable", "message": "list egressbudgets: refused"}]})
    assert (v["installed"], v["verdict"], v["exit_code"]) == (None, "degraded", 1)  # unknown, not "not installed"
    assert "ApiServerUnreachable: list egressbudgets: refused" in clusterview.render(v)
    v = clusterview.view(snapshot(lease={**snapshot()["lease"], "renew_time": "2026-11-28T03:50:00Z"}))
    assert "no controller leads: the Lease netagent-controller expired 585 s ago" in clusterview.render(v)


def test_the_controllers_view_ranks_pods_by_use_and_ages_each_nodes_report():
    """controller/view.py over a real ControllerState and a round of its own (no allocator: the
    view only reads what a round left)."""
    def allocate(reports):
        by_node = {n: [PodAllocation(p.namespace, p.name, "web", "bulk", 10e6, 20e6) for p in r.pods]
                   for n, r in reports.items()}
        summary = Summary("default", 100e6, 30e6, 40e6, 9e6, 3, 2, False,
                          teams={"web": TeamTotals(30e6, 40e6, 9e6, 3, 5e6, False)})
        return RoundResult(by_node, {n: 50e6 for n in reports}, 1e6, summary)

    state = ControllerState(allocate, lease_seconds=30)
    state.submit(None, NodeReport("n-a", [PodReport("web", "small", 1e6, 2e6), PodReport("web", "big", 6e6, 9e6)]))
    state.submit(None, NodeReport("n-b", [PodReport("web", "mid", 2e6, 3e6, ingress_usage_bps=1e6)]))
    state.run_round()
    now = max(t for t, _ in state.latest.values()) + 40
    v = cluster_view(state, top=2, now=now)
    assert [p["name"] for p in v["top_pods"]] == ["big", "mid"]  # by use, both directions
    assert v["top_pods"][1] == {"namespace": "web", "name": "mid", "node": "n-b", "team": "web", "class": "bulk",
                                "used_bps": 2e6, "allocation_bps": 10e6, "limit_bps": 20e6,
                                "download_used_bps": 1e6, "download_allocation_bps": None}
    assert set(v["nodes"]) == {"n-a", "n-b"} and min(v["nodes"].values()) >= 40  # older than the 30 s lease
    assert v["uploads"]["teams"] == [{"team": "web", "allocated_bps": 30e6, "demand_bps": 40e6, "used_bps": 9e6,
                                      "guarantee_bps": 5e6, "guarantee_unmet": False, "pods": 3}]
    assert (v["downloads"], v["generation"], v["lease_seconds"]) == (None, 1, 30)
    assert json.loads(json.dumps(v)) == v


# -- against the real API server and controller -----------------------------------------------------

def run_status(kubeconfig: Path, namespace: str, *extra: str, kubectl: Path | None = None) -> subprocess.CompletedProcess:
    """`netagent status --kubeconfig ...`, or with `kubectl` the real kubectl running its plugin:
    `kubectl netagent status ...` finds kubectl-netagent (pip installed it beside `netagent`) on PATH."""
    env = dict(os.environ)
    if kubectl is not None:
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        assert shutil.which("kubectl-netagent", path=env["PATH"]), "kubectl-netagent is not installed: pip install -e ."
        argv = [str(kubectl), "netagent", "status"]
    else:
        argv = [sys.executable, "-m", "netagent", "status"]
    return subprocess.run([*argv, "--kubeconfig", str(kubeconfig), "-n", namespace, *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def agent_pod(core, namespace: str, name: str, node: str, ready: bool) -> None:
    """An agent pod as the DaemonSet makes it (its labels) with the status a kubelet would write."""
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": AGENT_LABELS},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "x.invalid/netagent:1"}]}})
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    core.patch_namespaced_pod_status(name, namespace, {"status": {
        "phase": "Running" if ready else "Pending",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}]}})


@contextlib.contextmanager
def agent_reporting(base: str, node: str, pods: list[dict]):
    """Node `node`'s agent reporting every 0.5 s, as a running agent does (the view runs for seconds)."""
    stop = threading.Event()

    def loop():
        while not stop.wait(0.5):
            with contextlib.suppress(OSError):
                post(base, node, pods, None)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def test_cluster_view_against_the_real_apiserver_and_controller(kube_api, budget, nodes_and_pods, tmp_path):
    namespace, nodes = nodes_and_pods
    core = client.CoreV1Api(kube_api.admin)
    node_c = f"ctl-c-{uuid.uuid4().hex[:6]}"
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node_c)))
    try:
        agent_pod(core, namespace, "netagent-agent-a", nodes["a"], ready=True)
        with contextlib.ExitStack() as stack:
            _, base, _ = stack.enter_context(controller(
                kube_api, tmp_path, namespace, "--no-auth", "--status-interval", "1", "--lease-seconds", "3",
                "--agent-service-account", f"{namespace}:agent"))
            wait_for(lambda: leading(base), what="the only replica to lead")

            def reported():
                code, answer = post(base, nodes["a"], [workload(namespace, "work-a", 40e6)], None)
                st = client.CustomObjectsApi(kube_api.admin).get_cluster_custom_object(
                    "netagent.io", "v1alpha1", "egressbudgets", "default").get("status") or {}
                return code == 200 and answer["generation"] > 0 and st.get("pods") == 1

            wait_for(reported, timeout=30, what="a round and the budget status")
            reporter = agent_reporting(base, nodes["a"], [workload(namespace, "work-a", 40e6)])
            stack.enter_context(reporter)
            healthy = run_status(kube_api.kubeconfig, namespace, "-o", "json", *LEASE)
            v = json.loads(healthy.stdout)
            assert (healthy.returncode, v["verdict"]) == (0, "ok"), healthy.stdout + healthy.stderr
            assert v["controller"]["leader"].endswith(base.split("://")[1]) and v["controller"]["ready"]
            assert v["agents"] == {"pods": 1, "ready": 1, "reporting": 1, "unready": [], "fail_static": [],
                                   "not_reporting": []}
            assert v["budgets"][0]["uploads"]["total"] == "100M" and v["budgets"][0]["pods"] == 1
            assert [t["team"] for t in v["teams"]["uploads"]] and v["top_pods"][0]["name"] == "work-a"
            assert v["top_pods"][0]["used_bps"] == pytest.approx(20e6)
            text = run_status(kube_api.kubeconfig, namespace, *LEASE)
            assert text.returncode == 0 and "OK (exit 0)" in text.stdout, text.stdout + text.stderr
            (tmp_path / "healthy.txt").write_text(text.stdout)

            # node b's agent reported once and then went silent (fail-static after its 3 s lease), node
            # c's never did, a third is unready, and a stale report leaves a Warning Event
            agent_pod(core, namespace, "netagent-agent-b", nodes["b"], ready=True)
            agent_pod(core, namespace, "netagent-agent-c", node_c, ready=True)
            agent_pod(core, namespace, "netagent-agent-x", node_c, ready=False)
            assert post(base, nodes["b"], [workload(namespace, "work-b", 10e6)], None)[0] == 200
            post(base, nodes["a"], [workload(namespace, "work-a", 40e6), workload(namespace, "work-b")], None)

            def degraded():
                out = run_status(kube_api.kubeconfig, namespace, "-o", "json", *LEASE)
                v = json.loads(out.stdout)
                return (out.returncode == 1 and v["agents"]["fail_static"] and v["events"] and (out, v))

            out, v = wait_for(degraded, timeout=60, what="node b's agent fail-static and the Event in the view")
            a = v["agents"]
            assert [x["pod"] for x in a["fail_static"]] == ["netagent-agent-b"]
            assert a["not_reporting"] == [{"pod": "netagent-agent-c", "node": node_c}]
            assert [x["pod"] for x in a["unready"]] == ["netagent-agent-x"]
            assert v["events"][0]["reason"] == "RefusedPodNotOnNode"
            text = run_status(kube_api.kubeconfig, namespace, *LEASE, kubectl=kube_api.assets / "kubectl")
            assert text.returncode == 1 and "fail-static: netagent-agent-b" in text.stdout, text.stdout + text.stderr
            (tmp_path / "degraded.txt").write_text(text.stdout)
            if os.environ.get("NETAGENT_STATUS_CAPTURE"):  # docs/operations.md shows these two, captured here
                Path(os.environ["NETAGENT_STATUS_CAPTURE"]).write_text(
                    (tmp_path / "healthy.txt").read_text() + "\n----\n" + text.stdout)
    finally:
        core.delete_node(node_c)


def test_a_namespace_without_netagent_is_not_installed(crds, kube_namespace):
    out = run_status(crds.kubeconfig, kube_namespace)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"netagent is not installed in namespace {kube_namespace}" in out.stdout


def test_a_controller_nobody_serves_is_unreachable_and_the_api_servers_view_still_prints(
        kube_api, budget, kube_namespace):
    core = client.CoreV1Api(kube_api.admin)
    agent_pod(core, kube_namespace, "netagent-agent-a", "no-such-node", ready=True)
    port = free_port()  # bound and released: nothing listens there
    client.CoordinationV1Api(kube_api.admin).create_namespaced_lease(kube_namespace, {
        "metadata": {"name": "netagent-controller"},
        "spec": {"holderIdentity": f"gone@127.0.0.1:{port}", "leaseDurationSeconds": 3600,
                 "renewTime": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}})
    out = run_status(kube_api.kubeconfig, kube_namespace)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"ControllerUnreachable: controller unreachable at http://127.0.0.1:{port}" in out.stdout
    assert "100M" in out.stdout and "1 pods, 1 ready, ? reporting" in out.stdout  # what the API server holds


def test_rbac_that_denies_the_view_names_the_verb_and_resource(crds, kube_namespace):
    core = client.CoreV1Api(crds.admin)
    core.create_namespaced_service_account(kube_namespace, client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name="nobody")))
    token = core.create_namespaced_service_account_token("nobody", kube_namespace, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(expiration_seconds=600))).status.token
    out = run_status(crds.kubeconfig_for_token(token), kube_namespace, "-o", "json")
    assert out.returncode == 3, out.stdout + out.stderr
    v = json.loads(out.stdout)
    denied = {(p["verb"], p["resource"]) for p in v["problems"] if p["kind"] == "Forbidden"}
    assert ("list", "egressbudgets.netagent.io") in denied and ("get", "leases.coordination.k8s.io") in denied
    text = run_status(crds.kubeconfig_for_token(token), kube_namespace).stdout
    assert f'system:serviceaccount:{kube_namespace}:nobody" cannot list resource "egressbudgets"' in text


def reader_rbac(kube_api, namespace: str, subject: str) -> list[tuple[str, str]]:
    """docs/examples/status-reader-rbac.yaml as written, moved into `namespace` (its ClusterRole
    suffixed so tests never collide) and bound to ServiceAccount `subject`; returns what to delete."""
    import yaml

    docs = [d for d in yaml.safe_load_all((REPO / "docs/examples/status-reader-rbac.yaml").read_text()) if d]
    cluster_role = f"netagent-status-reader-{namespace}"
    for d in docs:
        if d["kind"] == "ClusterRole":
            d["metadata"]["name"] = cluster_role
        else:
            d["metadata"]["namespace"] = namespace
    sa = [{"kind": "ServiceAccount", "name": subject, "namespace": namespace}]
    docs += [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
              "metadata": {"name": cluster_role}, "subjects": sa,
              "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role}},
             {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
              "metadata": {"name": "netagent-status-reader", "namespace": namespace}, "subjects": sa,
              "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "netagent-status-reader"}}]
    kube_api.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    return [("clusterrole", cluster_role), ("clusterrolebinding", cluster_role)]


def test_a_token_user_with_the_reader_role_sees_everything_over_verified_tls(kube_api, budget, kube_namespace,
                                                                             tmp_path):
    """The controller as the chart runs it (TLS from its Secret, /metrics and /v1/status guarded):
    a token user bound to the documented reader role gets the controller's view over TLS verified
    against the Secret's CA (given with --controller-ca: the role reads no Secret); a user without
    a token (a client certificate, as the harness' admin) is told the controller refused it."""
    namespace = kube_namespace
    core = client.CoreV1Api(kube_api.admin)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="viewer")))
    created = reader_rbac(kube_api, namespace, "viewer")
    try:
        token = core.create_namespaced_service_account_token("viewer", namespace, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(expiration_seconds=600))).status.token
        viewer = kube_api.kubeconfig_for_token(token)
        with controller(kube_api, tmp_path, namespace, "--metrics-auth", "true", "--lease-name", "netagent-controller",
                        "--agent-service-account", f"{namespace}:agent", tls=True) as (_, base, _):
            def leads():
                try:
                    lease = client.CoordinationV1Api(kube_api.admin).read_namespaced_lease("netagent-controller", namespace)
                except ApiException as exc:
                    if exc.status == 404:  # not created yet: the controller's first election call is still to come
                        return False
                    raise
                return base.split("://")[1] in (lease.spec.holder_identity or "")

            wait_for(leads, what="the controller to hold the Lease")
            secret = core.read_namespaced_secret("netagent-controller-tls", namespace)
            ca = tmp_path / "ca.crt"
            ca.write_bytes(__import__("base64").b64decode(secret.data["ca.crt"]))

            out = run_status(viewer, namespace, "-o", "json", "--controller-ca", str(ca))
            v = json.loads(out.stdout)
            assert (out.returncode, v["verdict"]) == (0, "ok"), out.stdout + out.stderr
            assert v["controller"]["url"] == base and v["controller"]["generation"] == 0  # its view, no round yet

            out = run_status(viewer, namespace)  # no CA at hand: no token is sent, and the view says what to pass
            assert out.returncode == 1 and "ControllerUnreachable" in out.stdout and "--controller-ca" in out.stdout, \
                out.stdout + out.stderr

            out = run_status(kube_api.kubeconfig, namespace, "-o", "json")  # admin: reads the CA, has no token
            v = json.loads(out.stdout)
            refused = [p for p in v["problems"] if p["kind"] == "ControllerRefused"]
            assert out.returncode == 1 and refused and "401" in refused[0]["message"], out.stdout + out.stderr
            assert "nonResourceURL /metrics" in refused[0]["message"]
    finally:
        for kind, name in created:
            kube_api.kubectl("delete", kind, name, "--ignore-not-found")


def test_a_cluster_without_the_crds_is_not_installed(tmp_path):
    """A control plane of its own (the shared one keeps the CRDs other tests installed): the API
    server serves no egressbudgets.netagent.io."""
    with ControlPlane(require_assets(CONTROL_PLANE_BINARIES)) as bare:
        out = run_status(bare.kubeconfig, "netagent-system")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "netagent is not installed in this cluster: the API server serves no egressbudgets.netagent.io" in out.stdout
