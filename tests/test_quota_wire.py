"""Volume quotas on the wire (issue 38, docs/quotas.md): each pod's cumulative internet bytes per direction
and the agent's counter epoch in the report, bounded like every field, and what an older agent sends still
decodes. The agent side runs the real Agent on the fake data path (no kernel needed for the report's shape)."""
from __future__ import annotations

import msgspec
import pytest

from core.direction import PerDirection
from core.quantity import MAX_BYTES
from core.objects import Snapshot
from core.wire import POD_BYTES, encoder, report_decoder
from netagent.datapath_fake import FakeDataPath
from netagent.reporter import Reporter, build_report, counter_epoch
from tests.test_agent_core import DL_BUDGETS, DL_CLASSES, make_agent, pod


def _report(**pod_fields) -> bytes:
    return encoder.encode({"node": "n1", "epoch": "e1", "pods": [
        {"namespace": "ns", "name": "a", "usage_bps": 0.0, "demand_bps": 0.0, **pod_fields}]})


def test_counters_round_trip_and_are_read_per_direction():
    report = report_decoder.decode(_report(bytes_total=5, ingress_bytes_total=7))
    assert report.epoch == "e1"
    assert POD_BYTES.map(lambda get: get(report.pods[0])) == PerDirection(5, 7)
    assert report_decoder.decode(_report(bytes_total=MAX_BYTES)).pods[0].bytes_total == MAX_BYTES


@pytest.mark.parametrize("fields", [{"bytes_total": -1}, {"ingress_bytes_total": MAX_BYTES + 1},
                                    {"bytes_total": 1.5}, {"bytes_total": "5"}])
def test_bad_counters_refuse_the_report(fields):
    with pytest.raises(msgspec.ValidationError, match="bytes_total"):
        report_decoder.decode(_report(**fields))


def test_an_epoch_is_bounded():
    with pytest.raises(msgspec.ValidationError, match="epoch"):
        report_decoder.decode(encoder.encode({"node": "n1", "pods": [], "epoch": "x" * 129}))
    with pytest.raises(msgspec.ValidationError, match="epoch"):
        report_decoder.decode(encoder.encode({"node": "n1", "pods": [], "epoch": ""}))


def test_an_older_agents_report_has_no_counters():
    old = encoder.encode({"node": "n1", "pods": [{"namespace": "ns", "name": "a", "usage_bps": 1.0,
                                                   "demand_bps": 2.0}]})
    report = report_decoder.decode(old)
    assert report.epoch is None and report.pods[0].bytes_total is None and report.pods[0].ingress_bytes_total is None


def test_the_agent_reports_what_its_accounting_metrics_show():
    dp = FakeDataPath()
    agent, metrics = make_agent(dp, controller="http://controller")
    agent.on_snapshot(Snapshot((pod("a", "10.244.0.10"), pod("b", "10.244.0.11")), DL_CLASSES, DL_BUDGETS))
    assert agent.sync()
    dp.pod_counters = {"ns/a": {"egress_internet": 1000, "ingress_internet": 5000}}
    reporter = Reporter(agent, "http://controller", None, insecure_http=True)
    assert reporter.epoch == counter_epoch() and reporter.epoch
    report = reporter.build_report()
    got = {p.name: (p.bytes_total, p.ingress_bytes_total) for p in report.pods}
    view = {p.name: (p.egress_bytes["internet"], p.ingress_bytes["internet"]) for p in agent.view().pods}
    assert got == view and got["a"][1] == 5000 and got["b"] == (0, 0)
    assert {p.name: p.uid for p in report.pods} == {"a": "uid-a", "b": "uid-b"}
    assert report.epoch == reporter.epoch
    # the metric shows the same figures
    assert metrics.registry.get_sample_value("netagent_pod_ingress_bytes_total",
                                             {"namespace": "ns", "pod": "a", "scope": "internet"}) == 5000
    # without counters (an unreadable view): no epoch, no counters, the rest of the report as before
    bare = build_report(agent.report_inputs(), 2, 5.0, 0.0)
    assert bare.epoch is None and all(p.bytes_total is None for p in bare.pods)
    # a counter beyond the wire's bound is clamped, never refusing the whole report
    clamped = build_report(agent.report_inputs(), 3, 5.0, 0.0, counters={"ns/a": (2**64, -3)}, epoch="e")
    pa = next(p for p in clamped.pods if p.name == "a")
    assert (pa.bytes_total, pa.ingress_bytes_total) == (MAX_BYTES, 0)
    report_decoder.decode(encoder.encode(clamped))
