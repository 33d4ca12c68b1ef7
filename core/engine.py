"""The allocation engine: budget -> teams -> pods, weighted max-min fair with guarantees and caps.

Pure numpy, no I/O, deterministic (same input, same output). The columnar entry point
`allocate_columns` takes one array per attribute, so the controller and the benchmarks
can allocate 1M pods without a Python object per pod; `allocate` is the convenience
form over `PodDemandIn` objects. The semantics, and why limits never add up to more
than the budget, are in docs/allocation.md.

At each level (teams sharing the budget, then pods sharing their team's share) a
member's *floor* is its guarantee capped by its demand and its *upper* bound is
min(cap, demand). Floors come first; when they alone exceed the capacity they are
scaled down proportionally; otherwise every member gets clamp(level x weight, floor,
upper), with one water level per group chosen so the group's capacity is used
exactly (or every member is satisfied).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from .direction import Direction
from .policy import Policy
from .quantity import MAX_BPS


class EngineError(ValueError):
    """Input the engine cannot allocate (NaN, negative rates, unknown team index...)."""


@dataclass(frozen=True)
class EngineConfig:
    """Tunables of the engine (headroom, hysteresis, feedback gain bounds)."""
    hysteresis: float = 0.02  # relative change below which the previous number is kept (well inside the 5% convergence aim)
    # ... unless the round hands out the whole capacity and what is kept would leave more than this
    # share of it unspent: then the held increases go out. Pods that climb towards their shares in
    # steps under the hysteresis otherwise stop up to 2 % short of them, every one, and a contended
    # budget stays 2 % unspent (the demo after its class change: 118.1 of 120 Mbit/s in limits).
    held_back_max: float = 0.005
    gain_min: float = 0.5  # bounds of the feedback gain on the budget
    gain_max: float = 1.5
    # share of the distance to the plant's gain (feedback_gain) moved per feedback: all of it (issue 37). It
    # is a property of the plant, not an error to integrate; a half step only left the cold start 2-3 %
    # over the budget for 2 more periods
    gain_smoothing: float = 1.0
    gain_deadband: float = 0.005  # the gain stays when the feedback's is this close to it
    gain_min_usage: float = 0.05  # the pods' usage must be this share of the budget for a feedback to mean anything
    # unless both cover the same seconds (`same_window`), the gain moves only when the pods' usage
    # and the measured total, each as a share of the capacity they ran under, both moved less than
    # this since the last feedback: in a transient (a node's pods starting) an older agent's two
    # numbers cover different windows (its last 1 s sample against its node's counter since the last
    # report) and together they say nothing of the plant
    gain_steady: float = 0.03


# -- the water-fill: one level, many groups at once ------------------------------------------

_REL_TOL = 1e-12  # the water level is accepted once a group's total is this close below its capacity
_MAX_STEPS = 200  # bisection alone would need ~60 per group; Newton steps typically settle in under 20


class Fill(NamedTuple):
    """One water-fill's result: per-member allocations and the level reached per group."""
    allocation: np.ndarray  # per member
    scaled: np.ndarray  # per group: its floors exceeded its capacity and were scaled down
    level: np.ndarray  # per group: the water level (NaN where no water-fill was needed)


