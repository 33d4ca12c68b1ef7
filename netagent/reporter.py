"""Agent -> controller: post the node report, take allocations and a lease.

Fail-static: on any failure the agent keeps its last allocations until their lease
runs out (the sync then falls to the controller's safe floor). Reports are jittered
(±20%) so thousands of agents don't arrive in lockstep. Both directions use the shared
wire types (`core.wire`): the report is encoded from them and the answer is decoded and
checked by them (finite, in range, lease bounded) before anything is enforced.

Finding the leader: the agent posts to --controller (the Service, which reaches any
replica). A follower answers 307 with the leader's address; the agent follows it (only as
`transport.ControllerClient` allows: 307/308, same scheme, the pinned CA) and keeps posting
to the leader directly until that fails (connection error, a 307 or a 503), then goes back
to the Service. An answer with generation 0 comes from a leader
that has no round with this node yet (just elected): the agent keeps what it has.
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import msgspec

from core.direction import Direction, PerDirection
from core.policy import ResolvedPod
from core.quantity import MAX_BPS, MAX_BYTES
from core.wire import MAX_RATE, NodeAnswer, NodeReport, PodReport, decode_answer, encoder

from .agent import Agent, ReportInputs
from .allocations import Allocation, AllocationSet
from .outbound import bounded_annotations, bounded_ingress_annotation, bounded_pods
from .transport import ControllerClient, ControllerError

__all__ = ["ControllerError", "Reporter", "advised_period", "allocations_from", "answer_allocations", "build_report"]

log = logging.getLogger(__name__)
WIRE_SCOPES = ("cross-zone", "cross-region")  # the scopes a report carries beside internet (core.wire.ScopeBytes)
MAX_ANSWER_BYTES = 4 << 20  # a 1,024-pod answer is ~200 KiB


def build_report(inputs: ReportInputs, seq: int, period: float, node_egress_bps: float,
                 on_omitted: Callable[[str, int], None] | None = None, node_ingress_bps: float = 0.0,
                 counters: Mapping[str, tuple] | None = None, epoch: str | None = None,
                 node_shaped: PerDirection[float | None] = PerDirection(None, None)) -> NodeReport:
    """The wire report for one period: per pod its usage, demand, throttling and annotations, bounded
    (`outbound`): over-long annotation values and pods beyond one report's limit are left out and
    counted through `on_omitted(reason, n)`. `counters`: pod key -> its cumulative internet bytes (uploads,
    downloads) within `epoch`, for the volume quotas (docs/quotas.md), and optionally its cumulative bytes per
    cross-zone/cross-region scope (uploads, downloads: scope -> bytes; issue 39, for the cost per team).
    `node_shaped`: per direction what the node's classes carried over the same seconds as the node's rate."""
    counters = counters or {}
    omitted = on_omitted or (lambda reason, n: None)
    kept, left_out = bounded_pods(list(inputs.pods), key=lambda p: p.key)
    if left_out:
        omitted("too_many_pods", left_out)
        log.warning("this node has %d pods; the report carries the first %d", len(inputs.pods), len(kept))
    pods = []
    for p in kept:
        egress_class, egress_bandwidth = bounded_annotations(p)
        dropped = (egress_class is None) + (egress_bandwidth is None) - (p.class_annotation is None) \
            - (p.bandwidth[Direction.UPLOAD] is None)
        if dropped:
            omitted("annotation_too_long", dropped)
        pods.append(PodReport(
            namespace=p.namespace, name=p.name, egress_class=egress_class, egress_bandwidth=egress_bandwidth,
            **_demand_fields(p, inputs), **_byte_fields(counters.get(p.key), p.uid),
        ))
    return NodeReport(inputs.node, pods, seq, period, max(0.0, node_egress_bps),
                      node_internet_ingress_bps=max(0.0, node_ingress_bps), shapes_ingress=inputs.shaped.download,
                      epoch=epoch if counters else None,
                      node_shaped_egress_bps=_carried(node_shaped.upload),
                      node_shaped_ingress_bps=_carried(node_shaped.download) if inputs.shaped.download else None)


def _mine(counted: Mapping[str, int] | None, mine: Callable[[str], bool]) -> dict[str, int] | None:
    return None if counted is None else {k: n for k, n in counted.items() if mine(k)}


def _carried(bps: float | None) -> float | None:
    """A node's classes' rate for the wire: within the Rate bounds, None kept (not read with the node's)."""
    return None if bps is None else min(max(0.0, bps), MAX_RATE)


def _byte_fields(counted: tuple | None, uid: str) -> dict:
    """A pod's cumulative internet byte counters for the wire (clamped to its bounds: a counter past 2^63-1
    would take the whole report with it), and its per-scope ones when given (absent: none described)."""
    if counted is None:
        return {}
    up, down = (min(max(0, int(v)), MAX_BYTES) for v in counted[:2])
    out: dict[str, object] = {"bytes_total": up, "ingress_bytes_total": down, "uid": uid[:128] or None}
    for name, scopes in zip(("scope_bytes_total", "ingress_scope_bytes_total"), counted[2:4]):
        kept = {s: min(max(0, int(n)), MAX_BYTES) for s, n in scopes.items() if s in WIRE_SCOPES}
        if kept:
            out[name] = kept
    return out


def counter_epoch() -> str | None:
    """What the pods' byte counters count from: the kernel's boot and the node's network namespace. The
    counters live in the kernel (the classes and the kept carries, docs/accounting.md) and survive an agent
    restart, so a restart is the same epoch; a reboot (or a new network namespace) starts them from 0."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


# A pod's usage, demand and throttling per direction by their JSON names (core/wire.py keeps the
# wire's historical names: uploads unprefixed)
_DEMAND_FIELDS = PerDirection(("usage_bps", "demand_bps", "throttled"),
                              ("ingress_usage_bps", "ingress_demand_bps", "ingress_throttled"))


def _demand_fields(p: ResolvedPod, inputs: ReportInputs) -> dict:
    """A pod's usage, demand and throttling from its classes in each direction whose shaper is
    programmed (no measure yet: its guarantee), and its kubernetes.io/ingress-bandwidth value (bounded)."""
    out: dict = {"ingress_bandwidth": bounded_ingress_annotation(p)}
    for d in Direction:
        if inputs.shaped[d]:
            usage, demand, throttled = _DEMAND_FIELDS[d]
            got = inputs.demand[d].get(p.key)
            out[usage] = float(got.usage_bps) if got else 0.0
            out[demand] = float(got.demand_bps) if got else float(p.limits[d].min_bps)
            out[throttled] = bool(got.throttled) if got else False
    return out


def _rate(value: float) -> int:
    """A decoded rate (finite, 0..2^64 by the wire type) as enforceable bit/s: "no limit" is MAX_BPS."""
    return int(min(value, MAX_BPS))


def allocations_from(answer: NodeAnswer, now: float, node: str | None = None) -> AllocationSet:
    """The answer's numbers as the agent enforces them. The wire type already refused NaN, infinities,
    negative rates and leases outside (0, 3600] s; an answer for another node is refused here."""
    if node is not None and answer.node != node:
        raise ControllerError(f"the controller answered for node {answer.node!r}, not {node!r}; answer refused")
    return AllocationSet(
        pods={f"{p.namespace}/{p.name}": Allocation(_rate(p.allocation_bps), _rate(p.limit_bps)) for p in answer.pods},
        node_rate_bps=_rate(answer.node_rate_bps),
        safe_floor_bps=_rate(answer.safe_floor_bps),
        lease_expires=now + answer.lease_seconds,
        generation=answer.generation,
        source="controller",
    )


def answer_allocations(answer: NodeAnswer, now: float, node: str | None,
                       node_rate_bps: PerDirection[int | None]) -> PerDirection[AllocationSet]:
    """The answer's numbers per direction as the agent enforces them (`node_rate_bps`: the node's rate
    per direction when the answer has none, --ingress-rate)."""
    return PerDirection(allocations_from(answer, now, node), _download_allocations(answer, now, node_rate_bps.download))


def _download_allocations(answer: NodeAnswer, now: float, node_rate_bps: int | None) -> AllocationSet:
    """The answer's download numbers (checked as the upload ones, by the wire type and
    `allocations_from`). None for a pod: it is enforced at its own cap (`AllocationSet.own_cap`);
    no node download rate in the answer: `node_rate_bps` (--ingress-rate), else unlimited."""
    pods = {f"{p.namespace}/{p.name}": Allocation(_rate(p.ingress_allocation_bps), _rate(
        p.ingress_limit_bps if p.ingress_limit_bps is not None else p.ingress_allocation_bps))
            for p in answer.pods if p.ingress_allocation_bps is not None}
    node_rate = answer.node_ingress_rate_bps
    return AllocationSet(
        pods=pods,
        node_rate_bps=_rate(node_rate) if node_rate is not None else (node_rate_bps or MAX_BPS),
        safe_floor_bps=_rate(answer.safe_ingress_floor_bps) if answer.safe_ingress_floor_bps is not None else 0,
        lease_expires=now + answer.lease_seconds,
        generation=answer.generation,
        source="controller",
        own_cap=True,
    )


def advised_period(answer: NodeAnswer) -> float:
    """The report period the leader asks for (0: none): at most a third of the answer's lease, so
    a lease outlives several reports whatever the controller says."""
    return min(answer.report_period_seconds, answer.lease_seconds / 3)


# Failed reports in a row (a timeout, a 429, a 5xx: stretches_period) stretch the period: 1 after one
# (a leader's failover or one lost report: back at once), then 2, 4 and at most 8 periods, and
# never more than MAX_FAILURE_WAIT between reports. Without it an overloaded or restarting
# controller met every agent every period: at 5,000 nodes and 5 s (bench/scale.py) no report was
# answered, so no agent ever learned the paced period that would have relieved it.
MAX_FAILURE_BACKOFF = 8
MAX_FAILURE_WAIT = 60.0  # as transport.MAX_RETRY_AFTER: well inside a lease


# refusals that say "no leader to answer right now" (an election, a new leader's caches syncing):
# cheap answers with a Retry-After, not a sign of overload
NO_LEADER_YET = frozenset({"NoLeader", "NotReady"})


def stretches_period(status: int | None, reason: str, connection_refused: bool) -> bool:
    """Whether a failed report counts towards failure_backoff: a sign that the controller is
    overloaded (a timeout or other failed exchange, a 429, a 5xx). A refused connection (a replica
    gone: nothing listens, nothing is spent) and a 503 NoLeader/NotReady (a failover in progress)
    are not: the agent comes back after its period or the Retry-After, so it reaches the new leader
    as soon as that answers (at 5,000 nodes a failover's failures had spaced agents up to a
    minute apart: 2,862 of 5,000 had their first answer from the new leader within 120 s)."""
    if status is None:
        return not connection_refused
    return not (status == 503 and reason in NO_LEADER_YET)


def leader_failure(status: int | None, reason: str, connection_refused: bool) -> tuple[bool, bool]:
    """A failed report to the remembered leader: (leave it, so the next report goes through the
    Service; ask the Service again now). A leader that answered and refused the report (any status
    but 503, or 503 Overloaded) is kept. One that is gone or no longer leads (a refused connection,
    503 NoLeader/NotReady) is left and the Service asked at once; one that timed out is left at the
    next report: a second report now would add to what an overloaded leader cannot answer."""
    if status not in (None, 503) or reason == "Overloaded":
        return False, False
    return True, not stretches_period(status, reason, connection_refused)


def connection_refused(exc: ControllerError) -> bool:
    """The failure was a refused connection: nothing listens at that address (a replica gone)."""
    return isinstance(exc.__cause__, ConnectionRefusedError)


def failure_backoff(failures: int) -> float:
    """Periods between reports after `failures` failed reports in a row."""
    return float(min(2 ** max(min(failures, 16) - 1, 0), MAX_FAILURE_BACKOFF))


def report_wait(period: float, failures: int, retry_after: float, jitter: float, elapsed: float) -> float:
    """Seconds until the next report, `elapsed` after the last one started: the effective `period`,
    stretched after failures in a row, with `jitter` (0.8..1.2) from that start (a report slower
    than the period is followed at once), and never sooner than a refusal's Retry-After from now."""
    stretched = min(period * failure_backoff(failures), max(period, MAX_FAILURE_WAIT))
    return max(stretched * jitter - elapsed, retry_after * jitter, 0.0)


