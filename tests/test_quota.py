"""core/quota: the quota block's parser, calendar periods in a time zone, the ledger, the exhaustion transform."""
from datetime import datetime, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, strategies as st

from core.direction import Direction, PerDirection
from core.policy import Limits
from core.quota import (DirectionQuota, Ledger, Period, TeamQuota, apply_exhaustion, exhausted_teams,
                        parse_team_quota, parse_time_zone, period_bounds)

UP, DOWN = Direction.UPLOAD, Direction.DOWNLOAD
W = "EgressBudget main: teams[research].quota"
GOOD = {"period": "Month", "bytes": "50Ti", "exhaustedRate": "100M",
        "ingress": {"bytes": "200Ti", "exhaustedRate": "500M"}}


def test_the_issue_example_parses():
    quota, problems = parse_team_quota(GOOD, W)
    assert problems == []
    assert quota == TeamQuota(Period.MONTH, PerDirection(DirectionQuota(50 * 2**40, 10**8),
                                                         DirectionQuota(200 * 2**40, 5 * 10**8)))


def test_one_direction_and_no_exhausted_rate():
    quota, problems = parse_team_quota({"period": "Day", "ingress": {"bytes": "1G"}}, W)
    assert problems == [] and quota is not None
    assert quota.limits.upload is None and quota.limits.download == DirectionQuota(10**9, None)


@pytest.mark.parametrize("spec, fragment", [
    ({"period": "Month", "bytes": "-1Ti"}, f"{W}.bytes: '-1Ti' is negative"),
    ({"period": "Month", "bytes": "0"}, f"{W}.bytes: '0' is zero"),
    ({"period": "Month", "bytes": 0}, f"{W}.bytes: 0 is zero"),
    ({"period": "Month", "bytes": "8Ei"}, f"{W}.bytes: '8Ei' is above the largest byte count"),
    ({"period": "Month", "bytes": 2**63}, "above the largest byte count"),
    ({"period": "Month", "bytes": "lots"}, f"{W}.bytes: 'lots' is not a Kubernetes quantity in bytes"),
    ({"period": "Year", "bytes": "1Ti"}, f"{W}.period: 'Year' is not one of Day, Week, Month"),
    ({"period": "month", "bytes": "1Ti"}, f"{W}.period: 'month' is not one of"),
    ({"bytes": "1Ti"}, f"{W}.period: required"),
    ({"period": "Day", "ingress": {"bytes": "-5"}}, f"{W}.ingress.bytes: '-5' is negative"),
    ({"period": "Day", "ingress": {"bytes": "1G", "exhaustedRate": "9Z"}}, f"{W}.ingress.exhaustedRate: '9Z'"),
    ({"period": "Day", "bytes": "1G", "exhaustedRate": "2G"}, f"{W}.exhaustedRate: '2G' (2000000000 bit/s) is above"),
    ({"period": "Day", "exhaustedRate": "1M"}, f"{W}.bytes: required with exhaustedRate"),
    ({"period": "Day"}, "needs bytes"),
    ({"period": "Day", "bytes": "1G", "limit": 3}, "unknown field(s) limit"),
    ("50Ti", "expected a mapping"),
])
def test_bad_input_is_a_problem_naming_the_field(spec, fragment):
    quota, problems = parse_team_quota(spec, W, team_max_bps=PerDirection(10**9, 10**9))
    assert quota is None
    assert any(fragment in p for p in problems), problems


def test_exhausted_rate_at_the_cap_is_fine():
    quota, problems = parse_team_quota({"period": "Day", "bytes": "1G", "exhaustedRate": "1G"}, W,
                                       team_max_bps=PerDirection(10**9, 10**9))
    assert problems == [] and quota is not None


@pytest.mark.parametrize("value, ok", [(None, True), ("UTC", True), ("Europe/Berlin", True),
                                       ("Mars/Olympus", False), ("../etc/passwd", False), ("", False), (5, False)])
