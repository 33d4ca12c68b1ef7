"""The real node (tests/node/): a kubelet with containerd, runc and the CNI plugins on this
machine runs a pod created through the API, with an address from the CNI that answers from the
host. Missing assets skip, or fail under NETAGENT_REQUIRE_KUBE=1 (CI)."""
from __future__ import annotations

import ipaddress
import subprocess

import pytest

from lab.procs import wait_for

from tests.kube import kube_version
from tests.node import BUSYBOX_IMAGE_NAME, busybox_image

pytestmark = [pytest.mark.kube, pytest.mark.root]


def test_api_pod_runs_on_the_real_node_with_a_cni_address(kube_api, kube_namespace, real_node, tmp_path):
    from kubernetes import client

    core = client.CoreV1Api(kube_api.admin)
    node = core.read_node(real_node.name)
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
    assert node.status.node_info.kubelet_version == kube_version()  # the harness's release
    assert node.status.node_info.container_runtime_version.startswith("containerd://2.")

    real_node.import_image(busybox_image(tmp_path / "busybox.tar"))
    core.create_namespaced_pod(kube_namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
        "spec": {
            "nodeName": real_node.name,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": BUSYBOX_IMAGE_NAME, "imagePullPolicy": "Never",
                            "command": ["sleep", "3600"]}],
        },
    })

    def running():
        pod = core.read_namespaced_pod("sleeper", kube_namespace)
        return pod if pod.status.phase == "Running" and pod.status.pod_ip else None

    pod = wait_for(running, 90, what="the pod to run with an IP")
    ip = ipaddress.ip_address(pod.status.pod_ip)
    assert ip in real_node.pod_cidr
    assert pod.status.container_statuses[0].ready
    # the pod's address is routed to its veth in the host's namespace (ptp: a /32 route per pod)
    route = subprocess.run(["ip", "route", "get", str(ip)], capture_output=True, text=True, check=True).stdout
    assert " dev veth" in route, route
    ping = subprocess.run(["ping", "-c", "2", "-W", "2", str(ip)], capture_output=True, text=True)
    assert ping.returncode == 0, ping.stdout + ping.stderr


def test_daemonset_pod_lands_on_the_real_node_with_its_service_account_token(
        kube_api, kube_cluster, kube_namespace, real_node, tmp_path):
    """The agent's path: the DaemonSet controller and the scheduler put a hostNetwork pod on the
    real node, and the kubelet mounts its projected ServiceAccount token (which needs the
    kube-root-ca.crt ConfigMap kube-controller-manager publishes)."""
    from kubernetes import client

    real_node.import_image(busybox_image(tmp_path / "busybox.tar"))
    labels = {"app": "probe"}
    client.AppsV1Api(kube_api.admin).create_namespaced_daemon_set(kube_namespace, {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "probe"},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "nodeSelector": {"netagent.io/real-node": "true"},
                "hostNetwork": True,
                "terminationGracePeriodSeconds": 1,
                "containers": [{
                    "name": "main", "image": BUSYBOX_IMAGE_NAME, "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "test -s /var/run/secrets/kubernetes.io/serviceaccount/token && sleep 3600"],
                    "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}},
                }],
            }},
        },
    })
    core = client.CoreV1Api(kube_api.admin)

    def ready_pod():
        pods = core.list_namespaced_pod(kube_namespace, label_selector="app=probe").items
        return next((p for p in pods if p.status.phase == "Running"
                     and all(c.ready for c in p.status.container_statuses or [False])), None)

    pod = wait_for(ready_pod, 120, what="the DaemonSet's pod to run on the real node")
    assert pod.spec.node_name == real_node.name
    assert pod.status.pod_ip == real_node.node_ip  # hostNetwork: the node's address
