"""The controller reads the NetworkScopes object through its watched caches (controller/sources.py
ClusterCaches, the reflector machinery) against the real kube-apiserver (tests/kube.py): created, its
prices are in force; changed to a description only the parser refuses (an unknown currency code of the
right shape), the last valid prices stay in force and the problem is counted; deleted, no prices. A controller
process that leads tells a refused description with a Warning Event on the object."""
from __future__ import annotations

import copy
import time

from kubernetes import client

from controller.cost import CostKeeper
from controller.sources import ClusterCaches
from lab.procs import wait_for
from tests.test_agent_kube import install_crds
from tests.test_controller_kube import budget, controller, crds, leading  # noqa: F401 (fixtures)
from tests.test_scopes import EXAMPLE

GROUP, VERSION, PLURAL = "netagent.io", "v1alpha1", "networkscopes"


def test_the_controller_follows_the_networkscopes_object_and_keeps_the_last_valid(kube_api):
    install_crds(kube_api)
    objects = client.CustomObjectsApi(kube_api.admin)
    keeper = CostKeeper()
    caches = ClusterCaches(kube_api.admin, on_scopes=keeper.set_scopes)
    caches.start()
    try:
        objects.create_cluster_custom_object(GROUP, VERSION, PLURAL, copy.deepcopy(EXAMPLE))
        wait_for(lambda: keeper.prices is not None, timeout=30)
        assert keeper.prices is not None and keeper.prices.currency == "USD" and keeper.problems == []
        bad = copy.deepcopy(EXAMPLE["spec"])
        bad["prices"]["currency"] = "XXY"  # 3 capital letters (the schema's shape), not an ISO 4217 code
        objects.patch_cluster_custom_object(GROUP, VERSION, PLURAL, "cluster", {"spec": bad})
        wait_for(lambda: keeper.problems, timeout=30)
        assert any("spec.prices.currency" in p for p in keeper.problems), keeper.problems
        assert keeper.prices is not None and keeper.prices.currency == "USD"  # the last valid, in force
        objects.delete_cluster_custom_object(GROUP, VERSION, PLURAL, "cluster")
        wait_for(lambda: keeper.prices is None, timeout=30)
    finally:
        caches.stop()
        kube_api.kubectl("delete", "networkscopes", "--all", "--ignore-not-found", check=False)


def test_a_refused_description_is_told_with_an_event_on_the_object(kube_api, budget, kube_namespace, tmp_path):
    install_crds(kube_api)
    objects = client.CustomObjectsApi(kube_api.admin)
    bad = copy.deepcopy(EXAMPLE)
    bad["spec"]["prices"]["currency"] = "XXY"  # of the schema's shape, refused by the parser
    objects.create_cluster_custom_object(GROUP, VERSION, PLURAL, bad)
    try:
        with controller(kube_api, tmp_path, kube_namespace, "--no-auth") as (_, base, log_path):
            wait_for(lambda: leading(base), timeout=30)

            def told():
                events = client.CoreV1Api(kube_api.admin).list_namespaced_event(
                    "default", field_selector="involvedObject.name=cluster,involvedObject.kind=NetworkScopes").items
                return [e for e in events if e.reason == "NetworkScopesInvalid"]

            found = wait_for(told, timeout=30)
            assert "spec.prices.currency" in found[0].message and found[0].type == "Warning", found[0].message
            time.sleep(2)  # once per set of problems, not at every resync
            assert len(told()) == 1
    finally:
        objects.delete_cluster_custom_object(GROUP, VERSION, PLURAL, "cluster")
        client.CoreV1Api(kube_api.admin).delete_collection_namespaced_event(
            "default", field_selector="involvedObject.kind=NetworkScopes")
