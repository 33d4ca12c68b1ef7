"""`netagent demo`: the whole system on one machine, no cluster needed (root).

It builds the namespace lab (two nodes with three pods each, an "internet" host and
an internal peer), runs one real controller and one real agent per node (the same
`netagent controller` / `netagent run` a cluster runs, fed from YAML files), and
drives iperf3 traffic from every pod to the internet host (uploads) and from the
internet host to every pod (a dataset download), with an upload budget and a download
budget each smaller than the pods' combined demand, while one pod also downloads from
the internal peer: that download is never shaped. A live table shows each pod's class,
fair share (what `netagent plan` computes from the same policy), allocation and measured
rate in both directions; halfway through it moves one pod to another class and raises one
team's weight, so allocations visibly move. Team web has a small daily upload quota
(docs/quotas.md) sized to run out at about two thirds of the run: its pod then drops to the
quota's exhaustedRate and the others take the share. Team research has a daily cost quota (docs/scopes.md:
its internet bytes at the NetworkScopes prices in the policy file) sized to run out at about 65 % of the
run: both its directions are then held at the cost quota's exhaustedRates. At the end it writes a PNG of
the rates over time, uploads above, downloads below.
Ctrl-C or the end removes everything it created.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from core.direction import Direction
from core.engine import PodDemandIn, allocate
from core.policy import load_policy, resolve_pod

from .nsexec import NetnsWorker, http_get
from .topology import INTERNAL_CIDRS, INTERNET_V4, PEER_V4, UPLINK, Lab

CONTROLLER_IP = "10.0.0.1"  # the lab fabric's bridge address: reachable from every node
CONTROLLER_PORT = 9561
AGENT_PORT = 9560
STATE_ADDRESS = "127.0.0.1:9562"  # the agent's default --state-listen
FIRST_IPERF_PORT = 5201
FIRST_DOWNLOAD_PORT = 5301  # the internet host's servers the pods download from (iperf3 -R)
INTERNAL_DOWNLOAD_PORT = 5401  # the internal peer's server

CLASSES = {
    # name: (weight, min, max)
    "gold": (4, "20M", "400M"),
    "silver": (2, "10M", "400M"),
    "bronze": (1, "5M", "400M"),
}
# (node index, namespace, pod name, class annotation or None)
PODS = [
    (0, "research", "train-0", "gold"),
    (0, "research", "train-1", "silver"),
    (0, "data", "etl-0", "bronze"),
    (1, "data", "etl-1", "silver"),
    (1, "data", "crawl", "bronze"),
    (1, "web", "frontend", None),  # no annotation: its team's default class
]
BUDGET_TOTAL = "120M"
DOWNLOAD_TOTAL = "200M"  # spec.ingressTotal: what the cluster's NAT gateways carry in
# the same classes for downloads (spec.ingress): weights and guarantees as for uploads
# (namespace, pod) downloading from the internal peer at this rate, above the download
# budget: internal traffic is never shaped, so it runs at what it offers
INTERNAL_DOWNLOAD = (("research", "train-1"), "250M")
CHANGE_POD = ("data", "crawl", "gold")  # halfway: this pod moves to this class...
CHANGE_TEAM = ("data", 3)  # ...and this team's weight rises to this
# this team's daily upload quota runs out at about QUOTA_AT of the run (quota_bytes); then it is held at
# QUOTA_EXHAUSTED_RATE (above the least ceil, 4.19M, so its one pod's ceil holds it: docs/quotas.md)
QUOTA_TEAM = "web"
QUOTA_EXHAUSTED_RATE = "10M"
QUOTA_AT = 0.6
# this team's daily cost quota (its internet bytes at PRICES, both directions) runs out at about COST_AT of the
# run (cost_quota); then both its directions are held at COST_EXHAUSTED (its pods' ceils above the least ceil)
COST_TEAM = "research"
PRICES = {"currency": "USD", "internet": {"egress": "1", "ingress": "0.5"}}  # per GiB: a demo's round prices
COST_EXHAUSTED = {Direction.UPLOAD: "15M", Direction.DOWNLOAD: "20M"}
COST_AT = 0.65


@dataclass
class Series:
    t: list[float] = field(default_factory=list)
    rate: dict[str, list[float]] = field(default_factory=dict)  # uploads to the internet, Mbit/s
    limit: dict[str, list[float]] = field(default_factory=dict)
    down: dict[str, list[float]] = field(default_factory=dict)  # downloads from the internet, Mbit/s
    down_limit: dict[str, list[float]] = field(default_factory=dict)
    internal_down: list[float] = field(default_factory=list)  # INTERNAL_DOWNLOAD's 1 s intervals (iperf3), Mbit/s


@dataclass(frozen=True)
class DemoOptions:
    duration: float = 60.0  # seconds of traffic
    png: str = "netagent-demo.png"  # the chart of rates over time
    plain: bool = False  # lines instead of a live table (also when not a TTY)
    summary_json: str | None = None  # also write the measured series and fair shares as JSON
    stagger: float = 0.0  # seconds the second node's pods start after the first node's
    keep_logs: str | None = None  # copy the run's logs here before the lab goes


def policy_objects(team_weights: dict[str, int], quota: int | None = None,
                   exhausted: bool = False, cost: str | None = None, cost_spent: bool = False) -> list[dict]:
    """The demo's classes and budget; `quota`: QUOTA_TEAM's daily upload bytes; `exhausted`: that team as the
    controller holds it once spent (its exhaustedRate as its cap: what the fair shares are computed from);
    `cost`: COST_TEAM's daily cost quota (and the NetworkScopes document with the prices); `cost_spent`: that
    team held at its cost quota's exhaustedRates."""
    objs: list[dict] = []
    for name, (weight, lo, hi) in CLASSES.items():
        objs.append({"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": name},
                     "spec": {"weight": weight, "min": lo, "max": hi,
                              "ingress": {"weight": weight, "min": lo, "max": hi}}})
    teams = [
        {"name": "research", "namespaces": ["research"], "weight": team_weights["research"],
         "defaultClass": "silver", "allowedClasses": ["gold", "silver", "bronze"]},
        {"name": "data", "namespaces": ["data"], "weight": team_weights["data"],
         "defaultClass": "bronze", "allowedClasses": ["gold", "silver", "bronze"]},
        {"name": "web", "namespaces": ["web"], "weight": team_weights["web"],
         "defaultClass": "silver", "allowedClasses": ["silver", "bronze"]},
    ]
    for team in teams:
        if team["name"] == QUOTA_TEAM and quota is not None:
            team["quota"] = {"period": "Day", "bytes": str(quota), "exhaustedRate": QUOTA_EXHAUSTED_RATE}
            if exhausted:
                team["max"] = QUOTA_EXHAUSTED_RATE
        if team["name"] == COST_TEAM and cost is not None:
            team["quota"] = {"period": "Day", "cost": cost, "exhaustedRate": COST_EXHAUSTED[Direction.UPLOAD],
                             "ingress": {"exhaustedRate": COST_EXHAUSTED[Direction.DOWNLOAD]}}
            if cost_spent:
                team["max"], team["ingress"] = COST_EXHAUSTED[Direction.UPLOAD], {"max": COST_EXHAUSTED[Direction.DOWNLOAD]}
    objs.append({"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "cluster"},
                 "spec": {"total": BUDGET_TOTAL, "ingressTotal": DOWNLOAD_TOTAL, "teams": teams,
                          "defaultTeam": "web"}})
    if cost is not None:
        objs.append({"apiVersion": "netagent.io/v1alpha1", "kind": "NetworkScopes", "metadata": {"name": "cluster"},
                     "spec": {"prices": PRICES}})
    return objs


