"""netagent at cluster scale against a real API server: N nodes, 110 pods each, 10k agents.

    python3 bench/scale.py [--nodes 1000] [--pods-per-node 110] [--period 5] [--measure 60]
                           [--baseline 20] [--replicas 2] [--concurrency 48] [--no-pod-status] [--settle 10]
                           [--agent-processes 1] [--apiservers 1] [--apiserver-memory-limit-mib MIB]
                           [--max-reports-per-second RATE] [--lease-seconds S] [--report-ttl S] [--quotas]

What runs (all on this machine):
- the harness's real etcd + kube-apiserver (lab/kube.py; --apiservers more on the same etcd), tuned as a large cluster's would be
  (see APISERVER_ARGS / ETCD_ARGS), with an audit policy that logs netagent's own requests only
  (level Metadata for the netagent-system service accounts, None for everything else);
- N fake Nodes (Ready, as kwok would report them, but with no heartbeats: their lease traffic is
  not netagent's and would cost these 2 cores more than netagent does) and 110 pods on most
  (Running, one IP each from the node's /24, a mix of namespaces, teams, classes and
  annotations), the EgressClasses and an EgressBudget, netagent's CRDs and RBAC from deploy/;
- the real controller, --replicas processes with leader election, each with its own
  ServiceAccount token (`netagent controller --kubeconfig ...`);
- N simulated agents in --agent-processes worker processes (asyncio, a slice of the nodes each;
  the figures are computed in this process from their state), behaving towards the API server and the
  controller as the real agent does: one agent pod per node (as the DaemonSet's) and a
  TokenRequest token bound to it (so it carries the node claim); a list + resumable watch of its
  own node's pods (fieldSelector=spec.nodeName), of EgressClasses and of EgressBudgets, each on
  its own connection as the kubernetes client opens them; relists only after 410 Gone; a report
  every period with +-20 % jitter built by the agent's own code (core.policy.resolve_pods,
  netagent.demand.PodDemand, netagent.reporter.build_report, core.wire), posted to a random
  replica (the Service) and following the 307 to the leader; simulated traffic per pod as
  bench/simulation.py does (each pod sends min(its appetite, its limit); the demand estimator
  sees the counters), in both directions: each pod also downloads (its own appetite draw, the
  download limits of the answers; spec.ingressTotal in the budget) unless --no-downloads.

Printed, with the command and the machine: API server requests from netagent by client kind,
verb and resource (audit log) and their share of all requests (apiserver_request_total), LISTs
from agents after start, watches open, memory and CPU of kube-apiserver and etcd without and
with netagent; controller time from start to ready, memory, CPU; reports/s answered, p50/p99
answer latency, non-200 answers; TokenReviews and status writes per minute; the cluster's
allocated rate against the budget, and its downloads against the download budget. The simulated agents' own CPU is printed apart: it is this
benchmark's cost, not netagent's.
"""
from __future__ import annotations

import argparse
import calendar
import asyncio
import base64
import datetime
import json
import multiprocessing
import os
import platform
import random
import resource
import signal
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterable, NamedTuple

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.timing import process_cpu_seconds as cpu_seconds  # noqa: E402
from core.asynctls import TLS_READ_BUFFER_BYTES, set_tls_read_buffer  # noqa: E402
from core.direction import Direction, PerDirection  # noqa: E402
from core.engine import PodDemandIn, allocate  # noqa: E402
from core.objects import ANNOTATION_BANDWIDTH, ANNOTATION_CLASS, PodRecord, policy_fields  # noqa: E402
from core.policy import load_policy, resolve_pods  # noqa: E402
from controller.config import DEFAULT_TOKEN_CACHE_SECONDS  # noqa: E402
from core.wire import answer_decoder, encoder  # noqa: E402
from lab.kube import CONTROL_PLANE_BINARIES, ControlPlane, find_assets, free_port, write_kubeconfig  # noqa: E402
from lab.procs import stop_process  # noqa: E402
from netagent.agent import ReportInputs  # noqa: E402
from netagent.demand import PodDemand, Sample  # noqa: E402
from netagent.metrics import AgentMetrics  # noqa: E402
from netagent.view import NodeView, PodView  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from netagent.reporter import (advised_period, build_report, leader_failure, report_wait,  # noqa: E402
                               stretches_period)
from netagent.transport import refusal_reason, retry_after_seconds  # noqa: E402

SYSTEM_NS = "netagent-system"
AGENT_SA = "netagent-agent"
CONTROLLER_SA = "netagent-controller"
AUDIENCE = "netagent-controller"
TLS_SECRET = "netagent-controller-tls"  # the controller's default --tls-secret, created by it (--tls-manage)
SERVICE_NAME = f"netagent-controller.{SYSTEM_NS}.svc"  # a name in its certificate
TEAMS = 20
NAMESPACES_PER_TEAM = 5
# The budget is about 40 % of what the pods want (appetite() averages ~33 Mbit/s a pod), so
# the allocation is contended everywhere: 1.5 Gbit/s for a node of 110 pods.
BUDGET_PER_POD_BPS = 1.5e9 / 110
FLOOR_BPS = 1e6  # what an agent enforces before its first answer (the controller's safe floor is smaller)
# Downloads (unless --no-downloads): every agent shapes them, each pod wants twice its upload
# appetite's draw (its own draw: the uploads are the same pods' as without downloads), and the
# cluster's download budget (spec.ingressTotal) is twice the upload one: as contended.
DOWNLOAD_FACTOR = 2
WATCH_TIMEOUT_S = 300  # as core/reflector.py
# A large cluster's apiserver (kube-up's settings for 5,000 nodes; the watch cache sizes itself).
APISERVER_ARGS = [
    "--max-requests-inflight=3000",
    "--max-mutating-requests-inflight=1000",
    "--event-ttl=1h",
]
ETCD_ARGS = ["--quota-backend-bytes=8589934592", "--snapshot-count=10000"]
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts:{SYSTEM_NS}"]
  - level: None
"""
CLASSES = [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "bulk"},
     "spec": {"weight": 1, "max": "1G"}},
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "interactive"},
     "spec": {"weight": 4, "min": "2M"}},
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "batch"},
     "spec": {"weight": 1, "max": "200M"}},
]


def team_namespaces(t: int) -> list[str]:
    return [f"team{t:02d}-ns{k}" for k in range(NAMESPACES_PER_TEAM)]


def budget_totals(nodes: int, pods_per_node: int, downloads: bool = True) -> tuple[float, float]:
    """The upload and download budgets, bit/s (0 for downloads without `downloads`)."""
    total = nodes * pods_per_node * BUDGET_PER_POD_BPS
    return total, DOWNLOAD_FACTOR * total if downloads else 0.0


def budget_object(nodes: int, pods_per_node: int, downloads: bool = True) -> dict:
    """The EgressBudget: the upload total, and the download total (spec.ingressTotal) with `downloads`."""
    total, down = budget_totals(nodes, pods_per_node, downloads)
    guarantee = f"{total / TEAMS / 2 / 1e6:.0f}M"  # every 5th team: half its even share
    teams = [{"name": f"team{t:02d}", "namespaces": team_namespaces(t), "weight": 1 + t % 4,
              "defaultClass": "bulk", **({"min": guarantee} if t % 5 == 0 else {})} for t in range(TEAMS)]
    spec = {"total": f"{total / 1e6:.0f}M", "teams": teams}
    if downloads:
        spec["ingressTotal"] = f"{down / 1e6:.0f}M"
    return {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
            "spec": spec}


# --quotas: every team's quota is far above what it moves in a window (the overhead of counting and
# keeping the use, not of a cap); the exhausted rate only has to be valid.
QUOTA_BYTES = "100Pi"
QUOTA_EXHAUSTED_RATE = "10M"
STATUS_INTERVAL_S = 30.0  # the controller's --status-interval default: a status.quota patch at most this often
# The verdict on --quotas, set before the first run: the leader's CPU per report with quotas on every
# team at most this many times the same run's without, and netagent's writes to the API server at most
# one status.quota patch per status interval more (plus one: a window can hold one interval's both ends).
QUOTA_CPU_RATIO_MAX = 1.5


def with_quotas(budget: dict) -> dict:
    """`budget` (budget_object's) with a volume quota on every team, downloads too when it has a
    download total (docs/quotas.md's fields)."""
    spec = budget["spec"]
    quota: dict = {"period": "Month", "bytes": QUOTA_BYTES, "exhaustedRate": QUOTA_EXHAUSTED_RATE}
    if "ingressTotal" in spec:
        quota["ingress"] = {"bytes": QUOTA_BYTES, "exhaustedRate": QUOTA_EXHAUSTED_RATE}
    teams = [{**t, "quota": dict(quota)} for t in spec["teams"]]
    return {**budget, "spec": {**spec, "teams": teams}}


class WindowCost(NamedTuple):
    """One window's cost of netagent: the leader's CPU seconds per report it answered, and writes per
    minute to the API server (all clients', and netagent's own: the audit log)."""
    cpu_per_report_s: float
    reports_per_s: float
    writes_per_min: float
    netagent_writes_per_min: float
    budget_writes_per_min: float  # of these, to the EgressBudget (its status: the quotas' use goes there)


def window_cost(leader_cores: float, answered: int, measure_s: float, writes: float, netagent_writes: int,
                budget_writes: int) -> WindowCost:
    """The figures of a window of `measure_s` seconds: the busier replica's cores, the reports answered
    200 in it, the apiservers' write requests in it (apiserver_request_total), netagent's stored writes
    (audit log) and of those its writes to EgressBudgets."""
    rate = answered / measure_s
    return WindowCost(leader_cores / rate if rate > 0 else float("inf"), rate, writes * 60 / measure_s,
                      netagent_writes * 60 / measure_s, budget_writes * 60 / measure_s)


def quota_verdict(off: WindowCost, on: WindowCost, measure_s: float,
                  status_interval_s: float = STATUS_INTERVAL_S) -> tuple[bool, str]:
    """QUOTA_CPU_RATIO_MAX on the CPU per report; netagent's writes to the EgressBudget with quotas at most
    one status.quota patch per status interval more than without (+1 for a window that holds both ends
    of one)."""
    ratio = on.cpu_per_report_s / off.cpu_per_report_s if off.cpu_per_report_s > 0 else float("inf")
    extra = (measure_s / status_interval_s + 1) * 60 / measure_s
    more = on.budget_writes_per_min - off.budget_writes_per_min
    ok = ratio <= QUOTA_CPU_RATIO_MAX and more <= extra
    return ok, (f"CPU per report on/off {ratio:.2f} (rule <= {QUOTA_CPU_RATIO_MAX}); netagent's EgressBudget writes "
                f"{more:+.1f}/min (rule <= +{extra:.1f}/min): {'PASS' if ok else 'FAIL'}")


def node_name(i: int) -> str:
    return f"scale-node-{i:05d}"


def pod_ip(i: int, j: int) -> str:
    return f"10.{64 + i // 256}.{i % 256}.{j + 2}"


def pod_object(i: int, j: int) -> dict:
    t = (i + j) % TEAMS
    ns = team_namespaces(t)[(i // TEAMS + j) % NAMESPACES_PER_TEAM]
    annotations = {}
    if j % 5 == 0:
        annotations[ANNOTATION_CLASS] = "interactive"
    elif j % 7 == 0:
        annotations[ANNOTATION_CLASS] = "batch"
    if j % 11 == 0:
        annotations[ANNOTATION_BANDWIDTH] = "50M"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"w-{i:05d}-{j:03d}", "namespace": ns, "annotations": annotations,
                         "labels": {"app": f"app-{j % 10}"}},
            "spec": {"nodeName": node_name(i), "automountServiceAccountToken": False,
                     "containers": [{"name": "main", "image": "registry.invalid/train:1"}]}}


def pod_status(ip: str) -> dict:
    return {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def node_object(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node_name(i), "labels": {"kubernetes.io/hostname": node_name(i), "type": "scale"}},
            "spec": {"podCIDR": f"10.{64 + i // 256}.{i % 256}.0/24"},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                       "capacity": {"pods": "110", "cpu": "96", "memory": "1Ti"},
                       "allocatable": {"pods": "110", "cpu": "96", "memory": "1Ti"},
                       "addresses": [{"type": "InternalIP", "address": f"10.1.{i // 256}.{i % 256}"}]}}


def appetite(rng: random.Random) -> float:
    """A pod's true internet appetite, bit/s: a third idle, most modest, a few heavy."""
    r = rng.random()
    if r < 0.35:
        return 0.0
    if r < 0.95:
        return rng.lognormvariate(0, 1) * 5e6
    return rng.uniform(100e6, 1e9)


# -- processes -----------------------------------------------------------------------------------

def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Usage:
    """CPU (cores) and RSS of processes over a window."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.t0 = time.monotonic()
        self.c0 = {k: cpu_seconds(p) for k, p in pids.items()}

    def read(self) -> dict[str, tuple[float, float]]:
        dt = time.monotonic() - self.t0
        return {k: ((cpu_seconds(p) - self.c0[k]) / dt, rss_mib(p)) for k, p in self.pids.items()}


class MemoryGuard:
    """Cancels the run when the machine's available memory falls below `floor_mib`: the machine is
    shared, and the OOM killer would pick a process of someone else's. Keeps every watched
    process's peak RSS, printed either way (what a size costs, and what gave first)."""

    def __init__(self, floor_mib: float):
        self.floor_mib = floor_mib
        self.pids: dict[str, int] = {"bench": os.getpid()}
        self.peak: Counter = Counter()
        self.tripped = ""

    async def run(self, task: asyncio.Task) -> None:
        while True:
            for name, pid in list(self.pids.items()):
                try:
                    self.peak[name] = max(self.peak[name], rss_mib(pid))
                except OSError:  # exited (a killed leader)
                    pass
            available = next(int(line.split()[1]) / 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                             if line.startswith("MemAvailable:"))
            if available < self.floor_mib:
                self.tripped = f"MemAvailable {available:.0f} MiB < {self.floor_mib:.0f} MiB"
                task.cancel()
                return
            await asyncio.sleep(2.0)

    def summary(self) -> str:
        return ", ".join(f"{k} {v / 1024:.1f} GiB" for k, v in sorted(self.peak.items()))


# -- the API server over aiohttp -----------------------------------------------------------------

class Api:
    def __init__(self, url: str, ca_file: Path, *, cert: tuple[Path, Path] | None = None, token: str | None = None,
                 limit: int = 64):
        self.url = url
        self.ctx = ssl.create_default_context(cafile=str(ca_file))
        if cert:
            self.ctx.load_cert_chain(*cert)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ctx, limit=limit),
                                             headers=self.headers, timeout=aiohttp.ClientTimeout(total=120))

    async def call(self, method: str, path: str, body: dict | None = None, ok=(200, 201),
                   content_type: str = "application/json") -> dict:
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(5):
            async with self.session.request(method, self.url + path, data=data,
                                            headers={"Content-Type": content_type}) as r:
                if r.status in ok:
                    return await r.json()
                if r.status == 409 and method == "POST":
                    return {}
                text = await r.text()
                # 403 "error looking up service account": the admission cache has not seen it yet
                retry = r.status in (429, 500, 503, 504) or (r.status == 403 and "looking up service account" in text)
                if retry and attempt < 4:
                    await asyncio.sleep(0.5 * (attempt + 1))
                    continue
                raise RuntimeError(f"{method} {path}: {r.status} {text[:300]}")

    async def close(self) -> None:
        await self.session.close()


