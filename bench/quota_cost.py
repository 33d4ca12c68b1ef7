"""The controller's CPU per report with volume quotas on every team against quotas off, same process, same
reports (docs/quotas.md "Overhead"): Allocator.prepare (what each report costs at submit time, where the
ledger is fed) on 110-pod reports from `nodes` nodes, each report's counters grown since the last, and one
allocation round over all of them (where the exhausted teams are capped).

    python3 -m bench.quota_cost [--nodes 1000] [--reports 4]

Prints microseconds of CPU per report (prepare; a node's first report apart, where each pod's first
counter is a baseline) and milliseconds per round, quotas off and on. This is the
controller's code alone in one process, not bench/scale.py's 10,000-node run with real HTTP (not measured).
"""
from __future__ import annotations

import argparse
import time

from controller.allocator import Allocator
from controller.quota import QuotaKeeper
from core.policy import load_policy
from core.wire import NodeReport, PodReport

TEAMS = 20
PODS = 110


def _policy(quotas: bool):
    teams = [{"name": f"t{i}", "namespaces": [f"ns{i}"],
              **({"quota": {"period": "Month", "bytes": "50Ti", "exhaustedRate": "100M",
                            "ingress": {"bytes": "200Ti"}}} if quotas else {})} for i in range(TEAMS)]
    policy, problems = load_policy([], [{"metadata": {"name": "main"},
                                         "spec": {"total": "100G", "ingressTotal": "100G", "teams": teams}}])
    assert not problems, problems
    return policy


def _reports(nodes: int, step: int, counters: bool) -> list[NodeReport]:
    out = []
    for n in range(nodes):
        pods = [PodReport(f"ns{(n + i) % TEAMS}", f"p{n}-{i}", 1e6, 2e6, ingress_usage_bps=1e6,
                          ingress_demand_bps=2e6,
                          **({"bytes_total": step * 10**6 + i, "ingress_bytes_total": step * 10**7 + i,
                              "uid": f"u{n}-{i}"} if counters else {}))
                for i in range(PODS)]
        out.append(NodeReport(f"node-{n}", pods, seq=step, epoch="boot" if counters else None, shapes_ingress=True))
    return out


def run(nodes: int, reports: int, quotas: bool) -> tuple[float, float, float]:
    policy = _policy(quotas)
    keeper = None
    if quotas:
        keeper = QuotaKeeper()
        keeper.set_policy(policy)
        keeper.resume(None)
    alloc = Allocator(lambda: (policy, []), quota=keeper)
    batches = [_reports(nodes, step, quotas) for step in range(reports)]
    prepared = {}
    cpu = []
    for batch in batches:
        t = time.process_time()
        for r in batch:
            prepared[r.node] = alloc.prepare(r)
        cpu.append(time.process_time() - t)
    t = time.process_time()
    alloc(prepared)
    # the first report of each node (a pod's first counter: a baseline) apart from the steady state
    return cpu[0] / nodes * 1e6, sum(cpu[1:]) / (nodes * (reports - 1)) * 1e6, (time.process_time() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--reports", type=int, default=4)
    args = ap.parse_args()
    for quotas in (False, True, False, True):
        first, steady, round_ms = run(args.nodes, args.reports, quotas)
        print(f"quotas {'on ' if quotas else 'off'}: CPU per {PODS}-pod report (prepare) {steady:7.1f} us "
              f"(a node's first: {first:7.1f} us), round over {args.nodes} nodes {round_ms:7.1f} ms")


if __name__ == "__main__":
    main()
