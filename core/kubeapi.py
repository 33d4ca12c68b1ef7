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


class KubeError(NetagentError):
    """The API server refused or could not be reached, or credentials could not be loaded; the message says which."""


def load_api_client(kubeconfig: str | None) -> client.ApiClient:
    """A client from a kubeconfig file, or from the pod's in-cluster config when `kubeconfig` is None."""
    try:
        if kubeconfig:
            return config.new_client_from_config(config_file=kubeconfig)
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    except Exception as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster config (no --kubeconfig given)"
        raise KubeError(f"cannot load {where}: {exc}") from exc
