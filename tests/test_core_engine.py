"""The allocation engine: hand-worked cases and hypothesis properties (pure, no root)."""
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from core.engine import (EngineConfig, EngineError, PodColumns, PodDemandIn, TeamColumns, allocate,
                               allocate_columns, feedback_gain, waterfill)
from core.policy import load_policy
from core.quantity import MAX_BPS

INF = float(MAX_BPS)
M = 1_000_000


def policy_from(text):
    docs = list(yaml.safe_load_all(text))
    policy, problems = load_policy([d for d in docs if d["kind"] == "EgressClass"],
                                   [d for d in docs if d["kind"] == "EgressBudget"])
    assert all("Oversubscribed" in p for p in problems), problems
    return policy


def flat(capacity, weights, floors, uppers):
    n = len(weights)
    alloc, scaled, _ = waterfill(np.zeros(n, dtype=np.intp), 1, np.array([float(capacity)]),
                                 np.array(weights, float), np.array(floors, float), np.array(uppers, float))
    return list(np.round(alloc, 6)), bool(scaled[0])


# -- hand-worked, one level ------------------------------------------------------------------

def test_equal_weights_small_demand_satisfied_rest_split():
    # 100 among demands 10, 50, 100: 10 is satisfied, the other two split 90
    assert flat(100, [1, 1, 1], [0, 0, 0], [10, 50, 100]) == ([10, 45, 45], False)


def test_weights_split_in_proportion():
    assert flat(100, [1, 2, 1], [0, 0, 0], [100, 100, 100]) == ([25, 50, 25], False)


def test_guarantee_is_a_floor_not_a_bonus():
    # level 15: A is satisfied at 10, B (weight 2) gets 30, C's weighted share 15 is below its floor 60
    assert flat(100, [1, 2, 1], [0, 0, 60], [10, 100, 100]) == ([10, 30, 60], False)


def test_guarantee_overflow_scales_floors_proportionally():
    # floors 50 + 50 + 100 = 200 on a capacity of 100: everyone gets half of their floor
    assert flat(100, [1, 2, 1], [50, 50, 100], [100, 100, 100]) == ([25, 25, 50], True)


def test_everyone_satisfied_gets_the_demand():
    assert flat(100, [1, 1], [0, 0], [30, 40]) == ([30, 40], False)


def test_zero_capacity_and_zero_demand():
    assert flat(0, [1, 1], [0, 0], [30, 40]) == ([0, 0], False)
    assert flat(100, [1, 1], [0, 0], [0, 0]) == ([0, 0], False)


# -- hand-worked, the hierarchy ----------------------------------------------------------------

BUDGET = """
kind: EgressClass
metadata: {name: gold}
spec: {weight: 2, min: 20M, max: 500M}
---
kind: EgressClass
metadata: {name: capped}
spec: {weight: 1, max: 15M}
---
kind: EgressBudget
metadata: {name: default}
spec:
  total: %(total)s
  teams:
  - {name: a, namespaces: [a], weight: 3 %(a)s}
  - {name: b, namespaces: [b], weight: 1 %(b)s}
"""


def budget(total="100M", a="", b=""):
    return policy_from(BUDGET % {"total": total, "a": a, "b": b})


def pod(key, team, demand, cls="default", weight=1, min_bps=0, max_bps=INF):
    return PodDemandIn(key, team, cls, weight, min_bps, max_bps, demand)


def shares(result):
    return {k: round(v.allocation_bps / M, 3) for k, v in result.pods.items()}


def limits(result):
    return {k: round(v.limit_bps / M, 3) for k, v in result.pods.items()}


def test_teams_by_weight_then_pods_inside():
    r = allocate(budget(), [pod("a/1", "a", 1e9), pod("a/2", "a", 5 * M), pod("b/1", "b", 1e9)])
    # a:b = 3:1 -> 75/25; inside a, a/2 wants only 5
    assert shares(r) == {"a/1": 70, "a/2": 5, "b/1": 25}
    assert r.teams["a"].allocated_bps == 75 * M and r.teams["b"].pods == 1
    assert r.classes["default"].pods == 3 and r.classes["default"].allocated_bps == 100 * M
    assert r.allocated_bps == 100 * M and not r.oversubscribed and not r.scaled


