"""The volume quotas' use persisted in the EgressBudget's status (status.quota), and their metrics.

Only the leader writes, from its own thread, at most once per `interval` and only when the use changed, so the
API server sees O(1) writes a minute whatever the cluster's size. Each write is a merge patch of status.quota
carrying the resourceVersion this writer last saw: a 409 (the status writer or anyone else wrote since) re-reads
the object and writes ours again (only the leader counts: its figure is the truth, never max() with a stale one).
A refused write (409 twice, 429, 5xx, quota, the API server unreachable) is retried with exponential backoff (to
`max_backoff`) while counting goes on in memory; the failure is counted by reason and told once per streak by a
Warning Event on the EgressBudget, the recovery by a Normal one.

A new leader (failover or restart) resumes from status.quota before it counts (`QuotaKeeper.resume`): what it
loses is the use counted after the last write (at most one interval plus one report period), never more.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from core.direction import DIRECTIONS, Direction
from core.kubeapi import GROUP, TIMEOUT, VERSION
from core.policy import Policy
from core.quota import quota_figures

from .quota import QuotaKeeper

log = logging.getLogger(__name__)
PLURAL = "egressbudgets"


def failure_reason(exc: Exception) -> str:
    """A failed write's reason label: conflict, throttled, refused (4xx: quota, forbidden...), server (5xx),
    unreachable (no answer)."""
    if isinstance(exc, ApiException) and exc.status:
        if exc.status == 409:
            return "conflict"
        if exc.status == 429:
            return "throttled"
        return "server" if exc.status >= 500 else "refused"
    return "unreachable"


class QuotaStore:
    def __init__(self, api: client.ApiClient, keeper: QuotaKeeper, interval: float = 30.0,
                 leading: Callable[[], bool] = lambda: True, max_backoff: float = 60.0,
                 event: Callable[[str, str, str, str], None] = lambda budget, kind, reason, message: None,
                 registry=None, policy: Callable[[], Policy] | None = None,
                 ready: Callable[[], bool] = lambda: True):
        self.custom = client.CustomObjectsApi(api)
        self.keeper = keeper
        self.policy = policy  # the current policy, read before resuming (the budget's name, the teams' quotas)
        self.ready = ready  # the policy caches synced: resuming before would resume from nothing
        self.interval = interval  # the bound: at most one write per interval (and per backoff after a failure)
        self.leading = leading
        self.max_backoff = max_backoff
        self.event = event  # (budget, "Normal"|"Warning", reason, message)
        self.failures = 0  # failed attempts in a row (writes or the resume's read)
        self.written_version = -1  # the keeper's version last written
        self.last_write = 0.0  # wall time of the last successful write
        self.resource_version: str | None = None  # the EgressBudget's, as this writer last saw it
        # (budget, its status.quota) as resumed or last written: an equal one is not written again
        self.persisted: tuple[str, dict | None] = ("", None)
        self.write_failures = Counter("netagent_controller_quota_status_write_failures",
                                      "status.quota writes (or the resume's read) the API server refused or never "
                                      "answered, by reason; counting goes on in memory", ["reason"],
                                      registry=registry)
        self.writes = Counter("netagent_controller_quota_status_writes", "status.quota writes that succeeded",
                              registry=registry)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="quota-store", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Leadership changed: resume (or stop) now, not at the next interval."""
        self._wake.set()

    def backoff(self) -> float:
        return min(self.max_backoff, self.interval * 2 ** max(0, self.failures - 1)) if self.failures else self.interval

    def run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._wake.wait(self.backoff() if self.failures else self.interval if self.keeper.active else 1.0)
            self._wake.clear()

    def step(self) -> None:
        """One pass: stop counting when not leading; resume when leading and not counting yet; else write."""
        if not self.leading():
            self.keeper.stop()
            return
        if not self.keeper.active:
            if not self.ready():
                return
            if self.policy is not None:
                self.keeper.set_policy(self.policy())
            self.resume()
        elif self.keeper.version != self.written_version:
            self.write()
        if self.keeper.active:
            for team, d, reason, used, limit in self.keeper.crossings():
                self.event(self.keeper.budget_name, "Warning", reason,
                           f"team {team} has used {used} of its {limit} bytes of internet "
                           f"{'uploads' if d is Direction.UPLOAD else 'downloads'} this period ({100 * used // limit} %)"
                           + ("; it is capped at its exhaustedRate until the period ends" if used >= limit else ""))

    def observed(self, name: str, resource_version: str) -> None:
        """This process wrote the budget (the status writer's round figures): write on top of that version.
        A 409 is then only another writer's (a user, a replica that lost the lease)."""
        if name == self.keeper.budget_name:
            self.resource_version = resource_version

    def _read(self, name: str) -> dict:
        obj: dict = self.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name,  # type: ignore[assignment]
                                                          _request_timeout=TIMEOUT)
        self.resource_version = obj.get("metadata", {}).get("resourceVersion")
        return obj

    def resume(self) -> bool:
        name = self.keeper.budget_name
        try:
            persisted = ((self._read(name).get("status") or {}).get("quota")) if name else None
        except ApiException as exc:
            if exc.status != 404:
                return self._failed(name, exc, "read")
            persisted = None  # no budget object (deleted): nothing to resume
        except Exception as exc:
            return self._failed(name, exc, "read")
        teams = self.keeper.resume(persisted)
        self.written_version = -1
        self.persisted = (name, persisted if isinstance(persisted, dict) else None)
        self._recovered(name)
        log.info("volume quotas: counting as leader, resumed %d team(s) from EgressBudget %s status.quota",
                 teams, name or "-")
        return True

    def write(self) -> bool:
        name, version = self.keeper.budget_name, self.keeper.version
        if not name:
            return False
        quota = self.keeper.status()
        if self.persisted[0] == name and quota == (self.persisted[1] or {"teams": []}):
            # nothing new since the resume or the last write (a new leader, a budget without quotas): a write
            # would only wake every watcher of EgressBudgets
            self.written_version = version
            return False
        body = {"status": {"quota": quota}}
        for attempt in range(2):
            try:
                if self.resource_version is None or attempt:
                    self._read(name)
                patch = {**body, "metadata": {"resourceVersion": self.resource_version}}
                obj: dict = self.custom.patch_cluster_custom_object_status(  # type: ignore[assignment]
                    GROUP, VERSION, PLURAL, name, patch, _request_timeout=TIMEOUT)
            except ApiException as exc:
                if exc.status == 409 and not attempt:
                    self.write_failures.labels("conflict").inc()
                    continue  # someone wrote since: re-read, write ours
                return self._failed(name, exc, "write")
            except Exception as exc:
                return self._failed(name, exc, "write")
            self.resource_version = obj.get("metadata", {}).get("resourceVersion")
            self.written_version, self.last_write, self.persisted = version, time.time(), (name, quota)
            self.writes.inc()
            self._recovered(name)
            return True
        return False

    def _failed(self, name: str, exc: Exception, what: str) -> bool:
        reason = failure_reason(exc)
        if reason != "conflict":
            self.write_failures.labels(reason).inc()
        self.failures += 1
        detail = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else str(exc)
        log.warning("EgressBudget %s: status.quota %s failed (%s); counting goes on in memory, retry in %.0f s",
                    name, what, detail, self.backoff())
        if self.failures == 1:
            self.event(name, "Warning", "QuotaStatusWriteFailed",
                       f"status.quota {what} failed ({reason}: {detail[:200]}); the volume quotas' use is kept in "
                       f"the controller's memory and retried with backoff")
        return False

    def _recovered(self, name: str) -> None:
        if self.failures:
            self.event(name, "Normal", "QuotaStatusWritten",
                       f"status.quota written again after {self.failures} failed attempt(s)")
        self.failures = 0


