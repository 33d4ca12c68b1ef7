"""Who may read /metrics: a bearer token checked as kubelet and controller-runtime's secure
metrics (and kube-rbac-proxy) check it: a TokenReview says who the token belongs to, a
SubjectAccessReview whether that user may `get` the nonResourceURL `/metrics`.

Pure logic: the two API calls are injected (`core/kubereview.py` makes them with the
kubernetes client), so the agent's selector server and the controller's aiohttp app share the
cache, the bounds and the refusals. The order a scrape meets them:

- cheap rejection, no API call: no `Authorization: Bearer`, or a token that is not three
  base64url JWT parts of at most MAX_TOKEN_BYTES (401);
- the verdict cache, keyed by the token's sha256, bounded (LRU, `max_entries`), on a monotonic
  clock: a grant is reused for `ttl` seconds (never past the token's `exp`, converted to the
  monotonic clock once, when it was reviewed: a wall-clock step changes nothing), a refusal for
  `refusal_ttl` (a flood of one bad token is not a flood of reviews). Prometheus' token, once
  granted, costs nothing per scrape;
- admission of an unknown token (`admit`/`release`): at most `per_source` reviews pending per
  client address and at most `max_pending` overall, and at most `rate` reviews a second overall
  and `source_rate` per client address (token buckets, burst 2x): the API server's load from junk
  is bounded per agent whatever the node's pods send. A token granted before (its verdict
  expired) has `reserve` more slots and no rate, so junk from the node's pods, which fills the
  general slots and drains the buckets, never keeps Prometheus' own token from its renewal (a
  first grant under a flood may wait for a slot: Prometheus retries at its next scrape).
  Refused admission: 429 at once, no review;
- the reviews themselves (`authorize`, blocking: a worker thread): a TokenReview failing to
  authenticate is a 401, a SubjectAccessReview not allowing is a 403; an API error a 503 (not the
  caller's fault, not cached).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

from .errors import NetagentError

PATH = "/metrics"
VERB = "get"
MAX_TOKEN_BYTES = 4096  # ServiceAccount tokens are ~1 KiB
_JWT = re.compile(r"[A-Za-z0-9_-]+\.([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+")

# refusal reasons (the `reason` label of the refusals counter); the HTTP status each answers
STATUS = {"missing_token": 401, "malformed_token": 401, "unauthenticated": 401, "forbidden": 403,
          "busy": 429, "review_failed": 503}


class ScrapeRefused(NetagentError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.status = STATUS[reason]


@dataclass(frozen=True)
class User:
    """Who a TokenReview says the token belongs to (what a SubjectAccessReview asks about)."""
    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def from_review(cls, status: dict) -> "User":
        user = status.get("user") or {}
        extra = tuple(sorted((k, tuple(v or ())) for k, v in (user.get("extra") or {}).items()))
        return cls(user.get("username") or "", user.get("uid") or "", tuple(user.get("groups") or ()), extra)


def bearer_token(header: str | None) -> str:
    """The token of an `Authorization: Bearer <JWT>` header, or ScrapeRefused without any API call."""
    if not header or not header.startswith("Bearer "):
        raise ScrapeRefused("missing_token", "missing bearer token: send Authorization: Bearer <ServiceAccount "
                                             f"token> of a user allowed to get {PATH}")
    token = header[7:].strip()
    if len(token) > MAX_TOKEN_BYTES or _JWT.fullmatch(token) is None:
        raise ScrapeRefused("malformed_token", f"malformed bearer token (not a JWT of at most {MAX_TOKEN_BYTES} bytes)")
    return token


def _exp(token: str) -> float | None:
    """The token's `exp` claim (Unix time), unverified: only ever shortens a reviewed verdict."""
    payload = token.split(".")[1]
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, ValueError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) if isinstance(exp, (int, float)) and not isinstance(exp, bool) else None


