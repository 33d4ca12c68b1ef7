"""Every second: read the pod classes' counters into usage, throttling and demand.

In single-node mode the sampler also runs the local allocation rounds; in both modes it
notices a lease that just ran out and wakes the sync (so pods fall to the floor now, not
at the next resync), and ends adoption once fresh allocations exist.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from core.direction import Direction
from tc.model import NODE_MINOR

from .accounting import Accounting, ClassReading
from .allocations import Allocations
from .datapath import DataPath
from .demand import PodDemand, Sample
from .desired import NODE_RATIO_KEY, from_wire, ip_bytes
from .frames import FrameRatios
from .sync import NodeSync

log = logging.getLogger(__name__)
RATIO_WAKE_S = 5.0  # at most one sync this often for measured frame ratios (netagent.frames)


class Sampler:
    def __init__(self, node: NodeSync, datapath: DataPath, wake_sync: Callable[[], None], sample_seconds: float = 1.0,
                 allocate_seconds: float = 2.0, accounting: Accounting | None = None):
        """Samples each of `node`'s shaped lanes (netagent.lane): their demand and frame ratios."""
        self.node = node
        self.accounting = accounting if accounting is not None else Accounting()
        self.datapath = datapath
        self.allocations = node.lanes.upload.allocations  # its lease and fail-static decide for the node
        self.wake_sync = wake_sync
        self.sample_seconds = sample_seconds
        self.allocate_seconds = allocate_seconds
        self._stop = threading.Event()
        self._ratio_changed = False  # a class's measured frame ratio changed since the last wake for it
        self._ratio_wake_at = 0.0
        self._carry_error = ""
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        next_alloc = time.monotonic() + self.allocate_seconds
        while not self._stop.wait(self.sample_seconds):
            try:
                now = time.monotonic()
                if not self.allocations.fail_static and self.allocations.lease_expired(now):
                    self.wake_sync()  # the lease just ran out: fall to the floor now, not at the next resync
                self.sample()
                if self.node.lanes.upload.local is not None and time.monotonic() >= next_alloc:
                    next_alloc = time.monotonic() + self.allocate_seconds
                    state = self.node.state
                    for lane in self.node.shaped_lanes():
                        if state.pods and lane.local is not None and lane.allocations.replace(
                                lane.local(list(state.pods), lane.demand, state.budgets[lane.direction])):
                            self.wake_sync()
                if (self.allocations.adopted and self.node.state.sync_count
                        and self.allocations.current.source in ("local", "controller")):
                    for lane in self.node.shaped_lanes():
                        lane.allocations.adopted = {}  # fresh allocations exist: adoption has done its job
            except Exception:
                log.exception("sampling failed")

    def sample(self) -> None:
        """One sample of every pod class, both directions: usage, throttling and demand per pod."""
        state = self.node.state
        changed, now = False, time.monotonic()
        for lane in self.node.shaped_lanes():
            d = lane.direction
            if d is not Direction.UPLOAD and (state.desired is None or state.desired.shapers[d] is None):
                continue  # not programmed yet: no classes to read
            now, stats = self.datapath.sample_stats(d)  # the one read a second; the view shares it
            self._sample(now, stats, {p.key: p.limits[d].max_bps for p in state.pods}, lane.allocations, lane.demand,
                         state.budgets[d])
            changed |= self._observe_frames(lane.frames, stats)
            self._account(d.metric_word, stats)
        # a new ratio reaches the kernel at the next sync; wake one for it, at most every RATIO_WAKE_S
        # (allocations that hold still wake none, and a sync costs more than a sample)
        self._ratio_changed |= changed
        if self._ratio_changed and now >= self._ratio_wake_at:
            self._ratio_changed, self._ratio_wake_at = False, now + RATIO_WAKE_S
            self.wake_sync()

    def _account(self, direction: str, stats: dict) -> None:
        """Each pod class's delivered IP bytes into the accounting (netagent.accounting), in read order."""
        opts = self.node.cfg.datapath
        minors = self.node.state.minors
        readings = {}
        for key, minor in minors.items():
            st = stats.get(minor)
            if st is not None:
                readings[key] = ClassReading(ip_bytes(st.bytes, st.packets, opts), st.packets,
                                             ip_bytes(st.backlog_bytes, st.backlog_packets, opts))
        self.accounting.observe(direction, readings)
        self.accounting.keep(direction, minors)
        if direction == "egress" and self.accounting.seeding and self.node.state.sync_count:
            # the first agent counting this way on the node: each pod goes on from the old (offered) count
            pods, _ = self.datapath.counters(max_age=1.0)
            self.accounting.seed("egress", {k: c.get("egress_internet", 0) for k, c in pods.items() if k in readings})
        carries = self.accounting.take_dirty()
        if carries is not None:
            try:
                self.datapath.save_carries(carries)
                self._carry_error = ""
            except Exception as exc:  # kept in the process meanwhile; tried again at the next sample
                self.accounting.mark_dirty()
                if str(exc) != self._carry_error:
                    log.warning("could not keep the accounting carries in the kernel: %s", exc)
                self._carry_error = str(exc)

    def _observe_frames(self, ratios: FrameRatios, stats: dict) -> bool:
        """Each class's frames and packets into its measured frames per IP byte (the node class's
        too); True when a class's ratio changed."""
        minors = self.node.state.minors
        changed = False
        for key, minor in minors.items():
            st = stats.get(minor)
            if st is not None:
                changed |= ratios.observe(key, st.bytes, st.packets)
        node = stats.get(NODE_MINOR)
        if node is not None:
            changed |= ratios.observe(NODE_RATIO_KEY, node.bytes, node.packets)
        ratios.keep((*minors, NODE_RATIO_KEY))
        return changed

    def _sample(self, now: float, stats: dict, caps: dict[str, int], allocations: Allocations,
                demand: dict[str, PodDemand], budget_bps: int) -> None:
        """`caps`: each pod's cap in this direction (its max_bps), by key."""
        state = self.node.state
        allocs = allocations.current.pods
        opts = self.node.cfg.datapath
        answers = allocations.answers
        for key, minor in state.minors.items():
            st = stats.get(minor)
            max_bps = caps.get(key)
            if st is None or max_bps is None:
                continue
            d = demand.get(key)
            if d is None:
                d = demand[key] = PodDemand()
            limit = allocs[key].limit_bps if key in allocs else from_wire(st.ceil_bytes * 8, opts)
            # no demand above the budget means anything: a woken pod asking its cap asks at most that
            cap = min(max_bps, budget_bps) if budget_bps > 0 else max_bps
            # usage in IP bytes, the unit of every rate: the class counts each segment's frame
            d.update(Sample(now, ip_bytes(st.bytes, st.packets, opts), st.drops, st.overlimits, st.backlog_bytes),
                     int(limit), cap, answers)
        for gone in set(demand) - set(state.minors):
            del demand[gone]
