"""Agent API throughput: reports/s with 110 pods each against the real HTTP server on one core.

    python3 bench/agent_api.py [--nodes 2000] [--seconds 10] [--connections 64] [--client wrk|aiohttp]

The server is the real thing in its own process pinned to one CPU: aiohttp app, token
check (TokenReview verdicts cached, as in steady state), node binding (every pod looked
up), the report store, and allocation rounds every --period over all nodes through the
real adapter and engine, in the same process as in production. The client (wrk by
default: `apt-get install wrk`; or an aiohttp client) runs on the other CPU and cycles
through the nodes, so each node reports about once per nodes/rate seconds and the
per-node rate limit is never hit.

Printed: reports/s, p50/p99 latency, non-200 answers, allocation rounds/s and API-server
calls made during the run (O(1): rounds follow the period, not the reports), and the
baseline: decode+validate of the same report with msgspec vs the stdlib json plus
hand-written checks, with their ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timing import process_cpu_seconds  # noqa: E402

PODS_PER_NODE = 110
CLASSES = [{"kind": "EgressClass", "metadata": {"name": "bulk"}, "spec": {"weight": 1, "max": "1G"}},
           {"kind": "EgressClass", "metadata": {"name": "interactive"}, "spec": {"weight": 4, "min": "1M"}}]
BUDGET = {"kind": "EgressBudget", "metadata": {"name": "default"}, "spec": {
    "total": "100G", "teams": [{"name": f"team-{i}", "namespaces": [f"ns-{i}"], "weight": 1 + i % 3}
                               for i in range(50)]}}


def node_name(i: int) -> str:
    return f"node-{i:05d}"


def node_pods(i: int) -> list[dict]:
    return [{"namespace": f"ns-{(i + j) % 50}", "name": f"pod-{i:05d}-{j:03d}",
             "usage_bps": 1e6 * (j % 7), "demand_bps": 2e6 * (1 + j % 5), "throttled": j % 3 == 0,
             "egress_class": "interactive" if j % 4 == 0 else "bulk", "egress_bandwidth": None}
            for j in range(PODS_PER_NODE)]


def report_body(i: int) -> bytes:
    return json.dumps({"node": node_name(i), "pods": node_pods(i), "seq": 1, "period_seconds": 5.0,
                       "node_internet_egress_bps": 1e7}).encode()


# -- the server process ---------------------------------------------------------------------------

def serve(port: int, nodes: int, period: float, cpu: int, ready, stats_pipe) -> None:
    os.sched_setaffinity(0, {cpu})
    import logging

    from aiohttp import web

    from controller.allocator import Allocator
    from controller.api import APIStats, make_app
    from controller.auth import NODE_CLAIM, TokenAuthenticator
    from controller.app import configure_gc
    from core.policy import load_policy
    from controller.state import ControllerState

    logging.basicConfig(level=logging.WARNING)
    configure_gc()  # as `netagent controller` does
    policy = load_policy(CLASSES, [BUDGET])
    where = {(p["namespace"], p["name"]): node_name(i) for i in range(nodes) for p in node_pods(i)}
    counts = {"reports": 0, "rejected": {}, "reviews": 0, "rounds": 0, "round_s": []}

    def review(token: str) -> dict:  # the API server's answer for a node-bound agent token
        counts["reviews"] += 1
        return {"authenticated": True, "user": {"username": "system:serviceaccount:netagent:agent",
                                                "extra": {NODE_CLAIM: [token.removeprefix("token-")]}}}

    state = ControllerState(Allocator(lambda: policy), locate_pods=lambda keys: [where.get(k) for k in keys],
                            report_ttl=3600)

    def on_round(result):
        counts["rounds"] += 1
        counts["round_s"].append(result.duration_s)

    state.on_round = on_round

    def rejected(reason: str) -> None:
        counts["rejected"][reason] = counts["rejected"].get(reason, 0) + 1

    app = make_app(state, TokenAuthenticator(review, ttl=3600),
                   APIStats(count_report=lambda: counts.__setitem__("reports", counts["reports"] + 1),
                            count_rejected=rejected))

    async def stats(request):
        return web.json_response({**counts, "nodes_stored": len(state.latest)})

    async def reset(request):
        counts.update(reports=0, rejected={}, rounds=0, round_s=[])
        return web.json_response({})

    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/reset", reset)
    state.start(period)
    web.run_app(app, host="127.0.0.1", port=port, print=lambda *a: ready.set(), access_log=None, backlog=2048)


# -- clients ----------------------------------------------------------------------------------------

WRK_LUA = r"""
local nodes = %(nodes)d
local pods = %(pods)d
local bodies, paths, headers = {}, {}, {}
local counter = 0
local function body(i)
  local name = string.format("node-%%05d", i)
  local parts = {}
  for j = 0, pods - 1 do
    local cls = (j %% 4 == 0) and "interactive" or "bulk"
    parts[#parts + 1] = string.format(
      '{"namespace":"ns-%%d","name":"pod-%%05d-%%03d","usage_bps":%%d,"demand_bps":%%d,"throttled":%%s,"egress_class":"%%s","egress_bandwidth":null}',
      (i + j) %% 50, i, j, 1000000 * (j %% 7), 2000000 * (1 + j %% 5), (j %% 3 == 0) and "true" or "false", cls)
  end
  return name, '{"node":"' .. name .. '","pods":[' .. table.concat(parts, ",") .. '],"seq":1,"period_seconds":5.0,"node_internet_egress_bps":1e7}'