class ScrapeAuthorizer:
    """`cached` and `admit`/`release` are cheap (an event loop or a selector thread may call them);
    `authorize` may call the API server twice (a worker thread)."""

    def __init__(self, token_review: Callable[[str], dict], access_review: Callable[[User, str, str], bool],
                 ttl: float = 60.0, refusal_ttl: float = 5.0, max_entries: int = 4096, max_pending: int = 8,
                 reserve: int = 2, per_source: int = 1, rate: float = 5.0, source_rate: float = 1.0, path: str = PATH,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.token_review = token_review  # token -> TokenReview status dict (API call)
        self.access_review = access_review  # (user, verb, path) -> allowed (API call)
        self.ttl, self.refusal_ttl, self.max_entries = ttl, refusal_ttl, max_entries
        self.max_pending, self.reserve, self.per_source = max_pending, reserve, per_source
        self.path, self.clock, self.wall = path, clock, wall
        # token buckets (burst 2x) on reviews of tokens never granted: overall, and per client address
        self.rate, self.source_rate = rate, source_rate
        self._bucket = (2 * rate, clock())
        self._source_buckets: dict[str, tuple[float, float]] = {}
        # sha256(token) -> (fresh until on `clock`, granted-before until on `clock`, verdict)
        self._cache: OrderedDict[bytes, tuple[float, float, User | ScrapeRefused]] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._total = 0
        # what the metrics show: reviews made (by kind: token, access), refusals by reason
        self.reviews: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()

    def refuse(self, exc: ScrapeRefused) -> ScrapeRefused:
        """Count a refusal (every answer that is not a grant passes here once)."""
        self.refusals[exc.reason] += 1
        return exc

    # -- cheap -----------------------------------------------------------------------------------
    def cached(self, header: str | None) -> User | None:
        """The cached grant, None when the token must be reviewed; raises ScrapeRefused (counted) for
        a missing or malformed token or a cached refusal."""
        try:
            key = hashlib.sha256(bearer_token(header).encode()).digest()
        except ScrapeRefused as exc:
            raise self.refuse(exc) from None
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            fresh, known, verdict = hit
            if now >= fresh:
                if now >= known:
                    del self._cache[key]
                return None
            self._cache.move_to_end(key)
        if isinstance(verdict, ScrapeRefused):
            raise self.refuse(verdict)
        return verdict

    def _granted_before(self, header: str | None) -> bool:
        try:
            key = hashlib.sha256(bearer_token(header).encode()).digest()
        except ScrapeRefused:
            return False
        with self._lock:
            hit = self._cache.get(key)
        return hit is not None and isinstance(hit[2], User) and self.clock() < hit[1]

    def admit(self, source: str, header: str | None) -> bool:
        """A review slot for `source`, or False (counted as `busy`); `release(source)` after it."""
        known = self._granted_before(header)
        bound = self.max_pending + (self.reserve if known else 0)
        now = self.clock()
        with self._lock:
            if self._pending[source] >= self.per_source or self._total >= bound:
                ok = False
            elif known:  # a renewal: no rate, so junk that drains the buckets never delays it
                ok = True
            else:
                ok = self._take(source, now)
            if ok:
                self._pending[source] += 1
                self._total += 1
        if not ok:
            self.refusals["busy"] += 1
        return ok

    def _take(self, source: str, now: float) -> bool:
        """One review from the overall bucket and the source's (lock held): the API server's load from
        unknown tokens stays at most `rate` a second (burst 2x) however many pods send them."""
        tokens, last = self._bucket
        tokens = min(2 * self.rate, tokens + (now - last) * self.rate)
        mine, mine_last = self._source_buckets.get(source, (2 * self.source_rate, now))
        mine = min(2 * self.source_rate, mine + (now - mine_last) * self.source_rate)
        if len(self._source_buckets) > 4 * self.max_entries:  # forget idle sources (full again anyway)
            full = 2 / max(self.source_rate, 1e-9)
            self._source_buckets = {k: v for k, v in self._source_buckets.items() if now - v[1] < full}
        ok = tokens >= 1 and mine >= 1
        self._bucket = (tokens - ok, now)
        self._source_buckets[source] = (mine - ok, now)
        return ok

    def release(self, source: str) -> None:
        with self._lock:
            self._total -= 1
            self._pending[source] -= 1
            if self._pending[source] <= 0:
                del self._pending[source]

    def pending(self) -> int:
        return self._total

    # -- the reviews -----------------------------------------------------------------------------
    def authorize(self, header: str | None) -> User:
        """The cached verdict or a TokenReview and a SubjectAccessReview (blocking); raises
        ScrapeRefused (counted) when the scrape is refused."""
        hit = self.cached(header)
        if hit is not None:
            return hit
        token = bearer_token(header)
        now, wall_now = self.clock(), self.wall()
        try:
            self.reviews["token"] += 1
            status = self.token_review(token)
            if not status.get("authenticated"):
                verdict: User | ScrapeRefused = ScrapeRefused(
                    "unauthenticated", f"token rejected: {str(status.get('error') or 'not authenticated')[:200]}")
            else:
                user = User.from_review(status)
                self.reviews["access"] += 1
                verdict = user if self.access_review(user, VERB, self.path) else ScrapeRefused(
                    "forbidden", f"{user.username[:200]} may not {VERB} {self.path}: grant it with a ClusterRole of "
                                 f'nonResourceURLs ["{self.path}"] verbs ["{VERB}"] (docs/install.md)')
        except Exception as exc:  # the API server failed: not the caller's fault, nothing cached
            raise self.refuse(ScrapeRefused("review_failed", f"cannot review the token now ({exc}); retry")) from exc
        exp = _exp(token)
        left = float("inf") if exp is None else exp - wall_now  # the token's own life, now on the monotonic clock
        if isinstance(verdict, User):
            fresh = now + min(self.ttl, left)
            known = now + min(4 * self.ttl, left)  # a renewal keeps the reserved slots this long
        else:
            fresh = known = now + min(self.refusal_ttl, max(left, 0.0))
        with self._lock:
            self._cache[hashlib.sha256(token.encode()).digest()] = (fresh, known, verdict)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        if isinstance(verdict, ScrapeRefused):
            raise self.refuse(verdict)
        return verdict

    def __len__(self) -> int:
        return len(self._cache)

    def families(self, prefix: str, counter: Callable, gauge: Callable) -> list:
        """The authorizer's own figures as metric families, built by the caller's `counter` and
        `gauge` classes (prometheus_client's *MetricFamily): one text for the agent and the controller."""
        reviews = counter(prefix + "metrics_auth_reviews", "API reviews made for /metrics scrapes (cache "
                          "misses), by kind (token: TokenReview, access: SubjectAccessReview).", labels=["kind"])
        for kind in ("token", "access"):
            reviews.add_metric([kind], self.reviews[kind])
        refusals = counter(prefix + "metrics_auth_refusals", "/metrics scrapes refused, by reason "
                           "(missing_token, malformed_token, unauthenticated: 401; forbidden: 403; "
                           "busy: 429; review_failed: 503).", labels=["reason"])
        for reason in sorted(set(self.refusals) | {"missing_token", "unauthenticated", "forbidden", "busy"}):
            refusals.add_metric([reason], self.refusals[reason])
        cached = gauge(prefix + "metrics_auth_cache_entries", "Scrape verdicts cached (grants and refusals).",
                       value=len(self))
        return [reviews, refusals, cached]
