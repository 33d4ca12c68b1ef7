"""The agent's HTTP endpoints: /metrics, /healthz and /readyz on --listen (for Prometheus and the
kubelet's probes), /state (the node's pod inventory) on a loopback listener only.

A bounded server, because on hostNetwork --listen is reachable from every pod of the node:
  * one selector thread accepts and reads every connection, so idle or slow clients cost a
    file descriptor each, never a thread; at most MAX_CONNECTIONS are kept (the oldest one
    waiting for its request is closed to make room), each for at most READ_TIMEOUT_S before
    its request is complete, and a request head is at most MAX_REQUEST_BYTES;
  * /healthz and /readyz are answered on that thread (they read two fields: no lock, no I/O),
    so a probe is answered however many clients wait;
  * /metrics and /state, which read kernel counters, run on WORKERS threads from a bounded
    queue (full: 503 at once). Neither takes the sync loop's lock: they read what the sync
    published and the counters as the data path serves them.
One request per connection (Connection: close), GET and HEAD only, no request body.

With an `authorizer` (core/scrapeauth.py: Kubernetes mode on a non-loopback --listen, the
default), /metrics needs a bearer token a TokenReview and a SubjectAccessReview (`get` on the
nonResourceURL /metrics) accept, as kubelet's and controller-runtime's secure metrics do: no or a
malformed token 401, a token without the grant 403, both answered on the selector thread from the
cache; an unknown token waits for one of REVIEWERS threads only when the authorizer admits it
(bounded per client address and overall: 429 beyond), so junk never holds a /metrics worker. The
listener then serves TLS (`tls`: the agent's self-signed certificate, as kubelet's): a token never
travels in the clear. /healthz and /readyz stay open for the kubelet's probes (over the same TLS).
"""
from __future__ import annotations

import json
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, cast

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.address import is_loopback, join_host_port
from core.scrapeauth import ScrapeAuthorizer, ScrapeRefused

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 128
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
WORKERS = 2
WORK_QUEUE = 8
REVIEWERS = 2  # threads for the token reviews of /metrics (the authorizer bounds what waits for them)
TEXT = "text/plain; charset=utf-8"
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}


def response(code: int, body: bytes, ctype: str = TEXT, head: bool = False, extra: str = "") -> bytes:
    header = (f"HTTP/1.1 {code} {REASONS.get(code, 'Error')}\r\nContent-Type: {ctype}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\nCache-Control: no-store\r\n{extra}\r\n")
    return header.encode() + (b"" if head else body)


def refusal(exc: ScrapeRefused, head: bool = False) -> bytes:
    extra = 'WWW-Authenticate: Bearer realm="netagent"\r\n' if exc.status == 401 else (
        "Retry-After: 1\r\n" if exc.status in (429, 503) else "")
    return response(exc.status, f"{exc.reason}: {exc}\n".encode(), head=head, extra=extra)


def header_value(head: bytes, name: str) -> str | None:
    """One header's value from a request head (the first of that name), None when absent."""
    want = name.lower().encode() + b":"
    for line in head.split(b"\r\n")[1:]:
        if line[:len(want)].lower() == want:
            return line[len(want):].strip().decode("latin-1")
    return None


class ScrapeAuthCollector(Collector):
    """The authorizer's own figures: reviews made, refusals by reason, verdicts cached."""

    def __init__(self, authorizer: ScrapeAuthorizer, prefix: str = "netagent_"):
        self.authorizer, self.prefix = authorizer, prefix

    def collect(self):
        yield from self.authorizer.families(self.prefix, CounterMetricFamily, GaugeMetricFamily)