async def bounded(concurrency: int, coros: Iterable[Awaitable], progress: str = "", total: int = 0,
                  keep: bool = True) -> list:
    """Awaits `coros` with at most `concurrency` in flight, taking them from the iterable as workers
    free up (300,000 pod bodies and coroutines built up front were the bench's own peak memory);
    their results in order when `keep`, else []."""
    done = 0
    started = time.monotonic()
    results: dict[int, object] = {}
    items = enumerate(coros)  # shared by the workers: next() never awaits, so no two take the same

    async def worker() -> None:
        nonlocal done
        for k, c in items:
            result = await c
            if keep:
                results[k] = result
            done += 1
            if progress and done % 5000 == 0:
                print(f"  {progress}: {done}/{total or '?'} ({done / (time.monotonic() - started):.0f}/s)", flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [results[k] for k in range(len(results))]


# -- the simulated agent -------------------------------------------------------------------------

@dataclass
class Stats:
    lists: Counter = field(default_factory=Counter)  # (kind, phase) -> LIST calls
    relists_410: int = 0
    answers: Counter = field(default_factory=Counter)  # HTTP status -> count
    latencies: list = field(default_factory=list)  # seconds, successful answers in the window
    redirects: int = 0
    window: bool = False
    started_at: float = 0.0


class SimAgent:
    """One node's agent towards the API server and the controller (see the module docstring)."""

    policy_cache: dict = {}

    def __init__(self, host: "AgentHost", i: int, token: str):
        self.host, self.i, self.node, self.token = host, i, node_name(i), token
        self.rng = random.Random(i)
        self.pods: dict[str, PodRecord] = {}
        self.classes: dict[str, dict] = {}
        self.budgets: dict[str, dict] = {}
        self.synced = asyncio.Event()
        self.demand: dict[str, PodDemand] = {}
        self.appetite: dict[str, float] = {}
        self.bytes: dict[str, int] = {}
        self.overlimits: dict[str, int] = {}
        self.limits: dict[str, float] = {}
        # downloads: the same per pod, from the download classes (an rng of their own)
        self.down_rng = random.Random(f"down{i}")
        self.down_demand: dict[str, PodDemand] = {}
        self.down_appetite: dict[str, float] = {}
        self.down_bytes: dict[str, int] = {}
        self.down_overlimits: dict[str, int] = {}
        self.down_limits: dict[str, float] = {}
        self.answers = 0  # answers received (the estimator counts them, as the agent does)
        self.node_rate = 0.0
        self.leader: str | None = None
        self.leader_failed = False  # the last post failed at the remembered leader: ask the Service again
        self.seq = 0
        self._session: aiohttp.ClientSession | None = None
        self.advised = 0.0  # the period the leader asks for (netagent.reporter.advised_period)
        self.resolved: list = []
        self._resolved_key = None
        self._dirty = True
        self.sampled_at: float | None = None  # when advance() last added bytes (the counters' clock)

    # API server side: list once, then resumable watches, relist only on 410
    async def list_watch(self, path: str, store: dict, kind: str, convert) -> None:
        api, stats = self.host.agent_api, self.host.stats
        url, headers = self.host.api_url(self) + path, {"Authorization": f"Bearer {self.token}"}

        async def relist() -> str:
            stats.lists[(kind, "window" if stats.window else "start")] += 1
            async with api.session.get(url, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"list {kind}: {r.status}")
                rv = self.fill(store, kind, convert, await r.json())
            self._dirty = True
            self.host.mark_synced(self, kind)
            return rv

        await watch_loop(self.host, url, headers, kind, relist,
                         lambda line, rv: self.apply_event(store, kind, convert, line, rv), self.rng)

    @staticmethod
    def fill(store: dict, kind: str, convert, body: dict) -> str:
        """A LIST's items into `store`; its resourceVersion. Apart from list_watch so the decoded
        body is freed here: a local of that coroutine stayed alive through the watch that followed
        (4,500 objects an agent for 30 pods, the largest part of a simulated agent's Python heap)."""
        store.clear()
        for obj in body.get("items") or []:
            store[SimAgent.key(kind, obj)] = convert(obj)
        return body["metadata"]["resourceVersion"]

    @staticmethod
    def key(kind: str, obj: dict) -> str:
        """An object's key in its store: namespace/name for pods, the name for the cluster-wide CRDs."""
        meta = obj["metadata"]
        return f"{meta['namespace']}/{meta['name']}" if kind == "pods" else meta["name"]

    def apply_event(self, store: dict, kind: str, convert, line: bytes, rv: str) -> tuple[str | None, bool]:
        """One watch event into `store`: (the resourceVersion to resume from, whether the watch
        ended). A method, as fill(), so the decoded event is not held between events."""
        ev = json.loads(line)
        obj = ev["object"]
        if ev["type"] == "ERROR":
            if obj.get("code") == 410:
                self.host.stats.relists_410 += 1
                return None, True
            return rv, True
        rv = obj["metadata"]["resourceVersion"]
        if ev["type"] == "BOOKMARK":
            return rv, False
        key = self.key(kind, obj)
        old = store.get(key)
        if ev["type"] == "DELETED":
            store.pop(key, None)
        else:
            store[key] = convert(obj)
        # as the agent's reflector: an event that leaves what is kept as it was (the controller's status
        # writes to the EgressBudget, policy_fields) is no change; each one re-resolved every agent's pods
        if store.get(key) is not old:
            self._dirty = True
        return rv, False

    def policy(self):
        key = tuple(sorted((k, v["metadata"]["generation"]) for k, v in self.classes.items())) + \
            tuple(sorted((k, v["metadata"]["generation"]) for k, v in self.budgets.items()))
        cached = SimAgent.policy_cache.get(key)
        if cached is None:
            cached = SimAgent.policy_cache[key] = load_policy(list(self.classes.values()), list(self.budgets.values()))[0]
        return key, cached

    def advance(self, t: float) -> tuple[float, float]:
        """One period of simulated traffic under the current limits; the node's internet egress and
        ingress, bit/s (ingress 0 without downloads)."""
        key, policy = self.policy()
        if self._dirty or key != self._resolved_key:  # the real agent re-resolves on change only
            self.resolved = resolve_pods(policy, self.pods.values())
            self._resolved_key, self._dirty = key, False
        total = down = 0.0
        downloads = self.host.downloads
        # the bytes of the time that really passed since the last sample, as a kernel counter
        # counts them: not the nominal period (the sleep has +-20 % jitter and this loop can lag;
        # bytes for 5 s divided by the 4..6 s the estimator measured made every pod's usage
        # +-20 % wrong, and demand, the max of two such samples, ~10 % high: budget given to
        # pods that did not use it)
        dt = t - self.sampled_at if self.sampled_at is not None else self.period()
        self.sampled_at = t
        for rp in self.resolved:
            k = rp.key
            if k not in self.appetite:
                self.appetite[k] = appetite(self.rng)
                self.bytes[k] = self.overlimits[k] = 0
                self.demand[k] = PodDemand()
                if downloads:
                    self.down_appetite[k] = DOWNLOAD_FACTOR * appetite(self.down_rng)
                    self.down_bytes[k] = self.down_overlimits[k] = 0
                    self.down_demand[k] = PodDemand()
            factor = self.host.factor(rp.team)
            total += self._carry(k, self.appetite[k] * factor, self.limits, self.bytes, self.overlimits,
                                 self.demand, rp.limits[Direction.UPLOAD].max_bps, t, dt)
            if downloads:  # as netagent.sampler does for the download classes
                down += self._carry(k, self.down_appetite[k] * factor, self.down_limits, self.down_bytes,
                                    self.down_overlimits, self.down_demand, rp.limits[Direction.DOWNLOAD].max_bps, t, dt)
        return total, down

    def _carry(self, k: str, want: float, limits: dict, counted: dict, overlimits: dict,
               demand: dict[str, PodDemand], cap: int, t: float, dt: float) -> float:
        """One pod's traffic in one direction over `dt`: min(want, its limit), added to its counter
        as the kernel counts it, and the sample the agent's demand estimator takes of it."""
        limit = limits.get(k, FLOOR_BPS)
        sent = min(want, limit)
        counted[k] += int(sent * dt / 8)
        if want > limit * 1.001:
            overlimits[k] += 1
        demand[k].update(Sample(t, counted[k], 0, overlimits[k], 0), int(limit), cap, self.answers)
        return sent

    def session(self) -> aiohttp.ClientSession:
        """This agent's connection to the controller, from its own address (127.x.y.z, as each node
        has its own IP: the controller bounds unverified tokens per client address)."""
        if self._session is None:
            i = self.i + 1
            local = (f"127.{1 + i // 65536}.{(i // 256) % 256}.{i % 256}", 0)
            # one connection kept alive between reports, as the agent's transport (netagent/transport.py);
            # --connection-per-report: a new connection and TLS handshake per report, as agents before 0.1.0
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=2, ssl=self.host.controller_ctx, local_addr=local,
                                               **({"force_close": True} if self.host.connection_per_report
                                                  else {"keepalive_timeout": 3600})),
                timeout=aiohttp.ClientTimeout(total=self.host.report_timeout))  # the agent's 3 s by default
        return self._session

    def period(self) -> float:
        return max(self.host.period, self.advised)  # as netagent.reporter.Reporter.effective_period

    async def report_loop(self) -> None:
        b = self.host
        await self.synced.wait()
        await asyncio.sleep(self.rng.uniform(0, b.period))
        failures = 0
        while not b.stopping:
            started = time.monotonic()
            egress, ingress = self.advance(started)
            self.seq += 1
            inputs = ReportInputs(self.node, tuple(self.resolved), PerDirection(self.demand, self.down_demand),
                                  shaped=PerDirection(True, b.downloads))
            # --quotas: the pods' cumulative bytes, as the real agent always sends them (in both windows:
            # what differs between them is the teams' quotas)
            counters = {k: (self.bytes.get(k, 0), self.down_bytes.get(k, 0)) for k in self.bytes} if b.counters else None
            # the node's egress is its classes' bytes of the same seconds (no host traffic here): as the real
            # agent reads both counters together, node_shaped is the same figure (issue 37)
            body = encoder.encode(build_report(inputs, self.seq, self.period(), egress, node_ingress_bps=ingress,
                                               counters=counters, epoch=f"scale/{self.i}" if counters else None,
                                               node_shaped=PerDirection(egress, ingress if b.downloads else None)))
            answered, retry_after, stretches = await self.post(body, started)
            if not answered and self.leader_failed:  # as the agent: a dead leader's address, then the Service
                answered, retry_after, stretches = await self.post(body, started)
            failures = 0 if answered else failures + stretches
            # the agent's own wait (netagent.reporter.report_wait): longer after failures in a row
            # that signal overload (stretches_period), never sooner than a Retry-After
            await asyncio.sleep(report_wait(self.period(), failures, retry_after, self.rng.uniform(0.8, 1.2),
                                            time.monotonic() - started))

    async def post(self, body: bytes, started: float) -> tuple[bool, float, bool]:
        """One report as the agent's transport posts it: (answered, the refusal's Retry-After or 0,
        whether the failure stretches the period: netagent.reporter.stretches_period). When the
        remembered leader failed short of refusing the report, `leader_failed` says to ask again."""
        b = self.host
        path = f"/v1/nodes/{self.node}/report"
        self.leader_failed = False
        to_leader = self.leader is not None
        url = (self.leader or self.rng.choice(b.controller_urls)) + path
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        for _ in range(3):
            try:
                # connect to a replica's address, verify the Service's name against the pinned CA
                async with self.session().post(url, data=body, headers=headers, allow_redirects=False,
                                                     server_hostname=SERVICE_NAME) as r:
                    raw = await r.read()
                    status = r.status
                    location = r.headers.get("Location")
                    retry = r.headers.get("Retry-After")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                b.errors[f"report: {type(e).__name__}"] += 1
                b.stats.answers["error"] += 1
                refused = isinstance(getattr(e, "os_error", None), ConnectionRefusedError)
                self.left_leader(to_leader, None, "", refused)
                return False, 0.0, stretches_period(None, "", refused)
            if status in (307, 308) and location:
                b.stats.redirects += 1
                url = location
                self.leader = location.split("/v1/", 1)[0]
                continue
            b.stats.answers[status] += 1
            if status != 200:
                b.errors[f"report {status}: {raw[:120].decode(errors='replace')}"] += 1
                reason = refusal_reason(raw)
                self.left_leader(to_leader, status, reason, False)
                # as the agent's transport reads any refusal
                return False, retry_after_seconds(retry) or 0.0, stretches_period(status, reason, False)
            answer = answer_decoder.decode(raw)
            self.advised = advised_period(answer)
            if b.stats.window:
                b.stats.latencies.append(time.monotonic() - started)
            b.last_answer = time.monotonic()
            if answer.generation:  # generation 0 (a new leader without a round): keep what we have
                if b.killed and url.startswith(b.killed):
                    b.errors["answer from the killed leader"] += 1
                elif b.killed and b.first_new_answer is None:
                    b.first_new_answer = time.monotonic()
                limits = {f"{p.namespace}/{p.name}": float(p.limit_bps) for p in answer.pods}
                if b.killed and self.i not in b.answered_after_kill:
                    b.answered_after_kill.add(self.i)
                    # until the new leader's first answer from a round, the agent held its limits
                    held = b.held_at_kill.get(self.i, {})
                    b.changed_before_first_answer += sum(1 for k, v in self.limits.items() if held.get(k) != v)
                self.limits = limits
                if b.downloads:  # a pod without a download allocation in the answer keeps its limit
                    self.down_limits.update({f"{p.namespace}/{p.name}": float(p.ingress_limit_bps)
                                             for p in answer.pods if p.ingress_limit_bps is not None})
                self.answers += 1
                self.node_rate = float(answer.node_rate_bps)
            return True, 0.0, False
        b.errors["report: too many redirects"] += 1
        return False, 0.0, True

    def left_leader(self, to_leader: bool, status: int | None, reason: str, refused: bool) -> None:
        """After a failed post, as the agent (netagent.reporter.leader_failure): forget the leader
        unless it answered and refused; ask the Service again now only when it was the leader's
        address that failed and that leader is gone."""
        leave, again = leader_failure(status, reason, refused)
        if leave:
            self.leader = None
        self.leader_failed = to_leader and again

    def start(self) -> list[asyncio.Task]:
        sel = f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.node}&limit=500"
        grp = "/apis/netagent.io/v1alpha1"
        delay = random.Random(f"start{self.i}").uniform(0, self.host.ramp) if self.host.ramp > 0 else 0.0
        watches = () if self.host.shared_watches else (  # --sim-shared-watches: the worker's (AgentHost)
            self.list_watch(sel, self.pods, "pods", PodRecord.from_object),
            self.list_watch(f"{grp}/egressclasses?limit=500", self.classes, "egressclasses",
                            lambda o: self.host.shared("egressclasses", o)),
            self.list_watch(f"{grp}/egressbudgets?limit=500", self.budgets, "egressbudgets",
                            lambda o: self.host.shared("egressbudgets", o)))
        return [asyncio.create_task(self.ramped(delay, c)) for c in (*watches, self.report_loop())]

    @staticmethod
    async def ramped(delay: float, coro) -> None:
        """`coro` once this agent has started, `delay` s in (drawn from --agent-ramp: its node's DaemonSet pod
        coming up)."""
        if delay > 0:
            await asyncio.sleep(delay)
        await coro


