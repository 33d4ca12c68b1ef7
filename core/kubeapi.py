"""The Kubernetes API as both processes use it: one way to load credentials, the
netagent.io API group, and the timeout every call carries.

Every call made with this client must pass `_request_timeout=TIMEOUT` (or a shorter
bound of its caller's): without it a half-open connection blocks a thread for about
fifteen minutes (the kernel's TCP retransmission limit).
"""
from __future__ import annotations

from kubernetes import client, config

from .errors import NetagentError

GROUP, VERSION = "netagent.io", "v1alpha1"
# (connect, read) seconds for single requests (reads, writes, reviews); watches set their own
TIMEOUT = (5.0, 10.0)
# connections kept to the API server per client. The kubernetes client's default is 5 per CPU of the
# host (10 on a 2-CPU node), and a request beyond the pool opens a new TLS connection and closes it after
# ("Connection pool is full, discarding connection"): at 10,000 nodes the controller's TokenReviews (up
# to 16 at once in each of its two lanes, controller/api.py) beside its informers' watches, each holding
# one, did a handshake a review. 64 covers both lanes, the watches, leases, status and quota writes,
# Events and /metrics reviews.
POOL_CONNECTIONS = 64


class KubeError(NetagentError):
    """The API server refused or could not be reached, or credentials could not be loaded; the message says which."""


def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    """A client from a kubeconfig file, or from the pod's in-cluster config when `kubeconfig` is None."""
    try:
        cfg = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
        cfg.connection_pool_maxsize = POOL_CONNECTIONS
        return client.ApiClient(cfg)
    except Exception as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster config (no --kubeconfig given)"
        raise KubeError(f"cannot load {where}: {exc}") from exc
