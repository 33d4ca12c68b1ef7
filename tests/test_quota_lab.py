"""Issue 38's lab Show with real traffic: two nodes, one controller (`netagent controller --from-file`), real
agents, iperf3 to the lab's internet host. Team research (one pod on node0) has a 20 MB daily upload quota and an
8M exhaustedRate; team web (one pod on node1) has none; the budget is 40M. Root; under the traffic lock.

- the team's use as the leader counts it equals the bytes iperf3 moved, as IP segments, within 1 % (of the range
  between its receiver's count and its sender's);
- after exhaustion the team's measured upload holds at its exhaustedRate within 5 % and web takes the rest;
- the overshoot past the quota (sent before the cap took hold) is within report period + round + answer wait
  at the team's rate before the cap (docs/quotas.md)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from lab.agentproc import pod_object, server_intervals, wait_for, write_objects
from lab.netns import require_root
from lab.nsexec import NetnsWorker, http_get
from lab.topology import INTERNAL_CIDRS, INTERNET_V4, UPLINK, Lab

pytestmark = [pytest.mark.root, pytest.mark.traffic]

M = 1_000_000
QUOTA = 20 * M  # bytes
EXHAUSTED = 8 * M
PORTS = (5321, 5322)
CONTROLLER = "10.0.0.1:9563"
MTU = 1500
REPORT, ROUND, ANSWER_WAIT = 1.0, 1.0, 1.5
POLICY = [
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressClass", "metadata": {"name": "std"},
     "spec": {"weight": 1, "max": "400M"}},
    {"apiVersion": "netagent.io/v1alpha1", "kind": "EgressBudget", "metadata": {"name": "default"},
     "spec": {"total": "40M", "teams": [
         {"name": "research", "namespaces": ["research"], "defaultClass": "std",
          "quota": {"period": "Day", "bytes": "20M", "exhaustedRate": "8M"}},
         {"name": "web", "namespaces": ["web"], "defaultClass": "std"}]}},
]


def ip_bytes(result: dict, end: str = "sum_received") -> int:
    """What an iperf3 upload moved as IP segments of at most the MTU (payload + headers per MSS), by its receiver's
    count (`sum_received`: it stops counting at its timer, before the sender's last bytes arrive) or its sender's
    (`sum_sent`: it includes what was still in its socket when the test ended and was never sent)."""
    payload = int(result["end"][end]["bytes"])
    mss = result["start"]["tcp_mss_default"]
    return payload + math.ceil(payload / mss) * (MTU - mss)


def test_use_equals_what_iperf3_moved_and_the_exhausted_team_holds_at_its_rate(tmp_path):
    require_root()
    with Lab(nodes=2, pods_per_node=1) as lab:
        for port in PORTS:
            lab.iperf_server(lab.internet, port)
        (research_node, research), (web_node, web) = ((n, n.pods[0]) for n in lab.nodes)
        write_objects(tmp_path / "policy.yaml", POLICY)
        write_objects(tmp_path / "pods.yaml", [pod_object(research, research_node, namespace="research"),
                                               pod_object(web, web_node, namespace="web")])
        netagent = [sys.executable, "-m", "netagent"]
        log = open(tmp_path / "controller.log", "w")
        lab.spawn(lab.fabric, [*netagent, "controller", "--from-file", str(tmp_path / "policy.yaml"), "--no-auth",
                               "--insecure-http", "--listen", CONTROLLER, "--period", str(ROUND),
                               "--answer-wait", str(ANSWER_WAIT)], stdout=log, stderr=subprocess.STDOUT)
        for node in lab.nodes:
            lab.spawn(node.netns, [*netagent, "run", "--node", node.name, "--from-file", str(tmp_path),
                                   "--controller", f"http://{CONTROLLER}", "--controller-insecure-http",
                                   "--uplink", UPLINK, *[a for c in INTERNAL_CIDRS for a in ("--internal-cidr", c)],
                                   "--report-period", str(REPORT), "--token-path", ""],
                      stdout=open(tmp_path / f"agent-{node.name}.log", "w"), stderr=subprocess.STDOUT)
        fabric = NetnsWorker(lab.fabric)
        try:
            def status() -> dict:
                try:
                    code, body = fabric.call(http_get, f"http://{CONTROLLER}/v1/status", 2)
                except OSError:
                    return {}
                return json.loads(body) if code == 200 else {}

            def used() -> int | None:
                q = next((q for q in status().get("quota") or [] if q["team"] == "research"), None)
                return None if q is None else q["uploads"]["used"]

            wait_for(lambda: len(status().get("nodes") or {}) == 2, timeout=60, what="both agents reporting")
            time.sleep(3 * REPORT)  # the pods' first counters are the ledger's baselines
            assert used() == 0
            # 1. the use against what iperf3 moved (no quota reached: 2 s at 40M at most is 10 MB)
            first = lab.iperf(research.netns, INTERNET_V4, PORTS[0], seconds=2)
            moved, written = ip_bytes(first), ip_bytes(first, "sum_sent")
            # counted once the pod's next report after the run is in (a report period and a round)
            time.sleep(3 * REPORT + ROUND)
            counted = used()
            # what crossed the uplink lies between the two counts (a fresh-clone CI run read 1.6 % above the
            # receiver's: the bytes after its timer); within 1 % of that range
            assert 0.99 * moved <= counted <= 1.01 * written, (counted, moved, written)
            # 2. both teams send: research spends its quota, is held at 8M, web takes the rest
            web_run = lab.iperf_async(web.netns, INTERNET_V4, PORTS[1], seconds=18, extra=["--get-server-output"])
            research_run = lab.iperf(research.netns, INTERNET_V4, PORTS[0], seconds=16,
                                     extra=["--get-server-output"])
            web_result = json.loads(web_run.communicate(timeout=60)[0])
            intervals = server_intervals(research_run)
            # 3. the overshoot: what research sent past the quota before its rate fell to the cap
            total, cap_at, before_rate = counted, None, 0.0
            for start, end, bps in intervals:
                if total >= QUOTA and bps <= 1.2 * EXHAUSTED:
                    cap_at = start
                    break
                before_rate = max(before_rate, bps) if total < QUOTA else before_rate
                total += bps * (end - start) / 8 * MTU / (MTU - 52)  # payload to IP segments
            assert cap_at is not None, intervals
            # 2. held from 11 s on (the quota, 12-15 MB left after step 1 at ~20M, is spent by about 7 s and capped
            # by about 10 s), or from two seconds after a later cap (a loaded box caps later; the first second
            # after the cap may still carry the queue's tail), to the run's 16 s (not iperf3's short last interval)
            tail = [bps for start, end, bps in intervals if max(11, cap_at + 2) <= start < 16]
            assert len(tail) >= 3, ("capped too late to judge the held rate", cap_at, intervals)
            held = sum(tail) / len(tail) * MTU / (MTU - 52)  # iperf3's payload rate as IP segments, as the cap is
            assert abs(held - EXHAUSTED) <= 0.05 * EXHAUSTED, (held, intervals)
            web_tail = [bps for start, end, bps in server_intervals(web_result) if max(11, cap_at + 2) <= start < 16]
            assert sum(web_tail) / len(web_tail) * MTU / (MTU - 52) > 0.9 * (40 * M - EXHAUSTED), web_tail
            overshoot = total - QUOTA
            bound = 20 * M / 8 * (REPORT + ROUND + ANSWER_WAIT + 1)  # + one 1 s interval of iperf3's resolution
            print(f"use {counted} vs iperf3 {moved}-{written}; held at {held / M:.2f}M; overshoot {overshoot / M:.2f} MB "
                  f"(bound {bound / M:.2f} MB)")
            assert overshoot <= bound, (overshoot, bound, intervals)
        finally:
            fabric.close()
            print((tmp_path / "controller.log").read_text()[-3000:])
