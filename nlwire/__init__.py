"""Netlink on the wire, shared by tc/ (rtnetlink) and iptables/ (netfilter netlink): a raw socket
opened in a network namespace, and the framing of messages and attributes. Pure but for the socket;
what a message means stays with the layer that asks."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import socket
import struct
import sys
from collections.abc import Iterator

FULL_PACKAGE_NAMES = ("__all__", "__version__")


def lean_pyroute2() -> None:
    """Register the pyroute2 package without running its __init__, which imports every module of
    the library (NDB with sqlite, IPDB, wireless, plan9...: ~160 modules, ~6 MiB of the agent's
    RSS above the ~100 that tc/ and iptables/ use). Submodules import as usual; the first use of a
    name only the __init__ defines (`from pyroute2 import IPRoute`) runs it then, so every user
    still works. Called before anything imports pyroute2 (this module, first thing); a no-op
    when pyroute2 is already loaded."""
    if "pyroute2" in sys.modules:
        return
    spec = importlib.util.find_spec("pyroute2")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed as a package: the ordinary import says so
    package = importlib.util.module_from_spec(spec)
    loaded = []

    def __getattr__(name: str):
        if name.startswith("__") and name not in FULL_PACKAGE_NAMES:
            raise AttributeError(name)
        if not name.startswith("__"):
            try:
                return importlib.import_module(f"pyroute2.{name}")  # a submodule: that one only
            except ModuleNotFoundError as exc:
                if exc.name != f"pyroute2.{name}":
                    raise
        if not loaded:
            loaded.append(True)
            spec.loader.exec_module(package)  # the whole library, as an ordinary import does
            if name in vars(package):
                return vars(package)[name]
        raise AttributeError(f"module 'pyroute2' has no attribute {name!r}")

    package.__getattr__ = __getattr__
    sys.modules["pyroute2"] = package


lean_pyroute2()

import pyroute2.netns as pr_netns  # noqa: E402  (after lean_pyroute2)

NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLA_TYPE_MASK = 0x3FFF  # less NLA_F_NESTED and NLA_F_NET_BYTEORDER

HDR = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
NLA = struct.Struct("=HH")  # nlattr: length, type

Buffer = bytes | memoryview


@contextlib.contextmanager
def in_netns(netns: str | None) -> Iterator[None]:
    """Run the block with this thread in a network namespace (None: where it is): for sockets, which
    stay in the namespace they were made in, and calls that name a device by its ifindex, such as
    bpf(2)'s tcx links."""
    if netns:
        pr_netns.pushns(netns)
    try:
        yield
    finally:
        if netns:
            pr_netns.popns()


def socket_in(netns: str | None, protocol: int, family: int = socket.AF_NETLINK) -> socket.socket:
    """A raw socket (netlink of `protocol` by default), opened inside a network namespace (None:
    this one): a socket stays in the namespace it was made in."""
    with in_netns(netns):
        return socket.socket(family, socket.SOCK_RAW, protocol)


def message(msg_type: int, flags: int, seq: int, body: bytes) -> bytes:
    """One request: the header (this socket's port id left 0 for the kernel to fill) and `body`."""
    return HDR.pack(HDR.size + len(body), msg_type, flags, seq, 0) + body


def attr(kind: int, value: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    out = NLA.pack(4 + len(value), kind) + value
    return out + b"\0" * (-len(out) % 4)


def messages(data: Buffer) -> Iterator[tuple[int, int, int, Buffer]]:
    """(type, flags, seq, payload) of each message in one datagram; a memoryview stays a view."""
    off = 0
    while off + HDR.size <= len(data):
        length, mtype, flags, seq, _pid = HDR.unpack_from(data, off)
        if length < HDR.size:
            return
        yield mtype, flags, seq, data[off + HDR.size:off + length]
        off += (length + 3) & ~3


def iter_attrs(data: Buffer, off: int = 0, end: int | None = None) -> Iterator[tuple[int, Buffer]]:
    """(type, value) of each attribute in data[off:end], in order (a type may repeat)."""
    end = len(data) if end is None else end
    while off + 4 <= end:
        length, kind = NLA.unpack_from(data, off)
        if length < 4:
            return
        yield kind & NLA_TYPE_MASK, data[off + 4:off + length]
        off += (length + 3) & ~3


def text(value: Buffer) -> str:
    """A C string attribute: up to its first NUL."""
    return bytes(value).split(b"\0", 1)[0].decode(errors="replace")
