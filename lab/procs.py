"""Child processes of tests and benchmarks: stopped the same way everywhere."""
from __future__ import annotations

import subprocess


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
