"""The desired kernel state is pure: same inputs, same desired state; bad input is a clear error."""
import pytest

from core.direction import PerDirection
from netagent.desired import (DataPathOptions, DesiredStateError, NodeInputs, PodShape, assign_minors, desired_state,
                              from_wire, ip_bytes, to_wire)
from tc.model import DEFAULT_MINOR, RESERVED_MINORS


def inputs(pods=(), **kw):
    base = dict(uplinks=("eth0",), internal_cidrs=("10.0.0.0/8", "fd00::/8"), pods=tuple(pods), node_rate=1_000_000_000)
    base.update(kw)
    return NodeInputs(**base)


def pod(key, *ips, rate=10_000_000, ceil=20_000_000):
    return PodShape(key, ips, rate, ceil)


def test_minors_follow_the_ip_and_are_stable():
    a = desired_state(inputs([pod("ns/a", "10.244.0.11"), pod("ns/b", "10.244.0.12", "fd00::12")]))
    b = desired_state(inputs([pod("ns/b", "10.244.0.12", "fd00::12"), pod("ns/a", "10.244.0.11")]))
    assert a == b
    assert a.minors == {"ns/a": 11, "ns/b": 12}
    # packets are steered to the pod's leaves: bulk data, and small TCP segments to the control leaf
    assert {c.tc_class for c in a.classifier.pods} == {(1, 0x4000 | 11), (1, 0x4000 | 12)}
    assert {c.ack_class for c in a.classifier.pods} == {(1, 0x8000 | 11), (1, 0x8000 | 12)}
    assert {c.ingress_class for c in a.classifier.pods} == {None}  # downloads not shaped here
    # the low 14 bits of the address: the minors above 0x3fff are the pods' leaves
    assert assign_minors([pod("ns/c", "10.244.64.5")]) == {"ns/c": 5}


def test_minor_collisions_and_reserved_values_probe_upward():
    pods = [pod("ns/x", "10.1.0.1"), pod("ns/y", "10.2.0.1"), pod("ns/z", "10.3.255.254")]
    minors = assign_minors(pods)
    assert len(set(minors.values())) == 3
    assert not set(minors.values()) & RESERVED_MINORS


def test_pod_rates_are_clamped_to_the_node_and_default_class_floor():
    d = desired_state(inputs([pod("ns/a", "10.244.0.11", rate=5_000_000_000, ceil=9_000_000_000)], node_rate=100_000_000))
    (c,) = d.shaper.pods
    assert c.rate == c.ceil == to_wire(100_000_000, DataPathOptions()) == d.shaper.node_rate
    assert d.shaper.default.minor == DEFAULT_MINOR and d.shaper.default.rate == d.shaper.default.ceil


def test_unknown_sources_are_classified_to_the_default_class():
    d = desired_state(inputs([pod("ns/a", "10.244.0.11")], options=DataPathOptions(htb_majors=PerDirection(0x7, 0x2))))
    assert d.classifier.default_class == (0x7, DEFAULT_MINOR) == (d.shaper.major, d.shaper.default.minor)


def test_pod_without_ip_waits_and_reused_ip_goes_to_one_pod():
    d = desired_state(inputs([pod("ns/new"), pod("ns/old", "10.244.0.11"), pod("ns/reuse", "10.244.0.11")]))
    assert d.skipped["ns/new"] == "no IP yet"
    assert "still in use by ns/old" in d.skipped["ns/reuse"]
    assert set(d.minors) == {"ns/old"}


