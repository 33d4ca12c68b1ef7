"""Agents' kept-alive connections to a real controller process (TLS, from files): several reports
over one connection, a TLS session resumed after the controller closed an idle one, the
bounds on kept connections (per client address, in total, idle time) and on TLS handshakes in
progress (a reconnect storm), each counted in a metric (controller/connections.py,
core/asynctls.py, netagent/transport.py; issue 37)."""
from __future__ import annotations

import json
import re
import socket
import ssl
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lab.kube import Pki
from lab.procs import wait_for
from netagent.transport import ControllerClient, ControllerError
from tests.test_controller_service import controller_process, node_report, write_policy


def metric(base: str, ctx: ssl.SSLContext, name: str, labels: str = "") -> float:
    """One sample of the controller's /metrics, fetched from 127.0.0.1 on a connection of its own."""
    with urllib.request.urlopen(base + "/metrics", timeout=5, context=ctx) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def raw_tls(port: int, source: str, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    """A TLS connection from `source` (another loopback address: another client) that sends nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    return ctx.wrap_socket(sock, server_hostname="localhost")


def closed_by_server(sock: ssl.SSLSocket, wait: float = 5.0) -> bool:
    """The server closed (or aborted) the connection: a read returns EOF or fails."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError, OSError) as exc:
        return not isinstance(exc, (TimeoutError, socket.timeout))


@pytest.fixture
def tls_controller(tmp_path: Path):
    pki = Pki(tmp_path / "pki")
    policy = tmp_path / "policy.yaml"
    write_policy(policy, "100M")
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))

    def start(*flags: str):
        return controller_process(tmp_path, "--from-file", str(policy), "--no-auth", *flags, pki=pki)
    return start, pki, ctx


def test_reports_share_one_connection_and_a_new_one_resumes_the_tls_session(tls_controller):
    start, pki, ctx = tls_controller
    with start("--keepalive-timeout", "1") as (_proc, base):
        port = int(base.rsplit(":", 1)[1])
        client = ControllerClient(f"https://localhost:{port}", str(pki.ca_file))
        body = json.dumps(node_report("n1", [("web", "w1", 1e6)])).encode()
        before = metric(base, ctx, "netagent_controller_connections_opened_total")
        for _ in range(5):
            raw, _ = client.post("/v1/nodes/n1/report", body, None)
            assert "generation" in json.loads(raw)
        after = metric(base, ctx, "netagent_controller_connections_opened_total")
        assert client.connections_opened == 1
        assert after - before == 2  # the five reports' one connection, and this fetch's own
        # the controller closes the idle connection (--keepalive-timeout 1): the next report goes on a
        # new connection that resumes the TLS session, and is answered
        kept = client._kept[client.endpoint].conn.sock
        wait_for(lambda: closed_by_server(kept, 0.5), timeout=15, what="the idle connection closed")
        raw, _ = client.post("/v1/nodes/n1/report", body, None)
        assert "generation" in json.loads(raw)
        assert client.connections_opened == 2
        assert client.sessions_resumed == 1
        client.close()


def test_connections_over_a_bound_are_closed_and_counted(tls_controller):
    start, pki, ctx = tls_controller
    with start("--max-connections", "4", "--max-connections-per-address", "2") as (_proc, base):
        port = int(base.rsplit(":", 1)[1])
        held = [raw_tls(port, "127.0.0.2", ctx), raw_tls(port, "127.0.0.2", ctx)]
        try:
            third = raw_tls(port, "127.0.0.2", ctx)  # one too many from this address
            assert closed_by_server(third)
            third.close()
            assert not any(closed_by_server(s, 0.3) for s in held)  # the two within the bound stay
            assert metric(base, ctx, "netagent_controller_connections_refused_total",
                          '{reason="TooManyConnectionsFromAddress"}') == 1
            held += [raw_tls(port, "127.0.0.3", ctx), raw_tls(port, "127.0.0.4", ctx)]  # 4 = --max-connections
            fifth = raw_tls(port, "127.0.0.5", ctx)
            assert closed_by_server(fifth)
            fifth.close()
        finally:
            for s in held:
                s.close()
        # the held ones gone, a client is served again, and the refusals are counted by reason
        assert wait_for(lambda: metric(base, ctx, "netagent_controller_connections") <= 1, timeout=10,
                        what="the held connections released")
        assert metric(base, ctx, "netagent_controller_connections_refused_total", '{reason="TooManyConnections"}') == 1


