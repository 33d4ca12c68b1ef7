"""Agent -> controller transport and answers: where the token may go, which redirects are followed,
which answers are believed. The controller endpoints here are small stdlib HTTPS servers in the
test (CAs and certificates from core/certs.py): they play a follower, a leader, a foreign host
and a fault-injecting controller (NaN, 1e30, negative numbers: a real controller cannot be made
to send them; the wire type refuses to encode most of them)."""
from __future__ import annotations

import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lab.procs import wait_for
from core.certs import issue_serving, new_ca
from core.errors import ConfigError
from netagent.agent import Agent
from netagent.allocations import Allocation, AllocationSet
from netagent.config import AgentConfig, check_controller
from netagent.datapath_fake import FakeDataPath
from netagent.desired import to_wire
from netagent.reporter import ControllerError, Reporter
from tests.agents import make_agent

TOKEN = "secret-token-of-the-agent"
M = 1_000_000


class Endpoint:
    """An HTTP(S) server on 127.0.0.1 answering every POST with `answer(handler) -> (code, headers, body)`,
    recording each request's path and Authorization header."""

    def __init__(self, answer, cert: tuple[bytes, bytes] | None, tmp: Path, name: str):
        self.requests: list[tuple[str, str | None]] = []
        self.answer = answer  # may be replaced while serving
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests.append((self.path, self.headers.get("Authorization")))
                code, headers, body = outer.answer(self)
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if cert:
            (tmp / f"{name}.crt").write_bytes(cert[0])
            (tmp / f"{name}.key").write_bytes(cert[1])
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tmp / f"{name}.crt", tmp / f"{name}.key")
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.scheme = "https" if cert else "http"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pki(tmp_path):
    """Our CA (pinned by the agent) and a foreign one; serving pairs for the name "localhost" only,
    so reaching 127.0.0.1 works only with server_hostname = the configured host."""
    ours, foreign = new_ca("netagent-controller-ca"), new_ca("someone-else")
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ours[0])
    return {"ca_file": ca_file, "ours": ours, "foreign": foreign,
            "cert": issue_serving(*ours, ["localhost"]), "foreign_cert": issue_serving(*foreign, ["localhost"])}


@pytest.fixture
def servers():
    made = []
    yield made
    for s in made:
        s.close()


def serve(servers, answer, cert, tmp, name) -> Endpoint:
    s = Endpoint(answer, cert, tmp, name)
    servers.append(s)
    return s


PODS = (("web", "w1"), ("web", "w2"))


def reporting_agent() -> Agent:
    """tests.agents.make_agent reporting to a controller on this host, two pods published."""
    return make_agent(node="node-a", controller="https://localhost", internal_cidrs=(), pods=PODS)[0]


def answer_body(node="node-a", lease=30.0, floor=2 * M, node_rate=100 * M, rate=10 * M, limit=20 * M) -> bytes:
    # written by hand, not encoded from the wire type: the faults below are what it refuses to encode
    return (f'{{"node":"{node}","generation":3,"lease_seconds":{lease},"safe_floor_bps":{floor},'
            f'"node_rate_bps":{node_rate},"pods":[{{"namespace":"web","name":"w1","team":"web",'
            f'"egress_class":"default","allocation_bps":{rate},"limit_bps":{limit}}}]}}').encode()


def ok(handler):
    return 200, {"Content-Type": "application/json"}, answer_body()


def redirect(code: int, location: str):
    return lambda handler: (code, {"Location": location + handler.path}, b"")


def token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def unjittered_reporter(url: str, pki, tmp_path) -> Reporter:
    """A reporter with a 1 s period and no jitter, so its waits are exact."""
    reporter = Reporter(reporting_agent(), url, token_file(tmp_path), period=1.0, ca_file=str(pki["ca_file"]))
    reporter.rng.uniform = lambda a, b: 1.0
    return reporter


def test_https_with_the_pinned_ca_and_a_307_to_the_leaders_address(pki, servers, tmp_path):
    leader = serve(servers, ok, pki["cert"], tmp_path, "leader")
    # the follower points at the leader's pod IP: its certificate names only the Service ("localhost")
    follower = serve(servers, redirect(307, leader.url("127.0.0.1")), pki["cert"], tmp_path, "follower")
    agent = reporting_agent()
    reporter = Reporter(agent, follower.url("localhost"), token_file(tmp_path), ca_file=str(pki["ca_file"]))
    assert reporter.report_once()
    assert leader.requests == [("/v1/nodes/node-a/report", "Bearer " + TOKEN)]
    assert reporter.leader_url == leader.url("127.0.0.1")  # sticky
    assert agent.allocations.current.pods["web/w1"] == Allocation(10 * M, 20 * M)
    reporter.report_once()
    assert len(leader.requests) == 2 and len(follower.requests) == 1


