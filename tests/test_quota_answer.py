"""Volume quotas in the controller's answer (issue 38, docs/quotas.md "Where a team's use is seen"): the leader
sends each answer the quota state of the teams with pods in it, and only theirs; the cluster agent's /state and
`netagent status` show it in single-machine mode's shape with the answer's age; a bad value refuses the whole
answer; an answer without the field (an older controller) leaves it "not known". Real parts: the leader's
ControllerState and Allocator with its QuotaKeeper behind the real API app on loopback, the real Agent (on the
fake data path), its Reporter and its /state listener, `netagent status` through cli.main."""
from __future__ import annotations

import asyncio
import http.server
import json
import math
import socket
import tempfile
import threading
from datetime import datetime, timezone

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from core.direction import Direction
from core.policy import load_policy
from core.wire import NodeAnswer, NodeReport, PodReport, TeamQuotaState, decode_answer, encoder
from controller.allocator import Allocator
from controller.quota import QuotaKeeper
from controller.state import ControllerState
from controller.view import cluster_view
from netagent.datapath_fake import FakeDataPath
from netagent.http import AgentHTTP
from netagent.reporter import ControllerError, Reporter
from netagent.status import NOT_KNOWN, render
from tests.agents import make_agent
from tests.test_quota_local import Pods, keeper as local_keeper

M = 10**6
DAY1 = datetime(2026, 3, 10, 12, 0, tzinfo=timezone.utc).timestamp()
BUDGET = {"metadata": {"name": "main"}, "spec": {"total": "100M", "ingressTotal": "100M", "teams": [
    {"name": "research", "namespaces": ["research"],
     "quota": {"period": "Day", "bytes": "1M", "exhaustedRate": "2M", "ingress": {"bytes": "5M"}}},
    {"name": "ops", "namespaces": ["ops"], "quota": {"period": "Week", "bytes": "10M"}},
    {"name": "web", "namespaces": ["web"]}]}}


def _leader():
    policy, problems = load_policy([], [BUDGET])
    assert problems == []
    keeper = QuotaKeeper(lambda: DAY1)
    keeper.set_policy(policy)
    keeper.resume(None)  # this replica counts (a leader that resumed)
    return ControllerState(Allocator(lambda: (policy, []), quota=keeper), lease_seconds=30.0), keeper


def _report(node: str, *pods: tuple[str, str, int]) -> NodeReport:
    return NodeReport(node, [PodReport(ns, name, 1e6, 2e6, bytes_total=up, ingress_bytes_total=0, uid=f"uid-{name}")
                             for ns, name, up in pods], epoch="boot-1")


def test_the_answer_carries_the_quota_state_of_the_teams_of_its_pods_and_only_those():
    state, keeper = _leader()
    reports = {"n1": _report("n1", ("research", "r1", 100), ("research", "r2", 0), ("web", "w1", 0)),
               "n2": _report("n2", ("ops", "o1", 0)), "n3": _report("n3", ("web", "w2", 0))}
    for r in reports.values():
        assert state.submit(None, r).quota is None  # no round yet: not known
    state.run_round()
    state.submit(None, _report("n1", ("research", "r1", 300_100), ("research", "r2", 0), ("web", "w1", 0)))
    state.run_round()
    answers = {n: state.submit(None, r) for n, r in reports.items()}
    # research once for its two pods; web has no quota; ops has no pod on n1
    assert [q.team for q in answers["n1"].quota] == ["research"]
    assert [q.team for q in answers["n2"].quota] == ["ops"]
    assert answers["n3"].quota == []  # known: none of its teams has a byte quota
    research = answers["n1"].quota[0]
    assert research.period == "Day" and research.period_end - research.period_start == 86_400
    assert research.period_start == datetime(2026, 3, 10, tzinfo=timezone.utc).timestamp()
    assert (research.egress.bytes, research.egress.used, research.egress.exhausted) == (M, 300_000, False)
    assert research.egress.exhausted_bps == 2 * M and research.ingress.exhausted_bps is None
    assert answers["n2"].quota[0].ingress is None  # no download quota
    assert decode_answer(encoder.encode(answers["n1"])) == answers["n1"]  # what it sends, the agent takes
    # a replica that does not count (lost the Lease, or not resumed yet) says "not known", not a stale figure
    keeper.active = False
    state.run_round()
    assert state.submit(None, reports["n1"]).quota is None