def test_a_team_that_wants_little_leaves_the_rest():
    r = allocate(budget(), [pod("a/1", "a", 30 * M), pod("b/1", "b", 1e9)])
    assert shares(r) == {"a/1": 30, "b/1": 70}


def test_team_min_and_max():
    r = allocate(budget(a=", max: 20M", b=", min: 60M"), [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)])
    assert shares(r) == {"a/1": 20, "b/1": 80}
    r = allocate(budget(b=", min: 60M"), [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)])
    assert shares(r) == {"a/1": 40, "b/1": 60}


def test_team_guarantee_overflow():
    r = allocate(budget(a=", min: 80M", b=", min: 120M"), [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)])
    assert shares(r) == {"a/1": 40, "b/1": 60}  # 80:120 scaled to fit 100
    assert r.oversubscribed and r.scaled and r.guaranteed_bps == 200 * M


def test_pod_guarantees_count_towards_their_team():
    # three gold pods (min 20M each) in team b, weight 1 of 4: b's fair share 25M < 60M guaranteed
    pods = [pod(f"b/{i}", "b", 1e9, "gold", 2, 20 * M, 500 * M) for i in range(3)] + [pod("a/1", "a", 1e9)]
    r = allocate(budget(), pods)
    assert shares(r) == {"b/0": 20, "b/1": 20, "b/2": 20, "a/1": 40}


def test_pod_guarantee_overflow_inside_a_capped_team():
    pods = [pod(f"b/{i}", "b", 1e9, "gold", 2, 20 * M, 500 * M) for i in range(3)]
    r = allocate(budget(b=", max: 30M"), pods)
    assert shares(r) == {"b/0": 10, "b/1": 10, "b/2": 10}
    assert r.teams["b"].scaled


def test_guarantee_only_up_to_demand_and_lent_when_idle():
    pods = [pod("b/1", "b", 2 * M, "gold", 2, 20 * M, 500 * M), pod("a/1", "a", 1e9)]
    assert shares(allocate(budget(), pods)) == {"b/1": 2, "a/1": 98}


def test_headroom_shares_the_unused_budget_and_limits_fit_it():
    # 30 of 100 allocated; the 70 left go to teams by weight (a 3 : b 1), inside a team by pod weight
    r = allocate(budget(), [pod("a/1", "a", 10 * M), pod("a/2", "a", 0), pod("b/1", "b", 20 * M)])
    assert shares(r) == {"a/1": 10, "a/2": 0, "b/1": 20}
    # team limits: level L with max(3L, 10) + max(L, 20) = 100 -> L = 25: a 75, b 25;
    # inside a, its 65 spare split 1:1 on top of 10 and 0
    assert limits(r) == {"a/1": 42.5, "a/2": 32.5, "b/1": 25}
    assert sum(p.limit_bps for p in r.pods.values()) == pytest.approx(100 * M)


def test_headroom_never_above_the_pods_cap():
    r = allocate(budget(), [pod("a/1", "a", 10 * M, "capped", 1, 0, 15 * M), pod("a/2", "a", 10 * M)])
    assert limits(r)["a/1"] == 15
    assert r.pods["a/2"].limit_bps <= 100 * M - 15 * M + 1


def test_saturated_budget_has_no_headroom():
    r = allocate(budget(), [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)])
    assert limits(r) == shares(r)


def test_no_budget_means_caps_only():
    policy, _ = load_policy([], [])
    r = allocate(policy, [pod("x/1", "default", 5 * M, max_bps=10 * M), pod("x/2", "default", 5 * M)])
    assert shares(r) == {"x/1": 5, "x/2": 5}
    assert r.pods["x/1"].limit_bps == 10 * M and r.pods["x/2"].limit_bps >= 1e15


