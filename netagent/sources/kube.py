"""Kubernetes source: this node's pods and the two cluster-scoped policy kinds.

The seeds' lesson: thousands of agents polling the API server take it down. So:
one list + one resumable watch per kind, pods filtered server-side with
fieldSelector=spec.nodeName=<node>, bookmarks on, relist only after 410 Gone,
jittered exponential backoff on errors. No periodic polling, never a cluster-wide
pod list.
"""
from __future__ import annotations

import json
import logging
import random
import threading
from typing import Callable

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from ..model import PodRecord, Snapshot

log = logging.getLogger(__name__)
GROUP, VERSION = "netagent.io", "v1alpha1"
WATCH_TIMEOUT_S = 300  # server-side watch timeout; the watch is resumed from its resourceVersion
# (connect, read) client timeouts: a silently vanished apiserver is noticed, never waited on forever
LIST_TIMEOUT = (10, 60)
WATCH_READ_TIMEOUT = (10, WATCH_TIMEOUT_S + 30)


def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    cfg = client.Configuration()
    config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(cfg)


class Backoff:
    """Exponential backoff with full jitter, reset on success."""

    def __init__(self, base: float = 0.5, cap: float = 30.0, rng: random.Random | None = None):
        self.base, self.cap, self.attempt = base, cap, 0
        self.rng = rng or random.Random()

    def next(self) -> float:
        delay = self.rng.uniform(0, min(self.cap, self.base * (2**self.attempt)))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


class Reflector:
    """list + watch of one resource into a dict keyed by uid; calls on_change after each change."""

    def __init__(self, name: str, list_fn: Callable, on_change: Callable[[], None], stop: threading.Event,
                 metrics: Callable[[str], None] | None = None, optional: bool = False, **list_kwargs):
        self.name = name
        self.list_fn = list_fn
        self.list_kwargs = list_kwargs
        self.on_change = on_change
        self.stop = stop
        self.items: dict[str, dict] = {}
        self.resource_version = ""
        self.synced = threading.Event()
        self.relists = 0
        self.count_event = metrics or (lambda kind: None)
        self.lock = threading.Lock()
        self.optional = optional  # a CRD that may not be installed yet: absent means empty
        self.missing = False

    def relist(self) -> None:
        resp = self.list_fn(_preload_content=False, _request_timeout=LIST_TIMEOUT, **self.list_kwargs)
        body = json.loads(resp.data)
        with self.lock:
            self.items = {o["metadata"]["uid"]: o for o in body.get("items") or []}
            self.resource_version = body["metadata"]["resourceVersion"]
        self.relists += 1
        self.missing = False
        self.count_event("relist")
        self.synced.set()
        self.on_change()

    def run(self) -> None:
        backoff = Backoff()
        need_list = True
        while not self.stop.is_set():
            try:
                if need_list:
                    self.relist()
                    need_list = False
                self._watch()
                backoff.reset()
            except ApiException as exc:
                if exc.status == 410:
                    log.info("%s: watch expired (410 Gone); relisting", self.name)
                    self.count_event("gone")
                    need_list = True
                    continue
                if exc.status == 404 and self.optional:
                    self._absent()
                    need_list = True
                    self.stop.wait(backoff.next())
                    continue
                delay = backoff.next()
                log.warning("%s: API error %s; retrying in %.1fs", self.name, exc.status, delay)
                self.count_event("error")
                self.stop.wait(delay)
            except Exception as exc:  # connection refused, apiserver restart, TLS errors...
                delay = backoff.next()
                log.warning("%s: watch failed (%s); retrying in %.1fs", self.name, exc.__class__.__name__, delay)
                self.count_event("error")
                self.stop.wait(delay)

    def _absent(self) -> None:
        """The resource type does not exist (CRDs not installed): no objects, which the policy
        layer turns into its built-in defaults; said once, retried with backoff."""
        if not self.missing:
            log.warning("%s: the resource type is not installed (404); treating it as empty until it is "
                        "(install netagent's CRDs)", self.name)
        self.missing = True
        with self.lock:
            changed = bool(self.items)
            self.items, self.resource_version = {}, ""
        if changed or not self.synced.is_set():
            self.synced.set()
            self.on_change()

    def _watch(self) -> None:
        w = watch.Watch()
        stream = w.stream(
            self.list_fn,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=WATCH_READ_TIMEOUT,
            **self.list_kwargs,
        )
        try:
            for event in stream:
                if self.stop.is_set():
                    return
                etype, obj = event["type"], event.get("raw_object") or {}
                if etype == "ERROR":
                    code = obj.get("code")
                    raise ApiException(status=code or 500, reason=obj.get("message", "watch error"))
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if etype == "BOOKMARK":
                    continue
                uid = obj["metadata"]["uid"]
                with self.lock:
                    if etype == "DELETED":
                        self.items.pop(uid, None)
                    else:
                        self.items[uid] = obj
                self.count_event(etype.lower())
                self.on_change()
        finally:
            w.stop()

    def objects(self) -> list[dict]:
        with self.lock:
            return list(self.items.values())


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
            "pods", core.list_pod_for_all_namespaces, self._mark, self.stop_event,
            lambda k: metric("pods", k), field_selector=f"spec.nodeName={node}",
        )
        self.classes = Reflector(
            "egressclasses", custom.list_cluster_custom_object, self._mark, self.stop_event,
            lambda k: metric("egressclasses", k), optional=True, group=GROUP, version=VERSION, plural="egressclasses",
        )
        self.budgets = Reflector(
            "egressbudgets", custom.list_cluster_custom_object, self._mark, self.stop_event,
            lambda k: metric("egressbudgets", k), optional=True, group=GROUP, version=VERSION, plural="egressbudgets",
        )
        self.reflectors = (self.pods, self.classes, self.budgets)

    def _mark(self) -> None:
        self._changed.set()

    def snapshot(self) -> Snapshot:
        pods, errors = [], []
        for obj in self.pods.objects():
            try:
                pods.append(PodRecord.from_object(obj))
            except ValueError as exc:
                errors.append(str(exc))
        self._generation += 1
        return Snapshot(tuple(pods), tuple(self.classes.objects()), tuple(self.budgets.objects()), self._generation,
                        tuple(errors))

    def synced(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors)

    def run(self, on_change: Callable[[Snapshot], None]) -> None:
        threads = [threading.Thread(target=r.run, name=f"watch-{r.name}", daemon=True) for r in self.reflectors]
        for t in threads:
            t.start()
        # coalesce bursts of events: one snapshot per wakeup, after all three lists arrived
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
