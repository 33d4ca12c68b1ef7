"""The controller's agent API authentication over real HTTP on loopback (tests/test_controller_api.py's
server): a bearer token reviewed by TokenReview, answered here by a function as the API server's does
(the real one in tests/test_controller_kube.py); the verdict cache, its grace through an outage, junk tokens."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from controller.auth import AUDIENCE, NODE_CLAIM, POD_CLAIM, TokenAuthenticator
from controller.config import service_account_username
from tests.test_controller_api import new_state, post, report, serve


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