class QuotaCollector:
    """Per team and direction: quota bytes, used bytes, period start, exhausted (0/1) and the forecast time to
    exhaustion at the current rate; only on the leader (a follower's figures are not counted)."""

    def __init__(self, keeper: QuotaKeeper, store: QuotaStore | None, is_leader: Callable[[], bool]):
        self.keeper, self.store, self.is_leader = keeper, store, is_leader

    def collect(self) -> Iterable[Metric]:
        labels = ["team", "direction"]
        quota = GaugeMetricFamily("netagent_team_quota_bytes", "the team's volume quota per period (bytes)",
                                  labels=labels)
        used = GaugeMetricFamily("netagent_team_quota_used_bytes", "internet bytes the team used this period",
                                 labels=labels)
        start = GaugeMetricFamily("netagent_team_quota_period_start_seconds", "start of the team's period (Unix)",
                                  labels=labels)
        spent = GaugeMetricFamily("netagent_team_quota_exhausted",
                                  "1 when the team's quota is spent: it is capped at its exhaustedRate", labels=labels)
        forecast = GaugeMetricFamily("netagent_team_quota_exhaustion_forecast_seconds",
                                     "seconds until the quota is spent at the team's rate over the last minute "
                                     "(absent: no use)", labels=labels)
        if self.is_leader() and self.keeper.active:
            for u in self.keeper.teams():
                for d in DIRECTIONS:
                    f = quota_figures(u.quota.limits[d], u.used[d], u.byte_rate[d])
                    if f is None:
                        continue
                    lv = [u.name, d.metric_word]
                    quota.add_metric(lv, f.bytes)
                    used.add_metric(lv, f.used)
                    start.add_metric(lv, u.period_start.timestamp())
                    spent.add_metric(lv, 1.0 if f.exhausted else 0.0)
                    if f.forecast_seconds is not None:
                        forecast.add_metric(lv, f.forecast_seconds)
        yield from (quota, used, start, spent, forecast)
        if self.store is not None and self.store.last_write:
            yield GaugeMetricFamily("netagent_controller_quota_status_last_write_timestamp_seconds",
                                    "when status.quota was last written (Unix)", value=self.store.last_write)
