"""The controller's fault suite with figures: runs tests/test_faults_controller.py (the real
kube-apiserver of tests/kube.py, real controller processes; each test asserts what must hold and
records its figures) and prints the table of docs/reliability.md.

    python3 bench/faults_controller.py            # about 4 minutes; freezes its own API server for 60 s

Figures are about the allocations the controller answers (what an agent enforces from them, see
the test module's `Enforced`), not traffic through the kernel: "seconds over limit" is the agent
suite's column and shows "—" here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="netagent-faults-") as tmp:
        out = Path(tmp) / "rows.jsonl"
        env = {**os.environ, "NETAGENT_FAULTS_OUT": str(out),
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              str(REPO / "tests" / "test_faults_controller.py")], cwd=REPO, env=env)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    print("| fault | seconds over limit | peak over budget % | time to repair s | residue | lost reports "
          "| must hold | holds |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        over = "—" if r["seconds_over_limit"] is None else f"{r['seconds_over_limit']:.1f}"
        print(f"| {r['fault']} | {over} | {r['peak_over_budget']:.1f} | {r['repair_s']:.1f} | {r['residue']} "
              f"| {r['lost']} | {r['must_hold']} | {'yes' if r['holds'] else 'NO'} |")
    for r in rows:
        if r.get("note"):
            print(f"- {r['fault']}: {r['note']}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