def waterfill(group: np.ndarray, n_groups: int, capacity: np.ndarray, weight: np.ndarray,
              floor: np.ndarray, upper: np.ndarray, start: np.ndarray | None = None) -> Fill:
    """Share capacity[g] among the members of each group g.

    Requires weight > 0 and 0 <= floor <= upper. A group whose floors alone exceed its capacity
    gets floor x capacity/sum(floors) (`scaled`); one whose uppers fit gets the uppers; the
    others get clamp(level[g] x weight, floor, upper) with sum == capacity[g] (never above).

    The level solves the piecewise-linear, non-decreasing f(level) = sum clamp(level*w, floor,
    upper) = capacity with safeguarded Newton steps, vectorised over all groups: each step is a
    few passes over the members (bincount per group), and a Newton step taken inside the linear
    piece that holds the root lands on it, so a handful of steps suffice without sorting.
    `start` (per group, e.g. the previous round's levels) is the first guess where usable:
    after a small change the search ends in one or two steps.
    """
    capacity = np.asarray(capacity, dtype=np.float64)
    floors = np.bincount(group, floor, n_groups)
    uppers = np.bincount(group, upper, n_groups)
    scaled = floors > capacity
    satisfied = ~scaled & (uppers <= capacity)
    fill = ~scaled & ~satisfied
    ratio = np.where(scaled, capacity / np.where(scaled, floors, 1.0), 1.0)
    alloc = np.where(scaled[group], floor * ratio[group], upper)
    level = np.full(n_groups, np.nan)
    if fill.any():
        members = slice(None) if fill.all() else np.flatnonzero(fill[group])  # a slice copies nothing
        found = _water_level(group[members], n_groups, capacity, fill, weight[members], floor[members],
                             upper[members], floors, start)
        level = np.where(fill, found, np.nan)
        alloc[members] = np.minimum(np.maximum(found[group[members]] * weight[members], floor[members]),
                                    upper[members])
    return Fill(alloc, scaled, level)


def _water_level(gi: np.ndarray, n: int, capacity: np.ndarray, open_: np.ndarray, w: np.ndarray,
                 fl: np.ndarray, up: np.ndarray, floors: np.ndarray, start: np.ndarray | None) -> np.ndarray:
    """Per group: the largest level with sum clamp(level*w, floor, upper) <= capacity, to _REL_TOL.
    `start` (e.g. the previous round's levels) replaces the first guess where it is usable."""
    weights = np.bincount(gi, w, n)
    lo = np.zeros(n)  # f(lo) <= capacity: the answer if the search stops early
    hi = np.full(n, float(np.max(up / w)))  # f(hi) = sum of uppers > capacity
    level = np.where(weights > 0, (capacity - floors) / np.where(weights > 0, weights, 1.0), 0.0)
    if start is not None and start.shape == level.shape:
        level = np.where(np.isfinite(start) & (start > 0), start, level)
    level = np.minimum(np.maximum(level, lo), hi)
    tol = _REL_TOL * np.maximum(capacity, 1.0)
    open_ = open_.copy()
    for _ in range(_MAX_STEPS):
        x = level[gi] * w
        f = np.bincount(gi, np.minimum(np.maximum(x, fl), up), n)
        slope = np.bincount(gi, w * ((x > fl) & (x < up)), n)
        err = capacity - f
        below = err >= 0
        lo = np.where(open_ & below, level, lo)
        hi = np.where(open_ & ~below, level, hi)
        found = below & (err <= tol) | (hi - lo <= 4 * np.finfo(float).eps * hi)
        open_ &= ~found
        if not open_.any():
            break
        newton = level + err / np.where(slope > 0, slope, 1.0)
        step = np.where((slope > 0) & (newton > lo) & (newton < hi), newton, 0.5 * (lo + hi))
        level = np.where(open_, step, level)
        if np.count_nonzero(open_[gi]) < 0.8 * gi.size:  # enough groups settled: work only on the rest
            keep = open_[gi]
            gi, w, fl, up = gi[keep], w[keep], fl[keep], up[keep]
    return lo


# -- the columnar engine ---------------------------------------------------------------------

@dataclass(frozen=True)
class TeamColumns:
    """The policy's teams as columns (weight, guarantee, cap), indexed like `Policy.teams`."""
    names: tuple[str, ...]
    weight: np.ndarray
    min_bps: np.ndarray
    max_bps: np.ndarray

    @classmethod
    def from_policy(cls, policy: Policy, direction: Direction = Direction.UPLOAD) -> "TeamColumns":
        """The columns of `policy.teams` in direction `direction`, in its order."""
        limits = [t.limits[direction] for t in policy.teams]
        return cls(tuple(t.name for t in policy.teams), np.array([x.weight for x in limits], dtype=np.float64),
                   np.array([x.min_bps for x in limits], dtype=np.float64),
                   np.array([x.max_bps for x in limits], dtype=np.float64))


