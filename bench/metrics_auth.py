"""/metrics under a tenants' junk-token flood (issue 33 item 5): Prometheus keeps being answered.

The agent's HTTP server (netagent/http.py) with its real authorizer (core/scrapeauth.py) and TLS,
in this process, reviewing tokens against a real kube-apiserver (lab/kube.py, RBAC on). Prometheus
is a ServiceAccount bound to get /metrics; it scrapes every `--interval` seconds for `--seconds`.
Meanwhile `--sources` tenant addresses (in two other processes) (127.0.0.0/8 aliases of lo: each is its own client address)
each send scrapes as fast as they are answered with a fresh well-formed JWT of a forged signature
(every one unknown to the cache: the worst case, each needs a TokenReview). Prometheus' verdict
expires every `--ttl` seconds during the run, so its renewals meet the flood.

Printed: Prometheus' scrapes answered 200 (must be all), their p50/p99 answer time, how many
renewals it needed; the junk scrapes by answer (401 reviewed, 429 refused at once); the reviews
made (the API server's load) and reviews per second, which must stay within the authorizer's
overall rate (5/s, burst 2x) plus Prometheus' renewals; the cache's size at the end. Exit 1 when
a Prometheus scrape was not answered 200 or the reviews exceeded that bound.

    python3 bench/metrics_auth.py [--sources 100 --seconds 30 --interval 1 --ttl 5]
"""
from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import secrets
import socket
import ssl
import statistics
import sys
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kubernetes import client  # noqa: E402

from core.kubereview import access_review, token_review  # noqa: E402
from core.scrapeauth import ScrapeAuthorizer  # noqa: E402
from lab.kube import CONTROL_PLANE_BINARIES, ControlPlane, find_assets  # noqa: E402
from netagent.http import AgentHTTP  # noqa: E402
from netagent.selfsigned import self_signed_context  # noqa: E402

CONTEXT = ssl.create_default_context()
CONTEXT.check_hostname, CONTEXT.verify_mode = False, ssl.CERT_NONE


def scrape(port: int, token: str, source: str = "127.0.0.1") -> int:
    raw = socket.create_connection(("127.0.0.1", port), timeout=15, source_address=(source, 0))
    try:
        with CONTEXT.wrap_socket(raw) as s:
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return int(data.split(b" ", 2)[1])
    except OSError:
        return 0
    finally:
        raw.close()


def forged(namespace: str) -> str:
    """A JWT shaped like a ServiceAccount token (public claims), signature forged: unknown, reviewed."""
    def part(d: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")
    claims = {"iss": "https://kubernetes.default.svc", "sub": f"system:serviceaccount:{namespace}:tenant",
              "aud": ["https://kubernetes.default.svc"], "exp": int(time.time()) + 3600, "jti": secrets.token_hex(8)}
    return f"{part({'alg': 'RS256', 'kid': 'x'})}.{part(claims)}.{base64.urlsafe_b64encode(os.urandom(256)).decode().rstrip('=')}"


def flood(port: int, namespace: str, sources: range, seconds: float, out) -> None:
    """One process of tenants (apart from the server's process: its own interpreter lock and CPU)."""
    junk: Counter[int] = Counter()
    stop = time.monotonic() + seconds

    def tenant(i: int) -> None:
        source = f"127.0.{1 + i // 250}.{1 + i % 250}"
        while time.monotonic() < stop:
            junk[scrape(port, forged(namespace), source)] += 1

    threads = [threading.Thread(target=tenant, args=(i,), daemon=True) for i in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    out.put(dict(junk))


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sources", type=int, default=100)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--ttl", type=float, default=5.0, help="the grant cache's TTL here (60 s in the agent)")
    a = p.parse_args()
    cp = ControlPlane(find_assets(CONTROL_PLANE_BINARIES))
    cp.start()
    server = None
    try:
        core, rbac = client.CoreV1Api(cp.admin), client.RbacAuthorizationV1Api(cp.admin)
        ns = cp.create_namespace("bench-")
        core.create_namespaced_service_account(ns, {"metadata": {"name": "prometheus"}})
        rbac.create_cluster_role({"metadata": {"name": f"{ns}-reader"},
                                  "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]})
        rbac.create_cluster_role_binding({
            "metadata": {"name": f"{ns}-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{ns}-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": ns}]})
        prom = core.create_namespaced_service_account_token("prometheus", ns, {"spec": {}}).status.token
        reviews = Counter()
        tr, ar = token_review(cp.admin), access_review(cp.admin)

        def counted_tr(token: str) -> dict:
            reviews["token"] += 1
            return tr(token)

        authorizer = ScrapeAuthorizer(counted_tr, ar, ttl=a.ttl)
        server = AgentHTTP(("127.0.0.1", 0), None, lambda: (True, ""), lambda: (True, ""), lambda: {},
                           exposition=lambda: b"netagent_x 1\n" * 2000, authorizer=authorizer,
                           tls=self_signed_context("bench"))
        server.start()
        port = int(server.address.rsplit(":", 1)[1])
        assert scrape(port, prom) == 200, "Prometheus' token is refused before the flood"
        results = multiprocessing.get_context("fork").Queue()
        half = a.sources // 2
        procs = [multiprocessing.get_context("fork").Process(target=flood, args=(port, ns, r, a.seconds, results))
                 for r in (range(0, half), range(half, a.sources))]
        began = time.monotonic()
        for proc in procs:
            proc.start()
        start = time.monotonic()
        times, codes = [], Counter()
        while time.monotonic() - start < a.seconds:
            t0 = time.monotonic()
            codes[scrape(port, prom)] += 1
            times.append(time.monotonic() - t0)
            time.sleep(max(0.0, a.interval - (time.monotonic() - t0)))
        took = time.monotonic() - start
        junk: Counter[int] = Counter()
        for _ in procs:
            junk.update(results.get(timeout=60))
        for proc in procs:
            proc.join(10)
        window = time.monotonic() - began  # the flood's whole life: the reviews' window
        print(f"{a.sources} tenant addresses flooding forged tokens for {took:.0f} s; Prometheus every {a.interval:g} s, "
              f"its grant cached for {a.ttl:g} s")
        print(f"Prometheus: {codes[200]}/{sum(codes.values())} scrapes answered 200 {dict(codes)}; "
              f"p50 {statistics.median(times) * 1e3:.1f} ms, p99 {nearest_rank(times, 0.99) * 1e3:.1f} ms, "
              f"max {max(times) * 1e3:.1f} ms")
        print(f"junk scrapes: {sum(junk.values())} {dict(sorted(junk.items()))} (401: reviewed and refused; "
              f"429: refused at once, no review)")
        print(f"TokenReviews made: {reviews['token']} ({reviews['token'] / took:.1f}/s); authorizer: "
              f"reviews {dict(authorizer.reviews)}, refusals {dict(authorizer.refusals)}, cache {len(authorizer)}")
        # the bound on the API server's load: the overall bucket (burst 2x) plus Prometheus' renewals
        bound = authorizer.rate * window + 2 * authorizer.rate + window / a.ttl + 2
        answered = codes[200] == sum(codes.values())
        ok = answered and reviews["token"] <= bound
        print(f"verdict: {'PASS' if ok else 'FAIL'} (every Prometheus scrape answered: {answered}; "
              f"TokenReviews {reviews['token']} <= {bound:.0f}, the rate bound: {reviews['token'] <= bound})")
        return 0 if ok else 1
    finally:
        if server:
            server.stop()
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
