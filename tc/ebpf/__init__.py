"""Internal bytes and packets counted by eBPF: each local pod's on its host-side device, the node's on its
uplinks.

Why: the iptables rules count a pod's internal traffic with ipset lookups, and those lookups are
what internal traffic pays at line rate. A program on each pod device (the device is the pod's,
so no lookup decides whose packet it is) counts what the pod sends to, and receives from, the
internal CIDRs; a program on each uplink counts the node's totals by the far end's scope. The
rules can then let internal packets go before any set or device test.

Why eBPF: a classic-BPF scope test whose action statistics count needs `gact`, which minimal
kernels (this one) lack; `mirred`, often the one action there, clones or steals the packet. A
`sched_cls` program in direct-action mode tests the scope and adds to a map itself, and returns
TC_ACT_UNSPEC so the device's other programs and filters (netagent's download redirect) still run.
Attached by tcx links where the kernel has them (Linux >= 6.6), else as cls_bpf filters on clsact:
the link runs the program straight from the device's hook, at a third of the filter's cost.

The gate (tcx links only): the shaper's redirect filters sit on the same egress hooks (uplinks for
uploads, pod devices for downloads) and match only a packet with the mark bit, yet every packet runs
the clsact machinery to find that out (~100 ns). The egress programs therefore return TC_ACT_OK
(TCX_PASS: the hook ends) for a packet without the bit, and TC_ACT_UNSPEC for a marked one, which
goes on to the filter. Ending the hook would also skip anybody else's filter or later tcx program
on it, so each attach gates a device only where it finds neither (a clsact filter added later is
found at the next full resync).

What it counts is what the ipset and iptables counters count: the IP bytes of each skb, a GSO
super-packet once with its one header. tc shows the program the frame from its MAC header in
both directions (at ingress it pushes the MAC header back before the program runs), so the count
is skb->len less the 14-byte Ethernet header on either hook.

One map for all pods, keyed by the pod's address (an IPv4 address as ::ffff:a.b.c.d), so no
pod-to-device mapping is needed and routed and bridged pods are alike; the node's totals in a
second, two-entry map. With the scopes' tries (issue 39) an internal packet's far end is looked up, and
cross-zone and cross-region bytes also go to a map of their own, one for the pods and one for the node,
so the first two keep their shapes (an upgrade adopts them with their counts). Maps, programs and
tcx links are pinned in a bpffs: a restarted agent adopts the maps with their counts, finds the
programs it would load (same tag, same map) already running, and the links keep the programs
attached while no agent runs.

Loaded with raw bpf(2) calls through ctypes: the programs are tens of instructions (a few
hundred with 40 CIDRs) and need no compiler, no libbpf and no BTF.

The modules, by mechanism (as Cilium's loader is split): syscall (bpf(2) through ctypes), asm (the
instruction assembler), programs (the counting programs, built and loaded), maps (the maps, their
keys and the pins in a bpffs), tcx (tcx links and the gate), clsact (cls_bpf filters on clsact, and
their removal), counter (InternalCounter, which puts them together).
"""
from .clsact import remove_counting
from .counter import InternalCounter, unavailable
from .maps import unpin_dir
from .syscall import EbpfError
from .tcx import tcx_available

__all__ = ["EbpfError", "InternalCounter", "remove_counting", "tcx_available", "unavailable", "unpin_dir"]
