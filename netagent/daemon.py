"""Wiring of the agent: flags in, running threads out.

`Daemon.from_args` checks everything it can before touching the kernel (flags, the
uplinks, the kernel's tc features, our firewall-mark bit being free) and raises
`StartupError` naming what is wrong; only `start()` begins changing the kernel.
`stop()` stops the threads and leaves the data path in force (fail-static).
"""
from __future__ import annotations

import argparse
import logging
import socket
import threading
import time

from controller.quantity import parse_bps

from .agent import Agent, AgentConfig, AllocationSet
from .datapath import KernelDataPath, probe_leaf_qdisc
from .events import ProblemReporter
from .http import AgentHTTP
from .metrics import AgentMetrics
from .planner import PlanOptions, canonical_cidrs
from .policy_resolver import PolicyResolver

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The agent cannot start as configured; the message names the flag or fact and the fix."""


def _default_uplinks() -> tuple[str, ...]:
    from .netinfo import default_route_devices

    found = default_route_devices()
    if not found:
        raise StartupError("no default route on this node, so the uplink is unknown: name it with --uplink DEV")
    return found


class Daemon:
    def __init__(self, cfg: AgentConfig, agent: Agent, source, datapath: KernelDataPath, http: AgentHTTP,
                 reporter=None):
        self.cfg, self.agent, self.source, self.datapath, self.http, self.reporter = (
            cfg, agent, source, datapath, http, reporter)
        self._source_thread = threading.Thread(target=self._run_source, name="source", daemon=True)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Daemon":
        if args.from_file and args.kubeconfig:
            raise StartupError("--from-file and --kubeconfig exclude each other: pods come from files or from Kubernetes")
        node = args.node or (socket.gethostname() if args.from_file else "")
        if not node:
            raise StartupError("--node is required with Kubernetes (set it from spec.nodeName via the downward API)")
        try:
            default_rate = parse_bps(args.default_rate, "--default-rate")
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        uplinks = tuple(args.uplink) or _default_uplinks()
        for dev in uplinks:
            try:
                socket.if_nametoindex(dev)
            except OSError:
                raise StartupError(f"uplink {dev!r} does not exist on this node: check --uplink "
                                   f"(devices here: {', '.join(n for _, n in socket.if_nameindex())})") from None
        from .netinfo import connected_networks

        try:
            internal = canonical_cidrs([*args.internal_cidr, *args.pod_cidr, *args.service_cidr,
                                        *connected_networks(uplinks)])
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        leaf, _ = probe_leaf_qdisc()
        options = PlanOptions(mark_bit=args.mark_bit, ifb=args.ifb, leaf_qdisc=leaf, default_rate=default_rate)
        cfg = AgentConfig(node=node, uplinks=uplinks, internal_cidrs=internal, plan_options=options,
                          controller=args.controller, resync_seconds=args.resync_period,
                          default_floor_bps=default_rate)
        datapath = KernelDataPath(options, iptables_backend=args.iptables_backend)
        try:
            datapath.check_conflicts()
        except Exception:
            datapath.close()
            raise

        resolver = PolicyResolver()
        local = None
        if not args.controller:
            from .local_alloc import LocalAllocator

            local = LocalAllocator(resolver, default_rate)
        holder: dict[str, Agent] = {}
        metrics = AgentMetrics(lambda: holder["agent"].view())
        emit_event = None
        if args.from_file:
            from .sources.files import FileSource

            source = FileSource(list(args.from_file), node=node)
        else:
            from .events import kube_event_emitter
            from .sources.kube import KubeSource, load_api_client

            try:
                api = load_api_client(args.kubeconfig)
            except Exception as exc:
                raise StartupError(f"cannot load Kubernetes credentials ({exc}); give --kubeconfig or run in a pod") from exc
            source = KubeSource(api, node, on_metric=lambda res, kind: metrics.watch_events.labels(res, kind).inc())
            emit_event = kube_event_emitter(api, node)
        problems = ProblemReporter(emit_event, lambda reason: metrics.policy_problems.labels(reason).inc())
        agent = Agent(cfg, datapath, resolver, local, metrics=metrics, problems=problems)
        holder["agent"] = agent
        reporter = None
        if args.controller:
            from .reporter import Reporter

            # after a restart nothing is known yet: what the kernel holds stands for one lease-like
            # while, then the floor, unless the controller answers first
            agent.allocations = AllocationSet(lease_expires=time.monotonic() + max(30.0, 6 * args.report_period),
                                              source="adopted")
            reporter = Reporter(agent, args.controller, token_path=args.token_path, period=args.report_period,
                                on_failure=metrics.report_failures.inc)
        http = AgentHTTP(args.listen, metrics.registry, agent.health, agent.readiness, lambda: agent.view().as_dict())
        log.info("uplinks %s; internal %s; leaf qdisc %s; iptables %s; mark bit %#x; %s",
                 ",".join(uplinks), ",".join(internal), leaf, datapath.iptables_backend, args.mark_bit,
                 f"controller {args.controller}" if args.controller else "local allocation (no controller)")
        return cls(cfg, agent, source, datapath, http, reporter)

    def _run_source(self) -> None:
        try:
            self.source.run(self.agent.on_snapshot)
        except Exception:
            log.exception("the pod source stopped; the data path stays as it is")

    def start(self) -> None:
        self.http.start()
        self.agent.start()
        self._source_thread.start()
        if self.reporter:
            self.reporter.start()

    def stop(self) -> None:
        """Stop watching and reporting; leave every class and rule in the kernel (fail-static)."""
        self.source.stop()
        if self.reporter:
            self.reporter.stop()
        self.agent.stop()
        self.http.stop()
        self.datapath.close()
