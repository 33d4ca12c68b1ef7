"""Pacing for a level-triggered sync: when to run it, never how.

`Runner` calls `sync(full)` from its own thread: when woken (a burst of wake-ups
coalesced, at most once per `min_interval`), on a timer (`resync_seconds`, a full
re-read of the kernel that repairs drift), and after a failure with exponential
backoff (0.5 s doubling to 10 s) and a full re-read. It never raises and never exits
on a failed sync: the previous kernel state stays in force until one succeeds.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

MAX_BACKOFF_S = 10.0


class Runner:
    def __init__(self, sync: Callable[[bool], bool], min_interval: float, resync_seconds: float,
                 name: str = "sync"):
        self.sync = sync
        self.min_interval = min_interval
        self.resync_seconds = resync_seconds
        self.last_loop = time.monotonic()
        self._dirty = threading.Event()
        self._full = False  # a waker asked for a full re-read (drift seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def wake(self, full: bool = False) -> None:
        """Ask for a sync soon (many calls in a burst make one sync); `full`: re-read the whole
        kernel state (someone else changed it)."""
        if full:
            self._full = True
        self._dirty.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def health(self) -> tuple[bool, str]:
        """Alive while the loop turned recently (a sync stuck in the kernel shows here)."""
        stale = time.monotonic() - self.last_loop
        return stale < self.resync_seconds * 3 + 30, f"sync loop last ran {stale:.0f}s ago"

    def _loop(self) -> None:
        backoff = 0.0
        retry_at = None
        next_resync = time.monotonic() + self.resync_seconds
        while not self._stop.is_set():
            self.last_loop = time.monotonic()
            wake_at = min(next_resync, retry_at or next_resync)
            woke = self._dirty.wait(max(0.0, min(wake_at - time.monotonic(), self.resync_seconds)))
            if self._stop.is_set():
                return
            self._dirty.clear()
            now = time.monotonic()
            periodic = not woke and now >= next_resync
            if not woke and not periodic and (retry_at is None or now < retry_at):
                continue
            if periodic:
                next_resync = now + self.resync_seconds
            full, self._full = self._full, False
            if self.sync(periodic or full or retry_at is not None):
                backoff, retry_at = 0.0, None
            else:
                backoff = min(max(backoff * 2, 0.5), MAX_BACKOFF_S)
                retry_at = time.monotonic() + backoff
            time.sleep(self.min_interval)  # coalesce bursts of changes