def test_a_gone_leader_is_left_at_once_and_a_slow_one_at_the_next_report(pki, servers, tmp_path):
    """The remembered leader refuses the connection (the replica is gone): the same report goes
    through the Service at once. It times out (perhaps overloaded): the report fails and the next
    one goes through the Service; a second report at once would add to what it cannot answer."""
    slow = {"seconds": 0.0}

    def leader_answer(handler):
        time.sleep(slow["seconds"])
        return ok(handler)

    leader = serve(servers, leader_answer, pki["cert"], tmp_path, "leader")
    follower = serve(servers, redirect(307, leader.url("127.0.0.1")), pki["cert"], tmp_path, "follower")
    reporter = Reporter(reporting_agent(), follower.url("localhost"), token_file(tmp_path), timeout=0.5,
                        ca_file=str(pki["ca_file"]))
    assert reporter.report_once() and reporter.leader_url == leader.url("127.0.0.1")

    slow["seconds"] = 1.5
    with pytest.raises(ControllerError, match="unreachable"):
        reporter.report_once()
    assert len(follower.requests) == 1 and reporter.leader_url is None  # not asked again at once
    slow["seconds"] = 0.0
    assert reporter.report_once() and len(follower.requests) == 2  # the next one through the Service

    gone = leader.url("127.0.0.1")
    leader.close()  # nothing listens there now; the follower still points at it
    other = serve(servers, ok, pki["cert"], tmp_path, "new-leader")
    follower.answer = redirect(307, other.url("127.0.0.1"))
    assert reporter.leader_url == gone
    assert reporter.report_once()  # the same report, through the Service, to the new leader
    assert len(follower.requests) == 3 and len(other.requests) == 1
    assert reporter.leader_url == other.url("127.0.0.1")


def test_the_report_period_runs_from_each_reports_start(pki, servers, tmp_path):
    """A leader that holds each answer for its next round (--answer-wait) must not stretch the
    period: the next report is due a period (with its jitter) after this one started. In the demo
    a 1 s period with a 1.5 s hold reported every 2-2.5 s, so every answer to a policy change came
    that much later. A refusal's Retry-After still counts from the refusal."""
    hold = 0.5

    def held(handler):
        time.sleep(hold)
        return ok(handler)

    leader = serve(servers, held, pki["cert"], tmp_path, "leader")
    reporter = Reporter(reporting_agent(), leader.url("localhost"), token_file(tmp_path), period=1.0,
                        ca_file=str(pki["ca_file"]))
    wait = reporter.tick()
    assert not reporter.last_error and len(leader.requests) == 1
    assert wait <= 1.0 * 1.2 - hold  # jitter at most +20 %, and the hold already counts
    reporter.rng.uniform = lambda a, b: 1.0  # no jitter below
    assert reporter.next_wait(elapsed=0.3) == pytest.approx(0.7)
    assert reporter.next_wait(elapsed=2.5) == 0.0  # a report slower than the period: the next one at once
    reporter.retry_after = 3.0
    assert reporter.next_wait(elapsed=2.5) == 3.0  # an overloaded leader's Retry-After counts from its refusal


def test_failed_reports_in_a_row_stretch_the_period_and_an_answer_resets_it(pki, servers, tmp_path):
    """A controller that does not answer (overloaded, restarting) is not met by every agent every
    period: after one failure the next report comes at the period (a failover costs nothing), then
    at 2, 4 and at most 8 periods (never more than a minute); the first answer resets it."""
    from netagent.reporter import MAX_FAILURE_WAIT, failure_backoff, report_wait
    assert [failure_backoff(n) for n in range(7)] == [1, 1, 2, 4, 8, 8, 8]
    assert failure_backoff(10**9) == 8
    assert report_wait(5.0, 4, 0.0, 1.0, 0.0) == 40.0
    assert report_wait(30.0, 4, 0.0, 1.0, 0.0) == MAX_FAILURE_WAIT  # a paced period: still back within a minute
    assert report_wait(120.0, 4, 0.0, 1.0, 0.0) == 120.0  # never sooner than the advised period
    assert report_wait(5.0, 3, 90.0, 1.0, 0.0) == 90.0  # a Retry-After still holds

    answering = {"yes": False}

    def maybe(handler):
        if not answering["yes"]:
            handler.send_response(503)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        return ok(handler)

    leader = serve(servers, maybe, pki["cert"], tmp_path, "leader")
    reporter = unjittered_reporter(leader.url("localhost"), pki, tmp_path)
    waits = [reporter.tick() for _ in range(5)]
    assert reporter.last_error and reporter.failures == 5
    assert [round(w) for w in waits] == [1, 2, 4, 8, 8], waits
    answering["yes"] = True
    assert reporter.tick() <= 1.0 and reporter.failures == 0 and not reporter.last_error


