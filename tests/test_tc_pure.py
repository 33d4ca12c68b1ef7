"""tc logic that needs no kernel: BPF program, sizing, the diff."""
import re
from pathlib import Path

import pytest

from tc import markfilter, sizing
from tc.diff import desired_classes, desired_leaves, leaf_kind, plan_ops
from tc.model import (
    DEFAULT_MINOR,
    NODE_MINOR,
    ClassStats,
    HtbClassSpec,
    ObservedClass,
    ObservedFilter,
    ObservedLeaf,
    ObservedShaper,
    ShaperSpec,
    ack_minor,
    bulk_minor,
    fold_leaves,
)


def ticks(rate, size):
    return size * 1000 // max(rate, 1)


def spec(**kw):
    base = dict(
        ifb="na-ifb", devices=("eth0",), mark_bit=0x10000, node_rate=100_000_000,
        default=HtbClassSpec(DEFAULT_MINOR, 1_000_000, 1_000_000, "default"),
        pods=(HtbClassSpec(0x10, 10_000_000, 20_000_000, "a/p"),),
    )
    base.update(kw)
    return ShaperSpec(**base)


def converged(s: ShaperSpec, mtu: int = 1500) -> ObservedShaper:
    """What the kernel would report after applying s."""
    obs = ObservedShaper(ifb_index=7, ifb_ours=True, ifb_up=True, ifb_txqueuelen=s.ifb_txqueuelen,
                         root_kind="htb", root_handle_major=s.major, root_default_minor=DEFAULT_MINOR)
    for m, p in desired_classes(s, ticks).items():
        obs.classes[m] = ObservedClass(m, p.parent_minor, p.rate_bytes, p.ceil_bytes, p.buffer, p.cbuffer, p.quantum, p.prio)
    obs.feed_mtu = mtu
    for c in desired_leaves(s):
        kind = leaf_kind(s, c)
        limit = sizing.leaf_limit_bytes(c.ceil) if kind in ("bfifo", "tbf") else sizing.leaf_limit_packets(c.ceil)
        if kind == "tbf":
            obs.leaves[c.minor] = ObservedLeaf(c.minor, kind, c.minor, limit, sizing.SEGMENTER_RATE_BYTES,
                                               sizing.segmenter_burst_bytes(mtu))
        else:
            obs.leaves[c.minor] = ObservedLeaf(c.minor, kind, c.minor, limit)
    for up in s.devices:
        obs.uplink_index[up] = 3
        obs.uplink_clsact[up] = True
        obs.filters[up] = [ObservedFilter(up, s.filter_pref, 1, "bpf", s.mark_bit, 7)]
    return obs


def test_bpf_program_matches_the_verified_bytecode():
    assert markfilter.as_tc_bytecode(markfilter.mark_test(0x10000)) == (
        "5,32 0 0 4294963220,84 0 0 65536,21 0 1 65536,6 0 0 4294967295,6 0 0 0"
    )
    raw = markfilter.encode(markfilter.mark_test(0x400))
    assert markfilter.mark_bit_of(raw) == 0x400
    assert markfilter.mark_bit_of(raw[:-8]) is None


def test_sizing_is_gso_safe_and_bounded():
    assert sizing.burst_bytes(10_000_000) >= 64 * 1024
    assert sizing.burst_bytes(100_000_000_000) >= 100_000_000_000 // 8 // 1000
    assert sizing.quantum_bytes(8) == sizing.MTU_BYTES
    assert sizing.quantum_bytes(10**15) == sizing.MAX_QUANTUM
    assert 64 <= sizing.leaf_limit_packets(10**6) <= sizing.leaf_limit_packets(10**10) <= 2000


def test_empty_kernel_builds_everything_in_safe_order():
    ops = [o.action for o in plan_ops(spec(), ObservedShaper(uplink_index={"eth0": 3}), ticks)]
    assert ops[0] == "create_ifb" and ops[1] == "add_root"
    # the redirect filter is the last thing: no packet reaches an IFB without its classes
    assert ops[-1] == "add_filter"
    assert ops.index("add_class") < ops.index("add_clsact")


