"""One list + one resumable watch of one Kubernetes resource into a dict: the agent's and
the controller's only way of reading the API server.

The seeds' lesson: thousands of clients polling the API server take it down. So a
reflector lists once (paged), then watches from that resourceVersion with bookmarks on,
relists only after 410 Gone, and backs off with full jitter on errors. It never polls.
Events are parsed from the raw stream, not into client models: a cache keeps only what
`transform` extracts (the controller keeps one node name per pod, not the pod).
"""
from __future__ import annotations

import json
import logging
import random
import threading
from typing import Callable, Generic, TypeVar

from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)
V = TypeVar("V")

WATCH_TIMEOUT_S = 300  # server-side watch timeout; the watch resumes from its resourceVersion
# (connect, read) client timeouts: a silently vanished apiserver is noticed, never waited on forever
LIST_TIMEOUT = (10, 60)
WATCH_READ_TIMEOUT = (10, WATCH_TIMEOUT_S + 30)
LIST_PAGE = 500


class Backoff:
    """Exponential backoff with full jitter, reset on success."""

    def __init__(self, base: float = 0.5, cap: float = 30.0, rng: random.Random | None = None):
        self.base, self.cap, self.attempt = base, cap, 0
        self.rng = rng or random.Random()

    def next(self) -> float:
        """The next delay: uniform in [0, min(cap, base * 2^attempt)]."""
        delay = self.rng.uniform(0, min(self.cap, self.base * (2**self.attempt)))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """After a success: start from `base` again."""
        self.attempt = 0


def uid_key(obj: dict) -> str:
    """Key objects by their UID."""
    return obj["metadata"]["uid"]


def whole(obj: dict) -> dict:
    """Keep the whole object."""
    return obj


class Reflector(Generic[V]):
    """{key(obj): transform(obj)} for every object of one resource; `transform` returning None
    drops the object. `on_change` runs after a list and after each event that changed the
    map; `on_event(kind)` counts relist/added/modified/deleted/gone/error. With `optional`,
    a resource type that does not exist (404: CRDs not installed) reads as empty, said once
    with `absent_hint`; so does one the client may not read when 403 is among `absent_statuses`."""

    def __init__(self, name: str, list_fn: Callable, stop: threading.Event,
                 on_change: Callable[[], None] = lambda: None, on_event: Callable[[str], None] = lambda kind: None,
                 key: Callable[[dict], object] = uid_key, transform: Callable[[dict], V | None] = whole,
                 optional: bool = False, absent_statuses: tuple[int, ...] = (404,),
                 absent_hint: str = "install netagent's CRDs", **list_kwargs):
        self.name = name
        self.list_fn, self.list_kwargs = list_fn, list_kwargs
        self.key, self.transform = key, transform
        self.stop = stop
        self.on_change, self.on_event = on_change, on_event
        self.optional = optional
        self.absent_statuses, self.absent_hint = absent_statuses, absent_hint
        self.missing = False
        self.items: dict[object, V] = {}
        self.resource_version = ""
        self.synced = threading.Event()
        self.lock = threading.Lock()  # writers hold it; readers copy under it (values())

    def start(self) -> threading.Thread:
        """List and watch in a daemon thread until the stop event is set."""
        t = threading.Thread(target=self.run, name=f"watch-{self.name}", daemon=True)
        t.start()
        return t

    def values(self) -> list[V]:
        """A copy of the cached values."""
        with self.lock:
            return list(self.items.values())

    def get(self, key: object) -> V | None:
        """The cached value for `key`, or `default`."""
        return self.items.get(key)  # one dict lookup: atomic under the GIL

    def _put(self, items: dict, obj: dict) -> bool:
        """Store what `transform` keeps of obj; whether that changed anything."""
        value = self.transform(obj)
        k = self.key(obj)
        if value is None:
            return items.pop(k, None) is not None
        if items.get(k) == value:
            return False
        items[k] = value
        return True

    def relist(self) -> None:
        """One paged list into a fresh map; returns the list's resourceVersion."""
        items: dict[object, V] = {}
        token = None
        while True:
            kwargs = dict(self.list_kwargs, limit=LIST_PAGE, _preload_content=False, _request_timeout=LIST_TIMEOUT)
            if token:
                kwargs["_continue"] = token
            body = json.loads(self.list_fn(**kwargs).data)
            for obj in body.get("items") or []:
                self._put(items, obj)
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                break
        with self.lock:
            self.items = items
            self.resource_version = body["metadata"]["resourceVersion"]
        self.missing = False
        self.on_event("relist")
        self.synced.set()
        self.on_change()

    def run(self) -> None:
        """List, then watch from the list's resourceVersion; relist after 410; back off on errors."""
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
                    self.on_event("gone")
                    need_list = True
                    continue
                if exc.status in self.absent_statuses and self.optional:
                    self._absent(exc.status)
                    need_list = True
                    self.stop.wait(backoff.next())
                    continue
                delay = backoff.next()
                log.warning("%s: API error %s (%s); retrying in %.1fs", self.name, exc.status, exc.reason, delay)
                self.on_event("error")
                self.stop.wait(delay)
            except Exception as exc:  # connection refused, apiserver restart, TLS errors...
                delay = backoff.next()
                log.warning("%s: watch failed (%s: %s); retrying in %.1fs", self.name, exc.__class__.__name__,
                            exc, delay)
                self.on_event("error")
                self.stop.wait(delay)

    def _absent(self, status: int = 404) -> None:
        if not self.missing:
            what = "is not installed" if status == 404 else "may not be read"
            log.warning("%s: the resource type %s (%s); treating it as empty until it is (%s)", self.name, what,
                        status, self.absent_hint)
        self.missing = True
        with self.lock:
            changed = bool(self.items)
            self.items, self.resource_version = {}, ""
        if changed or not self.synced.is_set():
            self.synced.set()
            self.on_change()

    def _watch(self) -> None:
        resp = self.list_fn(watch=True, resource_version=self.resource_version, allow_watch_bookmarks=True,
                            timeout_seconds=WATCH_TIMEOUT_S, _preload_content=False,
                            _request_timeout=WATCH_READ_TIMEOUT, **self.list_kwargs)
        try:
            for line in iter_resp_lines(resp):
                if self.stop.is_set():
                    return
                if not line:
                    continue
                event = json.loads(line)
                etype, obj = event.get("type"), event.get("object") or {}
                if etype == "ERROR":
                    raise ApiException(status=obj.get("code") or 500, reason=obj.get("message", "watch error"))
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if etype == "BOOKMARK":
                    continue
                with self.lock:
                    if etype == "DELETED":
                        changed = self.items.pop(self.key(obj), None) is not None
                    else:
                        changed = self._put(self.items, obj)
                self.on_event(etype.lower())
                if changed:  # e.g. a pod's status update that does not move it to another node
                    self.on_change()
        finally:
            resp.release_conn()
