"""The agent API: HTTP/JSON, versioned paths (openapi: docs/agent-api.openapi.yaml).

POST /v1/nodes/{node}/report   an agent's node report -> its pods' allocations + lease
GET  /healthz /readyz          liveness; readiness (see ReportSink.ready)

Every request is bounded: body size and read time, pods per report, field ranges
(core.wire), per-node rate, uncached TokenReviews (ReviewGate), reports held at once
(--max-pending-reports: beyond it a 503 Overloaded before anything else, which tells the caller
nothing but when to come back). Then the order is fixed: the
token is checked first (so a follower never tells an unauthenticated caller where the
leader is), then leadership: a follower answers 307 with the leader's https address in
Location and in the JSON body, so agents, which reach any replica through the Service,
end up at the leader; then readiness: a leader whose caches have not synced answers 503
with Retry-After, and agents keep what they have. A report over MAX_BODY is refused whole
(413: it cannot be parsed safely); inside it, a bad pod is refused alone (state.refuse).
Nothing an agent sends reaches another node's allocations: a report only replaces its own
node's entry.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol

import msgspec
from aiohttp import web

from core.objects import DNS_NAME
from core.wire import MAX_ADVISED_PERIOD, MAX_REPORT_BYTES, ErrorBody, NodeAnswer, NodeReport, encoder, report_decoder

from .auth import AuthError, Identity, TokenAuthenticator
from .config import DEFAULT_MAX_PENDING_REPORTS

log = logging.getLogger(__name__)
MAX_BODY = MAX_REPORT_BYTES
BODY_TIMEOUT = 10.0  # seconds to receive a report's body: a slow sender does not hold a request forever
MAX_REVIEWS_IN_FLIGHT = 16  # TokenReviews of unknown tokens at once (their own threads), per lane
MAX_REVIEWS_PENDING = 256  # reviews waiting or in flight, all clients together, per lane; beyond: 429 at once
MAX_REVIEWS_PER_CLIENT = 4  # ... from one client address (shared lane)
MIN_OVERLOAD_RETRY = 2  # seconds: the shortest Retry-After an overloaded leader sends
REVIEW_RATE_PER_CLIENT = 5.0  # uncached reviews per second one client address may cause (burst 2x)
MAX_REVIEWS_PER_AGENT_POD = 2  # agent lane: pending per claimed pod (its report and one retry)
# agent lane: reviews per second per claimed pod (burst 2x), as per client address: an agent needs
# one a minute, one restarted or handed fresh tokens a few at once
REVIEW_RATE_PER_AGENT_POD = 5.0


class ReportSink(Protocol):
    def submit(self, identity: Identity | None, report: NodeReport) -> NodeAnswer: ...

    def is_leader(self) -> bool: ...

    def leader_address(self) -> str | None: ...

    def ready(self) -> tuple[bool, str]: ...

    def serving(self) -> tuple[bool, str]: ...

    async def settle(self, answer: NodeAnswer) -> NodeAnswer: ...


class TokenBucket:
    """Per-key token buckets; keys idle for a minute are forgotten (nodes come and go)."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.buckets: dict[str, tuple[float, float]] = {}
        self._pruned = time.monotonic()

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, last = self.buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if now - self._pruned > 60:
            self._pruned = now
            self.buckets = {k: v for k, v in self.buckets.items() if now - v[1] < 60}
        if tokens < 1:
            self.buckets[key] = (tokens, now)
            return False
        self.buckets[key] = (tokens - 1, now)
        return True


class _Lane:
    """One review lane: per key a token bucket and a bound on pending reviews, a bound on all
    its pending reviews, and its own fixed pool of review threads."""

    def __init__(self, name: str, rate: float, per_key: int, pending: int, in_flight: int):
        self.rate = TokenBucket(rate, 2 * rate)
        self.per_key, self.max_pending = per_key, pending
        self.pending: Counter[object] = Counter()
        self.total = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix=f"token-review-{name}")

    def admit(self, key) -> bool:
        if self.total >= self.max_pending or self.pending[key] >= self.per_key or not self.rate.allow(key):
            return False
        self.pending[key] += 1
        self.total += 1
        return True

    def release(self, key) -> None:
        self.total -= 1
        self.pending[key] -= 1
        if not self.pending[key]:
            del self.pending[key]


