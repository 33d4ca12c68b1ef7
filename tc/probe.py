"""What this kernel's traffic control offers, found by trying it on a device of our own.

The probe needs CAP_NET_ADMIN and nothing more (the agent's pod has no CAP_SYS_ADMIN, so
no scratch namespace): in the namespace it is pointed at (the agent's own: the node's)
it creates a short-lived IFB named `nap-<8 hex digits>`, left down and without
addresses so no packet can reach it, tries every feature on it and deletes it again,
also when a step fails. A probe device left by a probe that died half-way is removed
by the next probe (ours: that exact name pattern and kind ifb).

Only what netagent uses is tried (each try loads the kernel module behind it, and loading
netem, cake or sfq on every node of a cluster is not the agent's business): the IFB, HTB,
clsact, fq_codel (the leaf, else pfifo), cls_bpf and act_mirred. Every feature is created,
then read back; a feature counts only if the kernel shows
it as created. (An option the kernel accepts and ignores, like u32 `match mark`
without CONFIG_CLS_U32_MARK, is exactly what reading back catches.) The result
decides the leaf qdisc and whether netagent can run at all ("unsupported" is told
apart from "misconfigured" by the caller: a missing HTB or cls_bpf is fatal, a
missing fq_codel only means a pfifo leaf).
"""
from __future__ import annotations

import errno
import logging
import re
import secrets
from dataclasses import dataclass, field

import nlwire  # noqa: F401  (first: pyroute2 without its __init__, see nlwire.lean_pyroute2)
from pyroute2.netlink.exceptions import NetlinkError

from . import rawnl, sizing
from .errors import TcError
from .model import DEFAULT_MINOR, HtbClassSpec, ObservedShaper, ShaperSpec
from .netlink import Shaper

log = logging.getLogger(__name__)

QDISCS = ("htb", "fq_codel", "tbf", "pfifo")  # the shaper, and the leaf: fq_codel, else a segmenting tbf, else pfifo
REQUIRED_QDISCS = ("htb", "clsact")
PROBE_DEVICE = re.compile(r"nap-[0-9a-f]{8}")  # the one "is ours" test for probe devices
PROBE_ALIAS = "netagent: tc capability probe (short-lived)"  # for whoever sees it in `ip link`
ROOT = 0xFFFFFFFF
PFIFO_LIMIT = 100
# options a qdisc needs to be created at all; pfifo's limit is read back (the leaf must be bounded)
QDISC_OPTIONS = {"htb": {"default": 0x10}, "pfifo": {"limit": PFIFO_LIMIT},
                 # the segmenting leaf's settings: a 64-bit rate, and a bucket the kernel must report back
                 "tbf": {"rate": sizing.SEGMENTER_RATE_BYTES, "burst": 1522, "limit": 100_000}}


@dataclass(frozen=True)
class Capabilities:
    qdiscs: frozenset[str] = field(default_factory=frozenset)
    classifiers: frozenset[str] = field(default_factory=frozenset)
    actions: frozenset[str] = field(default_factory=frozenset)
    ifb: bool = False

    @property
    def leaf_qdisc(self) -> str:
        # fq_codel where the kernel has it; else a tbf that splits GSO packets into frames with a byte
        # limit (tc/sizing.py: it halves the loaded RTT of an HTB leaf, docs/datapath.md); else pfifo.
        # A bfifo leaf (tc/sizing.leaf_limit_bytes) is supported but not chosen: it tail-drops whole
        # GSO packets, which cost single TCP flows goodput at 10 Mbit/s.
        for kind in ("fq_codel", "tbf"):
            if kind in self.qdiscs:
                return kind
        return "pfifo"

    def missing(self) -> list[str]:
        """What netagent needs and this kernel lacks (empty: we can run)."""
        if not self.ifb:
            # the probe tries everything else on an IFB: without one, nothing else is known
            return ["IFB device (ifb module); the other tc features could not be tried without it"]
        need = [f"qdisc {q}" for q in REQUIRED_QDISCS if q not in self.qdiscs]
        need += [] if "bpf" in self.classifiers else ["classifier bpf (cls_bpf)"]
        need += [] if "mirred" in self.actions else ["action mirred (act_mirred)"]
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


