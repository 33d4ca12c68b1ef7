"""Where the controller's inputs come from: watched caches of the API server, or YAML files.

Watches (one list + one resumable watch each, bookmarks on, relist only after 410 Gone,
jittered backoff; never a poll):
- EgressClass and EgressBudget objects -> the policy;
- Namespaces -> their labels (teams chosen by namespaceSelector);
- Pods, cluster-wide, one watch -> (namespace, name) -> spec.nodeName, the node-binding
  check. Only that pair is kept per pod, not the object, so 300,000 pods cost a few tens
  of MB; events are parsed from the raw stream, not into client models.
- the agent's own pods (its ServiceAccount's, in its namespace: a field selector), the pair ->
  node, uid, terminating, finished (`AgentPod`): the nodes that run an agent, which a new
  leader waits to hear from (the takeover hold-back, controller/allocator.py), and the pods
  whose tokens may use the agent review lane (controller/auth.py). One node's pod each, so
  10,000 nodes cost little.

Files (`--from-file`, no cluster): the same objects in YAML, reloaded on change
(`FilePolicy`); pods in the files, if any, drive the node-binding check; Namespace objects,
if any, give their labels (as the agent's `core.files.FileSource` reads the same files).
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable, Mapping

from kubernetes import client

from core.files import FileSource
from core.kubeapi import GROUP, VERSION
from core.objects import Snapshot, namespace_labels
from core.reflector import Reflector

from .auth import AgentPod

log = logging.getLogger(__name__)


def _meta_key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return sys.intern(meta.get("namespace") or ""), meta.get("name") or ""  # few namespaces, many pods


def _policy_part(obj: dict) -> dict:
    """What the policy reads of an EgressClass/EgressBudget: its name and spec. Our own status
    writes (and other metadata churn) then do not count as policy changes."""
    meta = obj.get("metadata") or {}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
            "metadata": {"name": meta.get("name"), "generation": meta.get("generation")}, "spec": obj.get("spec")}


def _pod_node(obj: dict) -> str | None:
    node = (obj.get("spec") or {}).get("nodeName")
    return sys.intern(node) if node else None  # unscheduled pods are on no node yet; one string per node


def _agent_pod(obj: dict) -> AgentPod | None:
    node = _pod_node(obj)
    if node is None:
        return None  # unscheduled: no kubelet can mint its token yet
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    return AgentPod(node, meta.get("uid") or "", bool(meta.get("deletionTimestamp")),
                    status.get("phase") in ("Succeeded", "Failed"))


def _nodes(cache: Reflector) -> int:
    """Distinct nodes in a cache of (namespace, name) -> spec.nodeName (unscheduled pods: None)."""
    return len(set(cache.values()) - {None})


class ClusterCaches:
    """The watched caches the controller needs, and the callables the allocator and state take."""

    def __init__(self, api: client.ApiClient, on_policy_change: Callable[[], None] = lambda: None,
                 on_event: Callable[[str, str], None] = lambda resource, kind: None,
                 agent_service_account: tuple[str, str] | None = None,
                 on_namespace_gone: Callable[[str, int], None] = lambda namespace, pods: None,
                 on_scopes: Callable[[dict | None], None] = lambda obj: None):
        self.stop_event = threading.Event()
        self.on_namespace_gone = on_namespace_gone  # (namespace, pods still in it): deleted under them
        self._namespace_names: set[str] = set()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

        def cache(name, list_fn, key, transform, on_change=lambda: None, **kw) -> Reflector:
            return Reflector(name, list_fn, self.stop_event, on_change, lambda kind: on_event(name, kind),
                             key=key, transform=transform, **kw)

        self.pods = cache("pods", core.list_pod_for_all_namespaces, _meta_key, _pod_node)
        # labels decide teams chosen by namespaceSelector: a change re-resolves pods like a policy change
        self.namespaces = cache("namespaces", core.list_namespace, lambda o: o["metadata"]["name"],
                                namespace_labels,  # what the agent keeps of them, too
                                lambda: (self._namespaces_changed(), on_policy_change()))
        crd = dict(group=GROUP, version=VERSION)
        self.classes = cache("egressclasses", custom.list_cluster_custom_object, _meta_key, _policy_part,
                             on_policy_change, plural="egressclasses", **crd)
        self.budgets = cache("egressbudgets", custom.list_cluster_custom_object, _meta_key, _policy_part,
                             on_policy_change, plural="egressbudgets", **crd)
        self.caches = (self.pods, self.namespaces, self.classes, self.budgets)
        # NetworkScopes (issue 39): the object `cluster`, for prices. Started with the others but not waited
        # for (synced): a cluster whose CRDs predate it still allocates; its list is retried with backoff.
        self.scopes: Reflector = cache("networkscopes", custom.list_cluster_custom_object, _meta_key, _policy_part,
                                       lambda: on_scopes(self.scopes.get(("", "cluster"))),
                                       plural="networkscopes", **crd)
        self.agent_pods: Reflector | None = None
        if agent_service_account is not None:
            namespace, name = agent_service_account
            self.agent_pods = cache("agent-pods", core.list_namespaced_pod, _meta_key, _agent_pod,
                                    namespace=namespace, field_selector=f"spec.serviceAccountName={name}")
            self.caches += (self.agent_pods,)

    def start(self) -> None:
        for c in self.caches:
            c.start()
        self.scopes.start()

    def _namespaces_changed(self) -> None:
        """A Namespace gone while pods are still in it (its finalizer forced; the namespace controller
        deletes the pods first otherwise): logged and counted. Their pods then resolve by the namespace's
        name alone, here as on the agents. One scan of the pod cache per namespace gone: rare."""
        names = set(self.namespaces.items)
        gone, self._namespace_names = self._namespace_names - names, names
        for ns in sorted(gone):
            with self.pods.lock:
                pods = sum(1 for key in self.pods.items if key[0] == ns)
            if pods:
                log.warning("namespace %s is gone while %d pod(s) are still in it: they resolve by the "
                            "namespace's name alone (its labels are gone; the agents do the same)", ns, pods)
                self.on_namespace_gone(ns, pods)

    def stop(self) -> None:
        self.stop_event.set()

    def synced(self) -> tuple[bool, str]:
        waiting = [c.name for c in self.caches if not c.synced.is_set()]
        return (not waiting, f"waiting for the first list of {', '.join(waiting)}" if waiting else "caches synced")

    def locate_pods(self, keys: list[tuple[str, str]]) -> list[str | None]:
        where = self.pods.get
        return [where(k) for k in keys]

    def namespace_labels(self, namespace: str) -> dict[str, str] | None:
        return self.namespaces.get(namespace)

    def pod_count(self) -> int:
        """Scheduled pods in the cluster (every one could be on an agent's node): sizes the floor."""
        return len(self.pods.items)

    def node_count(self) -> int:
        """Nodes with scheduled pods (each may run an agent): the report pacing's count."""
        return _nodes(self.pods)

    def agent_node_count(self) -> int:
        """Nodes that run an agent pod (without the agent's ServiceAccount: every node with a pod)."""
        if self.agent_pods is None:
            return _nodes(self.pods)
        return len({pod.node for pod in self.agent_pods.values()})

    def agent_pod(self, key: tuple[str, str]) -> AgentPod | None:
        """The watched agent pod (namespace, name), for the agent-pod check (controller/auth.py)."""
        return self.agent_pods.get(key) if self.agent_pods is not None else None

    def agent_pods_synced(self) -> bool:
        """Whether the agent-pod watch has listed (without --agent-service-account: never)."""
        return self.agent_pods is not None and self.agent_pods.synced.is_set()

    def policy_objects(self) -> tuple[list[dict], list[dict]]:
        return self.classes.values(), self.budgets.values()

    def budget_generation(self, name: str) -> int | None:
        obj = self.budgets.get(("", name))
        return obj["metadata"].get("generation") if obj else None


class FilePolicy:
    """--from-file: policy (and pod placement, if the files hold Pods) from YAML, reloaded on change."""

    def __init__(self, paths: list[str]):
        self.source = FileSource(paths, node=None, interval=1.0)
        self.snapshot, _ = self.source.load()
        for error in self.snapshot.errors:
            log.error("policy files: %s", error)
        self._where = self._index(self.snapshot)
        self.thread = threading.Thread(target=self.source.run, args=(self._changed,), name="policy-files", daemon=True)
        self.on_change: Callable[[], None] = lambda: None
        # the NetworkScopes document named `cluster` in the files (its prices: docs/scopes.md), None when gone
        self.on_scopes: Callable[[Mapping[str, Any] | None], object] = lambda obj: None

    @staticmethod
    def _index(snapshot: Snapshot) -> dict[tuple[str, str], str]:
        return {(pod.namespace, pod.name): pod.node for pod in snapshot.pods if pod.node}

    def _changed(self, snapshot: Snapshot) -> None:
        scopes_changed = snapshot.network_scopes != self.snapshot.network_scopes
        self.snapshot, self._where = snapshot, self._index(snapshot)
        self.on_change()
        if scopes_changed:
            self.on_scopes(snapshot.network_scopes)

    def start(self) -> None:
        self.on_scopes(self.snapshot.network_scopes)  # what the first read found
        self.thread.start()

    def stop(self) -> None:
        self.source.stop()

    def policy_objects(self) -> tuple[list[dict], list[dict]]:
        return list(self.snapshot.classes), list(self.snapshot.budgets)

    def locate_pods(self, keys: list[tuple[str, str]]) -> list[str | None]:
        where = self._where.get
        return [where(k) for k in keys]

    def has_pods(self) -> bool:
        return bool(self.snapshot.pods)

    def namespace_labels(self, namespace: str) -> dict[str, str] | None:
        """The labels of a Namespace object in the files (None: not in them), as the agent reads them."""
        return (self.snapshot.namespaces or {}).get(namespace)

    def pod_count(self) -> int:
        return len(self._where)

    def node_count(self) -> int:
        return len(set(self._where.values()))
