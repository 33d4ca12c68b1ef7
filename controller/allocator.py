"""The allocator: node reports -> one engine run -> per-node answers (a `RoundResult`). Pure.

One round takes the latest report of every node, resolves each pod's policy from the
annotations the agent carried (team from the namespace, class, cap), runs the columnar
allocation engine once over all of them, and splits the result back per node:

- a pod's answer: allocation (HTB rate, its fair share) and limit (HTB ceil: share plus
  headroom, never above its cap);
- node_rate: the sum of the node's pods' limits, capped at the budget total. The engine
  keeps the sum of all limits within the budget (times its feedback gain), so node classes
  never hold a pod below its answer and the cluster total is held by the engine;
- safe_floor: the budget total divided by the number of pods the cluster has (the pod
  cache's count, `known_pods`, or the round's pods when larger), so that if every agent
  lost the controller at once and fell to the floor, the cluster would still stay within
  its budget (each agent also caps the floor at the pod's own max). Never sized from one
  round alone: right after a failover a round holds only the few nodes that reported yet;
- feedback (the engine's gain): the sum of the reports' node_internet_egress_bps (the
  measured total) and of their pods' usage_bps (what the pod classes sent), when agents
  report them, fed to the engine at most once per report period (the longest
  period_seconds among the reports). Robust to one node's lies: each node's egress counts
  at most EGRESS_MARGIN times what it may send (its node rate of the previous round, or a
  fair share of the budget per node when it has none), and its pods' usage at most its
  egress; so no node moves the gain by more than its own allocation's worth (a clamp, not
  a median: the sum must stay a sum of the nodes' traffic for the gain to mean anything).

Cost: each report's pods are resolved into columns when it arrives (`prepare`; the policy
resolution is cached per distinct (namespace, class, bandwidth) triple), so a round only
concatenates columns and runs the engine, with no Python step per pod; per-node answer
lists are built when that node next reports, not for all nodes in the round.
A pod that moved between nodes counts in both nodes' reports until the old node's next
report (with the node binding, the old node can no longer report it).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Callable, Iterator

import numpy as np

from core.engine import PodColumns, TeamColumns, allocate_columns
from core.policy import Policy, resolve_pod
from core.quantity import TRICKLE_BPS
from core.wire import NodeReport, PodAllocation, PodReport

log = logging.getLogger(__name__)
_TRIPLE = attrgetter("namespace", "egress_class", "egress_bandwidth")
_KEY = attrgetter("namespace", "name")
_DEMAND = attrgetter("demand_bps")
_USAGE = attrgetter("usage_bps")
MIN_SAFE_FLOOR_BPS = float(TRICKLE_BPS)  # a pod always keeps a trickle
EGRESS_MARGIN = 1.25  # a node's reported egress counts up to this times what it was allocated
MAX_RESOLVED = 65_536  # distinct (namespace, class, bandwidth) resolutions kept; then the cache starts afresh


@dataclass
class GroupTotals:
    allocated_bps: float = 0.0
    demand_bps: float = 0.0
    used_bps: float = 0.0
    pods: int = 0


@dataclass
class TeamTotals(GroupTotals):
    guarantee_bps: float = 0.0  # the team's guarantee in effect: its min (or its pods' mins) up to its demand
    guarantee_unmet: bool = False  # allocated less than that: starved of its guarantee


@dataclass
class Summary:
    budget_name: str
    budget_bps: float
    allocated_bps: float
    demand_bps: float
    used_bps: float
    pods: int
    nodes: int
    oversubscribed: bool  # the teams' guarantees add up to more than the budget
    gain: float = 1.0  # the engine's feedback gain on the budget (measured total vs budget)
    groups: dict[tuple[str, str], GroupTotals] = field(default_factory=dict)  # (team, class)
    teams: dict[str, TeamTotals] = field(default_factory=dict)
    policy_problems: tuple[str, ...] = ()


@dataclass
class RoundResult:
    """One allocation round: every node's answers, node rates and the cluster summary."""

    by_node: Mapping[str, list[PodAllocation]]
    node_rate: dict[str, float]
    safe_floor_bps: float
    summary: Summary | None = None  # budget totals and per team/class figures
    generation: int = 0  # set by ControllerState
    computed_at: float = 0.0  # monotonic, set by ControllerState
    duration_s: float = 0.0  # set by ControllerState
    wall_time: float = 0.0  # Unix time the round finished, set by ControllerState


