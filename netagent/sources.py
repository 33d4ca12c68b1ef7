"""The agent's Kubernetes side: where its snapshots come from (this node's pods, the two
cluster-scoped policy kinds and the cluster's ServiceCIDRs) and the Events it writes. In file mode (`core.files.FileSource`)
none of this, and not the kubernetes client, is loaded.

One reflector (list + resumable watch, see reflector.py) per kind; pods filtered
server-side with fieldSelector=spec.nodeName=<node>. No periodic polling, never a
cluster-wide pod list.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from core.kubeapi import GROUP, TIMEOUT, VERSION, load_api_client
from core.objects import (SCOPES_NAME, PodRecord, Snapshot, namespace_labels, node_zone_of, policy_fields,
                          service_cidrs_of)
from core.reflector import Reflector

log = logging.getLogger(__name__)
__all__ = ["KubeSource", "kube_event_emitter", "load_api_client"]


class KubeSource:
    def __init__(self, api: client.ApiClient, node: str, on_metric: Callable[[str, str], None] | None = None):
        if not node:
            raise ValueError("--node is required with Kubernetes (set it from spec.nodeName via the downward API)")
        self.api = api
        self.node = node
        self.stop_event = threading.Event()
        self._changed = threading.Event()
        self._on_change: Callable[[Snapshot], None] | None = None
        self._generation = 0
        metric = on_metric or (lambda resource, kind: None)
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        self.pods = Reflector(
            "pods", core.list_pod_for_all_namespaces, self.stop_event, self._mark,
            lambda k: metric("pods", k), field_selector=f"spec.nodeName={node}",
        )
        self.classes = Reflector(
            "egressclasses", custom.list_cluster_custom_object, self.stop_event, self._mark,
            lambda k: metric("egressclasses", k), optional=True, group=GROUP, version=VERSION, plural="egressclasses",
            transform=policy_fields,
        )
        self.budgets = Reflector(
            "egressbudgets", custom.list_cluster_custom_object, self.stop_event, self._mark,
            lambda k: metric("egressbudgets", k), optional=True, group=GROUP, version=VERSION, plural="egressbudgets",
            transform=policy_fields,  # the controller's status writes are no change for the agent
        )
        # the service ranges (networking.k8s.io/v1, Kubernetes >= 1.33): internal before kube-proxy's DNAT
        # (where the device counter sees a pod's packet); unknown where the API lacks them or RBAC
        # withholds them, and the agent then keeps what it was configured with
        self.services = Reflector(
            "servicecidrs", client.NetworkingV1Api(api).list_service_cidr, self.stop_event, self._mark,
            lambda k: metric("servicecidrs", k), transform=service_cidr_fields, optional=True,
            absent_statuses=(403, 404), absent_hint="Kubernetes >= 1.33 and list/watch on servicecidrs in the "
            "agent's ClusterRole; or give --service-cidr",
        )
        # namespaces' labels: teams chosen by namespaceSelector resolve here with the labels the controller
        # reads (docs/architecture.md, "One team for a pod"); one small watch per node, labels kept, never a poll
        self.namespaces = Reflector(
            "namespaces", core.list_namespace, self.stop_event, self._mark, lambda k: metric("namespaces", k),
            key=namespace_name, transform=namespace_labels, optional=True, absent_statuses=(403,),
            absent_hint="list/watch on namespaces in the agent's ClusterRole; until then a team chosen by "
            "namespaceSelector resolves by the namespace's name alone",
        )
        # destination scopes (issue 39): the one NetworkScopes object and this node's own Node (its zone label),
        # each a watch of one object by name; without them (no CRD, no RBAC) only internal and internet are counted
        self.scopes = Reflector(
            "networkscopes", custom.list_cluster_custom_object, self.stop_event, self._mark,
            lambda k: metric("networkscopes", k), optional=True, absent_statuses=(403, 404),
            absent_hint="install netagent's CRDs (crd-revision 4) and list/watch on networkscopes in the agent's "
            "ClusterRole", group=GROUP, version=VERSION, plural="networkscopes",
            field_selector=f"metadata.name={SCOPES_NAME}",
        )
        self.nodes = Reflector(
            "nodes", core.list_node, self.stop_event, self._mark, lambda k: metric("nodes", k),
            optional=True, absent_statuses=(403,), absent_hint="list/watch on nodes in the agent's ClusterRole; "
            "until then the node has no zone (every described zone is cross-zone from it)",
            field_selector=f"metadata.name={node}",
        )
        self.reflectors = (self.pods, self.classes, self.budgets, self.services, self.namespaces, self.scopes,
                           self.nodes)

    def _mark(self) -> None:
        self._changed.set()

    def snapshot(self) -> Snapshot:
        pods, errors = [], []
        for obj in self.pods.values():
            try:
                pods.append(PodRecord.from_object(obj))
            except ValueError as exc:
                errors.append(str(exc))
        services = None
        if not self.services.missing:
            services, problems = service_cidrs_of(self.services.values())
            errors += problems
        self._generation += 1
        with self.namespaces.lock:
            namespaces = None if self.namespaces.missing else dict(self.namespaces.items)
        scopes = next(iter(self.scopes.values()), None)
        node = next(iter(self.nodes.values()), None)
        return Snapshot(tuple(pods), tuple(self.classes.values()), tuple(self.budgets.values()), self._generation,
                        tuple(errors), services, namespaces, network_scopes=scopes,
                        node_zone=node_zone_of(node) if node is not None else None)

    def synced(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors)

    def run(self, on_change: Callable[[Snapshot], None]) -> None:
        for r in self.reflectors:
            r.start()
        # coalesce bursts of events: one snapshot per wakeup, after every list arrived
        while not self.stop_event.is_set():
            if not self._changed.wait(0.5):
                continue
            if not self.synced():
                self.stop_event.wait(0.1)  # a list is still failing: look again soon, without spinning
                continue
            self._changed.clear()
            on_change(self.snapshot())

    def stop(self) -> None:
        self.stop_event.set()
        self._changed.set()


def namespace_name(obj: dict) -> str:
    """A Namespace's key in the agent's cache: its name (pods name their namespace by it)."""
    return obj["metadata"]["name"]


def service_cidr_fields(obj: dict) -> dict:
    """What the agent keeps of a ServiceCIDR: its name and its networks."""
    return {"metadata": {"name": (obj.get("metadata") or {}).get("name")},
            "spec": {"cidrs": (obj.get("spec") or {}).get("cidrs")}}


def list_service_cidrs(api: client.ApiClient) -> tuple[tuple[str, ...] | None, str]:
    """The cluster's service CIDRs read once (at start, where the counting mode is chosen): (cidrs, why
    not) with cidrs None when they cannot be read (Kubernetes < 1.33, RBAC, the apiserver down)."""
    try:
        resp = client.NetworkingV1Api(api).list_service_cidr(_request_timeout=TIMEOUT, limit=100)
    except ApiException as exc:
        return None, f"listing ServiceCIDRs: API error {exc.status} ({exc.reason})"
    except Exception as exc:  # connection refused, TLS, timeout
        return None, f"listing ServiceCIDRs: {exc.__class__.__name__}: {exc}"
    objects = [service_cidr_fields(api.sanitize_for_serialization(o)) for o in resp.items or []]
    cidrs, problems = service_cidrs_of(objects)
    for problem in problems:
        log.warning("%s", problem)
    if not cidrs:
        return None, "the cluster has no ServiceCIDR objects"
    return cidrs, ""


def kube_event_emitter(api_client, node: str) -> Callable[[str, str, str, str, str], None]:
    """(namespace, pod, uid, reason, message) -> a Warning Event on the pod, written with a timeout."""
    core = client.CoreV1Api(api_client)

    def emit(namespace: str, name: str, uid: str, reason: str, message: str) -> None:
        now = dt.datetime.now(dt.timezone.utc)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{name}.netagent-", namespace=namespace),
            involved_object=client.V1ObjectReference(kind="Pod", namespace=namespace, name=name, uid=uid,
                                                     api_version="v1"),
            reason=reason,
            message=message,
            type="Warning",
            source=client.V1EventSource(component="netagent", host=node),
            reporting_component="netagent.io/agent",
            reporting_instance=node,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        core.create_namespaced_event(namespace, body, _request_timeout=TIMEOUT)

    return emit
