"""`netagent controller`: the central controller as a running service.

Two ways to run:
- in a cluster (default: in-cluster config, or --kubeconfig): policy from watched
  EgressClass/EgressBudget objects, pods' nodes from one cluster-wide pod watch (the
  node-binding check), agents authenticated by TokenReview, leader election on a Lease,
  EgressBudget status written by the leader at a bounded rate;
- from files (--from-file, no cluster): the same objects in YAML, reloaded on change,
  no leader election (this replica always leads), no status writes; --no-auth for the
  single-machine demo. Pods in the files, if any, drive the node-binding check.

Threads: the aiohttp event loop (agent API, /metrics), the allocation loop (one round per
--period over all nodes), the leader elector, the watches, the status writer.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import threading
from typing import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .adapter import Adapter
from .api import APIStats, make_app
from .service import ControllerState, RoundResult

log = logging.getLogger("netagent.controller")
DEFAULT_PORT = 9561


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("where the policy comes from (one of)")
    src.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    src.add_argument("--from-file", action="append", default=[], metavar="PATH",
                     help="YAML file or directory of EgressClass/EgressBudget (and optionally Pod) objects; "
                          "no cluster, no leader election (repeatable; reloaded on change)")
    p.add_argument("--listen", default=f"0.0.0.0:{DEFAULT_PORT}", help="agent API address (also /metrics by default)")
    p.add_argument("--metrics-listen", help="serve /metrics on this address instead of the agent API's")
    p.add_argument("--advertise", help="host:port agents use to reach this replica when it leads "
                                       "(default: $POD_IP, else this host's address, with the --listen port)")
    p.add_argument("--period", type=float, default=5.0, help="seconds between allocation rounds")
    p.add_argument("--answer-wait", type=float, default=0.0, metavar="SECONDS",
                   help="hold each report's answer until the next round, at most this long, so it reflects that "
                        "report (one report period less of reaction time; use with a short --period, e.g. "
                        "--period 0.5 --answer-wait 0.7); 0 answers at once from the latest round")
    p.add_argument("--lease-seconds", type=float, default=30.0,
                   help="how long agents keep an answer's allocations without a fresh one (then the safe floor)")
    p.add_argument("--report-rate", type=float, default=2.0, help="reports per second allowed per node (burst 3x)")
    p.add_argument("--report-ttl", type=float, default=60.0, help="a node silent this long leaves the allocation")
    p.add_argument("--status-interval", type=float, default=30.0,
                   help="at most one EgressBudget status write per this many seconds (only on change)")
    le = p.add_argument_group("leader election (cluster mode)")
    le.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "netagent"), help="namespace of the Lease")
    le.add_argument("--lease-name", default="netagent-controller", help="name of the Lease")
    le.add_argument("--identity", help="holder identity (default: <hostname>@<advertise>; the part after @ is "
                                       "where followers send agents)")
    le.add_argument("--election-lease-seconds", type=float, default=15.0,
                    help="Lease duration: a dead leader is replaced after this long")
    auth = p.add_argument_group("agent authentication (cluster mode)")
    auth.add_argument("--no-auth", action="store_true", help="accept reports without a token (demo/tests only)")
    auth.add_argument("--agent-service-account", metavar="NAMESPACE:NAME",
                      help="accept only tokens of this ServiceAccount (recommended: the agent DaemonSet's)")
    auth.add_argument("--token-cache-seconds", type=float, default=60.0, help="how long a TokenReview verdict is reused")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--log-level", default="info")


def configure_gc() -> None:
    """Collect the youngest generation every 50,000 allocations instead of 700: each report
    allocates a few hundred objects, and with the latest reports of thousands of nodes alive the
    default thresholds spent a third of the API's CPU in the cyclic GC (bench/agent_api.py).
    Nothing the controller keeps forms cycles; refcounting frees it."""
    gc.set_threshold(50_000, 50, 50)


def split_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} must be HOST:PORT, for example 0.0.0.0:{DEFAULT_PORT}")
    return host.strip("[]") or "0.0.0.0", int(port)


def default_advertise(listen_host: str, port: int) -> str:
    host = listen_host
    if host in ("0.0.0.0", "::", ""):
        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FilePolicy:
    """--from-file: policy (and pod placement, if the files hold Pods) from YAML, reloaded on change."""

    def __init__(self, paths: list[str]):
        from netagent.sources.files import FileSource

        self.source = FileSource(paths, node=None, interval=1.0)
        self.snapshot, _ = self.source.load()
        for error in self.snapshot.errors:
            log.error("policy files: %s", error)
        self._where = self._index(self.snapshot)
        self.thread = threading.Thread(target=self.source.run, args=(self._changed,), name="policy-files", daemon=True)
        self.on_change: Callable[[], None] = lambda: None

    @staticmethod
    def _index(snapshot) -> dict[tuple[str, str], str]:
        return {(pod.namespace, pod.name): pod.node for pod in snapshot.pods if pod.node}

    def _changed(self, snapshot) -> None:
        self.snapshot, self._where = snapshot, self._index(snapshot)
        self.on_change()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.source.stop()

    def policy_objects(self) -> tuple[list[dict], list[dict]]:
        return list(self.snapshot.classes), list(self.snapshot.budgets)

    def locate_pods(self, keys: list[tuple[str, str]]) -> list[str | None]:
        where = self._where.get
        return [where(k) for k in keys]

    def has_pods(self) -> bool:
        return bool(self.snapshot.pods)


class PolicyCache:
    """load_policy over the current objects, recomputed only after they changed."""

    def __init__(self, objects: Callable[[], tuple[list[dict], list[dict]]]):
        self.objects = objects
        self._dirty = True
        self._value: tuple[object, list[str]] | None = None
        self._lock = threading.Lock()

    def invalidate(self) -> None:
        self._dirty = True

    def __call__(self) -> tuple[object, list[str]]:
        from .policy import load_policy

        with self._lock:
            if self._dirty or self._value is None:
                self._dirty = False
                classes, budgets = self.objects()
                policy, problems = load_policy(classes, budgets)
                previous = self._value[1] if self._value else None
                if problems != previous:
                    for problem in problems:
                        log.warning("policy: %s", problem)
                self._value = (policy, problems)
            return self._value


class Controller:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        if args.from_file and args.kubeconfig:
            raise ValueError("give either --from-file (no cluster) or --kubeconfig, not both")
        from .auth import service_account_user

        allowed = service_account_user(args.agent_service_account) if args.agent_service_account else None
        listen_host, listen_port = split_host_port(args.listen, "--listen")
        self.listen = (listen_host, listen_port)
        self.metrics_listen = split_host_port(args.metrics_listen, "--metrics-listen") if args.metrics_listen else None
        if args.period <= 0 or args.lease_seconds <= args.period:
            raise ValueError(f"--lease-seconds ({args.lease_seconds:g}) must be longer than --period "
                             f"({args.period:g}): agents would fall to the floor between rounds")
        self.advertise = args.advertise or default_advertise(listen_host, listen_port)
        self.elector = None
        self.status_writer = None
        self.files: FilePolicy | None = None
        self.cluster = None
        auth = None
        locate_pods = None
        namespace_labels = None
        if args.from_file:
            self.files = FilePolicy(args.from_file)
            policy = PolicyCache(self.files.policy_objects)
            self.files.on_change = policy.invalidate
            if self.files.has_pods():
                locate_pods = self.files.locate_pods
            if not args.no_auth:
                raise ValueError("--from-file runs without a cluster, so agents cannot be authenticated: add --no-auth")
            readiness = lambda: (True, "policy from files")  # noqa: E731
        else:
            from .kube import ClusterView, StatusWriter, load_api_client
            from .leader import LeaderElector

            api = load_api_client(args.kubeconfig)
            policy = PolicyCache(lambda: self.cluster.policy_objects())
            self.cluster = ClusterView(api, on_policy_change=policy.invalidate,
                                       on_event=lambda resource, kind: self.metrics.watch_events.labels(
                                           resource, kind).inc())
            locate_pods, namespace_labels, readiness = (self.cluster.locate_pods, self.cluster.namespace_labels,
                                                      self.cluster.synced)
            identity = args.identity or f"{socket.gethostname()}@{self.advertise}"
            self.elector = LeaderElector(api, args.namespace, args.lease_name, identity,
                                         lease_seconds=args.election_lease_seconds,
                                         renew_deadline=args.election_lease_seconds * 2 / 3,
                                         retry_period=max(0.5, args.election_lease_seconds / 7.5),
                                         on_change=self._leadership)
            self.status_writer = StatusWriter(api, args.status_interval,
                                              on_write=lambda result: self.metrics.status_writes.labels(result).inc(),
                                              generation_of=self.cluster.budget_generation,
                                              leading=lambda: self.elector.leading)
            if not args.no_auth:
                from .auth import TokenAuthenticator, kube_token_review

                review = kube_token_review(api)

                def counted_review(token: str) -> dict:
                    self.metrics.token_reviews.inc()
                    return review(token)

                auth = TokenAuthenticator(counted_review, ttl=args.token_cache_seconds, allowed_users=allowed)
        self.policy = policy
        self.auth = auth
        leading = (lambda: self.elector.leading) if self.elector else (lambda: True)
        self.state = ControllerState(
            Adapter(policy, namespace_labels), locate_pods=locate_pods, lease_seconds=args.lease_seconds,
            report_ttl=args.report_ttl, leader=leading,
            leader_address=(lambda: self.elector.leader_address()) if self.elector else (lambda: None),
            readiness=readiness, answer_wait=args.answer_wait,
        )
        from .metrics import ControllerMetrics

        self.metrics = ControllerMetrics(self.state, leading)
        self.state.on_round = self._round_done
        self.state.on_round_failure = self.metrics.round_failures.inc

    def _leadership(self, leading: bool) -> None:
        self.state.on_leadership(leading)
        if leading:
            log.info("leading: serving agents at %s", self.advertise)
        else:
            log.info("following: agents are sent to the leader")

    def _round_done(self, result: RoundResult) -> None:
        self.metrics.observe_round(result)
        if self.status_writer is not None and result.summary is not None:
            self.status_writer.offer(result.summary, result.wall_time)

    def app(self) -> web.Application:
        stats = APIStats(count_report=self.metrics.reports.inc,
                         count_rejected=lambda reason: self.metrics.rejected.labels(reason).inc())
        app = make_app(self.state, self.auth, stats, per_node_rate=self.args.report_rate,
                       per_node_burst=3 * self.args.report_rate, self_address=self.advertise)
        if self.metrics_listen is None:
            app.router.add_get("/metrics", self.serve_metrics)
        return app

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
        if self.elector:
            self.elector.start()
        self.state.start(self.args.period)

    def stop_background(self) -> None:
        self.state.stop()
        if self.elector:
            self.elector.stop(release=True)  # the other replica takes over at once, not after the Lease runs out
        if self.status_writer:
            self.status_writer.stop()
        if self.cluster:
            self.cluster.stop()
        if self.files:
            self.files.stop()

    async def serve(self) -> None:
        runners = []
        app_runner = web.AppRunner(self.app(), access_log=None)
        await app_runner.setup()
        await web.TCPSite(app_runner, *self.listen, backlog=1024).start()
        runners.append(app_runner)
        if self.metrics_listen is not None:
            metrics_app = web.Application()
            metrics_app.router.add_get("/metrics", self.serve_metrics)
            metrics_runner = web.AppRunner(metrics_app, access_log=None)
            await metrics_runner.setup()
            await web.TCPSite(metrics_runner, *self.metrics_listen).start()
            runners.append(metrics_runner)
        self.start_background()
        mode = "files " + ", ".join(self.args.from_file) if self.files else "the API server"
        log.info("controller serving agents on http://%s:%d (policy from %s; advertised as %s; round every %gs)",
                 *self.listen, mode, self.advertise, self.args.period)
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopped.set)
        try:
            await stopped.wait()
        finally:
            log.info("stopping: releasing the Lease; agents keep their allocations for their lease")
            await loop.run_in_executor(None, self.stop_background)
            for runner in runners:
                await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    from netagent import logsetup

    logsetup.setup(args.log_format, args.log_level)
    configure_gc()
    try:
        controller = Controller(args)
    except Exception as exc:  # configuration and environment errors: say what and stop
        log.error("cannot start: %s", exc)
        return 2
    try:
        asyncio.run(controller.serve())
    except OSError as exc:  # the listen address is taken or not ours
        log.error("cannot serve: %s", exc)
        return 2
    return 0
