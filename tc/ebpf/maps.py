"""Maps and pins: the pods' map and the node's, their keys and shapes, the objects pinned in a bpffs.

Pinned, the maps keep their counts while no agent runs and a restarted agent adopts them; the
programs and tcx links are pinned beside them (PROG_PIN, LINK_PIN).
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import struct

from .syscall import (BPF_F_NO_PREALLOC, BPF_MAP_CREATE, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY, BPF_MAP_LOOKUP_ELEM,
                      BPF_MAP_TYPE_PERCPU_ARRAY, BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_UPDATE_ELEM, BPF_OBJ_GET,
                      BPF_OBJ_PIN, EbpfError, addr, bpf, bpf_attr, map_info, refusal, statfs_magic)

log = logging.getLogger(__name__)

BPF_FS_MAGIC = 0xCAFE4A11
KEY_SIZE = 16
VALUE = struct.Struct("=4Q")  # bytes and packets the pod sent, bytes and packets it received
MAP_NAME = b"na_internal"
PIN_NAME = "internal"
# the node's totals through its uplinks: a per-CPU array of two VALUEs (node's view), by the far end's scope
NODE_MAP_NAME = b"na_node"
NODE_PIN_NAME = "node"
NODE_INTERNAL, NODE_INTERNET = 0, 1
# what the rules miss of a pod's internet arrivals, keyed as the pods' map: the headers of the segments a
# GRO-merged packet carried beyond its first (bytes), and how many such segments (programs._merged)
SEGMENTS = struct.Struct("=2Q")
SEGMENTS_MAP_NAME = b"na_segments"
SEGMENTS_PIN_NAME = "segments"
# a pod's bytes by its far end's scope (issue 39), keyed as the pods' map: sent cross-zone, sent cross-region,
# received cross-zone, received cross-region (programs.SCOPE_SLOTS); its own map, so the pods' map keeps its shape
SCOPE_BYTES = struct.Struct("=4Q")
SCOPE_BYTES_MAP_NAME = b"na_scopebytes"
SCOPE_BYTES_PIN_NAME = "scopebytes"
# the node's bytes by its far end's scope, the same layout in one entry (key 0); beside the node map, which
# keeps its shape so that an upgraded agent adopts it with its counts
NODE_SCOPES_MAP_NAME = b"na_nodescopes"
NODE_SCOPES_PIN_NAME = "nodescopes"
SCOPE_PIN_NAMES = {4: "scopes4", 6: "scopes6"}  # the LPM tries (below), pinned beside the pods' map
SCOPE_ENTRIES = 8192  # a trie's bound: core.scopes.MAX_CIDRS described CIDRs and the cluster's own
PROG_PIN = "prog-"  # + the program's name
LINK_PIN = "link-"  # + "<ifindex>-in" / "-out": a tcx link, the attachment itself


def key_of(address: str) -> bytes:
    """A pod address as the map's key: 16 bytes, an IPv4 address as IPv4-mapped IPv6."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError as exc:
        raise EbpfError(f"pod address {address!r} is not an IP address") from exc
    return ip.packed if ip.version == 6 else b"\0" * 10 + b"\xff\xff" + ip.packed


def address_of(key: bytes) -> str:
    """The canonical text of a key's address (an IPv4-mapped key as plain IPv4)."""
    ip = ipaddress.IPv6Address(bytes(key))
    return str(ip.ipv4_mapped or ip)


def map_shape(max_entries: int) -> tuple[int, int, int, int, int]:
    """The pods' map's (type, key size, value size, max entries, flags), as bpf_map_info gives them back."""
    return BPF_MAP_TYPE_PERCPU_HASH, KEY_SIZE, VALUE.size, max_entries, BPF_F_NO_PREALLOC


def segments_shape(max_entries: int) -> tuple[int, int, int, int, int]:
    """The segments map's shape: the pods' map's keys, SEGMENTS values."""
    return BPF_MAP_TYPE_PERCPU_HASH, KEY_SIZE, SEGMENTS.size, max_entries, BPF_F_NO_PREALLOC


def scope_bytes_shape(max_entries: int) -> tuple[int, int, int, int, int]:
    """The scope bytes map's shape: the pods' map's keys, SCOPE_BYTES values."""
    return BPF_MAP_TYPE_PERCPU_HASH, KEY_SIZE, SCOPE_BYTES.size, max_entries, BPF_F_NO_PREALLOC


