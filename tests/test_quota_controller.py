"""The leader's volume quotas (controller/quota.py) through the real allocator: reports feed the ledger, an
exhausted team is capped at its exhaustedRate in that direction while the others take the freed share, a new
period lifts the cap within one round, and counted bytes are never counted twice nor lost across a leader
change beyond what the docs bound (docs/quotas.md). Pure: no API server (tests/test_quota_store.py has it)."""
from __future__ import annotations

from datetime import datetime, timezone

from core.direction import Direction
from core.policy import load_policy
from core.wire import NodeReport, PodReport
from controller.allocator import Allocator
from controller.quota import QuotaKeeper

M = 10**6
UP, DOWN = Direction.UPLOAD, Direction.DOWNLOAD
DAY1 = datetime(2026, 3, 10, 12, 0, tzinfo=timezone.utc).timestamp()


def _policy(quota=None):
    quota = quota or {"period": "Day", "bytes": "1M", "exhaustedRate": "2M", "ingress": {"bytes": "5M"}}
    budget = {"metadata": {"name": "main"}, "spec": {"total": "100M", "ingressTotal": "100M", "teams": [
        {"name": "research", "namespaces": ["research"], "min": "30M", "quota": quota},
        {"name": "web", "namespaces": ["web"]}]}}
    policy, problems = load_policy([], [budget])
    assert problems == []
    return policy


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _report(up: int, down: int = 0, epoch: str = "boot-1", uid: str = "uid-a") -> NodeReport:
    pods = [PodReport("research", "a", 50e6, 100e6, ingress_usage_bps=50e6, ingress_demand_bps=100e6,
                      bytes_total=up, ingress_bytes_total=down, uid=uid),
            PodReport("web", "w", 50e6, 100e6, ingress_usage_bps=50e6, ingress_demand_bps=100e6,
                      bytes_total=10**9, ingress_bytes_total=10**9, uid="uid-w")]
    return NodeReport("n1", pods, epoch=epoch, shapes_ingress=True)


def _setup(persisted=None):
    policy = _policy()
    clock = Clock(DAY1)
    keeper = QuotaKeeper(clock)
    keeper.set_policy(policy)
    keeper.resume(persisted)
    alloc = Allocator(lambda: (policy, []), quota=keeper)
    return alloc, keeper, clock


def _round(alloc, report):
    result = alloc({"n1": alloc.prepare(report)})
    pods = {p.name: p for p in result.by_node["n1"]}
    return pods["a"], pods["w"]


def test_an_exhausted_team_is_capped_at_its_exhausted_rate_and_the_others_take_the_share():
    alloc, keeper, clock = _setup()
    a, w = _round(alloc, _report(100))  # first sight: a baseline, nothing counted
    assert keeper.teams()[0].used.upload == 0
    assert a.allocation_bps > 30 * M  # its guarantee holds while it has quota left
    a, w = _round(alloc, _report(100 + 999_999))
    assert keeper.exhausted(UP) == frozenset() and keeper.teams()[0].used.upload == 999_999
    a, w = _round(alloc, _report(100 + 1_000_000))  # the quota's 1M bytes (1M = 10^6) reached
    assert keeper.exhausted(UP) == {"research"} and keeper.exhausted(DOWN) == frozenset()
    a, w = _round(alloc, _report(100 + 1_000_000))
    assert a.allocation_bps <= 2 * M and a.limit_bps <= 2 * M  # its exhaustedRate, its guarantee gone
    assert w.allocation_bps >= 95 * M  # the other team took the freed share
    assert a.ingress_allocation_bps > 30 * M  # downloads have quota left: not capped
    # downloads spent too: no ingress exhaustedRate, so only the safe floor
    _round(alloc, _report(2_000_000, 0))
    a, w = _round(alloc, _report(2_000_000, 5_000_000))
    assert keeper.exhausted(DOWN) == {"research"}
    a, w = _round(alloc, _report(2_000_000, 5_000_000))
    assert a.ingress_limit_bps <= 64_000 and w.ingress_allocation_bps >= 95 * M
    status = keeper.status()["teams"]
    assert status == [{"name": "research", "periodStart": "2026-03-10T00:00:00Z", "used": str(2_000_000 - 100),
                       "ingressUsed": "5000000", "exhausted": True, "ingressExhausted": True}]


