"""A fault injector: a TCP proxy that delays what a server sends back (or holds it).

Put in front of the real kube-apiserver, it makes the API server slow or hung for the clients
that go through it, a fault the real one cannot produce on demand (a half-open connection, an
overloaded apiserver). TLS passes through untouched: the client still verifies the API server.
"""
from __future__ import annotations

import socket
import threading
import time


class DelayProxy:
    """127.0.0.1:<port> -> upstream; `delay` seconds are added before each chunk the upstream
    sends back (0: a plain pipe). Changing `delay` applies to chunks from then on."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.delay = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="delay-proxy", daemon=True)

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if delayed and self.delay > 0:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