def pod_objects(lab: Lab, classes: dict[tuple[str, str], str | None]) -> list[dict]:
    objs = []
    for n, ns, name, _ in PODS:
        node, pod = lab.nodes[n], lab.nodes[n].pods[[p[2] for p in PODS if p[0] == n].index(name)]
        ann = {"netagent.io/egress-class": classes[(ns, name)]} if classes[(ns, name)] else {}
        objs.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": ns, "name": name, "uid": f"demo-{ns}-{name}", "annotations": ann},
            "spec": {"nodeName": node.name},
            "status": {"phase": "Running", "podIP": pod.ip4,
                       "podIPs": [{"ip": pod.ip4}] + ([{"ip": pod.ip6}] if lab.ipv6 else [])},
        })
    return objs


def write_yaml(path: Path, objs: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump_all(objs, sort_keys=False))
    os.replace(tmp, path)  # atomic: the file watchers never see half a file


def fair_shares(policy: list[dict], classes: dict[tuple[str, str], str | None],
                download: bool = False) -> dict[str, float]:
    """What `netagent plan` says each pod deserves when every pod wants more than the budget
    (the download budget and values with `download`)."""
    pol, _ = load_policy([o for o in policy if o["kind"] == "EgressClass"],
                         [o for o in policy if o["kind"] == "EgressBudget"])
    d = Direction.DOWNLOAD if download else Direction.UPLOAD
    pods = []
    for _, ns, name, _ in PODS:
        pp = resolve_pod(pol, ns, classes[(ns, name)])
        lim = pp.limits[d]
        pods.append(PodDemandIn(f"{ns}/{name}", pp.team, pp.egress_class, lim.weight, lim.min_bps, lim.max_bps, 1e9))
    res = allocate(pol, pods, direction=d)
    return {k: v.allocation_bps for k, v in res.pods.items()}


