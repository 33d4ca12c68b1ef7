"""Leader election with a coordination.k8s.io/v1 Lease, as client-go does it.

Expiry is judged by the *local* time at which we last saw the lease record change
(never by comparing our clock with the holder's renewTime), and every write carries
the resourceVersion it read, so two replicas can never both win one term. The
holder identity carries the leader's API address so followers can send agents there.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)


def _now() -> dt.datetime:
    now = dt.datetime.now(dt.timezone.utc)
    # isoformat() drops a zero fraction, and the API server's MicroTime wants exactly six digits
    return now.replace(microsecond=now.microsecond or 1)


class LeaderElector:
    def __init__(self, api_client, namespace: str, name: str, identity: str, lease_seconds: float = 15.0,
                 renew_deadline: float = 10.0, retry_period: float = 2.0,
                 on_change: Callable[[bool], None] | None = None):
        if not renew_deadline < lease_seconds:
            raise ValueError("renew deadline must be shorter than the lease duration")
        self.api = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds, self.renew_deadline, self.retry_period = lease_seconds, renew_deadline, retry_period
        self.on_change = on_change or (lambda leading: None)
        self.leading = False
        self.holder: str | None = None
        self._observed: tuple[str | None, str | None] = (None, None)  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._last_renew = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="leader-election", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.retry_period * 3)
        if release and self.leading:
            self._release()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                ok = self.try_acquire_or_renew()
            except Exception as exc:  # API server unreachable: keep what we have until the deadline
                log.warning("leader election: %s", exc)
                ok = False
            now = time.monotonic()
            if ok:
                self._last_renew = now
                self._set(True)
            elif self.leading and now - self._last_renew > self.renew_deadline:
                log.warning("leader election: could not renew within %.0fs; stepping down", self.renew_deadline)
                self._set(False)
            elif not ok and self.leading and self.holder not in (None, self.identity):
                self._set(False)
            self._stop.wait(self.retry_period)

    def _set(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.info("leader election: %s", "now leading" if leading else "no longer leading")
            self.on_change(leading)

    def try_acquire_or_renew(self) -> bool:
        now = _now()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=int(self.lease_seconds),
                                        acquire_time=now, renew_time=now, lease_transitions=0),
            )
            try:
                self.api.create_namespaced_lease(self.namespace, body)
            except ApiException as exc2:
                if exc2.status == 409:
                    return False  # someone else created it first
                raise
            self.holder = self.identity
            return True
        spec = lease.spec
        holder = spec.holder_identity
        record = (holder, spec.renew_time.isoformat() if spec.renew_time else None)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        self.holder = holder
        duration = spec.lease_duration_seconds or self.lease_seconds
        expired = time.monotonic() > self._observed_at + duration
        if holder and holder != self.identity and not expired:
            return False
        if holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = int(self.lease_seconds)
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease)  # carries resourceVersion
        except ApiException as exc:
            if exc.status == 409:
                return False  # lost the race: another replica wrote first
            raise
        self.holder = self.identity
        return True

    def _release(self) -> None:
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = ""
                lease.spec.lease_duration_seconds = 1
                self.api.replace_namespaced_lease(self.name, self.namespace, lease)
        except Exception as exc:
            log.info("leader election: release failed (%s); the lease will expire", exc)

    def leader_address(self) -> str | None:
        """Identities are `<name>@<host:port>`; the part after @ is where agents go."""
        if self.holder and "@" in self.holder:
            return self.holder.split("@", 1)[1]
        return None
