"""The bpf(2) syscall layer: raw calls through ctypes, the command numbers, the objects' info.

Raw calls, no libbpf: the programs are tens of instructions and need no compiler and no BTF.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

from ..errors import TcError

SYS_BPF = {"x86_64": 321, "aarch64": 280}  # by platform.machine(); both little-endian (see asm.le)
BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
BPF_PROG_LOAD, BPF_OBJ_PIN, BPF_OBJ_GET, BPF_OBJ_GET_INFO_BY_FD, BPF_PROG_QUERY = 5, 6, 7, 15, 16
BPF_MAP_LOOKUP_BATCH, BPF_LINK_CREATE, BPF_LINK_UPDATE = 24, 28, 29
BPF_TCX = {False: 46, True: 47}  # egress hook? -> BPF_TCX_INGRESS, BPF_TCX_EGRESS (Linux >= 6.6)
BPF_LINK_TYPE_TCX = 11
BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY = 5, 6
BPF_F_NO_PREALLOC = 1  # entries come from set_pods only: no memory for 4096 entries x every possible CPU up front
BPF_PROG_TYPE_SCHED_CLS = 3
BPF_NOEXIST = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class EbpfError(TcError):
    """A bpf(2) or tc operation of the internal counter failed; the message says what and why."""


def bpf(cmd: int, attr: ctypes.Array) -> int:
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        raise EbpfError(f"bpf(2): no syscall number known for {platform.machine()!r} (known: {', '.join(SYS_BPF)})")
    ret = _libc.syscall(ctypes.c_long(nr), ctypes.c_long(cmd), ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def bpf_attr(fmt: str, *values) -> ctypes.Array:
    """A zeroed union bpf_attr (128 bytes: more than any command here uses) starting with `values`."""
    attr = (ctypes.c_uint8 * 128)()
    struct.pack_into(fmt, attr, 0, *values)
    return attr


def addr(buf) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


def refusal(exc: OSError) -> str:
    """What a failed bpf(2) call means, as a sentence."""
    if exc.errno == errno.EPERM:
        return "bpf(2) refused: EPERM (the process needs CAP_BPF and CAP_NET_ADMIN, or CAP_SYS_ADMIN)"
    if exc.errno == errno.ENOSYS:
        return "bpf(2) is missing: ENOSYS (a kernel without CONFIG_BPF_SYSCALL)"
    return f"bpf(2) failed: {errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror})"


def statfs_magic(path: str) -> int:
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field, a long
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return struct.unpack_from("=l", buf, 0)[0] & 0xFFFFFFFF


def obj_info(fd: int, size: int, extra: str = "", *values) -> bytes:
    """BPF_OBJ_GET_INFO_BY_FD: the first `size` bytes of the object's info (prefilled with `values`
    packed as `extra`, for the info's own pointers)."""
    buf = ctypes.create_string_buffer(size)
    if extra:
        struct.pack_into(extra, buf, 0, *values)
    bpf(BPF_OBJ_GET_INFO_BY_FD, bpf_attr("=IIQ", fd, size, addr(buf)))
    return buf.raw


def map_info(fd: int) -> tuple[int, int, int, int, int, int]:
    """(type, id, key size, value size, max entries, flags) of a map."""
    return struct.unpack_from("=IIIIII", obj_info(fd, 40), 0)


def link_info(fd: int) -> tuple[int, int, int, int]:
    """(link type, program id, ifindex, attach type) of a tcx link (struct bpf_link_info: type at 0,
    prog_id at 8, tcx.ifindex at 16, tcx.attach_type at 20); ifindex 0: its device went."""
    kind, _id, prog_id, ifindex, attach_type = struct.unpack_from("=III4xII", obj_info(fd, 24), 0)
    return kind, prog_id, ifindex, attach_type


def prog_info(fd: int) -> tuple[int, bytes, tuple[int, ...]]:
    """(id, tag, the ids of the maps it uses) of a program (struct bpf_prog_info: id at 4, tag at
    8, nr_map_ids at 52, map_ids at 56)."""
    ids = (ctypes.c_uint32 * 8)()
    raw = obj_info(fd, 64, "=52xIQ", len(ids), addr(ids))
    prog_id, tag = struct.unpack_from("=4xI8s", raw, 0)
    (n,) = struct.unpack_from("=I", raw, 52)
    return prog_id, tag, tuple(ids[:min(n, len(ids))])


BPF_PROG_TEST_RUN = 10
SKB_CTX_SIZE = 192  # sizeof(struct __sk_buff) in Linux >= 5.16 (hwtstamp last)
SKB_CTX_GSO_SEGS, SKB_CTX_GSO_SIZE = 164, 176


def run_program(prog_fd: int, frame: bytes, repeat: int = 1, gso_segs: int = 0, gso_size: int = 0) -> tuple[int, int]:
    """Run a loaded sched_cls program over one Ethernet frame in the kernel (BPF_PROG_TEST_RUN: no device, no
    traffic), as a packet GRO merged from `gso_segs` segments of `gso_size` when those are given. ->
    (the program's return value, the kernel's average ns a run over `repeat` runs)."""
    data = ctypes.create_string_buffer(frame, len(frame))
    ctx = ctypes.create_string_buffer(SKB_CTX_SIZE)
    struct.pack_into("=I", ctx, SKB_CTX_GSO_SEGS, gso_segs)
    struct.pack_into("=I", ctx, SKB_CTX_GSO_SIZE, gso_size)
    attr = bpf_attr("=IIIIQQIIIIQQII", prog_fd, 0, len(frame), 0, addr(data), 0, repeat, 0,
                    SKB_CTX_SIZE, 0, addr(ctx), 0, 0, 0)
    bpf(BPF_PROG_TEST_RUN, attr)
    retval, duration = struct.unpack_from("=I", attr, 4)[0], struct.unpack_from("=I", attr, 36)[0]
    return ctypes.c_int32(retval).value, duration