@dataclass(frozen=True)
class PodColumns:
    """Pods as columns: team index, weight, guarantee, cap and demand (bit/s)."""
    team: np.ndarray  # index into TeamColumns
    weight: np.ndarray  # > 0 (the class weight)
    min_bps: np.ndarray  # guarantee
    max_bps: np.ndarray  # cap (class max tightened by the bandwidth annotation)
    demand_bps: np.ndarray

    def __len__(self) -> int:
        return int(self.team.size)


@dataclass
class ColumnarResult:
    """What `allocate_columns` returns: per-pod allocations and limits, per-team totals, the gain."""
    allocation: np.ndarray  # per pod, bit/s: the fair share (HTB rate)
    limit: np.ndarray  # per pod: allocation + headroom, <= the pod's cap (HTB ceil)
    team_allocation: np.ndarray
    team_limit: np.ndarray
    team_demand: np.ndarray  # raw demand sum
    team_guarantee: np.ndarray  # the floor the team got at the top level (before scaling)
    team_pods: np.ndarray
    team_scaled: np.ndarray  # its pods' guarantees exceeded the team's share and were scaled down
    team_level: np.ndarray  # the pods' water level in each team (NaN: none needed); next round's first guess
    total_bps: float  # the budget
    capacity_bps: float  # the budget x the feedback gain: what was shared this round
    gain: float
    guaranteed_bps: float  # sum of configured guarantees (team min or its pods' mins, within team max)
    oversubscribed: bool  # configured guarantees exceed the budget
    scaled: bool  # this round the teams' guarantees exceeded the capacity and were scaled down
    held: int  # pods whose small change was not pushed (hysteresis)
    # (shaped usage, measured total) / the capacity they ran under, at the last feedback: the
    # next feedback moves the gain only if it is steady against this (EngineConfig.gain_steady)
    feedback_point: tuple[float, float] | None = None


def _check(pods: PodColumns, n_teams: int) -> None:
    n = len(pods)
    for name in ("weight", "min_bps", "max_bps", "demand_bps"):
        column = getattr(pods, name)
        if column.shape != (n,):
            raise EngineError(f"pod column {name} has shape {column.shape}, expected ({n},)")
        if not np.isfinite(column).all() or (column < 0).any():
            bad = int(np.flatnonzero(~np.isfinite(column) | (column < 0))[0])
            raise EngineError(f"pod #{bad}: {name} is {float(column[bad])}; rates and weights must be finite and >= 0")
    if n and not (pods.weight > 0).all():
        raise EngineError(f"pod #{int(np.argmin(pods.weight))}: weight must be > 0")
    if n and (pods.team.min() < 0 or pods.team.max() >= n_teams):
        raise EngineError(f"pod team index out of range 0..{n_teams - 1}")


