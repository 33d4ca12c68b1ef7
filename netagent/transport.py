"""The agent's HTTP(S) client for the controller: where its bearer token may go, and how far.

The rules (docs/agent.md, "Talking to the controller"):
  * https:// with a pinned CA (`--controller-ca`, the Secret's ca.crt): only a server holding a
    key signed by that CA is a controller. The system trust store is never used. The file is
    re-read when it changes (a rotated CA needs no agent restart).
  * http:// only with the test-only `--controller-insecure-http`, and then the token is never
    sent: a token in the clear is a token given away.
  * A redirect is followed only when it is a 307/308 (the follower pointing at the leader)
    with the configured scheme; over https the leader's certificate is verified against the
    pinned CA with server_hostname = the host of `--controller`, so the agent may connect to the
    leader's pod IP and still only talk to a holder of the controller's key. 301/302/303 are
    never followed (urllib's default handler would turn them into a GET to any host with the
    Authorization header copied; this client does not use urllib at all).
  * Every exchange has a timeout and a size limit on what is read back.
  * One connection is kept open per controller address (HTTP/1.1 keep-alive) and a new one resumes
    the last TLS session, so a report costs no handshake (issue 37: the handshake was most of the
    leader's CPU a report). A kept connection the controller closed while idle is found on the next
    use and the report is sent once more on a new connection: a report replaces the node's last one
    (level-triggered), so a repeat changes nothing. A rotated CA drops kept connections and sessions.
"""
from __future__ import annotations

import http.client
import logging
import math
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

from core.errors import NetagentError
from core.wire import ErrorBody

log = logging.getLogger(__name__)

MAX_REDIRECTS = 3
FOLLOWED_REDIRECTS = (307, 308)  # keep method and body; everything else (301/302/303) is refused
MAX_ERROR_DETAIL = 300
MAX_RETRY_AFTER = 60.0  # the longest Retry-After honoured: well inside any lease (default 120 s)
error_decoder = msgspec.json.Decoder(ErrorBody)


