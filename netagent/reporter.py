"""Agent -> controller: post the node report, take allocations and a lease.

Fail-static: on any failure the agent keeps its last allocations until their lease
runs out (the sync loop then falls to the controller's safe floor). Reports are
jittered (±20%) so thousands of agents don't arrive in lockstep.
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


class Reporter:
    def __init__(self, agent: Agent, url: str, token_path: str | None = DEFAULT_TOKEN_PATH, period: float = 5.0,
                 timeout: float = 3.0, on_failure: Callable[[], None] | None = None, rng: random.Random | None = None):
        self.agent = agent
        self.url = url.rstrip("/")
        self.token_path = token_path
        self.period = period
        self.timeout = timeout
        self.on_failure = on_failure or (lambda: None)
        self.rng = rng or random.Random()
        self.seq = 0
        self.last_error = ""
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

    def build_report(self) -> dict:
        agent = self.agent
        with agent._lock:
            pods = list(agent.pods)
        out = []
        for p in pods:
            d = agent.demand.get(p.key)
            out.append({
                "namespace": p.namespace, "name": p.name,
                "usage_bps": float(d.usage_bps) if d else 0.0,
                "demand_bps": float(d.demand_bps) if d else float(p.min_bps),
                "throttled": bool(d.throttled) if d else False,
                "egress_class": p.class_annotation, "egress_bandwidth": p.bandwidth_annotation,
            })
        self.seq += 1
        return {"node": agent.cfg.node, "pods": out, "seq": self.seq, "period_seconds": self.period}

    def _post(self, url: str, body: bytes, hops: int = 3) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token_path and Path(self.token_path).exists():
            headers["Authorization"] = "Bearer " + Path(self.token_path).read_text().strip()  # re-read: kubelet rotates it
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code in (307, 308) and hops and exc.headers.get("Location"):
                return self._post(exc.headers["Location"], body, hops - 1)  # a follower points at the leader
            detail = exc.read()[:300].decode(errors="replace")
            raise RuntimeError(f"controller answered {exc.code}: {detail}") from None

    def report_once(self) -> None:
        body = json.dumps(self.build_report()).encode()
        answer = self._post(f"{self.url}/v1/nodes/{self.agent.cfg.node}/report", body)
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
        for problem in answer.get("problems") or []:
            log.warning("controller: %s", problem)
        self.agent.controller_reachable = True
        self.last_error = ""
        self.agent.set_allocations(allocs)
