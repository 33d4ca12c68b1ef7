"""Wiring of the agent: a typed config in, running threads out.

`Daemon.build` checks everything it can before touching the kernel (the kernel's tc
features, our firewall-mark bit being free, credentials) and raises a NetagentError
naming what is wrong; only `start()` begins changing the kernel. `stop()` stops the
threads and leaves the data path in force (fail-static).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest

from core.address import is_loopback, join_host_port
from core.files import FileSource

from .agent import Agent
from .allocations import AllocationSet
from .config import AgentConfig
from .datapath import KernelDataPath, choose_internal_counting, probe_leaf_qdisc
from .drift import DriftWatch
from .facts import NodeFacts
from .events import ProblemReporter
from .http import AgentHTTP
from .metrics import AgentMetrics
from .reporter import Reporter

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, cfg: AgentConfig, agent: Agent, source, datapath: KernelDataPath, http: AgentHTTP,
                 reporter: Reporter | None = None, problems: ProblemReporter | None = None,
                 drift: DriftWatch | None = None, quota=None):
        self.cfg, self.agent, self.source, self.datapath, self.http, self.reporter = (
            cfg, agent, source, datapath, http, reporter)
        self.problems, self.drift, self.quota = problems, drift, quota
        self._source_thread = threading.Thread(target=self._run_source, name="source", daemon=True)

    @classmethod
    def build(cls, cfg: AgentConfig) -> "Daemon":
        leaf, _ = probe_leaf_qdisc()
        api = None
        services: tuple[str, ...] = ()  # the cluster's service CIDRs when they are followed (a NodeFacts)
        if not cfg.from_file:
            from .sources import load_api_client

            api = load_api_client(cfg.kubeconfig)
            cfg, services = _cluster_services(cfg, api)
        cfg, datapath, counting = _datapath(cfg, leaf)
        holder: dict[str, Agent] = {}
        metrics = AgentMetrics(lambda: holder["agent"].view(), lean=cfg.lean_metrics)
        # A part is loaded only in the mode that uses it (tests/test_layers.py holds this): the
        # kubernetes client only with Kubernetes, the engine (numpy) only in single-node mode.
        source, problems = _source(cfg, api, metrics)
        initial, local, quota = _allocation_mode(cfg, lambda: holder["agent"].node.policy()[0])
        facts = NodeFacts(cfg.uplinks, cfg.internal_cidrs, services)
        agent = Agent(cfg, datapath, local, metrics=metrics, problems=problems, initial=initial, facts=facts)
        holder["agent"] = agent
        state = lambda: agent.view().as_dict()  # noqa: E731
        if quota is not None:
            from .localquota import counters_of

            quota.counters = counters_of(agent.view, lambda: agent.pods)
            state = lambda: {**agent.view().as_dict(), "quota": quota.teams()}  # noqa: E731
        reporter = None
        if cfg.controller:
            reporter = Reporter(agent, cfg.controller, token_path=cfg.token_path, period=cfg.report_period,
                                on_failure=metrics.report_failures.inc, ca_file=cfg.controller_ca,
                                insecure_http=cfg.controller_insecure_http,
                                on_omitted=lambda reason, n: metrics.report_omitted.labels(reason).inc(n),
                                on_refused=lambda reason: metrics.refused_pods.labels(reason).inc())
        authorizer, tls, exposition = _scrape_auth(cfg, api, metrics)
        http = AgentHTTP(cfg.listen, metrics.registry, agent.health, agent.readiness, state,
                         state_listen=cfg.state_listen, on_rejected=lambda r: metrics.http_rejected.labels(r).inc(),
                         exposition=exposition, authorizer=authorizer, tls=tls)
        log.info("uplinks %s; internal %s; leaf qdisc %s; iptables %s; internal bytes counted %s; mark bit %#x; "
                 "downloads %s; %s",
                 ",".join(facts.uplinks), ",".join(facts.internal), leaf, datapath.iptables_backend, counting,
                 cfg.datapath.mark_bit,
                 f"shaped on the pod devices through {cfg.datapath.ifbs.download}" if cfg.shape_ingress else "not shaped",
                 f"controller {cfg.controller}" if cfg.controller else "local allocation (no controller)")
        ifbs = tuple(lane.direction for lane in agent.node.shaped_lanes())
        drift = DriftWatch(tuple(cfg.datapath.ifbs[d] for d in ifbs), lambda: agent.facts.uplinks, agent.wake_full,
                           datapath.hooks_fingerprint, set_uplinks=agent.set_uplinks if cfg.uplinks_learnt else None,
                           count=lambda source: metrics.drift_checks.labels(source).inc(),
                           wake=agent.runner.wake if cfg.shape_ingress else None)
        return cls(cfg, agent, source, datapath, http, reporter, problems, drift, quota)

    def _run_source(self) -> None:
        try:
            self.source.run(self.agent.on_snapshot)
        except Exception:
            log.exception("the pod source stopped; the data path stays as it is")

    def start(self) -> None:
        if self.problems:
            self.problems.start()
        self.http.start()
        self.agent.start()
        if self.quota:
            self.quota.start()
        self._source_thread.start()
        if self.drift:
            self.drift.start()
        if self.reporter:
            self.reporter.start()

    def stop(self) -> None:
        """Stop watching and reporting; leave every class and rule in the kernel (fail-static)."""
        self.source.stop()
        if self.drift:
            self.drift.stop()
        if self.reporter:
            self.reporter.stop()
        self.agent.stop()
        if self.quota:
            self.quota.stop()  # the last count written
        self.http.stop()
        if self.problems:
            self.problems.stop()
        self.datapath.close()


def _datapath(cfg: AgentConfig, leaf: str) -> tuple[AgentConfig, KernelDataPath, str]:
    """The kernel data path with the probe's leaf qdisc and the counting mode the node allows:
    (the configuration with them, the data path, how internal bytes are counted); refuses to start
    where someone else uses the mark bit."""
    by_device, counting = choose_internal_counting(cfg.internal_counting, cfg.datapath.bpf_dir, cfg.services_known)
    cfg = dataclasses.replace(cfg, datapath=dataclasses.replace(cfg.datapath, leaf_qdisc=leaf,
                                                                internal_by_device=by_device))
    datapath = KernelDataPath(cfg.datapath, iptables_backend=cfg.iptables_backend)
    try:
        datapath.check_conflicts()
    except Exception:
        datapath.close()
        raise
    return cfg, datapath, counting


def _source(cfg: AgentConfig, api, metrics: AgentMetrics) -> tuple[object, ProblemReporter]:
    """The pod source (files, or this node's watches) and the policy problems' reporter (Events with
    Kubernetes)."""
    emit_event = None
    if cfg.from_file:
        source: object = FileSource(list(cfg.from_file), node=cfg.node)
    else:
        from .sources import KubeSource, kube_event_emitter

        source = KubeSource(api, cfg.node, on_metric=lambda res, kind: metrics.watch_events.labels(res, kind).inc())
        emit_event = kube_event_emitter(api, cfg.node)
    problems = ProblemReporter(emit_event, lambda reason: metrics.policy_problems.labels(reason).inc(),
                               on_dropped=metrics.events_dropped.inc)
    return source, problems


def _allocation_mode(cfg: AgentConfig, policy):
    """(the allocations the agent starts from, the single-node allocator's factory, its quota keeper): with a
    controller what the kernel holds stands for one lease-like while after a restart (nothing is known yet),
    then the floor, unless the controller answers first; without one the engine allocates locally and the
    agent keeps its teams' quota use in --state-dir (netagent.localquota)."""
    if cfg.controller:
        return (AllocationSet(lease_expires=time.monotonic() + max(30.0, 6 * cfg.report_period), source="adopted"),
                None, None)
    from .local import LocalAllocator
    from .localquota import LocalQuota
    from .reporter import counter_epoch

    quota = LocalQuota(cfg.state_dir, policy, counter_epoch())
    return None, functools.partial(LocalAllocator, floor_bps=cfg.default_floor_bps, quota=quota), quota


def _cluster_services(cfg: AgentConfig, api) -> tuple[AgentConfig, tuple[str, ...]]:
    """With no --service-cidr: the cluster's ServiceCIDRs, read once here for the counting mode (where a
    pod's packet to a ClusterIP is internal before DNAT); the source follows them from then on."""
    if not cfg.services_from_cluster:
        return cfg, ()
    from .sources import list_service_cidrs

    services, why_not = list_service_cidrs(api)
    if not services:
        log.warning("service CIDRs unknown (%s): give --service-cidr (chart value serviceCIDRs)", why_not)
        return cfg, ()
    log.info("service CIDRs from the cluster's ServiceCIDR objects: %s", ",".join(services))
    return dataclasses.replace(cfg, services_known=True), services


def _scrape_auth(cfg: AgentConfig, api, metrics: AgentMetrics):
    """--metrics-auth: (the scrape authorizer, the TLS context, the /metrics exposition with its own
    metrics); off: (None, None, the plain exposition), with a warning where every pod reaches it."""
    authorizer = tls = None
    exposition = metrics.exposition
    if cfg.metrics_auth:
        from core.kubereview import access_review, token_review
        from core.scrapeauth import ScrapeAuthorizer

        from .http import ScrapeAuthCollector
        from .selfsigned import self_signed_context

        authorizer = ScrapeAuthorizer(token_review(api), access_review(api))
        tls = self_signed_context(cfg.node)
        auth_registry = CollectorRegistry()
        auth_registry.register(ScrapeAuthCollector(authorizer))
        exposition = lambda: metrics.exposition() + generate_latest(auth_registry)  # noqa: E731
    elif not cfg.from_file and not is_loopback(cfg.listen[0]):
        log.warning("--metrics-auth=false: /metrics at %s lists every pod of this node to whoever reaches it",
                    join_host_port(*cfg.listen))
    return authorizer, tls, exposition
