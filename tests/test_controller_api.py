"""The controller's agent API over real HTTP on loopback: a real aiohttp server, the real
ControllerState, adapter and allocation engine. Only the API server's TokenReview is stood in
for (by a function answering as TokenReview does); tests/test_controller_kube.py uses the real one."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from lab.procs import wait_for

from controller.allocator import Allocator
from controller.api import MAX_BODY, make_app
from controller.auth import AUDIENCE, NODE_CLAIM, POD_CLAIM, TokenAuthenticator
from controller.config import service_account_username
from controller.state import ControllerState
from core.wire import MAX_ANNOTATION_VALUE, MAX_PODS_PER_REPORT, MAX_REFUSED

CLASSES = [
    {"kind": "EgressClass", "metadata": {"name": "bulk"}, "spec": {"weight": 1, "max": "80M"}},
    {"kind": "EgressClass", "metadata": {"name": "interactive"}, "spec": {"weight": 3, "min": "5M"}},
]
BUDGET = {"kind": "EgressBudget", "metadata": {"name": "default"}, "spec": {
    "total": "100M",
    "teams": [
        {"name": "research", "namespaces": ["research"], "weight": 1, "defaultClass": "bulk"},
        {"name": "web", "namespaces": ["web"], "weight": 2, "min": "10M"},
    ],
}}


def policy_source(classes=CLASSES, budgets=(BUDGET,)):
    from core.policy import load_policy

    value = load_policy(list(classes), list(budgets))
    return lambda: value


def pod(namespace: str, name: str, demand: float = 50e6, usage: float = 0.0, cls: str | None = None,
        bandwidth: str | None = None) -> dict:
    return {"namespace": namespace, "name": name, "usage_bps": usage, "demand_bps": demand, "throttled": False,
            "egress_class": cls, "egress_bandwidth": bandwidth}


def report(node: str, pods: list[dict], **extra) -> dict:
    return {"node": node, "pods": pods, "seq": 1, "period_seconds": 5.0, **extra}


def new_state(**kw) -> ControllerState:
    kw.setdefault("lease_seconds", 30.0)
    return ControllerState(Allocator(policy_source()), **kw)


@contextlib.asynccontextmanager
async def serve(state: ControllerState, auth=None, **kw):
    server = TestServer(make_app(state, auth, **kw), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            yield session, f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def post(session, base, node, body, headers=None, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    async with session.post(f"{base}/v1/nodes/{node}/report", data=data, allow_redirects=False,
                            headers={"Content-Type": "application/json", **(headers or {})}) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text else None), r.headers


# -- bad input: a clear 4xx, nothing stored ------------------------------------------------------

BAD_REPORTS = [
    ("malformed JSON", "node-a", b'{"node": "node-a", "pods": [', 400, "Malformed", "malformed JSON"),
    ("not an object", "node-a", b"[1, 2, 3]", 422, "Invalid", "Expected `object`"),
    ("unknown field", "node-a", json.dumps({**report("node-a", []), "surprise": 1}).encode(), 422, "Invalid",
     "unknown field `surprise`"),
    ("unknown pod field", "node-a", json.dumps(report("node-a", [{**pod("web", "p"), "x": 1}])).encode(), 422,
     "Invalid", "unknown field `x`"),
    ("missing field", "node-a", json.dumps({"pods": []}).encode(), 422, "Invalid", "missing required field `node`"),
    ("negative rate", "node-a", json.dumps(report("node-a", [pod("web", "p", demand=-1)])).encode(), 422,
     "Invalid", "demand_bps"),
    ("infinite rate", "node-a", b'{"node":"node-a","pods":[{"namespace":"web","name":"p","usage_bps":1e999,'
                                b'"demand_bps":1}]}', 422, "Invalid", "usage_bps"),
    ("rate too large", "node-a", json.dumps(report("node-a", [pod("web", "p", demand=2.0**65)])).encode(), 422,
     "Invalid", "demand_bps"),
    ("path and body disagree", "node-a", json.dumps(report("node-b", [])).encode(), 422, "Invalid",
     "names node 'node-b' but was posted for 'node-a'"),
    ("oversized body", "node-a", b'{"node": "node-a", "pods": [], "seq": 1' + b" " * MAX_BODY + b"}", 413,
     "TooLarge", "larger than"),
    ("not a node name", "Node_A", json.dumps(report("node-a", [])).encode(), 404, "NotFound", "must name a node"),
    ("negative download demand", "node-a", json.dumps(report("node-a", [{**pod("web", "p"), "ingress_demand_bps": -1}],
                                                           shapes_ingress=True)).encode(), 422, "Invalid",
     "ingress_demand_bps"),
    ("absurd download usage", "node-a", json.dumps(report("node-a", [{**pod("web", "p"), "ingress_usage_bps": 1e30}],
                                                        shapes_ingress=True)).encode(), 422, "Invalid",
     "ingress_usage_bps"),
    ("infinite node download total", "node-a", b'{"node":"node-a","pods":[],"shapes_ingress":true,'
                                               b'"node_internet_ingress_bps":1e999}', 422, "Invalid",
     "node_internet_ingress_bps"),
    ("download flag not a bool", "node-a", json.dumps(report("node-a", [], shapes_ingress="yes")).encode(), 422,
     "Invalid", "shapes_ingress"),
]


@pytest.mark.parametrize("what,node,body,status,reason,message", BAD_REPORTS, ids=[b[0] for b in BAD_REPORTS])
async def test_bad_report_is_refused_clearly_and_changes_nothing(what, node, body, status, reason, message):
    state = new_state()
    async with serve(state) as (session, base):
        assert (await post(session, base, "node-b", report("node-b", [pod("web", "w1")])))[0] == 200
        state.run_round()
        before = (dict(state.latest), state.result.by_node)
        code, answer, _ = await post(session, base, node, None, raw=body)
        assert (code, answer["reason"]) == (status, reason), answer
        assert message in answer["error"]
        assert (dict(state.latest), state.result.by_node) == before  # nothing stored, no other node touched
        code, again, _ = await post(session, base, "node-b", report("node-b", [pod("web", "w1")]))
        assert (code, again["generation"], [p["name"] for p in again["pods"]]) == (200, 1, ["w1"])


async def test_chunked_body_is_read_whole():
    """A body sent without Content-Length (chunked) is read to its end, not to the first chunk."""
    state = new_state()
    body = json.dumps(report("node-a", [pod("web", f"pod-{i}") for i in range(110)])).encode()

    async def chunks():
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    async with serve(state) as (session, base):
        async with session.post(f"{base}/v1/nodes/node-a/report", data=chunks()) as r:
            assert r.status == 200, await r.text()
    assert len(state.latest["node-a"][1].report.pods) == 110


# -- rate limiting -----------------------------------------------------------------------------

async def test_rate_limit_is_per_node():
    state = new_state()
    async with serve(state, per_node_rate=0.01, per_node_burst=2) as (session, base):
        codes = [(await post(session, base, "node-a", report("node-a", [])))[0] for _ in range(3)]
        assert codes == [200, 200, 429]
        code, answer, headers = await post(session, base, "node-a", report("node-a", []))
        assert (code, answer["reason"], headers["Retry-After"]) == (429, "RateLimited", "1")
        assert (await post(session, base, "node-b", report("node-b", [])))[0] == 200  # another node is not held back


# -- node binding --------------------------------------------------------------------------------

async def test_pod_of_another_node_is_refused_alone():
    where = {("web", "w1"): "node-a", ("web", "w2"): "node-b"}
    state = new_state(locate_pods=lambda keys: [where.get(k) for k in keys])
    async with serve(state) as (session, base):
        assert (await post(session, base, "node-a", report("node-a", [pod("web", "w1")])))[0] == 200
        state.run_round()
        code, answer, _ = await post(session, base, "node-a", report("node-a", [pod("web", "w1"), pod("web", "w2"),
                                                                               pod("web", "new")]))
        assert code == 200, answer  # a stale placement costs the report's other pods nothing
        assert answer["refused"] == [{"namespace": "web", "name": "w2", "reason": "PodNotOnNode"},
                                     {"namespace": "web", "name": "new", "reason": "UnknownPod"}]
        assert [p["name"] for p in answer["pods"]] == ["w1"]
        assert [p.name for p in state.latest["node-a"][1].report.pods] == ["w1"]  # refused pods are not allocated


async def test_bad_pods_are_refused_by_name_and_their_neighbours_allocated():
    """Oversize annotation values, duplicates, bad names and pods beyond the per-report maximum are
    refused one by one; the report's other pods are allocated as usual."""
    state = new_state(lease_seconds=30.0)
    huge = "x" * (1 << 20)  # 1 MiB of annotation on one pod
    pods = [pod("web", "good"), pod("web", "big", cls=huge), pod("web", "good"), pod("web", "Not_A_Name"),
            pod("web", "wide", bandwidth="9" * (MAX_ANNOTATION_VALUE + 1))]
    async with serve(state) as (session, base):
        code, answer, _ = await post(session, base, "node-a", report("node-a", pods))
        assert code == 200, answer
        assert [(r["name"], r["reason"]) for r in answer["refused"]] == [
            ("big", "AnnotationTooLong"), ("good", "Duplicate"), ("Not_A_Name", "InvalidName"),
            ("wide", "AnnotationTooLong")]
        state.run_round()
        _, answer, _ = await post(session, base, "node-a", report("node-a", pods))
        assert [p["name"] for p in answer["pods"]] == ["good"] and answer["generation"] == 1

        many = [pod("web", f"p{i}") for i in range(2000)]  # 2,000 pods in one report
        code, answer, _ = await post(session, base, "node-b", report("node-b", many))
        assert code == 200, answer
        assert len(answer["refused"]) == MAX_REFUSED  # the answer stays bounded
        assert {r["reason"] for r in answer["refused"]} == {"TooManyPods"}
        assert answer["refused"][0]["name"] == f"p{MAX_PODS_PER_REPORT}"
        assert f"{2000 - MAX_PODS_PER_REPORT - MAX_REFUSED} more pods refused" in answer["problems"][0]
        assert len(state.latest["node-b"][1].report.pods) == MAX_PODS_PER_REPORT


