"""bench/scale.py's control loop in one process (bench/scale_loop.py: the agents' estimator and the
engine, fixed seeds, no clocks): a guard that fails if convergence gets slower than it is now, and
the measured reason it is not yet two periods (docs/allocation.md, "Where a shift's periods go").
The figures are today's, not the aim: tighten them when the mechanism improves."""
import pytest

from bench.scale_loop import run

NODES, PODS = 10, 110  # 1,100 pods; each run a few seconds


@pytest.fixture(scope="module", params=[False, True], ids=["answer-from-latest-round", "answer-wait"])
def loop(request):
    why: list = []
    rows = run(NODES, PODS, False, wait=request.param, why=why)
    within = [c["ok"] / sum(c.values()) for c in why]  # per period after the shift (0: the shift's own)
    return request.param, rows, within, why


def settled_at(within: list[float], share: float = 0.95) -> int:
    """The first period from which at least `share` of the pods stay within 5 % of fair."""
    return next(k for k in range(len(within)) if min(within[k:]) >= share)


def test_the_steady_total_is_within_one_percent_of_the_budget(loop):
    _, rows, _, _ = loop
    steady = [sent for t, _, sent, _ in rows if 100 <= t < 160]  # the shift is at t=160
    assert steady and max(abs(s) for s in steady) <= 0.01, steady


def test_every_pod_is_at_its_fair_share_before_the_shift(loop):
    _, rows, _, _ = loop
    assert all(share == 1.0 for t, share, _, _ in rows if 60 <= t < 160), rows


def test_after_the_shift_95_percent_of_pods_settle_no_later_than_today(loop):
    # answers from the latest round (the default): 9 periods; waiting for the report's round: 4
    wait, _, within, _ = loop
    assert settled_at(within) <= (4 if wait else 9), within


def test_what_holds_a_shift_back_is_the_risen_pods_probe(loop):
    """Off fair in the first periods after the shift: mostly pods whose demand rose 3x and whose
    estimator still asks below their fair share (1.25x, then 2x per answer that raised the limit),
    not pods whose demand fell, nor pods asking their share without getting it."""
    _, _, _, why = loop
    for c in why[:3]:
        off = sum(c.values()) - c["ok"]
        assert c["rose/low/asks<fair"] >= 0.7 * off, c


def test_with_the_true_demand_the_default_timing_meets_two_periods():
    """The same loop with reports that carry each pod's true appetite (which no agent can know): every
    pod within 5 % two periods after the shift with answers from the latest round. So the answer lag
    alone costs no more than the aim; the estimator's probe is what makes it nine."""
    why: list = []
    run(NODES, PODS, False, why=why, true_demand=True)
    within = [c["ok"] / sum(c.values()) for c in why]
    assert settled_at(within, 1.0) <= 2, within
