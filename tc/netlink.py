"""The only module that talks to the kernel's traffic control: pyroute2 over netlink.

`Shaper` reads the kernel (observe), applies the operations `tc.diff.plan_ops`
computed (apply), reads counters in one class dump (stats) and removes exactly
what netagent created (cleanup). No `tc` subprocess anywhere.
"""
from __future__ import annotations

import errno
import logging
import socket
from contextlib import contextmanager
from dataclasses import dataclass

from pyroute2 import IPRoute, NetNS
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, nla
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTM_NEWTFILTER
from pyroute2.netlink.rtnl.tcmsg import sched_bpf, tcmsg
from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime
from pyroute2.netlink.rtnl.tcmsg.common_act import get_tca_action

from . import bpf, sizing
from .diff import ClassParams, Op, plan_ops
from .errors import TcError
from .model import ClassStats, ObservedClass, ObservedFilter, ObservedLeaf, ObservedShaper, ShaperSpec

log = logging.getLogger(__name__)

IFB_ALIAS = "netagent: internet egress shaper"  # marks the IFB as ours
TC_H_CLSACT = 0xFFFFFFF1
CLSACT_EGRESS = 0xFFFFFFF3  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)
ETH_P_ALL = 0x0003
FILTER_HANDLE = 0x1


class _CbpfOptions(nla):
    """cls_bpf options with TCA_BPF_OPS as raw bytes (pyroute2 types it as u32)."""

    nla_flags = 0x8000
    nla_map = (
        ("TCA_BPF_UNSPEC", "none"),
        ("TCA_BPF_ACT", "bpf_act"),
        ("TCA_BPF_POLICE", "none"),
        ("TCA_BPF_CLASSID", "uint32"),
        ("TCA_BPF_OPS_LEN", "uint16"),
        ("TCA_BPF_OPS", "cdata"),
        ("TCA_BPF_FD", "uint32"),
        ("TCA_BPF_NAME", "asciiz"),
        ("TCA_BPF_FLAGS", "uint32"),
    )
    bpf_act = sched_bpf.options.bpf_act


class _CbpfTcmsg(tcmsg):
    # pyroute2 caches compiled NLA tables per class and subclasses inherit the
    # cache flag: reset it so our nla_map is compiled.
    _nlmsg_base__compiled_nla = False
    nla_map = tuple(("TCA_OPTIONS", "cbpf_options") if n[0] == "TCA_OPTIONS" else n for n in tcmsg.nla_map)
    cbpf_options = _CbpfOptions


def _ticks(rate_bytes: int, size: int) -> int:
    return int(calc_xmittime(rate_bytes, size))


@dataclass
class ApplyResult:
    ops: list[Op]

    @property
    def changes(self) -> int:
        return len(self.ops)


