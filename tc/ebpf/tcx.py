"""tcx links: the counting programs attached straight to a device's hook (Linux >= 6.6), pinned so that
they outlive the agent, and the gate that ends an egress hook for an unmarked packet.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import struct

import nlwire

from ..netlink import CLSACT_EGRESS
from .clsact import OUR_NAMES, TCA_BPF_NAME, Filters, bpf_options
from .maps import LINK_PIN, get_pinned, pin_object
from .syscall import (BPF_LINK_CREATE, BPF_LINK_TYPE_TCX, BPF_LINK_UPDATE, BPF_PROG_QUERY, BPF_TCX, addr, bpf,
                      bpf_attr, link_info)

log = logging.getLogger(__name__)


def tcx_available(netns: str | None = None) -> bool:
    """Whether the kernel attaches programs to devices with tcx (Linux >= 6.6): a query of lo's."""
    with nlwire.in_netns(netns):
        try:
            bpf(BPF_PROG_QUERY, bpf_attr("=IIII", socket.if_nametoindex("lo"), BPF_TCX[False], 0, 0))
        except OSError:
            return False
    return True


def tcx_programs(ifindex: int, egress: bool) -> list[int]:
    """The ids of the programs on a device's tcx hook (in the calling thread's network namespace), in the
    order they run; OSError when the kernel cannot list them."""
    room = 16
    while True:
        ids = (ctypes.c_uint32 * room)()
        attr = bpf_attr("=IIIIQI", ifindex, BPF_TCX[egress], 0, 0, addr(ids), room)
        try:
            bpf(BPF_PROG_QUERY, attr)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:  # ENOSPC: more than `room`, their count given
                raise
        (count,) = struct.unpack_from("=I", attr, 24)
        if count <= room:
            return list(ids[:count])
        room = count


def link_pin(pin_dir: str, ifindex: int, egress: bool) -> str:
    return os.path.join(pin_dir, f"{LINK_PIN}{ifindex}-{'out' if egress else 'in'}")


def attach_links(tc: Filters, pin_dir: str, index: dict[str, int], uplinks: tuple[str, ...],
                 progs: dict[tuple[bool, bool, bool], tuple[int, int, bytes]], gate_mark: int, gate_pref: int,
                 was_gated: dict[str, str | None]) -> tuple[list[str], dict[str, str | None]]:
    """A pinned tcx link on each hook of each device, running the current program: on the egress
    the gated one where `gate_blocker` finds nothing it would skip. A pin whose link lost its
    device (the ifindex reused by a new one) is replaced. `progs`: PROGRAMS' keys -> (fd, id, tag);
    `was_gated` is the last attach's answer. -> (changes made, device -> None (its egress link gates) or
    why not)."""
    done: list[str] = []
    checked: set[str] = set()  # the pins looked at here: the prune skips them
    clsact = tc.chan.clsact_devices() if gate_mark else set()
    gated: dict[str, str | None] = {}
    with nlwire.in_netns(tc.netns):  # links name their device by ifindex
        for dev, idx in index.items():
            for egress in (False, True):
                hook = "egress" if egress else "ingress"
                pin = link_pin(pin_dir, idx, egress)
                checked.add(os.path.basename(pin))
                fd = get_pinned(pin)
                linked = None  # the program our link on this hook runs
                if fd is not None:
                    try:
                        kind, prog, ifindex, attach_type = link_info(fd)
                    except BaseException:
                        os.close(fd)
                        raise
                    if (kind, ifindex, attach_type) == (BPF_LINK_TYPE_TCX, idx, BPF_TCX[egress]):
                        linked = prog
                    else:
                        os.close(fd)
                        os.unlink(pin)  # the link of a device that went: released
                        fd = None
                blocker = None
                if egress and gate_mark:
                    blocker = gated[dev] = gate_blocker(tc, idx, idx in clsact, linked, gate_pref)
                    if blocker is not None and was_gated.get(dev, "") != blocker:
                        log.warning("ebpf: %s egress: every packet meets the shaper's filter there (~100 ns "
                                    "more for internal ones): %s", dev, blocker)
                prog_fd, prog_id, _ = progs[(dev in uplinks, egress, bool(egress and gate_mark and blocker is None))]
                if fd is not None:
                    try:
                        if linked != prog_id:
                            bpf(BPF_LINK_UPDATE, bpf_attr("=IIII", fd, prog_fd, 0, 0))
                            done.append(f"update tcx link {dev} {hook}")
                    finally:
                        os.close(fd)
                    continue
                try:
                    fd = bpf(BPF_LINK_CREATE, bpf_attr("=IIII", prog_fd, idx, BPF_TCX[egress], 0))
                except OSError as exc:
                    if exc.errno == errno.ENODEV:
                        continue  # gone meanwhile
                    raise
                try:
                    pin_object(fd, pin)
                finally:
                    os.close(fd)
                done.append(f"tcx link {dev} {hook}")
    done += prune_links(pin_dir, checked)
    return done, gated


def gate_blocker(tc: Filters, ifindex: int, has_clsact: bool, linked: int | None, gate_pref: int) -> str | None:
    """Why the egress link of this device (running program `linked`, None: no link yet, it will be
    the last) may not end the hook for an unmarked packet, or None: a tcx program after ours, or a
    clsact filter but the shaper's (and our own of the tc way), would not see such packets any more."""
    try:
        chain = tcx_programs(ifindex, True)
    except OSError as exc:
        return f"its tcx programs cannot be listed ({exc.strerror})"
    if len(chain) > 64:
        return f"{len(chain)} tcx programs on it"
    if linked is not None and linked in chain and chain[-1] != linked:
        return f"the tcx program {chain[-1]} runs after netagent's"
    if has_clsact:
        for handle, info, payload in tc.chan.dump_filters(ifindex, CLSACT_EGRESS):
            pref = info >> 16
            if not handle or pref == gate_pref:
                continue  # a chain header, or the shaper's redirect
            if pref == tc.pref:
                if nlwire.text(bpf_options(payload).get(TCA_BPF_NAME, b"")) in OUR_NAMES["egress"]:
                    continue  # our own filter of the tc way, removed right after
            return f"a tc filter at pref {pref:#x} on its egress is not netagent's"
    return None


def prune_links(pin_dir: str, checked: set[str]) -> list[str]:
    """Remove the pins of links whose device went (their programs were detached with it); those in
    `checked` are the listed devices' own, just looked at."""
    removed = []
    for name in os.listdir(pin_dir):
        if not name.startswith(LINK_PIN) or name in checked:
            continue
        pin = os.path.join(pin_dir, name)
        fd = get_pinned(pin)
        if fd is None:
            continue
        try:
            gone = link_info(fd)[2] == 0
        finally:
            os.close(fd)
        if gone:
            os.unlink(pin)
            removed.append(f"pin of a gone device's link {name}")
    return removed


def drop_links(pin_dir: str, index: dict[str, int]) -> list[str]:
    """Unpin our links on these devices: released, they detach their programs."""
    removed = []
    for dev, idx in index.items():
        for egress in (False, True):
            pin = link_pin(pin_dir, idx, egress)
            if os.path.lexists(pin):
                os.unlink(pin)
                removed.append(f"tcx link {dev} {'egress' if egress else 'ingress'}")
    return removed
