"""tc executor against the real kernel, in scratch namespaces."""
import pytest

from tc.errors import TcError
from tc.model import DEFAULT_MINOR, HtbClassSpec, ShaperSpec
from tc.netlink import Shaper
from tc.probe import probe, require
from tests.netns import scratch_netns, sh

pytestmark = pytest.mark.root


def make_spec(pods=None, **kw):
    base = dict(
        ifb="na-ifb0", uplinks=("eth0",), mark_bit=0x20000, node_rate=1_000_000_000,
        default=HtbClassSpec(DEFAULT_MINOR, 1_000_000, 1_000_000, "default"),
        pods=tuple(pods if pods is not None else (
            HtbClassSpec(0x10A, 10_000_000, 20_000_000, "a/p1"),
            HtbClassSpec(0x10B, 40_000_000_000, 60_000_000_000, "a/p2"),
        )),
    )
    base.update(kw)
    return ShaperSpec(**base)


@pytest.fixture
def node():
    with scratch_netns("tc") as ns:
        sh("ip link add eth0 type veth peer name eth1 && ip link set eth0 up && ip link set eth1 up", ns)
        yield ns


def snapshot(ns):
    return sh("tc qdisc show; tc filter show dev eth0 egress 2>/dev/null; ip -o link | sed 's/^[0-9]*: //'", ns)


def test_apply_is_idempotent_and_adopted_after_restart(node):
    spec = make_spec()
    with Shaper(node) as s:
        first = s.apply(spec)
        assert first.changes > 0
        assert s.apply(spec).changes == 0
    # a new process (restart) adopts what it finds: nothing to do
    with Shaper(node) as s2:
        assert s2.plan(spec) == []
    classes = sh("tc class show dev na-ifb0", node)
    assert "rate 40Gbit ceil 60Gbit" in classes  # 64-bit rate attributes
    assert "rate 10Mbit ceil 20Mbit" in classes
    filt = sh("tc filter show dev eth0 egress", node)
    assert "bytecode '5,32 0 0 4294963220,84 0 0 131072,21 0 1 131072" in filt
    assert "Redirect to device na-ifb0" in filt
    assert "default 0xfffe" in sh("tc qdisc show dev na-ifb0", node)


def test_change_in_place_and_delete(node):
    with Shaper(node) as s:
        s.apply(make_spec())
        handle_before = sh("tc qdisc show dev na-ifb0 | grep htb", node)
        changed = make_spec(pods=[HtbClassSpec(0x10A, 30_000_000, 30_000_000, "a/p1")])
        ops = s.apply(changed).ops
        assert {o.action for o in ops} <= {"change_class", "replace_leaf", "delete_class"}
        assert sh("tc qdisc show dev na-ifb0 | grep htb", node) == handle_before
        classes = sh("tc class show dev na-ifb0", node)
        assert "1:10b" not in classes and "rate 30Mbit ceil 30Mbit" in classes
        assert s.apply(changed).changes == 0


def test_stats_one_dump(node):
    with Shaper(node) as s:
        s.apply(make_spec())
        stats = s.stats("na-ifb0")
    assert set(stats) == {0x1, 0x10A, 0x10B, DEFAULT_MINOR}
    assert stats[0x10B].rate_bytes == 5_000_000_000
    assert all(st.bytes == 0 and st.drops == 0 for st in stats.values())


def test_missing_uplink_changes_nothing(node):
    before = snapshot(node)
    with Shaper(node) as s, pytest.raises(TcError, match="bond7.*not found.*nothing was changed"):
        s.apply(make_spec(uplinks=("eth0", "bond7")))
    assert snapshot(node) == before


def test_ifb_name_taken_by_someone_else(node):
    sh("ip link add na-ifb0 type veth peer name someone1", node)
    before = snapshot(node)
    with Shaper(node) as s, pytest.raises(TcError, match="na-ifb0.*not netagent's IFB"):
        s.apply(make_spec())
    assert snapshot(node) == before


def test_cleanup_removes_exactly_ours(node):
    before = snapshot(node)
    with Shaper(node) as s:
        s.apply(make_spec())
        assert s.cleanup("na-ifb0", ("eth0",), 0xC000)
        assert snapshot(node) == before
        assert s.cleanup("na-ifb0", ("eth0",), 0xC000) == []  # idempotent


def test_cleanup_keeps_a_clsact_someone_else_uses(node):
    sh("tc qdisc add dev eth0 clsact && tc filter add dev eth0 egress pref 7 bpf bytecode '1,6 0 0 0'", node)
    before = snapshot(node)
    with Shaper(node) as s:
        s.apply(make_spec())
        assert "pref 7 bpf" in sh("tc filter show dev eth0 egress", node)
        s.cleanup("na-ifb0", ("eth0",), 0xC000)
    assert snapshot(node) == before


def test_probe_finds_what_the_data_path_needs():
    caps = probe()
    require(caps)  # raises with the missing features named
    assert {"htb", "clsact", "pfifo"} <= caps.qdiscs
    assert caps.leaf_qdisc in ("fq_codel", "pfifo")


def test_node_rate_change_then_restart_changes_nothing(node):
    """HTB keeps an inner class's creation-time quantum (it only sets quanta of leaves): a
    changed node rate must not make every later reconcile, or a restart, 'fix' it again."""
    with Shaper(node) as s:
        s.apply(make_spec(node_rate=10_000_000_000))
        assert [o.action for o in s.apply(make_spec(node_rate=100_000_000)).ops] == ["change_class"]
        assert s.apply(make_spec(node_rate=100_000_000)).changes == 0
    with Shaper(node) as fresh:
        assert fresh.plan(make_spec(node_rate=100_000_000)) == []