class ReviewGate:
    """Admission for uncached TokenReviews, in two lanes that never wait on each other:
    - the agent lane, for tokens that name a live agent pod (TokenAuthenticator.triage): keyed
      by the claimed pod, so a forger who knew a pod's uid would queue behind that pod only;
    - the shared lane, keyed by client address: every token before the agent-pod watch has
      listed (a new leader), as it was before the lanes existed.
    Once the watch has listed, a token that names no live agent pod is refused before the gate,
    so the shared lane is idle: the API server sees at most one lane's MAX_REVIEWS_IN_FLIGHT
    reviews at once in either state. A caller refused here gets 429 at once instead of queueing:
    1,000 junk tokens a second from one pod cost 5 reviews a second (none once synced) and never
    delay another client's review."""

    def __init__(self, per_client_rate: float = REVIEW_RATE_PER_CLIENT, per_client: int = MAX_REVIEWS_PER_CLIENT,
                 pending: int = MAX_REVIEWS_PENDING, in_flight: int = MAX_REVIEWS_IN_FLIGHT,
                 per_agent_pod_rate: float = REVIEW_RATE_PER_AGENT_POD,
                 per_agent_pod: int = MAX_REVIEWS_PER_AGENT_POD):
        self.shared = _Lane("shared", per_client_rate, per_client, pending, in_flight)
        self.agents = _Lane("agents", per_agent_pod_rate, per_agent_pod, pending, in_flight)

    def lane(self, pod: tuple[str, str] | None) -> _Lane:
        return self.shared if pod is None else self.agents

    def admit(self, client: str, pod: tuple[str, str] | None = None) -> bool:
        """Called on the event loop (no lock needed); `release(client, pod)` after an admitted review."""
        return self.lane(pod).admit(client if pod is None else pod)

    def release(self, client: str, pod: tuple[str, str] | None = None) -> None:
        self.lane(pod).release(client if pod is None else pod)

    @property
    def total(self) -> int:
        return self.shared.total + self.agents.total

    def pool(self, pod: tuple[str, str] | None = None) -> concurrent.futures.ThreadPoolExecutor:
        return self.lane(pod).pool

    def shutdown(self) -> None:
        for lane in (self.shared, self.agents):
            lane.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class APIStats:
    count_report: Callable[[], None] = lambda: None
    count_rejected: Callable[[str], None] = lambda reason: None


def _error(status: int, reason: str, message: str, headers: dict | None = None,
           leader: str | None = None) -> web.Response:
    return web.Response(status=status, body=encoder.encode(ErrorBody(message, reason, leader)),
                        content_type="application/json", headers=headers)


def overload_retry_after(advised_period: float) -> int:
    """Retry-After (whole seconds) for a report shed by an overloaded leader: the paced period when
    pacing is on (agents then come back at the rate the leader can take), at least MIN_OVERLOAD_RETRY."""
    period = advised_period if math.isfinite(advised_period) else 0.0
    return int(min(MAX_ADVISED_PERIOD, max(MIN_OVERLOAD_RETRY, math.ceil(period))))


