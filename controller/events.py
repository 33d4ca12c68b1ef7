"""Kubernetes Events from the controller (a pod refused from a report), written from their own
thread through a bounded queue: a slow or unreachable API server never holds up a report or a
round; when the queue is full the Event is dropped and counted. The same (pod, reason) is told
at most once per `repeat_after` seconds (the memory of what was told is bounded too)."""
from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Callable

from kubernetes import client

from core.kubeapi import TIMEOUT

log = logging.getLogger(__name__)
COMPONENT = "netagent-controller"


class EventWriter:
    def __init__(self, create: Callable[[str, dict], None], max_queue: int = 256, repeat_after: float = 600.0,
                 max_remembered: int = 10_000, on_result: Callable[[str], None] = lambda result: None):
        self.create = create  # (namespace, Event body) -> None: one API call with a timeout
        self.queue: queue.Queue[tuple[str, dict]] = queue.Queue(max_queue)
        self.repeat_after = repeat_after
        self.max_remembered = max_remembered
        self.on_result = on_result  # "ok", "error", "dropped"
        self._told: OrderedDict[tuple[str, str, str], float] = OrderedDict()  # (ns, pod, reason) -> when
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="events", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.queue.put_nowait(("", {}))  # wake the thread
        except queue.Full:
            pass

    def pod_event(self, namespace: str, pod: str, reason: str, message: str, now: float | None = None) -> bool:
        """Queue a Warning Event on the pod; False when it was told recently or dropped."""
        now = time.monotonic() if now is None else now
        key = (namespace, pod, reason)
        with self._lock:
            told = self._told.get(key)
            if told is not None and now - told < self.repeat_after:
                return False
            self._told[key] = now
            self._told.move_to_end(key)
            while len(self._told) > self.max_remembered:
                self._told.popitem(last=False)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{pod}.", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod},
            "reason": reason, "message": message[:1024], "type": "Warning",
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            self.queue.put_nowait((namespace, body))
        except queue.Full:
            self.on_result("dropped")
            return False
        return True

    def budget_event(self, budget: str, kind: str, reason: str, message: str) -> bool:
        """Queue an Event (kind Normal or Warning) on the cluster-scoped EgressBudget (in namespace default, where
        `kubectl describe egressbudget` finds it); False when dropped."""
        return self.cluster_event("EgressBudget", budget, kind, reason, message)

    def cluster_event(self, object_kind: str, name: str, kind: str, reason: str, message: str) -> bool:
        """Queue an Event (kind Normal or Warning) on a cluster-scoped netagent.io object (EgressBudget,
        NetworkScopes), in namespace default where `kubectl describe` finds it; False when dropped."""
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": "default"},
            "involvedObject": {"apiVersion": "netagent.io/v1alpha1", "kind": object_kind, "name": name},
            "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        try:
            self.queue.put_nowait(("default", body))
        except queue.Full:
            self.on_result("dropped")
            return False
        return True

    def run(self) -> None:
        while not self._stop.is_set():
            namespace, body = self.queue.get()
            if self._stop.is_set():
                return
            try:
                self.create(namespace, body)
                self.on_result("ok")
            except Exception as exc:  # an Event that cannot be written costs nothing else
                self.on_result("error")
                log.info("could not write Event %s on %s/%s: %s", body["reason"], namespace,
                         body["involvedObject"]["name"], exc)


def kube_event_creator(api_client) -> Callable[[str, dict], None]:
    core = client.CoreV1Api(api_client)
    return lambda namespace, body: core.create_namespaced_event(namespace, body, _request_timeout=TIMEOUT)
