"""What this kernel's traffic control offers, found by trying it in a scratch namespace.

Every feature is created, then read back; a feature counts only if the kernel shows
it as created. (An option the kernel accepts and ignores, like u32 `match mark`
without CONFIG_CLS_U32_MARK, is exactly what reading back catches.) The result
decides the leaf qdisc and whether netagent can run at all ("unsupported" is told
apart from "misconfigured" by the caller: a missing HTB or cls_bpf is fatal, a
missing fq_codel only means a pfifo leaf).
"""
from __future__ import annotations

import logging
import secrets
import subprocess
from dataclasses import dataclass, field

from pyroute2 import NetNS
from pyroute2.netlink.exceptions import NetlinkError

from .errors import TcError

log = logging.getLogger(__name__)

QDISCS = ("htb", "tbf", "fq_codel", "fq", "sfq", "cake", "pfifo", "bfifo", "netem", "prio")
REQUIRED_QDISCS = ("htb", "clsact")


@dataclass(frozen=True)
class Capabilities:
    qdiscs: frozenset[str] = field(default_factory=frozenset)
    classifiers: frozenset[str] = field(default_factory=frozenset)
    actions: frozenset[str] = field(default_factory=frozenset)
    ifb: bool = False

    @property
    def leaf_qdisc(self) -> str:
        return "fq_codel" if "fq_codel" in self.qdiscs else "pfifo"

    def missing(self) -> list[str]:
        """What netagent needs and this kernel lacks (empty: we can run)."""
        need = [f"qdisc {q}" for q in REQUIRED_QDISCS if q not in self.qdiscs]
        need += [] if "bpf" in self.classifiers else ["classifier bpf (cls_bpf)"]
        need += [] if "mirred" in self.actions else ["action mirred (act_mirred)"]
        need += [] if self.ifb else ["IFB device (ifb module)"]
        return need

    def as_dict(self) -> dict:
        return {
            "qdiscs": sorted(self.qdiscs),
            "classifiers": sorted(self.classifiers),
            "actions": sorted(self.actions),
            "ifb": self.ifb,
            "leaf_qdisc": self.leaf_qdisc,
            "missing": self.missing(),
        }


def _kinds(ipr, index: int, parent: int | None = None) -> set[str]:
    return {q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index) if parent is None or q["parent"] == parent}


def probe() -> Capabilities:
    """Try each feature in a throwaway namespace (removed afterwards, also on error)."""
    ns = f"na-probe-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        return _probe_in(ns)
    except NetlinkError as exc:
        raise TcError(f"the tc capability probe failed unexpectedly: {exc}") from exc
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _probe_in(ns: str) -> Capabilities:
    from .bpf import encode, mark_test  # local: keeps import of probe cheap
    from .netlink import CLSACT_EGRESS, Shaper

    qdiscs: set[str] = set()
    classifiers: set[str] = set()
    actions: set[str] = set()
    with NetNS(ns) as ipr:
        ipr.link("add", ifname="probe0", kind="veth", peer="probe1")
        idx = ipr.link_lookup(ifname="probe0")[0]
        ipr.link("set", index=idx, state="up")
        ifb = True
        try:
            ipr.link("add", ifname="probeifb", kind="ifb")
            from .netlink import IFB_ALIAS

            ipr.link("set", index=ipr.link_lookup(ifname="probeifb")[0], ifalias=IFB_ALIAS)
        except NetlinkError:
            ifb = False
        for kind in QDISCS:
            kw = {"htb": {"default": 0x10}, "tbf": {"rate": 125000, "burst": 10000, "latency": 50000},
                  "pfifo": {"limit": 100}, "bfifo": {"limit": 100000}}.get(kind, {})
            try:
                ipr.tc("add", kind, idx, 0x10000, **kw)
                if kind in _kinds(ipr, idx):
                    qdiscs.add(kind)
                ipr.tc("del", index=idx, parent=0xFFFFFFFF)
            except (NetlinkError, KeyError, TypeError, ValueError):
                pass
        try:
            ipr.tc("add", "clsact", idx)
            if "clsact" in _kinds(ipr, idx):
                qdiscs.add("clsact")
        except NetlinkError:
            pass
        if "clsact" in qdiscs and ifb:
            # cls_bpf + mirred: exactly the filter netagent installs, read back and decoded
            from .model import DEFAULT_MINOR, HtbClassSpec, ShaperSpec

            spec = ShaperSpec("probeifb", ("probe0",), 0x1, 1_000_000, HtbClassSpec(DEFAULT_MINOR, 8000, 8000))
            s = Shaper.__new__(Shaper)
            s.netns, s._ipr, s._chan = ns, ipr, None
            try:
                s._redirect_filter("probe0", spec, replace=False)
                obs = s.observe(spec).filters.get("probe0", [])
                if obs and obs[0].kind == "bpf":
                    classifiers.add("bpf")
                if obs and obs[0].mark_bit == 0x1 and obs[0].redirect_ifindex:
                    actions.add("mirred")
            except (NetlinkError, TcError) as exc:
                log.info("probe: cls_bpf/mirred not available: %s", exc)
            finally:
                if s._chan is not None:
                    s._chan.close()
                s._ipr, s._chan = None, None
            for kind, kw in (("u32", {"keys": ["0x0/0x0+0"], "target": 0x10001}), ("fw", {"classid": 0x10001}),
                             ("matchall", {"classid": 0x10001}), ("basic", {"classid": 0x10001})):
                try:
                    ipr.tc("add-filter", kind, idx, parent=CLSACT_EGRESS, prio=100 + len(classifiers), **kw)
                    if any(f.get_attr("TCA_KIND") == kind for f in ipr.get_filters(index=idx, parent=CLSACT_EGRESS)):
                        classifiers.add(kind)
                except (NetlinkError, KeyError, TypeError, ValueError):
                    pass
    return Capabilities(frozenset(qdiscs), frozenset(classifiers), frozenset(actions), ifb)


def require(caps: Capabilities) -> None:
    missing = caps.missing()
    if missing:
        raise TcError(
            "this kernel lacks what netagent needs: " + ", ".join(missing)
            + " (load the modules, e.g. `modprobe sch_htb cls_bpf act_mirred ifb`, or use a kernel that has them)"
        )
