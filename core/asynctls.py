"""asyncio's TLS read buffer, per process.

asyncio's TLS transport (Python 3.11+) gives every connection a 256 KiB read buffer the moment it
is accepted or opened (`sslproto.SSLProtocol.max_size`, a class attribute read for each new
connection). A process holding thousands of connections that carry a few KiB each pays for the
buffers, not the data: at 5,000 nodes and a 5 s period (bench/scale.py) both controller replicas
reached 6.2 GiB holding report connections. One TLS record (16 KiB) is what one read can return
anyway. Measured: 280 KiB of RSS a connection before, 40 KiB after
(tests/test_controller_service.py::test_an_open_tls_connection_costs_the_controller_little_memory).
"""
from __future__ import annotations

import asyncio.sslproto

TLS_READ_BUFFER_BYTES = 16 * 1024


def set_tls_read_buffer(size: int = TLS_READ_BUFFER_BYTES) -> None:
    """asyncio's per-connection TLS read buffer for this process's new connections (left alone
    where a Python has no such attribute)."""
    if isinstance(getattr(asyncio.sslproto.SSLProtocol, "max_size", None), int):
        asyncio.sslproto.SSLProtocol.max_size = size