def test_internal_cidrs_are_canonical():
    d = desired_state(inputs(internal_cidrs=("10.0.0.5/8", "fd00::1/8", "10.0.0.0/8")))
    assert d.classifier.internal_cidrs == ("10.0.0.0/8", "fd00::/8")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(internal_cidrs=("10.0.0.0/33",)), "10.0.0.0/33"),
        (dict(internal_cidrs=("banana",)), "banana"),
        (dict(node_rate=0), "positive"),
        (dict(node_rate=-1), "positive"),
        (dict(node_rate=2**64), "2\\^64"),
        (dict(uplinks=()), "no uplink"),
        (dict(pods=(pod("ns/a", "10.244.0.300"),)), "ns/a.*not an IP"),
        (dict(pods=(pod("ns/a", "10.244.0.3", rate=0),)), "ns/a.*positive"),
        (dict(options=DataPathOptions(floors=PerDirection(0, 1_000_000))), "floor"),
        (dict(options=DataPathOptions(wire_mtu=0)), "MTU"),
    ],
)
def test_bad_input_names_the_thing(kw, message):
    with pytest.raises(DesiredStateError, match=message):
        desired_state(inputs(**kw))


@pytest.mark.parametrize("mtu,l2", [(1500, 14), (9000, 14), (1280, 18), (1500, 0)])
def test_rates_are_ip_bytes_and_the_classes_carry_them_in_frames(mtu, l2):
    """A configured rate is IP bytes per second on the wire: the HTB class (which counts frames)
    gets rate x (MTU + L2) / MTU, so full-size segments carry exactly the IP rate; the inverse
    gives back what a restarted agent adopts, and re-applying it changes nothing in HTB's bytes/s."""
    opts = DataPathOptions(wire_mtu=mtu, wire_l2_bytes=l2)
    for ip_bps in (8, 1_000_000, 20_000_000, 123_456_789, 10**10):
        wire = to_wire(ip_bps, opts)
        assert wire % 8 == 0  # HTB holds bytes/s: the kernel holds exactly this
        segments = ip_bps / 8 / mtu  # full-size IP packets per second
        assert 0 <= wire / 8 - segments * (mtu + l2) < 1
        assert to_wire(from_wire(wire, opts), opts) == wire  # what a restarted agent adopts re-applies unchanged
        if ip_bps % 8 == 0:
            assert from_wire(wire, opts) == ip_bps  # a round rate reads back as itself
    assert ip_bytes(10 * (mtu + l2), 10, opts) == 10 * mtu


def test_no_pod_gets_a_minor_whose_leaf_handle_is_an_htb_root():
    """A pod's leaf qdisc is <minor>:, so minors 1 and 2 (the upload and download roots' majors)
    are never a pod's: a pod at 10.0.0.2 (low 16 bits 0x0002) once made the download tree EINVAL."""
    from tc.model import DOWNLOAD_ROOT_MAJOR, NODE_MINOR

    pods = [PodShape(f"ns/p{i}", (f"10.244.0.{i}",), 1_000_000, 1_000_000) for i in range(0, 5)]
    minors = assign_minors(pods)
    assert NODE_MINOR not in minors.values() and DOWNLOAD_ROOT_MAJOR not in minors.values()
    assert len(set(minors.values())) == len(pods)


def test_internal_bytes_counted_on_the_devices_of_the_programmed_pods():
    """With `internal_by_device` the desired state names the device counter's internal networks (link-local
    and multicast too, as the rules' scope test), every programmed pod's addresses, the pod devices (the
    uplinks never) and the uplinks for the node's totals; without it there is none, and the rules count."""
    pods = [pod("ns/a", "10.244.0.11", "fd00::11"), pod("ns/b"), pod("ns/c", "10.244.0.12")]
    opts = DataPathOptions(internal_by_device=True)
    st = desired_state(inputs(pods, options=opts, pod_devices=("veth1", "eth0", "veth0")))
    assert st.classifier.internal_by_device
    c = st.device_counting
    assert c.networks == ((4, ("10.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "255.255.255.255/32")),
                          (6, ("fd00::/8", "fe80::/10", "ff00::/8")))
    assert c.addresses == ("10.244.0.11", "10.244.0.12", "fd00::11")  # ns/b has no address yet
    assert c.devices == ("veth0", "veth1")
    assert c.uplinks == ("eth0",)  # the node's totals are counted there
    plain = desired_state(inputs(pods, pod_devices=("veth0",)))
    assert plain.device_counting is None and not plain.classifier.internal_by_device
