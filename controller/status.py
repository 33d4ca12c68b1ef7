"""EgressBudget status: the leader writes what the last round computed.

At most once per `min_interval` seconds and only when what it would write changed
(rates rounded as `format_bps` prints them), so the API server sees O(1) writes
however many nodes report. Writes run in their own thread with a timeout: a slow API
server never holds up an allocation round.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from core.direction import Direction, PerDirection
from core.kubeapi import GROUP, TIMEOUT, VERSION
from core.quantity import format_bps

from .allocator import Summary

# The EgressBudget status's words per Direction (the CRD's names): downloads' fields and
# condition are the upload ones with an `ingress` prefix (allocated -> ingressAllocated); the
# download ones are null (removed) while no agent that shapes downloads reports.
STATUS_FIELD = PerDirection(lambda name: name, lambda name: "ingress" + name[0].upper() + name[1:])
TOTAL_FIELD = PerDirection("spec.total", "spec.ingressTotal")
CONDITION = PerDirection("Oversubscribed", "IngressOversubscribed")

log = logging.getLogger(__name__)


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def budget_status(summary: Summary, computed_at: float, previous: dict | None,
                  observed_generation: int | None = None) -> dict:
    """The EgressBudget status for one round, both directions (the download fields are null,
    which removes them, while no agent that shapes downloads reports). A condition keeps its
    lastTransitionTime while its status does not change."""
    unmet = sorted(t for t, v in summary.teams.items() if v.guarantee_unmet)
    generation = {} if observed_generation is None else {"observedGeneration": observed_generation}
    summaries = PerDirection(summary, summary.ingress)
    figures: dict = {}
    conditions = []
    for d, s in summaries.items():
        field = STATUS_FIELD[d]
        figures.update({field(name): format_bps(getattr(s, name + "_bps")) if s else None
                        for name in ("allocated", "demand", "used")})
        if s is not None:
            conditions.append(_oversubscribed(CONDITION[d], s.oversubscribed, TOTAL_FIELD[d],
                                              "" if d is Direction.UPLOAD else "download ", computed_at, previous,
                                              generation))
    return {
        **generation,
        **figures,
        "pods": summary.pods,
        "nodes": summary.nodes,
        "teamsBelowGuarantee": unmet,
        "lastComputed": _rfc3339(computed_at),
        "conditions": conditions,
    }


def _oversubscribed(kind: str, over: bool, total: str, what: str, computed_at: float, previous: dict | None,
                    generation: dict) -> dict:
    status = "True" if over else "False"
    old = next((c for c in (previous or {}).get("conditions") or [] if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else _rfc3339(computed_at)
    return {
        "type": kind,
        "status": status,
        "reason": "GuaranteesExceedTotal" if over else "GuaranteesFit",
        "message": (f"the teams' {what}guarantees add up to more than {total}; they are scaled down proportionally"
                    if over else f"every team's {what}guarantee fits within {total}"),
        "lastTransitionTime": since,
        **generation,
    }


def _comparable(status: dict | None) -> dict:
    """What counts as a change: everything but the timestamps."""
    if not status:
        return {}
    out = {k: v for k, v in status.items() if k != "lastComputed"}
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    return out


class StatusWriter:
    """Writes the latest round's summary to EgressBudget/<name>/status, rate-bounded, from its own
    thread: `offer` never blocks the allocation loop, and only the newest summary is written."""

    def __init__(self, api: client.ApiClient, min_interval: float = 30.0,
                 on_write: Callable[[str], None] = lambda result: None,
                 generation_of: Callable[[str], int | None] = lambda name: None,
                 leading: Callable[[], bool] = lambda: True,
                 on_version: Callable[[str, str], None] = lambda name, resource_version: None):
        self.custom = client.CustomObjectsApi(api)
        # the budget's resourceVersion after each write of ours, for the quota store's writes to the same
        # object (controller/quotastore.py): without it each of them met this write as a conflict
        self.on_version = on_version
        self.leading = leading  # a replica that lost the Lease since the round writes nothing
        self.generation_of = generation_of  # the budget's metadata.generation the round used
        self.min_interval = min_interval
        self.on_write = on_write
        self.written: dict[str, dict] = {}  # budget name -> the status we last wrote
        self._pending: tuple[Summary, float] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="status-writer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def offer(self, summary: Summary, computed_at: float) -> None:
        if summary.budget_name:  # the built-in default policy has no object to write to
            self._pending = (summary, computed_at)
            self._wake.set()

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, None
            if pending is not None and self.leading():
                self.write(*pending)
            self._stop.wait(self.min_interval)  # the bound: at most one write per interval

    def write(self, summary: Summary, computed_at: float) -> bool:
        name = summary.budget_name
        status = budget_status(summary, computed_at, self.written.get(name), self.generation_of(name))
        if _comparable(status) == _comparable(self.written.get(name)):
            return False
        try:
            obj = self.custom.patch_cluster_custom_object_status(GROUP, VERSION, "egressbudgets", name,
                                                                 {"status": status}, _request_timeout=TIMEOUT)
        except ApiException as exc:
            self.on_write("error")
            log.warning("EgressBudget %s: status write failed (%s %s); next round retries", name, exc.status,
                        exc.reason)
            return False
        except Exception as exc:
            self.on_write("error")
            log.warning("EgressBudget %s: status write failed (%s); next round retries", name, exc)
            return False
        self.written[name] = status
        self.on_write("ok")
        version = (obj.get("metadata") or {}).get("resourceVersion") if isinstance(obj, dict) else None
        if version:
            self.on_version(name, version)
        return True
