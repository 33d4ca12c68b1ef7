"""Facts about this node's network that the agent learns instead of being told.

Read through iproute2's JSON output (`ip -j`): iproute2 is required anyway, and only
tc/ speaks netlink through pyroute2.
"""
from __future__ import annotations

import ipaddress
import json
import subprocess


class NetInfoError(RuntimeError):
    """The node's routes or addresses could not be read; the message says what failed."""


def _ip_json(*args: str) -> list[dict]:
    argv = ["ip", "-j", *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetInfoError(f"{' '.join(argv)} failed: {exc} (is iproute2 installed?)") from exc
    if proc.returncode != 0:
        raise NetInfoError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout or "[]")


def default_route_devices() -> tuple[str, ...]:
    """Devices that carry a default route (IPv4 or IPv6, multipath included): the node's uplinks."""
    names: list[str] = []
    for family in ("-4", "-6"):
        for route in _ip_json(family, "route", "show", "default"):
            if route.get("type", "unicast") != "unicast":
                continue  # unreachable/blackhole defaults lead nowhere
            hops = [route] + list(route.get("nexthops") or [])
            for dev in (h.get("dev") for h in hops):
                if dev and dev != "lo" and dev not in names:
                    names.append(dev)
    return tuple(names)


def connected_networks(devices: tuple[str, ...]) -> tuple[str, ...]:
    """The subnets directly attached to the uplinks (the node's VPC subnet): internal by definition."""
    out: list[str] = []
    for dev in devices:
        for link in _ip_json("addr", "show", "dev", dev):
            for a in link.get("addr_info") or []:
                if a.get("scope") != "global" or "local" not in a:
                    continue
                net = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
                if net.prefixlen < net.max_prefixlen and str(net) not in out:
                    out.append(str(net))
    return tuple(out)
