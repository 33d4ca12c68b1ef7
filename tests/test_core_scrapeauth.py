"""core/scrapeauth.py's cache, clocks and bounds (pure logic: the two API calls are plain functions
here; tests/test_agent_metrics_auth_kube.py runs the same authorizer against a real kube-apiserver), and the
agent's HTTP server keeping Prometheus served while junk tokens wait for a review that is slow on
purpose (a slow API server, which the real one cannot be made on demand)."""
from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import time

import pytest

from core.errors import ConfigError
from core.scrapeauth import MAX_TOKEN_BYTES, ScrapeAuthorizer, ScrapeRefused, User
from netagent.config import metrics_auth_wanted
from netagent.http import AgentHTTP, ScrapeAuthCollector, header_value
from netagent.selfsigned import self_signed_context


def jwt(sub: str, exp: float | None = None) -> str:
    def part(d: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")
    claims = {"sub": sub, **({"exp": exp} if exp is not None else {})}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Reviews:
    """TokenReview: a token is authenticated when its sub starts with 'sa:'; SubjectAccessReview:
    allowed for the users in `granted`."""

    def __init__(self, granted=("sa:prometheus",)):
        self.granted = set(granted)
        self.tokens = []
        self.fail = False

    def token(self, token: str) -> dict:
        self.tokens.append(token)
        if self.fail:
            raise OSError("connection refused")
        payload = token.split(".")[1]
        sub = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["sub"]
        if not sub.startswith("sa:"):
            return {"authenticated": False, "error": "invalid signature"}
        return {"authenticated": True, "user": {"username": sub, "groups": ["g"]}}

    def access(self, user: User, verb: str, path: str) -> bool:
        assert (verb, path) == ("get", "/metrics")
        return user.username in self.granted


def make(reviews: Reviews, clock: Clock, wall: Clock | None = None, **kw) -> ScrapeAuthorizer:
    return ScrapeAuthorizer(reviews.token, reviews.access, clock=clock, wall=wall or Clock(1_000_000.0), **kw)


def refused(fn, *args) -> ScrapeRefused:
    with pytest.raises(ScrapeRefused) as exc:
        fn(*args)
    return exc.value


def test_refusals_by_reason_and_status():
    r, clock = Reviews(), Clock()
    a = make(r, clock)
    assert refused(a.cached, None).status == 401
    assert refused(a.cached, "Basic dXNlcg==").reason == "missing_token"
    assert refused(a.cached, "Bearer x" * 2).reason == "malformed_token"
    assert refused(a.cached, "Bearer " + "a" * MAX_TOKEN_BYTES + ".b.c").reason == "malformed_token"
    assert refused(a.authorize, f"Bearer {jwt('forged')}").status == 401
    e = refused(a.authorize, f"Bearer {jwt('sa:tenant')}")
    assert (e.status, e.reason) == (403, "forbidden") and "sa:tenant may not get /metrics" in str(e)
    assert a.authorize(f"Bearer {jwt('sa:prometheus')}").username == "sa:prometheus"
    assert r.tokens == [jwt("forged"), jwt("sa:tenant"), jwt("sa:prometheus")]  # no review for malformed ones
    assert a.refusals == {"missing_token": 2, "malformed_token": 2, "unauthenticated": 1, "forbidden": 1}
    assert a.reviews == {"token": 3, "access": 2}


def test_verdicts_cached_on_the_monotonic_clock_refusals_briefly_never_past_exp():
    r, clock, wall = Reviews(), Clock(), Clock(1_000_000.0)
    a = make(r, clock, wall, ttl=60, refusal_ttl=5)
    good, bad = f"Bearer {jwt('sa:prometheus')}", f"Bearer {jwt('sa:tenant')}"
    a.authorize(good)
    refused(a.authorize, bad)
    wall.t -= 3600  # a backward wall-clock step extends nothing
    clock.t += 4
    assert a.cached(good).username == "sa:prometheus"
    assert refused(a.cached, bad).reason == "forbidden"
    clock.t += 2  # 6 s: the refusal is gone, the grant is not
    assert a.cached(bad) is None and a.cached(good) is not None
    clock.t += 55  # 61 s: the grant too
    assert a.cached(good) is None
    assert len(r.tokens) == 2
    # a token expiring in 10 s (by its exp claim at review time) is granted for 10 s, not 60
    short = f"Bearer {jwt('sa:prometheus', exp=wall.t + 10)}"
    a.authorize(short)
    clock.t += 9
    assert a.cached(short) is not None
    clock.t += 2
    assert a.cached(short) is None


def test_cache_bounded_lru():
    r, clock = Reviews(granted={f"sa:{i}" for i in range(10)}), Clock()
    a = make(r, clock, max_entries=3)
    for i in range(5):
        a.authorize(f"Bearer {jwt(f'sa:{i}')}")
    assert len(a) == 3
    assert a.cached(f"Bearer {jwt('sa:0')}") is None and a.cached(f"Bearer {jwt('sa:4')}") is not None


def test_api_failure_is_503_and_not_cached():
    r, clock = Reviews(), Clock()
    a = make(r, clock)
    r.fail = True
    assert refused(a.authorize, f"Bearer {jwt('sa:prometheus')}").status == 503
    r.fail = False
    assert a.authorize(f"Bearer {jwt('sa:prometheus')}").username == "sa:prometheus"


def test_admission_per_source_and_overall_with_a_reserve_for_tokens_granted_before():
    r, clock = Reviews(), Clock()
    a = make(r, clock, ttl=60, max_pending=3, reserve=1, per_source=1)
    prom = f"Bearer {jwt('sa:prometheus')}"
    a.authorize(prom)
    clock.t += 61  # its verdict expired: it needs a review again, and was granted before
    assert a.cached(prom) is None
    assert a.admit("10.0.0.1", f"Bearer {jwt('junk1')}")
    assert not a.admit("10.0.0.1", f"Bearer {jwt('junk2')}")  # one pending per source
    assert a.admit("10.0.0.2", f"Bearer {jwt('junk3')}") and a.admit("10.0.0.3", f"Bearer {jwt('junk4')}")
    assert not a.admit("10.0.0.4", f"Bearer {jwt('junk5')}")  # the general slots are full
    assert a.admit("10.0.0.9", prom)  # the reserve: a token granted before still gets its review
    assert not a.admit("10.0.0.8", prom)
    assert a.refusals["busy"] == 3
    for source in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.9"):
        a.release(source)
    assert a.pending() == 0


# -- the agent's server ------------------------------------------------------------------------

def get(port: int, path: str, token: str | None = None, timeout: float = 10) -> tuple[int, bytes]:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
        with context.wrap_socket(raw) as s:
            auth = f"Authorization: Bearer {token}\r\n" if token else ""
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_header_value():
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nauthorization:  Bearer abc \r\n"
    assert header_value(head, "Authorization") == "Bearer abc"
    assert header_value(head, "X-None") is None


def test_junk_under_review_never_holds_prometheus_and_health_stays_open():
    """Ten junk tokens whose reviews hang (the slow API server) while Prometheus, granted before,
    scrapes: it is answered from the cache at once, junk beyond the bounds gets 429 at once."""
    r, release = Reviews(), threading.Event()
    slow_token = r.token

    def token_review(token: str) -> dict:
        payload = token.split(".")[1]
        if json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["sub"].startswith("junk"):
            release.wait(20)
        return slow_token(token)

    authorizer = ScrapeAuthorizer(token_review, r.access, max_pending=2, reserve=1, per_source=1)
    server = AgentHTTP(("127.0.0.1", 0), None, lambda: (True, ""), lambda: (True, ""), lambda: {},
                       exposition=lambda: b"netagent_x 1\n", authorizer=authorizer, tls=self_signed_context("n"))
    server.start()
    port = int(server.address.rsplit(":", 1)[1])
    prom = jwt("sa:prometheus")
    try:
        assert get(port, "/metrics", prom) == (200, b"netagent_x 1\n")
        results = []
        junk = [threading.Thread(target=lambda i=i: results.append(get(port, "/metrics", jwt(f"junk{i}"))[0]))
                for i in range(10)]
        for t in junk:
            t.start()
        deadline = time.monotonic() + 20
        while len(results) < 9 and time.monotonic() < deadline:
            time.sleep(0.05)
        # all from 127.0.0.1: one review pending for that source, the other nine refused at once
        assert sorted(results) == [429] * 9, results
        for _ in range(5):
            assert get(port, "/metrics", prom)[0] == 200  # cached: never behind the hanging review
        assert get(port, "/healthz")[0] == 200 and get(port, "/metrics")[0] == 401
        release.set()
        for t in junk:
            t.join(20)
        assert sorted(results) == [401] + [429] * 9
        families = {m.name: m for m in ScrapeAuthCollector(authorizer).collect()}
        assert {s.labels["reason"]: s.value for s in families["netagent_metrics_auth_refusals"].samples} == {
            "busy": 9, "forbidden": 0, "missing_token": 1, "unauthenticated": 1}
    finally:
        release.set()
        server.stop()


def test_plain_http_on_the_tls_port_gets_nothing():
    authorizer = ScrapeAuthorizer(lambda t: {}, lambda u, v, p: False)
    server = AgentHTTP(("127.0.0.1", 0), None, lambda: (True, ""), lambda: (True, ""), lambda: {},
                       exposition=lambda: b"", authorizer=authorizer, tls=self_signed_context("n"))
    server.start()
    port = int(server.address.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            try:
                answer = s.recv(100)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # closed: no answer in the clear
        assert get(port, "/readyz")[0] == 200
    finally:
        server.stop()


def test_agent_metrics_auth_mode():
    """auto: on with Kubernetes on a non-loopback --listen; never possible without an API server."""
    assert metrics_auth_wanted("auto", False, "0.0.0.0") and metrics_auth_wanted("auto", False, "10.0.0.5")
    assert not metrics_auth_wanted("auto", False, "127.0.0.1") and not metrics_auth_wanted("auto", True, "0.0.0.0")
    assert metrics_auth_wanted("true", False, "127.0.0.1") and not metrics_auth_wanted("false", False, "0.0.0.0")
    with pytest.raises(ConfigError, match="needs the API server"):
        metrics_auth_wanted("true", True, "0.0.0.0")


def test_review_rate_overall_and_per_source_but_never_for_a_renewal():
    r, clock = Reviews(), Clock()
    a = make(r, clock, ttl=60, max_pending=100, per_source=5, rate=5.0, source_rate=1.0)
    prom = f"Bearer {jwt('sa:prometheus')}"
    a.authorize(prom)
    clock.t += 61
    admitted = [i for i in range(40) if a.admit(f"10.0.0.{i}", f"Bearer {jwt(f'junk{i}')}")]
    assert admitted == list(range(10))  # 40 addresses at once: the overall burst (2 x 5/s) passes, then nothing
    assert a.admit("10.0.9.9", prom)  # the renewal of a token granted before: no rate applies
    for i in admitted:
        a.release(f"10.0.0.{i}")
    a.release("10.0.9.9")
    clock.t += 1  # five more overall; one address gets its burst of two, not more
    got = [a.admit("10.0.1.1", f"Bearer {jwt(f'junk-b{i}')}") for i in range(3)]
    assert got == [True, True, False]
    assert a.refusals["busy"] == 31
