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

from controller.allocator import Allocator
from controller.api import MAX_BODY, make_app
from controller.state import ControllerState
from core.direction import PerDirection
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
        pp = resolve_pod(policy, p["namespace"], p["egress_class"], PerDirection(p["egress_bandwidth"], None))
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
