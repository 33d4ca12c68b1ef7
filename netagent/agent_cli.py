"""`netagent run`: the per-node agent."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading

from .planner import DEFAULT_MARK_BIT, PlanOptions

log = logging.getLogger("netagent")


def _int(text: str) -> int:
    return int(text, 0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("where pods and policy come from (one of)")
    src.add_argument("--from-file", action="append", default=[], metavar="PATH",
                     help="YAML file or directory of Pod/EgressClass/EgressBudget objects (repeatable); reloaded on change")
    src.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    p.add_argument("--node", help="this node's name (required with Kubernetes; in file mode, pods of other nodes are ignored)")
    p.add_argument("--controller", metavar="URL", help="controller base URL; without it the agent allocates locally")
    p.add_argument("--token-path", default="/var/run/secrets/netagent/token",
                   help="projected ServiceAccount token presented to the controller")
    p.add_argument("--uplink", action="append", default=[], metavar="DEV",
                   help="internet-facing device (repeatable; default: the devices of the default routes)")
    p.add_argument("--internal-cidr", action="append", default=[], metavar="CIDR",
                   help="destination that is never shaped (repeatable); the uplinks' subnets are added automatically")
    p.add_argument("--pod-cidr", action="append", default=[], metavar="CIDR", help="this node's pod CIDR(s) (internal)")
    p.add_argument("--service-cidr", action="append", default=[], metavar="CIDR", help="the cluster's service CIDR(s)")
    p.add_argument("--listen", default="127.0.0.1:9560", help="address for /metrics /healthz /readyz /state")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--log-level", default="info")
    p.add_argument("--mark-bit", type=_int, default=DEFAULT_MARK_BIT, help=f"firewall-mark bit (default {DEFAULT_MARK_BIT:#x})")
    p.add_argument("--ifb", default="netagent0", help="name of the IFB device netagent owns")
    p.add_argument("--default-rate", default="1M", help="floor for internet traffic from unknown sources (bit/s quantity)")
    p.add_argument("--report-period", type=float, default=5.0, help="seconds between controller reports")
    p.add_argument("--resync-period", type=float, default=30.0,
                   help="seconds between resyncs that re-read the whole kernel state and repair drift")
    p.add_argument("--iptables-backend", choices=("auto", "nft", "legacy"), default="auto")


def run(args: argparse.Namespace) -> int:
    from . import logsetup

    logsetup.setup(args.log_format, args.log_level)
    try:
        from .daemon import Daemon

        daemon = Daemon.from_args(args)
    except Exception as exc:  # configuration and environment errors: say what and stop
        log.error("cannot start: %s", exc)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("signal %d: stopping; the data path stays in force (fail-static)", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.start()
    log.info("netagent running on node %r; endpoints at http://%s", daemon.cfg.node, daemon.http.address)
    stop.wait()
    # Stopping changes nothing in the kernel, so a stop that hangs (a tool blocked on the
    # xtables lock, a netlink socket) must not keep the pod past its grace period: after
    # SHUTDOWN_GRACE_S say where every thread stands and exit; the data path stays in force.
    watchdog = threading.Timer(SHUTDOWN_GRACE_S, _exit_stuck)
    watchdog.daemon = True
    watchdog.start()
    daemon.stop()
    watchdog.cancel()
    return 0


SHUTDOWN_GRACE_S = 10.0


def _exit_stuck() -> None:
    log.error("stopping took over %.0f s; exiting now (the data path stays in force). Threads:", SHUTDOWN_GRACE_S)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    logging.shutdown()
    os._exit(0)


__all__ = ["add_arguments", "run", "PlanOptions"]