def test_converged_state_plans_nothing():
    s = spec()
    assert plan_ops(s, converged(s), ticks) == []


def test_a_pod_is_an_inner_class_whose_control_leaf_goes_first_and_whose_leaves_share_its_rate():
    s = spec(pods=(HtbClassSpec(0x10, 10_000_000, 20_000_000, "a/p"), HtbClassSpec(0x3FFF, 8, 8, "a/tiny")))
    want = desired_classes(s, ticks)
    assert set(want) == {NODE_MINOR, DEFAULT_MINOR, 0x10, 0x4010, 0x8010, 0x3FFF, 0x7FFF, 0xBFFF}
    pod, ack, bulk = want[0x10], want[ack_minor(0x10)], want[bulk_minor(0x10)]
    assert pod.parent_minor == NODE_MINOR and pod.inner and want[DEFAULT_MINOR].parent_minor == NODE_MINOR
    assert (ack.parent_minor, bulk.parent_minor) == (0x10, 0x10)
    assert ack.prio < bulk.prio and not ack.inner and not bulk.inner
    # HTB lets a leaf under its own rate send without asking its parent: the leaves' rates add up to the pod's
    assert ack.rate_bytes + bulk.rate_bytes == pod.rate_bytes and 0 < ack.rate_bytes < bulk.rate_bytes
    assert ack.ceil_bytes == bulk.ceil_bytes == pod.ceil_bytes
    assert [leaf.minor for leaf in desired_leaves(s)] == sorted([DEFAULT_MINOR, 0x4010, 0x8010, 0x7FFF, 0xBFFF])
    with pytest.raises(ValueError, match="above 0x3fff"):
        spec(pods=(HtbClassSpec(0x4010, 8, 8, "a/p"),))


def test_an_inner_classs_quantum_and_prio_are_not_compared_a_leafs_are():
    s = spec()
    obs = converged(s)
    pod = obs.classes[0x10]
    obs.classes[0x10] = ObservedClass(0x10, pod.parent_minor, pod.rate_bytes, pod.ceil_bytes, pod.buffer, pod.cbuffer,
                                      12345, 3)  # the creation-time values HTB keeps once a class has children
    assert plan_ops(s, obs, ticks) == []
    leaf = obs.classes[0x8010]
    obs.classes[0x8010] = ObservedClass(0x8010, leaf.parent_minor, leaf.rate_bytes, leaf.ceil_bytes, leaf.buffer,
                                        leaf.cbuffer, leaf.quantum, 1)
    assert [(o.action, o.minor) for o in plan_ops(s, obs, ticks)] == [("change_class", 0x8010)]


def test_an_older_layouts_pod_leaf_gains_its_two_leaves_and_a_gone_pods_leaves_go_before_it():
    """Upgrade: a pod class that was a leaf (its pfifo under it) keeps its minor and gets its two
    leaves added under it (HTB turns it into an inner class); removal deletes children first."""
    s = spec()
    obs = converged(s)
    for m in (0x4010, 0x8010):
        del obs.classes[m], obs.leaves[m]
    obs.leaves[0x10] = ObservedLeaf(0x10, "pfifo", 0x10, 64)
    actions = [(o.action, o.minor) for o in plan_ops(s, obs, ticks)]
    assert actions == [("add_class", 0x4010), ("add_class", 0x8010),
                       ("replace_leaf", 0x4010), ("replace_leaf", 0x8010)]
    gone = plan_ops(spec(pods=()), converged(s), ticks)
    assert [(o.action, o.minor) for o in gone] == [("delete_class", 0x8010), ("delete_class", 0x4010), ("delete_class", 0x10)]


