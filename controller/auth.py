"""Who is calling: an agent's bound ServiceAccount token, checked by TokenReview.

Agents present a projected token (audience `netagent-controller`) that the kubelet
binds to their pod and node. The API server's TokenReview says whether it is valid
and which node it is bound to (`authentication.kubernetes.io/node-name`). Results are
cached by token hash for a short time so a report costs no API call in the steady
state (2,000 reports/s would otherwise be 2,000 TokenReviews/s).
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kubernetes import client

from core.errors import NetagentError
from core.kubeapi import TIMEOUT

from .config import service_account_username

NODE_CLAIM = "authentication.kubernetes.io/node-name"
POD_CLAIM = "authentication.kubernetes.io/pod-name"
AUDIENCE = "netagent-controller"


class AuthError(NetagentError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Identity:
    username: str
    node: str
    pod: str


def identity_from_review(status: dict) -> Identity:
    if not status.get("authenticated"):
        raise AuthError("Unauthenticated", f"token rejected: {status.get('error') or 'not authenticated'}")
    user = status.get("user") or {}
    extra = user.get("extra") or {}
    node = (extra.get(NODE_CLAIM) or [""])[0]
    pod = (extra.get(POD_CLAIM) or [""])[0]
    if not node:
        raise AuthError("NotNodeBound", "token is not bound to a node (use a projected ServiceAccount token of a pod)")
    return Identity(user.get("username", ""), node, pod)


class TokenAuthenticator:
    def __init__(self, review: Callable[[str], dict], ttl: float = 60.0, max_entries: int = 50_000,
                 allowed_users: Callable[[str], bool] | None = None):
        self.review = review  # token -> TokenReview status dict (API call)
        self.ttl = ttl
        self.max_entries = max_entries
        self.allowed_users = allowed_users or (lambda u: True)
        self._cache: dict[bytes, tuple[float, Identity | AuthError]] = {}
        self._lock = threading.Lock()
        self.reviews = 0

    @staticmethod
    def _token(header: str | None) -> str:
        if not header or not header.startswith("Bearer "):
            raise AuthError("Unauthenticated", "missing bearer token (Authorization: Bearer <projected token>)")
        token = header[7:].strip()
        if not token or len(token) > 16384:
            raise AuthError("Unauthenticated", "malformed bearer token")
        return token

    def cached(self, header: str | None) -> Identity | None:
        """The cached verdict without any API call: an Identity, None when unknown or
        expired; raises AuthError for a malformed header or a cached refusal. Cheap
        enough for the event loop, so steady-state reports never touch a thread pool."""
        key = hashlib.sha256(self._token(header).encode()).digest()
        hit = self._cache.get(key)
        if hit is None or hit[0] <= time.monotonic():
            return None
        if isinstance(hit[1], AuthError):
            raise hit[1]
        return hit[1]

    def authenticate(self, header: str | None) -> Identity:
        """Cached verdict or one TokenReview (blocking: call it from a worker thread)."""
        token = self._token(header)
        key = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit and hit[0] > now:
            result = hit[1]
        else:
            self.reviews += 1
            try:
                result = identity_from_review(self.review(token))
                if not self.allowed_users(result.username):
                    result = AuthError("Forbidden", f"{result.username} may not report to the controller "
                                                    "(only the agent's ServiceAccount may; see --agent-service-account)")
            except AuthError as exc:
                result = exc
            # failures are cached briefly too: a flood of bad tokens must not become a flood of reviews
            ttl = self.ttl if isinstance(result, Identity) else min(self.ttl, 5.0)
            with self._lock:
                if len(self._cache) >= self.max_entries:
                    self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                    if len(self._cache) >= self.max_entries:
                        self._cache.clear()
                self._cache[key] = (now + ttl, result)
        if isinstance(result, AuthError):
            raise result
        return result


def service_account_user(spec: str) -> Callable[[str], bool]:
    """`namespace:name` -> a check that the token belongs to that ServiceAccount."""
    expected = service_account_username(spec)
    return lambda username: username == expected


def kube_token_review(api_client, audience: str = AUDIENCE) -> Callable[[str], dict]:
    """token -> TokenReview status (one API call, bounded by TIMEOUT)."""
    auth = client.AuthenticationV1Api(api_client)

    def review(token: str) -> dict:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[audience]))
        resp = auth.create_token_review(body, _request_timeout=TIMEOUT)
        return api_client.sanitize_for_serialization(resp.status) or {}

    return review
