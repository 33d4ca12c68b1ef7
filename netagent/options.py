"""How the data path is laid out on a node: configuration, apart from the pure desired state.

`DataPathOptions` is built once at start (`config.from_flags`, then the probe's leaf qdisc and the
counting mode in `Daemon.build`) and read by the desired state, the data path and the cleanup.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.direction import PerDirection
from tc.model import DOWNLOAD_ROOT_MAJOR

# Not used by kube-proxy (0x4000, 0x8000), portmap (0x2000), Calico (0xff000000),
# Tailscale (0xff0000) or Cilium's magic marks (0xf00).
DEFAULT_MARK_BIT = 0x1000


# --internal-counting: where the pods' internal bytes are counted (netagent.datapath.choose_internal_counting)
COUNTING_MODES = ("auto", "device", "rules")


@dataclass(frozen=True)
class DataPathOptions:
    """How the data path is laid out on this node (mark bit, per direction its IFB, HTB major and
    floor, leaf qdisc). Uploads: an IFB fed from the uplinks; downloads: one fed from the pod-facing
    devices, its own HTB tree."""
    mark_bit: int = DEFAULT_MARK_BIT
    ifbs: PerDirection[str] = PerDirection("netagent0", "netagent-in")
    # a major per direction: a download class never reads as an upload one
    htb_majors: PerDirection[int] = PerDirection(0x1, DOWNLOAD_ROOT_MAJOR)
    leaf_qdisc: str = "pfifo"  # the probe picks fq_codel where the kernel has it
    # the floor, bit/s: internet traffic of addresses no known pod holds (the default class), pods not known yet
    floors: PerDirection[int] = PerDirection(1_000_000, 1_000_000)
    filter_pref: int = 0xC000
    wire_l2_bytes: int = 14  # what HTB counts per packet beyond the IP packet (Ethernet header)
    wire_mtu: int = 1500  # the uplink's IP MTU: the size of a full segment
    # the pods' internal bytes: counted on their devices by an eBPF program (tc/ebpf/; chosen at
    # start, `choose_internal_counting`) rather than by the rules in ipsets
    internal_by_device: bool = False
    bpf_dir: str = "/sys/fs/bpf/netagent"  # where the device counter's maps, programs and links are pinned (a bpffs)
    count_pref: int = 0xC001  # its filters' priority on the pod devices (after the download redirect)
    # how it attaches its programs: tcx links where the kernel has them (auto), else tc filters
    count_attach: str = "auto"
    # on tcx links, its egress programs end the hook for a packet without the mark bit, so an internal
    # packet skips the shaper's redirect filter (~100 ns a packet), where that skips nobody else's
    count_gate: bool = True
