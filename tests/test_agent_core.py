"""The agent's decisions without a kernel: which pods get a class, adoption after a restart,
the fail-static lease, drift accounting. The data path here is the in-memory fake that
lives beside the DataPath protocol (the real one is exercised in tests/test_agent_lab.py)."""
from __future__ import annotations

import functools
import time

from core.objects import PodRecord, Snapshot
from core.policy import shaped_pods
from netagent.agent import Agent
from netagent.allocations import Allocation, AllocationSet
from netagent.config import AgentConfig
from netagent.datapath_fake import FakeDataPath
from netagent.desired import DataPathOptions, PodShape, assign_minors, to_wire
from netagent.local import LocalAllocator
from netagent.metrics import AgentMetrics

M = 1_000_000
CLASSES = ({"kind": "EgressClass", "metadata": {"name": "bronze"}, "spec": {"max": "20M"}},)
BUDGETS = ({"kind": "EgressBudget", "metadata": {"name": "default"},
            "spec": {"total": "1G", "teams": [{"name": "a", "namespaces": ["ns"], "defaultClass": "bronze"}]}},)


def wire(*ip_bps: int):
    """The HTB rates that carry these IP rates (the desired state holds frame rates)."""
    out = tuple(to_wire(b, DataPathOptions()) for b in ip_bps)
    return out[0] if len(out) == 1 else out


def pod(name: str, ip: str | None, host_network=False, phase="Running", deleting=False, **ann) -> PodRecord:
    return PodRecord("ns", name, f"uid-{name}", "n1", (ip,) if ip else (), host_network, phase,
                     tuple(sorted(ann.items())), deleting=deleting)


def make_agent(dp, controller=None):
    holder = {}
    metrics = AgentMetrics(lambda: holder["a"].view())
    local = None if controller else functools.partial(LocalAllocator, floor_bps=1 * M)
    agent = Agent(AgentConfig("n1", ("eth0",), ("10.0.0.0/8",), controller=controller, default_floor_bps=1 * M),
                  dp, local, metrics=metrics)
    holder["a"] = agent
    return agent, metrics


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0


def test_which_pods_get_a_class():
    pods = shaped_pods([
        pod("host", "10.0.0.5", host_network=True),  # node traffic
        pod("done", "10.244.0.9", phase="Succeeded"),  # its IP is free again
        pod("waiting", None),
        pod("old", "10.244.0.10", deleting=True),  # being deleted; its IP went to "new"
        pod("new", "10.244.0.10"),
    ])
    got = {p.name: p.ips for p in pods}
    assert got == {"waiting": (), "old": (), "new": ("10.244.0.10",)}


def test_local_mode_shapes_a_new_pod_in_the_same_sync_and_tells_about_bad_annotations():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10", **{"netagent.io/egress-class": "gold"}),), CLASSES, BUDGETS))
    assert agent.sync()
    classes = {c.key: c for c in dp.applied[-1].shaper.pods}
    assert classes["ns/p"].ceil == wire(20 * M)  # the team's default class, bronze
    assert dp.applied[-1].shaper.node_rate == wire(1000 * M)  # the budget's total caps the node
    assert agent.pods[0].problems[0][0] == "UnknownEgressClass"


def test_restart_adopts_what_the_kernel_holds():
    minor = assign_minors([PodShape("ns/p", ("10.244.0.10",), 1, 1)])["ns/p"]
    dp = FakeDataPath(adopted={1: (700 * M, 700 * M), minor: (3 * M, 17 * M), 0xFFFE: (M, M)})
    agent, metrics = make_agent(dp)
    agent.start()
    try:
        agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
        deadline = time.monotonic() + 10
        while not dp.applied and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        agent.stop()
    desired = dp.applied[0]
    assert desired.shaper.node_rate == wire(700 * M)
    assert [(c.rate, c.ceil) for c in desired.shaper.pods] == [wire(3 * M, 17 * M)]


def test_controller_lease_then_floor_and_drift_accounting():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp, controller="http://controller")
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
    agent.set_allocations(AllocationSet(pods={"ns/p": Allocation(5 * M, 9 * M)}, node_rate_bps=50 * M,
                                        safe_floor_bps=2 * M, lease_expires=time.monotonic() + 60, source="controller"))
    assert agent.sync()
    assert [(c.rate, c.ceil) for c in dp.applied[-1].shaper.pods] == [wire(5 * M, 9 * M)]
    # the same plan again, yet the kernel needed changes: someone else changed it
    dp.next_changes = {"tc": 2, "iptables": 1}
    assert agent.sync()
    assert sample(metrics, "netagent_drift_repairs_total", kind="tc") == 2
    assert sample(metrics, "netagent_drift_repairs_total", kind="iptables") == 1
    # the lease runs out: the floor, never nothing
    dp.next_changes = {"tc": 1}
    agent.allocations.current.lease_expires = time.monotonic() - 1
    assert agent.sync()
    assert [(c.rate, c.ceil) for c in dp.applied[-1].shaper.pods] == [wire(2 * M, 2 * M)]
    assert agent.fail_static and agent.view().allocation_source == "floor"
    assert sample(metrics, "netagent_drift_repairs_total", kind="tc") == 2  # a planned change is not drift


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_failed_apply_is_retried_with_a_full_read_and_the_old_state_stays():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp)
    agent.start()
    try:
        agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
        wait_until(lambda: dp.applied)
        dp.fail_with = RuntimeError("netlink: device busy")
        agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"), pod("q", "10.244.0.11")), CLASSES, BUDGETS))
        wait_until(lambda: len(dp.applied) >= 2)  # the retry after the failure
        assert dp.full[-1] is True  # a retry re-reads the whole kernel state
        assert {c.key for c in dp.applied[-1].shaper.pods} == {"ns/p", "ns/q"}
        assert sample(metrics, "netagent_reconcile_errors_total", stage="apply") == 1
        assert agent.readiness()[0]
    finally:
        agent.stop()


def test_the_sampler_turns_class_counters_into_usage_and_demand():
    from tc.model import ClassStats

    dp = FakeDataPath()
    agent, _ = make_agent(dp)
    agent.on_snapshot(Snapshot((pod("p", "10.244.0.10"),), CLASSES, BUDGETS))
    assert agent.sync()
    minor = agent.node.state.minors["ns/p"]
    ceil = next(c.ceil for c in dp.applied[-1].shaper.pods if c.minor == minor)
    for sent in (0, 1_000_000):  # 1 MB in the interval between two samples
        dp.stats = {minor: ClassStats(minor, sent, sent // 1000, 0, 0, 0, 0, ceil // 8, ceil // 8)}
        agent.sampler.sample()
        time.sleep(0.2)
    view = {p.name: p for p in agent.view().pods}["p"]
    assert view.usage_bps > 0 and view.demand_bps >= view.usage_bps * 0.5
    assert not view.throttled