# -- allocations -----------------------------------------------------------------------------------

async def test_two_nodes_get_the_engine_allocation_split_per_node():
    from core.engine import PodDemandIn, allocate
    from core.policy import resolve_pod

    state = new_state()
    a_pods = [pod("web", "w1", 40e6, usage=30e6), pod("research", "r1", 90e6, usage=20e6),
              pod("research", "r2", 3e6, cls="interactive", usage=3e6)]
    b_pods = [pod("web", "w2", 40e6, usage=10e6, bandwidth="15M"), pod("other", "o1", 20e6, usage=5e6)]
    async with serve(state) as (session, base):
        assert (await post(session, base, "node-a", report("node-a", a_pods)))[1]["generation"] == 0
        assert (await post(session, base, "node-b", report("node-b", b_pods)))[0] == 200
        result = state.run_round()
        _, ans_a, _ = await post(session, base, "node-a", report("node-a", a_pods))
        _, ans_b, _ = await post(session, base, "node-b", report("node-b", b_pods))

    policy, _ = policy_source()()
    engine_in = []
    for p in b_pods + a_pods:
        pp = resolve_pod(policy, p["namespace"], p["egress_class"], p["egress_bandwidth"])
        up = pp.limits.upload
        engine_in.append(PodDemandIn(f"{p['namespace']}/{p['name']}", pp.team, pp.egress_class, up.weight,
                                     up.min_bps, up.max_bps, p["demand_bps"]))
    expected = allocate(policy, engine_in).pods
    for answer, pods in ((ans_a, a_pods), (ans_b, b_pods)):
        assert answer["generation"] == result.generation == 1
        got = {f"{p['namespace']}/{p['name']}": p for p in answer["pods"]}
        assert set(got) == {f"{p['namespace']}/{p['name']}" for p in pods}  # each node gets exactly its pods
        for key, p in got.items():
            assert p["allocation_bps"] == pytest.approx(expected[key].allocation_bps)
            assert p["limit_bps"] == pytest.approx(expected[key].limit_bps)
        assert answer["node_rate_bps"] == pytest.approx(min(100e6, sum(p["limit_bps"] for p in answer["pods"])))
    assert {p["name"]: p["team"] for p in ans_a["pods"] + ans_b["pods"]} == {
        "w1": "web", "w2": "web", "r1": "research", "r2": "research", "o1": "default"}
    assert {p["name"]: p["egress_class"] for p in ans_a["pods"]} == {"w1": "default", "r1": "bulk",
                                                                     "r2": "interactive"}
    assert sum(p["allocation_bps"] for p in ans_a["pods"] + ans_b["pods"]) <= 100e6 * (1 + 1e-9)
    summary = result.summary
    assert (summary.pods, summary.nodes, summary.budget_bps) == (5, 2, 100e6)
    assert summary.used_bps == pytest.approx(68e6)  # no node_internet_egress: the pods' usage
    assert summary.groups[("research", "bulk")].pods == 1


async def test_answer_carries_lease_and_safe_floor():
    state = new_state(lease_seconds=42.0)
    pods = [pod("web", f"w{i}") for i in range(4)]
    async with serve(state) as (session, base):
        _, first, _ = await post(session, base, "node-a", report("node-a", pods))
        assert (first["generation"], first["lease_seconds"], first["pods"]) == (0, 42.0, [])
        assert "no allocation round with this node yet" in first["problems"][0]
        await post(session, base, "node-b", report("node-b", [pod("web", "x")]))
        state.run_round()
        _, answer, _ = await post(session, base, "node-a", report("node-a", pods))
        # a node that first reports after the round (a new leader's first rounds) is told to keep what it has,
        # not given an empty set of allocations
        _, newcomer, _ = await post(session, base, "node-c", report("node-c", [pod("web", "c1")]))
        assert (newcomer["generation"], newcomer["pods"]) == (0, [])
    assert answer["lease_seconds"] == 42.0
    assert answer["safe_floor_bps"] == pytest.approx(100e6 / 5)  # the budget over the round's pods
    assert answer["generation"] == 1


