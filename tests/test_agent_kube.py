"""The real agent against a real kube-apiserver (root; runs in CI with the kube assets).

The agent runs in a lab node's namespace; it reaches the apiserver (on the test's loopback)
through a TCP forwarder whose listening socket lives in that namespace, so no link joins
the namespaces. Kernel state is read with tc over netlink, never through the agent.
"""
from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from lab.kube import SERVICE_CLUSTER_IP_RANGE
from lab.topology import Lab, run
from netagent.desired import DataPathOptions, PodShape, assign_minors, from_wire
from lab.agentproc import AgentProcess, NetnsPortForward, tc_classes, wait_for
from tests.kube import CONTROL_PLANE_BINARIES, REPO, ControlPlane, free_port, require_assets, write_kubeconfig
from lab.netns import require_root

pytestmark = [pytest.mark.root]

M = 1_000_000


@pytest.fixture(scope="module")
def lab():
    require_root()
    with Lab(nodes=1, pods_per_node=2) as lab:
        yield lab


def minor_of(pod) -> int:
    return assign_minors([PodShape("x", (pod.ip4, pod.ip6), 1, 1)])["x"]


def ceil_of(netns: str, minor: int) -> int | None:
    """The class's ceil as the IP rate it stands for (the kernel holds the frame rate)."""
    got = tc_classes(netns).get(minor)
    return from_wire(got[1], DataPathOptions()) if got else None


def make_pod(core, namespace: str, name: str, node: str, lab_pod=None, annotations: dict | None = None) -> None:
    """A pod bound to `node` with the lab pod's IPs in its status (what kubelet and CNI would write)."""
    body = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace, annotations=annotations or {}),
        spec=client.V1PodSpec(node_name=node, containers=[client.V1Container(name="c", image="pause")]))
    core.create_namespaced_pod(namespace, body)
    if lab_pod is not None:
        core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": "Running", "podIP": lab_pod.ip4, "podIPs": [{"ip": lab_pod.ip4}, {"ip": lab_pod.ip6}]}})


def install_crds(api) -> None:
    for f in sorted((REPO / "deploy" / "crds").glob("*.yaml")):
        if f.name != "kustomization.yaml":
            api.kubectl("apply", "-f", str(f))
    api.kubectl("wait", "--for=condition=Established", "crd/egressclasses.netagent.io", "crd/egressbudgets.netagent.io")


def agent_rbac_token(api, namespace: str, without: tuple[str, ...] = ()) -> str:
    """A ServiceAccount in `namespace` bound to exactly the agent's ClusterRole rules from deploy/ (less the
    rules on the resources `without` names: an older chart's role)."""
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "base" / "rbac-agent.yaml").read_text()) if d]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    role["rules"] = [r for r in role["rules"] if not set(r["resources"]) & set(without)]
    name = f"netagent-agent-{namespace}"
    rbac = client.RbacAuthorizationV1Api(api.admin)
    core = client.CoreV1Api(api.admin)
    rbac.create_cluster_role({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                              "metadata": {"name": name}, "rules": role["rules"]})
    rbac.create_cluster_role_binding({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "netagent-agent", "namespace": namespace}]})
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "netagent-agent"}})
    token = core.create_namespaced_service_account_token(
        "netagent-agent", namespace, {"spec": {"expirationSeconds": 3600}})
    return token.status.token


