"""Per-pod usage, throttling and demand, from successive kernel counter samples. Pure.

The estimate must follow a pod's real appetite within a period or two both ways
(docs/allocation.md, "Demand estimation"):

- Not throttled, the pod sent what it wanted: demand is the larger of its last
  RECENT_PERIODS periods' usage (one period of jitter does not move it), except
  that usage clearly below that (under CLEAR_DROP of it) is the demand at once: a
  pod that wants less gives its share back in the same period instead of holding a
  slowly decaying peak.
- Throttled (the kernel says so: the class dropped packets, went over its ceil, or
  kept a backlog), usage is censored: the pod might want ten times its limit. The
  estimate then asks PROBE_GAIN times its limit (or what it sent, if more), and at
  least the largest demand it had in the last PEAK_PERIODS periods: a bursty pod
  that comes back asks for its last burst at once instead of climbing back step by
  step; a steadily growing pod doubles its ask each period until it is no longer
  throttled (or its fair share stops it).

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
PEAK_PERIODS = 12  # throttled: ask at least the largest demand of this many periods (1 min at 5 s)
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
    recent_usage: deque = field(default_factory=lambda: deque(maxlen=RECENT_PERIODS))
    recent_demand: deque = field(default_factory=lambda: deque(maxlen=PEAK_PERIODS))

    def update(self, s: Sample, limit_bps: int, cap_bps: int) -> None:
        prev, self.last = self.last, s
        if prev is None or s.t <= prev.t or s.bytes < prev.bytes:
            return  # first sample, clock oddity, or a class recreated: start over from here
        dt = s.t - prev.t
        self.usage_bps = (s.bytes - prev.bytes) * 8 / dt
        self.recent_usage.append(self.usage_bps)
        self.throttled = s.drops > prev.drops or s.overlimits > prev.overlimits or s.backlog > 0
        if self.throttled:
            self.throttled_seconds += dt
            want = max(max(self.usage_bps, limit_bps) * PROBE_GAIN, max(self.recent_demand, default=0.0))
        else:
            recent = max(self.recent_usage)
            want = self.usage_bps if self.usage_bps < CLEAR_DROP * recent else recent
        self.demand_bps = float(min(max(want, MIN_DEMAND_BPS), cap_bps))
        self.recent_demand.append(self.demand_bps)
