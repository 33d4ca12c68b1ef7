"""The agent's /metrics body (`AgentMetrics.exposition`, rendered by netagent/metrics.py itself for
speed) is byte for byte what prometheus-client's `generate_latest` makes of the same registry:
110 pods, label values that need escaping, values Go formats its own way, lean mode, downloads
shaped or not, and over several scrapes while pods come, go and change labels (the renderer keeps
each sample's line head between scrapes)."""
from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from netagent.metrics import AgentMetrics, go_float, render
from netagent.view import NodeView, PodView
from prometheus_client.utils import floatToGoString

AWKWARD = ['quote"d', "back\\slash", "new\nline", "tab\tand ünïcode ✓", "", "{brace}=,", "trailing\\"]
VALUES = [0, 1, 7, 0.1, 1e-9, 123456, 1234567, 12345678.9, 2**53 + 1, 10**20, 1.5e300, -3.25, -1e7,
          math.inf, -math.inf, math.nan]


def view(pods: int, downloads: bool, turn: int = 0) -> NodeView:
    out = []
    for j in range(turn, turn + pods):  # each turn one pod goes and another comes
        odd = AWKWARD[j % len(AWKWARD)]
        out.append(PodView(
            f"ns-{j % 4}" if j % 5 else odd, f"pod-{j}" if j % 3 else f"{odd}-{j}",
            team=odd if j % 2 else "team-a", egress_class=f"class-{turn}" if j == turn + 1 else "bulk",
            minor=None if j % 11 == 0 else j + 2,
            limit_bps=VALUES[j % len(VALUES)], allocation_bps=VALUES[(j + 3) % len(VALUES)],
            demand_bps=VALUES[(j + 5) % len(VALUES)] + turn, throttled_seconds=3.0 + j + turn / 7,
            egress_bytes={"internal": 10 * j + turn, "internet": 10**12 + j * turn},
            ingress_bytes={"internal": 20, "internet": 2000 + j},
            dropped_packets=j * turn,
            problems=(("bad-class", "no class x"), (odd, "it")) if j % 9 == 0 else (),
            ingress_limit_bps=8e6 * j, ingress_allocation_bps=VALUES[(j + 7) % len(VALUES)],
            ingress_demand_bps=1e6 / (j + 1), ingress_throttled_seconds=1.0 + turn,
            ingress_dropped_packets=j))
    return NodeView("n1", out, egress_bytes={"internal": 5, "internet": 2**40 + turn},
                    ingress_bytes={"internal": 6, "internet": 7}, unknown_source_egress_bytes=turn,
                    allocation_bps=1e9 / 3, ready=bool(turn % 2), controller_reachable=True,
                    last_reconcile_success=1_790_000_000.123456 + turn, leaf_qdisc='fq_"codel"',
                    iptables_backend="nft\\legacy", ingress_allocation_bps=2.5e8 if downloads else None,
                    unknown_destination_ingress_bytes=3)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("downloads", [False, True])
def test_exposition_is_what_prometheus_client_renders(lean, downloads):
    current = {"view": view(110, downloads)}
    metrics = AgentMetrics(lambda: current["view"], lean=lean)
    metrics.reconcile_duration.observe(0.02)
    metrics.kernel_changes.labels('tc "class"\n').inc(3)
    metrics.report_failures.inc()
    for turn in range(6):
        current["view"] = view(110 - 20 * (turn % 2), downloads, turn)
        if turn == 4:
            current["view"] = view(0, downloads, turn)  # every pod gone
        ours, theirs = metrics.exposition(), generate_latest(metrics.registry)
        assert ours == theirs, first_difference(ours, theirs)
    assert b'namespace="quote\\"d"' in ours  # the last turn has escaped values


def test_the_pods_series_are_all_there():
    metrics = AgentMetrics(lambda: view(110, True))
    text = metrics.exposition().decode()
    assert text.count("\nnetagent_pod_egress_bytes_total{") == 2 * 110
    assert 'namespace="new\\nline"' in text and 'team="back\\\\slash"' in text


def test_help_text_is_escaped_as_prometheus_client_does():
    def families():
        return [(CounterMetricFamily("x_seconds", 'back\\slash and\nnewline "quoted"', labels=["b", "a"]),
                 [(["1", "2"], 3.5)]),
                (GaugeMetricFamily("y", "plain", labels=[]), [([], 2)])]

    class Registry:
        def collect(self):
            for family, rows in families():
                for labels, value in rows:
                    family.add_metric(labels, value)
                yield family
    assert render(families(), {}).encode() == generate_latest(Registry())


@pytest.mark.parametrize("value", VALUES + [5e-324, 0.0, -0.0, 999999.5, 1e6, 1e21, 3, True])
def test_numbers_are_formatted_as_go_does(value):
    assert go_float(value) == floatToGoString(value)


def first_difference(a: bytes, b: bytes) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"differ at byte {at}: ours {a[at - 80:at + 80]!r}\n theirs {b[at - 80:at + 80]!r}"