end
-- every body is built in init, which wrk runs before its clock starts
function init(args)
  for i = 0, nodes - 1 do
    local name, b = body(i)
    bodies[i] = b
    paths[i] = "/v1/nodes/" .. name .. "/report"
    headers[i] = {["Content-Type"] = "application/json", ["Authorization"] = "Bearer token-" .. name}
  end
end
request = function()
  local i = counter %% nodes
  counter = counter + 1
  return wrk.format("POST", paths[i], headers[i], bodies[i])
end
"""


def run_wrk(base: str, nodes: int, seconds: float, connections: int, cpu: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA % {"nodes": nodes, "pods": PODS_PER_NODE})
        script = f.name
    try:
        out = subprocess.run(["taskset", "-c", str(cpu), "wrk", "-t", "1", "-c", str(connections),
                              "-d", f"{seconds:g}s", "--latency", "-s", script, base],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script)

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        value, unit = float(m.group(1)), m.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"requests": total, "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": ms("50"), "p99_ms": ms("99"), "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": errors.group(1) if errors else "none"}


def run_aiohttp(base: str, nodes: int, seconds: float, connections: int, cpu: int) -> dict:
    os.sched_setaffinity(0, {cpu})
    import aiohttp

    bodies = [report_body(i) for i in range(nodes)]

    async def main():
        latencies, bad, counter = [], 0, 0
        deadline = time.perf_counter() + seconds
        conn = aiohttp.TCPConnector(limit=connections)
        async with aiohttp.ClientSession(connector=conn) as session:
            async def worker():
                nonlocal bad, counter
                while time.perf_counter() < deadline:
                    i = counter % nodes
                    counter += 1
                    t0 = time.perf_counter()
                    async with session.post(f"{base}/v1/nodes/{node_name(i)}/report", data=bodies[i], headers={
                            "Content-Type": "application/json", "Authorization": f"Bearer token-{node_name(i)}"}) as r:
                        await r.read()
                        bad += r.status != 200
                    latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(connections)))
            elapsed = time.perf_counter() - t0
        latencies.sort()
        return {"requests": len(latencies), "rps": len(latencies) / elapsed,
                "p50_ms": latencies[len(latencies) // 2] * 1000,
                "p99_ms": latencies[min(len(latencies) - 1, math.ceil(len(latencies) * 0.99) - 1)] * 1000,
                "non_2xx": bad, "socket_errors": "none"}

    return asyncio.run(main())


# -- the decode+validate baseline ----------------------------------------------------------------

NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def stdlib_decode_validate(body: bytes) -> dict:
    """What the API would do without msgspec: json.loads and the same checks by hand."""
    obj = json.loads(body)
    if not isinstance(obj, dict) or set(obj) - {"node", "pods", "seq", "period_seconds", "node_internet_egress_bps"}:
        raise ValueError("bad report")
    node, pods = obj["node"], obj["pods"]
    if not isinstance(node, str) or len(node) > 253 or not NAME.match(node):
        raise ValueError("node")
    if not isinstance(pods, list) or len(pods) > 1024:
        raise ValueError("pods")
    allowed = {"namespace", "name", "usage_bps", "demand_bps", "throttled", "egress_class", "egress_bandwidth"}
    out = []
    for p in pods:
        if not isinstance(p, dict) or set(p) - allowed:
            raise ValueError("pod")
        for k in ("namespace", "name"):
            v = p[k]
            if not isinstance(v, str) or not 0 < len(v) <= 253 or not NAME.match(v):
                raise ValueError(k)
        for k in ("usage_bps", "demand_bps"):
            v = p[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 2.0**64:
                raise ValueError(k)
        if not isinstance(p.get("throttled", False), bool):
            raise ValueError("throttled")
        for k in ("egress_class", "egress_bandwidth"):
            v = p.get(k)
            if v is not None and (not isinstance(v, str) or len(v) > 1024):
                raise ValueError(k)
        out.append(p)
    seq = obj.get("seq", 0)
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError("seq")
    return obj


def baseline(n: int = 500, repeats: int = 5) -> tuple[float, float]:
    """Per-report seconds of each decoder, the best of `repeats` runs (the least disturbed by
    other work on a shared machine)."""
    from core.wire import invalid_name, report_decoder

    def msgspec_decode_validate(body: bytes):
        report = report_decoder.decode(body)
        if invalid_name(report):
            raise ValueError("name")
        return report

    body = report_body(7)
    for fn in (msgspec_decode_validate, stdlib_decode_validate):
        fn(body)
    def best(fn) -> float:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                fn(body)
            runs.append((time.perf_counter() - t0) / n)
        return min(runs)

    return best(msgspec_decode_validate), best(stdlib_decode_validate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--period", type=float, default=5.0, help="allocation round period of the server")
    ap.add_argument("--client", choices=("wrk", "aiohttp"), default="wrk" if shutil.which("wrk") else "aiohttp")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = cpus[0], cpus[-1]

    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=serve, args=(port, args.nodes, args.period, server_cpu, ready, None), daemon=True)
    server.start()
    base = f"http://127.0.0.1:{port}"
    try:
        if not ready.wait(120):
            print("server did not start", file=sys.stderr)
            return 1
        import urllib.request

        def call(method: str, path: str) -> dict:
            req = urllib.request.Request(base + path, method=method, data=b"" if method == "POST" else None)
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())

        client = run_wrk if args.client == "wrk" else run_aiohttp
        # warm-up: every node reports once (TokenReview verdicts cached, node entries stored)
        client(base, args.nodes, max(2.0, args.nodes / 1500), args.connections, client_cpu)
        time.sleep(1.0)  # let per-node rate-limit buckets refill
        call("POST", "/bench/reset")
        cpu_before = process_cpu_seconds(server.pid)
        result = client(base, args.nodes, args.seconds, args.connections, client_cpu)
        server_cpu_s = process_cpu_seconds(server.pid) - cpu_before
        stats = call("GET", "/bench/stats")
    finally:
        server.terminate()
        server.join(5)

    fast, slow = baseline()
    rounds_s = stats["round_s"]
    print(f"agent API, {PODS_PER_NODE} pods per report, {args.nodes} nodes, server on CPU {server_cpu}, "
          f"client {args.client} ({args.connections} connections) on CPU {client_cpu}, {args.seconds:g} s")
    answered = stats["reports"] / args.seconds
    print(f"  reports/s             {answered:10.0f}   (answered with allocations; aim >= 2,000; "
          f"requests/s incl. refusals {result['rps']:.0f})")
    if stats["rejected"].get("RateLimited"):
        print(f"  note: {stats['rejected']['RateLimited']} reports over the per-node rate (2/s): use more --nodes")
    print(f"  latency p50 / p99     {result['p50_ms']:7.2f} ms / {result['p99_ms']:.2f} ms")
    print(f"  server CPU            {server_cpu_s:10.2f} s  -> {stats['reports'] / max(server_cpu_s, 1e-9):.0f} reports "
          f"per CPU-second (what one whole core would answer; load average now {os.getloadavg()[0]:.1f})")
    print(f"  answered 200          {stats['reports']:10d}   non-200: {result['non_2xx']} {stats['rejected'] or ''}"
          f"  socket errors: {result['socket_errors']}")
    print(f"  allocation rounds     {stats['rounds']:10d}   ({stats['rounds'] / args.seconds:.2f}/s at period "
          f"{args.period:g} s; {args.nodes * PODS_PER_NODE} pods; round "
          f"{(sum(rounds_s) / len(rounds_s) * 1000 if rounds_s else float('nan')):.0f} ms mean)")
    print(f"  API-server calls      {stats['reviews']:10d}   TokenReviews in the whole run incl. warm-up "
          f"(one per node, then cached); 0 per report; status writes <= 1 per --status-interval")
    print(f"decode+validate of one {PODS_PER_NODE}-pod report ({len(report_body(7))} bytes):")
    print(f"  msgspec + name check  {fast * 1e6:8.1f} us")
    print(f"  stdlib json + checks  {slow * 1e6:8.1f} us   ratio {slow / fast:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
