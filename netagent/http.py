"""The agent's one HTTP address: /metrics, /healthz, /readyz and /state.

stdlib's threading server is enough here: a handful of scrapes and probes per
minute, and no dependency to audit on a privileged DaemonSet.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from core.address import join_host_port

log = logging.getLogger(__name__)


class AgentHTTP:
    def __init__(self, listen: tuple[str, int], registry, health: Callable[[], tuple[bool, str]],
                 ready: Callable[[], tuple[bool, str]], state: Callable[[], dict]):
        host, port = listen
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # requests are not worth a log line each
                pass

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        self._send(200, generate_latest(outer.registry), CONTENT_TYPE_LATEST)
                    elif path in ("/healthz", "/readyz"):
                        ok, why = (outer.health if path == "/healthz" else outer.ready)()
                        self._send(200 if ok else 503, (why or ("ok" if ok else "not ready")).encode() + b"\n")
                    elif path == "/state":
                        self._send(200, json.dumps(outer.state(), indent=1, default=str).encode(), "application/json")
                    else:
                        self._send(404, b"not found: try /metrics /healthz /readyz /state\n")
                except Exception as exc:  # a scrape must never take the agent down
                    log.exception("http %s failed", path)
                    self._send(500, f"error: {exc}\n".encode())

        self.registry, self.health, self.ready, self.state = registry, health, ready, state
        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {join_host_port(host, port)}: {exc.strerror}") from exc
        self.server.daemon_threads = True
        self.address = join_host_port(host, self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
