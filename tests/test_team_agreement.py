"""The agent and the controller resolve the same team, class and caps for every pod (issue 33, item 2).

A team chosen by `namespaceSelector` reads the namespace's labels. The controller watches
Namespaces; the agent does too (one metadata watch, docs/agent.md), and both resolve through
`core.policy.resolve_pod` with the same labels. No kernel and no API server here: the agent runs on
its in-memory data path (netagent/datapath_fake.py), the controller's Allocator is the real one fed
the agent's real report; tests/test_agent_kube.py runs the label change against a real apiserver.
"""
from __future__ import annotations

import functools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.allocator import Allocator
from core.objects import PodRecord, Snapshot
from core.policy import PolicyCache
from core.wire import NodeAnswer
from netagent.agent import Agent
from netagent.config import AgentConfig
from netagent.datapath_fake import FakeDataPath
from netagent.desired import DataPathOptions, to_wire
from netagent.local import LocalAllocator
from netagent.metrics import AgentMetrics
from netagent.reporter import allocations_from, build_report

M = 1_000_000
NODE = "n1"
CLASSES = ({"kind": "EgressClass", "metadata": {"name": "bulk"}, "spec": {"weight": 4, "max": "400M"}},
           {"kind": "EgressClass", "metadata": {"name": "default"}, "spec": {"max": "10M"}})
BUDGETS = ({"kind": "EgressBudget", "metadata": {"name": "cluster"}, "spec": {"total": "1G", "teams": [
    {"name": "research", "namespaceSelector": {"matchLabels": {"netagent.io/team": "research"}},
     "defaultClass": "bulk"}]}},)


def pod(namespace: str, name: str, ip: str, **annotations: str) -> PodRecord:
    return PodRecord(namespace, name, f"uid-{namespace}-{name}", NODE, (ip,), False, "Running",
                     tuple(sorted(annotations.items())))


def make_agent(dp: FakeDataPath, controller: str | None = "https://controller"):
    holder = {}
    metrics = AgentMetrics(lambda: holder["a"].view())
    local = None if controller else functools.partial(LocalAllocator, floor_bps=1 * M)
    agent = Agent(AgentConfig(NODE, ("eth0",), ("10.0.0.0/8",), controller=controller, default_floor_bps=1 * M),
                  dp, local, metrics=metrics)
    holder["a"] = agent
    return agent, metrics


def controller_for(snap: Snapshot) -> Allocator:
    """The controller's allocator over the same objects, with the namespace labels its Namespace watch holds."""
    policy = PolicyCache(lambda: (list(snap.classes), list(snap.budgets)))
    return Allocator(policy, (snap.namespaces or {}).get)


def answer_for(allocator: Allocator, agent: Agent) -> NodeAnswer:
    """One round over the agent's own report, as the controller answers it (controller/state.py)."""
    report = build_report(agent.report_inputs(), 1, 5.0, 0.0)
    result = allocator({NODE: report})
    return NodeAnswer(NODE, 1, 60.0, result.safe_floor_bps, result.node_rate[NODE], result.by_node[NODE])


def test_a_team_chosen_by_namespace_label_is_enforced_at_the_controllers_allocation():
    """The reproduced case: the controller allocates 400 Mbit/s to a pod of team research (bulk, max 400M);
    an agent that did not know the namespace's label put the pod in the default team and class and clamped
    the answer to that class's 10M. Now the agent enforces the 400M and names the team the controller named."""
    snap = Snapshot((pod("lab", "trainer", "10.244.0.10"),), CLASSES, BUDGETS,
                    namespaces={"lab": {"netagent.io/team": "research"}})
    dp = FakeDataPath()
    agent, metrics = make_agent(dp)
    agent.on_snapshot(snap)
    assert agent.sync()
    answer = answer_for(controller_for(snap), agent)
    (alloc,) = answer.pods
    assert (alloc.team, alloc.egress_class, alloc.limit_bps) == ("research", "bulk", 400 * M)
    agent.set_allocations(allocations_from(answer, time.monotonic(), NODE))
    assert agent.sync()
    (shape,) = dp.applied[-1].shaper.pods
    assert shape.ceil == to_wire(400 * M, DataPathOptions())  # not 10M
    (resolved,) = agent.node.state.pods
    assert (resolved.team, resolved.egress_class, resolved.max_bps) == ("research", "bulk", 400 * M)