def parse_request(head: bytes) -> tuple[str, str] | None:
    """(method, path without the query) of a request head, None when it is not HTTP."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    return parts[0], parts[1].split("?", 1)[0]


@dataclass
class _Conn:
    sock: socket.socket
    listener: "_Listener"
    opened: float
    buf: bytearray = field(default_factory=bytearray)
    peer: str = ""
    handshaken: bool = False


@dataclass
class _Listener:
    sock: socket.socket
    paths: frozenset[str]
    address: str
    tls: ssl.SSLContext | None = None


class AgentHTTP:
    def __init__(self, listen: tuple[str, int], registry, health: Callable[[], tuple[bool, str]],
                 ready: Callable[[], tuple[bool, str]], state: Callable[[], dict],
                 state_listen: tuple[str, int] | None = None, on_rejected: Callable[[str], None] | None = None,
                 exposition: Callable[[], bytes] | None = None, authorizer: ScrapeAuthorizer | None = None,
                 tls: ssl.SSLContext | None = None):
        """`state_listen`: a loopback address for /state; None when `listen` is itself loopback (it
        serves /state then) or /state is not served at all. `exposition`: what /metrics answers
        (the agent's fast rendering of `registry`); `generate_latest(registry)` without it.
        `authorizer`: who may read /metrics (None: anyone who reaches `listen`); `tls`: the server
        context `listen` serves (the /state listener stays plain: loopback only)."""
        self.registry, self.health, self.ready, self.state = registry, health, ready, state
        self.exposition = exposition or (lambda: generate_latest(self.registry))
        self.on_rejected = on_rejected or (lambda reason: None)
        probes = {"/healthz", "/readyz"}
        main_paths = probes | {"/metrics"} | ({"/state"} if is_loopback(listen[0]) else set())
        self.authorizer = authorizer
        self.listeners = [self._listen(listen, frozenset(main_paths))]
        self.listeners[0].tls = tls
        if state_listen is not None:
            try:
                self.listeners.append(self._listen(state_listen, frozenset(probes | {"/state"})))
            except OSError:
                self.listeners[0].sock.close()
                raise
        self.address = self.listeners[0].address
        self.state_address = next((l.address for l in self.listeners if "/state" in l.paths), None)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[int, _Conn] = {}  # fd -> connection still reading its request
        self._work: queue.Queue = queue.Queue(maxsize=WORK_QUEUE)
        self._reviews: queue.Queue = queue.Queue()  # bounded by the authorizer's admission
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._serve, name="http", daemon=True)]
        self.threads += [threading.Thread(target=self._worker, name=f"http-worker-{i}", daemon=True)
                         for i in range(WORKERS)]
        if authorizer is not None:
            self.threads += [threading.Thread(target=self._reviewer, name=f"http-review-{i}", daemon=True)
                             for i in range(REVIEWERS)]

    @staticmethod
    def _listen(where: tuple[str, int], paths: frozenset[str]) -> _Listener:
        host, port = where
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot listen on {join_host_port(host, port)}: {exc.strerror}") from exc
        return _Listener(sock, paths, join_host_port(host, sock.getsockname()[1]))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for l in self.listeners:
            self._sel.register(l.sock, selectors.EVENT_READ, l)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        for _ in range(WORKERS):
            try:
                self._work.put_nowait(None)
            except queue.Full:
                pass
        for _ in range(REVIEWERS):
            self._reviews.put(None)
        for t in self.threads:
            if t.is_alive():
                t.join(5)
        for l in self.listeners:
            l.sock.close()
        for c in list(self._conns.values()):
            c.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def connections(self) -> int:
        """Connections waiting for their request (tests and the bench read it)."""
        return len(self._conns)

    # -- the selector thread --------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    self._wake_r.recv(64)
                elif isinstance(key.data, _Listener):
                    self._accept(key.data)
                else:
                    self._read(key.data)
            self._expire(time.monotonic())

    def _accept(self, listener: _Listener) -> None:
        for _ in range(64):  # a burst per turn; the rest on the next
            try:
                sock, _ = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: stop accepting this turn
                log.warning("http: accept failed: %s", exc)
                return
            sock.setblocking(False)
            try:
                peer = sock.getpeername()[0]
            except OSError:
                peer = ""
            if listener.tls is not None:  # the handshake runs on this thread, step by step, in _read
                sock = listener.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            if len(self._conns) >= MAX_CONNECTIONS:
                oldest = min(self._conns.values(), key=lambda c: c.opened)
                self._close(oldest, "too_many_connections")
            conn = _Conn(sock, listener, time.monotonic(), peer=peer)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn: _Conn, reason: str | None = None) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if reason:
            self.on_rejected(reason)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if now - c.opened > READ_TIMEOUT_S]:
            self._close(conn, "read_timeout")

    def _read(self, conn: _Conn) -> None:
        tls_sock = cast(ssl.SSLSocket, conn.sock)  # what it is whenever the listener has TLS
        if conn.listener.tls is not None and not conn.handshaken:
            try:
                tls_sock.do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:  # not TLS (a plain-http client), or a bad handshake
                self._close(conn, "tls_handshake")
                return
            conn.handshaken = True
        try:
            data = conn.sock.recv(4096)
            while conn.listener.tls is not None and data and tls_sock.pending():  # decrypted, not on the fd
                data += conn.sock.recv(tls_sock.pending())
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.buf += data
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.buf) > MAX_REQUEST_BYTES:
                self._reply_inline(conn, response(431, b"request head too large\n"), "too_large")
            return
        request = parse_request(bytes(conn.buf[:end]))
        if request is None:
            self._reply_inline(conn, response(400, b"not an HTTP request\n"), "bad_request")
            return
        method, path = request
        head = method == "HEAD"
        if method not in ("GET", "HEAD"):
            self._reply_inline(conn, response(405, b"GET only\n"), "bad_method")
        elif path not in conn.listener.paths:
            hint = " ".join(sorted(conn.listener.paths))
            self._reply_inline(conn, response(404, f"not found: try {hint}\n".encode(), head=head))
        elif path in ("/healthz", "/readyz"):
            ok, why = (self.health if path == "/healthz" else self.ready)()
            body = (why or ("ok" if ok else "not ready")).encode() + b"\n"
            self._reply_inline(conn, response(200 if ok else 503, body, head=head))
        elif path == "/metrics" and self.authorizer is not None:
            self._authorize(conn, header_value(bytes(conn.buf[:end]), "Authorization"), head)
        else:
            self._enqueue(conn, path, head)

    def _enqueue(self, conn: _Conn, path: str, head: bool) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        self._sel.unregister(conn.sock)
        try:
            self._work.put_nowait((conn.sock, path, head))
        except queue.Full:
            self.on_rejected("busy")
            self._send_and_close(conn.sock, response(503, b"busy: try again\n"), blocking=False)

    def _authorize(self, conn: _Conn, header: str | None, head: bool) -> None:
        """A cached verdict at once; an unknown token to a reviewer if the authorizer admits it."""
        try:
            user = self.authorizer.cached(header)
        except ScrapeRefused as exc:
            self._reply_inline(conn, refusal(exc, head))
            return
        if user is not None:
            self._enqueue(conn, "/metrics", head)
        elif not self.authorizer.admit(conn.peer, header):
            self._reply_inline(conn, refusal(ScrapeRefused("busy", "too many tokens under review; retry"), head))
        else:
            self._conns.pop(conn.sock.fileno(), None)
            self._sel.unregister(conn.sock)
            self._reviews.put((conn.sock, header, head, conn.peer))

    def _reviewer(self) -> None:
        while (item := self._reviews.get()) is not None:
            sock, header, head, peer = item
            try:
                self.authorizer.authorize(header)
            except ScrapeRefused as exc:
                self._send_and_close(sock, refusal(exc, head))
                continue
            except Exception as exc:  # a bug of ours: this scrape fails, the server keeps serving
                log.exception("http: scrape review failed")
                self._send_and_close(sock, response(500, f"error: {exc}\n".encode()))
                continue
            finally:
                self.authorizer.release(peer)
            try:
                self._work.put_nowait((sock, "/metrics", head))
            except queue.Full:
                self.on_rejected("busy")
                self._send_and_close(sock, response(503, b"busy: try again\n"))

    def _reply_inline(self, conn: _Conn, data: bytes, reason: str | None = None) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        self._sel.unregister(conn.sock)
        if reason:
            self.on_rejected(reason)
        self._send_and_close(conn.sock, data, blocking=False)

    @staticmethod
    def _send_and_close(sock: socket.socket, data: bytes, blocking: bool = True) -> None:
        """Small answers from the selector thread are sent without blocking (a fresh socket's send
        buffer takes them whole; a client that does not read loses its answer, nobody else waits)."""
        try:
            if blocking:
                sock.settimeout(WRITE_TIMEOUT_S)
                sock.sendall(data)
            else:
                sock.send(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            sock.close()

    # -- workers ------------------------------------------------------------------------------
    def _worker(self) -> None:
        while (item := self._work.get()) is not None:
            sock, path, head = item
            try:
                if path == "/metrics":
                    data = response(200, self.exposition(), CONTENT_TYPE_LATEST, head)
                else:
                    data = response(200, json.dumps(self.state(), indent=1, default=str).encode(),
                                    "application/json", head)
            except Exception as exc:  # a scrape must never take the agent down
                log.exception("http %s failed", path)
                data = response(500, f"error: {exc}\n".encode())
            self._send_and_close(sock, data)
