"""KernelDataPath's counters on a real kernel (a scratch namespace with a veth uplink):
read once and shared, never beside an apply's half-done state.

Needs root; nothing here touches the root network namespace.
"""
from __future__ import annotations

import pytest

from lab.netns import scratch_netns, sh
from netagent.datapath import KernelDataPath
from netagent.desired import DataPathOptions, NodeInputs, PodShape, desired_state
from tc.probe import probe

pytestmark = pytest.mark.root

M = 1_000_000


def inputs(pods: dict[str, str], options: DataPathOptions) -> NodeInputs:
    shapes = tuple(PodShape(f"default/{name}", (ip,), 10 * M, 10 * M) for name, ip in pods.items())
    return NodeInputs(("eth0",), ("10.0.0.0/8", "fd00::/8"), shapes, 100 * M, options)


@pytest.fixture
def datapath():
    with scratch_netns("dp") as ns:
        sh("ip link add eth0 type veth peer name eth0p && ip link set eth0 up && ip link set eth0p up", ns)
        dp = KernelDataPath(DataPathOptions(leaf_qdisc=probe(ns).leaf_qdisc), iptables_backend="nft", netns=ns)
        try:
            yield dp
        finally:
            dp._classifier.cleanup()
            dp.close()


def test_counters_are_read_once_and_shared(datapath):
    datapath.apply(desired_state(inputs({"a": "10.1.0.5"}, datapath.options)))
    first = datapath.counters()  # the reporter's read, fresh
    for _ in range(20):  # twenty scrapes within the second: no kernel read of their own
        assert datapath.counters(max_age=1.0) == first
    assert datapath.reads["counters"] == 1
    first[0]["default/a"]["egress_internet"] = 123  # a caller's copy, not the shared one
    assert datapath.counters(max_age=1.0)[0]["default/a"]["egress_internet"] == 0
    # nothing sent yet, in the unit of the budget; at most the lab link's own IPv6 autoconfiguration
    # (a link-local multicast or two at link-up, which CI once counted: 56 bytes)
    assert first[1]["egress_internet_wire"] < 1024
    datapath.counters()
    assert datapath.reads["counters"] == 2

    t, stats = datapath.sample_stats()  # the sampler's read...
    reads = datapath.reads["class_stats"]
    for _ in range(20):
        assert datapath.class_stats() is stats  # ...is what scrapes see
    assert datapath.reads["class_stats"] == reads


def test_a_read_beside_an_apply_is_redone_under_the_lock(datapath):
    """The byte counters are read without the sync loop's lock; when an apply ran during the read
    (here: a pod added while the sets were being read), the result is thrown away and read again
    under the lock, so it always matches the classifier's state."""
    opts = datapath.options
    datapath.apply(desired_state(inputs({"a": "10.1.0.5"}, opts)))
    real = datapath._classifier.counters
    calls = []

    def read_while_applying():
        calls.append(1)
        found = real()
        if len(calls) == 1:  # the sets were read; now the sync loop adds a pod
            datapath.apply(desired_state(inputs({"a": "10.1.0.5", "b": "10.1.0.6"}, opts)))
        return found

    datapath._classifier.counters = read_while_applying
    pods, _ = datapath.counters()
    assert len(calls) == 2
    assert set(pods) == {"default/a", "default/b"}