def test_the_cap_lifts_within_one_round_of_the_new_period():
    alloc, keeper, clock = _setup()
    _round(alloc, _report(0))
    _round(alloc, _report(5_000_000))
    a, _ = _round(alloc, _report(5_000_000))
    assert a.allocation_bps <= 2 * M
    clock.t = datetime(2026, 3, 11, 0, 0, 1, tzinfo=timezone.utc).timestamp()  # the next day
    a, _ = _round(alloc, _report(5_000_000))  # this round: use 0, cap lifted
    assert keeper.exhausted(UP) == frozenset() and a.allocation_bps > 30 * M
    assert keeper.teams()[0].period_start == datetime(2026, 3, 11, tzinfo=timezone.utc)
    _round(alloc, _report(5_000_100))  # the counters carried over: only the bytes after the boundary count
    assert keeper.teams()[0].used.upload == 100


def test_retried_reordered_and_replayed_reports_never_count_twice():
    alloc, keeper, clock = _setup()
    for up in (0, 300, 300, 200, 300, 500, 400, 500):  # duplicates, an older one late, a replay
        alloc.prepare(_report(up))
    assert keeper.teams()[0].used.upload == 500
    alloc.prepare(_report(50, epoch="boot-2"))  # the node rebooted: its counter restarted from 0
    alloc.prepare(_report(600, epoch="boot-1"))  # a late report of the old boot: ignored
    assert keeper.teams()[0].used.upload == 550
    alloc.prepare(_report(10, uid="uid-a2"))  # the pod made again under its name: a new counter, a baseline
    alloc.prepare(_report(30, uid="uid-a2"))
    assert keeper.teams()[0].used.upload == 570


def test_a_leader_change_resumes_from_the_persisted_use_never_above_the_true_bytes():
    alloc, keeper, clock = _setup()
    for up in range(0, 10_001, 1000):
        alloc.prepare(_report(up))
    true = 10_000
    persisted = keeper.status()  # the last write before the old leader died
    for up in range(11_000, 14_001, 1000):  # counted by the old leader after its last write: lost
        alloc.prepare(_report(up))
    keeper.stop()
    alloc.prepare(_report(20_000))  # a follower counts nothing
    assert keeper.teams()[0].used.upload == 14_000
    new_alloc, new_keeper, _ = _setup(persisted)
    assert new_keeper.teams()[0].used.upload == true
    new_alloc.prepare(_report(14_000))  # its first report after the change: a baseline
    new_alloc.prepare(_report(14_000))  # and replayed
    new_alloc.prepare(_report(15_000))
    used = new_keeper.teams()[0].used.upload
    assert used == true + 1000 <= 15_000  # lost: the 4,000 bytes between the last write and the first report
    # figures of another period are not resumed
    stale = {"teams": [{**persisted["teams"][0], "periodStart": "2026-03-09T00:00:00Z"}]}
    assert _setup(stale)[1].teams()[0].used.upload == 0


def test_a_refused_quota_keeps_the_previous_valid_one_in_force():
    alloc, keeper, clock = _setup()
    budget = {"metadata": {"name": "main"}, "spec": {"total": "100M", "teams": [
        {"name": "research", "namespaces": ["research"], "quota": {"period": "Day", "bytes": "-5"}}]}}
    bad, problems = load_policy([], [budget])
    assert any("quota.bytes" in p for p in problems)
    keeper.set_policy(bad)
    assert keeper.quotas["research"].limits.upload.bytes == 10**6


def test_events_at_80_and_100_percent_once_per_period_and_not_again_after_a_resume():
    alloc, keeper, clock = _setup()
    clock.t += 11 * 3600 + 59 * 60  # 23:59
    alloc.prepare(_report(0, 0))
    assert keeper.crossings() == []
    alloc.prepare(_report(799_999, 0))
    assert keeper.crossings() == []
    alloc.prepare(_report(800_000, 4_000_000))
    assert keeper.crossings() == [("research", UP, "QuotaNearlySpent", 800_000, 10**6),
                                  ("research", DOWN, "QuotaNearlySpent", 4_000_000, 5 * 10**6)]
    alloc.prepare(_report(900_000, 4_000_000))
    assert keeper.crossings() == []  # told once per level
    alloc.prepare(_report(1_000_000, 4_000_000))
    assert keeper.crossings() == [("research", UP, "QuotaSpent", 10**6, 10**6)]
    new_alloc, new_keeper, _ = _setup(keeper.status())  # a new leader: the previous one told these
    assert new_keeper.crossings() == []
    new_alloc.prepare(_report(1_000_000, 4_000_000))
    new_alloc.prepare(_report(1_000_000, 5_000_000))
    assert new_keeper.crossings() == [("research", DOWN, "QuotaSpent", 5 * 10**6, 5 * 10**6)]
    clock.t += 61  # just past midnight: the next day, told again when reached again
    keeper.tick()
    alloc.prepare(_report(1_900_000, 4_000_000))
    assert keeper.crossings() == [("research", UP, "QuotaNearlySpent", 900_000, 10**6)]


