"""The whole control loop without HTTP or clocks: the agents' demand estimator
(netagent.demand.PodDemand) and the allocation engine, one round per report period, against
issue 5's convergence aims: every pod within 5% of its fair share within 2 periods of a
demand shift, a pod whose demand jumps 10x at its fair share within 4, the measured total
within 5% of the budget. The loop is lab/loop.py; bench/simulation.py runs the same loop through the real
controller."""
import math

import pytest

from lab.loop import (HOST_BPS, L3_PER_L2, TOLERANCE, ClimbOnly, Loop, class_change, cold_start, jump_ratios, new_pod,
                      pod_ends, settled)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_pod_within_5_percent_of_fair_two_periods_after_a_shift(seed):
    loop = Loop(seed)
    loop.run(12)
    loop.shift(seed)
    errors = loop.run(8)
    # errors[0] is after the first round that saw the shift; "within 2 periods" is errors[2:]
    assert max(errors[2:]) <= TOLERANCE, errors
    assert abs(loop.total / loop.policy.totals.upload - 1) <= TOLERANCE


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_pod_whose_demand_jumps_tenfold_gets_its_fair_share_within_4_periods(seed):
    fair = jump_ratios(seed)
    assert all(f >= 1 - TOLERANCE for f in fair[4:]), fair
    assert min(fair[3:]) >= 1 - TOLERANCE, fair


def test_measured_total_settles_at_the_budget_through_the_gain():
    loop = Loop(4)
    loop.run(15)
    assert loop.total == pytest.approx(loop.policy.totals.upload, rel=0.02)
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
        share = loop.fair()[bursty.key]
        periods = 1 + math.ceil(math.log2(share / (1.25 * idle_limit)))
        errors = loop.run(periods + 1)
        assert errors[periods] <= TOLERANCE, (periods, errors)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pods_that_start_after_their_first_answer_reach_fair_within_4_periods(seed):
    """Issue 13's cold start (one node's first report came before its flows): the pods that start
    late ask their caps, and every pod is within 5% of fair from the fourth answer on (bench/
    estimator.py: median 2, worst 5 over 20 seeds). Climbing from the trickle by doublings took
    11-13 answers, which the estimator without the wake ask shows."""
    errors = cold_start(seed)
    assert max(errors[3:]) <= TOLERANCE, errors
    assert max(cold_start(seed, ClimbOnly)[3:8]) > TOLERANCE  # the scenario is the one that was slow


def test_a_class_change_reaches_every_pods_new_share_within_3_answers_where_the_climb_took_5():
    """Issue 13, the demo's change (a held pod moves to a class of 3x the weight, its team's weight
    triples; its share grows 3-7x): a pod held at its share through two answers asks its cap, so
    the answer to the change gives it the new share at once; the rest is the pods whose appetite
    lay between their old and new shares showing it (one answer). Over 20 seeds every pod is within
    5 % from the third answer on at worst (from the second in most); the estimator without the held
    and wake asks climbs 1.25x, 2x, 2x and needs up to 5."""
    seeds = range(1, 21)
    runs = [class_change(s) for s in seeds]
    shipped = [settled(errors) for _, errors in runs]
    climb = [settled(class_change(s, ClimbOnly)[1]) for s in seeds]
    assert max(shipped) <= 3, shipped
    assert sum(p <= 2 for p in shipped) >= 14, shipped
    assert max(climb) >= 5 and sum(climb) > sum(shipped) + 10, (climb, shipped)
    assert min(grew for grew, _ in runs) > 3  # the scenario is a large rise


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_pod_that_starts_in_a_saturated_cluster_is_at_its_share_within_two_periods(seed):
    """Issue 37, "a pod starts": its first report has no sample of it, so it is answered a trickle
    and is throttled in its first measured sample. It asks its cap there (no limit it merely jitters
    over), and every pod is within 5 % of fair from the second answer on and stays. It climbed 1.25x,
    then 2x per answer from the trickle before: not settled in 12 periods."""
    errors = new_pod(seed)
    assert settled(errors) <= 2 and max(errors[2:]) <= TOLERANCE, errors
    assert settled(new_pod(seed, ClimbOnly)) > 10  # the climb the wake ask replaced


def test_when_the_largest_pod_ends_every_pod_is_at_its_new_share_within_two_periods():
    """Issue 37, "a pod ends": its share goes to the pods held below their appetite, which ask their
    caps (held) or probe: every pod is within 5 % from the second answer on (from the first in most;
    seeds 1-20 in docs/allocation.md, 8 here for time)."""
    runs = [settled(pod_ends(seed)) for seed in range(1, 9)]
    assert max(runs) <= 1, runs
