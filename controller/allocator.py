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
  measured total) and of what their classes sent over the same seconds (node_shaped_egress_bps;
  an older agent's report has only its pods' usage_bps, and the engine then waits for a steady
  plant), when agents report them, fed to the engine at most once per report period (the longest
  period_seconds among the reports). Robust to one node's lies: each node's egress counts
  at most EGRESS_MARGIN times what it may send (its node rate of the previous round, or a
  fair share of the budget per node when it has none), and its pods' usage at most its
  egress; so no node moves the gain by more than its own allocation's worth (a clamp, not
  a median: the sum must stay a sum of the nodes' traffic for the gain to mean anything);
- takeover hold-back: for `takeover_seconds` (the report TTL) after this replica became leader
  (`new_term`), the engine shares only the heard nodes' part of the budget, total × heard nodes /
  known nodes (the nodes that run an agent pod, controller/sources.py), and holds the rest back for the nodes it has not
  heard from yet. Those agents still enforce the previous leader's answers under their lease,
  then the safe floor, and either is about a node's share; a new leader that gave the whole
  budget to the first nodes to report would let the cluster overshoot until every node had
  reported (+10.8 % at 5,000 nodes, docs/scale.md). The old leader kept a silent node's share for
  the same report TTL, so this is the same promise carried across the change of leader.

Cost: each report's pods are resolved into columns when it arrives (`prepare`; the policy
resolution is cached per distinct (namespace, class, bandwidth) triple), so a round only
concatenates columns and runs the engine, with no Python step per pod; per-node answer
lists are built when that node next reports, not for all nodes in the round.
A pod that moved between nodes counts in both nodes' reports until the old node's next
report (with the node binding, the old node can no longer report it).

