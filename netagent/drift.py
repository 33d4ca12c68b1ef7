"""Drift noticed within a second, not at the next periodic resync.

Two cheap watchers wake the sync loop for a full reconcile (which re-reads and repairs):
  * netlink (`tc.linkwatch`): the IFB or an uplink deleted, downed, renamed or replaced, or a
    default route changed; a new or changed veth (a pod's device: downloads are redirected from
    it into the download shaper) wakes an ordinary sync, which re-reads tc anyway. With learnt uplinks (no --uplink) the default-route devices are
    looked up again first, so a new default-route device is shaped from then on;
  * our iptables hooks: every HOOK_CHECK_S the mangle table's lines of our chains are counted
    (`DataPath.hooks_fingerprint`, one iptables-save per family, no lock taken, and only when
    the rules' version read in-process moved) and compared with what the last apply left; a
    flushed table or chain shows at once.
The watchers only wake the sync; they never touch the kernel themselves.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from tc.linkwatch import LinkEvent, LinkWatcher

from .netinfo import NetInfoError, default_route_devices

log = logging.getLogger(__name__)

HOOK_CHECK_S = 1.0


def pod_device(event: LinkEvent) -> bool:
    """A veth appeared or changed (not deleted: its filter goes with it): where downloads are shaped. Pure."""
    return event.kind == "link" and not event.deleted and event.link_kind == "veth"


def relevant(event: LinkEvent, devices: set[str], indexes: set[int]) -> bool:
    """Whether `event` can concern our data path: our devices (by name or index: a rename keeps
    the index), a default route, or lost notifications. Pure."""
    if event.kind == "overflow":
        return True
    if event.kind == "route":
        return event.default_route
    return event.name in devices or event.index in indexes


class DriftWatch:
    def __init__(self, ifbs: tuple[str, ...], uplinks: Callable[[], tuple[str, ...]], wake_full: Callable[[], None],
                 hooks_fingerprint: Callable[[], object | None], set_uplinks: Callable[[tuple[str, ...]], None]
                 | None = None, count: Callable[[str], None] | None = None, netns: str | None = None,
                 hook_check_s: float = HOOK_CHECK_S, wake: Callable[[], None] | None = None):
        """`ifbs`: the IFB of each shaped direction; `set_uplinks`: given when the uplinks are learnt
        from the default routes (no --uplink); `wake` (an ordinary sync): given when downloads are shaped."""
        self.ifbs, self.uplinks, self.wake_full = ifbs, uplinks, wake_full
        self.wake = wake
        self.hooks_fingerprint = hooks_fingerprint
        self.set_uplinks = set_uplinks
        self.count = count or (lambda source: None)
        self.hook_check_s = hook_check_s
        self._indexes: set[int] = set()
        self._refresh_indexes()
        self._last_hooks: object | None = None
        self._stop = threading.Event()
        self.watcher = LinkWatcher(self._on_event, netns)
        self._hooks_thread = threading.Thread(target=self._check_hooks, name="hookcheck", daemon=True)

    def start(self) -> None:
        self.watcher.start()
        self._hooks_thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.watcher.stop()

    def _devices(self) -> set[str]:
        return {*self.ifbs, *self.uplinks()}

    def _refresh_indexes(self) -> None:
        out = set()
        for name in self._devices():
            try:
                out.add(socket.if_nametoindex(name))
            except OSError:
                pass
        self._indexes = out

    def _on_event(self, event: LinkEvent) -> None:
        if not relevant(event, self._devices(), self._indexes):
            if self.wake is not None and pod_device(event) and event.name not in self.uplinks():
                self.count("pod_device")
                self.wake()  # a new pod device gets the download filter in this sync
            return
        if self.set_uplinks is not None and event.kind in ("route", "overflow", "link"):
            try:
                found = default_route_devices()
            except NetInfoError as exc:
                log.warning("could not look up the default routes again: %s", exc)
                found = ()
            if found and found != self.uplinks():
                log.warning("the default-route devices changed: %s -> %s; shaping there from now on",
                            ",".join(self.uplinks()), ",".join(found))
                self.set_uplinks(found)
                self.count("uplinks")
        self._refresh_indexes()
        self.count("netlink")
        log.info("%s %s changed (%s): resyncing now", event.kind, event.name or event.index,
                 "deleted" if event.deleted else ("up" if event.up else "down") if event.kind == "link" else "changed")
        self.wake_full()

    def _check_hooks(self) -> None:
        while not self._stop.wait(self.hook_check_s):
            try:
                seen = self.hooks_fingerprint()
            except Exception as exc:  # a tool that failed once: the next tick tries again
                log.debug("hook check failed: %s", exc)
                continue
            if seen is None:
                continue  # an apply is running, or nothing applied yet
            expected, now = seen
            if now != expected and now != self._last_hooks:
                log.warning("our iptables rules changed under us (%s lines, expected %s): resyncing now", now, expected)
                self.count("hooks")
                self.wake_full()
            self._last_hooks = now
