"""The one builder of an in-process agent for tests (no kernel, no process): `make_agent`.

Tests of the agent's decisions (tests/test_agent_core.py, tests/test_team_agreement.py), of its
reporter against a real controller (tests/test_controller_service.py, tests/test_controller_kube.py)
and of its transport (tests/test_agent_transport.py) all build it here, so an Agent or AgentConfig
change is made once. The real agent process is lab/agentproc.py's AgentProcess.
"""
from __future__ import annotations

import functools
from typing import Iterable

from core.direction import PerDirection
from core.policy import Limits, ResolvedPod
from netagent.agent import Agent
from netagent.config import AgentConfig
from netagent.datapath import DataPath
from netagent.datapath_fake import FakeDataPath
from netagent.local import LocalAllocator
from netagent.metrics import AgentMetrics
from netagent.sync import SyncState

M = 1_000_000


def make_agent(dp: DataPath | None = None, *, node: str = "n1", controller: str | None = None,
               internal_cidrs: tuple[str, ...] = ("10.0.0.0/8",),
               pods: Iterable[tuple[str, str]] = ()) -> tuple[Agent, AgentMetrics]:
    """An agent over `dp` (the in-memory FakeDataPath when None) and its metrics (a registry of its own,
    scraping the agent's view). Without `controller` it allocates locally (single-node mode, floor
    1 Mbit/s). `pods`, (namespace, name) pairs, are published as a sync would have published them
    (team "web", class "default", upload max 1 Gbit/s), for tests that report without syncing."""
    holder: dict[str, Agent] = {}
    metrics = AgentMetrics(lambda: holder["a"].view())
    local = None if controller else functools.partial(LocalAllocator, floor_bps=1 * M)
    cfg = AgentConfig(node, ("eth0",), internal_cidrs, controller=controller, default_floor_bps=1 * M)
    agent = Agent(cfg, dp if dp is not None else FakeDataPath(), local, metrics=metrics)
    holder["a"] = agent
    pods = tuple(pods)
    if pods:
        agent.node.state = SyncState(pods=tuple(
            ResolvedPod(f"{ns}/{name}", ns, name, f"uid-{name}", ("10.0.0.1",), "web", "default",
                        PerDirection(Limits(1.0, 0, 10**9), Limits(1.0)))
            for ns, name in pods), pods_known=True)
    return agent, metrics