def test_class_stats_fold_a_pods_leaves_into_the_pod():
    def st(minor, nbytes, drops, over, backlog):
        return ClassStats(minor, nbytes, nbytes // 1000, drops, over, backlog, backlog // 1000, 125, 250)
    raw = {0x10: st(0x10, 9000, 0, 1, 0), 0x4010: st(0x4010, 8000, 3, 2, 5000), 0x8010: st(0x8010, 1000, 1, 0, 64),
           DEFAULT_MINOR: st(DEFAULT_MINOR, 7, 0, 0, 0), NODE_MINOR: st(NODE_MINOR, 9007, 0, 0, 0),
           0x8011: st(0x8011, 5, 0, 0, 0)}  # a leaf whose pod class is missing keeps its own entry
    out = fold_leaves(raw)
    assert set(out) == {0x10, DEFAULT_MINOR, NODE_MINOR, 0x8011}
    assert out[0x10] == ClassStats(0x10, 9000, 9, 4, 3, 5064, 5, 125, 250)


def test_rate_change_is_in_place_and_deletion_last():
    old = spec(pods=(HtbClassSpec(0x10, 10_000_000, 20_000_000, "a/p"), HtbClassSpec(0x11, 1_000_000, 1_000_000, "a/q")))
    new = spec(pods=(HtbClassSpec(0x10, 30_000_000, 40_000_000, "a/p"),))
    ops = plan_ops(new, converged(old), ticks)
    actions = [(o.action, o.minor) for o in ops]
    assert ("change_class", 0x10) in actions
    assert actions[-1] == ("delete_class", 0x11)
    assert not any(a in ("add_root", "delete_root", "create_ifb") for a, _ in actions)


def test_rates_above_34_gbit_are_kept_exact():
    s = spec(node_rate=100_000_000_000, pods=(HtbClassSpec(0x10, 40_000_000_000, 80_000_000_000, "a/p"),))
    p = desired_classes(s, ticks)[0x10]
    assert p.rate_bytes == 5_000_000_000 and p.ceil_bytes == 10_000_000_000


def test_foreign_root_is_replaced_and_wrong_filter_replaced():
    s = spec()
    obs = converged(s)
    obs.root_kind, obs.root_handle_major = "tbf", 0x8001
    obs.filters["eth0"] = [ObservedFilter("eth0", s.filter_pref, 1, "bpf", 0x4000, 7)]
    ops = [o.action for o in plan_ops(s, obs, ticks)]
    assert ops[:2] == ["delete_root", "add_root"]
    assert "replace_filter" in ops


def test_missing_uplink_is_reported():
    s = spec(devices=("eth0", "bond9"))
    obs = converged(spec())
    obs.uplink_index["bond9"] = None
    assert any(o.action == "missing_uplink" and o.device == "bond9" for o in plan_ops(s, obs, ticks))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(rate=0, ceil=10), "too small"),
        (dict(rate=-5, ceil=10), "too small"),
        (dict(rate=10, ceil=2**64), r"exceeds 2\^64"),
        (dict(rate=20, ceil=10), "below rate"),
        (dict(rate=1.5, ceil=10), "integer"),
    ],
)
def test_bad_rates_are_clear_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        HtbClassSpec(0x10, kw["rate"], kw["ceil"], "ns/pod")


@pytest.mark.parametrize("bit", [0, 3, 1 << 32, -1])
def test_bad_mark_bit(bit):
    with pytest.raises(ValueError, match="exactly one bit"):
        spec(mark_bit=bit)


def test_bad_ifb_name_and_empty_uplinks():
    with pytest.raises(ValueError, match="IFB name"):
        spec(ifb="x" * 16)
    with pytest.raises(ValueError, match="no uplink"):
        spec(devices=())


def test_probe_without_ifb_names_only_the_ifb():
    """The probe tries every other feature on an IFB: without one it knows nothing else, and must
    not send the operator loading modules the kernel may well have."""
    from tc.probe import Capabilities

    assert Capabilities().missing() == ["IFB device (ifb module); the other tc features could not be tried without it"]
    caps = Capabilities(frozenset({"htb", "clsact", "pfifo"}), frozenset({"bpf"}), frozenset(), ifb=True)
    assert caps.missing() == ["action mirred (act_mirred)"] and caps.leaf_qdisc == "pfifo"
    assert Capabilities(frozenset({"fq_codel"}), ifb=True).leaf_qdisc == "fq_codel"


