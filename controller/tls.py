"""The controller's serving certificate: where it comes from, and reloading it without a restart.

Sources (the TLS contract, docs/controller.md "TLS"):
- `SecretTLS`: the Secret --tls-secret in the controller's namespace (keys ca.crt, ca.key,
  tls.crt, tls.key). With --tls-manage (default) the controller creates it when missing (a new
  CA and a serving certificate for --tls-dns-names) and reissues the serving certificate under
  the same CA when `core.certs.needs_renewal` says so; two replicas racing to create or renew
  it are resolved by the API server (409 -> read again and use the winner's). Without
  --tls-manage (cert-manager owns the Secret) it only reads it.
- `FileTLS`: --tls-cert-file/--tls-key-file (file mode, no cluster), re-read on change.

`ServingTLS` holds the one `ssl.SSLContext` the server listens with and loads a changed
certificate chain into that same context (OpenSSL uses the context's current certificate for
every new handshake), so a renewal or a cert-manager rotation is served without a restart and
without dropping connections.
"""
from __future__ import annotations

import base64
import logging
import os
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Callable, Protocol

from kubernetes import client
from kubernetes.client.rest import ApiException

from core import certs
from core.kubeapi import TIMEOUT, KubeError

log = logging.getLogger(__name__)


class TLSSource(Protocol):
    def load(self) -> tuple[bytes, bytes]:
        """(certificate chain PEM, key PEM) to serve now; raises when there is none."""


class FileTLS:
    def __init__(self, cert_file: str, key_file: str):
        self.cert_file, self.key_file = cert_file, key_file

    def load(self) -> tuple[bytes, bytes]:
        return Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes()


def _decoded(secret) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def _encoded(data: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in data.items()}


class SecretTLS:
    def __init__(self, api_client, namespace: str, name: str, dns_names: tuple[str, ...], manage: bool,
                 on_change: Callable[[str], None] = lambda what: None):
        self.core = client.CoreV1Api(api_client)
        self.namespace, self.name, self.dns_names, self.manage = namespace, name, dns_names, manage
        self.on_change = on_change  # "created", "renewed": for the log and metrics

    def _where(self) -> str:
        return f"Secret {self.namespace}/{self.name}"

    def load(self) -> tuple[bytes, bytes]:
        for _ in range(3):  # a 409 means another replica wrote first: read again and use its result
            try:
                secret = self.core.read_namespaced_secret(self.name, self.namespace, _request_timeout=TIMEOUT)
            except ApiException as exc:
                if exc.status != 404:
                    raise KubeError(f"cannot read {self._where()}: {exc.status} {exc.reason}") from exc
                if not self.manage:
                    raise KubeError(f"{self._where()} does not exist (--tls-manage=false: cert-manager or the "
                                    "installer must create it)") from exc
                bundle = certs.new_bundle(self.dns_names)
                body = client.V1Secret(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace,
                                                                    labels={"app.kubernetes.io/name": "netagent"}),
                                       type="Opaque", data=_encoded(bundle.as_dict()))
                try:
                    self.core.create_namespaced_secret(self.namespace, body, _request_timeout=TIMEOUT)
                except ApiException as exc2:
                    if exc2.status == 409:
                        continue
                    raise KubeError(f"cannot create {self._where()}: {exc2.status} {exc2.reason}") from exc2
                log.info("created %s: a new CA and a serving certificate for %s", self._where(),
                         ", ".join(self.dns_names))
                self.on_change("created")
                return bundle.tls_cert, bundle.tls_key
            data = _decoded(secret)
            crt, key, ca = data.get(certs.TLS_CERT), data.get(certs.TLS_KEY), data.get(certs.CA_CERT)
            if not self.manage:
                if not crt or not key:
                    raise KubeError(f"{self._where()} has no {certs.TLS_CERT}/{certs.TLS_KEY}")
                return crt, key
            if not ca or not data.get(certs.CA_KEY):
                raise KubeError(f"{self._where()} has no {certs.CA_CERT}/{certs.CA_KEY} to sign with "
                                "(managed by cert-manager? then run with --tls-manage=false)")
            why = certs.needs_renewal(crt, ca, self.dns_names) if crt and key else "no serving certificate"
            if why is None:
                return crt, key
            crt, key = certs.issue_serving(ca, data[certs.CA_KEY], self.dns_names)
            secret.data = _encoded({**data, certs.TLS_CERT: crt, certs.TLS_KEY: key})
            try:  # carries the resourceVersion read: of two replicas renewing at once, one wins
                self.core.replace_namespaced_secret(self.name, self.namespace, secret, _request_timeout=TIMEOUT)
            except ApiException as exc:
                if exc.status == 409:
                    continue
                raise KubeError(f"cannot renew {self._where()}: {exc.status} {exc.reason}") from exc
            log.info("renewed the serving certificate in %s (%s)", self._where(), why)
            self.on_change("renewed")
            return crt, key
        raise KubeError(f"{self._where()} kept changing while we tried to create or renew it")


def server_context() -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class ServingTLS:
    """The server's SSLContext, kept loaded with the source's current certificate."""

    def __init__(self, source: TLSSource, interval: float = 60.0):
        self.source = source
        self.interval = interval
        self.context = server_context()
        self.loaded: tuple[bytes, bytes] | None = None
        self.last_error = ""
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="tls-reload", daemon=True)

    def refresh(self) -> bool:
        """Load the source's certificate into the context if it changed; True when it did.
        Raises when the source has none (at start); later failures keep the current one."""
        pair = self.source.load()
        if pair == self.loaded:
            return False
        with tempfile.TemporaryDirectory(prefix="netagent-tls-") as tmp:  # load_cert_chain reads files
            cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pair[1])
            cert.write_bytes(pair[0])
            self.context.load_cert_chain(cert, key)
        reloading = self.loaded is not None
        self.loaded = pair
        if reloading:
            log.info("serving a new certificate (valid for %s)", ", ".join(sorted(certs.names_of(pair[0])[0])))
        return True

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
                self.last_error = ""
            except Exception as exc:  # keep serving the certificate we have; say so once
                if str(exc) != self.last_error:
                    log.warning("TLS: cannot refresh the serving certificate (%s); serving the current one", exc)
                self.last_error = str(exc)
