"""Snapshot -> the node's pods with their policy applied, and the budget's total. Pure.

Which pods are shaped here:
  * hostNetwork pods are node traffic: they share the node's addresses, so they are
    counted in the node totals and never get a class of their own;
  * finished pods (Succeeded/Failed) hold no IP any more and are dropped;
  * a pod without an IP yet is kept (it shows as waiting) and programmed when it gets one;
  * an IP held by two pods (a deleted pod's IP handed to a new one before the old
    object is gone): the pod being deleted gives it up.
The policy itself (classes, teams, annotations, fallbacks to the default class) is
the controller's `controller.policy`, so agent and controller can never disagree.
"""
from __future__ import annotations

import logging
import threading

from controller.policy import load_policy, resolve_pod

from .agent import ResolvedPod
from .model import ANNOTATION_BANDWIDTH, ANNOTATION_CLASS, PodRecord, Snapshot

log = logging.getLogger(__name__)


class PolicyResolver:
    """Callable for `Agent`: keeps the last loaded policy (the local allocator needs it too)."""

    def __init__(self) -> None:
        self.policy = None
        self._policy_key: tuple | None = None
        self._told_problems: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def __call__(self, snap: Snapshot) -> tuple[list[ResolvedPod], int]:
        key = (repr(snap.classes), repr(snap.budgets))
        with self._lock:
            if key != self._policy_key:
                policy, problems = load_policy(list(snap.classes), list(snap.budgets))
                self.policy, self._policy_key = policy, key
                if tuple(problems) != self._told_problems:  # once per change, not every sync
                    for p in problems:
                        log.warning("policy: %s", p)
                    self._told_problems = tuple(problems)
            policy = self.policy
        return resolve_pods(policy, snap.pods), int(policy.total_bps)


def shaped_pods(pods: tuple[PodRecord, ...] | list[PodRecord]) -> list[PodRecord]:
    """The pods that get a class of their own, with IPs given up by pods being deleted."""
    live = [p for p in pods if not p.host_network and not p.terminal]
    holders: dict[str, list[PodRecord]] = {}
    for p in live:
        for ip in p.ips:
            holders.setdefault(ip, []).append(p)
    losers: dict[str, set[str]] = {}  # pod uid -> IPs it must give up
    for ip, held in holders.items():
        if len(held) > 1 and any(not p.deleting for p in held):
            for p in held:
                if p.deleting:
                    losers.setdefault(p.uid, set()).add(ip)
    out = []
    for p in live:
        gone = losers.get(p.uid)
        if gone:
            p = PodRecord(**{**p.__dict__, "ips": tuple(ip for ip in p.ips if ip not in gone)})
        out.append(p)
    return out


def resolve_pods(policy, pods: tuple[PodRecord, ...] | list[PodRecord]) -> list[ResolvedPod]:
    out = []
    for p in shaped_pods(pods):
        cls_ann, bw_ann = p.annotation(ANNOTATION_CLASS), p.annotation(ANNOTATION_BANDWIDTH)
        pp = resolve_pod(policy, p.namespace, cls_ann, bw_ann)
        out.append(ResolvedPod(
            key=p.key, namespace=p.namespace, name=p.name, uid=p.uid, ips=p.ips,
            team=pp.team, egress_class=pp.egress_class, weight=float(pp.weight),
            min_bps=int(pp.min_bps), max_bps=int(pp.max_bps), problems=tuple(pp.problems),
            class_annotation=cls_ann, bandwidth_annotation=bw_ann,
        ))
    return out
