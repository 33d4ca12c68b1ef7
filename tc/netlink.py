"""The only module that talks to the kernel's traffic control: pyroute2 over netlink.

`Shaper` reads the kernel (observe), applies the operations `tc.diff.plan_ops`
computed (apply), reads counters in one class dump (stats) and removes exactly
what netagent created (cleanup). No `tc` subprocess anywhere.
"""
from __future__ import annotations

import logging
import socket
from contextlib import contextmanager
from dataclasses import dataclass

import nlwire  # noqa: F401  (first: pyroute2 without its __init__, see nlwire.lean_pyroute2)
from pyroute2.iproute import IPRoute, NetNS
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, nla
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import (
    RTM_DELQDISC,
    RTM_DELTCLASS,
    RTM_NEWQDISC,
    RTM_NEWTCLASS,
    RTM_NEWTFILTER,
)
from pyroute2.netlink.rtnl.tcmsg import sched_bpf, sched_htb, sched_pfifo, tcmsg
from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime
from pyroute2.netlink.rtnl.tcmsg.common_act import get_tca_action

from . import markfilter, rawnl, sizing
from .diff import Op, plan_ops
from .errors import TcError
from .model import (
    UPLOAD_IFB_ALIAS,
    IFB_ALIASES,
    ClassStats,
    ObservedClass,
    ObservedFilter,
    ObservedLeaf,
    ObservedShaper,
    ShaperSpec,
    pod_of_leaf,
)

log = logging.getLogger(__name__)

IFB_ALIAS = UPLOAD_IFB_ALIAS  # marks the upload IFB as ours (the download IFB: tc.model.DOWNLOAD_IFB_ALIAS)
TC_H_CLSACT = 0xFFFFFFF1
CLSACT_INGRESS = 0xFFFFFFF2  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)
CLSACT_EGRESS = 0xFFFFFFF3  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_EGRESS)
ETH_P_ALL = 0x0003
FILTER_HANDLE = 0x1


def _tcmsg_with_options(options: type, name: str) -> type:
    """A tcmsg whose TCA_OPTIONS are coded by `options` (our encoders for what pyroute2 codes
    otherwise, or not at all). pyroute2 caches compiled NLA tables per class and subclasses inherit
    the cache flag: it is reset so that this nla_map is compiled."""
    return type(name, (tcmsg,), {
        "_nlmsg_base__compiled_nla": False,
        "nla_map": tuple(("TCA_OPTIONS", "own_options") if n[0] == "TCA_OPTIONS" else n for n in tcmsg.nla_map),
        "own_options": options,
    })


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


class _HtbOptions(sched_htb.options):
    """HTB options whose parameters encode without rate tables.

    pyroute2 fills two 256-entry rate tables while encoding every class (~0.35 ms
    each class, half of a 110-pod apply); we never send them: HTB computes rates
    from the 64-bit rate itself."""

    _nlmsg_base__compiled_nla = False

    class htb_parms(sched_htb.options.htb_parms):
        def encode(self):
            nla.encode(self)


class _TbfOptions(nla):
    """tbf options: the parameters as raw struct tc_tbf_qopt, the 64-bit rate and the bucket in bytes
    (pyroute2's encoder has neither TCA_TBF_RATE64 nor TCA_TBF_BURST, and sends rate tables)."""

    nla_flags = 0x8000
    nla_map = (
        ("TCA_TBF_UNSPEC", "none"),
        ("TCA_TBF_PARMS", "cdata"),
        ("TCA_TBF_RTAB", "cdata"),
        ("TCA_TBF_PTAB", "cdata"),
        ("TCA_TBF_RATE64", "uint64"),
        ("TCA_TBF_PRATE64", "uint64"),
        ("TCA_TBF_BURST", "uint32"),
    )


_CbpfTcmsg = _tcmsg_with_options(_CbpfOptions, "_CbpfTcmsg")
_HtbTcmsg = _tcmsg_with_options(_HtbOptions, "_HtbTcmsg")
# pfifo and bfifo share struct tc_fifo_qopt (a u32 limit: packets or bytes); pyroute2 knows only
# pfifo's encoder, so bfifo's options are sent with it
_FifoTcmsg = _tcmsg_with_options(sched_pfifo.options, "_FifoTcmsg")
_TbfTcmsg = _tcmsg_with_options(_TbfOptions, "_TbfTcmsg")

TC_LINKLAYER_ETHERNET = 1  # a rate that names its link layer needs no rate table


