"""Who is calling: an agent's bound ServiceAccount token, checked by TokenReview.

Agents present a projected token (audience `netagent-controller`) that the kubelet
binds to their pod and node. The API server's TokenReview says whether it is valid, for
which audiences, and which node it is bound to (`authentication.kubernetes.io/node-name`).

Cost and abuse bounds, in the order a request meets them:
- cheap rejection, no API call: a token that is not three base64url JWT parts, is longer
  than MAX_TOKEN_BYTES, or whose (unverified) claims already say it is expired, for another
  audience or of another ServiceAccount than --agent-service-account. A forged token that
  claims the right things still goes to a TokenReview, which decides;
- a verdict cache keyed by the token's hash, bounded (LRU) and never past the token's `exp`:
  a report costs no API call in the steady state. Each verdict is fresh for a random
  (1 - TTL_SPREAD..1) x the TTL: agents that were all reviewed at once (a controller's start,
  a failover) would otherwise all be reviewed again at once every TTL, a burst of N reviews
  (1,000 in the same few seconds every minute at 1,000 nodes, docs/scale.md finding 11);
  spread, they come at ~N/TTL a second;
- the agent-pod check (`AgentPods`, once the controller's watch of the agent's own pods has
  listed them): a token's unverified `kubernetes.io` claims must name a pod (name AND uid) that
  is an agent pod bound to the claimed node and neither terminating nor finished. Any other
  token is refused here, with no review, by reason (`NotAgentPodToken`, `UnknownAgentPod`,
  `AgentPodOnOtherNode`, `AgentPodTerminating`, `AgentPodNotRunning`). Why refuse rather than
  give them a small lane of their own: the watch sees an agent pod (bound to its node, uid
  set) before the kubelet can mint that pod's token, so a real agent is never among them but
  for watch lag, which its next report outlives; any lane they could use, however small, is
  one more queue a tenant's junk fills. A tenant cannot name a live agent pod without reading
  the agent's namespace (the uid is random), and if it could, it would reach only that pod's
  own small per-pod bounds. Until the watch has listed (a new leader at takeover, or no
  --agent-service-account) every token is reviewed as before this check existed;
- uncached reviews pass a `ReviewGate` (controller/api.py): tokens of known agent pods in
  their own lane (per claimed pod a bounded rate and number pending, a bounded queue and
  pool of their own), the rest (only before that watch has listed) in the shared one: per
  client address a bounded rate and number pending, a bounded queue overall. Beyond a bound,
  a 429 at once. Junk never queues ahead of the agents;
- an outage of the API server (the review raises, it does not refuse): a token verified
  good within the last GRACE_SECONDS is still accepted, so an outage does not put the
  cluster on the floor; an unknown token gets a 503.

Time: a verdict's freshness and grace run on the monotonic clock, so a step of the wall clock
(NTP, a VM resumed) never extends a verdict. A token's `exp` is wall time: it is compared with
the wall clock at every check, and bounds the verdict's monotonic deadline when it is stored.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import random
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from kubernetes import client

from core.errors import NetagentError

NODE_CLAIM = "authentication.kubernetes.io/node-name"
POD_CLAIM = "authentication.kubernetes.io/pod-name"
AUDIENCE = "netagent-controller"
MAX_TOKEN_BYTES = 4096  # projected tokens are ~1 KiB (and aiohttp refuses headers over 8 KiB)
GRACE_SECONDS = 600.0  # a good verdict outlives its cache TTL by this much, only while the API server fails
REVIEW_TIMEOUT = (2.0, 2.5)  # (connect, read): an agent waits 3 s for its answer; a longer review is wasted
_JWT = re.compile(r"[A-Za-z0-9_-]+\.([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+")


class AuthError(NetagentError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Identity:
    username: str
    node: str
    pod: str


def identity_from_review(status: dict, audience: str | None = AUDIENCE) -> Identity:
    if not status.get("authenticated"):
        raise AuthError("Unauthenticated", f"token rejected: {status.get('error') or 'not authenticated'}")
    if audience is not None and audience not in (status.get("audiences") or []):
        # the API server authenticated the token for other audiences than the one we asked for
        raise AuthError("Unauthenticated", f"token is not for audience {audience!r}")
    user = status.get("user") or {}
    extra = user.get("extra") or {}
    node = (extra.get(NODE_CLAIM) or [""])[0]
    pod = (extra.get(POD_CLAIM) or [""])[0]
    if not node:
        raise AuthError("NotNodeBound", "token is not bound to a node (use a projected ServiceAccount token of a pod)")
    return Identity(user.get("username", ""), node, pod)


def unverified_claims(token: str) -> dict:
    """The JWT payload, not verified (only for cheap rejection and the cache's expiry after a
    review confirmed the token); AuthError when the token is not shaped like a JWT."""
    match = _JWT.fullmatch(token) if len(token) <= MAX_TOKEN_BYTES else None
    if match is None:
        raise AuthError("Unauthenticated", f"malformed bearer token (not a JWT of at most {MAX_TOKEN_BYTES} bytes)")
    payload = match.group(1)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise AuthError("Unauthenticated", "malformed bearer token (payload is not JSON)") from exc
    if not isinstance(claims, dict):
        raise AuthError("Unauthenticated", "malformed bearer token (payload is not an object)")
    return claims


@dataclass(frozen=True)
class AgentPod:
    """What the controller's watch keeps of one agent pod (controller/sources.py)."""
    node: str
    uid: str
    terminating: bool  # metadata.deletionTimestamp is set
    finished: bool  # status.phase is Succeeded or Failed