def feedback_gain(previous_gain: float, total_bps: float, measured_total_bps: float | None,
                  shaped_usage_bps: float | None, config: EngineConfig = EngineConfig()) -> float:
    """The next gain on the budget: the capacity that puts the measured internet egress
    (`measured_total_bps`: everything the nodes sent, host traffic included) on the budget, from what
    the pods' classes sent (`shaped_usage_bps`, what allocations govern) in the same seconds, bounded:

        capacity = budget - (measured - shaped),  gain = capacity / budget

    The unshaped part (measured - shaped: host traffic, the default class for unknown sources) is
    what the pods cannot have. Agents count both in IP bytes (docs/datapath.md), so that part does
    not grow with the pods' usage, and one feedback at any usage gives the gain: a cold start's first
    one, with the pods at a quarter of the budget, as well as a steady plant's (issue 37; the ratio
    shaped / measured it replaced read usage / (usage + U) there, 0.885 for 0.970 in
    bench/simulation.py). Where the two counts differ by a factor k (an older agent's node counter
    counting GSO packets' headers once: k = 0.955), the measured total still settles on the budget,
    each feedback leaving k - 1 of the last one's error.

    It is a property of the plant, not of demand: pods that use less than they were given
    lower both numbers alike, so the gain never pushes more share out while pods catch up
    with a new allocation (that fought the water-fill and overshot after every shift)."""
    if (measured_total_bps is None or shaped_usage_bps is None or total_bps >= MAX_BPS
            or not math.isfinite(measured_total_bps) or not math.isfinite(shaped_usage_bps)
            or measured_total_bps <= 0 or shaped_usage_bps < config.gain_min_usage * total_bps):
        return previous_gain
    target = min(max(1.0 - (measured_total_bps - shaped_usage_bps) / total_bps, config.gain_min), config.gain_max)
    if abs(target / previous_gain - 1.0) <= config.gain_deadband:
        return previous_gain
    return float(previous_gain + config.gain_smoothing * (target - previous_gain))


def allocate_columns(teams: TeamColumns, pods: PodColumns, total_bps: float,
                     measured_total_bps: float | None = None,
                     previous: ColumnarResult | None = None,
                     config: EngineConfig = EngineConfig(),
                     shaped_usage_bps: float | None = None, same_window: bool = False) -> ColumnarResult:
    """Allocate `total_bps` across teams and pods. `previous`, if given, must be aligned with
    `pods` (same pod at the same index; NaN for a pod it did not have) for hysteresis, and
    carries the feedback gain, which moves only when both the measured total and the pods'
    usage behind it are given (see `feedback_gain`); `same_window`: the two cover the same
    seconds, so no steady plant is needed for the gain to move (see `_gain`)."""
    n_teams = len(teams.names)
    _check(pods, n_teams)
    team = pods.team.astype(np.intp, copy=False)
    upper = np.minimum(pods.max_bps, pods.demand_bps)
    floor = np.minimum(pods.min_bps, upper)

    team_upper = np.minimum(teams.max_bps, np.bincount(team, upper, n_teams))
    team_floor = np.minimum(team_upper, np.maximum(teams.min_bps, np.bincount(team, floor, n_teams)))
    configured = np.minimum(teams.max_bps, np.maximum(teams.min_bps, np.bincount(team, pods.min_bps, n_teams)))
    guaranteed = float(configured.sum())

    gain, point = _gain(previous, total_bps, measured_total_bps, shaped_usage_bps, config, same_window)
    capacity = min(total_bps * gain, float(MAX_BPS))

    one = np.zeros(n_teams, dtype=np.intp)
    team_alloc, top_scaled, _ = waterfill(one, 1, np.array([capacity]), teams.weight, team_floor, team_upper)
    start = previous.team_level if previous is not None else None
    alloc, team_scaled, team_level = waterfill(team, n_teams, team_alloc, pods.weight, floor, upper, start)

    limit = _headroom(team, n_teams, teams, pods, alloc, team_alloc, capacity)

    held = 0
    if previous is not None and previous.allocation.shape == alloc.shape:
        alloc, h1 = _hold(team, n_teams, teams.max_bps, capacity, previous.allocation, alloc,
                          np.where(team_scaled[team], 0.0, floor), pods.max_bps, config.hysteresis,
                          config.held_back_max)
        limit, h2 = _hold(team, n_teams, teams.max_bps, capacity, previous.limit, np.maximum(limit, alloc),
                          alloc, pods.max_bps, config.hysteresis, config.held_back_max)
        held = int(np.count_nonzero(h1 | h2))
        limit = _fit_headroom(team, n_teams, teams.max_bps, capacity, alloc, limit)

    return ColumnarResult(
        allocation=alloc, limit=limit,
        team_allocation=np.bincount(team, alloc, n_teams), team_limit=np.bincount(team, limit, n_teams),
        team_demand=np.bincount(team, pods.demand_bps, n_teams), team_guarantee=team_floor,
        team_pods=np.bincount(team, minlength=n_teams), team_scaled=team_scaled, team_level=team_level,
        total_bps=float(total_bps), capacity_bps=capacity, gain=gain, guaranteed_bps=guaranteed,
        oversubscribed=guaranteed > total_bps, scaled=bool(top_scaled[0]), held=held, feedback_point=point)