async def watch_loop(host: "AgentHost", url: str, headers: dict, kind: str, relist: Callable[[], Awaitable[str]],
                     apply: Callable[[bytes, str], tuple[str | None, bool]], rng: random.Random) -> None:
    """List (`relist`: its resourceVersion), then resumable watches, each event through `apply` (the
    resourceVersion to resume from, whether the watch ended); relist only on 410. A failure is counted in
    the host's errors and retried with jittered backoff. One loop for a simulated agent's own watch and a
    worker's shared one (--sim-shared-watches)."""
    sep = "&" if "?" in url else "?"
    rv: str | None = None
    backoff = 0.5
    while not host.stopping:
        try:
            if rv is None:
                rv = await relist()
            watch = (f"{url}{sep}watch=1&allowWatchBookmarks=true&timeoutSeconds={WATCH_TIMEOUT_S}"
                     f"&resourceVersion={rv}")
            async with host.agent_api.session.get(watch, headers=headers, timeout=aiohttp.ClientTimeout(
                    sock_connect=10, sock_read=WATCH_TIMEOUT_S + 30)) as r:
                if r.status == 410:
                    host.stats.relists_410 += 1
                    rv = None
                    continue
                if r.status != 200:
                    raise RuntimeError(f"watch {kind}: {r.status}")
                backoff = 0.5
                async for line in r.content:
                    rv, gone = apply(line, rv)
                    if gone:
                        break
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
            if host.stopping:
                return
            host.errors[f"{kind}: {type(e).__name__}: {str(e)[:80]}"] += 1
            await asyncio.sleep(rng.uniform(0, backoff))
            backoff = min(backoff * 2, 30)


# -- the simulated agents' processes ---------------------------------------------------------------
# The agents run in --agent-processes worker processes, each owning a slice of the nodes (one
# process cannot hold 10,000 agents' watches under this VM's 20,000 open files). A worker only
# simulates: it answers the parent's commands with its agents' state and counters, and every
# figure is computed from those in the parent (Bench), whatever the number of workers.

class PodRow(NamedTuple):
    """One simulated pod as the parent's measurements see it (a tuple: cheap to pickle by the 100,000)."""
    node: int
    key: str
    team: str
    egress_class: str
    weight: float
    min_bps: float
    max_bps: float
    want: float  # its appetite now (after a demand shift), bit/s
    rate: float  # what it sends: min(want, its limit)
    ingress_weight: float = 0.0  # downloads: the same from its download class (0 without downloads)
    ingress_min_bps: float = 0.0
    ingress_max_bps: float = 0.0
    down_want: float = 0.0
    down_rate: float = 0.0


