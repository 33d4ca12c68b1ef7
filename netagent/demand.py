"""Per-pod usage, throttling and demand, from successive kernel counter samples. Pure.

The estimate must follow a pod's real appetite within a period or two both ways
(docs/allocation.md, "Demand estimation"):

- Not throttled, the pod sent what it wanted: demand is the larger of its last
  RECENT_PERIODS periods' usage. It falls as soon as usage falls (one period late, so
  a pod that pauses for one period keeps its share), and a pod that wants less gives
  its share back instead of holding a slowly decaying peak.
- Throttled (the kernel says so: the class dropped packets, went over its ceil, or
  kept a backlog), usage is censored: the pod might want ten times its limit. The
  estimate then asks PROBE_GAIN times its limit (or what it sent, if more), and at
  least its peak usage of the last PEAK_PERIODS periods: a bursty pod that comes
  back asks for its last burst at once instead of climbing back step by step; a
  steadily growing pod doubles its ask each period until it is no longer throttled
  (or its fair share stops it).

Usage near the limit alone is not throttling: a pod whose limit is exactly what it
asked for (the budget saturated, no headroom) runs at its limit unthrottled, and
probing it would take share from pods that need it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PROBE_GAIN = 2.0  # ask this multiple of the censored usage while throttled
RECENT_PERIODS = 2  # unthrottled demand: the max usage of this many periods
CLEAR_DROP = 0.8  # usage under this share of that max is a real drop, not jitter: demand follows at once
MARGIN = 1.005  # over that max: a pod limited to exactly what it used is throttled by any jitter, and probes
PEAK_PERIODS = 12  # throttled: ask at least the peak usage of this many periods (1 min at 5 s)
MIN_DEMAND_BPS = 8_000  # a pod that sends nothing still asks for a trickle


@dataclass(frozen=True)
class Sample:
    t: float  # monotonic seconds
    bytes: int  # internet egress bytes through the pod's class
    drops: int
    overlimits: int
    backlog: int


@dataclass
class PodDemand:
    usage_bps: float = 0.0
    demand_bps: float = float(MIN_DEMAND_BPS)
    throttled: bool = False
    throttled_seconds: float = 0.0
    last: Sample | None = None
    history: deque = field(default_factory=lambda: deque(maxlen=PEAK_PERIODS))  # usage per period, newest last

    def update(self, s: Sample, limit_bps: int, cap_bps: int) -> None:
        prev, self.last = self.last, s
        if prev is None or s.t <= prev.t or s.bytes < prev.bytes:
            return  # first sample, clock oddity, or a class recreated: start over from here
        dt = s.t - prev.t
        self.usage_bps = (s.bytes - prev.bytes) * 8 / dt
        self.history.append(self.usage_bps)
        self.throttled = s.drops > prev.drops or s.overlimits > prev.overlimits or s.backlog > 0
        if self.throttled:
            self.throttled_seconds += dt
            want = max(max(self.usage_bps, limit_bps) * PROBE_GAIN, max(self.history))
        else:
            recent = max(list(self.history)[-RECENT_PERIODS:])
            want = (self.usage_bps if self.usage_bps < CLEAR_DROP * recent else recent) * MARGIN
        self.demand_bps = float(min(max(want, MIN_DEMAND_BPS), cap_bps))