def test_unknown_team_counts_in_the_default_team():
    r = allocate(budget(), [pod("z/1", "gone", 1e9)])
    assert r.teams["default"].pods == 1 and r.pods["z/1"].allocation_bps == 100 * M


# -- hysteresis -------------------------------------------------------------------------------

def test_small_changes_are_held_large_ones_pushed():
    policy = budget()
    first = allocate(policy, [pod("a/1", "a", 40 * M), pod("a/2", "a", 50 * M)])
    # a/1 wants 2% more: held; a/2 wants 20% less: pushed
    second = allocate(policy, [pod("a/1", "a", 40.8 * M), pod("a/2", "a", 40 * M)], previous=first)
    assert shares(second) == {"a/1": 40, "a/2": 40}
    assert second.held >= 1


def test_cuts_forced_by_the_budget_are_always_pushed():
    policy = budget()
    first = allocate(policy, [pod("a/1", "a", 60 * M), pod("a/2", "a", 40 * M)])
    assert shares(first) == {"a/1": 60, "a/2": 40}
    # a new pod arrives: both existing pods must give a little (< 5%) so the total still fits
    second = allocate(policy, [pod("a/1", "a", 60 * M), pod("a/2", "a", 40 * M), pod("a/3", "a", 4 * M)],
                      previous=first)
    assert sum(p.allocation_bps for p in second.pods.values()) <= 100 * M + 1e-6
    assert second.pods["a/3"].allocation_bps == 4 * M


def test_a_contended_budget_is_spent_also_when_every_step_is_under_the_hysteresis():
    """a/1 wants less, so a/2 may have 1.7 % more: an increase the hysteresis alone would hold,
    leaving 1.2 % of a contended budget unspent in every round after (the demo: its pods climbed to
    their new shares in steps under 2 % and stopped 2 % short, 118.1 of 120 Mbit/s). The round hands
    out the whole budget, so the held increase goes out; an uncontended one is still held (above)."""
    policy = budget()
    first = allocate(policy, [pod("a/1", "a", 4.5 * M), pod("a/2", "a", 1e9), pod("b/1", "b", 1e9)])
    assert shares(first) == {"a/1": 4.5, "a/2": 70.5, "b/1": 25}
    second = allocate(policy, [pod("a/1", "a", 3.3 * M), pod("a/2", "a", 1e9), pod("b/1", "b", 1e9)],
                      previous=first)
    assert shares(second) == {"a/1": 3.3, "a/2": 71.7, "b/1": 25}
    assert sum(p.allocation_bps for p in second.pods.values()) == pytest.approx(100 * M)
    assert sum(p.limit_bps for p in second.pods.values()) == pytest.approx(100 * M)
    third = allocate(policy, [pod("a/1", "a", 3.3 * M), pod("a/2", "a", 1e9), pod("b/1", "b", 1e9)],
                     previous=second)
    assert shares(third) == shares(second) and third.held == 0


def test_hysteresis_keeps_limits_within_the_budget():
    policy = budget()
    first = allocate(policy, [pod("a/1", "a", 10 * M), pod("b/1", "b", 10 * M)])
    second = allocate(policy, [pod("a/1", "a", 10.3 * M), pod("b/1", "b", 9.8 * M)], previous=first)
    assert sum(p.limit_bps for p in second.pods.values()) <= 100 * M * (1 + 1e-12)
    for p in second.pods.values():
        assert p.allocation_bps <= p.limit_bps


# -- feedback gain ----------------------------------------------------------------------------

def test_the_gain_is_the_budget_less_the_unshaped_traffic_within_bounds():
    cfg = EngineConfig()
    # the pods' classes sent 1G, 1.2G left the nodes: 200M the pods cannot have, 800M they can
    assert feedback_gain(1.0, 1e9, 1.2e9, 1e9) == pytest.approx(0.8)
    assert feedback_gain(1.0, 1e9, 1e12, 1e9) == cfg.gain_min
    assert feedback_gain(1.0, 1e9, 1e9, 1e12) == cfg.gain_max