def quota_bytes(duration: float) -> int:
    """QUOTA_TEAM's daily upload quota for a run of `duration` s: what its pods' fair shares move until QUOTA_AT
    of the run (the first half at the shares before the change, then after it). Pure."""
    classes = {(ns, name): cls for _, ns, name, cls in PODS}
    before = fair_shares(policy_objects({"research": 1, "data": 1, "web": 1}), classes)
    changed = dict(classes)
    changed[CHANGE_POD[:2]] = CHANGE_POD[2]
    after = fair_shares(policy_objects({"research": 1, "data": 1, "web": 1} | dict([CHANGE_TEAM])), changed)
    team = [f"{ns}/{name}" for _, ns, name, _ in PODS if ns == QUOTA_TEAM]
    bps = sum(before[k] for k in team) * duration / 2 + sum(after[k] for k in team) * (QUOTA_AT - 0.5) * duration
    return int(bps / 8)


def cost_quota(duration: float) -> str:
    """COST_TEAM's daily cost quota for a run of `duration` s: what its internet bytes cost at PRICES, both
    directions at its fair shares, until COST_AT of the run (before the change, after it, after QUOTA_TEAM is
    held), as a decimal string. Pure."""
    from decimal import Decimal

    from core.scopes import GIB
    classes = {(ns, name): cls for _, ns, name, cls in PODS}
    changed = dict(classes)
    changed[CHANGE_POD[:2]] = CHANGE_POD[2]
    weights = {"research": 1, "data": 1, "web": 1}
    stages = ((policy_objects(weights), classes, 0.0, 0.5),
              (policy_objects(weights | dict([CHANGE_TEAM])), changed, 0.5, QUOTA_AT),
              (policy_objects(weights | dict([CHANGE_TEAM]), 1, exhausted=True), changed, QUOTA_AT, COST_AT))
    total = Decimal(0)
    for objs, cls, start, end in stages:
        for d, price in ((Direction.UPLOAD, PRICES["internet"]["egress"]), (Direction.DOWNLOAD, PRICES["internet"]["ingress"])):
            shares = fair_shares(objs, cls, download=d is Direction.DOWNLOAD)
            bps = sum(v for k, v in shares.items() if k.split("/")[0] == COST_TEAM)
            total += Decimal(str(bps / 8 * (end - start) * duration)) / GIB * Decimal(price)
    return str(total.quantize(Decimal("0.000001")))


def mean_rate(values: list[float]) -> float:
    """The mean of a series' seconds, skipping NaN (a pod not yet visible); 0 for none. Pure."""
    vals = [v for v in values if v == v]
    return sum(vals) / len(vals) if vals else 0.0


def settled_windows(summary: dict) -> tuple[list[int], list[int]]:
    """Indexes of a summary's settled seconds: the 6 s before the change, and the last 5 s (what
    tests/test_demo.py asserts on and bench/demo_runs.py reports). Pure."""
    t = summary["t"]
    (change_t, _), = summary["events"]
    return ([i for i, x in enumerate(t) if change_t - 6 <= x < change_t],
            [i for i, x in enumerate(t) if x >= t[-1] - 5])


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:7.1f}"


