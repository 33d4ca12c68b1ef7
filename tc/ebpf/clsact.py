"""clsact filters: the counting programs as cls_bpf filters in direct-action mode on a clsact qdisc,
where the kernel has no tcx (Linux < 6.6), and the removal of the counter's filters and qdiscs.
"""
from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterable
from typing import NamedTuple

import nlwire  # first: pyroute2 without its __init__ (nlwire.lean_pyroute2)
from pyroute2.netlink import NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE
from pyroute2.netlink.rtnl import RTM_DELQDISC, RTM_DELTFILTER, RTM_NEWQDISC, RTM_NEWTFILTER
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from .. import rawnl
from ..netlink import CLSACT_EGRESS, CLSACT_INGRESS, ETH_P_ALL, FILTER_HANDLE, TC_H_CLSACT, tc_message
from .syscall import EbpfError

TCA_BPF_FLAG_ACT_DIRECT = 1
TCA_BPF_NAME, TCA_BPF_FLAGS, TCA_BPF_ID = 7, 8, 11
# the two hooks: (clsact parent, the filter's name, is it the device's egress), on a pod's device and on an uplink
HOOKS = {"ingress": (CLSACT_INGRESS, "netagent-count-in", False), "egress": (CLSACT_EGRESS, "netagent-count-out", True)}
NODE_HOOKS = {"ingress": (CLSACT_INGRESS, "netagent-node-in", False), "egress": (CLSACT_EGRESS, "netagent-node-out", True)}
OUR_NAMES = {hook: {HOOKS[hook][1], NODE_HOOKS[hook][1]} for hook in HOOKS}


class Found(NamedTuple):
    """A filter at the counter's pref, as a dump shows it (name empty: not a cls_bpf filter)."""

    handle: int
    name: str
    prog_id: int
    flags: int


def bpf_options(payload: bytes) -> dict:
    """A dumped filter's cls_bpf options by attribute type; empty for a filter of another kind."""
    a = rawnl.attrs(payload)
    return rawnl.attrs(a.get(rawnl.TCA_OPTIONS, b"")) if a.get(rawnl.TCA_KIND, b"").rstrip(b"\0") == b"bpf" else {}


def _u32(value: bytes | None) -> int:
    return struct.unpack_from("=I", value)[0] if value is not None and len(value) >= 4 else 0


class Filters:
    """The counter's filters at one pref on the devices of one network namespace, over one netlink
    channel: what attach, detach and remove_counting share."""

    def __init__(self, netns: str | None, pref: int):
        self.netns = netns
        self.pref = pref
        self._chan: rawnl.NetlinkChannel | None = None

    @property
    def chan(self) -> rawnl.NetlinkChannel:
        if self._chan is None:
            self._chan = rawnl.open_channel(self.netns, EbpfError)
        return self._chan

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    def at_pref(self, ifindex: int) -> dict[str, tuple[list[Found], int]]:
        """Per hook: the filters at our pref, and how many filter messages the hook's dump had in all
        (anyone's, chain headers too)."""
        out = {}
        for hook, (parent, _, _) in HOOKS.items():
            found, total = [], 0
            for handle, info, payload in self.chan.dump_filters(ifindex, parent):
                total += 1
                if info >> 16 != self.pref or not handle:
                    continue  # somebody else's, or a chain header
                o = bpf_options(payload)
                found.append(Found(handle, nlwire.text(o.get(TCA_BPF_NAME, b"")), _u32(o.get(TCA_BPF_ID)),
                                   _u32(o.get(TCA_BPF_FLAGS))))
            out[hook] = (found, total)
        return out

    def indexes(self, devices: Iterable[str]) -> dict[str, int]:
        try:
            links = {name: index for name, _, index, _ in self.chan.dump_links()}
        except OSError as exc:
            raise EbpfError(f"listing devices in network namespace {self.netns!r} failed: {exc}") from exc
        return {d: links[d] for d in dict.fromkeys(devices) if d in links}  # a device that is gone: nothing to do

    def send(self, ops: list[tuple[str, tcmsg]]) -> list[str]:
        """Send the messages in one batch; -> the descriptions of those done. A device that went
        meanwhile (ENODEV, or ENOENT for what it held) is skipped."""
        done = []
        for (what, _), err in zip(ops, self.chan.batch([m for _, m in ops]) if ops else []):
            if not err:
                done.append(what)
            elif err not in (errno.ENODEV, errno.ENOENT):
                raise EbpfError(f"tc: {what} failed: {rawnl.errno_name(err)}")
        return done

    def detach(self, devices: Iterable[str]) -> list[str]:
        """Remove our filters (our pref and our name) from these devices, and the clsact qdisc of a
        device we removed one from when no filter (anyone's) remains on it. -> what was removed."""
        removed: list[str] = []
        try:
            index = self.indexes(devices)
            clsact = self.chan.clsact_devices()
            for dev, idx in index.items():
                if idx not in clsact:
                    continue
                ops = [(f"filter {dev} {hook} pref {self.pref:#x}",
                        tc_message(RTM_DELTFILTER, 0, idx, handle, HOOKS[hook][0], "bpf",
                                   info=(self.pref << 16) | socket.htons(ETH_P_ALL)))
                       for hook, (filters, _) in self.at_pref(idx).items()
                       for handle, name, *_ in filters if name in OUR_NAMES[hook]]
                done = self.send(ops)
                removed += done
                if done and not any(total for _, total in self.at_pref(idx).values()):
                    removed += self.send([(f"clsact {dev}",
                                           tc_message(RTM_DELQDISC, 0, idx, 0xFFFF0000, TC_H_CLSACT))])
        except OSError as exc:
            raise EbpfError(f"tc in network namespace {self.netns!r}: {exc}") from exc
        return removed


