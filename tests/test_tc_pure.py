"""tc logic that needs no kernel: BPF program, sizing, the diff."""
import pytest

from tc import bpf, sizing
from tc.diff import desired_classes, plan_ops
from tc.model import DEFAULT_MINOR, HtbClassSpec, ObservedClass, ObservedFilter, ObservedLeaf, ObservedShaper, ShaperSpec


def ticks(rate, size):
    return size * 1000 // max(rate, 1)


def spec(**kw):
    base = dict(
        ifb="na-ifb", uplinks=("eth0",), mark_bit=0x10000, node_rate=100_000_000,
        default=HtbClassSpec(DEFAULT_MINOR, 1_000_000, 1_000_000, "default"),
        pods=(HtbClassSpec(0x10, 10_000_000, 20_000_000, "a/p"),),
    )
    base.update(kw)
    return ShaperSpec(**base)


def converged(s: ShaperSpec) -> ObservedShaper:
    """What the kernel would report after applying s."""
    obs = ObservedShaper(ifb_index=7, ifb_ours=True, ifb_up=True, ifb_txqueuelen=s.ifb_txqueuelen,
                         root_kind="htb", root_handle_major=s.major, root_default_minor=DEFAULT_MINOR)
    for m, p in desired_classes(s, ticks).items():
        obs.classes[m] = ObservedClass(m, p.parent_minor, p.rate_bytes, p.ceil_bytes, p.buffer, p.cbuffer, p.quantum, 0)
    for c in s.classes:
        limit = sizing.leaf_limit_bytes(c.ceil) if s.leaf == "bfifo" else sizing.leaf_limit_packets(c.ceil)
        obs.leaves[c.minor] = ObservedLeaf(c.minor, s.leaf, c.minor, limit)
    for up in s.uplinks:
        obs.uplink_index[up] = 3
        obs.uplink_clsact[up] = True
        obs.filters[up] = [ObservedFilter(up, s.filter_pref, 1, "bpf", s.mark_bit, 7)]
    return obs


def test_bpf_program_matches_the_verified_bytecode():
    assert bpf.as_tc_bytecode(bpf.mark_test(0x10000)) == (
        "5,32 0 0 4294963220,84 0 0 65536,21 0 1 65536,6 0 0 4294967295,6 0 0 0"
    )
    raw = bpf.encode(bpf.mark_test(0x400))
    assert bpf.mark_bit_of(raw) == 0x400
    assert bpf.mark_bit_of(raw[:-8]) is None


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
    s = spec(uplinks=("eth0", "bond9"))
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
        spec(uplinks=())


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
    obs.leaves[0x10] = ObservedLeaf(0x10, "bfifo", 0x10, 1000)  # someone shrank it
    ops = plan_ops(s, obs, ticks)
    assert [(o.action, o.leaf_kind, o.leaf_limit) for o in ops] == [("replace_leaf", "bfifo", sizing.leaf_limit_bytes(20_000_000))]
