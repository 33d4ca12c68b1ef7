"""Child processes of tests and benchmarks: stopped the same way everywhere."""
from __future__ import annotations

import subprocess
import time


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (the graceful path under test), then SIGKILL after `timeout`: a child never
    outlives the test that started it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    """Poll until `predicate()` is truthy and return it. The timeout is a safety net for a
    broken build, not a claim about speed (speed is measured in bench/agent.py)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