def test_a_failover_in_progress_does_not_stretch_the_period(pki, servers, tmp_path):
    """Only signs of overload stretch the period (a timeout, a 429, a 5xx). A replica that says no
    one leads yet (503 NoLeader / NotReady, with Retry-After: controller/api.py) and a replica that is gone (a refused
    connection) keep the agent at its period, so it reaches the new leader as soon as that answers;
    a plain 503 or a 429 still counts."""
    import socket

    from netagent.reporter import stretches_period
    assert not stretches_period(503, "NoLeader", False) and not stretches_period(503, "NotReady", False)
    assert not stretches_period(None, "", True)
    assert stretches_period(None, "", False) and stretches_period(503, "Overloaded", False)
    assert stretches_period(429, "TooManyReviews", False) and stretches_period(500, "", False)

    answers = {"now": "NoLeader"}

    def refusing(handler):
        body = b'{"error":"no leader yet","reason":"%s"}' % answers["now"].encode()
        return 503, {"Content-Type": "application/json", "Retry-After": "2"}, body

    follower = serve(servers, refusing, pki["cert"], tmp_path, "follower")
    reporter = unjittered_reporter(follower.url("localhost"), pki, tmp_path)
    waits = [reporter.tick() for _ in range(4)]
    assert reporter.last_error and reporter.failures == 0
    assert all(1.9 <= w <= 2.0 for w in waits), waits  # the Retry-After, never stretched
    answers["now"] = "Overloaded"
    reporter.tick()
    reporter.tick()
    assert reporter.failures == 2

    with socket.socket() as s:  # a port nothing listens on: a replica that is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = unjittered_reporter(f"https://localhost:{port}", pki, tmp_path)
    waits = [gone.tick() for _ in range(4)]
    assert "unreachable" in gone.last_error and gone.failures == 0
    assert all(w <= 1.0 for w in waits), waits


@pytest.mark.parametrize("fault", ["foreign-ca", "302", "301", "303", "to-http"])
def test_a_redirect_elsewhere_gets_no_token_and_the_allocations_stay(fault, pki, servers, tmp_path):
    leader = serve(servers, ok, pki["cert"], tmp_path, "leader")
    foreign = serve(servers, ok, pki["foreign_cert"], tmp_path, "foreign")  # a valid cert, of another CA
    plain = serve(servers, ok, None, tmp_path, "plain")
    target, code = {"foreign-ca": (foreign.url(), 307), "302": (leader.url(), 302), "301": (leader.url(), 301),
                    "303": (leader.url(), 303), "to-http": (plain.url(), 307)}[fault]
    follower = serve(servers, redirect(code, target), pki["cert"], tmp_path, "follower")
    agent = reporting_agent()
    held = AllocationSet(pods={"web/w1": Allocation(5 * M, 6 * M)}, lease_expires=time.monotonic() + 30,
                         source="controller")
    agent.allocations.current = held
    reporter = Reporter(agent, follower.url("localhost"), token_file(tmp_path), ca_file=str(pki["ca_file"]))
    with pytest.raises(ControllerError) as err:
        reporter.report_once()
    assert follower.requests == [("/v1/nodes/node-a/report", "Bearer " + TOKEN)]  # the real follower: yes
    assert foreign.requests == [] and leader.requests == [] and plain.requests == []  # nobody else saw it
    assert agent.allocations.current is held and reporter.leader_url is None
    assert ("not a controller" in str(err.value)) == (fault == "foreign-ca")


def test_plain_http_needs_the_flag_and_never_carries_the_token(servers, tmp_path):
    plain = serve(servers, ok, None, tmp_path, "plain")
    agent = reporting_agent()
    with pytest.raises(ValueError, match="insecure"):
        Reporter(agent, plain.url(), token_file(tmp_path))
    Reporter(agent, plain.url(), token_file(tmp_path), insecure_http=True).report_once()
    assert plain.requests == [("/v1/nodes/node-a/report", None)]


