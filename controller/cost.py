"""Where the bytes go and what they cost (issue 39, docs/scopes.md "Cost in the controller"): the leader's
bytes per team, priced scope and direction from the counters the reports already carry (internet: the
quota counters, `wire.POD_BYTES`; cross-zone, cross-region: the per-scope fields, `wire.POD_SCOPE_BYTES`), and their cost from
the NetworkScopes prices (the last valid description; core/scopes.py).

Counted as the volume quotas count (core.quota.Ledger: per pod only an increase counts, a retried or
reordered report adds nothing, a new epoch counts afresh), one ledger per scope. Nothing is counted while
no NetworkScopes object with prices is known: without one the reports cost the controller nothing here.
Figures are held in memory since this replica started leading (`total`) and for each team's current
calendar period (its quota's period, a Month without a quota), not persisted (docs/scopes.md says so).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Callable, Iterable, Mapping
from zoneinfo import ZoneInfo

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from core.direction import DIRECTIONS, Direction
from core.quota import Ledger, Period, TeamQuota, period_bounds
from core.scopes import PRICED, Prices, Scope, ScopesDescription, cost, keep_last_valid, parse
from core.wire import POD_BYTES, POD_SCOPE_BYTES, NodeReport

log = logging.getLogger(__name__)

Key = tuple[str, Scope, Direction]  # (team, scope, direction)


def _counter(scope: Scope, d: Direction) -> Callable[[Any], int | None]:
    """The report field of one priced scope and direction (internet: the quota counter)."""
    if scope is Scope.INTERNET:
        return POD_BYTES[d]
    get, name = POD_SCOPE_BYTES[d], scope.value
    return lambda pod: get(pod).get(name)


_COUNTERS = {(s, d): _counter(s, d) for s in PRICED for d in DIRECTIONS}
_COLUMNS = tuple((s, d) for s in PRICED for d in DIRECTIONS)  # the node cache's columns, in this order
_ABSENT = -1  # a counter the report does not carry (the wire refuses negative counters)


# _matrix reads the fields by name, in _COLUMNS' order
assert [(s.value, d.value) for s, d in _COLUMNS] == [
    ("internet", "upload"), ("internet", "download"), ("cross-zone", "upload"), ("cross-zone", "download"),
    ("cross-region", "upload"), ("cross-region", "download")], _COLUMNS


def _matrix(pods: list[Any]) -> np.ndarray:
    """The report's counters, one row per pod, one column per (priced scope, direction) of _COLUMNS; _ABSENT
    where not carried. One pass over the pods, no object per pod kept."""
    a = _ABSENT
    up_bytes, down_bytes = POD_BYTES[Direction.UPLOAD], POD_BYTES[Direction.DOWNLOAD]
    up_scopes, down_scopes = POD_SCOPE_BYTES[Direction.UPLOAD], POD_SCOPE_BYTES[Direction.DOWNLOAD]
    return np.array([(a if (iu := up_bytes(p)) is None else iu,
                      a if (idn := down_bytes(p)) is None else idn,
                      (up := up_scopes(p)).get("cross-zone", a), (down := down_scopes(p)).get("cross-zone", a),
                      up.get("cross-region", a), down.get("cross-region", a)) for p in pods],
                    dtype=np.int64).reshape(len(pods), len(_COLUMNS))


@dataclass
class _NodeCache:
    """A node's pods as the ledgers last counted them: while the node's next report has the same epoch, pods,
    teams and carried counters, its increases are counted on these arrays (no Python step per pod); the
    ledgers' per-pod counters are brought up to date (`_flush`) before they count this node's pods again."""
    epoch: str
    keys: tuple[str, ...]
    rows: np.ndarray  # each pod's policy row
    heads: tuple[int, ...]  # the first pod of each distinct row: the teams are checked on these alone
    teams: tuple[str, ...]  # the team of each of `heads`
    unique: tuple[str, ...]  # the distinct teams, in first-seen order
    order: np.ndarray  # the pods sorted by team (stable), and where each team's run starts in it: the
    starts: np.ndarray  # per-team sums as one reduceat, in a few hundred bytes per node
    last: np.ndarray  # (pods, columns) int64, _ABSENT where not carried


class CostKeeper:
    """Bytes and cost per (team, scope, direction), this period and since counting started."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self.description: ScopesDescription | None = None
        self.problems: list[str] = []
        # a pod first seen is a baseline (its bytes before are not this controller's to count), as for quotas
        self.ledgers = {s: Ledger.resume({}) for s in PRICED}  # used = this period's bytes, per (team, direction)
        # bytes since counting started = rolled (earlier periods' counted bytes) + this period's - base (resumed)
        self.rolled: dict[Key, int] = {}
        self.base: dict[Key, int] = {}
        self._ends: dict[str, datetime] = {}  # team -> end of its current period (the roll-over check's cache)
        self.starts: dict[str, datetime] = {}  # team -> start of its current period
        self.quotas: Mapping[str, TeamQuota] = {}
        self.zone_name = "UTC"
        self._nodes: dict[str, _NodeCache] = {}  # node -> its pods' counters as last counted (the array path)

    @property
    def prices(self) -> Prices | None:
        return self.description.prices if self.description is not None else None

    def set_scopes(self, obj: Mapping[str, Any] | None) -> list[str]:
        """The NetworkScopes object (None: none in the cluster). A refused one keeps the last valid description
        (its problems returned and logged, each naming the field); a deleted one stops the counting."""
        with self._lock:
            if obj is None:
                self.description, self.problems = None, []
                return []
            parsed = parse(obj)
            self.description = keep_last_valid(self.description, parsed)
            self.problems = parsed.problems
        for p in parsed.problems:
            log.warning("NetworkScopes %s: %s; the last valid description stays in force",
                        (obj.get("metadata") or {}).get("name", "?"), p)
        return parsed.problems

    def set_quotas(self, quotas: Mapping[str, TeamQuota], zone_name: str) -> None:
        """The teams' quotas (their periods) and the quota time zone, from the current policy."""
        with self._lock:
            if quotas != self.quotas or zone_name != self.zone_name:
                self.quotas, self.zone_name = dict(quotas), zone_name
                self._ends.clear()  # a period may have changed: checked again at the next report

    def _roll(self, team: str, now: datetime) -> None:
        end = self._ends.get(team)
        if end is not None and now < end:
            return
        quota = self.quotas.get(team)
        start, self._ends[team] = period_bounds(quota.period if quota is not None else Period.MONTH, now,
                                                ZoneInfo(self.zone_name))
        if self.starts.get(team) != start:
            if team in self.starts:
                for scope, ledger in self.ledgers.items():
                    for d in DIRECTIONS:
                        k = (team, scope, d)
                        self.rolled[k] = self.rolled.get(k, 0) + ledger.team_used(team, d) - self.base.pop(k, 0)
                    ledger.roll_team(team)
            self.starts[team] = start

    def observe(self, report: NodeReport, rows: np.ndarray, team_of: Callable[[int], str]) -> bool:
        """One report's counters: each pod's team is `team_of(row)` of its policy row (the allocator's). True when
        a team with a cost quota counted bytes (its persisted figures changed)."""
        if self.prices is None or report.epoch is None:
            return False
        pods = report.pods
        keys = tuple(pod.uid or f"{pod.namespace}/{pod.name}" for pod in pods)
        new = _matrix(pods)
        now = datetime.fromtimestamp(self.clock(), timezone.utc)
        with self._lock:
            cache = self._nodes.get(report.node)
            if (cache is not None and cache.epoch == report.epoch and cache.keys == keys
                    and np.array_equal(cache.rows, rows) and cache.teams == tuple(map(team_of, cache.heads))
                    and np.array_equal(cache.last == _ABSENT, new == _ABSENT)):
                for team in cache.unique:
                    self._roll(team, now)
                changed = self._add_arrays(cache, new)
            else:
                teams = tuple(team_of(r) for r in rows.tolist())
                if cache is not None:
                    self._flush(report.node, cache)
                for team in dict.fromkeys(teams):
                    self._roll(team, now)
                changed = False
                for scope, ledger in self.ledgers.items():
                    up, down = _COUNTERS[(scope, Direction.UPLOAD)], _COUNTERS[(scope, Direction.DOWNLOAD)]
                    changed |= ledger.add_report(report.epoch, ((team, key, up(pod), down(pod))
                                                                for team, key, pod in zip(teams, keys, pods)))
                self._cache(report.node, report.epoch, keys, rows, teams, new)
        return changed and any(q.cost is not None for q in self.quotas.values())

    def _add_arrays(self, cache: _NodeCache, new: np.ndarray) -> bool:
        """Ledger.add_report's common case (known pods, same epoch: only an increase counts) on the arrays."""
        delta = np.subtract(new, cache.last, where=new > cache.last, out=np.zeros_like(new))
        if not delta.any():
            return False
        per_team = np.add.reduceat(delta[cache.order], cache.starts, axis=0)
        np.maximum(cache.last, new, out=cache.last)
        columns = [(self.ledgers[scope].used, d) for scope, d in _COLUMNS]
        for team, added in zip(cache.unique, per_team.tolist()):
            for (used, d), n in zip(columns, added):
                if n:
                    k = (team, d)
                    used[k] = used.get(k, 0) + n
        return True

    def _cache(self, node: str, epoch: str, keys: tuple[str, ...], rows: np.ndarray, teams: tuple[str, ...],
               new: np.ndarray) -> None:
        """Keep the node's counters as arrays when the ledgers now hold every carried one in this epoch (else the
        next report counts through the ledgers again: a stale epoch, a pod known in another one)."""
        last = np.full_like(new, _ABSENT)
        if not keys or len(set(keys)) != len(keys):  # a pod twice in one report: the ledgers count it in order
            self._nodes.pop(node, None)
            return
        for c, (scope, d) in enumerate(_COLUMNS):
            known = self.ledgers[scope].pods
            for i, key in enumerate(keys):
                if new[i, c] == _ABSENT:
                    continue
                entry = known.get((key, d))
                if entry is None or entry.epoch != epoch:
                    self._nodes.pop(node, None)
                    return
                last[i, c] = entry.last
        unique = tuple(dict.fromkeys(teams))
        where = {t: i for i, t in enumerate(unique)}
        index = np.fromiter((where[t] for t in teams), dtype=np.intp, count=len(teams))
        order = np.argsort(index, kind="stable")
        starts = np.searchsorted(index[order], np.arange(len(unique)))
        heads = tuple(dict.fromkeys(rows.tolist()))
        first = {r: i for i, r in reversed(list(enumerate(rows.tolist())))}
        self._nodes[node] = _NodeCache(epoch, keys, rows.copy(), heads, tuple(teams[first[r]] for r in heads),
                                       unique, order, starts, last)

    def _flush(self, node: str, cache: _NodeCache) -> None:
        """The node's counters counted on the arrays back into the ledgers' per-pod counters."""
        del self._nodes[node]
        for c, (scope, d) in enumerate(_COLUMNS):
            known = self.ledgers[scope].pods
            for i, key in enumerate(cache.keys):
                v = int(cache.last[i, c])
                entry = known.get((key, d))
                if v != _ABSENT and entry is not None and entry.epoch == cache.epoch and v > entry.last:
                    entry.last = v

    def figures(self) -> list[tuple[str, Scope, Direction, int, int]]:
        """(team, scope, direction, bytes this period, bytes in total), sorted."""
        with self._lock:
            keys = set(self.rolled) | {(t, s, d) for s, ledger in self.ledgers.items() for t, d in ledger.used}
            out = []
            for team, scope, d in sorted(keys, key=lambda k: (k[0], k[1].value, k[2].value)):
                k, used = (team, scope, d), self.ledgers[scope].team_used(team, d)
                out.append((team, scope, d, used, self.rolled.get(k, 0) + used - self.base.get(k, 0)))
            return out

    # -- persisted with the volume quotas' use (controller/quota.py status/resume, status.quota.teams[]) --------
    def status_of(self, team: str) -> dict[str, Any]:
        """The team's period bytes per priced scope and direction and its cost, for status.quota; {} without
        prices."""
        prices = self.prices
        if prices is None:
            return {}
        out: dict[str, Any] = {}
        for d, name in ((Direction.UPLOAD, "scopeUsed"), (Direction.DOWNLOAD, "ingressScopeUsed")):
            out[name] = {s.value: str(self.ledgers[s].team_used(team, d)) for s in PRICED}
        out["costUsed"] = format(self.team_cost(team).quantize(Decimal("0.000001")), "f")
        return out

    def resume(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """A new leader's period bytes per scope from status.quota's entries of the teams' current periods (a
        hand-edited figure that is not a number: that figure counts from 0); each pod's next counter is a
        baseline, as for the volume quotas."""
        used: dict[Scope, dict[tuple[str, Direction], int]] = {s: {} for s in PRICED}
        for entry in entries:
            for d, name in ((Direction.UPLOAD, "scopeUsed"), (Direction.DOWNLOAD, "ingressScopeUsed")):
                figures = entry.get(name)
                if not isinstance(figures, Mapping):
                    continue
                for s in PRICED:
                    try:
                        n = int(figures.get(s.value) or 0)
                    except (TypeError, ValueError):
                        continue
                    if n > 0:
                        used[s][(str(entry["name"]), d)] = n
        with self._lock:
            self.ledgers = {s: Ledger.resume(used[s]) for s in PRICED}
            # the resumed bytes are this period's, not counted by this replica: outside its total
            self.base = {(t, s, d): n for s in PRICED for (t, d), n in used[s].items()}
            self.rolled, self._ends = {}, {}
            self._nodes = {}  # new ledgers: each pod's next counter is a baseline in them

    def spent(self, quotas: Mapping[str, TeamQuota]) -> frozenset[str]:
        """The teams whose cost this period has reached their quota's cost (none without prices: a cost quota
        holds nothing while the prices are unknown, as a byte quota with no counters)."""
        if self.prices is None:
            return frozenset()
        with_cost = {t: q.cost for t, q in quotas.items() if q.cost is not None}
        if not with_cost:
            return frozenset()
        spent: dict[str, Decimal] = {}
        for team, scope, d, in_period, _ in self.figures():
            if team in with_cost:
                spent[team] = spent.get(team, Decimal(0)) + cost(self.prices, in_period, scope, d)
        return frozenset(t for t, limit in with_cost.items() if spent.get(t, Decimal(0)) >= limit)

    def team_cost(self, team: str) -> Decimal:
        """The team's cost this period over every priced scope and direction (0 without prices)."""
        prices = self.prices
        if prices is None:
            return Decimal(0)
        return sum((cost(prices, period, s, d) for t, s, d, period, _ in self.figures() if t == team), Decimal(0))


class CostCollector:
    """netagent_team_scope_bytes_total, netagent_team_cost_total and netagent_team_cost (this period), per team,
    scope and direction, on the leader only; the cost series carry the currency."""

    def __init__(self, keeper: CostKeeper, is_leader: Callable[[], bool]):
        self.keeper, self.is_leader = keeper, is_leader

    def collect(self) -> Iterable[Metric]:
        labels = ["team", "scope", "direction"]
        nbytes = CounterMetricFamily("netagent_team_scope_bytes", "bytes the team's pods moved, by priced scope "
                                     "(since this controller started leading)", labels=labels)
        total = CounterMetricFamily("netagent_team_cost", "cost of the team's bytes at the NetworkScopes prices "
                                    "(since this controller started leading)", labels=labels + ["currency"])
        period = GaugeMetricFamily("netagent_team_cost_period", "cost of the team's bytes in its current quota "
                                   "period (a calendar Month without a quota)", labels=labels + ["currency"])
        # every replica: the per-pod cost recording rules join the agents' bytes with it (no more agent series)
        price = GaugeMetricFamily("netagent_controller_scope_price_per_gib", "the NetworkScopes price per GiB by "
                                  "scope and direction", labels=["scope", "direction", "currency"])
        quota = GaugeMetricFamily("netagent_team_cost_quota", "the team's cost quota per period (quota.cost)",
                                  labels=["team", "currency"])
        problems = GaugeMetricFamily("netagent_controller_scopes_problems",
                                     "problems of the NetworkScopes object (the last valid one stays in force)",
                                     value=len(self.keeper.problems))
        prices = self.keeper.prices
        for (scope, d), per_gib in sorted((prices.per_gib if prices is not None else {}).items(),
                                          key=lambda kv: (kv[0][0].value, kv[0][1].value)):
            price.add_metric([scope.value, d.metric_word, prices.currency if prices else ""], float(per_gib))
        if prices is not None and self.is_leader():
            for team, scope, d, in_period, in_total in self.keeper.figures():
                lv = [team, scope.value, d.metric_word]
                nbytes.add_metric(lv, in_total)
                total.add_metric(lv + [prices.currency], float(cost(prices, in_total, scope, d)))
                period.add_metric(lv + [prices.currency], float(cost(prices, in_period, scope, d)))
            for team, q in sorted(self.keeper.quotas.items()):
                if q.cost is not None:
                    quota.add_metric([team, prices.currency], float(q.cost))
        yield from (nbytes, total, period, price, quota, problems)
