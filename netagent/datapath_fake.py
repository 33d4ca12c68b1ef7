"""An in-memory `DataPath` for fast tests of the agent's loop (no kernel, no root).

It keeps every desired state the agent asked for, returns scripted change counts (so
a test can play "someone else changed the kernel": drift), and serves the class
stats, counters and adopted rates a test puts in it.
"""
from __future__ import annotations

import time

from core.direction import Direction
from tc.model import ClassStats

from .datapath import NodeCounters, PodCounters
from .desired import DesiredState


class FakeDataPath:
    leaf_qdisc, iptables_backend = "pfifo", "nft"

    def __init__(self, adopted: dict[int, tuple[int, int]] | None = None):
        self.applied: list[DesiredState] = []
        self.full: list[bool] = []
        self.next_changes: dict[str, int] = {"tc": 0}
        self.adopted = dict(adopted or {})
        self.stats: dict[int, ClassStats] = {}
        self.pod_counters: PodCounters = {}
        self.node_counters: NodeCounters = {}
        self.fail_with: Exception | None = None  # raised by the next apply, then cleared
        self.download_stats: dict[int, ClassStats] = {}  # `stats`, `adopted`: the upload shaper's
        self.download_adopted: dict[int, tuple[int, int]] = {}
        self.devices: tuple[str, ...] = ()
        self.carries: dict | None = None  # what save_carries kept (None: nothing kept on this "node")

    def apply(self, desired: DesiredState, full: bool = True) -> dict[str, int]:
        if self.fail_with is not None:
            exc, self.fail_with = self.fail_with, None
            raise exc
        self.applied.append(desired)
        self.full.append(full)
        return dict(self.next_changes)

    def class_stats(self, direction: Direction = Direction.UPLOAD) -> dict[int, ClassStats]:
        return dict(self.stats if direction is Direction.UPLOAD else self.download_stats)

    def sample_stats(self, direction: Direction = Direction.UPLOAD) -> tuple[float, dict[int, ClassStats]]:
        return time.monotonic(), self.class_stats(direction)

    def counters(self, max_age: float = 0.0) -> tuple[PodCounters, NodeCounters]:
        return {k: dict(v) for k, v in self.pod_counters.items()}, dict(self.node_counters)

    def adopted_rates(self, direction: Direction = Direction.UPLOAD) -> dict[int, tuple[int, int]]:
        return dict(self.adopted if direction is Direction.UPLOAD else self.download_adopted)

    def pod_devices(self, uplinks: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(d for d in self.devices if d not in uplinks)

    def load_carries(self) -> dict | None:
        return None if self.carries is None else dict(self.carries)

    def save_carries(self, carries: dict) -> None:
        self.carries = dict(carries)
