"""The controller's CPU per report with NetworkScopes prices known (controller/cost.py counting every team's
bytes per priced scope) against without, same process, same reports (docs/scopes.md "Cost in the
controller"): Allocator.prepare on 110-pod reports carrying internet and per-scope counters, from `nodes`
nodes, each report's counters grown since the last (a node's first report, the baselines, apart).

    python3 -m bench.cost_observe [--nodes 200] [--reports 4] [--repeat 2]

Prints microseconds of CPU per report, prices off and on (the two alternated `repeat` times, the least of
each: a shared machine's noise only adds), and on/off, the ratio against the no-prices baseline of the same run. The controller's code alone in one process,
not bench/scale.py's run with real HTTP."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from controller.allocator import Allocator
from controller.cost import CostKeeper
from core.policy import load_policy
from core.wire import NodeReport, PodReport

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parent.parent / "docs/examples/networkscopes-aws.yaml").read_text())

TEAMS = 20
PODS = 110


def _report(node: int, n: int) -> NodeReport:
    pods = [PodReport(f"ns{i % TEAMS}", f"p{node}-{i}", 1e6, 1e6, uid=f"u{node}-{i}", bytes_total=n * i,
                      ingress_bytes_total=n * i, scope_bytes_total={"cross-zone": n * i, "cross-region": n},
                      ingress_scope_bytes_total={"cross-zone": n * i}) for i in range(PODS)]
    return NodeReport(f"n{node}", pods, epoch="boot-1")


def measure(nodes: int, reports: int, prices: bool) -> float:
    teams = [{"name": f"t{i}", "namespaces": [f"ns{i}"]} for i in range(TEAMS)]
    policy, _ = load_policy([], [{"metadata": {"name": "main"}, "spec": {"total": "10G", "teams": teams}}])
    keeper = CostKeeper()
    if prices:
        keeper.set_scopes(EXAMPLE)
    alloc = Allocator(lambda: (policy, []), cost=keeper)
    for node in range(nodes):  # baselines
        alloc.prepare(_report(node, 1))
    batches = [[_report(node, r + 2) for node in range(nodes)] for r in range(reports)]
    start = time.process_time()
    for batch in batches:
        for report in batch:
            alloc.prepare(report)
    return (time.process_time() - start) / (nodes * reports) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--reports", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeat):
        for p in (False, True):
            runs[p].append(measure(args.nodes, args.reports, p))
    off, on = min(runs[False]), min(runs[True])
    print(f"{'prices':<8}{'us CPU per 110-pod report (prepare)':>38}")
    print(f"{'off':<8}{off:>38.0f}")
    print(f"{'on':<8}{on:>38.0f}")
    print(f"{'on/off':<8}{on / off:>38.2f}")


if __name__ == "__main__":
    main()