def test_one_feedback_at_any_usage_gives_the_gain_the_budget_needs():
    """Issue 37's cold start: the pods ramp, their classes sent 100M of a 1G budget and 120M left the
    nodes (20M of unshaped host traffic). Their ratio, 0.83, is not the plant's at the budget: the
    20M stays 20M when the pods send 980M. The budget less the unshaped traffic is: 0.98 at once."""
    g = feedback_gain(1.0, 1e9, 120e6, 100e6)
    assert g == pytest.approx(0.98)
    assert feedback_gain(g, 1e9, 1e9, 0.98e9) == g  # and stays at the budget
    # with the node counter at 0.9 of the classes' count (k = 1/0.9): the rest of the way at the budget
    g = feedback_gain(1.0, 1e9, 100e6 / 0.9 + 20e6, 100e6)
    assert 0.95 < g < 0.98
    for _ in range(3):
        g = feedback_gain(g, 1e9, g * 1e9 / 0.9 + 20e6, g * 1e9)
    assert g == pytest.approx((1e9 - 20e6) / 1e9 * 0.9, rel=0.005)


def test_gain_ignores_pods_that_use_less_than_their_share():
    """Under-use after a shift lowers the pods' usage and the measured total alike: no change
    (the old rule raised the gain then and overshot once the pods caught up; the ratio rule after it
    read usage / measured, 0.93 here, as the plant's)."""
    assert feedback_gain(1.0, 1e9, 400e6, 400e6) == 1.0
    assert feedback_gain(0.97, 1e9, 430e6, 400e6) == 0.97  # 30M of host traffic beside 400M: as at the budget
    assert feedback_gain(0.97, 1e9, 432e6, 400e6) == 0.97  # deadband: 0.968 is within 0.5 % of 0.97
    assert feedback_gain(1.1, 1e9, None, 100e6) == 1.1
    assert feedback_gain(1.1, 1e9, 100e6, None) == 1.1
    assert feedback_gain(1.1, 1e9, 10e6, 10e6 * 0.9) == 1.1  # usage under 5% of the budget: nothing to trust


def test_gain_converges_measured_total_to_the_budget():
    """A plant whose measured egress is the pods' usage / 0.9 (L3 vs L2 counts) plus 5M of
    unshaped host traffic: the loop settles with the measured total at the budget."""
    policy = budget()
    pods = [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)]
    result, measured, used = None, None, None
    for _ in range(12):
        result = allocate(policy, pods, measured_total_bps=measured, previous=result, shaped_usage_bps=used)
        used = result.allocated_bps
        measured = used / 0.9 + 5 * M
    assert measured == pytest.approx(100 * M, rel=0.01)
    assert result.gain == pytest.approx(0.95 * 0.9, rel=0.01)


def test_gain_holds_through_a_transient_and_moves_once_the_plant_is_steady():
    """Issue 13's cold start, as the demo's agents reported it: a node's pods start, its counter
    since the last report has seen their first 15M while their last 1 s samples (taken before the
    report) show 5M. The ratio of the two (0.83) says nothing of the plant, and the gain cut on it
    held every pod ~13 % below its share for five periods. Steady numbers move the gain as before."""
    policy = budget()
    pods = [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)]
    result = allocate(policy, pods)
    result = allocate(policy, pods, measured_total_bps=56 * M, previous=result, shaped_usage_bps=56 * M)
    assert result.gain == 1.0  # the first feedback sets the point only
    result = allocate(policy, pods, measured_total_bps=71 * M, previous=result, shaped_usage_bps=61 * M)
    assert feedback_gain(1.0, 100 * M, 71 * M, 61 * M) < 0.94  # what the gain did before
    assert result.gain == 1.0 and result.capacity_bps == 100 * M
    # 10 % unshaped host traffic, steady: the gain follows it, a step per feedback after the first
    gains = []
    for _ in range(6):
        used = result.capacity_bps
        result = allocate(policy, pods, measured_total_bps=1.1 * used, previous=result, shaped_usage_bps=used)
        gains.append(result.gain)
    assert gains[0] == 1.0 and gains[1] < 0.96 and gains[-1] == pytest.approx(1 / 1.1, rel=0.01), gains


