"""A tenant's junk tokens cannot lock real agents out (issue 33 item 1), against the real parts: a
real `netagent controller` process, the real kube-apiserver of tests/kube.py (its TokenReview,
its pods), real projected tokens from TokenRequest for agent pods that exist.

100 tenant addresses (127.0.0.2-101, a process of their own) post well-formed junk tokens: the
agent's ServiceAccount and audience, `kubernetes.io` claims naming an agent pod's name and node
with a guessed uid, forged signatures. Meanwhile ten agents (127.0.1.1-10, one pod on each of
ten nodes) report every second with --token-cache-seconds 2, so most of their reports need a
fresh TokenReview, as agents whose cached verdicts expire during a flood do. Every agent report
must be answered 200 within the agent's own timeout (Reporter's 3 s; an answer later than that
is a lost report), so none goes past its lease.

`bench/auth_flood.py` runs this test and prints its figures (reviews made, refusals by reason,
the agents' p99 answer), and with --baseline REV the same against an older tree's controller
(NETAGENT_AUTHFLOOD_TREE), where it fails: the shared review queue fills with junk.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from lab.procs import stop_process
from tests.test_controller_kube import AUDIENCE, REPO, budget, crds, workload  # noqa: F401
from tests.test_controller_service import free_port, wait_for

AGENTS = 10
TENANTS = 100
SECONDS = 20.0
AGENT_PERIOD = 1.0
AGENT_TIMEOUT_S = 3.0  # netagent.reporter.Reporter's default timeout


@pytest.fixture
def agent_pods(kube_api, kube_namespace):
    """Ten nodes, an agent pod (ServiceAccount `agent`) and a workload pod on each."""
    core = client.CoreV1Api(kube_api.admin)
    suffix = uuid.uuid4().hex[:6]
    nodes = [f"flood-{i}-{suffix}" for i in range(AGENTS)]
    core.create_namespaced_service_account(kube_namespace, client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name="agent")))
    try:
        for i, node in enumerate(nodes):
            core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=node)))
            for name, sa in ((f"agent-{i}", "agent"), (f"work-{i}", "default")):
                core.create_namespaced_pod(kube_namespace, {
                    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                    "spec": {"nodeName": node, "serviceAccountName": sa,
                             "containers": [{"name": "c", "image": "x.invalid/p:1"}]}})
        yield kube_namespace, nodes
    finally:
        for node in nodes:
            with contextlib.suppress(ApiException):
                core.delete_node(node)


def junk_token(namespace: str, node: str, pod: str, n: int) -> str:
    def part(obj) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims = {"iss": "https://kubernetes.default.svc", "sub": f"system:serviceaccount:{namespace}:agent",
              "aud": [AUDIENCE], "exp": int(time.time()) + 3600, "iat": int(time.time()),
              "kubernetes.io": {"namespace": namespace, "pod": {"name": pod, "uid": str(uuid.uuid4())},
                                "node": {"name": node, "uid": str(uuid.uuid4())},
                                "serviceaccount": {"name": "agent", "uid": str(uuid.uuid4())}}}
    return f"{part({'alg': 'RS256', 'kid': 'x'})}.{part(claims)}.{part({'forged': n})}"


def _flood(base: str, namespace: str, nodes: list[str], stop, sent) -> None:
    """The tenants, in their own process: each address posts junk, one request after another,
    four connections at once (the old gate's per-address bound of pending reviews)."""
    import aiohttp

    async def tenant(i: int):
        connector = aiohttp.TCPConnector(local_addr=(f"127.0.0.{i + 2}", 0), limit=4)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as s:
            async def one_connection(c: int):
                n = 0
                while not stop.is_set():
                    k = (i + n) % len(nodes)
                    token = junk_token(namespace, nodes[k], f"agent-{k}", n)
                    with contextlib.suppress(Exception):
                        async with s.post(f"{base}/v1/nodes/{nodes[k]}/report", data=b"{}",
                                          headers={"Authorization": f"Bearer {token}"}) as r:
                            await r.read()
                    n += 1
                    with sent.get_lock():
                        sent.value += 1
            await asyncio.gather(*(one_connection(c) for c in range(4)))

    async def run():
        await asyncio.gather(*(tenant(i) for i in range(TENANTS)))

    asyncio.run(run())


async def _agents(base: str, namespace: str, nodes: list[str], tokens: list[str], seconds: float):
    """Ten agents, each from its own address, reporting every AGENT_PERIOD; (node, code, latency)."""
    import aiohttp

    results: list[tuple[str, int, float]] = []

    async def agent(i: int):
        connector = aiohttp.TCPConnector(local_addr=(f"127.0.1.{i + 1}", 0))
        async with aiohttp.ClientSession(connector=connector) as s:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.monotonic()
                body = json.dumps({"node": nodes[i], "pods": [workload(namespace, f"work-{i}")],
                                   "node_internet_egress_bps": 1e6}).encode()
                try:
                    async with s.post(f"{base}/v1/nodes/{nodes[i]}/report", data=body,
                                      headers={"Authorization": f"Bearer {tokens[i]}",
                                               "Content-Type": "application/json"},
                                      timeout=aiohttp.ClientTimeout(total=AGENT_TIMEOUT_S)) as r:
                        await r.read()
                        code = r.status
                except (asyncio.TimeoutError, aiohttp.ClientError):
                    code = 0  # no answer within the agent's timeout: a lost report
                results.append((nodes[i], code, time.monotonic() - t0))
                await asyncio.sleep(max(0.0, AGENT_PERIOD - (time.monotonic() - t0)))

    await asyncio.gather(*(agent(i) for i in range(len(nodes))))
    return results


@contextlib.contextmanager
def controller_process(kube_api, tmp_path: Path, namespace: str, tree: Path):
    """`netagent controller` from `tree` (this repository, or an older one's export: the bench's baseline)."""
    port = free_port()
    log_path = tmp_path / "controller.log"
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "netagent", "controller", "--kubeconfig", str(kube_api.kubeconfig),
         "--listen", f"127.0.0.1:{port}", "--advertise", f"127.0.0.1:{port}", "--identity", f"flood@127.0.0.1:{port}",
         "--namespace", namespace, "--lease-name", "netagent-controller-flood", "--period", "0.5",
         "--report-rate", "100", "--election-lease-seconds", "3", "--insecure-http",
         "--agent-service-account", f"{namespace}:agent", "--token-cache-seconds", "2"],
        cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def leading():
            if proc.poll() is not None:
                raise AssertionError(f"controller exited {proc.returncode}:\n{log_path.read_text()}")
            with contextlib.suppress(OSError):
                if "netagent_controller_is_leader 1.0" in metrics_text(base):
                    with urllib.request.urlopen(base + "/readyz", timeout=5) as r:
                        return r.status == 200
            return False

        wait_for(leading, timeout=60, what="the controller to lead with its caches synced")
        yield base
    finally:
        stop_process(proc, 15)
        log.close()