def test_bfifo_leaf_is_sized_in_bytes_and_kept_when_converged():
    """A byte-limited leaf: 5 ms at the ceil plus one 64 KiB GSO packet (a GSO packet can always pass)."""
    assert sizing.leaf_limit_bytes(20_000_000) == 2_500_000 * 5 // 1000 + 65536 + 1514
    assert sizing.leaf_limit_bytes(10**9) == 125_000_000 * 5 // 1000 + 65536 + 1514
    # an uncapped pod's ceil (up to MAX_BPS) must still fit the kernel's 32-bit limit
    assert sizing.leaf_limit_bytes(2**53) == sizing.LEAF_LIMIT_MAX_BYTES < 2**31
    assert sizing.leaf_limit_bytes(400 * 10**9) == 50_000_000 * 5 + 65536 + 1514
    s = spec(leaf="bfifo")
    assert plan_ops(s, converged(s), ticks) == []
    obs = converged(s)
    obs.leaves[0x4010] = ObservedLeaf(0x4010, "bfifo", 0x4010, 1000)  # someone shrank it
    ops = plan_ops(s, obs, ticks)
    assert [(o.action, o.leaf_kind, o.leaf_limit) for o in ops] == [("replace_leaf", "bfifo", sizing.leaf_limit_bytes(20_000_000))]


def test_the_segmenting_leaf_follows_the_ceil_and_the_feeding_devices_mtu():
    """tbf leaf: a rate far above any ceil (it never shapes), a bucket of one frame of the largest MTU
    feeding the IFB (a larger non-GSO packet would be dropped), the byte limit of bfifo."""
    s = spec(leaf="tbf")
    assert sizing.segmenter_burst_bytes(1500) == 1522 and sizing.segmenter_burst_bytes(9001) == 9023
    assert sizing.segmenter_burst_bytes(0) == 1522  # a device that reports no MTU: at least Ethernet's
    r = sizing.SEGMENTER_RATE_BYTES
    ops = plan_ops(s, ObservedShaper(), ticks)
    leaves = [o for o in ops if o.action == "replace_leaf"]
    assert {(o.minor, o.leaf_kind, o.leaf_rate, o.leaf_burst, o.leaf_limit) for o in leaves} == {
        (DEFAULT_MINOR, "tbf", r, 1522, sizing.leaf_limit_bytes(1_000_000)),
        (0x4010, "tbf", r, 1522, sizing.leaf_limit_bytes(20_000_000)),
        (0x8010, "tbf", r, 1522, sizing.leaf_limit_bytes(20_000_000)),
    }
    assert plan_ops(s, converged(s), ticks) == []
    # jumbo frames on the uplink: every leaf's bucket grows, nothing else changes
    jumbo = converged(s)
    jumbo.feed_mtu = 9000
    ops = plan_ops(s, jumbo, ticks)
    assert {(o.action, o.leaf_burst) for o in ops} == {("replace_leaf", 9022)} and len(ops) == 3
    assert plan_ops(s, converged(s, mtu=9000), ticks) == []
    # a ceil change changes the leaves' limit with the classes
    faster = spec(leaf="tbf", pods=(HtbClassSpec(0x10, 10_000_000, 40_000_000, "a/p"),))
    ops = plan_ops(faster, converged(s), ticks)
    assert {(o.minor, o.leaf_limit) for o in ops if o.action == "replace_leaf"} == {
        (0x4010, sizing.leaf_limit_bytes(40_000_000)), (0x8010, sizing.leaf_limit_bytes(40_000_000))}
    # a pfifo leaf left by an older netagent is replaced
    old = converged(spec(leaf="pfifo"))
    assert {o.leaf_kind for o in plan_ops(s, old, ticks) if o.action == "replace_leaf"} == {"tbf"}