class Demo:
    def __init__(self, opts: DemoOptions):
        self.opts = opts
        self.dir = Path(tempfile.mkdtemp(prefix="netagent-demo-"))
        self.lab: Lab | None = None
        self.fabric: NetnsWorker | None = None
        self._node_workers: dict[str, NetnsWorker] = {}
        self.classes = {(ns, name): cls for _, ns, name, cls in PODS}
        self.team_weights = {"research": 1, "data": 1, "web": 1}
        self.series = Series()
        self.moved: dict[str, float] = {}  # pod key -> seconds until its upload first moved
        self.moved_down: dict[str, float] = {}  # pod key -> seconds until its download first moved
        self.events: list[tuple[float, str]] = []
        self.quota = quota_bytes(opts.duration)  # QUOTA_TEAM's daily upload bytes
        self.quota_used: list[tuple[float, int]] = []  # (t, used) as the controller's /v1/status says
        self.exhausted_at: float | None = None
        self.cost = cost_quota(opts.duration)  # COST_TEAM's daily cost quota, in PRICES' currency
        self.cost_used: list[tuple[float, float]] = []  # (t, the period's cost) as the controller's /v1/status says
        self.cost_spent_at: float | None = None

    # -- set-up -----------------------------------------------------------------
    def start(self) -> None:
        self.lab = Lab(nodes=2, pods_per_node=3)
        self.lab.__enter__()
        self.fabric = NetnsWorker(self.lab.fabric)
        self.policy_file = self.dir / "policy.yaml"
        self.pods_file = self.dir / "pods.yaml"
        write_yaml(self.policy_file, policy_objects(self.team_weights, self.quota, cost=self.cost))
        write_yaml(self.pods_file, pod_objects(self.lab, self.classes))
        logs = self.dir / "logs"
        logs.mkdir()
        netagent = [sys.executable, "-m", "netagent"]
        self.lab.spawn(self.lab.fabric, [
            *netagent, "controller", "--from-file", str(self.policy_file), "--no-auth", "--insecure-http",
            "--listen", f"{CONTROLLER_IP}:{CONTROLLER_PORT}", "--period", "1", "--answer-wait", "1.5", "--lease-seconds", "15",
        ], stdout=open(logs / "controller.log", "w"), stderr=subprocess.STDOUT)
        for node in self.lab.nodes:
            self.lab.spawn(node.netns, [
                *netagent, "run", "--node", node.name, "--from-file", str(self.policy_file),
                "--from-file", str(self.pods_file), "--controller", f"http://{CONTROLLER_IP}:{CONTROLLER_PORT}",
                "--controller-insecure-http",
                "--uplink", UPLINK, *[a for c in INTERNAL_CIDRS for a in ("--internal-cidr", c)],
                "--listen", f"{node.ip4}:{AGENT_PORT}", "--report-period", "1", "--token-path", "",
            ], stdout=open(logs / f"agent-{node.name}.log", "w"), stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        pending = {n.name: n.ip4 for n in self.lab.nodes}
        while pending and time.monotonic() < deadline:
            for name, ip in list(pending.items()):
                try:
                    code, _ = self.fabric.call(http_get, f"http://{ip}:{AGENT_PORT}/readyz", 1)
                except OSError:
                    continue
                if code == 200:
                    del pending[name]
            time.sleep(0.3)
        if pending:
            raise RuntimeError(f"agents on {sorted(pending)} did not become ready within {timeout:.0f}s; "
                               f"their logs are in {self.dir / 'logs'}")

    def start_traffic(self, seconds: float) -> None:
        for i in range(len(PODS)):
            self.lab.iperf_server(self.lab.internet, FIRST_IPERF_PORT + i)
            self.lab.iperf_server(self.lab.internet, FIRST_DOWNLOAD_PORT + i)
        self.lab.iperf_server(self.lab.peer, INTERNAL_DOWNLOAD_PORT)
        late = [i for i, (n, *_) in enumerate(PODS) if n == 1 and self.opts.stagger > 0]
        for i in range(len(PODS)):
            if i not in late:
                self._start_pod(i, seconds)
        if late:
            # the second node's pods start later (their node has reported them idle by then): the
            # first answers give them a trickle and the first node's pods everything else
            timer = threading.Timer(self.opts.stagger, lambda: [self._start_pod(i, seconds) for i in late])
            timer.daemon = True
            timer.start()

    def _start_pod(self, i: int, seconds: float) -> None:
        n, ns, name, _ = PODS[i]
        run_for = ["-t", str(int(seconds) + 2), "-P", "2", "-i", "0.2", "--forceflush"]
        pod = self.lab.nodes[n].pods[[p[2] for p in PODS if p[0] == n].index(name)]
        # per-interval lines, flushed as they come: `first_moved` says when each pod's flow first moved
        for moved, port, reverse in ((self.moved, FIRST_IPERF_PORT + i, []),
                                     (self.moved_down, FIRST_DOWNLOAD_PORT + i, ["-R"])):
            proc = self.lab.spawn(pod.netns, ["iperf3", "-c", INTERNET_V4, "-p", str(port), *reverse, *run_for],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            threading.Thread(target=self._watch_flow, args=(f"{ns}/{name}", proc, time.monotonic(), moved,
                                                            "down" if reverse else "up"),
                             name=f"iperf-{name}", daemon=True).start()
        if (ns, name) == INTERNAL_DOWNLOAD[0]:
            proc = self.lab.spawn(pod.netns, ["iperf3", "-c", PEER_V4, "-p", str(INTERNAL_DOWNLOAD_PORT), "-R",
                                              "-b", INTERNAL_DOWNLOAD[1], "-t", str(int(seconds) + 2), "-i", "1",
                                              "--forceflush"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            threading.Thread(target=self._watch_internal, args=(proc,), name="iperf-internal", daemon=True).start()

    def _internal_now(self) -> float:
        """The internal download's latest 1 s interval, Mbit/s (NaN before the first)."""
        return self.series.internal_down[-1] if self.series.internal_down else float("nan")

    def _watch_internal(self, proc: subprocess.Popen) -> None:
        """The internal download's 1 s intervals as iperf3 received them (its -R client is the receiver)."""
        with open(self.dir / "logs" / "iperf-internal-download.log", "w") as log:
            for line in proc.stdout:
                log.write(line)
                parts = line.split()
                # "[  5]   1.00-2.00   sec  35.8 MBytes   300 Mbits/sec" (the summary lines end in sender/receiver)
                if len(parts) == 8 and parts[0] == "[" and parts[7] == "Mbits/sec":
                    self.series.internal_down.append(float(parts[6]))
                elif len(parts) == 7 and parts[0].startswith("[") and parts[6] == "Mbits/sec":
                    self.series.internal_down.append(float(parts[5]))

    def _watch_flow(self, key: str, proc: subprocess.Popen, started: float, moved: dict[str, float],
                    direction: str) -> None:
        """Read one client's interval lines as iperf3 flushes them; the first [SUM] interval that moved
        bytes marks the moment the flow moved (at most one 0.2 s interval late). The lines go to its log."""
        with open(self.dir / "logs" / f"iperf-{direction}-{key.replace('/', '-')}.log", "w") as log:
            for line in proc.stdout:
                log.write(line)
                parts = line.split()
                # "[SUM]   0.00-0.20   sec  1.23 MBytes  ..." (with -P 2 the SUM line is the pod's total)
                if key not in moved and len(parts) > 4 and parts[0] == "[SUM]" and parts[2] == "sec":
                    try:
                        bytes_moved = float(parts[3]) > 0
                    except ValueError:
                        continue
                    if bytes_moved:
                        moved[key] = round(time.monotonic() - started, 2)

    def first_moved(self, moved: dict[str, float] | None = None) -> dict[str, float | None]:
        """Pod key -> seconds from starting its iperf3 to the first interval that moved bytes (None: never);
        uploads unless `moved` is self.moved_down."""
        moved = self.moved if moved is None else moved
        return {f"{ns}/{name}": moved.get(f"{ns}/{name}") for _, ns, name, _ in PODS}

    def steady_total(self, rates: dict[str, list[float]] | None = None, budget: str = BUDGET_TOTAL) -> dict:
        """The measured total against the budget in steady state: the mean over the last 10 s before
        the change and the last 10 s of the run (IP bytes, the budget's unit); uploads unless given
        the download series and budget."""
        rates = self.series.rate if rates is None else rates
        n, t = len(self.series.t), self.series.t
        total = [sum(v[i] for v in rates.values() if i < len(v) and v[i] == v[i]) for i in range(n)]
        change = self.events[0][0] if self.events else t[-1]
        out = {}
        for label, lo, hi in (("before_change", change - 10, change), ("end", t[-1] - 10, t[-1] + 1)):
            window = [total[i] for i in range(n) if lo <= t[i] < hi]
            if window:
                mean = sum(window) / len(window)
                out[label] = {"total_mbps": round(mean, 3),
                              "error": round(mean / (float(budget.rstrip("M"))) - 1, 4), "samples": len(window)}
        return out

    # -- the changes halfway ---------------------------------------------------------
    def change(self, t: float) -> str:
        ns, name, cls = CHANGE_POD
        team, weight = CHANGE_TEAM
        self.classes[(ns, name)] = cls
        self.team_weights[team] = weight
        write_yaml(self.pods_file, pod_objects(self.lab, self.classes))
        write_yaml(self.policy_file, policy_objects(self.team_weights, self.quota, cost=self.cost))
        what = f"{ns}/{name} → class {cls}; team {team} weight → {weight}"
        self.events.append((t, what))
        return what

    def fair(self, download: bool = False) -> dict[str, float]:
        """Each pod's fair share now: the policy as it stands, QUOTA_TEAM capped once its quota is spent."""
        return fair_shares(policy_objects(self.team_weights, self.quota, exhausted=self.exhausted_at is not None,
                                          cost=self.cost, cost_spent=self.cost_spent_at is not None),
                           self.classes, download=download)

    def watch_quota(self, t: float) -> bool:
        """QUOTA_TEAM's use and COST_TEAM's cost from the controller's /v1/status; True the first time either says
        spent (the fair shares change)."""
        try:
            code, body = self.fabric.call(http_get, f"http://{CONTROLLER_IP}:{CONTROLLER_PORT}/v1/status", 2)
            status = json.loads(body) if code == 200 else {}
        except (OSError, ValueError):
            return False
        changed = False
        mine = next((q for q in status.get("quota") or [] if q.get("team") == QUOTA_TEAM and q.get("uploads")), None)
        if mine is not None:
            self.quota_used.append((t, int(mine["uploads"]["used"])))
            if mine["uploads"]["exhausted"] and self.exhausted_at is None:
                self.exhausted_at, changed = t, True
        cost = next((c for c in status.get("cost") or [] if c.get("team") == COST_TEAM), None)
        if cost is not None:
            self.cost_used.append((t, float(cost["period_cost"])))
            if cost.get("spent") and self.cost_spent_at is None:
                self.cost_spent_at, changed = t, True
        return changed

    def quota_note(self) -> str:
        used = self.quota_used[-1][1] if self.quota_used else 0
        state = (f"EXHAUSTED at t={self.exhausted_at:.0f}s: held at {QUOTA_EXHAUSTED_RATE}bit/s, the others take "
                 "its share" if self.exhausted_at is not None else "")
        spent = self.cost_used[-1][1] if self.cost_used else 0.0
        cost_state = (f"SPENT at t={self.cost_spent_at:.0f}s: held at {COST_EXHAUSTED[Direction.UPLOAD]}bit/s up, "
                      f"{COST_EXHAUSTED[Direction.DOWNLOAD]}bit/s down" if self.cost_spent_at is not None else "")
        return (f"team {QUOTA_TEAM}'s daily upload quota: {used / 1e6:.0f} of {self.quota / 1e6:.0f} MB used"
                + (f" — {state}" if state else "")
                + f"\nteam {COST_TEAM}'s daily cost quota: {spent:.3f} of {self.cost} {PRICES['currency']} spent"
                + (f" — {cost_state}" if cost_state else ""))

    # -- observing ------------------------------------------------------------------
    def states(self) -> dict[str, dict]:
        out = {}
        for node in self.lab.nodes:
            try:  # /state is served on the node's loopback only (the agent's --state-listen)
                if node.name not in self._node_workers:
                    self._node_workers[node.name] = NetnsWorker(node.netns)
                code, body = self._node_workers[node.name].call(http_get, f"http://{STATE_ADDRESS}/state", 2)
                if code == 200:
                    out[node.name] = json.loads(body)
            except (OSError, ValueError):
                pass
        return out

    def rows(self, states: dict[str, dict], fair: dict[str, float], fair_down: dict[str, float]) -> list[dict]:
        rows = []
        for node, st in sorted(states.items()):
            for p in st.get("pods", []):
                key = f"{p['namespace']}/{p['name']}"
                rows.append({"node": node, "key": key, "team": p.get("team", ""), "class": p.get("egress_class", ""),
                             "fair": fair.get(key, 0.0), "allocation": p.get("allocation_bps", 0.0),
                             "limit": p.get("limit_bps", 0.0), "rate": p.get("usage_bps", 0.0),
                             "down_fair": fair_down.get(key, 0.0),
                             "down_allocation": p.get("ingress_allocation_bps", 0.0),
                             "down_limit": p.get("ingress_limit_bps", 0.0), "down_rate": p.get("ingress_usage_bps", 0.0),
                             "problems": "; ".join(m for _, m in p.get("problems", []))})
        return rows

    def table(self, rows: list[dict], t: float, note: str):

        tab = Table(title=f"netagent demo — t={t:4.0f}s of {self.opts.duration:.0f}s — upload budget {BUDGET_TOTAL}"
                          f"bit/s, download budget {DOWNLOAD_TOTAL}bit/s" + (f"\n{note}" if note else "")
                          + f"\n{self.quota_note()}")
        numbers = ("up fair", "up alloc", "up measured", "down fair", "down alloc", "down measured")
        for col in ("node", "pod", "team", "class", *numbers):
            tab.add_column(col, justify="right" if col in numbers else "left")
        total = total_down = 0.0
        for r in rows:
            total += r["rate"]
            total_down += r["down_rate"]
            tab.add_row(r["node"], r["key"], r["team"], r["class"], *(_mbit(r[k]) + " M" for k in (
                "fair", "allocation", "rate", "down_fair", "down_allocation", "down_rate")))
        tab.add_row("", "[b]total[/]", "", "", "", "", f"[b]{_mbit(total)} M[/]", "", "", f"[b]{_mbit(total_down)} M[/]")
        internal = self._internal_now()
        (ns, name), offered = INTERNAL_DOWNLOAD
        tab.caption = (f"{ns}/{name} also downloads from the internal peer at {offered}bit/s offered: "
                       f"{internal:.1f} Mbit/s measured (internal traffic is never shaped)")
        return tab

    def record(self, t: float, rows: list[dict]) -> None:
        self.series.t.append(t)
        n = len(self.series.t)
        for r in rows:
            for store, value in ((self.series.rate, r["rate"]), (self.series.limit, r["limit"]),
                                 (self.series.down, r["down_rate"]), (self.series.down_limit, r["down_limit"])):
                seq = store.setdefault(r["key"], [])
                seq.extend([float("nan")] * (n - 1 - len(seq)))
                seq.append(value / 1e6)

    def chart(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (up, down) = plt.subplots(2, 1, figsize=(11, 10), dpi=100, sharex=True)
        n = len(self.series.t)
        for ax, rates, budget, what in ((up, self.series.rate, BUDGET_TOTAL, "uploads: internet egress"),
                                        (down, self.series.down, DOWNLOAD_TOTAL, "downloads: internet ingress")):
            for key in sorted(rates):
                seq = rates[key] + [float("nan")] * (n - len(rates[key]))
                ax.plot(self.series.t, seq, label=key, linewidth=1.6)
            total = [sum(v for v in (rates[k][i] if i < len(rates[k]) else float("nan") for k in rates) if v == v)
                     for i in range(n)]
            ax.plot(self.series.t, total, label="total", color="black", linewidth=2.2)
            ax.axhline(float(budget.rstrip("M")), color="red", linestyle="--", label=f"budget {budget}")
            ax.set_ylabel(f"{what}, Mbit/s")
            ax.grid(alpha=0.3)
        (ns, name), offered = INTERNAL_DOWNLOAD
        internal = self.series.internal_down
        down.plot([self.series.t[0] + i + 1 for i in range(len(internal))] if self.series.t else [], internal,
                  color="grey", linestyle="-.", linewidth=1.6,
                  label=f"{ns}/{name} from the internal peer ({offered} offered, not shaped)")
        for ax in (up, down):
            for t, what in self.events:
                ax.axvline(t, color="grey", linestyle=":")
                ax.annotate(what, (t, ax.get_ylim()[1] * 0.95), fontsize=8, ha="left")
        if self.exhausted_at is not None:  # uploads only: the quota counts web's uploads
            up.axvline(self.exhausted_at, color="orange", linestyle=":")
            up.annotate(f"team {QUOTA_TEAM}'s daily quota spent → held at {QUOTA_EXHAUSTED_RATE}",
                        (self.exhausted_at, up.get_ylim()[1] * 0.85), fontsize=8, ha="left", color="darkorange")
        if self.cost_spent_at is not None:  # both directions: the cost counts both
            for ax, d in ((up, Direction.UPLOAD), (down, Direction.DOWNLOAD)):
                ax.axvline(self.cost_spent_at, color="purple", linestyle=":")
                ax.annotate(f"team {COST_TEAM}'s daily cost quota spent → held at {COST_EXHAUSTED[d]}",
                            (self.cost_spent_at, ax.get_ylim()[1] * 0.6), fontsize=8, ha="left", color="purple")
        for ax in (up, down):
            ax.legend(loc="center right", fontsize=8)
        down.set_xlabel("seconds (rates measured from kernel counters)")
        up.set_title("netagent: pods' internet uploads and downloads converging to their fair shares")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    # -- the run -------------------------------------------------------------------
    def run(self) -> int:

        console = Console()
        plain = self.opts.plain or not console.is_terminal
        console.print(f"building the lab: 2 nodes × 3 pods, internet host {INTERNET_V4}, internal peer; "
                      f"files and logs in {self.dir}")
        self.start()
        self.start_traffic(self.opts.duration)
        fair = fair_before = self.fair()
        fair_down = fair_down_before = self.fair(download=True)
        note = ""
        t0 = time.monotonic()
        changed = False
        live = None if plain else Live(console=console, refresh_per_second=2, transient=False)
        if live:
            live.start()
        try:
            while (t := time.monotonic() - t0) < self.opts.duration:
                if not changed and t >= self.opts.duration / 2:
                    changed = True
                    note = "changed: " + self.change(t)
                    fair, fair_down = self.fair(), self.fair(download=True)
                    if plain:
                        console.print(f"t={t:.0f}s {note}")
                if self.watch_quota(t):
                    # a team held at its exhaustedRate(s): the others' shares grow
                    fair, fair_down = self.fair(), self.fair(download=True)
                    if plain:
                        console.print(f"t={t:.0f}s {self.quota_note()}")
                rows = self.rows(self.states(), fair, fair_down)
                self.record(t, rows)
                if live:
                    live.update(self.table(rows, t, note))
                else:
                    total = sum(r["rate"] for r in rows)
                    total_down = sum(r["down_rate"] for r in rows)
                    console.print(f"t={t:4.0f}s up total={_mbit(total).strip()}M  " + "  ".join(
                        f"{r['key']}={_mbit(r['rate']).strip()}/{_mbit(r['fair']).strip()}" for r in rows),
                        soft_wrap=True, highlight=False)
                    console.print(f"       down total={_mbit(total_down).strip()}M  " + "  ".join(
                        f"{r['key']}={_mbit(r['down_rate']).strip()}/{_mbit(r['down_fair']).strip()}" for r in rows)
                        + f"  internal={self._internal_now():.1f}M", soft_wrap=True, highlight=False)
                time.sleep(1.0)
        finally:
            if live:
                live.stop()
        png = Path(self.opts.png).resolve()
        self.chart(png)
        if self.opts.summary_json:
            Path(self.opts.summary_json).write_text(json.dumps({
                "budget_bps": float(BUDGET_TOTAL.rstrip("M")) * 1e6, "events": self.events, "t": self.series.t,
                "rate_mbps": self.series.rate, "limit_mbps": self.series.limit,
                "fair_before_bps": fair_before, "fair_after_bps": fair,
                "steady_total": self.steady_total(), "first_moved_s": self.first_moved(),
                "quota": {"team": QUOTA_TEAM, "bytes": self.quota, "exhausted_rate": QUOTA_EXHAUSTED_RATE,
                          "exhausted_at": self.exhausted_at, "used": self.quota_used},
                "cost": {"team": COST_TEAM, "quota": self.cost, "currency": PRICES["currency"],
                         "exhausted_rates": {d.value: r for d, r in COST_EXHAUSTED.items()},
                         "spent_at": self.cost_spent_at, "used": self.cost_used},
                "download": {
                    "budget_bps": float(DOWNLOAD_TOTAL.rstrip("M")) * 1e6, "rate_mbps": self.series.down,
                    "limit_mbps": self.series.down_limit, "fair_before_bps": fair_down_before,
                    "fair_after_bps": fair_down, "first_moved_s": self.first_moved(self.moved_down),
                    "steady_total": self.steady_total(self.series.down, DOWNLOAD_TOTAL),
                    "internal": {"pod": "/".join(INTERNAL_DOWNLOAD[0]), "offered": INTERNAL_DOWNLOAD[1],
                                 "rate_mbps": self.series.internal_down}}}, indent=1))
        console.print(f"chart of rates over time: {png}")
        fab = self.lab.fabric
        console.print("metrics (inside the lab; they go away with it):")
        for node in self.lab.nodes:
            console.print(f"  agent {node.name}:  ip netns exec {fab} curl -s http://{node.ip4}:{AGENT_PORT}/metrics")
        console.print(f"  controller:   ip netns exec {fab} curl -s http://{CONTROLLER_IP}:{CONTROLLER_PORT}/metrics")
        return 0

    def close(self) -> None:
        if self.fabric:
            self.fabric.close()
        for worker in self._node_workers.values():
            worker.close()
        if self.lab:
            self.lab.close()  # kills agents, controller and iperf3, removes every namespace
        if self.opts.keep_logs and (self.dir / "logs").is_dir():
            shutil.copytree(self.dir / "logs", self.opts.keep_logs, dirs_exist_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def run(opts: DemoOptions) -> int:
    """Run the demo; 0 when it ran to the end, 2 when the machine cannot run it."""
    if os.geteuid() != 0:
        print("netagent demo needs root: it builds network namespaces and programs tc and iptables in them",
              file=sys.stderr)
        return 2
    missing = [t for t in ("ip", "iptables", "ipset", "iperf3") if not shutil.which(t)]
    if missing:
        print(f"netagent demo needs {', '.join(missing)}: run `sudo bash scripts/bootstrap.sh` first", file=sys.stderr)
        return 2
    demo = Demo(opts)
    # Ctrl-C and SIGTERM both end in close(): nothing is left behind
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return demo.run()
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        logs = demo.dir / "logs"
        for f in sorted(logs.glob("*.log")) if logs.exists() else []:
            tail = f.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {f.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)
        return 1
    finally:
        demo.close()