def metrics_text(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        return r.read().decode()


def counters(text: str, name: str) -> Counter:
    """{reason label or '': value} of one counter family in Prometheus text."""
    out: Counter = Counter()
    for m in re.finditer(rf'^netagent_controller_{name}_total(?:{{reason="([^"]*)"}})? ([0-9.e+]+)$', text, re.M):
        out[m.group(1) or ""] += float(m.group(2))
    return out


def record(**row) -> None:
    path = os.environ.get("NETAGENT_AUTHFLOOD_OUT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def test_junk_from_a_hundred_tenant_addresses_never_locks_out_ten_agents(kube_api, budget, agent_pods, tmp_path):
    namespace, nodes = agent_pods
    tree = Path(os.environ.get("NETAGENT_AUTHFLOOD_TREE") or REPO)
    tokens = [kube_api.token_for_pod(namespace, "agent", f"agent-{i}", audiences=[AUDIENCE]) for i in range(AGENTS)]
    with controller_process(kube_api, tmp_path, namespace, tree) as base:
        before = metrics_text(base)
        ctx = multiprocessing.get_context("spawn")
        stop, sent = ctx.Event(), ctx.Value("q", 0)
        flooder = ctx.Process(target=_flood, args=(base, namespace, nodes, stop, sent), daemon=True)
        flooder.start()
        try:
            wait_for(lambda: sent.value >= 500, timeout=60, what="the flood to be under way")
            t0, sent0 = time.monotonic(), sent.value
            results = asyncio.run(_agents(base, namespace, nodes, tokens, SECONDS))
            rate = (sent.value - sent0) / (time.monotonic() - t0)
        finally:
            stop.set()
            flooder.join(30)
            if flooder.is_alive():
                flooder.kill()
        after = metrics_text(base)
    reviews = counters(after, "token_reviews")[""] - counters(before, "token_reviews")[""]
    refusals = counters(after, "rejected_reports") - counters(before, "rejected_reports")
    codes = Counter(code for _, code, _ in results)
    answered = sorted(latency for _, code, latency in results if code == 200)
    p99 = answered[min(len(answered) - 1, int(0.99 * len(answered)))] if answered else float("nan")
    record(tree=str(tree), junk_per_second=round(rate), agent_reports=len(results), agent_codes=dict(codes),
           reviews=reviews, refusals={k: v for k, v in refusals.items() if v}, agent_p99_s=round(p99, 3),
           agent_worst_s=round(max(answered), 3) if answered else None)
    assert len(results) >= AGENTS * 5 and rate > 0  # the agents reported throughout, under the flood
    # every real report answered within the agent's timeout: none is lost, so none goes past its lease
    assert codes == {200: len(results)}, f"agents' answers {dict(codes)} (0: no answer within {AGENT_TIMEOUT_S} s)"
    assert refusals["UnknownAgentPod"] > 0 and refusals["ReviewsBusy"] == 0, dict(refusals)
    assert reviews <= len(results)  # the agents' own reviews only: junk costs the API server none


def test_bad_tokens_naming_agent_pods_are_refused_by_reason(kube_api, budget, agent_pods, tmp_path):
    """A token naming a pod that does not exist (deleted), an agent pod on another node than the
    claimed one, an agent pod that is terminating: each refused (403) with its reason, counted in
    netagent_controller_rejected_reports_total, and the other agent still answered."""
    namespace, nodes = agent_pods
    core = client.CoreV1Api(kube_api.admin)
    token = {i: kube_api.token_for_pod(namespace, "agent", f"agent-{i}", audiences=[AUDIENCE]) for i in (0, 1, 2, 3)}
    claims1 = json.loads(base64.urlsafe_b64decode(token[1].split(".")[1] + "=="))
    claims1["kubernetes.io"]["node"]["name"] = nodes[0]  # agent-1's real uid, but node 0 claimed

    def forged(claims: dict) -> str:
        head, _, sig = token[1].split(".")
        return ".".join((head, base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode(), sig))

    with controller_process(kube_api, tmp_path, namespace, REPO) as base:
        # deleted: its (real, bound) token names a pod that no longer exists
        core.delete_namespaced_pod("agent-2", namespace, grace_period_seconds=0)
        # terminating: a finalizer holds it after its deletion (no kubelet here to finish it)
        core.patch_namespaced_pod("agent-3", namespace, {"metadata": {"finalizers": ["netagent.io/test-hold"]}})
        core.delete_namespaced_pod("agent-3", namespace)
        try:
            def post(node: str, tok: str) -> tuple[int, str]:
                import urllib.error
                req = urllib.request.Request(f"{base}/v1/nodes/{node}/report", method="POST", data=json.dumps(
                    {"node": node, "pods": [], "node_internet_egress_bps": 1e6}).encode(),
                    headers={"Authorization": f"Bearer {tok}", "Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        return r.status, ""
                except urllib.error.HTTPError as exc:
                    return exc.code, json.loads(exc.read() or b"{}").get("reason", "")

            def seen(reason_of):
                return lambda: post(*reason_of[0])[1] == reason_of[1]
            # the watch follows the deletions within moments; wait for it rather than guess a time
            wait_for(seen(((nodes[2], token[2]), "UnknownAgentPod")), timeout=30, what="deleted pod's token refused")
            wait_for(seen(((nodes[3], token[3]), "AgentPodTerminating")), timeout=30, what="terminating pod refused")
            assert post(nodes[0], forged(claims1)) == (403, "AgentPodOnOtherNode")
            assert post(nodes[0], token[0]) == (200, "")  # nothing else disturbed
            refusals = counters(metrics_text(base), "rejected_reports")
            assert min(refusals[r] for r in ("UnknownAgentPod", "AgentPodTerminating", "AgentPodOnOtherNode")) >= 1
        finally:
            with contextlib.suppress(ApiException):
                core.patch_namespaced_pod("agent-3", namespace, {"metadata": {"finalizers": None}})