def test_counts_of_the_same_seconds_move_the_gain_at_the_first_feedback():
    """Agents that report their pods' bytes over the same seconds as their node's counter
    (`node_shaped_egress_bps`) give a ratio no transient skews, so the steady-plant rule above is not
    needed: the cold start's first feedback, the pods at a quarter of the budget beside 3M of host
    traffic, sets the gain the budget needs (issue 37). An older agent's feedback still waits."""
    policy = budget()
    pods = [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)]
    first = allocate(policy, pods)
    result = allocate(policy, pods, measured_total_bps=28 * M, previous=first, shaped_usage_bps=25 * M,
                      same_window=True)
    assert result.gain == pytest.approx(0.97) and result.capacity_bps == pytest.approx(97 * M)
    older = allocate(policy, pods, measured_total_bps=28 * M, previous=first, shaped_usage_bps=25 * M)
    assert older.gain == 1.0


def test_a_steady_plant_sets_the_gain_in_one_feedback_and_the_total_never_swings_far_past_the_budget():
    """Issue 37: the gain takes the whole step to the plant's. With measured = k x usage + U the next
    gain's error is the last one's times 1 - k (here k = 1/0.955: 4.7 % of it, on the other side): from
    the first steady feedback on, the measured total is within 1 % of the budget and never more than
    0.5 % below it. The half step (smoothing 0.5) needed three more feedbacks to get within 1 %."""
    policy = budget()
    pods = [pod("a/1", "a", 1e9), pod("b/1", "b", 1e9)]
    result = allocate(policy, pods)
    totals = []
    for _ in range(12):
        used = result.allocated_bps
        measured = used / 0.955 + 5 * M  # the iptables count of the lab (IP bytes) and 5 % unshaped host traffic
        totals.append(measured)
        result = allocate(policy, pods, measured_total_bps=measured, previous=result, shaped_usage_bps=used)
    # totals[0] ran under gain 1 (the first feedback sets the point only), totals[1] too (the second is
    # the first steady one and moves the gain), totals[2] under the gain it set
    assert totals[1] > 104 * M
    assert all(abs(t / (100 * M) - 1) <= 0.01 for t in totals[2:]), totals
    assert all(t >= 100 * M * (1 - 0.005) for t in totals), totals  # from above; a swing below stays small


# -- errors -----------------------------------------------------------------------------------

def test_bad_input_is_refused_with_the_pod_named():
    teams = TeamColumns(("t",), np.ones(1), np.zeros(1), np.full(1, INF))
    good = dict(team=np.zeros(2, dtype=np.intp), weight=np.ones(2), min_bps=np.zeros(2), max_bps=np.full(2, INF),
                demand_bps=np.ones(2))
    for column, value, fragment in (("demand_bps", np.nan, "demand_bps is nan"), ("min_bps", -1.0, "min_bps is -1"),
                                    ("weight", 0.0, "weight must be > 0")):
        bad = dict(good)
        bad[column] = good[column].copy()
        bad[column][1] = value
        with pytest.raises(EngineError, match=fragment):
            allocate_columns(teams, PodColumns(**bad), 1e6)
    with pytest.raises(EngineError, match="team index"):
        allocate_columns(teams, PodColumns(**{**good, "team": np.array([0, 1])}), 1e6)
    with pytest.raises(EngineError, match="unique"):
        allocate(budget(), [pod("a/1", "a", 1), pod("a/1", "a", 2)])


def test_no_pods():
    r = allocate(budget(), [])
    assert r.pods == {} and r.allocated_bps == 0


# -- properties -------------------------------------------------------------------------------

RATES = st.sampled_from([0, 1, 5, 10, 20, 33, 50, 100, 250, 1000])