class AgentHost:
    """What one worker's simulated agents share: the API server and controller clients, the
    demand shift, the failover bookkeeping and the counters the parent collects."""

    def __init__(self, cfg: dict):
        self.period = cfg["period"]
        self.downloads = cfg["downloads"]
        self.connection_per_report = cfg.get("connection_per_report", False)
        self.report_timeout = cfg.get("report_timeout", AGENT_REPORT_TIMEOUT_S)  # --sim-report-timeout
        self.counters = cfg.get("counters", False)
        self.ramp = cfg.get("ramp", 0.0)  # seconds over which the agents start (--agent-ramp)
        self.shared_watches = cfg.get("shared_watches", False)  # --sim-shared-watches
        self.controller_urls = cfg["controller_urls"]
        self.controller_ctx = ssl.create_default_context(cadata=cfg["controller_ca"])
        self.agent_api = Api(cfg["api_urls"][0], Path(cfg["api_ca_file"]), limit=0)
        self.api_urls = cfg["api_urls"]
        self.shifted = False  # after the demand shift: even teams want 3x, odd teams 0.3x
        self.killed: str | None = None  # the leader's URL once it was killed (failover)
        self.first_new_answer: float | None = None  # time.monotonic(): one clock for all processes
        self.held_at_kill: dict[int, dict[str, float]] = {}
        self.answered_after_kill: set[int] = set()
        self.changed_before_first_answer = 0
        self.stopping = False
        self.stats = Stats()
        self.errors: Counter = Counter()
        self.last_answer = 0.0
        self._synced_kinds: dict[int, set] = {}
        self._shared: dict[tuple, dict] = {}
        self.agents = [SimAgent(self, i, tok) for i, tok in cfg["agents"]]
        # --sim-shared-watches: one store of each policy kind, read by every agent of this worker
        self.classes: dict[str, dict] = {}
        self.budgets: dict[str, dict] = {}
        if self.shared_watches:
            for a in self.agents:
                a.classes, a.budgets = self.classes, self.budgets

    def api_url(self, agent: "SimAgent") -> str:
        """The agent's API server (a real cluster's Service spreads agents over its apiservers)."""
        return self.api_urls[agent.i % len(self.api_urls)]

    def shared(self, kind: str, obj: dict) -> dict:
        """What the agent keeps of a cluster-wide object (an EgressClass, the EgressBudget: policy_fields),
        one copy of each generation for all of this worker's agents, which only read them: each agent
        decoding and keeping its own was 60 % of a simulated agent's Python heap (tracemalloc, 500
        agents). The simulator's memory, not the agent's, which holds one copy as any node does. The
        same copy for the same generation: a status write is no change (SimAgent.apply_event)."""
        kept = policy_fields(obj)
        key = (kind, kept["metadata"]["name"])
        seen = self._shared.get(key)
        if seen is not None and seen == kept:
            return seen
        self._shared[key] = kept
        return kept

    def factor(self, team: str) -> float:
        if not self.shifted:
            return 1.0
        return 3.0 if int(team[4:] or 0) % 2 == 0 else 0.3

    def mark_synced(self, agent: "SimAgent", kind: str) -> None:
        kinds = self._synced_kinds.setdefault(agent.i, set())
        kinds.add(kind)
        if len(kinds) == 3:
            agent.synced.set()

    # --sim-shared-watches: one list (paged) and watch of each kind for all of this worker's agents
    # instead of three an agent. The controller's side is unchanged (its informer, TokenReviews and
    # writes); what is left out is the API server's load of N agents' lists and watches, which a
    # 2-core machine cannot serve beside N simulated agents and the controllers (docs/scale.md)
    async def shared_list_watch(self, path: str, kind: str) -> None:
        agent0 = self.agents[0]
        url, headers = self.api_url(agent0) + path, {"Authorization": f"Bearer {agent0.token}"}
        by_node = {a.node: a for a in self.agents}
        await watch_loop(self, url, headers, kind, lambda: self._shared_list(url, headers, kind, by_node),
                         lambda line, rv: self._shared_event(kind, by_node, line, rv), random.Random(kind))

    def _shared_event(self, kind: str, by_node: dict, line: bytes, rv: str) -> tuple[str | None, bool]:
        """One watch event to the agents it concerns, as SimAgent.apply_event does for one agent's store."""
        ev = json.loads(line)
        obj = ev["object"]
        if ev["type"] == "ERROR":
            if obj.get("code") == 410:
                self.stats.relists_410 += 1
                return None, True
            return rv, True
        if ev["type"] != "BOOKMARK":
            self._route(kind, obj, by_node, deleted=ev["type"] == "DELETED")
        return obj["metadata"]["resourceVersion"], False

    async def _shared_list(self, url: str, headers: dict, kind: str, by_node: dict) -> str:
        """A paged LIST of `kind` into the agents' stores (cleared first); its resourceVersion."""
        if kind == "pods":
            for a in self.agents:
                a.pods.clear()
        else:
            self._policy_store(kind).clear()
        cont = ""
        while True:
            self.stats.lists[(kind, "window" if self.stats.window else "start")] += 1
            page = url + (f"&continue={urllib.parse.quote(cont, safe='')}" if cont else "")
            async with self.agent_api.session.get(page, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"list {kind}: {r.status}")
                body = await r.json()
            for obj in body.get("items") or []:
                self._route(kind, obj, by_node)
            meta = body["metadata"]
            cont = meta.get("continue") or ""
            if not cont:
                break
        for a in self.agents:
            a._dirty = True
            self.mark_synced(a, kind)
        return meta["resourceVersion"]

    def _policy_store(self, kind: str) -> dict[str, dict]:
        return self.classes if kind == "egressclasses" else self.budgets

    def _route(self, kind: str, obj: dict, by_node: dict, deleted: bool = False) -> None:
        """One object into the store of the agent it concerns: a pod to its node's agent (if this
        worker's), an EgressClass or EgressBudget to the worker's one store, every agent re-resolving
        only when what the agent keeps of it changed (as SimAgent.apply_event)."""
        key = SimAgent.key(kind, obj)
        if kind == "pods":
            agent = by_node.get((obj.get("spec") or {}).get("nodeName"))
            if agent is None:
                return
            agents, store, value = [agent], agent.pods, None if deleted else PodRecord.from_object(obj)
        else:
            agents, store = self.agents, self._policy_store(kind)
            value = None if deleted else self.shared(kind, obj)
        old = store.pop(key, None) if deleted else store.get(key)
        if not deleted:
            store[key] = value
        if value is not old:
            for a in agents:
                a._dirty = True

    def state(self, pods: bool) -> dict:
        rows = []
        if pods:
            for a in self.agents:
                for rp in a.resolved:
                    want = a.appetite.get(rp.key, 0.0) * self.factor(rp.team)
                    down = a.down_appetite.get(rp.key, 0.0) * self.factor(rp.team)
                    up, dn = rp.limits.upload, rp.limits.download
                    rows.append(PodRow(a.i, rp.key, rp.team, rp.egress_class, up.weight, up.min_bps, up.max_bps,
                                       want, min(want, a.limits.get(rp.key, FLOOR_BPS)),
                                       dn.weight, dn.min_bps, dn.max_bps,
                                       down, min(down, a.down_limits.get(rp.key, FLOOR_BPS)) if self.downloads else 0.0))
        return {"stats": self.stats, "errors": self.errors, "pods": rows,
                "synced": sum(1 for k in self._synced_kinds.values() if len(k) == 3),
                "agents": [(a.leader, a.advised, a.node_rate) for a in self.agents],
                "answered": sum(1 for a in self.agents if a.answers),
                "first_new_answer": self.first_new_answer, "answered_after_kill": len(self.answered_after_kill),
                "changed_before_first_answer": self.changed_before_first_answer}

    def command(self, cmd: str, arg):
        if cmd == "state":
            return self.state(pods=arg)
        if cmd == "window":  # the steady window starts (answers counted afresh) or ends
            self.stats.window = arg
            if arg:
                self.stats.answers.clear()
        elif cmd == "shift":
            self.shifted = True
        elif cmd == "kill":  # the parent killed the leader at `arg`
            self.held_at_kill = {a.i: dict(a.limits) for a in self.agents}
            self.stats.answers.clear()
            self.killed = arg
        else:
            raise ValueError(cmd)
        return None

    async def serve(self, conn) -> None:
        tasks = [t for a in self.agents for t in a.start()]
        if self.shared_watches and self.agents:
            grp = "/apis/netagent.io/v1alpha1"
            tasks += [asyncio.create_task(self.shared_list_watch(path, kind)) for path, kind in (
                ("/api/v1/pods?limit=500", "pods"), (f"{grp}/egressclasses?limit=500", "egressclasses"),
                (f"{grp}/egressbudgets?limit=500", "egressbudgets"))]
        try:
            while True:
                cmd, arg = await asyncio.to_thread(conn.recv)
                if cmd == "stop":
                    break
                conn.send(self.command(cmd, arg))
        finally:
            self.stopping = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for a in self.agents:
                if a._session is not None:
                    await a._session.close()
            await self.agent_api.close()
            conn.send("stopped")


def raise_open_files(need: int) -> None:
    """Soft limit to the hard one (root may raise the hard one too, up to fs.nr_open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, need), max(hard, need)))
    except (ValueError, OSError):
        if hard < need:
            raise SystemExit(f"open files limit {hard} is too small: {need} needed")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# asyncio's TLS (core/asynctls.py) keeps a 256 KiB read buffer for every connection, 768 KiB an
# agent for its three watches: half of what a simulated agent cost (1.6 MiB at 5,000 nodes). The
# simulator's cost, not the agent's: the real agent's client (urllib3) reads into per-call buffers.
AGENT_REPORT_TIMEOUT_S = 3.0  # the agent's own (netagent/transport.py)
SIM_TLS_READ_BYTES = TLS_READ_BUFFER_BYTES


def agent_worker(conn, cfg: dict) -> None:
    """A worker process's entry: its slice of the agents until the parent says stop."""
    raise_open_files(3 * len(cfg["agents"]) + 1000)  # 3 watches an agent + reports now and then
    if cfg.get("tls_read_bytes"):
        set_tls_read_buffer(cfg["tls_read_bytes"])
    async def serve() -> None:  # the sessions need the running loop
        await AgentHost(cfg).serve(conn)

    asyncio.run(serve())


# -- the benchmark -------------------------------------------------------------------------------