def test_only_slow_classes_are_segmented_and_a_ceil_near_the_boundary_keeps_its_queue():
    """Splitting costs CPU per frame: classes above SEGMENT_CEIL_BPS get pfifo. Between it and twice it
    a leaf keeps its kind, so a ceil moving around the boundary does not replace its queue each period."""
    t = sizing.SEGMENT_CEIL_BPS

    def pod(ceil):
        return spec(leaf="tbf", pods=(HtbClassSpec(0x10, 1_000_000, ceil, "a/p"),))

    def kinds(s, obs):
        return {o.minor: o.leaf_kind for o in plan_ops(s, obs, ticks) if o.action == "replace_leaf"}

    assert kinds(pod(t), ObservedShaper())[0x4010] == "tbf"
    assert kinds(pod(t + 8), ObservedShaper())[0x4010] == "pfifo"  # a new leaf in the band: the cheap kind
    slow, fast = converged(pod(t)), converged(pod(4 * t))
    assert slow.leaves[0x4010].kind == "tbf" and fast.leaves[0x4010].kind == "pfifo"
    # in the band each keeps its kind: only the limit follows the ceil
    assert kinds(pod(2 * t), slow) == {0x4010: "tbf", 0x8010: "tbf"}
    assert set(kinds(pod(t + 8), fast).values()) <= {"pfifo"}  # (its packet limit is capped: nothing to do)
    assert all(o.leaf_limit == sizing.leaf_limit_bytes(2 * t) for o in plan_ops(pod(2 * t), slow, ticks)
               if o.action == "replace_leaf")
    # beyond the band the kind changes
    assert kinds(pod(2 * t + 8), slow) == {0x4010: "pfifo", 0x8010: "pfifo"}
    assert kinds(pod(t), fast) == {0x4010: "tbf", 0x8010: "tbf"}
    # a restart adopts a leaf of either kind in the band
    for s, obs in ((pod(t), slow), (pod(4 * t), fast)):
        assert plan_ops(s, obs, ticks) == []


def test_a_tiny_guarantee_keeps_its_buckets_within_htbs_32_bit_buffer():
    """A pod guaranteed a few kbit/s gives its control leaf an eighth of that: a 64 KiB bucket at
    ~1 kbit/s is more ticks than HTB's 32-bit buffer holds, so the bucket is cut to fit."""
    from tc.diff import MAX_TICKS, class_params

    def kernel_ticks(rate_b, size):  # psched ticks as the kernel counts them: 64 ns each
        return int(size * 1_000_000_000 / rate_b / 64)

    for bps in (8, 800, 8_000, 10**6, 10**10):
        p = class_params(None, 0x8010, 0x10, bps, max(bps, 10**9), kernel_ticks)
        assert 0 < p.buffer <= MAX_TICKS and 0 < p.cbuffer <= MAX_TICKS
        if bps >= 10**6:
            assert p.burst_bytes == sizing.burst_bytes(bps)  # only buckets that cannot fit are cut


def test_ingress_and_egress_in_tc_are_hook_words_only():
    """In tc/, "ingress" and "egress" name a device's hook (clsact's, tcx's), never a pod's direction
    (upload, download: the shaper's IFB aliases are UPLOAD_/DOWNLOAD_). The one exception is the
    node counter's keys, which are the rules' node kinds that the agent's counters share."""
    hook_words = {"ingress", "egress", "CLSACT_INGRESS", "CLSACT_EGRESS", "BPF_TCX_INGRESS", "BPF_TCX_EGRESS",
                  "TC_H_MIN_INGRESS", "TC_H_MIN_EGRESS"}
    rules_kinds = {"egress_internal", "ingress_internal", "ingress_internet"}  # InternalCounter.read_node
    tc_dir = Path(__file__).resolve().parents[1] / "tc"
    found = {(word, str(path.relative_to(tc_dir))) for path in tc_dir.rglob("*.py")
             for word in re.findall(r"\b\w*(?:ingress|egress)\w*\b", path.read_text(), re.IGNORECASE)}
    assert {(w, p) for w, p in found if w not in hook_words | rules_kinds} == set()
    assert {p for w, p in found if w in rules_kinds} == {"ebpf/counter.py"}
