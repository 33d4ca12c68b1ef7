"""Report pacing (controller/pacing.py): the period a leader advises so that it carries any
number of nodes, and how answers carry it. Pure: no server (the process-level test, the
reporter adopting the period from a real controller, is in test_controller_service.py)."""
from __future__ import annotations

import json
import msgspec
import pytest

from controller.pacing import REFRESH_SECONDS, ReportPacer, advised_period
from controller.state import ControllerState
from core.wire import MAX_ADVISED_PERIOD, NodeReport, PodReport, answer_decoder


def test_small_clusters_keep_the_base_period_and_large_ones_are_paced():
    assert advised_period(200, 5.0, 400, 120) == 0.0  # 40 reports/s: the agents' own period
    assert advised_period(2000, 5.0, 400, 120) == 0.0  # exactly the rate
    assert advised_period(5000, 5.0, 400, 120) == 12.5  # 5,000 / 400
    assert advised_period(10000, 5.0, 400, 120) == 25.0
    assert advised_period(100000, 5.0, 400, 120) == 30.0  # a quarter of the lease at most
    assert advised_period(10**7, 5.0, 400, 3600) == MAX_ADVISED_PERIOD
    assert advised_period(10000, 5.0, 0, 120) == 0.0  # pacing off: agents keep their own period


def test_the_pacer_recounts_at_most_every_refresh_interval():
    now, nodes, counted = [0.0], [100], []

    def count():
        counted.append(nodes[0])
        return nodes[0]

    pacer = ReportPacer(count, base=5.0, max_reports_per_s=10, lease_seconds=400, clock=lambda: now[0])
    assert pacer.period() == 10.0
    nodes[0] = 200
    now[0] += REFRESH_SECONDS / 2
    assert pacer.period() == 10.0 and counted == [100]  # not recounted yet
    now[0] += REFRESH_SECONDS / 2
    assert pacer.period() == 20.0 and counted == [100, 200]


def test_every_answer_carries_the_advised_period_also_before_the_first_round():
    state = ControllerState(lambda reports: None)
    state.report_period = lambda: 12.5
    report = NodeReport("node-a", [PodReport("web", "w1", 1e6, 2e6)], 1, 5.0, 1e6)
    answer = state.submit(None, report)
    assert answer.generation == 0 and answer.report_period_seconds == 12.5  # a new leader paces too
    assert ControllerState(lambda reports: None).submit(None, report).report_period_seconds == 0.0


def answer_with(**extra) -> bytes:
    return json.dumps({"node": "node-a", "generation": 1, "lease_seconds": 30, "safe_floor_bps": 1e6,
                       "node_rate_bps": 1e7, "pods": [], **extra}).encode()


def test_answers_bound_the_advised_period():
    assert answer_decoder.decode(answer_with()).report_period_seconds == 0.0  # an older controller
    assert answer_decoder.decode(answer_with(report_period_seconds=25)).report_period_seconds == 25
    for bad in (-1, MAX_ADVISED_PERIOD + 1):
        with pytest.raises(msgspec.ValidationError):
            answer_decoder.decode(answer_with(report_period_seconds=bad))
    for raw in (b"1e999", b"NaN", b"Infinity"):  # infinite or not JSON: refused all the same
        with pytest.raises(msgspec.DecodeError):  # (ValidationError is a DecodeError)
            answer_decoder.decode(answer_with().replace(b'"pods"', b'"report_period_seconds": ' + raw + b', "pods"'))


def test_an_overloaded_leader_asks_for_the_paced_period_in_whole_seconds():
    from controller.api import MIN_OVERLOAD_RETRY, overload_retry_after

    assert overload_retry_after(0.0) == MIN_OVERLOAD_RETRY  # not paced: the shortest wait
    assert overload_retry_after(12.5) == 13  # paced: come back at the paced period, never sooner
    assert overload_retry_after(float("nan")) == MIN_OVERLOAD_RETRY
    assert overload_retry_after(1e9) == MAX_ADVISED_PERIOD


def test_the_agent_honours_a_bounded_retry_after_only():
    from netagent.transport import MAX_RETRY_AFTER, refusal_reason, retry_after_seconds

    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds("1e9") == MAX_RETRY_AFTER  # never silent past its lease
    for bad in (None, "", "soon", "-1", "nan", "inf", "Wed, 21 Oct 2015 07:28:00 GMT"):
        assert retry_after_seconds(bad) is None, bad
    assert refusal_reason(b'{"error": "busy", "reason": "Overloaded"}') == "Overloaded"
    assert refusal_reason(b"<html>proxy error</html>") == ""
