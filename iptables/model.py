"""Desired classifier state as plain, comparable data.

The agent (`netagent.desired`) builds a `ClassifierState`; `iptables.render`
turns it into iptables-restore text and ipset contents, and the applier diffs
that against what the kernel holds. Nothing here touches the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class PodClassification:
    """One pod: its addresses and the HTB classes its internet egress (and ingress) are steered to."""

    key: str  # "namespace/name": rule comments and counter keys
    ips: tuple[str, ...]  # IPv4 and/or IPv6 addresses, canonical text
    tc_class: tuple[int, int]  # (HTB major, minor) for CLASSIFY --set-class MAJ:MIN
    # the pod's class in the download shaper (the skbprio of its ingress-inet members); None: the
    # pod's downloads are counted only (no ingress shaper on this node)
    ingress_class: tuple[int, int] | None = None
    # where its small packets (pure ACKs above all, pings, DNS-sized datagrams) go instead, ahead of
    # its bulk data: the pod's control leaf in each shaper; None: with the rest
    ack_class: tuple[int, int] | None = None
    ingress_ack_class: tuple[int, int] | None = None


@dataclass(frozen=True)
class ClassifierState:
    """Everything netagent wants in iptables/ip6tables and ipset on one node."""

    mark_bit: int  # our single firewall-mark bit; set as value/mask so other bits stay intact
    internal_cidrs: tuple[str, ...]  # destinations that are never shaped (IPv4 and IPv6 mixed)
    pods: tuple[PodClassification, ...]
    uplinks: tuple[str, ...]  # internet-facing devices; node totals count traffic through them
    # HTB (major, minor) for internet traffic the node forwards from a source that is none of `pods`
    # (a pod the agent does not know yet): marked and classified there, so it is shaped at the
    # default class's floor, never unshaped. None: such traffic is left alone.
    default_class: tuple[int, int] | None = None
    # Downloads (internet ingress): the class in the download shaper for internet traffic the node
    # forwards to an address that is none of `pods` (a pod the agent does not know yet): marked
    # and classified there, held at the download floor. None: downloads are counted, not marked.
    ingress_default_class: tuple[int, int] | None = None
    # Where the pods' internal bytes are counted. False: by the rules, in the egress-int/ingress-int
    # ipsets (a set lookup or two per internal packet). True: by an eBPF counter on each pod's own
    # device (tc/ebpf/), so the rules return a packet whose both ends are internal before any set
    # lookup; internet traffic, node totals, marks and classes are the same either way.
    internal_by_device: bool = False