async def test_floor_is_sized_from_the_clusters_pods_not_from_one_round():
    """Right after a failover only a few nodes have reported: the floor is the budget over the pods
    the cluster has (the pod cache), never over the few pods of that round."""
    state = ControllerState(Allocator(policy_source(), known_pods=lambda: 1000), lease_seconds=30.0)
    async with serve(state) as (session, base):
        await post(session, base, "node-a", report("node-a", [pod("web", "w1")]))
        state.run_round()
        _, answer, _ = await post(session, base, "node-a", report("node-a", [pod("web", "w1")]))
    assert answer["safe_floor_bps"] == pytest.approx(100e6 / 1000)


async def test_leader_answers_only_when_its_caches_are_synced():
    synced = {"ok": False}
    state = new_state(readiness=lambda: (synced["ok"], "waiting for the first list of pods"))
    async with serve(state) as (session, base):
        code, answer, headers = await post(session, base, "node-a", report("node-a", [pod("web", "w1")]))
        assert (code, answer["reason"], headers["Retry-After"]) == (503, "NotReady", "2")
        assert "pods" in answer["error"] and not state.latest
        synced["ok"] = True
        assert (await post(session, base, "node-a", report("node-a", [pod("web", "w1")])))[0] == 200


async def test_measured_total_is_the_sum_of_node_egress():
    state = new_state()
    async with serve(state) as (session, base):
        await post(session, base, "node-a", report("node-a", [pod("web", "w1", usage=10e6)],
                                                   node_internet_egress_bps=30e6))
        await post(session, base, "node-b", report("node-b", [pod("web", "w2", usage=10e6)],
                                                   node_internet_egress_bps=25e6))
        result = state.run_round()
    assert result.summary.used_bps == pytest.approx(55e6)


async def test_new_term_never_answers_from_an_old_round():
    state = new_state()
    async with serve(state) as (session, base):
        await post(session, base, "node-a", report("node-a", [pod("web", "w1")]))
        state.run_round()
        state.on_leadership(True)
        _, answer, _ = await post(session, base, "node-a", report("node-a", [pod("web", "w1")]))
    assert (answer["generation"], answer["pods"]) == (0, [])


# -- followers ---------------------------------------------------------------------------------

async def test_follower_redirects_to_the_leader():
    state = new_state(leader=lambda: False, leader_address=lambda: "10.1.2.3:9561")
    async with serve(state, self_address="10.9.9.9:9561") as (session, base):
        code, answer, headers = await post(session, base, "node-a", report("node-a", []))
    assert code == 307
    assert headers["Location"] == "https://10.1.2.3:9561/v1/nodes/node-a/report"  # the scheme it serves: https
    assert (answer["reason"], answer["leader"]) == ("NotLeader", "10.1.2.3:9561")
    assert not state.latest  # a follower stores nothing


@pytest.mark.parametrize("leader_address", [None, "10.9.9.9:9561"], ids=["no leader", "stale lease naming us"])
async def test_follower_without_a_leader_answers_503(leader_address):
    state = new_state(leader=lambda: False, leader_address=lambda: leader_address)
    async with serve(state, self_address="10.9.9.9:9561") as (session, base):
        code, answer, headers = await post(session, base, "node-a", report("node-a", []))
    assert (code, answer["reason"], headers["Retry-After"]) == (503, "NoLeader", "2")


# -- authentication (TokenReview answered by a function; the real one in test_controller_kube) ----

AGENT_SA = "system:serviceaccount:netagent:netagent-agent"


def jwt(sub: str = AGENT_SA, node: str = "node-a", aud=(AUDIENCE,), exp: float | None = None, sig: str = "sig") -> str:
    """A token shaped as the kubelet's projected tokens are (its signature is not checked here:
    the stand-in review decides, as the API server's does)."""
    import base64
    import time

    def part(obj) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims = {"sub": sub, "aud": list(aud), "exp": int(exp if exp is not None else time.time() + 3600),
              "kubernetes.io": {"node": {"name": node}}}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.{sig}"


def review_for(tokens: dict[str, tuple[str, str]], calls: list, delay: float = 0.0):
    """token -> (username, node), answering as the API server's TokenReview status does."""
    import time

    def review(token: str) -> dict:
        calls.append(token)
        time.sleep(delay)
        if token not in tokens:
            return {"authenticated": False, "error": "invalid bearer token"}
        user, node = tokens[token]
        return {"authenticated": True, "audiences": [AUDIENCE],
                "user": {"username": user, "extra": {NODE_CLAIM: [node], POD_CLAIM: ["agent"]}}}
    return review


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


async def test_token_must_be_valid_bound_to_the_node_and_the_agents():
    calls: list[str] = []
    tok_a, forged = jwt(), jwt(sig="forged")
    tok_other = jwt(sub="system:serviceaccount:x:y")
    review = review_for({tok_a: (AGENT_SA, "node-a"), tok_other: ("system:serviceaccount:x:y", "node-a")}, calls)
    auth = TokenAuthenticator(review, allowed_user=service_account_username("netagent:netagent-agent"))
    state = new_state()
    async with serve(state, auth) as (session, base):
        code, answer, _ = await post(session, base, "node-a", report("node-a", []))
        assert (code, answer["reason"]) == (401, "Unauthenticated") and "missing bearer token" in answer["error"]
        code, answer, _ = await post(session, base, "node-a", report("node-a", []), bearer(forged))
        assert (code, answer["reason"]) == (401, "Unauthenticated") and "invalid bearer token" in answer["error"]
        code, answer, _ = await post(session, base, "node-b", report("node-b", []), bearer(tok_a))
        assert (code, answer["reason"]) == (403, "WrongNode")
        code, answer, _ = await post(session, base, "node-a", report("node-a", []), bearer(tok_other))
        assert (code, answer["reason"]) == (403, "Forbidden")
        for _ in range(3):
            code, _, _ = await post(session, base, "node-a", report("node-a", []), bearer(tok_a))
            assert code == 200
        await post(session, base, "node-a", report("node-a", []), bearer(forged))
        # malformed, expired or for another audience: refused without any TokenReview
        for junk, why in (("not-a-jwt", "not a JWT"), ("a.b.c", "not JSON"), (jwt(exp=1), "expired"),
                          (jwt(aud=("https://kubernetes.default.svc",)), "audience"),
                          (jwt(sig="s" * 5000), "not a JWT")):
            code, answer, _ = await post(session, base, "node-a", report("node-a", []), bearer(junk))
            assert (code, answer["reason"]) == (401, "Unauthenticated") and why in answer["error"], answer
    assert sorted(calls) == sorted([forged, tok_a])  # good verdicts cached; the other SA never reviewed
    assert set(state.latest) == {"node-a"}


async def test_review_must_confirm_the_audience():
    tok = jwt()

    def review(token: str) -> dict:  # the API server authenticated it, but for its own audience only
        return {"authenticated": True, "audiences": ["https://kubernetes.default.svc"],
                "user": {"username": AGENT_SA, "extra": {NODE_CLAIM: ["node-a"]}}}

    async with serve(new_state(), TokenAuthenticator(review)) as (session, base):
        code, answer, _ = await post(session, base, "node-a", report("node-a", []), bearer(tok))
    assert (code, answer["reason"]) == (401, "Unauthenticated") and "audience" in answer["error"]