# refusals of the agent-pod check: no review was made (docs/controller.md, "Refusals")
AGENT_POD_REASONS = ("NotAgentPodToken", "UnknownAgentPod", "AgentPodOnOtherNode", "AgentPodTerminating",
                     "AgentPodNotRunning")


def claimed_pod(claims: dict) -> tuple[str, str, str, str] | None:
    """(namespace, pod name, pod uid, node name) from a projected token's unverified
    `kubernetes.io` claims; None when any of them is missing or not a string."""
    k8s = claims.get("kubernetes.io")
    if not isinstance(k8s, dict):
        return None
    pod, node = k8s.get("pod"), k8s.get("node")
    if not isinstance(pod, dict) or not isinstance(node, dict):
        return None
    found = (k8s.get("namespace"), pod.get("name"), pod.get("uid"), node.get("name"))
    return found if all(isinstance(v, str) and v for v in found) else None  # type: ignore[return-value]


def check_agent_pod(claims: dict, agent_pod: Callable[[tuple[str, str]], AgentPod | None]) -> tuple[str, str]:
    """The (namespace, name) of the live agent pod the token's claims name, or AuthError saying
    why not (a reason of AGENT_POD_REASONS). Cheap: one lookup in the watched cache."""
    found = claimed_pod(claims)
    if found is None:
        raise AuthError("NotAgentPodToken", "the token names no pod and node (the agent presents its pod's "
                                            "projected ServiceAccount token)")
    namespace, name, uid, node = found
    pod = agent_pod((namespace, name))
    if pod is None or pod.uid != uid:
        raise AuthError("UnknownAgentPod", f"the token names pod {namespace[:63]}/{name[:253]} (uid {uid[:36]}), "
                                           "which is not a running agent pod")
    if pod.node != node:
        raise AuthError("AgentPodOnOtherNode", f"the token claims node {node[:253]!r} but agent pod "
                                               f"{namespace}/{name} is on node {pod.node!r}")
    if pod.terminating:
        raise AuthError("AgentPodTerminating", f"agent pod {namespace}/{name} is terminating")
    if pod.finished:
        raise AuthError("AgentPodNotRunning", f"agent pod {namespace}/{name} has finished")
    return namespace, name


def _exp(claims: dict) -> float | None:
    exp = claims.get("exp")
    return float(exp) if isinstance(exp, (int, float)) and not isinstance(exp, bool) else None


TTL_SPREAD = 0.25  # a verdict is fresh for (1 - TTL_SPREAD..1) x the TTL, at random


