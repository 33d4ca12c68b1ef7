"""Tell users about bad annotations: a Kubernetes Event on the pod, a log line and a
metric, once per change (never in a loop while the bad value stays)."""
from __future__ import annotations

import logging
import threading
from typing import Callable

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
