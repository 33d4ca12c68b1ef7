"""The whole fault suite: the controller's faults (real kube-apiserver, real controller processes)
then the agent's (live traffic in the namespace lab), each printing its rows of the table in
docs/reliability.md.

    sudo python3 bench/faults.py          # about 10 minutes; needs root for the lab

The agent's part takes the machine's traffic lock (/tmp/netagent-traffic.lock), so no other
traffic measurement runs beside it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    print("## The controller's faults\n", flush=True)
    controller = subprocess.run([sys.executable, str(HERE / "faults_controller.py")]).returncode
    print("\n## The agents' faults\n", flush=True)
    agent = subprocess.run(["flock", "/tmp/netagent-traffic.lock", sys.executable, str(HERE / "faults_agent.py")]).returncode
    return controller or agent


if __name__ == "__main__":
    sys.exit(main())