def _gain(previous: ColumnarResult | None, total_bps: float, measured_total_bps: float | None,
          shaped_usage_bps: float | None, config: EngineConfig,
          same_window: bool = False) -> tuple[float, tuple[float, float] | None]:
    """This round's gain and feedback point: `feedback_gain` when the two numbers cover the same
    seconds (`same_window`) or this feedback is steady against the last one (both numbers within
    `gain_steady` of the capacity they ran under); else the gain held. Without `same_window` the
    first feedback only sets the point: a start is a transient too."""
    gain = previous.gain if previous is not None else 1.0
    last = previous.feedback_point if previous is not None else None
    if measured_total_bps is None or shaped_usage_bps is None:
        return gain, last
    ran_under = previous.capacity_bps if previous is not None else total_bps * gain
    if not (ran_under > 0 and math.isfinite(ran_under) and math.isfinite(measured_total_bps)
            and math.isfinite(shaped_usage_bps)):
        return gain, last
    point = (shaped_usage_bps / ran_under, measured_total_bps / ran_under)
    if not same_window and (last is None or max(abs(point[0] - last[0]), abs(point[1] - last[1]))
                            > config.gain_steady):
        return gain, point
    return feedback_gain(gain, total_bps, measured_total_bps, shaped_usage_bps, config), point


def _headroom(team: np.ndarray, n_teams: int, teams: TeamColumns, pods: PodColumns, alloc: np.ndarray,
              team_alloc: np.ndarray, capacity: float) -> np.ndarray:
    """Limits: each pod's allocation plus a share of what nobody uses, such that the limits of all
    pods together never exceed the capacity (so everyone growing at once cannot blow the budget).

    The unused capacity goes to teams by weight (a water-fill over the teams whose pods could take
    more), and inside a team to its pods below their cap by weight, each up to its cap."""
    room = pods.max_bps - alloc
    has_room = room > 0
    team_cap = np.minimum(teams.max_bps, np.minimum(np.bincount(team, pods.max_bps, n_teams), capacity))
    team_cap = np.maximum(team_cap, team_alloc)
    one = np.zeros(n_teams, dtype=np.intp)
    team_limit = waterfill(one, 1, np.array([capacity]), teams.weight, team_alloc, team_cap).allocation
    spare = np.maximum(team_limit - np.bincount(team, alloc, n_teams), 0.0)
    open_weight = np.bincount(team, pods.weight * has_room, n_teams)
    share = np.where(open_weight > 0, spare / np.where(open_weight > 0, open_weight, 1.0), 0.0)
    return np.where(has_room, np.minimum(pods.max_bps, alloc + share[team] * pods.weight), alloc)


def _fit_headroom(team: np.ndarray, n_teams: int, team_max: np.ndarray, capacity: float, alloc: np.ndarray,
                  limit: np.ndarray) -> np.ndarray:
    """After hysteresis kept some older, larger numbers: shrink the headroom (never an allocation)
    so limits again fit each team's max and the capacity."""
    headroom = limit - alloc
    team_alloc = np.bincount(team, alloc, n_teams)
    team_headroom = np.bincount(team, headroom, n_teams)
    with np.errstate(divide="ignore", invalid="ignore"):
        k_team = np.clip(np.where(team_headroom > 0, (team_max - team_alloc) / team_headroom, 1.0), 0.0, 1.0)
    headroom = headroom * k_team[team]
    total_headroom = float(headroom.sum())
    if total_headroom > 0 and alloc.sum() + total_headroom > capacity:
        headroom *= max(0.0, (capacity - float(alloc.sum())) / total_headroom)
    out: np.ndarray = alloc + headroom
    return out


