"""Agent -> controller: post the node report, take allocations and a lease.

Fail-static: on any failure the agent keeps its last allocations until their lease
runs out (the sync then falls to the controller's safe floor). Reports are jittered
(±20%) so thousands of agents don't arrive in lockstep. Both directions use the shared
wire types (`core.wire`): the report is encoded from them and the answer is decoded and
checked by them (finite, in range, lease bounded) before anything is enforced.

Finding the leader: the agent posts to --controller (the Service, which reaches any
replica). A follower answers 307 with the leader's address; the agent follows it and
keeps posting to the leader directly until that fails (connection error, a 307 or a
503), then goes back to the Service. An answer with generation 0 comes from a leader
that has no round with this node yet (just elected): the agent keeps what it has.
"""
from __future__ import annotations

import logging
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import msgspec

from core.errors import NetagentError
from core.wire import NodeAnswer, NodeReport, PodReport, answer_decoder, encoder

from .agent import Agent, ReportInputs
from .allocations import Allocation, AllocationSet

log = logging.getLogger(__name__)
MAX_REDIRECTS = 3
MAX_ANSWER_BYTES = 4 << 20  # a 1,024-pod answer is ~200 KiB


class ControllerError(NetagentError):
    """The controller could not be reached (status None) or refused the report; the message says which."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def build_report(inputs: ReportInputs, seq: int, period: float, node_egress_bps: float) -> NodeReport:
    """The wire report for one period: per pod its usage, demand, throttling and annotations."""
    pods = []
    for p, d in inputs.pods:
        pods.append(PodReport(
            namespace=p.namespace, name=p.name,
            usage_bps=float(d.usage_bps) if d else 0.0,
            demand_bps=float(d.demand_bps) if d else float(p.min_bps),
            throttled=bool(d.throttled) if d else False,
            egress_class=p.class_annotation, egress_bandwidth=p.bandwidth_annotation,
        ))
    return NodeReport(inputs.node, pods, seq, period, max(0.0, node_egress_bps))


def allocations_from(answer: NodeAnswer, now: float) -> AllocationSet:
    return AllocationSet(
        pods={f"{p.namespace}/{p.name}": Allocation(int(p.allocation_bps), int(p.limit_bps)) for p in answer.pods},
        node_rate_bps=int(answer.node_rate_bps),
        safe_floor_bps=int(answer.safe_floor_bps),
        lease_expires=now + answer.lease_seconds,
        generation=answer.generation,
        source="controller",
    )


class Reporter:
    def __init__(self, agent: Agent, url: str, token_path: str | None, period: float = 5.0,
                 timeout: float = 3.0, on_failure: Callable[[], None] | None = None, rng: random.Random | None = None,
                 on_refused: Callable[[str], None] | None = None):
        self.agent = agent
        self.url = url.rstrip("/")
        self.leader_url: str | None = None  # where the last redirect pointed; used until it fails
        self.token_path = token_path
        self.period = period
        self.timeout = timeout
        self.on_failure = on_failure or (lambda: None)
        self.on_refused = on_refused or (lambda reason: None)  # per pod the controller refused: count by reason
        self.rng = rng or random.Random()
        self.seq = 0
        self.last_error = ""
        self._egress: tuple[float, int] | None = None  # (monotonic, node internet egress bytes) last report
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="reporter", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self._stop.wait(self.rng.uniform(0, self.period))  # spread the first reports too
        while not self._stop.is_set():
            try:
                self.report_once()
            except Exception as exc:
                self.agent.set_controller_reachable(False)
                if str(exc) != self.last_error:
                    log.warning("controller report failed: %s (keeping allocations until the lease ends)", exc)
                self.last_error = str(exc)
                self.on_failure()
            self._stop.wait(self.period * self.rng.uniform(0.8, 1.2))

    def _node_egress_bps(self, total: int | None, pods_usage: float) -> float:
        """The node's measured internet egress (host traffic included) as a rate since the last
        report; the pods' usage when the counter is missing or went backwards."""
        if total is None:
            return pods_usage
        now, prev, self._egress = time.monotonic(), self._egress, (time.monotonic(), total)
        if prev is None or now <= prev[0] or total < prev[1]:
            return pods_usage
        return (total - prev[1]) * 8 / (now - prev[0])

    def build_report(self) -> NodeReport:
        inputs = self.agent.report_inputs()
        usage = sum(float(d.usage_bps) for _, d in inputs.pods if d)
        self.seq += 1
        return build_report(inputs, self.seq, self.period, self._node_egress_bps(inputs.node_internet_egress_bytes, usage))

    def _post(self, url: str, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self.token_path and Path(self.token_path).exists():
            headers["Authorization"] = "Bearer " + Path(self.token_path).read_text().strip()  # re-read: kubelet rotates it
        for _ in range(MAX_REDIRECTS + 1):
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return resp.read(MAX_ANSWER_BYTES + 1)
            except urllib.error.HTTPError as exc:
                location = exc.headers.get("Location")
                if exc.code in (307, 308) and location:  # a follower points at the leader
                    url = location
                    self.leader_url = location.split("/v1/", 1)[0]
                    continue
                detail = exc.read(300).decode(errors="replace")
                raise ControllerError(f"controller {url} answered {exc.code}: {detail}", exc.code) from None
            except (urllib.error.URLError, OSError) as exc:
                raise ControllerError(f"controller {url} unreachable: {exc}") from exc
        raise ControllerError(f"controller redirected more than {MAX_REDIRECTS} times (last: {url})")

    def _exchange(self, url: str, body: bytes) -> NodeAnswer:
        raw = self._post(url, body)
        if len(raw) > MAX_ANSWER_BYTES:
            raise ControllerError(f"controller {url} answered more than {MAX_ANSWER_BYTES} bytes; answer refused")
        try:
            return answer_decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ControllerError(f"controller {url} sent an invalid answer ({exc}); answer refused") from None

    def report_once(self) -> None:
        body = encoder.encode(self.build_report())
        path = f"/v1/nodes/{self.agent.cfg.node}/report"
        if self.leader_url:
            try:
                answer = self._exchange(self.leader_url + path, body)
            except ControllerError as exc:
                if exc.status not in (None, 503):
                    raise  # the leader answered and refused the report: asking again elsewhere would not help
                log.info("leader %s failed (%s); asking the controller Service again", self.leader_url, exc)
                self.leader_url = None
                answer = self._exchange(self.url + path, body)
        else:
            answer = self._exchange(self.url + path, body)
        fresh_leader = answer.generation == 0
        for problem in answer.problems:
            log.log(logging.INFO if fresh_leader else logging.WARNING, "controller: %s", problem)
        for r in answer.refused:  # the rest of the report was answered: these pods keep what they have
            log.warning("controller refused pod %s/%s (%s): it is not allocated by the controller", r.namespace,
                        r.name, r.reason)
            self.on_refused(r.reason)
        self.agent.set_controller_reachable(True)
        self.last_error = ""
        if fresh_leader:
            return  # no round yet: keep the allocations and the lease we have
        self.agent.set_allocations(allocations_from(answer, time.monotonic()))