def test_the_array_path_counts_as_the_ledger_does_through_pod_churn_and_missing_counters():
    """The node's pods as arrays (the common case) against core.quota.Ledger pod by pod, on a random run of
    reports with retries, reorders, pods coming and going, a pod without a counter and a reboot."""
    import random

    from core.quota import Ledger
    rnd = random.Random(38)
    alloc, keeper, clock = _setup()
    ref = Ledger.resume({})
    counters = {f"uid-{i}": [0, 0] for i in range(6)}
    live = ["uid-0", "uid-1", "uid-2"]
    epoch, history = "boot-1", []
    for step in range(300):
        roll = rnd.random()
        if roll < 0.05 and len(live) > 1:
            live.remove(rnd.choice(live))
        elif roll < 0.1:
            uid = rnd.choice(sorted(counters))
            if uid not in live:
                live.append(uid)
        elif roll < 0.12:
            epoch = f"boot-{step}"
            counters = {u: [0, 0] for u in counters}
        for uid in live:
            counters[uid][0] += rnd.randrange(0, 5000)
            counters[uid][1] += rnd.randrange(0, 5000)
        pods = [PodReport("research", uid, 1e6, 1e6, bytes_total=None if rnd.random() < 0.02 else counters[uid][0],
                          ingress_bytes_total=counters[uid][1], uid=uid) for uid in live]
        report = NodeReport("n1", pods, epoch=epoch, shapes_ingress=True)
        history.append(report)
        if rnd.random() < 0.2 and len(history) > 2:
            report = history[-rnd.randrange(2, min(5, len(history)) + 1)]  # a retry or a late one instead
        alloc.prepare(report)
        ref.add_report(report.epoch, [("research", p.uid, p.bytes_total, p.ingress_bytes_total) for p in report.pods])
    assert keeper.teams()[0].used.upload == ref.team_used("research", UP) > 0
    assert keeper.teams()[0].used.download == ref.team_used("research", DOWN) > 0


def _counted_round():
    """A controller state that counted three reports of research's pod (1.2 MB each way) and ran a round;
    and its quota keeper."""
    from controller.state import ControllerState
    alloc, keeper, _ = _setup()
    state = ControllerState(alloc)
    for counter in (0, 600_000, 1_200_000):
        state.submit(None, _report(counter, counter))
    state.run_round()
    return state, keeper


def test_v1_status_shows_each_teams_use_quota_and_forecast():
    from controller.view import cluster_view
    state, keeper = _counted_round()
    quota, = cluster_view(state)["quota"]
    assert quota["team"] == "research" and quota["period"] == "Day"
    assert quota["period_start"] == "2026-03-10T00:00:00+00:00" and quota["period_end"] == "2026-03-11T00:00:00+00:00"
    assert quota["uploads"] == {"bytes": 10**6, "used": 1_200_000, "exhausted": True, "exhausted_bps": 2 * M,
                                "forecast_seconds": 0.0}
    assert quota["downloads"]["used"] == 1_200_000 and not quota["downloads"]["exhausted"]
    keeper.stop()
    assert cluster_view(state)["quota"] == []  # a follower's figures are not counted


def test_the_forecast_metric_the_dashboard_shows():
    """netagent_team_quota_exhaustion_forecast_seconds (the cluster dashboard's "Quota forecast"): 0 when spent,
    absent with no use over the last minute; the live dashboard test cannot wait the minute it needs."""
    from prometheus_client import CollectorRegistry

    from controller.quotastore import QuotaCollector
    state, keeper = _counted_round()
    registry = CollectorRegistry()
    registry.register(QuotaCollector(keeper, None, lambda: True))
    metric = "netagent_team_quota_exhaustion_forecast_seconds"
    assert registry.get_sample_value(metric, {"team": "research", "direction": "egress"}) == 0.0  # spent
    assert registry.get_sample_value(metric, {"team": "research", "direction": "ingress"}) is None  # no rate yet


def test_netagent_status_shows_the_quotas_from_v1_status():
    from cli import clusterview
    from controller.view import cluster_view
    from tests.test_status_cluster import snapshot
    state, _ = _counted_round()
    snap = snapshot()
    snap["controller"]["view"]["quota"] = cluster_view(state)["quota"]
    v = clusterview.view(snap)
    assert v["quotas"][0]["team"] == "research"
    text = clusterview.render(v)
    assert "Quotas:" in text
    up = next(line for line in text.splitlines() if "research" in line and "uploads" in line)
    assert "120% EXHAUSTED" in up and "Day from 2026-03-10T00:00" in up
    assert clusterview.view(snapshot())["quotas"] == []
