"""Timing helpers shared by the benchmarks: repeated calls in milliseconds, percentiles, a process's CPU time."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
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


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
