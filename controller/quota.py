"""The leader's volume quotas (issue 38, docs/quotas.md): the ledger fed from the reports, each team's period,
and the exhausted teams' caps for the engine.

Only the leader counts: reports reach it alone (controller/state.py), and `active` is set only once this
replica has resumed from the persisted use (controller/quotastore.py) after it became leader, and cleared when
it stops leading. Each pod's counter is keyed by its uid (the name for a report without one). A pod first seen
is a baseline (`Ledger.resume`): its bytes before that report are either in the persisted figure or never
counted, so the figure is never above the true bytes.
"""
from __future__ import annotations

import threading
import time
from itertools import repeat
from operator import attrgetter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Mapping
from zoneinfo import ZoneInfo

import msgspec
import numpy as np

from core.direction import DIRECTIONS, Direction, PerDirection
from core.engine import TeamColumns
from core.policy import Limits, Policy
from core.quota import Ledger, TeamQuota, apply_exhaustion, exhausted_teams, period_bounds, quota_figures
from core.quantity import MAX_BYTES
from core.wire import MAX_FORECAST_SECONDS, POD_BYTES, NodeReport, QuotaFigures, TeamQuotaState

FORGET_AFTER = 3600.0  # s: a pod unreported this long leaves the ledger's counters (its counted bytes stay)
RATE_WINDOW = 60.0  # s: the forecast's rate is the team's use over about this long
PRUNE_EVERY = 60.0  # s: how often the pods not reported for FORGET_AFTER are looked for
_UID = attrgetter("uid")
# the share of a quota at which an Event on the EgressBudget says so, and its reason
LEVELS = ((1.0, "QuotaSpent"), (0.8, "QuotaNearlySpent"))


@dataclass(frozen=True)
class TeamUse:
    """One team's quota and its use in the current period (metrics, status, /v1/status)."""
    name: str
    quota: TeamQuota
    period_start: datetime
    period_end: datetime
    used: PerDirection[int]
    exhausted: PerDirection[bool]
    byte_rate: PerDirection[float]  # bytes a second over the last RATE_WINDOW (the forecast's rate)


@dataclass
class _NodeCounters:
    """One node's pods with a quota, as its last report listed them, and their counters (upload, download)."""
    epoch: str
    keys: tuple[str, ...]  # the ledger's keys of the pods with a quota
    team_names: tuple[str, ...]  # the distinct teams, indexed by team_index
    team_index: np.ndarray
    last: np.ndarray  # (pods with a quota, 2) int64
    seen: float
    uids: tuple[str | None, ...]  # every pod of the report, as it listed them
    rows: np.ndarray  # their policy rows: the same rows and token = the same teams
    token: object
    mask: np.ndarray  # which of them have a quota


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


def _rfc3339(at: datetime) -> str:
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def figures(u: TeamUse, d: Direction) -> QuotaFigures | None:
    """Direction d of a team's quota for an answer; None without a byte quota in d."""
    f = quota_figures(u.quota.limits[d], u.used[d], u.byte_rate[d])
    if f is None:
        return None
    # clamped to the wire's bounds: an out-of-range figure would make the agent refuse the whole answer
    left = f.forecast_seconds
    return msgspec.structs.replace(f, used=min(f.used, MAX_BYTES),
                                   forecast_seconds=None if left is None else min(left, MAX_FORECAST_SECONDS))


