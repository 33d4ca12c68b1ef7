"""The agent's Kubernetes source follows the NetworkScopes object `cluster` and its own Node's zone label
on a real kube-apiserver (issue 39): both arrive in its snapshot, a relabelled Node and a deleted object
follow. The CRD from deploy/crds; the cluster-scoped objects it creates are removed even on failure."""
from __future__ import annotations

import threading
import time
import uuid

from kubernetes import client

from netagent.sources import KubeSource
from tests.kube import REPO

ZONE = "topology.kubernetes.io/zone"


def wait_for(source: KubeSource, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if source.synced():
            snap = source.snapshot()
            if check(snap):
                return snap
        time.sleep(0.1)
    raise AssertionError(f"the source never showed it: {source.snapshot()}")


def test_the_source_reads_the_cluster_scopes_and_its_own_nodes_zone(kube_api):
    kube_api.kubectl("apply", "-f", str(REPO / "deploy" / "crds" / "networkscopes.yaml"))
    kube_api.kubectl("wait", "--for=condition=Established", "crd/networkscopes.netagent.io")
    core, custom = client.CoreV1Api(kube_api.admin), client.CustomObjectsApi(kube_api.admin)
    node, other = f"scopes-{uuid.uuid4().hex[:8]}", f"scopes-other-{uuid.uuid4().hex[:8]}"
    for name, zone in ((node, "a"), (other, "b")):
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels={ZONE: zone})))
    scopes = {"apiVersion": "netagent.io/v1alpha1", "kind": "NetworkScopes", "metadata": {"name": "cluster"},
              "spec": {"zones": [{"name": "a", "cidrs": ["10.1.0.0/16"]}, {"name": "b", "cidrs": ["10.2.0.0/16"]}]}}
    source = KubeSource(kube_api.admin, node)
    thread = threading.Thread(target=source.run, args=(lambda snap: None,), daemon=True)
    try:
        custom.create_cluster_custom_object("netagent.io", "v1alpha1", "networkscopes", scopes)
        thread.start()
        snap = wait_for(source, lambda s: s.network_scopes is not None and s.node_zone == "a")
        assert snap.network_scopes["spec"] == scopes["spec"]
        # its Node relabelled: the new zone; then the object deleted: no description
        core.patch_node(node, {"metadata": {"labels": {ZONE: "b"}}})
        wait_for(source, lambda s: s.node_zone == "b")
        custom.delete_cluster_custom_object("netagent.io", "v1alpha1", "networkscopes", "cluster")
        wait_for(source, lambda s: s.network_scopes is None and s.node_zone == "b")
    finally:
        source.stop()
        thread.join(timeout=10)
        for name in (node, other):
            core.delete_node(name)
        try:
            custom.delete_cluster_custom_object("netagent.io", "v1alpha1", "networkscopes", "cluster")
        except client.ApiException as exc:
            if exc.status != 404:
                raise