def test_the_flags_https_needs_a_ca_that_loads_http_needs_the_test_flag(pki, tmp_path):
    check_controller("https://netagent-controller.netagent-system.svc:9561", str(pki["ca_file"]), False)
    check_controller("http://127.0.0.1:9561", None, True)
    bad = tmp_path / "bad.crt"
    bad.write_text("not a certificate")
    for url, ca, insecure, message in [
        ("https://c:9561", None, False, "needs --controller-ca"),
        ("https://c:9561", str(bad), False, "--controller-ca"),
        ("https://c:9561", str(tmp_path / "missing.crt"), False, "--controller-ca"),
        ("http://c:9561", None, False, "in the clear"),
        ("http://c:9561", str(pki["ca_file"]), True, "for an https"),
        ("ftp://c:9561", None, False, "must be https"),
        ("https://user:pw@c:9561", str(pki["ca_file"]), False, "credentials"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_controller(url, ca, insecure)


def test_the_pinned_ca_is_re_read_when_its_file_changes(pki, servers, tmp_path):
    """A rotated CA is picked up without a restart; until then a server of the new CA is refused."""
    rotated = serve(servers, ok, pki["foreign_cert"], tmp_path, "rotated")
    agent = reporting_agent()
    reporter = Reporter(agent, rotated.url("localhost"), token_file(tmp_path), ca_file=str(pki["ca_file"]))
    with pytest.raises(ControllerError, match="not a controller"):
        reporter.report_once()
    tmp = pki["ca_file"].with_suffix(".tmp")
    tmp.write_bytes(pki["foreign"][0])
    tmp.replace(pki["ca_file"])  # as the kubelet updates a mounted Secret: a new file, renamed in
    reporter.report_once()
    assert rotated.requests == [("/v1/nodes/node-a/report", "Bearer " + TOKEN)]
    pki["ca_file"].write_text("garbage mid-rotation")  # a bad file keeps the last good CA
    reporter.report_once()
    assert len(rotated.requests) == 2


@pytest.mark.parametrize("body", [
    answer_body(lease="NaN"), answer_body(lease="1e30"), answer_body(lease=-5), answer_body(lease="Infinity"),
    answer_body(node_rate="1e30"), answer_body(node_rate=-1), answer_body(rate="NaN"), answer_body(limit=-1e9),
    answer_body(floor="1e400"), answer_body(node="node-b"), b'{"node":"node-a"', b"x" * (5 << 20),
], ids=["lease-nan", "lease-1e30", "lease-negative", "lease-inf", "node-rate-1e30", "node-rate-negative",
        "rate-nan", "limit-negative", "floor-1e400", "other-node", "truncated", "5-MiB"])
def test_a_bad_answer_is_refused_and_fail_static_holds_then_the_floor(body, pki, servers, tmp_path):
    bad = serve(servers, lambda h: (200, {"Content-Type": "application/json"}, body), pki["cert"], tmp_path, "bad")
    agent = reporting_agent()
    held = AllocationSet(pods={"web/w1": Allocation(5 * M, 6 * M)}, node_rate_bps=50 * M, safe_floor_bps=M,
                         lease_expires=time.monotonic() + 0.5, source="controller")
    agent.allocations.current = held
    reporter = Reporter(agent, bad.url("localhost"), token_file(tmp_path), ca_file=str(pki["ca_file"]))
    with pytest.raises(ControllerError, match="refused"):
        reporter.report_once()
    assert agent.allocations.current is held
    pods = agent.node.state.pods
    assert agent.allocations.effective(pods, lambda p: None, time.monotonic())["web/w1"] == Allocation(5 * M, 6 * M)
    later = time.monotonic() + 1  # the lease ran out: the floor, as documented
    assert agent.allocations.effective(pods, lambda p: None, later)["web/w1"] == Allocation(M, M)


def test_huge_but_in_range_numbers_are_capped_by_the_node_rate(pki, servers, tmp_path):
    """2^64 bit/s passes the wire type; the agent enforces at most the node's rate, and in total
    no more than it (HTB rates add up beyond the parent's otherwise)."""
    body = answer_body(node_rate=50 * M, rate=2.0**64, limit=2.0**64, floor=2.0**64)
    ctl = serve(servers, lambda h: (200, {}, body), pki["cert"], tmp_path, "ctl")
    agent = reporting_agent()
    Reporter(agent, ctl.url("localhost"), token_file(tmp_path), ca_file=str(pki["ca_file"])).report_once()
    agent.on_snapshot(_snapshot())
    assert agent.sync()
    shaper = agent.datapath.applied[-1].shaper
    node = to_wire(50 * M, agent.cfg.datapath)  # HTB holds IP rates as the frames that carry them
    assert shaper.node_rate == node
    assert all(c.ceil <= node for c in shaper.pods)
    # (each class rounded up to the whole bytes per second HTB holds: at most 8 bit/s each)
    assert sum(c.rate for c in shaper.pods) + shaper.default.rate <= node + 8 * (len(shaper.pods) + 1)
    # w2 has no allocation: it gets the floor, never more than a fair share of the node
    w2 = next(c for c in shaper.pods if c.key == "web/w2")
    assert w2.ceil <= to_wire(25 * M, agent.cfg.datapath)


def _snapshot():
    from core.objects import PodRecord, Snapshot

    budgets = ({"kind": "EgressBudget", "metadata": {"name": "default"},
                "spec": {"total": "1G", "teams": [{"name": "web", "namespaces": ["web"]}]}},)
    pods = tuple(PodRecord("web", n, "uid-" + n, "node-a", (ip,), False, "Running", ()) for n, ip in
                 (("w1", "10.244.0.10"), ("w2", "10.244.0.11")))
    return Snapshot(pods, (), budgets)


def test_no_report_before_the_pod_source_synced(pki, servers, tmp_path):
    """After a restart the agent knows no pods until its source lists them: an empty report would
    make the controller give this node's share away."""
    ctl = serve(servers, ok, pki["cert"], tmp_path, "ctl")
    agent = Agent(AgentConfig(node="node-a", uplinks=("eth0",), internal_cidrs=(), controller="https://localhost"),
                  FakeDataPath())
    reporter = Reporter(agent, ctl.url("localhost"), token_file(tmp_path), ca_file=str(pki["ca_file"]))
    assert reporter.report_once() is False and ctl.requests == []
    agent.on_snapshot(_snapshot())
    agent.sync()
    assert reporter.report_once() and len(ctl.requests) == 1


def test_reports_are_bounded_long_annotations_left_out_with_an_event_and_a_metric():
    from core.objects import PodRecord, Snapshot
    from netagent.events import ProblemReporter
    from netagent.metrics import AgentMetrics
    from netagent.reporter import build_report

    holder = {}
    metrics = AgentMetrics(lambda: holder["a"].view())
    events = []
    problems = ProblemReporter(lambda *e: events.append(e), lambda r: metrics.policy_problems.labels(r).inc())
    problems.start()
    agent = Agent(AgentConfig(node="node-a", uplinks=("eth0",), internal_cidrs=(), controller="https://localhost"),
                  FakeDataPath(), metrics=metrics, problems=problems)
    holder["a"] = agent
    budgets = ({"kind": "EgressBudget", "metadata": {"name": "default"},
                "spec": {"total": "1G", "teams": [{"name": "web", "namespaces": ["web"]}]}},)
    huge = "x" * (1 << 20)
    pods = [PodRecord("web", "bad", "uid-bad", "node-a", ("10.244.0.10",), False, "Running",
                      (("kubernetes.io/egress-bandwidth", "1" * 100), ("netagent.io/egress-class", huge)))]
    pods += [PodRecord("web", f"p{i:04d}", f"uid-{i}", "node-a", (f"10.245.{i // 250}.{i % 250 + 1}",), False,
                       "Running", (("netagent.io/egress-class", "gold"),)) for i in range(1100)]
    agent.on_snapshot(Snapshot(tuple(pods), (), budgets))
    agent.sync()
    omitted = []
    report = build_report(agent.report_inputs(), 1, 5.0, 0.0, lambda reason, n: omitted.append((reason, n)))
    assert len(report.pods) == 1024
    bad = next(p for p in report.pods if p.name == "bad")
    assert bad.egress_class is None and bad.egress_bandwidth is None
    assert all(p.egress_class == "gold" for p in report.pods if p.name != "bad")
    assert ("too_many_pods", 1101 - 1024) in omitted and ("annotation_too_long", 2) in omitted
    from core.wire import encoder, report_decoder

    report_decoder.decode(encoder.encode(report))  # the controller's own decoder takes it
    wait_for(lambda: sum(e[3] == "AnnotationTooLong" for e in events) == 2, what="the Events")
    too_long = [e for e in events if e[3] == "AnnotationTooLong"]
    assert len(too_long) == 2 and all(e[1] == "bad" and len(e[4]) <= 1024 for e in too_long)
    assert all(len(e[4]) <= 1024 for e in events)  # the 1 MiB value is never copied into an Event
    assert metrics.registry.get_sample_value("netagent_policy_problems_total", {"reason": "AnnotationTooLong"}) == 2
    problems.stop()