def delete_rbac(api, namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(api.admin)
    name = f"netagent-agent-{namespace}"
    for fn in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
        try:
            fn(name)
        except client.ApiException:
            pass


@contextlib.contextmanager
def rbac_agent(kube_api, namespace: str, lab, node, tmp_path: Path, port: int, node_name: str,
               without: tuple[str, ...] = ()):
    """The agent for `node` (not started yet: a test may make objects first), reaching the apiserver through a
    forwarder in the node's namespace with a token of exactly the agent's ClusterRole from deploy/; after, its
    log printed, and the agent, the forwarder and the RBAC objects gone."""
    forward = NetnsPortForward(node.netns, ("127.0.0.1", int(kube_api.url.rsplit(":", 1)[1])))
    agent = None
    try:
        token = agent_rbac_token(kube_api, namespace, without)
        kubeconfig = write_kubeconfig(tmp_path / "agent.kubeconfig", f"https://127.0.0.1:{forward.port}",
                                      kube_api.ca_file, {"token": token})
        agent = AgentProcess(lab, node, [], port=port, log_dir=tmp_path, node_name=node_name,
                             extra=["--kubeconfig", str(kubeconfig)])
        yield agent
    finally:
        if agent:
            print(agent.log())
            agent.close()
        forward.close()
        delete_rbac(kube_api, namespace)


def test_sees_only_its_node_and_tells_users_about_bad_annotations(kube_api, kube_namespace, lab, tmp_path):
    ns = kube_namespace
    node = lab.nodes[0]
    mine_pod, bad_pod = node.pods
    node_name, elsewhere = f"{ns}-node0", f"{ns}-node1"
    install_crds(kube_api)
    custom = client.CustomObjectsApi(kube_api.admin)
    core = client.CoreV1Api(kube_api.admin)
    silver = f"{ns}-silver"
    custom.create_cluster_custom_object("netagent.io", "v1alpha1", "egressclasses", {
        "apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": silver},
        "spec": {"weight": 2, "max": "60M"}})
    try:
        with rbac_agent(kube_api, ns, lab, node, tmp_path, 9580, node_name) as agent:
            make_pod(core, ns, "mine", node_name, mine_pod, {"netagent.io/egress-class": silver})
            make_pod(core, ns, "bad", node_name, bad_pod, {"netagent.io/egress-class": "platinum"})
            make_pod(core, ns, "other", elsewhere, None, {"netagent.io/egress-class": silver})
            agent.start()
            agent.wait_ready(60)
            wait_for(lambda: ceil_of(node.netns, minor_of(mine_pod)) == 60 * M, 30, what="the pod's class from its EgressClass")
            state = agent.state()
            assert {p["name"] for p in state["pods"]} == {"mine", "bad"}  # never the other node's pod
            assert ceil_of(node.netns, minor_of(bad_pod)) is not None  # shaped in the default class

            def bad_events():
                evs = core.list_namespaced_event(ns, field_selector="involvedObject.name=bad").items
                return [e for e in evs if e.reason == "UnknownEgressClass" and e.source.component == "netagent"]
            events = wait_for(bad_events, 30, 0.2, "an Event about the unknown class")
            assert "platinum" in events[0].message and events[0].type == "Warning"
            # once per change, not per sync: several resyncs later there is still one
            syncs = agent.metric("netagent_reconcile_duration_seconds_count")
            wait_for(lambda: agent.metric("netagent_reconcile_duration_seconds_count") >= syncs + 2, 30, 0.2, "resyncs")
            assert len(bad_events()) == 1
            assert agent.metric("netagent_watch_events_total", 'resource="pods",type="relist"') == 1

            # an annotation edit on the running pod reaches the kernel
            core.patch_namespaced_pod("mine", ns, {"metadata": {"annotations": {"kubernetes.io/egress-bandwidth": "25M"}}})
            wait_for(lambda: ceil_of(node.netns, minor_of(mine_pod)) == 25 * M, 30, what="the bandwidth annotation")
            # the pod goes: its class goes
            core.delete_namespaced_pod("mine", ns, grace_period_seconds=0)
            wait_for(lambda: minor_of(mine_pod) not in tc_classes(node.netns), 30, what="class removed")
            assert "Forbidden" not in agent.log() and "API error 403" not in agent.log()  # not "403": timestamps carry ms
    finally:
        try:
            custom.delete_cluster_custom_object("netagent.io", "v1alpha1", "egressclasses", silver)
        except client.ApiException:
            pass