class NodeAllocations(Mapping):
    """node -> list[PodAllocation], built from the round's columns when the node asks (nodes
    report about once per round, so nothing is kept: 825,000 pods' answers would be ~280 MiB)."""

    def __init__(self, spans: dict[str, tuple[int, list[PodReport]]], team: np.ndarray, cls: np.ndarray,
                 team_names: tuple[str, ...], class_names: tuple[str, ...], alloc: np.ndarray, limit: np.ndarray):
        self._spans = spans
        self._team, self._cls = team, cls
        self._team_names, self._class_names = team_names, class_names
        self._alloc, self._limit = alloc, limit

    def __getitem__(self, node: str) -> list[PodAllocation]:
        start, pods = self._spans[node]
        end = start + len(pods)
        teams, classes = self._team[start:end].tolist(), self._cls[start:end].tolist()
        alloc, limit = self._alloc[start:end].tolist(), self._limit[start:end].tolist()
        tn, cn = self._team_names, self._class_names
        return [PodAllocation(p.namespace, p.name, tn[t], cn[c], a, lim)
                for p, t, c, a, lim in zip(pods, teams, classes, alloc, limit)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


@dataclass
class PreparedReport:
    """A node report with its pods' policy resolved into columns (done at submit time)."""

    report: NodeReport
    tables: tuple  # the policy tables (and resolution cache) the rows index into
    keys: tuple[tuple[str, str], ...]  # (namespace, name) per pod
    rows: np.ndarray  # per pod: its row in the policy's table (team index, class index, weight, min, max)
    demand: np.ndarray
    usage: np.ndarray


class Allocator:
    """Callable for ControllerState: (prepared reports by node) -> RoundResult; `prepare` runs
    per report at submit time, so a round only concatenates columns and runs the engine.

    `policy` returns the current (Policy, problems) from the watched or loaded CRDs;
    `namespace_labels` (optional) returns a namespace's labels for teams chosen by
    namespaceSelector."""

    def __init__(self, policy: Callable[[], tuple[Policy, list[str]]],
                 namespace_labels: Callable[[str], Mapping[str, str] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, known_pods: Callable[[], int] | None = None):
        self.policy = policy
        self.namespace_labels = namespace_labels or (lambda ns: None)
        self.known_pods = known_pods or (lambda: 0)  # pods the cluster has (pod cache): sizes the floor
        self.clock = clock
        self._last_feedback = float("-inf")
        self._previous: dict[str, tuple[tuple, np.ndarray, np.ndarray]] = {}  # node -> (keys, allocation, limit)
        self._gain_carrier = None  # the last ColumnarResult: carries the feedback gain
        self._node_rate: dict[str, float] = {}  # the previous round's node rates: bound each node's egress
        self._tables = None  # per Policy: team columns, name tuples and indexes, the resolution cache and rows
        self._resolving = threading.Lock()

    def _policy_tables(self, policy: Policy, fresh: bool = False) -> tuple:
        """(policy, team columns, names, indexes, resolution cache, rows) for `policy`; `fresh`
        starts a new cache when the current one is full (its keys are agent-supplied strings)."""
        tables = self._tables
        if tables is None or tables[0] is not policy or fresh:
            with self._resolving:
                tables = self._tables
                if tables is None or tables[0] is not policy or (fresh and len(tables[6]) >= MAX_RESOLVED):
                    team_names = tuple(t.name for t in policy.teams)
                    class_names = tuple(policy.classes)
                    tables = self._tables = (
                        policy, TeamColumns.from_policy(policy), team_names, class_names,
                        {n: i for i, n in enumerate(team_names)}, {n: i for i, n in enumerate(class_names)}, {}, [])
        return tables

    def prepare(self, report: NodeReport, policy: Policy | None = None, in_round: bool = False) -> PreparedReport:
        """The report's pods resolved into columns (cached per (namespace, class, bandwidth);
        at submit time a full cache starts afresh, and the next round re-resolves the reports
        prepared against the old one)."""
        if policy is None:
            policy, _ = self.policy()
        tables = self._policy_tables(policy)
        if not in_round and len(tables[6]) >= MAX_RESOLVED:
            tables = self._policy_tables(policy, fresh=True)
        _, _, _, _, team_index, class_index, cache, table = tables
        pods = report.pods
        triples = list(map(_TRIPLE, pods))  # map/attrgetter: the per-pod steps run in C
        rows = list(map(cache.get, triples))
        if None in rows:
            with self._resolving:  # the event loop and the round thread (after a policy change) both come here
                for i, (row, triple) in enumerate(zip(rows, triples)):
                    if row is None:
                        row = cache.get(triple)
                    if row is None:
                        namespace, egress_class, bandwidth = triple
                        pp = resolve_pod(policy, namespace, egress_class, bandwidth,
                                         self.namespace_labels(namespace))
                        table.append((team_index[pp.team], class_index[pp.egress_class], float(pp.weight),
                                      float(pp.min_bps), float(pp.max_bps)))
                        row = cache[triple] = len(table) - 1
                    rows[i] = row
        n = len(pods)
        return PreparedReport(
            report, tables, tuple(map(_KEY, pods)), np.array(rows, dtype=np.intp),
            np.fromiter(map(_DEMAND, pods), dtype=np.float64, count=n),
            np.fromiter(map(_USAGE, pods), dtype=np.float64, count=n),
        )

    def __call__(self, reports: dict[str, PreparedReport | NodeReport]) -> RoundResult:
        """One round over the latest report of every node."""
        policy, problems = self.policy()
        tables = self._policy_tables(policy)
        _, team_cols, team_names, class_names, _, _, _, rows = tables
        nodes = sorted(reports)  # a stable order: unchanged pods keep their index between rounds
        prepared = []
        for node in nodes:
            item = reports[node]
            # the policy changed since, or the resolution cache started afresh
            if not isinstance(item, PreparedReport) or item.tables is not tables:
                item = self.prepare(item if isinstance(item, NodeReport) else item.report, policy, in_round=True)
            prepared.append(item)
        n = sum(len(item.keys) for item in prepared)
        # `rows` is read after preparing: a pod resolved just now has its row
        ids = np.concatenate([item.rows for item in prepared]) if prepared else np.zeros(0, dtype=np.intp)
        table = np.array(rows, dtype=np.float64).reshape(len(rows), 5)[ids]
        demand = np.concatenate([item.demand for item in prepared]) if prepared else np.zeros(0)
        usage = np.concatenate([item.usage for item in prepared]) if prepared else np.zeros(0)
        team = table[:, 0].astype(np.intp)
        cls = table[:, 1].astype(np.intp)
        pods = PodColumns(team=team, weight=table[:, 2].copy(), min_bps=table[:, 3].copy(),
                          max_bps=table[:, 4].copy(), demand_bps=demand)

        total = float(policy.total_bps)
        # each node's word on the measured total is bounded by what it may send (see the module doc)
        fair_node = total / max(1, len(nodes))
        egress = [min(item.report.node_internet_egress_bps,
                      EGRESS_MARGIN * max(self._node_rate.get(node, 0.0), fair_node))
                  for node, item in zip(nodes, prepared)]
        measured = sum(egress)
        any_measured = any(e > 0 for e in egress)
        report_period = max((item.report.period_seconds for item in prepared), default=0.0)
        # the measured total changes once per report period: feeding it to the gain in every
        # round of a shorter allocation period would apply the same correction several times
        feedback = None
        now = self.clock()
        if any_measured and now - self._last_feedback >= report_period * 0.9:
            feedback, self._last_feedback = measured, now
        # the gain is the ratio of what the pods' classes sent to the measured total (other byte
        # counts, unshaped host traffic), both from the nodes that measure their egress; a node's
        # pods never sent more than the node did
        shaped = None
        if feedback is not None:
            shaped = float(sum(min(float(item.usage.sum()), e) for item, e in zip(prepared, egress) if e > 0))
        result = allocate_columns(team_cols, pods, total, feedback, self._aligned_previous(nodes, prepared),
                                  shaped_usage_bps=shaped)
        alloc, limit = result.allocation, result.limit

        spans: dict[str, tuple[int, list[PodReport]]] = {}
        node_rate: dict[str, float] = {}
        previous: dict[str, tuple[tuple, np.ndarray, np.ndarray]] = {}
        start = 0
        for node, item in zip(nodes, prepared):
            end = start + len(item.keys)
            spans[node] = (start, item.report.pods)
            node_rate[node] = min(total, float(limit[start:end].sum()))
            previous[node] = (item.keys, alloc[start:end], limit[start:end])
            start = end
        self._previous, self._gain_carrier, self._node_rate = previous, result, node_rate
        by_node = NodeAllocations(spans, team, cls, team_names, class_names, alloc, limit)
        floor = max(MIN_SAFE_FLOOR_BPS, total / max(1, n, self.known_pods()))
        summary = self._summary(policy, problems, result, team, cls, team_names, class_names, demand, usage,
                                measured if any_measured else float(usage.sum()), len(reports))
        return RoundResult(by_node, node_rate, floor, summary)

    def _aligned_previous(self, nodes: list[str], prepared: list[PreparedReport]):
        """The previous round's per-pod numbers in this round's order (NaN for pods it did not
        have), node by node: a node whose pod list did not change costs one tuple comparison."""
        if self._gain_carrier is None:
            return None
        allocs, limits = [], []
        for node, item in zip(nodes, prepared):
            old = self._previous.get(node)
            if old is not None and old[0] == item.keys:
                allocs.append(old[1])
                limits.append(old[2])
                continue
            a = np.full(len(item.keys), np.nan)
            lim = np.full(len(item.keys), np.nan)
            if old is not None:
                position = {k: i for i, k in enumerate(old[0])}
                for i, k in enumerate(item.keys):
                    j = position.get(k)
                    if j is not None:
                        a[i], lim[i] = old[1][j], old[2][j]
            allocs.append(a)
            limits.append(lim)
        empty = np.zeros(0)
        return replace(self._gain_carrier, allocation=np.concatenate(allocs) if allocs else empty,
                       limit=np.concatenate(limits) if limits else empty)

    @staticmethod
    def _summary(policy, problems, result, team, cls, team_names, class_names, demand, usage, used_total,
                 nodes) -> Summary:
        n_teams, n_classes = len(team_names), len(class_names)
        group = team * n_classes + cls
        size = n_teams * n_classes
        g_alloc = np.bincount(group, result.allocation, size)
        g_demand = np.bincount(group, demand, size)
        g_used = np.bincount(group, usage, size)
        g_pods = np.bincount(group, minlength=size)
        groups = {}
        for g in np.flatnonzero(g_pods).tolist():
            groups[(team_names[g // n_classes], class_names[g % n_classes])] = GroupTotals(
                float(g_alloc[g]), float(g_demand[g]), float(g_used[g]), int(g_pods[g]))
        t_used = np.bincount(team, usage, n_teams)
        teams = {}
        for t in np.flatnonzero(result.team_pods).tolist():
            allocated, guarantee = float(result.team_allocation[t]), float(result.team_guarantee[t])
            teams[team_names[t]] = TeamTotals(allocated, float(result.team_demand[t]), float(t_used[t]),
                                              int(result.team_pods[t]), guarantee,
                                              allocated < guarantee * (1 - 1e-6))
        return Summary(
            budget_name=policy.budget_name, budget_bps=float(policy.total_bps),
            allocated_bps=float(result.allocation.sum()), demand_bps=float(demand.sum()), used_bps=used_total,
            pods=int(team.size), nodes=nodes, oversubscribed=bool(result.oversubscribed), gain=float(result.gain),
            groups=groups, teams=teams, policy_problems=tuple(problems),
        )