async def test_follower_authenticates_before_it_names_the_leader():
    calls: list[str] = []
    tok = jwt()
    auth = TokenAuthenticator(review_for({tok: (AGENT_SA, "node-a")}, calls))
    state = new_state(leader=lambda: False, leader_address=lambda: "10.1.2.3:9561")
    async with serve(state, auth, self_address="10.9.9.9:9561") as (session, base):
        code, answer, headers = await post(session, base, "node-a", report("node-a", []))
        assert (code, answer["reason"]) == (401, "Unauthenticated")
        assert "10.1.2.3" not in json.dumps(answer) and "Location" not in headers
        code, answer, headers = await post(session, base, "node-a", report("node-a", []), bearer(jwt(sig="x")))
        assert code == 401 and "Location" not in headers
        code, answer, headers = await post(session, base, "node-a", report("node-a", []), bearer(tok))
        assert (code, answer["leader"]) == (307, "10.1.2.3:9561")


async def test_review_outage_is_503_not_the_agents_fault():
    def review(token: str) -> dict:
        raise ConnectionRefusedError("apiserver down")

    async with serve(new_state(), TokenAuthenticator(review)) as (session, base):
        code, answer, _ = await post(session, base, "node-a", report("node-a", []), bearer(jwt()))
    assert (code, answer["reason"]) == (503, "AuthUnavailable")


def test_recent_good_verdicts_hold_through_an_outage_for_a_bounded_grace():
    now = [1000.0]
    up = [True]
    tok, stranger = jwt(exp=1000.0 + 7200), jwt(sig="other", exp=1000.0 + 7200)

    def review(token: str) -> dict:
        if not up[0]:
            raise ConnectionRefusedError("apiserver down")
        return review_for({tok: (AGENT_SA, "node-a")}, [])(token)

    auth = TokenAuthenticator(review, ttl=60, grace=600, clock=lambda: now[0], monotonic=lambda: now[0])
    assert auth.authenticate(f"Bearer {tok}").node == "node-a"
    up[0] = False
    now[0] += 300  # past the cache TTL, within the grace: the outage does not cost the agent its answers
    assert auth.authenticate(f"Bearer {tok}").node == "node-a" and auth.grace_used == 1
    with pytest.raises(ConnectionRefusedError):  # a token never verified is not let in
        auth.authenticate(f"Bearer {stranger}")
    now[0] += 400  # past the grace: fail closed
    with pytest.raises(ConnectionRefusedError):
        auth.authenticate(f"Bearer {tok}")


def test_token_cache_honours_expiry_and_is_bounded():
    now = [1000.0]
    calls: list[str] = []
    short = jwt(exp=1000.0 + 10)
    tokens = {short: (AGENT_SA, "node-a"), **{jwt(sig=f"s{i}"): (AGENT_SA, "node-a") for i in range(50)}}
    auth = TokenAuthenticator(review_for(tokens, calls), ttl=60, max_entries=20, clock=lambda: now[0],
                              monotonic=lambda: now[0])
    auth.authenticate(f"Bearer {short}")
    now[0] += 11  # the token's own exp is sooner than the cache TTL
    with pytest.raises(Exception, match="expired"):
        auth.cached(f"Bearer {short}")
    for token in list(tokens)[1:]:
        auth.authenticate(f"Bearer {token}")
    assert len(auth) == 20  # least recently used verdicts are evicted


def test_agents_reviewed_at_once_are_not_reviewed_at_once_again():
    """1,000 agents reviewed in the same second (a controller's start, a failover): with every verdict
    fresh for the same 60 s they were all reviewed again in the same second every minute, a burst
    of 1,000 TokenReviews (finding 11 of docs/scale.md). Each verdict's freshness is spread over
    45-60 s: no second of the next cycles holds more than a tenth of them, no verdict is reused
    past the 60 s, and the reviews average about one an agent a minute."""
    import random

    now = [1000.0]
    calls: list[str] = []
    tokens = {jwt(sig=f"a{i}"): (AGENT_SA, f"node-{i}") for i in range(1000)}
    auth = TokenAuthenticator(review_for(tokens, calls), ttl=60, clock=lambda: now[0], monotonic=lambda: now[0],
                              rng=random.Random(7))
    reviewed_at: dict[str, float] = {}
    per_second: list[int] = []
    for _ in range(600):  # ten minutes, every agent reporting every second
        before = len(calls)
        for token in tokens:
            if auth.cached(f"Bearer {token}") is None:
                auth.authenticate(f"Bearer {token}")
                if token in reviewed_at:
                    assert now[0] - reviewed_at[token] <= 60.0 + 1.0  # never reused past the TTL
                reviewed_at[token] = now[0]
        per_second.append(len(calls) - before)
        now[0] += 1.0
    assert per_second[0] == 1000
    assert max(per_second[1:]) <= 100, max(per_second[1:])
    assert 1000 * 600 / 60 <= sum(per_second) <= 1000 * 600 / 45 + 1000


async def test_junk_tokens_never_delay_a_real_agent():
    """1,000 well-formed junk tokens a second from one pod (each would need a TokenReview that takes
    20 ms) while a real agent with a token the controller has not seen yet reports: the agent is
    answered within its 3 s timeout."""
    import time

    calls: list[str] = []
    tok = jwt(sig="real")
    auth = TokenAuthenticator(review_for({tok: (AGENT_SA, "node-a")}, calls, delay=0.02),
                              allowed_user=AGENT_SA)
    state = new_state()
    async with serve(state, auth) as (session, base):
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0), limit=200)
        async with aiohttp.ClientSession(connector=connector) as junk_session:
            stop = asyncio.Event()
            statuses: list[int] = []

            async def flood():
                i = 0
                while not stop.is_set():
                    batch = [post(junk_session, base, "node-a", report("node-a", []), bearer(jwt(sig=f"junk{i + k}")))
                             for k in range(50)]
                    i += 50
                    statuses.extend(r[0] for r in await asyncio.gather(*batch))
                    await asyncio.sleep(0.05)

            flooding = asyncio.ensure_future(flood())
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            async with session.post(f"{base}/v1/nodes/node-a/report", data=json.dumps(report("node-a", [])),
                                    headers=bearer(tok), timeout=aiohttp.ClientTimeout(total=3)) as r:
                assert r.status == 200, await r.text()
            waited = time.monotonic() - t0
            while len(statuses) < 500 and not flooding.done():  # the flood's size, not its duration, is the point
                await asyncio.sleep(0.05)
            stop.set()
            await flooding
    assert len(statuses) >= 500 and 429 in statuses  # the flood ran and was turned away at the gate
    assert sum(1 for c in calls if c != tok) < len(statuses) / 5  # few junk tokens cost a review
    assert waited < 3