def test_figures_beyond_the_wire_bounds_are_clamped_by_the_leader_not_refused():
    state, keeper = _leader()
    state.submit(None, _report("n1", ("research", "r1", 0)))
    state.run_round()
    keeper.ledger.used[("research", Direction.UPLOAD)] = 2**64  # an absurd figure (only a bug makes it)
    keeper._rates[("research", Direction.DOWNLOAD)] = 1e-30  # 5 MB at this rate: ~10^37 s
    state.run_round()
    answer = state.submit(None, _report("n1", ("research", "r1", 0)))
    q = decode_answer(encoder.encode(answer)).quota[0]
    assert q.egress.used == 2**63 - 1 and q.egress.exhausted and q.egress.forecast_seconds == 0.0
    assert q.ingress.forecast_seconds == 1e12


# -- the agent: a real Reporter against the leader's API on loopback ----------------------------------------

class _Served:
    """An aiohttp app on loopback in a thread."""

    def __init__(self, app_of):
        from aiohttp import web

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app_of(self.url))
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()


@pytest.fixture
def leader():
    from controller.api import make_app

    state, keeper = _leader()
    served = _Served(lambda url: make_app(state, None, self_address=url.removeprefix("http://"), scheme="http"))
    yield state, keeper, served.url
    served.stop()


@pytest.fixture
def agent_http():
    made = []

    def serve(agent):
        s = AgentHTTP(("127.0.0.1", 0), CollectorRegistry(), lambda: (True, "alive"), lambda: (True, "ready"),
                      lambda: agent.view().as_dict())  # the daemon's /state in controller mode
        s.start()
        made.append(s)
        return s.state_address

    yield serve
    for s in made:
        s.stop()


def _agent():
    dp = FakeDataPath()
    agent, _ = make_agent(dp, controller="http://controller", internal_cidrs=(),
                          pods=[("research", "r1"), ("web", "w1")])
    dp.pod_counters = {"research/r1": {"egress_internet": 1000, "ingress_internet": 0}}
    return agent, dp


def _status(capsys, address: str) -> str:
    from cli.main import main

    assert main(["status", "--agent", address]) == 0
    return capsys.readouterr().out


def test_the_cluster_agents_state_and_status_show_its_teams_use_quota_and_forecast_with_the_answers_age(
        leader, agent_http, capsys):
    from netagent.status import fetch_state

    state, keeper, url = leader
    agent, dp = _agent()
    reporter = Reporter(agent, url, token_path=None, insecure_http=True)
    address = agent_http(agent)
    reporter.report_once()  # the leader's first answer: no round with this node yet
    shown = fetch_state(address)
    assert shown["quota"] is None and shown["quota_age_seconds"] is None
    assert NOT_KNOWN in _status(capsys, address)
    state.run_round()  # the first report was a baseline
    dp.pod_counters["research/r1"]["egress_internet"] = 1000 + 400_000
    reporter.report_once()  # counted
    state.run_round()
    reporter.report_once()  # answered from the round that counted it
    shown = fetch_state(address)
    leaders = [q for q in cluster_view(state)["quota"] if q["team"] == "research"]  # its /v1/status
    assert shown["quota"] == leaders and shown["quota"][0]["uploads"]["used"] == 400_000
    assert 0 <= shown["quota_age_seconds"] < 5
    # the shape of single-machine mode's /state quota (netagent.localquota), so `netagent status` renders both
    with tempfile.TemporaryDirectory() as d:
        local = local_keeper(d, Pods())
        local.look()  # takes the policy
        entry = local.teams()[0]
    assert set(entry) == set(shown["quota"][0]) and set(entry["uploads"]) == set(shown["quota"][0]["uploads"])
    text = _status(capsys, address)
    assert "the controller's figures as of its answer" in text and NOT_KNOWN not in text, text
    line = next(x for x in text.splitlines() if x.startswith("research") and "uploads" in x)
    assert "40%" in line and "Day from 2026-03-10T00:00" in line, line
    assert any(x.startswith("research") and "downloads" in x for x in text.splitlines())
    table = text.split("quotas (", 1)[1].splitlines()[2:]  # below its title and header
    assert {x.split()[0] for x in table} == {"research"}, text  # web has no quota; ops no pod on this node


