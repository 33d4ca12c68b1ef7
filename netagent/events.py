"""Tell users about bad annotations: a Kubernetes Event on the pod, a log line and a
metric, once per change (never in a loop while the bad value stays)."""
from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import Callable

from kubernetes import client

from core.kubeapi import TIMEOUT

log = logging.getLogger(__name__)


class ProblemReporter:
    def __init__(self, emit_event: Callable[[str, str, str, str, str], None] | None, count: Callable[[str], None]):
        self.emit_event = emit_event  # (namespace, pod name, pod uid, reason, message)
        self.count = count
        self._told: dict[str, frozenset] = {}  # pod uid -> problems already reported
        self._lock = threading.Lock()

    def report(self, namespace: str, name: str, uid: str, problems: tuple[tuple[str, str], ...]) -> None:
        current = frozenset(problems)
        with self._lock:
            before = self._told.get(uid, frozenset())
            if current == before:
                return
            self._told[uid] = current
        for reason, message in sorted(current - before):
            log.warning("pod %s/%s: %s: %s", namespace, name, reason, message)
            self.count(reason)
            if self.emit_event:
                try:
                    self.emit_event(namespace, name, uid, reason, message)
                except Exception as exc:  # an Event that can't be written must not stop shaping
                    log.warning("could not write Event for %s/%s: %s", namespace, name, exc)

    def forget(self, live_uids: set[str]) -> None:
        with self._lock:
            for uid in set(self._told) - live_uids:
                del self._told[uid]


def kube_event_emitter(api_client, node: str) -> Callable[[str, str, str, str, str], None]:
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