async def test_policy_change_between_report_and_round_uses_the_new_policy():
    from core.policy import load_policy

    current = {"value": load_policy(CLASSES, [BUDGET])}
    state = ControllerState(Allocator(lambda: current["value"]))
    async with serve(state) as (session, base):
        await post(session, base, "node-a", report("node-a", [pod("web", "w1", 90e6), pod("research", "r1", 90e6)]))
        smaller = {**BUDGET, "spec": {**BUDGET["spec"], "total": "10M", "teams": [
            {"name": "research", "namespaces": ["research"], "weight": 1, "defaultClass": "interactive"}]}}
        current["value"] = load_policy(CLASSES, [smaller])  # resolved at submit against the old one
        result = state.run_round()
        _, answer, _ = await post(session, base, "node-a", report("node-a", []))
    got = {p["name"]: p for p in answer["pods"]}
    assert (got["w1"]["team"], got["r1"]["team"], got["r1"]["egress_class"]) == ("default", "research", "interactive")
    assert sum(p["allocation_bps"] for p in answer["pods"]) <= 10e6 * (1 + 1e-9)
    assert result.summary.budget_bps == 10e6


def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                        max_leaves=12)


async def test_arbitrary_input_never_crashes_or_corrupts():
    """Random JSON, and valid reports with one field replaced by a random value: always a 200 or
    a clear 4xx, never a 500, and the other node's allocation is untouched."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    state = new_state()
    fields = ["node", "pods", "seq", "period_seconds", "node_internet_egress_bps", "node_internet_ingress_bps",
              "shapes_ingress"]
    pod_fields = ["namespace", "name", "usage_bps", "demand_bps", "throttled", "egress_class", "egress_bandwidth",
                  "ingress_usage_bps", "ingress_demand_bps", "ingress_throttled", "ingress_bandwidth"]
    async with serve(state, per_node_rate=1e6, per_node_burst=1e6) as (session, base):
        assert (await post(session, base, "node-b", report("node-b", [pod("web", "w1")])))[0] == 200
        state.run_round()
        before = state.result.by_node["node-b"]
        seen: list[int] = []

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.one_of(
            _json_values().map(lambda v: ("whole", None, v)),
            st.tuples(st.just("field"), st.sampled_from(fields), _json_values()),
            st.tuples(st.just("pod"), st.sampled_from(pod_fields), _json_values()),
        ))
        def check(case):
            kind, name, value = case
            if kind == "whole":
                body = value
            elif kind == "field":
                body = {**report("node-a", [pod("web", "a1")]), name: value}
            else:
                body = report("node-a", [{**pod("web", "a1"), name: value}])
            seen.append(asyncio.run_coroutine_threadsafe(post(session, base, "node-a", body), loop).result()[0])

        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, check)
        assert set(seen) <= {200, 400, 422}, sorted(set(seen))
        assert 422 in seen
        assert state.result.by_node["node-b"] == before
        assert (await post(session, base, "node-a", report("node-a", [pod("web", "a1")])))[0] == 200
        async with session.get(f"{base}/healthz") as r:
            assert r.status == 200


async def test_answer_wait_answers_from_the_round_that_includes_the_report():
    state = new_state(answer_wait=10.0)
    async with serve(state) as (session, base):
        loop = asyncio.get_running_loop()
        posted = asyncio.ensure_future(post(session, base, "node-a", report("node-a", [pod("web", "w1")])))
        while "node-a" not in state.latest:  # the report is stored; its answer waits for the round
            await asyncio.sleep(0.01)
        assert not posted.done()
        await loop.run_in_executor(None, state.run_round)
        code, answer, _ = await posted
    assert (code, answer["generation"], [p["name"] for p in answer["pods"]]) == (200, 1, ["w1"])
    assert answer["problems"] == []


async def test_answer_wait_gives_up_after_its_bound():
    state = new_state(answer_wait=0.2)
    async with serve(state) as (session, base):
        code, answer, _ = await post(session, base, "node-a", report("node-a", [pod("web", "w1")]))
    assert (code, answer["generation"]) == (200, 0)  # no round came: the answer it had
    assert not state._round_waiters


# -- downloads (ingress): the same engine, its own total, only for agents that shape them ------------

IN_CLASSES = [
    {"kind": "EgressClass", "metadata": {"name": "bulk"}, "spec": {"weight": 1, "max": "80M"}},
    {"kind": "EgressClass", "metadata": {"name": "interactive"},
     "spec": {"weight": 3, "min": "5M", "ingress": {"weight": 3, "max": "30M"}}},
]
IN_BUDGET = {"kind": "EgressBudget", "metadata": {"name": "default"}, "spec": {
    "total": "100M", "ingressTotal": "60M",
    "teams": [
        {"name": "research", "namespaces": ["research"], "weight": 1, "defaultClass": "bulk", "ingress": {"weight": 2}},
        {"name": "web", "namespaces": ["web"], "weight": 2, "min": "10M"},  # no ingress block: weight 2
    ],
}}


def down(namespace: str, name: str, ingress_demand: float, cls: str | None = None, ingress_bandwidth=None,
         ingress_usage: float = 0.0) -> dict:
    return {**pod(namespace, name, 20e6, cls=cls), "ingress_demand_bps": ingress_demand,
            "ingress_usage_bps": ingress_usage, "ingress_bandwidth": ingress_bandwidth}


async def test_download_demand_above_ingress_total_is_shared_by_team_and_class_weights():
    """Two nodes whose agents shape downloads want 500M against ingressTotal 60M: the answers'
    download allocations add up to the budget, split by the teams' ingress weights (research 2,
    web 2 from its upload weight) and inside a team by the classes' (bulk 1, interactive 3, capped
    at 30M); uploads are allocated as before, against their own total."""
    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    a_pods = [down("research", "r1", 100e6), down("research", "r2", 100e6, cls="interactive"),
              down("web", "w1", 100e6)]
    b_pods = [down("web", "w2", 100e6), down("research", "r3", 100e6)]
    async with serve(state) as (session, base):
        for node, pods in (("node-a", a_pods), ("node-b", b_pods)):
            assert (await post(session, base, node, report(node, pods, shapes_ingress=True)))[0] == 200
        result = state.run_round()
        _, ans_a, _ = await post(session, base, "node-a", report("node-a", a_pods, shapes_ingress=True))
        _, ans_b, _ = await post(session, base, "node-b", report("node-b", b_pods, shapes_ingress=True))
    got = {p["name"]: p for p in ans_a["pods"] + ans_b["pods"]}
    assert sum(p["ingress_allocation_bps"] for p in got.values()) == pytest.approx(60e6)
    # teams 1:1 (30M each); research: r2 (interactive, 3) : r1 : r3 (bulk, 1 each) = 18 : 6 : 6
    assert got["w1"]["ingress_allocation_bps"] == pytest.approx(15e6)
    assert got["w2"]["ingress_allocation_bps"] == pytest.approx(15e6)
    assert got["r2"]["ingress_allocation_bps"] == pytest.approx(18e6)
    assert got["r1"]["ingress_allocation_bps"] == pytest.approx(6e6)
    assert got["r3"]["ingress_allocation_bps"] == pytest.approx(6e6)
    for p in got.values():
        assert p["ingress_allocation_bps"] <= p["ingress_limit_bps"] <= 60e6 * (1 + 1e-9)
    assert got["r2"]["ingress_limit_bps"] <= 30e6 * (1 + 1e-9)  # the class's download cap
    assert sum(p["ingress_limit_bps"] for p in got.values()) <= 60e6 * (1 + 1e-9)
    for answer in (ans_a, ans_b):
        assert answer["node_ingress_rate_bps"] == pytest.approx(
            min(60e6, sum(p["ingress_limit_bps"] for p in answer["pods"])))
        assert answer["safe_ingress_floor_bps"] == pytest.approx(60e6 / 5)
    # uploads: their own total and weights (web 2 : research 1 of 100M, 20M demand each)
    assert sum(p["allocation_bps"] for p in got.values()) == pytest.approx(100e6)
    assert answer["safe_floor_bps"] == pytest.approx(100e6 / 5)
    ingress = result.summary.ingress
    assert (ingress.budget_bps, ingress.allocated_bps, ingress.demand_bps, ingress.nodes, ingress.pods) == \
        (60e6, pytest.approx(60e6), 500e6, 2, 5)
    assert ingress.teams["research"].allocated_bps == pytest.approx(30e6)
    assert ingress.groups[("research", "interactive")].allocated_bps == pytest.approx(18e6)
    assert result.summary.budget_bps == 100e6 and result.summary.demand_bps == pytest.approx(100e6)


async def test_an_agent_that_does_not_shape_downloads_gets_no_download_answer():
    """Older agents (no shapes_ingress) get None in every download field and their pods take no share
    of the download budget, even if their report carries download numbers."""
    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    async with serve(state) as (session, base):
        await post(session, base, "node-a", report("node-a", [down("web", "w1", 100e6)], shapes_ingress=True))
        await post(session, base, "node-old", report("node-old", [down("web", "w2", 100e6)]))
        result = state.run_round()
        _, new, _ = await post(session, base, "node-a", report("node-a", [down("web", "w1", 100e6)],
                                                                shapes_ingress=True))
        _, old, _ = await post(session, base, "node-old", report("node-old", [down("web", "w2", 100e6)]))
    assert new["pods"][0]["ingress_allocation_bps"] == pytest.approx(60e6)  # alone in the download budget
    assert (old["node_ingress_rate_bps"], old["safe_ingress_floor_bps"]) == (None, None)
    assert (old["pods"][0]["ingress_allocation_bps"], old["pods"][0]["ingress_limit_bps"]) == (None, None)
    assert old["pods"][0]["allocation_bps"] == pytest.approx(20e6)  # uploads as ever
    assert result.summary.ingress.nodes == 1 and result.summary.nodes == 2


async def test_bad_ingress_bandwidth_annotation_keeps_the_class_download_values():
    """A malformed kubernetes.io/ingress-bandwidth is ignored for that pod (its class's download
    values, reason InvalidIngressBandwidth, which the agent turns into an Event); a good one caps;
    an oversize one refuses that pod alone, as for the upload annotation."""
    from core.policy import REASON_INVALID_INGRESS_BANDWIDTH, resolve_pod

    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    pods = [down("research", "bad", 100e6, cls="interactive", ingress_bandwidth="-5M"),
            down("research", "capped", 100e6, cls="interactive", ingress_bandwidth="2M"),
            down("research", "huge", 100e6, ingress_bandwidth="9" * (MAX_ANNOTATION_VALUE + 1)),
            down("web", "fine", 100e6)]
    async with serve(state) as (session, base):
        code, answer, _ = await post(session, base, "node-a", report("node-a", pods, shapes_ingress=True))
        assert code == 200 and answer["refused"] == [{"namespace": "research", "name": "huge",
                                                      "reason": "AnnotationTooLong"}]
        state.run_round()
        _, answer, _ = await post(session, base, "node-a", report("node-a", pods, shapes_ingress=True))
    got = {p["name"]: p for p in answer["pods"]}
    assert set(got) == {"bad", "capped", "fine"}
    assert got["capped"]["ingress_limit_bps"] <= 2e6 * (1 + 1e-9)
    assert got["bad"]["ingress_allocation_bps"] == pytest.approx(28e6)  # 30M for research, less capped's 2M
    assert got["bad"]["ingress_limit_bps"] <= 30e6 * (1 + 1e-9)  # the class's cap, not unshaped
    assert got["fine"]["ingress_allocation_bps"] == pytest.approx(30e6)
    policy, _ = policy_source(IN_CLASSES, (IN_BUDGET,))()
    (reason, message), = resolve_pod(policy, "research", "interactive", None,
                                     ingress_bandwidth_annotation="-5M").problems
    assert reason == REASON_INVALID_INGRESS_BANDWIDTH and "kubernetes.io/ingress-bandwidth" in message


def test_controller_metrics_have_download_twins():
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics
    from core.wire import NodeReport, PodReport

    state = ControllerState(Allocator(policy_source(IN_CLASSES, (IN_BUDGET,))), lease_seconds=30.0)
    metrics = ControllerMetrics(state, lambda: True)
    state.submit(None, NodeReport("node-old", [PodReport("web", "o", 0, 1e6)]))
    state.run_round()
    before = generate_latest(metrics.registry).decode()
    assert "netagent_controller_budget_bytes_per_second 1.25e+07" in before
    # no agent shapes downloads yet: the download budget alone, with no agent keeping it (the
    # NetagentIngressNotShaped alert reads exactly this), and no per-team download view
    assert "netagent_controller_ingress_agents 0.0" in before
    assert "netagent_controller_ingress_budget_bytes_per_second 7.5e+06" in before
    assert "netagent_controller_ingress_allocated_bytes_per_second{" not in before
    plain = new_state()  # a budget without spec.ingressTotal: no download view at all
    plain_metrics = ControllerMetrics(plain, lambda: True)
    plain.submit(None, NodeReport("node-old", [PodReport("web", "o", 0, 1e6)]))
    plain.run_round()
    assert "netagent_controller_ingress_" not in generate_latest(plain_metrics.registry).decode()
    state.submit(None, NodeReport("node-a", [PodReport("web", "w", 0, 1e6, ingress_demand_bps=1e9)],
                                  shapes_ingress=True))
    state.run_round()
    text = generate_latest(metrics.registry).decode()
    for line in ("netagent_controller_ingress_budget_bytes_per_second 7.5e+06",
                 'netagent_controller_ingress_allocated_bytes_per_second{class="default",team="web"} 7.5e+06',
                 'netagent_controller_ingress_demand_bytes_per_second{class="default",team="web"} 1.25e+08',
                 'netagent_controller_ingress_used_bytes_per_second{class="default",team="web"} 0.0',
                 'netagent_controller_ingress_guarantee_unmet{team="web"} 0.0',
                 "netagent_controller_ingress_feedback_gain 1.0", "netagent_controller_ingress_oversubscribed 0.0",
                 "netagent_controller_ingress_agents 1.0", "netagent_controller_ingress_safe_floor_bytes_per_second",
                 'netagent_controller_allocated_bytes_per_second{class="default",team="web"} 250000.0'):
        assert line in text, line


def test_refused_pods_keep_the_reports_download_fields():
    """A report with a refused pod is stored without that pod but with all its other fields."""
    from core.wire import NodeReport, PodReport

    state = new_state()
    pods = [PodReport("web", "a", 0, 1e6), PodReport("web", "a", 0, 1e6)]  # a duplicate
    state.submit(None, NodeReport("node-a", pods, 3, 5.0, 1e6, node_internet_ingress_bps=7e6, shapes_ingress=True))
    stored = state.latest["node-a"][1].report
    assert (len(stored.pods), stored.node_internet_ingress_bps, stored.shapes_ingress) == (1, 7e6, True)


def _ingress_gain(ingress_of, rounds=8) -> tuple[float, float]:
    """(upload gain, download gain) after `rounds` rounds of ten nodes reporting."""
    from core.wire import NodeReport, PodReport

    now = [0.0]
    alloc = Allocator(policy_source(IN_CLASSES, (IN_BUDGET,)), clock=lambda: now[0])
    result = None
    for _ in range(rounds):
        now[0] += 5.0
        reports = {}
        for n in range(10):
            pods = [PodReport("web", f"p{n}", usage_bps=8e6, demand_bps=10e6, ingress_usage_bps=5e6,
                              ingress_demand_bps=6e6)]
            ingress = ingress_of(n)
            reports[f"node-{n}"] = alloc.prepare(NodeReport(f"node-{n}", pods, 1, 5.0, 8e6,
                                                            node_internet_ingress_bps=ingress, shapes_ingress=True))
        result = alloc(reports)
    return result.summary.gain, result.summary.ingress.gain


def test_download_gain_is_its_own_and_bounded_per_node():
    """The download gain follows node_internet_ingress_bps (other traffic the pods' classes do not
    carry lowers it) without touching the upload gain; one node's absurd download total is clamped
    to what it was allocated plus a margin, as for uploads."""
    honest = _ingress_gain(lambda n: 5e6)
    assert honest == (pytest.approx(1.0, abs=0.01), pytest.approx(1.0, abs=0.01))
    from core.wire import NodeReport, PodReport

    # 10% more arrives than the pods' classes carried, at full use of the budget (6M x 10 = the 60M): gain < 1
    now = [0.0]
    alloc = Allocator(policy_source(IN_CLASSES, (IN_BUDGET,)), clock=lambda: now[0])
    for _ in range(12):
        now[0] += 5.0
        reports = {f"node-{n}": alloc.prepare(NodeReport(
            f"node-{n}", [PodReport("web", f"p{n}", 8e6, 10e6, ingress_usage_bps=6e6, ingress_demand_bps=20e6)],
            1, 5.0, 8e6, node_internet_ingress_bps=6.6e6, shapes_ingress=True)) for n in range(10)}
        result = alloc(reports)
    assert result.summary.gain == pytest.approx(1.0, abs=0.01)
    assert result.summary.ingress.gain == pytest.approx(1 / 1.1, abs=0.02)
    assert result.summary.ingress.allocated_bps == pytest.approx(60e6 * result.summary.ingress.gain)
    lied = _ingress_gain(lambda n: 1e18 if n == 0 else 5e6)
    assert lied[0] == pytest.approx(1.0, abs=0.01) and lied[1] > 0.9


# -- bounded memory, robust aggregation, Events ------------------------------------------------------

def test_one_nodes_absurd_egress_does_not_move_the_cluster():
    """Nine honest nodes report their egress, one reports 1e18 bit/s: its word on the measured total
    is clamped to what it was allocated plus a margin, so the gain stays near 1 (unclamped it would
    fall to its floor, 0.5: half the cluster's capacity gone)."""
    from core.wire import NodeReport, PodReport

    now = [0.0]

    def run(liar: bool) -> float:
        alloc = Allocator(policy_source(), clock=lambda: now[0])
        result = None
        for _ in range(8):
            now[0] += 5.0
            reports = {}
            for n in range(10):
                pods = [PodReport("web", f"p{n}", usage_bps=8e6, demand_bps=10e6)]
                egress = 1e18 if (liar and n == 0) else 8e6
                reports[f"node-{n}"] = alloc.prepare(NodeReport(f"node-{n}", pods, 1, 5.0, egress))
            result = alloc(reports)
        return result.summary.gain

    honest, lied = run(False), run(True)
    assert honest == pytest.approx(1.0, abs=0.01)
    assert lied > 0.9


def test_resolution_cache_is_bounded(monkeypatch):
    """Agent-supplied annotation strings key the resolution cache: it starts afresh when full, and
    reports prepared against the old one are resolved again, correctly."""
    from controller import allocator as allocator_module
    from core.wire import NodeReport, PodReport

    monkeypatch.setattr(allocator_module, "MAX_RESOLVED", 8)
    alloc = Allocator(policy_source())
    reports = {}
    for n in range(20):
        pods = [PodReport("research", f"r{n}", usage_bps=0, demand_bps=1e6, egress_class="bulk",
                          egress_bandwidth=f"{n + 1}M")]
        reports[f"node-{n}"] = alloc.prepare(NodeReport(f"node-{n}", pods, 1, 5.0, 0.0))
        assert len(alloc._tables[6]) <= 8
    result = alloc(reports)
    for n in range(20):
        (a,) = result.by_node[f"node-{n}"]
        assert (a.team, a.egress_class) == ("research", "bulk") and a.limit_bps <= (n + 1) * 1e6 * (1 + 1e-9)


def test_events_are_written_from_a_bounded_queue_and_dropped_when_full():
    import threading

    from controller.events import EventWriter

    release = threading.Event()
    written, results = [], []

    def create(namespace, body):  # an API server that hangs until released
        release.wait(10)
        written.append((namespace, body["involvedObject"]["name"], body["reason"]))

    events = EventWriter(create, max_queue=4, on_result=results.append)
    events.start()
    try:
        queued = [events.pod_event("web", f"p{i}", "RefusedAnnotationTooLong", "too long") for i in range(10)]
        assert not events.pod_event("web", "p0", "RefusedAnnotationTooLong", "again")  # told recently: not again
        assert queued.count(True) <= 5 and results.count("dropped") >= 5  # never blocks the caller: drops, counts
        release.set()
        wait_for(lambda: results.count("ok") == queued.count(True), what="the queued Events written")
        assert len(written) == queued.count(True)
    finally:
        release.set()
        events.stop()


def test_a_new_leader_shares_only_the_heard_nodes_part_of_the_budget_until_the_report_ttl():
    """After a failover the nodes not heard from yet keep the old leader's answers (then their floor):
    the new leader holds their part of both budgets back (heard / known nodes) for the report TTL,
    so the cluster total never passes the budget while agents find it; afterwards it shares it all."""
    from core.wire import NodeReport, PodReport

    now = [1000.0]
    alloc = Allocator(policy_source(IN_CLASSES, (IN_BUDGET,)), clock=lambda: now[0],
                      known_pods=lambda: 40, known_nodes=lambda: 4, takeover_seconds=150.0)
    state = ControllerState(alloc, lease_seconds=30.0, report_ttl=1e9)

    def node_report(node: str) -> NodeReport:  # ten pods that each want far more than the budget
        pods = [PodReport("research", f"{node}-{i}", usage_bps=0.0, demand_bps=80e6, ingress_demand_bps=30e6)
                for i in range(10)]
        return NodeReport(node, pods, 1, 5.0, shapes_ingress=True)

    def totals(result) -> tuple[float, float]:
        up = sum(p.limit_bps for node in result.by_node for p in result.by_node[node])
        down = sum(p.ingress_limit_bps for node in result.by_node for p in result.by_node[node])
        return up, down

    # the first term of a fresh replica holds back too: agents may hold answers of a controller before it
    state.on_leadership(True)
    state.submit(None, node_report("node-a"))
    result = state.run_round()
    up, down = totals(result)
    assert up == pytest.approx(25e6, rel=0.01) and down == pytest.approx(15e6, rel=0.01)
    assert (result.summary.held_back_bps, result.summary.ingress.held_back_bps) == (75e6, 45e6)
    assert result.node_rate["node-a"] <= 25e6 * 1.01
    assert result.safe_floor_bps == pytest.approx(100e6 / 40)  # the floor is the whole budget's, per pod

    now[0] += 60.0
    state.submit(None, node_report("node-b"))
    up, down = totals(state.run_round())
    assert up == pytest.approx(50e6, rel=0.01) and down == pytest.approx(30e6, rel=0.01)

    now[0] += 91.0  # the report TTL since the term began: silent nodes are no longer held for
    result = state.run_round()
    up, down = totals(result)
    assert up == pytest.approx(100e6, rel=0.01) and down == pytest.approx(60e6, rel=0.01)
    assert result.summary.held_back_bps == 0.0

    # a follower again, then leader again: a new term holds back again
    state.on_leadership(False)
    state.on_leadership(True)
    state.submit(None, node_report("node-a"))
    state.submit(None, node_report("node-b"))
    state.submit(None, node_report("node-c"))
    up, _ = totals(state.run_round())
    assert up == pytest.approx(75e6, rel=0.01)


# -- failover in seconds: a new term answers from its first round, not after the period's tick -----

async def test_a_new_terms_first_reports_are_answered_from_a_round_without_waiting_for_the_period():
    """The allocation loop runs every 60 s here, so only the new-term wake can explain an answer
    from a round: the term's first reports are held (FIRST_ROUND_WAIT) and answered from its first
    round, run FIRST_ROUND_GATHER after the first report; a node that reports after that round is
    answered at once with generation 0 (keep what you have), never held for the next tick. The
    takeover hold-back bounds that round: one of four known nodes heard, a quarter of the budget."""
    alloc = Allocator(policy_source(), known_pods=lambda: 4, known_nodes=lambda: 4, takeover_seconds=150.0)
    state = ControllerState(alloc, lease_seconds=120.0, report_ttl=150.0)
    state.on_leadership(True)
    state.start(60.0)
    try:
        async with serve(state) as (session, base):
            answers = await asyncio.gather(*(post(session, base, node, report(node, [pod("research", f"{node}-p",
                                                                                            demand=300e6)]))
                                             for node in ("node-a", "node-b")))
            for code, answer, _ in answers:
                assert (code, answer["generation"]) == (200, 1), answer
                assert answer["problems"] == []
            assert sum(p["limit_bps"] for _, a, _ in answers for p in a["pods"]) <= 50e6 * 1.01  # 2 of 4 heard
            code, late, _ = await post(session, base, "node-c", report("node-c", [pod("research", "c-p")]))
            assert (code, late["generation"], late["pods"]) == (200, 0, [])  # not in the round: at once
            assert not state._round_waiters
            # a follower, then leader again: the new term starts from nothing and answers from its own round
            state.on_leadership(False)
            state.on_leadership(True)
            code, again, _ = await post(session, base, "node-c", report("node-c", [pod("research", "c-p")]))
            assert (code, again["generation"]) == (200, 2)
            assert [p["name"] for p in again["pods"]] == ["c-p"]
    finally:
        state.stop()


def test_a_silent_node_ages_out_after_the_report_ttl_and_is_counted():
    """A node that stops reporting keeps its share for --report-ttl (it may still enforce its last
    answer for the lease), then leaves the rounds: the others get its share, and the metric counts it."""
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics
    from core.wire import NodeReport, PodReport

    now = [1000.0]  # the TTL judged on a clock the test moves (no sleeping)
    state = ControllerState(Allocator(policy_source()), lease_seconds=30.0, report_ttl=60.0, clock=lambda: now[0])
    metrics = ControllerMetrics(state, lambda: True)

    def node_report(node: str) -> NodeReport:
        return NodeReport(node, [PodReport("research", f"{node}-p", usage_bps=0.0, demand_bps=300e6)], 1, 5.0)

    state.submit(None, node_report("node-a"))
    state.submit(None, node_report("node-b"))
    first = state.run_round()
    assert first.node_rate["node-a"] == pytest.approx(50e6, rel=0.01)
    now[0] += 59.0
    state.submit(None, node_report("node-a"))  # node b is silent from here on
    assert state.run_round().node_rate["node-a"] == pytest.approx(50e6, rel=0.01)  # b's share still held
    now[0] += 2.0
    result = state.run_round()
    assert "node-b" not in result.node_rate and result.node_rate["node-a"] == pytest.approx(80e6, rel=0.01)
    assert state.expired_nodes == 1
    assert "netagent_controller_expired_agents_total 1.0" in generate_latest(metrics.registry).decode()


def test_a_node_reporting_1000x_its_use_takes_at_most_its_weighted_share_and_is_counted():
    """Bad input: node a's pod uses 10M and reports 1,000x that as its (unthrottled) demand. The
    engine treats it as real demand, so the pod takes its weighted fair share and no more: the three
    honest pods (40M wanted each, same class and weight) keep a quarter of the budget each (25M;
    30M with an honest neighbour): the others lose at most the liar's share minus its use. Under a
    cap (kubernetes.io/egress-bandwidth 5M) the lie gains nothing above the cap. The gauge counts it."""
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics
    from core.wire import NodeReport, PodReport

    def run(liar_bandwidth: str | None) -> tuple[ControllerState, dict[str, float]]:
        state = ControllerState(Allocator(policy_source()), lease_seconds=30.0, report_ttl=60.0)
        state.submit(None, NodeReport("node-a", [PodReport("research", "liar", usage_bps=10e6, demand_bps=10e9,
                                                           egress_bandwidth=liar_bandwidth)], 1, 5.0))
        for node in ("node-b", "node-c", "node-d"):
            state.submit(None, NodeReport(node, [PodReport("research", f"{node}-p", usage_bps=40e6,
                                                           demand_bps=40e6)], 1, 5.0))
        result = state.run_round()
        return state, {p.name: p.allocation_bps for pods in result.by_node.values() for p in pods}

    state, shares = run(None)
    assert shares["liar"] == pytest.approx(25e6, rel=0.01)  # its weighted share, not the 80M class cap
    for node in ("node-b", "node-c", "node-d"):
        assert shares[f"{node}-p"] == pytest.approx(25e6, rel=0.01)
    assert state.demand_above_use == 1
    assert "netagent_controller_demand_above_use_pods 1.0" in generate_latest(
        ControllerMetrics(state, lambda: True).registry).decode()

    state, shares = run("5M")
    assert shares["liar"] <= 5e6 * 1.0001
    for node in ("node-b", "node-c", "node-d"):
        assert shares[f"{node}-p"] == pytest.approx(95e6 / 3, rel=0.01)  # the rest, shared