NODE_MAP_SHAPE = (BPF_MAP_TYPE_PERCPU_ARRAY, 4, VALUE.size, 2, 0)  # the node's map: NODE_INTERNAL, NODE_INTERNET
NODE_SCOPES_SHAPE = (BPF_MAP_TYPE_PERCPU_ARRAY, 4, SCOPE_BYTES.size, 1, 0)  # the node's scope bytes


def create_map(shape: tuple[int, int, int, int, int], name: bytes = MAP_NAME) -> int:
    return bpf(BPF_MAP_CREATE, bpf_attr("=IIIIIII16s", *shape, 0, 0, name))


def bpffs_problem(pin_dir: str) -> str | None:
    """Why maps cannot be pinned in `pin_dir` (it, or its parent when it does not exist yet, must be
    on a bpffs), or None."""
    where = pin_dir if os.path.isdir(pin_dir) else os.path.dirname(os.path.abspath(pin_dir))
    try:
        magic = statfs_magic(where)
    except OSError as exc:
        return f"the pin directory {pin_dir} cannot be made: {where}: {exc.strerror}"
    if magic != BPF_FS_MAGIC:
        return (f"{where} is not on a bpffs (filesystem magic {magic:#x}), so the counter's map cannot be pinned "
                f"there; mount one (mount -t bpf bpf {where}) or choose a pin directory under one")
    return None


def create_pinned(pin: str, shape: tuple[int, int, int, int, int], name: bytes) -> int:
    """A new map of this shape, pinned at `pin`."""
    try:
        fd = create_map(shape, name)
    except OSError as exc:
        raise EbpfError(f"creating the counter's map {name.decode()} failed: {refusal(exc)}") from None
    try:
        pin_object(fd, pin)
    except EbpfError:
        os.close(fd)
        raise
    return fd


def adopt(pin: str, shape: tuple[int, int, int, int, int], name: bytes) -> int:
    """The map pinned by an earlier agent, with its counts; a new one when nothing is pinned there,
    or what is is not such a map (another object, or another shape or size)."""
    fd = get_pinned(pin)
    if fd is None:
        return create_pinned(pin, shape, name)
    if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-map":
        kind, _id, *found_shape = map_info(fd)
        # a different capacity too: set_pods refuses by the capacity it was given
        if (kind, *found_shape) == shape:
            return fd
        found = f"a map of (type, key, value, entries, flags) {(kind, *found_shape)}"
    else:
        found = "another kind of bpf object"
    os.close(fd)
    log.warning("ebpf: %s holds %s, not the counter's map %s: replaced by a new map, its counts start at zero",
                pin, found, shape)
    os.unlink(pin)
    return create_pinned(pin, shape, name)


def get_pinned(pin: str) -> int | None:
    """The object pinned at `pin` (an fd), or None when nothing is."""
    if not os.path.lexists(pin):
        return None
    path = ctypes.create_string_buffer(os.fsencode(pin))
    try:
        return bpf(BPF_OBJ_GET, bpf_attr("=QI", addr(path), 0))
    except OSError as exc:
        raise EbpfError(f"opening the pinned object {pin} failed: {exc.strerror}") from None


def pin_object(fd: int, pin: str) -> None:
    """Pin `fd` at `pin`, in place of what was pinned there."""
    if os.path.lexists(pin):
        os.unlink(pin)
    path = ctypes.create_string_buffer(os.fsencode(pin))
    try:
        bpf(BPF_OBJ_PIN, bpf_attr("=QI", addr(path), fd))
    except OSError as exc:
        raise EbpfError(f"pinning at {pin} failed: {exc.strerror}") from None


def possible_cpus() -> int:
    """How many values a per-CPU map holds for each key: one per possible CPU."""
    with open("/sys/devices/system/cpu/possible") as f:
        text = f.read().strip()
    count = 0
    for part in text.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def unpin_dir(pin_dir: str) -> list[str]:
    """Remove the counter's pins from `pin_dir` (its tcx links, which detaches their programs once no
    process holds them, its programs and its maps), and `pin_dir` when that left it empty; nothing off
    a bpffs (then it is not ours). Programs attached as tc filters keep the maps while they run. ->
    what was removed."""
    if not os.path.isdir(pin_dir) or statfs_magic(pin_dir) != BPF_FS_MAGIC:
        return []
    removed = []
    for name in sorted(os.listdir(pin_dir)):
        pin = os.path.join(pin_dir, name)
        if name.startswith(LINK_PIN):  # releasing the link detaches its program
            os.unlink(pin)
            removed.append(f"tcx link {pin}")
        elif name.startswith(PROG_PIN):
            os.unlink(pin)
            removed.append(f"pinned program {pin}")
    for name in (PIN_NAME, NODE_PIN_NAME, SEGMENTS_PIN_NAME, SCOPE_BYTES_PIN_NAME, NODE_SCOPES_PIN_NAME,
                 *SCOPE_PIN_NAMES.values()):
        pin = os.path.join(pin_dir, name)
        if os.path.lexists(pin):
            os.unlink(pin)
            removed.append(f"pinned map {pin}")
    if not os.listdir(pin_dir):
        os.rmdir(pin_dir)
        removed.append(f"directory {pin_dir}")
    return removed


