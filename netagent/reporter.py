"""Agent -> controller: post the node report, take allocations and a lease.

Fail-static: on any failure the agent keeps its last allocations until their lease
runs out (the sync loop then falls to the controller's safe floor). Reports are
jittered (±20%) so thousands of agents don't arrive in lockstep.

Finding the leader: the agent posts to --controller (the Service, which reaches any
replica). A follower answers 307 with the leader's address; the agent follows it and
keeps posting to the leader directly until that fails (connection error, a 307 or a
503), then goes back to the Service. An answer with generation 0 comes from a leader
that has no round with this node yet (just elected): the agent keeps what it has.
"""
from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from .agent import Agent, Allocation, AllocationSet

log = logging.getLogger(__name__)
DEFAULT_TOKEN_PATH = "/var/run/secrets/netagent/token"
MAX_REDIRECTS = 3


class ControllerError(Exception):
    """The controller could not be reached (status None) or refused the report; the message says which."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Reporter:
    def __init__(self, agent: Agent, url: str, token_path: str | None = DEFAULT_TOKEN_PATH, period: float = 5.0,
                 timeout: float = 3.0, on_failure: Callable[[], None] | None = None, rng: random.Random | None = None):
        self.agent = agent
        self.url = url.rstrip("/")
        self.leader_url: str | None = None  # where the last redirect pointed; used until it fails
        self.token_path = token_path
        self.period = period
        self.timeout = timeout
        self.on_failure = on_failure or (lambda: None)
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
                self.agent.controller_reachable = False
                if str(exc) != self.last_error:
                    log.warning("controller report failed: %s (keeping allocations until the lease ends)", exc)
                self.last_error = str(exc)
                self.on_failure()
            self._stop.wait(self.period * self.rng.uniform(0.8, 1.2))

    def _node_egress_bps(self, pods_usage: float) -> float:
        """The node's measured internet egress (host traffic included) from the data path's node
        counter, as a rate since the last report; the pods' usage when the counter is missing."""
        try:
            _, node_counters = self.agent.datapath.counters()
        except Exception:
            return pods_usage
        total = node_counters.get("egress_internet")
        if total is None:
            return pods_usage
        now, prev, self._egress = time.monotonic(), self._egress, (time.monotonic(), int(total))
        if prev is None or now <= prev[0] or total < prev[1]:
            return pods_usage
        return (total - prev[1]) * 8 / (now - prev[0])

    def build_report(self) -> dict:
        agent = self.agent
        with agent._lock:
            pods = list(agent.pods)
        out = []
        usage_total = 0.0
        for p in pods:
            d = agent.demand.get(p.key)
            usage = float(d.usage_bps) if d else 0.0
            usage_total += usage
            out.append({
                "namespace": p.namespace, "name": p.name,
                "usage_bps": usage,
                "demand_bps": float(d.demand_bps) if d else float(p.min_bps),
                "throttled": bool(d.throttled) if d else False,
                "egress_class": p.class_annotation, "egress_bandwidth": p.bandwidth_annotation,
            })
        self.seq += 1
        return {"node": agent.cfg.node, "pods": out, "seq": self.seq, "period_seconds": self.period,
                "node_internet_egress_bps": max(0.0, self._node_egress_bps(usage_total))}

    def _post(self, url: str, body: bytes) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token_path and Path(self.token_path).exists():
            headers["Authorization"] = "Bearer " + Path(self.token_path).read_text().strip()  # re-read: kubelet rotates it
        for _ in range(MAX_REDIRECTS + 1):
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                location = exc.headers.get("Location")
                if exc.code in (307, 308) and location:  # a follower points at the leader
                    url = location
                    self.leader_url = location.split("/v1/", 1)[0]
                    continue
                detail = exc.read()[:300].decode(errors="replace")
                raise ControllerError(f"controller {url} answered {exc.code}: {detail}", exc.code) from None
            except (urllib.error.URLError, OSError) as exc:
                raise ControllerError(f"controller {url} unreachable: {exc}") from exc
        raise ControllerError(f"controller redirected more than {MAX_REDIRECTS} times (last: {url})")

    def report_once(self) -> None:
        body = json.dumps(self.build_report()).encode()
        path = f"/v1/nodes/{self.agent.cfg.node}/report"
        if self.leader_url:
            try:
                answer = self._post(self.leader_url + path, body)
            except ControllerError as exc:
                if exc.status not in (None, 503):
                    raise  # the leader answered and refused the report: asking again elsewhere would not help
                log.info("leader %s failed (%s); asking the controller Service again", self.leader_url, exc)
                self.leader_url = None
                answer = self._post(self.url + path, body)
        else:
            answer = self._post(self.url + path, body)
        fresh_leader = int(answer["generation"]) == 0
        for problem in answer.get("problems") or []:
            log.log(logging.INFO if fresh_leader else logging.WARNING, "controller: %s", problem)
        self.agent.controller_reachable = True
        self.last_error = ""
        if fresh_leader:
            return  # no round yet: keep the allocations and the lease we have
        now = time.monotonic()
        allocs = AllocationSet(
            pods={f"{p['namespace']}/{p['name']}": Allocation(int(p["allocation_bps"]), int(p["limit_bps"]))
                  for p in answer["pods"]},
            node_rate_bps=int(answer["node_rate_bps"]),
            safe_floor_bps=int(answer["safe_floor_bps"]),
            lease_expires=now + float(answer["lease_seconds"]),
            generation=int(answer["generation"]),
            source="controller",
        )
        self.agent.set_allocations(allocs)