def test_a_client_that_sends_nothing_is_closed_after_the_idle_timeout(tls_controller):
    """A slow client holding a connection open loses it after --keepalive-timeout, whether it never
    sent a request or stopped halfway through one."""
    start, pki, ctx = tls_controller
    with start("--keepalive-timeout", "1") as (_proc, base):
        port = int(base.rsplit(":", 1)[1])
        silent = raw_tls(port, "127.0.0.2", ctx)
        partial = raw_tls(port, "127.0.0.3", ctx)
        partial.sendall(b"POST /v1/nodes/n1/report HTTP/1.1\r\nHost: localhost\r\n")  # headers never end
        try:
            started = time.monotonic()
            assert closed_by_server(silent, 20)
            assert closed_by_server(partial, 20 - (time.monotonic() - started))
        finally:
            silent.close()
            partial.close()


def silent_tcp(port: int, source: str) -> socket.socket:
    """A connection from `source` that never starts its TLS handshake: the controller's handshake
    with it stays in progress (until the handshake timeout, 10 s)."""
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def test_handshakes_over_the_bound_are_closed_before_tls_and_counted_and_the_accepted_are_answered(tls_controller):
    """A reconnect storm's bound: at most --max-handshakes TLS handshakes in progress, at most
    --max-connections-per-address of them (in progress or waiting) from one address; a connection
    over the address bound is closed on accept, one over the total waits up to 2 s for a handshake
    to end and is closed if none does (its client sees the connection end, no TLS), each counted
    as TooManyHandshakes; a client within the bound is answered meanwhile, and a waiting one when
    a handshake ends. Silent TCP clients stand for the handshakes a
    storm has in progress (a real storm's cannot be held open on demand)."""
    start, pki, ctx = tls_controller
    with start("--max-handshakes", "3", "--max-connections-per-address", "2") as (_proc, base):
        port = int(base.rsplit(":", 1)[1])
        body = json.dumps(node_report("n1", [("web", "w1", 1e6)])).encode()
        held = [silent_tcp(port, "127.0.0.2"), silent_tcp(port, "127.0.0.2")]
        try:
            third = silent_tcp(port, "127.0.0.2")  # a third handshake from that address
            assert closed_by_server(third)
            third.close()
            client = ControllerClient(f"https://localhost:{port}", str(pki.ca_file))
            raw, _ = client.post("/v1/nodes/n1/report", body, None)  # 2 of 3 in progress: answered
            assert "generation" in json.loads(raw)
            client.close()
            held.append(silent_tcp(port, "127.0.0.3"))  # 3 in progress: the bound
            over = silent_tcp(port, "127.0.0.4")
            assert closed_by_server(over)
            over.close()
            refused = ControllerClient(f"https://localhost:{port}", str(pki.ca_file))
            with pytest.raises(ControllerError, match="unreachable"):
                refused.post("/v1/nodes/n1/report", body, None)
            refused.close()
            assert not any(closed_by_server(s, 0.3) for s in held)  # those in progress are kept
            # a client that waits (all 3 in progress) starts its handshake when one ends, and is answered
            waiting = ControllerClient(f"https://localhost:{port}", str(pki.ca_file))
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(waiting.post, "/v1/nodes/n1/report", body, None)
                time.sleep(0.3)  # ordering only: its connection is accepted and waits
                held.pop().close()
                assert "generation" in json.loads(answer.result(timeout=10)[0])
            waiting.close()
        finally:
            for s in held:
                s.close()

        def refusals() -> float | None:  # the fetch is refused too until the held ones are gone
            try:
                return metric(base, ctx, "netagent_controller_connections_refused_total",
                              '{reason="TooManyHandshakes"}')
            except OSError:
                return None
        assert wait_for(lambda: refusals() is not None, timeout=10, what="the held handshakes released")
        assert refusals() == 3  # the third from 127.0.0.2, the fourth in progress, the refused client
        client = ControllerClient(f"https://localhost:{port}", str(pki.ca_file))
        raw, _ = client.post("/v1/nodes/n1/report", body, None)  # served again
        assert "generation" in json.loads(raw)
        client.close()
