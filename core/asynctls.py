"""asyncio's TLS read buffer, per process, and a bound on the TLS handshakes a server works on.

asyncio's TLS transport (Python 3.11+) gives every connection a 256 KiB read buffer the moment it
is accepted or opened (`sslproto.SSLProtocol.max_size`, a class attribute read for each new
connection). A process holding thousands of connections that carry a few KiB each pays for the
buffers, not the data: at 5,000 nodes and a 5 s period (bench/scale.py) both controller replicas
reached 6.2 GiB holding report connections. One TLS record (16 KiB) is what one read can return
anyway. Measured: 280 KiB of RSS a connection before, 40 KiB after
(tests/test_controller_service.py::test_an_open_tls_connection_costs_the_controller_little_memory).
"""
from __future__ import annotations

import asyncio
import asyncio.sslproto
import ssl
from collections import Counter, deque
from typing import Any, Callable

TLS_READ_BUFFER_BYTES = 16 * 1024


def set_tls_read_buffer(size: int = TLS_READ_BUFFER_BYTES) -> None:
    """asyncio's per-connection TLS read buffer for this process's new connections (left alone
    where a Python has no such attribute)."""
    if isinstance(getattr(asyncio.sslproto.SSLProtocol, "max_size", None), int):
        asyncio.sslproto.SSLProtocol.max_size = size


HANDSHAKE_TIMEOUT_SECONDS = 10  # a client silent this long mid-handshake gives its place up
# the longest a connection waits for its handshake to start: an agent waits 3 s for the server's
# first bytes, and a started handshake takes milliseconds (at 1.0 s, 66 of 300 stormers were closed
# while the answered ones took 1.5 s at p99 under load 7: bench/report_cost.py --storm --nodes 300)
HANDSHAKE_WAIT_SECONDS = 2.0
WAITING_PER_HANDSHAKE = 16  # connections that may wait, per handshake in progress


class HandshakeGate:
    """A TLS server's protocol factory (for `loop.create_server` without `ssl=`) that works on at
    most `limit` handshakes at once. The connections accepted beyond that wait, not read, in
    arrival order for at most `wait` seconds and start their handshake as others finish; one that
    waited longer, one beyond the waiting room (16 a handshake), and one from an address that
    already has `per_address` handshakes in progress or waiting is closed before any TLS work,
    and `on_refused(address)` is called.

    Why: with `ssl=`, asyncio starts every accepted connection's handshake at once, and they share
    the one event loop; in a reconnect storm of 2,000 agents every handshake finished late and 1,997
    of 2,000 first reports timed out at the agents' 3 s (docs/scale.md "Bad input at scale"). With
    the gate a storm is worked through at the loop's handshake rate, each handshake quick, and the
    connections that could not start in time are closed early, so their agents come back later.
    The TLS layer is asyncio's own (SSLProtocol, as `ssl=` builds it), started per connection."""

    def __init__(self, context: ssl.SSLContext, protocol_factory: Callable[[], asyncio.BaseProtocol], limit: int,
                 per_address: int, on_refused: Callable[[str], None],
                 handshake_timeout: int = HANDSHAKE_TIMEOUT_SECONDS, wait: float = HANDSHAKE_WAIT_SECONDS):
        self.context = context
        self.protocol_factory = protocol_factory
        self.limit = limit
        self.per_address = per_address
        self.on_refused = on_refused
        self.handshake_timeout = handshake_timeout
        self.wait = wait
        self.in_flight = 0
        self.by_address: Counter[str] = Counter()  # handshakes in progress or waiting, per client address
        self.waiting: deque[tuple[float, str, asyncio.Transport]] = deque()  # (deadline, address, transport)
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self) -> asyncio.Protocol:
        return _Gated(self)

    def accepted(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        self._expire()
        if self.by_address[address] >= self.per_address or len(self.waiting) >= self.limit * WAITING_PER_HANDSHAKE:
            self._refuse(transport, address)
            return
        self.by_address[address] += 1
        if self.in_flight < self.limit and not self.waiting:
            self._begin(transport, address)
            return
        transport.pause_reading()  # its ClientHello stays in the kernel until its handshake starts
        loop = asyncio.get_running_loop()
        self.waiting.append((loop.time() + self.wait, address, transport))
        if self._timer is None:
            self._timer = loop.call_later(self.wait, self._tick)

    def _begin(self, transport: asyncio.Transport, address: str) -> None:
        self.in_flight += 1
        loop = asyncio.get_running_loop()
        done = loop.create_future()  # resolved when the handshake ends, either way
        done.add_done_callback(lambda f: self._ended(address, f))
        tls = asyncio.sslproto.SSLProtocol(loop, self.protocol_factory(), self.context, done, server_side=True,
                                           ssl_handshake_timeout=self.handshake_timeout)
        transport.set_protocol(tls)
        tls.connection_made(transport)
        transport.resume_reading()  # a waiting one was paused (a no-op otherwise)

    def _ended(self, address: str, done: asyncio.Future[Any]) -> None:
        self.in_flight -= 1
        self._release(address)
        if not done.cancelled():
            done.exception()  # retrieved: a failed handshake is the client's problem, asyncio logs it in debug
        self._expire()
        while self.in_flight < self.limit and self.waiting:
            _, address, transport = self.waiting.popleft()
            if transport.is_closing():
                self._release(address)
            else:
                self._begin(transport, address)

    def _expire(self) -> None:
        now = asyncio.get_running_loop().time()
        while self.waiting and self.waiting[0][0] <= now:
            _, address, transport = self.waiting.popleft()
            self._release(address)
            self._refuse(transport, address)

    def _tick(self) -> None:
        self._timer = None
        self._expire()
        if self.waiting:
            delay = max(self.waiting[0][0] - asyncio.get_running_loop().time(), 0.01)
            self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _refuse(self, transport: asyncio.Transport, address: str) -> None:
        transport.abort()
        self.on_refused(address)

    def _release(self, address: str) -> None:
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


class _Gated(asyncio.Protocol):
    """An accepted connection before its handshake: started, waiting or closed (HandshakeGate)."""

    def __init__(self, gate: HandshakeGate):
        self.gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.gate.accepted(transport)
