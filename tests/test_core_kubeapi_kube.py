"""core/kubeapi.load_api_client against the real kube-apiserver (tests/kube.py): the controller's concurrent
TokenReviews (both review lanes' threads at once, controller/api.py) and its informers' watches share one
client, and every request finds a kept connection. The kubernetes client's own pool is 5 per CPU (10 on a
2-CPU node); beyond it each request opened a new TLS connection and closed it after (urllib3: "Connection pool
is full, discarding connection"), 1,140 times in nine minutes on the leader of a 10,000-node run."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from controller.api import MAX_REVIEWS_IN_FLIGHT
from controller.auth import kube_token_review
from core.kubeapi import POOL_CONNECTIONS, load_api_client

WATCHES = 8  # the controller's informers (pods, namespaces, classes, budgets, scopes, ...), each holds one


def test_concurrent_reviews_keep_their_connections(kube_api, caplog):
    callers = 2 * MAX_REVIEWS_IN_FLIGHT + WATCHES
    assert POOL_CONNECTIONS >= callers
    api = load_api_client(str(kube_api.kubeconfig))
    assert api.configuration.connection_pool_maxsize == POOL_CONNECTIONS
    review = kube_token_review(api)
    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"), ThreadPoolExecutor(callers) as pool:
        for _ in range(3):
            answers = list(pool.map(review, [f"not-a-token-{i}" for i in range(callers)]))
    assert all(a.get("authenticated") is not True for a in answers)  # the API server answered each, and refused
    full = [r.getMessage() for r in caplog.records if "pool is full" in r.getMessage()]
    assert not full, f"{len(full)} requests opened a connection beyond the pool: {full[:2]}"
