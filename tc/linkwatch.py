"""Link and route changes as the kernel announces them (rtnetlink multicast groups).

The agent's data path hangs off devices: the IFB it owns and the uplinks its redirect filter
sits on. A deleted or downed IFB, a renamed or replaced uplink or a new default-route device
breaks shaping at once; waiting for the periodic resync would leave traffic unshaped or dropped
for up to its period. `LinkWatcher` reads RTM_NEWLINK/RTM_DELLINK and RTM_NEWROUTE/RTM_DELROUTE
notifications from a raw NETLINK_ROUTE socket and hands each one over as a small `LinkEvent`;
deciding which matter is the caller's job. An overflow of the socket's buffer (ENOBUFS: events
were lost) is reported as an event of kind "overflow": the caller must assume anything changed.
"""
from __future__ import annotations

import errno
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import nlwire

from .rawnl import IFLA_IFNAME, IFLA_INFO_KIND, IFLA_LINKINFO, route_socket

RTMGRP_LINK = 0x1
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_ROUTE = 0x400
RTM_NEWLINK, RTM_DELLINK, RTM_NEWROUTE, RTM_DELROUTE = 16, 17, 24, 25
IFF_UP = 0x1
RT_TABLE_MAIN = 254
RTA_OIF = 4

_IFINFO = struct.Struct("=BxHiII")
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags


@dataclass(frozen=True)
class LinkEvent:
    kind: str  # "link", "route" or "overflow"
    deleted: bool = False
    index: int = 0  # the device (for a route: its output device, 0 when unknown)
    name: str = ""  # links only
    up: bool = False  # links only: IFF_UP
    default_route: bool = False  # routes only: a default route of the main table
    link_kind: str = ""  # links only: "veth", "bridge", "ifb"... ("" when the message does not say)


def parse(data: bytes) -> list[LinkEvent]:
    """The link and route events in one datagram of notifications. Pure."""
    out: list[LinkEvent] = []
    for msg_type, _flags, _seq, body in nlwire.messages(data):
        if msg_type in (RTM_NEWLINK, RTM_DELLINK) and _IFINFO.size <= len(body):
            _, _, index, flags, _ = _IFINFO.unpack_from(body, 0)
            name = link_kind = ""
            for kind, value in nlwire.iter_attrs(body, _IFINFO.size):
                if kind == IFLA_IFNAME:
                    name = nlwire.text(value)
                elif kind == IFLA_LINKINFO:
                    for sub, subvalue in nlwire.iter_attrs(value):
                        if sub == IFLA_INFO_KIND:
                            link_kind = nlwire.text(subvalue)
            out.append(LinkEvent("link", msg_type == RTM_DELLINK, index, name, bool(flags & IFF_UP),
                                 link_kind=link_kind))
        elif msg_type in (RTM_NEWROUTE, RTM_DELROUTE) and _RTMSG.size <= len(body):
            _, dst_len, _, _, table, _, _, _, _ = _RTMSG.unpack_from(body, 0)
            oif = 0
            for kind, value in nlwire.iter_attrs(body, _RTMSG.size):
                if kind == RTA_OIF and len(value) >= 4:
                    oif = struct.unpack_from("=i", value)[0]
            out.append(LinkEvent("route", msg_type == RTM_DELROUTE, oif,
                                 default_route=dst_len == 0 and table == RT_TABLE_MAIN))
    return out


class LinkWatcher:
    """Calls `on_event(LinkEvent)` from its own thread for every link and route notification in
    `netns` (a namespace name; None: this process's own) until `stop()`."""

    def __init__(self, on_event: Callable[[LinkEvent], None], netns: str | None = None):
        self.on_event = on_event
        self.sock = route_socket(netns, 1 << 20)
        self.sock.bind((0, RTMGRP_LINK | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE))
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="linkwatch", daemon=True)

    def start(self) -> "LinkWatcher":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(2)
        self.sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                if exc.errno == errno.ENOBUFS:  # notifications were lost: anything may have changed
                    self.on_event(LinkEvent("overflow"))
                    continue
                raise
            for event in parse(data):
                self.on_event(event)