@st.composite
def scenarios(draw, team_max=True):
    n_teams = draw(st.integers(1, 4))
    n_pods = draw(st.integers(1, 14))
    team_weight = np.array(draw(st.lists(st.integers(1, 5), min_size=n_teams, max_size=n_teams)), float)
    team_min = np.array(draw(st.lists(st.sampled_from([0, 0, 10, 40, 200]), min_size=n_teams, max_size=n_teams)),
                        float)
    if team_max:
        team_cap = np.array(draw(st.lists(st.sampled_from([INF, INF, 30, 300]), min_size=n_teams, max_size=n_teams)),
                            float)
    else:
        team_cap = np.full(n_teams, INF)
    team_cap = np.maximum(team_cap, team_min)
    team = np.array(draw(st.lists(st.integers(0, n_teams - 1), min_size=n_pods, max_size=n_pods)), np.intp)
    weight = np.array(draw(st.lists(st.integers(1, 8), min_size=n_pods, max_size=n_pods)), float)
    cap = np.array(draw(st.lists(st.sampled_from([INF, INF, 15, 60, 400]), min_size=n_pods, max_size=n_pods)), float)
    minimum = np.minimum(np.array(draw(st.lists(st.sampled_from([0, 0, 5, 25]), min_size=n_pods,
                                                max_size=n_pods)), float), cap)
    demand = np.array(draw(st.lists(RATES, min_size=n_pods, max_size=n_pods)), float)
    total = float(draw(st.sampled_from([0, 10, 100, 333, 1000, 5000])))
    teams = TeamColumns(tuple(f"t{i}" for i in range(n_teams)), team_weight, team_min, team_cap)
    return teams, PodColumns(team, weight, minimum, cap, demand), total


EPS = 1e-6
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(scenarios())
def test_never_more_than_capacity_demand_or_cap(case):
    teams, pods, total = case
    r = allocate_columns(teams, pods, total)
    assert r.allocation.sum() <= total * (1 + 1e-9) + EPS
    assert r.limit.sum() <= total * (1 + 1e-9) + EPS
    assert (r.allocation <= np.minimum(pods.demand_bps, pods.max_bps) + EPS).all()
    assert (r.allocation <= r.limit + EPS).all() and (r.limit <= pods.max_bps + EPS).all()
    assert (r.allocation >= 0).all()
    team_alloc = np.bincount(pods.team, r.allocation, len(teams.names))
    assert (team_alloc <= teams.max_bps + EPS).all()
    assert (np.bincount(pods.team, r.limit, len(teams.names)) <= teams.max_bps + EPS).all()


def _max_min_holds(alloc, weight, floor, upper, group):
    """Nobody below its upper bound is behind, by weight, a member of its group who is above its floor."""
    for i in range(alloc.size):
        if alloc[i] >= upper[i] - EPS:
            continue  # satisfied: no claim on anyone
        same = group == group[i]
        ahead = same & (alloc / weight > alloc[i] / weight[i] + EPS) & (alloc > floor + EPS)
        if ahead.any():
            return False
    return True


@PROPS
@given(scenarios())
def test_max_min_fair_at_both_levels(case):
    teams, pods, total = case
    r = allocate_columns(teams, pods, total)
    upper = np.minimum(pods.max_bps, pods.demand_bps)
    floor = np.minimum(pods.min_bps, upper)
    # pods inside a team, against the team's share; a scaled team's floors are scaled too
    scale = np.where(r.team_scaled, r.team_allocation / np.maximum(np.bincount(pods.team, floor, len(teams.names)),
                                                                    1e-300), 1.0)
    assert _max_min_holds(r.allocation, pods.weight, floor * np.minimum(scale[pods.team], 1.0), upper, pods.team)
    # teams against the budget
    n = len(teams.names)
    team_upper = np.minimum(teams.max_bps, np.bincount(pods.team, upper, n))
    team_floor = r.team_guarantee * (min(1.0, total / r.team_guarantee.sum()) if r.scaled else 1.0)
    assert _max_min_holds(r.team_allocation, teams.weight, team_floor, team_upper, np.zeros(n, np.intp))