class _Canned(http.server.BaseHTTPRequestHandler):
    body = b"{}"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def canned():
    """A controller that answers every report with _Canned.body (an older one, or a broken one)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _answer(quota=None, **fields) -> dict:
    out = {"node": "n1", "generation": 3, "lease_seconds": 30, "safe_floor_bps": 1e6, "node_rate_bps": 1e7,
           "pods": [{"namespace": ns, "name": name, "team": team, "egress_class": "default",
                     "allocation_bps": 1e6, "limit_bps": 2e6} for ns, name, team in
                    (("research", "r1", "research"), ("web", "w1", "web"))], **fields}
    if quota is not None:
        out["quota"] = quota
    return out


def _state(team="research", **figures) -> dict:
    return {"team": team, "period": "Day", "period_start": 1_773_100_800.0, "period_end": 1_773_187_200.0,
            "egress": {"bytes": M, "used": 5, "exhausted": False, "exhausted_bps": 2e6, "forecast_seconds": 9.0,
                       **figures}}


def test_an_older_controllers_answer_leaves_the_quota_not_known(canned, capsys, agent_http):
    server, url = canned
    _Canned.body = json.dumps(_answer()).encode()  # no `quota`: a controller from before it
    agent, _ = _agent()
    address = agent_http(agent)
    Reporter(agent, url, token_path=None, insecure_http=True).report_once()
    assert agent.allocations.current.source == "controller"  # the rest of the answer is taken
    shown = agent.view().as_dict()
    assert shown["quota"] is None and shown["quota_age_seconds"] is None
    assert NOT_KNOWN in _status(capsys, address)
    # an older agent ignores the field: the answer's struct takes unknown fields (as every older one did)
    # (the answer of before: these fields with their types, no `quota`)
    before = [(f.name, f.type) if f.required else
              (f.name, f.type, msgspec.field(default=f.default, default_factory=f.default_factory))
              for f in msgspec.structs.fields(NodeAnswer) if f.name != "quota"]
    old = msgspec.defstruct("OldNodeAnswer", before)
    assert not NodeAnswer.__struct_config__.forbid_unknown_fields
    decoded = msgspec.json.decode(json.dumps(_answer([_state()])).encode(), type=old)
    assert decoded.generation == 3 and len(decoded.pods) == 2


def test_a_later_answer_without_the_field_keeps_the_last_figures_with_their_age(canned):
    server, url = canned
    agent, _ = _agent()
    reporter = Reporter(agent, url, token_path=None, insecure_http=True)
    _Canned.body = json.dumps(_answer([_state()])).encode()
    reporter.report_once()
    first = agent.view().as_dict()
    assert [q["team"] for q in first["quota"]] == ["research"] and first["quota"][0]["uploads"]["used"] == 5
    assert first["quota"][0]["period_start"] == "2026-03-10T00:00:00+00:00"
    _Canned.body = json.dumps(_answer()).encode()  # a new leader not yet resumed: the last kept, aging
    agent.quota = (agent.quota[0] - 40, agent.quota[1])
    reporter.report_once()
    later = agent.view().as_dict()
    assert later["quota"] == first["quota"] and later["quota_age_seconds"] >= 40
    _Canned.body = json.dumps(_answer([])).encode()  # known: none of these teams has a quota now
    reporter.report_once()
    assert agent.view().as_dict()["quota"] == []


BAD = {
    "negative use": [_state(used=-1)],
    "use above 2^63-1": [_state(used=2**63)],
    "a zero quota": [_state(bytes=0)],
    "a negative forecast": [_state(forecast_seconds=-1.0)],
    "an infinite forecast": [_state(forecast_seconds=math.inf)],
    "a NaN forecast": [_state(forecast_seconds=math.nan)],
    "a NaN exhausted rate": [_state(exhausted_bps=math.nan)],
    "a rate as a string": [_state(exhausted_bps="2M")],
    "an unknown period": [{**_state(), "period": "Year"}],
    "an end before its start": [{**_state(), "period_end": 1_773_100_000.0}],
    "a start past the year 4147": [{**_state(), "period_start": 2.0**40, "period_end": 2.0**40 + 1}],
    "an oversize team name": [_state(team="r" * 254)],
    "an empty team name": [_state(team="")],
    "a team twice": [_state(), _state()],
    "a team with no pod in the answer": [_state(team="ops")],
    "more states than pods allowed": [_state(team=f"t{i}") for i in range(1025)],
    "not a list": {"research": _state()},
}


def _raw(value) -> bytes:
    """JSON as Python writes it: NaN and Infinity as the literals a broken encoder sends (not JSON)."""
    return json.dumps(value, allow_nan=True).encode()


@pytest.mark.parametrize("what", sorted(BAD))
def test_a_bad_quota_value_refuses_the_whole_answer(what, canned):
    raw = _raw(_answer(BAD[what]))
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        decode_answer(raw)
    # the agent refuses it as it refuses any bad field: its allocations and its quota stay as they were
    server, url = canned
    agent, _ = _agent()
    reporter = Reporter(agent, url, token_path=None, insecure_http=True)
    _Canned.body = _raw(_answer([_state()]))
    reporter.report_once()
    held, quota = agent.allocations.current, agent.quota
    _Canned.body = raw
    with pytest.raises(ControllerError, match="invalid answer"):
        reporter.report_once()
    assert agent.allocations.current is held and agent.quota is quota


def test_the_wire_bounds_hold_on_the_leaders_side_too():
    with pytest.raises(ValueError, match="period_end"):
        TeamQuotaState("research", "Day", 10.0, 10.0)