def test_time_zone(value, ok):
    zone, problems = parse_time_zone(value, "EgressBudget main: spec.quotaTimeZone")
    assert (problems == []) == ok
    if not ok:
        assert problems[0].startswith("EgressBudget main: spec.quotaTimeZone: ")
        assert zone == ZoneInfo("UTC")


def test_periods_in_utc():
    at = datetime(2026, 11, 28, 8, 30, tzinfo=timezone.utc)  # a Saturday
    utc = ZoneInfo("UTC")
    assert period_bounds(Period.DAY, at, utc) == (datetime(2026, 11, 28, tzinfo=utc), datetime(2026, 11, 29, tzinfo=utc))
    assert period_bounds(Period.WEEK, at, utc) == (datetime(2026, 11, 23, tzinfo=utc), datetime(2026, 11, 30, tzinfo=utc))
    assert period_bounds(Period.MONTH, at, utc) == (datetime(2026, 11, 1, tzinfo=utc), datetime(2026, 12, 1, tzinfo=utc))
    dec = datetime(2026, 12, 31, 23, 59, tzinfo=timezone.utc)
    assert period_bounds(Period.MONTH, dec, utc)[1] == datetime(2027, 1, 1, tzinfo=utc)


def test_periods_in_a_zone_follow_local_midnight_and_dst():
    berlin = ZoneInfo("Europe/Berlin")
    # 23:30 UTC on 31 Oct is already 1 Nov in Berlin (CET, +1): November's period
    start, end = period_bounds(Period.MONTH, datetime(2026, 10, 31, 23, 30, tzinfo=timezone.utc), berlin)
    assert start.astimezone(timezone.utc) == datetime(2026, 10, 31, 23, 0, tzinfo=timezone.utc)
    # the day clocks go back (25 Oct 2026) is 25 hours long
    s, e = period_bounds(Period.DAY, datetime(2026, 10, 25, 12, tzinfo=timezone.utc), berlin)
    # (in UTC: Python subtracts two datetimes of one tzinfo by wall clock)
    assert (e.astimezone(timezone.utc) - s.astimezone(timezone.utc)).total_seconds() == 25 * 3600


def test_naive_instant_refused():
    with pytest.raises(ValueError):
        period_bounds(Period.DAY, datetime(2026, 1, 1), ZoneInfo("UTC"))


def test_ledger_never_counts_twice_nor_drops_what_is_held():
    led = Ledger()
    assert led.add("r", "p1", UP, "e1", 100) == 100
    assert led.add("r", "p1", UP, "e1", 100) == 0  # retried / duplicated
    assert led.add("r", "p1", UP, "e1", 250) == 150
    assert led.add("r", "p1", UP, "e1", 180) == 0  # reordered: an older report
    # a lost report (counter 300) drops nothing: the next one carries it
    assert led.add("r", "p1", UP, "e1", 400) == 150
    assert led.add("r", "p1", UP, "e2", 30) == 30  # agent restarted: new epoch, counter from 0
    assert led.add("r", "p1", UP, "e1", 500) == 0 and led.stale == 1  # a late report of the old epoch
    assert led.team_used("r", UP) == 430 and led.team_used("r", DOWN) == 0


def test_resume_takes_the_first_report_as_baseline():
    led = Ledger.resume({("r", UP): 1000})
    assert led.add("r", "p1", UP, "e1", 900) == 0  # already in the persisted figure (or the lost interval)
    assert led.add("r", "p1", UP, "e1", 950) == 50
    assert led.add("r", "p1", UP, "e2", 10) == 10  # a restart seen live counts in full
    assert led.team_used("r", UP) == 1060


