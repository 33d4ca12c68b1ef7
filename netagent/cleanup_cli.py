"""`netagent cleanup`: remove everything netagent created on this node. Idempotent.

Removes the redirect filters netagent put on any device (recognised by their
priority *and* by decoding their BPF program: someone else's filter is left
alone), a clsact qdisc left empty by that, the IFB (recognised by its alias) with
its HTB tree, and netagent's iptables/ip6tables chains and ipsets. Run it after
uninstalling the DaemonSet; running it twice is harmless.
"""
from __future__ import annotations

import argparse
import logging
import socket

from .planner import PlanOptions

log = logging.getLogger("netagent")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ifb", default=PlanOptions.ifb, help="the IFB device netagent used (its --ifb)")
    p.add_argument("--iptables-backend", choices=("auto", "nft", "legacy"), default="auto")


def _all_devices() -> tuple[str, ...]:
    return tuple(name for _, name in socket.if_nameindex())


def run(args: argparse.Namespace) -> int:
    from iptables.apply import Classifier
    from tc.netlink import Shaper

    failed = False
    done: list[str] = []
    try:
        with Shaper() as shaper:
            devices = tuple(d for d in _all_devices() if d != args.ifb)
            done += shaper.cleanup(args.ifb, devices, PlanOptions.filter_pref)
    except Exception as exc:
        print(f"tc cleanup failed: {exc}")
        failed = True
    try:
        done += Classifier(backend=args.iptables_backend).cleanup()
    except Exception as exc:
        print(f"iptables cleanup failed: {exc}")
        failed = True
    for item in done:
        print(f"removed {item}")
    if not done and not failed:
        print("nothing of netagent's found: already clean")
    return 1 if failed else 0