@PROPS
@given(scenarios(team_max=False))
def test_guarantees_honoured_whenever_they_fit(case):
    teams, pods, total = case
    upper = np.minimum(pods.max_bps, pods.demand_bps)
    floor = np.minimum(pods.min_bps, upper)
    n = len(teams.names)
    team_floor = np.minimum(np.bincount(pods.team, upper, n), np.maximum(teams.min_bps, np.bincount(pods.team, floor, n)))
    assume(team_floor.sum() <= total)
    r = allocate_columns(teams, pods, total)
    assert (r.allocation >= floor - EPS).all()
    assert (r.team_allocation >= team_floor - EPS).all()
    assert not r.scaled and not r.team_scaled.any()


@PROPS
@given(scenarios(), st.data())
def test_raising_one_demand_never_raises_another_allocation(case, data):
    teams, pods, total = case
    k = data.draw(st.integers(0, len(pods) - 1))
    more = data.draw(st.sampled_from([1, 10, 100, 1000]))
    before = allocate_columns(teams, pods, total)
    demand = pods.demand_bps.copy()
    demand[k] += more
    after = allocate_columns(teams, PodColumns(pods.team, pods.weight, pods.min_bps, pods.max_bps, demand), total)
    others = np.arange(len(pods)) != k
    if before.scaled or after.scaled:
        # when team guarantees are scaled, a team's share grows with its pods' demand and its
        # other pods share that growth (see docs/allocation.md): only other teams' pods are bound
        others &= pods.team != pods.team[k]
    assert (after.allocation[others] <= before.allocation[others] + EPS).all()
    assert after.allocation[k] >= before.allocation[k] - EPS


@PROPS
@given(scenarios())
def test_identical_input_identical_output(case):
    teams, pods, total = case
    a = allocate_columns(teams, pods, total)
    b = allocate_columns(teams, PodColumns(*(np.copy(x) for x in (pods.team, pods.weight, pods.min_bps, pods.max_bps,
                                                                  pods.demand_bps))), total)
    assert np.array_equal(a.allocation, b.allocation) and np.array_equal(a.limit, b.limit)


@PROPS
@given(scenarios(), st.data())
def test_hysteresis_never_breaks_capacity_or_caps(case, data):
    teams, pods, total = case
    first = allocate_columns(teams, pods, total)
    jitter = np.array(data.draw(st.lists(st.sampled_from([0.9, 0.97, 1.0, 1.03, 1.2]), min_size=len(pods),
                                         max_size=len(pods))))
    moved = PodColumns(pods.team, pods.weight, pods.min_bps, pods.max_bps, pods.demand_bps * jitter)
    second = allocate_columns(teams, moved, total, previous=first)
    assert second.allocation.sum() <= total * (1 + 1e-9) + EPS
    assert second.limit.sum() <= total * (1 + 1e-9) + EPS
    assert (second.allocation <= second.limit + EPS).all() and (second.limit <= pods.max_bps + EPS).all()
    assert (np.bincount(pods.team, second.allocation, len(teams.names)) <= teams.max_bps + EPS).all()


def test_pushing_held_increases_does_not_leave_held_decreases_over_the_capacity():
    """The case hypothesis found: a held increase pushed because the budget is contended (held_back_max) and a
    held decrease of 0.00035 that then put the pods over the capacity; the decrease goes out too."""
    teams = TeamColumns(("t0", "t1", "t2"), np.ones(3), np.array([0.0, 200.0, 0.0]), np.full(3, INF))
    demand = np.array([0.0, 1, 0, 0, 0, 0, 10, 20, 250, 0])
    pods = PodColumns(np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 0]), np.ones(10), np.array([0.0, 5, 0, 0, 0, 0, 5, 0, 0, 0]),
                      np.full(10, INF), demand)
    first = allocate_columns(teams, pods, 100.0)
    moved = PodColumns(pods.team, pods.weight, pods.min_bps, pods.max_bps,
                       demand * np.array([0.9, 1.03, 0.9, 0.9, 0.9, 0.9, 0.9, 0.97, 0.9, 0.9]))
    second = allocate_columns(teams, moved, 100.0, previous=first)
    assert second.allocation.sum() <= 100.0 * (1 + 1e-9) + EPS


