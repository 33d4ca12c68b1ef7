"""Remove everything netagent created on this node (`netagent cleanup`). Idempotent.

Removes the redirect filters netagent put on any device (recognised by their
priority *and* by decoding their BPF program: someone else's filter is left
alone), the device counter's filters (priority and name) and its pinned map, a
clsact qdisc left empty by that, the IFB (recognised by its alias) with
its HTB tree, and netagent's iptables/ip6tables chains and ipsets. Run it after
uninstalling the DaemonSet; running it twice is harmless.
"""
from __future__ import annotations

import socket

from iptables.apply import Classifier
from tc.ebpf import remove_counting, unpin_dir
from tc.netlink import Shaper

from .datapath import remove_carries
from .options import DataPathOptions


def cleanup(ifbs: tuple[str, ...], iptables_backend: str,
            bpf_dir: str = DataPathOptions.bpf_dir) -> tuple[list[str], list[str]]:
    """Remove netagent's filters, its IFBs (`ifbs`: uploads', downloads') with their HTB trees, the device counter
    (its filters and pinned map), chains and ipsets from this node. -> (what was removed, what failed);
    both empty: already clean."""
    failed: list[str] = []
    done: list[str] = []
    devices = tuple(name for _, name in socket.if_nameindex())
    try:
        # first: a pod device's clsact goes with the last of our filters on it
        done += remove_counting(devices, DataPathOptions.count_pref)
        done += unpin_dir(bpf_dir)
    except Exception as exc:
        failed.append(f"device counter cleanup failed: {exc}")
    try:
        with Shaper() as shaper:
            # the first pass removes our filters on every device: the uplinks' (uploads) and the
            # pod devices' (downloads); then each IFB with its tree
            first, *rest = ifbs
            done += shaper.cleanup(first, tuple(d for d in devices if d not in ifbs), DataPathOptions.filter_pref)
            for ifb in rest:
                done += shaper.cleanup(ifb, (), DataPathOptions.filter_pref)
    except Exception as exc:
        failed.append(f"tc cleanup failed: {exc}")
    try:
        classifier = Classifier(backend=iptables_backend)
        done += classifier.cleanup()
        done += remove_carries(classifier.runner)  # the accounting carries go with the classes they complete
    except Exception as exc:
        failed.append(f"iptables cleanup failed: {exc}")
    return done, failed