class Bench:
    """The parent's side: starts the agents' workers, sends them the run's events and computes
    every figure from their state."""

    def __init__(self, args):
        self.args = args
        self.workers: list[tuple[multiprocessing.Process, object]] = []

    def start_agents(self, tokens: list[str], cfg: dict) -> None:
        n = max(1, min(self.args.agent_processes, len(tokens)))
        ctx = multiprocessing.get_context("spawn")  # not fork: this process runs an event loop
        for w in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=agent_worker, name=f"scale-agents-{w}", daemon=True, args=(child, {
                **cfg, "agents": [(i, tokens[i]) for i in range(w, len(tokens), n)]}))
            proc.start()
            child.close()
            self.workers.append((proc, parent))

    @property
    def worker_pids(self) -> dict[str, int]:
        return {f"agents-{w}": proc.pid for w, (proc, _) in enumerate(self.workers)}

    async def ask(self, cmd: str, arg=None) -> list:
        for _, conn in self.workers:
            conn.send((cmd, arg))
        return [await asyncio.to_thread(conn.recv) for _, conn in self.workers]

    async def state(self, pods: bool = False) -> dict:
        """All workers' state merged: counters summed, lists joined."""
        parts = await self.ask("state", pods)
        stats, errors = Stats(), Counter()
        for p in parts:
            s = p["stats"]
            stats.lists.update(s.lists)
            stats.answers.update(s.answers)
            stats.latencies.extend(s.latencies)
            stats.relists_410 += s.relists_410
            stats.redirects += s.redirects
            errors.update(p["errors"])
        firsts = [p["first_new_answer"] for p in parts if p["first_new_answer"] is not None]
        return {"stats": stats, "errors": errors, "pods": [r for p in parts for r in p["pods"]],
                "synced": sum(p["synced"] for p in parts), "agents": [a for p in parts for a in p["agents"]],
                "answered": sum(p["answered"] for p in parts),
                "first_new_answer": min(firsts) if firsts else None,
                "answered_after_kill": sum(p["answered_after_kill"] for p in parts),
                "changed_before_first_answer": sum(p["changed_before_first_answer"] for p in parts)}

    async def sent(self) -> tuple[float, float]:
        """What all pods send and receive now, bit/s: min(appetite, limit) each, per direction."""
        rows = (await self.state(pods=True))["pods"]
        return sum(r.rate for r in rows), sum(r.down_rate for r in rows)

    def budgets(self) -> tuple[float, float]:
        """The upload and download budgets, bit/s (0 for downloads with --no-downloads)."""
        return budget_totals(self.args.nodes, self.args.pods_per_node, self.args.downloads)

    def fair_shares(self, rows: list[PodRow], download: bool = False) -> dict[tuple[int, str], float]:
        """Every pod's fair share of the budget for its true demand now (the engine's allocation
        of the budget with nothing censored), as bench/simulation.py judges it; of the download
        budget with the pods' download values with `download`."""
        policy = load_policy(CLASSES, [budget_object(self.args.nodes, self.args.pods_per_node, self.args.downloads)])[0]
        out = {}
        if download:
            demands = [PodDemandIn(f"{r.node}|{r.key}", r.team, r.egress_class, r.ingress_weight, r.ingress_min_bps,
                                   r.ingress_max_bps, r.down_want) for r in rows]
        else:
            demands = [PodDemandIn(f"{r.node}|{r.key}", r.team, r.egress_class, r.weight, r.min_bps,
                                   r.max_bps, r.want) for r in rows]
        result = allocate(policy, demands, direction=Direction.DOWNLOAD if download else Direction.UPLOAD)
        for k, r in result.pods.items():
            i, key = k.split("|", 1)
            out[(int(i), key)] = r.allocation_bps
        return out

    def share_within(self, rows: list[PodRow], fair: dict[tuple[int, str], float], tolerance: float = 0.05,
                     download: bool = False) -> float:
        """Share of pods whose rate, min(want, limit), is within `tolerance` of their fair share
        (shares under 5 % of the mean count as 5 % of it, as bench/simulation.py); downloads with
        `download`."""
        floor = 0.05 * self.budgets()[download] / max(1, len(fair))
        ok = 0
        for r in rows:
            f = fair.get((r.node, r.key))
            if f is not None:
                ok += abs((r.down_rate if download else r.rate) - f) <= tolerance * max(f, floor)
        return ok / max(1, len(fair))

    async def stop_agents(self) -> None:
        for proc, conn in self.workers:
            try:
                conn.send(("stop", None))
                await asyncio.wait_for(asyncio.to_thread(conn.recv), 30)
            except (OSError, EOFError, asyncio.TimeoutError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def kubectl(cp: ControlPlane, *args: str) -> None:
    cp.kubectl(*args, timeout=300)


def audit_counts(paths: list[Path], since: float, reviews_by_second: Counter | None = None,
                 until: float = float("inf")) -> Counter:
    """(client kind, verb, resource) -> requests from the apiservers' audit logs in [since, until) (epoch s);
    the TokenReviews per whole second into `reviews_by_second` when given (are they a steady rate or
    bursts?)."""
    counts: Counter = Counter()
    for path in paths:
        if path.exists():
            with path.open() as f:
                _count_audit(f, since, counts, reviews_by_second, until)
    return counts


# what netagent writes that the API server stores (a TokenReview or an access review is a POST that
# stores nothing)
STORED_WRITES = ("create", "update", "patch", "delete")
UNSTORED = ("tokenreviews", "subjectaccessreviews")


def stored_writes(counts: Counter, resource: str = "") -> int:
    """netagent's (agent and controller) requests in `counts` that the API server stores; only those to
    `resource` (and its subresources) when given."""
    return sum(n for (kind, verb, res), n in counts.items()
               if kind in ("agent", "controller") and verb in STORED_WRITES and res not in UNSTORED
               and (not resource or res.split("/", 1)[0] == resource))


def _count_audit(f, since: float, counts: Counter, reviews_by_second: Counter | None = None,
                 until: float = float("inf")) -> None:
    for line in f:
        ev = json.loads(line)
        verb, stage = ev.get("verb"), ev.get("stage")
        if not (stage == "ResponseComplete" or (verb == "watch" and stage == "ResponseStarted")):
            continue
        if verb == "watch" and stage == "ResponseComplete":
            continue
        ts = ev.get("requestReceivedTimestamp", "")
        at = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() if ts else 0.0
        if not since <= at < until:
            continue
        user = ev.get("user", {}).get("username", "")
        kind = "agent" if user.endswith(":" + AGENT_SA) else "controller" if user.endswith(":" + CONTROLLER_SA) else user
        ref = ev.get("objectRef") or {}
        res = ref.get("resource", "") + ("/" + ref["subresource"] if ref.get("subresource") else "")
        counts[(kind, verb, res)] += 1
        if reviews_by_second is not None and res == "tokenreviews":
            reviews_by_second[int(at)] += 1


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


async def apiserver_metrics(admin: Api, urls: list[str]) -> dict[str, float]:
    """apiserver_request_total summed (all clients; `writes`: of WRITE_VERBS), long-running watches open, over all apiservers;
    and each one's Go heap in use, MiB (what its RSS holds live, beside what the GC has not yet
    freed or returned)."""
    total = watches = writes = 0.0
    heaps = []
    for url in urls:
        async with admin.session.get(url + "/metrics") as r:
            out = await r.text()
        for line in out.splitlines():
            if line.startswith("apiserver_request_total{"):
                n = float(line.rsplit(" ", 1)[1])
                total += n
                if any(f'verb="{v}"' in line for v in WRITE_VERBS):
                    writes += n
            elif line.startswith("apiserver_longrunning_requests{") and 'verb="WATCH"' in line:
                watches += float(line.rsplit(" ", 1)[1])
            elif line.startswith("go_memstats_heap_inuse_bytes "):
                heaps.append(float(line.rsplit(" ", 1)[1]) / 2**20)
    return {"requests": total, "watches": watches, "heaps": heaps, "writes": writes}


def start_more_apiservers(cp: ControlPlane, n: int, workdir: Path) -> tuple[list[str], list[Path]]:
    """n-1 further kube-apiservers with the first one's flags, PKI and etcd (a large cluster runs
    several behind its Service; here each holds its share of the agents' watches under the
    machine's open-files limit); their URLs and audit logs, the first one's included."""
    first = next(p for p in cp.processes if p.name == "kube-apiserver")
    urls, logs = [cp.url], [Path(next(a for a in first.argv if a.startswith("--audit-log-path=")).split("=", 1)[1])]
    for k in range(1, n):
        port = free_port()
        logs.append(workdir / f"audit-{k}.log")
        cp.spawn(f"kube-apiserver-{k}", [f"--secure-port={port}" if a.startswith("--secure-port=") else
                                         f"--audit-log-path={logs[-1]}" if a.startswith("--audit-log-path=") else a
                                         for a in first.argv], first.env)
        urls.append(f"https://127.0.0.1:{port}")
    return urls, logs


async def wait_apiservers(admin: Api, urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                async with admin.session.get(url + "/readyz") as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready within {timeout:.0f} s")
            await asyncio.sleep(0.5)


async def load_cluster(cp: ControlPlane, args, admin: Api) -> dict[str, float]:
    """Namespaces, nodes, pods (+ status), policy objects; returns the loader's timings."""
    t0 = time.monotonic()
    namespaces = [ns for t in range(TEAMS) for ns in team_namespaces(t)]
    await bounded(args.concurrency, (admin.call("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
                                     for ns in namespaces), keep=False)
    await bounded(args.concurrency, (admin.call("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                                                {"metadata": {"name": "default"}}) for ns in namespaces), keep=False)
    for obj in CLASSES + [budget_object(args.nodes, args.pods_per_node, args.downloads)]:
        plural = "egressclasses" if obj["kind"] == "EgressClass" else "egressbudgets"
        await admin.call("POST", f"/apis/netagent.io/v1alpha1/{plural}", obj)
    await bounded(args.concurrency, (admin.call("POST", "/api/v1/nodes", node_object(i)) for i in range(args.nodes)),
                  "nodes", args.nodes, keep=False)
    # a Node's status is kept on create, but set it through the status subresource as kubelet does
    await bounded(args.concurrency, (admin.call("PATCH", f"/api/v1/nodes/{node_name(i)}/status",
                                                {"status": node_object(i)["status"]},
                                                content_type="application/merge-patch+json")
                                     for i in range(args.nodes)), keep=False)
    t_nodes = time.monotonic()
    n_pods = args.nodes * args.pods_per_node

    def pods():
        return ((i, j, pod_object(i, j)) for i in range(args.nodes) for j in range(args.pods_per_node))

    await bounded(args.concurrency, (admin.call("POST", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods", pod)
                                     for _, _, pod in pods()), "pods", n_pods, keep=False)
    t_pods = time.monotonic()
    if args.pod_status:
        await bounded(args.concurrency, (
            admin.call("PATCH", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/"
                                f"{pod['metadata']['name']}/status", pod_status(pod_ip(i, j)),
                       content_type="application/merge-patch+json") for i, j, pod in pods()),
            "pod status", n_pods, keep=False)
    t_status = time.monotonic()
    return {"nodes_s": t_nodes - t0, "pods_s": t_pods - t_nodes, "status_s": t_status - t_pods,
            "pods_per_s": n_pods / max(1e-9, t_pods - t_nodes)}


async def agent_tokens(cp: ControlPlane, args, admin: Api) -> list[str]:
    """One agent pod per node (the DaemonSet's) and a TokenRequest token bound to it."""
    async def one(i: int) -> str:
        name = f"netagent-agent-{i:05d}"
        pod = await admin.call("POST", f"/api/v1/namespaces/{SYSTEM_NS}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "netagent-agent"}},
            "spec": {"nodeName": node_name(i), "serviceAccountName": AGENT_SA, "hostNetwork": True,
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "agent", "image": "registry.invalid/netagent:scale"}]}})
        if not pod:
            pod = await admin.call("GET", f"/api/v1/namespaces/{SYSTEM_NS}/pods/{name}")
        tr = await admin.call("POST", f"/api/v1/namespaces/{SYSTEM_NS}/serviceaccounts/{AGENT_SA}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [AUDIENCE, "https://kubernetes.default.svc.cluster.local"],
                     "expirationSeconds": 7200,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}}})
        return tr["status"]["token"]

    return await bounded(args.concurrency, (one(i) for i in range(args.nodes)), "agent tokens", args.nodes)


# the bench's flags (argparse dests) that are the controller's, and the controller flag each is passed as
CONTROLLER_FLAGS = (("max_reports_per_second", "--max-reports-per-second"), ("round_period", "--period"),
                    ("answer_wait", "--answer-wait"), ("lease_seconds", "--lease-seconds"),
                    ("report_ttl", "--report-ttl"), ("election_lease_seconds", "--election-lease-seconds"),
                    ("token_cache_seconds", "--token-cache-seconds"))


def controller_flags(args) -> list[tuple[str, str, float]]:
    """(the bench's flag, the controller's flag, value) of each controller flag given to the bench
    (the others stay the controller's defaults)."""
    return [(f"--{dest.replace('_', '-')}", flag, getattr(args, dest)) for dest, flag in CONTROLLER_FLAGS
            if getattr(args, dest) is not None]


def start_controllers(cp: ControlPlane, args, token: str, workdir: Path) -> list[tuple[subprocess.Popen, str, Path]]:
    kubeconfig = write_kubeconfig(workdir / "controller.kubeconfig", cp.url, cp.ca_file, {"token": token})
    out = []
    for r in range(args.replicas):
        port = free_port()
        log = workdir / f"controller-{r}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "netagent", "controller", "--kubeconfig", str(kubeconfig),
             "--listen", f"127.0.0.1:{port}", "--advertise", f"127.0.0.1:{port}",
             "--namespace", SYSTEM_NS, "--identity", f"scale-controller-{r}@127.0.0.1:{port}",
             "--agent-service-account", f"{SYSTEM_NS}:{AGENT_SA}", "--log-format", "json",
             # controller_series scrapes /metrics without a token; the guard is bench/metrics_auth.py's
             "--metrics-auth", "false",
             *(a for _, flag, value in controller_flags(args) for a in (flag, str(value)))],
            cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        out.append((proc, f"https://127.0.0.1:{port}", log))
    return out