class ControllerError(NetagentError):
    """The controller could not be reached (status None) or refused the report; the message says which."""

    def __init__(self, message: str, status: int | None = None, reason: str = "", retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason  # the refusal's reason (core.wire.ErrorBody), "" when there was none
        self.retry_after = retry_after  # seconds the controller asked us to wait (Retry-After), bounded


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds (the HTTP-date form is not used by the controller), bounded
    to MAX_RETRY_AFTER so a wrong value cannot silence the agent past its lease; None when absent
    or not a number."""
    try:
        seconds = float(value) if value is not None else float("nan")
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RETRY_AFTER)


def refusal_reason(data: bytes) -> str:
    """The `reason` of a refusal's JSON body (core.wire.ErrorBody), "" when it has none."""
    try:
        return error_decoder.decode(data).reason
    except (msgspec.ValidationError, msgspec.DecodeError):
        return ""


@dataclass(frozen=True)
class Endpoint:
    scheme: str  # "https" or "http"
    host: str
    port: int

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_endpoint(url: str, what: str = "--controller") -> tuple[Endpoint, str]:
    """(endpoint, path prefix) of an http(s) URL; ValueError naming `what` when it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{what} {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"{what} {url!r} must be https://HOST[:PORT] (or http:// for tests)")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"{what} {url!r} must not carry credentials, a query or a fragment")
    return Endpoint(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)), \
        parts.path.rstrip("/")


class PinnedCA:
    """An SSL client context trusting exactly the CA in one file, rebuilt when the file changes.

    A file that cannot be loaded (half-written during a rotation) keeps the previous context
    and is tried again on the next use; with no good context ever, every use raises."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple | None = None
        self._context: ssl.SSLContext | None = None
        self._error = ""
        self._lock = threading.Lock()

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                st = os.stat(self.path)
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError as exc:
                stamp, self._error = None, f"cannot read the controller CA {self.path}: {exc.strerror}"
            if stamp is not None and stamp != self._stamp:
                try:
                    self._context = self.load(self.path)
                    self._stamp, self._error = stamp, ""
                    log.info("controller CA loaded from %s", self.path)
                except (OSError, ssl.SSLError, ValueError) as exc:
                    self._error = f"the controller CA {self.path} does not load: {exc}"
                    log.warning("%s (keeping the previous one)" if self._context else "%s", self._error)
            if self._context is None:
                raise ControllerError(self._error or f"no controller CA loaded from {self.path}")
            return self._context

    @staticmethod
    def load(path: str) -> ssl.SSLContext:
        """The context: TLS >= 1.2, certificate and host name verified, only this CA trusted."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cafile=path)  # no load_default_certs(): the system store is not trusted
        if not ctx.get_ca_certs():
            raise ValueError("no CA certificate in the file")
        return ctx


class _PinnedHTTPSConnection(http.client.HTTPConnection):
    """HTTPS to (host, port) with the certificate checked for `server_hostname`, which may differ
    from the address connected to (the leader's pod IP while the certificate names the Service)."""

    default_port = 443

    def __init__(self, host: str, port: int, *, context: ssl.SSLContext, server_hostname: str, timeout: float,
                 session: ssl.SSLSession | None = None):
        super().__init__(host, port, timeout=timeout)
        self._ctx, self._sni, self._session = context, server_hostname, session

    def connect(self) -> None:
        super().connect()
        self.sock = self._ctx.wrap_socket(self.sock, server_hostname=self._sni, session=self._session)

    def tls_session(self) -> ssl.SSLSession | None:
        """The TLS session to resume next time (TLS 1.3 sends its ticket after the handshake, so
        this is read after an answer), None when there is none."""
        sock = self.sock
        return sock.session if isinstance(sock, ssl.SSLSocket) else None


# A kept connection the controller closed while idle shows as one of these on its next use
STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
KEPT_ADDRESSES = 2  # the Service's address and the leader's a redirect led to


@dataclass
class _Kept:
    conn: http.client.HTTPConnection
    context: ssl.SSLContext | None  # the pinned CA's context it was verified with


class ControllerClient:
    """POSTs to the controller under the rules of this module's docstring."""

    def __init__(self, url: str, ca_file: str | None, insecure_http: bool = False, timeout: float = 3.0,
                 max_answer_bytes: int = 4 << 20, keep_alive: bool = True):
        self.endpoint, self.prefix = parse_endpoint(url)
        if self.endpoint.scheme == "https" and not ca_file:
            raise ValueError("an https controller needs its CA (--controller-ca)")
        if self.endpoint.scheme == "http" and not insecure_http:
            raise ValueError("a plain-http controller needs --controller-insecure-http (tests only)")
        self.ca = PinnedCA(ca_file) if self.endpoint.scheme == "https" else None
        self.timeout = timeout
        self.max_answer_bytes = max_answer_bytes
        self.keep_alive = keep_alive
        self._lock = threading.Lock()  # one exchange at a time over the kept connections
        self._kept: dict[Endpoint, _Kept] = {}  # insertion order = least recently used first
        self._sessions: dict[Endpoint, tuple[ssl.SSLContext, ssl.SSLSession]] = {}
        self.connections_opened = 0  # new TCP (and TLS) connections, for tests and the agent's metrics
        self.sessions_resumed = 0  # of those, how many resumed a TLS session (an abbreviated handshake)

    @property
    def url(self) -> str:
        return self.endpoint.base + self.prefix

    def may_send_token(self) -> bool:
        return self.endpoint.scheme == "https"

    def _connection(self, target: Endpoint) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection to `target`, whether it was kept from an earlier exchange). A kept one made
        under another CA context than today's (a rotation) is closed, with the TLS sessions."""
        context = self.ca.context() if target.scheme == "https" else None
        kept = self._kept.pop(target, None)
        if kept is not None:
            if kept.context is context:
                return kept.conn, True
            kept.conn.close()
        self.connections_opened += 1
        if context is None:
            return http.client.HTTPConnection(target.host, target.port, timeout=self.timeout), False
        remembered = self._sessions.get(target)
        session = remembered[1] if remembered is not None and remembered[0] is context else None
        return _PinnedHTTPSConnection(target.host, target.port, context=context, server_hostname=self.endpoint.host,
                                      timeout=self.timeout, session=session), False

    def _keep(self, target: Endpoint, conn: http.client.HTTPConnection) -> None:
        """Keep `conn` for the next exchange with `target` (and its TLS session for a new one)."""
        if isinstance(conn, _PinnedHTTPSConnection):
            session = conn.tls_session()
            if session is not None:
                self._sessions[target] = (conn._ctx, session)
        if not self.keep_alive:
            conn.close()
            return
        self._kept[target] = _Kept(conn, conn._ctx if isinstance(conn, _PinnedHTTPSConnection) else None)
        while len(self._kept) > KEPT_ADDRESSES:
            self._kept.pop(next(iter(self._kept))).conn.close()
        while len(self._sessions) > KEPT_ADDRESSES:
            self._sessions.pop(next(iter(self._sessions)))

    def close(self) -> None:
        """Close the kept connections (the agent's shutdown)."""
        with self._lock:
            for kept in self._kept.values():
                kept.conn.close()
            self._kept.clear()

    def redirect_target(self, code: int, location: str | None, current: Endpoint) -> tuple[Endpoint, str]:
        """Where a redirect may be followed to, or ControllerError: only 307/308 with a Location in
        the configured scheme (an https client never falls back to http)."""
        if code not in FOLLOWED_REDIRECTS:
            raise ControllerError(f"controller {current.base} answered {code} (a redirect that keeps no method; "
                                  f"not followed)", code)
        if not location:
            raise ControllerError(f"controller {current.base} answered {code} without a Location", code)
        try:
            target, path = parse_endpoint(location, "redirect Location")
        except ValueError as exc:
            raise ControllerError(f"controller {current.base} redirected to an unusable place: {exc}", code) from None
        if target.scheme != self.endpoint.scheme:
            raise ControllerError(f"controller {current.base} redirected from {self.endpoint.scheme} to "
                                  f"{target.scheme} ({location}); not followed", code)
        return target, path

    def post(self, path: str, body: bytes, token: str | None, base: str | None = None) -> tuple[bytes, str | None]:
        """POST `body` to `base` (default: the configured URL) + `path`; (answer bytes, the base
        URL a redirect led to, or None). Raises ControllerError."""
        target, prefix = parse_endpoint(base) if base else (self.endpoint, self.prefix)
        url_path = prefix + path
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if not self.keep_alive:
            headers["Connection"] = "close"
        if token and self.may_send_token():
            headers["Authorization"] = "Bearer " + token
        redirected: str | None = None
        for _ in range(MAX_REDIRECTS + 1):
            status, location, data, retry_after = self._once(target, url_path, body, headers)
            if status == 200:
                return data, redirected
            if 300 <= status < 400:
                target, new_path = self.redirect_target(status, location, target)
                url_path = new_path or url_path
                suffix = "/v1/"
                redirected = target.base + (new_path.split(suffix, 1)[0] if suffix in new_path else "")
                continue
            detail = data[:MAX_ERROR_DETAIL].decode(errors="replace")
            raise ControllerError(f"controller {target.base} answered {status}: {detail}", status,
                                  refusal_reason(data), retry_after_seconds(retry_after))
        raise ControllerError(f"controller redirected more than {MAX_REDIRECTS} times (last: {target.base})")

    def _once(self, target: Endpoint, path: str, body: bytes,
              headers: dict) -> tuple[int, str | None, bytes, str | None]:
        with self._lock:
            return self._exchange(target, path, body, headers)

    def _exchange(self, target: Endpoint, path: str, body: bytes,
                  headers: dict) -> tuple[int, str | None, bytes, str | None]:
        conn, kept = self._connection(target)
        deadline = time.monotonic() + self.timeout * 2  # the whole exchange, not only each socket read
        reusable = False
        try:
            try:
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
            except STALE_CONNECTION:
                if not kept:
                    raise
                conn.close()  # closed by the controller while idle: once more on a new connection
                conn, kept = self._connection(target)
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
            if not kept and isinstance(conn.sock, ssl.SSLSocket) and conn.sock.session_reused:
                self.sessions_resumed += 1
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_answer_bytes:
                raise ControllerError(f"controller {target.base} announced {length} bytes (limit "
                                      f"{self.max_answer_bytes}); answer refused", resp.status)
            data = bytearray()
            while len(data) <= self.max_answer_bytes:
                chunk = resp.read(min(65536, self.max_answer_bytes + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
                if time.monotonic() > deadline:
                    raise ControllerError(f"controller {target.base} took longer than {self.timeout * 2:.0f} s "
                                          f"to answer; answer refused")
            if len(data) > self.max_answer_bytes:
                raise ControllerError(f"controller {target.base} answered more than {self.max_answer_bytes} "
                                      f"bytes; answer refused", resp.status)
            reusable = resp.isclosed() and not resp.will_close  # read to its end, and the server keeps it open
            return resp.status, resp.getheader("Location"), bytes(data), resp.getheader("Retry-After")
        except ssl.SSLCertVerificationError as exc:
            raise ControllerError(f"controller {target.base} is not a controller: its certificate does not verify "
                                  f"against the pinned CA for {self.endpoint.host!r} ({exc.verify_message}); "
                                  f"nothing was sent") from None
        except (ssl.SSLError, http.client.HTTPException, OSError, socket.timeout) as exc:
            raise ControllerError(f"controller {target.base} unreachable: {exc.__class__.__name__}: {exc}") from exc
        finally:
            if reusable:
                self._keep(target, conn)
            else:
                conn.close()
