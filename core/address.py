"""HOST:PORT as both processes take it on their command lines."""
from __future__ import annotations

import ipaddress

from .errors import ConfigError


def parse_host_port(text: str, what: str, example: str) -> tuple[str, int]:
    """`text` as (host, port) with 0 < port < 65536; an empty host means all addresses
    ("0.0.0.0"). IPv6 hosts are written in brackets: "[::1]:9560". Raises ConfigError
    naming `what` (the flag) and showing `example`."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {text!r} must be HOST:PORT with a port from 1 to 65535, for example {example}")
    return host.strip("[]") or "0.0.0.0", int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of parse_host_port: brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost": an address only this machine (namespace) reaches."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
