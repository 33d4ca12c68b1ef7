"""The controller's state between HTTP and the allocator: reports in, rounds, answers out.

Reports only *replace their own node's entry* in `latest`; one allocation round
runs every `period` over the union of all nodes' pods (not one per report: the
API server and the CPU see O(1) rounds per period, not O(nodes)), and each report
is answered from the most recent round. A bad pod is refused alone, listed by name with
its reason in the answer (`Refused`): a pod the node-binding check places elsewhere or does
not know, an oversize annotation value, a duplicate, a pod beyond MAX_PODS_PER_REPORT. Its
neighbours are allocated as usual.

Reports are answered only when the inputs are ready (policy and pod caches synced) and this
replica leads; until then the API answers 503 and agents keep what they have.

A new term (a failover, a restart) does not wait for the period's tick: its first report wakes
the allocation loop, which runs the term's first round FIRST_ROUND_GATHER later over what has
arrived, and the reports that came before it are held (at most FIRST_ROUND_WAIT) and answered
from it. The takeover hold-back (allocator.new_term) keeps that round's total to the heard nodes'
part of the budget, so answering from a few nodes' reports is safe (docs/scale.md, finding 13).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from operator import attrgetter
from typing import Callable

import msgspec
import numpy as np

from core.direction import PerDirection
from core.wire import (MAX_PODS_PER_REPORT, MAX_REFUSED, REPORT_VERSION, NodeAnswer, NodeReport, Refused,
                       invalid_name_indexes, long_annotation_indexes)

from .allocator import RoundResult
from .auth import Identity

log = logging.getLogger(__name__)
_KEY = attrgetter("namespace", "name")
_TEAM = attrgetter("team")
NO_ROUND = "no allocation round with this node yet: keep the current allocations"
# A pod reported unthrottled with a demand over DEMAND_OVER_USE times its use (judged against at
# least DEMAND_OVER_USE_FLOOR): a lying or broken agent, or a pod whose use just collapsed (an
# agent's unthrottled demand at most halves a report: netagent/demand.py). Counted, not corrected:
# the engine already bounds what such a pod takes to its weighted share under its cap, as if the
# demand were real (docs/scale.md, "Bad input").
DEMAND_OVER_USE = 64.0
DEMAND_OVER_USE_FLOOR = 1e6  # bit/s
# ... checked at most this often, on the round's thread (tens of ms at 300,000 pods)
DEMAND_CHECK_SECONDS = 30.0
_THROTTLED = PerDirection(attrgetter("throttled"), attrgetter("ingress_throttled"))  # core.wire's field names
# a new term's first round runs this long after its first report: the reports arriving with it
# (hundreds a second at 10,000 nodes) join it instead of waiting a period for the next
FIRST_ROUND_GATHER = 0.25
# the reports of a new term held for its first round at most this long: under the agent's 3 s
# answer timeout (netagent/transport.py), and at 1,000 reports/s within --max-pending-reports
FIRST_ROUND_WAIT = 1.5


def _resolve(fut: asyncio.Future, result: "RoundResult | None") -> None:
    if not fut.done():
        fut.set_result(result)


# (prepared reports by node) -> RoundResult; the allocator provides it
Allocate = Callable[[dict[str, object]], RoundResult]
# [(namespace, pod), ...] -> [node name, or None for a pod unknown, ...]
PodLocator = Callable[[list[tuple[str, str]]], list[str | None]]


def demand_above_use(reports: list) -> int:
    """The pods of the round's prepared reports (allocator.prepare: demand and usage columns), each
    direction, unthrottled with a demand above DEMAND_OVER_USE times their use: over all pods at
    once on the round's thread (every DEMAND_CHECK_SECONDS), not on the reports' path; the
    throttled flags are read only for the rare pods over the bound."""
    reports = [r for r in reports if getattr(r, "demand", None) is not None]  # allocators without columns: none
    if not reports:
        return 0
    n = 0
    for d, _ in reports[0].demand.items():
        columns = list(map(attrgetter(f"demand.{d.value}"), reports))  # attrgetter: the per-report steps in C
        wanted = np.concatenate(columns)
        usage = np.concatenate(list(map(attrgetter(f"usage.{d.value}"), reports)))
        over = np.flatnonzero(wanted > DEMAND_OVER_USE * np.maximum(usage, DEMAND_OVER_USE_FLOOR))
        if over.size:
            starts = np.cumsum([0, *map(len, columns)])
            which = np.searchsorted(starts, over, side="right") - 1
            throttled = _THROTTLED[d]
            n += sum(1 for r, i in zip(which, over) if not throttled(reports[r].report.pods[i - starts[r]]))
    return n


class ControllerState:
    def __init__(self, allocate: Allocate, locate_pods: PodLocator | None = None, lease_seconds: float = 30.0,
                 report_ttl: float = 60.0, leader: Callable[[], bool] = lambda: True,
                 leader_address: Callable[[], str | None] = lambda: None,
                 readiness: Callable[[], tuple[bool, str]] = lambda: (True, ""), answer_wait: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.allocate = allocate
        self.clock = clock  # when reports arrived: the report TTL is judged on it
        # per report, at submit time: the work a round would otherwise do per pod (allocator.prepare)
        self.prepare: Callable[[NodeReport], object] = getattr(allocate, "prepare", lambda report: report)
        # a new term: the allocator holds back the share of the nodes not heard from yet (allocator.new_term)
        self._new_term: Callable[[], None] = getattr(allocate, "new_term", lambda: None)
        self.locate_pods = locate_pods
        self.lease_seconds = lease_seconds
        self.report_ttl = report_ttl  # a node silent this long is dropped from the round
        self._leader = leader
        self._leader_address = leader_address
        self._readiness = readiness  # inputs ready (policy loaded, pod cache synced)
        # > 0: hold each answer until the next round (at most this long), so it reflects the report
        # it answers: one report period less of control-loop delay (see docs/controller.md)
        self.answer_wait = answer_wait
        self._round_waiters: list[asyncio.Future] = []
        self._wake = threading.Event()  # a new term's first report: run its first round now
        self._first_round_due = False  # this term has no round yet and its loop was woken for it
        self.expired_nodes = 0  # nodes dropped after --report-ttl of silence (a metric counts them)
        self.demand_above_use = 0  # pods of the last round with demand far above use (DEMAND_OVER_USE; a metric)
        self._demand_checked = float("-inf")
        self.latest: dict[str, tuple[float, object]] = {}  # node -> (monotonic, prepared report)
        self.result: RoundResult | None = None
        self.generation = 0
        self.last_error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.on_round: Callable[[RoundResult], None] = lambda r: None
        self.on_round_failure: Callable[[], None] = lambda: None
        # (node, refused pods) for each report that had some: metrics and Events (never blocks)
        self.on_refused: Callable[[str, list[Refused]], None] = lambda node, refused: None
        # the report period advised in every answer (controller/pacing.py); 0: the agents' own
        self.report_period: Callable[[], float] = lambda: 0.0

    # -- ReportSink ------------------------------------------------------------
    def is_leader(self) -> bool:
        return self._leader()

    def leader_address(self) -> str | None:
        return self._leader_address()

    def serving(self) -> tuple[bool, str]:
        """Whether this replica may answer reports now: it leads and its inputs are ready. A
        leader whose pod cache has not synced would refuse every pod as unknown (and the floor
        would be sized from nothing)."""
        if not self.is_leader():
            return False, "not the leader"
        return self._readiness()

    def ready(self) -> tuple[bool, str]:
        ok, why = self._readiness()
        if not ok:
            return False, why
        if not self.is_leader():
            return True, "follower (the leader serves agents)"
        if self.result is None:
            return True, "leader, waiting for the first reports"
        return True, f"leader, round {self.result.generation}"

    def on_leadership(self, leading: bool) -> None:
        """A new term starts from nothing: never answer with a round from an older term."""
        with self._lock:
            self.latest.clear()
            self.result = None
            self._first_round_due = False
        if leading:
            self._new_term()

    def refuse(self, report: NodeReport) -> dict[int, str]:
        """{index of a pod in the report: why it is refused}; empty for almost every report
        (each check has a fast path that costs no Python step per pod)."""
        pods = report.pods
        bad: dict[int, str] = {}
        if len(pods) > MAX_PODS_PER_REPORT:
            bad.update((i, "TooManyPods") for i in range(MAX_PODS_PER_REPORT, len(pods)))
        keys = list(map(_KEY, pods))
        if len(set(keys)) != len(keys):
            seen: set[tuple[str, str]] = set()
            for i, key in enumerate(keys):
                if key in seen:
                    bad.setdefault(i, "Duplicate")
                seen.add(key)
        for i in long_annotation_indexes(report):
            bad.setdefault(i, "AnnotationTooLong")
        if self.locate_pods is None:  # with a locator, a bad name is simply a pod it does not know
            for i in invalid_name_indexes(report):
                bad.setdefault(i, "InvalidName")
        else:
            where = self.locate_pods(keys)
            if where.count(report.node) != len(where):
                for i, node in enumerate(where):
                    if node is None:
                        bad.setdefault(i, "UnknownPod")
                    elif node != report.node:
                        bad.setdefault(i, "PodNotOnNode")
        return bad

    def submit(self, identity: Identity | None, report: NodeReport) -> NodeAnswer:
        bad = self.refuse(report)
        refused: list[Refused] = []
        problems: list[str] = []
        if bad:
            pods = report.pods
            refused = [Refused(pods[i].namespace[:253], pods[i].name[:253], reason) for i, reason in sorted(bad.items())]
            self.on_refused(report.node, refused)
            if len(refused) > MAX_REFUSED:
                problems.append(f"{len(refused) - MAX_REFUSED} more pods refused (not listed)")
                refused = refused[:MAX_REFUSED]
            # every other field (both directions' node totals, shapes_ingress) kept as reported
            report = msgspec.structs.replace(report, pods=[p for i, p in enumerate(pods) if i not in bad])
        prepared = self.prepare(report)
        with self._lock:
            self.latest[report.node] = (self.clock(), prepared)
            result = self.result
            if result is None and not self._first_round_due and self._looping():
                self._first_round_due = True  # a new term's first report: its round now, not at the tick
                self._wake.set()
        return self._answer(report.node, result, problems, refused)

    def _looping(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and not self._stop.is_set()

    def _answer(self, node: str, result: RoundResult | None, problems: list[str],
                refused: list[Refused]) -> NodeAnswer:
        if result is None or node not in result.node_rate:  # a node the round has not seen: the agent keeps what it has
            return NodeAnswer(node, 0, self.lease_seconds, 0.0, 0.0, [], problems + [NO_ROUND], refused,
                              report_period_seconds=self.report_period(), report_version=REPORT_VERSION)
        # downloads: only for a node whose agent shapes them (its pods' answers carry them too)
        download_rate = result.node_ingress_rate.get(node)
        pods = result.by_node[node]
        quota = None
        if result.quota is not None:  # the quota state of this node's pods' teams, each once (docs/quotas.md)
            states = result.quota
            quota = [states[t] for t in dict.fromkeys(map(_TEAM, pods)) if t in states]
        return NodeAnswer(node, result.generation, self.lease_seconds, result.safe_floor_bps,
                          result.node_rate[node], pods, problems, refused,
                          node_ingress_rate_bps=download_rate,
                          safe_ingress_floor_bps=result.safe_ingress_floor_bps if download_rate is not None else None,
                          report_period_seconds=self.report_period(), quota=quota, report_version=REPORT_VERSION)

    def last(self) -> tuple[dict[str, tuple[float, object]], RoundResult | None]:
        """(latest reports by node, last round), read together (controller/view.py)."""
        with self._lock:
            return dict(self.latest), self.result

    # -- the allocation loop -----------------------------------------------------
    def nodes(self) -> int:
        return len(self.latest)

    def run_round(self) -> RoundResult | None:
        now = self.clock()
        with self._lock:
            before = len(self.latest)
            self.latest = {n: v for n, v in self.latest.items() if now - v[0] <= self.report_ttl}
            self.expired_nodes += before - len(self.latest)
            reports = {n: prepared for n, (_, prepared) in self.latest.items()}
        if not reports:
            return None
        t0 = time.perf_counter()
        if now - self._demand_checked >= DEMAND_CHECK_SECONDS:
            self._demand_checked = now
            self.demand_above_use = demand_above_use(list(reports.values()))
        result = self.allocate(reports)
        self.generation += 1
        result.generation = self.generation
        result.duration_s = time.perf_counter() - t0
        result.computed_at = time.monotonic()
        result.wall_time = time.time()
        with self._lock:
            first_of_term = self.result is None
            self.result = result
            self._first_round_due = False
            waiters, self._round_waiters = self._round_waiters, []
        for fut in waiters:
            fut.get_loop().call_soon_threadsafe(_resolve, fut, result)
        if first_of_term:  # a failover's timeline reads this line (bench/scale.py)
            log.info("first allocation round of this term: %d nodes heard", len(reports))
        self.on_round(result)
        return result

    async def settle(self, answer: NodeAnswer) -> NodeAnswer:
        """With answer_wait: the answer again after the next round, which includes the report
        just submitted; the given answer if no round completes in time. Without it, a report of a
        new term that has no round yet is held for the term's first round (FIRST_ROUND_WAIT)."""
        wait = self.answer_wait
        first = answer.generation == 0 and NO_ROUND in answer.problems
        if wait <= 0 and not first:
            return answer
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            result = self.result
            if first and result is not None and answer.node in result.node_rate:
                pass  # the first round came between submit and now: answer from it
            elif first and result is None and self._first_round_due:
                wait = max(wait, FIRST_ROUND_WAIT)
                self._round_waiters.append(fut)
            elif wait > 0:
                self._round_waiters.append(fut)
                result = None
            else:
                return answer
        if result is None:
            try:
                result = await asyncio.wait_for(fut, wait)
            except asyncio.TimeoutError:
                with self._lock:
                    if fut in self._round_waiters:
                        self._round_waiters.remove(fut)
                return answer
        if result is None:  # the round failed: the answer it had
            return answer
        return self._answer(answer.node, result, [p for p in answer.problems if p != NO_ROUND], answer.refused)

    def start(self, period: float) -> None:
        def loop():
            next_round = time.monotonic() + period
            while not self._stop.is_set():
                if self._wake.wait(max(0.0, next_round - time.monotonic())):
                    self._wake.clear()  # a new term's first report: gather a moment, then its round
                    if self._stop.wait(FIRST_ROUND_GATHER):
                        break
                if self._stop.is_set():
                    break
                next_round = time.monotonic() + period
                if not self.is_leader():
                    continue
                try:
                    self.run_round()
                    self.last_error = ""
                except Exception as exc:
                    self.last_error = str(exc)
                    self.on_round_failure()
                    log.exception("allocation round failed; agents keep the previous round's answers")
                    self._release_waiters()

        self.thread = threading.Thread(target=loop, name="allocation", daemon=True)
        self.thread.start()

    def _release_waiters(self) -> None:
        """After a failed round: held answers go out as they were (the agents keep what they have)."""
        with self._lock:
            self._first_round_due = False
            waiters, self._round_waiters = self._round_waiters, []
        for fut in waiters:
            fut.get_loop().call_soon_threadsafe(_resolve, fut, None)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