async def controller_ca(admin: Api, timeout: float) -> str:
    """The agents' pinned CA: ca.crt of the Secret the controller creates (as the DaemonSet mounts it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            secret = await admin.call("GET", f"/api/v1/namespaces/{SYSTEM_NS}/secrets/{TLS_SECRET}")
            return base64.b64decode(secret["data"]["ca.crt"]).decode()
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def wait_ready(urls: list[str], ctx: ssl.SSLContext, timeout: float) -> float:
    """Seconds until one replica's /readyz answers 200 (the leader with its caches synced)."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3),
                                     connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        while time.monotonic() - t0 < timeout:
            for u in urls:
                try:
                    async with s.get(u + "/readyz", server_hostname=SERVICE_NAME) as r:
                        if r.status == 200:
                            return time.monotonic() - t0
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"no controller replica ready within {timeout:.0f} s")


def series_of(exposition: bytes) -> int:
    return sum(1 for line in exposition.decode().splitlines() if line and not line.startswith("#"))


def agent_series(pods: int, lean: bool = False, downloads: bool = True, scopes: bool = False) -> int:
    """Series one agent's /metrics exports with `pods` pods (its own registry, every pod in a class,
    as AgentMetrics renders them; one policy problem on no pod; downloads shaped unless not; with
    `scopes`, a NetworkScopes description in force: bytes by cross-zone and cross-region too, issue 39)."""
    def counts() -> dict[str, int]:
        return dict.fromkeys(("internal", "cross-zone", "cross-region", "internet") if scopes else ("internal", "internet"), 0)
    view = NodeView("n", [PodView(f"ns{j % 5}", f"p{j}", "team00", "bulk", minor=j + 2, egress_bytes=counts(),
                                  ingress_bytes=counts()) for j in range(pods)],
                    ingress_allocation_bps=1e9 if downloads else None)
    metrics = AgentMetrics(lambda: view, lean=lean)
    return series_of(generate_latest(metrics.registry))


async def controller_metrics(urls: list[str], ctx: ssl.SSLContext) -> list[bytes | None]:
    """Each controller's /metrics exposition (None where it cannot be read)."""
    out: list[bytes | None] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                     connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        for u in urls:
            try:
                async with s.get(u + "/metrics", server_hostname=SERVICE_NAME) as r:
                    out.append(await r.read() if r.status == 200 else None)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                out.append(None)
    return out


