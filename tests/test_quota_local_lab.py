"""Issue 38's Show item "in single-machine mode: quota exhausted, agent restarted, still exhausted (use kept)":
the real agent (`python3 -m netagent run --from-file ... --state-dir`) in the namespace lab, real traffic.

A team with a 3 MB daily upload quota and an 8M exhaustedRate sends past it; the agent caps its pod at 8M and its
state file says the use; the agent is killed with -9 and started again; it reads the file and the team stays
exhausted: its pod's measured upload rate stays at the exhaustedRate. Root; under the traffic lock."""
from __future__ import annotations

import json
import sys

import pytest

from lab.agentproc import AgentProcess, pod_object, received_bps, tc_classes, wait_for, write_objects
from lab.netns import require_root, run
from lab.topology import INTERNET_V4, Lab
from netagent.desired import DataPathOptions, PodShape, assign_minors, from_wire
from netagent.localquota import STATE_FILE, persisted_use

pytestmark = [pytest.mark.root, pytest.mark.traffic]

M = 1_000_000
QUOTA = 3 * M  # bytes: about 1.2 s of the class's 20M
# above LEAST_CEIL_BPS (4.19M): a pod's ceil is never set below that (tc/sizing.py), so an exhaustedRate below
# it per pod is held only as the pods' HTB rates, not their ceils (docs/quotas.md)
EXHAUSTED = 8 * M
PORT = 5311
POLICY = [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "bronze"},
     "spec": {"weight": 1, "max": "20M"}},
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
     "spec": {"total": "100M", "teams": [
         {"name": "research", "namespaces": ["research"], "defaultClass": "bronze",
          "quota": {"period": "Day", "bytes": "3M", "exhaustedRate": "8M"}},
         {"name": "web", "namespaces": ["web"], "defaultClass": "bronze"}]}},
]


def ceil_of(netns: str, pod) -> int | None:
    got = tc_classes(netns).get(assign_minors([PodShape("x", (pod.ip4, pod.ip6), 1, 1)])["x"])
    return from_wire(got[1], DataPathOptions()) if got else None


def research_quota(agent: AgentProcess) -> dict | None:
    st = agent.state() or {}
    return next((q for q in st.get("quota") or [] if q["team"] == "research"), None)


def test_quota_exhausted_agent_restarted_still_exhausted(tmp_path):
    require_root()
    state_dir = tmp_path / "state"
    with Lab(nodes=1, pods_per_node=2) as lab:
        lab.iperf_server(lab.internet, PORT)
        node = lab.nodes[0]
        research, web = node.pods
        write_objects(tmp_path / "policy.yaml", POLICY)
        write_objects(tmp_path / "pods.yaml", [pod_object(research, node, namespace="research"),
                                               pod_object(web, node, namespace="web")])
        agent = AgentProcess(lab, node, [tmp_path], port=9571, log_dir=tmp_path,
                             extra=["--state-dir", str(state_dir)]).start()
        try:
            agent.wait_ready()
            wait_for(lambda: ceil_of(node.netns, research) == 20 * M, what="the research pod's bronze class")
            before = wait_for(lambda: research_quota(agent), what="the team's quota in /state")
            assert before["uploads"] == {"bytes": QUOTA, "used": 0, "exhausted": False, "exhausted_bps": EXHAUSTED,
                                         "forecast_seconds": None}, before
            # past the quota: the team is capped at its exhaustedRate
            lab.iperf(research.netns, INTERNET_V4, PORT, seconds=3)
            wait_for(lambda: (research_quota(agent) or {})["uploads"]["exhausted"], what="the quota spent")
            wait_for(lambda: (ceil_of(node.netns, research) or 0) <= EXHAUSTED, what="research capped")
            assert ceil_of(node.netns, web) == 20 * M  # the other team keeps its class
            used = research_quota(agent)["uploads"]["used"]
            wait_for(lambda: (state_dir / STATE_FILE).exists() and persisted_use(
                json.loads((state_dir / STATE_FILE).read_text()))["research"][0] >= QUOTA, timeout=30,
                what="the use in the state file")
            # killed and started again: the file and the kernel's counters give the use back
            agent.kill9()
            agent.start()
            agent.wait_ready()
            wait_for(lambda: research_quota(agent) is not None and research_quota(agent)["uploads"]["exhausted"],
                     what="still exhausted after the restart")
            assert research_quota(agent)["uploads"]["used"] >= used  # kept, nothing lost
            wait_for(lambda: (agent.state() or {}).get("allocation_source") == "local", timeout=15,
                     what="the local allocator's first round")  # not just the class the kernel kept
            rate = received_bps(lab.iperf(research.netns, INTERNET_V4, PORT, seconds=3))
            assert 0.8 * EXHAUSTED < rate < 1.1 * EXHAUSTED, rate  # held at the exhaustedRate, not the floor
            # `netagent status` on the node prints the team's use, quota and forecast
            text = run([sys.executable, "-m", "netagent", "status", "--agent", "127.0.0.1:9571"], node.netns)
            row = next(line for line in text.splitlines() if line.startswith("research") and "uploads" in line)
            assert "2.9 MiB" in row and "EXHAUSTED" in row and row.rstrip().endswith("0.0 h"), text
            assert ceil_of(node.netns, web) == 20 * M
        finally:
            print(agent.log())
            agent.close()
