"""The TokenReview gate's agent-pod check and lanes, and the verdict cache's clocks (controller/auth.py,
controller/api.py ReviewGate), as pure logic and through the real aiohttp app. The TokenReview
here is a stand-in that answers as the API server's does (tests/test_controller_auth.py
`review_for`); the real one is in tests/test_controller_authflood.py."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import Counter

import aiohttp
import pytest

from controller.api import MAX_REVIEWS_PENDING, APIStats, ReviewGate
from controller.auth import AUDIENCE, NODE_CLAIM, POD_CLAIM, AgentPod, AuthError, TokenAuthenticator, check_agent_pod
from tests.test_controller_api import new_state, post, report, serve
from tests.test_controller_auth import AGENT_SA

NS = "netagent"


def pod_jwt(pod: str = "agent-a", uid: str = "uid-a", node: str = "node-a", namespace: str = NS,
            sig: str = "sig", exp: float | None = None, sub: str = AGENT_SA) -> str:
    """Shaped as the kubelet's projected token: `kubernetes.io` claims name the pod (name, uid) and node."""
    def part(obj) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims = {"sub": sub, "aud": [AUDIENCE], "exp": int(exp if exp is not None else time.time() + 3600),
              "kubernetes.io": {"namespace": namespace, "pod": {"name": pod, "uid": uid},
                                "node": {"name": node, "uid": "n-" + node}}}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.{sig}"