def test_follows_the_clusters_service_cidrs(kube_api, kube_namespace, lab, tmp_path):
    """No --service-cidr: the agent reads the cluster's ServiceCIDR objects (the apiserver's default one, from
    --service-cluster-ip-range) with the ClusterRole of deploy/, counts them internal, and follows a range
    added and removed while it runs: the internal rules change with them."""
    ns, node = kube_namespace, lab.nodes[0]
    networking = client.NetworkingV1Api(kube_api.admin)
    extra, extra_name = "172.30.0.0/24", f"{ns}-extra"

    def internal_rules() -> str:
        return run("iptables-save -t mangle", node.netns)

    try:
        with rbac_agent(kube_api, ns, lab, node, tmp_path, 9581, f"{ns}-node0") as agent:
            agent.start()
            agent.wait_ready(60)
            assert f"service CIDRs from the cluster's ServiceCIDR objects: {SERVICE_CLUSTER_IP_RANGE}" in agent.log()
            wait_for(lambda: f"-d {SERVICE_CLUSTER_IP_RANGE} " in internal_rules(), 30, what="the service range internal")
            networking.create_service_cidr({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                                            "metadata": {"name": extra_name}, "spec": {"cidrs": [extra]}})
            wait_for(lambda: f"-d {extra} " in internal_rules(), 30, what="an added ServiceCIDR internal")
            networking.delete_service_cidr(extra_name)
            release_finalizer(networking, extra_name)
            wait_for(lambda: f"-d {extra} " not in internal_rules(), 30, what="a removed ServiceCIDR no longer internal")
            assert f"-d {SERVICE_CLUSTER_IP_RANGE} " in internal_rules()
            assert "Forbidden" not in agent.log() and "API error 403" not in agent.log()
    finally:
        try:
            networking.delete_service_cidr(extra_name)
        except client.ApiException:
            pass
        release_finalizer(networking, extra_name)


def release_finalizer(networking, name: str) -> None:
    """A deleted ServiceCIDR waits for the controller manager's finalizer: the shared apiserver may run without
    one (then the test releases it), or with one that already did (then it is gone: 404)."""
    try:
        networking.patch_service_cidr(name, {"metadata": {"finalizers": None}})
    except client.ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def own_control_plane():
    """An apiserver of this test's own: it gets restarted, which the shared one must not be."""
    cp = ControlPlane(require_assets(CONTROL_PLANE_BINARIES), apiserver_port=free_port())
    with cp:
        yield cp


def restart_apiserver(cp: ControlPlane) -> None:
    proc = next(p for p in cp.processes if p.name == "kube-apiserver")
    proc.stop()
    cp.processes.remove(proc)
    cp._start_apiserver()
    cp._wait_ready("kube-apiserver", cp._apiserver_ready)


def test_apiserver_restart_and_410_without_a_gap(own_control_plane, lab, tmp_path):
    cp = own_control_plane
    node = lab.nodes[0]
    pod = node.pods[0]
    minor = minor_of(pod)
    core = client.CoreV1Api(cp.admin)
    ns = f"t-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    core.create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
    make_pod(core, ns, "mine", node.name, pod, {"kubernetes.io/egress-bandwidth": "30M"})
    forward = NetnsPortForward(node.netns, ("127.0.0.1", int(cp.url.rsplit(":", 1)[1])))
    kubeconfig = Path(tmp_path / "agent.kubeconfig")
    kubeconfig.write_text(cp.kubeconfig.read_text().replace(cp.url, f"https://127.0.0.1:{forward.port}"))
    agent = AgentProcess(lab, node, [], port=9581, log_dir=tmp_path, extra=["--kubeconfig", str(kubeconfig)])
    try:
        agent.start()
        agent.wait_ready(60)
        wait_for(lambda: ceil_of(node.netns, minor) == 30 * M, 30, what="the pod's cap in the kernel")
        assert "not installed" in agent.log()  # no CRDs on this apiserver: built-in policy, said once

        # the apiserver goes away; the cluster moves on meanwhile; it comes back with a fresh
        # watch cache that no longer holds the agent's resourceVersion (410 Gone)
        forward.pause()
        core.patch_namespaced_pod("mine", ns, {"metadata": {"annotations": {"kubernetes.io/egress-bandwidth": "40M"}}})
        for i in range(5):
            core.create_namespaced_config_map(ns, {"metadata": {"name": f"churn-{i}"}})
        restart_apiserver(cp)
        assert ceil_of(node.netns, minor) == 30 * M  # enforcement never stopped
        forward.retarget(("127.0.0.1", int(cp.url.rsplit(":", 1)[1])))
        forward.resume()
        seen = []

        def caught_up():
            seen.append(ceil_of(node.netns, minor))
            return seen[-1] == 40 * M
        wait_for(caught_up, 90, 0.1, "the change made during the outage")
        assert set(seen) <= {30 * M, 40 * M}, seen  # no gap: the class was there at every look
        assert agent.metric("netagent_watch_events_total", 'resource="pods",type="gone"') >= 1
        assert agent.metric("netagent_watch_events_total", 'resource="pods",type="relist"') >= 2
        assert agent.alive() and agent.get("/readyz")[0] == 200
    finally:
        print(agent.log())
        agent.close()
        forward.close()
