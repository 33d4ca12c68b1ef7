"""Tell users about bad annotations: a Kubernetes Event on the pod, a log line and a
metric, once per change (never in a loop while the bad value stays).

`report` is called from the sync loop, which must never wait for the API server: it only
records, logs, counts and queues. The Events are written by their own thread from a
bounded queue; when the queue is full (an apiserver slower than the pods' problems arrive)
the Event is dropped and counted (`on_dropped`), the log line and the metric still tell.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

QUEUE_SIZE = 256
MAX_MESSAGE_CHARS = 1024  # an Event's message as the API server keeps it; a log line no longer


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 14] + " …(truncated)"


class ProblemReporter:
    def __init__(self, emit_event: Callable[[str, str, str, str, str], None] | None, count: Callable[[str], None],
                 on_dropped: Callable[[], None] | None = None, queue_size: int = QUEUE_SIZE):
        self.emit_event = emit_event  # (namespace, pod name, pod uid, reason, message); carries its own timeout
        self.count = count
        self.on_dropped = on_dropped or (lambda: None)
        self._told: dict[str, frozenset] = {}  # pod uid -> problems already reported
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def start(self) -> None:
        if self.emit_event and self._thread is None:
            self._thread = threading.Thread(target=self._write_events, name="events", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass  # a daemon thread: it ends with the process

    def report(self, namespace: str, name: str, uid: str, problems: tuple[tuple[str, str], ...]) -> None:
        current = frozenset(problems)
        with self._lock:
            before = self._told.get(uid, frozenset())
            if current == before:
                return
            self._told[uid] = current
        for reason, message in sorted(current - before):
            message = _clip(message)
            log.warning("pod %s/%s: %s: %s", namespace, name, reason, message)
            self.count(reason)
            if self.emit_event:
                try:
                    self._queue.put_nowait((namespace, name, uid, reason, message))
                except queue.Full:
                    self.dropped += 1
                    self.on_dropped()

    def _write_events(self) -> None:
        while (item := self._queue.get()) is not None:
            namespace, name = item[0], item[1]
            try:
                self.emit_event(*item)
            except Exception as exc:  # an Event that can't be written must not stop the others
                log.warning("could not write Event for %s/%s: %s", namespace, name, exc)

    def forget(self, live_uids: set[str]) -> None:
        with self._lock:
            for uid in set(self._told) - live_uids:
                del self._told[uid]
