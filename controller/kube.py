"""The controller's view of the API server: watched caches in, EgressBudget status out.

Watches (one list + one resumable watch each, bookmarks on, relist only after 410 Gone,
jittered backoff; never a poll):
- EgressClass and EgressBudget objects -> the policy;
- Namespaces -> their labels (teams chosen by namespaceSelector);
- Pods, cluster-wide, one watch -> (namespace, name) -> spec.nodeName, the node-binding
  check. Only that pair is kept per pod, not the object, so 300,000 pods cost a few tens
  of MB; events are parsed from the raw stream, not into client models.

Status: the leader writes the EgressBudget's status subresource at most once per
`min_interval` seconds and only when what it would write changed (rates rounded as
`format_bps` prints them), so the API server sees O(1) writes however many nodes report.
"""
from __future__ import annotations

import datetime as dt
import logging
import sys
import threading
from typing import Callable

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from netagent.sources.reflector import Reflector

from .adapter import Summary

log = logging.getLogger(__name__)
GROUP, VERSION = "netagent.io", "v1alpha1"


class KubeError(Exception):
    """The API server refused or could not be reached; the message says which call."""


def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    try:
        if kubeconfig:
            return config.new_client_from_config(config_file=kubeconfig)
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    except Exception as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster config (no --kubeconfig given)"
        raise KubeError(f"cannot load {where}: {exc}") from exc


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


class ClusterView:
    """The watched caches the controller needs, and the callables the adapter and service take."""

    def __init__(self, api: client.ApiClient, on_policy_change: Callable[[], None] = lambda: None,
                 on_event: Callable[[str, str], None] = lambda resource, kind: None):
        self.stop_event = threading.Event()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

        def cache(name, list_fn, key, transform, on_change=lambda: None, **kw) -> Reflector:
            return Reflector(name, list_fn, self.stop_event, on_change, lambda kind: on_event(name, kind),
                             key=key, transform=transform, **kw)

        self.pods = cache("pods", core.list_pod_for_all_namespaces, _meta_key, _pod_node)
        # labels decide teams chosen by namespaceSelector: a change re-resolves pods like a policy change
        self.namespaces = cache("namespaces", core.list_namespace, lambda o: o["metadata"]["name"],
                                lambda o: dict(o["metadata"].get("labels") or {}), on_policy_change)
        crd = dict(group=GROUP, version=VERSION)
        self.classes = cache("egressclasses", custom.list_cluster_custom_object, _meta_key, _policy_part,
                             on_policy_change, plural="egressclasses", **crd)
        self.budgets = cache("egressbudgets", custom.list_cluster_custom_object, _meta_key, _policy_part,
                             on_policy_change, plural="egressbudgets", **crd)
        self.caches = (self.pods, self.namespaces, self.classes, self.budgets)

    def start(self) -> None:
        for c in self.caches:
            c.start()

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

    def policy_objects(self) -> tuple[list[dict], list[dict]]:
        return self.classes.values(), self.budgets.values()

    def budget_generation(self, name: str) -> int | None:
        obj = self.budgets.get(("", name))
        return obj["metadata"].get("generation") if obj else None


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def budget_status(summary: Summary, computed_at: float, previous: dict | None,
                  observed_generation: int | None = None) -> dict:
    """The EgressBudget status for one round. Oversubscribed keeps its lastTransitionTime
    while its status does not change."""
    from .quantity import format_bps

    over = "True" if summary.oversubscribed else "False"
    old = next((c for c in (previous or {}).get("conditions") or [] if c.get("type") == "Oversubscribed"), None)
    since = old["lastTransitionTime"] if old and old.get("status") == over else _rfc3339(computed_at)
    unmet = sorted(t for t, v in summary.teams.items() if v.guarantee_unmet)
    generation = {} if observed_generation is None else {"observedGeneration": observed_generation}
    return {
        **generation,
        "allocated": format_bps(summary.allocated_bps),
        "demand": format_bps(summary.demand_bps),
        "used": format_bps(summary.used_bps),
        "pods": summary.pods,
        "nodes": summary.nodes,
        "teamsBelowGuarantee": unmet,
        "lastComputed": _rfc3339(computed_at),
        "conditions": [{
            "type": "Oversubscribed",
            "status": over,
            "reason": "GuaranteesExceedTotal" if summary.oversubscribed else "GuaranteesFit",
            "message": ("the teams' guarantees add up to more than spec.total; they are scaled down proportionally"
                        if summary.oversubscribed else "every team's guarantee fits within spec.total"),
            "lastTransitionTime": since,
            **generation,
        }],
    }


def _comparable(status: dict | None) -> dict:
    """What counts as a change: everything but the timestamps."""
    if not status:
        return {}
    out = {k: v for k, v in status.items() if k != "lastComputed"}
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    return out


class StatusWriter:
    """Writes the latest round's summary to EgressBudget/<name>/status, rate-bounded, from its own
    thread: `offer` never blocks the allocation loop, and only the newest summary is written."""

    def __init__(self, api: client.ApiClient, min_interval: float = 30.0,
                 on_write: Callable[[str], None] = lambda result: None,
                 generation_of: Callable[[str], int | None] = lambda name: None,
                 leading: Callable[[], bool] = lambda: True):
        self.custom = client.CustomObjectsApi(api)
        self.leading = leading  # a replica that lost the Lease since the round writes nothing
        self.generation_of = generation_of  # the budget's metadata.generation the round used
        self.min_interval = min_interval
        self.on_write = on_write
        self.written: dict[str, dict] = {}  # budget name -> the status we last wrote
        self._pending: tuple[Summary, float] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="status-writer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def offer(self, summary: Summary, computed_at: float) -> None:
        if summary.budget_name:  # the built-in default policy has no object to write to
            self._pending = (summary, computed_at)
            self._wake.set()

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, None
            if pending is not None and self.leading():
                self.write(*pending)
            self._stop.wait(self.min_interval)  # the bound: at most one write per interval

    def write(self, summary: Summary, computed_at: float) -> bool:
        name = summary.budget_name
        status = budget_status(summary, computed_at, self.written.get(name), self.generation_of(name))
        if _comparable(status) == _comparable(self.written.get(name)):
            return False
        try:
            self.custom.patch_cluster_custom_object_status(GROUP, VERSION, "egressbudgets", name, {"status": status})
        except ApiException as exc:
            self.on_write("error")
            log.warning("EgressBudget %s: status write failed (%s %s); next round retries", name, exc.status,
                        exc.reason)
            return False
        except Exception as exc:
            self.on_write("error")
            log.warning("EgressBudget %s: status write failed (%s); next round retries", name, exc)
            return False
        self.written[name] = status
        self.on_write("ok")
        return True