class QuotaKeeper:
    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock  # wall clock: periods are calendar periods
        self._lock = threading.Lock()
        self.ledger = Ledger.resume({})
        self.quotas: dict[str, TeamQuota] = {}
        self.zone_name = "UTC"
        self.budget_name = ""
        self.starts: dict[str, datetime] = {}  # team -> start of the period its use counts
        self.seen: dict[str, float] = {}  # pod key -> wall time of its last counted report
        self.active = False
        self.version = 0  # bumped whenever what the status would say changes
        self._policy: Policy | None = None
        self._window: tuple[float, dict[tuple[str, Direction], int]] = (0.0, {})
        self._rates: dict[tuple[str, Direction], float] = {}
        self.told: dict[tuple[str, Direction], tuple[datetime, float]] = {}  # -> (period start, level told)
        self._quiet = False
        self._nodes: dict[str, _NodeCounters] = {}  # node -> its pods' counters as arrays (the common case)
        self._pruned = 0.0
        self.cost_spent: frozenset[str] = frozenset()  # teams whose cost quota is spent (controller/cost.py)
        # the cost quotas' figures persisted beside the bytes (controller/cost.py CostKeeper: status_of, resume)
        self.cost: Any = None

    # -- policy and periods ------------------------------------------------------------------------------
    def set_policy(self, policy: Policy) -> None:
        """The teams' quotas from the current policy; a refused quota or zone keeps the previous valid one."""
        if policy is self._policy:
            return
        with self._lock:
            quotas = {}
            for t in policy.teams:
                if t.quota_refused:
                    if t.name in self.quotas:
                        quotas[t.name] = self.quotas[t.name]
                elif t.quota is not None:
                    quotas[t.name] = t.quota
            self.quotas = quotas
            for cache in self._nodes.values():  # which pods have a quota may have changed
                self._flush(cache)
            self._nodes.clear()
            self.zone_name = policy.quota_zone or self.zone_name
            self.budget_name = policy.budget_name
            self._policy = policy
            self.version += 1
        self.tick()

    def tick(self, now: float | None = None) -> None:
        """Period roll-over (each team's own period; its use starts at 0, counters kept) and forgetting pods
        not reported for FORGET_AFTER. Called every round: a period's cap lifts within one round of its end."""
        now = self.clock() if now is None else now
        zone = ZoneInfo(self.zone_name)
        with self._lock:
            for team, quota in self.quotas.items():
                start, _ = period_bounds(quota.period, _utc(now), zone)
                if self.starts.get(team) != start:
                    if team in self.starts:
                        self.ledger.roll_team(team)
                    self.starts[team] = start
                    self.version += 1
            if now - self._pruned >= PRUNE_EVERY:
                self._prune(now)
            then, before = self._window
            if now - then >= RATE_WINDOW:
                used = dict(self.ledger.used)
                if then > 0:
                    self._rates = {k: max(0, v - before.get(k, 0)) / (now - then) for k, v in used.items()}
                self._window = (now, used)

    # -- counting -----------------------------------------------------------------------------------------
    def observe(self, report: NodeReport, rows: np.ndarray, team_of: Callable[[int], str], token: object) -> None:
        """One report's pod counters. `rows`: each pod's policy row (the allocator's resolution), `team_of(row)`
        its team, `token` what the rows index into (the allocator's tables: a new policy is a new token)."""
        if not self.active or report.epoch is None or not self.quotas:
            return
        pods, now = report.pods, self.clock()
        uids = tuple(map(_UID, pods))
        with self._lock:
            cache = self._nodes.get(report.node)
            if (cache is not None and cache.epoch == report.epoch and cache.token is token and cache.uids == uids
                    and np.array_equal(cache.rows, rows)):
                try:  # the common case: the node's same pods as last time, as arrays (no Python step per pod)
                    new = np.stack([np.fromiter(map(get, pods), dtype=np.int64, count=len(pods))
                                    for get in (POD_BYTES.upload, POD_BYTES.download)], axis=1)[cache.mask]
                except (TypeError, OverflowError):  # a pod without a counter this time
                    new = None
                if new is not None:
                    self._add_arrays(cache, new)
                    cache.seen = now
                    return
            if cache is not None:  # the node's pods changed: the ledger takes the pods' counters back
                self._flush(cache)
                del self._nodes[report.node]
            quotas, (up, down) = self.quotas, (POD_BYTES.upload, POD_BYTES.download)
            teams = [team_of(r) for r in rows.tolist()]
            mask = np.fromiter((team in quotas for team in teams), dtype=bool, count=len(teams))
            counted = [(team, pod.uid or f"{pod.namespace}/{pod.name}", up(pod), down(pod))
                       for pod, team, m in zip(pods, teams, mask.tolist()) if m]
            if not counted:
                return
            keys = tuple(row[1] for row in counted)
            self.seen.update(dict.fromkeys(keys, now))
            names = tuple(row[0] for row in counted)
            if self._all_new(keys) and not any(row[2] is None or row[3] is None for row in counted):
                # every pod new to this ledger (a new leader's first reports): each counter is a baseline
                # (Ledger.add's rule after a resume), kept as the node's arrays without a step per pod in the ledger
                last = np.array([row[2:] for row in counted], dtype=np.int64)
                self._cache(report.node, report.epoch, keys, names, now, uids, rows.copy(), token, mask, last)
                return
            if self.ledger.add_report(report.epoch, counted):
                self.version += 1
            self._cache(report.node, report.epoch, keys, names, now, uids, rows.copy(), token, mask)

    def _all_new(self, keys: tuple[str, ...]) -> bool:
        """No pod of `keys` known to the ledger in either direction, nor owed a count in full (a new epoch seen)."""
        ledger = self.ledger
        return ledger.resumed and all(ledger.pods.keys().isdisjoint(zip(keys, repeat(d))) and
                                      ledger.fresh.isdisjoint(zip(keys, repeat(d))) for d in DIRECTIONS)

    def _add_arrays(self, cache: _NodeCounters, new: np.ndarray) -> None:
        """Ledger.add's rule on a node's arrays: per pod and direction only an increase counts, the largest
        counter is kept (a retried or reordered report adds nothing)."""
        delta = new - cache.last
        np.maximum(delta, 0, out=delta)
        if not delta.any():
            return
        used = self.ledger.used
        for i, d in enumerate(DIRECTIONS):
            sums = np.bincount(cache.team_index, delta[:, i], minlength=len(cache.team_names))
            for j in np.flatnonzero(sums).tolist():
                key = (cache.team_names[j], d)
                used[key] = used.get(key, 0) + int(sums[j])
        np.maximum(cache.last, new, out=cache.last)
        self.version += 1

    def _cache(self, node: str, epoch: str, keys: tuple[str, ...], names: tuple[str, ...], now: float,
               uids: tuple[str | None, ...], rows: np.ndarray, token: object, mask: np.ndarray,
               last: np.ndarray | None = None) -> None:
        """Keep the node's pods' counters as arrays (`last`, or what the ledger holds when it holds every one in
        this epoch)."""
        if last is None:
            pods = self.ledger.pods
            last = np.zeros((len(keys), 2), dtype=np.int64)
            for i, key in enumerate(keys):
                for j, d in enumerate(DIRECTIONS):
                    held = pods.get((key, d))
                    if held is None or held.epoch != epoch:
                        return
                    last[i, j] = held.last
        team_names = tuple(dict.fromkeys(names))
        index = {n: i for i, n in enumerate(team_names)}
        self._nodes[node] = _NodeCounters(epoch, keys, team_names,
                                          np.fromiter((index[n] for n in names), dtype=np.intp, count=len(names)),
                                          last, now, uids, rows, token, mask)

    def _flush(self, cache: _NodeCounters) -> None:
        """The node's array counters back into the ledger (they only grew since it held them)."""
        for i, key in enumerate(cache.keys):
            for j, d in enumerate(DIRECTIONS):
                self.ledger.seed(key, d, cache.epoch, int(cache.last[i, j]))

    def _prune(self, now: float) -> None:
        """Forget the counters of nodes and pods not reported for FORGET_AFTER (their counted bytes stay)."""
        self._pruned = now
        for node, cache in list(self._nodes.items()):
            if now - cache.seen > FORGET_AFTER:
                self._flush(cache)
                del self._nodes[node]
        live = {key for cache in self._nodes.values() for key in cache.keys}
        for key in [k for k, t in self.seen.items() if now - t > FORGET_AFTER and k not in live]:
            self.ledger.forget_pod(key)
            del self.seen[key]

    def exhausted(self, d: Direction) -> frozenset[str]:
        with self._lock:
            return exhausted_teams(self.quotas, self.ledger, d, self.cost_spent)

    def set_cost_spent(self, teams: frozenset[str]) -> None:
        """The hook of the cost quotas (issue 39): these teams are held as exhausted in both directions."""
        if teams != self.cost_spent:
            self.cost_spent = teams
            self.version += 1

    def capped(self, teams: TeamColumns, d: Direction, pod_team: np.ndarray, floor_per_pod: float) -> TeamColumns:
        """The engine's team columns of direction d with each exhausted team capped at its exhaustedRate (or
        its pods' safe floor), guarantee 0 (core.quota.apply_exhaustion); the same columns when none is."""
        gone = self.exhausted(d)
        index = {n: i for i, n in enumerate(teams.names) if n in gone}
        if not index:
            return teams
        pods = np.bincount(pod_team, minlength=len(teams.names))
        weight, mins, maxs = teams.weight.copy(), teams.min_bps.copy(), teams.max_bps.copy()
        for name, i in index.items():
            cur = {name: Limits(float(weight[i]), int(mins[i]), int(min(maxs[i], 2**62)))}
            floor = int(floor_per_pod * max(1, int(pods[i])))
            limits = apply_exhaustion(cur, self.quotas, frozenset((name,)), d, floor)[name]
            mins[i], maxs[i] = limits.min_bps, limits.max_bps
        return TeamColumns(teams.names, weight, mins, maxs)

    # -- what is shown and persisted ----------------------------------------------------------------------
    def teams(self) -> list[TeamUse]:
        zone = ZoneInfo(self.zone_name)
        now = _utc(self.clock())
        with self._lock:
            out = []
            for team, quota in sorted(self.quotas.items()):
                start, end = period_bounds(quota.period, now, zone)
                used = PerDirection.build(lambda d: self.ledger.team_used(team, d))
                spent = PerDirection.build(lambda d: (q := quota.limits[d]) is not None and used[d] >= q.bytes)
                rates = PerDirection.build(lambda d: self._rates.get((team, d), 0.0))
                out.append(TeamUse(team, quota, start, end, used, spent, rates))
            return out

    def answer_states(self) -> dict[str, TeamQuotaState] | None:
        """Each team with a byte quota, its state as answers carry it (core.wire.TeamQuotaState: the figures
        QuotaCollector exports); None while this replica does not count (not leading, not resumed yet)."""
        if not self.active:
            return None
        out = {}
        for u in self.teams():
            both = PerDirection.build(lambda d: figures(u, d))
            if both.upload is not None or both.download is not None:  # a cost-only quota has no bytes
                out[u.name] = TeamQuotaState(u.name, u.quota.period.value, u.period_start.timestamp(),
                                             u.period_end.timestamp(), both.upload, both.download)
        return out

    def status(self) -> dict[str, Any]:
        """status.quota of the EgressBudget: per team its period start, use and exhaustion, per direction."""
        teams = [{"name": u.name, "periodStart": _rfc3339(u.period_start),
                  "used": str(u.used.upload), "ingressUsed": str(u.used.download),
                  "exhausted": u.exhausted.upload, "ingressExhausted": u.exhausted.download}
                 for u in self.teams()]
        if self.cost is not None:  # a cost quota's bytes per scope and its cost (issue 39)
            for entry in teams:
                entry.update(self.cost.status_of(entry["name"]))
        return {"teams": teams}

    def resume(self, persisted: Mapping[str, Any] | None) -> int:
        """Start counting as leader from the persisted status.quota: each team's use where its periodStart is the
        team's current period start (else 0); every pod's next counter is a baseline. Returns teams resumed."""
        zone = ZoneInfo(self.zone_name)
        now = _utc(self.clock())
        used: dict[tuple[str, Direction], int] = {}
        resumed = 0
        scoped: list[Mapping[str, Any]] = []  # this period's entries, for the cost quotas' figures
        with self._lock:
            starts = {t: period_bounds(q.period, now, zone)[0] for t, q in self.quotas.items()}
            for entry in (persisted or {}).get("teams") or []:
                if not isinstance(entry, Mapping) or entry.get("name") not in starts:
                    continue
                team = entry["name"]
                if entry.get("periodStart") != _rfc3339(starts[team]):
                    continue  # another period's figures
                try:
                    figures = PerDirection(int(entry.get("used") or 0), int(entry.get("ingressUsed") or 0))
                except (TypeError, ValueError):
                    continue  # a hand-edited figure is not a number: that team counts from 0
                for d in DIRECTIONS:
                    if figures[d] > 0:
                        used[(team, d)] = figures[d]
                if self.cost is not None:
                    scoped.append(entry)
                resumed += 1
            self.ledger = Ledger.resume(used)
            self.starts = starts
            self.seen.clear()
            self._nodes.clear()
            self._window, self._rates = (0.0, {}), {}
            self._quiet = True  # the levels the resumed figures reached were told by the previous leader
            self.active = True
            self.version += 1
        if self.cost is not None:
            self.cost.resume(scoped)
        return resumed

    def crossings(self) -> list[tuple[str, Direction, str, int, int]]:
        """The quotas that reached 80 % or 100 % since last asked, once per level and period: (team, direction,
        Event reason, used, bytes). After a resume the levels already reached are not told again."""
        out = []
        for u in self.teams():
            for d in DIRECTIONS:
                limit = u.quota.limits[d]
                if limit is None:
                    continue
                level, reason = next(((lv, r) for lv, r in LEVELS if u.used[d] >= lv * limit.bytes), (0.0, ""))
                start, told = self.told.get((u.name, d), (u.period_start, 0.0))
                if start != u.period_start:
                    told = 0.0
                if level > told:
                    if not self._quiet:
                        out.append((u.name, d, reason, u.used[d], limit.bytes))
                    self.told[(u.name, d)] = (u.period_start, level)
        self._quiet = False
        return out

    def stop(self) -> None:
        """No longer the leader: stop counting (the next leader resumes from the persisted use)."""
        with self._lock:
            self.active = False