class TokenAuthenticator:
    """`cached` (cheap, for the event loop) and `authenticate` (may call the API: a worker thread)."""

    def __init__(self, review: Callable[[str], dict], ttl: float = 60.0, max_entries: int = 50_000,
                 allowed_user: str | None = None, audience: str | None = AUDIENCE, grace: float = GRACE_SECONDS,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 agent_pod: Callable[[tuple[str, str]], AgentPod | None] | None = None,
                 agent_pods_synced: Callable[[], bool] = lambda: False):
        self.review = review  # token -> TokenReview status dict (API call)
        self.ttl = ttl  # the longest a verdict is reused without a review (--token-cache-seconds)
        self.rng = rng or random.Random()
        self.grace = grace
        self.max_entries = max_entries
        self.allowed_user = allowed_user  # the username the agents' tokens carry; None: any
        self.audience = audience
        self.clock = clock  # wall time: token `exp` claims are Unix times; only compared with them
        self.monotonic = monotonic  # every deadline of the cache: a wall clock's step never extends one
        # the agent-pod check (module docstring): (namespace, name) -> the watched agent pod, and
        # whether that watch has listed; until then (a new leader), every token is reviewed
        self.agent_pod = agent_pod
        self.agent_pods_synced = agent_pods_synced
        # sha256(token) -> (fresh until, good-for-grace until, verdict), monotonic; most recently used last
        self._cache: OrderedDict[bytes, tuple[float, float, Identity | AuthError]] = OrderedDict()
        self._lock = threading.Lock()
        self.reviews = 0
        self.grace_used = 0

    def _checked(self, header: str | None) -> tuple[str, dict]:
        """The token and its unverified claims, or AuthError without any API call."""
        if not header or not header.startswith("Bearer "):
            raise AuthError("Unauthenticated", "missing bearer token (Authorization: Bearer <projected token>)")
        token = header[7:].strip()
        claims = unverified_claims(token)
        exp = _exp(claims)
        if exp is not None and exp <= self.clock():
            raise AuthError("Unauthenticated", "token expired")
        if self.audience is not None:
            aud = claims.get("aud")
            if self.audience not in (aud if isinstance(aud, list) else [aud]):
                raise AuthError("Unauthenticated", f"token is not for audience {self.audience!r}")
        if self.allowed_user is not None and claims.get("sub") != self.allowed_user:
            raise AuthError("Forbidden", f"{str(claims.get('sub'))[:100]} may not report to the controller "
                                         "(only the agent's ServiceAccount may; see --agent-service-account)")
        return token, claims

    def _lookup(self, key: bytes, now: float, stale_ok: bool = False) -> Identity | AuthError | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            fresh, stale, verdict = hit
            if now < fresh or (stale_ok and isinstance(verdict, Identity) and now < stale):
                self._cache.move_to_end(key)
                return verdict
            if now >= max(fresh, stale):
                del self._cache[key]
        return None

    def triage(self, header: str | None) -> tuple[Identity | None, tuple[str, str] | None]:
        """Without any API call: (the cached verdict, None when unknown or expired; the agent pod
        the token names, whose review lane it may use, None before the agent-pod watch has
        listed). Raises AuthError for a malformed or cheaply rejected token (the agent-pod check
        included: it holds for cached verdicts too, so a terminating pod's token stops at once),
        or a cached refusal."""
        token, claims = self._checked(header)
        pod = None
        if self.agent_pod is not None and self.agent_pods_synced():
            pod = check_agent_pod(claims, self.agent_pod)
        verdict = self._lookup(hashlib.sha256(token.encode()).digest(), self.monotonic())
        if isinstance(verdict, AuthError):
            raise verdict
        return verdict, pod

    def cached(self, header: str | None) -> Identity | None:
        """The cached verdict without any API call: an Identity, None when unknown or expired;
        raises AuthError for a malformed or cheaply rejected token, or a cached refusal."""
        return self.triage(header)[0]

    def authenticate(self, header: str | None) -> Identity:
        """Cached verdict or one TokenReview (blocking: call it from a worker thread)."""
        token, claims = self._checked(header)
        key = hashlib.sha256(token.encode()).digest()
        now = self.monotonic()
        result = self._lookup(key, now)
        if result is None:
            self.reviews += 1
            try:
                status = self.review(token)
            except Exception:
                held = self._lookup(key, now, stale_ok=True)  # the API server fails: a recent good verdict holds
                if held is None:
                    raise
                if isinstance(held, AuthError):  # a refusal another thread cached meanwhile
                    raise held from None
                self.grace_used += 1
                return held
            try:
                result = identity_from_review(status, self.audience)
                if self.allowed_user is not None and result.username != self.allowed_user:
                    result = AuthError("Forbidden", f"{result.username} may not report to the controller "
                                                    "(only the agent's ServiceAccount may; see --agent-service-account)")
            except AuthError as exc:
                result = exc
            # verified now: the token's own expiry bounds every reuse, as a monotonic deadline
            exp_wall = _exp(claims)
            exp = float("inf") if exp_wall is None else now + (exp_wall - self.clock())
            if isinstance(result, Identity):
                ttl = self.ttl * (1.0 - TTL_SPREAD * self.rng.random())
                fresh, stale = min(now + ttl, exp), min(now + ttl + self.grace, exp)
            else:  # refusals are cached briefly too: a flood of one bad token is not a flood of reviews
                fresh = stale = now + min(self.ttl, 5.0)
            with self._lock:
                self._cache[key] = (fresh, stale, result)
                self._cache.move_to_end(key)
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        if isinstance(result, AuthError):
            raise result
        return result

    def __len__(self) -> int:
        return len(self._cache)


def kube_token_review(api_client, audience: str = AUDIENCE) -> Callable[[str], dict]:
    """token -> TokenReview status (one API call, bounded by REVIEW_TIMEOUT)."""
    auth = client.AuthenticationV1Api(api_client)

    def review(token: str) -> dict:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[audience]))
        resp = auth.create_token_review(body, _request_timeout=REVIEW_TIMEOUT)
        return api_client.sanitize_for_serialization(resp.status) or {}

    return review

