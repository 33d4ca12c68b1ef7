"""The whole control loop without HTTP or clocks: the agents' demand estimator
(netagent.demand.PodDemand) and the allocation engine, one round per report period, against
issue 5's convergence aims: every pod within 5% of its fair share within 2 periods of a
demand shift, a pod whose demand jumps 10x at its fair share within 4, the measured total
within 5% of the budget. bench/simulation.py runs the same loop through the real controller."""
import dataclasses
import math

import numpy as np
import pytest

from core.engine import PodDemandIn, allocate
from core.policy import load_policy
from netagent.demand import PodDemand, Sample

M = 1e6
L3_PER_L2 = 0.955  # the nodes count IP bytes (GSO: one header per 64 KiB), HTB counts frames
HOST_BPS = 30 * M  # unshaped host-network traffic, in the measured total only
TOLERANCE = 0.05

POLICY = [
    {"kind": "EgressClass", "metadata": {"name": "bulk"}, "spec": {"weight": 1, "max": "60M"}},
    {"kind": "EgressClass", "metadata": {"name": "interactive"}, "spec": {"weight": 3, "min": "2M"}},
    {"kind": "EgressBudget", "metadata": {"name": "default"}, "spec": {"total": "1G", "teams": [
        {"name": "research", "namespaces": ["research"], "weight": 1, "defaultClass": "bulk"},
        {"name": "data", "namespaces": ["data"], "weight": 2, "defaultClass": "bulk", "min": "100M"},
        {"name": "web", "namespaces": ["web"], "weight": 3, "defaultClass": "interactive"}]}},
]


@dataclasses.dataclass
class Pod:
    key: str
    team: str
    cls: str
    weight: float
    min_bps: float
    max_bps: float
    demand: float  # the true appetite
    limit: float = 1 * M  # the safe floor until the first answer
    sent: int = 0
    overlimits: int = 0
    estimator: PodDemand = dataclasses.field(default_factory=PodDemand)


class Loop:
    def __init__(self, seed: int, n: int = 120):
        self.policy, problems = load_policy([o for o in POLICY if o["kind"] == "EgressClass"],
                                            [o for o in POLICY if o["kind"] == "EgressBudget"])
        assert not problems, problems
        rng = np.random.default_rng(seed)
        self.pods = []
        for i in range(n):
            team = ("research", "data", "web")[i % 3]
            spec = self.policy.classes["interactive" if team == "web" else "bulk"]
            self.pods.append(Pod(f"{team}/p{i}", team, spec.name, spec.weight, spec.min_bps, spec.max_bps,
                                 float(rng.lognormal(0, 0.6)) * 1.6e9 / n))
        self.result = None
        self.period = 0
        self.total = 0.0  # the measured total of the last period

    def inputs(self, demand) -> list[PodDemandIn]:
        return [PodDemandIn(p.key, p.team, p.cls, p.weight, p.min_bps, p.max_bps, demand(p)) for p in self.pods]

    def step(self) -> None:
        """One report period: pods send min(demand, limit) (HTB marks the class over its ceil when
        it wants more), agents estimate demand, the controller allocates."""
        usage = 0.0
        for p in self.pods:
            rate = min(p.demand, p.limit)
            usage += rate
            p.sent += int(rate / 8)
            p.overlimits += p.demand > p.limit * 1.001
            p.estimator.update(Sample(float(self.period), p.sent, 0, p.overlimits, 0), int(p.limit), int(p.max_bps))
        self.total = usage * L3_PER_L2 + HOST_BPS
        first = self.period == 0
        self.result = allocate(self.policy, self.inputs(lambda p: p.estimator.demand_bps),
                               measured_total_bps=None if first else self.total, previous=self.result,
                               shaped_usage_bps=None if first else usage)
        for p in self.pods:
            p.limit = max(self.result.pods[p.key].limit_bps, 1.0)
        self.period += 1

    def worst_error(self) -> float:
        """The worst pod's distance from its fair share (the engine's answer for the true demands,
        at the capacity that puts the measured total on the budget), by what it can send."""
        capacity = (self.policy.total_bps - HOST_BPS) / L3_PER_L2
        fair = allocate(dataclasses.replace(self.policy, total_bps=int(capacity)), self.inputs(lambda p: p.demand))
        return max(abs(min(p.demand, p.limit) - fair.pods[p.key].allocation_bps) / fair.pods[p.key].allocation_bps
                   for p in self.pods)

    def run(self, periods: int) -> list[float]:
        errors = []
        for _ in range(periods):
            self.step()
            errors.append(self.worst_error())
        return errors


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_pod_within_5_percent_of_fair_two_periods_after_a_shift(seed):
    loop = Loop(seed)
    loop.run(12)
    rng = np.random.default_rng(seed + 100)
    for p in loop.pods[::2]:
        p.demand *= rng.choice([0.3, 2.0])
    errors = loop.run(8)
    # errors[0] is after the first round that saw the shift; "within 2 periods" is errors[2:]
    assert max(errors[2:]) <= TOLERANCE, errors
    assert abs(loop.total / loop.policy.total_bps - 1) <= TOLERANCE


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_pod_whose_demand_jumps_tenfold_gets_its_fair_share_within_4_periods(seed):
    loop = Loop(seed)
    loop.run(12)
    jumper = min((p for p in loop.pods if p.team == "data"), key=lambda p: p.demand)
    jumper.demand *= 10
    fair = []
    for _ in range(6):
        loop.step()
        capacity = (loop.policy.total_bps - HOST_BPS) / L3_PER_L2
        share = allocate(dataclasses.replace(loop.policy, total_bps=int(capacity)),
                         loop.inputs(lambda p: p.demand)).pods[jumper.key].allocation_bps
        fair.append(min(jumper.demand, jumper.limit) / share)
    assert all(f >= 1 - TOLERANCE for f in fair[4:]), fair
    assert min(fair[3:]) >= 1 - TOLERANCE, fair


def test_measured_total_settles_at_the_budget_through_the_gain():
    loop = Loop(4)
    loop.run(15)
    assert loop.total == pytest.approx(loop.policy.total_bps, rel=0.02)
    assert loop.result.gain == pytest.approx((1e9 - HOST_BPS) / 1e9 / L3_PER_L2, rel=0.01)


def test_a_bursty_pod_lends_its_share_between_bursts_and_climbs_back_by_probing():
    """Idle between bursts, its share goes to others (a guarantee is up to demand). When it bursts
    again with the budget saturated it has no headroom: it climbs 1.25x, then 2x per period, so it
    is back at its fair share after 1 + ceil(log2(share / (1.25 x idle rate))) periods; the other
    pods stay within 5% of their fair share throughout once it is settled."""
    loop = Loop(5)
    bursty = loop.pods[7]
    base = bursty.demand
    loop.run(10)
    for _ in range(2):
        bursty.demand = 0.05 * base
        loop.run(3)
        assert loop.worst_error() <= TOLERANCE  # its share went to the others
        idle_limit = bursty.limit
        bursty.demand = 3 * base
        capacity = (loop.policy.total_bps - HOST_BPS) / L3_PER_L2
        share = allocate(dataclasses.replace(loop.policy, total_bps=int(capacity)),
                         loop.inputs(lambda p: p.demand)).pods[bursty.key].allocation_bps
        periods = 1 + math.ceil(math.log2(share / (1.25 * idle_limit)))
        errors = loop.run(periods + 1)
        assert errors[periods] <= TOLERANCE, (periods, errors)
