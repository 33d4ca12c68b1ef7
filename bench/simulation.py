"""Convergence of the whole loop: N simulated nodes against the real controller over HTTP.

    python3 bench/simulation.py [--nodes 20] [--pods 10] [--period 0.5] [--l3-per-l2 1.0] [--host 1.5e6]
                                [--jitter 0.03]

Starts `netagent controller --from-file` (the real service: HTTP API, adapter, engine,
rounds every period/5) and simulates each node's agent faithfully: every report period a
pod sends min(its true demand, the limit the controller gave it), its class counters
(bytes, overlimits) feed the agent's own demand estimator (netagent.demand.PodDemand, which
probes above censored usage), and the node posts its report with the node's measured
internet egress. The node's measured egress is not its pods' usage: it includes unshaped
host traffic, as on a real node, and `--l3-per-l2` scales the pods' part of it. The agent
reports both in IP bytes from the same class counters (docs/datapath.md, what a rate means),
so the default is 1.0; 0.955 models the iptables node counter agents reported before (one
header per GSO super-packet against HTB's frames). The feedback gain has to find that ratio. The "fair allocation"
is the engine's answer for the *true* demands at the capacity that puts the measured total
on the budget, (budget - host traffic) / (L3 per L2).

Scenario: steady demands above the budget; at SHIFT half the pods change demand; at JUMP
one small pod's demand jumps 10x; from BURST some pods burst on and off. Printed: per
period the share of pods within 5% of their fair share and the worst pod's error (by
rate, min(demand, limit), and by allocation), the measured total against the budget, the
jumping pod's allocation against its fair share; then the settling times (periods until
the condition holds and keeps holding until the next event) against the aims: within 5%
of fair within 2 periods of any change, the cold start and the 10x pod included (issue 37;
the 10x pod's aim was 4 periods, the cold start's 4); measured total within 5% of the budget.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from netagent.demand import PodDemand, Sample  # noqa: E402
from lab.procs import stop_process  # noqa: E402

BUDGET_BPS = 1e9
SHIFT, JUMP, BURST, END = 12, 24, 36, 48
TOLERANCE = 0.05
STEADY = [range(6, SHIFT), range(SHIFT + 6, JUMP), range(JUMP + 6, BURST)]  # periods to judge the total in


def policy_objects() -> list[dict]:
    return [
        {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "bulk"},
         "spec": {"weight": 1, "max": "200M"}},
        {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "interactive"},
         "spec": {"weight": 3, "min": "2M"}},
        {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
         "spec": {"total": "1G", "teams": [
             {"name": "research", "namespaces": ["research"], "weight": 1, "defaultClass": "bulk"},
             {"name": "data", "namespaces": ["data"], "weight": 2, "defaultClass": "bulk", "min": "100M"},
             {"name": "web", "namespaces": ["web"], "weight": 3, "defaultClass": "interactive"},
         ]}},
    ]


@dataclass
class SimPod:
    node: str
    namespace: str
    name: str
    egress_class: str | None
    demand: float  # the true appetite, bit/s
    bursty: bool = False
    limit: float = 1e6  # what the agent enforces (HTB ceil); the floor until the first answer
    answers: int = 0  # answers its node received (the estimator counts them, as the agent does)
    allocation: float = 0.0
    bytes: int = 0
    overlimits: int = 0
    estimator: PodDemand = field(default_factory=PodDemand)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def build_pods(nodes: int, per_node: int, rng: random.Random) -> list[SimPod]:
    pods = []
    namespaces = ["research", "data", "web"]
    for n in range(nodes):
        for j in range(per_node):
            ns = namespaces[(n + j) % 3]
            cls = "interactive" if ns == "research" and j % 4 == 0 else None
            pods.append(SimPod(f"sim-node-{n:03d}", ns, f"pod-{n:03d}-{j:02d}", cls,
                               demand=rng.lognormvariate(0, 0.6) * 1.6 * BUDGET_BPS / (nodes * per_node),
                               bursty=(n * per_node + j) % 10 == 3))
    return pods


def fair_allocation(pods: list[SimPod], capacity_bps: float) -> dict[str, float]:
    from dataclasses import replace

    from core.direction import Direction
    from core.engine import PodDemandIn, allocate
    from core.policy import load_policy, resolve_pod

    objs = policy_objects()
    policy, _ = load_policy([o for o in objs if o["kind"] == "EgressClass"],
                            [o for o in objs if o["kind"] == "EgressBudget"])
    policy = replace(policy, totals=policy.totals.replace(Direction.UPLOAD, int(capacity_bps)))
    rows = []
    for p in pods:
        pp = resolve_pod(policy, p.namespace, p.egress_class)
        up = pp.limits.upload
        rows.append(PodDemandIn(p.key, pp.team, pp.egress_class, up.weight, up.min_bps, up.max_bps, p.demand))
    return {k: r.allocation_bps for k, r in allocate(policy, rows).pods.items()}


def advance(pods: list[SimPod], t: float, dt: float, jitter: float, rng: random.Random) -> float:
    """One report period of traffic under the current limits; returns what the pods' classes sent
    (bit/s). Each pod wants its demand times a uniform factor in [1 - jitter, 1 + jitter] this
    period. A class is marked over its ceil (HTB's overlimits) when the pod wants more than its
    limit by more than HTB's burst absorbs over a period (0.1%)."""
    total = 0.0
    for p in pods:
        want = p.demand * (1 + rng.uniform(-jitter, jitter)) if jitter else p.demand
        sent = min(want, p.limit)
        total += sent
        p.bytes += int(sent * dt / 8)
        if want > p.limit * 1.001:
            p.overlimits += 1
        p.estimator.update(Sample(t, p.bytes, 0, p.overlimits, 0), int(p.limit), 2**62, p.answers)
    return total


async def post_reports(session, base: str, pods: list[SimPod], period: float, egress: dict[str, float],
                       shaped: dict[str, float] | None) -> int:
    """`shaped`: what each node's classes sent over the same seconds as its egress (an agent that reads
    both together); None: reports as older agents sent them, the pods' last samples only."""
    by_node: dict[str, list[SimPod]] = {}
    for p in pods:
        by_node.setdefault(p.node, []).append(p)

    async def one(node: str, members: list[SimPod]) -> int:
        body = {"node": node, "seq": 1, "period_seconds": period, "node_internet_egress_bps": egress.get(node, 0.0),
                **({"node_shaped_egress_bps": shaped[node]} if shaped is not None else {}),
                "pods": [{"namespace": p.namespace, "name": p.name, "usage_bps": p.estimator.usage_bps,
                          "demand_bps": p.estimator.demand_bps, "throttled": p.estimator.throttled,
                          "egress_class": p.egress_class} for p in members]}
        async with session.post(f"{base}/v1/nodes/{node}/report", json=body) as r:
            answer = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{node}: {r.status} {answer}")
        if answer["generation"] == 0:
            return 0
        got = {f"{a['namespace']}/{a['name']}": a for a in answer["pods"]}
        for p in members:
            p.answers += 1
            a = got.get(p.key)
            if a is not None:
                p.limit, p.allocation = max(a["limit_bps"], 1.0), a["allocation_bps"]
        return answer["generation"]

    gens = await asyncio.gather(*(one(n, m) for n, m in by_node.items()))
    return max(gens)


def share_within(pods: list[SimPod], fair: dict[str, float], tolerance: float) -> float:
    """The share of pods whose rate, min(demand, limit), is within `tolerance` of their fair share
    (shares under 5% of the mean share count as 5% of it, as in `worst_error`)."""
    mean_share = BUDGET_BPS / len(pods)
    ok = sum(abs(min(p.demand, p.limit) - fair[p.key]) <= tolerance * max(fair[p.key], 0.05 * mean_share)
             for p in pods)
    return ok / len(pods)


def worst_error(pods: list[SimPod], fair: dict[str, float], rate: bool) -> float:
    """The worst pod's distance from its fair share, relative to it (shares under 5% of the mean
    share count as 5% of it: a pod wanting almost nothing is not a 1000% error). rate=True
    judges what the pod can send, min(its demand, its limit); False the allocation itself."""
    mean_share = BUDGET_BPS / len(pods)
    return max(abs((min(p.demand, p.limit) if rate else p.allocation) - fair[p.key])
               / max(fair[p.key], 0.05 * mean_share) for p in pods)


async def gain_of(session, base: str) -> float:
    """The controller's feedback gain, from its /metrics."""
    async with session.get(f"{base}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("netagent_controller_feedback_gain "):
                return float(line.split()[1])
    return float("nan")


async def simulate(base: str, args, pods: list[SimPod], rng: random.Random) -> list[dict]:
    import aiohttp

    jumper = min((p for p in pods if not p.bursty and p.namespace == "data"), key=lambda p: p.demand)
    rows = []
    base_demand = {p.key: p.demand for p in pods}
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        for step in range(END):
            if step == SHIFT:
                for p in pods[::2]:
                    p.demand *= rng.choice((0.3, 2.0))
            if step == JUMP:
                jumper.demand *= 10
            if step >= BURST:
                for p in pods:
                    if p.bursty:
                        p.demand = base_demand[p.key] * (3.0 if (step // 2) % 2 == 0 else 0.1)
            t = step * args.period
            egress: dict[str, float] = {}
            shaped: dict[str, float] = {}
            cluster = 0.0
            for node in {p.node for p in pods}:
                shaped[node] = advance([p for p in pods if p.node == node], t, args.period, args.jitter, rng)
                egress[node] = shaped[node] * args.l3_per_l2 + args.host
                cluster += egress[node]
            generation = await post_reports(session, base, pods, args.period, egress,
                                            None if args.older_agents else shaped)
            fair = fair_allocation(pods, (BUDGET_BPS - args.host * args.nodes) / args.l3_per_l2)
            bursting = [p for p in pods if p.bursty and p.demand > base_demand[p.key]]
            rows.append({"step": step, "generation": generation, "error": worst_error(pods, fair, rate=True),
                         "burst_error": worst_error(bursting, fair, rate=True) if bursting else None,
                         "bursting": bool(bursting), "gain": await gain_of(session, base),
                         "alloc_error": worst_error(pods, fair, rate=False),
                         "within": share_within(pods, fair, TOLERANCE),
                         "total": cluster / BUDGET_BPS, "demand": sum(p.demand for p in pods) / BUDGET_BPS,
                         "jumper": jumper.allocation / fair[jumper.key] if fair[jumper.key] else 1.0})
            await asyncio.sleep(max(0.0, start + (step + 1) * args.period - time.monotonic()))
    return rows


def periods_until(rows: list[dict], start: int, end: int, ok) -> int | None:
    """Settling time: periods from `start` until `ok` holds in that period and every later one before `end`."""
    window = rows[start:end]
    for i in range(len(window)):
        if all(ok(r) for r in window[i:]):
            return i
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--pods", type=int, default=10, help="pods per node")
    ap.add_argument("--period", type=float, default=0.5, help="report period (s); controller rounds every period/5")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--l3-per-l2", type=float, default=1.0,
                    help="the node's measured egress per byte the pod classes sent (1.0: both in IP bytes, as the "
                         "agent reports them; 0.955: the iptables node counter against HTB frames)")
    ap.add_argument("--host", type=float, default=1.5e6, help="unshaped host traffic per node (bit/s)")
    ap.add_argument("--older-agents", action="store_true",
                    help="report as agents before issue 37's same-window read did: no node_shaped_egress_bps, so "
                         "the controller's gain waits for a steady plant")
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="each period a pod wants its demand x U(1-j, 1+j); the fair share is judged on the demand")
    ap.add_argument("--keep", action="store_true", help="keep the controller's log (its path is printed)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pods = build_pods(args.nodes, args.pods, rng)

    import yaml

    workdir = Path(tempfile.mkdtemp(prefix="netagent-sim-"))
    policy = workdir / "policy.yaml"
    policy.write_text(yaml.safe_dump_all(policy_objects()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(workdir / "controller.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "controller", "--from-file", str(policy),
                             "--no-auth", "--insecure-http", "--listen", f"127.0.0.1:{port}", "--period", f"{args.period / 5:g}",
                             "--answer-wait", f"{args.period / 5 * 1.5:g}",
                             "--lease-seconds", f"{args.period * 10:g}", "--report-rate", f"{4 / args.period:g}",
                             # every simulated node posts from 127.0.0.1 over one pool of kept connections
                             "--max-connections-per-address", "1000"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base + "/healthz", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    print(f"controller did not start; log: {workdir / 'controller.log'}", file=sys.stderr)
                    return 1
                time.sleep(0.1)
        rows = asyncio.run(simulate(base, args, pods, rng))
    finally:
        stop_process(proc, 10)
        log.close()

    print(f"simulation: {args.nodes} nodes x {args.pods} pods against the real controller over HTTP; "
          f"budget {BUDGET_BPS / 1e6:.0f} Mbit/s; report period {args.period:g} s, rounds every {args.period / 5:g} s; "
          f"measured = {args.l3_per_l2:g} x pods' usage + {args.host / 1e6:g} Mbit/s host traffic per node; "
          f"jitter {args.jitter:.0%}")
    print(f"{'period':>6} {'event':>6} {'round':>5} {'pods within 5%':>15} {'worst rate error':>17} "
          f"{'worst alloc error':>18} "
          f"{'total/budget':>13} {'demand/budget':>14} {'gain':>6} {'10x pod/fair':>13} {'bursting pods':>14}")
    events = {SHIFT: "shift", JUMP: "10x", BURST: "burst"}
    for r in rows:
        print(f"{r['step']:6d} {events.get(r['step'], ''):>6} {r['generation']:5d} {r['within'] * 100:14.0f}% "
              f"{r['error'] * 100:16.1f}% "
              f"{r['alloc_error'] * 100:17.1f}% "
              f"{r['total']:13.3f} {r['demand']:14.2f} {r['gain']:6.3f} {r['jumper']:13.2f} "
              + (f"{r['burst_error'] * 100:13.1f}%" if r["burst_error"] is not None else ""))
    shift = periods_until(rows, SHIFT, JUMP, lambda r: r["error"] <= TOLERANCE)
    initial = periods_until(rows, 0, SHIFT, lambda r: r["error"] <= TOLERANCE)
    shift95 = periods_until(rows, SHIFT, JUMP, lambda r: r["within"] >= 0.95)
    initial95 = periods_until(rows, 0, SHIFT, lambda r: r["within"] >= 0.95)
    jump = periods_until(rows, JUMP, BURST, lambda r: r["jumper"] >= 1 - TOLERANCE)
    steady = [rows[i]["total"] for span in STEADY for i in span if i < len(rows)]
    worst_total = max(abs(x - 1) for x in steady)
    burst_totals = [r["total"] for r in rows[BURST:]]
    # a burst's first report: its answer governs the burst's second period. The first burst has no
    # earlier burst to remember, so it climbs by probing; the later ones should be served at once
    burst_starts = [r for r in rows[BURST + 4:] if r["bursting"] and r["step"] % 2 == 0]
    served = sum(r["burst_error"] <= TOLERANCE for r in burst_starts)

    def verdict(value, aim) -> str:
        return "not settled" if value is None else f"{value} periods (aim <= {aim}: {'met' if value <= aim else 'MISSED'})"

    # issue 37's aim for every change, a cold start included: two periods (the 10x pod's was 4 before it)
    print(f"from a cold start, every pod within {TOLERANCE:.0%} of fair:  {verdict(initial, 2)}")
    print(f"after the demand shift, every pod within {TOLERANCE:.0%} of fair:  {verdict(shift, 2)}")
    print(f"from a cold start, 95% of pods within {TOLERANCE:.0%} of fair:  {verdict(initial95, 2)}")
    print(f"after the demand shift, 95% of pods within {TOLERANCE:.0%} of fair: {verdict(shift95, 2)}")
    print(f"the 10x pod at {1 - TOLERANCE:.0%} of its fair share:            {verdict(jump, 2)}")
    print(f"measured total in steady periods: worst {worst_total:.1%} from the budget "
          f"(aim <= 5%: {'met' if worst_total <= 0.05 else 'MISSED'}); during bursts "
          f"{min(burst_totals):.3f}..{max(burst_totals):.3f} of the budget")
    print(f"bursting pods within {TOLERANCE:.0%} of fair from the first report of a burst (after the first burst): "
          f"{served} of {len(burst_starts)} bursts")
    if args.keep:
        print(f"controller log: {workdir / 'controller.log'}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