class Shaper:
    """tc state of one node (a network namespace name, or None for this one)."""

    def __init__(self, netns: str | None = None):
        self.netns = netns
        self._ipr: IPRoute | None = None

    # -- connection ---------------------------------------------------------
    @property
    def ipr(self) -> IPRoute:
        if self._ipr is None:
            try:
                self._ipr = NetNS(self.netns) if self.netns else IPRoute()
            except Exception as exc:  # pyroute2 raises a mix of OSError/FileNotFoundError
                raise TcError(f"cannot open netlink in network namespace {self.netns!r}: {exc}") from exc
        return self._ipr

    def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None

    def __enter__(self) -> "Shaper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _index(self, name: str) -> int | None:
        found = self.ipr.link_lookup(ifname=name)
        return found[0] if found else None

    # -- observe ------------------------------------------------------------
    def observe(self, spec: ShaperSpec) -> ObservedShaper:
        obs = ObservedShaper()
        ifb = self._index(spec.ifb)
        if ifb is not None:
            link = self.ipr.get_links(ifb)[0]
            obs.ifb_index = ifb
            info = link.get_attr("IFLA_LINKINFO")
            kind = info.get_attr("IFLA_INFO_KIND") if info else None
            obs.ifb_ours = kind == "ifb" and link.get_attr("IFLA_IFALIAS") == IFB_ALIAS
            if not obs.ifb_ours:
                raise TcError(
                    f"a device named {spec.ifb!r} exists and is not netagent's IFB "
                    f"(kind {kind!r}, alias {link.get_attr('IFLA_IFALIAS')!r}); "
                    "choose another --ifb name or remove that device"
                )
            obs.ifb_up = bool(link["flags"] & 1)
            obs.ifb_txqueuelen = link.get_attr("IFLA_TXQLEN") or 0
            self._observe_ifb_qdiscs(ifb, spec, obs)
        for up in spec.uplinks:
            idx = self._index(up)
            obs.uplink_index[up] = idx
            if idx is not None:
                self._observe_uplink(up, idx, spec, obs)
        return obs

    def _observe_ifb_qdiscs(self, ifb: int, spec: ShaperSpec, obs: ObservedShaper) -> None:
        for q in self.ipr.get_qdiscs(ifb):
            kind = q.get_attr("TCA_KIND")
            if q["parent"] == 0xFFFFFFFF:
                obs.root_kind = kind
                obs.root_handle_major = q["handle"] >> 16
                if kind == "htb":
                    init = q.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_INIT")
                    obs.root_default_minor = init["defcls"] if init else None
            elif (q["parent"] >> 16) == spec.major and kind:
                limit = None
                if kind == "pfifo":
                    opts = q.get_attr("TCA_OPTIONS")
                    limit = opts["limit"] if opts is not None and "limit" in opts else None
                obs.leaves[q["parent"] & 0xFFFF] = ObservedLeaf(q["parent"] & 0xFFFF, kind, q["handle"] >> 16, limit)
        if obs.root_kind != "htb":
            return
        for c in self.ipr.get_classes(ifb):
            if c.get_attr("TCA_KIND") != "htb" or (c["handle"] >> 16) != spec.major:
                continue
            opts = c.get_attr("TCA_OPTIONS")
            parms = opts.get_attr("TCA_HTB_PARMS")
            rate64, ceil64 = opts.get_attr("TCA_HTB_RATE64"), opts.get_attr("TCA_HTB_CEIL64")
            parent = c["parent"]
            obs.classes[c["handle"] & 0xFFFF] = ObservedClass(
                minor=c["handle"] & 0xFFFF,
                parent_minor=0 if parent == ((spec.major << 16) | 0) or parent == 0xFFFFFFFF else parent & 0xFFFF,
                rate_bytes=rate64 or parms["rate"],
                ceil_bytes=ceil64 or parms["ceil"],
                buffer=parms["buffer"],
                cbuffer=parms["cbuffer"],
                quantum=parms["quantum"],
                prio=parms["prio"],
            )

    def _observe_uplink(self, up: str, idx: int, spec: ShaperSpec, obs: ObservedShaper) -> None:
        obs.uplink_clsact[up] = any(
            q.get_attr("TCA_KIND") == "clsact" for q in self.ipr.get_qdiscs(idx) if q["parent"] == TC_H_CLSACT
        )
        found: list[ObservedFilter] = []
        if obs.uplink_clsact[up]:
            for f in self.ipr.get_filters(index=idx, parent=CLSACT_EGRESS):
                pref = f["info"] >> 16
                if pref != spec.filter_pref or not f["handle"]:
                    continue  # the chain header, or somebody else's filter
                found.append(self._decode_filter(up, f, pref))
        obs.filters[up] = found

    @staticmethod
    def _decode_filter(up: str, f, pref: int) -> ObservedFilter:
        kind = f.get_attr("TCA_KIND")
        bit = ifindex = None
        if kind == "bpf":
            # re-decode the raw message with our cls_bpf layout to read the program bytes
            raw = _CbpfTcmsg(f.data[f.offset : f.offset + f["header"]["length"]])
            raw.decode()
            opts = raw.get_attr("TCA_OPTIONS")
            ops = opts.get_attr("TCA_BPF_OPS") if opts else None
            bit = bpf.mark_bit_of(ops) if ops else None
            act = opts.get_attr("TCA_BPF_ACT") if opts else None
            if act:
                for _, a in act["attrs"]:
                    if a.get_attr("TCA_ACT_KIND") == "mirred":
                        parms = a.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
                        if parms and parms["eaction"] == 1:  # egress redirect
                            ifindex = parms["ifindex"]
        return ObservedFilter(up, pref, f["handle"], kind, bit, ifindex)

    # -- plan + apply ---------------------------------------------------------
    def plan(self, spec: ShaperSpec) -> list[Op]:
        return plan_ops(spec, self.observe(spec), _ticks)

    def apply(self, spec: ShaperSpec) -> ApplyResult:
        """Make the kernel match `spec`. A second call with the same spec makes no change."""
        ops = self.plan(spec)
        missing = [op.device for op in ops if op.action == "missing_uplink"]
        if missing:
            raise TcError(
                f"uplink device(s) {', '.join(missing)} not found; nothing was changed "
                "(check --uplink, or the default-route device)"
            )
        for op in ops:
            try:
                self._do(op, spec)
            except NetlinkError as exc:
                raise TcError(f"tc operation '{op}' failed: {exc} (errno {exc.code})") from exc
        if ops:
            log.info("tc: applied %d change(s): %s", len(ops), ", ".join(map(str, ops[:8])) + (" ..." if len(ops) > 8 else ""))
        return ApplyResult(ops)

    def _do(self, op: Op, spec: ShaperSpec) -> None:
        ipr = self.ipr
        a = op.action
        if a == "create_ifb":
            ipr.link("add", ifname=spec.ifb, kind="ifb")
            idx = self._index(spec.ifb)
            # txqueuelen before any qdisc is attached (HTB sizes its direct queue from it)
            ipr.link("set", index=idx, ifalias=IFB_ALIAS, txqlen=spec.ifb_txqueuelen)
            ipr.link("set", index=idx, state="up")
        elif a == "set_ifb":
            ipr.link("set", index=self._index(spec.ifb), txqlen=spec.ifb_txqueuelen, state="up")
        elif a == "delete_root":
            ipr.tc("del", index=self._index(spec.ifb), parent=0xFFFFFFFF)
        elif a == "add_root":
            ipr.tc("add", "htb", self._index(spec.ifb), spec.major << 16, default=spec.default.minor, r2q=sizing.R2Q)
        elif a == "change_root":
            ipr.tc("change", "htb", self._index(spec.ifb), spec.major << 16, default=spec.default.minor, r2q=sizing.R2Q)
        elif a in ("add_class", "change_class"):
            self._class(a.replace("_class", "-class"), spec, op.params)
        elif a == "delete_class":
            # HTB destroys the class's leaf qdisc with it
            ipr.tc("del-class", index=self._index(spec.ifb), handle=(spec.major << 16) | op.minor)
        elif a == "replace_leaf":
            idx = self._index(spec.ifb)
            parent = (spec.major << 16) | op.minor
            kw = {"limit": op.leaf_limit} if op.leaf_kind == "pfifo" else {}
            ipr.tc("replace", op.leaf_kind, idx, op.minor << 16, parent=parent, **kw)
        elif a == "add_clsact":
            ipr.tc("add", "clsact", self._index(op.device))
        elif a in ("add_filter", "replace_filter"):
            self._redirect_filter(op.device, spec, replace=a == "replace_filter")
        else:
            raise TcError(f"unknown tc operation {a!r}")

    def _class(self, command: str, spec: ShaperSpec, p: ClassParams) -> None:
        parent = (spec.major << 16) | p.parent_minor if p.parent_minor else spec.major << 16
        self.ipr.tc(
            command,
            "htb",
            self._index(spec.ifb),
            (spec.major << 16) | p.minor,
            parent=parent,
            rate=p.rate_bytes,
            ceil=p.ceil_bytes,
            burst=p.burst_bytes,
            cburst=p.cburst_bytes,
            quantum=p.quantum,
            prio=0,
        )

    def _redirect_filter(self, uplink: str, spec: ShaperSpec, replace: bool) -> None:
        idx, ifb = self._index(uplink), self._index(spec.ifb)
        program = bpf.encode(bpf.mark_test(spec.mark_bit))
        msg = _CbpfTcmsg()
        msg["family"] = socket.AF_UNSPEC
        msg["index"] = idx
        msg["handle"] = FILTER_HANDLE
        msg["parent"] = CLSACT_EGRESS
        msg["info"] = (spec.filter_pref << 16) | socket.htons(ETH_P_ALL)
        action = get_tca_action({"action": {"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": ifb}})
        msg["attrs"] = [
            ["TCA_KIND", "bpf"],
            [
                "TCA_OPTIONS",
                {
                    "attrs": [
                        ["TCA_BPF_OPS_LEN", len(program) // 8],
                        ["TCA_BPF_OPS", program],
                        ["TCA_BPF_NAME", f"netagent-mark-{spec.mark_bit:#x}"],
                        ["TCA_BPF_ACT", action],
                    ]
                },
            ],
        ]
        msg["header"]["type"] = RTM_NEWTFILTER
        flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
        msg["header"]["flags"] = flags | (NLM_F_REPLACE if replace else NLM_F_EXCL)
        self.ipr.nlm_request_batch([msg])

    # -- stats ----------------------------------------------------------------
    def stats(self, ifb: str, major: int = 0x1) -> dict[int, ClassStats]:
        """Counters of every HTB class on the IFB, from one class dump."""
        idx = self._index(ifb)
        if idx is None:
            return {}
        out: dict[int, ClassStats] = {}
        for c in self.ipr.get_classes(idx):
            if c.get_attr("TCA_KIND") != "htb" or (c["handle"] >> 16) != major:
                continue
            s2 = c.get_attr("TCA_STATS2")
            basic = s2.get_attr("TCA_STATS_BASIC") if s2 else None
            queue = s2.get_attr("TCA_STATS_QUEUE") if s2 else None
            opts = c.get_attr("TCA_OPTIONS")
            parms = opts.get_attr("TCA_HTB_PARMS") if opts else None
            minor = c["handle"] & 0xFFFF
            out[minor] = ClassStats(
                minor=minor,
                bytes=basic["bytes"] if basic else 0,
                packets=basic["packets"] if basic else 0,
                drops=queue["drops"] if queue else 0,
                overlimits=queue["overlimits"] if queue else 0,
                backlog_bytes=queue["backlog"] if queue else 0,
                backlog_packets=queue["qlen"] if queue else 0,
                rate_bytes=(opts.get_attr("TCA_HTB_RATE64") or parms["rate"]) if parms else 0,
                ceil_bytes=(opts.get_attr("TCA_HTB_CEIL64") or parms["ceil"]) if parms else 0,
            )
        return out

    # -- cleanup --------------------------------------------------------------
    def cleanup(self, ifb: str, uplinks: tuple[str, ...], filter_pref: int = 0xC000) -> list[str]:
        """Remove our redirect filters and our IFB (with its qdiscs); leave everything else.

        The clsact qdisc on an uplink is removed only when no filter of anyone else remains on it.
        """
        done: list[str] = []
        for up in uplinks:
            idx = self._index(up)
            if idx is None:
                continue
            has_clsact = any(
                q.get_attr("TCA_KIND") == "clsact" for q in self.ipr.get_qdiscs(idx) if q["parent"] == TC_H_CLSACT
            )
            if not has_clsact:
                continue
            for parent in (CLSACT_EGRESS,):
                for f in self.ipr.get_filters(index=idx, parent=parent):
                    if f["info"] >> 16 == filter_pref and f["handle"]:
                        decoded = self._decode_filter(up, f, filter_pref)
                        if decoded.mark_bit is None:
                            continue  # same pref, not our program: not ours to delete
                        self.ipr.tc("del-filter", index=idx, parent=parent, handle=f["handle"], prio=filter_pref,
                                    protocol=ETH_P_ALL, kind="bpf")
                        done.append(f"filter {up} egress pref {filter_pref:#x}")
            others = [
                f
                for parent in (CLSACT_EGRESS, 0xFFFFFFF2)
                for f in self.ipr.get_filters(index=idx, parent=parent)
            ]
            if not others:
                self.ipr.tc("del", index=idx, parent=TC_H_CLSACT)
                done.append(f"clsact {up}")
        idx = self._index(ifb)
        if idx is not None:
            link = self.ipr.get_links(idx)[0]
            if link.get_attr("IFLA_IFALIAS") == IFB_ALIAS:
                self.ipr.link("del", index=idx)
                done.append(f"ifb {ifb}")
            else:
                log.warning("tc cleanup: %s is not netagent's IFB; left alone", ifb)
        return done


@contextmanager
def shaper(netns: str | None = None):
    s = Shaper(netns)
    try:
        yield s
    finally:
        s.close()
