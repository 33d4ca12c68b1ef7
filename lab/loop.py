"""The whole control loop without HTTP or clocks: the agents' demand estimator
(netagent.demand.PodDemand) and the allocation engine, one round per report period. Pure and
deterministic per seed. tests/test_closed_loop.py holds it to issue 5's convergence aims;
bench/estimator.py measures estimator variants with it (docs/allocation.md, "Demand estimation");
bench/simulation.py runs the same loop through the real controller."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np

from core.direction import Direction
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


def load(objs: list[dict]):
    """The loop's policy objects as the engine's Policy (they are the loop's own: no problems)."""
    policy, problems = load_policy([o for o in objs if o["kind"] == "EgressClass"],
                                   [o for o in objs if o["kind"] == "EgressBudget"])
    assert not problems, problems
    return policy


@dataclasses.dataclass
class Pod:
    key: str
    team: str
    cls: str
    weight: float
    min_bps: float
    max_bps: float
    demand: float  # the true appetite (its mean, when the loop jitters)
    limit: float = 1 * M  # the safe floor until the first answer
    sent: int = 0
    overlimits: int = 0
    estimator: PodDemand = dataclasses.field(default_factory=PodDemand)


class Loop:
    """`n` pods in three teams (lognormal demands adding up to ~1.6x the budget); `jitter`: each
    period every pod wants its demand times a uniform factor in [1 - jitter, 1 + jitter];
    `estimator`: the PodDemand class the agents run."""

    def __init__(self, seed: int, n: int = 120, jitter: float = 0.0, estimator: type[PodDemand] = PodDemand):
        self.policy = load(POLICY)
        rng = np.random.default_rng(seed)
        self.pods = []
        for i in range(n):
            team = ("research", "data", "web")[i % 3]
            spec = self.policy.classes["interactive" if team == "web" else "bulk"]
            up = spec.limits.upload
            self.pods.append(Pod(f"{team}/p{i}", team, spec.name, up.weight, up.min_bps, up.max_bps,
                                 float(rng.lognormal(0, 0.6)) * 1.6e9 / n, estimator=estimator()))
        self.jitter = jitter
        self.rng = np.random.default_rng(seed + 1000)
        self.result = None
        self.period = 0
        self.total = 0.0  # the measured total of the last period

    def inputs(self, demand) -> list[PodDemandIn]:
        return [PodDemandIn(p.key, p.team, p.cls, p.weight, p.min_bps, p.max_bps, demand(p)) for p in self.pods]

    def step(self) -> None:
        """One report period: pods send min(want, limit) (HTB marks the class over its ceil when
        it wants more), agents estimate demand, the controller allocates."""
        usage = 0.0
        for p in self.pods:
            want = p.demand * (1 + self.rng.uniform(-self.jitter, self.jitter)) if self.jitter else p.demand
            rate = min(want, p.limit)
            usage += rate
            p.sent += int(rate / 8)
            p.overlimits += want > p.limit * 1.001
            p.estimator.update(Sample(float(self.period), p.sent, 0, p.overlimits, 0), int(p.limit), int(p.max_bps),
                               answers=self.period)  # one answer per period
        self.total = usage * L3_PER_L2 + HOST_BPS
        first = self.period == 0
        self.result = allocate(self.policy, self.inputs(lambda p: p.estimator.demand_bps),
                               measured_total_bps=None if first else self.total, previous=self.result,
                               shaped_usage_bps=None if first else usage, same_window=True)  # as agents read them
        for p in self.pods:
            p.limit = max(self.result.pods[p.key].limit_bps, 1.0)
        self.period += 1

    def fair(self) -> dict[str, float]:
        """Each pod's fair share: the engine's answer for the true (mean) demands, at the capacity
        that puts the measured total on the budget."""
        capacity = (self.policy.totals.upload - HOST_BPS) / L3_PER_L2
        fair = allocate(dataclasses.replace(self.policy, totals=self.policy.totals.replace(Direction.UPLOAD, int(capacity))), self.inputs(lambda p: p.demand))
        return {p.key: fair.pods[p.key].allocation_bps for p in self.pods}

    def errors(self) -> dict[str, float]:
        """Each pod's distance from its fair share, by what it can send (its mean demand, at most
        its limit)."""
        fair = self.fair()
        return {p.key: abs(min(p.demand, p.limit) - fair[p.key]) / fair[p.key] for p in self.pods}

    def worst_error(self) -> float:
        return max(self.errors().values())

    def shift(self, seed: int) -> None:
        """Every other pod's demand changes, x0.3 or x2 (drawn from `seed`): the shift scenario."""
        rng = np.random.default_rng(seed + 100)
        for p in self.pods[::2]:
            p.demand *= rng.choice([0.3, 2.0])

    def run(self, periods: int) -> list[float]:
        errors = []
        for _ in range(periods):
            self.step()
            errors.append(self.worst_error())
        return errors


def cold_start(seed: int, estimator: type[PodDemand] = PodDemand, idle_periods: int = 4, horizon: int = 20) -> list[float]:
    """Every other pod idle for `idle_periods` answers (the others saturate the budget, so the idle
    pods' answers are a trickle), then all want their demand: the worst error per period after."""
    loop = Loop(seed, estimator=estimator)
    late = loop.pods[1::2]
    want = {p.key: p.demand for p in late}
    for p in late:
        p.demand = 0.0
    for _ in range(idle_periods):
        loop.step()
    for p in late:
        p.demand = want[p.key]
    return loop.run(horizon)


def jump_ratios(seed: int, estimator: type[PodDemand] = PodDemand, periods: int = 6) -> list[float]:
    """After 12 settled periods the smallest data pod's demand jumps tenfold: what it can send over
    its fair share, per period after."""
    loop = Loop(seed, estimator=estimator)
    loop.run(12)
    jumper = min((p for p in loop.pods if p.team == "data"), key=lambda p: p.demand)
    jumper.demand *= 10
    ratios = []
    for _ in range(periods):
        loop.step()
        ratios.append(min(jumper.demand, jumper.limit) / loop.fair()[jumper.key])
    return ratios


def class_change(seed: int, estimator: type[PodDemand] = PodDemand, periods: int = 10) -> tuple[float, list[float]]:
    """The demo's change: the data pod held furthest below its appetite moves from bulk to
    interactive (3x the weight) and the data team's weight triples. Its flow dipped under its limit
    for one period shortly before (TCP does that; the probe starts over). -> (how many times its fair
    share grew, the worst error per period after the change)."""
    loop = Loop(seed, estimator=estimator)
    loop.run(10)
    fair = loop.fair()
    pod = max((p for p in loop.pods if p.team == "data"), key=lambda p: p.demand / fair[p.key])
    want, pod.demand = pod.demand, 0.95 * pod.limit
    loop.step()
    pod.demand = want
    loop.run(3)
    objs = copy.deepcopy(POLICY)
    for team in objs[-1]["spec"]["teams"]:
        team["weight"] *= 3 if team["name"] == "data" else 1
    loop.policy = load(objs)
    spec = loop.policy.classes["interactive"]
    up = spec.limits.upload
    pod.cls, pod.weight, pod.min_bps, pod.max_bps = spec.name, up.weight, up.min_bps, up.max_bps
    grew = loop.fair()[pod.key] / fair[pod.key]
    return grew, loop.run(periods)


def new_pod(seed: int, estimator: type[PodDemand] = PodDemand, periods: int = 12) -> list[float]:
    """After 12 settled periods a data pod starts that wants more than any pod of its team gets (the
    budget is saturated, so its first answer, to a report with no sample of it, is a trickle): the
    worst error per period after (issue 37: "a pod starts")."""
    loop = Loop(seed, estimator=estimator)
    loop.run(12)
    spec = loop.policy.classes["bulk"]
    up = spec.limits.upload
    fair = loop.fair()
    want = 2 * max(fair[p.key] for p in loop.pods if p.team == "data")
    loop.pods.append(Pod("data/new", "data", spec.name, up.weight, up.min_bps, up.max_bps, want, estimator=estimator()))
    return loop.run(periods)


def pod_ends(seed: int, estimator: type[PodDemand] = PodDemand, periods: int = 12) -> list[float]:
    """After 12 settled periods the pod with the largest fair share leaves: the worst error per period
    after (issue 37: "a pod ends"; its share goes to the pods held below their appetite)."""
    loop = Loop(seed, estimator=estimator)
    loop.run(12)
    fair = loop.fair()
    loop.pods.remove(max(loop.pods, key=lambda p: fair[p.key]))
    return loop.run(periods)


def settled(errors: list[float]) -> int:
    """Periods until every pod is within 5 % and stays: 0 when the answer to the first report after
    the event already did it; len(errors) + 1 when never."""
    return next((i for i in range(len(errors)) if max(errors[i:]) <= TOLERANCE), len(errors) + 1)


class ClimbOnly(PodDemand):
    """The estimator without its wake and held asks (the baseline the benchmark and the tests compare
    with): a pod climbs from its limit by 1.25x, then doublings, one answer each."""

    held_answers = 1 << 62

    def woke(self, jumped: bool, limit_bps: int) -> bool:
        return False