Two directions, one engine: uploads (egress) over every report against the budget's total,
and downloads (ingress) over the reports of agents that shape them (`shapes_ingress`)
against `spec.ingressTotal`, with the policy's download values (`Limits` per `Direction`): one
loop over the directions, each with its own hysteresis, feedback gain (from the node's and the
pods' measured internet traffic in that direction, bounded per node the same way) and node rates. Pods of an agent that
does not shape downloads get no download answer (None): that agent enforces its own caps.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Callable, Iterator, NamedTuple

import numpy as np

from core.direction import DIRECTIONS, Direction, PerDirection
from core.engine import ColumnarResult, PodColumns, TeamColumns, allocate_columns
from core.quantity import MAX_BPS
from core.policy import Policy, resolve_pod
from core.quantity import TRICKLE_BPS
from core.wire import (NODE_MEASURED, NODE_SHAPED, POD_DEMAND, POD_USAGE, NodeReport, PodAllocation, PodReport,
                       TeamQuotaState)

from .cost import CostKeeper
from .quota import QuotaKeeper

log = logging.getLogger(__name__)
# what a pod's policy depends on: namespace, class, and the two bandwidth annotations
_ANNOTATIONS = attrgetter("namespace", "egress_class", "egress_bandwidth", "ingress_bandwidth")
_KEY = attrgetter("namespace", "name")
MIN_SAFE_FLOOR_BPS = float(TRICKLE_BPS)  # a pod always keeps a trickle
# a node's reported internet traffic (either direction) counts up to this times what it was allocated
REPORT_MARGIN = 1.25
MAX_RESOLVED = 65_536  # distinct (namespace, class, annotations) resolutions kept; then the cache starts afresh
ROW = 8  # a resolved row: team index, class index, then weight, min, max per direction:
_COLUMNS = PerDirection(slice(2, 5), slice(5, 8))


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
    held_back_bps: float = 0.0  # held for nodes a new leader has not heard from yet (takeover hold-back)
    groups: dict[tuple[str, str], GroupTotals] = field(default_factory=dict)  # (team, class)
    teams: dict[str, TeamTotals] = field(default_factory=dict)
    policy_problems: tuple[str, ...] = ()
    # the same figures for downloads (budget_bps = spec.ingressTotal, nodes = those shaping
    # downloads); None while no agent shaping downloads reports
    ingress: "Summary | None" = None


@dataclass
class RoundResult:
    """One allocation round: every node's answers, node rates and the cluster summary."""

    by_node: Mapping[str, list[PodAllocation]]
    node_rate: dict[str, float]
    safe_floor_bps: float
    summary: Summary | None = None  # budget totals and per team/class figures
    # downloads: only the nodes whose agent shapes them (the others' answers carry None)
    node_ingress_rate: dict[str, float] = field(default_factory=dict)
    safe_ingress_floor_bps: float | None = None
    generation: int = 0  # set by ControllerState
    computed_at: float = 0.0  # monotonic, set by ControllerState
    duration_s: float = 0.0  # set by ControllerState
    wall_time: float = 0.0  # Unix time the round finished, set by ControllerState
    # each team with a byte quota, its state as the answers carry it (controller/quota.py answer_states);
    # None: no quota keeper, or this replica does not count
    quota: Mapping[str, TeamQuotaState] | None = None


class NodeAllocations(Mapping):
    """node -> list[PodAllocation], built from the round's columns when the node asks (nodes
    report about once per round, so nothing is kept: 825,000 pods' answers would be ~280 MiB)."""

    def __init__(self, spans: dict[str, tuple[int, list[PodReport]]], team: np.ndarray, cls: np.ndarray,
                 team_names: tuple[str, ...], class_names: tuple[str, ...], lanes: PerDirection["_Lane"]):
        self._spans = spans
        self._team, self._cls = team, cls
        self._team_names, self._class_names = team_names, class_names
        self._lanes = lanes

    def __getitem__(self, node: str) -> list[PodAllocation]:
        start, pods = self._spans[node]
        end = start + len(pods)
        teams, classes = self._team[start:end].tolist(), self._cls[start:end].tolist()
        tn, cn = self._team_names, self._class_names
        # per direction (alloc, limit) lists; None for a direction this node's agent does not shape
        figures = [(lane.alloc[start:end].tolist(), lane.limit[start:end].tolist()) if node in lane.nodes
                   else ([None] * len(pods),) * 2 for _, lane in self._lanes.items()]
        (up_a, up_l), (down_a, down_l) = figures
        return [PodAllocation(p.namespace, p.name, tn[t], cn[c], a, lim, da, dl)
                for p, t, c, a, lim, da, dl in zip(pods, teams, classes, up_a, up_l, down_a, down_l)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


@dataclass
class PreparedReport:
    """A node report with its pods' policy resolved into columns (done at submit time)."""

    report: NodeReport
    tables: "_Tables"  # the policy tables (and resolution cache) the rows index into
    keys: tuple[tuple[str, str], ...]  # (namespace, name) per pod
    rows: np.ndarray  # per pod: its row in the policy's table (see ROW)
    demand: PerDirection[np.ndarray]  # downloads: zeros when the agent does not shape them
    usage: PerDirection[np.ndarray]


class _Tables(NamedTuple):
    """One policy's tables: team columns per direction, names and indexes, the resolution cache
    ((namespace, class, egress bandwidth, ingress bandwidth) -> row) and the rows (see ROW)."""
    policy: Policy
    teams: PerDirection[TeamColumns]
    team_names: tuple[str, ...]
    class_names: tuple[str, ...]
    team_index: dict[str, int]
    class_index: dict[str, int]
    cache: dict[tuple, int]
    rows: list[tuple[float, ...]]


@dataclass
class _Direction:
    """What one direction carries from round to round."""
    previous: dict[str, tuple[tuple, np.ndarray, np.ndarray]] = field(default_factory=dict)  # node -> (keys, alloc, limit)
    gain_carrier: ColumnarResult | None = None  # the last round's result: carries the feedback gain
    node_rate: dict[str, float] = field(default_factory=dict)  # the previous round's: bound each node's measured total
    last_feedback: float = float("-inf")


class _Lane(NamedTuple):
    """One direction's round, aligned with all the round's pods (NaN for pods of other nodes)."""
    alloc: np.ndarray
    limit: np.ndarray
    nodes: frozenset[str]  # the nodes allocated in this direction
    node_rate: dict[str, float]
    floor: float | None  # None: no node allocated in this direction
    summary: "Summary | None"


class _Run(NamedTuple):
    """One direction's round: the engine's result and its per-node figures."""
    result: ColumnarResult
    node_rate: dict[str, float]
    used_bps: float  # the measured total, or the pods' usage when no node measures it


class Allocator:
    """Callable for ControllerState: (prepared reports by node) -> RoundResult; `prepare` runs
    per report at submit time, so a round only concatenates columns and runs the engine.

    `policy` returns the current (Policy, problems) from the watched or loaded CRDs;
    `namespace_labels` (optional) returns a namespace's labels for teams chosen by
    namespaceSelector."""

    def __init__(self, policy: Callable[[], tuple[Policy, list[str]]],
                 namespace_labels: Callable[[str], Mapping[str, str] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, known_pods: Callable[[], int] | None = None,
                 known_nodes: Callable[[], int] | None = None, takeover_seconds: float = 0.0,
                 quota: QuotaKeeper | None = None, cost: CostKeeper | None = None):
        self.policy = policy
        self.quota = quota  # volume quotas: fed from each report, caps exhausted teams (controller/quota.py)
        self.cost = cost  # bytes and cost per team and scope (controller/cost.py): fed from each report
        self.namespace_labels = namespace_labels or (lambda ns: None)
        self.known_pods = known_pods or (lambda: 0)  # pods the cluster has (pod cache): sizes the floor
        self.known_nodes = known_nodes or (lambda: 0)  # nodes that run an agent: sizes the takeover hold-back
        self.takeover_seconds = takeover_seconds
        self.clock = clock
        self._term_start = float("-inf")
        self._lanes = PerDirection(_Direction(), _Direction())
        self._tables: _Tables | None = None
        self._resolving = threading.Lock()

    def new_term(self) -> None:
        """This replica just became leader: hold back the budget of the nodes not heard from yet
        (module doc, takeover hold-back) for the next `takeover_seconds`."""
        self._term_start = self.clock()

    def heard_share(self, heard_nodes: int, now: float) -> float:
        """The part of each budget this round may share: 1 outside a new term's takeover window,
        else heard / known nodes (1 when the pod watch knows no more nodes than reported)."""
        if now - self._term_start >= self.takeover_seconds:
            return 1.0
        known = self.known_nodes()
        return 1.0 if known <= heard_nodes else heard_nodes / known

    def _policy_tables(self, policy: Policy, fresh: bool = False) -> _Tables:
        """The tables for `policy`; `fresh` starts a new cache when the current one is full (its
        keys are agent-supplied strings)."""
        tables = self._tables
        if tables is None or tables.policy is not policy or fresh:
            with self._resolving:
                tables = self._tables
                if tables is None or tables.policy is not policy or (fresh and len(tables.cache) >= MAX_RESOLVED):
                    team_names = tuple(t.name for t in policy.teams)
                    class_names = tuple(policy.classes)
                    tables = self._tables = _Tables(
                        policy, PerDirection.build(lambda d: TeamColumns.from_policy(policy, d)), team_names,
                        class_names, {n: i for i, n in enumerate(team_names)},
                        {n: i for i, n in enumerate(class_names)}, {}, [])
        return tables

    def prepare(self, report: NodeReport, policy: Policy | None = None, in_round: bool = False) -> PreparedReport:
        """The report's pods resolved into columns (cached per (namespace, class, bandwidth
        annotations); at submit time a full cache starts afresh, and the next round re-resolves
        the reports prepared against the old one)."""
        if policy is None:
            policy, _ = self.policy()
        tables = self._policy_tables(policy)
        if not in_round and len(tables.cache) >= MAX_RESOLVED:
            tables = self._policy_tables(policy, fresh=True)
        team_index, class_index, cache, table = tables.team_index, tables.class_index, tables.cache, tables.rows
        pods = report.pods
        keys = list(map(_ANNOTATIONS, pods))  # map/attrgetter: the per-pod steps run in C
        rows = list(map(cache.get, keys))
        if None in rows:
            with self._resolving:  # the event loop and the round thread (after a policy change) both come here
                for i, (row, key) in enumerate(zip(rows, keys)):
                    if row is None:
                        row = cache.get(key)
                    if row is None:
                        namespace, egress_class, up_bandwidth, down_bandwidth = key
                        pp = resolve_pod(policy, namespace, egress_class, PerDirection(up_bandwidth, down_bandwidth),
                                         self.namespace_labels(namespace))
                        table.append((team_index[pp.team], class_index[pp.egress_class],
                                      *(float(v) for d in DIRECTIONS for v in (pp.limits[d].weight,
                                                                               pp.limits[d].min_bps,
                                                                               pp.limits[d].max_bps))))
                        row = cache[key] = len(table) - 1
                    rows[i] = row
        n = len(pods)
        shapes = PerDirection(True, report.shapes_ingress)

        row_ids = np.array(rows, dtype=np.intp)
        if self.quota is not None and report.epoch is not None:  # the pods' byte counters, by team
            self.quota.observe(report, row_ids, lambda r: tables.team_names[int(table[r][0])], tables)
        if self.cost is not None and report.epoch is not None:
            counted = self.cost.observe(report, row_ids, lambda r: tables.team_names[int(table[r][0])])
            if counted and self.quota is not None:
                self.quota.version += 1  # status.quota's cost figures changed: written at the next interval

        def column(field: PerDirection[attrgetter], d: Direction) -> np.ndarray:
            return np.fromiter(map(field[d], pods), dtype=np.float64, count=n) if shapes[d] else np.zeros(n)
        return PreparedReport(report, tables, tuple(map(_KEY, pods)), row_ids,
                              PerDirection.build(lambda d: column(POD_DEMAND, d)),
                              PerDirection.build(lambda d: column(POD_USAGE, d)))

    def __call__(self, reports: dict[str, PreparedReport | NodeReport]) -> RoundResult:
        """One round over the latest report of every node: uploads over all of them, downloads
        over those whose agent shapes downloads."""
        policy, problems = self.policy()
        if self.quota is not None:
            self.quota.set_policy(policy)
            self.quota.tick()  # a new period lifts its cap in this round
            if self.cost is not None:  # the cost's periods are the quotas' periods; a spent cost quota holds
                self.cost.set_quotas(self.quota.quotas, self.quota.zone_name)
                self.quota.set_cost_spent(self.cost.spent(self.quota.quotas))
        tables = self._policy_tables(policy)
        nodes = sorted(reports)  # a stable order: unchanged pods keep their index between rounds
        prepared = []
        for node in nodes:
            item = reports[node]
            # the policy changed since, or the resolution cache started afresh
            if not isinstance(item, PreparedReport) or item.tables is not tables:
                item = self.prepare(item if isinstance(item, NodeReport) else item.report, policy, in_round=True)
            prepared.append(item)
        sizes = [len(item.keys) for item in prepared]
        n = sum(sizes)
        # `rows` is read after preparing: a pod resolved just now has its row
        ids = np.concatenate([item.rows for item in prepared]) if prepared else np.zeros(0, dtype=np.intp)
        table = np.array(tables.rows, dtype=np.float64).reshape(len(tables.rows), ROW)[ids]
        team = table[:, 0].astype(np.intp)
        cls = table[:, 1].astype(np.intp)
        now = self.clock()
        share = self.heard_share(len(reports), now)
        lanes = PerDirection.build(lambda d: self._lane(d, policy, tables, nodes, prepared, sizes, table, team, cls,
                                                        share, now))
        summary = lanes.upload.summary
        if summary is not None:
            summary.policy_problems = tuple(problems)
            summary.ingress = lanes.download.summary
        spans: dict[str, tuple[int, list[PodReport]]] = {}
        start = 0
        for node, item in zip(nodes, prepared):
            spans[node] = (start, item.report.pods)
            start += len(item.keys)
        by_node = NodeAllocations(spans, team, cls, tables.team_names, tables.class_names, lanes)
        return RoundResult(by_node, lanes.upload.node_rate, lanes.upload.floor or MIN_SAFE_FLOOR_BPS, summary,
                           node_ingress_rate=lanes.download.node_rate, safe_ingress_floor_bps=lanes.download.floor,
                           quota=self.quota.answer_states() if self.quota is not None else None)

    def _lane(self, d: Direction, policy: Policy, tables: _Tables, nodes: list[str],
              prepared: list[PreparedReport], sizes: list[int], table: np.ndarray, team: np.ndarray,
              cls: np.ndarray, share: float, now: float) -> _Lane:
        """Direction `d`'s allocation over the reports of the agents that shape it (uploads: all
        of them, even none; downloads: those with shapes_ingress)."""
        shaping = [d is Direction.UPLOAD or item.report.shapes_ingress for item in prepared]
        lane_nodes = [node for node, s in zip(nodes, shaping) if s]
        lane_prepared = [item for item, s in zip(prepared, shaping) if s]
        budget = float(policy.totals[d])
        n = sum(sizes)
        if not lane_prepared and d is not Direction.UPLOAD:
            self._lanes = self._lanes.replace(d, _Direction())  # no agent shapes it now: start afresh when one does
            # a budget no agent keeps: exported (0 nodes) so NetagentIngressNotShaped can say so
            summary = (Summary(policy.budget_name, budget, 0.0, 0.0, 0.0, pods=0, nodes=0, oversubscribed=False)
                       if budget < MAX_BPS else None)
            return _Lane(np.full(n, np.nan), np.full(n, np.nan), frozenset(), {}, None, summary)
        mask = np.repeat(np.array(shaping, dtype=bool), sizes) if prepared else np.zeros(0, dtype=bool)
        total = budget * share if budget < MAX_BPS else budget  # unset (no budget): nothing to hold back
        demand = _joined(lane_prepared, lambda item: item.demand[d])
        usage = _joined(lane_prepared, lambda item: item.usage[d])
        teams = tables.teams[d]
        if self.quota is not None:  # an exhausted team capped at its exhaustedRate (docs/quotas.md)
            teams = self.quota.capped(teams, d, team[mask], MIN_SAFE_FLOOR_BPS)
        run = self._run(self._lanes[d], teams, total, lane_nodes, lane_prepared, team[mask],
                        table[mask, _COLUMNS[d]], demand, usage,
                        [NODE_MEASURED[d](item.report) for item in lane_prepared],
                        [NODE_SHAPED[d](item.report) for item in lane_prepared], now)
        alloc, limit = np.full(n, np.nan), np.full(n, np.nan)
        alloc[mask], limit[mask] = run.result.allocation, run.result.limit
        # the floor is every pod's share of the whole budget (all agents on it at once stay within it)
        floor = max(MIN_SAFE_FLOOR_BPS, budget / max(1, int(mask.sum()), self.known_pods()))
        summary = self._summary(policy.budget_name, budget, run.result, team[mask], cls[mask], tables.team_names,
                                tables.class_names, demand, usage, run.used_bps, len(lane_nodes))
        summary.held_back_bps = budget - total
        return _Lane(alloc, limit, frozenset(lane_nodes), run.node_rate, floor, summary)

    def _run(self, state: _Direction, teams: TeamColumns, total: float, nodes: list[str],
             prepared: list[PreparedReport], team: np.ndarray, policy_columns: np.ndarray, demand: np.ndarray,
             usage: np.ndarray, node_measured: list[float], node_shaped: list[float | None], now: float) -> _Run:
        """One direction's engine run over `nodes` (their pods in order): weight, min, max in
        `policy_columns`; `node_measured` the nodes' measured internet totals in that direction, and
        `node_shaped` what their classes carried over the same seconds (None: an older agent)."""
        pods = PodColumns(team=team, weight=policy_columns[:, 0].copy(), min_bps=policy_columns[:, 1].copy(),
                          max_bps=policy_columns[:, 2].copy(), demand_bps=demand)
        # each node's word on the measured total is bounded by what it may use (see the module doc)
        fair_node = total / max(1, len(nodes))
        measured_by_node = [min(m, REPORT_MARGIN * max(state.node_rate.get(node, 0.0), fair_node))
                            for node, m in zip(nodes, node_measured)]
        measured = sum(measured_by_node)
        any_measured = any(m > 0 for m in measured_by_node)
        report_period = max((item.report.period_seconds for item in prepared), default=0.0)
        # the measured total changes once per report period: feeding it to the gain in every
        # round of a shorter allocation period would apply the same correction several times
        feedback = None
        if any_measured and now - state.last_feedback >= report_period * 0.9:
            feedback, state.last_feedback = measured, now
        # the gain weighs what the pods' classes carried against the measured total (unshaped host
        # traffic, other byte counts: core.engine.feedback_gain), both from the nodes that measure it; a
        # node's pods never carried more than the node did. A node that read both over the same seconds says what its
        # classes carried then; an older agent's pods' last samples cover other seconds, and one such
        # node makes the engine wait for a steady plant (core.engine: same_window)
        shaped, same_window = None, False
        if feedback is not None:
            shaped, start, same_window = 0.0, 0, True
            for item, m, carried in zip(prepared, measured_by_node, node_shaped):
                end = start + len(item.keys)
                if m > 0:
                    if carried is None:
                        carried, same_window = float(usage[start:end].sum()), False
                    shaped += min(carried, m)
                start = end
        result = allocate_columns(teams, pods, total, feedback, self._aligned_previous(state, nodes, prepared),
                                  shaped_usage_bps=shaped, same_window=same_window)
        node_rate: dict[str, float] = {}
        previous: dict[str, tuple[tuple, np.ndarray, np.ndarray]] = {}
        start = 0
        for node, item in zip(nodes, prepared):
            end = start + len(item.keys)
            node_rate[node] = min(total, float(result.limit[start:end].sum()))
            previous[node] = (item.keys, result.allocation[start:end], result.limit[start:end])
            start = end
        state.previous, state.gain_carrier, state.node_rate = previous, result, node_rate
        return _Run(result, node_rate, measured if any_measured else float(usage.sum()))

    @staticmethod
    def _aligned_previous(state: _Direction, nodes: list[str], prepared: list[PreparedReport]):
        """The previous round's per-pod numbers in this round's order (NaN for pods it did not
        have), node by node: a node whose pod list did not change costs one tuple comparison."""
        if state.gain_carrier is None:
            return None
        allocs, limits = [], []
        for node, item in zip(nodes, prepared):
            old = state.previous.get(node)
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
        return replace(state.gain_carrier, allocation=np.concatenate(allocs) if allocs else empty,
                       limit=np.concatenate(limits) if limits else empty)

    @staticmethod
    def _summary(budget_name, budget_bps, result, team, cls, team_names, class_names, demand, usage, used_total,
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
            budget_name=budget_name, budget_bps=budget_bps,
            allocated_bps=float(result.allocation.sum()), demand_bps=float(demand.sum()), used_bps=used_total,
            pods=int(team.size), nodes=nodes, oversubscribed=bool(result.oversubscribed), gain=float(result.gain),
            groups=groups, teams=teams,
        )


def _joined(prepared: list[PreparedReport], column: Callable[[PreparedReport], np.ndarray]) -> np.ndarray:
    """One per-pod column of the prepared reports, concatenated in their order."""
    return np.concatenate([column(item) for item in prepared]) if prepared else np.zeros(0)
