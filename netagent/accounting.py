"""Where a pod's internet byte is counted: after its shaper (docs/accounting.md). Pure.

The rules (mangle POSTROUTING) count what a pod offered: a sender flooding above its cap is
counted for every byte its shaper then drops. A byte is counted where it is billed: uploads as
they leave the pod's HTB class (dequeued, so on their way out through the uplink), downloads as
they arrive (the rules, before the download shaper) with what left the download class beside
them. HTB counts each segment's frame at dequeue; `desired.ip_bytes` turns that into IP bytes
exactly (frame bytes - link header x segments).

A class's counters start from zero when the class is made again (a pod's class recreated, the
IFB replaced), so each is read through a `Carry`: a reading below the last one adds the last one
to the carry, and the exposed value never goes down. Dropped bytes are the offered bytes the
class neither sent nor holds: offered - delivered - queued, never below what was shown before.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable, Iterable


class Carry:
    """One cumulative counter read from a kernel counter that may restart from zero."""

    __slots__ = ("last", "carry")

    def __init__(self) -> None:
        self.last = 0  # the kernel's last reading
        self.carry = 0  # what counters the kernel has forgotten had counted

    def read(self, kernel: int) -> int:
        if kernel < self.last:  # the counter was made again: what it had counted is kept
            self.carry += self.last
        self.last = kernel
        return self.carry + kernel

    @property
    def value(self) -> int:
        return self.carry + self.last


@dataclass(frozen=True)
class ClassReading:
    """One class's counters in IP bytes (desired.ip_bytes) at one read."""
    ip_bytes: int
    packets: int
    backlog_ip_bytes: int = 0


class Accounting:
    """Per direction ("egress", "ingress") and pod key: delivered bytes and packets (carried across
    class resets) and dropped bytes (offered - delivered - queued, monotonic). The sampler observes
    every read of the classes (one thread); the view and the reporter read (others): one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, Hashable], Carry] = {}
        self._packets: dict[tuple[str, Hashable], Carry] = {}
        self._backlog: dict[tuple[str, Hashable], int] = {}
        self._dropped: dict[tuple[str, Hashable], int] = {}

    def observe(self, direction: str, readings: dict[Hashable, ClassReading]) -> None:
        """One read of every class of `direction`, in the order read (never an older copy after a newer:
        a stale reading below a fresh one would read as a reset and count again)."""
        with self._lock:
            for key, r in readings.items():
                k = (direction, key)
                self._bytes.setdefault(k, Carry()).read(r.ip_bytes)
                self._packets.setdefault(k, Carry()).read(r.packets)
                self._backlog[k] = r.backlog_ip_bytes

    def keep(self, direction: str, keys: Iterable[Hashable]) -> None:
        """Forget the classes of `direction` not in `keys` (pods that left: a new pod starts at zero)."""
        alive = {(direction, k) for k in keys}
        with self._lock:
            for d in (self._bytes, self._packets, self._backlog, self._dropped):
                for gone in [k for k in d if k[0] == direction and k not in alive]:
                    del d[gone]

    def delivered(self, direction: str, key: Hashable) -> tuple[int, int] | None:
        """(IP bytes, packets) the pod's class let through since it was first seen; None: no class
        observed (a pod without one is counted by the rules alone)."""
        with self._lock:
            b = self._bytes.get((direction, key))
            return None if b is None else (b.value, self._packets[(direction, key)].value)

    def dropped(self, direction: str, key: Hashable, offered: int) -> int:
        """Bytes of `offered` (the rules' count of what reached the shaper, same start) that the class
        neither delivered nor holds; never below the last answer. The rules count a GSO packet with
        one header where the class counts each segment's, so for bulk TCP this is a floor."""
        with self._lock:
            k = (direction, key)
            b = self._bytes.get(k)
            if b is None:
                return self._dropped.get(k, 0)
            now = max(self._dropped.get(k, 0), offered - b.value - self._backlog.get(k, 0))
            self._dropped[k] = now
            return now
