"""The agent's metrics listener's certificate (--metrics-auth): self-signed, made at start. Its own
module because it loads cryptography, which the agent needs only with --metrics-auth."""
from __future__ import annotations

import os
import ssl
import tempfile

from core.certs import issue_serving, new_ca


def self_signed_context(name: str, days: int = 365) -> ssl.SSLContext:
    """A server context with a fresh self-signed certificate for `name`, made at start and kept in
    memory (kubelet's and controller-runtime's default without a configured certificate): it
    encrypts, it does not prove who serves, so scrapers skip verification (the chart's monitors
    say insecureSkipVerify) and trust the endpoint Kubernetes discovered."""
    ca_cert, ca_key = new_ca(f"netagent-agent-{name}"[:64])
    cert, key = issue_serving(ca_cert, ca_key, [name], days=days)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="netagent-metrics-tls-") as tmp:  # load_cert_chain reads files
        path = os.path.join(tmp, "tls.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(key + cert + ca_cert)
        context.load_cert_chain(path)
    return context
