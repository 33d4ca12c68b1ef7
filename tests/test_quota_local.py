"""Single-machine mode's volume quotas (netagent.localquota, docs/quotas.md "Single-machine mode"): the state
file, its atomic write, the restart rules, and the cap through the local allocator. Pure apart from a temporary
directory; the real agent process across a restart is tests/test_quota_local_lab.py."""
from __future__ import annotations

import json
from datetime import datetime, timezone

from core.direction import Direction
from core.policy import load_policy
from netagent.localquota import STATE_FILE, LocalQuota, persisted_use

M = 1_000_000
CLASSES = [{"metadata": {"name": "bronze"}, "spec": {"weight": 1, "max": "100M"}}]
BUDGET = {"metadata": {"name": "default"}, "spec": {"total": "100M", "teams": [
    {"name": "research", "namespaces": ["research"], "defaultClass": "bronze",
     "quota": {"period": "Day", "bytes": "1M", "exhaustedRate": "2M"}},
    {"name": "web", "namespaces": ["web"], "defaultClass": "bronze"}]}}
NOW = datetime(2026, 11, 28, 12, tzinfo=timezone.utc).timestamp()


def policy():
    pol, problems = load_policy(CLASSES, [BUDGET])
    assert not problems
    return pol


class Pods:
    def __init__(self):
        self.rows: dict[str, tuple[str, int, int]] = {}

    def __call__(self):
        return [(k, team, up, down) for k, (team, up, down) in self.rows.items()]


def keeper(tmp_path, pods, epoch="boot-1", clock=lambda: NOW):
    q = LocalQuota(tmp_path, policy, epoch, pods, clock=clock, write_every=0.0)
    q.load()
    return q


def test_counts_increases_writes_atomically_and_a_restart_in_the_same_epoch_loses_nothing(tmp_path):
    pods = Pods()
    pods.rows["research/a"] = ("research", 100, 5)
    pods.rows["web/b"] = ("web", 10**9, 0)  # a team without a quota: not counted
    q = keeper(tmp_path, pods)
    q.look()  # no state file at the first start: the counters so far are a baseline (never above the true bytes)
    pods.rows["research/a"] = ("research", 600_100, 5)
    q.look()
    q.look()  # the same counter again adds nothing
    data = json.loads((tmp_path / STATE_FILE).read_text())
    assert persisted_use(data) == {"research": (600_000, 0)}
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed
    # the agent restarts (same epoch: the kernel kept the counters), the pod sent 500,000 bytes meanwhile
    pods.rows["research/a"] = ("research", 1_100_100, 5)
    q2 = keeper(tmp_path, pods)
    q2.look()
    assert q2.ledger.team_used("research", Direction.UPLOAD) == 1_100_000
    assert q2.exhausted(Direction.UPLOAD) == {"research"}
    # the cap: research at its exhaustedRate with no guarantee; web unchanged
    capped = q2.limit(policy(), [], Direction.UPLOAD, M)
    research = next(t for t in capped.teams if t.name == "research")
    assert (research.limits.upload.max_bps, research.limits.upload.min_bps) == (2 * M, 0)
    assert next(t for t in capped.teams if t.name == "web") == next(t for t in policy().teams if t.name == "web")
    assert q2.limit(policy(), [], Direction.DOWNLOAD, M) == policy()
    shown = q2.teams()[0]
    assert shown["team"] == "research" and shown["uploads"]["used"] == 1_100_000 and shown["uploads"]["exhausted"]
    assert shown["uploads"]["forecast_seconds"] == 0.0 and shown["downloads"] is None


def test_a_new_epoch_takes_the_counters_as_baselines_and_keeps_the_figure(tmp_path):
    pods = Pods()
    pods.rows["research/a"] = ("research", 0, 0)
    q = keeper(tmp_path, pods)
    q.look()
    pods.rows["research/a"] = ("research", 400_000, 0)
    q.look()
    pods.rows["research/a"] = ("research", 7_000, 0)  # a reboot: the counters started again from 0
    q2 = keeper(tmp_path, pods, epoch="boot-2")
    q2.look()
    assert q2.ledger.team_used("research", Direction.UPLOAD) == 400_000  # kept, the baseline not counted
    pods.rows["research/a"] = ("research", 9_000, 0)
    q2.look()
    assert q2.ledger.team_used("research", Direction.UPLOAD) == 402_000


def test_a_new_period_starts_at_zero_and_an_unreadable_file_is_a_fresh_start(tmp_path):
    pods = Pods()
    pods.rows["research/a"] = ("research", 0, 0)
    q = keeper(tmp_path, pods)
    q.look()
    pods.rows["research/a"] = ("research", 2 * M, 0)
    q.look()
    assert q.exhausted(Direction.UPLOAD)
    tomorrow = NOW + 86_400
    q2 = keeper(tmp_path, pods, clock=lambda: tomorrow)  # the file's figure is yesterday's
    q2.look()
    assert q2.ledger.team_used("research", Direction.UPLOAD) == 0 and not q2.exhausted(Direction.UPLOAD)
    q.clock = lambda: tomorrow  # the running keeper rolls over too, counters kept
    pods.rows["research/a"] = ("research", 2 * M + 10, 0)
    q.look()
    assert q.ledger.team_used("research", Direction.UPLOAD) == 10
    (tmp_path / STATE_FILE).write_text("{not json")
    q3 = keeper(tmp_path, pods)
    q3.look()
    assert q3.ledger.team_used("research", Direction.UPLOAD) == 0


def test_the_forecast_and_netagent_status_show_each_teams_use_quota_and_forecast(tmp_path):
    from netagent.status import quota_table

    pods = Pods()
    pods.rows["research/a"] = ("research", 0, 0)
    now = [NOW]
    q = keeper(tmp_path, pods, clock=lambda: now[0])
    q.look()
    assert q.teams()[0]["uploads"]["forecast_seconds"] is None  # no use yet: never, at this rate
    now[0] += 60
    pods.rows["research/a"] = ("research", 300_000, 0)  # 5,000 bytes a second over the last minute
    q.look()
    shown = q.teams()
    assert shown[0]["uploads"]["forecast_seconds"] == (M - 300_000) / 5_000  # 140 s
    text = quota_table(shown)
    assert "research" in text and "uploads" in text and "30%" in text and "0.0 h" in text, text
    assert "downloads" not in text  # no quota on downloads