# Destination scopes (issue 39; programs.program looks the far address up in them): two LPM tries, one
# per family, key = u32 prefix length + the address bytes (network order), value = a u32 scope id
# (core.scopes.SCOPE_IDS). A changed description is an upsert/delete of entries, never a re-attach.
BPF_MAP_TYPE_LPM_TRIE = 11
SCOPE_VALUE = struct.Struct("=I")
SCOPE_MAP_NAMES = {4: b"na_scopes4", 6: b"na_scopes6"}


def scope_map_shape(version: int, max_entries: int) -> tuple[int, int, int, int, int]:
    """An LPM trie must be created without preallocation (the kernel refuses it otherwise)."""
    return BPF_MAP_TYPE_LPM_TRIE, 4 + (4 if version == 4 else 16), SCOPE_VALUE.size, max_entries, BPF_F_NO_PREALLOC


def scope_key(network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bytes:
    return struct.pack("=I", network.prefixlen) + network.network_address.packed


def scope_apply(fds: dict[int, int], upserts: dict, deletes: list) -> None:
    """Apply core.scopes.diff_entries' result to the tries keyed by IP version."""
    for net in deletes:
        key = ctypes.create_string_buffer(scope_key(net))
        bpf(BPF_MAP_DELETE_ELEM, bpf_attr("=IIQ", fds[net.version], 0, addr(key)))
    for net, sid in upserts.items():
        key = ctypes.create_string_buffer(scope_key(net))
        val = ctypes.create_string_buffer(SCOPE_VALUE.pack(sid))
        bpf(BPF_MAP_UPDATE_ELEM, bpf_attr("=IIQQQ", fds[net.version], 0, addr(key), addr(val), 0))


def scope_lookup(fds: dict[int, int], address: str) -> int | None:
    """The kernel's longest-prefix match for one address (a full-length key), None = no entry."""
    ip = ipaddress.ip_address(address)
    key = ctypes.create_string_buffer(struct.pack("=I", ip.max_prefixlen) + ip.packed)
    val = ctypes.create_string_buffer(SCOPE_VALUE.size)
    try:
        bpf(BPF_MAP_LOOKUP_ELEM, bpf_attr("=IIQQ", fds[ip.version], 0, addr(key), addr(val)))
    except OSError as exc:
        if exc.errno == 2:  # ENOENT
            return None
        raise
    return int(SCOPE_VALUE.unpack(val.raw[:SCOPE_VALUE.size])[0])


def scope_entries(fds: dict[int, int]) -> dict[ipaddress.IPv4Network | ipaddress.IPv6Network, int]:
    """Every entry of the tries (prefix -> scope id): what an earlier agent left, to diff against."""
    out: dict[ipaddress.IPv4Network | ipaddress.IPv6Network, int] = {}
    for version, fd in fds.items():
        size = 4 + (4 if version == 4 else 16)
        key, nxt = ctypes.create_string_buffer(size), ctypes.create_string_buffer(size)
        val = ctypes.create_string_buffer(SCOPE_VALUE.size)
        first = True
        while True:
            try:
                bpf(BPF_MAP_GET_NEXT_KEY, bpf_attr("=IIQQ", fd, 0, 0 if first else addr(key), addr(nxt)))
            except OSError as exc:
                if exc.errno == 2:  # ENOENT: the last key
                    break
                raise EbpfError(f"reading the scopes trie failed: {exc.strerror}") from None
            first = False
            key.raw = nxt.raw
            try:
                bpf(BPF_MAP_LOOKUP_ELEM, bpf_attr("=IIQQ", fd, 0, addr(key), addr(val)))
            except OSError:
                continue  # deleted meanwhile
            (plen,) = struct.unpack_from("=I", key.raw)
            address = ipaddress.ip_address(key.raw[4:size])
            net = ipaddress.ip_network(f"{address}/{plen}")
            out[net] = int(SCOPE_VALUE.unpack(val.raw[:SCOPE_VALUE.size])[0])
    return out
