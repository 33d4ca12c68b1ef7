"""Bounds on the agents' kept-alive connections to the controller, and their counts.

Agents keep one connection open to the controller (netagent/transport.py), so a report costs no
TLS handshake. Kept connections are a shared resource: a client may hold at most
`per_address` of them (an agent needs one, two during a failover), all clients together at most
`total` (the file descriptors and the ~40 KiB each costs: core/asynctls.py), and a connection idle
for `keepalive_timeout` seconds is closed (aiohttp's RequestHandler, set by the caller). A
connection over a bound is closed as soon as it is accepted, before it can send a request, and
counted by reason; it costs the others nothing but its accept and, with TLS, its handshake. The
handshakes in progress are bounded before that (core/asynctls.HandshakeGate, `--max-handshakes`):
a connection beyond them waits up to 2 s, then is closed before any TLS work (TooManyHandshakes).

Hooked into aiohttp's `web.Server` (the protocol factory an AppRunner serves): its public
`connection_made`/`connection_lost` are called for every connection the server accepts.
"""
from __future__ import annotations

import asyncio
import logging
import resource
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .config import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS

if TYPE_CHECKING:  # the agent's CLI loads controller/config.py, never aiohttp (tests/test_layers.py)
    from aiohttp import web

log = logging.getLogger(__name__)

TOO_MANY = "TooManyConnections"
TOO_MANY_FROM_ADDRESS = "TooManyConnectionsFromAddress"
TOO_MANY_HANDSHAKES = "TooManyHandshakes"


@dataclass(eq=False)  # a collector in a registry: hashed by identity
class ConnectionBounds:
    """Counts open connections (in total and per client address) and refuses those over a bound."""

    total: int = DEFAULT_MAX_CONNECTIONS
    per_address: int = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    open_by_address: Counter[str] = field(default_factory=Counter)
    admitted: dict[Any, str] = field(default_factory=dict)  # handler -> client address
    opened: int = 0
    refused: Counter[str] = field(default_factory=Counter)

    def admit(self, handler: Any, address: str) -> str | None:
        """None when `handler`'s connection from `address` may stay open, else the refusal's reason."""
        if len(self.admitted) >= self.total:
            reason = TOO_MANY
        elif self.open_by_address[address] >= self.per_address:
            reason = TOO_MANY_FROM_ADDRESS
        else:
            self.admitted[handler] = address
            self.open_by_address[address] += 1
            self.opened += 1
            return None
        self.refused[reason] += 1
        return reason

    def refuse_handshake(self, address: str) -> None:
        """A connection closed before its handshake (core/asynctls.HandshakeGate's on_refused)."""
        self.refused[TOO_MANY_HANDSHAKES] += 1
        self._log_refusal(TOO_MANY_HANDSHAKES, address)

    def _log_refusal(self, reason: str, address: str) -> None:
        if self.refused[reason] in (1, 10, 100) or self.refused[reason] % 1000 == 0:
            log.warning("connection from %s closed: %s (%d open, at most %d, %d per address); %d so far",
                        address, reason, self.open, self.total, self.per_address, self.refused[reason])

    def release(self, handler: Any) -> None:
        address = self.admitted.pop(handler, None)
        if address is not None:
            self.open_by_address[address] -= 1
            if self.open_by_address[address] <= 0:
                del self.open_by_address[address]

    @property
    def open(self) -> int:
        return len(self.admitted)

    def hook(self, server: web.Server) -> None:
        """Wrap `server`'s per-connection calls (an AppRunner's `server` after setup())."""
        made: Callable[[Any, asyncio.Transport], None] = server.connection_made
        lost: Callable[..., None] = server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)  # aiohttp's bookkeeping first: its connection_lost undoes it
            peer = transport.get_extra_info("peername")
            reason = self.admit(handler, str(peer[0]) if peer else "?")
            if reason is not None:
                self._log_refusal(reason, str(peer[0]) if peer else "?")
                transport.abort()

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self.release(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def collect(self) -> list[Any]:
        """netagent_controller_connections{,_opened_total,_refused_total{reason}} for the registry."""
        now = GaugeMetricFamily("netagent_controller_connections",
                                "Agent API connections open now (kept alive between reports).")
        now.add_metric([], self.open)
        opened = CounterMetricFamily("netagent_controller_connections_opened",
                                     "Agent API connections accepted and kept (each one a TLS handshake with TLS).")
        opened.add_metric([], self.opened)
        refused = CounterMetricFamily("netagent_controller_connections_refused",
                                      "Agent API connections closed on accept: over --max-connections in total "
                                      "(TooManyConnections) or per client address (TooManyConnectionsFromAddress), "
                                      "or before their TLS handshake after waiting 2 s beyond --max-handshakes in "
                                      "progress (TooManyHandshakes).",
                                      labels=["reason"])
        for reason in (TOO_MANY, TOO_MANY_FROM_ADDRESS, TOO_MANY_HANDSHAKES):
            refused.add_metric([reason], self.refused[reason])
        return [now, opened, refused]


def raise_open_files_limit(wanted: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards `wanted` (within the hard limit): kept
    connections need one descriptor each. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit to %d (%s); %d connections at most", target, exc, soft)
    return soft
