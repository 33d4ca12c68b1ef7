"""The API calls of core/scrapeauth.py: a TokenReview and a SubjectAccessReview with the
kubernetes client (the ServiceAccount needs `create` on tokenreviews and subjectaccessreviews:
the chart's and deploy/'s ClusterRoles grant them). Kept apart from the pure module so the
agent in single-machine mode never loads the kubernetes client (tests/test_layers.py)."""
from __future__ import annotations

from typing import Callable

from kubernetes import client

from .scrapeauth import User

REVIEW_TIMEOUT = (2.0, 3.0)  # (connect, read): a scrape waits for it; Prometheus' timeout is ~10 s


def token_review(api_client) -> Callable[[str], dict]:
    """token -> TokenReview status (the API server's own audiences: a pod's default token)."""
    auth = client.AuthenticationV1Api(api_client)

    def review(token: str) -> dict:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token))
        resp = auth.create_token_review(body, _request_timeout=REVIEW_TIMEOUT)
        return api_client.sanitize_for_serialization(resp.status) or {}

    return review


def access_review(api_client) -> Callable[[User, str, str], bool]:
    """(user, verb, nonResourceURL) -> allowed, by a SubjectAccessReview."""
    authz = client.AuthorizationV1Api(api_client)

    def review(user: User, verb: str, path: str) -> bool:
        body = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=user.username, uid=user.uid or None, groups=list(user.groups) or None,
            extra={k: list(v) for k, v in user.extra} or None,
            non_resource_attributes=client.V1NonResourceAttributes(path=path, verb=verb)))
        resp = authz.create_subject_access_review(body, _request_timeout=REVIEW_TIMEOUT)
        return bool(resp.status and resp.status.allowed)

    return review