def attach_filters(tc: Filters, index: dict[str, int], uplinks: tuple[str, ...], taken: list[str],
                   progs: dict[tuple[bool, bool, bool], tuple[int, int, bytes]]) -> list[str]:
    """A clsact qdisc and our filter at our pref on each hook of each device, running the current
    program (`progs`: PROGRAMS' keys -> (fd, id, tag)); a device where another filter holds our pref is
    added to `taken`. A filter runs the current program when its id is the loaded one's: set_networks
    adopted the pinned program when it was the one it would load (the same tag and our map), so the filter
    of a restarted agent runs exactly that program."""
    clsact = tc.chan.clsact_devices()
    ops: list[tuple[str, tcmsg]] = []
    for dev, idx in index.items():
        uplink = dev in uplinks
        if idx not in clsact:
            ops.append((f"add clsact to {dev}",
                        tc_message(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, idx, 0xFFFF0000, TC_H_CLSACT,
                                   "clsact")))
            found: dict[str, tuple[list[Found], int]] = {hook: ([], 0) for hook in HOOKS}
        else:
            found = tc.at_pref(idx)
        for hook, (parent, name, egress) in (NODE_HOOKS if uplink else HOOKS).items():
            filters = found[hook][0]
            if any(f.name not in OUR_NAMES[hook] for f in filters):
                taken.append(f"{dev} {hook}: another filter holds pref {tc.pref:#x} (remove it, or give the "
                             "counter another pref)")
                continue
            stale = [f.handle for f in filters if not (f.name == name and f.flags & TCA_BPF_FLAG_ACT_DIRECT and
                                                       progs[(uplink, egress, False)][1] == f.prog_id)]
            options = {"attrs": [["TCA_BPF_FD", progs[(uplink, egress, False)][0]], ["TCA_BPF_NAME", name],
                                 ["TCA_BPF_FLAGS", TCA_BPF_FLAG_ACT_DIRECT]]}
            for handle in stale or ([] if filters else [FILTER_HANDLE]):
                ops.append((f"{'replace' if filters else 'add'} filter {dev} {hook} pref {tc.pref:#x}",
                            tc_message(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_REPLACE, idx, handle, parent,
                                       "bpf", options, info=(tc.pref << 16) | socket.htons(ETH_P_ALL))))
    return tc.send(ops)


def remove_counting(devices: Iterable[str], pref: int = 0xC001, netns: str | None = None) -> list[str]:
    """InternalCounter.detach without a counter (`netagent cleanup`, or an agent that counts by the rules
    again): needs netlink only, neither bpf(2) nor a bpffs. -> what was removed."""
    filters = Filters(netns, pref)
    try:
        return filters.detach(devices)
    finally:
        filters.close()