class Reporter:
    def __init__(self, agent: Agent, url: str, token_path: str | None, period: float = 5.0,
                 timeout: float = 3.0, on_failure: Callable[[], None] | None = None, rng: random.Random | None = None,
                 ca_file: str | None = None, insecure_http: bool = False,
                 on_omitted: Callable[[str, int], None] | None = None,
                 on_refused: Callable[[str], None] | None = None):
        self.agent = agent
        self.on_omitted = on_omitted
        self.client = ControllerClient(url, ca_file, insecure_http=insecure_http,
                                       timeout=timeout, max_answer_bytes=MAX_ANSWER_BYTES)
        self.url = self.client.url
        self.leader_url: str | None = None  # where the last redirect pointed; used until it fails
        self.token_path = token_path
        self.period = period  # our own; the leader may ask for a longer one (effective_period)
        self.advised_period = 0.0  # from the last answer (controller/pacing.py); 0: none
        self.retry_after = 0.0  # from the last refusal's Retry-After (an overloaded leader); 0: none
        self.failures = 0  # failed reports in a row that stretch the period (stretches_period, failure_backoff)
        self.timeout = timeout
        self.on_failure = on_failure or (lambda: None)
        self.on_refused = on_refused or (lambda reason: None)  # per pod the controller refused: count by reason
        self.rng = rng or random.Random()
        self.seq = 0
        self.last_error = ""
        # per direction, the last report's read: (when, the node's internet bytes, its classes' IP bytes or None)
        self._node_bytes: dict[Direction, tuple[float, int, Mapping[str, int] | None]] = {}
        self.epoch = counter_epoch()  # the pods' byte counters' epoch (volume quotas)
        # the newest report fields the controller said it decodes (NodeAnswer.report_version); 0 until an answer
        # says more, and again after a failure: an older controller refuses a report with a field it does not know
        self.controller_report_version = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="reporter", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self._stop.wait(self.rng.uniform(0, self.period))  # spread the first reports too
        while not self._stop.is_set():
            self._stop.wait(self.tick())
        self.client.close()  # the kept connection: the controller need not wait for its idle timeout

    def tick(self) -> float:
        """One report, its failure logged and counted; -> seconds until the next one, counted from
        this report's start: an answer the leader holds for its next round (--answer-wait) must not
        stretch the period (a 1 s period with a 1.5 s hold reported every 2-2.5 s, and every answer
        to a policy change came that much later)."""
        self.retry_after = 0.0
        started = time.monotonic()
        try:
            self.report_once()
            self.failures = 0
        except ControllerError as exc:
            self.retry_after = exc.retry_after or 0.0
            self._failed(exc, stretches_period(exc.status, exc.reason, connection_refused(exc)))
        except Exception as exc:
            self._failed(exc, True)
        return self.next_wait(time.monotonic() - started)

    def _failed(self, exc: Exception, stretches: bool) -> None:
        self.controller_report_version = 0  # perhaps another controller now (a rollout): only fields all decode
        if stretches:
            self.failures += 1
        self.agent.set_controller_reachable(False)
        if str(exc) != self.last_error:
            log.warning("controller report failed: %s (keeping allocations until the lease ends)", exc)
        self.last_error = str(exc)
        self.on_failure()

    def next_wait(self, elapsed: float = 0.0) -> float:
        """Seconds until the next report, `elapsed` after the last one started (report_wait): the
        effective period, longer after failed reports in a row, with +-20 % jitter from that start,
        and never sooner than a refusal's Retry-After from now (an overloaded leader sheds reports
        and says when to come back; the jitter spreads the agents it shed at once)."""
        return report_wait(self.effective_period(), self.failures, self.retry_after, self.rng.uniform(0.8, 1.2), elapsed)

    def effective_period(self) -> float:
        """Our own period, or the longer one the leader asked for (large clusters): never shorter than
        our own, and (the wire bounds it) never longer than MAX_ADVISED_PERIOD."""
        return max(self.period, self.advised_period)

    def _window_bps(self, direction: Direction, total: int | None, classes: Mapping[str, int] | None, at: float,
                    pods_usage: float) -> tuple[float, float | None]:
        """The node's measured internet traffic in `direction` (host traffic included) and what its classes
        carried, as rates over the same seconds: since the last report's read to this one's (`at`). The pods'
        usage and None when the node's counter is missing or went backwards; None for the classes when they
        were not read with it (this time or the last). A class made since the last read counts from 0; the
        bytes of one removed in between are missing from that one window."""
        if total is None:
            return pods_usage, None
        prev = self._node_bytes.get(direction)
        self._node_bytes[direction] = (at, total, classes)
        if prev is None or at <= prev[0] or total < prev[1]:
            return pods_usage, None
        seconds = at - prev[0]
        node = (total - prev[1]) * 8 / seconds
        if classes is None or prev[2] is None:
            return node, None
        before = prev[2]
        sent = sum(n - before.get(k, 0) if n >= before.get(k, 0) else n for k, n in classes.items())
        return node, sent * 8 / seconds

    def build_report(self) -> NodeReport:
        inputs = self.agent.report_inputs()
        keys = {p.key for p in inputs.pods}
        # uploads: the pods' own; downloads: every measured class (as reported before)
        mine = PerDirection.build(lambda d: (lambda k: d is Direction.DOWNLOAD or k in keys))
        usage = PerDirection.build(lambda d: sum(float(v.usage_bps) for k, v in inputs.demand[d].items() if mine[d](k)))
        classes = PerDirection.build(lambda d: _mine(inputs.class_bytes[d], mine[d]))
        at = inputs.read_at if inputs.read_at is not None else time.monotonic()
        window = PerDirection.build(lambda d: self._window_bps(d, inputs.node_internet_bytes[d], classes[d], at,
                                                               usage[d]))
        self.seq += 1
        newer = self.controller_report_version >= 1  # the controller reads node_shaped_* (core.wire.REPORT_VERSION)
        shaped: PerDirection[float | None] = window.map(lambda w: w[1] if newer else None)
        return build_report(inputs, self.seq, self.effective_period(), window.upload[0], self.on_omitted,
                            window.download[0], self._counters(), self.epoch, node_shaped=shaped)

    def _counters(self) -> dict[str, tuple]:
        """Per pod its internet bytes as the accounting metrics show them (the agent's view: uploads as they left
        the shaper, downloads as they arrived), then its cross-zone/cross-region bytes per direction (the same
        counters' other scopes); none when the view cannot be read (no quota spent this report)."""
        if self.epoch is None:
            return {}
        try:
            view = self.agent.view()
        except Exception as exc:
            log.debug("pod byte counters unreadable: %s", exc)
            return {}
        return {f"{p.namespace}/{p.name}": (p.egress_bytes.get("internet", 0), p.ingress_bytes.get("internet", 0),
                                            {s: n for s, n in p.egress_bytes.items() if s in WIRE_SCOPES},
                                            {s: n for s, n in p.ingress_bytes.items() if s in WIRE_SCOPES})
                for p in view.pods}

    def _token(self) -> str | None:
        if not self.token_path or not self.client.may_send_token():
            return None  # never over plain http
        try:
            return Path(self.token_path).read_text().strip() or None  # re-read: kubelet rotates it
        except OSError:
            return None

    def _exchange(self, base: str | None, path: str, body: bytes) -> NodeAnswer:
        raw, redirected = self.client.post(path, body, self._token(), base=base)
        if redirected:
            self.leader_url = redirected
        try:
            return decode_answer(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ControllerError(f"controller {base or self.url} sent an invalid answer ({exc}); answer refused") from None

    def report_once(self) -> bool:
        """One report and its answer; False (nothing sent) while the agent does not know its pods yet:
        an empty report would tell the controller this node needs nothing, and it would give the
        node's share away (after a restart, before the pod source has synced)."""
        if not self.agent.pods_known():
            log.info("not reporting yet: the pod source has not synced")
            return False
        body = encoder.encode(self.build_report())
        path = f"/v1/nodes/{self.agent.cfg.node}/report"
        if self.leader_url:
            try:
                answer = self._exchange(self.leader_url, path, body)
            except ControllerError as exc:
                leave, again = leader_failure(exc.status, exc.reason, connection_refused(exc))
                if not leave:
                    raise
                leader, self.leader_url = self.leader_url, None  # the next report goes through the Service
                if not again:
                    raise
                log.info("leader %s failed (%s); asking the controller Service again", leader, exc)
                answer = self._exchange(None, path, body)
        else:
            answer = self._exchange(None, path, body)
        self.advised_period = advised_period(answer)
        self.controller_report_version = answer.report_version
        fresh_leader = answer.generation == 0
        now = time.monotonic()
        allocs = None if fresh_leader else answer_allocations(answer, now, self.agent.cfg.node, self.agent.cfg.node_rate_bps)
        for problem in answer.problems:
            log.log(logging.INFO if fresh_leader else logging.WARNING, "controller: %s", problem)
        for r in answer.refused:  # the rest of the report was answered: these pods keep what they have
            log.warning("controller refused pod %s/%s (%s): it is not allocated by the controller", r.namespace,
                        r.name, r.reason)
            self.on_refused(r.reason)
        self.agent.set_controller_reachable(True)
        self.last_error = ""
        if answer.quota is not None:  # absent (an older controller, a new leader's first answer): the last kept
            self.agent.set_quota(answer.quota)
        if allocs is None:
            return True  # no round yet: keep the allocations and the lease we have
        self.agent.set_allocations(allocs)
        return True