def test_roll_starts_at_zero_and_keeps_counters():
    led = Ledger()
    led.add("r", "p1", UP, "e1", 100)
    new = led.roll()
    assert new.team_used("r", UP) == 0
    assert new.add("r", "p1", UP, "e1", 160) == 60


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=30), st.randoms())
def test_any_order_and_duplicates_count_the_largest_counter_once(increments, rnd):
    counters = []
    total = 0
    for inc in increments:
        total += inc
        counters.append(total)
    reports = counters + rnd.sample(counters, k=len(counters) // 2)  # duplicates
    rnd.shuffle(reports)
    led = Ledger()
    for c in reports:
        led.add("t", "p", DOWN, "e", c)
    assert led.team_used("t", DOWN) == max(counters)


def test_exhaustion_caps_at_exhausted_rate_or_safe_floor():
    quotas = {"a": TeamQuota(Period.DAY, PerDirection(DirectionQuota(100, 10**6), None)),
              "b": TeamQuota(Period.DAY, PerDirection(DirectionQuota(100), None)),
              "c": TeamQuota(Period.DAY, PerDirection(DirectionQuota(10**9), None))}
    led = Ledger()
    for team in "abc":
        led.add(team, f"{team}-pod", UP, "e", 100)
    gone = exhausted_teams(quotas, led, UP)
    assert gone == {"a", "b"} and exhausted_teams(quotas, led, DOWN) == frozenset()
    limits = {t: Limits(10, 5 * 10**6, 10**9) for t in "abcd"}
    out = apply_exhaustion(limits, quotas, gone, UP, safe_floor_bps=8000)
    assert out["a"] == Limits(10, 0, 10**6)
    assert out["b"] == Limits(10, 0, 8000)
    assert out["c"] == limits["c"] and out["d"] == limits["d"]


# -- the policy hook (core/policy.py) ---------------------------------------------------------------

def _budget(quota=None, zone=None) -> dict:
    team = {"name": "research", "namespaces": ["research"], "max": "1G"}
    if quota is not None:
        team["quota"] = quota
    spec = {"total": "10G", "teams": [team]}
    if zone is not None:
        spec["quotaTimeZone"] = zone
    return {"metadata": {"name": "main"}, "spec": spec}


def test_policy_carries_each_teams_quota_and_the_zone():
    from core.policy import load_policy
    policy, problems = load_policy([], [_budget(GOOD | {"exhaustedRate": "100M"}, "Europe/Berlin")])
    assert problems == []
    team = policy.team("research")
    assert team.quota == parse_team_quota(GOOD, W)[0] and not team.quota_refused
    assert policy.quota_zone == "Europe/Berlin"
    assert policy.team(policy.default_team).quota is None
    policy, problems = load_policy([], [_budget()])
    assert problems == [] and policy.quota_zone == "UTC" and policy.team("research").quota is None


@pytest.mark.parametrize("quota, zone, field", [
    ({"period": "Month", "bytes": "-5"}, None, "spec.teams[0] (research).quota.bytes"),
    ({"period": "Year", "bytes": "1Ti"}, None, "spec.teams[0] (research).quota.period"),
    ({"period": "Month", "bytes": "1Ti", "exhaustedRate": "2G"}, None, "spec.teams[0] (research).quota.exhaustedRate"),
    ({"period": "Month", "bytes": str(2**63)}, None, "spec.teams[0] (research).quota.bytes"),
    (GOOD, "Mars/Olympus", "spec.quotaTimeZone"),
])
def test_a_bad_quota_is_a_policy_problem_naming_the_field_and_the_team_keeps_its_rates(quota, zone, field):
    from core.policy import load_policy
    policy, problems = load_policy([], [_budget(quota, zone)])
    assert problems and all(p.startswith("EgressBudget main: ") for p in problems), problems
    assert any(field in p and "previous valid" in p for p in problems), problems
    team = policy.team("research")  # the team and its rates stay; only the quota part is refused
    assert team.limits.upload.max_bps == 10**9 and team.namespaces == ("research",)
    if zone is None:
        assert team.quota is None and team.quota_refused
    else:
        assert policy.quota_zone is None and team.quota is not None
