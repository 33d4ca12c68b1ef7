"""A class's frames per IP byte, measured from its own counters (netagent/frames.py), and what the
desired state makes of it: a rate is IP bytes for the packets the class really carries."""
from __future__ import annotations

import math

import pytest

from core.direction import PerDirection
from netagent.desired import (NODE_RATIO_KEY, DataPathOptions, DesiredStateError, NodeInputs, PodShape, frames_bits,
                              desired_state, from_wire, to_wire)
from netagent.frames import MAX_EXTRA, MIN_PACKETS, STEP, FrameRatios

FULL = 1514 / 1500
M = 1_000_000


def mix(bulk: int, acks: int) -> tuple[int, int]:
    """(frame bytes, packets) of `bulk` full-size segments and `acks` pure ACKs (52 IP bytes)."""
    return bulk * 1514 + acks * 66, bulk + acks


def test_a_class_carrying_acks_beside_its_data_gets_its_measured_ratio():
    w = FrameRatios(1500, 14)
    w.observe("ns/p", 0, 0)
    frames, packets = mix(1000, 500)  # a pod uploading at its limit while it downloads: an ACK per 2 segments
    w.observe("ns/p", frames, packets)
    assert w.get("ns/p") == pytest.approx(frames / (frames - 14 * packets))
    assert w.get("ns/p") / FULL - 1 == pytest.approx(0.0044, abs=1e-4)


def test_full_size_traffic_keeps_the_full_size_ratio_and_noise_changes_nothing():
    w = FrameRatios(1500, 14)
    w.observe("ns/p", 0, 0)
    frames, packets = mix(2000, 0)
    w.observe("ns/p", frames, packets)
    assert w.get("ns/p") is None  # nothing measured that differs: to_wire's exact full-size conversion
    f2, p2 = mix(1000, 500)
    w.observe("ns/p", frames + f2, packets + p2)
    first = w.get("ns/p")
    f3, p3 = mix(1000, 480)  # the mix moved by less than STEP: the class is not changed
    w.observe("ns/p", frames + f2 + f3, packets + p2 + p3)
    assert w.get("ns/p") == first
    assert abs(((f3 / (f3 - 14 * p3)) / first) - 1) <= STEP


def test_a_ratio_needs_enough_packets_and_is_bounded():
    w = FrameRatios(1500, 14)
    w.observe("a", 0, 0)
    w.observe("a", *mix(0, MIN_PACKETS - 1))  # too few packets: no ratio yet, the window goes on
    assert w.get("a") is None
    w.observe("a", *mix(0, MIN_PACKETS))
    assert w.get("a") == pytest.approx(FULL * (1 + MAX_EXTRA))  # ACKs only (1.27): held to the bound
    w.observe("a", 10, 1)  # the counters went back (the class was re-made): a new window
    w.observe("a", 10 + 66 * 500, 501)
    assert w.get("a") == pytest.approx(FULL * (1 + MAX_EXTRA))
    w.keep(["b"])
    assert w.get("a") is None


def test_the_desired_state_gives_each_class_its_ratio_and_the_view_reads_the_ip_rate_back():
    opts = DataPathOptions()
    ratio, node_ratio = FULL * 1.0044, FULL * 1.002
    rate, ceil = PerDirection(10 * M, 30 * M), PerDirection(20 * M, 40 * M)
    pods = (PodShape("ns/a", ("10.0.0.2",), rate, ceil, wire_ratio=PerDirection.same(ratio)),
            PodShape("ns/b", ("10.0.0.3",), rate, ceil))
    d = desired_state(NodeInputs(("eth0",), ("10.0.0.0/8",), pods, PerDirection(100 * M, 200 * M), opts,
                                 wire_ratio=PerDirection(node_ratio, None)))
    a, b = (next(c for c in d.shaper.pods if c.key == k) for k in ("ns/a", "ns/b"))
    assert (a.rate, a.ceil) == (math.ceil(10 * M * ratio / 8) * 8, math.ceil(20 * M * ratio / 8) * 8)
    assert (b.rate, b.ceil) == (to_wire(10 * M, opts), to_wire(20 * M, opts))  # not measured: full-size, exact
    assert d.shaper.node_rate == math.ceil(100 * M * node_ratio / 8) * 8
    ia = next(c for c in d.shapers.download.pods if c.key == "ns/a")
    assert ia.ceil == math.ceil(40 * M * ratio / 8) * 8
    assert d.shapers.download.node_rate == to_wire(200 * M, opts)
    assert d.wire_ratios == PerDirection({"ns/a": ratio, NODE_RATIO_KEY: node_ratio}, {"ns/a": ratio})
    assert abs(from_wire(a.ceil, opts, ratio) - 20 * M) <= 8  # what the view shows: the IP limit
    for bad in (0.9, float("nan"), 3.0):
        with pytest.raises(DesiredStateError, match="frames per IP byte"):
            desired_state(NodeInputs(("eth0",), (), (PodShape("ns/a", ("10.0.0.2",), M, M, wire_ratio=bad),), M, opts))


def test_a_restarted_agent_keeps_the_ratio_the_kernel_shows_and_nothing_else():
    """The agent before the restart gave a class its measured ratio; the new process, which has
    measured nothing yet, takes that ratio back from the class's HTB rate and ceil when they are
    exactly its IP numbers in frames of one ratio within the bounds, so its first sync changes
    nothing. A full-size class, a number out of the bounds (a class someone else changed) or a
    class it has measured already is not seeded."""
    old = FULL * 1.0137
    for rate, ceil in ((3 * M, 20 * M), (19_999_999, 20_000_001), (123_456, 7_654_321), (10 * M, 10 * M)):
        w = FrameRatios(1500, 14)
        w.seed("ns/p", rate, ceil, frames_bits(rate, old), frames_bits(ceil, old))
        got = w.get("ns/p")
        assert got == pytest.approx(old, rel=1e-6)
        assert (frames_bits(rate, got), frames_bits(ceil, got)) == (frames_bits(rate, old), frames_bits(ceil, old))
    w = FrameRatios(1500, 14)
    opts = DataPathOptions()
    w.seed("full", M, 20 * M, to_wire(M, opts), to_wire(20 * M, opts))
    w.seed("beyond", M, 20 * M, frames_bits(M, FULL * 1.05), frames_bits(20 * M, FULL * 1.05))
    w.seed("adopted", M, 20 * M, frames_bits(M, old) + 8, frames_bits(20 * M, old))  # not one ratio: left
    assert w.ratios == {}
    w.observe("measured", 0, 0)
    w.observe("measured", *mix(1000, 500))
    measured = w.get("measured")
    w.seed("measured", M, 20 * M, frames_bits(M, old), frames_bits(20 * M, old))
    assert w.get("measured") == measured
