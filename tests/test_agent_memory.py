"""The agent's malloc arenas (cli.main.limit_malloc_arenas, called first thing by `netagent run`):
threads allocating at the same time share two arenas instead of one each (glibc's malloc_stats
lists them)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CODE = """
import ctypes, sys, threading
from cli.main import limit_malloc_arenas
if sys.argv[1] == "limit":
    assert limit_malloc_arenas(2)
barrier = threading.Barrier(6)
held = []
def allocate():
    barrier.wait()
    held.append(bytearray(300_000))  # above pymalloc's size: glibc malloc, in this thread's arena
    barrier.wait()
threads = [threading.Thread(target=allocate) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ctypes.CDLL(None).malloc_stats()  # to stderr: one "Arena N:" per arena
"""


def arenas(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", CODE, mode], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


def test_threads_share_two_malloc_arenas():
    assert arenas("limit") <= 2
    assert arenas("default") > 2  # the test can tell: without the limit each thread has its own
