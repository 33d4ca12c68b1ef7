"""Per-pod usage, throttling and demand, from successive kernel counter samples. Pure.

Usage seen under a limit is censored: a pod held at 10 Mbit/s might want 100. So
when a pod is throttled (its class went over its limit, dropped packets, or ran
within 5% of its ceil) the estimate probes above what it used, multiplying by
PROBE_GAIN each period until the pod stops being throttled; the allocator then
offers more if the budget allows, and the pod's real appetite shows. Unthrottled,
demand is the recent peak of usage plus a little headroom, decaying slowly so a
bursty pod isn't cut between bursts.
"""
from __future__ import annotations

from dataclasses import dataclass

PROBE_GAIN = 1.5  # per period while throttled
HEADROOM = 1.1  # over observed usage when not throttled
DECAY = 0.7  # how fast the remembered peak fades per period
NEAR_LIMIT = 0.95
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
    peak_bps: float = 0.0
    throttled: bool = False
    throttled_seconds: float = 0.0
    last: Sample | None = None

    def update(self, s: Sample, limit_bps: int, cap_bps: int) -> None:
        prev, self.last = self.last, s
        if prev is None or s.t <= prev.t or s.bytes < prev.bytes:
            return  # first sample, clock oddity, or a class recreated: start over from here
        dt = s.t - prev.t
        self.usage_bps = (s.bytes - prev.bytes) * 8 / dt
        self.throttled = (
            s.drops > prev.drops
            or s.overlimits > prev.overlimits
            or s.backlog > 0
            or (limit_bps > 0 and self.usage_bps >= NEAR_LIMIT * limit_bps)
        )
        if self.throttled:
            self.throttled_seconds += dt
        self.peak_bps = max(self.usage_bps, self.peak_bps * DECAY)
        if self.throttled:
            want = max(self.usage_bps, limit_bps) * PROBE_GAIN
        else:
            want = self.peak_bps * HEADROOM
        self.demand_bps = float(min(max(want, MIN_DEMAND_BPS), cap_bps))