def claims_of(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


PODS = {
    (NS, "agent-a"): AgentPod("node-a", "uid-a", terminating=False, finished=False),
    (NS, "agent-b"): AgentPod("node-b", "uid-b", terminating=False, finished=False),
    (NS, "agent-gone"): AgentPod("node-c", "uid-c", terminating=True, finished=False),
    (NS, "agent-done"): AgentPod("node-d", "uid-d", terminating=False, finished=True),
}


def reviewer(good: set[str], calls: list[str], delay: float = 0.0):
    """The API server's TokenReview: `good` tokens are bound to the pod and node their claims name."""
    def review(token: str) -> dict:
        calls.append(token)
        time.sleep(delay)
        if token not in good:
            return {"authenticated": False, "error": "invalid bearer token"}
        k8s = claims_of(token)["kubernetes.io"]
        return {"authenticated": True, "audiences": [AUDIENCE],
                "user": {"username": AGENT_SA, "extra": {NODE_CLAIM: [k8s["node"]["name"]],
                                                         POD_CLAIM: [k8s["pod"]["name"]]}}}
    return review


@pytest.mark.parametrize("token, reason", [
    (pod_jwt(), None),
    (pod_jwt(pod="agent-x", uid="uid-x"), "UnknownAgentPod"),  # no such pod
    (pod_jwt(uid="uid-old"), "UnknownAgentPod"),  # the name of a live pod, the uid of one deleted
    (pod_jwt(namespace="tenant"), "UnknownAgentPod"),  # a tenant's pod of the same name
    (pod_jwt(node="node-b"), "AgentPodOnOtherNode"),
    (pod_jwt(pod="agent-gone", uid="uid-c", node="node-c"), "AgentPodTerminating"),
    (pod_jwt(pod="agent-done", uid="uid-d", node="node-d"), "AgentPodNotRunning"),
])
def test_the_agent_pod_check_names_its_reason(token, reason):
    claims = claims_of(token)
    if reason is None:
        assert check_agent_pod(claims, PODS.get) == (NS, "agent-a")
        return
    with pytest.raises(AuthError) as err:
        check_agent_pod(claims, PODS.get)
    assert err.value.reason == reason


@pytest.mark.parametrize("k8s", [None, "x", {}, {"namespace": NS, "node": {"name": "node-a"}},
                                 {"namespace": NS, "pod": {"name": "agent-a"}, "node": {"name": "node-a"}},
                                 {"namespace": NS, "pod": {"name": "agent-a", "uid": 7}, "node": {"name": "node-a"}}])
def test_a_token_naming_no_pod_is_refused_as_such(k8s):
    with pytest.raises(AuthError) as err:
        check_agent_pod({"sub": AGENT_SA, **({} if k8s is None else {"kubernetes.io": k8s})}, PODS.get)
    assert err.value.reason == "NotAgentPodToken"


def test_until_the_watch_has_listed_every_token_is_reviewed_as_before():
    """A new leader whose agent-pod watch has not listed yet must not lock every agent out: the
    check is off (the shared lane, as before it existed); once listed, junk costs no review."""
    calls: list[str] = []
    synced = [False]
    good = pod_jwt(sig="real")
    auth = TokenAuthenticator(reviewer({good}, calls), allowed_user=AGENT_SA, agent_pod=PODS.get,
                              agent_pods_synced=lambda: synced[0])
    junk = pod_jwt(pod="agent-x", uid="uid-x", sig="junk")
    assert auth.triage(f"Bearer {junk}") == (None, None)  # unknown yet: reviewed, in the shared lane
    assert auth.triage(f"Bearer {good}") == (None, None)
    synced[0] = True
    assert auth.triage(f"Bearer {good}") == (None, (NS, "agent-a"))  # the agent lane
    assert auth.authenticate(f"Bearer {good}").node == "node-a"
    with pytest.raises(AuthError) as err:
        auth.triage(f"Bearer {junk}")
    assert err.value.reason == "UnknownAgentPod" and calls == [good]


def test_a_cached_verdict_stops_when_its_pod_terminates():
    calls: list[str] = []
    pods = dict(PODS)
    good = pod_jwt(sig="real")
    auth = TokenAuthenticator(reviewer({good}, calls), agent_pod=pods.get, agent_pods_synced=lambda: True)
    auth.authenticate(f"Bearer {good}")
    assert auth.triage(f"Bearer {good}")[0].node == "node-a"
    pods[(NS, "agent-a")] = AgentPod("node-a", "uid-a", terminating=True, finished=False)
    with pytest.raises(AuthError, match="terminating"):
        auth.triage(f"Bearer {good}")
    assert calls == [good]


def test_the_shared_lane_full_never_holds_back_the_agent_lane():
    gate = ReviewGate()
    try:
        admitted = sum(gate.admit(f"127.0.0.{i % 250 + 2}") for i in range(10 * MAX_REVIEWS_PENDING))
        assert admitted == MAX_REVIEWS_PENDING and not gate.admit("10.0.0.9")  # the shared lane is full
        for i in range(100):  # a hundred agents whose verdicts expired at once all get in
            assert gate.admit("10.1.0.1", (NS, f"agent-{i}"))
        # one claimed pod gets at most its own two: a forger who knew a uid delays that pod only
        assert gate.admit("10.1.0.2", (NS, "pod-x")) and gate.admit("10.1.0.3", (NS, "pod-x"))
        assert not gate.admit("10.1.0.4", (NS, "pod-x"))
        gate.release("10.1.0.2", (NS, "pod-x"))
        assert gate.agents.pending[(NS, "pod-x")] == 1 and gate.total == MAX_REVIEWS_PENDING + 101
    finally:
        gate.shutdown()


def test_a_backward_step_of_the_wall_clock_never_extends_a_verdict():
    """A fake wall clock: the real one cannot be stepped inside a test. Verified at wall 10,000,
    the wall clock then steps back an hour (NTP, a VM resumed) while 61 s pass: the verdict
    (60 s TTL) is stale and the token is reviewed again; with the old wall-time cache it was
    fresh for another hour."""
    wall, mono = [10_000.0], [500.0]
    calls: list[str] = []
    tok = pod_jwt(exp=10_000.0 + 7200)
    auth = TokenAuthenticator(reviewer({tok}, calls), ttl=60, grace=0, clock=lambda: wall[0],
                              monotonic=lambda: mono[0])
    auth.authenticate(f"Bearer {tok}")
    assert auth.cached(f"Bearer {tok}") is not None
    wall[0] -= 3600
    mono[0] += 61
    assert auth.cached(f"Bearer {tok}") is None
    auth.authenticate(f"Bearer {tok}")
    assert len(calls) == 2


def test_exp_is_still_honoured_on_the_wall_clock():
    """exp is wall time: a forward step past it refuses at once though the verdict is fresh on the
    monotonic clock; and a verdict never outlives exp as measured when it was stored."""
    wall, mono = [10_000.0], [500.0]
    calls: list[str] = []
    tok = pod_jwt(exp=10_000.0 + 30)
    auth = TokenAuthenticator(reviewer({tok}, calls), ttl=60, clock=lambda: wall[0], monotonic=lambda: mono[0])
    auth.authenticate(f"Bearer {tok}")
    wall[0] += 31
    with pytest.raises(AuthError, match="expired"):
        auth.cached(f"Bearer {tok}")
    wall[0] -= 3600  # stepped back: exp looks far off, but 31 s of the 30 the verdict had are gone
    mono[0] += 31
    assert auth.cached(f"Bearer {tok}") is None


def test_a_refusal_cached_while_the_review_failed_is_a_refusal_not_an_identity():
    """The API server fails this review while another review of the same token (another request's,
    here nested in the failing one) refused it and cached the refusal: the grace lookup finds that
    refusal and raises it. Before, it returned the AuthError as if it were the Identity (mypy found it)."""
    tok = pod_jwt()
    calls: list[str] = []
    refuse = reviewer(set(), calls)  # the token is not (or no longer) good
    failed: list[str] = []  # the review the API server fails

    def review(token: str) -> dict:
        if not failed:
            failed.append(token)
            with pytest.raises(AuthError):
                auth.authenticate(f"Bearer {tok}")  # the other request: reviewed, refused, cached
            raise ConnectionError("the API server went away")
        return refuse(token)

    auth = TokenAuthenticator(review)
    with pytest.raises(AuthError, match="invalid bearer token"):
        auth.authenticate(f"Bearer {tok}")
    assert calls == [tok]


async def test_junk_from_a_hundred_addresses_never_delays_agents():
    """100 tenant addresses post junk tokens that claim pods the watch does not know (and the
    agent's ServiceAccount and audience, and a forged signature) while ten agents with fresh
    tokens report: every agent is answered, and no junk token costs a review."""
    calls: list[str] = []
    pods = {(NS, f"agent-{i}"): AgentPod(f"node-{i}", f"uid-{i}", False, False) for i in range(10)}
    agents = [pod_jwt(pod=f"agent-{i}", uid=f"uid-{i}", node=f"node-{i}", sig=f"real{i}") for i in range(10)]
    auth = TokenAuthenticator(reviewer(set(agents), calls, delay=0.02), allowed_user=AGENT_SA,
                              agent_pod=pods.get, agent_pods_synced=lambda: True)
    statuses: list[tuple[int, str]] = []
    rejected: Counter[str] = Counter()
    stats = APIStats(count_rejected=lambda reason: rejected.update([reason]))
    async with serve(new_state(), auth, stats=stats) as (session, base):
        stop = asyncio.Event()

        async def tenant(i: int):
            connector = aiohttp.TCPConnector(local_addr=(f"127.0.0.{i + 2}", 0), limit=4)
            async with aiohttp.ClientSession(connector=connector) as s:
                n = 0
                while not stop.is_set():
                    token = pod_jwt(pod=f"agent-{n % 10}", uid=f"guess-{i}-{n}", node=f"node-{n % 10}", sig=f"j{n}")
                    code, answer, _ = await post(s, base, f"node-{n % 10}", report(f"node-{n % 10}", []),
                                                 {"Authorization": f"Bearer {token}"})
                    statuses.append((code, answer.get("reason", "")))
                    n += 1

        tenants = [asyncio.ensure_future(tenant(i)) for i in range(100)]
        await asyncio.sleep(0.5)
        answered = []
        for i, token in enumerate(agents):
            async with session.post(f"{base}/v1/nodes/node-{i}/report", data=json.dumps(report(f"node-{i}", [])),
                                    headers={"Authorization": f"Bearer {token}"},
                                    timeout=aiohttp.ClientTimeout(total=3)) as r:  # the agent's own timeout
                answered.append(r.status)
        stop.set()
        await asyncio.gather(*tenants)
    assert answered == [200] * 10
    assert statuses and {s for s in statuses} == {(403, "UnknownAgentPod")}
    assert sorted(calls) == sorted(agents)  # the reviews made: the agents' ten, none for junk
    assert rejected == {"UnknownAgentPod": len(statuses)}  # netagent_controller_rejected_reports{reason}
