"""SIGTERM stops the agent even when another thread takes the signal.

A process-directed signal goes to any thread that does not block it. The agent's other
threads spawn iptables-restore and ipset; when one of them takes SIGTERM, its C handler
only flags the signal, and Python runs the handler in the main thread at its next bytecode.
A main thread parked in an untimed `Event.wait()` never gets there: CI saw an agent ignore
SIGTERM for 20 s. This runs the agent's own wait (`cli.main.wait_until_set`) in a child
process whose threads spawn processes as the agent's do, and signals it many times.
"""
from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = 40

CHILD = textwrap.dedent("""
    import signal, subprocess, sys, threading
    from cli.main import wait_until_set

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def spawn():
        while True:
            subprocess.run(["true"])

    for _ in range(2):
        threading.Thread(target=spawn, daemon=True).start()
    while True:
        print("waiting", flush=True)
        wait_until_set(stop)
        stop.clear()
""")


def test_every_sigterm_ends_the_wait_while_other_threads_spawn_processes():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    rng = random.Random(7)

    def next_line() -> str | None:
        # a liveness bound, not a timing: the fixed wait answers within its poll slice
        return child.stdout.readline().strip() if sel.select(timeout=10) else None

    try:
        assert next_line() == "waiting"
        for n in range(SIGNALS):
            sel.select(timeout=rng.uniform(0.01, 0.1))  # land the signal at varied points of the spawning
            child.send_signal(signal.SIGTERM)
            line = next_line()
            assert line is not None, f"SIGTERM {n + 1} did not end the wait within 10 s"
            assert line == "waiting", line
    finally:
        child.kill()
        child.wait(timeout=10)
        sel.close()
        child.stdout.close()
