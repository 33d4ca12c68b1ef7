"""The agent's HTTP server under hostile clients, and the Events queue under a slow API server:
neither may hold up the probes or the sync loop (on hostNetwork every pod reaches the port)."""
from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from core.objects import PodRecord, Snapshot
from lab.procs import wait_for
from netagent import http as agent_http
from netagent.agent import Agent
from netagent.config import AgentConfig
from netagent.datapath_fake import FakeDataPath
from netagent.events import ProblemReporter
from netagent.http import AgentHTTP
from netagent.metrics import AgentMetrics


def get(address: str, path: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class BlockingCollector:
    """A scrape that hangs (counters stuck behind a busy kernel): it must cost workers, not probes."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def collect(self):
        self.entered.release()
        self.release.wait(30)
        return []


@pytest.fixture
def server():
    made = []

    def make(listen=("127.0.0.1", 0), state_listen=None, registry=None):
        rejected = []
        s = AgentHTTP(listen, registry or CollectorRegistry(), lambda: (True, "alive"), lambda: (True, "ready"),
                      lambda: {"pods": ["ns/secret-pod"]}, state_listen=state_listen, on_rejected=rejected.append)
        s.rejected = rejected
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def local(address: str) -> str:
    return address.replace("0.0.0.0", "127.0.0.1")


def test_state_only_on_loopback_metrics_and_probes_on_the_node_listener(server):
    s = server(("0.0.0.0", 0), state_listen=("127.0.0.1", 0))
    node, loop = local(s.address), s.state_address
    assert get(node, "/healthz") == (200, b"alive\n") and get(node, "/readyz") == (200, b"ready\n")
    assert get(node, "/metrics")[0] == 200
    assert get(node, "/state")[0] == 404  # the pod inventory is not for every pod of the node
    assert get(loop, "/state") == (200, b'{\n "pods": [\n  "ns/secret-pod"\n ]\n}')
    assert get(loop, "/metrics")[0] == 404
    both = server(("127.0.0.1", 0))  # a loopback --listen serves /state itself
    assert get(both.address, "/state")[0] == 200 and both.state_address == both.address


def test_500_idle_connections_leave_probes_answering_and_threads_bounded(server):
    s = server()
    host, port = s.address.rsplit(":", 1)
    threads_before = threading.active_count()
    idle = []
    try:
        for _ in range(500):
            c = socket.create_connection((host, int(port)))
            idle.append(c)
        for c in idle[:50]:
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        wait_for(lambda: s.connections() == agent_http.MAX_CONNECTIONS or s.rejected, what="connections accepted")
        for _ in range(5):
            assert get(s.address, "/healthz", timeout=1.0) == (200, b"alive\n")  # within the probe's 1 s
        assert threading.active_count() <= threads_before  # no thread per connection
        assert s.connections() <= agent_http.MAX_CONNECTIONS
        assert "too_many_connections" in s.rejected
        # idle ones are closed after the read timeout, the head that never ended too
        wait_for(lambda: s.connections() <= 1, timeout=agent_http.READ_TIMEOUT_S * 4, what="idle connections closed")
        assert "read_timeout" in s.rejected
    finally:
        for c in idle:
            c.close()


def test_oversized_and_malformed_requests_are_refused(server):
    s = server()
    host, port = s.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as c:
        c.sendall(b"GET /healthz HTTP/1.1\r\nX: " + b"a" * (agent_http.MAX_REQUEST_BYTES + 10))
        assert c.recv(100).startswith(b"HTTP/1.1 431")
    with socket.create_connection((host, int(port)), timeout=5) as c:
        c.sendall(b"\x16\x03\x01 not http\r\n\r\n")
        assert c.recv(100).startswith(b"HTTP/1.1 400")
    with socket.create_connection((host, int(port)), timeout=5) as c:
        c.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
        assert c.recv(100).startswith(b"HTTP/1.1 405")
    assert {"too_large", "bad_request", "bad_method"} <= set(s.rejected)


def test_a_hanging_scrape_costs_workers_never_probes(server):
    blocker = BlockingCollector()
    registry = CollectorRegistry()
    registry.register(blocker)
    s = server(registry=registry)
    host, port = s.address.rsplit(":", 1)
    scrapes = []
    try:
        for _ in range(agent_http.WORKERS + agent_http.WORK_QUEUE + 3):
            c = socket.create_connection((host, int(port)), timeout=10)
            c.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            scrapes.append(c)
        for _ in range(agent_http.WORKERS):
            assert blocker.entered.acquire(timeout=10)
        wait_for(lambda: "busy" in s.rejected, what="the work queue to refuse")
        assert get(s.address, "/healthz", timeout=1.0)[0] == 200
        assert get(s.address, "/readyz", timeout=1.0)[0] == 200
    finally:
        blocker.release.set()
        for c in scrapes:
            c.close()


def test_events_never_hold_up_the_sync_and_a_full_queue_drops_and_counts():
    """20 pods with a bad annotation and an API server that does not answer: the kernel is
    updated at once; Events wait in their own bounded queue (full: dropped, counted)."""
    stuck = threading.Event()
    written = []

    def emit(*event):
        stuck.wait(30)
        written.append(event)

    holder = {}
    metrics = AgentMetrics(lambda: holder["a"].view())
    problems = ProblemReporter(emit, lambda r: metrics.policy_problems.labels(r).inc(),
                               on_dropped=metrics.events_dropped.inc, queue_size=5)
    problems.start()
    dp = FakeDataPath()
    agent = Agent(AgentConfig("n1", ("eth0",), ("10.0.0.0/8",)), dp, metrics=metrics, problems=problems)
    holder["a"] = agent
    budgets = ({"kind": "EgressBudget", "metadata": {"name": "default"},
                "spec": {"total": "1G", "teams": [{"name": "a", "namespaces": ["ns"]}]}},)
    pods = tuple(PodRecord("ns", f"p{i}", f"uid-{i}", "n1", (f"10.244.0.{i + 10}",), False, "Running",
                           (("netagent.io/egress-class", "no-such-class"),)) for i in range(20))
    agent.on_snapshot(Snapshot(pods, (), budgets))
    done = threading.Thread(target=agent.sync, daemon=True)
    done.start()
    done.join(10)
    try:
        assert not done.is_alive() and dp.applied, "the sync waited for the API server"
        assert agent.node.state.ready
        dropped = metrics.registry.get_sample_value("netagent_events_dropped_total")
        assert dropped == problems.dropped and 20 - 5 - 1 <= dropped <= 20 - 5
        assert metrics.registry.get_sample_value("netagent_policy_problems_total", {"reason": "UnknownEgressClass"}) == 20
    finally:
        stuck.set()
    wait_for(lambda: len(written) == 20 - problems.dropped, what="the queued Events written")
    problems.stop()
