"""Timing helpers shared by the benchmarks: repeated calls in milliseconds, percentiles."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def timed_ms(fn: Callable[[], object], n: int) -> list[float]:
    """Wall time of `n` calls of fn, each in milliseconds."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (1..99), interpolated between samples."""
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]
