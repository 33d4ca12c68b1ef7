"""Report pacing: the period the leader asks agents to report at, so that one leader carries
any cluster size. Pure apart from the clock.

One leader answers every report (authentication, decoding, the node-binding check, preparing
the pods' columns: about a millisecond of CPU each, docs/scale.md), so its load is
nodes / period. Below `--max-reports-per-second` x `--period` nodes nothing changes: agents
report at their own `--report-period`. Above it the leader advises, in every answer, a period
of nodes / max-reports-per-second (never more than a quarter of the answer's lease, so an agent
still reports several times per lease, and never more than MAX_ADVISED_PERIOD); agents adopt it
with their own +-20 % jitter. The cost is reaction time: a demand shift settles in about two
report periods, so it grows with the period (docs/scale.md has the measured figures).

The node count is the larger of the nodes that reported within the report TTL and the nodes the
pod cache places pods on: a new leader starts with no reports, and advising the short period
then would call every agent in at the base rate at once (a storm right after a failover).
"""
from __future__ import annotations

import time
from typing import Callable

from core.wire import MAX_ADVISED_PERIOD

REFRESH_SECONDS = 10.0  # the node count is recounted at most this often (the pod cache is large)


def advised_period(nodes: int, base: float, max_reports_per_s: float, lease_seconds: float) -> float:
    """Seconds between reports that keep `nodes` agents at or under `max_reports_per_s` on the
    leader; 0 (the agents' own period) while that rate is met at `base` (the round period) or when
    pacing is off (rate <= 0)."""
    if max_reports_per_s <= 0 or nodes / max_reports_per_s <= base:
        return 0.0  # the agents' own period (a shorter one than `base` stays theirs)
    ceiling = min(MAX_ADVISED_PERIOD, lease_seconds / 4)
    return round(min(ceiling, nodes / max_reports_per_s), 3)


class ReportPacer:
    """The advised period, recomputed at most every REFRESH_SECONDS from `nodes()`."""

    def __init__(self, nodes: Callable[[], int], base: float, max_reports_per_s: float, lease_seconds: float,
                 clock: Callable[[], float] = time.monotonic):
        self.nodes = nodes
        self.base, self.max_reports_per_s, self.lease_seconds = base, max_reports_per_s, lease_seconds
        self.clock = clock
        self._period = 0.0
        self._at = float("-inf")

    def period(self) -> float:
        now = self.clock()
        if now - self._at >= REFRESH_SECONDS:
            self._at = now
            self._period = advised_period(self.nodes(), self.base, self.max_reports_per_s, self.lease_seconds)
        return self._period