async def controller_series(urls: list[str], ctx: ssl.SSLContext) -> list[int]:
    return [-1 if text is None else series_of(text) for text in await controller_metrics(urls, ctx)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass
class Run:
    """What one run holds: the steps below share it, and run() cleans it up whatever step failed."""
    args: argparse.Namespace
    cp: ControlPlane
    workdir: Path
    guard: MemoryGuard
    bench: Bench
    admin: Api | None = None
    controllers: list = field(default_factory=list)  # (Popen, URL, log path) per replica
    pids: dict[str, int] = field(default_factory=dict)  # the control plane's processes
    api_urls: list[str] = field(default_factory=list)
    audit_logs: list = field(default_factory=list)


@dataclass
class Baseline:
    """The loaded cluster without netagent: apiserver metrics around the window, its processes' use."""
    m0: dict
    m1: dict
    idle_use: dict


@dataclass
class Window:
    """The steady-state window with netagent."""
    m2: dict
    m3: dict
    busy_use: dict
    bench_cpu: float
    st: dict
    allocated: float
    budget: float
    down_budget: float
    sent_samples: list
    sent: float
    received: float
    t_window: float


def control_plane(args, workdir: Path) -> ControlPlane:
    """etcd and kube-apiserver with an audit log (who asked what: the report counts netagent's requests)."""
    assets = find_assets(CONTROL_PLANE_BINARIES)
    audit_policy = workdir / "audit-policy.yaml"
    audit_policy.write_text(AUDIT_POLICY)
    audit_log = workdir / "audit.log"
    return ControlPlane(assets, ready_timeout=180, extra_etcd_args=ETCD_ARGS, extra_apiserver_args=APISERVER_ARGS + [
        f"--audit-policy-file={audit_policy}", f"--audit-log-path={audit_log}", "--audit-log-format=json",
        "--audit-log-mode=batch", "--audit-log-maxsize=0"],
        apiserver_env={"GOMEMLIMIT": f"{args.apiserver_memory_limit_mib}MiB"} if args.apiserver_memory_limit_mib else None)


def print_header(args) -> None:
    print(f"# bench/scale.py --nodes {args.nodes} --pods-per-node {args.pods_per_node} --period {args.period} "
          f"--measure {args.measure} --replicas {args.replicas} --settle {args.settle:g} "
          f"--agent-processes {args.agent_processes} --apiservers {args.apiservers}"
          + ("" if args.pod_status else " --no-pod-status") + (" --quotas" if args.quotas else "")
          + (f" --agent-ramp {args.agent_ramp:g}" if args.agent_ramp else "")
          + (" --sim-shared-watches" if args.sim_shared_watches else "")
          + (f" --sim-report-timeout {args.sim_report_timeout:g}"
             if args.sim_report_timeout != AGENT_REPORT_TIMEOUT_S else "")
          + (f" --apiserver-memory-limit-mib {args.apiserver_memory_limit_mib}" if args.apiserver_memory_limit_mib else "")
          + "".join(f" {flag} {value:g}" for flag, _, value in controller_flags(args)))
    print(f"# machine: {platform.node()} {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, Python {platform.python_version()}")


async def load(r: Run) -> tuple[dict, str]:
    """The control plane started, the CRDs and RBAC applied, the nodes and pods loaded, the further
    apiservers started; the agents' tokens and the controller's."""
    args, cp = r.args, r.cp
    cp.start()
    r.pids = {p.name: p.popen.pid for p in cp.processes}
    r.guard.pids.update(r.pids)
    kubectl(cp, "apply", "-f", str(REPO / "deploy/crds/egressclasses.yaml"), "-f", str(REPO / "deploy/crds/egressbudgets.yaml"))
    kubectl(cp, "wait", "--for=condition=Established", "crd/egressclasses.netagent.io", "crd/egressbudgets.netagent.io")
    kubectl(cp, "apply", "-n", SYSTEM_NS, "-f", str(REPO / "deploy/base/namespace.yaml"), "-f", str(REPO / "deploy/base/rbac-agent.yaml"),
            "-f", str(REPO / "deploy/base/rbac-controller.yaml"))
    admin_cert, admin_key = cp.pki.client("scale-loader", "scale-loader", ["system:masters"])
    r.admin = admin = Api(cp.url, cp.ca_file, cert=(admin_cert, admin_key), limit=args.concurrency)
    print(f"loading {args.nodes} nodes and {args.nodes * args.pods_per_node} pods ...", flush=True)
    timings = await load_cluster(cp, args, admin)
    print(f"loaded: nodes {timings['nodes_s']:.0f} s, pods {timings['pods_s']:.0f} s "
          f"({timings['pods_per_s']:.0f}/s), pod status {timings['status_s']:.0f} s", flush=True)
    # further apiservers once the cluster is loaded (their watch caches start with one list)
    r.api_urls, r.audit_logs = start_more_apiservers(cp, args.apiservers, r.workdir)
    await wait_apiservers(admin, r.api_urls, 300)
    r.pids = {p.name: p.popen.pid for p in cp.processes}
    r.guard.pids.update(r.pids)
    loaded = await apiserver_metrics(admin, r.api_urls)
    print("loaded cluster, before any netagent: " + ", ".join(
        f"{p.name} RSS {rss_mib(p.popen.pid):.0f} MiB" for p in cp.processes)
        + "; apiservers' Go heap in use " + " + ".join(f"{h:.0f}" for h in loaded["heaps"]) + " MiB", flush=True)
    tokens = await agent_tokens(cp, args, admin)
    ctl_token = (await admin.call("POST", f"/api/v1/namespaces/{SYSTEM_NS}/serviceaccounts/{CONTROLLER_SA}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 7200}}))["status"]["token"]
    return tokens, ctl_token


async def baseline(r: Run) -> Baseline:
    """The loaded cluster without netagent for --baseline seconds."""
    await asyncio.sleep(5)
    m0 = await apiserver_metrics(r.admin, r.api_urls)
    idle = Usage(r.pids)
    await asyncio.sleep(r.args.baseline)
    idle_use = idle.read()
    m1 = await apiserver_metrics(r.admin, r.api_urls)
    return Baseline(m0, m1, idle_use)


async def start_netagent(r: Run, tokens: dict, ctl_token: str) -> tuple[ssl.SSLContext, float]:
    """The controllers, then the agents in --agent-processes workers, synced, answered and settled; the
    controllers' TLS context and when the agents started (Unix time: the audit log's clock)."""
    args, bench = r.args, r.bench
    r.controllers = controllers = start_controllers(r.cp, args, ctl_token, r.workdir)
    r.guard.pids.update({f"controller-{k}": p.pid for k, (p, _, _) in enumerate(controllers)})
    controller_ca_pem = await controller_ca(r.admin, 120)
    ctx = ssl.create_default_context(cadata=controller_ca_pem)
    ready_s = await wait_ready([u for _, u, _ in controllers], ctx, 600)
    print(f"controller ready after {ready_s:.1f} s", flush=True)

    bench.start_agents(tokens, {
        "period": args.period, "downloads": args.downloads,
        "connection_per_report": args.connection_per_report, "report_timeout": args.sim_report_timeout,
        "controller_urls": [u for _, u, _ in controllers],
        "controller_ca": controller_ca_pem, "api_urls": r.api_urls, "api_ca_file": str(r.cp.ca_file),
        "tls_read_bytes": args.sim_tls_read_bytes, "counters": args.quotas,
        "ramp": args.agent_ramp, "shared_watches": args.sim_shared_watches})
    r.guard.pids.update(bench.worker_pids)
    t_agents = time.time()
    t_sync0 = time.monotonic()
    sync_deadline = t_sync0 + args.agent_ramp + max(300, args.nodes * 0.2)
    next_progress = t_sync0 + 30
    while (st := await bench.state())["synced"] < args.nodes:
        now = time.monotonic()
        if now > sync_deadline:
            raise RuntimeError(f"agents not synced within {sync_deadline - t_sync0:.0f} s: {st['synced']} synced, "
                               f"errors {st['errors'].most_common(3)}")
        if now >= next_progress:  # a slow sync says how far it got and what failed, not just nothing
            next_progress = now + 30
            print(f"  {now - t_sync0:.0f} s: {st['synced']} of {args.nodes} agents synced, lists "
                  f"{sum(st['stats'].lists.values())}, errors {st['errors'].most_common(3)}", flush=True)
        await asyncio.sleep(1.0)
    print(f"{args.nodes} agents synced ({'3 lists a simulator process, pods paged' if args.sim_shared_watches else '3 lists each'}) after {time.monotonic() - t_sync0:.1f} s "
          f"({len(bench.workers)} agent processes)", flush=True)
    await asyncio.sleep(3 * args.period)  # the first reports, TokenReviews, first rounds
    # the cold start: every pod begins at the floor and climbs by probing (~2 periods a doubling),
    # at the period the leader advises: known once (nearly) every agent has had an answer
    t_first = time.monotonic()
    while (st := await bench.state())["answered"] < 0.95 * args.nodes and time.monotonic() - t_first < 300:
        await asyncio.sleep(2.0)
    advised_now = max((adv for _, adv, _ in st["agents"]), default=0.0)
    print(f"{st['answered']} of {args.nodes} agents answered after {time.monotonic() - t_sync0:.0f} s; "
          f"settling for {args.settle} report periods of {max(args.period, advised_now):g} s", flush=True)
    await asyncio.sleep(args.settle * max(args.period, advised_now))
    return ctx, t_agents


async def steady_window(r: Run) -> Window:
    """--measure seconds with netagent: the processes' use, the apiservers' metrics, the cluster's rate."""
    args, bench = r.args, r.bench
    m2 = await apiserver_metrics(r.admin, r.api_urls)
    ctl_pids = {f"controller-{k}": p.pid for k, (p, _, _) in enumerate(r.controllers)}
    busy = Usage({**r.pids, **ctl_pids, **bench.worker_pids})
    t_window = time.time()
    await bench.ask("window", True)
    # the cluster's sending rate sampled through the window (one instant is one draw of the
    # agents' jittered report phases)
    sent_samples = []
    t_end = time.monotonic() + args.measure
    while (left := t_end - time.monotonic()) > 0:
        await asyncio.sleep(min(left, args.period))
        sent_samples.append(await bench.sent())
    await bench.ask("window", False)
    busy_use = busy.read()
    bench_cpu = sum(busy_use[k][0] for k in bench.worker_pids)
    m3 = await apiserver_metrics(r.admin, r.api_urls)
    st = await bench.state()
    allocated = sum(rate for _, _, rate in st["agents"])
    budget, down_budget = bench.budgets()
    sent = sum(v for v, _ in sent_samples) / max(1, len(sent_samples))
    received = sum(v for _, v in sent_samples) / max(1, len(sent_samples))
    return Window(m2, m3, busy_use, bench_cpu, st, allocated, budget, down_budget, sent_samples, sent, received,
                  t_window)


def report_requests(r: Run, base: Baseline, w: Window, t_agents: float) -> None:
    """The table without/with netagent, and netagent's API requests by kind (the audit log)."""
    args, pids, stats = r.args, r.pids, w.st["stats"]
    busy_use, idle_use = w.busy_use, base.idle_use
    counts_start = audit_counts(r.audit_logs, t_agents)
    reviews_by_second: Counter = Counter()
    counts_window = audit_counts(r.audit_logs, w.t_window, reviews_by_second)
    ours = {k: v for k, v in counts_window.items() if k[0] in ("agent", "controller")}
    all_reqs = (w.m3["requests"] - w.m2["requests"]) / args.measure
    our_rate = sum(ours.values()) / args.measure
    print()
    print(f"| {args.nodes} nodes, {args.nodes * args.pods_per_node} pods | without netagent | with netagent |")
    print("|---|---|---|")
    for name in pids:
        print(f"| {name} CPU (cores) / RSS (MiB) | {idle_use[name][0]:.2f} / {idle_use[name][1]:.0f} | "
              f"{busy_use[name][0]:.2f} / {busy_use[name][1]:.0f} |")
    print(f"| API requests/s (all clients) | {(base.m1['requests'] - base.m0['requests']) / args.baseline:.1f} | {all_reqs:.1f} |")
    print(f"| watches open | {base.m1['watches']:.0f} | {w.m3['watches']:.0f} |")
    print(f"| apiservers' Go heap in use (MiB) | {' + '.join(f'{h:.0f}' for h in base.m1['heaps'])} | "
          f"{' + '.join(f'{h:.0f}' for h in w.m3['heaps'])} |")
    print()
    print(f"netagent's API requests in the window: {our_rate:.1f}/s ({our_rate / max(all_reqs, 1e-9):.0%} of all)")
    for (kind, verb, res), n in sorted(ours.items()):
        print(f"  {kind:10s} {verb:8s} {res:28s} {n / args.measure:8.2f}/s")
    agent_lists_after = sum(n for (k, v, _), n in counts_window.items() if k == "agent" and v == "list")
    print(f"agent LISTs at start: {sum(n for (k, v, _), n in counts_start.items() if k == 'agent' and v == 'list')}"
          f" (expected {'3 a simulator process, pods paged' if args.sim_shared_watches else 3 * args.nodes}); after start (window): {agent_lists_after}; relists after 410: {stats.relists_410}")
    tr = sum(n for (k, v, r_), n in counts_start.items() if k == "controller" and r_ == "tokenreviews")
    status_w = sum(n for (k, v, r_), n in counts_window.items() if k == "controller" and r_.endswith("/status"))
    tr_w = sum(n for (k, v, r_), n in counts_window.items() if k == "controller" and r_ == "tokenreviews")
    ttl = args.token_cache_seconds or DEFAULT_TOKEN_CACHE_SECONDS
    print(f"TokenReviews by the controller since agents started: {tr} ({args.nodes} distinct agents); "
          f"in the window {tr_w * 60 / args.measure:.0f}/min (--token-cache-seconds {ttl:g}; N/{ttl:g} = {args.nodes / ttl:.1f}/s); "
          f"the busiest second of the window {max(reviews_by_second.values(), default=0)}")
    print(f"status writes: {status_w * 60 / args.measure:.1f}/min")


async def report_netagent(r: Run, w: Window, ctx: ssl.SSLContext) -> float:
    """The controllers' use, the answers and their latency, the cluster's rate against the budget, the
    metric series; returns the report period the leader advised (the shift's sampling period)."""
    args, bench, busy_use, st = r.args, r.bench, w.busy_use, w.st
    stats = st["stats"]
    budget, down_budget, sent_samples = w.budget, w.down_budget, w.sent_samples
    for k, (cpu, rss) in busy_use.items():
        if k.startswith("controller"):
            print(f"{k}: CPU {cpu:.2f} cores, RSS {rss:.0f} MiB")
    ok = stats.answers.get(200, 0)
    print(f"reports answered 200: {ok / args.measure:.1f}/s (expected {args.nodes / args.period:.1f}/s); "
          f"others: {dict((k, v) for k, v in stats.answers.items() if k != 200)}; redirects {stats.redirects}")
    print(f"answer latency p50 {pct(stats.latencies, 0.5) * 1e3:.1f} ms, "
          f"p99 {pct(stats.latencies, 0.99) * 1e3:.1f} ms")
    ups = [v for v, _ in sent_samples]
    print(f"allocated (sum of node rates) {w.allocated / 1e9:.2f} Gbit/s, sent {w.sent / 1e9:.2f} Gbit/s "
          f"(mean of {len(sent_samples)} samples, {min(ups) / 1e9:.2f}..{max(ups) / 1e9:.2f}), "
          f"budget {budget / 1e9:.0f} Gbit/s: {(w.sent / budget - 1) * 100:+.1f} %")
    print("sent in the window, one sample per period: "
          + " ".join(f"{(v / budget - 1) * 100:+.1f}%" for v in ups))
    if args.downloads:
        downs = [v for _, v in sent_samples]
        print(f"downloads: received {w.received / 1e9:.2f} Gbit/s (mean of {len(downs)} samples, "
              f"{min(downs) / 1e9:.2f}..{max(downs) / 1e9:.2f}), download budget {down_budget / 1e9:.0f} Gbit/s: "
              f"{(w.received / down_budget - 1) * 100:+.1f} %; one sample per period: "
              + " ".join(f"{(v / down_budget - 1) * 100:+.1f}%" for v in downs))
    print(f"simulated agents' own CPU ({len(bench.workers)} processes, not netagent): {w.bench_cpu:.2f} cores, "
          f"RSS {sum(busy_use[k][1] for k in bench.worker_pids):.0f} MiB")
    per_node = agent_series(args.pods_per_node, downloads=args.downloads)
    ctl_series = await controller_series([u for _, u, _ in r.controllers], ctx)
    cluster_series = per_node * args.nodes + sum(max(0, n) for n in ctl_series)
    print(f"metric series: one agent with {args.pods_per_node} pods {per_node} "
          f"({(per_node - agent_series(0, downloads=args.downloads)) / max(1, args.pods_per_node):.0f} per pod); controllers {ctl_series}; "
          f"cluster {cluster_series:,} series, {cluster_series / 30:,.0f} samples/s at a 30 s scrape")
    lean_node = agent_series(args.pods_per_node, lean=True, downloads=args.downloads)
    lean_cluster = lean_node * args.nodes + sum(max(0, n) for n in ctl_series)
    print(f"with the agents' --lean-metrics: one agent {lean_node} "
          f"({(lean_node - agent_series(0, lean=True, downloads=args.downloads)) / max(1, args.pods_per_node):.0f} per pod); "
          f"cluster {lean_cluster:,} series, {lean_cluster / 30:,.0f} samples/s at a 30 s scrape")
    scoped, scoped_lean = (agent_series(args.pods_per_node, lean=lean, downloads=args.downloads, scopes=True)
                           for lean in (False, True))
    print(f"with NetworkScopes described (issue 39): one agent {scoped} (+{scoped - per_node}), "
          f"--lean-metrics {scoped_lean} (+{scoped_lean - lean_node})")
    advised = Counter(round(adv, 1) for _, adv, _ in st["agents"])
    period = max(args.period, max(advised, default=0.0))
    print(f"report period advised by the leader: {dict(advised)} (agents' own {args.period:g} s)")
    print(f"leader CPU per report: {max(c for k, (c, _) in busy_use.items() if k.startswith('controller')) / max(ok / args.measure, 1e-9) * 1e3:.2f} ms "
          f"(the busier replica's CPU over the reports it answered)", flush=True)
    return period


async def controller_samples(urls: list[str], ctx: ssl.SSLContext, name: str) -> list[list[float]]:
    """Each controller's samples of metric `name` (none where its /metrics cannot be read; a follower
    exports no team quotas)."""
    return [[float(line.rsplit(" ", 1)[1]) for line in (text or b"").decode().splitlines() if line.startswith(name + "{")]
            for text in await controller_metrics(urls, ctx)]


def window_costs(r: Run, w: Window) -> WindowCost:
    """A steady window's WindowCost: the busier replica's CPU, the apiservers' write requests, netagent's
    stored writes in the audit log."""
    leader = max(c for k, (c, _) in w.busy_use.items() if k.startswith("controller"))
    ours = audit_counts(r.audit_logs, w.t_window, until=w.t_window + r.args.measure)
    return window_cost(leader, w.st["stats"].answers.get(200, 0), r.args.measure, w.m3["writes"] - w.m2["writes"],
                       stored_writes(ours), stored_writes(ours, "egressbudgets"))


async def quota_phase(r: Run, off: Window, ctx: ssl.SSLContext, period: float) -> None:
    """--quotas: every team of the EgressBudget gets a volume quota (with_quotas), the controller takes it
    (its netagent_team_quota_bytes), the agents report once more, then a window as long as the first: the
    leader's CPU per report and the writes to the API server, quotas off (the first window) against on."""
    args = r.args
    teams = with_quotas(budget_object(args.nodes, args.pods_per_node, args.downloads))["spec"]["teams"]
    await r.admin.call("PATCH", "/apis/netagent.io/v1alpha1/egressbudgets/default", {"spec": {"teams": teams}},
                       content_type="application/merge-patch+json")
    want = TEAMS * (2 if args.downloads else 1)
    t0 = time.monotonic()
    urls = [u for _, u, _ in r.controllers]
    while (seen := max(map(len, await controller_samples(urls, ctx, "netagent_team_quota_bytes")))) < want:
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"the controllers export {seen} of {want} netagent_team_quota_bytes after 300 s")
        await asyncio.sleep(1.0)
    print(f"quotas on every team ({QUOTA_BYTES} a month, both directions): taken after {time.monotonic() - t0:.1f} s; "
          f"two report periods before the window (every node's first report with quotas takes baselines)", flush=True)
    await asyncio.sleep(2 * period)
    on = await steady_window(r)
    costs = {"quotas off": window_costs(r, off), "quotas on": window_costs(r, on)}
    print()
    print(f"| {args.nodes} nodes, {args.nodes * args.pods_per_node} pods, {args.measure:g} s each | "
          "leader CPU per report | reports answered/s | apiserver writes/min (all clients; TokenReviews are POSTs) "
          "| netagent's stored writes/min (audit; leases included) | of them to the EgressBudget |")
    print("|---|---|---|---|---|---|")
    for name, c in costs.items():
        print(f"| {name} | {c.cpu_per_report_s * 1e3:.2f} ms | {c.reports_per_s:.1f} | {c.writes_per_min:.0f} "
              f"| {c.netagent_writes_per_min:.1f} | {c.budget_writes_per_min:.1f} |")
    used = max(map(sum, await controller_samples(urls, ctx, "netagent_team_quota_used_bytes")))
    print(f"the teams' use the leader counted since the quotas came (netagent_team_quota_used_bytes summed): "
          f"{used / 1e9:.1f} GB")
    print(f"netagent's requests in the quotas-on window: " + ", ".join(
        f"{kind} {verb} {res} {n}" for (kind, verb, res), n in sorted(
            audit_counts(r.audit_logs, on.t_window, until=on.t_window + args.measure).items())
        if kind in ("agent", "controller") and verb in STORED_WRITES))
    ok, why = quota_verdict(costs["quotas off"], costs["quotas on"], args.measure)
    print(f"verdict (set before the run): {why}", flush=True)


async def demand_shift(r: Run, period: float) -> None:
    """A demand shift: even teams want 3x, odd teams 0.3x; pods within 5 % of fair per period."""
    args, bench = r.args, r.bench
    directions = (False, True) if args.downloads else (False,)
    rows = (await bench.state(pods=True))["pods"]
    for d in directions:
        print(f"before the shift{' (downloads)' if d else ''}: "
              f"{bench.share_within(rows, bench.fair_shares(rows, d), download=d):.1%} of pods within 5 % of fair")
    await bench.ask("shift")
    rows = (await bench.state(pods=True))["pods"]
    fair = {d: bench.fair_shares(rows, d) for d in directions}
    t_shift = time.monotonic()
    shares: dict[bool, list[float]] = {d: [] for d in directions}
    for k in range(args.shift_periods):
        await asyncio.sleep(period)
        rows = (await bench.state(pods=True))["pods"]
        for d in directions:
            shares[d].append(bench.share_within(rows, fair[d], download=d))
    for d in directions:
        got = shares[d]
        first95 = next((k + 1 for k, v in enumerate(got) if v >= 0.95), None)
        what = "downloads: pods" if d else "pods"
        print(f"after the shift{' (downloads)' if d else ''} (one sample per {period:g} s period): "
              + " ".join(f"{v:.1%}" for v in got))
        print(f"{what} within 5 % of fair: 95 % after {first95 if first95 else '>' + str(len(got))} periods "
              f"({(first95 or len(got)) * period:.0f} s); {got[-1]:.1%} after {len(got)} periods "
              f"({time.monotonic() - t_shift:.0f} s)", flush=True)


async def failover(r: Run, budget: float, down_budget: float) -> None:
    """The leader killed (SIGKILL); time until the other replica answers from a round."""
    args, bench, controllers = r.args, r.bench, r.controllers
    leaders = Counter(leader for leader, _, _ in (await bench.state())["agents"] if leader)
    leader_url = leaders.most_common(1)[0][0] if leaders else None
    victim = next((c for c in controllers if c[1] == leader_url), None)
    if victim is None:
        print("failover: no leader known to the agents; skipped")
        return
    sent_before, received_before = await bench.sent()
    victim[0].send_signal(signal.SIGKILL)
    t_kill, t_kill_wall = time.monotonic(), time.time()
    await bench.ask("kill", leader_url)  # the agents keep their limits as they are now
    peak = peak_down = 0.0
    while time.monotonic() - t_kill < args.failover_timeout and \
            (st := await bench.state())["answered_after_kill"] < args.nodes:
        await asyncio.sleep(1.0)
        up, down = await bench.sent()
        peak, peak_down = max(peak, up), max(peak_down, down)
    st = await bench.state()
    first = st["first_new_answer"]
    print(f"failover: leader killed; first answer from a round of the new leader after "
          f"{(first - t_kill) if first else float('nan'):.1f} s; "
          f"{st['answered_after_kill']}/{args.nodes} agents answered after "
          f"{time.monotonic() - t_kill:.0f} s; answers meanwhile {dict(st['stats'].answers)}")
    survivor = next((c for c in controllers if c is not victim), None)
    if survivor is not None:
        print("failover: the survivor's log after the kill: " + "; ".join(
            f"{what} {at - t_kill_wall:+.1f} s" for at, what in log_marks(survivor[2], t_kill_wall)))
    print(f"failover: pods whose limit changed between the kill and their agent's first answer from "
          f"the new leader's round: {st['changed_before_first_answer']} (so none above its limit); "
          f"sent total at the kill {(sent_before / budget - 1) * 100:+.1f} % of the budget, "
          f"peak after {(peak / budget - 1) * 100:+.1f} %"
          + (f"; downloads at the kill {(received_before / down_budget - 1) * 100:+.1f} %, peak after "
             f"{(peak_down / down_budget - 1) * 100:+.1f} %" if args.downloads else ""), flush=True)


async def run(args) -> None:
    """One run, step by step: the loaded cluster without netagent, then with it (the steady window, a
    demand shift, a failover), each step's rows printed as it ends; everything stopped whatever failed."""
    # the API servers inherit this limit: each holds its share of the agents' 3 watches (the
    # agents' processes raise their own, agent_worker)
    raise_open_files(3 * -(-args.nodes // args.apiservers) + 1000)
    workdir = Path(tempfile.mkdtemp(prefix="netagent-scale-"))
    r = Run(args, control_plane(args, workdir), workdir, MemoryGuard(args.min_available_mib), Bench(args))
    print_header(args)
    guard_task = asyncio.create_task(r.guard.run(asyncio.current_task()))
    try:
        tokens, ctl_token = await load(r)
        base = await baseline(r)
        ctx, t_agents = await start_netagent(r, tokens, ctl_token)
        w = await steady_window(r)
        report_requests(r, base, w, t_agents)
        period = await report_netagent(r, w, ctx)
        if args.quotas:
            await quota_phase(r, w, ctx, period)
        if args.shift_periods:
            await demand_shift(r, period)
        if args.failover and len(r.controllers) > 1:
            await failover(r, w.budget, w.down_budget)
        errors = (await r.bench.state())["errors"]
        if errors:
            print("errors:", dict(errors.most_common(8)))
    except asyncio.CancelledError:
        if not r.guard.tripped:
            raise
        print(f"STOPPED after the last step above: {r.guard.tripped}", flush=True)
    finally:
        guard_task.cancel()
        print(f"peak RSS: {r.guard.summary()}", flush=True)
        await r.bench.stop_agents()
        for proc, _, _ in r.controllers:
            stop_process(proc, 10)
        if r.admin:
            await r.admin.close()
        r.cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def log_marks(path: Path, since: float) -> list[tuple[float, str]]:
    """(Unix time, what) of the controller log's failover milestones after `since` (JSON lines)."""
    marks = {"leader election: now leading": "leading", "first allocation round of this term": "first round"}
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
            at = calendar.timegm(time.strptime(rec["ts"][:19], "%Y-%m-%dT%H:%M:%S")) + float(rec["ts"][19:-1] or 0)
        except (ValueError, KeyError, TypeError):
            continue
        what = next((w for m, w in marks.items() if str(rec.get("msg", "")).startswith(m)), None)
        if what and at >= since:
            out.append((at, what))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--pods-per-node", type=int, default=110)
    p.add_argument("--period", type=float, default=5.0, help="agent report period, seconds")
    p.add_argument("--measure", type=float, default=60.0, help="steady-state window, seconds")
    p.add_argument("--baseline", type=float, default=20.0, help="window without netagent, seconds")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--min-available-mib", type=float, default=1536,
                   help="stop the run when the machine's MemAvailable falls below this (shared machine)")
    p.add_argument("--apiservers", type=int, default=1,
                   help="kube-apiservers on the one etcd, the agents spread over them (each holds its "
                        "share of the watches under the open-files limit)")
    p.add_argument("--apiserver-memory-limit-mib", type=int, default=0,
                   help="GOMEMLIMIT for each kube-apiserver (the Go runtime's soft limit: it collects "
                        "sooner instead of letting the heap grow to twice the live data; 0: unset)")
    p.add_argument("--agent-processes", type=int, default=1,
                   help="processes the simulated agents are split over (each holds 3 watches an agent "
                        "under this machine's open-files limit)")
    p.add_argument("--settle", type=float, default=10.0,
                   help="report periods between the agents' first reports and the window (the cold start's climb)")
    p.add_argument("--concurrency", type=int, default=48, help="loader requests in flight")
    p.add_argument("--shift-periods", type=int, default=6,
                   help="report periods followed after a demand shift (0: no shift)")
    p.add_argument("--no-failover", dest="failover", action="store_false", help="do not kill the leader at the end")
    p.add_argument("--connection-per-report", action="store_true",
                   help="agents open a new connection (and TLS handshake) per report, as before keep-alive: the "
                        "baseline of docs/scale.md's keep-alive table")
    p.add_argument("--no-downloads", dest="downloads", action="store_false",
                   help="agents shape uploads only (no spec.ingressTotal; the rows before downloads were simulated)")
    p.add_argument("--failover-timeout", type=float, default=120.0, help="seconds to wait for the new leader")
    p.add_argument("--max-reports-per-second", type=float, default=None,
                   help="the controller's flag of that name (default: the controller's default)")
    p.add_argument("--round-period", type=float, default=None,
                   help="the controller's --period (seconds between rounds; default: the controller's)")
    p.add_argument("--answer-wait", type=float, default=None,
                   help="the controller's --answer-wait (default: the controller's)")
    p.add_argument("--lease-seconds", type=float, default=None,
                   help="the controller's --lease-seconds (default: the controller's; a quarter of it "
                        "caps the paced report period)")
    p.add_argument("--election-lease-seconds", type=float, default=None,
                   help="the controllers' --election-lease-seconds (default: theirs, 3 s; it was 15 s before finding 13)")
    p.add_argument("--report-ttl", type=float, default=None,
                   help="the controller's --report-ttl (default: the controller's; at least --lease-seconds)")
    p.add_argument("--token-cache-seconds", type=float, default=None,
                   help="the controller's --token-cache-seconds (default: the controller's, 60): how long a "
                        "TokenReview's verdict is reused; N nodes need N/that reviews a second")
    p.add_argument("--sim-tls-read-bytes", type=int, default=SIM_TLS_READ_BYTES,
                   help="the simulated agents' asyncio TLS read buffer per connection (0: Python's 256 KiB)")
    p.add_argument("--sim-report-timeout", type=float, default=AGENT_REPORT_TIMEOUT_S,
                   help="the simulated agents' report timeout, seconds (default: the agent's 3 s). A simulator "
                        "process holds thousands of agents, and its own loop's lag counts against their timeout: "
                        "a longer one keeps a busy simulator from closing kept connections the controller answers "
                        "(each timed-out report costs the next one a TLS handshake); the answer latency printed is "
                        "the same measure either way")
    p.add_argument("--sim-shared-watches", action="store_true",
                   help="each simulator process lists and watches the pods, EgressClasses and EgressBudgets once "
                        "for all its agents (three an agent without it): the controller's side is unchanged, the "
                        "API server's load of N agents' watches is left out of the run (docs/scale.md says where "
                        "it is measured)")
    p.add_argument("--agent-ramp", type=float, default=0.0,
                   help="seconds over which the simulated agents start, each at a uniformly drawn time (as a "
                        "DaemonSet's pods come up node by node); 0: all at once")
    p.add_argument("--quotas", action="store_true",
                   help="after the steady window give every team a volume quota and measure a second window: "
                        "the leader's CPU per report and the API server writes, on against off (the agents "
                        "send their pods' byte counters in both)")
    p.add_argument("--no-pod-status", dest="pod_status", action="store_false",
                   help="leave pods Pending without IPs (faster loading; netagent reports them all the same)")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