def make_app(sink: ReportSink, auth: TokenAuthenticator | None, stats: APIStats | None = None,
             per_node_rate: float = 2.0, per_node_burst: float = 6.0,
             self_address: str | None = None, scheme: str = "https", gate: ReviewGate | None = None,
             max_pending: int = DEFAULT_MAX_PENDING_REPORTS,
             advised_period: Callable[[], float] = lambda: 0.0) -> web.Application:
    """auth=None disables authentication: for the single-machine demo and tests only.
    self_address is this replica's own host:port, so a stale lease naming us is never
    turned into a redirect to ourselves; `scheme` is the one this replica serves (and the
    leader with it): redirects keep it. At most `max_pending` reports are held at once (being
    authenticated, read, or waiting for their round); more are shed at once with a 503
    Overloaded and a Retry-After of the paced period (`advised_period`, controller/pacing.py):
    a leader offered more reports than it answers keeps its memory flat instead of queueing
    them (docs/scale.md, the 5,000-node run)."""
    stats = stats or APIStats()
    limiter = TokenBucket(per_node_rate, per_node_burst)
    gate = gate or ReviewGate()
    pending = 0

    async def authenticate(header: str | None, client: str) -> Identity:
        identity, pod = auth.triage(header)  # cheap checks and the cache: no API call, no thread
        if identity is not None:
            return identity
        if not gate.admit(client, pod):
            raise AuthError("ReviewsBusy", "too many unverified tokens from this client; retry")
        try:
            return await asyncio.get_running_loop().run_in_executor(gate.pool(pod), auth.authenticate, header)
        finally:
            gate.release(client, pod)

    def reject(status: int, reason: str, message: str, **kw) -> web.Response:
        stats.count_rejected(reason)
        return _error(status, reason, message, **kw)

    async def report(request: web.Request) -> web.Response:
        nonlocal pending
        node = request.match_info["node"]
        if not DNS_NAME.match(node):
            return reject(404, "NotFound", "the path must name a node: /v1/nodes/<node name>/report")
        if pending >= max_pending:  # before the token review: shedding must cost next to nothing
            return reject(503, "Overloaded", f"the controller holds {pending} reports already; keep your "
                                             "allocations and report again after Retry-After",
                          headers={"Retry-After": str(overload_retry_after(advised_period()))})
        pending += 1
        try:
            return await handle(request, node)
        finally:
            pending -= 1

    async def handle(request: web.Request, node: str) -> web.Response:
        identity = None
        if auth is not None:  # first: nothing, not even the leader's address, for an unauthenticated caller
            try:
                identity = await authenticate(request.headers.get("Authorization"), request.remote or "")
            except AuthError as exc:
                if exc.reason == "ReviewsBusy":
                    return reject(429, exc.reason, str(exc), headers={"Retry-After": "1"})
                return reject(401 if exc.reason == "Unauthenticated" else 403, exc.reason, str(exc))
            except Exception as exc:  # the API server is unreachable: not the agent's fault
                log.warning("TokenReview failed: %s", exc)
                return reject(503, "AuthUnavailable", "cannot verify the token right now; retry",
                              headers={"Retry-After": "2"})
            if identity.node != node:
                return reject(403, "WrongNode", f"token is bound to node {identity.node!r}, not {node!r}")
        if not sink.is_leader():
            leader = sink.leader_address()
            if leader and leader != self_address:
                stats.count_rejected("NotLeader")
                return _error(307, "NotLeader", f"this replica is not the leader; report to {leader}",
                              headers={"Location": f"{scheme}://{leader}{request.rel_url}"}, leader=leader)
            return reject(503, "NoLeader", "no controller is leading yet; keep your allocations and retry shortly",
                          headers={"Retry-After": "2"})
        ok, why = sink.serving()
        if not ok:  # leading, but the caches are not synced: an answer now would drop every pod
            return reject(503, "NotReady", f"the controller is not ready ({why}); keep your allocations and retry",
                          headers={"Retry-After": "2"})
        if not limiter.allow(node):
            return reject(429, "RateLimited", f"node {node} reports too often (at most {per_node_rate:g}/s)",
                          headers={"Retry-After": "1"})
        if request.content_length is not None and request.content_length > MAX_BODY:
            return reject(413, "TooLarge", f"report larger than {MAX_BODY} bytes (refused whole: it cannot be "
                                           "parsed safely)")
        try:
            body = await asyncio.wait_for(request.read(), BODY_TIMEOUT)  # bounded by client_max_size
        except web.HTTPRequestEntityTooLarge:
            return reject(413, "TooLarge", f"report larger than {MAX_BODY} bytes (refused whole: it cannot be "
                                           "parsed safely)")
        except asyncio.TimeoutError:
            return reject(408, "Timeout", f"the report's body did not arrive within {BODY_TIMEOUT:g}s")
        except Exception:
            return reject(400, "Malformed", "could not read the request body")
        try:
            rep = report_decoder.decode(body)
        except msgspec.ValidationError as exc:
            return reject(422, "Invalid", f"invalid report: {exc}")
        except msgspec.DecodeError as exc:
            return reject(400, "Malformed", f"malformed JSON: {exc}")
        if rep.node != node:
            return reject(422, "Invalid", f"report names node {rep.node!r} but was posted for {node!r}")
        try:
            answer = await sink.settle(sink.submit(identity, rep))
        except Exception:  # a bug of ours must not take the server down, nor look like the agent's fault
            log.exception("report from node %s failed", node)
            return reject(500, "Internal", "the controller failed to process this report; it keeps running")
        stats.count_report()
        return web.Response(body=encoder.encode(answer), content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        ok, why = sink.ready()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    async def shutdown(app: web.Application) -> None:
        gate.shutdown()

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/nodes/{node}/report", report)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.on_cleanup.append(shutdown)
    return app
