"""Where a pod's internet byte is counted: after its shaper (docs/accounting.md). Pure.

The rules (mangle POSTROUTING) count what a pod offered: a sender flooding above its cap is
counted for every byte its shaper then drops. A byte is counted where it is billed: uploads as
they leave the pod's HTB class (dequeued, so on their way out through the uplink), downloads as
they arrive (the rules, before the download shaper) with what left the download class beside
them. HTB counts each segment's frame at dequeue; `desired.ip_bytes` turns that into IP bytes
exactly (frame bytes - link header x segments).

A class's counters start from zero when the class is made again (a pod's class recreated, the
IFB replaced), so each is read through a `Carry`: a reading below the last one adds the last one
to the carry, and the exposed value never goes down. The carries are kept in the kernel beside the
classes (`KernelDataPath.save_carries`), so the next agent goes on from them; an agent that finds
none is the first that counts this way on the node (an upgrade from counting offered bytes): it
seeds each pod present then with offered - sent, so its upload counter goes on from the old one. Dropped bytes are the offered bytes the
class neither sent nor holds: offered - delivered - queued, never below what was shown before.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable, Iterable


class Carry:
    """One cumulative counter read from a kernel counter that may restart from zero."""

    __slots__ = ("last", "carry", "seen")

    def __init__(self) -> None:
        self.last = 0  # the kernel's last reading
        self.carry = 0  # what counters the kernel has forgotten had counted
        self.seen = False  # read at least once (a restored carry is not yet)

    def read(self, kernel: int) -> int:
        if kernel < self.last:  # the counter was made again: what it had counted is kept
            self.carry += self.last
        self.last, self.seen = kernel, True
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
        self.seeding = False  # no carries were kept: the pods present at the first sync are seeded
        self._dirty = False  # a carry changed since the last take_dirty()

    def restore(self, carries: dict[tuple[str, Hashable], tuple[int, int]] | None) -> None:
        """The carries a previous agent kept (None: none were, see `seeding`): each class's count goes on
        from its carry. Before the first observe."""
        with self._lock:
            self.seeding = carries is None
            for k, (nbytes, packets) in (carries or {}).items():
                self._bytes.setdefault(k, Carry()).carry = nbytes
                self._packets.setdefault(k, Carry()).carry = packets

    def seed(self, direction: str, offered: dict[Hashable, int]) -> None:
        """Upgrade: each pod already counted (`offered`: what the agent before showed, the rules' count)
        starts from that, so its counter neither steps down nor restarts; ends the seeding."""
        with self._lock:
            for key, nbytes in offered.items():
                b = self._bytes.get((direction, key))
                if b is not None and nbytes > b.value:
                    b.carry += nbytes - b.value
            self.seeding, self._dirty = False, True  # kept even when empty: the next agent does not seed

    def mark_dirty(self) -> None:
        with self._lock:
            self._dirty = True

    def take_dirty(self) -> dict[tuple[str, Hashable], tuple[int, int]] | None:
        """Every non-zero carry when one changed since the last call (to keep), else None."""
        with self._lock:
            if not self._dirty:
                return None
            self._dirty = False
            return {k: (c.carry, self._packets[k].carry) for k, c in self._bytes.items() if c.carry}

    def observe(self, direction: str, readings: dict[Hashable, ClassReading]) -> None:
        """One read of every class of `direction`, in the order read (never an older copy after a newer:
        a stale reading below a fresh one would read as a reset and count again)."""
        with self._lock:
            for key, r in readings.items():
                k = (direction, key)
                b = self._bytes.setdefault(k, Carry())
                carried = b.carry
                b.read(r.ip_bytes)
                self._packets.setdefault(k, Carry()).read(r.packets)
                self._dirty |= b.carry != carried
                self._backlog[k] = r.backlog_ip_bytes

    def keep(self, direction: str, keys: Iterable[Hashable]) -> None:
        """Forget the classes of `direction` not in `keys` (pods that left: a new pod starts at zero)."""
        alive = {(direction, k) for k in keys}
        with self._lock:
            for d in (self._bytes, self._packets, self._backlog, self._dropped):
                for gone in [k for k in d if k[0] == direction and k not in alive]:
                    self._dirty |= d is self._bytes and d[gone].carry != 0
                    del d[gone]

    def delivered(self, direction: str, key: Hashable, now: ClassReading | None = None) -> tuple[int, int] | None:
        """(IP bytes, packets) the pod's class let through, carries included; None: no class observed
        (a pod without one is counted by the rules alone). `now`: the class's reading in the caller's
        hand, for a class not observed yet (a scrape between the agent's first sync and its first
        sample), so the first value shown is already the carried one."""
        with self._lock:
            k = (direction, key)
            b = self._bytes.get(k)
            if b is not None and b.seen:
                return b.value, self._packets[k].value
            if now is None:
                return None
            p = self._packets.get(k)
            return (b.carry if b else 0) + now.ip_bytes, (p.carry if p else 0) + now.packets

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