def _hold(team: np.ndarray, n_teams: int, team_max: np.ndarray, capacity: float, before: np.ndarray,
          after: np.ndarray, low: np.ndarray, cap: np.ndarray, threshold: float,
          held_back_max: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Keep `before` where it differs from `after` by less than `threshold` and stays within
    [low, cap]; but a held decrease is pushed after all when keeping it would put a team over
    its max or all pods over the capacity (cuts forced by the budget always go out), and held
    increases are pushed when this round hands out the whole capacity (within `held_back_max`)
    and what is kept would leave more than `held_back_max` of it unspent (a contended budget
    is spent, also when the pods climb to their shares in small steps)."""
    with np.errstate(invalid="ignore"):
        held = (np.isfinite(before) & (np.abs(after - before) <= threshold * np.maximum(after, before))
                & (before >= low) & (before <= cap))
    kept = np.where(held, before, after)
    decrease = held & (before > after)
    over_team = np.bincount(team, kept, n_teams) > team_max
    if kept.sum() > capacity:
        push = decrease
    else:
        push = decrease & over_team[team]
    full = (1.0 - held_back_max) * capacity
    if held_back_max > 0 and float(after.sum()) >= full and float(np.where(push, after, kept).sum()) < full:
        push = push | (held & (before < after))
    if push.any():
        held &= ~push
        kept = np.where(held, before, after)
        # the increases pushed may leave the decreases still held over the capacity or a team's max
        decrease = held & (before > after)
        if kept.sum() > capacity:
            held &= ~decrease
        else:
            held &= ~(decrease & (np.bincount(team, kept, n_teams) > team_max)[team])
        kept = np.where(held, before, after)
    return kept, held & (before != after)


# -- the object form -------------------------------------------------------------------------

@dataclass(frozen=True)
class PodDemandIn:
    """One pod as `allocate` takes it: its resolved policy and its demand."""
    key: str  # "namespace/name"
    team: str
    egress_class: str
    weight: float
    min_bps: float
    max_bps: float
    demand_bps: float


@dataclass(frozen=True)
class PodResult:
    """One pod's answer: its fair share (HTB rate) and its limit (HTB ceil)."""
    allocation_bps: float  # the fair share
    limit_bps: float  # allocation + headroom, never above the pod's cap


@dataclass(frozen=True)
class Totals:
    """Allocated, demanded and guaranteed bit/s of one team or class."""
    allocated_bps: float
    limit_bps: float
    demand_bps: float
    min_bps: float  # the guarantee in effect (team: its floor this round; class: its pods' guarantees)
    pods: int
    scaled: bool = False  # guarantees exceeded the share and were scaled down


@dataclass
class AllocationResult:
    """What `allocate` returns: per pod, per team and per class, and the engine state for hysteresis."""
    pods: dict[str, PodResult]
    teams: dict[str, Totals]
    classes: dict[str, Totals]
    total_bps: float
    capacity_bps: float  # total x gain
    gain: float
    allocated_bps: float
    demand_bps: float
    guaranteed_bps: float
    oversubscribed: bool  # configured guarantees exceed the budget (status condition Oversubscribed)
    scaled: bool  # guarantees were scaled down this round
    held: int
    columns: ColumnarResult = field(repr=False)
    keys: tuple[str, ...] = field(repr=False, default=())


def allocate(policy: Policy, pods: Sequence[PodDemandIn], measured_total_bps: float | None = None,
             previous: AllocationResult | None = None, config: EngineConfig = EngineConfig(),
             shaped_usage_bps: float | None = None, direction: Direction = Direction.UPLOAD,
             same_window: bool = False) -> AllocationResult:
    """Allocate the policy's budget in `direction` to `pods` (their values for that direction).
    A pod naming a team the policy does not have is counted in the default team (the policy
    changed since it was resolved)."""
    teams = TeamColumns.from_policy(policy, direction)
    index = policy.team_index()
    default = index[policy.default_team]
    keys = tuple(p.key for p in pods)
    if len(set(keys)) != len(keys):
        raise EngineError("pod keys must be unique")
    columns = PodColumns(
        team=np.fromiter((index.get(p.team, default) for p in pods), dtype=np.intp, count=len(pods)),
        weight=np.fromiter((p.weight for p in pods), dtype=np.float64, count=len(pods)),
        min_bps=np.fromiter((p.min_bps for p in pods), dtype=np.float64, count=len(pods)),
        max_bps=np.fromiter((p.max_bps for p in pods), dtype=np.float64, count=len(pods)),
        demand_bps=np.fromiter((p.demand_bps for p in pods), dtype=np.float64, count=len(pods)),
    )
    prev_columns = None
    if previous is not None:
        prev_columns = _realign(previous, keys)
    result = allocate_columns(teams, columns, float(policy.totals[direction]), measured_total_bps, prev_columns, config,
                              shaped_usage_bps, same_window)

    pod_results = {k: PodResult(float(a), float(l)) for k, a, l in zip(keys, result.allocation, result.limit)}
    team_totals = {
        name: Totals(float(result.team_allocation[i]), float(result.team_limit[i]), float(result.team_demand[i]),
                     float(result.team_guarantee[i]), int(result.team_pods[i]), bool(result.team_scaled[i]))
        for i, name in enumerate(teams.names)
    }
    return AllocationResult(
        pods=pod_results, teams=team_totals, classes=_class_totals(pods, columns, result),
        total_bps=result.total_bps, capacity_bps=result.capacity_bps, gain=result.gain,
        allocated_bps=float(result.allocation.sum()), demand_bps=float(columns.demand_bps.sum()),
        guaranteed_bps=result.guaranteed_bps, oversubscribed=result.oversubscribed, scaled=result.scaled,
        held=result.held, columns=result, keys=keys)


def _realign(previous: AllocationResult, keys: tuple[str, ...]) -> ColumnarResult:
    """The previous round's per-pod numbers in this round's pod order (NaN for new pods)."""
    prev = previous.columns
    if previous.keys == keys:
        return prev
    position: Mapping[str, int] = {k: i for i, k in enumerate(previous.keys)}
    at = np.fromiter((position.get(k, -1) for k in keys), dtype=np.intp, count=len(keys))
    known = at >= 0
    return replace(prev, allocation=np.where(known, prev.allocation[at], np.nan),
                   limit=np.where(known, prev.limit[at], np.nan))


def _class_totals(pods: Sequence[PodDemandIn], columns: PodColumns, result: ColumnarResult) -> dict[str, Totals]:
    names = sorted({p.egress_class for p in pods})
    index = {n: i for i, n in enumerate(names)}
    cls = np.fromiter((index[p.egress_class] for p in pods), dtype=np.intp, count=len(pods))
    n = len(names)
    floor = np.minimum(columns.min_bps, np.minimum(columns.max_bps, columns.demand_bps))
    sums = {name: np.bincount(cls, values, n) for name, values in
            (("a", result.allocation), ("l", result.limit), ("d", columns.demand_bps), ("m", floor))}
    count = np.bincount(cls, minlength=n)
    return {name: Totals(float(sums["a"][i]), float(sums["l"][i]), float(sums["d"][i]), float(sums["m"][i]),
                         int(count[i])) for i, name in enumerate(names)}