def probe(netns: str | None = None) -> Capabilities:
    """Try each feature on a probe IFB in `netns` (a namespace name; None: this process's own).

    Raises TcError when the probe cannot run at all (e.g. no CAP_NET_ADMIN); a kernel
    without IFB is an answer (ifb=False), not an error."""
    shaper = Shaper(netns)
    where = f"network namespace {netns!r}" if netns else "this network namespace"
    try:
        _remove_leftovers(shaper)
        device = f"nap-{secrets.token_hex(4)}"
        try:
            shaper.ipr.link("add", ifname=device, kind="ifb")
        except NetlinkError as exc:
            if exc.code != errno.EOPNOTSUPP:
                raise
            log.warning("tc probe: this kernel cannot create IFB devices (%s)", exc)
            return Capabilities()
        try:
            return _try_features(shaper, device)
        finally:
            _delete(shaper, device)
    except (NetlinkError, OSError) as exc:
        raise TcError(f"the tc capability probe could not run in {where}: {exc} (it needs CAP_NET_ADMIN)") from exc
    finally:
        shaper.close()


def _remove_leftovers(shaper: Shaper) -> None:
    for link in shaper.ipr.get_links():
        name = link.get_attr("IFLA_IFNAME")
        info = link.get_attr("IFLA_LINKINFO")
        kind = info.get_attr("IFLA_INFO_KIND") if info else None
        if PROBE_DEVICE.fullmatch(name or "") and kind == "ifb":
            log.info("tc probe: removing %s, left by an earlier probe", name)
            _delete(shaper, name)


def _delete(shaper: Shaper, device: str) -> None:
    try:
        shaper.ipr.link("del", ifname=device)
    except NetlinkError as exc:  # the next probe removes it; the answer stays valid
        log.warning("tc probe: could not delete its device %s: %s", device, exc)


def _try_features(shaper: Shaper, device: str) -> Capabilities:
    ipr = shaper.ipr
    idx = ipr.link_lookup(ifname=device)[0]
    ipr.link("set", index=idx, ifalias=PROBE_ALIAS)
    qdiscs = {kind for kind in QDISCS if _root_qdisc_works(shaper, idx, kind)}
    classifiers: set[str] = set()
    actions: set[str] = set()
    try:
        ipr.tc("add", "clsact", idx)
    except NetlinkError as exc:
        log.info("tc probe: qdisc clsact not available: %s", exc)
    if not shaper._has_clsact(idx):
        return Capabilities(frozenset(qdiscs), frozenset(), frozenset(), ifb=True)
    qdiscs.add("clsact")
    # cls_bpf + mirred: exactly the filter netagent installs (redirecting to the probe device
    # itself), read back and decoded the way the agent reads its own
    spec = ShaperSpec(device, (device,), 0x1, 1_000_000, HtbClassSpec(DEFAULT_MINOR, 8000, 8000))
    try:
        shaper._redirect_filter(device, spec, replace=False)
    except TcError as exc:
        log.info("tc probe: cls_bpf/mirred not available: %s", exc)
    obs = ObservedShaper()
    shaper._observe_uplink(device, idx, spec, obs)
    for f in obs.filters[device]:
        if f.kind == "bpf" and f.mark_bit == spec.mark_bit:
            classifiers.add("bpf")
        if f.redirect_ifindex == idx:
            actions.add("mirred")
    return Capabilities(frozenset(qdiscs), frozenset(classifiers), frozenset(actions), ifb=True)


def _root_qdisc_works(shaper: Shaper, idx: int, kind: str) -> bool:
    try:
        if kind in ("pfifo", "bfifo", "tbf"):
            o = QDISC_OPTIONS[kind]
            err = (shaper.add_tbf_root(idx, o["rate"], o["burst"], o["limit"]) if kind == "tbf"
                   else shaper.add_fifo_root(idx, kind, o["limit"]))
            if err:
                log.debug("tc probe: qdisc %s not available: errno %d", kind, err)
                return False
        else:
            shaper.ipr.tc("add", kind, idx, 0x10000, **QDISC_OPTIONS.get(kind, {}))
    except (NetlinkError, KeyError, TypeError, ValueError) as exc:  # pyroute2 lacks encoders for some
        log.debug("tc probe: qdisc %s not available: %s", kind, exc)
        return False
    try:
        root = [rawnl.parse_qdisc(h, parent, payload) for h, parent, payload in shaper.chan.dump_qdiscs(idx)
                if parent == ROOT]
        o = QDISC_OPTIONS.get(kind, {})
        return any(q.kind == kind and q.limit == o.get("limit", q.limit) and q.tbf_rate == o.get("rate", q.tbf_rate)
                   and q.tbf_mtu == o.get("burst", q.tbf_mtu) for q in root)
    finally:
        shaper.ipr.tc("del", index=idx, parent=ROOT)


def require(caps: Capabilities) -> None:
    missing = caps.missing()
    if missing:
        raise TcError(
            "this kernel lacks what netagent needs: " + ", ".join(missing)
            + " (load the modules, e.g. `modprobe sch_htb cls_bpf act_mirred ifb`, or use a kernel that has them)"
        )