@PROPS
@given(scenarios(), st.data())
def test_warm_start_from_the_previous_round_gives_the_same_answer(case, data):
    teams, pods, total = case
    first = allocate_columns(teams, pods, total)
    factor = data.draw(st.sampled_from([0.5, 0.99, 1.0, 1.01, 3.0]))
    moved = PodColumns(pods.team, pods.weight, pods.min_bps, pods.max_bps, pods.demand_bps * factor)
    no_hysteresis = EngineConfig(hysteresis=0.0)
    warm = allocate_columns(teams, moved, total, previous=first, config=no_hysteresis)
    cold = allocate_columns(teams, moved, total, config=no_hysteresis)
    np.testing.assert_allclose(warm.allocation, cold.allocation, rtol=1e-9, atol=1e-6)


def test_many_groups_at_once_match_one_at_a_time():
    """The vectorised water level over 200 groups equals solving each group alone."""
    rng = np.random.default_rng(7)
    n, groups = 5000, 200
    group = rng.integers(0, groups, n)
    weight = rng.integers(1, 5, n).astype(float)
    upper = rng.lognormal(10, 2, n)
    floor = np.where(rng.random(n) < 0.2, np.minimum(upper, 5e4), 0.0)
    capacity = rng.uniform(0, 1, groups) * np.bincount(group, upper, groups)
    together = waterfill(group, groups, capacity, weight, floor, upper).allocation
    for g in range(0, groups, 17):
        members = group == g
        alone = waterfill(np.zeros(members.sum(), np.intp), 1, capacity[g:g + 1], weight[members], floor[members],
                          upper[members]).allocation
        np.testing.assert_allclose(together[members], alone, rtol=1e-9)
        assert together[members].sum() <= capacity[g] * (1 + 1e-12)


def test_closed_loop_with_the_agents_demand_estimator_settles_at_the_fair_share():
    """Engine + netagent.demand.PodDemand in a loop, as agents and controller run it: pods send
    min(true demand, limit), the estimator (which probes above censored usage) reports demand,
    the pods' usage and the measured total feed the gain. The rates settle within 5%
    of the allocation the true demands would get, and the total at the budget."""
    from netagent.demand import PodDemand, Sample

    policy = budget(total="200M", b=", min: 60M")
    rng = np.random.default_rng(5)
    true = {f"{t}/{i}": float(rng.lognormal(0, 0.6) * 5 * M) for t in ("a", "b") for i in range(30)}
    estimators = {k: PodDemand() for k in true}
    sent_bytes = {k: 0 for k in true}
    limits_now = {k: 1 * M for k in true}
    result, measured = None, None

    def pods_with(demand):
        return [pod(k, k.split("/")[0], demand[k]) for k in true]

    for step in range(20):
        measured = 0.0
        for k, est in estimators.items():
            rate = min(true[k], limits_now[k])
            measured += rate
            sent_bytes[k] += int(rate / 8)
            # over its ceil by more than HTB's burst absorbs (0.1%): the class counts overlimits
            # (the byte counter rounds down, so a pod at exactly its limit reads a hair under it)
            est.update(Sample(float(step), sent_bytes[k], 0, step if true[k] > limits_now[k] * 1.001 else 0, 0),
                       int(limits_now[k]), 2**62)
        result = allocate(policy, pods_with({k: e.demand_bps for k, e in estimators.items()}),
                          measured_total_bps=measured if step else None, previous=result,
                          shaped_usage_bps=measured if step else None)
        limits_now = {k: max(p.limit_bps, 1.0) for k, p in result.pods.items()}
    fair = allocate(policy, pods_with(true)).pods
    worst = max(abs(min(true[k], limits_now[k]) - fair[k].allocation_bps) / fair[k].allocation_bps for k in true)
    assert worst <= 0.05, worst
    assert measured == pytest.approx(200 * M, rel=0.02)
