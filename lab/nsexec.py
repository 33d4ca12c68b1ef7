"""Run Python code inside a network namespace from a process that lives outside it.

setns(2) with CLONE_NEWNET moves only the calling *thread*, so a dedicated worker
thread enters the namespace once and then serves calls: sockets it opens live in
that namespace. The demo and the tests use it to read agents' endpoints and to talk
to Prometheus inside the lab without adding any link to the host's namespace.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future
from typing import Any, Callable

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(OSError):
    pass


def _enter(netns: str) -> None:
    path = netns if netns.startswith("/") else f"/run/netns/{netns}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NetnsError(exc.errno, f"network namespace {netns!r} not found ({path}): {exc.strerror}") from exc
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(err, f"setns into {netns!r} failed: {os.strerror(err)} (needs root)")
    finally:
        os.close(fd)


class NetnsWorker:
    """A thread that lives in `netns` and runs the callables it is given."""

    def __init__(self, netns: str):
        self.netns = netns
        self._jobs: queue.Queue = queue.Queue()
        started: Future = Future()
        self._thread = threading.Thread(target=self._serve, args=(started,), name=f"netns-{netns}", daemon=True)
        self._thread.start()
        started.result(timeout=10)  # raises NetnsError when the namespace cannot be entered

    def _serve(self, started: Future) -> None:
        try:
            _enter(self.netns)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args, kwargs = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    fut.set_exception(exc)

    def call(self, fn: Callable[..., Any], *args, timeout: float | None = 30, **kwargs) -> Any:
        fut: Future = Future()
        self._jobs.put((fut, fn, args, kwargs))
        return fut.result(timeout=timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def __enter__(self) -> "NetnsWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    """A plain GET (run it through NetnsWorker.call to reach an address inside a namespace)."""

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
