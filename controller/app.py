"""The controller as a running service: wiring of its parts, and serving (`netagent controller`).

Two ways to run:
- in a cluster (default: in-cluster config, or --kubeconfig): policy from watched
  EgressClass/EgressBudget objects, pods' nodes from one cluster-wide pod watch (the
  node-binding check), agents authenticated by TokenReview, leader election on a Lease,
  EgressBudget status written by the leader at a bounded rate;
- from files (--from-file, no cluster): the same objects in YAML, reloaded on change,
  no leader election (this replica always leads), no status writes; --no-auth for the
  single-machine demo. Pods in the files, if any, drive the node-binding check.

Threads: the aiohttp event loop (agent API, /metrics), the allocation loop (one round per
--period over all nodes), the leader elector, the watches, the status writer, the Event
writer, the TLS reloader, the TokenReview pool.

Transport: HTTPS by default (controller/tls.py): the serving certificate from the Secret
--tls-secret (cluster mode) or --tls-cert-file/--tls-key-file; plain HTTP only with
--insecure-http.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from core.address import join_host_port
from core.asynctls import HandshakeGate, set_tls_read_buffer
from core.kubeapi import load_api_client
from core.kubereview import access_review, token_review
from core.policy import PolicyCache
from core.scrapeauth import ScrapeAuthorizer

from . import view
from .allocator import Allocator, RoundResult
from .api import APIStats, make_app
from .auth import TokenAuthenticator, kube_token_review
from .connections import ConnectionBounds, raise_open_files_limit
from .config import ControllerConfig, service_account_username
from .events import EventWriter, kube_event_creator
from .leader import LeaderElector
from .metrics import ControllerMetrics
from .metricsauth import ScrapeAuthCollector, guarded
from .pacing import ReportPacer
from .sources import ClusterCaches, FilePolicy
from .state import ControllerState
from .cost import CostCollector, CostKeeper
from .quota import QuotaKeeper
from .quotastore import QuotaCollector, QuotaStore
from .status import StatusWriter
from .tls import FileTLS, SecretTLS, ServingTLS

log = logging.getLogger("netagent.controller")


def configure_gc() -> None:
    """Collect the youngest generation every 50,000 allocations instead of 700: each report
    allocates a few hundred objects, and with the latest reports of thousands of nodes alive the
    default thresholds spent a third of the API's CPU in the cyclic GC (bench/agent_api.py).
    Nothing the controller keeps forms cycles; refcounting frees it."""
    gc.set_threshold(50_000, 50, 50)


class Controller:
    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg
        self.elector: LeaderElector | None = None
        self.status_writer: StatusWriter | None = None
        self.files: FilePolicy | None = None
        self.cluster: ClusterCaches | None = None
        self.events: EventWriter | None = None
        self._scopes_told: tuple[str, ...] = ()  # the NetworkScopes problems an Event told (_tell_scopes_problems)
        self.tls: ServingTLS | None = None
        auth = None
        locate_pods = None
        namespace_labels = None
        known_pods = known_nodes = None
        api = None
        self.cost = CostKeeper()  # bytes and cost per team and scope (docs/scopes.md): counted by the leader
        if cfg.from_file:
            self.files = FilePolicy(list(cfg.from_file))
            policy = PolicyCache(self.files.policy_objects)
            self.files.on_change = policy.invalidate  # Namespaces' labels too: they re-resolve pods
            self.files.on_scopes = self._scopes_changed  # the prices of a NetworkScopes document in the files
            namespace_labels = self.files.namespace_labels
            if self.files.has_pods():
                locate_pods = self.files.locate_pods
                known_pods, known_nodes = self.files.pod_count, self.files.node_count
            readiness = lambda: (True, "policy from files")  # noqa: E731
        else:
            api = load_api_client(cfg.kubeconfig)
            policy = PolicyCache(lambda: self.cluster.policy_objects())
            agent_sa = tuple(cfg.agent_service_account.split(":", 1)) if cfg.agent_service_account else None
            self.cluster = ClusterCaches(api, on_policy_change=policy.invalidate, on_scopes=self._scopes_changed,
                                         on_event=lambda resource, kind: self.metrics.watch_events.labels(
                                             resource, kind).inc(),
                                         agent_service_account=agent_sa,
                                         on_namespace_gone=lambda ns, pods: self.metrics.namespaces_missing.inc())
            locate_pods, namespace_labels, readiness = (self.cluster.locate_pods, self.cluster.namespace_labels,
                                                      self.cluster.synced)
            known_pods, known_nodes = self.cluster.pod_count, self.cluster.agent_node_count
            self.elector = LeaderElector(api, cfg.namespace, cfg.lease_name, cfg.identity,
                                         lease_seconds=cfg.election_lease_seconds,
                                         renew_deadline=cfg.election_lease_seconds * 2 / 3,
                                         retry_period=max(0.25, cfg.election_lease_seconds / 7.5),
                                         on_change=self._leadership)
            self.status_writer = StatusWriter(api, cfg.status_interval,
                                              on_write=lambda result: self.metrics.status_writes.labels(result).inc(),
                                              generation_of=self.cluster.budget_generation,
                                              leading=lambda: self.elector.leading)
            if not cfg.no_auth:
                review = kube_token_review(api)

                def counted_review(token: str) -> dict:
                    self.metrics.token_reviews.inc()
                    return review(token)

                allowed = service_account_username(cfg.agent_service_account) if cfg.agent_service_account else None
                auth = TokenAuthenticator(counted_review, ttl=cfg.token_cache_seconds, allowed_user=allowed,
                                          agent_pod=self.cluster.agent_pod,
                                          agent_pods_synced=self.cluster.agent_pods_synced)
            self.events = EventWriter(kube_event_creator(api),
                                      on_result=lambda result: self.metrics.events.labels(result).inc())
        if cfg.tls_mode == "secret":
            self.tls = ServingTLS(SecretTLS(api, cfg.namespace, cfg.tls_secret, cfg.tls_dns_names, cfg.tls_manage,
                                            on_change=lambda what: self.metrics.tls_changes.labels(what).inc()),
                                  cfg.tls_check_seconds)
        elif cfg.tls_mode == "files":
            self.tls = ServingTLS(FileTLS(cfg.tls_cert_file, cfg.tls_key_file), cfg.tls_check_seconds)
        self.policy = policy
        self.auth = auth
        self.scrape_auth = None
        if cfg.metrics_auth:  # cluster mode with TLS (ControllerConfig): scrapers show a token allowed /metrics
            self.scrape_auth = ScrapeAuthorizer(token_review(api), access_review(api))
        leading = (lambda: self.elector.leading) if self.elector else (lambda: True)
        self.quota = QuotaKeeper()  # volume quotas (docs/quotas.md): counted by the leader only
        self.quota.cost = self.cost  # cost quotas' figures persisted and resumed with the bytes (docs/scopes.md)
        self.state = ControllerState(
            Allocator(policy, namespace_labels, known_pods=known_pods, known_nodes=known_nodes,
                      takeover_seconds=cfg.report_ttl, quota=self.quota, cost=self.cost),
            locate_pods=locate_pods, lease_seconds=cfg.lease_seconds,
            report_ttl=cfg.report_ttl, leader=leading,
            leader_address=(lambda: self.elector.leader_address()) if self.elector else (lambda: None),
            readiness=readiness, answer_wait=cfg.answer_wait,
        )
        node_count = self.cluster.node_count if self.cluster else self.files.node_count if self.files else (lambda: 0)
        self.pacer = ReportPacer(lambda: max(self.state.nodes(), node_count()), cfg.period,
                                 cfg.max_reports_per_second, cfg.lease_seconds)
        self.state.report_period = self.pacer.period
        self.metrics = ControllerMetrics(self.state, leading)
        self.quota_store: QuotaStore | None = None
        if api is not None:  # the use persisted in the EgressBudget's status; a new leader resumes from it
            events = self.events
            self.quota_store = QuotaStore(api, self.quota, cfg.status_interval, leading=leading,
                                          event=lambda *e: events.budget_event(*e) if events else None,
                                          registry=self.metrics.registry, policy=lambda: policy()[0],
                                          ready=lambda: readiness()[0])
            self.status_writer.on_version = self.quota_store.observed  # one object, two writers: no false 409
        else:  # --from-file: one replica, no API server: the use is kept in memory only
            self.quota.set_policy(policy()[0])
            self.quota.resume(None)
        self.metrics.registry.register(QuotaCollector(self.quota, self.quota_store, leading))
        self.metrics.registry.register(CostCollector(self.cost, leading))
        self.connections = ConnectionBounds(cfg.max_connections, cfg.max_connections_per_address)
        self.metrics.registry.register(self.connections)
        self._stop_scrape_reviews = lambda: None
        self.metrics_handler = self.serve_metrics
        self.view_handler = self.serve_view
        if self.scrape_auth is not None:
            self.metrics.registry.register(ScrapeAuthCollector(self.scrape_auth))
            self.metrics_handler, stop_metrics = guarded(self.serve_metrics, self.scrape_auth)
            # /v1/status asks what /metrics asks (get on the nonResourceURL /metrics): the same figures, per team and pod
            self.view_handler, stop_view = guarded(self.serve_view, self.scrape_auth)
            self._stop_scrape_reviews = lambda: (stop_metrics(), stop_view())
        self.state.on_round = self._round_done
        self.state.on_round_failure = self.metrics.round_failures.inc
        self.state.on_refused = self._refused
        if self.tls is not None:
            self.tls.refresh()  # no certificate, no start: the error says which Secret or file

    def _refused(self, node: str, refused) -> None:
        """Count each refused pod by reason; tell the pod's owner with an Event (not for pods the
        pod watch has not seen yet: that is lag, and the pod may not exist)."""
        for r in refused:
            self.metrics.refused_pods.labels(r.reason).inc()
            if self.events is not None and r.reason not in ("UnknownPod", "InvalidName"):
                self.events.pod_event(r.namespace, r.name, f"Refused{r.reason}",
                                      f"node {node}'s report of this pod was refused ({r.reason}); "
                                      "the pod is not allocated by the controller (see docs/controller.md)")

    def _scopes_changed(self, obj) -> list[str]:
        problems = self.cost.set_scopes(obj)
        self._tell_scopes_problems()
        return problems

    def _tell_scopes_problems(self) -> None:
        """A Warning Event on the NetworkScopes object while its description is refused (the last valid one stays
        in force): from the leader only, once per set of problems (again by a new leader)."""
        problems = tuple(self.cost.problems)
        if not problems:
            self._scopes_told = ()
            return
        if problems == self._scopes_told or self.events is None or not (self.elector and self.elector.leading):
            return
        self._scopes_told = problems
        self.events.cluster_event("NetworkScopes", "cluster", "Warning", "NetworkScopesInvalid",
                                  "; ".join(problems) + " (the last valid description stays in force)")

    def _leadership(self, leading: bool) -> None:
        self.state.on_leadership(leading)
        if not leading:
            self.quota.stop()  # the next leader counts, from the persisted use
        if self.quota_store is not None:
            self.quota_store.wake()
        if leading:
            log.info("leading: serving agents at %s", self.cfg.advertise)
            self._scopes_told = ()  # a new leader tells a refused NetworkScopes description again
            self._tell_scopes_problems()
        else:
            log.info("following: agents are sent to the leader")

    def _round_done(self, result: RoundResult) -> None:
        self.metrics.observe_round(result)
        if self.status_writer is not None and result.summary is not None:
            self.status_writer.offer(result.summary, result.wall_time)

    def app(self) -> web.Application:
        stats = APIStats(count_report=self.metrics.reports.inc,
                         count_rejected=lambda reason: self.metrics.rejected.labels(reason).inc())
        app = make_app(self.state, self.auth, stats, per_node_rate=self.cfg.report_rate,
                       per_node_burst=3 * self.cfg.report_rate, self_address=self.cfg.advertise,
                       scheme="http" if self.tls is None else "https",
                       max_pending=self.cfg.max_pending_reports, advised_period=self.pacer.period)
        if self.cfg.metrics_listen is None:
            app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/v1/status", self.view_handler)
        return app

    async def serve_view(self, request: web.Request) -> web.Response:
        """The leader's last round for `netagent status --kubeconfig` (controller/view.py); off the
        event loop: it walks the last round's pods."""
        try:
            top = int(request.query.get("top", view.TOP_PODS))
        except ValueError:
            return web.json_response({"error": "top: an integer", "reason": "Invalid"}, status=400)
        body = await asyncio.get_running_loop().run_in_executor(None, view.cluster_view, self.state, top)
        return web.json_response(body)

    async def serve_metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def start_background(self) -> None:
        if self.files:
            self.files.start()
        if self.cluster:
            self.cluster.start()
        if self.status_writer:
            self.status_writer.start()
        if self.quota_store:
            self.quota_store.start()
        if self.events:
            self.events.start()
        if self.tls:
            self.tls.start()
        if self.elector:
            self.elector.start()
        self.state.start(self.cfg.period)

    def stop_background(self) -> None:
        self.state.stop()
        if self.elector:
            self.elector.stop(release=True)  # the other replica takes over at once, not after the Lease runs out
        if self.status_writer:
            self.status_writer.stop()
        if self.quota_store:
            self.quota_store.stop()
        if self.events:
            self.events.stop()
        if self.tls:
            self.tls.stop()
        if self.cluster:
            self.cluster.stop()
        if self.files:
            self.files.stop()

    async def serve(self) -> None:
        set_tls_read_buffer()  # thousands of kept connections: core/asynctls.py
        raise_open_files_limit(self.cfg.max_connections + 1024)  # one descriptor a connection, and the rest
        runners = []
        app_runner = web.AppRunner(self.app(), access_log=None, keepalive_timeout=self.cfg.keepalive_timeout)
        await app_runner.setup()
        assert app_runner.server is not None
        self.connections.hook(app_runner.server)
        loop = asyncio.get_running_loop()
        agent_server = None
        if self.tls:  # the handshakes in progress bounded (a reconnect storm): core/asynctls.HandshakeGate
            gate = HandshakeGate(self.tls.context, app_runner.server, self.cfg.max_handshakes,
                                 self.cfg.max_connections_per_address, self.connections.refuse_handshake)
            agent_server = await loop.create_server(gate, *self.cfg.listen, backlog=1024)
        else:
            await web.TCPSite(app_runner, *self.cfg.listen, backlog=1024).start()
        runners.append(app_runner)
        if self.cfg.metrics_listen is not None:
            metrics_app = web.Application()
            metrics_app.router.add_get("/metrics", self.metrics_handler)
            metrics_runner = web.AppRunner(metrics_app, access_log=None)
            await metrics_runner.setup()
            # a scraper's token is never sent in the clear: with metrics auth, this port serves TLS too
            await web.TCPSite(metrics_runner, *self.cfg.metrics_listen,
                              ssl_context=self.tls.context if self.tls and self.scrape_auth else None).start()
            runners.append(metrics_runner)
        self.start_background()
        mode = "files " + ", ".join(self.cfg.from_file) if self.files else "the API server"
        log.info("controller serving agents on %s://%s (policy from %s; advertised as %s; round every %gs)",
                 "https" if self.tls else "http", join_host_port(*self.cfg.listen), mode, self.cfg.advertise, self.cfg.period)
        stopped = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopped.set)
        try:
            await stopped.wait()
        finally:
            log.info("stopping: releasing the Lease; agents keep their allocations for their lease")
            await loop.run_in_executor(None, self.stop_background)
            if agent_server is not None:
                agent_server.close()  # no new connections; the runner's cleanup closes the open ones
            for runner in runners:
                await runner.cleanup()
            self._stop_scrape_reviews()


def run(cfg: ControllerConfig) -> int:
    """Serve until SIGTERM/SIGINT; 2 when the controller cannot start or cannot listen."""
    configure_gc()
    try:
        controller = Controller(cfg)
    except Exception as exc:  # environment errors (credentials, ...): say what and stop
        log.error("cannot start: %s", exc)
        return 2
    try:
        asyncio.run(controller.serve())
    except OSError as exc:  # the listen address is taken or not ours
        log.error("cannot serve: %s", exc)
        return 2
    return 0
