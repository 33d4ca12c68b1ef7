"""Per-pod usage, throttling and demand, from successive kernel counter samples. Pure.

The estimate must follow a pod's real appetite within a period or two both ways
(docs/allocation.md, "Demand estimation" has the measurements behind every constant):

- Not throttled, the pod sent what it wanted: demand is the larger of its last
  RECENT_PERIODS periods' usage (one period of jitter does not move it), except
  that usage clearly below that (under CLEAR_DROP of it) is followed at once, down
  to half of it per sample (FALL_FLOOR): a pod that wants less gives its share back
  within a period or two instead of holding a slowly decaying peak, and a pod whose
  connection stalled for one sample does not drop to a trickle and have to climb
  back from there.
- Throttled (the kernel says so: the class dropped packets, went over its ceil, or
  kept a backlog), usage is censored: the pod might want ten times its limit. The
  first probe asks FIRST_PROBE_GAIN times the limit (or what it sent, if more); once
  an answer raised the limit and the pod is still throttled, PROBE_GAIN times the
  new limit: a pod that only jittered over its limit costs others little, a pod that
  really grew doubles its ask with every answer until it is no longer throttled (or
  its fair share stops it). Samples (every second) come faster than answers (every
  report period): repeated samples under the same limit do not escalate, and a cut
  while probing (an answer to older demand) rebases the probe so the next raise counts.
- Woken: throttled under a limit it had room under when last unthrottled (idle, or
  well below it), or in its first measured sample (a new pod: no limit it merely jitters
  over), the pod's appetite grew past that room; that is no jitter, and
  climbing from an idle pod's trickle by doublings took 11-13 answers (issue 13: one
  node's first report came before its flows). It asks its cap while it stays
  throttled: the engine's max-min answer is its fair share, at once, and an answer
  computed before the ask (answers lag a report) does not end it.
- Cut: throttled under a limit clearly below what it sent the sample before (under CLEAR_DROP
  of it), the pod asks at least that: an answer cut it, not its appetite (a drop shows as an
  unthrottled sample first). With answers a report late (the controller's default) the 1.25x
  ask of the cut limit was answered out of phase, and pods swung high and low for good.
- Held: still throttled after HELD_ANSWERS answers that did not raise its limit, the pod sits
  at its fair share and wants more (jitter over a limit is answered by the first probe, or its
  next sample is unthrottled). It asks its cap as a woken pod does: the answer stays its fair
  share while that is what it gets, and when a policy change or a neighbour leaving raises the
  share, the next answer gives it all at once instead of 1.25x, then 2x per answer (issue 13: a
  class change took 4 answers in the demo).

Usage near the limit alone is not throttling: a pod whose limit is exactly what it
asked for (the budget saturated, no headroom) runs at its limit unthrottled, and
probing it would take share from pods that need it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from core.quantity import TRICKLE_BPS

HELD_ANSWERS = 2  # answers that left a throttled pod's limit where it was: it is held at its share
FIRST_PROBE_GAIN = 1.25  # the first throttled period asks this multiple of the censored usage...
PROBE_GAIN = 2.0  # ...and every further one this multiple
RECENT_PERIODS = 2  # unthrottled demand: the max usage of this many periods
CLEAR_DROP = 0.8  # usage under this share of that max is a real drop, not jitter: demand follows at once
FALL_FLOOR = 0.5  # ...but it at most halves per sample: one stalled sample must not cost the pod its share
MIN_DEMAND_BPS = TRICKLE_BPS  # a pod that sends nothing still asks for a trickle


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
    probe_gain: float = 0.0  # while throttled: the multiple of the limit asked (0: not probing)
    probed_limit: float = 0.0  # the limit that multiple was first asked at
    roomy_below: float | None = None  # the last unthrottled sample had room under any limit from this (usage / CLEAR_DROP)
    waking: bool = False  # woken or held: asks its cap while it stays throttled
    answers_seen: int = 0  # the agent's answer count at the last sample
    refusals: int = 0  # answers since the probe began (or was last raised) that did not raise the limit
    cut_from: float = 0.0  # while throttled: what it sent the sample before a cut took it clearly below that

    held_answers = HELD_ANSWERS  # a class attribute: bench/estimator.py's baseline turns the rule off

    def update(self, s: Sample, limit_bps: int, cap_bps: int, answers: int = 0) -> None:
        """`answers`: how many answers (allocation sets) the agent has received so far; the count
        moving is how the estimator knows an answer came between two samples."""
        prev, self.last = self.last, s
        answered, self.answers_seen = answers != self.answers_seen, answers
        if prev is None or s.t <= prev.t or s.bytes < prev.bytes:
            return  # first sample, clock oddity, or a class recreated: start over from here
        dt = s.t - prev.t
        self.usage_bps = (s.bytes - prev.bytes) * 8 / dt
        before = self.recent_usage[-1] if self.recent_usage else None
        self.recent_usage.append(self.usage_bps)
        # it sent clearly more than the sample before (jitter does not, nor does a pod held at its limit),
        # or this is its first measured sample: a new pod (or a new agent) has no limit it merely jitters
        # over, and climbing from the floor by doublings took 11 answers in a saturated cluster (issue 37)
        jumped = before is None or self.usage_bps * CLEAR_DROP > max(before, MIN_DEMAND_BPS)
        self.throttled = s.drops > prev.drops or s.overlimits > prev.overlimits or s.backlog > 0
        if self.throttled:
            self.throttled_seconds += dt
            # escalate only once an answer raised the limit and the pod is still held: samples
            # come faster than answers, and the same limit asked about twice is no new evidence
            if not self.probe_gain:
                self.probe_gain, self.probed_limit, self.refusals = FIRST_PROBE_GAIN, limit_bps, 0
                self.waking = self.woke(jumped, limit_bps)
            elif limit_bps > self.probed_limit:
                self.probe_gain, self.probed_limit, self.refusals = PROBE_GAIN, limit_bps, 0
            else:
                if limit_bps < self.probed_limit:
                    self.probed_limit = limit_bps  # cut while probing (an answer to older demand): the next raise counts
                # the first answer may predate the report that carried the probe; the second cannot
                self.refusals += answered
                self.waking = self.waking or self.refusals >= self.held_answers
            self.roomy_below = None
            if before is not None and before * CLEAR_DROP > limit_bps:
                # cut below what it sent a sample ago (an answer to an older report, a neighbour's ask):
                # it wants that at least, while it stays throttled. Answers a report late, asking 1.25x
                # the cut limit locked pods into a two-period swing, out of phase with the answers (issue 37)
                self.cut_from = max(self.cut_from, before)
            want = cap_bps if self.waking else max(self.usage_bps, limit_bps) * self.probe_gain
            want = max(want, self.cut_from)
        else:
            self.probe_gain, self.waking, self.refusals, self.cut_from = 0.0, False, 0, 0.0
            self.roomy_below = self.usage_bps / CLEAR_DROP if self.usage_bps < CLEAR_DROP * limit_bps else None
            recent = max(self.recent_usage)
            want = max(self.usage_bps, FALL_FLOOR * recent) if self.usage_bps < CLEAR_DROP * recent else recent
        self.demand_bps = float(min(max(want, MIN_DEMAND_BPS), cap_bps))

    def woke(self, jumped: bool, limit_bps: int) -> bool:
        """Throttled for the first time since it was unthrottled: is it a new appetite rather than
        jitter over its limit? Yes when it had room under this limit when last unthrottled (an idle
        pod started, a pod woke from a lull), or when it sent clearly more than the sample before
        (a pod that borrowed over a trickle limit shows no room, but its flows just started), or
        when there is no sample before (`jumped` says so too: a new pod)."""
        return jumped or (self.roomy_below is not None and self.roomy_below <= limit_bps)