def tbf_options(rate_bytes: int, burst_bytes: int, limit_bytes: int) -> dict:
    """A TBF with this rate (bytes/s), bucket (bytes: the largest packet it passes whole; a larger
    GSO packet is split into segments) and queue limit (bytes).

    The kernel reports the bucket only as its time in 64 ns ticks, 0 at the segmenter's rate, so a
    restarted agent could not tell which MTU it was sized for. The bucket's bytes are therefore also
    written to the peak bucket's field (struct tc_tbf_qopt.mtu), which TBF keeps and reports as given
    and ignores while there is no peak rate."""
    parms = rawnl.TBF_QOPT.pack(0, TC_LINKLAYER_ETHERNET, 0, 0, 0, min(rate_bytes, 0xFFFFFFFF),
                                0, 0, 0, 0, 0, 0, limit_bytes, 0, burst_bytes)
    attrs = [["TCA_TBF_PARMS", parms], ["TCA_TBF_BURST", burst_bytes]]
    if rate_bytes > 0xFFFFFFFF:
        attrs.append(["TCA_TBF_RATE64", rate_bytes])
    return {"attrs": attrs}


def _ticks(rate_bytes: int, size: int) -> int:
    return int(calc_xmittime(rate_bytes, size))


def tc_message(msg_type: int, flags: int, index: int, handle: int, parent: int, kind: str | None = None,
               options=None, cls=tcmsg, info: int = 0):
    """One tc request (qdisc, class or filter) for a batch, asking for an acknowledgement."""
    msg = cls()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = index
    msg["handle"] = handle
    msg["parent"] = parent
    msg["info"] = info
    msg["attrs"] = []
    if kind:
        msg["attrs"].append(["TCA_KIND", kind])
    if options is not None:
        msg["attrs"].append(["TCA_OPTIONS", options])
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
    return msg


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
        self._chan: rawnl.NetlinkChannel | None = None

    # -- connection ---------------------------------------------------------
    @property
    def ipr(self) -> IPRoute:
        if self._ipr is None:
            try:
                self._ipr = NetNS(self.netns) if self.netns else IPRoute()
            except Exception as exc:  # pyroute2 raises a mix of OSError/FileNotFoundError
                raise TcError(f"cannot open netlink in network namespace {self.netns!r}: {exc}") from exc
        return self._ipr

    @property
    def chan(self) -> rawnl.NetlinkChannel:
        if self._chan is None:
            self._chan = rawnl.open_channel(self.netns, TcError)
        return self._chan

    def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    def __enter__(self) -> "Shaper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _index(self, name: str) -> int | None:
        link = self._link(name)
        return link.index if link else None

    def _link(self, name: str) -> rawnl.RawLink | None:
        try:
            return self.chan.get_link(name)
        except OSError as exc:
            raise TcError(f"reading device {name!r} in network namespace {self.netns!r} failed: {exc}") from exc

    # -- observe ------------------------------------------------------------
    def observe(self, spec: ShaperSpec) -> ObservedShaper:
        obs = ObservedShaper()
        link = self._link(spec.ifb)
        if link is not None:
            ifb = obs.ifb_index = link.index
            obs.ifb_ours = link.kind == "ifb" and link.alias == spec.ifb_alias
            if not obs.ifb_ours:
                raise TcError(
                    f"a device named {spec.ifb!r} exists and is not netagent's IFB "
                    f"(kind {link.kind!r}, alias {link.alias!r}); "
                    "choose another --ifb name or remove that device"
                )
            obs.ifb_up = link.up
            obs.ifb_txqueuelen = link.txqlen
            self._observe_ifb_qdiscs(ifb, spec, obs)
        if len(spec.devices) > 2:
            # many devices (the pod devices of the download shaper): one link dump and one qdisc
            # dump for all of them, then one filter dump each
            try:
                links = {name: (i, mtu) for name, _, i, mtu in self.chan.dump_links()}
                clsact = self.chan.clsact_devices()
            except OSError as exc:
                raise TcError(f"reading devices in network namespace {self.netns!r} failed: {exc}") from exc
            for up in spec.devices:
                idx, mtu = links.get(up, (None, 0))
                obs.uplink_index[up] = idx
                if idx is not None:
                    obs.feed_mtu = max(obs.feed_mtu, mtu)
                    self._observe_uplink(up, idx, spec, obs, idx in clsact)
            return obs
        for up in spec.devices:
            up_link = self._link(up)
            idx = obs.uplink_index[up] = up_link.index if up_link else None
            if up_link is not None:
                obs.feed_mtu = max(obs.feed_mtu, up_link.mtu)
                self._observe_uplink(up, up_link.index, spec, obs)
        return obs

    def _observe_ifb_qdiscs(self, ifb: int, spec: ShaperSpec, obs: ObservedShaper) -> None:
        for handle, parent, payload in self.chan.dump_qdiscs(ifb):
            q = rawnl.parse_qdisc(handle, parent, payload)
            if parent == 0xFFFFFFFF:
                obs.root_kind = q.kind
                obs.root_handle_major = handle >> 16
                obs.root_default_minor = q.htb_default
            elif (parent >> 16) == spec.major and q.kind:
                obs.leaves[parent & 0xFFFF] = ObservedLeaf(parent & 0xFFFF, q.kind, handle >> 16, q.limit,
                                                           q.tbf_rate, q.tbf_mtu)
        if obs.root_kind != "htb":
            return
        for c in self._htb_classes(ifb, spec.major):
            parent = c.parent
            obs.classes[c.handle & 0xFFFF] = ObservedClass(
                minor=c.handle & 0xFFFF,
                parent_minor=0 if parent in (spec.major << 16, 0xFFFFFFFF) else parent & 0xFFFF,
                rate_bytes=c.rate_bytes,
                ceil_bytes=c.ceil_bytes,
                buffer=c.buffer,
                cbuffer=c.cbuffer,
                quantum=c.quantum,
                prio=c.prio,
            )

    def _htb_classes(self, ifindex: int, major: int) -> list[rawnl.RawClass]:
        out = []
        for handle, parent, payload in self.chan.dump_classes(ifindex, major):
            if handle >> 16 != major:
                continue
            c = rawnl.parse_htb_class(handle, parent, payload)
            if c is not None:
                out.append(c)
        return out

    def _observe_uplink(self, up: str, idx: int, spec: ShaperSpec, obs: ObservedShaper,
                        has_clsact: bool | None = None) -> None:
        obs.uplink_clsact[up] = self._has_clsact(idx) if has_clsact is None else has_clsact
        found: list[ObservedFilter] = []
        if obs.uplink_clsact[up]:
            # raw dump and decode (pyroute2's get_filters costs ~2 ms a device: 110 pod devices
            # made every download reconcile ~250 ms)
            for handle, info, payload in self.chan.dump_filters(idx, CLSACT_EGRESS):
                pref = info >> 16
                if pref != spec.filter_pref or not handle:
                    continue  # the chain header, or somebody else's filter
                f = rawnl.parse_filter(payload)
                bit = markfilter.mark_bit_of(f.bpf_ops) if f.kind == "bpf" and f.bpf_ops else None
                found.append(ObservedFilter(up, pref, handle, f.kind, bit,
                                            f.mirred_ifindex if f.mirred_eaction == 1 else None))
        obs.filters[up] = found

    def _has_clsact(self, ifindex: int) -> bool:
        return any(
            parent == TC_H_CLSACT and rawnl.parse_qdisc(h, parent, payload).kind == "clsact"
            for h, parent, payload in self.chan.dump_qdiscs(ifindex)
        )

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
            bit = markfilter.mark_bit_of(ops) if ops else None
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
        """Make the kernel match `spec`. A second call with the same spec makes no change.

        Device changes go through pyroute2; every tc change of the reconcile is then
        sent in one netlink batch, in the order `plan_ops` chose (IFB and classes
        before the redirect filter, deletions last). On a failure the error names
        the operation; everything before it is in force and consistent.
        """
        ops = self.plan(spec)
        missing = [op.device for op in ops if op.action == "missing_uplink"]
        if missing and spec.optional_devices:
            # a pod's device that went since it was listed: nothing to shape there any more
            ops = [op for op in ops if op.action != "missing_uplink"]
            missing = []
        if missing:
            raise TcError(
                f"uplink device(s) {', '.join(missing)} not found; nothing was changed "
                "(check --uplink, or the default-route device)"
            )
        try:
            for op in ops:
                if op.action in ("create_ifb", "set_ifb"):
                    self._link_op(op, spec)
            index = {name: self._index(name) for name in (spec.ifb, *spec.devices)}
            tc_ops = [op for op in ops if op.action not in ("create_ifb", "set_ifb")]
            if spec.optional_devices:  # a pod device gone since observe: its ops go with it
                tc_ops = [op for op in tc_ops if not op.device or index.get(op.device) is not None]
            messages = [self._message(op, spec, index) for op in tc_ops]
        except NetlinkError as exc:
            raise TcError(f"tc: preparing the IFB {spec.ifb} failed: {exc}") from exc
        if messages:
            for op, err in zip(tc_ops, self.chan.batch(messages)):
                if err:
                    raise TcError(f"tc operation '{op}' failed: {rawnl.errno_name(err)}")
        if ops:
            log.info("tc: applied %d change(s): %s", len(ops), ", ".join(map(str, ops[:8])) + (" ..." if len(ops) > 8 else ""))
        return ApplyResult(ops)

    def _link_op(self, op: Op, spec: ShaperSpec) -> None:
        ipr = self.ipr
        if op.action == "create_ifb":
            ipr.link("add", ifname=spec.ifb, kind="ifb")
            idx = self._index(spec.ifb)
            # txqueuelen before any qdisc is attached (HTB sizes its direct queue from it)
            ipr.link("set", index=idx, ifalias=spec.ifb_alias, txqlen=spec.ifb_txqueuelen)
            ipr.link("set", index=idx, state="up")
        else:
            ipr.link("set", index=self._index(spec.ifb), txqlen=spec.ifb_txqueuelen, state="up")

    def _message(self, op: Op, spec: ShaperSpec, index: dict[str, int | None]):
        a = op.action
        ifb = index[spec.ifb]
        root = spec.major << 16
        create = NLM_F_CREATE | NLM_F_EXCL
        if a == "delete_root":
            return tc_message(RTM_DELQDISC, 0, ifb, 0, 0xFFFFFFFF)
        if a in ("add_root", "change_root"):
            opts = sched_htb.get_parameters({"default": spec.default.minor, "r2q": sizing.R2Q})
            return tc_message(RTM_NEWQDISC, create if a == "add_root" else NLM_F_REPLACE, ifb, root, 0xFFFFFFFF, "htb", opts)
        if a in ("add_class", "change_class"):
            p = op.params
            parent = root | p.parent_minor if p.parent_minor else root
            opts = sched_htb.get_class_parameters({
                "rate": p.rate_bytes, "ceil": p.ceil_bytes, "burst": p.burst_bytes, "cburst": p.cburst_bytes,
                "quantum": p.quantum, "prio": p.prio,
            })
            # rate tables are legacy (the kernel computes rates itself); skip their 2 KB per class
            opts["attrs"] = [x for x in opts["attrs"] if x[0] not in ("TCA_HTB_RTAB", "TCA_HTB_CTAB")]
            return tc_message(RTM_NEWTCLASS, create if a == "add_class" else 0, ifb, root | p.minor, parent, "htb", opts,
                               _HtbTcmsg)
        if a == "delete_class":
            # HTB destroys the class's leaf qdisc with it
            return tc_message(RTM_DELTCLASS, 0, ifb, root | op.minor, 0)
        if a == "delete_leaf":
            return tc_message(RTM_DELQDISC, 0, ifb, op.minor << 16, root | op.minor)
        if a == "replace_leaf":
            if op.leaf_kind in ("pfifo", "bfifo"):
                options, cls = {"limit": op.leaf_limit}, _FifoTcmsg
            elif op.leaf_kind == "tbf":
                options, cls = tbf_options(op.leaf_rate, op.leaf_burst, op.leaf_limit), _TbfTcmsg
            else:
                options, cls = {"attrs": []}, tcmsg
            return tc_message(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE, ifb, op.minor << 16, root | op.minor,
                               op.leaf_kind, options, cls)
        if a == "add_clsact":
            return tc_message(RTM_NEWQDISC, create, index[op.device], 0xFFFF0000, TC_H_CLSACT, "clsact")
        if a in ("add_filter", "replace_filter"):
            return self._filter_message(index[op.device], ifb, spec, replace=a == "replace_filter")
        raise TcError(f"unknown tc operation {a!r}")

    def _filter_message(self, uplink_index: int, ifb_index: int, spec: ShaperSpec, replace: bool):
        program = markfilter.encode(markfilter.mark_test(spec.mark_bit))
        action = get_tca_action(
            {"action": {"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": ifb_index}}
        )
        options = {
            "attrs": [
                ["TCA_BPF_OPS_LEN", len(program) // 8],
                ["TCA_BPF_OPS", program],
                ["TCA_BPF_NAME", f"netagent-mark-{spec.mark_bit:#x}"],
                ["TCA_BPF_ACT", action],
            ]
        }
        flags = NLM_F_CREATE | (NLM_F_REPLACE if replace else NLM_F_EXCL)
        msg = tc_message(RTM_NEWTFILTER, flags, uplink_index, FILTER_HANDLE, CLSACT_EGRESS, "bpf", options, _CbpfTcmsg)
        msg["info"] = (spec.filter_pref << 16) | socket.htons(ETH_P_ALL)
        return msg

    def add_tbf_root(self, index: int, rate_bytes: int, burst_bytes: int, limit_bytes: int) -> int:
        """A tbf root qdisc (the probe's test); -> the kernel's errno, 0 on success."""
        msg = tc_message(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, index, 0x10000, 0xFFFFFFFF, "tbf",
                          tbf_options(rate_bytes, burst_bytes, limit_bytes), _TbfTcmsg)
        return self.chan.batch([msg])[0]

    def add_fifo_root(self, index: int, kind: str, limit: int) -> int:
        """A pfifo or bfifo root qdisc with its limit (the probe's test; pyroute2 cannot encode bfifo's
        options); -> the kernel's errno, 0 on success."""
        msg = tc_message(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, index, 0x10000, 0xFFFFFFFF, kind, {"limit": limit},
                          _FifoTcmsg)
        return self.chan.batch([msg])[0]

    def _redirect_filter(self, uplink: str, spec: ShaperSpec, replace: bool) -> None:
        msg = self._filter_message(self._index(uplink), self._index(spec.ifb), spec, replace)
        err = self.chan.batch([msg])[0]
        if err:
            raise TcError(f"installing the redirect filter on {uplink} failed: {rawnl.errno_name(err)}")

    def has_device(self, name: str) -> bool:
        return self._link(name) is not None

    def devices_of_kind(self, kinds: tuple[str, ...] = ("veth",), exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
        """Names of the namespace's devices of these kinds (sorted), less `exclude`: the
        pod-facing devices downloads are redirected from (host-side veths, also bridge ports)."""
        try:
            links = self.chan.dump_links()
        except OSError as exc:
            raise TcError(f"listing devices in network namespace {self.netns!r} failed: {exc}") from exc
        return tuple(sorted(name for name, kind, _, _ in links if kind in kinds and name and name not in exclude))

    # -- stats ----------------------------------------------------------------
    def stats(self, ifb: str, major: int = 0x1) -> dict[int, ClassStats]:
        """Counters of every HTB class on the IFB but the pods' leaves, from one class dump; a pod's
        entry (its inner class) carries its leaves' drops, backlog and overlimits too (as
        `fold_leaves` does; only the counters are decoded: `rawnl.class_counters`)."""
        idx = self._index(ifb)
        if idx is None:
            return {}
        return fold_counters(self.chan.dump_class_counters(idx, major))

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
            if not self._has_clsact(idx):
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
                for parent in (CLSACT_EGRESS, CLSACT_INGRESS)
                for f in self.ipr.get_filters(index=idx, parent=parent)
            ]
            if not others:
                self.ipr.tc("del", index=idx, parent=TC_H_CLSACT)
                done.append(f"clsact {up}")
        idx = self._index(ifb)
        if idx is not None:
            link = self.ipr.get_links(idx)[0]
            if link.get_attr("IFLA_IFALIAS") in IFB_ALIASES:
                self.ipr.link("del", index=idx)
                done.append(f"ifb {ifb}")
            else:
                log.warning("tc cleanup: %s is not netagent's IFB; left alone", ifb)
        return done


def fold_counters(raw: dict[int, tuple[int, ...]]) -> dict[int, ClassStats]:
    """`fold_leaves` of `rawnl.class_counters` tuples (by minor), building a ClassStats only per
    entry kept: a pod's leaves' drops, overlimits and backlog added to the pod's class."""
    pods: dict[int, list[int]] = {}
    for minor, c in raw.items():
        pod = pod_of_leaf(minor)
        if pod is not None and pod in raw:
            # bytes, packets, drops, overlimits, backlog bytes, backlog packets, rate, ceil
            p = pods.get(pod) or pods.setdefault(pod, list(raw[pod]))
            p[2] += c[2]
            p[3] += c[3]
            p[4] += c[4]
            p[5] += c[5]
    return {minor: ClassStats(minor, *(pods.get(minor) or c)) for minor, c in raw.items()
            if minor in pods or pod_of_leaf(minor) not in raw}


@contextmanager
def shaper(netns: str | None = None):
    s = Shaper(netns)
    try:
        yield s
    finally:
        s.close()
