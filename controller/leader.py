"""Leader election with a coordination.k8s.io/v1 Lease, as client-go does it.

Expiry is judged by the *local* time at which we last saw the lease record change
(never by comparing our clock with the holder's renewTime), and every write carries
the resourceVersion it read, so two replicas can never both win one term. The
holder identity carries the leader's API address so followers can send agents there.

Leadership is bounded in time on our side too: `leading` is true only until
`renew_deadline` after the *start* of the last successful renewal (the write happened
after that start, so no other replica can see the lease expire before then: it waits a
whole lease duration from when it saw our write). Every call carries a timeout short
enough (`call_timeout`) that a read and a write fit in the renew deadline, and nothing
but the clock is needed to stop leading: a hung API server call cannot keep a replica
leading while another one takes over.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from core.kubeapi import TIMEOUT

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
        # (connect, read) per call: a read and a replace together stay within the renew deadline
        self.call_timeout = (min(TIMEOUT[0], renew_deadline / 4), min(TIMEOUT[1], renew_deadline / 4))
        self._leading = False  # what the election loop last decided; `leading` also checks the clock
        self._valid_until = 0.0  # monotonic: start of the last successful renewal + renew_deadline
        self.holder: str | None = None
        self._observed: tuple[str | None, str | None] = (None, None)  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="leader-election", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.retry_period * 3)
        if release and self._leading:
            self._valid_until = 0.0  # stop answering before the lease is handed over
            self._release()

    @property
    def leading(self) -> bool:
        """True only while the last renewal is younger than the renew deadline, whatever the
        election thread is doing (it may be stuck in a call to a hung API server)."""
        return self._leading and time.monotonic() < self._valid_until

    def run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                ok = self.try_acquire_or_renew()
            except Exception as exc:  # API server unreachable or slow: keep leading until the deadline
                log.warning("leader election: %s", exc)
                ok = False
            if ok:
                self._valid_until = started + self.renew_deadline
                self._set(time.monotonic() < self._valid_until)  # a renewal slower than the deadline leads nowhere
            elif self._leading and not self.leading:
                log.warning("leader election: could not renew within %gs; stepping down", self.renew_deadline)
                self._set(False)
            elif self._leading and self.holder not in (None, self.identity):
                self._valid_until = 0.0
                self._set(False)
            self._stop.wait(self.retry_period)

    def _set(self, leading: bool) -> None:
        if leading != self._leading:
            self._leading = leading
            log.info("leader election: %s", "now leading" if leading else "no longer leading")
            self.on_change(leading)

    def try_acquire_or_renew(self) -> bool:
        now = _now()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.call_timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=int(self.lease_seconds),
                                        acquire_time=now, renew_time=now, lease_transitions=0),
            )
            try:
                self.api.create_namespaced_lease(self.namespace, body, _request_timeout=self.call_timeout)
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
            # carries resourceVersion: two replicas can never both win one term
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=self.call_timeout)
        except ApiException as exc:
            if exc.status == 409:
                return False  # lost the race: another replica wrote first
            raise
        self.holder = self.identity
        return True

    def _release(self) -> None:
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.call_timeout)
            if lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = ""
                lease.spec.lease_duration_seconds = 1
                self.api.replace_namespaced_lease(self.name, self.namespace, lease,
                                                  _request_timeout=self.call_timeout)
        except Exception as exc:
            log.info("leader election: release failed (%s); the lease will expire", exc)

    def leader_address(self) -> str | None:
        """Identities are `<name>@<host:port>`; the part after @ is where agents go."""
        if self.holder and "@" in self.holder:
            return self.holder.split("@", 1)[1]
        return None
